"""Intrinsic reward: an episodic, count-based novelty bonus on observations, shared by a GRPO group.

    epo train algo=grpo algo.intrinsic.kind=count algo.intrinsic.coef=0.5 algo.intrinsic.decay=0.95

Definition (algo.intrinsic.kind=count). At turn t of trajectory j the policy acted and the env answered
with the observation o_{j,t} (the text after the action, e.g. "You open the drawer 2. The drawer 2 is open.
In it, you see a mug 1."). The trajectories of one group (the rollouts of one task) share one count table,
filled turn by turn, every trajectory of the group at turn t at once:

    N_g(o, t)  = #{ (j', t') : j' in group g, t' <= t, o_{j',t'} = o }          (exact text match)
    r_int(j, t) = coef * decay^k / sqrt(N_g(o_{j,t}, t))                        k = RL iteration, 0-based

So an observation no rollout of the group had reached before turn t, reached by one rollout at turn t,
earns coef * decay^k; one that all 8 rollouts of a group reach at the same turn earns coef * decay^k /
sqrt(8) each; a state revisited keeps a count that only grows. Counting by turn index (not by wall-clock
order) makes the bonus symmetric in the group's trajectories and a pure function of the group's episodes
and k: the same on any number of ranks, with or without rollout.overlap, and after a resume. The table is
per group and per iteration: nothing is carried across iterations (episodic novelty), so the bonus never
rewards what other tasks or earlier iterations saw.

The bonus is a turn reward: it is added to the turn's `reward` (where the invalid-action penalty and
subgoal rewards sit), never to the task outcome, so success stays the true task success; the batch keeps
it apart in `TurnBatch.intrinsic` (metric `rollout/intrinsic_reward`, summed over the batch like
`rollout/shaped_reward`, which excludes it). With GRPO's default mean_over=turns a turn's score is the
outcome plus its own turn reward, so the bonus credits the very turn whose action reached the new
observation. It is added in GroupSampler.play_round (epo_cli/training/group_sampler.py), before the
group filters: with algo.dynamic_sampling, almost every group then carries signal (its turns' bonuses
differ), so the filters drop few groups.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

#: algo.intrinsic.kind
KINDS = ("none", "count")


def count_bonus(group_ids: Sequence[int], turn_index: Sequence[int], observations: Sequence[str],
                scale: float) -> list[float]:
    """r_int of every row: scale / sqrt(N_g(o, t)), the module docstring's definition with scale =
    coef * decay^k. Rows may come in any order; row i is (group_ids[i], turn_index[i], observations[i])."""
    rows_at: dict[int, dict[int, list[int]]] = {}  # group -> turn -> rows
    for i, (g, t) in enumerate(zip(group_ids, turn_index)):
        rows_at.setdefault(g, {}).setdefault(t, []).append(i)
    bonus = [0.0] * len(observations)
    for by_turn in rows_at.values():
        counts: Counter[str] = Counter()
        for t in sorted(by_turn):
            rows = by_turn[t]
            counts.update(observations[i] for i in rows)  # every trajectory's turn t counts before any is read
            for i in rows:
                bonus[i] = scale / math.sqrt(counts[observations[i]])
    return bonus


def intrinsic_scale(cfg: Any, step: int) -> float:
    """coef * decay^k at RL iteration k (0-based)."""
    return float(cfg.coef) * float(cfg.decay) ** step


def intrinsic_rewards(episodes: Sequence[Any], cfg: Any, step: int) -> torch.Tensor:
    """The bonus of every turn of `episodes` (rollout Episodes), rows in episodes_to_batch's order (episode
    by episode, turn by turn); cfg = algo.intrinsic. Needs each turn's `result` (the env's answer)."""
    if cfg.kind not in KINDS:
        raise ValueError(f"unknown intrinsic reward '{cfg.kind}' ({' | '.join(KINDS)})")
    groups, turns, results = [], [], []
    for ep in episodes:
        for t, turn in enumerate(ep.turns):
            groups.append(ep.group_id)
            turns.append(t)
            results.append(turn.result)
    if cfg.kind == "none":
        return torch.zeros(len(results))
    return torch.tensor(count_bonus(groups, turns, results, intrinsic_scale(cfg, step)), dtype=torch.float32)
