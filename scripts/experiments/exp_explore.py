"""Exploration study: on the demo's regime (docs/learning.md), which exploration device helps RL from the
warm start, and does EPO's corridor prevent collapses there?

    python scripts/experiments/exp_explore.py --warm-start RUN [--out outputs/exp_explore] [--arms grpo,epo,...]
                                  [--seeds 0,1,2] [--iterations 40] [--jobs 2] [--warm-success X]
                                  [--experiment improve_on_teacher] [OVERRIDES...]
    python scripts/experiments/exp_explore.py --quick --warm-start RUN --out /tmp/exp_explore_quick   # smoke test

Every run is `epo train experiment=E model.path=<RUN>/final seed=S trainer.total_steps=N` plus its arm's
overrides (ARMS; E: --experiment, the demo's RL preset by default; RUN: an `experiment=noisy_warm_start`
run), in OUT/runs/<arm>/it<N>-seed<S>/ (train log next to it). `--jobs J` runs J of
these at once. A run with a final policy is never rerun; an unfinished one is deleted and started again,
so an interrupted study continues where it stopped, and seeds or arms can be added by later invocations.
Then every final policy, and the warm start, plays the same `--episodes` fixed tasks (eval_in_distribution
of the runs' level and turn limit, drawn with seed 0, T=1.0: the demo's evaluation); `--episodes 0` skips
that. Every other figure comes from the runs' metrics.jsonl (training rollouts, T=1.0).

Written: OUT/summary.md (tables and the definitions below), OUT/summary.json, OUT/explore.png (training
success and policy entropy per iteration: mean over seeds with a min-max band per arm).

Definitions (k = iteration, 1-based; success_k = rollout/success of the iteration's training rollouts):
- eval success: success rate of the final policy on the fixed eval tasks (mean ± std over seeds).
- final success: mean of success_k over the last 5 iterations (mean ± std over seeds).
- warm start value W: `--warm-success`, or the mean of success_1 over every run of the study (iteration 1
  samples from the warm start itself, before any update). "to W + 0.2": the first k whose 3-iteration
  trailing moving average m_k = mean(success_{k-2..k}) reaches W + 0.2.
- entropy swing: policy/entropy_swing = |H_k - H_{k-1}| / H_{k-1} (mean and max over the run).
- diversity: rollout/diversity (distinct action 2-grams / actions per group); "early" = mean over the first
  20% of iterations (at least one), "late" = mean over the rest, drop = 1 - late / early.
- success collapse: iteration k is collapsing when m_j - m_k >= 0.2 for some j in k-5..k-1 (a fall of
  >= 0.2 within 5 iterations on the moving average); each maximal run of collapsing iterations is one event.
- entropy event: iteration k >= 2 is out of band when H_k lies outside [kappa_low, kappa_high] x Href_k
  (the run's own kappas; Href_k = policy/entropy_ref, EPO's cumulative mean of H_1..H_{k-1}, logged by every
  arm); each run of >= 5 consecutive out-of-band iterations is one event.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from exp_common import (
    Arm,
    check_study_args,
    eval_rate,
    finished_run,
    rows_of,
    run_folder,
    run_jobs,
    seed_major,
    study_parser,
    train_once,
)
from exp_entropy import mean_curve, reference

from epo_cli.rundir.saved_state import load_yaml

EXPERIMENT = "improve_on_teacher"  # the RL preset of `make demo`


ARMS = {  # each arm's overrides go on top of the RL preset (--experiment)
    "grpo": Arm("GRPO", ()),
    # the notebook's run P: a constant entropy bonus
    "grpo_bonus": Arm("GRPO + entropy bonus 0.1", ("algo.loss_terms=[policy_clip,kl,entropy]", "entropy.coef=0.1")),
    "epo": Arm("EPO (paper settings)", ("algo=epo",)),
    # the notebook's M4 without its 4 PPO epochs: the band alone at full weight (lambda 1, alpha 1), no bonus
    "epo_bind": Arm("EPO, binding band (alpha 1.0)", ("algo=epo", "algo.loss_terms=[policy_clip,kl,entropy_smoothing]",
                                                      "entropy.coef=1.0", "algo.entropy_smoothing.alpha=1.0")),
    "grpo_dyn": Arm("GRPO + dynamic sampling", ("algo.dynamic_sampling=true",)),
    "gigpo": Arm("GiGPO", ("algo=gigpo",)),
    "epo_gigpo": Arm("EPO on GiGPO", ("algo=epo", "algo.base=gigpo")),
    # the notebook's run G2: an episodic count bonus of 3 / sqrt(N) per turn, constant over training
    "grpo_count": Arm("GRPO + count bonus 3.0", ("algo.intrinsic.kind=count", "algo.intrinsic.coef=3.0",
                                                 "algo.intrinsic.decay=1.0")),
    # the corridor against the entropy explosion the bonus arm causes: the same bonus (lambda 0.1) inside EPO,
    # with a band that binds (alpha 1.0: smoothing weight lambda x beta_k x alpha = 0.1-0.2, as strong as the bonus)
    "epo_bonus_bind": Arm("EPO + entropy bonus 0.1, binding band (alpha 1.0)",
                          ("algo=epo", "entropy.coef=0.1", "algo.entropy_smoothing.alpha=1.0")),
}
QUICK_ARMS = "grpo,epo"
QUICK_OVERRIDES = ["algo.tasks_per_step=2", "algo.group_size=2", "env.max_turns=3", "rollout.max_new_tokens=16"]
LAST = 5          # iterations averaged for the final success
MA = 3            # moving-average window of the success collapse and of "to W + 0.2"
FALL = 0.2        # a success collapse: a fall of at least this ...
FALL_WITHIN = 5   # ... within this many iterations
OUT_RUN = 5       # an entropy event: at least this many consecutive iterations out of band
GAIN = 0.2        # "to W + GAIN"
EARLY = 0.2       # share of iterations that is "early" for the diversity
# the literature's claims (issue: "the seeds' claims") and the iteration after which the diversity drop is
CLAIM_ITERATION = 12


# ----------------------------------------------------------------------------------------------------
# the per-run statistics (pure functions of the metric series; unit-tested on hand-made series)
# ----------------------------------------------------------------------------------------------------

def moving_average(xs: list[float], window: int = MA) -> list[float]:
    """Trailing means: entry i is mean(xs[i-window+1..i]), for i >= window-1 (so len(xs)-window+1 entries)."""
    return [statistics.fmean(xs[i - window + 1:i + 1]) for i in range(window - 1, len(xs))]


def runs_of(flags: list[bool]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of True in flags."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def success_collapses(success: list[float]) -> int:
    """Events where the 3-iteration moving average fell by >= FALL below one of its previous FALL_WITHIN values."""
    m = moving_average(success)
    falling = [any(m[j] - m[i] >= FALL - 1e-12 for j in range(max(0, i - FALL_WITHIN), i)) for i in range(len(m))]
    return len(runs_of(falling))


def out_of_band_flags(entropy: list[float], ref: list[float | None], kappa_low: float, kappa_high: float) -> list[bool]:
    """Per iteration from the second on: H_k outside [kappa_low, kappa_high] x Href_k (bounds inside). A missing
    Href_k (None) is recomputed as the mean of the earlier H (EPO's cumulative reference)."""
    refs = [r if r is not None else own for r, own in zip(ref[1:], reference(entropy))]
    return [not (kappa_low * r <= h <= kappa_high * r) for h, r in zip(entropy[1:], refs)]


def entropy_events(flags: list[bool]) -> int:
    return sum(1 for _, length in runs_of(flags) if length >= OUT_RUN)


def iterations_to(success: list[float], threshold: float) -> int | None:
    """First iteration (1-based) whose moving average reaches threshold; None if none does."""
    for i, m in enumerate(moving_average(success)):
        if m >= threshold - 1e-12:
            return i + MA
    return None


def early_late(xs: list[float]) -> tuple[float, float]:
    """Means over the first EARLY share of the iterations (at least one) and over the rest (nan if none)."""
    n = max(1, math.ceil(EARLY * len(xs)))
    return statistics.fmean(xs[:n]), statistics.fmean(xs[n:]) if xs[n:] else float("nan")


def run_stats(rows: list[dict], kappa: tuple[float, float]) -> dict:
    """Everything the tables need from one run's metrics rows."""
    success = [r["rollout/success"] for r in rows]
    entropy = [r["policy/entropy"] for r in rows]
    diversity = [r["rollout/diversity"] for r in rows]
    swing = [r["policy/entropy_swing"] for r in rows[1:] if "policy/entropy_swing" in r]  # 0 at the first
    early, late = early_late(diversity)
    flags = out_of_band_flags(entropy, [r.get("policy/entropy_ref") for r in rows], *kappa)
    after = diversity[CLAIM_ITERATION:]
    return {"iterations": len(rows), "success": success, "entropy": entropy, "diversity": diversity,
            "final_success": statistics.fmean(success[-LAST:]), "first_success": success[0],
            "swing_mean": statistics.fmean(swing) if swing else float("nan"),
            "swing_max": max(swing) if swing else float("nan"),
            "diversity_early": early, "diversity_late": late,
            "diversity_drop": 1 - late / early if early else float("nan"),
            "diversity_drop_after_12": 1 - statistics.fmean(after) / early if after and early else float("nan"),
            "success_step_change": statistics.fmean(abs(b - a) for a, b in zip(success, success[1:]))
            if len(success) > 1 else float("nan"),
            "out_of_band_share": sum(flags) / len(flags) if flags else float("nan"),
            "success_collapses": success_collapses(success), "entropy_events": entropy_events(flags),
            "kappa": list(kappa)}


# ----------------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------------

def train(key: str, seed: int, a: argparse.Namespace, out: Path, warm: Path) -> None:
    """One run of one arm (exp_common.train_once: unless it finished in an earlier invocation)."""
    train_once(run_folder(out, key, a.iterations, seed),
               [f"experiment={a.experiment}", *ARMS[key].overrides, f"model.path={warm / 'final'}", f"seed={seed}",
                f"trainer.total_steps={a.iterations}", "logger=none", *a.overrides], f"{key} seed {seed}")


def evaluate(run: Path, target: Path, episodes: int, env: tuple[str, int]) -> float:
    """Eval success of run's final policy on `episodes` fixed tasks of env = (level, turn limit), drawn with
    seed 0 for every policy (kept under target and reused)."""
    level, max_turns = env
    return eval_rate(run, target, episodes, False, ("seed=0", f"env.level={level}", f"env.max_turns={max_turns}"))


def collect(out: Path, arms: list[str], iterations: int, seeds: list[int]) -> list[dict]:
    """Every finished run of these arms and seeds at this many iterations (also of earlier invocations)."""
    runs = []
    for key in arms:
        for seed in seeds:
            run = finished_run(run_folder(out, key, iterations, seed))
            if run is None:
                continue
            config = load_yaml(run / "config.yaml")
            band = config.algo.entropy_smoothing
            runs.append({"arm": key, "seed": int(config.seed), "run": str(run),
                         **run_stats(rows_of(run), (float(band.kappa_low), float(band.kappa_high)))})
    return runs


# ----------------------------------------------------------------------------------------------------
# summary: tables, the literature's claims, plot
# ----------------------------------------------------------------------------------------------------

def arm_summary(rs: list[dict], threshold: float) -> dict:
    reached = [iterations_to(r["success"], threshold) for r in rs]
    hit = [k for k in reached if k is not None]
    evals = [r["eval_success"] for r in rs if "eval_success" in r]
    return {"runs": len(rs), "seeds": [r["seed"] for r in rs],
            "eval_success": statistics.fmean(evals) if evals else None,
            "eval_success_std": statistics.stdev(evals) if len(evals) > 1 else 0.0 if evals else None,
            **{k: statistics.fmean(r[k] for r in rs) for k in
               ("final_success", "swing_mean", "swing_max", "diversity_early", "diversity_late", "diversity_drop",
                "diversity_drop_after_12", "success_step_change", "out_of_band_share")},
            "final_success_std": statistics.stdev(r["final_success"] for r in rs) if len(rs) > 1 else 0.0,
            "swing_max_max": max(r["swing_max"] for r in rs),
            "reached": len(hit), "iterations_to_gain": statistics.fmean(hit) if hit else None,
            "success_collapses": sum(r["success_collapses"] for r in rs),
            "entropy_events": sum(r["entropy_events"] for r in rs)}


def ratio(a: float | None, b: float | None) -> float:
    """a / b, nan where either is missing or b is 0."""
    return a / b if a is not None and b and not math.isnan(a) else float("nan")


def claims(summary: dict[str, dict], arms: dict[str, Arm] = ARMS) -> list[dict]:
    """The literature's figures next to this study's, where the arms they compare ran (`arms`: the study's
    table, for the labels; exp_long_horizon.py passes its own)."""
    rows = []
    for key in ("grpo", "gigpo"):
        if key in summary:
            rows.append({"claim": f"diversity drop after iteration {CLAIM_ITERATION}, {arms[key].label}",
                         "claimed": "73%", "measured": fmt(summary[key]["diversity_drop_after_12"], ".0%"),
                         "definition": f"1 - mean(rollout/diversity, iterations > {CLAIM_ITERATION}) "
                                       "/ mean(first 20%)"})
    for epo, base in (("epo", "grpo"), ("epo_bind", "grpo"), ("epo_gigpo", "gigpo")):
        if epo not in summary or base not in summary:
            continue
        e, b = summary[epo], summary[base]
        versus = f"{arms[epo].label} vs {arms[base].label}"
        rows.append({"claim": f"early diversity, {versus}", "claimed": "2.3x",
                     "measured": fmt(ratio(e["diversity_early"], b["diversity_early"]), ".2f") + "x",
                     "definition": "ratio of mean rollout/diversity over the first 20% of iterations"})
        rows.append({"claim": f"training stability (success), {versus}", "claimed": "+41%",
                     "measured": fmt(ratio(b["success_step_change"], e["success_step_change"]) - 1, "+.0%"),
                     "definition": "stability = 1 / mean abs(success_k - success_{k-1}) (training success)"})
        rows.append({"claim": f"training stability (entropy), {versus}", "claimed": "+41%",
                     "measured": fmt(ratio(b["swing_mean"], e["swing_mean"]) - 1, "+.0%"),
                     "definition": "stability = 1 / mean entropy swing"})
        events = [s["success_collapses"] + s["entropy_events"] for s in (e, b)]
        rows.append({"claim": f"collapses, {versus}", "claimed": "-67%",
                     "measured": f"{fmt(ratio(events[0], events[1]) - 1, '+.0%')} ({events[0]} vs {events[1]} events)",
                     "definition": "success collapses + entropy events (definitions above), summed over seeds"})
    return rows


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def tables(summary: dict[str, dict], threshold: float, warm_eval: float | None) -> str:
    head = (f"| arm | seeds | eval success | training success, last {LAST} "
            f"| to W + {GAIN} = {threshold:.3f} (seeds reaching; mean "
            "iteration) | entropy swing mean / max "
            "| diversity early / late (change) | out of band | success collapses | entropy events |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|",
             f"| warm start | | {fmt(warm_eval)} | | | | | | | |"]
    for key, s in summary.items():
        to = f"{s['reached']}/{s['runs']}" + (f"; {s['iterations_to_gain']:.1f}" if s["iterations_to_gain"] else "")
        evals = "-" if s["eval_success"] is None else f"{s['eval_success']:.3f} ± {s['eval_success_std']:.3f}"
        lines.append(f"| {ARMS[key].label} | {s['runs']} | {evals} "
                     f"| {s['final_success']:.3f} ± {s['final_success_std']:.3f} "
                     f"| {to} | {fmt(s['swing_mean'], '.2f')} / {fmt(s['swing_max_max'], '.2f')} "
                     f"| {fmt(s['diversity_early'])} / {fmt(s['diversity_late'])} "
                     f"({fmt(-s['diversity_drop'], '+.0%')}) "
                     f"| {fmt(s['out_of_band_share'], '.0%')} | {s['success_collapses']} | {s['entropy_events']} |")
    return "\n".join(lines)


def claims_table(rows: list[dict]) -> str:
    lines = ["| quantity | claimed | measured here | definition |", "|---|---|---|---|"]
    lines += [f"| {r['claim']} | {r['claimed']} | {r['measured']} | {r['definition']} |" for r in rows]
    return "\n".join(lines)


def plot(runs: list[dict], arms: list[str], path: Path, labels: dict[str, Arm] = ARMS,
         title: str = "mean over seeds, band = min-max over seeds") -> None:
    """Training success and policy entropy per iteration, one line per arm (mean over seeds) with its min-max
    band; `labels`: the study's arm table (exp_long_horizon.py passes its own)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    colors = plt.get_cmap("tab10")
    for i, key in enumerate(arms):
        rs = [r for r in runs if r["arm"] == key]
        if not rs:
            continue
        for ax, metric in zip(axes, ("success", "entropy")):
            curves = [r[metric] for r in rs]
            n = min(len(c) for c in curves)
            steps = range(1, n + 1)
            ax.plot(steps, mean_curve([c[:n] for c in curves]), color=colors(i), lw=1.5,
                    label=f"{labels[key].label} ({len(rs)} seeds)")
            ax.fill_between(steps, [min(c[k] for c in curves) for k in range(n)],
                            [max(c[k] for c in curves) for k in range(n)], color=colors(i), alpha=0.1)
    axes[0].set_ylabel("training success (rollout/success)")
    axes[1].set_ylabel("policy/entropy (nats/token, log scale)")
    axes[1].set_yscale("log")  # an entropy bonus can multiply the entropy tenfold; the others differ by percent
    axes[1].set_xlabel("iteration")
    axes[0].set_title(title, fontsize=10)
    axes[0].legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = study_parser(__doc__, "outputs/exp_explore", ARMS, "run dir of the warm start (holding final/), required",
                     "runs at the same time")
    p.add_argument("--iterations", type=int, default=40, help="RL iterations per run")
    p.add_argument("--experiment", default=EXPERIMENT, help="the RL preset every arm starts from")
    p.add_argument("--episodes", type=int, default=64, help="fixed eval tasks per policy (0: no evaluation)")
    p.add_argument("--warm-success", type=float, help="the warm start's success W (default: mean iteration-1 success)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: arms {QUICK_ARMS}, the first seed, 2 tiny iterations; its numbers mean nothing")
    p.add_argument("overrides", nargs="*", help="extra overrides for every run")
    a = p.parse_args(argv)
    if a.quick:
        a.arms, a.seeds, a.iterations, a.episodes = QUICK_ARMS, a.seeds.split(",")[0], 2, 4
        a.overrides = [*QUICK_OVERRIDES, *a.overrides]
    check_study_args(p, a, ARMS, "experiment=noisy_warm_start")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    out, warm = a.out.resolve(), Path(a.warm_start).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    arms = a.arms.split(",")
    run_jobs(seed_major(arms, a.seed_list), lambda job: train(*job, a, out, warm), a.jobs)

    runs = collect(out, arms, a.iterations, a.seed_list)
    warm_eval = None
    if a.episodes and runs:
        # the warm start's own config names its SFT level: it plays the runs' level and turn limit instead
        config = load_yaml(Path(runs[0]["run"]) / "config.yaml")
        env = (str(config.env.level), int(config.env.max_turns))
        # one after another, in this process (exp_common.eval_rate): evaluations are CPU-bound Python
        targets = [(warm, out / "eval" / "warm_start"), *((Path(r["run"]), Path(r["run"]) / "eval_explore")
                                                          for r in runs)]
        warm_eval, *rates = [evaluate(run, target, a.episodes, env) for run, target in targets]
        for r, rate in zip(runs, rates):
            r["eval_success"] = rate
    warm_success = a.warm_success if a.warm_success is not None else statistics.fmean(r["first_success"] for r in runs)
    threshold = warm_success + GAIN
    summary = {key: arm_summary([r for r in runs if r["arm"] == key], threshold)
               for key in arms if any(r["arm"] == key for r in runs)}
    claim_rows = claims(summary)
    plot(runs, arms, out / "explore.png")
    wall = time.perf_counter() - start
    w_from = "given" if a.warm_success is not None else "mean iteration-1 training success over all runs"
    settings = (f"`experiment={a.experiment}` from `{warm}/final`, {a.iterations} iterations, seeds {a.seeds}, "
                f"overrides {a.overrides or 'none'}. Eval: {a.episodes or 'no'} fixed tasks per policy (seed 0, "
                f"T=1.0); every other figure from the runs' training rollouts (metrics.jsonl). W (warm start) = "
                f"{warm_success:.3f} ({w_from}). Wall time of this invocation: {wall / 60:.1f} min.")
    definitions = __doc__.split("Definitions", 1)[1].split("\n", 1)[1].strip()
    md = (f"{settings}\n\n{tables(summary, threshold, warm_eval)}\n\n"
          f"The literature's claims and this run's figures:\n\n{claims_table(claim_rows)}\n\n"
          f"Definitions:\n\n{definitions}\n\n![success and entropy](explore.png)\n")
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_text(json.dumps(
        {"settings": settings, "warm_success": warm_success, "warm_eval_success": warm_eval,
         "eval_episodes": a.episodes, "threshold": threshold, "iterations": a.iterations,
         "arms": {k: {"label": ARMS[k].label, "overrides": list(ARMS[k].overrides), **s} for k, s in summary.items()},
         "claims": claim_rows, "runs": runs, "wall_s": wall}, indent=1))
    print(md)
    print(f"written: {out / 'summary.md'}, {out / 'explore.png'} ({wall / 60:.1f} min)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the runs got the terminal's Ctrl-C too, and stopped at the end of a step
        print("\ninterrupted: the finished runs are kept and reused by the next invocation with the same --out "
              "(an unfinished run is started over).", file=sys.stderr, flush=True)
        sys.exit(130)
