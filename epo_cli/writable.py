"""Folders a command writes its results into, checked before any work: one message naming the setting.

A file where the folder should be, a read-only run directory (an `epo eval` or `epo report` of a run that
someone shared read-only), or a full disk would otherwise surface as an OSError once the work is done.
"""

from __future__ import annotations

import os
from pathlib import Path

from epo_cli.errors import UserError


def prepare_output_dir(path: Path, key: str) -> Path:
    """Create the folder a command writes its results into and make sure it can: one UserError naming the
    setting (`key`) and the path when it is a file, or cannot be created or written (a read-only run
    directory, a full disk), before any work starts."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}: '{path}' is a file, not a folder. Choose a folder ({key}=DIR).")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".epo-write-check-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise UserError(f"{key}: cannot write into '{path}' ({why}: {err.filename or path}). Choose a writable "
                        f"folder ({key}=DIR), or make this one writable / free disk space.") from None
    return path
