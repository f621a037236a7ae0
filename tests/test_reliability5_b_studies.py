"""Issue 41, class 6: the studies are user commands, with `epo`'s one-message rule, exit codes and Ctrl-C.

scripts/experiments/exp_long_horizon.py (and the study driver it shares, exp_common.py) was a traceback on
`--continue-from` a study whose run has an empty metrics.jsonl (IndexError) or no perf/lr (KeyError), `--out`
a file or a read-only folder, `--experiment nosuch`, a bad override, and Ctrl-C. Each is now one message and a
non-zero exit (2 for bad options, 1 for a run that cannot be continued, 130 for Ctrl-C), before any folder is
made where the options are at fault. Every row failed on the code before this change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_round4_messages import interrupt_when

from conftest import REPO, read_only_view, terminal_signal_dispositions

SCRIPT = REPO / "scripts" / "experiments" / "exp_long_horizon.py"


def study(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def one_message(proc: subprocess.CompletedProcess, code: int, *texts: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    for text in texts:
        assert text in proc.stderr, (text, proc.stderr[-3000:])


@pytest.fixture
def warm(tmp_path: Path) -> Path:
    (tmp_path / "warm" / "final").mkdir(parents=True)  # the options' checks only look for final/
    return tmp_path / "warm"


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder on a read-only view: a read-only bind mount as root (root ignores permissions), else its mode."""
    source = tmp_path / "source"
    source.mkdir()
    with read_only_view(source, tmp_path / "read_only") as view:
        yield view


OPTION_ERRORS = [
    (["--out", "{file}"], ["is a file, not a folder"]),
    (["--out", "{out}", "--experiment", "nosuch"], ["--experiment nosuch: no such preset", "coin_long_horizon"]),
    (["--out", "{out}", "algo.nosuch=1"], ["the overrides algo.nosuch=1", "Unknown config key 'algo.nosuch'"]),
    (["--out", "{out}", "env.max_turns=abc"], ["the overrides env.max_turns=abc"]),
]


@pytest.mark.parametrize(("args", "texts"), OPTION_ERRORS, ids=[" ".join(a) for a, _ in OPTION_ERRORS])
def test_bad_study_options_are_one_message(args: list[str], texts: list[str], warm: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file")
    args = [a.format(file=tmp_path / "file", out=tmp_path / "out") for a in args]
    proc = study(["--warm-start", str(warm), *args], tmp_path)
    one_message(proc, 2, *texts)
    assert not (tmp_path / "out").exists()


def test_a_read_only_out_is_one_message(read_only_folder: Path, warm: Path, tmp_path: Path) -> None:
    proc = study(["--warm-start", str(warm), "--out", str(read_only_folder / "study")], tmp_path)
    one_message(proc, 2, f"{read_only_folder} is not a writable folder")


METRICS = {
    "empty": ("", "metrics.jsonl is empty"),
    "without perf/lr": ('{"step": 1, "rollout/success": 0.0}\n', "has no positive perf/lr in its last row (got None)"),
    "perf/lr 0": ('{"step": 1, "perf/lr": 0}\n', "has no positive perf/lr in its last row (got 0)"),
    "not JSON": ("{garbage\n", "metrics.jsonl cannot be read (JSONDecodeError"),
}


@pytest.mark.parametrize("case", list(METRICS))
def test_continue_from_a_run_that_cannot_be_continued_is_one_message(case: str, warm: Path, tmp_path: Path) -> None:
    metrics, why = METRICS[case]
    run = tmp_path / "earlier" / "runs" / "grpo" / "it2-seed0" / "2026-01-01" / "10-00-00-grpo"
    (run / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(metrics)
    proc = study(["--warm-start", str(warm), "--out", str(tmp_path / "out"), "--continue-from",
                  str(tmp_path / "earlier"), "--iterations", "4", "--arms", "grpo", "--seeds", "0", "--episodes", "0"],
                 tmp_path)
    one_message(proc, 1, f"cannot continue grpo seed 0: {run / 'metrics.jsonl'}", why)
    assert not (tmp_path / "out" / "runs").exists()  # nothing copied


def test_ctrl_c_in_the_long_horizon_study_is_one_line(warm: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--quick", "--warm-start", str(warm), "--out", str(out)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                            preexec_fn=terminal_signal_dispositions)
    interrupt_when(proc, lambda: any(warm.rglob("*.log")))  # the warm start's evaluation has started
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "interrupted: the long-horizon study stopped" in text, text[-3000:]
