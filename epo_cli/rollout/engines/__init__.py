"""Rollout engines: what generates the tokens of a rollout, behind one port (`RolloutEngine`, base.py).

    rollout.engine=hf     today's batched KV-cache sampler (rollout/generation.py) on the policy's own module
    rollout.engine=vllm   an in-process vLLM `LLM` per rank, its weights synced from the policy every step
    rollout.engine=my_pkg.my_module:MyEngine    a plugin: any RolloutEngine subclass, imported by that name

Why a package beside rollout/generation.py, not in training/: an engine is the rollout's generation backend
(episodes.Policy.act calls it through `EnginePolicy`); the trainer only builds one and tells it, once per
step, to take the updated weights (Trainer.sync_weights). This module imports no torch: config validation
reads the registry's names without loading an engine.
"""

from __future__ import annotations

import importlib
import importlib.util

from epo_cli.errors import ConfigError
from epo_cli.registry import Registry

#: rollout.engine -> the RolloutEngine class ("module:name" strings are imported when first built)
ROLLOUT_ENGINES = Registry("rollout engine")
ROLLOUT_ENGINES.register("hf", "epo_cli.rollout.engines.hf:HFEngine")
ROLLOUT_ENGINES.register("vllm", "epo_cli.rollout.engines.vllm_engine:VLLMEngine")


def is_plugin_name(name: str) -> bool:
    """"package.module:Class": a plugin engine named on the command line."""
    module, sep, attr = name.partition(":")
    return bool(sep) and attr.isidentifier() and all(part.isidentifier() for part in module.split("."))


def register_plugin_engine(name: str) -> None:
    """Make rollout.engine=<package.module:Class> a registered name, after checking that its module can be
    found (it is imported when the engine is built, so composing a config loads none of its code). ConfigError
    naming the fix when it cannot be found; registered names and other strings are left to the registry's
    own check (an unknown name lists the valid ones)."""
    if name in ROLLOUT_ENGINES or not is_plugin_name(name):
        return
    module = name.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"Invalid value for 'rollout.engine': plugin module '{module}' cannot be found. "
                          f"Fix: install it or put its folder on PYTHONPATH, or use one of "
                          f"{', '.join(n for n in ROLLOUT_ENGINES.names() if not is_plugin_name(n))}.")
    ROLLOUT_ENGINES.register(name, name)


def mismatch_metrics_on(rollout: object) -> bool:
    """rollout.mismatch_metrics, its null read as: on for every engine but hf (see the setting)."""
    setting = getattr(rollout, "mismatch_metrics", None)
    return bool(setting) if setting is not None else str(getattr(rollout, "engine", "hf")) != "hf"


def keeps_engine_logprobs(rollout: object) -> bool:
    """Whether training rollouts keep the engine's log-probs: for the mismatch metrics, or for a correction
    (rollout.correction.mode) that weighs the loss by them."""
    correction = getattr(getattr(rollout, "correction", None), "mode", "none")
    return mismatch_metrics_on(rollout) or str(correction) != "none"


GIB = 1024 ** 3


def engine_memory(rollout: object, weight_bytes: float, hf_kv_bytes: float, device_bytes: float,
                  device: str) -> dict[str, float]:
    """What the rollout engine adds to a rank's memory, for `epo plan` (epo_cli/analysis/plan.py): parts by
    name; "rollout KV cache" is the transient part (never alive with the update's activations).

    hf: the KV cache of the rank's rollout batch (`hf_kv_bytes`), generated with the policy's own weights.
    vllm: its own weight copy plus the KV cache it reserves: on CPU rollout.vllm.kv_cache_gib GiB; on GPU
    vLLM takes rollout.vllm.gpu_memory_utilization of the device for both. With sleep_during_update (GPU)
    the whole reservation is freed during the update, so it counts as transient; else it is held throughout."""
    if str(getattr(rollout, "engine", "hf")) != "vllm":
        return {"rollout KV cache": hf_kv_bytes}
    settings = rollout.vllm
    if device == "gpu":
        reserved = max(float(settings.gpu_memory_utilization) * device_bytes, weight_bytes)
        if settings.sleep_during_update:
            return {"rollout KV cache": reserved}
        return {"rollout KV cache": 0.0, "vLLM weights + KV cache": reserved}
    return {"rollout KV cache": 0.0, "vLLM weight copy": weight_bytes,
            "vLLM KV cache": float(settings.kv_cache_gib) * GIB}


__all__ = ["ROLLOUT_ENGINES", "engine_memory", "is_plugin_name", "keeps_engine_logprobs", "mismatch_metrics_on",
           "register_plugin_engine"]
