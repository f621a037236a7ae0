"""Advantage estimators: one advantage per turn-sample, broadcast later to every token of the turn.

Each estimator is declared in ESTIMATORS (epo_cli/algos/registries.py: its conf/ name for algo.estimator, the
algo sections its settings come from, its checks) and implemented here; it has the signature

    fn(batch: TurnBatch, *settings, all_reduce_sum=None) -> (advantages [N], returns [N])

(`settings`: its own config sections, e.g. gae(batch, GAEConfig)); `AdvantageEstimator.from_config(algo)`
is the one algo.estimator names with its settings, fixed for the run. `all_reduce_sum` sums a tensor over
ranks (identity when None). Only statistics that are global in meaning use it (GAE's whitening); GRPO/RLOO
groups and trajectories are whole on one rank by construction.

    gae   PPO with a critic: turn-level GAE per trajectory (Schulman et al. 2016), optionally whitened
    grpo  group-relative: (score - group mean) / (group std + eps) (Shao et al. 2024; verl-agent)
    rloo  REINFORCE leave-one-out: trajectory score minus the mean of the group's other trajectories
          (Ahmadian et al. 2024)
    gigpo group-in-group (Feng et al. 2025, arXiv 2505.10978; verl-agent's headline estimator): the
          episode-level GRPO advantage plus step_weight x a step-level advantage, normalised among the
          group's turns that saw the same observation (anchor state)

Scores follow verl-agent: the episode outcome (reward_scale * won) is broadcast to every turn, and a
turn's own reward (minus the invalid-action penalty, plus subgoal rewards) is added on top of it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from epo_cli.algos.registries import ESTIMATORS
from epo_cli.config import GAEConfig, GiGPOConfig, GRPOConfig
from epo_cli.rollout.batch import TurnBatch

AllReduce = Callable[[Tensor], Tensor]


def whiten(x: Tensor, all_reduce_sum: AllReduce | None = None, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) with mean and std over x on ALL ranks.

    One all-reduce of [sum, sum of squares, count] (in float64, so the sum-of-squares form does not lose
    precision); std uses Bessel's correction when the global count is > 1.
    """
    x64 = x.double()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    stats = torch.stack([x64.sum(), (x64 * x64).sum(), count])
    if all_reduce_sum is not None:
        stats = all_reduce_sum(stats)
    total, total_sq, count = stats.tolist()
    if count == 0:
        return x
    mean = total / count
    sq_dev = max(total_sq - count * mean * mean, 0.0)  # sum (x - mean)^2, clamped against rounding
    std = (sq_dev / (count - 1)) ** 0.5 if count > 1 else 0.0
    return ((x64 - mean) / (std + eps)).to(x.dtype)


def _trajectories(batch: TurnBatch) -> dict[int, list[int]]:
    """traj_id -> indices of its turn-samples, ordered by true turn index (checked to be 0..T-1)."""
    rows: dict[int, list[int]] = defaultdict(list)
    for i, tid in enumerate(batch.traj_id.tolist()):
        rows[tid].append(i)
    turn = batch.turn_index.tolist()
    for tid, idx in rows.items():
        idx.sort(key=lambda i: turn[i])
        if [turn[i] for i in idx] != list(range(len(idx))):
            raise ValueError(
                f"trajectory {tid}: turn indices {sorted(turn[i] for i in idx)} are not 0..T-1; "
                "every turn of a trajectory must be in the batch (and on the same rank)"
            )
    return rows


@ESTIMATORS.implement("gae")
def gae(batch: TurnBatch, settings: GAEConfig, all_reduce_sum: AllReduce | None = None) -> tuple[Tensor, Tensor]:
    """Turn-level GAE. One "time step" is one turn; V_t = critic value of turn t's prompt.

        r_t     = reward_t + (outcome if t is the last turn else 0)
        delta_t = r_t + gamma * V_{t+1} - V_t          V_{T} = 0: every episode end is terminal
        A_t     = delta_t + gamma * lam * A_{t+1}       (= sum_l (gamma lam)^l delta_{t+l})
        returns = A + V                                  (critic targets, before whitening)

    The turn limit is treated as terminal too (no bootstrap): the agent sees its remaining turns in
    the prompt, so the state at the limit has no future.
    """
    if batch.old_values is None:
        raise ValueError("gae needs batch.old_values (the critic's values of each turn's prompt)")
    gamma, lam = settings.gamma, settings.lam
    reward, outcome, values = batch.reward.tolist(), batch.outcome.tolist(), batch.old_values.tolist()
    adv = [0.0] * len(batch)
    for idx in _trajectories(batch).values():
        next_value, next_adv = 0.0, 0.0
        for k, i in enumerate(reversed(idx)):
            r = reward[i] + (outcome[i] if k == 0 else 0.0)  # k == 0: the trajectory's last turn
            delta = r + gamma * next_value - values[i]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i]
            adv[i] = next_adv
    advantages = torch.tensor(adv, dtype=batch.old_values.dtype)  # [N]
    returns = advantages + batch.old_values  # [N]
    if settings.whiten:
        advantages = whiten(advantages, all_reduce_sum)
    return advantages, returns


