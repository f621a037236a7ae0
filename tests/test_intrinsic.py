"""The intrinsic reward (algo.intrinsic, epo_cli/algos/intrinsic.py): hand-computed bonuses, its place in
the batch, and the CLI (the bonus changes the update, not the rollout; a setting of it while it is off is
warned)."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from epo_cli.algos.intrinsic import count_bonus, intrinsic_rewards, intrinsic_scale
from epo_cli.envs.base import Task
from epo_cli.launch.setup import compose_for_train
from epo_cli.rollout.episodes import Episode, Turn, episodes_to_batch
from tests.conftest import metrics_rows, only_run_dir, run_epo


def test_count_bonus_by_hand() -> None:
    # group 0: trajectory a answers X, Y, X; trajectory b answers X, Z. Group 1: one trajectory answers X.
    #   turn 0: group 0 saw X twice (a and b together)  -> a, b: 1/sqrt(2) = 0.70711
    #   turn 1: Y once, Z once                           -> a: 1, b: 1
    #   turn 2: X a third time                           -> a: 1/sqrt(3) = 0.57735
    #   group 1 has its own table: X once at turn 0      -> 1
    groups = [0, 0, 0, 0, 0, 1]
    turns = [0, 1, 2, 0, 1, 0]
    obs = ["X", "Y", "X", "X", "Z", "X"]
    got = count_bonus(groups, turns, obs, scale=1.0)
    assert got == pytest.approx([0.70711, 1.0, 0.57735, 0.70711, 1.0, 1.0], abs=1e-5)
    # scale multiplies: coef 0.5, decay 0.9 at iteration k = 2: 0.5 * 0.81 = 0.405
    cfg = SimpleNamespace(kind="count", coef=0.5, decay=0.9)
    assert intrinsic_scale(cfg, 2) == pytest.approx(0.405)
    assert count_bonus(groups, turns, obs, scale=0.405) == pytest.approx([0.405 * g for g in got])


def test_count_bonus_ignores_row_order() -> None:
    # a pure function of (group, turn, observation): shuffling the rows permutes the bonuses alike
    rng = random.Random(0)
    rows = [(rng.randrange(3), rng.randrange(6), rng.choice("ABCD")) for _ in range(60)]
    base = count_bonus(*zip(*rows), scale=1.0)
    order = list(range(len(rows)))
    rng.shuffle(order)
    shuffled = count_bonus(*zip(*[rows[i] for i in order]), scale=1.0)
    assert shuffled == [base[i] for i in order]


def test_count_bonus_revisits_keep_counting() -> None:
    # one trajectory going back and forth between two states: counts 1, 1, 2, 2, 3 -> 1, 1, 1/sqrt2, 1/sqrt2, 1/sqrt3
    got = count_bonus([7] * 5, [0, 1, 2, 3, 4], ["A", "B", "A", "B", "A"], scale=2.0)
    assert got == pytest.approx([2.0, 2.0, 2 / math.sqrt(2), 2 / math.sqrt(2), 2 / math.sqrt(3)])


def _episode(traj: int, group: int, results: list[str], won: bool = False) -> Episode:
    ep = Episode(Task("t", "pick_and_place", 0, "train"), traj_id=traj, group_id=group, won=won)
    for r in results:
        ep.turns.append(Turn([1], [2], "", "obs", [], "a", True, [], False, False, result=r))
    return ep


def test_intrinsic_rewards_follow_the_batch_rows() -> None:
    # two rollouts of one task; rows in episodes_to_batch's order: episode by episode, turn by turn
    #   turn 0: both reach "P" (count 2) -> 1/sqrt(2) each; turn 1: "Q" (1) -> 1; "P" again (3) -> 1/sqrt(3)
    episodes = [_episode(0, 5, ["P", "Q"], won=True), _episode(1, 5, ["P", "P"])]
    cfg = SimpleNamespace(kind="count", coef=0.3, decay=1.0)
    bonus = intrinsic_rewards(episodes, cfg, step=4)
    assert bonus.tolist() == pytest.approx([0.3 / math.sqrt(2), 0.3, 0.3 / math.sqrt(2), 0.3 / math.sqrt(3)])
    batch = episodes_to_batch(episodes, reward_scale=10.0, invalid_penalty=0.1)
    assert len(batch) == len(bonus)
    assert intrinsic_rewards(episodes, SimpleNamespace(kind="none", coef=0.3, decay=1.0), 0).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="unknown intrinsic reward"):
        intrinsic_rewards(episodes, SimpleNamespace(kind="rnd", coef=0.3, decay=1.0), 0)


def test_the_bonus_does_not_depend_on_how_groups_are_split_over_ranks() -> None:
    # GroupSampler gives each rank whole groups; every rank computes the bonus of its own episodes. The
    # bonus of a row is the same whether one rank holds all 4 groups or two ranks hold 2 each.
    rng = random.Random(1)
    episodes = [_episode(8 * g + k, g, [rng.choice("PQR") for _ in range(rng.randrange(1, 6))])
                for g in range(4) for k in range(8)]
    cfg = SimpleNamespace(kind="count", coef=0.7, decay=0.9)
    one_rank = intrinsic_rewards(episodes, cfg, step=3)
    two_ranks = torch.cat([intrinsic_rewards(episodes[:16], cfg, 3), intrinsic_rewards(episodes[16:], cfg, 3)])
    assert torch.equal(one_rank, two_ranks)


def test_batch_select_keeps_the_bonus_apart() -> None:
    batch = episodes_to_batch([_episode(0, 0, ["P", "Q"]), _episode(1, 0, ["R"])], 10.0, 0.1)
    batch.intrinsic = torch.tensor([0.5, 0.25, 1.0])
    assert batch.select([2, 0]).intrinsic.tolist() == [1.0, 0.5]


@pytest.mark.parametrize(("overrides", "text"), [
    (["algo=grpo", "algo.intrinsic.coef=0.5"], "algo.intrinsic.coef=0.5: no effect in this run "
                                                 "(algo.intrinsic.kind=none adds no bonus"),
    (["algo=sft", "algo.intrinsic.kind=count"], "algo.intrinsic.kind=count: no effect in this run "
                                                  "(algo=sft plays no rollouts"),
])
def test_settings_while_off_are_warned(overrides: list[str], text: str) -> None:
    with pytest.warns(UserWarning, match=re.escape(text)):
        compose_for_train(overrides)


def test_bad_intrinsic_settings_fail_at_config_time(tmp_path: Path) -> None:
    proc = run_epo(["train", "algo=grpo", "algo.intrinsic.kind=curiosity"], cwd=tmp_path, expect=2)
    assert "algo.intrinsic.kind" in proc.stderr and "count" in proc.stderr
    proc = run_epo(["train", "algo=grpo", "algo.intrinsic.decay=1.5"], cwd=tmp_path, expect=2)
    assert "algo.intrinsic.decay" in proc.stderr


def _first_step(tmp_path: Path, name: str, small_config, warm: Path, *extra: str) -> dict:
    out = tmp_path / name
    run_epo(["train", *small_config.rl("algo=grpo", f"model.path={warm / 'final'}", "trainer.total_steps=1",
                                       "trainer.save_every=0", f"output_dir={out}", *extra)], cwd=tmp_path)
    return metrics_rows(only_run_dir(out))[0]


def test_the_bonus_changes_the_update_not_the_rollout(tmp_path: Path, small_config, warm_start_short: Path) -> None:
    plain = _first_step(tmp_path, "plain", small_config, warm_start_short)
    bonus = _first_step(tmp_path, "bonus", small_config, warm_start_short, "algo.intrinsic.kind=count",
                        "algo.intrinsic.coef=1.0")
    # same seed, same weights: the same episodes were played
    for key in ("rollout/success", "rollout/episode_len", "rollout/invalid_rate", "rollout/samples",
                "rollout/task_reward"):
        assert bonus[key] == plain[key], key
    # the shaped reward is reported without the bonus: (r + b) - b in float32 rounds, so equal to ~1e-6
    assert bonus["rollout/shaped_reward"] == pytest.approx(plain["rollout/shaped_reward"], rel=1e-5, abs=1e-5)
    assert "rollout/intrinsic_reward" not in plain
    # every turn earns between coef / sqrt(group_size * turns) (all 4 rollouts on one state at every turn)
    # and coef (always a new state)
    n, turns = bonus["rollout/samples"], bonus["rollout/max_turns"]
    assert n / math.sqrt(4 * turns) <= bonus["rollout/intrinsic_reward"] <= n
    # ... and the rewards the estimator saw differ: another gradient
    assert bonus["perf/grad_norm"] != pytest.approx(plain["perf/grad_norm"], rel=1e-6)
