"""Curricula driven by synthetic success streams (no model), plus one CLI run (slow).

Hand-computed values are in the comments. Stats passed to `observe` are global (wins, episodes) per level.
"""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import fields, replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from epo_cli.algos.curriculum import (
    CURRICULA,
    AdaptiveCurriculum,
    AdaptiveCurriculumConfig,
    CommonCurriculumConfig,
    Curriculum,
    StagedCurriculum,
    build_curriculum,
)
from epo_cli.compose import compose
from epo_cli.config import CurriculumConfig
from epo_cli.envs.base import EnvSuite, Task
from epo_cli.envs.household import HouseholdConfig, HouseholdSuite
from epo_cli.errors import ConfigError

from conftest import metrics_rows, only_run_dir, run_epo

LEVELS = ["tiny_open_pick_place", "small_pick_and_light", "medium_with_transforms"]


def env_cfg(**kw) -> HouseholdConfig:
    return HouseholdConfig(**kw)


def staged(**kw) -> StagedCurriculum:
    cfg = replace(CurriculumConfig(name="staged", window=2, promote_at=0.5, replay_share=0.0), **kw)
    return StagedCurriculum(cfg, env_cfg(), LEVELS)


def adaptive(**kw) -> AdaptiveCurriculum:
    cfg = replace(CurriculumConfig(name="adaptive", window=2, exploration_floor=0.2), **kw)
    return AdaptiveCurriculum(cfg, env_cfg(), ["a", "b", "c"])


def levels_of(tasks: list[Task]) -> list[str]:
    return [t.level for t in tasks]


# ----------------------------------------------------------------------------------------------------
# staged
# ----------------------------------------------------------------------------------------------------


def test_staged_promotes_after_a_full_window_at_promote_at():
    cur = staged()
    cur.observe(0, {LEVELS[0]: (4.0, 4.0)})  # one iteration: window (2) not full yet
    assert cur.stage == 0
    cur.observe(1, {LEVELS[0]: (0.0, 4.0)})  # window 4/8 = 0.5 >= 0.5 -> promote
    assert cur.stage == 1 and cur.window == [] and cur.promotions == 1
    m = cur.metrics()
    assert m["curriculum/level"] == 1.0 and m["curriculum/weight/small_pick_and_light"] == 1.0
    cur.observe(2, {LEVELS[1]: (1.0, 4.0)})
    cur.observe(3, {LEVELS[1]: (1.0, 4.0)})  # 2/8 = 0.25 < 0.5: stay
    assert cur.stage == 1
    cur.observe(4, {LEVELS[1]: (3.0, 4.0)})  # sliding window (1+3)/8 = 0.5 -> promote to the last level
    assert cur.stage == 2
    for s in range(5, 10):  # the last level never promotes further
        cur.observe(s, {LEVELS[2]: (4.0, 4.0)})
    assert cur.stage == 2 and cur.promotions == 2


def test_staged_window_is_episode_weighted_and_ignores_other_levels():
    cur = staged()
    # 1/1 and 0/9 -> 1/10 = 0.1 (the mean of per-iteration rates would be 0.5 and promote)
    cur.observe(0, {LEVELS[0]: (1.0, 1.0), LEVELS[1]: (9.0, 9.0)})
    cur.observe(1, {LEVELS[0]: (0.0, 9.0)})
    assert cur.stage == 0
    cur.observe(2, {LEVELS[1]: (5.0, 5.0)})  # an iteration without the current level: not counted
    assert cur.window == [[1.0, 1.0], [0.0, 9.0]]


def test_staged_demotes_below_demote_at_and_restarts_the_window():
    cur = staged(demote_at=0.2)
    cur.observe(0, {LEVELS[0]: (3.0, 4.0)})
    cur.observe(1, {LEVELS[0]: (3.0, 4.0)})
    assert cur.stage == 1
    cur.observe(2, {LEVELS[1]: (0.0, 4.0)})  # window not full: no decision
    assert cur.stage == 1
    cur.observe(3, {LEVELS[1]: (1.0, 4.0)})  # 1/8 = 0.125 < 0.2 -> back to level 0
    assert cur.stage == 0 and cur.demotions == 1 and cur.window == []
    cur.observe(4, {LEVELS[0]: (0.0, 4.0)})
    cur.observe(5, {LEVELS[0]: (0.0, 4.0)})  # level 0 is never demoted further
    assert cur.stage == 0


