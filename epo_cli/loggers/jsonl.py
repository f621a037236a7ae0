"""metrics.jsonl: one JSON object per logged step (`{"step": N, "<metric>": value, ...}`).

Written by epo_cli.loggers.logger.MetricsLogger; read back by `epo report`, sweeps and resumed runs.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any


def row_line(step: int, metrics: dict[str, float]) -> str:
    """One line of metrics.jsonl; inf and nan are written as strings (JSON has no such numbers)."""
    return json.dumps({"step": step, **{k: _json_num(v) for k, v in metrics.items()}}) + "\n"


def _parse_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) of every readable line of a metrics.jsonl. A line that is not a JSON object with an
    integer `step` (a write cut short by a kill or a full disk, a hand edit) is skipped with one warning."""
    rows, bad = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
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
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)  # a crash while rewriting leaves the old file, not half of it


def read_metrics(run: Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for _, row in _parse_rows(path)]


def _json_num(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)
