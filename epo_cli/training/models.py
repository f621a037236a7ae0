"""The models of a run, built once: tokenizer, policy (DeepSpeed engine + the copy that generates), the
frozen reference (a `kl` loss term) and the critic (estimator gae).

The update part (training/update.py) trains `engine` and `critic_engine`; the group sampler, evaluation
and the scoring forward use `policy.module` (the engine's module, or under ZeRO-3 a full copy gathered
after each update: engine.RolloutModule), which `refresh()` brings up to date.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

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
from epo_cli.rollout.episodes import ModelPolicy
from epo_cli.training.engine import DistInfo, RolloutModule, build_engine, inference_copy
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

    def refresh(self) -> None:
        """The generating copies of the policy (and critic) take the updated weights (collective, ZeRO-3)."""
        self.policy.refresh()
        if self.critic is not None:
            self.critic.refresh()

    def sampling_policy(self, rollout: Any, temperature: float | None = None) -> ModelPolicy:
        """The policy that plays episodes: `policy.module` sampling with the rollout.* settings, at `temperature`
        (default: rollout.temperature, the training rollouts')."""
        temperature = rollout.temperature if temperature is None else temperature
        return ModelPolicy.from_rollout(self.policy.module, self.tokenizer, rollout, temperature, self.vocab_limit)


def build_models(cfg: Any, dist: DistInfo, suite: EnvSuite) -> Models:
    """Load (or, for model=tiny, build) the policy and wrap it and its companions in DeepSpeed engines."""
    algo = cfg.algo
    source = model_source(cfg.model, suite, cfg.seed)
    tokenizer = load_tokenizer(source, cfg.model)
    dtype = resolve_dtype(cfg.model, dist.device)
    policy = load_causal_lm(source, cfg.model, dtype).to(dist.device)
    check_context(policy, cfg.rollout, source)  # a prompt and its response fit the model's positions
    # packed micro-batches for scoring and update (before the copies below, which inherit the attention)
    packing = enable_packing(policy, algo.pack_tokens)
    ref_model = frozen_copy(policy) if "kl" in algo.loss_terms else None
    policy = apply_lora(policy, cfg.model.lora)
    critic = ValueModel(frozen_copy(policy if cfg.model.lora.rank <= 0 else policy.get_base_model())) \
        if algo.estimator == "gae" else None
    if critic is not None:
        for p in critic.parameters():
            p.requires_grad_(True)
    template = inference_copy(policy, cfg.deepspeed.zero_stage)  # ZeRO-3: before DeepSpeed partitions
    engine = build_engine(policy, cfg, dist, lr=algo.lr, weight_decay=algo.weight_decay)
    models = Models(tokenizer, len(tokenizer), packing, engine,
                    RolloutModule(engine, template, cfg.deepspeed.zero_stage), ref_model)
    if critic is not None:
        critic_template = inference_copy(critic, cfg.deepspeed.zero_stage)
        models.critic_engine = build_engine(critic, cfg, dist, lr=algo.value.lr or algo.lr)
        models.critic = RolloutModule(models.critic_engine, critic_template, cfg.deepspeed.zero_stage)
        models.critic.refresh()  # ZeRO-3 copies take rank 0's weights, which DeepSpeed broadcast
    models.policy.refresh()
    return models
