"""DeepSpeed's JSON config, derived from the run config, and a free port; no torch, so that a launcher can
check the batch layout against the world size before any rank (or engine) starts."""

from __future__ import annotations

import math
import socket
from typing import Any

from epo_cli.errors import ConfigError


def free_port() -> int:
    """A TCP port that is free on this machine now (for a single-node MASTER_PORT). Free when picked, bound
    later by rank 0: another process can take it in between, so callers retry (port_taken, PORT_ATTEMPTS)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: how often a free port picked here is tried before the failure is reported
PORT_ATTEMPTS = 3


def port_taken(text: str) -> bool:
    """Whether a rank's error (or its output) says that rank 0 could not listen on the master port because
    another process holds it: torch's TCPStore names the errno."""
    return "EADDRINUSE" in text


def precision(cfg: Any, device_type: str) -> str:
    """deepspeed.precision, with auto resolved: bf16 on GPU, fp32 on CPU."""
    p = cfg.deepspeed.precision
    return ("bf16" if device_type == "cuda" else "fp32") if p == "auto" else p


def deepspeed_config(cfg: Any, world_size: int, device_type: str) -> dict[str, Any]:
    """DeepSpeed's JSON config from the run config; batch sizes must divide over the world (ConfigError).
    `device_type`: "cuda" or "cpu"."""
    algo = cfg.algo
    per_rank = algo.micro_batch_size * world_size
    if algo.mini_batch_size % per_rank:
        raise ConfigError(
            f"algo.mini_batch_size={algo.mini_batch_size} must be divisible by algo.micro_batch_size="
            f"{algo.micro_batch_size} x world size {world_size} = {per_rank}. Change one of them "
            f"(e.g. algo.mini_batch_size={math.ceil(algo.mini_batch_size / per_rank) * per_rank})."
        )
    stage = cfg.deepspeed.zero_stage
    pin = device_type == "cuda"
    zero: dict[str, Any] = {"stage": stage}
    if cfg.deepspeed.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if cfg.deepspeed.offload_param and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    dtype = precision(cfg, device_type)
    config: dict[str, Any] = {
        "train_batch_size": algo.mini_batch_size,
        "train_micro_batch_size_per_gpu": algo.micro_batch_size,
        "gradient_accumulation_steps": algo.mini_batch_size // per_rank,
        "managed_gradient_accumulation": False,
        # stage 0: GuardedAdamW clips (DeepSpeed would not report the norm); ZeRO clips itself
        "gradient_clipping": algo.grad_clip if stage > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    # deepspeed.activation_checkpointing is applied as Hugging Face gradient checkpointing in build_engine:
    # DeepSpeed's own "activation_checkpointing" section only configures deepspeed.checkpointing, which
    # HF models never call.
    return config
