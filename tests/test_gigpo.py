"""GiGPO (arXiv 2505.10978) against hand-computed values (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from epo_cli.algos.advantages import (
    anchor_groups,
    anchor_keys,
    discounted_step_returns,
    gigpo,
    key_similarity,
    text_similarity,
)
from epo_cli.compose import compose
from epo_cli.config import AlgoConfig, GiGPOConfig, GRPOConfig
from epo_cli.errors import ConfigError
from epo_cli.rollout.batch import TurnBatch

torch.set_num_threads(1)


def make_batch(trajs, order=None) -> TurnBatch:
    """trajs: list of (traj_id, group_id, outcome, [turn rewards], [anchor observations])."""
    rows = []
    for tid, gid, outcome, rewards, obs in trajs:
        assert len(rewards) == len(obs)
        for t, (r, o) in enumerate(zip(rewards, obs)):
            rows.append((tid, gid, t, len(rewards), r, outcome, o))
    if order is not None:
        rows = [rows[i] for i in order]
    col = list(zip(*rows))
    n = len(rows)
    return TurnBatch(
        prompt_ids=[[1]] * n, response_ids=[[2]] * n,
        traj_id=torch.tensor(col[0]), group_id=torch.tensor(col[1]), turn_index=torch.tensor(col[2]),
        num_turns=torch.tensor(col[3]), reward=torch.tensor(col[4], dtype=torch.float32),
        outcome=torch.tensor(col[5], dtype=torch.float32), valid=torch.ones(n, dtype=torch.bool),
        won=torch.tensor([o > 0 for o in col[5]]), task_type=["t"] * n, anchor_obs=list(col[6]),
    )


def gigpo_algo(**kw) -> AlgoConfig:
    algo = AlgoConfig()
    for k, v in kw.items():
        setattr(algo.gigpo, k, v)
    return algo


def close(x, expected, atol=1e-5):
    assert torch.allclose(x.double(), torch.tensor(expected, dtype=torch.float64), atol=atol), (x, expected)


#: two groups. Group 0: traj 0 wins in 2 turns (A, B); traj 1 fails in 3 turns and comes back to A
#: (A, C, A); traj 2 fails in 2 turns (A, B) with a turn reward of -1 at its second turn.
#: Group 1: traj 3 wins in one turn from an observation also called "A" (another task: never grouped
#: with group 0's A); traj 4 fails (D, E): turns without a partner.
TWO_GROUPS = [
    (0, 0, 10.0, [0.0, 0.0], ["A", "B"]),
    (1, 0, 0.0, [0.0, 0.0, 0.0], ["A", "C", "A"]),
    (2, 0, 0.0, [0.0, -1.0], ["A", "B"]),
    (3, 1, 10.0, [0.0], ["A"]),
    (4, 1, 0.0, [0.0, 0.0], ["D", "E"]),
]


def test_step_returns_are_discounted_with_the_outcome_at_the_end():
    # gamma = 0.5, r_l = reward_l + outcome on the last turn
    #   traj 0: r = [0, 10]      -> R_1 = 10,  R_0 = 0 + 0.5*10 = 5
    #   traj 1: r = [0, 0, 0]    -> 0, 0, 0
    #   traj 2: r = [0, -1]      -> R_1 = -1,  R_0 = 0 + 0.5*-1 = -0.5
    #   traj 3: r = [10]         -> 10;        traj 4: 0, 0
    close(discounted_step_returns(make_batch(TWO_GROUPS), 0.5), [5, 10, 0, 0, 0, -0.5, -1, 10, 0, 0])


def test_anchor_groups_stay_inside_their_episode_group():
    ids = anchor_groups(make_batch(TWO_GROUPS)).tolist()
    # rows: t0:A t0:B t1:A t1:C t1:A t2:A t2:B | t3:A t4:D t4:E
    a, b, c = ids[0], ids[1], ids[3]
    assert ids[:7] == [a, b, a, c, a, a, b]  # the revisited A of traj 1 joins the group's A
    assert len({a, b, c}) == 3
    assert len(set(ids[7:])) == 3 and not set(ids[7:]) & {a, b, c}  # group 1's "A" is its own step group


def test_gigpo_mean_norm_two_groups_by_hand():
    # mode mean_norm, gamma 0.5, step_weight 1, episode statistics over turn-samples (grpo.mean_over=turns)
    # Episode level, score = outcome + turn reward:
    #   group 0 rows: t0 [10, 10], t1 [0, 0, 0], t2 [0, -1]; mean = 19/7
    #     A_ep: t0: 10 - 19/7 = 51/7 (both rows); t1: -19/7; t2: -19/7, -1 - 19/7 = -26/7
    #   group 1 rows: t3 [10], t4 [0, 0]; mean = 10/3 -> A_ep: t3: 20/3; t4: -10/3, -10/3
    # Step level (returns from the test above):
    #   group 0, anchor A: t0r0 5, t1r0 0, t1r2 0, t2r0 -0.5; mean = 4.5/4 = 1.125
    #     A_step = 3.875, -1.125, -1.125, -1.625
    #   group 0, anchor B: t0r1 10, t2r1 -1; mean = 4.5 -> 5.5, -5.5
    #   group 0, anchor C (t1r1) and group 1's A, D, E: alone -> 0
    algo = gigpo_algo(gamma=0.5, step_weight=1.0, mode="mean_norm")
    adv, ret = gigpo(make_batch(TWO_GROUPS), algo.gigpo, algo.grpo)
    expected = [51 / 7 + 3.875, 51 / 7 + 5.5,
                -19 / 7 - 1.125, -19 / 7, -19 / 7 - 1.125,
                -19 / 7 - 1.625, -26 / 7 - 5.5,
                20 / 3, -10 / 3, -10 / 3]
    close(adv, expected)
    close(ret, expected)


def test_gigpo_row_order_does_not_matter():
    # the same batch with rows shuffled: every row keeps its own advantage
    order = [9, 3, 0, 7, 5, 1, 8, 2, 6, 4]
    algo = gigpo_algo(gamma=0.5, mode="mean_norm")
    straight, _ = gigpo(make_batch(TWO_GROUPS), algo.gigpo, algo.grpo)
    shuffled, _ = gigpo(make_batch(TWO_GROUPS, order=order), algo.gigpo, algo.grpo)
    close(shuffled, straight[order].tolist())


def test_gigpo_mean_std_norm_and_step_weight():
    # group of traj 0 and traj 2 only (from TWO_GROUPS), mean_std_norm, step_weight 0.5, gamma 0.5
    # Episode: scores [10, 10, 0, -1]; mean 4.75; deviations 5.25, 5.25, -4.75, -5.75
    #   sum of squares 27.5625 + 27.5625 + 22.5625 + 33.0625 = 110.75; unbiased std = sqrt(110.75 / 3)
    # Step: anchor A returns [5, -0.5], anchor B [10, -1]: a pair normalises to +-(d/2) / (|d|/sqrt 2)
    #   = +-1/sqrt(2) (the eps 1e-6 is below the tolerance)
    batch = make_batch([TWO_GROUPS[0], TWO_GROUPS[2]])
    adv, _ = gigpo(batch, GiGPOConfig(gamma=0.5, step_weight=0.5, mode="mean_std_norm"), GRPOConfig())
    std = math.sqrt(110.75 / 3)
    h = 0.5 / math.sqrt(2)
    close(adv, [5.25 / std + h, 5.25 / std + h, -4.75 / std - h, -5.75 / std - h])


def test_gigpo_episode_level_over_trajectories():
    # grpo.mean_over=trajectories: episode score = trajectory return; group 0: [10, 0, -1], mean 3
    #   A_ep = 7, -3, -4 for every turn of traj 0, 1, 2; group 1: [10, 0], mean 5 -> 5, -5
    # step_weight 0: only the episode level remains
    algo = gigpo_algo(gamma=0.5, step_weight=0.0, mode="mean_norm")
    algo.grpo.mean_over = "trajectories"
    adv, _ = gigpo(make_batch(TWO_GROUPS), algo.gigpo, algo.grpo)
    close(adv, [7, 7, -3, -3, -3, -4, -4, 5, -5, -5])


def test_similarity_threshold_merges_near_identical_anchors():
    # difflib ratio = 2 * matches / (len a + len b): "abcd" vs "abce" -> 2*3/8 = 0.75; "abcd" vs "wxyz" -> 0
    assert text_similarity("abcd", "abce") == pytest.approx(0.75)
    assert text_similarity("abcd", "wxyz") == 0.0
    trajs = [(0, 0, 10.0, [0.0], ["abcd"]), (1, 0, 0.0, [0.0], ["abce"]), (2, 0, 0.0, [0.0], ["wxyz"])]
    exact = anchor_groups(make_batch(trajs), 1.0).tolist()
    loose = anchor_groups(make_batch(trajs), 0.7).tolist()
    strict = anchor_groups(make_batch(trajs), 0.8).tolist()
    assert len(set(exact)) == 3 and len(set(strict)) == 3
    assert loose[0] == loose[1] != loose[2]
    # with 0.7, A_step (mean_norm, gamma 1) in the {abcd, abce} step group: returns 10, 0 -> +5, -5;
    # wxyz alone -> 0. Episode level: scores 10, 0, 0, mean 10/3 -> 20/3, -10/3, -10/3
    adv, _ = gigpo(make_batch(trajs), GiGPOConfig(gamma=1.0, mode="mean_norm", similarity=0.7), GRPOConfig())
    close(adv, [20 / 3 + 5, -10 / 3 - 5, -10 / 3])


def test_admissible_actions_refine_the_anchor():
    # three turns that all read "Nothing happens.", two at the same place (same admissible actions)
    trajs = [(0, 0, 10.0, [0.0], ["Nothing happens."]), (1, 0, 0.0, [0.0], ["Nothing happens."]),
             (2, 0, 0.0, [0.0], ["Nothing happens."])]
    batch = make_batch(trajs)
    batch.admissible = ["look\ntake mug 1", "look\ntake mug 1", "look\nopen fridge 1"]
    assert len(set(anchor_groups(batch).tolist())) == 1
    refined = anchor_groups(batch, anchor="observation_admissible").tolist()
    assert refined[0] == refined[1] != refined[2]
    # mean_norm, gamma 1: episode 20/3, -10/3, -10/3 (mean 10/3); step: {10, 0} -> +5, -5; alone -> 0
    algo = gigpo_algo(gamma=1.0, mode="mean_norm", anchor="observation_admissible")
    close(gigpo(batch, algo.gigpo, algo.grpo)[0], [20 / 3 + 5, -10 / 3 - 5, -10 / 3])
    batch.admissible = []
    with pytest.raises(ValueError, match="admissible"):
        gigpo(batch, algo.gigpo, algo.grpo)


def test_observation_admissible_keys_on_the_pair_not_a_joined_string():
    # obs 'a\n--\nb' with admissible 'c', and obs 'a' with admissible 'b\n--\nc': the old key, the string
    # obs + "\n--\n" + adm, was 'a\n--\nb\n--\nc' for both, so two different states shared a step group
    trajs = [(0, 0, 10.0, [0.0], ["a\n--\nb"]), (1, 0, 0.0, [0.0], ["a"])]
    batch = make_batch(trajs)
    batch.admissible = ["c", "b\n--\nc"]
    assert anchor_keys(batch, "observation_admissible") == [("a\n--\nb", "c"), ("a", "b\n--\nc")]
    ids = anchor_groups(batch, anchor="observation_admissible").tolist()
    assert ids[0] != ids[1]
    # each turn is alone in its step group -> A_step = 0; A = the episode level only (mean_norm, scores
    # 10 and 0 -> +5, -5). With the two merged it was +5 + 5 and -5 - 5.
    algo = gigpo_algo(gamma=1.0, mode="mean_norm", anchor="observation_admissible")
    close(gigpo(batch, algo.gigpo, algo.grpo)[0], [5.0, -5.0])
    # below similarity 1 the pair is compared field by field (the lower similarity counts): 'a\n--\nb' vs
    # 'a' = 2*1/6 = 0.33 -> apart at 0.9, however similar the joined strings would be
    assert len(set(anchor_groups(batch, 0.9, "observation_admissible").tolist())) == 2
    assert key_similarity(("abcd", "x"), ("abce", "x")) == pytest.approx(0.75)


def test_gigpo_needs_anchor_observations():
    batch = make_batch(TWO_GROUPS)
    batch.anchor_obs = []
    with pytest.raises(ValueError, match="anchor_obs"):
        gigpo(batch, GiGPOConfig(), GRPOConfig())


def test_select_keeps_anchors():
    batch = make_batch(TWO_GROUPS)
    batch.admissible = [f"a{i}" for i in range(len(batch))]
    picked = batch.select([3, 0])
    assert picked.anchor_obs == ["C", "A"] and picked.admissible == ["a3", "a0"]


def test_gigpo_configs():
    cfg = compose(["algo=gigpo"])
    assert cfg.algo.estimator == "gigpo" and cfg.algo.gigpo.gamma == 0.95 and cfg.algo.gigpo.step_weight == 1.0
    assert cfg.algo.gigpo.mode == "mean_std_norm" and cfg.algo.group_size == 8
    epo = compose(["algo=epo", "algo.base=gigpo"])
    assert epo.algo.estimator == "gigpo" and "entropy_smoothing" in epo.algo.loss_terms
    assert compose(["algo=grpo", "algo.estimator=gigpo"]).algo.estimator == "gigpo"


@pytest.mark.parametrize("overrides,needle", [
    (["algo=gigpo", "algo.gigpo.mode=std"], "mean_std_norm, mean_norm"),
    (["algo=gigpo", "algo.gigpo.similarity=0"], "0 < value <= 1"),
    (["algo=gigpo", "algo.gigpo.anchor=state"], "observation, observation_admissible"),
    (["algo=gigpo", "algo.gigpo.similarity=1.5"], "0 < value <= 1"),
    (["algo=gigpo", "algo.group_size=1"], "group_size >= 2"),
    (["algo=grpo", "algo.estimator=gipgo"], "gigpo"),
])
def test_bad_gigpo_config_is_one_clear_error(overrides, needle):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert needle in str(err.value)
