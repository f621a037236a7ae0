"""EnvPool: many env slots stepped together, in the calling process or in worker processes.

Every env goes through a pool (household too). The rollout sees numbered *slots*: `reset(tasks)` puts
tasks[i] in slot i, `step({slot: action})` advances the slots it names and returns their results.

    num_workers = 0   envs live in the calling process: no IPC at all (the fast, pure-Python household env)
    num_workers = N   N worker processes (spawn context: torch may be loaded in the parent, and fork would
                      copy its threads and memory); slot i lives in worker i % N, so a batch of tasks keeps
                      every worker busy. One `step` sends every worker its actions first and gathers after,
                      so the workers step their slots at the same time.

`step` is `submit` + `collect`. The two halves let a caller overlap env steps with its own work (the
overlapped rollout generates for one wave of slots while the workers step another):

    pool.submit({slot: action})      send the actions, return at once (in-process envs step right here)
    ...                              the caller works; the workers step
    pool.collect(slots)              wait for those slots' results (others may stay in flight)

`start_reset(tasks)` is `reset` without the wait: `collect` then returns each slot's (observation, info) as
its env answers, so the caller can generate for the first envs while the others still reset (ALFWorld:
~1.3 s a game). A slot has at most one step or reset in flight; each worker serves its slots in the order
they were sent. A worker that dies during an asynchronous reset is restarted and the resets it owed are
sent again once, with those it answered that nobody collected yet (slots already collected lose their
episodes, as after any crash).

Faults never lose a run. A worker that dies, or does not answer within `step_timeout_s` for one slot, is
killed (with its children: ScienceWorld's JVMs) and restarted; each episode it held comes back as
`StepResult(done=True, reward=0, info={"truncated": True, "error": why, ...})` and its slots work again after
the next `reset`. An exception raised by an env's `step` ends that episode the same way (with a warning
carrying the traceback); an exception in `reset` (missing data, bad task) is raised in the caller.

Results depend only on the tasks and actions, never on `num_workers`: each slot has its own env, and envs
draw any randomness from their task's seed.

Shutdown leaves no processes behind: `close()` (also via `with`, garbage collection and atexit) asks the
workers to close their envs, then kills whatever is left. Workers ignore Ctrl-C (the terminal sends it to
the whole process group) and let the parent decide: a KeyboardInterrupt in the parent while the pool talks
to its workers closes the pool. SIGTERM to the parent closes all pools first when no other SIGTERM
handler is installed; workers die with their parent (PR_SET_PDEATHSIG on Linux), and the JVMs die when
their worker's pipe closes (py4j's die-on-broken-pipe).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.errors import UserError

log = logging.getLogger(__name__)

#: seconds a new worker may take to import the package and unpickle the suite
START_TIMEOUT_S = 120.0
#: seconds `close()` gives workers to close their envs (JVM shutdown) before killing them
CLOSE_TIMEOUT_S = 10.0


def resolve_num_workers(num_workers: int | None) -> int:
    """`env.num_workers` as a count: None means one worker per CPU."""
    if num_workers is None:
        return os.cpu_count() or 1
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 or None (got {num_workers})")
    return num_workers


def truncated_result(why: str, info: dict[str, Any] | None = None) -> StepResult:
    """The result of an episode cut short by a fault: done, no reward, the reason in info['error']."""
    info = {**(info or {}), "won": False, "lost": False, "truncated": True, "error": why}
    info.setdefault("admissible_commands", [])
    return StepResult(observation="", reward=0.0, done=True, info=info)


def _safe_step(env: Env, action: str) -> tuple[StepResult, str | None]:
    """Step one env; an exception ends the episode (truncated) instead of the run. Returns the traceback."""
    try:
        return env.step(action), None
    except Exception as err:  # noqa: BLE001 - any env bug must not take the other episodes down
        return truncated_result(f"env.step raised {type(err).__name__}: {err}"), traceback.format_exc()


# ----------------------------------------------------------------------------------------------------
# Worker process
# ----------------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (even by SIGKILL), so nothing is orphaned."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except Exception:  # noqa: BLE001 - best effort; EOF on the pipe still ends the worker
        pass


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _portable_exception(err: BaseException) -> BaseException:
    """The exception itself if it survives pickling (keeps UserError a UserError), else a RuntimeError."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")


