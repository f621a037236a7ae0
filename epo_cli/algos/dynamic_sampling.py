"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, Sec. 3.2): train only on groups that carry a
learning signal.

A group whose trajectories all scored the same has zero score variance, so every group-relative advantage
in it is 0: it costs a forward/backward and only dilutes the token-mean of the others. With
`algo.dynamic_sampling=true` such groups are dropped and fresh groups are played, a round of
`tasks_per_step` groups at a time, until `tasks_per_step` groups with signal are in hand or
`algo.dynamic_sampling_max_rounds` extra rounds have been played.

How the batch is formed (deterministic for a seed, the same on any number of ranks):
- round r draws its tasks from a seed-and-step-and-round rng, identically on every rank; rank k plays its
  share of whole groups; group and trajectory ids are global (round r, group g -> r * tasks_per_step + g),
  so sampling seeds (and so the episodes) do not depend on the rank that plays them.
- the batch is the first `tasks_per_step` groups with signal in play order (round, then group), as DAPO
  truncates its over-full batch. If the rounds run out first it is topped up with zero-variance groups in
  play order, so the batch ALWAYS has tasks_per_step groups: the learning rate and token-mean scale stay
  those the run was configured with (the shortfall is logged as rollout/groups_topped_up).
- the chosen groups are then dealt out to ranks by position (rank k gets positions
  [k * G / W, (k + 1) * G / W)): every rank still holds whole groups, and the same number of them.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from epo_cli.rollout.batch import TurnBatch

#: algo.dynamic_sampling_metric: what must differ within a group for it to carry signal
METRICS = ("return", "outcome")


def group_has_signal(batch: TurnBatch, metric: str = "return", tol: float = 1e-6) -> dict[int, bool]:
    """group id -> whether its trajectories' scores differ (max - min > tol).

    return: the trajectory's return (outcome + its turn rewards, e.g. invalid-action penalties), the score
        GRPO normalises; outcome: the task reward alone (DAPO's accuracy filter).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown dynamic sampling metric '{metric}' ({' | '.join(METRICS)})")
    per_traj: dict[int, tuple[int, float]] = {}  # traj -> (group, score)
    for tid, gid, r, o in zip(batch.traj_id.tolist(), batch.group_id.tolist(), batch.reward.tolist(),
                              batch.outcome.tolist()):
        g, s = per_traj.get(tid, (gid, o))  # the outcome is the same on every turn: counted once
        per_traj[tid] = (g, s + (r if metric == "return" else 0.0))
    scores: dict[int, list[float]] = {}
    for g, s in per_traj.values():
        scores.setdefault(g, []).append(s)
    return {g: max(s) - min(s) > tol for g, s in scores.items()}


def choose_groups(played: list[tuple[int, bool]], target: int) -> tuple[list[int], int]:
    """played: (global group id, has signal) of every group played, in play order.

    Returns (the ids of the batch's groups in play order, how many of them are zero-variance top-ups).
    """
    with_signal = [g for g, ok in played if ok][:target]
    top_up = [g for g, ok in played if not ok][:max(target - len(with_signal), 0)]
    chosen = set(with_signal) | set(top_up)
    return [g for g, _ in played if g in chosen], len(top_up)


def concat_batches(batches: list[TurnBatch]) -> TurnBatch:
    """Rows of all `batches` in order (every field: lists are joined, tensors concatenated)."""
    if len(batches) == 1:
        return batches[0]
    values = {}
    for f in fields(TurnBatch):
        parts = [getattr(b, f.name) for b in batches]
        if all(p is None for p in parts):
            values[f.name] = None
        elif isinstance(parts[0], torch.Tensor):
            values[f.name] = torch.cat(parts)
        else:
            values[f.name] = [x for p in parts for x in p]
    return TurnBatch(**values)


def rows_of_groups(batch: TurnBatch, groups: list[int]) -> list[int]:
    """Row indices of `groups` (in that order of groups, rows in batch order within a group)."""
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_id.tolist()):
        by_group.setdefault(g, []).append(i)
    return [i for g in groups for i in by_group.get(g, [])]
