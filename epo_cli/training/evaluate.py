"""Evaluation during training: env.eval_splits every trainer.eval_every steps (and after the last), through
the evaluation core that `epo eval` uses (epo_cli/evaluation/split.py), each rank playing its share of a split's
fixed tasks; the metrics are all-reduced, so every rank returns the same eval/<split>/* values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epo_cli.envs.base import EnvSuite
from epo_cli.evaluation.split import eval_tasks, evaluate_split, write_samples
from epo_cli.rollout.episodes import Episode, Policy
from epo_cli.rollout.prompts import PromptBuilder
from epo_cli.training.engine import DistInfo
from epo_cli.training.step_metrics import reduce_sums


@dataclass(frozen=True)
class TrainingEvalSettings:
    """What the training-time evaluation reads, fixed for the run (training/settings.py cuts it from the run config)."""

    splits: tuple[str, ...]  # env.eval_splits; the first gives eval/success
    every: int  # trainer.eval_every: evaluate every so many steps (0: only after the last)
    episodes: int  # trainer.eval_episodes per split
    samples_to_save: int  # rollout.num_samples_to_save: episodes of each split written as Markdown
    max_turns: int  # env.max_turns
    seed: int  # the run's seed: the splits' fixed tasks and the episodes' sampling seeds
    overlap: bool  # rollout.overlap: generation overlaps the env steps


@dataclass
class TrainingEval:
    settings: TrainingEvalSettings
    dist: DistInfo
    suite: EnvSuite
    pool: Any
    builder: PromptBuilder
    tokenizer: Any

    def due(self, done_steps: int, total: int) -> bool:
        every = self.settings.every
        return bool(self.settings.splits) and (done_steps == total or (every > 0 and done_steps % every == 0))

    def split(self, policy: Policy, split: str, episodes: int) -> tuple[dict[str, float], list[Episode]]:
        """Play `episodes` fixed tasks of `split` (this rank: its contiguous share); all-reduced metrics and this
        rank's episodes."""
        settings, w, r = self.settings, self.dist.world_size, self.dist.rank
        tasks = eval_tasks(self.suite, split, episodes, settings.seed)
        mine = range(r * len(tasks) // w, (r + 1) * len(tasks) // w)
        return evaluate_split(policy, self.pool, self.builder, self.tokenizer, split, [tasks[i] for i in mine],
                              list(mine), settings.max_turns, settings.seed,
                              reduce=lambda sums: reduce_sums(sums, self.dist.device), overlap=settings.overlap)

    def all_splits(self, policy: Policy, done_steps: int, samples: Path | None) -> dict[str, float]:
        """eval/<split>/* of every env.eval_splits, and eval/success (the first split's). With `samples` (a
        folder), the first rollout.num_samples_to_save episodes of each split are written there as Markdown."""
        settings, out = self.settings, {}
        for i, split in enumerate(settings.splits):
            metrics, episodes = self.split(policy, split, settings.episodes)
            if samples is not None:
                write_samples(samples / f"step_{done_steps}-{split}.md", episodes[: settings.samples_to_save])
            out.update(metrics)
            if i == 0:
                out["eval/success"] = metrics.get(f"eval/{split}/success", 0.0)
        return out
