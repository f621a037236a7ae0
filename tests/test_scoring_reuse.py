"""No redundant scoring forward: the update's first mini-batch scores its own samples.

Two trainers built from the same config (same initial weights, same rollout: sampling seeds depend only on
(seed, step, row)) run one RL iteration, one with algo.reuse_scoring_forward and one without; every metric
and every optimizer step's gradient must agree (fp32, 1e-6), and where the update is a single mini-batch the
ratio is exactly 1 (approx_kl == 0, clipfrac == 0).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

ARGS = ["algo=epo_ppo", "env.level=tiny_open_pick_place", "env.prompt_template=compact", "env.max_turns=6",
        "algo.tasks_per_step=2", "algo.group_size=2", "algo.micro_batch_size=4", "env.eval_splits=[]",
        "logger.console=false", "logger.tensorboard=false", "trainer.total_steps=4"]


def _iteration(tmp_path: Path, name: str, overrides: list[str]) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One rl_step of a fresh trainer: (metrics, flattened policy gradient at each optimizer step)."""
    from epo_cli.compose import compose
    from epo_cli.training.trainer import Trainer

    cfg = compose([*ARGS, *overrides])
    cfg.run_dir = str(tmp_path / name)
    Path(cfg.run_dir).mkdir()
    trainer = Trainer(cfg, Path(cfg.run_dir))
    grads: list[torch.Tensor] = []
    engine_step = trainer.engine.step

    def step(*args, **kwargs):
        grads.append(torch.cat([p.grad.detach().flatten().clone() for p in trainer.engine.module.parameters()
                                if p.grad is not None]))
        return engine_step(*args, **kwargs)

    trainer.engine.step = step
    try:
        metrics = trainer.rl_step(0, cfg.trainer.total_steps)
    finally:
        trainer.pool.close()
        trainer.logger.close()
    return metrics, grads


@pytest.mark.parametrize("mini_batch,epochs", [(8, 2), (512, 1)])
def test_reused_scoring_equals_separate_pass(epo_cache: Path, tmp_path: Path, in_process_world: None,
                                             mini_batch: int, epochs: int) -> None:
    common = [f"algo.mini_batch_size={mini_batch}", f"algo.ppo_epochs={epochs}"]
    fused, fused_grads = _iteration(tmp_path, "reuse", [*common, "algo.reuse_scoring_forward=true"])
    plain, plain_grads = _iteration(tmp_path, "separate", [*common, "algo.reuse_scoring_forward=false"])

    samples = fused["rollout/samples"]
    assert samples > mini_batch or mini_batch == 512
    expected_share = 1.0 if mini_batch >= samples else mini_batch / samples
    assert fused["perf/scoring_reused"] == pytest.approx(expected_share)
    assert plain["perf/scoring_reused"] == 0.0
    assert fused["loss/policy_clip"] != 0.0 and fused_grads and float(fused_grads[0].abs().max()) > 0

    keys = {k for k in plain if not k.startswith("perf/")}
    assert keys == {k for k in fused if not k.startswith("perf/")}
    bad = [f"{k}: {fused[k]!r} vs {plain[k]!r}" for k in sorted(keys)
           if not (math.isclose(fused[k], plain[k], rel_tol=1e-6, abs_tol=1e-6)
                   or (math.isnan(fused[k]) and math.isnan(plain[k])))]
    assert not bad, "reused scoring changed metrics:\n  " + "\n  ".join(bad)
    assert len(fused_grads) == len(plain_grads) == fused["perf/optimizer_steps"]
    for i, (a, b) in enumerate(zip(fused_grads, plain_grads)):
        diff = float((a - b).abs().max())
        assert diff <= 1e-6 * max(1.0, float(b.abs().max())), f"optimizer step {i}: gradients differ by {diff}"

    if mini_batch >= samples:  # one mini-batch, scored by its own forward: the ratio is exactly 1
        assert fused["policy/approx_kl"] == 0.0 and fused["policy/clipfrac"] == 0.0

