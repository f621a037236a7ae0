"""Saving and loading a checkpoint's engine states; which checkpoints exist and what `trainer.resume`
names is epo_cli/checkpoint_paths.py (no torch: the launchers and `epo eval` read paths without engines).

    <run>/checkpoints/step_N/
        DeepSpeed model + optimizer states (every ZeRO stage), critic/ (ppo),
        trainer_state.json (counters, entropy history, monitor, schedules, curriculum, logger run ids; JSON),
        rng_rank<r>.pt (tensors and plain values only: loads with torch.load(weights_only=True)),
        COMPLETE (written last; then `latest`, and `best` when it is the best, point at it)

Safe loading: epo's own files (trainer_state.json, rng_rank<r>.pt) are read as JSON and with the restricted
unpickler, and checked before anything else. DeepSpeed's model and optimizer states are then restored by
DeepSpeed's own loader, which unpickles them fully: that happens only here, when the user resumes a run
explicitly (`trainer.resume=` on the command line). `epo eval` never calls `load`; it reads weights only.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from epo_cli.checkpoint_paths import COMPLETE, check_world_size, listing, prune, read_pointer, write_pointer
from epo_cli.errors import UserError
from epo_cli.safe_load import load_tensors
from epo_cli.saved_state import CHECKPOINT_FORMAT, read_trainer_state
from epo_cli.training import rng_state
from epo_cli.training.engine import barrier

#: Fault-injection seam: each hook is called with (run, step) as every `save` starts, before anything is
#: written; a hook may raise (a full disk), signal the process or end it (a rank that dies or hangs while
#: saving). Empty in a normal run; epo_cli.launch.rank's EPO_TEST_KILL_RANK and tests/test_outside_faults.py
#: add hooks.
SAVE_HOOKS: list[Callable[[Path, int], None]] = []


def save(run: Path, step: int, engine: Any, critic_engine: Any, payload: dict[str, Any], rank: int,
         keep: int, best_step: int | None) -> Path:
    """Save step `step` (all ranks call this; DeepSpeed saves its shards collectively)."""
    for hook in SAVE_HOOKS:
        hook(run, step)
    root = Path(run) / "checkpoints"
    tag = f"step_{step}"
    folder = root / tag
    if (folder / COMPLETE).exists():  # already saved at this step (e.g. best + periodic)
        if rank == 0 and best_step == step:
            write_pointer(root, "best", tag)
        return folder
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    if critic_engine is not None:
        critic_engine.save_checkpoint(str(folder), tag="critic", save_latest=False)
    torch.save(rng_state.capture(), folder / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        (folder / "trainer_state.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, **payload}, indent=1))
        (folder / COMPLETE).write_text(str(step))
        write_pointer(root, "latest", tag)
        if best_step == step:
            write_pointer(root, "best", tag)
        prune(root, keep, keep_tags={tag, read_pointer(root / "best")})
    barrier()
    return folder


def _read_own_files(folder: Path, rank: int) -> tuple[dict[str, Any], Any]:
    """trainer_state.json and this rank's RNG states, read without unpickling, checked before DeepSpeed
    touches anything: a checkpoint of another format or with a planted pickle stops here."""
    payload = read_trainer_state(folder)  # checked whole (epo_cli/saved_state.py): format, step, parts
    rng_file = folder / f"rng_rank{rank}.pt"
    if not rng_file.exists():  # e.g. a ZeRO-0 run resumed on more ranks than saved it
        warnings.warn(f"'{rng_file}' does not exist: rank {rank} keeps the RNG states its seed gave it, so "
                      "sampling will not repeat the original run exactly.", stacklevel=2)
        return payload, None
    return payload, load_tensors(rng_file)


def load(folder: Path, engine: Any, critic_engine: Any, rank: int) -> dict[str, Any]:
    """Restore engines, RNG states and return the trainer payload; a corrupt checkpoint is a UserError.
    Only for an explicit resume: DeepSpeed's loader unpickles its model and optimizer states."""
    import torch.distributed as torch_dist

    check_world_size(folder, torch_dist.get_world_size() if torch_dist.is_initialized() else 1)
    try:
        payload, rng = _read_own_files(folder, rank)
        path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_module_strict=True)
        if path is None:
            raise FileNotFoundError("DeepSpeed found no model states")
        if critic_engine is not None:
            cpath, _ = critic_engine.load_checkpoint(str(folder), tag="critic")
            if cpath is None:
                raise FileNotFoundError("no critic states (was this checkpoint saved by a ppo run?)")
        if rng is not None:
            rng_state.restore(rng, folder / f"rng_rank{rank}.pt")
    except UserError as err:
        raise UserError(f"{err}\nComplete checkpoints of this run: {listing(folder.parent.parent)}.",
                        exit_code=err.exit_code) from None
    except Exception as err:  # noqa: BLE001 - any failure to read is reported the same way
        raise UserError(
            f"Checkpoint '{folder}' is corrupt or incompatible with this config: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}\nComplete checkpoints of this run: "
            f"{listing(folder.parent.parent)}. Resume from another with trainer.resume=<checkpoint dir>; "
            "nothing was modified."
        ) from None
    return payload