def test_staged_without_demote_at_never_demotes():
    cur = staged()
    cur.stage = 1
    for s in range(5):
        cur.observe(s, {LEVELS[1]: (0.0, 4.0)})
    assert cur.stage == 1 and cur.demotions == 0


def test_staged_replay_share_over_many_draws():
    cur = staged(replay_share=0.3)
    suite = HouseholdSuite(env_cfg())
    assert all(t.level == LEVELS[0] for t in cur.sample_tasks(suite, 8, random.Random(0), 0, 10))  # level 0
    cur.stage = 2
    counts = {lv: 0 for lv in LEVELS}
    rng = random.Random(1)
    draws, n = 400, 5
    for i in range(draws):
        tasks = cur.sample_tasks(suite, n, rng, i, draws)
        assert len(tasks) == n
        for t in tasks:
            counts[t.level] += 1
    total = draws * n
    # expected: 30% replay, split evenly over the two earlier levels (15% each); 2000 draws -> sd ~1%
    assert counts[LEVELS[2]] / total == pytest.approx(0.7, abs=0.03)
    assert counts[LEVELS[0]] / total == pytest.approx(0.15, abs=0.03)
    assert counts[LEVELS[1]] / total == pytest.approx(0.15, abs=0.03)
    w = cur.metrics()
    assert w["curriculum/weight/medium_with_transforms"] == pytest.approx(0.7)
    assert w["curriculum/weight/tiny_open_pick_place"] == pytest.approx(0.15)


def test_staged_draw_is_a_function_of_state_and_rng():
    suite = HouseholdSuite(env_cfg())
    a, b = staged(replay_share=0.5), staged(replay_share=0.5)
    a.stage = b.stage = 1
    ta = a.sample_tasks(suite, 6, random.Random(7), 3, 10)
    tb = b.sample_tasks(suite, 6, random.Random(7), 3, 10)
    assert ta == tb and levels_of(ta) == levels_of(tb)


def test_staged_config_checks():
    with pytest.raises(ConfigError, match="demote_at"):
        staged(demote_at=0.6)  # must be below promote_at = 0.5
    with pytest.raises(ConfigError, match="replay_share"):
        staged(replay_share=1.0)
    with pytest.raises(ConfigError, match="more than once"):
        StagedCurriculum(CurriculumConfig(name="staged"), env_cfg(), ["a", "a"])


@pytest.mark.parametrize("make, name", [(StagedCurriculum, "staged"), (AdaptiveCurriculum, "adaptive")])
def test_staged_and_adaptive_need_a_level(make: type[Curriculum], name: str):
    # the one check in Curriculum.__init__ (needs_levels); `none` with no levels keeps the env's own draw
    with pytest.raises(ConfigError, match=rf"^curriculum={name} needs at least one level \(curriculum.levels\)\.$"):
        make(CurriculumConfig(name=name), env_cfg(), [])
    assert Curriculum(CurriculumConfig(name="none"), env_cfg(), []).levels == []


# ----------------------------------------------------------------------------------------------------
# adaptive
# ----------------------------------------------------------------------------------------------------


def test_adaptive_starts_uniform():
    cur = adaptive()
    assert cur.level_weights() == pytest.approx([1 / 3] * 3)


def test_adaptive_progress_weights_by_hand():
    cur = adaptive()  # window 2, floor 0.2
    # a: 0.0, 0.0, 0.5, 1.0 -> |mean(0.5,1.0) - mean(0,0)| = 0.75
    # b: 0.5, 0.5           -> |0.5 - 0.5| = 0  (two entries: halves of one)
    # c: 0.25               -> one entry: unknown -> optimistic score 1
    for s, (a, b) in enumerate([(0.0, 2.0), (0.0, 2.0), (2.0, None), (4.0, None)]):
        stats = {"a": (a, 4.0)}
        if b is not None:
            stats["b"] = (b, 4.0)
        if s == 0:
            stats["c"] = (1.0, 4.0)
        cur.observe(s, stats)
    assert cur.score("a") == pytest.approx(0.75)
    assert cur.score("b") == pytest.approx(0.0)
    assert cur.score("c") is None
    # scores (0.75, 0, 1) sum 1.75: w = 0.2/3 + 0.8 * s / 1.75
    expected = [0.2 / 3 + 0.8 * 0.75 / 1.75, 0.2 / 3, 0.2 / 3 + 0.8 / 1.75]
    assert cur.level_weights() == pytest.approx(expected)
    assert sum(cur.level_weights()) == pytest.approx(1.0)
    m = cur.metrics()
    assert m["curriculum/weight/a"] == pytest.approx(expected[0])
    assert m["curriculum/level"] == pytest.approx(expected[1] + 2 * expected[2])
    assert m["curriculum/score/a"] == pytest.approx(0.75)


