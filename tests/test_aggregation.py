"""Aggregation modes against hand-computed values (arithmetic in the comments).

Crafted batch: trajectory 0 has 1 turn, trajectory 1 has 3 turns, plus one padding row; R = 4.
    row 0: traj 0, t=0, T=1, H = [1, 3]        |y| = 2, mean 2, sum 4
    row 1: traj 1, t=0, T=3, H = [4]           |y| = 1, mean 4, sum 4
    row 2: traj 1, t=1, T=3, H = [1, 2, 3]     |y| = 3, mean 2, sum 6
    row 3: traj 1, t=2, T=3, H = [1, 1, 1, 5]  |y| = 4, mean 2, sum 8
    row 4: padding (no tokens; its values are garbage and must not count)
"""

from __future__ import annotations

import pytest
import torch

from epo_cli.algos.aggregation import AGGREGATIONS, normalized_weights, weighted_sum

torch.set_num_threads(1)

NAN = float("nan")
H = torch.tensor(
    [
        [1.0, 3.0, NAN, NAN],
        [4.0, NAN, NAN, NAN],
        [1.0, 2.0, 3.0, NAN],
        [1.0, 1.0, 1.0, 5.0],
        [NAN, NAN, NAN, NAN],
    ]
)
MASK = torch.tensor(
    [
        [1, 1, 0, 0],
        [1, 0, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
        [0, 0, 0, 0],
    ],
    dtype=torch.bool,
)
TURN = torch.tensor([0, 0, 1, 2, 0])
NUM_TURNS = torch.tensor([1, 3, 3, 3, 0])

# hand values of aggregate(H) per mode (turn-decay with decay 0.5)
EXPECTED = {
    # all tokens: (4 + 4 + 6 + 8) / (2 + 1 + 3 + 4) = 22 / 10
    "token-mean": 2.2,
    # row means: (2 + 4 + 2 + 2) / 4
    "seq-mean-token-mean": 2.5,
    # row sums: (4 + 4 + 6 + 8) / 4
    "seq-mean-token-sum": 5.5,
    # EPO Eq. 2: (1/B) sum_j (1/T_j) sum_t mean_i H = (1/2) * (2/1 + (4 + 2 + 2)/3) = (1/2)(14/3) = 7/3
    "trajectory": 7 / 3,
    # traj 0: Z = 1, weight 1 -> 2; traj 1: Z = 1 + 0.5 + 0.25 = 1.75,
    #   (1*4 + 0.5*2 + 0.25*2) / 1.75 = 5.5 / 1.75 = 22/7; sum(d) = 1 + 1 = 2  ->  (2 + 22/7)/2 = 18/7
    "turn-decay": 18 / 7,
}


def aggregate(mode: str, rows=slice(None), D=None) -> torch.Tensor:
    u, d = AGGREGATIONS[mode].weights(MASK[rows], TURN[rows], NUM_TURNS[rows], decay=0.5)
    return weighted_sum(u / (d.sum() if D is None else D), H[rows])


def test_registry_names():
    assert set(AGGREGATIONS) == set(EXPECTED)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_each_mode_by_hand(mode):
    assert aggregate(mode).item() == pytest.approx(EXPECTED[mode], rel=1e-6)


def test_trajectory_differs_from_token_mean():
    # 7/3 = 2.333 vs 2.2: the 1-turn trajectory counts as much as the whole 3-turn one
    assert aggregate("trajectory").item() == pytest.approx(7 / 3)
    assert aggregate("token-mean").item() == pytest.approx(2.2)


def test_trajectory_weights_by_hand():
    # u = 1/(T |y|) on real tokens, d = 1/T; padding row: 0 and 0
    u, d = AGGREGATIONS["trajectory"].weights(MASK, TURN, NUM_TURNS)
    assert torch.allclose(u[:, 0], torch.tensor([1 / 2, 1 / 3, 1 / 9, 1 / 12, 0.0]))
    assert torch.allclose(d, torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3, 0.0]))
    assert (u[~MASK] == 0).all()


def test_turn_decay_weights_by_hand():
    # decay 0.5, traj 1: Z = 1.75; d = [1, 1/1.75, 0.5/1.75, 0.25/1.75, 0]; u = d / |y|
    u, d = AGGREGATIONS["turn-decay"].weights(MASK, TURN, NUM_TURNS, decay=0.5)
    expected_d = torch.tensor([1.0, 1 / 1.75, 0.5 / 1.75, 0.25 / 1.75, 0.0])
    assert torch.allclose(d, expected_d)
    assert torch.allclose(u[:, 0], expected_d / torch.tensor([2.0, 1.0, 3.0, 4.0, 1.0]))
    # decay = 1 reduces to the trajectory mode (Z = T)
    u1, d1 = AGGREGATIONS["turn-decay"].weights(MASK, TURN, NUM_TURNS, decay=1.0)
    ut, dt = AGGREGATIONS["trajectory"].weights(MASK, TURN, NUM_TURNS)
    assert torch.allclose(u1, ut) and torch.allclose(d1, dt)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_two_micro_batches_with_global_denominator(mode):
    # the loop sums d over all micro-batches first, then each micro-batch uses w = u / D
    parts = [slice(0, 2), slice(2, 5)]
    D = sum(AGGREGATIONS[mode].weights(MASK[p], TURN[p], NUM_TURNS[p], decay=0.5)[1].sum() for p in parts)
    total = sum(aggregate(mode, p, D) for p in parts)
    assert total.item() == pytest.approx(EXPECTED[mode], rel=1e-6)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_normalized_weights_across_two_ranks(mode):
    # two "ranks" holding rows [0, 1] and [2, 3, 4]; all_reduce_sum adds the other rank's sum(d)
    a, b = slice(0, 2), slice(2, 5)
    d_a = AGGREGATIONS[mode].weights(MASK[a], TURN[a], NUM_TURNS[a], decay=0.5)[1].sum()
    d_b = AGGREGATIONS[mode].weights(MASK[b], TURN[b], NUM_TURNS[b], decay=0.5)[1].sum()
    w_a = normalized_weights(mode, MASK[a], TURN[a], NUM_TURNS[a], 0.5, all_reduce_sum=lambda D: D + d_b)
    w_b = normalized_weights(mode, MASK[b], TURN[b], NUM_TURNS[b], 0.5, all_reduce_sum=lambda D: D + d_a)
    total = weighted_sum(w_a, H[a]) + weighted_sum(w_b, H[b])
    assert total.item() == pytest.approx(EXPECTED[mode], rel=1e-6)
    w = normalized_weights(mode, MASK, TURN, NUM_TURNS, 0.5)
    assert weighted_sum(w, H).item() == pytest.approx(EXPECTED[mode], rel=1e-6)


def test_all_padding_gives_zero_weights():
    w = normalized_weights("trajectory", MASK[4:], TURN[4:], NUM_TURNS[4:])
    assert (w == 0).all()
    assert weighted_sum(w, H[4:]).item() == 0.0  # NaN padding values do not leak through


def test_unknown_mode():
    with pytest.raises(KeyError, match="valid"):
        normalized_weights("nope", MASK, TURN, NUM_TURNS)
