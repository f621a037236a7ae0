"""`epo report <run_dir>|<sweep_dir> [...] [--out DIR]`: PNG plots of one run or many runs overlaid, and an
index page (Markdown) that shows them with a small table. Default output: <first dir>/plots/.

    entropy.png              policy/entropy; for EPO runs (entropy_smoothing in algo.loss_terms) also the
                             smoothing reference Href (dashed) and its band [kappa_low, kappa_high] x Href
    entropy_fluctuation.png  policy/entropy_fluctuation (monitor sigma) and policy/entropy_swing
    success.png              rollout/success (training) and eval/<split>/success for each split
    kl.png                   policy/kl_ref
    coefficients.png         every coef/* (one panel each)
    lr.png                   perf/lr
    collapse.png             the collapse panel: on one step axis, entropy with EPO's band, collapse/mi, the
                             groups' return std and zero-std share, state diversity and the samples outside the
                             band (above solid, below dashed); steps with collapse/alert = 1 are shaded
    entropy_turns.png        per-turn entropy (policy/entropy_turn/<t>): turn index x step, one heatmap per
                             configuration (mean over its seeds)
    index.md                 the table, a line per run whose collapse alert fired (the steps it went on), and
                             the images

Runs whose overrides differ only in `seed` are one configuration: its seeds are drawn as the mean with a
shaded band of +- one standard deviation. The EPO reference is recomputed from the logged policy/entropy
values exactly as training keeps it (epo_cli.algos.entropy, mode algo.entropy_smoothing.history: the mean of
all past steps, of the last `window` steps, or their EMA; the global reference, also for per_turn runs).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from epo_cli.algos.entropy import _Stream
from epo_cli.analysis.sweep_summary import (
    config_key,
    config_label,
    is_run_dir,
    job_number,
    mean_pm_std,
    run_overrides,
    varying_keys,
)
from epo_cli.errors import UserError
from epo_cli.loggers.jsonl import read_metrics
from epo_cli.rundir.folder import read_status, read_yaml_data
from epo_cli.rundir.writable import check_output_dir


@dataclass
class RunData:
    path: Path
    overrides: list[str]
    config: dict[str, Any]  # the run's saved config.yaml (empty if it has none)
    rows: list[dict[str, Any]]  # metrics.jsonl


@dataclass
class Group:
    """Runs of one configuration (its seeds)."""

    label: str
    runs: list[RunData]


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------

def find_runs(paths: list[Path]) -> list[Path]:
    """Run folders behind the given paths: a run directory itself, or the job folders of a sweep."""
    found: list[Path] = []
    for path in paths:
        if path.exists() and not path.is_dir():
            raise UserError(f"'{path}' is a file, not a folder. Pass a run directory (outputs/<date>/<time>-<name>) "
                            "or a sweep directory (outputs/sweeps/<date>/<time>-<name>).")
        if not path.is_dir():
            raise UserError(f"'{path}' does not exist. Pass a run directory (outputs/<date>/<time>-<name>) "
                            "or a sweep directory (outputs/sweeps/<date>/<time>-<name>).")
        if (path / "metrics.jsonl").exists() or (path / "config.yaml").exists():
            found.append(path)
            continue
        jobs = sorted((p for p in path.iterdir() if is_run_dir(p)),
                      key=lambda p: (job_number(p) is None, job_number(p) or 0, p.name))
        if not jobs:
            raise UserError(f"'{path}' holds no run (no metrics.jsonl or config.yaml, and no job folders). "
                            "Pass a run directory or a sweep directory.")
        found += jobs
    return found


def load_run(path: Path) -> RunData:
    cfg_path = path / "config.yaml"
    config = read_yaml_data(cfg_path) if cfg_path.exists() else {}
    rows = ordered_steps(read_metrics(path), path / "metrics.jsonl")
    return RunData(path, run_overrides(path), config if isinstance(config, dict) else {}, rows)


def ordered_steps(rows: list[dict[str, Any]], where: Path) -> list[dict[str, Any]]:
    """One row per step, in step order. A run logs each step once, counting up from 1; a step logged again
    (two runs wrote into one folder) or a step that is not a whole number >= 0 would draw lines that run back
    and forth: one warning each, then the last row of a repeated step is kept and the others are dropped."""
    by_step: dict[int, dict[str, Any]] = {}
    bad, repeated = [], []
    for row in rows:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not float(step).is_integer() or step < 0:
            bad.append(step)
            continue
        if int(step) in by_step:
            repeated.append(int(step))
        by_step[int(step)] = row
    if bad:
        shown = ", ".join(str(b) for b in bad[:5]) + (", ..." if len(bad) > 5 else "")
        warnings.warn(f"'{where}' has {len(bad)} row(s) whose step is not a whole number >= 0 ({shown}); they are "
                      "left out of the plots.", stacklevel=2)
    if repeated:
        shown = ", ".join(str(r) for r in sorted(set(repeated))[:8]) + (", ..." if len(set(repeated)) > 8 else "")
        warnings.warn(f"'{where}' logs some steps more than once ({shown}): more than one run wrote into this "
                      "folder. The plots keep the last row of each step; the file holds them all.", stacklevel=2)
    return [by_step[step] for step in sorted(by_step)]


def group_runs(runs: list[RunData]) -> list[Group]:
    shown = varying_keys([r.overrides for r in runs])
    groups: dict[tuple[str, ...], list[RunData]] = {}
    for r in runs:
        groups.setdefault(config_key(r.overrides), []).append(r)
    out = []
    for key, members in groups.items():
        label = config_label(list(key), shown)
        if label == "(all runs)" and len(members) == 1:  # a single run: its folder names it best
            label = members[0].path.name
        out.append(Group(label, members))
    return out


# ----------------------------------------------------------------------------------------------------
# Series
# ----------------------------------------------------------------------------------------------------

def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


#: the largest magnitude a plot shows: matplotlib's axis ticks overflow to inf on a range near float64's
#: limit (1e308 is an arange ValueError), and a band's variance squares the values
PLOT_LIMIT = 1e100
_warned_beyond: set[str] = set()


def series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one metric, finite values within PLOT_LIMIT only (those beyond: one warning)."""
    pairs = [(r["step"], _num(r[key])) for r in rows if key in r]
    pairs = [(s, v) for s, v in pairs if math.isfinite(v)]
    beyond = [s for s, v in pairs if abs(v) > PLOT_LIMIT]
    if beyond and key not in _warned_beyond:
        _warned_beyond.add(key)
        warnings.warn(f"{key} has values beyond +-{PLOT_LIMIT:g} at step(s) {', '.join(map(str, beyond[:5]))}"
                      f"{' ...' if len(beyond) > 5 else ''}: they are left out of its plot (no axis holds them).",
                      stacklevel=2)
    pairs = [(s, v) for s, v in pairs if abs(v) <= PLOT_LIMIT]
    return np.array([p[0] for p in pairs], dtype=float), np.array([p[1] for p in pairs], dtype=float)


