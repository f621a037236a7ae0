"""model.attn_implementation checked against this machine before any work (transformers would fail only when
the model loads, after the run directory was written). Torch-free to import: `launcher=local` imports this
module before the Trainer, and the launcher's first torch import is the Trainer's (tests/test_imports.py).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from epo_cli.errors import UserError

#: attention implementations that need a package of their own and a CUDA GPU: (module, package to install)
NEEDS_PACKAGE = {"flash_attention_2": ("flash_attn", "flash-attn"),
                 "flash_attention_3": ("flash_attn_interface", "flash-attn 3 (hopper)")}


#: attention implementations epo runs on CUDA GPUs only: flex_attention's kernels are compiled by torch's
#: inductor, whose CPU path fails on this model after minutes of compiling (seen with torch 2.x on a CPU run)
CUDA_ONLY = {"flex_attention"}


def check_attention(model_cfg: Any, device_type: str) -> None:
    """model.attn_implementation's package and device (`device_type`: cuda | cpu, epo_cli.runtime.device).
    flash_attention_2/3 need their packages and a CUDA GPU, flex_attention a CUDA GPU; sdpa and eager run
    anywhere."""
    if model_cfg.attn_implementation in CUDA_ONLY and device_type != "cuda":
        raise UserError(f"model.attn_implementation={model_cfg.attn_implementation} cannot be used here: epo runs "
                        "it on CUDA GPUs only (on the CPU, torch's compiler fails on its kernels after minutes) and "
                        "this run is on the CPU. Use model.attn_implementation=sdpa (the default).")
    if model_cfg.attn_implementation not in NEEDS_PACKAGE:
        return
    module, package = NEEDS_PACKAGE[model_cfg.attn_implementation]
    problems = []
    if importlib.util.find_spec(module) is None:
        problems.append(f"the {package} package is not installed")
    if device_type != "cuda":
        problems.append("it runs on CUDA GPUs only and this run is on the CPU")
    if problems:
        raise UserError(f"model.attn_implementation={model_cfg.attn_implementation} cannot be used here: "
                        f"{' and '.join(problems)}. Use model.attn_implementation=sdpa (the default).")
