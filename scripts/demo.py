"""`make demo`: the main job on the embedded environment, through the real CLI, in about 10 minutes.

    python scripts/demo.py [--out outputs/demo]

1. warm start   epo train experiment=warm_start                       (behaviour cloning, tiny model)
2. EPO          epo train experiment=epo_household model.path=<1>/final
3. evaluation   epo eval run=<1> ... and epo eval run=<2> ...  on the same fixed tasks
4. report       epo report <2>                                        (entropy with its EPO band, success, ...)
and a summary table with where the plots and metrics are. Each command is printed before it runs, so
the demo doubles as a tour of the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(highlight=False)


os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def epo(*args: str, cwd: Path) -> None:
    console.print(f"\n[bold cyan]$ epo {' '.join(args)}[/]", soft_wrap=True)
    proc = subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=cwd)
    if proc.returncode != 0:
        sys.exit(proc.returncode)


def newest_run(root: Path) -> Path:
    return max((p for p in root.glob("*/*") if (p / "config.yaml").exists()), key=lambda p: p.stat().st_mtime)


def evaluate(run: Path, out: Path, episodes: int, cwd: Path) -> dict:
    epo("eval", f"run={run}", f"episodes={episodes}", "temperature=1.0", f"out={out}", cwd=cwd)
    return json.loads(next(out.glob("*.json")).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo")
    parser.add_argument("--episodes", type=int, default=64, help="evaluation episodes per policy")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    epo("train", "experiment=warm_start", f"output_dir={out / 'warm_start'}", cwd=out)
    warm = newest_run(out / "warm_start")
    epo("train", "experiment=epo_household", f"model.path={warm / 'final'}", f"output_dir={out / 'epo'}", cwd=out)
    run = newest_run(out / "epo")
    # the same fixed tasks for both policies, sampled at the training temperature
    before = evaluate(warm, out / "eval" / "warm_start", args.episodes, out)
    after = evaluate(run, out / "eval" / "epo", args.episodes, out)
    epo("report", str(run), cwd=out)

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    table = Table(title="epo demo: household (tiny_open_pick_place), tiny model")
    table.add_column("")
    table.add_column("warm start (SFT)", justify="right")
    table.add_column("after EPO", justify="right")

    def rate(result: dict) -> str:
        lo, hi = result["success"]["ci95"]
        return f"{result['success']['rate']:.3f} [{lo:.2f}, {hi:.2f}]"

    table.add_row(f"eval success, {args.episodes} fixed tasks, T=1.0 (95% CI)", rate(before), rate(after))
    table.add_row("mean episode length", f"{before['episode_len']['mean']:.1f}", f"{after['episode_len']['mean']:.1f}")
    table.add_row("train rollout success (first / last iteration)", f"{rows[0]['rollout/success']:.3f}",
                  f"{rows[-1]['rollout/success']:.3f}")
    table.add_row("policy entropy (first / last iteration)", f"{rows[0]['policy/entropy']:.3f}",
                  f"{rows[-1]['policy/entropy']:.3f}")
    console.print(table)
    console.print(f"warm start run: {warm}\nEPO run:        {run}")
    console.print(f"metrics:        {run / 'metrics.jsonl'} (tensorboard --logdir {out})")
    console.print(f"plots:          {run / 'plots' / 'index.md'}")
    console.print(f"samples:        {run / 'samples'}")
    console.print(f"total time:     {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
