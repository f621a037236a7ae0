"""Sweeps: many runs from one command through Hydra's multirun (its sweepers and launchers), and a summary.

    epo sweep algo=ppo,grpo,epo seed=0,1,2 trainer.total_steps=50
    epo sweep algo.entropy_smoothing.alpha=0.05,0.1 seed=range(0,3) hydra/launcher=joblib \
              hydra.launcher.n_jobs=2
    epo sweep hydra/sweeper=optuna hydra.sweeper.n_trials=20 'algo.lr=tag(log,interval(1e-5,1e-3))' \
              sweep.metric=eval/success sweep.direction=maximize
    epo sweep ... hydra/launcher=epo_slurm hydra.launcher.partition=gpu launcher=deepspeed launcher.num_gpus=8
              (conf/hydra/launcher/epo_slurm.yaml: submitit_slurm, one task per job; or submitit_slurm itself)
    epo sweep summarize outputs/sweeps/<date>/<time>-<name> [sweep.threshold=0.7]

Options of the sweep itself (never passed to the runs): sweep.name (folder name), sweep.metric (the value a
job returns to the sweeper, e.g. optuna's objective; default eval/success), sweep.direction (maximize |
minimize; also optuna's direction), sweep.threshold (success level for the "steps to threshold" column),
sweep.max_jobs (the most jobs it starts, default MAX_JOBS = 1000: it says how many jobs a sweep starts, and
refuses more unless sweep.max_jobs=N allows them). `epo sweep` exits non-zero only when every job failed.
One process runs a sweep directory at a time (its lock, epo_cli/rundir/folder.py), and a sweep directory that holds
anything already (an earlier sweep) is refused: choose a new hydra.sweep.dir.

Every job trains in its own subprocess (`python -m epo_cli train <job overrides> run_dir=<job dir>`), so
jobs share no process group, GPU memory or global state, and a failing job is recorded (status.json:
failed, with the error and the log's tail) while the others go on; it returns the worst value to the
sweeper. Layout:

    <output_dir>/sweeps/<date>/<time>-<name>/
        sweep.json                    the sweep's options and command
        multirun.yaml                 hydra's record of the sweep
        <job>-<swept overrides>/      a normal run directory (config.yaml, metrics.jsonl, final/, ...) plus
            sweep_job.json            job number, overrides, command, exit code, duration, objective value
            train.log                 the training subprocess' output
            .hydra/  epo_sweep.log    hydra's record and log of the job
        summary.csv  summary.md  runs.csv     (rebuilt any time by `epo sweep summarize`)
        optimization_results.yaml     (optuna) the best parameters and value

The summary (its columns and how they aggregate over seeds) is epo_cli/analysis/sweep_summary.py.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir, version
from hydra._internal.utils import _run_hydra, get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from omegaconf import OmegaConf

from epo_cli.analysis.sweep_summary import SweepSummaryConfig, is_run_dir, last_value, split_sweep_options, summarize
from epo_cli.compose import compose, validate
from epo_cli.compose.overrides import hydra_overrides
from epo_cli.config import GROUPS, config_dir, group_options
from epo_cli.errors import ConfigError, UserError
from epo_cli.loggers.jsonl import read_metrics
from epo_cli.rundir.folder import (
    LOCK_NAME,
    check_lengths,
    check_name,
    check_path,
    lock_folder,
    read_status,
    release_folders,
    write_status,
)
from epo_cli.rundir.writable import json_ready, open_for_writing, prepare_output_dir, write_file

log = logging.getLogger("epo.sweep")


def _slug(text: str) -> str:
    """A folder name for a job's swept overrides: 'algo=epo,seed=1' -> 'algo-epo+seed-1'. No '=' or ',' so
    the path can be passed on as an override value (model.path=<job>/final) without quoting."""
    text = re.sub(r"(^|,)\+\+", r"\1", str(text))  # ++key=value (see hydra_overrides) reads as key=value
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "_", text.replace("=", "-").replace(",", "+")).strip("_")
    return slug[:120] or "run"


# Hydra resolves each job's folder name (hydra.sweep.subdir) with this resolver, also inside joblib and
# submitit workers: unpickling the job function imports this module, which registers it there.
OmegaConf.register_new_resolver("epo_slug", _slug, replace=True)


# ----------------------------------------------------------------------------------------------------
# One job: a training subprocess
# ----------------------------------------------------------------------------------------------------

@dataclass
class SweepJob:
    """Hydra's task function: trains one job's overrides in a subprocess; never raises for a failed run."""

    options: SweepSummaryConfig
    python: str = field(default_factory=lambda: sys.executable)

    def __call__(self, cfg: Any) -> float:
        hc = HydraConfig.get()
        run = Path(hc.runtime.output_dir)
        # `epo train` turns key=value into ++key=value itself (epo_cli.overrides.hydra_overrides)
        overrides = [o[2:] if o.startswith("++") else o for o in map(str, hc.overrides.task)]
        cmd = [self.python, "-m", "epo_cli", "train", *overrides, f"run_dir={_quote(str(run))}"]
        record: dict[str, Any] = {"job": int(hc.job.num), "overrides": overrides, "command": cmd,
                                  "started": _now()}
        _write_json(run / "sweep_job.json", record)
        log.info(f"job {hc.job.num}: {' '.join(overrides)} -> {run}")
        started = time.perf_counter()
        with open_for_writing(run / "train.log") as out:
            rc = _run_job(cmd, out)
        record.update(exit_code=rc, ended=_now(), duration_s=round(time.perf_counter() - started, 1))
        if rc != 0:
            error = record_failure(run, rc)
            log.warning(f"job {hc.job.num} failed (exit {rc}): {error}")
            value = self.options.worst
        else:
            value = last_value(read_metrics(run), self.options.metric)
            if math.isnan(value):
                log.warning(f"job {hc.job.num} logged no '{self.options.metric}' (sweep.metric); it counts "
                            "as the worst value")
                value = self.options.worst
            log.info(f"job {hc.job.num} finished in {record['duration_s']:.0f} s: "
                     f"{self.options.metric}={value:.4g}")
        record["objective"] = {"metric": self.options.metric, "value": value}
        _write_json(run / "sweep_job.json", record)
        return value


def _run_job(cmd: list[str], out: Any) -> int:
    """The job's `epo train`. On Ctrl-C (which the job receives too, from the terminal) wait for it: it
    finishes its step and saves a checkpoint (epo_cli.training.stop); a second Ctrl-C kills it at once."""
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path.cwd())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait()
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
        raise


def _quote(value: str) -> str:
    """A Hydra override value that parses back to exactly `value` (paths may hold spaces or commas)."""
    return "'" + value.replace("'", "\\'") + "'"


def record_failure(run: Path, exit_code: int, tail_lines: int = 20) -> str:
    """Mark a run failed with its error and the tail of its log; return the error line."""
    tail = _tail(run / "train.log", tail_lines)
    status = read_status(run)
    error = status.get("error") if status.get("status") == "failed" else None
    error = error or _error_line(tail) or f"exit code {exit_code}"
    write_status(run, "failed", error=error, exit_code=exit_code, log_tail=tail)
    return error


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _error_line(tail: str) -> str | None:
    """The user-facing error (`error: ...`) or the last line of a traceback."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("error:"):
            return " ".join(lines[i:i + 3])[:500]
    return lines[-1][:500] if lines else None


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """JSON as the standard has it: a non-finite number (a failed job's worst objective, -inf) is null."""
    write_file(path, json.dumps(json_ready(payload), indent=2, default=str, allow_nan=False))


