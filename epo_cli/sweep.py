"""Sweeps: many runs from one command through Hydra's multirun (its sweepers and launchers), and a summary.

    epo sweep algo=ppo,grpo,epo seed=0,1,2 trainer.total_steps=50
    epo sweep algo.entropy_smoothing.alpha=0.05,0.1 seed=range(0,3) hydra/launcher=joblib \
              hydra.launcher.n_jobs=2
    epo sweep hydra/sweeper=optuna hydra.sweeper.n_trials=20 'algo.lr=tag(log,interval(1e-5,1e-3))' \
              sweep.metric=eval/success sweep.direction=maximize
    epo sweep ... hydra/launcher=submitit_slurm hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=8
    epo sweep summarize outputs/sweeps/<date>/<time>-<name> [sweep.threshold=0.7]

Options of the sweep itself (never passed to the runs): sweep.name (folder name), sweep.metric (the value a
job returns to the sweeper, e.g. optuna's objective), sweep.direction (maximize | minimize), sweep.threshold
(success level for the "steps to threshold" column).

Every job trains in its own subprocess (`python -m epo_cli train <job overrides> run_dir=<job dir>`), so
jobs share no process group, GPU memory or global state, and a failing job is recorded (status.json:
failed, with the error and the log's tail) while the others go on; it returns the worst value to the
sweeper. Layout:

    <output_dir>/sweeps/<date>/<time>-<name>/
        sweep.json                    the sweep's options and command
        multirun.yaml                 hydra's record of the sweep
        <job>-<swept overrides>/      a normal run directory (config.yaml, metrics.jsonl, final/, ...) plus
            sweep_job.json            job number, overrides, command, exit code, duration, objective value
            train.log                 the training subprocess' output;  .hydra/  hydra's job record
        summary.csv  summary.md  runs.csv     (rebuilt any time by `epo sweep summarize`)
        optimization_results.yaml     (optuna) the best parameters and value

summary.csv: one row per configuration (all overrides but `seed`), mean and sample std over its seeds of
the final success (eval/success, else rollout/success), of the run's mean policy/entropy_fluctuation and
policy/entropy_swing, and of the first step whose success reached sweep.threshold (over the runs that did).
"""

from __future__ import annotations

import csv
import datetime
import json
import logging
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from epo_cli.errors import ConfigError, UserError
from epo_cli.metrics import read_metrics
from epo_cli.run_dir import read_status, write_status

log = logging.getLogger("epo.sweep")

#: override keys that never distinguish configurations (grouping and labels ignore them)
NON_CONFIG_KEYS = ("seed", "run_dir", "output_dir", "name", "trainer.resume")
SUCCESS_KEYS = ("eval/success", "rollout/success")


@dataclass
class SweepOptions:
    name: str = "sweep"
    metric: str = "eval/success"
    direction: str = "maximize"
    threshold: float = 0.5

    @property
    def worst(self) -> float:
        """What a failed job returns to the sweeper: it completes as the worst trial, never the best."""
        return -math.inf if self.direction == "maximize" else math.inf


def split_sweep_options(args: list[str], base: SweepOptions | None = None) -> tuple[SweepOptions, list[str]]:
    """Take the sweep.* arguments out of `args` (they configure the sweep, not the runs)."""
    opts, rest = base or SweepOptions(), []
    valid = list(SweepOptions.__dataclass_fields__)
    for arg in args:
        key, _, value = arg.partition("=")
        if not key.startswith("sweep."):
            rest.append(arg)
            continue
        name = key[len("sweep."):]
        if name not in valid:
            names = ", ".join("sweep." + v for v in valid)
            raise ConfigError(f"Unknown sweep option '{key}'. Valid: {names}.")
        if name == "threshold":
            try:
                opts.threshold = float(value)
            except ValueError:
                raise ConfigError(f"sweep.threshold must be a number (got '{value}').") from None
        else:
            setattr(opts, name, value)
    if opts.direction not in ("maximize", "minimize"):
        raise ConfigError(f"sweep.direction must be maximize or minimize (got '{opts.direction}').")
    return opts, rest


