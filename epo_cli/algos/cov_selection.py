"""Which tokens Clip-Cov and KL-Cov act on, chosen over a whole mini-batch (Cui et al. 2025, arXiv 2505.22617).

Both losses rank the tokens by the centred covariance of advantage and log-prob

    cov_i = (A_i - mean A) * (logp_i - mean logp)        means over all real tokens of the MINI-BATCH

and act on a share `ratio` of them: Clip-Cov detaches the gradient of tokens drawn at random among those with
lb < cov_i < ub (that the PPO clip left alone), KL-Cov penalises the top tokens by cov_i. Here the statistics,
the count and the choice span the whole mini-batch: every micro-batch, every rank. So the share is `ratio`
whatever `algo.micro_batch_size` or the number of ranks (verl computes them per forward pass, i.e. per
micro-batch, with at least one token each: at the default ratio 2e-4 and micro-batches of <= 1024 tokens
that floor, not the ratio, set the share).

    count   n = floor(ratio * N) + [u < frac(ratio * N)]     N = real tokens of the mini-batch, u ~ U(0, 1)
            from the mini-batch's seed: the expected share is exactly `ratio` (verl: max(1, floor(ratio * N))
            per micro-batch)
    order   KL-Cov: by cov, largest first; Clip-Cov: by a uniform random priority per token, drawn from a seed
            of (mini-batch seed, the sample's trajectory and turn) so it does not depend on where the sample
            sits. Ties are broken by (trajectory, turn, position): one global order.
    choice  the first n tokens of that order: each rank keeps its own first n, all ranks' are gathered and
            merged, and every rank marks the chosen tokens of its own rows.

The log-probs are the current policy's (as in the paper and verl). They exist per micro-batch only during
the backward loop, so the trainer scores the mini-batch once without gradient first (`mini_batch_selection`:
one extra no-grad forward per mini-batch, only for these two losses); with the weights fixed within a
mini-batch those are the log-probs the backward loop computes (up to rounding where a sample sits in a
differently padded micro-batch, which can only swap tokens whose covariances are equal to rounding).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from epo_cli.rollout.batch import MicroBatch
from epo_cli.seeding import derive_seed

AllReduce = Callable[[Tensor], Tensor]
AllGather = Callable[[Any], list[Any]]


@dataclass(frozen=True)
class SelectionRule:
    """How a loss chooses its tokens: `ratio` of the mini-batch's real tokens, drawn at random among those
    whose covariance lies strictly inside `band` (Clip-Cov), or the top ones by covariance (band None: KL-Cov)."""

    ratio: float
    band: tuple[float, float] | None = None


@dataclass
class RowTokens:
    """One sample's response tokens as the selection sees them."""

    key: tuple[int, int]  # (trajectory id, turn index): the sample's global identity
    advantage: float
    logprobs: Tensor  # [k] float64, current policy, real tokens only
    eligible: Tensor  # [k] bool: tokens the loss may choose (Clip-Cov: not already clipped by the PPO clip)


class TokenSelector(Protocol):
    """A loss term that acts on selected tokens (ClipCovLoss, KLCovLoss)."""

    def selection_rule(self) -> SelectionRule: ...

    def eligible(self, mb: MicroBatch, logprobs: Tensor) -> Tensor: ...  # [B, R] bool


def selection_count(ratio: float, n_tokens: int, seed: int) -> int:
    """floor(ratio * N), plus one with probability frac(ratio * N): E[count] = ratio * N exactly."""
    x = ratio * n_tokens
    whole = math.floor(x + 1e-9)
    frac = x - whole
    if frac <= 1e-9:
        return int(whole)
    u = float(torch.rand(1, generator=torch.Generator().manual_seed(derive_seed(seed, "count"))))
    return int(whole) + int(u < frac)


