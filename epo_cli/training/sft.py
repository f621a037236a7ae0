"""Behaviour cloning (algo=sft): demonstrations through the same update as RL, with the nll loss term.

    data = demonstrations(settings.demos, suite, pool, builder, tokenizer, save_to, log)
    each step: result = sft_step(update, data, coefs, step)   # update: training/update.py, as RL's

A step's mini-batch is a function of (seed, step): each epoch is a fresh permutation of the
demonstrations, so a resumed run trains on exactly the rows an uninterrupted one would.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epo_cli.envs.base import EnvSuite
from epo_cli.errors import UserError
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.demos import episodes_to_records, read_jsonl, records_to_batch, write_jsonl
from epo_cli.rollout.episodes import ExpertPolicy, PlayConfig, episode_slots, run_episodes
from epo_cli.rollout.prompts import PromptBuilder
from epo_cli.seeding import derive_seed
from epo_cli.training.update import PolicyUpdate, UpdateResult


@dataclass(frozen=True)
class DemoSettings:
    """Where the demonstrations come from, fixed for the run (training/settings.py cuts it from the run config)."""

    demos: str  # algo.demos: expert (played now), or a JSONL file of demonstrations
    episodes: int  # algo.demo_episodes the expert plays
    slip: float  # algo.demo_slip: the expert's chance per turn to take another admissible action
    level: str | None  # algo.demo_level: the tasks' level (None: any)
    split: str  # env.train_split: where the tasks come from
    max_turns: int  # env.max_turns
    seed: int  # the run's seed: the tasks and the slips


def demonstrations(settings: DemoSettings, suite: EnvSuite, pool: Any, builder: PromptBuilder, tokenizer: Any,
                   save_to: Path | None, log: Callable[[str], None]) -> TurnBatch:
    """The turn samples to clone: demos=expert plays `episodes` episodes with the env's expert (slipping with
    chance `slip` per turn; the solved episodes are kept, slips included, and written to `save_to` as
    JSONL), else `demos` names a JSONL file."""
    if settings.demos != "expert":
        return records_to_batch(read_jsonl(settings.demos), builder, tokenizer)
    rng = random.Random(derive_seed(settings.seed, "demos"))
    tasks = suite.sample_tasks(settings.split, settings.episodes, rng, level=settings.level)
    play = PlayConfig(builder, tokenizer, settings.max_turns, seed=derive_seed(settings.seed, "demo_slips"))
    episodes, _ = run_episodes(ExpertPolicy(tokenizer, slip=settings.slip), pool,
                               episode_slots(tasks, list(range(len(tasks)))), play)
    solved = [ep for ep in episodes if ep.won]
    records = episodes_to_records(solved)
    if save_to is not None:
        write_jsonl(save_to, records)
    log(f"expert solved {len(solved)}/{len(episodes)} demo episodes "
        f"({sum(len(e.turns) for e in solved)} turn samples) -> {save_to}")
    if not solved:
        raise UserError(no_demos_message(settings, len(episodes)))
    return records_to_batch(records, builder, tokenizer)


def no_demos_message(settings: DemoSettings, played: int) -> str:
    """Why no demonstration episode was solved, naming the setting most likely at fault."""
    slip, turns = settings.slip, settings.max_turns
    if slip > 0:
        return (f"The expert solved none of the {played} demonstration episodes: with algo.demo_slip="
                f"{slip:g} it takes another command than its own on {slip:.0%} of its turns, "
                f"and no episode reached the goal within env.max_turns={turns}. Lower algo.demo_slip (the demo's "
                "noisy teacher slips on 40% of its turns), or raise env.max_turns.")
    return (f"The expert solved none of the {played} demonstration episodes within env.max_turns={turns}; raise "
            "env.max_turns.")


def step_rows(n: int, step: int, mini_batch_size: int, seed: int, rank: int,
              world_size: int) -> tuple[list[int], float]:
    """(this rank's rows of step `step`'s mini-batch of the `n` demonstrations, epochs done so far)."""
    per_epoch = max(1, n // mini_batch_size)
    epoch, pos = divmod(step, per_epoch)
    shuffle = torch.Generator().manual_seed(derive_seed(seed, "sft_epoch", epoch))
    perm = torch.randperm(n, generator=shuffle).tolist()
    global_rows = perm[pos * mini_batch_size:(pos + 1) * mini_batch_size]
    return global_rows[rank::world_size], step / per_epoch


def sft_step(update: PolicyUpdate, data: TurnBatch, coefs: dict[str, float], step: int) -> UpdateResult:
    """One optimizer step on this rank's rows of the step's mini-batch; perf/* and sft/epoch join the
    update's metrics."""
    mine, epochs = step_rows(len(data), step, update.settings.mini_batch_size, update.settings.seed,
                             update.dist.rank, update.dist.world_size)
    t0 = time.perf_counter()
    result = update.run(data.select(mine), coefs, step)
    update_s = time.perf_counter() - t0
    tokens = sum(len(data.prompt_ids[r]) + len(data.response_ids[r]) for r in mine)
    result.metrics.update({"perf/update_s": update_s, "perf/tokens_per_s": tokens / max(update_s, 1e-9),
                           "perf/lr": update.learning_rate, "sft/epoch": epochs})
    return result