def _slug(text: str) -> str:
    """A folder name for a job's swept overrides: 'algo=epo,seed=1' -> 'algo-epo+seed-1'. No '=' or ',' so
    the path can be passed on as an override value (model.path=<job>/final) without quoting."""
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "_", str(text).replace("=", "-").replace(",", "+")).strip("_")
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

    options: SweepOptions
    python: str = field(default_factory=lambda: sys.executable)

    def __call__(self, cfg: Any) -> float:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        run = Path(hc.runtime.output_dir)
        overrides = [str(o) for o in hc.overrides.task]
        cmd = [self.python, "-m", "epo_cli", "train", *overrides, f"run_dir={_quote(str(run))}"]
        record: dict[str, Any] = {"job": int(hc.job.num), "overrides": overrides, "command": cmd,
                                  "started": _now()}
        _write_json(run / "sweep_job.json", record)
        log.info(f"job {hc.job.num}: {' '.join(overrides)} -> {run}")
        started = time.perf_counter()
        with open(run / "train.log", "w") as out:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path.cwd()).returncode
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
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------------
# The sweep: Hydra multirun
# ----------------------------------------------------------------------------------------------------

def _parse(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # noqa: BLE001 - hydra's grammar errors are the user's to fix
        raise ConfigError(f"Invalid override: {str(err).splitlines()[0]}\nSweep overrides look like "
                          "`algo=ppo,grpo seed=range(0,3) algo.lr=interval(1e-5,1e-3)`.") from None


def check_first_job(parsed: list[Any]) -> None:
    """Compose and validate the sweep's first combination now: a typo fails here, once, not in every job."""
    from epo_cli.config import compose

    first = []
    for o in parsed:
        if o.is_hydra_override():
            continue
        if o.is_sweep_override():
            try:
                first.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
            except Exception:  # noqa: BLE001 - intervals have no first value; optuna picks one
                continue
        else:
            first.append(o.input_line)
    compose(first)


def new_sweep_dir(output_dir: str, name: str) -> Path:
    now = datetime.datetime.now()
    day, clock = now.strftime("%Y-%m-%d"), now.strftime("%H-%M-%S")
    return Path(output_dir).resolve() / "sweeps" / day / f"{clock}-{name}"


def hydra_argv(overrides: list[str], parsed: list[Any], sweep_dir: Path, options: SweepOptions) -> list[str]:
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
        argv.append(f"hydra.sweep.dir={sweep_dir}")
    if any(o.input_line == "hydra/sweeper=optuna" for o in parsed) and "hydra.sweeper.direction" not in keys:
        argv.append(f"hydra.sweeper.direction={options.direction}")
    return argv


def run_sweep(args: list[str]) -> Path:
    """`epo sweep ARGS`: run every job through Hydra, then summarise. Returns the sweep directory."""
    from hydra import version
    from hydra._internal.utils import _run_hydra, get_args_parser

    from epo_cli.config import config_dir

    options, overrides = split_sweep_options(args)
    if any(o.split("=", 1)[0] == "run_dir" for o in overrides):
        raise ConfigError("run_dir is set per job by `epo sweep`; use output_dir=DIR or hydra.sweep.dir=DIR.")
    parsed = _parse(overrides)
    check_first_job(parsed)
    output_dir = next((o.value() for o in parsed
                       if o.key_or_group == "output_dir" and not o.is_sweep_override()), "outputs")
    given = next((o.value() for o in parsed if o.key_or_group == "hydra.sweep.dir"), None)
    sweep_dir = Path(given).resolve() if given else new_sweep_dir(str(output_dir), options.name)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    _write_json(sweep_dir / "sweep.json", {"options": asdict(options), "overrides": overrides,
                                           "command": " ".join(["epo", *sys.argv[1:]]), "started": _now()})

    version.setbase("1.3")
    parser = get_args_parser()
    hydra_args = parser.parse_args(hydra_argv(overrides, parsed, sweep_dir, options))
    try:
        _run_hydra(args=hydra_args, args_parser=parser, task_function=SweepJob(options),
                   config_path=str(config_dir()), config_name="config")
    except KeyboardInterrupt:
        if any(is_run_dir(p) for p in sweep_dir.iterdir()):  # keep what ran: the summary of the jobs so far
            summarize(sweep_dir, options)
        raise
    summarize(sweep_dir, options)
    return sweep_dir


# ----------------------------------------------------------------------------------------------------
# Summary across runs
# ----------------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    """What one run reached (NaN where it logged nothing)."""

    path: Path
    job: int | None
    overrides: list[str]
    status: str  # finished | failed | unfinished (<raw status>)
    error: str | None = None
    success: float = math.nan
    success_metric: str | None = None
    entropy_fluctuation: float = math.nan  # mean over logged steps of policy/entropy_fluctuation
    entropy_swing: float = math.nan  # mean over logged steps of policy/entropy_swing
    steps_to_threshold: float = math.nan  # first step whose success >= threshold (NaN: never)
    objective: float = math.nan  # last value of sweep.metric
    last_step: int = 0

    @property
    def seed(self) -> str:
        return next((o.split("=", 1)[1] for o in self.overrides if o.split("=", 1)[0] == "seed"), "0")

    @property
    def config_key(self) -> tuple[str, ...]:
        return config_key(self.overrides)


def config_key(overrides: list[str]) -> tuple[str, ...]:
    """The configuration a run belongs to: its overrides without seed (and without where it was written)."""
    return tuple(sorted(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in NON_CONFIG_KEYS))


def last_value(rows: list[dict[str, Any]], key: str) -> float:
    values = [_num(r[key]) for r in rows if key in r]
    return values[-1] if values else math.nan


def _num(value: Any) -> float:
    try:
        return float(value)  # metrics.jsonl writes non-finite values as strings ("nan", "inf")
    except (TypeError, ValueError):
        return math.nan


def _mean_of(rows: list[dict[str, Any]], key: str) -> float:
    values = [v for v in (_num(r[key]) for r in rows if key in r) if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def run_result(rows: list[dict[str, Any]], threshold: float, metric: str = "eval/success",
               **fields: Any) -> RunResult:
    """A RunResult from a run's metrics rows (one dict per logged step)."""
    result = RunResult(**fields)
    result.objective = last_value(rows, metric)
    key = next((k for k in SUCCESS_KEYS if any(k in r for r in rows)), None)
    if key is not None:
        result.success, result.success_metric = last_value(rows, key), key
        reached = [r["step"] for r in rows if key in r and _num(r[key]) >= threshold]
        result.steps_to_threshold = float(reached[0]) if reached else math.nan
    result.entropy_fluctuation = _mean_of(rows, "policy/entropy_fluctuation")
    result.entropy_swing = _mean_of(rows, "policy/entropy_swing")
    result.last_step = int(rows[-1]["step"]) if rows else 0
    return result


def job_number(path: Path) -> int | None:
    match = re.match(r"(\d+)", path.name)
    return int(match.group(1)) if match else None


def run_overrides(path: Path) -> list[str]:
    job = path / "sweep_job.json"
    if job.exists():
        return list(json.loads(job.read_text()).get("overrides", []))
    if (path / ".hydra" / "overrides.yaml").exists():
        return [str(o) for o in OmegaConf.load(path / ".hydra" / "overrides.yaml")]
    if (path / "config.yaml").exists():
        meta = OmegaConf.load(path / "config.yaml").get("meta", {})
        return [str(o) for o in meta.get("overrides", [])]
    return []


def is_run_dir(path: Path) -> bool:
    markers = ("sweep_job.json", "config.yaml", "metrics.jsonl")
    return path.is_dir() and any((path / f).exists() for f in markers)


def collect_runs(sweep_dir: Path, options: SweepOptions) -> list[RunResult]:
    """Every job folder of a sweep (finished, failed or interrupted), in job order."""
    runs = []
    for path in sorted((p for p in sweep_dir.iterdir() if is_run_dir(p)),
                       key=lambda p: (job_number(p) is None, job_number(p) or 0, p.name)):
        status = read_status(path)
        raw = status.get("status", "unknown")
        label = raw if raw in ("finished", "failed") else f"unfinished ({raw})"
        runs.append(run_result(read_metrics(path), options.threshold, options.metric, path=path,
                               job=job_number(path),
                               overrides=run_overrides(path), status=label, error=status.get("error")))
    return runs


@dataclass
class ConfigSummary:
    """One configuration aggregated over its seeds (finished runs only)."""

    label: str
    overrides: list[str]
    runs: int
    finished: int
    failed: int
    seeds: list[str]
    success_mean: float
    success_std: float
    success_metric: str
    entropy_fluctuation_mean: float
    entropy_fluctuation_std: float
    entropy_swing_mean: float
    entropy_swing_std: float
    steps_to_threshold_mean: float
    steps_to_threshold_std: float
    reached_threshold: str  # "k/n": finished runs whose success reached the threshold
    objective_mean: float  # sweep.metric (what the sweeper optimised)
    objective_std: float


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1) of the finite values; std is NaN below two values."""
    xs = [v for v in values if math.isfinite(v)]
    if not xs:
        return math.nan, math.nan
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return mean, std


def varying_keys(override_lists: list[list[str]]) -> set[str]:
    """Config keys whose value differs between runs (a missing key counts as a value): what labels show."""
    maps = [dict(o.partition("=")[::2] for o in config_key(ov)) for ov in override_lists]
    keys: set[str] = set().union(*maps) if maps else set()
    return {k for k in keys if len({m.get(k) for m in maps}) > 1}


def config_label(overrides: list[str], shown: set[str]) -> str:
    return ",".join(o for o in config_key(overrides) if o.partition("=")[0] in shown) or "(all runs)"


def aggregate(runs: list[RunResult]) -> list[ConfigSummary]:
    """Group runs by configuration (all overrides but seed) and aggregate the finished ones over seeds."""
    groups: dict[tuple[str, ...], list[RunResult]] = {}
    for r in runs:
        groups.setdefault(r.config_key, []).append(r)
    shown = varying_keys([r.overrides for r in runs])
    out = []
    for key, members in groups.items():
        done = [r for r in members if r.status == "finished"]
        metrics = {r.success_metric for r in done if r.success_metric}
        reached = [r.steps_to_threshold for r in done if math.isfinite(r.steps_to_threshold)]
        label = config_label(list(key), shown)
        out.append(ConfigSummary(
            label=label, overrides=list(key), runs=len(members), finished=len(done),
            failed=sum(r.status == "failed" for r in members), seeds=[r.seed for r in members],
            success_metric="/".join(sorted(metrics)) or "-",
            **_prefixed("success", mean_std([r.success for r in done])),
            **_prefixed("entropy_fluctuation", mean_std([r.entropy_fluctuation for r in done])),
            **_prefixed("entropy_swing", mean_std([r.entropy_swing for r in done])),
            **_prefixed("steps_to_threshold", mean_std(reached)),
            reached_threshold=f"{len(reached)}/{len(done)}",
            **_prefixed("objective", mean_std([r.objective for r in done])),
        ))
    return out


def _prefixed(name: str, mean_and_std: tuple[float, float]) -> dict[str, float]:
    return {f"{name}_mean": mean_and_std[0], f"{name}_std": mean_and_std[1]}


# ---- writing and printing ------------------------------------------------------------------------------

SUMMARY_COLUMNS = [f for f in ConfigSummary.__dataclass_fields__]
RUN_COLUMNS = ["job", "path", "status", "seed", "success", "success_metric", "entropy_fluctuation",
               "entropy_swing", "steps_to_threshold", "objective", "last_step", "overrides", "error"]


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "" if value is None else value


def _pm(mean: float, std: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.3g}" if math.isnan(std) else f"{mean:.3g} ± {std:.2g}"


def display_columns(options: SweepOptions) -> list[tuple[str, Any]]:
    """(header, ConfigSummary -> text) of the printed and Markdown tables."""
    t = f"{options.threshold:g}"
    cols: list[tuple[str, Any]] = [
        ("configuration", lambda g: g.label),
        ("runs", lambda g: str(g.runs)),
        ("finished", lambda g: str(g.finished)),
        ("success", lambda g: _pm(g.success_mean, g.success_std)),
        ("entropy fluct.", lambda g: _pm(g.entropy_fluctuation_mean, g.entropy_fluctuation_std)),
        ("entropy swing", lambda g: _pm(g.entropy_swing_mean, g.entropy_swing_std)),
        (f"steps to {t}", lambda g: f"{_pm(g.steps_to_threshold_mean, g.steps_to_threshold_std)} "
                                    f"({g.reached_threshold})"),
    ]
    if options.metric not in SUCCESS_KEYS:  # the sweeper's objective, when it is not the success column
        cols.append((options.metric, lambda g: _pm(g.objective_mean, g.objective_std)))
    return cols


def write_summary(sweep_dir: Path, runs: list[RunResult], groups: list[ConfigSummary],
                  options: SweepOptions) -> None:
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SUMMARY_COLUMNS)
        for g in groups:
            writer.writerow([_cell(getattr(g, c)) for c in SUMMARY_COLUMNS])
    with open(sweep_dir / "runs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(RUN_COLUMNS)
        for r in runs:
            row = {**asdict(r), "seed": r.seed, "path": str(r.path)}
            writer.writerow([_cell(row[c]) for c in RUN_COLUMNS])
    t = f"{options.threshold:g}"
    cols = display_columns(options)
    lines = [
        f"# Sweep summary: {sweep_dir.name}", "",
        f"{len(runs)} runs, {sum(r.status == 'finished' for r in runs)} finished, "
        f"{sum(r.status == 'failed' for r in runs)} failed. Mean ± sample std over the finished runs "
        "(seeds) of each configuration. success: the last eval/success (rollout/success where a run logged "
        "no evaluation); entropy fluctuation / swing: mean over the run's steps of "
        f"policy/entropy_fluctuation / policy/entropy_swing; steps to {t}: first step whose success reached "
        f"{t}, over the runs that reached it (how many did, in parentheses).", "",
        "| " + " | ".join(h for h, _ in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(fn(g) for _, fn in cols) + " |" for g in groups]
    lines += ["", "## Runs", "", "| job | run | status | success | last step | error |",
              "|---|---|---|---|---|---|"]
    for r in runs:
        error = (r.error or "").replace("|", "\\|").replace("\n", " ")[:300]
        success = "-" if math.isnan(r.success) else f"{r.success:.3g}"
        lines.append(f"| {r.job if r.job is not None else '-'} | {r.path.name} | {r.status} | {success} | "
                     f"{r.last_step} | {error} |")
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")


def print_summary(sweep_dir: Path, runs: list[RunResult], groups: list[ConfigSummary],
                  options: SweepOptions) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:  # logs and pipes: no need to squeeze the table into 80 columns
        console.width = max(console.width, 150)
    table = Table(title=f"sweep {sweep_dir.name}: {len(runs)} runs (mean ± std over seeds)")
    cols = display_columns(options)
    for header, _ in cols:
        first = header == "configuration"
        table.add_column(header, justify="left" if first else "right", overflow="fold",
                         min_width=12 if first else None)
    for g in groups:
        table.add_row(*(fn(g) for _, fn in cols))
    console.print(table)
    for r in runs:
        if r.status != "finished":
            console.print(f"[yellow]{r.status}[/]: {r.path.name}" + (f": {r.error}" if r.error else ""),
                          markup=True, soft_wrap=True)
    best = sweep_dir / "optimization_results.yaml"
    if best.exists():
        res = OmegaConf.load(best)
        params = dict(res.get("best_params", {}))
        console.print(f"optuna best {options.metric}: {res.get('best_value')} with {params}")
    console.print(f"summary: {sweep_dir / 'summary.md'} (also summary.csv, runs.csv)")


def summarize(sweep_dir: Path, options: SweepOptions | None = None) -> list[ConfigSummary]:
    """Rebuild summary.csv / summary.md / runs.csv from the run folders (also of an interrupted sweep)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise UserError(f"Sweep directory '{sweep_dir}' does not exist. Pass the folder `epo sweep` printed, "
                        "e.g. outputs/sweeps/<date>/<time>-<name>.")
    if options is None:
        saved = sweep_dir / "sweep.json"
        options = SweepOptions(**json.loads(saved.read_text())["options"]) if saved.exists() \
            else SweepOptions()
    runs = collect_runs(sweep_dir, options)
    if not runs:
        raise UserError(f"No runs in '{sweep_dir}' (no job folders with sweep_job.json or config.yaml). Pass "
                        "the sweep folder itself, e.g. outputs/sweeps/<date>/<time>-<name>.")
    groups = aggregate(runs)
    write_summary(sweep_dir, runs, groups, options)
    print_summary(sweep_dir, runs, groups, options)
    return groups


def summarize_command(args: list[str]) -> None:
    """`epo sweep summarize <sweep_dir> [sweep.threshold=T]`."""
    paths = [a for a in args if "=" not in a]
    if len(paths) != 1:
        raise UserError("Usage: epo sweep summarize <sweep_dir> [sweep.threshold=0.5]")
    sweep_dir = Path(paths[0]).expanduser()
    saved = sweep_dir / "sweep.json"
    base = SweepOptions(**json.loads(saved.read_text())["options"]) if saved.exists() else SweepOptions()
    options, _ = split_sweep_options([a for a in args if "=" in a], base)
    summarize(sweep_dir, options)
