"""metrics.jsonl: one JSON object per logged step (`{"step": N, "<metric>": value, ...}`).

Written by epo_cli.loggers.logger.MetricsLogger; read back by `epo report`, sweeps and resumed runs.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import IO, Any

from epo_cli.rundir.received import loads, read_text
from epo_cli.rundir.writable import open_for_writing, write_file


def row_line(step: int, metrics: dict[str, float]) -> str:
    """One line of metrics.jsonl; inf and nan are written as strings (JSON has no such numbers)."""
    return _dumps({"step": step, **{k: _json_num(v) for k, v in metrics.items()}}) + "\n"


def _dumps(row: dict[str, Any]) -> str:
    import json  # only the writer needs it: the reader goes through received.loads (its nesting cap)

    return json.dumps(row)


def open_metrics(run: Path) -> IO[Any]:
    """<run>/metrics.jsonl opened to append one row, never through a planted symlink, FIFO or hard link
    (epo_cli/rundir/writable.open_for_writing: one message naming it)."""
    return open_for_writing(Path(run) / "metrics.jsonl", append=True)


def _parse_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) of every readable line of a metrics.jsonl, read as bounded data (a regular file inside
    its run, at most its cap: epo_cli/rundir/received.py, else one UserError naming it). A line that is not a
    JSON object with an integer `step` (a write cut short by a kill or a full disk, a hand edit, a nesting
    beyond the cap) is skipped with one warning."""
    rows, bad = [], []
    for n, line in enumerate(read_text(path, "metrics", within=path.parent, errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = loads(line)
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError:  # json.JSONDecodeError is a ValueError
            bad.append(n)
            continue
        rows.append((line, row))
    if bad:
        where = f"line {bad[0]}" if len(bad) == 1 else f"lines {', '.join(map(str, bad[:5]))}" + (
            "..." if len(bad) > 5 else "")
        warnings.warn(f"{path}: skipped {len(bad)} unreadable {'line' if len(bad) == 1 else 'lines'} ({where}: "
                      "truncated or not a JSON object with a 'step')", stacklevel=3)
    return rows


def truncate_metrics_file(run: Path, after_step: int) -> None:
    """Drop metrics.jsonl lines logged after `after_step` (a resumed run re-logs them), and unreadable lines."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return
    kept = [line for line, row in _parse_rows(path) if row["step"] <= after_step]
    # metrics.jsonl.tmp, renamed over it: a crash while rewriting leaves the old file, not half of it
    write_file(path, "".join(line + "\n" for line in kept))


def read_metrics(run: Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for _, row in _parse_rows(path)]


def _json_num(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)
