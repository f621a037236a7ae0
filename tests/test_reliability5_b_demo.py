"""Issue 41, class 6: `make demo` run again continues or starts over, says which first, and never fails because
it ran before.

A second `make demo` (or one after an interrupted demo) used to spend ~3 minutes on a new warm start, then exit
2 with "expected one run under outputs/demo/warm_start, found 2: use a fresh --out" (`make demo` takes no --out).
Now the demo first says, for each stage, what it does with what it finds: a finished run (and its evaluation)
is reused, an interrupted run with a checkpoint is continued, anything else is moved aside and that stage starts
over. Shrunk (--quick): one demo, then the reruns. Every assertion on a rerun failed on the code before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "demo.py"


def demo(out: Path, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


def stage_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines that say what the demo does with each stage, before anything runs."""
    head = proc.stdout.split("$ epo", 1)[0]
    return [line for line in head.splitlines() if line.startswith(("warm start:", "GRPO:", "EPO:"))]


@pytest.mark.slow
def test_a_rerun_reuses_continues_or_starts_over_and_says_which_first(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    first = demo(out, tmp_path)
    assert stage_lines(first) == ["warm start: trains a new run", "GRPO: trains a new run", "EPO: trains a new run"]
    summary = json.loads((out / "summary.json").read_text())

    # run again: every run and evaluation reused, the same table, nothing trained
    again = demo(out, tmp_path)
    assert [line.split(" /")[0] for line in stage_lines(again)] == [
        "warm start: reuses the finished run", "GRPO: reuses the finished run", "EPO: reuses the finished run"]
    assert "$ epo" not in again.stdout
    assert json.loads((out / "summary.json").read_text())["success"] == summary["success"]

    # an RL arm interrupted before its first checkpoint: moved aside, trained again; the rest reused
    grpo = Path(summary["runs"]["grpo"])
    shutil.rmtree(grpo / "final")
    shutil.rmtree(grpo / "checkpoints", ignore_errors=True)
    (grpo / "status.json").write_text('{"status": "stopped"}')
    partial = demo(out, tmp_path)
    lines = stage_lines(partial)
    assert lines[0].startswith("warm start: reuses") and lines[2].startswith("EPO: reuses"), lines
    assert lines[1].startswith("GRPO: starts over in a fresh folder (it stopped before its first checkpoint"), lines
    assert [p.name for p in out.glob("grpo.old-*")] and (out / "grpo").is_dir()
    assert partial.stdout.count("$ epo train") == 1 and "$ epo eval" in partial.stdout
    new_grpo = Path(json.loads((out / "summary.json").read_text())["runs"]["grpo"])
    assert (new_grpo / "final").is_dir() and new_grpo != grpo


def test_what_a_rerun_does_with_each_stage_folder(tmp_path: Path) -> None:
    """find_stage on the folders an earlier demo leaves (no training: the runs are their files only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    spec.loader.exec_module(script)

    def run(root: Path, name: str, status: str, model_path: str | None = None, checkpoint: bool = False,
            final: bool = False) -> Path:
        folder = root / "2026-01-01" / name
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(f"model:\n  path: {model_path or 'null'}\ntrainer:\n  total_steps: 4\n")
        (folder / "status.json").write_text(json.dumps({"status": status}))
        if final:
            (folder / "final").mkdir()
        if checkpoint:
            (folder / "checkpoints" / "step_2").mkdir(parents=True)
            (folder / "checkpoints" / "latest").write_text("step_2")
        return folder

    warm = run(tmp_path / "warm_start", "a", "finished", final=True)
    assert script.find_stage(tmp_path / "nothing").action == "fresh"
    assert (script.find_stage(tmp_path / "warm_start").action, script.find_stage(tmp_path / "warm_start").run) == \
        ("reuse", warm)
    resumable = run(tmp_path / "grpo", "b", "stopped", model_path=str(warm / "final"), checkpoint=True)
    assert script.find_stage(tmp_path / "grpo", warm / "final").action == "resume"
    assert script.find_stage(tmp_path / "grpo", warm / "final").run == resumable
    done = run(tmp_path / "ppo", "f", "running", model_path=str(warm / "final"), checkpoint=True)
    (done / "checkpoints" / "latest").write_text("step_4")  # at its last step: nothing to resume
    assert "its final policy is missing" in script.find_stage(tmp_path / "ppo", warm / "final").why
    run(tmp_path / "epo", "c", "finished", model_path="/another/warm/final", final=True)
    other = script.find_stage(tmp_path / "epo", warm / "final")
    assert other.action == "again" and "not from this warm start" in other.why
    run(tmp_path / "warm_start", "d", "running")
    two = script.find_stage(tmp_path / "warm_start")
    assert two.action == "again" and two.why == "it holds 2 runs, not one"
    (tmp_path / "damaged" / "2026-01-01" / "e").mkdir(parents=True)
    (tmp_path / "damaged" / "2026-01-01" / "e" / "config.yaml").write_text("{unclosed")
    assert script.find_stage(tmp_path / "damaged").why == "its config.yaml cannot be read"
    script.clear_stage(two)
    assert not (tmp_path / "warm_start").exists() and len(list(tmp_path.glob("warm_start.old-*"))) == 1


@pytest.mark.slow
def test_the_demo_warm_start_plays_the_tokens_the_readme_was_measured_with(tmp_path: Path) -> None:
    """The warm start shrunk to DIGEST_STEPS steps and evaluated as the demo evaluates: its played episodes'
    digest is the one recorded with the README's table (a change that moves the demo's tokens fails here; the
    kernels are the demo's pinned AVX2 ones, so any AVX2 machine computes the same)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    if not script.has_avx2():
        pytest.skip("the demo's kernels are pinned to AVX2, which this CPU lacks: its tokens are its own")
    env = script.pin_kernels({k: v for k, v in os.environ.items() if k not in script.PINNED_KERNELS})

    def epo(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=tmp_path, env=env, check=True,
                       capture_output=True, timeout=900)

    epo("train", f"experiment={script.WARM_PRESET}", f"trainer.total_steps={script.DIGEST_STEPS}",
        "trainer.eval_every=0", "env.eval_splits=[]", "logger.tensorboard=false",
        f"model.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'warm'}")
    run = next((tmp_path / "warm").glob("*/*"))
    epo("eval", f"run={run}", f"episodes={script.DIGEST_EPISODES}", "temperature=1.0", "seed=0",
        "split=eval_in_distribution", "env.level=tiny_open_pick_place", "env.max_turns=15", f"out={tmp_path / 'eval'}")
    assert script.played_digest(tmp_path / "eval") == script.WARM_START_DIGEST
