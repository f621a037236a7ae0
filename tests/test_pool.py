"""EnvPool semantics with a small deterministic fake suite (no real simulator needed).

The fake env understands a few special actions that make it misbehave on purpose:
"crash" kills its worker process, "hang" never answers, "raise" raises inside step.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.envs.pool import EnvPool, descendant_pids

from conftest import terminal_signal_dispositions


class FakeEnv(Env):
    """Three-step episodes whose text depends only on the task and the actions (and its seed)."""

    def __init__(self) -> None:
        self.task: Task | None = None
        self.rng = random.Random()
        self.turn = 0

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        marker = task.extra.get("crash_once")  # a file: crash the worker the first time only
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(4)
        if task.task_id == "bad":
            raise ValueError("no such game")
        self.task, self.turn = task, 0
        self.rng = random.Random(task.seed)
        return f"start {task.task_id}", self._info(won=False)

    def step(self, action: str) -> StepResult:
        if action == "crash":
            os._exit(3)
        if action == "hang":
            time.sleep(3600)
        if action == "raise":
            raise ValueError("broken env")
        if action == "sleep":  # a slow step, as ALFWorld's
            time.sleep(0.4)
        self.turn += 1
        won = action == "win"
        obs = f"{self.task.task_id} turn {self.turn} did {action} draw {self.rng.random():.6f}"
        return StepResult(obs, 1.0 if won else 0.0, won or self.turn >= 3, self._info(won=won))

    def _info(self, won: bool) -> dict[str, Any]:
        return {"won": won, "lost": False, "task_id": self.task.task_id,
                "admissible_commands": ["win", "wait"], "pid": os.getpid()}


class FakeSuite(EnvSuite):
    name = "fake"

    def make_env(self) -> Env:
        return FakeEnv()

    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        return [Task(f"t{i}", "fake", rng.randrange(1000), split) for i in range(n)]


TASKS = FakeSuite(None).sample_tasks("train", 4, random.Random(0))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _children() -> list[int]:
    """Our descendants, less multiprocessing's resource tracker (one per interpreter, exits with us)."""
    found = []
    for pid in descendant_pids(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except FileNotFoundError:
            continue
        found.append(pid)
    return found


def _no_pid(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k != "pid"}


def _play(pool: EnvPool) -> list[Any]:
    """Reset the four tasks and play a fixed script; everything except pids is recorded."""
    trace: list[Any] = [[(obs, _no_pid(info)) for obs, info in pool.reset(TASKS)]]
    for actions in ({0: "wait", 1: "win", 2: "wait", 3: "wait"}, {0: "wait", 2: "win", 3: "wait"},
                    {0: "win", 3: "wait"}):
        results = pool.step(actions)
        assert list(results) == list(actions)  # answers come back in the order asked
        trace.append({s: (r.observation, r.reward, r.done, _no_pid(r.info)) for s, r in results.items()})
    return trace


@pytest.mark.slow
def test_same_results_whatever_the_number_of_workers() -> None:
    traces = []
    for num_workers in (0, 1, 2):
        with EnvPool(FakeSuite(None), num_workers=num_workers, step_timeout_s=30) as pool:
            traces.append(_play(pool))
            if num_workers == 2:  # slots are spread so both workers play
                pids = {r.info["pid"] for r in pool.step({0: "wait", 1: "wait"}).values()}
                assert len(pids) == 2
    assert traces[0] == traces[1] == traces[2]
    first_step = traces[0][1]
    assert first_step[1][2] is True and first_step[1][1] == 1.0  # "win" ends slot 1 with reward 1
    assert first_step[0][2] is False


@pytest.mark.slow
def test_submit_returns_at_once_and_collect_gathers_in_any_order() -> None:
    """The async half of the API: steps run in the workers while the caller goes on."""
    with EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=30) as pool:
        pool.reset(TASKS)
        reference = {s: (r.observation, r.done) for s, r in pool.step({0: "wait", 1: "wait"}).items()}
        pool.reset(TASKS)
        t0 = time.monotonic()
        pool.submit({0: "sleep", 1: "sleep"})  # one sleeping step in each worker
        assert time.monotonic() - t0 < 0.3  # returned before the 0.4 s steps could end
        pool.submit({2: "wait"})  # slot 2 shares slot 0's worker: it steps after it
        assert pool.in_flight() == [0, 1, 2]
        with pytest.raises(RuntimeError, match="already has a step in flight"):
            pool.submit({0: "wait"})
        with pytest.raises(RuntimeError, match="no step in flight"):
            pool.collect([3])
        first = pool.collect([0, 1, 2], wait_all=False)  # whatever has answered, at least one
        assert first and set(first) <= {0, 1, 2}
        rest = pool.collect([s for s in (0, 1, 2) if s not in first])
        results = {**first, **rest}
        assert pool.in_flight() == []
        elapsed = time.monotonic() - t0
        # the two workers slept at the same time: the busy time is one sleep, not two
        assert 0.4 <= pool.busy_seconds() < min(0.75, elapsed + 0.05)
        # a "sleep" is a "wait" that takes longer: same results as the lock-step call above
        assert {s: (results[s].observation.replace("sleep", "wait"), results[s].done) for s in (0, 1)} == reference
        assert not results[2].done


