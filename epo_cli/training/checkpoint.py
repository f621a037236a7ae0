"""Saving and loading a checkpoint's engine states; which checkpoints exist and what `trainer.resume`
names is epo_cli/rundir/checkpoint_paths.py (no torch: the launchers and `epo eval` read paths without engines).

    <run>/checkpoints/step_N/
        DeepSpeed model + optimizer states (every ZeRO stage), critic/ (ppo),
        trainer_state.json (counters, entropy history, monitor, schedules, curriculum, logger run ids, and
                           `written_by`: the algorithm, whether a critic was saved, the model's shape; JSON),
        rng_rank<r>.pt (tensors and plain values only: loads with torch.load(weights_only=True)),
        COMPLETE (written last; then `latest`, and `best` when it is the best, point at it)

Safe loading: nothing in a checkpoint is unpickled. epo's own files (trainer_state.json, rng_rank<r>.pt) are
read as JSON and with the restricted unpickler and checked first, then the checkpoint must have been written
by this run's algorithm and model shape (`check_written_by`: a ppo step with its critic/ swapped into a grpo
run, or a model of another hidden size, is one message naming what differs). Only then does DeepSpeed
restore its model and optimizer states, with every torch.load it makes routed through the restricted
unpickler (epo_cli/rundir/safe_load.py: its checkpoint engine's loader asks for full unpickling).
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from epo_cli.errors import UserError
from epo_cli.rundir.checkpoint_paths import COMPLETE, check_world_size, listing, prune, read_pointer, write_pointer
from epo_cli.rundir.safe_load import load_tensors, restricted_torch_load
from epo_cli.rundir.saved_state import CHECKPOINT_FORMAT, read_trainer_state
from epo_cli.rundir.writable import check_entries, check_entry, write_file
from epo_cli.training import rng_state
from epo_cli.training.engine import barrier

#: Fault-injection seam: each hook is called with (run, step) as every `save` starts, before anything is
#: written; a hook may raise (a full disk), signal the process or end it (a rank that dies or hangs while
#: saving). Empty in a normal run; epo_cli.launch.rank's EPO_TEST_KILL_RANK and tests/test_outside_faults.py
#: add hooks.
SAVE_HOOKS: list[Callable[[Path, int], None]] = []


#: the settings of a model's config that decide the shapes of its weights (recorded in `written_by.model`)
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def model_shape(module: Any) -> dict[str, Any]:
    """The SHAPE_KEYS of a model's (Hugging Face) config; a LoRA-wrapped model answers for its base model."""
    config = getattr(module, "config", None)
    values = {key: getattr(config, key, None) for key in SHAPE_KEYS}
    return {key: v for key, v in values.items() if isinstance(v, (int, str, bool))}


def written_by(algo: str, engine: Any, critic_engine: Any) -> dict[str, Any]:
    """What wrote a checkpoint: resuming it needs the same (check_written_by)."""
    return {"algo": algo, "critic": critic_engine is not None, "model": model_shape(engine.module)}


def save(run: Path, step: int, engine: Any, critic_engine: Any, payload: dict[str, Any], rank: int,
         keep: int, best_step: int | None, algo: str) -> Path:
    """Save step `step` (all ranks call this; DeepSpeed saves its shards collectively). `algo`: the run's
    algo.name, recorded with the model's shape so that a resume can tell a checkpoint of another run."""
    for hook in SAVE_HOOKS:
        hook(run, step)
    root = Path(run) / "checkpoints"
    tag = f"step_{step}"
    folder = root / tag
    if (folder / COMPLETE).exists():  # already saved at this step (e.g. best + periodic)
        if rank == 0 and best_step == step:
            write_pointer(root, "best", tag)
        return folder
    check_entry(root, folder=True)  # DeepSpeed's torch.save follows symlinks: a leftover save's entries first
    if folder.exists():
        check_entry(folder, folder=True)
        check_entries(folder)
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    if critic_engine is not None:
        critic_engine.save_checkpoint(str(folder), tag="critic", save_latest=False)
    rng = io.BytesIO()  # epo's own files: written without following a planted entry (writable.write_file)
    torch.save(rng_state.capture(), rng)
    write_file(folder / f"rng_rank{rank}.pt", rng.getvalue())
    barrier()
    if rank == 0:
        state = {"format": CHECKPOINT_FORMAT, **payload, "written_by": written_by(algo, engine, critic_engine)}
        write_file(folder / "trainer_state.json", json.dumps(state, indent=1))
        write_file(folder / COMPLETE, str(step))
        write_pointer(root, "latest", tag)
        if best_step == step:
            write_pointer(root, "best", tag)
        prune(root, keep, keep_tags={tag, read_pointer(root / "best")})
    barrier()
    return folder


