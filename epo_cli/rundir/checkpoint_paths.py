"""Where a run's checkpoints are, which ones are complete, and what `trainer.resume=` names. No torch.

    <run>/checkpoints/
        step_N/            one checkpoint (written by epo_cli.training.checkpoint.save); COMPLETE is its
                           last file, so a folder without it is a save that did not finish
        latest             names the newest complete checkpoint (replaced atomically after COMPLETE)
        best               names the checkpoint with the best trainer.best_metric
        superseded/        newer checkpoints moved aside when a run is resumed from an earlier step_N

The launchers (checking a resume before any rank starts), `epo eval` (which checkpoint to read) and the
trainer all read checkpoints through this module; saving and loading engine states is
epo_cli/training/checkpoint.py.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path

from epo_cli.errors import ConfigError, UserError
from epo_cli.rundir.received import ReceivedFileError, read_text
from epo_cli.rundir.writable import write_file

COMPLETE = "COMPLETE"


def write_pointer(root: Path, name: str, tag: str) -> None:
    """checkpoints/<name> (latest | best) := tag, replaced atomically, never written through a planted entry."""
    write_file(root / name, tag)


def read_pointer(path: Path) -> str | None:
    """What a pointer file (checkpoints/latest, best) names; None when it is missing. Read as bounded data: a
    pointer that is not a small regular file inside checkpoints/ is one UserError naming it."""
    try:
        tag = read_text(path, "pointer", within=Path(path).parent, errors="replace").strip()
    except FileNotFoundError:
        return None
    if Path(tag).name != tag or tag in (".", ".."):  # a pointer names a folder beside it, never a path
        raise ReceivedFileError(path, f"names {tag[:80]!r}, not a checkpoint folder beside it", "pointer")
    return tag


def complete_checkpoints(run: Path) -> list[Path]:
    root = Path(run) / "checkpoints"
    found = [p for p in root.glob("step_*") if (p / COMPLETE).exists()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_tag(run: Path) -> str | None:
    return read_pointer(Path(run) / "checkpoints" / "latest")


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
                            f"{listing(path)}.")
        candidate = root / (read_pointer(pointer) or "")
    else:
        candidate = root / which
    if not (candidate / COMPLETE).exists():
        raise UserError(f"Checkpoint '{candidate}' is missing or incomplete (no {COMPLETE} marker). "
                        f"Complete checkpoints: {listing(path)}.")
    return candidate


def listing(run: Path) -> str:
    """The run's complete checkpoints, for messages ("none" if it has none)."""
    found = complete_checkpoints(run)
    return ", ".join(str(p) for p in found) if found else "none"


RESUME_FORMS = ("a run directory (outputs/<date>/<time>-<name>, holding config.yaml)",
                "<run>/checkpoints (its latest checkpoint)",
                "<run>/checkpoints/latest or <run>/checkpoints/best",
                "<run>/checkpoints/step_N (continues from step N)",
                "auto (with run_dir=<dir>: that run's latest checkpoint, or a fresh start)")


@dataclass
class ResumeTarget:
    """What `trainer.resume=<path>` names: the run (its config.yaml, metrics, checkpoints) and the
    checkpoint folder to continue from."""

    run: Path
    checkpoint: Path


def _expected_forms() -> str:
    return "Pass one of:\n" + "\n".join(f"  - {form}" for form in RESUME_FORMS)


def locate_resume(resume: str | Path) -> ResumeTarget:
    """Resolve every path form a user would pass to trainer.resume (see RESUME_FORMS). A checkpoint
    folder's run is two levels up; a path that is none of these is a ConfigError listing the forms."""
    given = str(resume)
    path = Path(given).expanduser()
    if not path.exists():
        raise ConfigError(f"trainer.resume='{given}' does not exist. {_expected_forms()}")
    path = path.resolve()
    if (path / "config.yaml").is_file():  # a run directory: its latest checkpoint
        run, which = path, "latest"
    elif path.name == "checkpoints" and path.is_dir():
        run, which = path.parent, "latest"
    elif path.parent.name == "checkpoints" and (path.name in ("latest", "best") or path.name.startswith("step_")):
        run, which = path.parent.parent, path.name
    else:
        raise ConfigError(f"trainer.resume='{given}' is neither a run directory (no config.yaml) nor one of "
                          f"its checkpoints. {_expected_forms()}")
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"trainer.resume='{given}': the run directory '{run}' has no config.yaml, so the "
                          "config that run used is unknown (epo never falls back to the default config). "
                          f"{_expected_forms()}")
    if path.is_dir() and path.name not in ("checkpoints",) and path != run and (path / COMPLETE).exists():
        return ResumeTarget(run, path)  # step_N, or a `latest`/`best` folder rather than a pointer file
    return ResumeTarget(run, resolve_checkpoint(run, which))


