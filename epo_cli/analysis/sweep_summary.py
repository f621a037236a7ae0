"""The summary of a sweep: one row per configuration, aggregated over its seeds; rebuilt from the run
folders alone, so an interrupted sweep (or `epo sweep summarize`) gets one too.

    summary.csv   one row per configuration (all overrides but seed), columns SUMMARY_COLUMNS:
                  label, overrides, runs, finished, failed, seeds,
                  success_mean/_std (the last eval/success, else rollout/success; success_metric says which),
                  entropy_fluctuation_mean/_std, entropy_swing_mean/_std (each run: the mean over its steps of
                  policy/entropy_fluctuation and policy/entropy_swing),
                  steps_to_threshold_mean/_std (first step whose success >= sweep.threshold, over the runs
                  that reached it), reached_threshold ("k/n"), objective_mean/_std (sweep.metric)
    runs.csv      one row per run (RUN_COLUMNS), with its status (finished | failed | unfinished (<status>))
                  and error
    summary.md    both tables for people

Means and sample standard deviations (n - 1) are over the finished runs of a configuration.
"""

from __future__ import annotations

import csv
import math
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from epo_cli.errors import ConfigError, UserError
from epo_cli.loggers.jsonl import read_metrics
from epo_cli.rundir.folder import read_status, read_yaml_data
from epo_cli.rundir.received import read_json
from epo_cli.rundir.writable import open_for_writing, write_file

NON_CONFIG_KEYS = ("seed", "run_dir", "output_dir", "name", "trainer.resume")
SUCCESS_KEYS = ("eval/success", "rollout/success")


@dataclass
class SweepSummaryConfig:
    name: str = "sweep"
    metric: str = "eval/success"
    direction: str = "maximize"
    threshold: float = 0.5

    @property
    def worst(self) -> float:
        """What a failed job returns to the sweeper: it completes as the worst trial, never the best."""
        return -math.inf if self.direction == "maximize" else math.inf


def split_sweep_options(args: list[str],
                        base: SweepSummaryConfig | None = None) -> tuple[SweepSummaryConfig, list[str]]:
    """Take the sweep.* arguments out of `args` (they configure the sweep, not the runs)."""
    opts, rest = base or SweepSummaryConfig(), []
    valid = list(SweepSummaryConfig.__dataclass_fields__)
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
            if not math.isfinite(opts.threshold):  # nan would also be written into sweep.json, which is JSON
                raise ConfigError(f"sweep.threshold must be a finite number (got '{value}'), e.g. "
                                  "sweep.threshold=0.5.")
        else:
            setattr(opts, name, value)
    if opts.direction not in ("maximize", "minimize"):
        raise ConfigError(f"sweep.direction must be maximize or minimize (got '{opts.direction}').")
    return opts, rest



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


def read_json_file(path: Path, what: str) -> dict[str, Any] | None:
    """A JSON object that a sweep wrote (sweep.json, sweep_job.json), or None with a one-line warning when it
    is damaged: the summary goes on without it."""
    try:
        data = read_json(path, "sweep record", within=path.parent)  # bounded: epo_cli/rundir/received.py
    except (OSError, UserError) as err:
        warnings.warn(f"'{path}' is unreadable ({type(err).__name__}); {what}.", stacklevel=2)
        return None
    if not isinstance(data, dict):
        warnings.warn(f"'{path}' is not a JSON object; {what}.", stacklevel=2)
        return None
    return data


def saved_options(sweep_dir: Path) -> SweepSummaryConfig:
    """The options a sweep was started with (sweep.json), checked like the command line's; the defaults
    (with a warning) when the file is missing or damaged."""
    path = Path(sweep_dir) / "sweep.json"
    if not path.exists():
        return SweepSummaryConfig()
    data = read_json_file(path, "its sweep options are taken as the defaults")
    options = data.get("options") if data is not None else None
    if data is not None and not isinstance(options, dict):
        warnings.warn(f"'{path}' holds no `options` object; its sweep options are taken as the defaults.",
                      stacklevel=2)
    if not isinstance(options, dict):
        return SweepSummaryConfig()
    args = [f"sweep.{k}={v}" for k, v in options.items() if k in SweepSummaryConfig.__dataclass_fields__]
    try:
        return split_sweep_options(args)[0]
    except ConfigError as err:
        warnings.warn(f"'{path}': {err}; its sweep options are taken as the defaults.", stacklevel=2)
        return SweepSummaryConfig()


def job_number(path: Path) -> int | None:
    match = re.match(r"(\d+)", path.name)
    return int(match.group(1)) if match else None


