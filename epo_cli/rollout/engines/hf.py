"""rollout.engine=hf: today's generator (rollout/generation.py) on the policy's own module.

It generates with the very module the trainer scores with (ZeRO 0-2: the DeepSpeed engine's module; ZeRO-3:
the full copy RolloutModule gathers after each update), so its weights are the trainer's by construction and
its log-probs differ from the scoring forward's only by the KV-cache arithmetic.

It owns that module's mode: the update puts the engine's module in train mode, and `sync_weights` (the
trainer's step after the update) and every `generate` put it back in eval mode, so rollouts and the scoring
forward that reads the same module never run with dropout.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from epo_cli.rollout.engines.base import EngineContext, Generation, RolloutEngine
from epo_cli.rollout.generation import COMPACT_BELOW, SamplingConfig, generate
from epo_cli.runtime.precision import autocast


class HFEngine(RolloutEngine):
    promises = ("row i's tokens are a function of (the weights, its prompt, seeds[i]) alone: the same on 1 or "
                "N ranks, in any batch, and after a resume (counter-based noise per row, rollout/generation.py)")

    def __init__(self, context: EngineContext) -> None:
        self.policy: Any = context.policy  # RolloutModule
        self.tokenizer = context.tokenizer
        self.vocab_limit: int | None = context.vocab_limit
        self.shared_prefill: bool = context.rollout.shared_prefill
        self.compact_below = COMPACT_BELOW
        self.autocast_to = context.autocast_to  # model.autocast: the scoring forward's precision too
        self.device = context.device

    @property
    def module(self) -> nn.Module:
        """The module that generates (and that the trainer scores with)."""
        return self.policy.module

    def generate(self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int] | None,
                 logprobs: bool = False) -> Generation:
        module = self.module
        if module.training:  # the update left it in train mode (dropout): a rollout samples in eval mode
            module.eval()
        values: list[list[float]] | None = [] if logprobs else None
        with autocast(self.autocast_to, self.device):
            tokens = generate(module, prompts, params, self.tokenizer, seeds=seeds, vocab_limit=self.vocab_limit,
                              shared_prefill=self.shared_prefill, logprobs=values, compact_below=self.compact_below)
        return Generation(tokens, values if values is not None else [[] for _ in tokens])

    def sync_weights(self) -> None:
        self.policy.refresh()  # ZeRO-3: gather the partitions into the copy (collective); else nothing to copy
        self.module.eval()  # the scoring forward reads this module too
