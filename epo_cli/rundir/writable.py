"""Folders a command writes its results into, checked before any work: one message naming the setting.

A file where the folder should be, a read-only run directory (an `epo eval` or `epo report` of a run that
someone shared read-only), or a full disk would otherwise surface as an OSError once the work is done.
`json_ready` makes the values written into such a folder's JSON files strict JSON.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from epo_cli.errors import UserError


def check_output_dir(path: Path, key: str) -> Path:
    """Make sure the folder a command will write its results into can be made and written, without creating
    anything yet: one UserError naming the setting (`key`) and the path when it, or the nearest part of it
    that exists, is a file, or when that part cannot be written (a read-only run directory, a full disk)."""
    path = Path(path).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not existing.is_dir():
        shown = f"'{path}' is a file" if existing == path else f"'{existing}' (in '{path}') is a file"
        raise UserError(f"{key}: {shown}, not a folder. Choose a folder ({key}=DIR).")
    probe = existing / f".epo-write-check-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise UserError(f"{key}: cannot write into '{existing}' ({why}), so '{path}' cannot be written. Choose "
                        f"a writable folder ({key}=DIR), or make this one writable / free disk space.") from None
    return path


def prepare_output_dir(path: Path, key: str) -> Path:
    """check_output_dir, then create the folder."""
    path = check_output_dir(path, key)
    path.mkdir(parents=True, exist_ok=True)
    return path


def json_ready(value: Any) -> Any:
    """`value` with every NaN/inf float as None, through dicts, lists and tuples: NaN/inf are not JSON (an
    interval over zero episodes, a metric of a run that diverged), and json.dumps(allow_nan=False) refuses them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value
