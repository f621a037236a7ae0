"""The rollout engine owns eval mode: after an update, rollouts and the scoring forward run without dropout.

The latent bug (issue 40): under ZeRO 0-2 the generating module is the DeepSpeed engine's own module, which
the update puts in train mode (`engine.train()`). Nothing put it back, so with `model.lora.dropout > 0` every
rollout and scoring forward after step 0 ran with dropout on: two scorings of the same batch differed, and a
rollout was no longer a function of (weights, prompt, seed). LoRA's B matrices start at zero, so step 0 hides
it; one update exposes it.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARGS = ["algo=grpo", "env.level=tiny_open_pick_place", "env.prompt_template=compact", "env.max_turns=3",
        "algo.tasks_per_step=1", "algo.group_size=2", "algo.micro_batch_size=4", "env.eval_splits=[]",
        "logger.console=false", "logger.tensorboard=false", "trainer.total_steps=3", "algo.lr=0.05",
        "model.lora.rank=4", "model.lora.dropout=0.5", "rollout.max_new_tokens=8"]

def test_rollouts_and_scoring_after_an_update_run_without_dropout(epo_cache: Path, tmp_path: Path,
                                                                   in_process_world: None) -> None:
    from epo_cli.compose import compose
    from epo_cli.training.trainer import Trainer

    cfg = compose(ARGS)
    cfg.run_dir = str(tmp_path / "run")
    Path(cfg.run_dir).mkdir()
    trainer = Trainer(cfg, Path(cfg.run_dir))
    try:
        trainer.rl_step(0, cfg.trainer.total_steps)  # one update (it leaves the engine in train mode)
        # the tiny policy's group all fails, so the update's gradient is zero: move LoRA's B off zero by
        # hand, so that dropout (if on) changes the outputs
        lora_b = [p for n, p in trainer.models.engine.module.named_parameters() if "lora_B" in n]
        assert lora_b
        with torch.no_grad():
            for p in lora_b:
                p.add_(0.5)

        rollout = trainer.sample(1, cfg.trainer.total_steps)
        first = trainer.score(rollout.batch, 1)
        second = trainer.score(rollout.batch, 1)
        for a, b in zip(first.old_logprobs, second.old_logprobs):
            assert torch.equal(a, b)  # dropout on: two scorings of the same batch differ
        again = trainer.sample(1, cfg.trainer.total_steps)
        assert again.batch.response_ids == rollout.batch.response_ids  # a rollout is a function of its seeds
        assert not trainer.models.policy.module.training
    finally:
        trainer.pool.close()
        trainer.logger.close()