def select_tokens(rows: list[RowTokens], rule: SelectionRule, seed: int, all_reduce_sum: AllReduce | None = None,
                  all_gather: AllGather | None = None) -> list[Tensor]:
    """The chosen tokens of this rank's `rows` (a [k] bool per row), chosen over the rows of all ranks.
    Every rank must call it (two collectives)."""
    sums = torch.zeros(3, dtype=torch.float64)  # sum A (per token), sum logp, tokens
    for row in rows:
        k = row.logprobs.numel()
        sums += torch.stack([torch.tensor(row.advantage * k, dtype=torch.float64), row.logprobs.double().sum(),
                             torch.tensor(float(k), dtype=torch.float64)])
    if all_reduce_sum is not None:
        sums = all_reduce_sum(sums)
    sum_a, sum_lp, n_tokens = sums.tolist()
    mean_a, mean_lp = sum_a / max(n_tokens, 1.0), sum_lp / max(n_tokens, 1.0)
    n = selection_count(rule.ratio, int(round(n_tokens)), seed)

    candidates: list[tuple[float, tuple[int, int], int]] = []  # (order value, key, position)
    for row in rows:
        cov = (row.advantage - mean_a) * (row.logprobs.double() - mean_lp)  # [k]
        ok = row.eligible.clone()
        if rule.band is not None:
            lb, ub = rule.band
            ok &= (cov > lb) & (cov < ub)
            priority = torch.rand(cov.numel(), generator=torch.Generator().manual_seed(
                derive_seed(seed, "priority", *row.key)), dtype=torch.float64)
            order = priority
        else:
            order = -cov
        for pos in torch.nonzero(ok).flatten().tolist():
            candidates.append((float(order[pos]), row.key, pos))
    mine = heapq.nsmallest(n, candidates) if n else []
    everyone = all_gather(mine) if all_gather is not None else [mine]
    chosen: dict[tuple[int, int], list[int]] = {}
    for _, key, pos in heapq.nsmallest(n, (c for part in everyone for c in part)):
        chosen.setdefault(tuple(key), []).append(pos)
    out = []
    for row in rows:
        mask = torch.zeros(row.logprobs.numel(), dtype=torch.bool)
        mask[chosen.get(row.key, [])] = True
        out.append(mask)
    return out


def micro_batch_rows(selector: TokenSelector, mb: MicroBatch, logprobs: Tensor,
                     keys: list[tuple[int, int]]) -> list[RowTokens]:
    """RowTokens of the first len(keys) rows of a micro-batch, from the current policy's `logprobs` [B, R]."""
    if mb.advantages is None:
        raise ValueError("token selection needs the micro-batch's advantages")
    eligible = selector.eligible(mb, logprobs) & mb.response_mask  # [B, R]
    rows = []
    for i, key in enumerate(keys):
        real = mb.response_mask[i]
        rows.append(RowTokens(key, float(mb.advantages[i]), logprobs[i][real].detach().double().cpu(),
                              eligible[i][real].cpu()))
    return rows


def mini_batch_selection(selector: TokenSelector, passes: Iterable[tuple[list[int], MicroBatch, Tensor]],
                         keys: Callable[[int], tuple[int, int]], seed: int, all_reduce_sum: AllReduce | None = None,
                         all_gather: AllGather | None = None) -> dict[int, Tensor]:
    """row -> its chosen tokens [k] bool, for this rank's rows of one mini-batch. `passes` yields
    (rows, their micro-batch, the current policy's log-probs [B, R]) for every micro-batch of this rank."""
    rows: list[int] = []
    tokens: list[RowTokens] = []
    for m, mb, logprobs in passes:
        rows += m
        tokens += micro_batch_rows(selector, mb, logprobs, [keys(r) for r in m])
    masks = select_tokens(tokens, selector.selection_rule(), seed, all_reduce_sum, all_gather)
    return dict(zip(rows, masks))


def selection_mask(chosen: dict[int, Tensor], rows: list[int], response_mask: Tensor) -> Tensor:
    """The [B, R] bool mask of a micro-batch of `rows` from `mini_batch_selection`'s result."""
    out = torch.zeros_like(response_mask, dtype=torch.bool)
    for i, r in enumerate(rows):
        mask = chosen[r].to(response_mask.device)
        out[i, :mask.numel()] = mask
    return out
