"""Checkpoints that survive a restart, and never leave a half-written `latest`.

    <run>/checkpoints/
        step_N/            DeepSpeed model + optimizer states (every ZeRO stage), critic/ (ppo),
                           trainer_state.json (counters, entropy history, monitor, schedules, curriculum,
                           logger run ids), rng_rank<r>.pt, COMPLETE (written last)
        latest             names the newest complete checkpoint (replaced atomically after COMPLETE)
        best               names the checkpoint with the best trainer.best_metric
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epo_cli.errors import UserError
from epo_cli.training.engine import barrier

COMPLETE = "COMPLETE"


def _write_pointer(root: Path, name: str, tag: str) -> None:
    tmp = root / f".{name}.tmp"
    tmp.write_text(tag)
    tmp.replace(root / name)


def complete_checkpoints(run: Path) -> list[Path]:
    root = Path(run) / "checkpoints"
    found = [p for p in root.glob("step_*") if (p / COMPLETE).exists()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_tag(run: Path) -> str | None:
    pointer = Path(run) / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def resolve_checkpoint(path: str | Path, which: str = "latest") -> Path:
    """A checkpoint folder from a run dir (+ latest | best | step_N) or a checkpoint folder itself."""
    path = Path(path).expanduser()
    if (path / COMPLETE).exists():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if which in ("latest", "best"):
        pointer = root / which
        if not pointer.exists():
            hint = "" if which == "latest" else " (no evaluation improved trainer.best_metric yet)"
            raise UserError(f"No '{which}' checkpoint in '{path}'{hint}. Complete checkpoints: "
                            f"{_listing(path)}.")
        candidate = root / pointer.read_text().strip()
    else:
        candidate = root / which
    if not (candidate / COMPLETE).exists():
        raise UserError(f"Checkpoint '{candidate}' is missing or incomplete (no {COMPLETE} marker). "
                        f"Complete checkpoints: {_listing(path)}.")
    return candidate


def _listing(run: Path) -> str:
    found = complete_checkpoints(run)
    return ", ".join(str(p) for p in found) if found else "none"


def resolve_resume(resume: str | None, run: Path) -> Path | None:
    """trainer.resume: null (fresh start), auto (this run's latest if any) or a run/checkpoint path."""
    if not resume:
        return None
    if resume == "auto":
        return resolve_checkpoint(run) if latest_tag(run) else None
    if not Path(resume).expanduser().exists():
        raise UserError(f"trainer.resume='{resume}' does not exist. Pass a run directory (outputs/<date>/"
                        "<time>-<name>), one of its checkpoints/step_N folders, or trainer.resume=auto.")
    return resolve_checkpoint(resume)


def save(run: Path, step: int, engine: Any, critic_engine: Any, payload: dict[str, Any], rank: int,
         keep: int, best_step: int | None) -> Path:
    """Save step `step` (all ranks call this; DeepSpeed saves its shards collectively)."""
    root = Path(run) / "checkpoints"
    tag = f"step_{step}"
    folder = root / tag
    if (folder / COMPLETE).exists():  # already saved at this step (e.g. best + periodic)
        if rank == 0 and best_step == step:
            _write_pointer(root, "best", tag)
        return folder
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    if critic_engine is not None:
        critic_engine.save_checkpoint(str(folder), tag="critic", save_latest=False)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               folder / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        (folder / "trainer_state.json").write_text(json.dumps(payload, indent=1))
        (folder / COMPLETE).write_text(str(step))
        _write_pointer(root, "latest", tag)
        if best_step == step:
            _write_pointer(root, "best", tag)
        _prune(root, keep, keep_tags={tag, _read(root / "best")})
    barrier()
    return folder


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def _prune(root: Path, keep: int, keep_tags: set[str | None]) -> None:
    if keep <= 0:
        return
    steps = sorted((p for p in root.glob("step_*") if (p / COMPLETE).exists()),
                   key=lambda p: int(p.name.split("_")[1]))
    for old in steps[:-keep]:
        if old.name not in keep_tags:
            shutil.rmtree(old, ignore_errors=True)


def check_world_size(folder: Path, world: int) -> None:
    """ZeRO 1-3 save one optimizer shard per rank and reload only on the same number of ranks."""
    shards = len(list(Path(folder).glob("*zero_pp_rank_*_optim_states.pt")))
    if shards and shards != world:
        raise UserError(
            f"Checkpoint '{folder}' was saved by {shards} ranks (ZeRO shards) and this run has {world}. "
            f"Resume with the same number of ranks (launcher.num_gpus / launcher.num_procs / num_nodes), "
            "or start a new run from the exported model: model.path=<run>/final."
        )


def load(folder: Path, engine: Any, critic_engine: Any, rank: int) -> dict[str, Any]:
    """Restore engines, RNG states and return the trainer payload; a corrupt checkpoint is a UserError."""
    import torch.distributed as torch_dist

    check_world_size(folder, torch_dist.get_world_size() if torch_dist.is_initialized() else 1)
    try:
        payload = json.loads((folder / "trainer_state.json").read_text())
        path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_module_strict=True)
        if path is None:
            raise FileNotFoundError("DeepSpeed found no model states")
        if critic_engine is not None:
            cpath, _ = critic_engine.load_checkpoint(str(folder), tag="critic")
            if cpath is None:
                raise FileNotFoundError("no critic states (was this checkpoint saved by a ppo run?)")
        rng_file = folder / f"rng_rank{rank}.pt"
        if rng_file.exists():
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read is reported the same way
        raise UserError(
            f"Checkpoint '{folder}' is corrupt or incompatible with this config: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}\nComplete checkpoints of this run: "
            f"{_listing(folder.parent.parent)}. Resume from another with trainer.resume=<checkpoint dir>; "
            "nothing was modified."
        ) from None
    return payload