def make_env(suite: EnvSuite, reads_expert: bool | None) -> Env:
    """One env of `suite`; `reads_expert` tells the suite whether anyone reads the env's expert (None: the
    suite's own default, for suites whose make_env takes no such argument)."""
    return suite.make_env() if reads_expert is None else suite.make_env(reads_expert=reads_expert)


def _worker_main(conn: Connection, suite: EnvSuite, parent_pid: int, reads_expert: bool | None = None,
                 scratch: str | None = None) -> None:
    """Serve one pool: build env slots with `make_env(suite, reads_expert)` and play them as the parent asks.

    Messages in: ("reset", [(slot, task)]), ("step", [(slot, action)]), ("close", None).
    Messages out, one per slot as soon as it is done (so a hang is pinned on the slot that hangs):
    ("reset", slot, obs, info, started, finished) | ("reset_error", slot, exception, traceback) |
    ("step", slot, obs, reward, done, info, traceback_or_None, started, finished) (time.monotonic(): the
    clock is system-wide, so the parent can add up the time its workers spent stepping).
    """
    # The parent decides what Ctrl-C means; SIGTERM (from the parent dying, or from close) unwinds
    # through `finally` so the envs close their JVMs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    if scratch:  # this worker's temp files (ScienceWorld's object trees, ...) go where the parent removes them
        os.environ["TMPDIR"] = tempfile.tempdir = scratch
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    envs: dict[int, Env] = {}
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                command, payload = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            if command == "reset":
                for slot, task in payload:
                    try:
                        started = time.monotonic()
                        if slot not in envs:
                            envs[slot] = make_env(suite, reads_expert)
                        obs, info = envs[slot].reset(task)
                        conn.send(("reset", slot, obs, info, started, time.monotonic()))
                    except Exception as err:  # noqa: BLE001 - raised again in the parent
                        conn.send(("reset_error", slot, _portable_exception(err), traceback.format_exc()))
            elif command == "step":
                for slot, action in payload:
                    started = time.monotonic()
                    env = envs.get(slot)
                    if env is None:  # cannot happen through EnvPool; keep the protocol whole anyway
                        result, tb = truncated_result(f"slot {slot} has no env in this worker"), None
                    else:
                        result, tb = _safe_step(env, action)
                    conn.send(("step", slot, result.observation, result.reward, result.done, result.info, tb,
                               started, time.monotonic()))
            elif command == "close":
                return
    finally:
        for env in envs.values():
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                pass
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass


# ----------------------------------------------------------------------------------------------------
# Process helpers
# ----------------------------------------------------------------------------------------------------


def descendant_pids(pid: int) -> list[int]:
    """All processes below `pid` (children, grandchildren, ...), read from /proc; [] where there is none."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # field 4 (ppid) follows the command name, which is in parentheses and may hold spaces
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        parents[int(entry)] = ppid
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        found.extend(children)
        frontier.extend(children)
    return found


def _kill_tree(process: mp.process.BaseProcess) -> None:
    """SIGKILL a worker and everything it started (JVMs), then reap it."""
    if process.pid is not None and process.is_alive():
        for pid in descendant_pids(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.kill()
    process.join(timeout=5)


class EnvWorkerDied(UserError):
    """A worker died where the pool cannot go on without it (while starting, or resetting the same tasks
    twice): one message for the user (the run is recorded `failed`), never a traceback. Deaths during a step
    only end that worker's episodes (module docstring)."""


def _worker_death_message(why: str, tasks: list[Task]) -> str:
    """`why` with the tasks the worker was resetting, and what to do."""
    names = sorted({f"{t.split}/{t.task_id}" if t.split else str(t.task_id) for t in tasks})
    held = f" while resetting {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" if names else ""
    return (f"{why}{held}, twice. Its own output above (the env's or the interpreter's) says why: a damaged "
            "game or data file, or the machine's memory. Fix: repair or remove what it names and run again.")


