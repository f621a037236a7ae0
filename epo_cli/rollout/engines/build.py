"""Building the engine rollout.engine names: for the trainer (training/models.py) and `epo eval`."""

from __future__ import annotations

from typing import Any

import torch

from epo_cli.errors import UserError
from epo_cli.rollout.engines import ROLLOUT_ENGINES, register_plugin_engine
from epo_cli.rollout.engines.base import EngineContext, EnginePolicy, FixedWeights, RolloutEngine, sampling_config
from epo_cli.runtime.precision import autocast_dtype


def build_rollout_engine(name: str, context: EngineContext) -> RolloutEngine:
    """The engine rollout.engine names (a registered name or a plugin's "package.module:Class")."""
    register_plugin_engine(name)  # a plugin named in a saved config.yaml: registered in this process too
    engine_class = ROLLOUT_ENGINES.target(name)
    if not (isinstance(engine_class, type) and issubclass(engine_class, RolloutEngine)):
        raise UserError(f"rollout.engine={name} is not a RolloutEngine subclass "
                        f"(epo_cli.rollout.engines.base.RolloutEngine). Fix: name the engine's class.")
    return engine_class(context)


def evaluation_policy(model: Any, tokenizer: Any, cfg: Any, source: str, temperature: float) -> EnginePolicy:
    """`epo eval`'s policy: `model` (loaded, in eval mode) sampling through the engine cfg.rollout.engine
    names, with the rollout.* settings at `temperature`; the engine takes `model`'s weights (a checkpoint's
    may differ from `source`'s)."""
    param = next(model.parameters())
    rollout = cfg.rollout
    engine = build_rollout_engine(str(rollout.engine), EngineContext(
        FixedWeights(model), tokenizer, len(tokenizer), rollout, source, param.dtype, param.device,
        rollout.max_prompt_tokens + rollout.max_new_tokens, int(cfg.seed), False,
        autocast_dtype(cfg.model, param.dtype, param.device.type)))
    with torch.no_grad():
        engine.sync_weights()
    return EnginePolicy(engine, tokenizer, sampling_config(rollout, temperature), rollout.generation_batch_size)