def _normalize_in_groups(scores: Tensor, groups: Tensor, norm_by_std: bool, eps: float) -> Tensor:
    """(score - group mean) [/ (group std + eps)] per group; a group of one element gets 0.

    A lone element has nothing to be compared against (and its unbiased std is undefined), so it
    carries no learning signal rather than a NaN.
    """
    adv = torch.zeros_like(scores)
    for g in groups.unique():
        member = groups == g  # [M] bool
        s = scores[member]
        if s.numel() < 2:
            continue
        centred = s - s.mean()
        adv[member] = centred / (s.std() + eps) if norm_by_std else centred  # std: unbiased
    return adv


def _trajectory_scores(batch: TurnBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(row -> trajectory position [N], trajectory return [J], trajectory group [J]).

    A trajectory's return is its outcome plus the sum of its turns' rewards.
    """
    _, row_traj = torch.unique(batch.traj_id, return_inverse=True)  # [N] in 0..J-1
    J = int(row_traj.max()) + 1 if len(batch) else 0
    turn_sum = torch.zeros(J, dtype=batch.reward.dtype).index_add_(0, row_traj, batch.reward)  # [J]
    # outcome and group are the same on every turn of a trajectory: any row's value will do
    outcome = torch.zeros(J, dtype=batch.outcome.dtype).scatter_(0, row_traj, batch.outcome)  # [J]
    group = torch.zeros(J, dtype=torch.long).scatter_(0, row_traj, batch.group_id)  # [J]
    return row_traj, outcome + turn_sum, group


@ESTIMATORS.implement("grpo")
def grpo(
    batch: TurnBatch, settings: GRPOConfig, all_reduce_sum: AllReduce | None = None
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages; returns = the scores that were normalised.

    mean_over="turns" (verl-agent): score of a turn-sample = outcome + its own reward; mean/std over all
        turn-samples of the group (long episodes weigh more in the statistics).
    mean_over="trajectories": score = trajectory return; mean/std over the group's trajectories; every
        turn of a trajectory gets that trajectory's advantage (returns: its return, broadcast).
    """
    cfg = settings
    if cfg.mean_over == "turns":
        scores = batch.outcome + batch.reward  # [N]
        adv = _normalize_in_groups(scores, batch.group_id, cfg.norm_by_std, cfg.eps)
        return adv, scores
    if cfg.mean_over == "trajectories":
        row_traj, traj_score, traj_group = _trajectory_scores(batch)
        traj_adv = _normalize_in_groups(traj_score, traj_group, cfg.norm_by_std, cfg.eps)  # [J]
        return traj_adv[row_traj], traj_score[row_traj]
    raise ValueError(f"unknown algo.grpo.mean_over '{cfg.mean_over}' (turns | trajectories)")


@ESTIMATORS.implement("rloo")
def rloo(batch: TurnBatch, all_reduce_sum: AllReduce | None = None) -> tuple[Tensor, Tensor]:
    """A_j = score_j - mean of the OTHER trajectories' scores in j's group (0 for a lone trajectory).

    score_j = trajectory return; broadcast to every turn of j. returns = score_j.
    """
    row_traj, score, group = _trajectory_scores(batch)
    adv = torch.zeros_like(score)  # [J]
    for g in group.unique():
        member = group == g
        s = score[member]
        n = s.numel()
        if n < 2:
            continue
        adv[member] = s - (s.sum() - s) / (n - 1)
    return adv[row_traj], score[row_traj]


def discounted_step_returns(batch: TurnBatch, gamma: float) -> Tensor:
    """R_t = sum_{l >= t} gamma^(l - t) r_l per trajectory (GiGPO Eq. 5), r_l = reward_l + outcome at the last
    turn (the episode outcome is earned at the end; the turn-local rewards where they happen). [N]"""
    reward, outcome = batch.reward.tolist(), batch.outcome.tolist()
    out = [0.0] * len(batch)
    for idx in _trajectories(batch).values():
        running = 0.0
        for k, i in enumerate(reversed(idx)):
            running = reward[i] + (outcome[i] if k == 0 else 0.0) + gamma * running
            out[i] = running
    return torch.tensor(out, dtype=batch.reward.dtype)


def text_similarity(a: str, b: str) -> float:
    """Normalised edit similarity in [0, 1] (difflib's ratio: 2 * matched characters / total length)."""
    return 1.0 if a == b else SequenceMatcher(None, a, b).ratio()


def key_similarity(a: tuple[str, ...], b: tuple[str, ...]) -> float:
    """Similarity of two anchor keys: the lowest text_similarity of their fields (1 only when every field
    is the same text, so two different states never look identical)."""
    return min(text_similarity(x, y) for x, y in zip(a, b))


#: algo.gigpo.anchor: what identifies a turn's state
ANCHORS = ("observation", "observation_admissible")


def anchor_keys(batch: TurnBatch, anchor: str = "observation") -> list[tuple[str, ...]]:
    """The key each turn is matched on: (its observation,) (the paper, verl-agent), or (observation,
    admissible actions of its prompt) (separates states whose observation alone is the same, such as
    household's "Nothing happens." at different places). A tuple, not a joined string: no choice of
    separator can make two different (observation, admissible) pairs equal."""
    if anchor not in ANCHORS:
        raise ValueError(f"unknown algo.gigpo.anchor '{anchor}' ({' | '.join(ANCHORS)})")
    if len(batch.anchor_obs) != len(batch):
        raise ValueError("gigpo needs batch.anchor_obs (the observation of every turn); this batch has "
                         f"{len(batch.anchor_obs)} for {len(batch)} turns")
    if anchor == "observation":
        return [(o,) for o in batch.anchor_obs]
    if len(batch.admissible) != len(batch):
        raise ValueError("algo.gigpo.anchor=observation_admissible needs batch.admissible for every turn")
    return list(zip(batch.anchor_obs, batch.admissible))


def anchor_groups(batch: TurnBatch, similarity: float = 1.0, anchor: str = "observation") -> Tensor:
    """Step-group id per turn-sample [N]: turns of ONE episode group whose anchor keys match.

    similarity = 1.0: exact match of every field. Below 1: greedy clustering in row order (as verl-agent):
    a turn joins the first cluster of its group whose first member's key has key_similarity >= similarity,
    else it starts a new cluster. Turns of the same trajectory may share a step group (a revisited state).
    """
    keys = anchor_keys(batch, anchor)
    ids = [0] * len(batch)
    next_id = 0
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(batch.group_id.tolist()):
        by_group[g].append(i)
    for g in sorted(by_group):
        exact: dict[tuple[str, ...], int] = {}
        clusters: list[tuple[tuple[str, ...], int]] = []  # (representative key, id)
        for i in by_group[g]:
            key = keys[i]
            if similarity >= 1.0:
                if key not in exact:
                    exact[key], next_id = next_id, next_id + 1
                ids[i] = exact[key]
                continue
            match = next((cid for rep, cid in clusters if key_similarity(key, rep) >= similarity), None)
            if match is None:
                match, next_id = next_id, next_id + 1
                clusters.append((key, match))
            ids[i] = match
    return torch.tensor(ids, dtype=torch.long)


@ESTIMATORS.implement("gigpo")
def gigpo(
    batch: TurnBatch, settings: GiGPOConfig, episode: GRPOConfig, all_reduce_sum: AllReduce | None = None
) -> tuple[Tensor, Tensor]:
    """GiGPO (Feng et al. 2025, arXiv 2505.10978), following verl-agent's core_gigpo:

        A_episode = GRPO normalisation of the episode scores in the group (Eq. 3; over turn-samples or
                    trajectories as episode.mean_over (algo.grpo.mean_over) says, like grpo)
        R_t       = discounted return from turn t, gamma = algo.gigpo.gamma (Eq. 5)
        A_step    = R_t normalised among the turns of the group with the same anchor observation (Eq. 6-7);
                    a step group of one turn gets 0
        A         = A_episode + step_weight * A_step (Eq. 8)

    mode mean_std_norm: (x - mean) / (std + eps) at both levels (std unbiased); mean_norm: x - mean.
    returns = A (as verl-agent; there is no critic).
    """
    cfg = settings
    if cfg.mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"unknown algo.gigpo.mode '{cfg.mode}' (mean_norm | mean_std_norm)")
    by_std = cfg.mode == "mean_std_norm"
    if episode.mean_over == "turns":
        episode_adv = _normalize_in_groups(batch.outcome + batch.reward, batch.group_id, by_std, cfg.eps)  # [N]
    else:
        row_traj, traj_score, traj_group = _trajectory_scores(batch)
        episode_adv = _normalize_in_groups(traj_score, traj_group, by_std, cfg.eps)[row_traj]  # [N]
    step_returns = discounted_step_returns(batch, cfg.gamma)  # [N]
    step_groups = anchor_groups(batch, cfg.similarity, cfg.anchor)  # [N]
    step_adv = _normalize_in_groups(step_returns, step_groups, by_std, cfg.eps)  # [N]
    adv = episode_adv + cfg.step_weight * step_adv  # [N]
    return adv, adv


@dataclass(frozen=True)
class AdvantageEstimator:
    """The estimator algo.estimator names with its own settings sections (e.g. algo.grpo), read once."""

    name: str
    settings: tuple[Any, ...]

    @classmethod
    def from_config(cls, algo: Any) -> AdvantageEstimator:
        sections = ESTIMATORS.entry(algo.estimator).settings(algo)
        # copies: a change to the config after this does not reach the run's estimator
        return cls(algo.estimator, tuple(OmegaConf.to_object(s) if isinstance(s, DictConfig) else deepcopy(s)
                                         for s in sections))

    def __call__(self, batch: TurnBatch, all_reduce_sum: AllReduce | None = None) -> tuple[Tensor, Tensor]:
        """(advantages [N], returns [N]) of `batch`."""
        return ESTIMATORS.build(self.name, batch, *self.settings, all_reduce_sum=all_reduce_sum)
