"""Stopping on signals and resuming from every path form, through the real CLI (issue 15 items 1 and 2).

    SIGTERM to a real `epo train` (single process) -> exit 143, status stopped (SIGTERM), a checkpoint of
        the last completed step; `trainer.resume=<run>` then ends with the metrics of an uninterrupted run
    SIGINT once -> exit 130 with a checkpoint; SIGINT twice -> exits at once (130), the step abandoned
    (2 CPU ranks: the same SIGTERM + resume, against an uninterrupted 2-rank run, is in test_distributed.py)
    trainer.resume=<run> | <run>/checkpoints | <run>/checkpoints/latest | <run>/checkpoints/step_N
    a path that is none of these -> exit 2 with the expected forms, nothing written
The signal tests run the real console script (conftest.run_cli, a process to signal); the path forms run
`epo train` in-process (conftest.run_epo: the same CLI without ~10 s of process start per command).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import metrics_rows, run_cli, run_epo, terminal_signal_dispositions

pytestmark = pytest.mark.slow

#: the small RL shape of tests/test_train.py; checkpoints only at the end (or at a stop)
RL_ARGS = ["algo=epo", "env.level=tiny_open_pick_place", "env.prompt_template=compact", "env.max_turns=8",
           "algo.tasks_per_step=2", "algo.group_size=4", "algo.mini_batch_size=512", "algo.micro_batch_size=16",
           "trainer.eval_every=0", "env.eval_splits=[]", "logger.tensorboard=false", "trainer.save_every=0",
           "trainer.total_steps=4"]


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def assert_same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if not key.startswith("perf/"):  # timings
                assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (ra["step"], key)


def start_train(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "epo_cli", "train", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
                            preexec_fn=terminal_signal_dispositions)


def signal_after_first_step(proc: subprocess.Popen, run: Path, signals: list[signal.Signals],
                            timeout: float = 600) -> tuple[int, str]:
    """Send `signals` once metrics.jsonl has its first row; returns (exit code, stderr).

    Each signal but the last is sent only after the process has said it received the one before
    ("SIGINT received: ..."): two signals sent back to back can reach a process as one (a signal that lands
    on a thread other than the main one while the main thread waits in a system call is run once, however
    often it was sent), and a late one can arrive after the run has already stopped."""
    err_chunks: list[str] = []
    readers = [threading.Thread(target=lambda: err_chunks.extend(iter(proc.stderr.readline, "")), daemon=True),
               threading.Thread(target=lambda: proc.stdout.read(), daemon=True)]
    for reader in readers:
        reader.start()
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=60)
            raise AssertionError(f"no first metrics row (exit {proc.poll()})\n{''.join(err_chunks)[-3000:]}")
        time.sleep(0.1)
    for i, sig in enumerate(signals):
        proc.send_signal(sig)
        if i < len(signals) - 1:
            acknowledged = time.monotonic() + 120
            while f"{sig.name} received" not in "".join(err_chunks):
                if proc.poll() is not None or time.monotonic() > acknowledged:
                    proc.kill()
                    raise AssertionError(f"{sig.name} was not acknowledged\n{''.join(err_chunks)[-3000:]}")
                time.sleep(0.01)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the process did not exit after the signal") from None
    for reader in readers:
        reader.join(timeout=60)
    return proc.returncode, "".join(err_chunks)


@pytest.fixture(scope="module")
def straight(warm_start: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference run (4 iterations)."""
    root = tmp_path_factory.mktemp("straight")
    run = root / "run"
    run_cli(["train", *RL_ARGS, f"model.path={warm_start / 'final'}", f"run_dir={run}"], cwd=root)
    return run