def run_overrides(path: Path) -> list[str]:
    job = path / "sweep_job.json"
    record = read_json_file(job, "the job's overrides are read from its other files") if job.exists() else None
    if record is not None and isinstance(record.get("overrides"), list):
        return [str(o) for o in record["overrides"]]
    if record is not None:
        warnings.warn(f"'{job}' holds no `overrides` list; the job's overrides are read from its other files.",
                      stacklevel=2)
    if (path / ".hydra" / "overrides.yaml").exists():
        listed = read_yaml_data(path / ".hydra" / "overrides.yaml")
        return [str(o) for o in listed] if isinstance(listed, list) else []
    if (path / "config.yaml").exists():
        data = read_yaml_data(path / "config.yaml")
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        return [str(o) for o in meta.get("overrides", [])] if isinstance(meta, dict) else []
    return []


def is_run_dir(path: Path) -> bool:
    markers = ("sweep_job.json", "config.yaml", "metrics.jsonl")
    return path.is_dir() and any((path / f).exists() for f in markers)


def collect_runs(sweep_dir: Path, options: SweepSummaryConfig) -> list[RunResult]:
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


def format_mean_std(mean: float, std: float, digits: str = ".3g", std_digits: str = ".2g") -> str:
    """`mean ± std`, the mean alone when std is NaN (one value), `-` without a mean: the one format of a
    statistic over seeds (this table, `epo report`'s, the study scripts' in scripts/experiments)."""
    if math.isnan(mean):
        return "-"
    return format(mean, digits) if math.isnan(std) else f"{format(mean, digits)} ± {format(std, std_digits)}"


def mean_pm_std(values: list[float], digits: str = ".3g", std_digits: str = ".2g") -> str:
    """format_mean_std of the finite `values` (mean_std: sample std)."""
    return format_mean_std(*mean_std(values), digits, std_digits)


def display_columns(options: SweepSummaryConfig) -> list[tuple[str, Any]]:
    """(header, ConfigSummary -> text) of the printed and Markdown tables."""
    t = f"{options.threshold:g}"
    cols: list[tuple[str, Any]] = [
        ("configuration", lambda g: g.label),
        ("runs", lambda g: str(g.runs)),
        ("finished", lambda g: str(g.finished)),
        ("success", lambda g: format_mean_std(g.success_mean, g.success_std)),
        ("entropy fluct.", lambda g: format_mean_std(g.entropy_fluctuation_mean, g.entropy_fluctuation_std)),
        ("entropy swing", lambda g: format_mean_std(g.entropy_swing_mean, g.entropy_swing_std)),
        (f"steps to {t}", lambda g: f"{format_mean_std(g.steps_to_threshold_mean, g.steps_to_threshold_std)} "
                                    f"({g.reached_threshold})"),
    ]
    if options.metric not in SUCCESS_KEYS:  # the sweeper's objective, when it is not the success column
        cols.append((options.metric, lambda g: format_mean_std(g.objective_mean, g.objective_std)))
    return cols


def write_summary(sweep_dir: Path, runs: list[RunResult], groups: list[ConfigSummary],
                  options: SweepSummaryConfig) -> None:
    with open_for_writing(sweep_dir / "summary.csv") as f:  # never through a planted symlink
        writer = csv.writer(f)
        writer.writerow(SUMMARY_COLUMNS)
        for g in groups:
            writer.writerow([_cell(getattr(g, c)) for c in SUMMARY_COLUMNS])
    with open_for_writing(sweep_dir / "runs.csv") as f:  # never through a planted symlink
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
    write_file(sweep_dir / "summary.md", "\n".join(lines) + "\n")


def print_summary(sweep_dir: Path, runs: list[RunResult], groups: list[ConfigSummary],
                  options: SweepSummaryConfig) -> None:
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
        params = {str(k).lstrip("+"): v for k, v in dict(res.get("best_params", {})).items()}
        console.print(f"optuna best {options.metric}: {res.get('best_value')} with {params}")
    console.print(f"summary: {sweep_dir / 'summary.md'} (also summary.csv, runs.csv)")


def summarize(sweep_dir: Path, options: SweepSummaryConfig | None = None) -> list[ConfigSummary]:
    """Rebuild summary.csv / summary.md / runs.csv from the run folders (also of an interrupted sweep)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise UserError(f"Sweep directory '{sweep_dir}' does not exist. Pass the folder `epo sweep` printed, "
                        "e.g. outputs/sweeps/<date>/<time>-<name>.")
    if options is None:
        options = saved_options(sweep_dir)
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
    if not sweep_dir.is_dir():
        raise UserError(f"Sweep directory '{sweep_dir}' does not exist or is not a folder. Pass the folder "
                        "`epo sweep` printed, e.g. outputs/sweeps/<date>/<time>-<name>.")
    options, _ = split_sweep_options([a for a in args if "=" in a], saved_options(sweep_dir))
    summarize(sweep_dir, options)
