"""The collapse/* metrics of one RL iteration and the `collapse` alert (settings: algo.diagnostics).

    watch = CollapseWatch(settings.collapse, dist, models, run_or_None, warn)
    metrics.update(watch.metrics(batch, episodes, history, step, subgoal_coef, turns))   # step 6
    alert, signals = watch.alert(metrics, step + 1, signals)                            # end of step 8

The math is in epo_cli/algos/diagnostics.py; this module gathers its inputs from the iteration (the played
episodes, the trained batch, EPO's entropy history before this step's update), sums over ranks and, for the
mutual information, scores prompt/response pairs with the policy after this iteration's update. Every value
is over all ranks and the same on any number of ranks (groups are whole on one rank; MI's subsample is drawn
from global ids).

    collapse/reward_std           mean over the played groups of the std of their trajectories' returns
    collapse/zero_std_groups      share of the played groups whose returns are all equal
    collapse/adv_signal_share     share of the trained turn-samples with a non-zero advantage (the rest only
                                  feed the KL and entropy terms)
    collapse/corridor_above|below share of the trained turn-samples whose mean token entropy lies above /
                                  below EPO's band [kappa_low, kappa_high] x Href (Href: the reference of
                                  the sample's turn before this step); per turn index t:
                                  collapse/corridor_above_turn/<t>, collapse/corridor_below_turn/<t>
    collapse/state_diversity      mean over states a group reached more than once of (distinct actions - 1) /
                                  (visits - 1): 0 = every visit took the same action
    collapse/mi                   cross-prompt mutual information of prompts and responses, nats per token
                                  (every algo.diagnostics.mi_every iterations)
    collapse/alert                1 while a signal is beyond its threshold (algo.diagnostics.alert_*); the
                                  console warning and status.json note come when one crosses into it
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from epo_cli.algos.diagnostics import (
    advantage_signal,
    alert_crossings,
    collapse_reasons,
    corridor_counts,
    cross_prompt_mi,
    group_return_std,
    measured_signals,
    state_diversity,
)
from epo_cli.algos.entropy import EntropyHistory
from epo_cli.algos.group_filter import trajectory_returns
from epo_cli.config import DiagnosticsConfig
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.episodes import Episode, episodes_to_batch
from epo_cli.rundir.folder import record_alert
from epo_cli.seeding import derive_seed
from epo_cli.training.engine import DistInfo, all_gather_objects, all_reduce_sum
from epo_cli.training.forward import collate, policy_forward
from epo_cli.training.models import Models

AllReduce = Callable[[Tensor], Tensor]
AllGather = Callable[[Any], list[Any]]


@dataclass(frozen=True)
class CollapseSettings:
    """What the collapse diagnostics read, fixed for the run (training/settings.py cuts it from the run config)."""

    diagnostics: DiagnosticsConfig  # algo.diagnostics: enabled, MI's cadence and subsample, alert thresholds
    reward_scale: float  # algo.reward_scale and algo.invalid_action_penalty: the played episodes' returns,
    invalid_action_penalty: float  # as the rollout's batch computes them
    max_turns: int  # env.max_turns: the corridor's turn slots (at least; a curriculum may allow more)
    kappa_low: float  # EPO's band [kappa_low, kappa_high] x Href (algo.entropy_smoothing)
    kappa_high: float
    seed: int  # the run's seed: MI's subsample
    temperature: float  # rollout.temperature: MI scores at the sampling temperature
    micro_batch_size: int  # MI's scoring passes


@dataclass(frozen=True)
class PairScorer:
    """Scores (prompt, response) token sequences with a policy, without gradient."""

    model: nn.Module
    pad_id: int
    device: torch.device
    temperature: float
    vocab_limit: int | None
    packed: bool
    micro_batch_size: int
    autocast_to: torch.dtype | None = None  # model.autocast: the precision every other forward of the run uses

    def sequence_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> Tensor:
        """log p(response | prompt), summed over the response's tokens, per pair ([P] float64)."""
        n = len(prompts)
        pairs = TurnBatch(prompt_ids=prompts, response_ids=responses, traj_id=torch.arange(n),
                          group_id=torch.arange(n), turn_index=torch.zeros(n, dtype=torch.long),
                          num_turns=torch.ones(n, dtype=torch.long), reward=torch.zeros(n), outcome=torch.zeros(n),
                          valid=torch.ones(n, dtype=torch.bool), won=torch.zeros(n, dtype=torch.bool),
                          task_type=[""] * n)
        out = torch.zeros(n, dtype=torch.float64)
        with torch.no_grad():
            for start in range(0, n, self.micro_batch_size):
                rows = list(range(start, min(start + self.micro_batch_size, n)))
                mb = collate(pairs, rows, self.pad_id, self.device, packed=self.packed)
                logp = policy_forward(self.model, mb, self.temperature, self.vocab_limit, with_entropy=False,
                                      autocast_to=self.autocast_to).logprobs
                out[rows] = torch.where(mb.response_mask, logp, torch.zeros_like(logp)).double().sum(-1).cpu()
        return out


