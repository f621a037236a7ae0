"""The benchmark scripts keep working: each runs in its shrunk CPU mode and prints its ratios.

Figures are not asserted (machines here are noisy); what is checked is that every side ran, timed
something and produced a finite ratio.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.slow
def test_bench_vs_trl_quick(tmp_path: Path, epo_cache: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_vs_trl.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "epo / TRL time per iteration" in proc.stdout
    figures = json.loads(out.read_text())
    for side in ("epo", "trl"):
        # 2 prompts x 2 completions x at most 8 new tokens, at least one token each
        assert 4 <= figures[side]["tokens_per_iter"] <= 32
        assert figures[side]["s_per_iter"] > 0
    assert math.isfinite(figures["ratio_s_per_iter"]) and figures["ratio_s_per_iter"] > 0