def _read_own_files(folder: Path, rank: int) -> tuple[dict[str, Any], Any]:
    """trainer_state.json and this rank's RNG states, read without unpickling, checked before DeepSpeed
    touches anything: a checkpoint of another format or with a planted pickle stops here."""
    payload = read_trainer_state(folder)  # checked whole (epo_cli/rundir/saved_state.py): format, step, parts
    rng_file = folder / f"rng_rank{rank}.pt"
    if not rng_file.exists():  # e.g. a ZeRO-0 run resumed on more ranks than saved it
        warnings.warn(f"'{rng_file}' does not exist: rank {rank} keeps the RNG states its seed gave it, so "
                      "sampling will not repeat the original run exactly.", stacklevel=2)
        return payload, None
    return payload, load_tensors(rng_file)


def check_written_by(folder: Path, recorded: dict[str, Any] | None, algo: str, engine: Any,
                     critic_engine: Any) -> None:
    """A checkpoint resumes only the kind of run that wrote it: the same algorithm (algo.name), a critic
    exactly when this run has one, the same model shape. One UserError naming every difference. Checkpoints
    saved before `written_by` was recorded are checked by what their folder holds (critic/ or not); their
    model shape is then checked by DeepSpeed's strict load (load's message names the tensors)."""
    has_critic = (folder / "critic").is_dir()
    differences = []
    if recorded is not None and recorded["algo"] != algo:
        differences.append(f"it was written by algo={recorded['algo']}, this run is algo={algo}")
    if has_critic and critic_engine is None:
        differences.append(f"it holds a critic (critic/, saved by a run with a value model such as ppo) and this "
                           f"run (algo={algo}) has none")
    elif not has_critic and critic_engine is not None:
        differences.append(f"it holds no critic (no critic/) and this run (algo={algo}) trains one")
    if recorded is not None:
        mine = model_shape(engine.module)
        for key in SHAPE_KEYS:
            theirs = recorded["model"].get(key)
            if key in mine and theirs is not None and theirs != mine[key]:
                differences.append(f"its model has {key}={theirs}, this run's {key}={mine[key]}")
    if differences:
        raise UserError(f"Checkpoint '{folder}' was not written by a run like this one: {'; '.join(differences)}. "
                        "A checkpoint resumes only the algorithm and model shape that wrote it (was a step_N "
                        "folder copied in from another run, or a model setting overridden?); nothing was "
                        "loaded or modified. Resume it with its own run (trainer.resume=<that run>), or start a "
                        "new run from its weights (model.path=<run>/final).")


def _mismatch_detail(err: Exception) -> str:
    """The lines of torch's load_state_dict error that name a tensor (size mismatch, missing, unexpected)."""
    lines = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
    return " ".join(lines[:3])[:600]


def load(folder: Path, engine: Any, critic_engine: Any, rank: int, algo: str) -> dict[str, Any]:
    """Restore engines, RNG states and return the trainer payload; a corrupt checkpoint, one that holds
    anything but tensors and plain values, or one written by another kind of run is a UserError."""
    import torch.distributed as torch_dist

    check_world_size(folder, torch_dist.get_world_size() if torch_dist.is_initialized() else 1)
    try:
        payload, rng = _read_own_files(folder, rank)
        check_written_by(folder, payload.pop("written_by", None), algo, engine, critic_engine)
        with restricted_torch_load():  # DeepSpeed's checkpoint engine asks torch.load for full unpickling
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
        first = str(err).splitlines()[0] if str(err) else ""
        if isinstance(err, RuntimeError) and "loading state_dict" in first:  # strict load: name the tensors
            first = f"{first} {_mismatch_detail(err)}"
        raise UserError(
            f"Checkpoint '{folder}' is corrupt or incompatible with this config: {type(err).__name__}: "
            f"{first}\nComplete checkpoints of this run: "
            f"{listing(folder.parent.parent)}. Resume from another with trainer.resume=<checkpoint dir>; "
            "nothing was modified."
        ) from None
    return payload
