"""env=alfworld on the real ALFWorld games in ../shared/alfworld (train and valid_seen splits).

The games are never copied into the repository; tests point env.data_dir at the shared folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from epo_cli.envs.alfworld import TASK_TYPES, AlfworldConfig, AlfworldSuite
from epo_cli.envs.base import Task
from epo_cli.envs.pool import EnvPool
from epo_cli.envs.subgoals import SUBGOALS
from epo_cli.errors import ConfigError, UserError

from conftest import REPO, metrics_rows, only_run_dir, run_cli, shared_dir

if importlib.util.find_spec("alfworld") is None:  # not imported here: importing alfworld creates its data dir
    pytest.skip("alfworld is not installed (pip install 'epo[envs]')", allow_module_level=True)
pytest.importorskip("textworld", reason="textworld is not installed (pip install 'epo[envs]')")

SHARED = shared_dir() / "alfworld"
pytestmark = pytest.mark.realenv


def suite(**overrides) -> AlfworldSuite:
    return AlfworldSuite(AlfworldConfig(data_dir=str(SHARED), **overrides))


def test_task_type_numbering_is_alfworlds() -> None:
    os.environ["ALFWORLD_DATA"] = str(SHARED)  # what the suite does before any alfworld import
    from alfworld.agents.environment.alfred_tw_env import TASK_TYPES as ALFWORLD_TASK_TYPES

    assert {i: alf for i, (_, alf) in TASK_TYPES.items()} == ALFWORLD_TASK_TYPES
    chosen = suite(task_types=["2", "pick_two_obj_and_place", "pick_heat_then_place_in_recep"])
    assert chosen.task_types() == ["look_at_obj_in_light", "pick_heat_then_place", "pick_two_obj_and_place"]
    with pytest.raises(ConfigError, match="Valid task types: 1=pick_and_place"):
        suite(task_types=["7"]).task_types()


def test_suite_interface_for_curricula_and_subgoal_rewards() -> None:
    # a curriculum climbs the configured task types in alfworld's order, whatever order the config lists
    chosen = suite(task_types=["pick_two_obj_and_place", "2", "pick_heat_then_place_in_recep"])
    assert chosen.curriculum_levels() == ["look_at_obj_in_light", "pick_heat_then_place", "pick_two_obj_and_place"]
    assert suite().curriculum_levels() == [short for short, _ in TASK_TYPES.values()]
    assert chosen.reports_subgoals and set(SUBGOALS) == {short for short, _ in TASK_TYPES.values()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen.check_subgoal_rewards()  # events come from the PDDL facts: nothing to fix, nothing to warn


def test_lists_solvable_games_per_split_and_task_type() -> None:
    everything = suite()
    everything.check()
    train, valid_seen = everything.games("train"), everything.games("eval_in_distribution")
    # the shared folder's README: 200 train games, 187 valid_seen trials of which 152 are solvable
    assert len(train) == 200 and len(valid_seen) == 152
    assert all(task_id.startswith("valid_seen/") for task_id, _ in valid_seen)
    per_type = {short: suite(task_types=[str(i)]).games("train") for i, (short, _) in TASK_TYPES.items()}
    assert sum(len(games) for games in per_type.values()) == 200
    for short, games in per_type.items():
        assert games and all(task_type == short for _, task_type in games)
        assert all(short in task_id for task_id, _ in games)  # folder names carry the type
    # levels restrict sampling to task types; tasks are reproducible from the rng
    tasks = everything.sample_tasks("train", 5, random.Random(3), level="look_at_obj_in_light,6")
    assert {t.task_type for t in tasks} <= {"look_at_obj_in_light", "pick_two_obj_and_place"}
    assert tasks == everything.sample_tasks("train", 5, random.Random(3), level="look_at_obj_in_light,6")
    assert everything.levels()[0] == "pick_and_place" and len(everything.levels()) == 6
    assert set(everything.versions()) >= {"alfworld", "textworld"}
    assert everything.splits == ("train", "eval_in_distribution")  # the shared folder has no valid_unseen


def test_missing_data_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        AlfworldSuite(AlfworldConfig(data_dir=str(tmp_path / "nowhere"))).check()
    message = str(err.value)
    assert "alfworld-download" in message and "env.data_dir" in message and "ALFWORLD_DATA" in message
    assert str(tmp_path / "nowhere") in message
    # the shared folder has no valid_unseen: asking for that split fails the same way
    with pytest.raises(UserError, match="valid_unseen does not exist"):
        suite().sample_tasks("eval_out_of_distribution", 1, random.Random(0))


def test_config_composition_imports_no_simulator() -> None:
    code = (
        "import sys\n"
        "from epo_cli.compose import compose\n"
        "for env in ('alfworld', 'scienceworld', 'textworld'):\n"
        "    compose([f'env={env}'])\n"
        "print(sorted(m for m in ('alfworld', 'textworld', 'scienceworld') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_rollouts_skip_the_expert_unless_it_is_read() -> None:
    """env.expert=null (the default): the expert runs where its actions are read (SFT demos, eval
    policy=expert, the tiny tokenizer's corpus: make_env's default), not in RL rollouts (the trainer's
    pool: reads_expert=False, passed to the one suite's make_env); an explicit true/false is kept either way."""
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.envs.pool import EnvPool

    cfg = compose(["env=alfworld", f"env.data_dir={SHARED}"])
    assert cfg.env.expert is None
    suite = make_suite(cfg.env)
    assert suite.make_env().use_expert is True
    assert suite.make_env(reads_expert=False).use_expert is False
    for reads_expert, first_expert_action in ((False, None), (True, "look")):  # the trainer's pool, a worker
        with EnvPool(suite, num_workers=1, step_timeout_s=60, reads_expert=reads_expert) as pool:
            [(_, info)] = pool.reset([_task(suite, "pick_and_place")])
            assert info["expert_action"] == first_expert_action
    for forced in (True, False):
        cfg = compose(["env=alfworld", f"env.data_dir={SHARED}", f"env.expert={str(forced).lower()}"])
        assert make_suite(cfg.env).make_env().use_expert is forced
        assert make_suite(cfg.env).make_env(reads_expert=False).use_expert is forced
    household = make_suite(compose(["env=household"]).env)  # no expert setting: computed either way
    assert household.make_env(reads_expert=False) is not None


def _task(suite_: AlfworldSuite, task_type: str, seed: int = 0) -> Task:
    task_id = next(t for t, tt in suite_.games("train") if tt == task_type)
    return Task(task_id, task_type, seed, "train")


@pytest.fixture(scope="module")
def pool():
    with EnvPool(suite(), num_workers=2, step_timeout_s=60) as pool:
        yield pool


@pytest.mark.slow
def test_expert_solves_games_through_the_pool(pool: EnvPool) -> None:
    s = suite()
    tasks = [_task(s, t) for t in ("pick_and_place", "look_at_obj_in_light", "pick_clean_then_place")]
    first = pool.reset(tasks)
    infos = {i: info for i, (_, info) in enumerate(first)}
    for i, (obs, info) in enumerate(first):
        assert info["goal"] and info["goal"] in obs and "Welcome" not in obs
        assert info["task_type"] == tasks[i].task_type and info["expert_action"] == "look"
        assert "help" not in info["admissible_commands"] and "look" in info["admissible_commands"]
    played: dict[int, list[str]] = {i: [] for i in infos}
    active = set(infos)
    for _ in range(50):
        actions = {i: infos[i]["expert_action"] for i in sorted(active)}
        for i, action in actions.items():
            played[i].append(action)
        for i, result in pool.step(actions).items():
            infos[i] = result.info
            if result.done:
                active.discard(i)
                assert result.info["won"] and result.reward == 1.0 and not result.info["truncated"]
        if not active:
            break
    assert not active, "the expert did not finish within 50 turns"

    # the same game in this process, with the same seed, gives the same expert trajectory
    env = s.make_env()
    try:
        _, info = env.reset(tasks[2])
        actions = []
        while True:
            actions.append(info["expert_action"])
            result = env.step(actions[-1])
            info = result.info
            if result.done:
                break
        assert actions == played[2]
    finally:
        env.close()


@pytest.mark.slow
def test_expert_reaches_every_subgoal_event_of_its_task_type() -> None:
    """Subgoal events (curriculum.subgoal_rewards) derived from the PDDL facts: the handcoded expert, which
    solves these games, must pass through every event of its task type once, in a sensible order."""
    s = suite()
    env = s.make_env()
    try:
        for task_type in s.task_types():
            _, info = env.reset(_task(s, task_type))
            assert info["subgoals"] == [] and info["progress"] == 0.0
            events, progress = [], [0.0]
            for _ in range(60):
                result = env.step(info["expert_action"])
                info = result.info
                events += info["subgoals"]
                progress.append(info["progress"])
                if result.done:
                    break
            assert info["won"], task_type
            assert sorted(events) == sorted(SUBGOALS[task_type]), (task_type, events)  # each exactly once
            assert events.index("found_target") < events.index("picked"), (task_type, events)
            for later in ("transformed", "placed_first"):
                if later in events:
                    assert events.index(later) > events.index("picked"), (task_type, events)
            assert progress == sorted(progress) and progress[-1] == 1.0
            assert progress[-2] == len(events) / (len(events) + 1)  # every event before the winning step
        # a policy that only looks around reaches nothing
        _, info = env.reset(_task(s, "pick_two_obj_and_place"))
        for _ in range(3):
            info = env.step("inventory").info
            assert info["subgoals"] == [] and info["progress"] == 0.0
    finally:
        env.close()


@pytest.mark.slow
def test_killed_worker_truncates_the_episode_and_is_replaced(pool: EnvPool) -> None:
    s = suite()
    tasks = [_task(s, "pick_and_place"), _task(s, "look_at_obj_in_light")]
    pool.reset(tasks)
    pool.step({0: "look", 1: "look"})
    victim = pool.worker_pids()[0]  # slot 0 lives in worker 0
    os.kill(victim, signal.SIGKILL)
    results = pool.step({0: "look", 1: "look"})
    assert results[0].done and results[0].reward == 0.0 and results[0].info["truncated"]
    assert "died" in results[0].info["error"] and results[0].info["task_id"] == tasks[0].task_id
    assert not results[1].done and "error" not in results[1].info
    first = pool.reset(tasks)  # a fresh worker takes slot 0 over
    assert victim not in pool.worker_pids()
    assert first[0][1]["task_id"] == tasks[0].task_id
    assert not pool.step({0: "look"})[0].done


@pytest.mark.slow
def test_parser_cache_leaves_the_game_unchanged(pool: EnvPool) -> None:
    """The pool's workers cache TextWorld's parsing (the default); a stock worker must play identically."""
    task = _task(suite(), "pick_heat_then_place", seed=3)

    def trajectory(p: EnvPool) -> list:
        (obs, info), = p.reset([task])
        trace, rng = [(obs, info)], random.Random(0)
        for _ in range(15):
            result = p.step({0: rng.choice(info["admissible_commands"])})[0]
            info = result.info
            trace.append((result.observation, result.reward, result.done, info))
        return trace

    with EnvPool(suite(fast_textgen=False), num_workers=1, step_timeout_s=60) as stock:
        assert trajectory(pool) == trajectory(stock)


@pytest.mark.slow
def test_grpo_on_alfworld_through_the_cli(tmp_path: Path) -> None:
    """`epo train algo=grpo env=alfworld model=tiny` end to end: 2 iterations on the shared games, envs in
    2 worker processes, a tiny model whose tokenizer is trained on ALFWorld's own text."""
    run_cli(["train", "algo=grpo", "env=alfworld", "model=tiny", f"env.data_dir={SHARED}", "env.num_workers=2",
             "env.max_turns=3", "algo.tasks_per_step=1", "algo.group_size=2", "trainer.total_steps=2",
             "env.eval_splits=[]", "logger.tensorboard=false", f"output_dir={tmp_path}"], cwd=tmp_path)
    run = only_run_dir(tmp_path)
    rows = metrics_rows(run)
    assert len(rows) == 2 and rows[0]["rollout/episode_len"] == 3.0
    assert "alfworld" in (run / "config.yaml").read_text().split("versions:")[1]  # env version recorded


@pytest.mark.slow
def test_sft_on_alfworld_from_the_handcoded_expert(tmp_path: Path) -> None:
    """algo=sft env=alfworld: demonstrations played by ALFWorld's handcoded expert through the pool."""
    run_cli(["train", "algo=sft", "env=alfworld", f"env.data_dir={SHARED}", "env.num_workers=2",
             "env.task_types=[1]", "algo.demo_episodes=2", "trainer.total_steps=2", "env.eval_splits=[]",
             "logger.tensorboard=false", f"output_dir={tmp_path}"], cwd=tmp_path)
    run = only_run_dir(tmp_path)
    demos = [json.loads(line) for line in (run / "demos.jsonl").read_text().splitlines()]
    assert len(demos) == 2 and all(d["won"] and d["task_type"] == "pick_and_place" for d in demos)
    assert all(step["action"] in step["admissible_commands"] for d in demos for step in d["steps"])


def _play(p: EnvPool, episodes: list[tuple[Task, str, int]]) -> list[list]:
    """Episodes in turn in slot 0 of `p` (one env): (task, policy, steps), policy "expert" (its action),
    "random" (a random admissible command) or "mixed" (either, by a coin); each episode's observations and
    infos."""
    played, rng = [], random.Random(0)
    for task, policy, steps in episodes:
        (obs, info), = p.reset([task])
        trace = [(task.task_id, obs, info)]
        for _ in range(steps):
            if policy == "expert" or (policy == "mixed" and rng.random() < 0.5):
                action = info["expert_action"] or "look"
            else:
                action = rng.choice(info["admissible_commands"])
            result = p.step({0: action})[0]
            info = result.info
            trace.append((action, result.observation, result.reward, result.done, info))
            if result.done:
                break
        played.append(trace)
    return played


@pytest.mark.slow
def test_speedups_leave_whole_trajectories_unchanged(pool: EnvPool) -> None:
    """env.fast_textgen (parser cache + exact deepcopy) and env.cache_pddl, the defaults of the pool's
    workers, against stock TextWorld in a fresh worker: the same observations, admissible commands, rewards,
    done and won flags, subgoal events and expert actions, over different games in sequence in one env and
    a game replayed after another (its PDDL translation cached)."""
    s = suite()
    clean, lamp = _task(s, "pick_clean_then_place", seed=1), _task(s, "look_at_obj_in_light", seed=2)
    episodes = [(clean, "expert", 30), (lamp, "random", 10), (clean, "mixed", 15)]
    with EnvPool(suite(fast_textgen=False, cache_pddl=False), num_workers=1, step_timeout_s=60) as stock:
        expected = _play(stock, episodes)
    played = _play(pool, episodes)
    assert played == expected
    # worth comparing: the expert's game is won (reward 1, done) with every subgoal event on the way
    _, _, reward, done, info = expected[0][-1]
    assert info["won"] and reward == 1.0 and done
    assert sorted(e for step in expected[0] for e in step[-1]["subgoals"]) == sorted(SUBGOALS[clean.task_type])
    assert any(step[-1]["subgoals"] for step in expected[1] + expected[2])  # and some by the other policies
    assert expected[2][0] == expected[0][0]  # the same game starts the same the second time


def test_exact_deepcopy_and_pddl_cache_match_textworld(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces of the speed-ups, in this process: the exact deepcopy returns what copy.deepcopy returns
    (same values, same sharing, nothing shared with the original); the PDDL cache returns the translator's
    own result, keeps PDDL_CACHE_GAMES games, and installing either twice changes nothing."""
    import copy
    import pickle

    os.environ["ALFWORLD_DATA"] = str(SHARED)
    import fast_downward
    from textworld.envs.pddl import textgen
    from textworld.generator.game import EntityInfo
    from textworld.logic import Placeholder, Variable

    import epo_cli.envs.textworld_speedups as speedups

    speedups.fast_textgen_copies()
    fast = textgen.deepcopy
    speedups.fast_textgen_copies()
    assert textgen.deepcopy is fast and fast.epo_exact

    info = EntityInfo("apple_1", "o")
    info.name, info.definite, info.synonyms = "apple 1", "the", ["fruit"]
    ph, var = Placeholder("o", "object"), Variable("apple_1", "o")
    symbols = textgen.ContextSensitiveGrammar.parse(json.dumps({"x": [{
        "rhs": "You see {o.name}, [{r.name | inreceptacle(o:object, r:receptacle)}] and #y#.\\n"}]}))._rules["x"][0].rhs
    assert {type(obj).__name__ for obj in _objects(symbols)} >= {
        "TerminalSymbol", "NonterminalSymbol", "EvalSymbol", "ListSymbol", "ConditionalSymbol"}
    context = {"variables": {"o": info, "again": info}, "mapping": {ph: var, Placeholder("r", "r"): var},
               "pair": (info, "text"), "same": (1, "a"), "symbols": symbols}
    for symbol in symbols:
        symbol.context = context
    original = pickle.dumps(context)
    for value in (context, symbols, context["variables"], info, (info, [info])):
        mine, theirs = fast(value), copy.deepcopy(value)
        assert pickle.dumps(mine) == pickle.dumps(theirs)  # pickle records values and sharing
        kept = {id(obj) for obj in _objects(value)}
        assert not any(id(obj) in kept for obj in _objects(mine) if not isinstance(obj, (str, int, tuple, type(None))))
    copied = fast(context)
    assert copied["variables"]["o"] is copied["variables"]["again"] is copied["pair"][0]
    assert copied["same"] is context["same"]  # deepcopy keeps tuples of atoms
    assert pickle.dumps(context) == original  # the original is untouched

    speedups.cache_pddl_translations()
    cached = fast_downward.pddl2sas
    speedups.cache_pddl_translations()
    assert fast_downward.pddl2sas is cached and cached.epo_cached
    monkeypatch.setattr(speedups, "PDDL_CACHE_GAMES", 1)
    cached.cache.clear()
    games = [json.loads((SHARED / "json_2.1.1" / task_id / "game.tw-pddl").read_text())
             for task_id, _ in suite().games("train")[:2]]
    first = cached(games[0]["pddl_domain"], games[0]["pddl_problem"])
    assert cached(games[0]["pddl_domain"], games[0]["pddl_problem"]) is first
    assert first[1] == cached.original(games[0]["pddl_domain"], games[0]["pddl_problem"])[1]
    assert cached(games[0]["pddl_domain"], games[0]["pddl_problem"], optimize=True)[1] != first[1]
    cached(games[1]["pddl_domain"], games[1]["pddl_problem"])
    assert len(cached.cache) == 2 and (games[0]["pddl_domain"], games[0]["pddl_problem"], False) not in cached.cache


def _objects(value, seen=None) -> list:
    """Every object reachable from `value` through containers, slots and __dict__ (for sharing checks)."""
    seen = {} if seen is None else seen
    if id(value) in seen:
        return []
    seen[id(value)] = value
    found = [value]
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)):
        children = list(value)
    else:
        children = [getattr(value, slot) for slot in getattr(type(value), "__slots__", ()) if hasattr(value, slot)]
        children += list(getattr(value, "__dict__", {}).values())
    for child in children:
        found += _objects(child, seen)
    return found