def mean_band(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and (population) std across runs at every step any of them logged."""
    steps = np.unique(np.concatenate([s for s, _ in parts])) if parts else np.array([])
    mean, std = np.full(len(steps), np.nan), np.zeros(len(steps))
    for i, step in enumerate(steps):
        vals = [v[s == step][0] for s, v in parts if np.any(s == step)]
        mean[i], std[i] = float(np.mean(vals)), float(np.std(vals))
    return steps, mean, std


def smoothing_settings(config: dict[str, Any]) -> dict[str, Any] | None:
    """algo.entropy_smoothing of an EPO run (None when the run has no smoothing term)."""
    algo = config.get("algo", {})
    if "entropy_smoothing" not in (algo.get("loss_terms") or []):
        return None
    return algo.get("entropy_smoothing") or {}


def entropy_reference(rows: list[dict[str, Any]], settings: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Href at each step, from the entropies of the steps before it (training's own history class)."""
    stream = _Stream(settings.get("history", "cumulative"), int(settings.get("window", 10)),
                     float(settings.get("ema_decay", 0.9)))
    steps, refs = [], []
    for step, h in zip(*series(rows, "policy/entropy")):
        steps.append(step)
        refs.append(stream.value())  # NaN at the first step: no history yet
        stream.add(float(h))
    return np.array(steps, dtype=float), np.array(refs, dtype=float)


# ----------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _axes(n: int, title: str):
    plt = _pyplot()
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    width = 5.5 * cols if cols > 1 else 8.0  # one panel: wide enough for its legend
    fig, axes = plt.subplots(rows, cols, figsize=(width, 3.6 * rows if cols > 1 else 4.5), squeeze=False)
    fig.suptitle(title)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def draw_metric(ax: Any, groups: list[Group], key: str, title: str, linestyle: str = "-", suffix: str = "") -> bool:
    """One metric, one line per configuration (mean over seeds, shaded +- std). False if nothing logged."""
    drawn = False
    for i, group in enumerate(groups):
        parts = [p for p in (series(r.rows, key) for r in group.runs) if len(p[0])]
        if not parts:
            continue
        steps, mean, std = mean_band(parts)
        color = f"C{i % 10}"
        few = len(steps) <= 3  # sparse series (evaluations): show the points
        ax.plot(steps, mean, color=color, label=f"{group.label}{suffix} (n={len(parts)})", linestyle=linestyle,
                marker="o" if few else None)
        if len(parts) > 1:
            ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
        drawn = True
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    return drawn


def draw_entropy_band(ax: Any, groups: list[Group]) -> None:
    """EPO's smoothing reference and band, averaged over each configuration's seeds."""
    for i, group in enumerate(groups):
        parts, settings = [], None
        for r in group.runs:
            settings = smoothing_settings(r.config)
            if settings is not None:
                steps, refs = entropy_reference(r.rows, settings)
                ok = np.isfinite(refs)
                if ok.any():
                    parts.append((steps[ok], refs[ok]))
        if not parts or settings is None:
            continue
        steps, ref, _ = mean_band(parts)
        low, high = float(settings.get("kappa_low", 0.0)), float(settings.get("kappa_high", 2.0))
        color = f"C{i % 10}"
        ax.plot(steps, ref, color=color, linestyle="--", linewidth=1, label=f"{group.label}: Href")
        ax.fill_between(steps, low * ref, high * ref, color=color, alpha=0.08, linewidth=0,
                        label=f"{group.label}: band [{low:g}, {high:g}] x Href")
    ax.legend(fontsize=7)


def _keys(runs: list[RunData], prefix: str, suffix: str = "") -> list[str]:
    keys = {k for r in runs for row in r.rows for k in row if k.startswith(prefix) and k.endswith(suffix)}
    return sorted(keys)


def make_plots(groups: list[Group], out: Path) -> dict[str, tuple[str, bool]]:
    """Write every PNG; returns {file: (title, anything drawn)}."""
    plt = _pyplot()
    runs = [r for g in groups for r in g.runs]
    written: dict[str, tuple[str, bool]] = {}

    def save(fig: Any, name: str, title: str, drawn: bool) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        written[name] = (title, drawn)

    fig, (ax,) = _axes(1, "Policy entropy (token mean)")
    drawn = draw_metric(ax, groups, "policy/entropy", "policy/entropy")
    if drawn and any(smoothing_settings(r.config) is not None for r in runs):
        draw_entropy_band(ax, groups)
    save(fig, "entropy.png", "Entropy", drawn)

    fig, axes = _axes(2, "Entropy fluctuation")
    drawn = draw_metric(axes[0], groups, "policy/entropy_fluctuation", "policy/entropy_fluctuation (sigma)")
    drawn |= draw_metric(axes[1], groups, "policy/entropy_swing", "policy/entropy_swing |dH|/H")
    save(fig, "entropy_fluctuation.png", "Entropy fluctuation", drawn)

    # eval/<split>/success, not eval/<split>/success/<task type> nor the eval/success alias
    splits = [k for k in _keys(runs, "eval/", "/success") if k.count("/") == 2]
    fig, axes = _axes(1 + len(splits), "Success")
    drawn = draw_metric(axes[0], groups, "rollout/success", "rollout/success (training)")
    for ax, key in zip(axes[1:], splits):
        drawn |= draw_metric(ax, groups, key, key)
    save(fig, "success.png", "Success", drawn)

    fig, (ax,) = _axes(1, "KL to the reference policy")
    save(fig, "kl.png", "KL", draw_metric(ax, groups, "policy/kl_ref", "policy/kl_ref"))

    coefs = _keys(runs, "coef/") or ["coef/"]
    fig, axes = _axes(len(coefs), "Loss coefficients")
    drawn = False
    for ax, key in zip(axes, coefs):
        drawn |= draw_metric(ax, groups, key, key)
    save(fig, "coefficients.png", "Coefficients", drawn)

    fig, (ax,) = _axes(1, "Learning rate")
    save(fig, "lr.png", "Learning rate", draw_metric(ax, groups, "perf/lr", "perf/lr"))

    fig, drawn = collapse_panel(groups, runs)
    save(fig, "collapse.png", "Collapse diagnostics", drawn)
    fig, drawn = entropy_heatmaps(groups)
    save(fig, "entropy_turns.png", "Entropy per turn", drawn)
    return written


#: the collapse panel's rows: (title, [(metric, line style, label suffix)])
COLLAPSE_ROWS = (
    ("policy/entropy (EPO's band dashed/shaded)", [("policy/entropy", "-", "")]),
    ("collapse/mi: nats/token (~0: answers ignore the prompt)", [("collapse/mi", "-", "")]),
    ("collapse/reward_std: return std within groups", [("collapse/reward_std", "-", "")]),
    ("collapse/zero_std_groups: share of groups without return spread", [("collapse/zero_std_groups", "-", "")]),
    ("collapse/state_diversity: distinct actions per shared state", [("collapse/state_diversity", "-", "")]),
    ("collapse/corridor: samples above (solid) / below (dashed) the band",
     [("collapse/corridor_above", "-", " above"), ("collapse/corridor_below", "--", " below")]),
)


def alert_steps(rows: list[dict[str, Any]]) -> list[int]:
    """Steps with collapse/alert = 1 (a signal beyond its threshold)."""
    steps, values = series(rows, "collapse/alert")
    return [int(s) for s, v in zip(steps, values) if v > 0]


def alert_onsets(rows: list[dict[str, Any]]) -> list[int]:
    """Steps where collapse/alert went from 0 (or not logged) to 1."""
    steps, values = series(rows, "collapse/alert")
    return [int(s) for i, (s, v) in enumerate(zip(steps, values)) if v > 0 and (i == 0 or values[i - 1] <= 0)]


def collapse_panel(groups: list[Group], runs: list[RunData]) -> tuple[Any, bool]:
    """The collapse panel (one figure, rows on one shared step axis) and whether anything was drawn."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(COLLAPSE_ROWS), 1, figsize=(9.0, 2.3 * len(COLLAPSE_ROWS)), sharex=True,
                             squeeze=False)
    fig.suptitle("Collapse diagnostics")
    alerts = sorted({s for r in runs for s in alert_steps(r.rows)})
    drawn = False
    for ax, (title, keys) in zip(axes[:, 0], COLLAPSE_ROWS):
        row_drawn = False
        for key, style, suffix in keys:
            row_drawn |= draw_metric(ax, groups, key, title, linestyle=style, suffix=suffix)
        is_entropy = keys[0][0] == "policy/entropy"
        if is_entropy and row_drawn and any(smoothing_settings(r.config) is not None for r in runs):
            draw_entropy_band(ax, groups)
        for step in alerts:
            ax.axvspan(step - 0.5, step + 0.5, color="red", alpha=0.12, linewidth=0)
        ax.set_xlabel("")
        drawn |= row_drawn and not is_entropy  # the panel counts as drawn when a collapse signal is
    axes[-1, 0].set_xlabel("step" + ("  (red: collapse alert)" if alerts else ""))
    return fig, drawn


def turn_entropy_grid(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps [S], turns [T], entropy [T, S], NaN where a turn had no sample) from policy/entropy_turn/<t>."""
    prefix = "policy/entropy_turn/"
    turns = sorted({int(k[len(prefix):]) for r in rows for k in r if k.startswith(prefix)})
    steps = sorted({int(r["step"]) for r in rows if any(k.startswith(prefix) for k in r)})
    grid = np.full((len(turns), len(steps)), np.nan)
    col = {s: j for j, s in enumerate(steps)}
    row = {t: i for i, t in enumerate(turns)}
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix) and math.isfinite(_num(v)):
                grid[row[int(k[len(prefix):])], col[int(r["step"])]] = _num(v)
    return np.array(steps, dtype=float), np.array(turns, dtype=float), grid


