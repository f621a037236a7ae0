"""Warm start benchmark: household env speed, SFT throughput and wall time, greedy success per level.

    python scripts/bench/bench_sft.py [--out DIR] [--episodes 32] [--skip-train RUN_DIR] [OVERRIDES...]

1. household env steps/s (expert and random admissible actions, one process)
2. `epo train experiment=warm_start` (behaviour cloning of the tiny model on the easiest level):
   wall time of the whole command, and perf/tokens_per_s of its SFT steps (mean over steps)
3. `epo eval ... greedy=true` of the warm start on every household level, next to a random-admissible
   policy on the same tasks (the baseline SFT must beat)
Target: at least 50% greedy success on the easiest level within 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def household_steps_per_second(seconds: float = 3.0) -> float:
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite

    suite = make_suite(compose([]).env)
    env, rng, steps = suite.make_env(), random.Random(0), 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        task = suite.sample_tasks("train", 1, rng, level=rng.choice(suite.levels()))[0]
        obs, info = env.reset(task)
        for _ in range(40):
            action = info["expert_action"] if rng.random() < 0.7 else rng.choice(info["admissible_commands"])
            result = env.step(action or "look")
            info, steps = result.info, steps + 1
            if result.done:
                break
    return steps / (time.perf_counter() - start)


def epo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"epo {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def eval_success(run: Path, level: str, policy: str, episodes: int, out: Path) -> float:
    target = out / f"eval-{policy}-{level}"
    epo("eval", f"run={run}", f"env.level={level}", "greedy=true", f"episodes={episodes}", f"policy={policy}",
        "split=eval_in_distribution", f"out={target}", cwd=out)
    result = json.loads(next(target.glob("*.json")).read_text())
    return result["success"]["rate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/bench_sft")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--skip-train", help="evaluate this existing warm-start run instead of training")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    from rich.console import Console
    from rich.table import Table

    from epo_cli.envs.household import LEVELS
    from epo_cli.loggers.jsonl import read_metrics

    steps_per_s = household_steps_per_second()
    if args.skip_train:
        run, wall = Path(args.skip_train).resolve(), float("nan")
    else:
        start = time.perf_counter()
        epo("train", "experiment=warm_start", f"output_dir={out}", "logger.tensorboard=false", *args.overrides,
            cwd=out)
        wall = time.perf_counter() - start
        run = max((p for p in out.glob("*/*") if (p / "config.yaml").exists()), key=lambda p: p.stat().st_mtime)
    rows = read_metrics(run)
    tokens = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r]

    table = Table(title="warm start (experiment=warm_start)")
    table.add_column("level")
    table.add_column("greedy success (SFT)", justify="right")
    table.add_column("random admissible", justify="right")
    for level in [lvl.name for lvl in LEVELS]:
        sft = eval_success(run, level, "model", args.episodes, out)
        rnd = eval_success(run, level, "random", args.episodes, out)
        table.add_row(level, f"{sft:.3f}", f"{rnd:.3f}")
    console = Console()
    console.print(table)
    console.print(f"household env: {steps_per_s:,.0f} steps/s (one process, 70% expert / 30% random actions)")
    console.print(f"warm start wall time (whole `epo train experiment=warm_start`): {wall:.0f} s")
    if tokens:
        console.print(f"SFT step throughput: {sum(tokens) / len(tokens):,.0f} tokens/s (mean over {len(tokens)} steps)")
    console.print(f"run: {run}")


if __name__ == "__main__":
    main()
