"""The one rule for which device a run uses: trainer.device=cuda, or auto with a CUDA GPU visible, is the GPU;
anything else the CPU. Torch-free to import (torch loads when the rule is applied): `launcher=local` checks
the attention implementation against the planned device before the Trainer imports torch, and the process
settings (launch/libraries.py) name DeepSpeed's accelerator before `import deepspeed` (tests/test_imports.py)."""

from __future__ import annotations

import glob
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from epo_cli.errors import UserError

if TYPE_CHECKING:
    import torch


def gpu_driver_present() -> bool:
    """Whether this machine may have a GPU at all (a /dev/nvidia* device, ROCm's /dev/kfd or nvidia-smi), without
    loading torch: where not, trainer.device=auto is the CPU."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or Path("/dev/kfd").exists() or shutil.which("nvidia-smi"))


def device_type(trainer_device: str = "auto") -> str:
    """'cuda' or 'cpu' for trainer.device=`trainer_device` (auto | cuda | cpu) on this machine."""
    import torch  # not at the top: see the module docstring

    return "cuda" if trainer_device == "cuda" or (trainer_device == "auto" and torch.cuda.is_available()) else "cpu"


def pick_device(trainer_device: str, local_rank: int) -> torch.device:
    """This rank's device under trainer.device=`trainer_device` (`device_type`'s rule): its local GPU, or the
    CPU."""
    import torch

    if device_type(trainer_device) == "cuda":
        if not torch.cuda.is_available():
            raise UserError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu.")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