@pytest.mark.slow
def test_start_reset_answers_through_collect_retries_a_crash_and_raises_env_errors(tmp_path: Path) -> None:
    with EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=30) as pool:
        reference = pool.reset(TASKS)
        tasks = [*TASKS[:3], Task("t3", "fake", TASKS[3].seed, extra={"crash_once": str(tmp_path / "crashed")})]
        pool.start_reset(tasks)  # slot 3's worker dies once, is restarted, and slots 1 and 3 reset again
        assert pool.in_flight() == [0, 1, 2, 3]
        got = pool.collect([0, 1, 2, 3])  # slot 1 answered before the crash, uncollected: reset again too
        assert (tmp_path / "crashed").exists()
        assert [(obs, _no_pid(info)) for obs, info in (got[s] for s in range(4))] == \
            [(obs, _no_pid(info)) for obs, info in reference]
        assert not any(r.done for r in pool.step({0: "wait", 1: "wait", 3: "wait"}).values())
        pool.start_reset([TASKS[0], Task("bad", "fake", 0)])
        with pytest.raises(ValueError, match="no such game"):  # the env's own error, raised by collect
            pool.collect([0, 1])
        assert pool.reset(TASKS)[3][0] == "start t3"  # and the pool is still usable


def test_in_process_submit_steps_at_once() -> None:
    with EnvPool(FakeSuite(None), num_workers=0) as pool:
        pool.reset(TASKS)
        pool.submit({1: "win", 0: "wait"})
        assert pool.in_flight() == [0, 1]
        results = pool.collect([1, 0], wait_all=False)  # in-process: everything is there already
        assert list(results) == [1, 0] and results[1].done and not results[0].done
        assert pool.busy_seconds() > 0


@pytest.mark.slow
def test_killed_worker_truncates_its_episodes_and_is_replaced() -> None:
    with EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=30) as pool:
        pool.reset(TASKS)
        victim = pool.step({0: "wait"})[0].info["pid"]  # slots 0 and 2 live in this worker
        os.kill(victim, signal.SIGKILL)
        results = pool.step({0: "wait", 1: "wait", 2: "wait", 3: "wait"})
        for slot in (0, 2):
            r = results[slot]
            assert r.done and r.reward == 0.0 and r.info["truncated"] is True
            assert "died" in r.info["error"] and r.info["task_id"] == f"t{slot}"
        for slot in (1, 3):
            assert not results[slot].done and "truncated" not in results[slot].info
        # the slots work again after the next reset, on a new worker
        pool.reset(TASKS)
        r = pool.step({0: "wait"})[0]
        assert not r.done and r.info["pid"] != victim
        assert victim not in pool.worker_pids()


