"""The stop-signal record (epo_cli.training.stop) in-process: first signal remembered, second leaves at
once, an inherited SIG_IGN for SIGINT respected, the launcher's relay read by every rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from epo_cli.training.stop import Interrupted, StopRequest, exit_code, write_relay


@pytest.fixture
def saved_dispositions():
    """The dispositions a process started from a terminal has (whatever the suite inherited: a background job
    of a non-interactive shell starts with SIGINT ignored), restored afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_first_signal_is_remembered_second_leaves_at_once(saved_dispositions: None) -> None:
    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() == signal.SIGUSR1  # the handler ran; nothing was raised
        with pytest.raises(Interrupted) as err:
            os.kill(os.getpid(), signal.SIGTERM)
        assert err.value.exit_code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()
    assert (exit_code(signal.SIGTERM), exit_code(signal.SIGINT), exit_code(signal.SIGUSR1)) == (143, 130, 138)


def test_an_inherited_ignored_sigint_stays_ignored_sigterm_does_not(saved_dispositions: None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # how a non-interactive shell starts a background job
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop = StopRequest()
    stop.install()
    try:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # restored as it was


def test_the_launchers_relay_reaches_every_rank(tmp_path: Path) -> None:
    stop = StopRequest()
    assert stop.requested(tmp_path) is None
    write_relay(tmp_path, signal.SIGINT)
    assert stop.requested(tmp_path) == signal.SIGINT
    (tmp_path / "ranks" / "stop.json").write_text("{half")  # torn write: still a request to stop
    assert stop.requested(tmp_path) == signal.SIGTERM


#: a process that has ended its command and then gets `signal` while a finalizer runs at exit
_TEARDOWN = """
import atexit, os, signal, sys, time
from epo_cli.training.stop import leave_at_once_on_stop_signals
if {ignore_sigint}:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
def slow_finalizer():
    os.kill(os.getpid(), signal.{signal})
    time.sleep(2)
    print("finalizer ended", flush=True)
atexit.register(slow_finalizer)
leave_at_once_on_stop_signals({code})
sys.exit({code})
"""


@pytest.mark.parametrize("sig, code, ignore_sigint, expected", [
    ("SIGINT", 0, False, 130),     # a succeeded command stopped in its teardown: 128 + SIGINT
    ("SIGINT", 130, False, 130),   # a second Ctrl-C while a stopped run exits: its own code, no traceback
    ("SIGTERM", 3, False, 3),      # the command's failure code is kept
    ("SIGINT", 0, True, 0),        # SIGINT ignored since the start stays ignored: the teardown finishes
])
def test_a_signal_during_teardown_leaves_at_once_without_a_traceback(sig: str, code: int, ignore_sigint: bool,
                                                                      expected: int) -> None:
    import subprocess
    import sys
    script = _TEARDOWN.format(signal=sig, code=code, ignore_sigint=ignore_sigint)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == expected, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert ("finalizer ended" in proc.stdout) == ignore_sigint


def test_a_signal_after_a_requested_stop_leaves_quietly_once_the_handler_is_gone() -> None:
    """The window between the stop handler's removal and the command's end (the run writes `stopped` and
    prints how to resume): a second Ctrl-C there exits with the first signal's code, no traceback."""
    import subprocess
    import sys
    script = """
import os, signal, time
from epo_cli.training.stop import StopRequest
stop = StopRequest()
stop.install()
os.kill(os.getpid(), signal.SIGTERM)   # the first signal: remembered
stop.uninstall()                       # the run has stopped after its step
os.kill(os.getpid(), signal.SIGINT)    # pressed again while the process is ending
time.sleep(2)
print("not reached", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 143, proc.stderr
    assert "Traceback" not in proc.stderr and "not reached" not in proc.stdout