def test_adaptive_progress_uses_the_last_two_windows():
    cur = adaptive()
    for s, wins in enumerate([4.0, 0.0, 0.0, 2.0, 4.0]):  # history kept: last 4 -> 0, 0, 0.5, 1
        cur.observe(s, {"a": (wins, 4.0)})
    assert cur.history["a"] == [[0.0, 4.0], [0.0, 4.0], [2.0, 4.0], [4.0, 4.0]]
    assert cur.score("a") == pytest.approx(0.75)


def test_adaptive_closeness_weights_by_hand():
    cur = adaptive(adaptive_signal="closeness", exploration_floor=0.0)
    cur.observe(0, {"a": (2.0, 4.0), "b": (1.0, 4.0), "c": (4.0, 4.0)})
    # p = 0.5, 0.25, 1.0 -> 4p(1-p) = 1, 0.75, 0 -> weights 1/1.75, 0.75/1.75, 0
    assert cur.level_weights() == pytest.approx([1 / 1.75, 0.75 / 1.75, 0.0])
    cur.observe(1, {"c": (4.0, 4.0)})  # all solved everywhere -> would be all zero except a, b
    assert cur.level_weights()[2] == 0.0


def test_adaptive_all_zero_scores_fall_back_to_uniform():
    cur = adaptive(adaptive_signal="closeness")
    cur.observe(0, {"a": (0.0, 4.0), "b": (4.0, 4.0), "c": (0.0, 4.0)})
    assert cur.level_weights() == pytest.approx([1 / 3] * 3)


def test_adaptive_sampling_follows_the_weights():
    cfg = CurriculumConfig(name="adaptive", adaptive_signal="closeness", exploration_floor=0.0)
    cur = AdaptiveCurriculum(cfg, env_cfg(), LEVELS)
    cur.observe(0, {LEVELS[0]: (2.0, 4.0), LEVELS[1]: (0.0, 4.0), LEVELS[2]: (0.0, 4.0)})
    assert cur.level_weights() == pytest.approx([1.0, 0.0, 0.0])
    tasks = cur.sample_tasks(HouseholdSuite(env_cfg()), 16, random.Random(0), 1, 10)
    assert set(levels_of(tasks)) == {LEVELS[0]}


def test_adaptive_rejects_unknown_signal():
    with pytest.raises(ConfigError, match="adaptive_signal"):
        adaptive(adaptive_signal="bandit")


# ----------------------------------------------------------------------------------------------------
# horizon, subgoal coefficient, none
# ----------------------------------------------------------------------------------------------------


def test_horizon_schedule_values():
    cfg = CurriculumConfig(name="horizon", horizon=True, start_turns=10, horizon_share=0.5)
    cur = Curriculum(cfg, env_cfg(max_turns=30), [])
    # total 100: grows over 50 steps from 10 to 30 -> 10 + 20 * step / 50
    assert cur.max_turns(0, 100) == 10
    assert cur.max_turns(10, 100) == 14
    assert cur.max_turns(25, 100) == 20
    assert cur.max_turns(26, 100) == 20  # 20.4 rounds to 20
    assert cur.max_turns(49, 100) == 30  # 29.6 rounds to 30
    assert cur.max_turns(50, 100) == 30
    assert cur.max_turns(99, 100) == 30
    flat = Curriculum(replace(cfg, horizon_share=0.0), env_cfg(), [])
    assert flat.max_turns(0, 100) == 30
    assert Curriculum(replace(cfg, horizon=False), env_cfg(max_turns=30), []).max_turns(0, 100) == 30
    with pytest.raises(ConfigError, match="start_turns"):
        Curriculum(CurriculumConfig(name="horizon", horizon=True, start_turns=31), env_cfg(max_turns=30), [])


