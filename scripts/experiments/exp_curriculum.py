"""Experiment: does a staged curriculum with subgoal rewards help GRPO on a household level the warm start
does not master?

Two arms, the same GRPO settings and seeds, both starting from the same behaviour-cloned warm start:
    baseline   grpo on the target level, sparse task reward (curriculum=none)
    curriculum grpo with curriculum=staged over the household levels up to the target (easiest first),
               plus curriculum.subgoal_rewards=true (decaying to 0 at 80% of training)
Both are evaluated on the target level (env.level = target, eval_in_distribution, eval temperature), so the
evaluation curves are comparable; training success on the target level is read from
curriculum/level_success/<target>.

Every run is a real `epo train` subprocess (its own run directory under OUT/runs/); the script reads the
runs' metrics.jsonl and writes OUT/results.md (table + per-iteration curves) and OUT/curves.png. Runs that
already finished are not repeated and an unfinished one is started over, so an interrupted experiment
continues where it stopped (exp_common's study driver runs the jobs, seed-major, --jobs at a time; this
study keeps its own flat run folders, OUT/runs/<arm>-s<seed>/, with their logs in OUT/logs/).

    python scripts/experiments/exp_curriculum.py --out outputs/exp_curriculum                 # full: 3 seeds
    python scripts/experiments/exp_curriculum.py --quick --out /tmp/exp_curriculum_quick      # smoke test, ~3 min

Cost on a 2-core CPU: ~35 s per iteration at the defaults while episodes fail (4 tasks x 8 rollouts x 20
turns), ~15 s per evaluation: ~25 min per run, ~2.5 h for 2 arms x 3 seeds (--jobs 2: ~1.8 h).

Without --warm-start the script first trains the warm start through the CLI (same settings as the test
suite's fixture: behaviour cloning on tiny_open_pick_place, compact prompts), once, under OUT/warm_start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from exp_common import is_finished, run_jobs, seed_cell, seed_major, train_logged

HOUSEHOLD_LEVELS = ["tiny_open_pick_place", "small_pick_and_light", "medium_with_transforms",
                    "large_all_tasks", "alfworld_size_all_tasks"]
#: the shipped warm start (as `make demo` and the test suite's fixture train it)
WARM_START_ARGS = ["experiment=warm_start", "logger.tensorboard=false"]
EVAL_KEY = "eval/eval_in_distribution/success"
ARMS = ("baseline", "curriculum")


@dataclass
class RunResult:
    arm: str
    seed: int
    run: Path
    wall_s: float
    steps: list[int]
    train_success: list[float | None]  # target-level training success per iteration (None: not played)
    level: list[float]  # curriculum/level per iteration (0 for the baseline)
    eval_steps: list[int]
    eval_success: list[float]


# ----------------------------------------------------------------------------------------------------
# running the CLI
# ----------------------------------------------------------------------------------------------------


def cli_env() -> dict[str, str]:
    env = os.environ.copy()
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline", "DS_ACCELERATOR": "cpu",
                # seeds do not depend on the str hash salt (epo_cli.seeding.derive_seed); fixing it also fixes
                # the iteration order of sets of strings, so runs repeat exactly whatever iterates one
                "PYTHONHASHSEED": "0"})
    return env


def train_into(run: Path, args: list[str], log: Path, label: str) -> float:
    """`epo train ARGS run_dir=RUN` (exp_common.train_logged, console in LOG, this script's environment);
    returns its wall time. This study names its run directories itself (OUT/runs/<arm>-s<seed>, not
    exp_common.run_folder's layout), so an unfinished one of an interrupted invocation is deleted here first
    (`epo train` refuses a run_dir that holds a run)."""
    if run.exists():
        shutil.rmtree(run)
    run.parent.mkdir(parents=True, exist_ok=True)
    return train_logged([*args, f"run_dir={run}"], log, label, env=cli_env())


def ensure_warm_start(given: str | None, out: Path, quick: bool) -> Path:
    """The warm start's exported model folder (<run>/final)."""
    if given:
        path = Path(given).expanduser().resolve()
        path = path / "final" if (path / "final").is_dir() else path
        if not (path / "config.json").exists():
            raise SystemExit(f"--warm-start {given}: no model there (expected <run>/final with config.json)")
        return path
    run = out / "warm_start"
    if not is_finished(run):
        args = list(WARM_START_ARGS)
        if quick:  # a weaker but quick warm start, enough to smoke-test the pipeline
            args += ["trainer.total_steps=30", "algo.demo_episodes=40"]
        train_into(run, [*args, "name=warm_start"], out / "logs" / "warm_start.log", "warm start")
    return run / "final"


def arm_args(arm: str, a: argparse.Namespace, warm: Path, seed: int) -> list[str]:
    common = [
        "algo=grpo", f"model.path={warm}", "env.prompt_template=compact", f"env.level={a.level}", f"algo.lr={a.lr}",
        f"env.max_turns={a.max_turns}", "env.eval_splits=[eval_in_distribution]",
        f"algo.tasks_per_step={a.tasks_per_step}", f"algo.group_size={a.group_size}",
        f"trainer.total_steps={a.steps}", f"trainer.eval_every={a.eval_every}",
        f"trainer.eval_episodes={a.eval_episodes}", "trainer.save_every=0", "trainer.best_metric=null",
        "logger.tensorboard=false", f"seed={seed}", f"name={arm}-s{seed}",
    ]
    if arm == "baseline":
        return [*common, "curriculum=none"]
    levels = HOUSEHOLD_LEVELS[:HOUSEHOLD_LEVELS.index(a.level) + 1]
    return [*common, "curriculum=staged", f"curriculum.levels=[{','.join(levels)}]",
            f"curriculum.promote_at={a.promote_at}", f"curriculum.window={a.window}",
            f"curriculum.replay_share={a.replay_share}", "curriculum.subgoal_rewards=true",
            f"curriculum.subgoal_coef={a.subgoal_coef}"]


# ----------------------------------------------------------------------------------------------------
# reading and summarising
# ----------------------------------------------------------------------------------------------------


def read_run(arm: str, seed: int, run: Path, level: str, wall_s: float) -> RunResult:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "rollout/success" in r]  # RL iterations (skip any summary lines)
    key = f"curriculum/level_success/{level}"
    ev = [(int(r["step"]), float(r[EVAL_KEY])) for r in rows if EVAL_KEY in r]
    return RunResult(arm, seed, run, wall_s, [int(r["step"]) for r in rows],
                     [float(r[key]) if key in r else None for r in rows],
                     [float(r.get("curriculum/level", 0.0)) for r in rows],
                     [s for s, _ in ev], [v for _, v in ev])


def first_reach(steps: list[int], values: list[float | None], threshold: float) -> int | None:
    """First iteration whose value reaches the threshold (None: never)."""
    return next((s for s, v in zip(steps, values) if v is not None and v >= threshold), None)


def smoothed(values: list[float | None], k: int) -> list[float | None]:
    """Mean of the last k observed values at each iteration (None until one is observed)."""
    out: list[float | None] = []
    seen: list[float] = []
    for v in values:
        if v is not None:
            seen.append(v)
        out.append(statistics.fmean(seen[-k:]) if seen else None)
    return out


def summary_rows(results: list[RunResult], threshold: float, smooth: int, steps: int) -> list[list[str]]:
    rows = []
    for arm in ARMS:
        rs = [r for r in results if r.arm == arm]
        if not rs:
            continue
        final_eval = [r.eval_success[-1] for r in rs if r.eval_success]
        best_eval = [max(r.eval_success) for r in rs if r.eval_success]
        reach_eval = [first_reach(r.eval_steps, list(r.eval_success), threshold) for r in rs]
        reach_train = [first_reach(r.steps, smoothed(r.train_success, smooth), threshold) for r in rs]

        def reach(xs: list[int | None]) -> str:
            hit = [x for x in xs if x is not None]
            mean = f"{statistics.fmean(hit):.1f}" if hit else f">{steps}"
            return f"{mean} ({len(hit)}/{len(xs)} seeds)"

        rows.append([arm, str(len(rs)), seed_cell(final_eval), seed_cell(best_eval), reach(reach_eval),
                     reach(reach_train), f"{max(max(r.level) for r in rs):.0f}",
                     f"{statistics.fmean(r.wall_s for r in rs) / 60:.1f}"])
    return rows


HEADER = ["arm", "seeds", "final eval success", "best eval success", "iters to eval >= thr",
          "iters to train >= thr (smoothed)", "max level", "min/run"]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    return "\n".join(lines + [fmt.format(*r) for r in rows])


def curve_table(results: list[RunResult]) -> str:
    """Per-iteration mean over seeds: eval success and (smoothed-free) target-level training success."""
    steps = sorted({s for r in results for s in r.steps})
    header = ["iter"] + [f"{arm} {what}" for arm in ARMS for what in ("eval", "train@target", "level")]
    rows = []
    for s in steps:
        row = [str(s)]
        for arm in ARMS:
            rs = [r for r in results if r.arm == arm]
            ev = [r.eval_success[r.eval_steps.index(s)] for r in rs if s in r.eval_steps]
            tr = [r.train_success[r.steps.index(s)] for r in rs if s in r.steps]
            lv = [r.level[r.steps.index(s)] for r in rs if s in r.steps]
            tr_seen = [v for v in tr if v is not None]
            row += [f"{statistics.fmean(ev):.3f}" if ev else "",
                    f"{statistics.fmean(tr_seen):.3f}" if tr_seen else "",
                    f"{statistics.fmean(lv):.2f}" if lv else ""]
        rows.append(row)
    return markdown_table(header, rows)


def plot(results: list[RunResult], path: Path, level: str, threshold: float, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {"baseline": "tab:gray", "curriculum": "tab:blue"}
    for arm in ARMS:
        rs = [r for r in results if r.arm == arm]
        if not rs:
            continue
        for i, r in enumerate(rs):
            label = arm if i == 0 else None
            axes[0].plot(r.eval_steps, r.eval_success, "o-", color=colors[arm], alpha=0.35, lw=1)
            tr = smoothed(r.train_success, smooth)
            axes[1].plot(r.steps, [math.nan if v is None else v for v in tr], color=colors[arm], alpha=0.35,
                         lw=1)
            axes[2].step(r.steps, r.level, where="post", color=colors[arm], alpha=0.6, label=label)
        eval_steps = sorted({s for r in rs for s in r.eval_steps})
        means = [statistics.fmean([r.eval_success[r.eval_steps.index(s)] for r in rs if s in r.eval_steps])
                 for s in eval_steps]
        axes[0].plot(eval_steps, means, "o-", color=colors[arm], lw=2.5, label=f"{arm} (mean of {len(rs)})")
    axes[0].axhline(threshold, ls="--", color="k", lw=0.8)
    axes[1].axhline(threshold, ls="--", color="k", lw=0.8)
    axes[0].set(title=f"eval success on {level}", xlabel="iteration", ylabel="success", ylim=(-0.02, 1.02))
    axes[1].set(title=f"training success on {level} (mean of last {smooth} iters)", xlabel="iteration",
                ylim=(-0.02, 1.02))
    axes[2].set(title="curriculum level index (after each iteration's decision)", xlabel="iteration",
                ylabel="level")
    axes[0].legend()
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/exp_curriculum"))
    p.add_argument("--warm-start", help="warm start run directory or its final/ folder (default: train one)")
    p.add_argument("--level", default="small_pick_and_light", choices=HOUSEHOLD_LEVELS[1:],
                   help="target household level (the warm start was trained on tiny_open_pick_place)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40, help="GRPO iterations per run")
    p.add_argument("--lr", type=float, default=5e-4, help="GRPO learning rate (experiment=epo_household's)")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-episodes", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.3, help="success threshold for 'iterations to reach'")
    p.add_argument("--smooth", type=int, default=3, help="iterations averaged for the training-success curve")
    p.add_argument("--promote-at", type=float, default=0.5)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--replay-share", type=float, default=0.2)
    p.add_argument("--subgoal-coef", type=float, default=1.0)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    # two CPU-bound runs give ~1.4x the throughput of one on a 2-core machine
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 seed, 3 tiny iterations, promote after every iteration")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.steps, a.tasks_per_step, a.group_size, a.max_turns = a.seeds[:1], 3, 2, 2, 8
        a.eval_every, a.eval_episodes, a.promote_at, a.window = 3, 4, 0.0, 1
    return a


def run_one(arm: str, seed: int, a: argparse.Namespace, out: Path, warm: Path) -> float:
    """Train one (arm, seed) unless it already finished; returns its wall time in seconds."""
    run = out / "runs" / f"{arm}-s{seed}"
    timing = run / "wall_s.txt"
    if is_finished(run) and timing.exists():
        return float(timing.read_text())
    wall = train_into(run, arm_args(arm, a, warm, seed), out / "logs" / f"{arm}-s{seed}.log", f"{arm} seed {seed}")
    timing.write_text(f"{wall:.1f}")
    return wall


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    out = a.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    warm = ensure_warm_start(a.warm_start, out, a.quick)
    jobs = seed_major(a.arms, a.seeds)
    walls = dict(zip(jobs, run_jobs(jobs, lambda job: run_one(*job, a, out, warm), a.jobs)))
    results = [read_run(arm, seed, out / "runs" / f"{arm}-s{seed}", a.level, walls[(arm, seed)])
               for arm, seed in jobs]

    rows = summary_rows(results, a.threshold, a.smooth, a.steps)
    print()
    print(plain_table(HEADER, rows))
    plot(results, out / "curves.png", a.level, a.threshold, a.smooth)
    levels = HOUSEHOLD_LEVELS[:HOUSEHOLD_LEVELS.index(a.level) + 1]
    settings = (f"target level `{a.level}`, {a.steps} GRPO iterations x {a.tasks_per_step} tasks x group "
                f"{a.group_size}, max_turns {a.max_turns}, eval every {a.eval_every} iterations on "
                f"{a.eval_episodes} eval_in_distribution episodes, seeds {a.seeds}; curriculum arm: staged "
                f"over {levels}, promote_at {a.promote_at}, window {a.window}, replay_share "
                f"{a.replay_share}, subgoal_coef {a.subgoal_coef} (decays to 0 at 80%); "
                f"warm start `{warm}`; threshold {a.threshold}")
    md = "\n\n".join([
        "# Staged curriculum + subgoal rewards vs. plain GRPO (household)",
        settings + ".",
        markdown_table(HEADER, rows),
        "Iterations to threshold: mean over the seeds that reached it (how many did in brackets); the "
        "training variant uses target-level training success averaged over the last "
        f"{a.smooth} iterations in which the target level was played.",
        "![curves](curves.png)",
        "## Per-iteration means over seeds",
        curve_table(results),
    ])
    (out / "results.md").write_text(md + "\n")
    print(f"\nwrote {out / 'results.md'} and {out / 'curves.png'}")


if __name__ == "__main__":
    main()
