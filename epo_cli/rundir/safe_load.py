"""Reading files from a run directory without running code from them.

Run directories, checkpoints and model folders are data: people share them, copy them between machines
and download them. A pickle can run arbitrary code when it is loaded, so every `torch.load` epo makes, and
every one DeepSpeed makes for epo (resuming a run, consolidating ZeRO shards), uses the restricted
unpickler (`torch.load(weights_only=True)`: tensors, numbers, strings, lists, dicts) with exactly the few
DeepSpeed classes its states hold allowed (`deepspeed_state_classes`). Everything else epo reads is JSON,
YAML or safetensors. A file that needs more is refused with one message naming it; nothing in it runs.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import re
import warnings
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from epo_cli.errors import UserError

#: torch's own advice around a refusal (its message tells the user to unpickle: epo never repeats that)
_TORCH_ADVICE = ("weights_only", "Weights only load failed", "torch.serialization", "safe_globals",
                 "trust the source", "pytorch.org", "Please file an issue", "In PyTorch 2.6")


def _reason(text: str) -> str:
    """What the restricted unpickler objected to, in a few words, without torch's advice (which says that
    loading with weights_only=False "will likely succeed": a received file is never fully unpickled)."""
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    if found:
        return f"it refers to {found.group(1)}"
    text = text.split("WeightsUnpickler error:")[-1]
    for line in (part.strip() for part in text.splitlines()):
        if line and not any(advice in line for advice in _TORCH_ADVICE):
            if line.startswith("Unsupported operand"):  # a pickle protocol or opcode beyond tensors and values
                return f"its pickle uses an instruction the restricted unpickler does not allow: {line[:200]}"
            return line[:300]
    return "it is not a file of tensors and plain values"


def refused_message(path: Path, err: Exception) -> str:
    """The one message for a file the restricted unpickler refused, in epo's words (never torch's advice)."""
    detail = _reason(str(err)) if isinstance(err, pickle.UnpicklingError) else \
        f"reading it failed with {type(err).__name__}: {_reason(str(err))}"
    return (f"'{path}' holds objects other than tensors and plain values ({detail}); "
            "epo loads files from run directories with torch.load(weights_only=True) and never unpickles "
            "them, since unpickling can run code. It was written by something other than this version of "
            "epo (or by an older epo), or damaged; nothing was loaded or modified.")


@contextlib.contextmanager
def quiet_unpickler() -> Iterator[None]:
    """Without torch's "Detected pickle protocol N" UserWarning: the restricted unpickler prints it for any
    file not written with torch.save's default protocol, just before it refuses (or reads) the file, so a
    refused file would show torch's warning above epo's own message."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected pickle protocol", category=UserWarning)
        yield


def deepspeed_state_classes() -> list[type]:
    """The DeepSpeed classes its ZeRO optimizer shards store next to the tensors: an enum, the loss
    scaler (plain attributes) and a two-int dataclass. Allowing exactly these lets the restricted unpickler
    read those shards; they have no custom unpickling hooks."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def _enum_classes() -> list[type[Enum]]:
    return [c for c in deepspeed_state_classes() if isinstance(c, type) and issubclass(c, Enum)]


@functools.cache
def _enum_lookup(enum_class: type[Enum]) -> Any:
    """What the restricted unpickler gets for an allowed Enum class's name: a function that returns a member
    by value (`EnumClass(value)`, the pickle form of Python 3.12+ and 3.11.5+), not the class itself. The
    unpickler's BUILD opcode sets the state of objects whose type is allowed: with the class allowed, a
    crafted BUILD on a member renamed and revalued that member for the whole process. The function's
    members are of no allowed type, so BUILD on them is refused. Cached: one function per class, so that
    torch's list of allowed globals holds it once."""
    def member(value: Any) -> Enum:
        try:
            return enum_class(value)
        except (ValueError, TypeError):
            raise pickle.UnpicklingError(f"{enum_class.__qualname__}({value!r}) is no member of that Enum") from None

    member.__qualname__ = member.__name__ = enum_class.__qualname__
    member._epo_enum = enum_class  # type: ignore[attr-defined]
    return member


def enum_member(owner: Any, name: Any) -> Enum:
    """What `builtins.getattr` means inside the restricted unpickler: a member of an allowed Enum, nothing else.

    Python 3.11.0-3.11.4 (Debian 12's 3.11.2 among them) pickle an Enum member as
    `getattr(EnumClass, "NAME")`; later versions as `EnumClass(value)`. DeepSpeed's ZeRO shards hold one
    (ZeroStageEnum), so both forms must load, but a general getattr would reach any attribute of any
    allowed object (a function's __globals__, a class's methods): only an allowed Enum class's own member
    names are looked up here, and anything else is refused like a disallowed global. The owner the
    unpickler hands over is _enum_lookup's function for the class."""
    allowed = _enum_classes()
    enum_class = getattr(owner, "_epo_enum", owner) if callable(owner) else owner
    if enum_class in allowed and isinstance(name, str) and name in enum_class.__members__:
        return enum_class.__members__[name]
    shown = getattr(enum_class, "__qualname__", type(owner).__name__)
    raise pickle.UnpicklingError(f"getattr({shown}, {name!r}): only the members of an allowed Enum "
                                 f"({', '.join(c.__name__ for c in allowed)}) may be read that way")


def _allowed_globals() -> list[Any]:
    classes = [c for c in deepspeed_state_classes() if c not in _enum_classes()]
    enums = [(_enum_lookup(c), f"{c.__module__}.{c.__qualname__}") for c in _enum_classes()]
    return [*classes, *enums, (enum_member, "builtins.getattr")]


#: what a failed restricted load of a damaged or crafted file raises besides UnpicklingError (a REDUCE of an
#: allowed class with wrong arguments, a rebuild with an odd storage, a truncated stream)
_LOAD_FAILURES = (pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError, KeyError, EOFError)


@contextlib.contextmanager
def restricted_torch_load() -> Iterator[None]:
    """Inside this block every `torch.load` uses the restricted unpickler (weights_only=True) with the
    DeepSpeed state classes allowed, whatever its caller asked for: DeepSpeed's engine (resuming a run:
    its checkpoint engine's `load`) and its zero_to_fp32 (`epo eval` of a ZeRO 1-3 checkpoint) load with
    weights_only=False. A file that needs more is a UserError naming it; nothing in it runs.

    Re-entrant: an inner block leaves the outer one's allowed globals and patched torch.load in place."""
    original = torch.load
    if getattr(original, "_epo_restricted", False):  # already inside a block
        yield
        return

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except _LOAD_FAILURES as err:  # a refused or damaged file: epo's one message, naming it
            raise UserError(refused_message(Path(f) if isinstance(f, (str, Path)) else Path(str(f)), err)) from None

    load._epo_restricted = True  # type: ignore[attr-defined]
    added = [g for g in _allowed_globals() if g not in torch.serialization.get_safe_globals()]
    with torch.serialization.safe_globals(added), quiet_unpickler():
        torch.load = load
        try:
            yield
        finally:
            torch.load = original


def load_tensors(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`; a file that needs full unpickling is a UserError, not run."""
    with restricted_torch_load():
        return torch.load(path, map_location=map_location)
