"""Two runs cannot write one folder (issue 30, class 5): a run (or sweep) directory is owned by one process at
a time (its .epo.lock, epo_cli/rundir/folder.py), and a directory that holds a run is only written again to resume
it. Every refusal names the folder and the fix, and leaves the folder's files as they were.

Each row used to be accepted: `run_dir=<finished run>` overwrote its config and appended to its metrics
([1,2,1,2]), two trains on one run_dir interleaved their metrics, two sweeps on one sweep dir wrote both jobs
into one 0-run, `resume=auto` over a run without a checkpoint appended a fresh run, and `trainer.resume=<run>
run_dir=<other>` ignored run_dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SmallConfig, metrics_rows, one_error, run_epo, terminal_signal_dispositions


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (but its lock) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".epo.lock"}


SFT = SmallConfig().sft()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, epo_cache: Path) -> Path:
    """A finished 2-step SFT run (checkpoints/step_2, final/, metrics of steps 1 and 2)."""
    root = tmp_path_factory.mktemp("finished")
    run_epo(["train", *SFT, f"run_dir={root / 'run'}"], cwd=root)
    return root / "run"


def copy_of(run: Path, target: Path, without: tuple[str, ...] = ()) -> Path:
    import shutil

    shutil.copytree(run, target, ignore=shutil.ignore_patterns(*without))
    return target


@pytest.mark.parametrize("case", ["new run", "resume=auto without a checkpoint", "a folder with other files"])
def test_a_folder_that_holds_something_is_never_reused_for_a_new_run(case: str, finished_run: Path,
                                                                     tmp_path: Path) -> None:
    if case == "new run":
        run = copy_of(finished_run, tmp_path / "run")
        args, texts = [f"run_dir={run}"], ["already holds a run", f"trainer.resume={run}", "another run_dir"]
    elif case == "resume=auto without a checkpoint":
        run = copy_of(finished_run, tmp_path / "run", without=("checkpoints",))
        args, texts = [f"run_dir={run}", "trainer.resume=auto"], ["trainer.resume=auto found no complete "
                                                                  "checkpoint", "new run_dir"]
    else:
        run = tmp_path / "notes"
        run.mkdir()
        (run / "notes.txt").write_text("mine")
        args, texts = [f"run_dir={run}"], ["is not empty", "notes.txt", "another run_dir"]
    before = snapshot(run)
    proc = run_epo(["train", *SFT, *args], cwd=tmp_path, expect=1)
    one_error(proc, str(run), *texts)
    assert snapshot(run) == before


def test_resume_auto_over_an_empty_or_new_folder_starts_the_run(tmp_path: Path, epo_cache: Path) -> None:
    """The decision for resume=auto without a checkpoint: start clean only where nothing was written."""
    (tmp_path / "empty").mkdir()
    for run in (tmp_path / "empty", tmp_path / "new"):
        run_epo(["train", *SFT, f"run_dir={run}", "trainer.resume=auto"], cwd=tmp_path)
        assert (run / "final").is_dir()


def test_resume_with_another_run_dir_is_refused_not_ignored(finished_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    for command in (["train"], ["config", "show"]):
        proc = run_epo([*command, f"trainer.resume={finished_run}", "trainer.total_steps=4", f"run_dir={other}"],
                       cwd=tmp_path, expect=2)
        one_error(proc, f"run_dir={other} cannot apply", str(finished_run), "Drop run_dir=")
    assert not other.exists()
    # the same folder given twice is what it says: no conflict
    run_epo(["config", "show", f"trainer.resume={finished_run}", "trainer.total_steps=4",
             f"run_dir={finished_run}"], cwd=tmp_path)


def test_a_run_dir_that_is_a_file_is_one_message(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run_epo(["train", *SFT, f"run_dir={blocker}"], cwd=tmp_path, expect=1)
    one_error(proc, f"'{blocker}' is a file, not a folder")
    assert blocker.read_text() == "x"


def test_a_sweep_directory_in_use_or_used_is_refused(lock_holder, tmp_path: Path) -> None:
    busy, used = tmp_path / "busy", tmp_path / "used"
    holder = lock_holder(busy)
    proc = run_epo(["sweep", "algo=sft", "seed=0,1", f"hydra.sweep.dir={busy}"], cwd=tmp_path, expect=1)
    one_error(proc, str(busy), "is in use by another epo process", f"pid {holder.pid}")
    used.mkdir()
    (used / "sweep.json").write_text("{}")
    (used / "0-seed-0").mkdir()
    proc = run_epo(["sweep", "algo=sft", "seed=0,1", f"hydra.sweep.dir={used}"], cwd=tmp_path, expect=1)
    one_error(proc, str(used), "already holds 0-seed-0, sweep.json", "another hydra.sweep.dir")
    assert sorted(p.name for p in used.iterdir()) == ["0-seed-0", "sweep.json"]
    assert not any((busy / name).exists() for name in ("sweep.json", "multirun.yaml"))


def test_a_run_dir_in_use_is_refused_also_to_a_resume(lock_holder, finished_run: Path, tmp_path: Path) -> None:
    run = copy_of(finished_run, tmp_path / "run")
    before = snapshot(run)
    holder = lock_holder(run)
    for args in ([f"run_dir={run}"], [f"trainer.resume={run}", "trainer.total_steps=4"]):
        proc = run_epo(["train", *SFT, *args] if args[0].startswith("run_dir") else ["train", *args], cwd=tmp_path,
                       expect=1)
        one_error(proc, str(run), "is in use by another epo process", f"pid {holder.pid}")
    assert snapshot(run) == before


def test_two_trains_on_one_run_dir_at_once_the_second_refuses(tmp_path: Path, epo_cache: Path) -> None:
    """Two real `epo train` processes: the second is refused while the first runs; the first's metrics are
    its own (steps 1..N, once each)."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "epo_cli", "train", *SFT, "trainer.total_steps=30",
                              f"run_dir={run}"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                             preexec_fn=terminal_signal_dispositions)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():  # a step done
            assert first.poll() is None and time.time() < deadline, first.stderr.read()
            time.sleep(0.2)
        second = run_epo(["train", *SFT, f"run_dir={run}"], cwd=tmp_path, expect=1)
        one_error(second, str(run), "is in use by another epo process", f"pid {first.pid}")
    finally:
        first.send_signal(signal.SIGTERM)  # it stops at the end of its step, with a checkpoint
        first.wait(timeout=300)
    steps = [row["step"] for row in metrics_rows(run)]
    assert steps == list(range(1, len(steps) + 1)), steps


def test_the_lock_is_released_when_the_command_ends(finished_run: Path, tmp_path: Path) -> None:
    """Released at the end, leaving no lock file (a stale one, of a killed process, is taken over), and a
    refused new folder that the claim created is removed again with the parents it made."""
    run = copy_of(finished_run, tmp_path / "run")
    before = snapshot(run)
    run_epo(["train", *SFT, f"run_dir={run}"], cwd=tmp_path, expect=1)
    assert not (run / ".epo.lock").exists() and snapshot(run) == before
    (run / ".epo.lock").write_text("pid 1: a process that was killed")
    proc = run_epo(["train", *SFT, f"run_dir={run}"], cwd=tmp_path, expect=1)
    one_error(proc, "already holds a run")  # not "in use": nobody holds that lock
    proc = run_epo(["train", "model.attn_implementation=flash_attention_2", "trainer.device=cpu",
                    f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, expect=1)
    one_error(proc, "flash_attention_2 cannot be used here")
    assert not (tmp_path / "out").exists()