def test_sigterm_checkpoints_the_last_step_and_resume_matches(warm_start: Path, straight: Path,
                                                              tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_train([*RL_ARGS, f"model.path={warm_start / 'final'}", f"run_dir={run}"], tmp_path)
    code, err = signal_after_first_step(proc, run, [signal.SIGTERM])
    assert code == 143, err[-3000:]
    assert "Traceback" not in err and f"trainer.resume={run}" in err
    st = status(run)
    assert st["status"] == "stopped" and st["signal"] == "SIGTERM", st
    done = st["step"]
    assert 1 <= done < 4
    # save_every=0: the only checkpoint is the one the stop wrote, of the last completed step
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{done}"
    assert (run / "checkpoints" / f"step_{done}" / "COMPLETE").exists()
    assert [r["step"] for r in metrics_rows(run)] == list(range(1, done + 1))
    assert not (run / "final").exists()

    run_cli(["train", f"trainer.resume={run}"], cwd=tmp_path)
    assert status(run)["status"] == "finished"
    assert_same_metrics(metrics_rows(straight), metrics_rows(run))


@pytest.mark.parametrize("times", [1, 2])
def test_sigint_exits_130(warm_start: Path, tmp_path: Path, times: int) -> None:
    """Once: stop after the step with a checkpoint. Twice: leave at once, the step in progress abandoned."""
    run = tmp_path / "run"
    proc = start_train([*RL_ARGS, f"model.path={warm_start / 'final'}", f"run_dir={run}"], tmp_path)
    code, err = signal_after_first_step(proc, run, [signal.SIGINT] * times)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err
    st = status(run)
    assert st["status"] == "stopped" and st["signal"] == "SIGINT", st
    if times == 1:
        assert (run / "checkpoints" / f"step_{st['step']}" / "COMPLETE").exists()
        assert "abandoned" not in st
    else:
        assert "abandoned" in st
        assert len(metrics_rows(run)) == 1  # the second step was not finished
        assert not (run / "checkpoints" / "latest").exists()  # save_every=0: nothing was saved


# ---- resume from every path a user would pass --------------------------------------------------------------

@pytest.fixture(scope="module")
def two_checkpoints(warm_start: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A grpo run of 2 iterations with a checkpoint after each, stopped there (trainer.stop_after=2 of 3)."""
    root = tmp_path_factory.mktemp("resume_forms")
    run = root / "run"
    args = [a for a in RL_ARGS if not a.startswith(("trainer.save_every", "trainer.total_steps", "algo="))]
    run_epo(["train", "algo=grpo", *args, "trainer.save_every=1", "trainer.total_steps=3", "trainer.stop_after=2",
             f"model.path={warm_start / 'final'}", f"run_dir={run}"], cwd=root)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    return run


def _copy(run: Path, dest: Path) -> Path:
    """A copy of a run (a resume continues in the folder it is given, whatever config.yaml's run_dir says)."""
    import shutil

    shutil.copytree(run, dest, symlinks=True)
    return dest


@pytest.mark.parametrize("form", ["run", "checkpoints", "latest", "step_2", "step_1"])
def test_resume_from_each_path_form(two_checkpoints: Path, tmp_path: Path, form: str) -> None:
    run = _copy(two_checkpoints, tmp_path / "copy")
    given = {"run": run, "checkpoints": run / "checkpoints", "latest": run / "checkpoints" / "latest",
             "step_2": run / "checkpoints" / "step_2", "step_1": run / "checkpoints" / "step_1"}[form]
    before = metrics_rows(run)
    if form == "checkpoints":  # and a kill while a metrics row was written left half a line
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"step": 3, "rollout/succ')
    # from another directory, so nothing could be found relative to the working directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_epo(["train", f"trainer.resume={given}"], cwd=elsewhere)
    assert not list(elsewhere.iterdir()), "a resume must continue the run, not start a new one here"
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:") and "metrics" in line]
    if form == "checkpoints":  # skipped with one warning, and the rewritten file is clean
        assert len(warned) == 1 and "skipped 1 unreadable line (line 3" in warned[0], proc.stderr[-2000:]
    else:
        assert not warned
    start = 1 if form == "step_1" else 2
    assert f"at step {start}" in proc.stdout
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[:start] == before[:start]  # rows up to the checkpoint are kept as they were
    saved = (run / "config.yaml").read_text()
    assert "name: grpo" in saved  # the run's own config (algo=grpo), not the default (epo)
    assert status(run)["status"] == "finished"
    if form == "step_1":  # the abandoned branch's step_2 is kept aside, not mixed into this one
        assert (run / "checkpoints" / "superseded" / "step_2" / "COMPLETE").exists()
        assert (run / "checkpoints" / "latest").read_text().strip() == "step_3"


def test_resume_path_that_is_not_a_run_is_exit_2(two_checkpoints: Path, tmp_path: Path) -> None:
    run = _copy(two_checkpoints, tmp_path / "copy")
    stray = tmp_path / "not_a_run"
    stray.mkdir()
    (run / "checkpoints" / "step_9").mkdir()  # a save that never completed
    (run / "somewhere_inside").mkdir()
    before = sorted(str(p) for p in run.rglob("*"))
    cases = {
        "missing": tmp_path / "nowhere",
        "stray folder": stray,
        "a folder inside the run": run / "somewhere_inside",
        "incomplete step": run / "checkpoints" / "step_9",
    }
    for what, path in cases.items():
        proc = run_epo(["train", f"trainer.resume={path}"], cwd=tmp_path, expect=None)
        assert "Traceback" not in proc.stderr, what
        if what == "incomplete step":
            assert proc.returncode == 1 and "incomplete" in proc.stderr, (what, proc.stderr)
            assert "step_1" in proc.stderr and "step_2" in proc.stderr  # the complete ones are listed
        else:
            assert proc.returncode == 2 and "Pass one of" in proc.stderr and "step_N" in proc.stderr, \
                (what, proc.stderr)
    assert not (tmp_path / "outputs").exists()  # no default-config run was started anywhere
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing in the run was touched


def test_ctrl_c_in_a_sweep_lets_the_running_job_checkpoint(warm_start: Path, tmp_path: Path) -> None:
    """Ctrl-C reaches the whole foreground process group: the sweep waits while its job stops cleanly."""
    out = tmp_path / "out"
    args = [a for a in RL_ARGS if not a.startswith("algo=")]
    proc = subprocess.Popen([sys.executable, "-m", "epo_cli", "sweep", "algo=grpo", "seed=0,1", *args,
                             f"model.path={warm_start / 'final'}", f"output_dir={out}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
                            preexec_fn=terminal_signal_dispositions, start_new_session=True)
    deadline = time.monotonic() + 600
    while not list(out.glob("sweeps/*/*/0-*/metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the sweep did not exit after Ctrl-C") from None
    assert proc.returncode == 130, err[-3000:]
    job = next(out.glob("sweeps/*/*/0-*"))
    st = status(job)
    assert st["status"] == "stopped" and st["signal"] == "SIGINT", st
    assert (job / "checkpoints" / f"step_{st['step']}" / "COMPLETE").exists()
    assert not list(out.glob("sweeps/*/*/1-*"))  # the second job never started