def mi_subsample(batch: TurnBatch, step: int, seed: int, size: int,
                 all_gather: AllGather) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of `size` turn-samples of the whole batch (all ranks), drawn by a seed of
    (run seed, step, each sample's trajectory and turn): the same subsample, in the same order, on every rank
    and on any number of ranks."""
    keys = [(derive_seed(seed, "mi", step, t, i), t, i)
            for t, i in zip(batch.traj_id.tolist(), batch.turn_index.tolist())]
    chosen = sorted(k for part in all_gather(keys) for k in part)[:size]
    wanted = set(chosen)
    mine = {k: (batch.prompt_ids[r], batch.response_ids[r]) for r, k in enumerate(keys) if k in wanted}
    found = {k: v for part in all_gather(mine) for k, v in part.items()}
    return [found[k] for k in chosen]


def mutual_information(scorer: PairScorer, batch: TurnBatch, step: int, seed: int, size: int,
                       all_reduce_sum: AllReduce, all_gather: AllGather, rank: int = 0,
                       world: int = 1) -> float | None:
    """collapse/mi on a subsample of `size` turn-samples: every (prompt j, response i) pair scored once, the
    pairs dealt to ranks by position and the [m, m] matrix summed over ranks (None: fewer than 2 samples)."""
    samples = mi_subsample(batch, step, seed, size, all_gather)
    m = len(samples)
    if m < 2:
        return None
    pairs = [(i, j) for i in range(m) for j in range(m)]
    mine = pairs[rank * len(pairs) // world:(rank + 1) * len(pairs) // world]
    logp = torch.zeros(m * m, dtype=torch.float64)
    if mine:
        scored = scorer.sequence_logprobs([samples[j][0] for _, j in mine], [samples[i][1] for i, _ in mine])
        logp[[i * m + j for i, j in mine]] = scored
    logp = all_reduce_sum(logp.to(scorer.device)).cpu().reshape(m, m)
    lengths = torch.tensor([len(r) for _, r in samples], dtype=torch.float64)
    return cross_prompt_mi(logp, lengths)


def collapse_metrics(batch: TurnBatch, episodes: list[Episode], history: EntropyHistory, settings: CollapseSettings,
                     step: int,
                     subgoal_coef: float, max_turns: int, scorer: PairScorer, all_reduce_sum: AllReduce,
                     all_gather: AllGather, rank: int = 0, world: int = 1) -> dict[str, float]:
    """The collapse/* metrics of one iteration (see the module docstring); {} when algo.diagnostics.enabled is
    false. Call after the update (every sample's entropy is known) and before the entropy history records this
    step; `scorer` scores MI's pairs. Collectives: every rank calls it."""
    if not settings.diagnostics.enabled:
        return {}
    t0 = time.perf_counter()
    played = episodes_to_batch(episodes, settings.reward_scale, settings.invalid_action_penalty, subgoal_coef)
    std_sum, groups, zero = group_return_std(trajectory_returns(played).values())
    signal, samples = advantage_signal(batch.advantages) if batch.advantages is not None else (0, len(batch))
    div_sum, states = state_diversity((ep.group_id, (turn.observation, tuple(turn.admissible)), turn.action)
                                      for ep in episodes for turn in ep.turns)
    turns = max(settings.max_turns, max_turns)
    corridor = corridor_counts(batch.entropy, batch.turn_index, history.reference(batch.turn_index),
                               settings.kappa_low, settings.kappa_high, turns)  # [T, 3]
    sums = torch.cat([torch.tensor([std_sum, groups, zero, signal, samples, div_sum, states], dtype=torch.float64),
                      corridor.flatten()])
    sums = all_reduce_sum(sums.to(scorer.device)).cpu().tolist()
    std_sum, groups, zero, signal, samples, div_sum, states = sums[:7]
    out = {
        "collapse/reward_std": std_sum / max(groups, 1.0),
        "collapse/zero_std_groups": zero / max(groups, 1.0),
        "collapse/adv_signal_share": signal / max(samples, 1.0),
    }
    if states > 0:
        out["collapse/state_diversity"] = div_sum / states
    corridor = torch.tensor(sums[7:], dtype=torch.float64).reshape(turns, 3)
    counted = float(corridor[:, 0].sum())
    if counted > 0:  # a reference exists (not the first step)
        out["collapse/corridor_above"] = float(corridor[:, 1].sum()) / counted
        out["collapse/corridor_below"] = float(corridor[:, 2].sum()) / counted
        for t in torch.nonzero(corridor[:, 0]).flatten().tolist():
            n = float(corridor[t, 0])
            out[f"collapse/corridor_above_turn/{t}"] = float(corridor[t, 1]) / n
            out[f"collapse/corridor_below_turn/{t}"] = float(corridor[t, 2]) / n
    if mi_due(settings.diagnostics, step):
        t_mi = time.perf_counter()
        mi = mutual_information(scorer, batch, step, settings.seed, settings.diagnostics.mi_samples,
                                all_reduce_sum, all_gather, rank, world)
        if mi is not None:
            out["collapse/mi"] = mi
        out["perf/mi_s"] = time.perf_counter() - t_mi  # the MI part of perf/diagnostics_s
    out["perf/diagnostics_s"] = time.perf_counter() - t0
    return out


def mi_due(settings: DiagnosticsConfig, step: int) -> bool:
    """Whether step `step` measures collapse/mi (every algo.diagnostics.mi_every steps; 0: never)."""
    return settings.enabled and settings.mi_every > 0 and step % settings.mi_every == 0


def collapse_alert(metrics: dict[str, float], settings: DiagnosticsConfig, step: int, beyond_before: list[str],
                   warn: Callable[[str], None], run: Path | None) -> tuple[dict[str, float], list[str]]:
    """({collapse/alert: 1 while a signal is beyond its threshold, else 0}, the signals beyond after this step)
    for this step's metrics and the signals beyond before it. When a signal crosses into its threshold: one
    console warning naming the signals that crossed, and a note in <run>/status.json (`run`: rank 0's run
    directory, None on other ranks). ({}, []) when disabled."""
    if not settings.enabled:
        return {}, []
    reasons = collapse_reasons(metrics, settings)
    beyond, crossed = alert_crossings(beyond_before, reasons, measured_signals(metrics, settings), settings)
    if crossed:
        why = [reasons[s] for s in crossed]
        warn(f"collapse alert at step {step}: " + "; ".join(why))
        if run is not None:
            record_alert(run, "collapse", step, why)
    return {"collapse/alert": float(bool(beyond))}, beyond


class CollapseWatch:
    """The Trainer's part for the collapse diagnostics (algo.diagnostics): step 6's collapse/* metrics and
    the collapse alert at the end of step 8. `run`: rank 0's run directory (None on other ranks), where the
    alert is noted in status.json; `warn`: the console."""

    def __init__(self, settings: CollapseSettings, dist: DistInfo, models: Models, run: Path | None,
                 warn: Callable[[str], None]) -> None:
        self.settings, self.dist, self.models, self.run, self.warn = settings, dist, models, run, warn

    def metrics(self, batch: TurnBatch, episodes: list[Episode], history: EntropyHistory, step: int,
                subgoal_coef: float, max_turns: int) -> dict[str, float]:
        """collapse_metrics of this iteration (after the update, before the entropy history records it).
        MI scores with the updated weights: under ZeRO 0-2 `policy.module` is the engine's module, which has
        them; under ZeRO-3 its copy takes them here (a collective, in the steps that measure MI only)."""
        models, settings = self.models, self.settings
        if mi_due(settings.diagnostics, step):
            models.policy.refresh()
        scorer = PairScorer(models.policy.module, models.tokenizer.pad_token_id, self.dist.device,
                            settings.temperature, models.vocab_limit, models.packing, settings.micro_batch_size,
                            models.autocast_to)
        return collapse_metrics(batch, episodes, history, settings, step, subgoal_coef, max_turns, scorer,
                                all_reduce_sum, all_gather_objects, self.dist.rank, self.dist.world_size)

    def alert(self, metrics: dict[str, float], step: int, beyond_before: list[str]) -> tuple[dict[str, float],
                                                                                             list[str]]:
        """collapse_alert of this step (`step`: the number of steps done, as logged)."""
        return collapse_alert(metrics, self.settings.diagnostics, step, beyond_before, self.warn, self.run)