def entropy_heatmaps(groups: list[Group]) -> tuple[Any, bool]:
    """Per-turn entropy heatmaps, one per configuration (the mean over its seeds where they logged a turn)."""
    grids = []
    for group in groups:
        parts = [turn_entropy_grid(r.rows) for r in group.runs]
        parts = [p for p in parts if p[2].size]
        if not parts:
            grids.append((group.label, None))
            continue
        steps = np.unique(np.concatenate([p[0] for p in parts]))
        turns = np.unique(np.concatenate([p[1] for p in parts]))
        stack = np.full((len(parts), len(turns), len(steps)), np.nan)
        for n, (s, t, g) in enumerate(parts):
            stack[n][np.ix_(np.searchsorted(turns, t), np.searchsorted(steps, s))] = g
        with np.errstate(all="ignore"):
            mean = np.nanmean(stack, axis=0) if len(parts) > 1 else stack[0]
        grids.append((f"{group.label} (n={len(parts)})", (steps, turns, mean)))
    fig, axes = _axes(len(grids), "Entropy per turn index (policy/entropy_turn/<t>)")
    drawn = False
    for ax, (label, data) in zip(axes, grids):
        ax.set_title(label, fontsize=8)
        if data is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        steps, turns, mean = data
        image = ax.imshow(np.ma.masked_invalid(mean), aspect="auto", origin="lower", cmap="viridis",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, turns[0] - 0.5, turns[-1] + 0.5),
                          interpolation="nearest")
        ax.figure.colorbar(image, ax=ax, label="nats/token")
        ax.set_xlabel("step")
        ax.set_ylabel("turn index")
        drawn = True
    return fig, drawn


