"""env=textworld with env.challenge: TextWorld's Coin Collector (and Treasure Hunter) generated offline by
textworld.challenges, cached by their options, splits on disjoint seeds, the expert replanned from any state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from epo_cli.envs import textworld_games
from epo_cli.envs.textworld_games import (
    COIN_GOAL,
    TextWorldConfig,
    TextWorldSuite,
    coin_collector_rooms,
    ood_level,
)
from epo_cli.errors import ConfigError

textworld = pytest.importorskip("textworld", reason="textworld is not installed (pip install 'epo[envs]')")

DIRECTIONS = {"go north", "go south", "go east", "go west"}


def coin_suite(tmp: Path, level: int, **kw) -> TextWorldSuite:
    cfg = TextWorldConfig(cache_dir=str(tmp), challenge="coin_collector", challenge_level=level,
                          num_games=kw.pop("num_games", 2), num_eval_games=kw.pop("num_eval_games", 1), seed=7,
                          max_turns=kw.pop("max_turns", 50), **kw)
    return TextWorldSuite(cfg)


def test_levels_rooms_and_longer_eval_chains() -> None:
    assert coin_collector_rooms(30) == (30, 30)
    assert coin_collector_rooms(130) == (30, 60)  # a dead end beside each chain room
    assert coin_collector_rooms(205) == (5, 15)
    assert ood_level("coin_collector", 130) == 150  # chain 50, 100 rooms: the most TextWorld 1.7 builds
    assert ood_level("coin_collector", 140) == 150  # only 10 longer: 100 rooms hold no more
    assert ood_level("coin_collector", 10) == 30
    assert ood_level("treasure_hunter", 25) == 30


def test_bad_challenge_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"160 rooms.*at most env.challenge_level=150"):
        coin_suite(tmp_path, 180).check()
    with pytest.raises(ConfigError, match="env.challenge_ood_level=.*at most 100"):
        coin_suite(tmp_path, 130, challenge_ood_level=160,
                   eval_splits=["eval_in_distribution", "eval_out_of_distribution"]).check()
    with pytest.raises(ConfigError, match="treasure_hunter has levels 1-30"):
        TextWorldSuite(TextWorldConfig(challenge="treasure_hunter", challenge_level=31)).check()
    with pytest.raises(ConfigError, match="env.world_size=9 would be ignored"):
        coin_suite(tmp_path, 5, world_size=9).check()
    with pytest.raises(ConfigError, match="env.games_dir both"):
        coin_suite(tmp_path, 5, games_dir=str(tmp_path)).check()


@pytest.mark.realenv
def test_generate_cache_and_disjoint_splits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    suite = coin_suite(tmp_path, 5, eval_splits=["eval_in_distribution", "eval_out_of_distribution"])
    suite.check()  # generates the three splits
    train_dir, train = suite.games("train")
    eval_dir, evals = suite.games("eval_in_distribution")
    ood_dir, ood = suite.games("eval_out_of_distribution")
    assert train == ["game_7.z8", "game_8.z8"] and evals == ["game_100007.z8"] and ood == ["game_200007.z8"]
    assert len({train_dir, eval_dir, ood_dir}) == 3  # a folder per split (its first seed is in the key)
    assert "coin_collector-5-" in eval_dir.name and "coin_collector-25-" in ood_dir.name
    uuids = {textworld.Game.load(str(d / g.replace(".z8", ".json"))).metadata["uuid"]
             for d, games in ((train_dir, train), (eval_dir, evals), (ood_dir, ood)) for g in games}
    assert len(uuids) == 4  # four different games
    ood_walk = textworld.Game.load(str(ood_dir / "game_200007.json")).metadata["walkthrough"]
    assert len(ood_walk) == 25  # 24 moves along a chain of 25 rooms, then `take coin`

    # cached: a second suite with the same options generates nothing, a new level gets its own folder
    def refuse(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(textworld_games, "_make_game", refuse)
    again = coin_suite(tmp_path, 5, eval_splits=["eval_in_distribution", "eval_out_of_distribution"])
    again.check()
    assert again.games("train") == (train_dir, train)
    assert coin_suite(tmp_path, 6).split_folder("train") != train_dir


def play_expert(suite: TextWorldSuite, task, wrong_turns: int = 0) -> tuple[bool, int, str, str]:
    """Play the expert until the episode ends, with `wrong_turns` moves off its path after its first move
    (back down the chain, or into a dead end); (won, turns, first observation, goal)."""
    env = suite.make_env()
    try:
        obs, info = env.reset(task)
        first, goal, turns = obs, info["goal"], 0
        if wrong_turns:
            result = env.step(info["expert_action"])
            info, turns = result.info, 1
        for _ in range(wrong_turns):  # wander: an exit the expert would not take
            off = sorted(a for a in info["admissible_commands"] if a in DIRECTIONS and a != info["expert_action"])
            if not off:
                break
            result = env.step(off[0])
            info, turns = result.info, turns + 1
        while True:
            assert info["expert_action"] in info["admissible_commands"]
            result = env.step(info["expert_action"])
            info, turns = result.info, turns + 1
            if result.done:
                return bool(info["won"]), turns, first, goal
    finally:
        env.close()


@pytest.mark.realenv
@pytest.mark.slow
@pytest.mark.parametrize("level", [8, 108])  # a bare chain of 8, and the chain with a dead end beside each room
def test_the_expert_wins_every_game_within_max_turns(tmp_path: Path, level: int) -> None:
    chain, _ = coin_collector_rooms(level)
    suite = coin_suite(tmp_path, level, num_games=4, max_turns=chain + 6)
    suite.check()
    _, games = suite.games("train")
    tasks = suite.sample_tasks("train", len(games), random.Random(0))
    for task in tasks:
        won, turns, first, goal = play_expert(suite, task)
        assert won and turns == chain  # chain - 1 moves and `take coin`: the walkthrough, shortest
        assert goal == COIN_GOAL and "$$" not in first
        assert "First step" not in first and "Here is your task" not in first  # the way is not told
        # replanned from off the path: 3 wrong moves (into a dead end and back, or backwards) cost turns only
        won, turns, _, _ = play_expert(suite, task, wrong_turns=3)
        assert won and chain < turns <= chain + 6


@pytest.mark.realenv
@pytest.mark.slow
def test_treasure_hunter_generates_and_its_expert_wins(tmp_path: Path) -> None:
    suite = TextWorldSuite(TextWorldConfig(cache_dir=str(tmp_path), challenge="treasure_hunter", challenge_level=1,
                                           num_games=1, num_eval_games=1, seed=3, max_turns=30))
    suite.check()
    task = suite.sample_tasks("train", 1, random.Random(0))[0]
    won, turns, _, goal = play_expert(suite, task)
    assert won and turns <= 30 and goal  # its goal names the object to find: kept


def test_presets_compose_without_warnings() -> None:
    import warnings

    from epo_cli.launch.setup import compose_for_train

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no setting of the presets goes unread
        cfg = compose_for_train(["env=coin_collector"])[0]
        warm = compose_for_train(["experiment=coin_warm_start"])[0]
        rl = compose_for_train(["experiment=coin_long_horizon", "model.path=/nonexistent"])[0]
    assert cfg.env.challenge == "coin_collector" and cfg.env.challenge_level == 130
    assert warm.algo.name == "sft" and warm.algo.demo_slip > 0 and warm.env.challenge == "coin_collector"
    assert rl.env.challenge == "coin_collector" and rl.env.max_turns >= 30
    assert rl.env.challenge_level == 130 and warm.env.challenge_level <= rl.env.challenge_level


def test_policy_text_is_made_safe_for_the_game() -> None:
    from epo_cli.envs.textworld_games import MAX_COMMAND_CHARS, game_command

    assert game_command("  go   east\n") == "go east"
    assert game_command("go\teast\x00\u00e9") == "go east"  # control and non-ASCII characters become spaces
    assert len(game_command("take coin " * 50)) == MAX_COMMAND_CHARS


@pytest.mark.realenv
def test_garbage_actions_get_an_answer_not_a_crash(tmp_path: Path) -> None:
    # frotz crashed the process (SIGSEGV) on a long sampled action before game_command
    suite = coin_suite(tmp_path, 3, num_games=1)
    suite.check()
    env = suite.make_env()
    try:
        env.reset(suite.sample_tasks("train", 1, random.Random(0))[0])
        for action in ("<think>" + "go east " * 200, "\u00e9\u00e9\n\n\x00>>", ""):
            result = env.step(action)
            assert isinstance(result.observation, str) and not result.info["won"]
    finally:
        env.close()


def test_tw_make_cache_folders_are_unchanged_by_the_challenges(tmp_path: Path) -> None:
    # the key of tw-make's games as it was computed before env.challenge existed (same fields, same hash)
    import hashlib
    import json
    from importlib.metadata import version

    suite = TextWorldSuite(TextWorldConfig(cache_dir=str(tmp_path)))
    old = {"world_size": 5, "nb_objects": 10, "quest_length": 5, "count": None, "first_seed": 1234,
           "textworld": version("textworld")}
    digest = hashlib.sha1(json.dumps(old, sort_keys=True).encode()).hexdigest()[:10]
    assert suite.split_folder("train") == tmp_path / f"r5-o10-q5-{digest}"


def test_expert_thought_names_the_rooms_exits() -> None:
    from epo_cli.envs.textworld_games import expert_thought

    admissible = ["go east", "go north", "inventory", "look", "take coin"]
    assert expert_thought("exits", admissible) == "exits: east, north"  # the list's order, `go` commands only
    assert expert_thought("exits", ["look", "inventory"]) == "exits: none"
    assert expert_thought(None, admissible) is None
    assert expert_thought("exits_back", admissible, "south") == "exits: east, north; back: north"
    assert expert_thought("exits_back", admissible, None) == "exits: east, north; back: none"  # no move yet
    assert expert_thought("back_on", admissible, "west") == "back: east; on: north"
    assert expert_thought("back_on", ["go west", "look"], "east") == "back: west; on: none"  # a dead end
    assert expert_thought("back_on", admissible, None) == "back: none; on: east, north"


@pytest.mark.realenv
def test_expert_thought_reaches_the_demonstrations(tmp_path: Path) -> None:
    """With env.expert_thought=exits_back every step's info names the exits the admissible list offers and
    the reverse of the last move made; a command into a wall is no move."""
    suite = coin_suite(tmp_path, 105, num_games=1, expert_thought="exits_back")
    suite.check()
    task = suite.sample_tasks("train", 1, random.Random(0))[0]
    env = suite.make_env()
    reverse = {"north": "south", "south": "north", "east": "west", "west": "east"}
    try:
        _, info = env.reset(task)
        back = "none"
        for turn in range(6):
            exits = [c[3:] for c in info["admissible_commands"] if c.startswith("go ")]
            assert info["expert_thought"] == "exits: " + ", ".join(exits) + f"; back: {back}" and exits
            wall = next(d for d in reverse if d not in exits)
            action = f"go {wall}" if turn == 2 else info["expert_action"]
            result = env.step(action)
            if action.startswith("go ") and turn != 2:
                back = reverse[action[3:]]
            info = result.info
            if result.done:
                break
    finally:
        env.close()
    plain = coin_suite(tmp_path, 105, num_games=1)  # the same games: the thought is no generator option
    env = plain.make_env()
    try:
        assert env.reset(task)[1]["expert_thought"] is None  # the default: no thought
    finally:
        env.close()
