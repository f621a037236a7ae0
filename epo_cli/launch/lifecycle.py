"""A run's lifecycle in one training process: launcher=local (epo_cli.launch.local) and every rank
(epo_cli.launch.rank) call `run_training`, which installs the stop handler, builds and runs the Trainer, and
maps how it ended to status.json and an exit code. Every status a run's processes write goes through
`record_status` (the deepspeed launcher's process writes its own `running`, `failed` and abandoned `stopped`
through it too):

    running    the Trainer is built and trains
    finished   every step trained (final/ holds the policy)                                      exit 0
    stopped    a stop signal (training/stop.py): after the step that completed, with the signal,
               step, the checkpoint holding it and the command that continues      exit 128 + signal
               (+ `abandoned`: a second signal left in the middle of a step)
    failed     an error, with its text (under the deepspeed launcher, its process writes it, naming the rank
               that caused it)                                                           exit non-zero

    ending = run_training(open_run, build, is_main=True, reports_failure=True)
    ending.exit_code, ending.stopped()

Nothing here imports torch: the launching process of a distributed run reads and writes statuses with it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epo_cli.errors import Stopped, UserError
from epo_cli.rundir.checkpoint_paths import disk_error_message, is_disk_error, latest_tag
from epo_cli.rundir.folder import write_status
from epo_cli.training.stop import STOP, Interrupted, exit_code, signal_name

ABANDONED = "a second signal abandoned the step in progress"


def record_status(run: Path, status: str, *, best_effort: bool = False, **fields: Any) -> None:
    """Write <run>/status.json (epo_cli.rundir.folder.write_status). `best_effort`: a failed write (the disk that is
    full) is ignored, so that it does not hide the error or signal being reported."""
    try:
        write_status(run, status, **fields)
    except OSError:
        if not best_effort:
            raise


def record_stopped(run: Path, signum: int | None, step: int | None, abandoned: str | None = None) -> None:
    """status.json `stopped`: the signal (None: trainer.stop_after), the last completed step, the checkpoint
    that holds the run and the command that continues it; `abandoned` says why a step in progress was left
    (best effort then)."""
    tag = latest_tag(run)
    # no checkpoint: nothing to continue (trainer.resume would refuse the folder), so no resume command
    fields: dict[str, Any] = {"step": step, "checkpoint": tag,
                              "resume": f"epo train trainer.resume={run}" if tag else None}
    if signum:
        fields["signal"] = signal_name(signum)
    if abandoned:
        fields["abandoned"] = abandoned
    record_status(run, "stopped", best_effort=abandoned is not None, **fields)


def stopped_message(run: Path, signum: int, step: int) -> str:
    """What `epo train` says when a run stopped on a signal after `step`: where it is and how to continue."""
    tag = latest_tag(run)
    if tag is None:
        return (f"{signal_name(signum)}: stopped before any checkpoint was saved; status.json says `stopped`, and "
                f"there is nothing to continue. Start again in a new run_dir (or remove {run} first).")
    return (f"{signal_name(signum)}: stopped after step {step}; status.json says `stopped`, and the checkpoint "
            f"{run / 'checkpoints' / tag} holds the run. Continue with: epo train trainer.resume={run}")


def latest_step(run: Path) -> int | None:
    """The step of the run's latest complete checkpoint (None: none yet)."""
    tag = latest_tag(run)
    return int(tag.split("_", 1)[1]) if tag and tag.startswith("step_") else None


@dataclass
class Ending:
    """How a training process's run ended, when it ended by itself (finished or stopped by a signal)."""

    run: Path
    metrics: dict[str, float]  # the last step's metrics
    step: int  # steps completed
    #: the signal the run stopped on before its last step (None: it finished, or stopped at trainer.stop_after)
    stop_signal: int | None

    @property
    def exit_code(self) -> int:
        """0, or 128 + the stop signal (143 SIGTERM, 130 SIGINT, 138 SIGUSR1)."""
        return 0 if self.stop_signal is None else exit_code(self.stop_signal)

    def stopped(self) -> Stopped:
        """The error `epo train` raises for a run stopped by a signal: its message says how to continue."""
        assert self.stop_signal is not None
        return Stopped(stopped_message(self.run, self.stop_signal, self.step), self.exit_code)


def run_training(open_run: Callable[[], Path], build: Callable[[Path], Any], *, is_main: bool,
                 reports_failure: bool) -> Ending:
    """One training process's run, start to end:

      1. the stop handler is installed (training/stop.py: the first SIGTERM/SIGINT/SIGUSR1 finishes the step
         and checkpoints it; a second one leaves at once), until this returns;
      2. run = open_run(): the run directory (when resuming, after the checkpoint has loaded: an unusable one
         leaves the directory as it was); nothing is recorded when this fails;
      3. trainer = build(run); status `running`; trainer.train(); status `finished` or `stopped` (main
         process: `is_main`).
    A second signal (Interrupted, KeyboardInterrupt) propagates after `stopped` (abandoned) is recorded by the
    main process; any other error after step 2 after `failed` is recorded, where this process reports
    failures (`reports_failure`; a rank leaves that to the process that launched it)."""
    STOP.install()
    try:
        run = open_run()
        try:
            trainer = build(run)
            if is_main:
                _outside_training(lambda: record_status(run, "running"), run)
            metrics = trainer.train()
            step, stop_signal = trainer.state.step, trainer.stop_signal
            finished = step >= trainer.cfg.trainer.total_steps
            if is_main:
                _outside_training(lambda: record_status(run, "finished", step=step) if finished else
                                  record_stopped(run, stop_signal, step), run)
        except (KeyboardInterrupt, Interrupted) as err:
            if is_main:
                record_stopped(run, err.signum if isinstance(err, Interrupted) else int(signal.SIGINT),
                               latest_step(run), abandoned=ABANDONED)
            raise
        except BaseException as err:
            if reports_failure:
                record_status(run, "failed", best_effort=True, error=f"{type(err).__name__}: {err}")
            raise
    finally:
        STOP.uninstall()
    return Ending(run, metrics, step, None if finished else stop_signal)


def _outside_training(write: Callable[[], None], run: Path) -> None:
    """A status write: a full or read-only disk is the message Trainer.train gives for its own writes."""
    try:
        write()
    except OSError as err:
        if not is_disk_error(err):
            raise
        raise UserError(disk_error_message(run, err)) from None