# ----------------------------------------------------------------------------------------------------
# Index page and command
# ----------------------------------------------------------------------------------------------------

def _last(rows: list[dict[str, Any]], key: str) -> float:
    _, values = series(rows, key)
    return float(values[-1]) if len(values) else math.nan


def write_index(groups: list[Group], written: dict[str, tuple[str, bool]], out: Path,
                sources: list[Path]) -> Path:
    lines = [f"# Report: {', '.join(str(s) for s in sources)}", "",
             "Mean ± sample std over the seeds of each configuration (final values).", "",
             "| configuration | runs | last step | final success | final eval/success | final entropy "
             "| status |",
             "|---|---|---|---|---|---|---|"]
    for g in groups:
        statuses = sorted({read_status(r.path).get("status", "unknown") for r in g.runs})
        last = max((int(r.rows[-1]["step"]) for r in g.runs if r.rows), default=0)
        lines.append(f"| {g.label} | {len(g.runs)} | {last} | "
                     f"{mean_pm_std([_last(r.rows, 'rollout/success') for r in g.runs])} | "
                     f"{mean_pm_std([_last(r.rows, 'eval/success') for r in g.runs])} | "
                     f"{mean_pm_std([_last(r.rows, 'policy/entropy') for r in g.runs])} | {', '.join(statuses)} |")
    lines.append("")
    alerted = [(r, alert_onsets(r.rows), len(alert_steps(r.rows))) for g in groups for r in g.runs]
    for r, onsets, on in alerted:
        if onsets:
            shown = ", ".join(str(s) for s in onsets[:20]) + (", ..." if len(onsets) > 20 else "")
            lines.append(f"**Collapse alert** in `{r.path.name}` from step{'s' if len(onsets) > 1 else ''} {shown} "
                         f"(on for {on} step{'s' if on > 1 else ''}; what crossed which threshold: the run's "
                         f"console log and `status.json`; see [collapse.png](collapse.png))  ")
    if any(onsets for _, onsets, _ in alerted):
        lines.append("")
    for name, (title, drawn) in written.items():
        note = "" if drawn else " (not logged by these runs)"
        lines += [f"## {title}", "", f"![{title}]({name}){note}", ""]
    index = out / "index.md"
    index.write_text("\n".join(lines))
    return index


def run_report(paths: list[Path], out: Path | None = None) -> Path:
    """`epo report`: plots + index for runs and sweeps; returns the index page."""
    _warned_beyond.clear()  # each report warns about its own runs
    if not paths:
        raise UserError("Usage: epo report <run_dir>|<sweep_dir> [...] [--out DIR]")
    runs = [load_run(p) for p in find_runs([Path(p).expanduser() for p in paths])]
    if not any(r.rows for r in runs):
        raise UserError(f"No metrics to plot: none of {', '.join(str(r.path) for r in runs[:3])} has a "
                        "metrics.jsonl with rows yet (logger.jsonl=false, or the run failed before step 1).")
    out = Path(out) if out is not None else Path(paths[0]).expanduser() / "plots"
    check_output_dir(out, "--out", entries=True)  # a received run's plots/: no planted symlink written through
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    written = make_plots(groups, out)
    index = write_index(groups, written, out, [Path(p) for p in paths])
    Console(highlight=False).print(f"{len(written)} plots of {len(runs)} runs ({len(groups)} configurations) "
                                   f"-> {out}\nindex: {index}")
    return index
