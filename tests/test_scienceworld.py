"""env=scienceworld with the real simulator (Java). Each env starts its own JVM (~4 s), so few are started."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from epo_cli.envs.base import Task
from epo_cli.envs.pool import EnvPool, descendant_pids
from epo_cli.envs.scienceworld import STAGES, ScienceWorldConfig, ScienceWorldSuite, java_problem
from epo_cli.errors import ConfigError, UserError

pytest.importorskip("scienceworld", reason="scienceworld is not installed (pip install 'epo[envs]')")

# short gold paths (6 and 11 actions with the easy simplification)
TASKS = ["lifespan-longest-lived", "power-component"]


def _suite(**overrides) -> ScienceWorldSuite:
    return ScienceWorldSuite(ScienceWorldConfig(tasks=TASKS, **overrides))


def test_missing_java_gives_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without java
    assert java_problem() == "`java` was not found on PATH"
    with pytest.raises(UserError) as err:
        _suite().check()
    message = str(err.value)
    assert "Java" in message and "PATH" in message and "openjdk-17" in message and "java -version" in message


def test_rollouts_skip_the_gold_path_unless_it_is_read() -> None:
    """env.expert=null (the default): gold paths are generated where they are read, not in RL rollouts."""
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite

    cfg = compose(["env=scienceworld"])
    assert cfg.env.expert is None
    suite = make_suite(cfg.env)
    assert suite.make_env().use_expert is True  # no JVM yet: it starts at the first reset
    assert suite.make_env(reads_expert=False).use_expert is False
    forced = compose(["env=scienceworld", "env.expert=true"])
    assert make_suite(forced.env).make_env(reads_expert=False).use_expert is True


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="Valid tasks: boil"):
        ScienceWorldSuite(ScienceWorldConfig(tasks=["boil-the-ocean"])).check()
    with pytest.raises(ConfigError, match="sparse, dense"):
        _suite(reward="shaped").check()
    assert ScienceWorldSuite(ScienceWorldConfig(tasks=["1-1"])).task_names() == ["boil"]
    assert len(ScienceWorldSuite(ScienceWorldConfig()).task_names()) == 30


def test_suite_interface_for_curricula_and_subgoal_rewards() -> None:
    # configured tasks: one level each, in the order given and as written
    assert ScienceWorldSuite(ScienceWorldConfig(tasks=["find-animal", "1-1"])).curriculum_levels() == \
        ["find-animal", "1-1"]
    # all tasks: the four stages, which name every ScienceWorld task exactly once
    everything = ScienceWorldSuite(ScienceWorldConfig())
    stages = everything.curriculum_levels()
    assert stages == [",".join(group) for group in STAGES] and len(stages) == 4
    names = [name for level in stages for name in level.split(",")]
    assert sorted(names) == sorted(everything.task_names()) and len(names) == 30
    assert everything.levels() == []  # no named levels: the stages are only a curriculum's default ladder
    # progress events need the dense reward; with it there is nothing to fix
    assert everything.reports_subgoals
    with pytest.raises(ConfigError, match="env.reward=dense"):
        everything.check_subgoal_rewards()
    _suite(reward="dense").check_subgoal_rewards()


@pytest.mark.realenv
@pytest.mark.slow
def test_two_tasks_gold_path_wins_and_wrong_focus_loses() -> None:
    suite = _suite(reward="dense")
    suite.check()
    # variation splits come from ScienceWorld's API (train < dev < test ranges for these tasks)
    saved = os.environ.get("JAVA_TOOL_OPTIONS")
    table = suite.variations()  # starts a JVM in this process
    assert os.environ.get("JAVA_TOOL_OPTIONS") == saved  # set for the JVM's start only
    for name in TASKS:
        train, dev, test = (set(table[name][s]) for s in ("train", "eval_in_distribution",
                                                            "eval_out_of_distribution"))
        assert train and dev and test and not (train & dev or train & test or dev & test)
    tasks = suite.sample_tasks("eval_out_of_distribution", 2, random.Random(0))
    assert sorted(t.task_type for t in tasks) == sorted(TASKS)
    for t in tasks:
        assert int(t.task_id.split("/")[1]) in table[t.task_type]["eval_out_of_distribution"]

    env = suite.make_env()
    try:
        for task in tasks:
            obs, info = env.reset(task)
            assert obs and info["goal"].startswith("Your task is to")
            assert info["task_type"] == task.task_type and info["task_id"] == task.task_id
            assert 0 < len(info["admissible_commands"]) <= 50 and "look around" in info["admissible_commands"]
            assert "focus on OBJ" in info["action_templates"] and info["objects"]
            subgoals, turns = [], 0
            while True:
                result = env.step(info["expert_action"])
                info, turns = result.info, turns + 1
                subgoals += info["subgoals"]
                if result.done:
                    break
            assert info["won"] and not info["lost"] and result.reward == 1.0 and info["score"] == 100
            assert info["progress"] == 1.0 and subgoals  # dense: goal items were reported as reached
            assert turns < 30

        # leaving the gold path ends the expert's advice; a wrong `focus on` loses the episode
        _, info = env.reset(tasks[0])
        result = env.step("inventory")
        assert result.info["expert_action"] is None and not result.done
        wrong = next(a for a in result.info["admissible_commands"] if a.startswith("focus on"))
        result = env.step(wrong)
        assert result.done and result.info["lost"] and not result.info["won"] and result.reward == 0.0
        assert result.info["score"] == -100
        # the agent may not restart the simulation under the env
        env.reset(tasks[0])
        assert env.step("reset task").observation == "No known action matches that input."
    finally:
        env.close()


def _java_pids(pids: list[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"java" in f.read().split(b"\0")[0]:
                    found.append(pid)
        except FileNotFoundError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.realenv
@pytest.mark.slow
def test_pool_shuts_its_jvms_down() -> None:
    suite = _suite()
    tasks = [Task("lifespan-longest-lived/0", "lifespan-longest-lived", 0),
             Task("power-component/0", "power-component", 1)]
    pool = EnvPool(suite, num_workers=2, step_timeout_s=60)
    try:
        first = pool.reset(tasks)
        assert all(info["expert_action"] for _, info in first)
        jvms = _java_pids([p for w in pool.worker_pids() for p in descendant_pids(w)])
        assert len(jvms) == 2  # one JVM per env, inside the workers
        for pid in jvms:  # env.jvm_options reach every JVM
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"JAVA_TOOL_OPTIONS={ScienceWorldConfig.jvm_options}".encode() in environ
        results = pool.step({0: first[0][1]["expert_action"], 1: first[1][1]["expert_action"]})
        assert not any(r.done for r in results.values())
        # a worker killed outright cannot close its JVM: the JVM notices its pipe break and exits
        victim = pool.worker_pids()[0]
        victim_jvm = _java_pids(descendant_pids(victim))
        os.kill(victim, signal.SIGKILL)
        assert _gone([victim, *victim_jvm], timeout=20)
        result = pool.step({0: "look around"})[0]
        assert result.done and result.info["truncated"] and "died" in result.info["error"]
        workers = pool.worker_pids()
    finally:
        pool.close()
    assert _gone(jvms + workers)
