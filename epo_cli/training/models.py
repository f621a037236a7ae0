"""The models of a run, built once: tokenizer, policy (DeepSpeed engine + the module that scores), the
rollout engine that generates (rollout.engine), the frozen reference (a `kl` loss term) and the critic
(estimator gae).

The update part (training/update.py) trains `engine` and `critic_engine`; the scoring forward uses
`policy.module` (the engine's module, or under ZeRO-3 a full copy gathered after each update:
engine.RolloutModule); the group sampler and evaluation sample through `rollout_engine`
(`sampling_policy`). `sync_weights()`, the trainer's step after each update, brings both up to date.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from epo_cli.config import ModelConfig, RolloutConfig
from epo_cli.envs.base import EnvSuite
from epo_cli.models.loading import (
    ValueModel,
    apply_lora,
    check_context,
    frozen_copy,
    load_causal_lm,
    load_tokenizer,
    model_source,
    resolve_dtype,
)
from epo_cli.rollout.engines import keeps_engine_logprobs
from epo_cli.rollout.engines.base import EngineContext, EnginePolicy, RolloutEngine, sampling_config
from epo_cli.rollout.engines.build import build_rollout_engine
from epo_cli.runtime.precision import autocast_dtype
from epo_cli.training.engine import DistInfo, EngineSettings, RolloutModule, build_engine, inference_copy
from epo_cli.training.packing import enable_packing


@dataclass
class Models:
    tokenizer: Any
    vocab_limit: int  # the tokenizer's size: logits beyond it (the model's padded vocabulary) are never sampled
    packing: bool  # packed micro-batches (algo.pack_tokens) for scoring and update
    engine: Any  # the policy's DeepSpeed engine
    policy: RolloutModule  # the policy that generates and scores
    ref_model: nn.Module | None  # frozen reference (only with a `kl` loss term)
    critic_engine: Any | None = None  # the critic's DeepSpeed engine (estimator gae only)
    critic: RolloutModule | None = None
    rollout_engine: RolloutEngine | None = None  # what generates the rollouts (rollout.engine)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # the rollout.* settings it samples with
    autocast_to: torch.dtype | None = None  # model.autocast: every forward's autocast dtype (None: the weights')

    def sync_weights(self) -> None:
        """After an update (or a resume): the rollout engine and the scoring copies take the trained weights
        (every rank calls it: ZeRO-3 gathers), and the scoring modules return to eval mode (the update left
        them in train mode: dropout)."""
        if self.rollout_engine is not None:
            self.rollout_engine.sync_weights()  # refreshes policy's copy first (the engines read it)
        else:
            self.policy.refresh()
        self.policy.module.eval()
        if self.critic is not None:
            self.critic.refresh()
            self.critic.module.eval()

    def refresh(self) -> None:
        """The old name of sync_weights (scripts and other callers)."""
        self.sync_weights()

    def sampling_policy(self, temperature: float | None = None) -> EnginePolicy:
        """The policy that plays episodes: the rollout engine sampling with the rollout.* settings at
        `temperature` (default: rollout.temperature, the training rollouts'; it then keeps the engine's
        log-probs for the mismatch metrics)."""
        rollout, training = self.rollout, temperature is None
        temperature = rollout.temperature if temperature is None else temperature
        return EnginePolicy(self.rollout_engine, self.tokenizer, sampling_config(rollout, temperature),
                            rollout.generation_batch_size, keep_logprobs=training and keeps_engine_logprobs(rollout))


@dataclass(frozen=True)
class ModelSettings:
    """What build_models reads, fixed for the run (training/settings.py cuts it from the run config)."""

    model: ModelConfig  # the model section as data: source (path or tiny), dtype, attention, LoRA (models/loading.py)
    # a prompt and its response must fit the model's positions (check_context)
    max_prompt_tokens: int  # rollout.max_prompt_tokens
    max_new_tokens: int  # rollout.max_new_tokens
    seed: int  # model=tiny builds its weights from it
    pack_tokens: int | None  # algo.pack_tokens: packed micro-batches (null: where the attention allows; 0: off)
    reference: bool  # a frozen reference copy (the `kl` loss term needs it)
    critic: bool  # a critic (estimator gae)
    lr: float  # the policy's optimizer (the lr schedule sets it per step)
    weight_decay: float  # the policy's (the critic's is 0)
    critic_lr: float  # algo.value.lr, else algo.lr
    engine: EngineSettings  # DeepSpeed (ZeRO stage, batch sizes, precision)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # rollout.engine and its sampling settings


def build_models(settings: ModelSettings, dist: DistInfo, suite: EnvSuite) -> Models:
    """Load (or, for model=tiny, build) the policy and wrap it and its companions in DeepSpeed engines."""
    model_cfg, stage = settings.model, settings.engine.zero_stage
    source = model_source(model_cfg, suite, settings.seed)
    tokenizer = load_tokenizer(source, model_cfg)
    dtype = resolve_dtype(model_cfg, dist.device)
    autocast_to = autocast_dtype(model_cfg, dtype, dist.device.type)
    policy = load_causal_lm(source, model_cfg, dtype).to(dist.device)
    check_context(policy, settings.max_prompt_tokens, settings.max_new_tokens, source)
    # packed micro-batches for scoring and update (before the copies below, which inherit the attention)
    packing = enable_packing(policy, settings.pack_tokens)
    ref_model = frozen_copy(policy) if settings.reference else None
    policy = apply_lora(policy, model_cfg.lora)
    critic = ValueModel(frozen_copy(policy if model_cfg.lora.rank <= 0 else policy.get_base_model())) \
        if settings.critic else None
    if critic is not None:
        for p in critic.parameters():
            p.requires_grad_(True)
    template = inference_copy(policy, stage)  # ZeRO-3: before DeepSpeed partitions
    engine = build_engine(policy, settings.engine, lr=settings.lr, weight_decay=settings.weight_decay)
    models = Models(tokenizer, len(tokenizer), packing, engine, RolloutModule(engine, template, stage), ref_model,
                    autocast_to=autocast_to)
    if critic is not None:
        critic_template = inference_copy(critic, stage)
        models.critic_engine = build_engine(critic, settings.engine, lr=settings.critic_lr)
        models.critic = RolloutModule(models.critic_engine, critic_template, stage)
    models.rollout, rollout = settings.rollout, settings.rollout
    models.rollout_engine = build_rollout_engine(rollout.engine, EngineContext(
        models.policy, tokenizer, models.vocab_limit, rollout, source, dtype, dist.device,
        settings.max_prompt_tokens + settings.max_new_tokens, settings.seed, model_cfg.lora.rank > 0, autocast_to))
    models.sync_weights()  # ZeRO-3 copies take rank 0's weights, which DeepSpeed broadcast
    return models

