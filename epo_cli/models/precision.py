"""Mixed precision on fp32 weights (`model.autocast=bf16`): the forward passes run their matmuls in bfloat16
under torch.autocast while the weights, their gradients and Adam's moments stay float32.

On a CPU with bf16 instructions this is where the speed is (docs/learning.md "A real model": scoring 1.68x,
update 1.75x, generation 1.27x on SmolLM2-135M), at a per-token log-prob difference of ~0.03 against fp32.
Every forward of a run (generation on the hf engine, scoring, the update's forward, the critic, the collapse
probe, `epo eval`) enters the same context, so the PPO ratio's two log-probs come from one precision and the
first mini-batch's ratio stays exactly 1. bf16 *weights* (`model.dtype=bf16`) are another thing: an lr 1e-5
step rounds away on a weight near 1 (bf16 keeps 8 bits of mantissa), which fp32 master weights avoid.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from epo_cli.errors import UserError

AUTOCAST_DTYPES = {"none": None, "bf16": torch.bfloat16}


def autocast_dtype(model_cfg: Any, weights: torch.dtype) -> torch.dtype | None:
    """The dtype model.autocast asks the forward passes to run in (None: the weights' own), for weights of
    dtype `weights` (model.dtype resolved on this device)."""
    dtype = AUTOCAST_DTYPES[str(getattr(model_cfg, "autocast", "none"))]
    if dtype is not None and weights != torch.float32:
        raise UserError(f"model.autocast={model_cfg.autocast} runs fp32 weights' forward passes in bf16, but the "
                        f"weights here are {str(weights).removeprefix('torch.')} (model.dtype={model_cfg.dtype} on "
                        "this device), so it would change nothing. Fix: model.dtype=fp32 (mixed precision) or "
                        "model.autocast=none.")
    return dtype


def autocast(dtype: torch.dtype | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` on `device`'s type around a forward; nothing for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