def test_subgoal_coefficient_decays_to_zero():
    cfg = CurriculumConfig(subgoal_rewards=True, subgoal_coef=2.0, subgoal_decay_share=0.5)
    cur = Curriculum(cfg, env_cfg())
    # 2 * (1 - (step/100) / 0.5)
    assert cur.subgoal_coef(0, 100) == pytest.approx(2.0)
    assert cur.subgoal_coef(25, 100) == pytest.approx(1.0)
    assert cur.subgoal_coef(50, 100) == 0.0
    assert cur.subgoal_coef(90, 100) == 0.0
    assert Curriculum(replace(cfg, subgoal_decay_share=None), env_cfg()).subgoal_coef(90, 100) == 2.0
    assert Curriculum(replace(cfg, subgoal_rewards=False), env_cfg()).subgoal_coef(0, 100) == 0.0
    # combinable: staged with subgoal rewards keeps the same coefficient
    st = StagedCurriculum(replace(cfg, name="staged"), env_cfg(), LEVELS)
    assert st.subgoal_coef(25, 100) == pytest.approx(1.0)


def test_none_keeps_the_env_draw():
    suite = HouseholdSuite(env_cfg(level="tiny_open_pick_place"))
    cur = Curriculum(CurriculumConfig(), env_cfg())
    expected = suite.sample_tasks("train", 4, random.Random(3))
    assert cur.sample_tasks(suite, 4, random.Random(3), 0, 10) == expected
    assert cur.metrics() == {} and cur.max_turns(0, 10) == 30


def test_none_with_levels_is_a_uniform_mix():
    cur = Curriculum(CurriculumConfig(levels=LEVELS[:2]), env_cfg(), LEVELS[:2])
    tasks = cur.sample_tasks(HouseholdSuite(env_cfg()), 400, random.Random(0), 0, 10)
    share = levels_of(tasks).count(LEVELS[0]) / 400
    assert share == pytest.approx(0.5, abs=0.08)


# ----------------------------------------------------------------------------------------------------
# state round trip, build from config, level semantics
# ----------------------------------------------------------------------------------------------------


def _stream(seed: int, steps: int, levels: list[str]) -> list[dict[str, tuple[float, float]]]:
    rng = random.Random(seed)
    # each level is played in ~80% of the iterations, with 0-4 wins out of 4
    return [{lv: (float(rng.randint(0, 4)), 4.0) for lv in levels if rng.random() < 0.8}
            for _ in range(steps)]


@pytest.mark.parametrize("make", [
    lambda: staged(replay_share=0.3, demote_at=0.2, promote_at=0.4),
    lambda: AdaptiveCurriculum(CurriculumConfig(name="adaptive", window=2), env_cfg(), LEVELS),
    lambda: AdaptiveCurriculum(CurriculumConfig(name="adaptive", adaptive_signal="closeness"), env_cfg(),
                               LEVELS),
])
def test_state_round_trip_reproduces_future_decisions(make):
    suite = HouseholdSuite(env_cfg())
    stream = _stream(0, 24, LEVELS)
    a = make()
    for s in range(12):
        a.sample_tasks(suite, 4, random.Random(s), s, 24)
        a.observe(s, stream[s])
    state = json.loads(json.dumps(a.state_dict()))  # JSON-able, as checkpoints store it
    b = make()
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict() and b.metrics() == a.metrics()
    for s in range(12, 24):
        ta = a.sample_tasks(suite, 4, random.Random(s), s, 24)
        tb = b.sample_tasks(suite, 4, random.Random(s), s, 24)
        assert ta == tb and levels_of(ta) == levels_of(tb)
        a.observe(s, stream[s])
        b.observe(s, stream[s])
        assert a.metrics() == b.metrics()