# ----------------------------------------------------------------------------------------------------
# The sweep: Hydra multirun
# ----------------------------------------------------------------------------------------------------

def _parse(overrides: list[str]) -> list[Any]:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # noqa: BLE001 - hydra's grammar errors are the user's to fix
        raise ConfigError(f"Invalid override: {str(err).splitlines()[0]}\nSweep overrides look like "
                          "`algo=ppo,grpo seed=range(0,3) algo.lr=interval(1e-5,1e-3)`.") from None


def check_first_job(parsed: list[Any]) -> None:
    """Validate the sweep before anything runs or any folder is made: the first combination is composed
    in full, and every other value of every swept key is checked too (a group option against conf/, a
    key's value against the schema), so `algo=grpo,nosuch` fails here, once, with exit 2 like `epo train`."""
    first, swept = [], []
    for o in parsed:
        if o.is_hydra_override():
            continue
        if o.is_sweep_override():
            try:
                values = [str(v) for v in o.sweep_string_iterator()]
            except Exception:  # noqa: BLE001 - intervals have no values to list; optuna picks them
                continue
            if not values:
                raise ConfigError(f"The sweep over '{o.get_key_element()}' has no values.")
            first.append(f"{o.get_key_element()}={values[0]}")
            swept.append((o.get_key_element(), values[1:]))
        else:
            first.append(o.input_line)
    check_lengths(first)
    check_hydra_groups(parsed)
    base = compose(first)
    plain = OmegaConf.to_container(base, resolve=False)
    for key, values in swept:
        group = key.lstrip("+~")
        if group in GROUPS or (config_dir() / group).is_dir():
            options = group_options(group, nested=True)  # experiment=paper/<name> too
            for value in values:
                if value not in options:
                    raise ConfigError(f"Unknown option '{value}' for config group '{group}' in the sweep "
                                      f"{key}=...\nValid options for {group}: {', '.join(options)}.")
            continue
        for value in values:  # schema checks without a full compose (a seed range may hold many values)
            check_lengths([f"{key}={value}"])
            candidate = OmegaConf.merge(OmegaConf.create(plain), OmegaConf.from_dotlist([f"{group}={value}"]))
            validate(candidate)


