"""Mixed precision on fp32 weights (`model.autocast=bf16`): the forward passes run their matmuls in bfloat16
under torch.autocast while the weights, their gradients and Adam's moments stay float32.

It pays only on hardware with bf16 matmul instructions: on a CPU with avx512_bf16 SmolLM2-135M's scoring ran
1.68x, its update 1.75x and generation 1.27x faster, at a per-token log-prob difference of ~0.03 against fp32;
on a CPU without them (bf16 emulated) a whole RL iteration ran 3x slower, which a warning says (docs/learning.md,
"A real model").
Every forward of a run (generation on the hf engine, scoring, the update's forward, the critic, the collapse
probe, `epo eval`) enters the same context, so the PPO ratio's two log-probs come from one precision and the
first mini-batch's ratio stays exactly 1. bf16 *weights* (`model.dtype=bf16`) are another thing: an lr 1e-5
step rounds away on a weight near 1 (bf16 keeps 8 bits of mantissa), which fp32 master weights avoid.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

from epo_cli.errors import UserError

AUTOCAST_DTYPES = {"none": None, "bf16": torch.bfloat16}
#: the x86 CPU flags of bf16 matmul instructions; without them oneDNN emulates bf16, which measured 3-4x slower
#: than fp32 on SmolLM2-135M's forward and backward (docs/learning.md, "A real model")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU has bf16 matmul instructions (None: unknown, e.g. not Linux or not x86)."""
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else any(f in flags.split() for f in BF16_CPU_FLAGS)


def autocast_dtype(model_cfg: Any, weights: torch.dtype, device_type: str = "cpu") -> torch.dtype | None:
    """The dtype model.autocast asks the forward passes to run in (None: the weights' own), for weights of
    dtype `weights` (model.dtype resolved on this device); a warning where a CPU would emulate it."""
    dtype = AUTOCAST_DTYPES[str(getattr(model_cfg, "autocast", "none"))]
    if dtype is not None and weights != torch.float32:
        raise UserError(f"model.autocast={model_cfg.autocast} runs fp32 weights' forward passes in bf16, but the "
                        f"weights here are {str(weights).removeprefix('torch.')} (model.dtype={model_cfg.dtype} on "
                        "this device), so it would change nothing. Fix: model.dtype=fp32 (mixed precision) or "
                        "model.autocast=none.")
    if dtype is not None and device_type == "cpu" and cpu_has_bf16() is False:
        warnings.warn(f"model.autocast={model_cfg.autocast}: this CPU has no bf16 instructions "
                      f"({' or '.join(BF16_CPU_FLAGS)}), so bf16 matmuls are emulated: on such a CPU an RL iteration "
                      "of SmolLM2-135M measured 3x slower than fp32. model.autocast=none is faster here.",
                      stacklevel=2)
    return dtype


def autocast(dtype: torch.dtype | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` on `device`'s type around a forward; nothing for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
