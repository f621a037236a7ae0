"""What the benchmark scripts share: scratch folders that leave nothing behind, Trainers in them (whose public
RL steps the scripts run: Trainer.sample, score, advantages, coefficients, update), and whole RL iterations of
several Trainers, interleaved and timed.

A script imports it as `common` (`python scripts/bench/bench_x.py` puts scripts/bench first on sys.path).
Nothing here imports torch or epo_cli at import time: the scripts set OMP_NUM_THREADS and DS_ACCELERATOR
before those load.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def scratch_dir(prefix: str) -> Path:
    """A temporary folder removed when this script exits: a benchmark leaves nothing in the temp directory."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def scratch_trainer(cfg: Any, prefix: str, suite: Any = None) -> Any:
    """The Trainer `epo train` builds for the composed config `cfg` (and the env suite `suite`, if given), in a
    scratch run directory (`scratch_dir`)."""
    from epo_cli.training.trainer import Trainer

    run = scratch_dir(prefix)
    cfg.run_dir = str(run)
    return Trainer(cfg, run, suite)


def interleaved_iterations(trainers: dict[str, Any], iterations: int, keys: Iterable[str],
                           show: Callable[[int, str, dict[str, float]], None],
                           prepare: Callable[[int], None] | None = None) -> dict[str, dict[str, float]]:
    """`iterations` whole RL iterations of every Trainer, as the training loop runs them (learning rates, then
    Trainer.rl_step). The order alternates (forwards on even iterations, backwards on odd ones) so that drift in
    the machine's load hits all alike. `prepare(it)`, if given, runs before iteration `it` of any Trainer and
    `prepare(iterations)` after the last (untimed). After each iteration `show(it, name, metrics)`, where
    metrics["iteration_s"] is its wall time. Returns each Trainer's mean of `keys` (a key it did not report
    counts 0)."""
    keys = list(keys)
    names = list(trainers)
    means = {name: dict.fromkeys(keys, 0.0) for name in names}
    for it in range(iterations):
        if prepare is not None:
            prepare(it)
        for name in names if it % 2 == 0 else names[::-1]:
            trainer = trainers[name]
            total = trainer.cfg.trainer.total_steps
            t0 = time.perf_counter()
            trainer.set_learning_rates(it, total)
            metrics = trainer.rl_step(it, total)
            metrics["iteration_s"] = time.perf_counter() - t0
            for key in keys:
                means[name][key] += metrics.get(key, 0.0) / iterations
            show(it, name, metrics)
    if prepare is not None:
        prepare(iterations)
    return means


def start_from(reference: Any, others: Iterable[Any]) -> None:
    """Every Trainer in `others` takes `reference`'s policy (and critic) weights and optimizer state, so that
    their next iteration starts where the reference's does. Without it, Trainers whose updates round
    differently (packed vs padded sums, scoring reuse) drift apart by rounding, which Adam's step magnifies
    for near-zero gradients; one flipped sampled token then changes an episode, and the later iterations'
    episodes no longer test whether the rollout speed-ups play the same episodes."""
    import copy

    others = list(others)
    for part in ("engine", "critic_engine"):
        source = getattr(reference.models, part)
        if source is None:
            continue
        weights, optimizer = source.module.state_dict(), source.optimizer.state_dict()
        for trainer in others:
            engine = getattr(trainer.models, part)
            engine.module.load_state_dict(weights)
            # a copy each: load_state_dict keeps the given tensors, which the two optimizers would then share
            engine.optimizer.load_state_dict(copy.deepcopy(optimizer))
    for trainer in others:
        trainer.models.refresh()  # the generating copy takes the weights (ZeRO-3: gathered)


def flat_policy(trainer: Any) -> Any:
    """The policy's weights as one float64 vector (the update comparisons of the benchmarks)."""
    import torch

    return torch.cat([p.detach().flatten().double() for p in trainer.engine.module.parameters()])