def test_resume_with_other_levels_is_refused():
    a = staged()
    b = StagedCurriculum(CurriculumConfig(name="staged"), env_cfg(), LEVELS[:2])
    with pytest.raises(Exception, match="same curriculum"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict({})  # checkpoints without curriculum state load as a fresh curriculum
    # another kind of curriculum is refused; flags on `none` (horizon, subgoal rewards) load into each other
    with pytest.raises(Exception, match="same curriculum"):
        b.load_state_dict({"name": "adaptive", "levels": LEVELS[:2]})
    plain = Curriculum(CurriculumConfig(name="horizon", horizon=True), env_cfg(), [])
    plain.load_state_dict({"name": "horizon", "levels": []})  # saved by the former HorizonCurriculum
    plain.load_state_dict({"name": "none", "levels": []})


def test_build_from_composed_config():
    cur = build_curriculum(compose(["curriculum=staged", "curriculum.subgoal_rewards=true"]))
    assert isinstance(cur, StagedCurriculum)
    assert cur.levels == HouseholdSuite().levels()
    assert cur.subgoal_coef(0, 10) == 1.0
    assert isinstance(build_curriculum(compose(["curriculum=adaptive"])), AdaptiveCurriculum)
    horizon = build_curriculum(compose(["curriculum=horizon", "env.max_turns=30"]))
    assert type(horizon) is Curriculum and horizon.max_turns(0, 10) == 10 and horizon.max_turns(5, 10) == 30
    # horizon combines with the task curricula: staged levels and a growing turn limit at once
    both = build_curriculum(compose(["curriculum=staged", "curriculum.horizon=true", "curriculum.start_turns=6",
                                     "env.max_turns=30"]))
    assert isinstance(both, StagedCurriculum) and both.max_turns(0, 10) == 6 and both.max_turns(5, 10) == 30
    sub = build_curriculum(compose(["curriculum=subgoal_rewards"]))
    assert type(sub) is Curriculum and sub.subgoal_coef(0, 10) == 1.0
    assert build_curriculum(compose([])).subgoal_coef(0, 10) == 0.0


class LadderSuite(EnvSuite):
    """A suite whose default curriculum ladder differs from its named levels, as ScienceWorld's does."""

    name = "ladder"

    def make_env(self):
        raise NotImplementedError

    def sample_tasks(self, split, n, rng, level=None):
        return [Task(f"{level}/{rng.randrange(100)}", "any", 0, split) for _ in range(n)]

    def levels(self):
        return ["named"]

    def curriculum_levels(self):
        return ["easy", "easy,hard"]


def test_default_levels_come_from_the_suite():
    cfg = compose(["curriculum=adaptive"])
    assert build_curriculum(cfg, LadderSuite(cfg.env)).levels == ["easy", "easy,hard"]
    # configured levels win over the suite's; a suite without a ladder needs them configured
    listed = compose(["curriculum=staged", "curriculum.levels=[hard]"])
    assert build_curriculum(listed, LadderSuite(listed.env)).levels == ["hard"]

    class NoLadder(LadderSuite):
        def curriculum_levels(self):
            return []

    with pytest.raises(ConfigError, match="env=household defines none"):
        build_curriculum(compose(["curriculum=staged"]), NoLadder(cfg.env))
    assert build_curriculum(compose(["curriculum=none"]), NoLadder(cfg.env)).levels == []  # none needs none


def test_every_curriculum_is_registered_with_the_settings_it_reads():
    assert CURRICULA.names() == ["adaptive", "horizon", "none", "staged", "subgoal_rewards"]
    for name in CURRICULA.names():
        entry = CURRICULA.entry(name)
        assert entry.config is entry.build.settings_class
        # every setting is a key of the flat curriculum section (conf/curriculum/none.yaml, CurriculumConfig)
        assert {f.name for f in fields(entry.config)} <= {f.name for f in fields(CurriculumConfig)}
    with pytest.raises(ConfigError, match="Unknown curriculum 'spiral'. Valid: adaptive, horizon, none"):
        build_curriculum(OmegaConf.create({"curriculum": {"name": "spiral", "levels": []}, "env": {}}))
    # each curriculum keeps only its own settings, read by name from the flat section
    section = replace(CurriculumConfig(), window=5, exploration_floor=0.3, promote_at=0.9)
    settings = AdaptiveCurriculumConfig.of(section)
    assert (settings.window, settings.exploration_floor, settings.horizon) == (5, 0.3, False)
    assert not hasattr(settings, "promote_at")
    assert not hasattr(CommonCurriculumConfig.of(section), "window")
    with pytest.raises(ConfigError, match="'curriculum.exploration_floor': 1.5 is out of range"):
        AdaptiveCurriculumConfig.of(replace(section, exploration_floor=1.5))


def test_unknown_household_level_fails_at_the_first_draw():
    cur = StagedCurriculum(CurriculumConfig(name="staged"), env_cfg(), ["tiny_open_pick_place", "huge"])
    with pytest.raises(ConfigError, match="huge"):
        cur.sample_tasks(HouseholdSuite(env_cfg()), 2, random.Random(0), 0, 10)


def test_levels_are_tagged_on_suites_that_leave_task_level_unset():
    class TypeSuite:  # like alfworld/scienceworld: level = a task type, Task.level left None
        name = "fake"

        def sample_tasks(self, split, n, rng, level=None):
            return [Task(f"{level}/{rng.randrange(100)}", level or "any", 0, split) for _ in range(n)]

    levels = ["pick_and_place", "pick_two_obj_and_place"]
    cur = AdaptiveCurriculum(CurriculumConfig(name="adaptive"), env_cfg(), levels)
    tasks = cur.sample_tasks(TypeSuite(), 8, random.Random(0), 0, 10)
    assert all(t.level == t.task_type for t in tasks)


def test_scienceworld_subgoal_rewards_need_dense_reward():
    with pytest.raises(ConfigError, match="env.reward=dense"):
        build_curriculum(compose(["env=scienceworld", "curriculum=subgoal_rewards"]))
    build_curriculum(compose(["env=scienceworld", "env.reward=dense", "curriculum=subgoal_rewards"]))


def test_subgoal_rewards_warn_only_where_the_env_reports_no_events():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # alfworld derives its events from the PDDL facts: no warning
        build_curriculum(compose(["env=alfworld", "curriculum=subgoal_rewards"]))
    with pytest.warns(UserWarning, match="reports no subgoal events"):
        build_curriculum(compose(["env=textworld", "curriculum=subgoal_rewards"]))


# ----------------------------------------------------------------------------------------------------
# through the CLI
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_staged_grpo_promotes_and_resumes(warm_start_short: Path, tmp_path: Path):
    """A tiny grpo run whose staged curriculum promotes after every iteration (promote_at=0, window=1),
    run for 2 iterations and resumed for a third: the level index climbs, the promoted level's tasks are
    played, and the curriculum state comes back from the checkpoint."""
    run_epo(["train", "algo=grpo", f"model.path={warm_start_short / 'final'}", "env.prompt_template=compact",
             "env.level=small_pick_and_light", "env.max_turns=8", "algo.tasks_per_step=2",
             "algo.group_size=2", "algo.mini_batch_size=64", "trainer.total_steps=2",
             "trainer.eval_every=0", "trainer.save_every=0", "trainer.best_metric=null",
             "logger.tensorboard=false", "env.eval_splits=[]", "curriculum=staged", "curriculum.window=1",
             "curriculum.promote_at=0.0", "curriculum.replay_share=0.0", "curriculum.subgoal_rewards=true",
             "curriculum.levels=[tiny_open_pick_place,small_pick_and_light,medium_with_transforms]",
             f"output_dir={tmp_path}", "name=cur"], cwd=tmp_path)
    run = only_run_dir(tmp_path)
    rows = _metric_rows(run)
    assert [r["curriculum/level"] for r in rows] == [1.0, 2.0]
    assert "curriculum/level_success/tiny_open_pick_place" in rows[0]
    assert "curriculum/level_success/small_pick_and_light" in rows[1]  # the promoted level is played
    assert rows[0]["curriculum/weight/small_pick_and_light"] == 1.0
    assert rows[0]["rollout/subgoal_coef"] == 1.0  # subgoal rewards on, decaying from curriculum.subgoal_coef
    saved = _checkpoint_curriculum_state(run)
    assert saved["stage"] == 2 and saved["promotions"] == 2 and saved["window"] == []

    run_epo(["train", f"trainer.resume={run}", "trainer.total_steps=3"], cwd=tmp_path)
    last = _metric_rows(run)[-1]
    assert last["step"] == 3 and last["curriculum/level"] == 2.0  # the state came back from the checkpoint
    assert "curriculum/level_success/medium_with_transforms" in last
    assert last["curriculum/window_fill"] == 1.0 and last["curriculum/promotions"] == 2.0
    assert 0.0 < last["rollout/subgoal_coef"] < 1.0


def _metric_rows(run: Path) -> list[dict]:
    return [r for r in metrics_rows(run) if "curriculum/level" in r]


def _checkpoint_curriculum_state(run: Path) -> dict:
    """The curriculum state saved with the latest checkpoint (checkpoints/step_N/trainer_state.json)."""
    states = sorted((run / "checkpoints").glob("step_*/trainer_state.json"),
                    key=lambda p: int(p.parent.name[len("step_"):]))
    assert states, f"no checkpoint under {run / 'checkpoints'}"
    return json.loads(states[-1].read_text())["curriculum"]
