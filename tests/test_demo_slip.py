"""The slipping demonstrator (algo.demo_slip): the noisy teacher of the learning regime (docs/learning.md)."""

from __future__ import annotations

import random

import pytest

from epo_cli.envs.household import HouseholdSuite
from epo_cli.envs.pool import EnvPool
from epo_cli.rollout.episodes import ExpertPolicy, PlayConfig, episode_slots, run_episodes
from epo_cli.rollout.prompts import PromptBuilder


class CharTokenizer:
    """Text <-> code points: enough to read back what the policy wrote."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(r) for r in rows]


INFO = {"expert_action": "go to sinkbasin 1", "expert_thought": "look for the soap",
        "admissible_commands": ["go to sinkbasin 1", "go to toilet 1", "help", "look"]}


def _actions(slip: float, seeds: list[int]) -> list[str]:
    tok = CharTokenizer()
    out = ExpertPolicy(tok, slip=slip).act([[]] * len(seeds), [INFO] * len(seeds), seeds)
    return [tok.decode(ids) for ids in out]


def test_no_slip_is_the_expert() -> None:
    assert set(_actions(0.0, list(range(50)))) == {"<think>look for the soap</think><action>go to sinkbasin 1</action>"}


def test_a_slip_is_the_seeded_draw_worked_by_hand() -> None:
    """Row seed s: slip when Random(s).random() < slip, then Random(s).choice(others) (the same generator,
    second draw); `others` leaves out the expert's action and `help`; the thought is the expert's."""
    for seed in range(40):
        rng = random.Random(seed)
        slipped = rng.random() < 0.3
        action = rng.choice(["go to toilet 1", "look"]) if slipped else "go to sinkbasin 1"
        assert _actions(0.3, [seed]) == [f"<think>look for the soap</think><action>{action}</action>"]


@pytest.mark.parametrize("slip", [0.1, 0.4])
def test_the_slip_rate_is_the_setting(slip: float) -> None:
    actions = _actions(slip, list(range(4000)))
    rate = sum("sinkbasin" not in a.split("<action>")[1] for a in actions) / len(actions)
    assert abs(rate - slip) < 0.025
    assert not any("help" in a for a in actions)


def test_slipping_demonstrations_still_win_and_are_longer() -> None:
    """The expert answers from any state, so a slipping teacher still solves the tiny level, in more turns;
    the same seed plays the same demonstrations."""
    suite = HouseholdSuite()
    tasks = suite.sample_tasks("train", 24, random.Random(0), level="tiny_open_pick_place")
    tok = CharTokenizer()
    settings = PlayConfig(PromptBuilder("compact", 2, 4096, tok.encode), tok, 30, seed=7)

    def play(slip: float) -> list:
        with EnvPool(suite, num_workers=0) as pool:
            return run_episodes(ExpertPolicy(tok, slip=slip), pool, episode_slots(tasks, list(range(len(tasks)))),
                                settings)[0]

    clean, noisy, again = play(0.0), play(0.4), play(0.4)
    assert all(ep.won for ep in clean)
    assert sum(ep.won for ep in noisy) >= 20
    assert sum(len(ep.turns) for ep in noisy) > 1.3 * sum(len(ep.turns) for ep in clean)
    assert [ep.actions for ep in noisy] == [ep.actions for ep in again]