def check_hydra_groups(parsed: list[Any]) -> None:
    """hydra/launcher=..., hydra/sweeper=...: an unknown option is one ConfigError (exit 2) before any folder
    is made, listing the options Hydra knows (its plugins' and conf/hydra/'s)."""
    groups = [o.input_line for o in parsed if o.is_hydra_override() and not o.is_sweep_override()
              and o.key_or_group not in ("hydra.sweep.dir", "hydra.sweep.subdir")]
    if not groups:
        return
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            hydra_compose(config_name="config", overrides=groups, return_hydra_config=True)
    except Exception as err:  # noqa: BLE001 - hydra's errors are the user's to fix; bugs re-raised below
        if not type(err).__module__.startswith(("hydra", "omegaconf")):
            raise
        text = str(err)
        missing = re.search(r"Could not find '([\w\-/.]+)/([\w\-.]+)'", text)
        if not missing:
            raise ConfigError(_hydra_setting_message(text, err.__cause__)) from None
        options = re.findall(r"^\t(\S+)\s*$", text, flags=re.M)
        raise ConfigError(f"Unknown option '{missing.group(2)}' for '{missing.group(1)}'."
                          + (f"\nValid options for {missing.group(1)}: {', '.join(options)}." if options else "")
                          ) from None
    finally:
        GlobalHydra.instance().clear()


def _hydra_setting_message(text: str, cause: BaseException | None) -> str:
    """A hydra.* setting Hydra refused (a wrong type, a key the selected launcher or sweeper does not have)."""
    merging = re.search(r"Error merging override (\S+)", text)
    if merging:
        why = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else "wrong type"
        return f"Invalid value in {merging.group(1)}: {why}. Fix the value (see the launcher's or sweeper's docs)."
    unknown = re.search(r"Could not override '([\w.\-]+)'", text)
    if unknown:
        return (f"'{unknown.group(1)}' is not a setting of the selected Hydra launcher or sweeper. Select the "
                "plugin that has it first (e.g. hydra/launcher=joblib for hydra.launcher.n_jobs).")
    return f"Invalid override: {text.strip().splitlines()[0]}"


#: the most jobs one `epo sweep` starts unless `sweep.max_jobs=N` allows more: each job is a training process
#: and a run directory, and a range typed one digit too long (seed=range(0,100000)) should not start them all
MAX_JOBS = 1000


