"""env=textworld: generate a tiny game offline, play it with its walkthrough, win."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from epo_cli.envs.pool import EnvPool
from epo_cli.envs.textworld_games import TextWorldConfig, TextWorldSuite, _clean
from epo_cli.errors import UserError

textworld = pytest.importorskip("textworld", reason="textworld is not installed (pip install 'epo[envs]')")


@pytest.mark.realenv
@pytest.mark.slow
def test_generated_game_is_won_by_its_walkthrough(tmp_path: Path) -> None:
    cfg = TextWorldConfig(cache_dir=str(tmp_path), num_games=1, num_eval_games=1, world_size=2, nb_objects=3,
                          quest_length=2, seed=7)
    suite = TextWorldSuite(cfg)
    suite.check()  # generates train and eval_in_distribution (one game each) into the cache
    folder, games = suite.games("train")
    assert games == ["game_7.z8"] and (folder / "game_7.json").is_file()
    assert suite.games("eval_in_distribution")[1] == ["game_100007.z8"]
    walkthrough = textworld.Game.load(str(folder / "game_7.json")).metadata["walkthrough"]
    assert walkthrough

    task = suite.sample_tasks("train", 1, random.Random(0))[0]
    env = suite.make_env()
    try:
        obs, info = env.reset(task)
        assert info["goal"] and "$$" not in obs and info["admissible_commands"] and not info["won"]
        assert info["expert_action"] == walkthrough[0]
        for i, action in enumerate(walkthrough):
            assert action in info["admissible_commands"]
            result = env.step(action)
            info = result.info
            assert result.done == (i == len(walkthrough) - 1)
        assert info["won"] and result.reward == 1.0 and info["progress"] == 1.0
    finally:
        env.close()

    # the suite travels to a worker process, which finds the generated game from the config alone
    with EnvPool(suite, num_workers=1, step_timeout_s=30) as pool:
        (_, info), = pool.reset([task])
        result = pool.step({0: info["expert_action"]})[0]
        assert not result.done and result.info["expert_action"] == walkthrough[1]


def test_games_dir_problems_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "old.ulx").write_bytes(b"")
    with pytest.raises(UserError, match="Glulx"):
        TextWorldSuite(TextWorldConfig(games_dir=str(tmp_path))).games("train")
    with pytest.raises(UserError, match="not a folder"):
        TextWorldSuite(TextWorldConfig(games_dir=str(tmp_path / "missing"))).games("train")


def test_suite_interface_for_curricula_and_subgoal_rewards() -> None:
    suite = TextWorldSuite(TextWorldConfig())
    assert suite.curriculum_levels() == []  # no levels: a staged or adaptive curriculum must list them
    assert not suite.reports_subgoals
    with pytest.warns(UserWarning, match="env=textworld reports no subgoal events"):
        suite.check_subgoal_rewards()


def test_banner_and_status_line_are_dropped() -> None:
    raw = ("\n\n   ________  __\n  |  \\$$$$$$$$|\n\nWelcome to the attic.\n\n\n\nYou see a box.\n"
           ">                                       -= Attic =-0/1")
    assert _clean(raw) == "Welcome to the attic.\n\nYou see a box."
