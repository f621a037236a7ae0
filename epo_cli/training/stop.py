"""Stopping a run cleanly on SIGTERM, SIGINT or SIGUSR1 (a cluster's preemption warning).

    first signal     remembered; the trainer finishes the current step, every rank agrees at the step
                     boundary (max all-reduce of the signal number, so all stop after the same step),
                     checkpoints that completed step, sets status.json to `stopped` (with the signal) and
                     the process exits 128 + signal number (143 SIGTERM, 130 SIGINT, 138 SIGUSR1)
    second signal    exits at once: KeyboardInterrupt (SIGINT) or `Interrupted` unwinds through the
                     `finally` blocks (env workers and JVMs are closed); the last complete checkpoint stays

SLURM sends SIGTERM to every task of a cancelled or preempted job (then SIGKILL after KillWait), and with
`sbatch --signal=USR1@120` SIGUSR1 two minutes before the time limit. A SIGINT that the process inherited
as ignored (a background job of a non-interactive shell) stays ignored; SIGTERM is always handled.

With the deepspeed launcher the ranks run in their own session, so a terminal's Ctrl-C reaches only the
`epo train` process: it relays the request through `<run>/ranks/stop.json` (`write_relay`), which every
rank reads at the step boundary (`requested`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from epo_cli.rundir.received import ReceivedFileError, read_json
from epo_cli.rundir.writable import write_file

#: the signals that ask a run to stop after the current step
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGINT", "SIGUSR1")) if s is not None)
RELAY_FILE = Path("ranks") / "stop.json"


class Interrupted(BaseException):
    """A second stop signal: leave now (a BaseException, like KeyboardInterrupt, so that no `except
    Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by a second {signal_name(signum)}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(signum: int) -> int:
    return 128 + signum


class StopRequest:
    """The process-wide record of a stop signal; `install()` from the main thread before training."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self.on_second: Any = None  # optional callable run before leaving at once (the launcher's kill)

    def install(self, message: str = "stopping after the current step with a checkpoint") -> None:
        self.signum = None
        self._message = message
        for sig in STOP_SIGNALS:
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # started as a background job: Ctrl-C was never meant for this process
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Restore the handlers from before `install()`; after a stop was requested, a further stop signal
        (the process is already writing its outcome and exiting) leaves at once instead, without a traceback."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self.signum is not None:
            leave_at_once_on_stop_signals(exit_code(self.signum))

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if self.on_second is not None:
                self.on_second(signum)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Interrupted(signum)
        self.signum = signum
        # os.write, not print: a handler that prints can interrupt another print on the same stream
        _say(f"{signal_name(signum)} received: {self._message} (send it again to stop at once)")

    def requested(self, run: Path | None = None) -> int | None:
        """This process's signal, else one relayed by the launching process through <run>/ranks/stop.json."""
        if self.signum is not None or run is None:
            return self.signum
        relay = Path(run) / RELAY_FILE
        if relay.exists():
            try:
                return int(read_json(relay, "sweep record", within=Path(run))["signal"])
            except (ReceivedFileError, OSError, ValueError, KeyError, TypeError):
                return int(signal.SIGTERM)  # a half-written (or planted) relay still asks to stop
        return None


def write_relay(run: Path, signum: int) -> None:
    """Ask every rank of the run in `run` to stop after its current step."""
    path = Path(run) / RELAY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps({"signal": int(signum), "name": signal_name(signum)}))


def _say(text: str) -> None:
    try:
        os.write(2, f"\n{text}\n".encode())
    except OSError:
        pass


#: the one record of this process (signal handlers are per process)
STOP = StopRequest()


def leave_at_once_on_stop_signals(exit_code_now: int) -> None:
    """After a command has ended (its outcome written): a stop signal during the interpreter's teardown
    (Ctrl-C pressed again while torch's finalizers run) leaves at once with the command's exit code -- or
    128 + the signal's number where the command succeeded -- instead of a KeyboardInterrupt traceback from
    whichever finalizer was running. A signal ignored since the start stays ignored."""

    def leave(signum: int, frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(exit_code_now or exit_code(signum))

    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, leave)
