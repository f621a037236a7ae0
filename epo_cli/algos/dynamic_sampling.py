"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, Sec. 3.2): train only on groups that pass the
group filter (algo.group_filter, epo_cli/algos/group_filter.py; `signal`: the groups the estimator gives a
non-zero advantage), replacing the others by fresh rounds.

A group without signal has all-zero advantages: it costs a forward/backward and only dilutes the token-mean
of the others (and feeds the KL and entropy terms nothing but their own pull). With
`algo.dynamic_sampling=true` the groups that do not pass are dropped and fresh groups are played, a round of
`tasks_per_step` groups at a time, until `tasks_per_step` groups that pass are in hand or
`algo.dynamic_sampling_max_rounds` extra rounds have been played.

How the batch is formed (deterministic for a seed, the same on any number of ranks):
- round r draws its tasks from a seed-and-step-and-round rng, identically on every rank; rank k plays its
  share of whole groups; group and trajectory ids are global (round r, group g -> r * tasks_per_step + g),
  so sampling seeds (and so the episodes) do not depend on the rank that plays them.
- the batch is the first `tasks_per_step` groups that pass in play order (round, then group), as DAPO
  truncates its over-full batch. If the rounds run out first it is topped up with groups that did not pass,
  in play order, so the batch ALWAYS has tasks_per_step groups: the learning rate and token-mean scale stay
  those the run was configured with (the shortfall is logged as rollout/groups_topped_up).
- the chosen groups are then dealt out to ranks by position (rank k gets positions
  [k * G / W, (k + 1) * G / W)): every rank still holds whole groups, and the same number of them.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from epo_cli.rollout.batch import TurnBatch


def choose_groups(played: list[tuple[int, bool]], target: int) -> tuple[list[int], int]:
    """played: (global group id, passes the filter) of every group played, in play order.

    Returns (the ids of the batch's groups in play order, how many of them are top-ups that did not pass).
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
