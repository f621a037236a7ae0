"""Advantage estimators against hand-computed values (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from epo_cli.algos.advantages import ESTIMATORS, AdvantageEstimator, gae, grpo, rloo, whiten
from epo_cli.config import AlgoConfig, GAEConfig, GRPOConfig
from epo_cli.errors import ConfigError
from epo_cli.rollout.batch import TurnBatch

torch.set_num_threads(1)


def make_batch(trajs, values=None, order=None) -> TurnBatch:
    """trajs: list of (traj_id, group_id, outcome, [turn rewards]); values: per trajectory list of V_t.

    Rows are emitted trajectory by trajectory, turn by turn, then permuted by `order` (to check that
    estimators sort by the true turn index rather than trusting row order).
    """
    rows = []
    for j, (tid, gid, outcome, rewards) in enumerate(trajs):
        for t, r in enumerate(rewards):
            v = values[j][t] if values is not None else 0.0
            rows.append((tid, gid, t, len(rewards), r, outcome, v))
    if order is not None:
        rows = [rows[i] for i in order]
    col = list(zip(*rows))
    n = len(rows)
    return TurnBatch(
        prompt_ids=[[1]] * n,
        response_ids=[[2]] * n,
        traj_id=torch.tensor(col[0]),
        group_id=torch.tensor(col[1]),
        turn_index=torch.tensor(col[2]),
        num_turns=torch.tensor(col[3]),
        reward=torch.tensor(col[4], dtype=torch.float32),
        outcome=torch.tensor(col[5], dtype=torch.float32),
        valid=torch.ones(n, dtype=torch.bool),
        won=torch.tensor([o > 0 for o in col[5]]),
        task_type=["t"] * n,
        old_values=torch.tensor(col[6], dtype=torch.float32),
    )


def close(x, expected, atol=1e-5):
    assert torch.allclose(x.double(), torch.tensor(expected, dtype=torch.float64), atol=atol), (x, expected)


def test_registry_names():
    assert ESTIMATORS.names() == ["gae", "gigpo", "grpo", "rloo"]


# ------------------------------------------------------------------------------------------------ gae


def test_gae_three_turns_gamma09_lam08_and_a_one_turn_trajectory():
    # traj 7: rewards [0, -0.1, 0], outcome 10, V = [1, 2, 4]; traj 8: reward [-0.1], outcome 0, V = [0.5]
    # traj 7: r = [0, -0.1, 0 + 10] (outcome on the last turn); V after the last turn = 0
    #   delta_2 = 10 + 0.9*0 - 4        = 6
    #   delta_1 = -0.1 + 0.9*4 - 2      = 1.5
    #   delta_0 = 0 + 0.9*2 - 1         = 0.8
    #   gamma*lam = 0.72
    #   A_2 = 6;  A_1 = 1.5 + 0.72*6 = 5.82;  A_0 = 0.8 + 0.72*5.82 = 0.8 + 4.1904 = 4.9904
    #   returns = A + V = [5.9904, 7.82, 10.0]
    # traj 8: delta_0 = -0.1 + 0 - 0.5 = -0.6 = A;  return = -0.1
    # rows shuffled: row order = [traj7 t2, traj8 t0, traj7 t0, traj7 t1]
    batch = make_batch(
        [(7, 0, 10.0, [0.0, -0.1, 0.0]), (8, 0, 0.0, [-0.1])],
        values=[[1.0, 2.0, 4.0], [0.5]],
        order=[2, 3, 0, 1],
    )
    adv, ret = gae(batch, GAEConfig(gamma=0.9, lam=0.8, whiten=False))
    close(adv, [6.0, -0.6, 4.9904, 5.82])
    close(ret, [10.0, -0.1, 5.9904, 7.82])


def test_gae_gamma_lam_one_is_return_to_go_minus_value():
    # gamma = lam = 1: A_t = (sum_{t'>=t} r_t' + outcome) - V_t
    #   returns-to-go: t0: 0 - 0.1 + 10 = 9.9, t1: -0.1 + 10 = 9.9, t2: 10
    #   A = [9.9 - 1, 9.9 - 2, 10 - 4] = [8.9, 7.9, 6.0]
    batch = make_batch([(0, 0, 10.0, [0.0, -0.1, 0.0])], values=[[1.0, 2.0, 4.0]])
    adv, ret = gae(batch, GAEConfig(gamma=1.0, lam=1.0, whiten=False))
    close(adv, [8.9, 7.9, 6.0])
    close(ret, [9.9, 9.9, 10.0])


def test_gae_whitened_returns_unwhitened():
    # A = [8.9, 7.9, 6.0]: mean = 22.8/3 = 7.6, deviations [1.3, 0.3, -1.6],
    # squares 1.69 + 0.09 + 2.56 = 4.34, unbiased var = 4.34/2 = 2.17, std = sqrt(2.17)
    batch = make_batch([(0, 0, 10.0, [0.0, -0.1, 0.0])], values=[[1.0, 2.0, 4.0]])
    adv, ret = gae(batch, GAEConfig(gamma=1.0, lam=1.0, whiten=True))
    s = math.sqrt(2.17)
    close(adv, [1.3 / s, 0.3 / s, -1.6 / s])
    close(ret, [9.9, 9.9, 10.0])  # critic targets are A + V before whitening


def test_gae_needs_values_and_whole_trajectories():
    batch = make_batch([(0, 0, 1.0, [0.0, 0.0])])
    batch.old_values = None
    with pytest.raises(ValueError, match="old_values"):
        gae(batch, GAEConfig())
    partial = make_batch([(0, 0, 1.0, [0.0, 0.0, 0.0])]).select([0, 2])  # turn 1 missing
    with pytest.raises(ValueError, match="0..T-1"):
        gae(partial, GAEConfig())


# --------------------------------------------------------------------------------------------- whiten


def test_whiten_split_over_two_ranks_equals_global():
    x = torch.tensor([1.0, 4.0, -2.0, 0.5, 3.0, 7.0, -1.0])
    a, b = x[:4], x[4:]
    # what each "rank" contributes: capture its local [sum, sum sq, count]
    captured = {}
    whiten(a, all_reduce_sum=lambda s: captured.setdefault("a", s.clone()))
    whiten(b, all_reduce_sum=lambda s: captured.setdefault("b", s.clone()))
    wa = whiten(a, all_reduce_sum=lambda s: s + captured["b"])
    wb = whiten(b, all_reduce_sum=lambda s: s + captured["a"])
    expected = (x - x.mean()) / (x.std() + 1e-8)  # global mean, unbiased global std
    close(torch.cat([wa, wb]), expected.tolist())
    close(whiten(x), expected.tolist())
    # by hand for a tiny case: [1, 3]: mean 2, std = sqrt(((-1)^2 + 1^2)/1) = sqrt(2)
    close(whiten(torch.tensor([1.0, 3.0])), [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    close(whiten(torch.tensor([5.0])), [0.0])  # one value: std 0, centred value 0


# ----------------------------------------------------------------------------------------------- grpo

# group 0: traj A: 1 turn, outcome 2, reward [0];  traj B: 3 turns, outcome 0, rewards [0, 0, 0]
UNEVEN = [(0, 0, 2.0, [0.0]), (1, 0, 0.0, [0.0, 0.0, 0.0])]


def test_grpo_turns_mode_uneven_lengths():
    # turn scores [2, 0, 0, 0]: mean 0.5; deviations [1.5, -0.5, -0.5, -0.5];
    # unbiased var = (2.25 + 3*0.25)/3 = 1, std = 1  ->  A = [1.5, -0.5, -0.5, -0.5] / (1 + 1e-6)
    batch = make_batch(UNEVEN)
    adv, ret = grpo(batch, GRPOConfig(mean_over="turns", norm_by_std=True))
    close(adv, [1.5, -0.5, -0.5, -0.5])
    close(ret, [2.0, 0.0, 0.0, 0.0])
    adv, _ = grpo(batch, GRPOConfig(mean_over="turns", norm_by_std=False))
    close(adv, [1.5, -0.5, -0.5, -0.5])  # std is 1 here: same numbers, now exactly score - mean


def test_grpo_trajectories_mode_uneven_lengths():
    # one score per trajectory: A: 2 + 0 = 2, B: 0 + 0 = 0; mean 1, unbiased std = sqrt(1 + 1) = sqrt(2)
    # A gets 1/sqrt(2) on its one turn; B gets -1/sqrt(2) on all three turns (the long episode does
    # not outweigh the short one, unlike turns mode where the mean was 0.5)
    batch = make_batch(UNEVEN)
    adv, ret = grpo(batch, GRPOConfig(mean_over="trajectories", norm_by_std=True))
    r = 1 / math.sqrt(2)
    close(adv, [r, -r, -r, -r])
    close(ret, [2.0, 0.0, 0.0, 0.0])
    adv, _ = grpo(batch, GRPOConfig(mean_over="trajectories", norm_by_std=False))
    close(adv, [1.0, -1.0, -1.0, -1.0])  # 2 - 1, 0 - 1


def test_grpo_two_groups_and_single_element_groups():
    # group 0 as above; group 1: traj C: 2 turns, outcome 1, rewards [0, 0]; traj D: 1 turn, outcome 0;
    # group 2: a lone 1-turn trajectory (outcome 5)
    batch = make_batch(UNEVEN + [(2, 1, 1.0, [0.0, 0.0]), (3, 1, 0.0, [0.0]), (4, 2, 5.0, [0.0])])
    adv, _ = grpo(batch, GRPOConfig(mean_over="turns", norm_by_std=True))
    # group 1 turn scores [1, 1, 0]: mean 2/3; deviations [1/3, 1/3, -2/3];
    # unbiased var = (1/9 + 1/9 + 4/9)/2 = 1/3, std = 1/sqrt(3)
    #   C: (1/3)*sqrt(3) = 0.57735;  D: (-2/3)*sqrt(3) = -1.1547
    # group 2: a single sample -> 0 (nothing to compare against)
    s3 = math.sqrt(3)
    close(adv, [1.5, -0.5, -0.5, -0.5, s3 / 3, s3 / 3, -2 * s3 / 3, 0.0], atol=1e-5)
    adv, _ = grpo(batch, GRPOConfig(mean_over="trajectories", norm_by_std=False))
    # group 0: [1, -1 x3]; group 1 trajectory scores C = 1, D = 0: mean 0.5 -> C +0.5, D -0.5;
    # group 2: one trajectory -> 0
    close(adv, [1.0, -1.0, -1.0, -1.0, 0.5, 0.5, -0.5, 0.0])


def test_grpo_single_trajectory_group_is_zero_in_trajectories_mode():
    batch = make_batch([(0, 0, 3.0, [0.0, -0.1])])
    adv, _ = grpo(batch, GRPOConfig(mean_over="trajectories"))
    close(adv, [0.0, 0.0])


def test_grpo_invalid_penalty_is_turn_local_in_turns_mode():
    # both trajectories won (outcome 10); F's first turn was invalid (-0.1)
    # turns: scores E [10, 10], F [9.9, 10]: mean 9.975; deviations [.025, .025, -.075, .025];
    #   unbiased var = (3*0.000625 + 0.005625)/3 = 0.0025, std = 0.05
    #   A = [0.5, 0.5, -1.5, 0.5]: only the invalid turn is pushed down
    batch = make_batch([(0, 0, 10.0, [0.0, 0.0]), (1, 0, 10.0, [-0.1, 0.0])])
    adv, _ = grpo(batch, GRPOConfig(mean_over="turns", eps=0.0))
    close(adv, [0.5, 0.5, -1.5, 0.5], atol=1e-3)  # float32 scores around 10: ~1e-4 relative error
    # trajectories: returns E 10, F 9.9: mean 9.95, std = sqrt(2 * 0.05^2) = 0.0707
    #   A_E = 0.05/0.0707 = 1/sqrt(2) on both turns, A_F = -1/sqrt(2) on both turns
    adv, _ = grpo(batch, GRPOConfig(mean_over="trajectories", eps=0.0))
    r = 1 / math.sqrt(2)
    close(adv, [r, r, -r, -r], atol=1e-3)


# ----------------------------------------------------------------------------------------------- rloo


def test_rloo_by_hand():
    # group 0: X: 1 turn, outcome 2 -> score 2; Y: 2 turns, outcome 0, rewards [0, 0] -> 0;
    #          Z: 1 turn, outcome 1.1, reward -0.1 -> 1.0
    #   A_X = 2 - (0 + 1)/2 = 1.5;  A_Y = 0 - (2 + 1)/2 = -1.5;  A_Z = 1 - (2 + 0)/2 = 0
    # group 1: a lone trajectory -> 0
    batch = make_batch([(0, 0, 2.0, [0.0]), (1, 0, 0.0, [0.0, 0.0]), (2, 0, 1.1, [-0.1]), (3, 1, 4.0, [0.0])])
    adv, ret = rloo(batch)
    close(adv, [1.5, -1.5, -1.5, 0.0, 0.0])
    close(ret, [2.0, 0.0, 0.0, 1.0, 4.0])


def test_the_estimator_algo_estimator_names():
    batch = make_batch([(0, 0, 2.0, [0.0]), (1, 0, 0.0, [0.0])])
    algo = AlgoConfig(estimator="rloo")
    adv, _ = AdvantageEstimator.from_config(algo)(batch)
    close(adv, [2.0, -2.0])
    # the estimator gets its own settings section: algo.grpo for grpo (no normalisation by std: 2 - 1, 0 - 1)
    algo = AlgoConfig(estimator="grpo")
    algo.grpo.norm_by_std = False
    estimator = AdvantageEstimator.from_config(algo)
    algo.grpo.norm_by_std = True  # read once: a later change to the config does not reach it
    adv, _ = estimator(batch)
    close(adv, [1.0, -1.0])
    with pytest.raises(ConfigError, match="Valid: gae, gigpo, grpo, rloo"):
        AdvantageEstimator.from_config(AlgoConfig(estimator="nope"))
