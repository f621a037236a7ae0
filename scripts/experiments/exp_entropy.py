"""Entropy stress study: GRPO with a constant entropy bonus drives the policy entropy away; which remedy holds
it in EPO's band, and at what success cost?

    python scripts/experiments/exp_entropy.py --warm-start RUN [--out outputs/exp_entropy] [--arms grpo,grpo_bonus,...]
                                  [--seeds 0,1,2] [--steps 60] [--jobs 2] [--episodes 64] [OVERRIDES...]
    python scripts/experiments/exp_entropy.py --quick --warm-start RUN --out /tmp/exp_entropy_quick    # smoke test

Every arm is `experiment=entropy_stress` (GRPO + a constant entropy bonus, household, from the warm start)
plus the overrides in ARMS, swept over the seeds by one `epo sweep` per arm (OUT/sweeps/<arm>/seeds-<seeds>/);
`--jobs N` runs N arms' sweeps at the same time. Seeds can be added by later invocations (`--seeds 0`, then
`--seeds 1`: every arm gets seed 0 first); the table covers every finished run under OUT/sweeps/<arm>/.
Every final policy, and the warm start, is then evaluated (evaluate_run, what `epo eval` runs, in this process)
on the same fixed eval_in_distribution tasks (drawn with `seed=--eval-seed` for every policy, not the run's own
seed) under the runs' turn limit, at T=1.0 and greedily. Written: OUT/results.md (table), OUT/results.json
(per run), OUT/entropy_curves.png.
Sweeps with a summary and evaluations already on disk are reused, so an interrupted study continues.
Its jobs are arms, not (arm, seed) runs: each arm is one `epo sweep` over all its seeds in Hydra's sweep folders,
so the arms go through exp_common.run_jobs but not its per-run train_once/run_folder.

Table columns (per run, then mean ± std over seeds): eval success; the batch entropy H_k (policy/entropy,
token mean at the sampling temperature) at the first iteration, over the last 5, its min and max; the
relative step-to-step swing |H_k - H_{k-1}| / H_{k-1} (mean, max) and the monitor's sigma (mean over the
run), as exp_algos.py; "out of band": the share of iterations k >= 1 whose H_k lies outside EPO's band
[kappa_low, kappa_high] x Href(k), Href(k) = mean(H_0..H_{k-1}) (the paper's cumulative reference; the
run's own kappas, (0, 2) by default), whether or not the arm's loss enforces the band; "tokens above band"
(EPO arms only): the share of response tokens whose own entropy is above kappa_high x Href, where the
smoothing penalty acts (policy/entropy_above_band, mean over iterations k >= 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from exp_common import (
    Arm,
    check_arms,
    epo,
    eval_rate,
    fluctuation,
    rows_of,
    run_jobs,
    seed_cell,
    study_parser,
    warm_start_run,
)

from epo_cli.rundir.saved_state import load_yaml

EPO_TERMS = "algo.loss_terms=[policy_clip,kl,entropy,entropy_smoothing]"  # the preset's loss_terms lack it


ARMS = {  # each arm's overrides go on top of experiment=entropy_stress
    "grpo": Arm("GRPO, no bonus", ("algo.loss_terms=[policy_clip,kl]",)),
    "grpo_bonus": Arm("GRPO + bonus", ()),
    "clip_higher": Arm("+ clip-higher 0.28", ("algo.policy_clip.clip_high=0.28",)),
    "clip_cov": Arm("+ Clip-Cov", ("algo.policy_loss=clip_cov",)),
    "kl_cov": Arm("+ KL-Cov", ("algo.policy_loss=kl_cov",)),
    "epo": Arm("EPO (paper, alpha 0.1)", ("algo=epo", EPO_TERMS)),
    "epo_bind": Arm("EPO, binding band (alpha 1.0)", ("algo=epo", EPO_TERMS, "algo.entropy_smoothing.alpha=1.0")),
}
LAST = 5  # iterations averaged for "H end"
COLUMNS = ("t1", "greedy", "h_start", "h_end", "h_min", "h_max", "swing_mean", "swing_max", "sigma", "out_of_band",
           "tokens_above_band")
HEADER = ("eval success T=1.0", "eval success greedy", "H start", f"H end (last {LAST})", "H min", "H max",
          "swing mean", "swing max", "sigma", "out of band", "tokens above band")


def reference(h: list[float]) -> list[float]:
    """Href(k) = mean(H_0..H_{k-1}) for k = 1..len(h)-1: EPO's cumulative reference before iteration k."""
    return [statistics.fmean(h[:k]) for k in range(1, len(h))]


