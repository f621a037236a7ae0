"""How per-token values become one number: loss aggregation modes.

Every mode is a pair (numerator token weight u [B, R], denominator contribution d [B]) so that

    aggregate(x) = sum(u * x) / sum(d)

where both sums run over a whole mini-batch. Splitting the sums this way is what makes gradient
accumulation exact: the training loop all-reduces D = sum(d) over ranks and micro-batches first, then
hands each loss term w = u / D (MicroBatch.weights[mode]); a term's loss is sum(w * x) and the sum of
those over micro-batches and ranks is the mini-batch aggregate, whatever the micro-batch split.

All modes give every real token of a row the same weight, u[b, i] = c[b] * mask[b, i], so a mode is
defined by its row scale c [B] and denominator d [B] (|y| = number of real response tokens of the row,
t = true turn index, T = turns of the row's trajectory):

    token-mean             c = 1                 d = |y|           mean over all tokens (verl default)
    seq-mean-token-mean    c = 1/|y|             d = 1             mean over rows of the row's token mean
    seq-mean-token-sum     c = 1                 d = 1             mean over rows of the row's token sum
    trajectory             c = 1/(T |y|)         d = 1/T           EPO Eq. 2: tokens -> turns -> trajectories
    turn-decay             c = g^t/(Z |y|)       d = g^t/Z         Z = sum_{t<T} g^t; early turns weigh more

With every turn of a trajectory in the mini-batch, sum(d) of `trajectory` is the number of trajectories
and the aggregate is (1/B) sum_j (1/T_j) sum_t mean_i x_{j,t,i}. Rows with |y| = 0 (padding rows) get
c = 0 and d = 0 in every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from epo_cli.algos.registries import AGGREGATIONS

AllReduce = Callable[[Tensor], Tensor]
#: (lengths |y| [B] float, turn_index [B] float, num_turns [B] float, decay) -> (c [B], d [B])
RowScale = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]


def _token_mean(n: Tensor, t: Tensor, T: Tensor, decay: float) -> tuple[Tensor, Tensor]:
    return torch.ones_like(n), n


def _seq_mean_token_mean(n: Tensor, t: Tensor, T: Tensor, decay: float) -> tuple[Tensor, Tensor]:
    return 1.0 / n, torch.ones_like(n)


def _seq_mean_token_sum(n: Tensor, t: Tensor, T: Tensor, decay: float) -> tuple[Tensor, Tensor]:
    return torch.ones_like(n), torch.ones_like(n)


def _trajectory(n: Tensor, t: Tensor, T: Tensor, decay: float) -> tuple[Tensor, Tensor]:
    return 1.0 / (T * n), 1.0 / T


def _turn_decay(n: Tensor, t: Tensor, T: Tensor, decay: float) -> tuple[Tensor, Tensor]:
    # Z_j = sum_{t<T_j} g^t = (1 - g^T) / (1 - g), or T_j when g = 1; normalising by Z_j keeps every
    # trajectory's total weight at 1 whatever its length, like the `trajectory` mode.
    Z = T.clone() if decay == 1.0 else (1.0 - decay**T) / (1.0 - decay)
    turn_weight = decay**t / Z  # [B]
    return turn_weight / n, turn_weight


@dataclass(frozen=True)
class Aggregation:
    """One aggregation mode: turns a response mask into (u [B, R], d [B])."""

    name: str
    row_scale: RowScale

    def weights(
        self, response_mask: Tensor, turn_index: Tensor, num_turns: Tensor, decay: float = 0.9
    ) -> tuple[Tensor, Tensor]:
        """(u [B, R], d [B]) for a [B, R] bool response mask; `decay` is only used by turn-decay."""
        mask = response_mask.float()  # [B, R]
        n = mask.sum(-1)  # [B] |y|
        real = n > 0  # [B] padding rows have no tokens
        # clamp only to avoid 0-division on padding rows; they are zeroed just below
        c, d = self.row_scale(n.clamp(min=1.0), turn_index.float(), num_turns.float().clamp(min=1.0), decay)
        c = torch.where(real, c, torch.zeros_like(c))  # [B]
        d = torch.where(real, d, torch.zeros_like(d))  # [B]
        return c[:, None] * mask, d


# the modes AGGREGATIONS declares (epo_cli/algos/registries.py)
for _name, _scale in (("token-mean", _token_mean), ("seq-mean-token-mean", _seq_mean_token_mean),
                      ("seq-mean-token-sum", _seq_mean_token_sum), ("trajectory", _trajectory),
                      ("turn-decay", _turn_decay)):
    AGGREGATIONS.implement(_name, Aggregation(_name, _scale))


def get_aggregation(mode: str) -> Aggregation:
    return AGGREGATIONS[mode]  # KeyError listing the valid modes


def normalized_weights(
    mode: str,
    response_mask: Tensor,
    turn_index: Tensor,
    num_turns: Tensor,
    decay: float = 0.9,
    all_reduce_sum: AllReduce | None = None,
    denominator: float | None = None,
) -> Tensor:
    """w = u / D [B, R]: a micro-batch's token weights, MicroBatch.weights[mode].

    D is the mini-batch's denominator: `denominator` when given (the training loop sums d over all the
    mini-batch's micro-batches and ranks first), else this micro-batch's own sum(d), summed over ranks by
    `all_reduce_sum` (a mini-batch that is a single micro-batch).
    """
    u, d = get_aggregation(mode).weights(response_mask, turn_index, num_turns, decay)
    if denominator is not None:
        return u / denominator
    D = d.sum()
    if all_reduce_sum is not None:
        D = all_reduce_sum(D)
    # D = 0 only when there is no real token anywhere; u is all zero then too
    return u / D if D > 0 else torch.zeros_like(u)


def weighted_sum(weights: Tensor, values: Tensor) -> Tensor:
    """sum(w * x) [scalar], ignoring x where w == 0.

    Padding positions may hold anything (even inf/NaN from a masked log-softmax); 0 * inf would poison
    the sum and its gradient, so those positions are replaced by 0 before multiplying.
    """
    values = torch.where(weights != 0, values, torch.zeros_like(values))
    return (weights * values).sum()
