"""What the collapse diagnostics cost: whole RL iterations on household with algo.diagnostics off, at their
defaults, and with MI every iteration, in one process.

    python scripts/bench/bench_diagnostics.py [--model PATH] [--iterations 4] [--quick] [--json F] [OVERRIDES...]

Three Trainers with the same seed (so the same tasks) run `Trainer.rl_step` interleaved per iteration (the
order alternates), so drift in the machine's load hits all alike:

    off       algo.diagnostics.enabled=false
    defaults  the defaults: the per-iteration collapse/* signals and the alert, no MI
    mi        the defaults + algo.diagnostics.mi_every=1 (MI on algo.diagnostics.mi_samples turn-samples)

Printed per variant: mean iteration seconds, the diagnostics' own seconds as the iteration times them
(perf/diagnostics_s, and perf/mi_s for the MI part), their share of the iteration, and the iteration time
against `off`. The self-timed share is the figure to read on a shared machine: the three variants' whole
iterations differ by more than the diagnostics cost whenever the machine's load moves.

Defaults: experiment=epo_household (GRPO + EPO, 4 tasks x 8 rollouts, 15 turns) with the tiny model, from
--model (a warm start's final/, as the experiments use) or random weights; --quick shrinks it for a test.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common import interleaved_iterations, scratch_trainer

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

VARIANTS = {
    "off": ["algo.diagnostics.enabled=false"],
    "defaults": [],
    "mi": ["algo.diagnostics.mi_every=1"],
}
KEYS = ("iteration_s", "perf/diagnostics_s", "perf/mi_s", "perf/rollout_s", "perf/update_s")


def overrides(args: argparse.Namespace) -> list[str]:
    out = ["experiment=epo_household", "env.eval_splits=[]", "logger.console=false", "logger.tensorboard=false",
           "logger.jsonl=false", "trainer.total_steps=100", "trainer.save_every=0"]
    if args.model:
        out.append(f"model.path={args.model}")
    if args.quick:
        out += ["algo.tasks_per_step=2", "algo.group_size=2", "env.max_turns=3", "rollout.max_new_tokens=16",
                "algo.diagnostics.mi_samples=4", "env.level=tiny_open_pick_place", "env.prompt_template=compact"]
    return out


def print_iteration(it: int, name: str, metrics: dict[str, float]) -> None:
    print(f"  iteration {it} {name}: {metrics['iteration_s']:.2f}s, diagnostics "
          f"{metrics.get('perf/diagnostics_s', 0.0):.3f}s (MI {metrics.get('perf/mi_s', 0.0):.3f}s), "
          f"{int(metrics['rollout/samples'])} samples", flush=True)


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from epo_cli.compose import compose

    trainers = {}
    for name, extra in VARIANTS.items():
        cfg = compose([*overrides(args), *extra, *args.overrides])
        trainers[name] = scratch_trainer(cfg, f"bench_diagnostics_{name}_")
    try:
        return interleaved_iterations(trainers, args.iterations, KEYS, print_iteration)
    finally:
        for trainer in trainers.values():
            trainer.pool.close()


def report(sums: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = sums["off"]["iteration_s"]
    # diag: perf/diagnostics_s; MI: its perf/mi_s part; share: diag / iteration; defaults' share: (diag - MI) /
    # (iteration - MI), the per-iteration signals against an iteration without MI
    table = Table(title="bench_diagnostics (means per iteration)")
    for column in ("variant", "iteration s", "diag s", "MI s", "share", "defaults' share", "vs off"):
        table.add_column(column, justify="right")
    for name, m in sums.items():
        it, diag, mi = m["iteration_s"], m["perf/diagnostics_s"], m["perf/mi_s"]
        table.add_row(name, f"{it:.2f}", f"{diag:.3f}", f"{mi:.3f}", f"{diag / it:.2%}",
                      f"{(diag - mi) / max(it - mi, 1e-9):.2%}", f"{it / base:.3f}x")
    Console(width=120).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a policy folder (e.g. <warm start run>/final)")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a test")
    parser.add_argument("--json", default=None, help="write the means here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every variant")
    args = parser.parse_args()
    sums = run(args)
    report(sums)
    if args.json:
        Path(args.json).write_text(json.dumps(sums, indent=2))


if __name__ == "__main__":
    main()