@pytest.mark.slow
def test_crash_inside_step_and_env_exception() -> None:
    with EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=30) as pool:
        pool.reset(TASKS)
        results = pool.step({0: "crash", 1: "raise", 2: "wait", 3: "wait"})
        assert results[0].info["truncated"] and "died (exit code 3)" in results[0].info["error"]
        # slot 2 shares the crashed worker; it was stepped after slot 0 and never answered
        assert results[2].info["truncated"]
        # an exception in an env ends only that episode; its worker goes on
        assert results[1].done and "ValueError: broken env" in results[1].info["error"]
        assert not results[3].done
        assert not pool.step({3: "wait"})[3].done


@pytest.mark.slow
def test_hung_worker_times_out_and_is_replaced() -> None:
    with EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=1.0) as pool:
        pool.reset(TASKS)
        hung = pool.step({1: "wait"})[1].info["pid"]
        t0 = time.monotonic()
        results = pool.step({0: "wait", 1: "hang", 2: "wait"})
        assert time.monotonic() - t0 < 10
        assert results[1].done and results[1].info["truncated"] and "within 1s" in results[1].info["error"]
        assert not results[0].done and not results[2].done  # the other worker is unaffected
        assert _wait_gone([hung]) == []
        # slot 3 lived in the hung worker too: its episode is gone, reported at its next step
        r3 = pool.step({3: "wait"})[3]
        assert r3.done and r3.info["truncated"]
        pool.reset(TASKS)
        assert not pool.step({1: "wait"})[1].done


@pytest.mark.slow
def test_reset_retries_a_crashed_worker_once_and_raises_env_errors(tmp_path: Path) -> None:
    with EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=30) as pool:
        tasks = [*TASKS[:2], Task("t2", "fake", 5, extra={"crash_once": str(tmp_path / "crashed")})]
        first = pool.reset(tasks)  # slot 2's worker dies once; the pool restarts it and resets again
        assert [obs for obs, _ in first] == ["start t0", "start t1", "start t2"]
        assert (tmp_path / "crashed").exists()
        assert not any(r.done for r in pool.step({0: "wait", 2: "wait"}).values())
        with pytest.raises(ValueError, match="no such game"):  # the env's own error, raised here
            pool.reset([TASKS[0], Task("bad", "fake", 0)])
        assert pool.reset(TASKS)[3][0] == "start t3"  # and the pool is still usable


def test_in_process_pool_steps_without_workers() -> None:
    with EnvPool(FakeSuite(None), num_workers=0, step_timeout_s=1.0) as pool:
        pool.reset(TASKS[:2])
        results = pool.step({0: "raise", 1: "wait"})
        assert results[0].info["truncated"] and results[1].info["pid"] == os.getpid()
        assert pool.worker_pids() == []
        with pytest.raises(IndexError):
            pool.step({2: "wait"})


@pytest.mark.slow
def test_close_leaves_no_children() -> None:
    # descendants another test left running in this pytest process are not this pool's
    before = set(_children())
    pool = EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=30)
    pool.reset(TASKS)
    pids = pool.worker_pids()
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    pool.close()
    assert _wait_gone(pids, timeout=1.0) == []
    assert set(_children()) - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        pool.reset(TASKS)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_stopping_the_owner_leaves_no_orphans(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_pool import FakeSuite, TASKS
        from epo_cli.envs.pool import EnvPool

        if __name__ == "__main__":
            pool = EnvPool(FakeSuite(None), num_workers=2, step_timeout_s=30)
            pool.reset(TASKS)
            print(*pool.worker_pids(), flush=True)
            time.sleep(600)
    """))
    repo = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    # the owner plays a program started from a terminal, whatever started this suite (`make test &` in a
    # script ignores SIGINT, and the ctrl-c case then waited forever)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                             preexec_fn=terminal_signal_dispositions)
    try:
        workers = [int(p) for p in owner.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        owner.send_signal(sig)  # SIGINT: a KeyboardInterrupt in the owner's main thread
        assert owner.wait(timeout=20) == -sig  # the pool's hooks close it, then the usual exit happens
        assert _wait_gone(workers) == []
    finally:
        owner.kill()