def pop_max_jobs(args: list[str]) -> tuple[int, list[str]]:
    """sweep.max_jobs=N out of the arguments (an option of `epo sweep` itself, never passed to the runs)."""
    limit, rest = MAX_JOBS, []
    for arg in args:
        key, _, value = arg.partition("=")
        if key != "sweep.max_jobs":
            rest.append(arg)
            continue
        try:
            limit = int(value)
        except ValueError:
            limit = 0
        if limit < 1:
            raise ConfigError(f"sweep.max_jobs must be a whole number >= 1 (got '{value}').")
    return limit, rest


def _picks_values(parsed: list[Any]) -> bool:
    """Whether a sweeper that picks its own values (optuna, ...) runs the sweep, not Hydra's basic one."""
    return any(o.is_hydra_override() and o.key_or_group == "hydra/sweeper" and o.value() != "basic"
               for o in parsed)


def check_sweep_values(parsed: list[Any]) -> None:
    """Swept values Hydra's sweepers would fail on with a traceback: a range with step 0, and an interval under
    the basic sweeper (which lists values and cannot list an interval's)."""
    for o in parsed:
        if o.is_hydra_override() or not o.is_sweep_override():
            continue
        value, key = o.value(), o.get_key_element()
        if isinstance(value, RangeSweep) and not value.step:
            raise ConfigError(f"{o.input_line}: a range's step cannot be 0 (it would never reach its end). Fix: "
                              f"{key}=range({value.start:g},{value.stop:g}) or a non-zero step.")
        if isinstance(value, IntervalSweep) and not _picks_values(parsed):
            raise ConfigError(f"{o.input_line}: an interval has no list of values, and Hydra's basic sweeper only "
                              f"runs listed ones. Fix: list them ({key}=0,0.5,1 or {key}=range(0,10)), or let a "
                              "sweeper pick them: hydra/sweeper=optuna hydra.sweeper.n_trials=N.")


def _sweep_size(value: Any) -> int | None:
    """How many values one swept override takes (None: the sweeper picks them, as optuna's intervals)."""
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step or 1
        return max(0, math.ceil((stop - start) / step)) if math.isfinite((stop - start) / step) else None
    if isinstance(value, ChoiceSweep):
        return len(value.list)
    if isinstance(value, IntervalSweep):
        return None
    return 1  # a glob over a group's options: a handful at most


def job_count(parsed: list[Any]) -> int | None:
    """The jobs this sweep starts, from the overrides alone (without listing them): the product of the swept
    values' counts, or hydra.sweeper.n_trials for a sweeper that picks its values (None when not given)."""
    trials = next((o.value() for o in parsed if o.key_or_group == "hydra.sweeper.n_trials"), None)
    if _picks_values(parsed):
        return int(trials) if isinstance(trials, int) else None
    count = 1
    for o in parsed:
        if o.is_hydra_override() or not o.is_sweep_override():
            continue
        size = _sweep_size(o.value())
        if size is None:
            return None
        count *= size
    return count


def check_job_count(parsed: list[Any], limit: int) -> int | None:
    """Say how many jobs the sweep starts; refuse more than `limit` (sweep.max_jobs) before anything runs."""
    count = job_count(parsed)
    if count is not None and count > limit:
        raise ConfigError(f"This sweep would start {count} jobs (the product of its swept values), more than "
                          f"sweep.max_jobs={limit}{' (the default)' if limit == MAX_JOBS else ''}: each job is a "
                          "training process and a run directory. Check the ranges; if you mean it, add "
                          f"sweep.max_jobs={count}.")
    return count


def new_sweep_dir(output_dir: str, name: str) -> Path:
    now = datetime.datetime.now()
    day, clock = now.strftime("%Y-%m-%d"), now.strftime("%H-%M-%S")
    return Path(output_dir).resolve() / "sweeps" / day / f"{clock}-{name}"