def resolve_resume(resume: str | None, run: Path) -> Path | None:
    """trainer.resume: null (fresh start), auto (this run's latest if any) or a run/checkpoint path."""
    if not resume:
        return None
    if resume == "auto":
        return resolve_checkpoint(run) if latest_tag(run) else None
    return locate_resume(resume).checkpoint


def supersede_newer(run: Path, step: int) -> list[Path]:
    """Resuming from an earlier step_N: move the run's newer checkpoints aside (checkpoints/superseded/,
    nothing is deleted) so the new branch neither mixes with them nor skips saving over them, and point
    `latest` at step_N. Returns the moved folders (rank 0 calls this before any save)."""
    root = Path(run) / "checkpoints"
    newer = [p for p in root.glob("step_*") if p.is_dir() and _step_of(p) is not None and _step_of(p) > step]
    if not newer:
        return []
    target = root / "superseded"
    target.mkdir(exist_ok=True)
    moved = []
    for folder in sorted(newer, key=_step_of):
        dest = target / folder.name
        n = 1
        while dest.exists():
            dest, n = target / f"{folder.name}.{n}", n + 1
        folder.rename(dest)
        moved.append(dest)
    write_pointer(root, "latest", f"step_{step}")
    if (read_pointer(root / "best") or "") in {p.name for p in newer}:
        (root / "best").unlink()
    return moved


def _step_of(folder: Path) -> int | None:
    try:
        return int(folder.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return None


def prune(root: Path, keep: int, keep_tags: set[str | None]) -> None:
    """Delete all but the newest `keep` complete checkpoints (and those in keep_tags). Never leaves a folder
    that looks complete but is not: the COMPLETE marker goes first, then the folder is renamed out of the
    step_* namespace, and only then are its files deleted (a crash at any point leaves no false step_N)."""
    for leftover in root.glob(".pruned-step_*"):  # an earlier prune that was interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    if keep <= 0:
        return
    steps = sorted((p for p in root.glob("step_*") if (p / COMPLETE).exists()),
                   key=lambda p: int(p.name.split("_")[1]))
    for old in steps[:-keep]:
        if old.name not in keep_tags:
            (old / COMPLETE).unlink(missing_ok=True)
            doomed = root / f".pruned-{old.name}"
            try:
                old.rename(doomed)
            except OSError:
                doomed = old  # not renamable: it is already marked incomplete
            shutil.rmtree(doomed, ignore_errors=True)


def check_world_size(folder: Path, world: int) -> None:
    """ZeRO 1-3 save one optimizer shard per rank and reload only on the same number of ranks."""
    shards = len(list(Path(folder).glob("*zero_pp_rank_*_optim_states.pt")))
    if shards and shards != world:
        raise UserError(
            f"Checkpoint '{folder}' was saved by {shards} ranks (ZeRO shards) and this run has {world}. "
            f"Resume with the same number of ranks (launcher.num_gpus / launcher.num_procs / num_nodes), "
            "or start a new run from the exported model: model.path=<run>/final."
        )


# ---- a save that could not be written ---------------------------------------------------------------------

#: errno values that mean "this directory cannot be written" (disk full, quota, read-only, permissions)
DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG}

#: how torch.save reports a write that failed (its C++ writer raises RuntimeError, not OSError)
TORCH_WRITE_FAILURES = ("PytorchStreamWriter failed", "file write failed", "basic_ios::clear")


def is_disk_error(err: BaseException) -> bool:
    """A failure to write the run directory: an OSError with a disk errno, or torch's writer failing."""
    for e in (err, err.__cause__, err.__context__):
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return True
        if isinstance(e, RuntimeError) and any(text in str(e) for text in TORCH_WRITE_FAILURES):
            return True
    return False


def disk_error_message(run: Path, err: BaseException) -> str:
    where = getattr(err, "filename", None)
    latest = latest_tag(run)
    last = (f"The last complete checkpoint, {Path(run) / 'checkpoints' / latest}, is intact; continue with "
            f"`epo train trainer.resume={run}`." if latest else "No checkpoint was completed before it.")
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return (f"Could not write to the run directory {run}{f' ({where})' if where else ''}: {first}. "
            f"Free disk space or make the directory writable. {last}")