def out_of_band(h: list[float], kappa_low: float, kappa_high: float) -> float:
    """Share of iterations k >= 1 with H_k outside [kappa_low, kappa_high] x Href(k) (bounds inside)."""
    refs = reference(h)
    outside = [not (kappa_low * r <= x <= kappa_high * r) for x, r in zip(h[1:], refs)]
    return sum(outside) / len(outside) if outside else float("nan")


def entropy_stats(h: list[float], kappa_low: float, kappa_high: float) -> dict[str, float]:
    return {"h_start": h[0], "h_end": statistics.fmean(h[-LAST:]), "h_min": min(h), "h_max": max(h),
            "out_of_band": out_of_band(h, kappa_low, kappa_high)}


# ----------------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------------

def eval_overrides(a: argparse.Namespace, max_turns: int) -> tuple[str, ...]:
    """Evaluation overrides shared by every policy: the task draw's seed and the turn limit of the runs."""
    return (f"seed={a.eval_seed}", f"env.max_turns={max_turns}")


def run_arm(key: str, a: argparse.Namespace, out: Path, warm: Path) -> list[dict]:
    """One arm: its sweep over the seeds (unless done), then the evaluation of each final policy of the arm
    (also those of earlier invocations with other seeds: OUT/sweeps/<arm>/seeds-<seeds>/)."""
    sweep = out / "sweeps" / key / f"seeds-{a.seeds.replace(',', '_')}"
    if not (sweep / "summary.csv").exists():
        if sweep.exists():  # an interrupted sweep of this script: its job folders would clash with a new one
            shutil.rmtree(sweep)
        t0 = time.perf_counter()
        epo("sweep", "experiment=entropy_stress", *ARMS[key].overrides, f"seed={a.seeds}",
            f"model.path={warm / 'final'}", f"trainer.total_steps={a.steps}", "trainer.eval_every=0",
            "env.eval_splits=[]", "logger=none", f"hydra.sweep.dir={sweep}", *a.overrides, cwd=out)
        (sweep / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    runs = []
    for run in sorted(p for p in sweep.parent.glob("seeds-*/*") if (p / "metrics.jsonl").exists()):
        if not (run / "final").exists():
            print(f"skipping unfinished run {run}", flush=True)
            continue
        config = load_yaml(run / "config.yaml")
        smoothing = config.algo.entropy_smoothing
        rows = [r for r in rows_of(run) if "policy/entropy" in r]
        h = [r["policy/entropy"] for r in rows]
        extra = eval_overrides(a, int(config.env.max_turns))
        evals = {"t1": eval_rate(run, run / "eval_exp", a.episodes, False, extra)}
        if a.greedy:
            evals["greedy"] = eval_rate(run, run / "eval_exp", a.episodes, True, extra)
        fl = fluctuation(rows)
        # logged by the smoothing term (EPO arms), from the second iteration on (the first has no reference)
        above = [r["policy/entropy_above_band"] for r in rows if "policy/entropy_above_band" in r
                 and "policy/entropy_ref" in r]
        runs.append({"arm": key, "run": str(run), "seed": int(config.seed), "max_turns": int(config.env.max_turns),
                     "entropy": h,
                     "kappa": [float(smoothing.kappa_low), float(smoothing.kappa_high)], **evals,
                     "swing_mean": fl["swing_mean"], "swing_max": fl["swing_max"], "sigma": fl["sigma"],
                     **entropy_stats(h, float(smoothing.kappa_low), float(smoothing.kappa_high)),
                     **({"tokens_above_band": statistics.fmean(above)} if above else {})})
    return runs


# ----------------------------------------------------------------------------------------------------
# table and plot
# ----------------------------------------------------------------------------------------------------

def table(runs: list[dict], arms: list[str], base: dict[str, float]) -> str:
    shown = [(k, h) for k, h in zip(COLUMNS, HEADER) if k != "greedy" or "greedy" in base]  # --no-greedy
    lines = ["| arm | runs | " + " | ".join(h for _, h in shown) + " |", "|---|---|" + "---|" * len(shown)]
    warm = [f"{base[k]:.3f}" if k in base else "" for k, _ in shown]
    lines.append("| warm start (SFT) | | " + " | ".join(warm) + " |")
    for key in arms:
        rs = [r for r in runs if r["arm"] == key]
        cells = [seed_cell([r[k] for r in rs]) if all(k in r for r in rs) else "-" for k, _ in shown]
        lines.append(f"| {ARMS[key].label} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_curve(curves: list[list[float]]) -> list[float]:
    """Mean over seeds at each iteration that every seed reached."""
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


def plot(runs: list[dict], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(arms) + 1
    cols = min(4, panels)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), sharex=True, sharey=True, squeeze=False)
    flat = axes.flatten()
    colors = plt.get_cmap("tab10")
    for i, key in enumerate(arms):
        rs = [r for r in runs if r["arm"] == key]
        if not rs:
            continue
        color = colors(i)
        mean = mean_curve([r["entropy"] for r in rs])
        flat[0].plot(range(1, len(mean) + 1), mean, color=color, lw=1.6, label=ARMS[key].label)
        ax = flat[i + 1]
        for r in rs:
            ax.plot(range(1, len(r["entropy"]) + 1), r["entropy"], color=color, lw=0.7, alpha=0.35)
        ax.plot(range(1, len(mean) + 1), mean, color=color, lw=2, label=f"mean of {len(rs)} seeds")
        # the band around the mean curve's own reference (Href is linear in H, so it is the seeds' mean Href)
        low, high = rs[0]["kappa"]
        ref = reference(mean)
        steps = range(2, len(mean) + 1)
        enforced = any("entropy_smoothing" in o for o in ARMS[key].overrides)
        ax.fill_between(steps, [low * x for x in ref], [high * x for x in ref], color="gray",
                        alpha=0.25 if enforced else 0.1,
                        label=f"band [{low:g}, {high:g}] x Href" + ("" if enforced else " (not enforced)"))
        ax.set_title(ARMS[key].label, fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    flat[0].set_title("mean entropy over seeds, all arms", fontsize=10)
    flat[0].legend(fontsize=7, loc="upper left")
    for ax in flat[panels:]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    for ax in axes[:, 0]:
        ax.set_ylabel("policy/entropy (nats/token)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = study_parser(__doc__, "outputs/exp_entropy", ARMS, "run dir of an existing warm start (default: train one)",
                     "arms whose sweeps run at the same time")
    p.add_argument("--steps", type=int, default=60, help="GRPO iterations per run")
    p.add_argument("--episodes", type=int, default=64, help="fixed eval tasks per policy")
    p.add_argument("--eval-seed", type=int, default=0, help="seed that draws the eval tasks for every policy")
    p.add_argument("--no-greedy", dest="greedy", action="store_false", help="skip the greedy evaluation")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: arms grpo_bonus and epo_bind, 1 seed, 2 small iterations, 4 eval episodes")
    p.add_argument("overrides", nargs="*", help="extra overrides for every run")
    a = p.parse_args(argv)
    if a.quick:
        a.arms, a.seeds, a.steps, a.episodes = "grpo_bonus,epo_bind", a.seeds.split(",")[0], 2, 4
        a.overrides = ["algo.tasks_per_step=2", "algo.group_size=2", "env.max_turns=4", *a.overrides]
    check_arms(p, a.arms, ARMS)
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    start = time.perf_counter()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_start_run(a.warm_start, out)
    arms = a.arms.split(",")

    runs = [r for rs in run_jobs(arms, lambda key: run_arm(key, a, out, warm), a.jobs) for r in rs]
    if not runs:
        raise SystemExit(f"no finished run under {out / 'sweeps'}; see the sweeps' summary.md and train.log files")
    # the warm start plays the same tasks under the same turn limit as the trained policies
    extra = eval_overrides(a, runs[0]["max_turns"])
    base = {"t1": eval_rate(warm, out / "eval" / "warm_start", a.episodes, False, extra)}
    if a.greedy:
        base["greedy"] = eval_rate(warm, out / "eval" / "warm_start", a.episodes, True, extra)

    plot(runs, arms, out / "entropy_curves.png")
    wall = time.perf_counter() - start
    md = table(runs, arms, base)
    settings = (f"`experiment=entropy_stress` from `{warm}`, {a.steps} iterations, seeds {a.seeds}, overrides "
                f"{a.overrides or 'none'}; eval: {a.episodes} eval_in_distribution tasks drawn with seed "
                f"{a.eval_seed}, the same for every policy. Wall time of this invocation: {wall / 60:.1f} min.")
    (out / "results.md").write_text(f"{settings}\n\n{md}\n\n![entropy curves](entropy_curves.png)\n")
    (out / "results.json").write_text(json.dumps({"warm_start": base, "runs": runs, "wall_s": wall,
                                                  "settings": settings}, indent=1))
    print(md)
    print(f"\nwritten: {out / 'results.md'}, {out / 'entropy_curves.png'} ({wall / 60:.1f} min)")


if __name__ == "__main__":
    main()