class _ResetError:
    """An env's exception from an asynchronous reset, kept until `collect` raises it."""

    def __init__(self, error: BaseException, traceback: str) -> None:
        self.error, self.traceback = error, traceback


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, ctx: Any, suite: EnvSuite, index: int, reads_expert: bool | None = None) -> None:
        self.index = index
        # the worker's temp directory: removed by `kill`, also after a SIGKILL left the worker no time to
        # remove its own temp files
        self.scratch = tempfile.mkdtemp(prefix=f"epo-env-worker-{index}-")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, suite, os.getpid(), reads_expert, self.scratch),
            name=f"epo-env-worker-{index}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()  # the parent's copy; EOF on our end now means the worker died
        self.pid: int | None = None

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            why = "died" if not self.process.is_alive() else f"did not start within {timeout:.0f}s"
            self.kill()
            raise EnvWorkerDied(f"env worker {self.index} {why} while starting (exit code "
                                f"{self.process.exitcode}). Its output above says why (often the machine's "
                                "memory). Fix: fewer env.num_workers, or env.num_workers=0.")
        try:
            tag, self.pid = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise EnvWorkerDied(
                f"env worker {self.index} died while starting (exit code {self.process.exitcode}). Its output "
                "above says why (often the machine's memory). Fix: fewer env.num_workers, or env.num_workers=0."
            ) from None
        assert tag == "ready", tag

    def send(self, message: tuple[str, Any]) -> bool:
        try:
            self.conn.send(message)
            return True
        except (BrokenPipeError, OSError):
            return False

    def kill(self) -> None:
        _kill_tree(self.process)
        self.conn.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# Shutdown hooks shared by all pools
# ----------------------------------------------------------------------------------------------------

_LIVE_POOLS: weakref.WeakSet[EnvPool] = weakref.WeakSet()
_hooks_installed = False


def _close_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        try:
            pool.close(timeout=2.0)
        except Exception:  # noqa: BLE001 - shutting down; close the others
            pass


def _on_sigterm(signum: int, frame: Any) -> None:
    _close_all_pools()
    # Chain to the previous disposition (the default: terminate, with the usual "killed by SIGTERM" status).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    """atexit always; a SIGTERM handler only where nobody installed one (and only the main thread may)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all_pools)
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            pass


# ----------------------------------------------------------------------------------------------------
# The pool
# ----------------------------------------------------------------------------------------------------


