"""Which groups of rollouts carry a learning signal: the group filters that dynamic sampling applies.

A group is the `group_size` rollouts of one task. `algo.group_filter` says which groups pass; with
`algo.dynamic_sampling=true` the groups that do not pass are replaced by fresh rounds (round mechanics in
dynamic_sampling.py). The filters:

    none          every group passes
    signal        the group gets a non-zero advantage somewhere (|A| > tol) from the estimator the update
                  uses (algo.estimator, computed on the group itself). This is the one test that matches every
                  group estimator: "the trajectories' returns differ" does not. GRPO with mean_over=turns
                  normalises per-turn scores, so two lost episodes whose invalid-action penalties fall on
                  different turns have equal returns yet advantages +-0.866, while returns [-0.1] and
                  [-0.2] (one penalty per turn) differ yet give all-zero advantages; GiGPO's step level gives
                  two winning episodes of equal return different advantages when one reaches a shared state
                  by a shorter path. (gae is no group estimator: its advantages come from the critic, so
                  compose refuses dynamic sampling with this filter under gae.)
    top_variance  RAGEN-2's SNR-aware filter (arXiv 2604.06268): of each round's groups, the top
                  `algo.group_filter_keep` share by the variance of their trajectory returns passes
                  (ceil(keep x groups of the round); ties by play order). A zero-variance group passes only
                  when fewer than that share have any variance.

Every rank computes `group_stats` for the groups it played; the gathered stats of a round, in play order,
go through `passing_groups` identically on every rank. The filters are the GROUP_FILTERS registry's
(declared, with their config checks, in epo_cli/algos/registries.py; implemented here).
"""

from __future__ import annotations

import math

from epo_cli.algos.advantages import AdvantageEstimator
from epo_cli.algos.registries import GROUP_FILTERS
from epo_cli.rollout.batch import TurnBatch

#: (group id, has signal, return variance) of one group: what the filters decide on
GroupStats = tuple[int, bool, float]
#: |A| above this counts as signal (estimators return exact zeros for groups without one)
SIGNAL_TOL = 1e-6


def trajectory_returns(batch: TurnBatch) -> dict[int, tuple[int, float]]:
    """traj id -> (group id, return): the outcome (counted once) plus the sum of the turns' rewards."""
    out: dict[int, tuple[int, float]] = {}
    for tid, gid, r, o in zip(batch.traj_id.tolist(), batch.group_id.tolist(), batch.reward.tolist(),
                              batch.outcome.tolist()):
        g, total = out.get(tid, (gid, o))
        out[tid] = (g, total + r)
    return out


def group_return_variance(batch: TurnBatch) -> dict[int, float]:
    """group id -> population variance of its trajectories' returns (float64 sums)."""
    returns: dict[int, list[float]] = {}
    for g, ret in trajectory_returns(batch).values():
        returns.setdefault(g, []).append(ret)
    out = {}
    for g, xs in returns.items():
        mean = math.fsum(xs) / len(xs)
        out[g] = math.fsum((x - mean) ** 2 for x in xs) / len(xs)
    return out


def group_signal(batch: TurnBatch, estimator: AdvantageEstimator, tol: float = SIGNAL_TOL) -> dict[int, bool]:
    """group id -> whether the run's advantage estimator gives any of its turns |A| > tol.

    grpo, rloo and gigpo compute each group's advantages from that group's rows alone, so running the
    estimator on a batch of whole groups gives every group exactly the advantages it gets in the update.
    (gae's come from the critic, which this batch has not been scored by: compose refuses it.)"""
    if estimator.name in ("gae", "none"):
        raise ValueError(f"algo.group_filter=signal needs a group estimator, not '{estimator.name}'")
    adv, _ = estimator(batch)  # [N]
    signal: dict[int, bool] = {}
    for g, a in zip(batch.group_id.tolist(), adv.abs().tolist()):
        signal[g] = signal.get(g, False) or a > tol
    return signal


def group_stats(batch: TurnBatch, group_filter: str, estimator: AdvantageEstimator | None) -> list[GroupStats]:
    """(group id, has signal, return variance) of every group in `batch`, by group id; `has signal` is
    only computed for group_filter=signal (False otherwise), with the run's advantage `estimator`."""
    variance = group_return_variance(batch)
    signal = group_signal(batch, estimator) if group_filter == "signal" else {}
    return [(g, signal.get(g, False), variance[g]) for g in sorted(variance)]


def passing_groups(stats: list[GroupStats], group_filter: str, keep: float = 1.0) -> list[tuple[int, bool]]:
    """(group id, passes) for one round's groups; `stats` (every rank's group_stats) in play order."""
    return GROUP_FILTERS[group_filter](stats, keep)


@GROUP_FILTERS.implement("none")
def _every_group(stats: list[GroupStats], keep: float) -> list[tuple[int, bool]]:
    return [(g, True) for g, _, _ in stats]


@GROUP_FILTERS.implement("signal")
def _groups_with_signal(stats: list[GroupStats], keep: float) -> list[tuple[int, bool]]:
    return [(g, ok) for g, ok, _ in stats]


@GROUP_FILTERS.implement("top_variance")
def _top_variance(stats: list[GroupStats], keep: float) -> list[tuple[int, bool]]:
    n_keep = math.ceil(keep * len(stats) - 1e-9)  # ceil, robust to 0.5 * 4 = 2.0000000001
    order = sorted(range(len(stats)), key=lambda i: (-stats[i][2], i))  # ties: play order
    kept = set(order[:n_keep])
    return [(g, i in kept) for i, (g, _, _) in enumerate(stats)]
