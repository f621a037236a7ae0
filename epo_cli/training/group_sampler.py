"""Step 1 of an RL iteration: the step's tasks, played as whole groups by the current policy.

    sampler = GroupSampler(settings.sampler, rank, world_size, suite, pool, curriculum,
                           builder, tokenizer)
    rollout = sampler.sample(policy, step, total)   # Rollout: episodes, batch (one sample per turn), stats

One round draws algo.tasks_per_step tasks from the curriculum (the same draw on every rank) and plays
algo.group_size episodes of each; this rank plays its contiguous share of whole groups. Group and
trajectory ids are global and include the round, so a row's sampling seed never depends on the rank.
With algo.dynamic_sampling (DAPO), the groups algo.group_filter drops are replaced by fresh rounds
(epo_cli/algos/dynamic_sampling.py, group_filter.py); the batch then holds the chosen groups, the same count
on every rank.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from epo_cli.algos.advantages import AdvantageEstimator
from epo_cli.algos.curriculum import Curriculum
from epo_cli.algos.dynamic_sampling import choose_groups, concat_batches, rows_of_groups
from epo_cli.algos.group_filter import group_stats, passing_groups
from epo_cli.algos.intrinsic import intrinsic_rewards
from epo_cli.config import IntrinsicConfig
from epo_cli.envs.base import EnvSuite
from epo_cli.errors import UserError
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.episodes import (
    Episode,
    EpisodeSlot,
    PlayConfig,
    Policy,
    RolloutStats,
    episodes_to_batch,
    run_episodes,
)
from epo_cli.rollout.prompts import PromptBuilder
from epo_cli.seeding import derive_seed
from epo_cli.training.engine import all_gather_objects

#: the RolloutStats fields that add up over dynamic sampling's rounds
_ADDED_UP = ("rollout_s", "generate_s", "env_s", "env_steps", "generated_tokens")


@dataclass
class Rollout:
    """What step 1 returns (rewards as configured, no scoring yet)."""

    episodes: list[Episode]  # every episode this rank played (every round: each is an unbiased draw)
    batch: TurnBatch  # one sample per turn of the chosen groups
    stats: RolloutStats
    metrics: dict[str, float] = field(default_factory=dict)  # dynamic sampling's counters (rollout/...)


@dataclass(frozen=True)
class GroupSamplerSettings:
    """What step 1 reads, fixed for the run (training/settings.py cuts it from the run config)."""

    seed: int  # the run's seed: task draws and sampling seeds
    tasks_per_step: int  # groups per round (all ranks together)
    group_size: int  # episodes per group (one task)
    reward_scale: float  # the batch's rewards: the episode's outcome times this,
    invalid_action_penalty: float  # minus this per invalid action
    intrinsic: IntrinsicConfig  # algo.intrinsic: the novelty bonus (kind none: off)
    overlap: bool  # rollout.overlap: generation overlaps the env steps
    dynamic_sampling: bool  # DAPO: replace the groups group_filter drops with fresh rounds
    max_rounds: int  # algo.dynamic_sampling_max_rounds: extra rounds at most
    group_filter: str  # which groups pass (algo.group_filter)
    group_filter_keep: float


class GroupSampler:
    def __init__(self, settings: GroupSamplerSettings, rank: int, world_size: int, suite: EnvSuite, pool: Any,
                 curriculum: Curriculum, builder: PromptBuilder, tokenizer: Any,
                 estimator: AdvantageEstimator | None = None) -> None:
        """`estimator`: the run's advantage estimator (step 3's), which gives a group its signal under
        algo.group_filter=signal (None: estimator=none)."""
        self.settings, self.estimator = settings, estimator
        self.rank, self.world_size = rank, world_size
        self.suite, self.pool, self.curriculum = suite, pool, curriculum
        self.builder, self.tokenizer = builder, tokenizer

    def sample(self, policy: Policy, step: int, total: int) -> Rollout:
        """This rank's whole groups of step `step`, played by `policy` into one sample per turn."""
        settings, groups = self.settings, self.settings.tasks_per_step
        if groups % self.world_size:
            raise UserError(f"algo.tasks_per_step={groups} must be divisible by the number of ranks "
                            f"({self.world_size}) so every GRPO group stays on one rank.")
        if not settings.dynamic_sampling:
            return self.play_round(policy, step, total, 0)
        episodes, batches, stats = [], [], RolloutStats()
        played: list[tuple[int, bool]] = []  # (global group id, passes algo.group_filter), in play order
        rounds = 0
        for r in range(1 + settings.max_rounds):
            round_ = self.play_round(policy, step, total, r)
            rounds += 1
            episodes += round_.episodes
            batches.append(round_.batch)
            for name in _ADDED_UP:
                setattr(stats, name, getattr(stats, name) + getattr(round_.stats, name))
            # every rank's groups, by group id
            gathered = all_gather_objects(group_stats(round_.batch, settings.group_filter, self.estimator))
            round_stats = sorted(s for rank_stats in gathered for s in rank_stats)
            played += passing_groups(round_stats, settings.group_filter, settings.group_filter_keep)
            if sum(ok for _, ok in played) >= groups:
                break
        chosen, topped_up = choose_groups(played, groups)
        everyone = concat_batches(all_gather_objects(concat_batches(batches)))  # every rank's played rows
        mine = chosen[self.rank * groups // self.world_size:(self.rank + 1) * groups // self.world_size]
        batch = everyone.select(rows_of_groups(everyone, mine))  # whole groups, the same count on every rank
        return Rollout(episodes, batch, stats, {
            "rollout/groups_dropped": float(sum(not ok for _, ok in played) - topped_up),
            "rollout/groups_topped_up": float(topped_up),
            "rollout/sampling_rounds": float(rounds - 1),
        })

    def play_round(self, policy: Policy, step: int, total: int, round_index: int) -> Rollout:
        """One round of tasks_per_step groups; this rank plays its share of whole groups."""
        settings, groups = self.settings, self.settings.tasks_per_step
        # tasks: identical draw on every rank; this rank plays whole groups
        rng = random.Random(derive_seed(settings.seed, "tasks", step, round_index))
        tasks = self.curriculum.sample_tasks(self.suite, groups, rng, step, total)
        first = round_index * groups  # global id of this round's first group
        mine = range(self.rank * groups // self.world_size, (self.rank + 1) * groups // self.world_size)
        slots = [EpisodeSlot(tasks[g], traj_id=(first + g) * settings.group_size + k, group_id=first + g)
                 for g in mine for k in range(settings.group_size)]
        # play them: one sample per turn
        play = PlayConfig(self.builder, self.tokenizer, self.curriculum.max_turns(step, total), seed=settings.seed,
                          step=step, overlap=settings.overlap)
        episodes, stats = run_episodes(policy, self.pool, slots, play)
        batch = episodes_to_batch(episodes, settings.reward_scale, settings.invalid_action_penalty,
                                  self.curriculum.subgoal_coef(step, total))
        if settings.intrinsic.kind != "none":  # novelty bonus per turn, counted per group (algos/intrinsic.py)
            batch.intrinsic = intrinsic_rewards(episodes, settings.intrinsic, step)
            batch.reward = batch.reward + batch.intrinsic
        return Rollout(episodes, batch, stats)