def hydra_argv(overrides: list[str], parsed: list[Any], sweep_dir: Path, options: SweepSummaryConfig) -> list[str]:
    """Hydra's command line for this sweep: the user's overrides plus where and how jobs are named."""
    keys = {o.key_or_group for o in parsed}
    fixed = sorted({o.key_or_group for o in parsed
                    if not o.is_hydra_override() and not o.is_sweep_override()})
    # folder names show what differs between jobs, not the settings every job shares
    argv = ["--multirun", *overrides, "hydra.job.name=epo_sweep",
            f"hydra.job.config.override_dirname.exclude_keys=[{','.join(fixed)}]"]
    if "hydra.sweep.subdir" not in keys:
        argv.append("hydra.sweep.subdir='${hydra.job.num}-${epo_slug:${hydra.job.override_dirname}}'")
    if "hydra.sweep.dir" not in keys:
        argv.append(f"hydra.sweep.dir={_quote(str(sweep_dir))}")
    if any(o.input_line == "hydra/sweeper=optuna" for o in parsed) and "hydra.sweeper.direction" not in keys:
        argv.append(f"hydra.sweeper.direction={options.direction}")
    return argv


def run_sweep(args: list[str]) -> Path:
    """`epo sweep ARGS`: run every job through Hydra, then summarise. Returns the sweep directory."""
    max_jobs, args = pop_max_jobs(args)
    options, overrides = split_sweep_options(args)
    if any(o.split("=", 1)[0] == "run_dir" for o in overrides):
        raise ConfigError("run_dir is set per job by `epo sweep`; use output_dir=DIR or hydra.sweep.dir=DIR.")
    check_name(options.name, "sweep.name")
    parsed = _parse(overrides)
    check_sweep_values(parsed)
    count = check_job_count(parsed, max_jobs)  # before the values are listed: a huge range is never built
    check_first_job(parsed)
    output_dir = next((o.value() for o in parsed
                       if o.key_or_group == "output_dir" and not o.is_sweep_override()), "outputs")
    given = next((o.value() for o in parsed if o.key_or_group == "hydra.sweep.dir"), None)
    sweep_dir = Path(given).resolve() if given else new_sweep_dir(str(output_dir), options.name)
    check_path(sweep_dir, "the sweep directory")
    created = [d for d in (sweep_dir, *sweep_dir.parents) if not d.exists()]  # removed again if nothing runs
    prepare_output_dir(sweep_dir, "hydra.sweep.dir" if given else "output_dir")
    lock_folder(sweep_dir, "sweep directory")  # held until this command ends: one sweep per folder
    earlier = sorted(p.name for p in sweep_dir.iterdir() if p.name != LOCK_NAME)
    if earlier:
        release_folders()
        raise UserError(f"The sweep directory '{sweep_dir}' already holds {', '.join(earlier[:5])}"
                        f"{', ...' if len(earlier) > 5 else ''} (an earlier sweep): a sweep starts in a new folder, "
                        "or its jobs would mix with the earlier ones. Choose another hydra.sweep.dir (or leave it "
                        "unset for a new dated folder).")
    print(f"epo sweep: {count if count is not None else 'the sweeper decides how many'} jobs -> {sweep_dir}",
          flush=True)
    _write_json(sweep_dir / "sweep.json", {"options": asdict(options), "overrides": overrides,
                                           "command": " ".join(["epo", *sys.argv[1:]]), "started": _now()})

    version.setbase("1.3")
    parser = get_args_parser()
    # ++key=value: hydra accepts every schema key, also those the selected yaml does not spell out
    hydra_args = parser.parse_args(hydra_argv(hydra_overrides(overrides), parsed, sweep_dir, options))
    try:
        _run_hydra(args=hydra_args, args_parser=parser, task_function=SweepJob(options),
                   config_path=str(config_dir()), config_name="config")
    except KeyboardInterrupt:
        if any(is_run_dir(p) for p in sweep_dir.iterdir()):  # keep what ran: the summary of the jobs so far
            summarize(sweep_dir, options)
        raise
    except BaseException:
        if created and not any(is_run_dir(p) for p in sweep_dir.iterdir()):  # no job ran: leave no empty sweep
            shutil.rmtree(sweep_dir, ignore_errors=True)
            for parent in created[1:]:  # the date and sweeps/ folders this sweep created, if still empty
                try:
                    parent.rmdir()
                except OSError:
                    break
        raise
    groups = summarize(sweep_dir, options)
    if groups and all(g.finished == 0 for g in groups):
        raise UserError(f"Every job of the sweep failed; their errors are in {sweep_dir / 'summary.md'} and "
                        "in each job's train.log. Fix the cause, then run the sweep again.")
    return sweep_dir


