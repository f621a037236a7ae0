"""Reading files from a run directory without running code from them.

Run directories, checkpoints and model folders are data: people share them, copy them between machines
and download them. A pickle can run arbitrary code when it is loaded, so `epo` reads every such file
with the restricted unpickler (`torch.load(weights_only=True)`: tensors, numbers, strings, lists, dicts),
JSON, YAML or safetensors. The one exception is resuming a run (`trainer.resume=` on the command line):
DeepSpeed's engine then restores its optimizer states with its own, full unpickling loader, because the
user asked for that run explicitly (see epo_cli/training/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from epo_cli.errors import UserError


def refused_message(path: Path, err: Exception) -> str:
    """The one message for a file the restricted unpickler refused."""
    text = str(err)
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    detail = f"it refers to {found.group(1)}" if found else \
        (text.split("WeightsUnpickler error:")[-1].strip().splitlines() or [type(err).__name__])[0]
    if detail.startswith("Unsupported operand"):  # a pickle protocol or opcode beyond tensors and plain values
        detail = f"its pickle uses an instruction the restricted unpickler does not allow: {detail}"
    return (f"'{path}' holds objects other than tensors and plain values ({detail}); "
            "epo loads files from run directories with torch.load(weights_only=True) and never unpickles "
            "them, since unpickling can run code. It was written by something other than this version of "
            "epo (or by an older epo); nothing was loaded or modified.")


@contextlib.contextmanager
def quiet_unpickler() -> Iterator[None]:
    """Without torch's "Detected pickle protocol N" UserWarning: the restricted unpickler prints it for any
    file not written with torch.save's default protocol, just before it refuses (or reads) the file, so a
    refused file would show torch's warning above epo's own message."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected pickle protocol", category=UserWarning)
        yield


def load_tensors(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`; a file that needs full unpickling is a UserError, not run."""
    try:
        with quiet_unpickler():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UserError(refused_message(Path(path), err)) from None


def _deepspeed_state_classes() -> list[type]:
    """The DeepSpeed classes its ZeRO optimizer shards store next to the tensors: an enum, the loss
    scaler (plain attributes) and a two-int dataclass. Allowing exactly these lets the restricted unpickler
    read those shards; they have no custom unpickling hooks."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def restricted_torch_load() -> Iterator[None]:
    """Inside this block every `torch.load` uses the restricted unpickler (weights_only=True), whatever
    its caller asked for. DeepSpeed's zero_to_fp32 loads its shards with weights_only=False; `epo eval`
    consolidates ZeRO 1-3 checkpoints through it inside this block, so a crafted shard is refused."""
    original = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    with torch.serialization.safe_globals(_deepspeed_state_classes()), quiet_unpickler():
        torch.load = load
        try:
            yield
        finally:
            torch.load = original