class EnvPool:
    """Slots of `suite` envs, in-process (`num_workers=0`) or spread over `num_workers` processes.

    `reads_expert`: whether the caller reads info["expert_action"] (False for RL rollouts: an env whose
    `expert` setting is null then skips computing it); None leaves it to the suite (see make_env)."""

    def __init__(
        self,
        suite: EnvSuite,
        num_workers: int | None,
        step_timeout_s: float = 60.0,
        reset_timeout_s: float | None = None,
        reads_expert: bool | None = None,
    ) -> None:
        self.suite, self.reads_expert = suite, reads_expert
        self.num_workers = resolve_num_workers(num_workers)
        self.step_timeout_s = float(step_timeout_s)
        # A reset may build the env first (ScienceWorld: start a JVM, ~4 s; ALFWorld: ~1.3 s per game).
        default_reset_timeout = max(5 * self.step_timeout_s, 60.0)
        self.reset_timeout_s = float(reset_timeout_s) if reset_timeout_s else default_reset_timeout
        self._envs: list[Env] = []  # num_workers == 0
        self._workers: list[_Worker | None] = [None] * self.num_workers
        self._ctx = mp.get_context("spawn") if self.num_workers else None
        self._tasks: list[Task] = []  # the task in each slot since the last reset
        self._active: list[bool] = []  # slot holds an episode that has not ended
        self._lost: dict[int, str] = {}  # slot -> why its episode died with its worker
        self._in_flight: dict[int, list[int]] = {}  # worker -> slots submitted to it, not yet answered
        self._progress: dict[int, float] = {}  # worker -> when it last answered (or was sent work while idle)
        self._ready: dict[int, StepResult] = {}  # results received, not yet collected
        self._busy: list[tuple[float, float]] = []  # (start, end) of each env step since the last reset
        self._resetting: dict[int, int] = {}  # slot -> how often its asynchronous reset was sent before
        self._closed = False
        if self.num_workers:
            _install_hooks()
            _LIVE_POOLS.add(self)

    # -- public API ------------------------------------------------------------------------------------

    def worker_pids(self) -> list[int]:
        """Pids of the running workers (for diagnostics and tests)."""
        return [w.process.pid for w in self._workers if w is not None and w.process.pid is not None]

    def reset(self, tasks: list[Task]) -> list[tuple[str, dict[str, Any]]]:
        """Start tasks[i] in slot i; return each slot's first observation and info."""
        self._check_open()
        if self.in_flight():  # steps of the previous episodes nobody collected (a rollout cut short)
            self.collect(self.in_flight())
        tasks = list(tasks)
        self._tasks = tasks
        self._busy = []
        self._active = [True] * len(tasks)
        self._lost.clear()
        if not self.num_workers:
            while len(self._envs) < len(tasks):
                self._envs.append(make_env(self.suite, self.reads_expert))
            return [self._envs[i].reset(task) for i, task in enumerate(tasks)]
        results, error = self._guarded(self._reset_workers, tasks)
        if error is not None:  # the exchange itself went fine: the pool stays usable
            raise error
        return results

    def start_reset(self, tasks: list[Task]) -> None:
        """`reset` without waiting: `collect(slots)` returns each slot's (observation, info) and raises an
        env's reset error (missing data, bad task) when it reads it. In-process envs reset here."""
        self._check_open()
        if self.in_flight():
            self.collect(self.in_flight())
        self._tasks = list(tasks)
        self._busy = []
        self._active = [True] * len(self._tasks)
        self._lost.clear()
        if not self.num_workers:
            started = time.monotonic()
            for slot, (obs, info) in enumerate(self.reset(self._tasks)):
                self._ready[slot] = (obs, info)
            self._busy.append((started, time.monotonic()))  # as the workers' resets count, in busy_seconds
            return
        self._resetting = {}
        self._guarded(self._send_resets, dict(enumerate(self._tasks)))

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        """Apply `actions[slot]` in each named slot, all workers at once; return the results by slot."""
        self.submit(actions)
        return self.collect(list(actions))

    def submit(self, actions: dict[int, str]) -> None:
        """Send `actions[slot]` to each named slot's worker and return without waiting for the results
        (`collect` gets them). In-process envs (num_workers=0) step here, before returning."""
        self._check_open()
        for slot in actions:
            if not 0 <= slot < len(self._tasks):
                raise IndexError(f"slot {slot} was not reset (the pool has {len(self._tasks)} slots)")
            if slot in self._ready or any(slot in slots for slots in self._in_flight.values()):
                raise RuntimeError(f"slot {slot} already has a step in flight; collect it first")
        if self.num_workers:
            self._reap_dead_workers()
        todo: dict[int, str] = {}
        for slot in sorted(actions):
            if slot in self._lost:  # its worker died while it was waiting for this action
                self._finish(slot, truncated_result(self._lost.pop(slot), self._task_info(slot)))
            else:
                todo[slot] = actions[slot]
        if not self.num_workers:
            for slot, action in todo.items():
                started = time.monotonic()
                result, tb = _safe_step(self._envs[slot], action)
                self._busy.append((started, time.monotonic()))
                if tb:
                    log.warning("env slot %d: %s\n%s", slot, result.info["error"], tb)
                self._finish(slot, result)
        elif todo:
            self._guarded(self._submit_to_workers, todo)

    def collect(self, slots: list[int], wait_all: bool = True) -> dict[int, Any]:
        """Wait for the results of `slots` (each submitted and not yet collected); return them by slot, in
        the order asked. Results of other slots that arrive meanwhile are kept for their own `collect`.

        wait_all=False: wait until at least one of `slots` has its result, then return those that have
        (answers already queued in the pipes are read first, so this returns everything that is done).
        """
        self._check_open()
        for slot in slots:
            if slot not in self._ready and not any(slot in s for s in self._in_flight.values()):
                raise RuntimeError(f"slot {slot} has no step in flight; submit it first")
        if self.num_workers and any(slot not in self._ready for slot in slots):
            self._guarded(self._receive_until, set(slots), wait_all)
        results = {slot: self._ready.pop(slot) for slot in slots if slot in self._ready}
        for slot, result in results.items():
            if isinstance(result, _ResetError):  # the pool stays usable, as after a failed `reset`
                err = result.error
                if hasattr(err, "add_note"):
                    err.add_note(f"(raised in an env worker while resetting slot {slot})\n{result.traceback}")
                raise err
        return results

    def busy_seconds(self) -> float:
        """Wall time since the last reset during which at least one env was stepping (the union of every
        step's interval over all workers): the env time a rollout would spend if nothing overlapped it."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self._busy):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    def in_flight(self) -> list[int]:
        """Slots submitted and not yet collected."""
        return sorted({*self._ready, *(slot for slots in self._in_flight.values() for slot in slots)})

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Close every env and worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE_POOLS.discard(self)
        for env in self._envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - close the others
                log.warning("closing an env failed", exc_info=True)
        self._envs = []
        self._in_flight, self._ready, self._resetting = {}, {}, {}
        workers = [w for w in self._workers if w is not None]
        self._workers = [None] * self.num_workers
        # Ask all first, then wait: the workers close their JVMs in parallel.
        for w in workers:
            if w.process.is_alive():
                w.send(("close", None))
        deadline = time.monotonic() + timeout
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            w.kill()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=2.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn modules down
            pass

    # -- internals -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EnvPool is closed")

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """Run an exchange with the workers; if it is interrupted (Ctrl-C, a bug), the pipes may hold
        half a conversation, so close the pool rather than leave it in a state nobody can reason about."""
        try:
            return fn(*args)
        except BaseException:
            self.close(timeout=2.0)
            raise

    def _task_info(self, slot: int) -> dict[str, Any]:
        task = self._tasks[slot]
        return {"task_id": task.task_id, "task_type": task.task_type}

    def _worker_of(self, slot: int) -> int:
        return slot % self.num_workers

    def _start_workers(self, indices: list[int]) -> dict[int, _Worker]:
        """Start (or reuse) workers; new ones start in parallel and are awaited together."""
        fresh = []
        for i in indices:
            worker = self._workers[i]
            if worker is None or not worker.process.is_alive():
                if worker is not None:
                    worker.kill()
                self._workers[i] = _Worker(self._ctx, self.suite, i, self.reads_expert)
                fresh.append(self._workers[i])
        for worker in fresh:
            worker.wait_ready(START_TIMEOUT_S)
        return {i: self._workers[i] for i in indices}  # type: ignore[misc]

    def _reap_dead_workers(self) -> None:
        """Notice workers that died between calls (killed from outside), so their episodes are reported."""
        for index, worker in enumerate(self._workers):
            # a worker with steps in flight may have answered before it died: `_receive_until` reads those
            if worker is not None and not worker.process.is_alive() and not self._in_flight.get(index):
                self._restart(index, f"env worker {index} died (exit code {worker.process.exitcode})")

    def _restart(self, index: int, why: str) -> None:
        """Drop a dead or hung worker (a fresh one starts at its next exchange); the other live episodes
        it held died with it and end, truncated, at their next step."""
        log.warning("%s; restarting it", why)
        worker = self._workers[index]
        if worker is not None:
            worker.kill()
        self._workers[index] = None
        for slot in range(len(self._tasks)):
            if self._worker_of(slot) == index and self._active[slot]:
                self._lost[slot] = why

    def _exchange(
        self, command: str, by_worker: dict[int, list[tuple[int, Any]]], timeout: float
    ) -> tuple[dict[int, tuple], dict[int, list[int]], dict[int, str]]:
        """Send each worker its part, then gather one answer per slot.

        Returns (answers by slot, slots without an answer by worker, why each of those workers failed).
        A worker fails when it dies or when `timeout` passes without its next answer; it is killed here.
        """
        workers = self._start_workers(sorted(by_worker))
        pending: dict[int, list[int]] = {}
        failed: dict[int, str] = {}
        for index, items in by_worker.items():
            pending[index] = [slot for slot, _ in items]
            if not workers[index].send((command, items)):
                failed[index] = f"env worker {index} died (its pipe broke)"
        deadline = {index: time.monotonic() + timeout for index in pending}
        answers: dict[int, tuple] = {}
        waiting = {index for index in pending if index not in failed}
        while waiting:
            now = time.monotonic()
            next_deadline = min(deadline[index] for index in waiting)
            handles: dict[Any, int] = {}
            for index in waiting:
                handles[workers[index].conn] = index
                handles[workers[index].process.sentinel] = index
            ready = wait(list(handles), timeout=max(0.0, next_deadline - now))
            for handle in ready:
                index = handles[handle]
                if index not in waiting:
                    continue
                conn = workers[index].conn
                try:
                    # drain everything this worker has sent (its sentinel may fire with answers still queued)
                    while pending[index] and conn.poll():
                        message = conn.recv()
                        slot = message[1]
                        answers[slot] = message
                        pending[index].remove(slot)
                        deadline[index] = time.monotonic() + timeout
                except (EOFError, OSError):
                    pass
                if not pending[index]:
                    waiting.discard(index)
                elif not workers[index].process.is_alive():
                    code = workers[index].process.exitcode
                    failed[index] = f"env worker {index} died (exit code {code})"
                    waiting.discard(index)
            now = time.monotonic()
            for index in list(waiting):
                if now >= deadline[index]:
                    slot = pending[index][0]
                    failed[index] = f"env worker {index} gave no answer for slot {slot} within {timeout:g}s"
                    waiting.discard(index)
        for index in failed:
            workers[index].kill()
        return answers, {i: pending[i] for i in failed}, failed

    def _split(self, items: dict[int, Any]) -> dict[int, list[tuple[int, Any]]]:
        by_worker: dict[int, list[tuple[int, Any]]] = {}
        for slot in sorted(items):
            by_worker.setdefault(self._worker_of(slot), []).append((slot, items[slot]))
        return by_worker

    def _reset_workers(
        self, tasks: list[Task]
    ) -> tuple[list[tuple[str, dict[str, Any]]], BaseException | None]:
        """Reset every slot; returns the results, or the first exception an env raised (traceback noted)."""
        by_worker = self._split(dict(enumerate(tasks)))
        answers, _, failed = self._exchange("reset", by_worker, self.reset_timeout_s)
        if failed:
            # A restarted worker lost every env it held, even those reset a moment ago: redo its whole part.
            for index, why in failed.items():
                log.warning("%s during reset; restarting it and retrying its resets once", why)
                self._workers[index] = None
            retry = {index: by_worker[index] for index in failed}
            again, _, failed_again = self._exchange("reset", retry, self.reset_timeout_s)
            if failed_again:
                index = min(failed_again)
                raise EnvWorkerDied(_worker_death_message(
                    failed_again[index], [task for _, task in retry[index]]))
            answers.update(again)
        errors = [answers[slot] for slot in range(len(tasks)) if answers[slot][0] == "reset_error"]
        if errors:
            _, slot, err, tb = errors[0]
            if hasattr(err, "add_note"):
                err.add_note(f"(raised in an env worker while resetting slot {slot})\n{tb}")
            return [], err
        return [(answers[slot][2], answers[slot][3]) for slot in range(len(tasks))], None

    def _finish(self, slot: int, result: StepResult) -> None:
        self._ready[slot] = result
        if result.done:
            self._active[slot] = False

    def _submit_to_workers(self, actions: dict[int, str]) -> None:
        by_worker = self._split(actions)
        workers = self._start_workers(sorted(by_worker))
        for index, items in by_worker.items():
            if not self._in_flight.get(index):
                self._progress[index] = time.monotonic()  # its clock starts now, not at its last answer
            self._in_flight.setdefault(index, []).extend(slot for slot, _ in items)
            if not workers[index].send(("step", items)):
                self._fail_worker(index, f"env worker {index} died (its pipe broke)")

    def _send_resets(self, tasks: dict[int, Task]) -> None:
        by_worker = self._split(tasks)
        workers = self._start_workers(sorted(by_worker))
        for index, items in by_worker.items():
            for slot, _ in items:
                self._resetting[slot] = self._resetting.get(slot, -1) + 1
            if not self._in_flight.get(index):
                self._progress[index] = time.monotonic()
            self._in_flight.setdefault(index, []).extend(slot for slot, _ in items)
            if not workers[index].send(("reset", items)):
                self._fail_worker(index, f"env worker {index} died (its pipe broke)")

    def _receive_until(self, wanted: set[int], wait_all: bool = True) -> None:
        """Read answers from the workers until every slot in `wanted` has a result (wait_all=False: one).

        A worker fails when it dies, or when `step_timeout_s` passes without its next answer: it is killed,
        the slots it still owed end truncated, and its other live episodes end at their next step.
        """
        def timeout_of(index: int) -> float:  # a reset may build its env first: it gets longer
            return self.reset_timeout_s if self._in_flight[index][0] in self._resetting else self.step_timeout_s

        first = True
        while any(slot not in self._ready for slot in wanted):
            if not wait_all and not first and any(slot in self._ready for slot in wanted):
                return
            busy = [index for index, slots in self._in_flight.items() if slots]
            if not busy:
                raise RuntimeError(f"slots {sorted(wanted - set(self._ready))} have no step in flight")
            handles: dict[Any, int] = {}
            for index in busy:
                worker = self._workers[index]
                handles[worker.conn] = index
                handles[worker.process.sentinel] = index
            next_deadline = min(self._progress[index] + timeout_of(index) for index in busy)
            # the first pass only reads what is already there (so wait_all=False returns all of it)
            ready = wait(list(handles), timeout=0.0 if first else max(0.0, next_deadline - time.monotonic()))
            first = False
            for index in sorted({handles[h] for h in ready}):
                if not self._in_flight.get(index):
                    continue
                worker = self._workers[index]
                try:
                    # drain everything this worker has sent (its sentinel may fire with answers still queued)
                    while self._in_flight[index] and worker.conn.poll():
                        message = worker.conn.recv()
                        tag, slot = message[0], message[1]
                        self._in_flight[index].remove(slot)
                        self._progress[index] = time.monotonic()
                        if tag == "step":
                            _, _, obs, reward, done, info, tb, started, finished = message
                            self._busy.append((started, finished))
                            if tb:
                                log.warning("env slot %d: %s\n%s", slot, info.get("error"), tb)
                            self._finish(slot, StepResult(obs, reward, done, info))
                        elif tag == "reset":
                            _, _, obs, info, started, finished = message
                            self._busy.append((started, finished))
                            self._resetting.pop(slot, None)
                            self._ready[slot] = (obs, info)
                        else:  # reset_error
                            self._resetting.pop(slot, None)
                            self._ready[slot] = _ResetError(message[2], message[3])
                except (EOFError, OSError):
                    pass
                if self._in_flight[index] and not worker.process.is_alive():
                    self._fail_worker(index, f"env worker {index} died (exit code {worker.process.exitcode})")
            now = time.monotonic()
            for index in busy:
                if self._in_flight.get(index) and now >= self._progress[index] + timeout_of(index):
                    slot, timeout = self._in_flight[index][0], timeout_of(index)
                    self._fail_worker(index, f"env worker {index} gave no answer for slot {slot} within {timeout:g}s")

    def _fail_worker(self, index: int, why: str) -> None:
        """The steps a dead or hung worker still owed end truncated now; then it is restarted, and the
        asynchronous resets it owed are sent again, once."""
        retry: dict[int, Task] = {}
        for slot in self._in_flight.pop(index, []):
            if slot in self._resetting:
                if self._resetting[slot] >= 1:
                    raise EnvWorkerDied(_worker_death_message(why, [self._tasks[slot]]))
                retry[slot] = self._tasks[slot]
            else:
                self._finish(slot, truncated_result(why, self._task_info(slot)))
        for slot, answer in list(self._ready.items()):  # resets it answered that nobody collected yet
            if self._worker_of(slot) == index and isinstance(answer, tuple):
                retry[slot] = self._tasks[slot]
                del self._ready[slot]
        self._restart(index, why)
        if retry:
            for slot in retry:
                self._lost.pop(slot, None)  # its reset is redone on the fresh worker
            self._send_resets(retry)
