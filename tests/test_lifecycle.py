"""The run lifecycle (epo_cli/launch/lifecycle.py) with a stand-in Trainer: how a run ends maps to one
status.json and one exit code, the stop handler is installed only while it runs, and the fault-injection
seam of checkpoint.save calls its hooks."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from epo_cli.launch.lifecycle import ABANDONED, latest_step, record_stopped, run_training
from epo_cli.rundir.folder import read_status
from epo_cli.training.stop import STOP, Interrupted


class FakeTrainer:
    """What the lifecycle reads of a Trainer: train(), state.step, stop_signal, cfg.trainer.total_steps."""

    def __init__(self, total: int, reach: int, stop_signal: int | None = None,
                 error: BaseException | None = None) -> None:
        self.cfg = SimpleNamespace(trainer=SimpleNamespace(total_steps=total))
        self.state = SimpleNamespace(step=0)
        self.reach, self.stop_signal, self.error = reach, stop_signal, error
        self.handler_installed = False

    def train(self) -> dict[str, float]:
        self.handler_installed = signal.getsignal(signal.SIGTERM) == STOP._handle
        self.state.step = self.reach
        if self.error is not None:
            raise self.error
        return {"loss/policy_clip": 0.5}


def _checkpoint(run: Path, step: int) -> None:
    folder = run / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text(str(step))
    (run / "checkpoints" / "latest").write_text(f"step_{step}")


def _run(tmp_path: Path, trainer: FakeTrainer, **kwargs):
    return run_training(lambda: tmp_path, lambda run: trainer, is_main=kwargs.pop("is_main", True),
                        reports_failure=kwargs.pop("reports_failure", True))


def test_a_finished_run(tmp_path: Path) -> None:
    trainer = FakeTrainer(total=3, reach=3)
    ending = _run(tmp_path, trainer)
    assert trainer.handler_installed and signal.getsignal(signal.SIGTERM) != STOP._handle  # only while running
    assert ending.exit_code == 0 and ending.stop_signal is None and ending.step == 3
    assert ending.metrics == {"loss/policy_clip": 0.5}
    status = read_status(tmp_path)
    assert status["status"] == "finished" and status["step"] == 3


def test_a_run_stopped_by_a_signal_after_a_step(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    ending = _run(tmp_path, FakeTrainer(total=5, reach=2, stop_signal=int(signal.SIGTERM)))
    assert ending.exit_code == 143 and ending.step == 2
    stopped = ending.stopped()
    assert stopped.exit_code == 143 and "SIGTERM: stopped after step 2" in str(stopped)
    assert f"epo train trainer.resume={tmp_path}" in str(stopped)
    status = read_status(tmp_path)
    assert {k: status[k] for k in ("status", "step", "signal", "checkpoint")} == {
        "status": "stopped", "step": 2, "signal": "SIGTERM", "checkpoint": "step_2"}
    assert status["resume"] == f"epo train trainer.resume={tmp_path}" and "abandoned" not in status


def test_a_run_stopped_before_its_first_checkpoint_offers_no_resume(tmp_path: Path) -> None:
    # trainer.resume refuses a folder without a checkpoint: neither the message nor status.json may offer it
    ending = _run(tmp_path, FakeTrainer(total=5, reach=0, stop_signal=int(signal.SIGTERM)))
    message = str(ending.stopped())
    assert "before any checkpoint" in message and "trainer.resume" not in message and "new run_dir" in message
    status = read_status(tmp_path)
    assert status["status"] == "stopped" and status["checkpoint"] is None and status["resume"] is None


def test_a_run_stopped_at_stop_after_is_not_a_signal(tmp_path: Path) -> None:
    ending = _run(tmp_path, FakeTrainer(total=5, reach=2))
    assert ending.exit_code == 0 and ending.stop_signal is None
    status = read_status(tmp_path)
    assert status["status"] == "stopped" and status["step"] == 2 and "signal" not in status


@pytest.mark.parametrize("error,code", [(Interrupted(int(signal.SIGTERM)), 143), (KeyboardInterrupt(), 130)])
def test_a_second_signal_is_recorded_as_abandoned_and_propagates(tmp_path: Path, error: BaseException,
                                                                 code: int) -> None:
    _checkpoint(tmp_path, 1)
    with pytest.raises(type(error)):
        _run(tmp_path, FakeTrainer(total=5, reach=1, error=error))
    status = read_status(tmp_path)
    assert status["status"] == "stopped" and status["abandoned"] == ABANDONED and status["step"] == 1
    assert status["signal"] == ("SIGTERM" if code == 143 else "SIGINT") and status["checkpoint"] == "step_1"


def test_a_failure_is_recorded_where_this_process_reports_failures(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        _run(tmp_path, FakeTrainer(total=5, reach=1, error=ValueError("boom")))
    status = read_status(tmp_path)
    assert status["status"] == "failed" and status["error"] == "ValueError: boom"
    rank = tmp_path / "rank"
    rank.mkdir()
    with pytest.raises(ValueError):  # a rank: the launching process reports it (its `failed` is not written here)
        run_training(lambda: rank, lambda run: FakeTrainer(5, 1, error=ValueError("boom")), is_main=True,
                     reports_failure=False)
    assert read_status(rank)["status"] == "running"


def test_a_failure_to_open_the_run_records_nothing(tmp_path: Path) -> None:
    """Resuming: the checkpoint loads before the run directory is touched; when that fails, it stays as it was."""
    def unusable_checkpoint() -> Path:
        raise RuntimeError("corrupt checkpoint")

    with pytest.raises(RuntimeError):
        run_training(unusable_checkpoint, lambda run: FakeTrainer(5, 5), is_main=True, reports_failure=True)
    assert not (tmp_path / "status.json").exists()


def test_only_the_main_process_writes_the_status(tmp_path: Path) -> None:
    _run(tmp_path, FakeTrainer(total=3, reach=3), is_main=False)
    assert not (tmp_path / "status.json").exists()


def test_record_stopped_and_latest_step(tmp_path: Path) -> None:
    assert latest_step(tmp_path) is None
    _checkpoint(tmp_path, 4)
    assert latest_step(tmp_path) == 4
    record_stopped(tmp_path, int(signal.SIGUSR1), 4, abandoned="why")
    status = read_status(tmp_path)
    assert status["signal"] == "SIGUSR1" and status["abandoned"] == "why" and status["checkpoint"] == "step_4"


def test_checkpoint_save_calls_the_fault_injection_hooks_first(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from epo_cli.training import checkpoint

    def full_disk(run: Path, step: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "SAVE_HOOKS", [full_disk])
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(tmp_path, 3, engine=None, critic_engine=None, payload={}, rank=0, keep=1, best_step=None,
                        algo="grpo")
    assert not (tmp_path / "checkpoints").exists()  # the hook runs before anything is written
