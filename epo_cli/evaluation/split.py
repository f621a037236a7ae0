"""Evaluation: one function plays a split's fixed tasks and scores them; the trainer's periodic evaluation
and `epo eval` (epo_cli/evaluation/run.py: its arguments, the run's config and weights, the files it writes)
both call it, so a number in metrics.jsonl and a number from `epo eval` mean the same thing.

    evaluate_split    play the split's tasks with a policy and return eval/<split>/* metrics and the episodes
    score_episodes    success overall and per task type, episode length, invalid-action rate, with 95% intervals
    FixedActionPolicy, RandomPolicy   scripted baselines (policy=look | random)
    write_samples     a readable Markdown file of decoded trajectories
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epo_cli.envs.base import EnvSuite, Task
from epo_cli.rollout.episodes import Episode, PlayConfig, Policy, episode_metrics, episode_slots, run_episodes
from epo_cli.rollout.prompts import format_response
from epo_cli.rundir.writable import write_file
from epo_cli.seeding import derive_seed

#: z for a two-sided 95% interval
Z95 = 1.959963984540054

# ----------------------------------------------------------------------------------------------------
# The shared evaluation (trainer and `epo eval`)
# ----------------------------------------------------------------------------------------------------

def eval_tasks(suite: EnvSuite, split: str, n: int, seed: int) -> list[Task]:
    """The fixed evaluation tasks of a split: one draw, whoever evaluates (the seed is the run's seed)."""
    return suite.sample_tasks(split, n, random.Random(derive_seed(seed, "eval_tasks")))


def local_reduce(sums: dict[str, tuple[float, float]]) -> dict[str, float]:
    """{name: (sum, count)} -> value (sum / count, or the sum for counters with count 0): a world of one."""
    return {k: s / c if c > 0 else s for k, (s, c) in sums.items()}


def evaluate_split(
    policy: Policy,
    pool: Any,
    builder: Any,
    tokenizer: Any,
    split: str,
    tasks: list[Task],
    ids: list[int],
    max_turns: int,
    seed: int,
    reduce: Callable[[dict[str, tuple[float, float]]], dict[str, float]] = local_reduce,
    overlap: bool = False,
) -> tuple[dict[str, float], list[Episode]]:
    """Play `tasks` (this rank's share; `ids` are their global indices, which seed the sampling) and return
    the metrics under eval/<split>/... (reduced over ranks by `reduce`) and this rank's episodes."""
    settings = PlayConfig(builder, tokenizer, max_turns, seed=seed, step=-1, overlap=overlap)
    episodes, _ = run_episodes(policy, pool, episode_slots(tasks, ids), settings)
    reduced = reduce(episode_metrics(episodes))
    return {k.replace("rollout/", f"eval/{split}/", 1): v for k, v in reduced.items()}, episodes


# ----------------------------------------------------------------------------------------------------
# Confidence intervals
# ----------------------------------------------------------------------------------------------------

def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (sensible at 0 and n, unlike the normal one)."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float, float, float]:
    """(mean, sample std, lower, upper): normal approximation mean +- z * std / sqrt(n)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan, math.nan
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = z * std / math.sqrt(n)
    return mean, std, mean - half, mean + half


def rate_summary(successes: int, n: int) -> dict[str, Any]:
    lo, hi = wilson_interval(successes, n)
    return {"rate": successes / n if n else math.nan, "wins": successes, "n": n, "ci95": [lo, hi],
            "ci_method": "wilson"}


def score_episodes(episodes: list[Episode]) -> dict[str, Any]:
    """Success overall and per task type, episode length and invalid-action rate, with 95% intervals."""
    by_type: dict[str, list[bool]] = {}
    for ep in episodes:
        by_type.setdefault(ep.task.task_type, []).append(ep.won)
    mean, std, lo, hi = mean_interval([float(len(ep.turns)) for ep in episodes])
    invalid = sum(not t.valid for ep in episodes for t in ep.turns)
    turns = sum(len(ep.turns) for ep in episodes)
    ilo, ihi = wilson_interval(invalid, turns)
    # what a model that has not learned the format yet does: how often its action is one the env lists
    # (the admissible actions of that turn's prompt), and how long it talks
    admissible = sum(t.action in t.admissible for ep in episodes for t in ep.turns)
    alo, ahi = wilson_interval(admissible, turns)
    lengths = [float(len(t.response_ids)) for ep in episodes for t in ep.turns]
    return {
        "success": rate_summary(sum(ep.won for ep in episodes), len(episodes)),
        "success_by_task_type": {t: rate_summary(sum(w), len(w)) for t, w in sorted(by_type.items())},
        "episode_len": {"mean": mean, "std": std, "n": len(episodes), "ci95": [lo, hi],
                        "ci_method": "normal (mean +- 1.96 std/sqrt(n))"},
        # turns of one episode are not independent: this interval is optimistic, which the name says
        "invalid_rate": {"rate": invalid / turns if turns else math.nan, "invalid_turns": invalid,
                         "turns": turns, "ci95": [ilo, ihi], "ci_method": "wilson over turns"},
        "admissible_rate": {"rate": admissible / turns if turns else math.nan, "admissible_turns": admissible,
                            "turns": turns, "ci95": [alo, ahi], "ci_method": "wilson over turns"},
        "response_tokens": {"mean": sum(lengths) / len(lengths) if lengths else math.nan, "turns": len(lengths)},
    }


# ----------------------------------------------------------------------------------------------------
# Scripted policies (baselines and checks: their success can be reasoned about by hand)
# ----------------------------------------------------------------------------------------------------

@dataclass
class FixedActionPolicy:
    """Always answers the same well-formed action (default `look`: valid, never solves a task)."""

    tokenizer: Any
    action: str = "look"

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        ids = self.tokenizer.encode(format_response("", self.action), add_special_tokens=False)
        return [list(ids) for _ in prompts]


@dataclass
class RandomPolicy:
    """A uniformly random admissible action, seeded per (episode, turn) like model sampling."""

    tokenizer: Any

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        out = []
        for info, seed in zip(infos, seeds):
            actions = info.get("admissible_commands") or ["look"]
            text = format_response("", random.Random(seed).choice(actions))
            out.append(self.tokenizer.encode(text, add_special_tokens=False))
        return out


def write_samples(path: Path, episodes: list[Episode]) -> None:
    """A readable Markdown file of decoded trajectories (`epo eval` and the trainer's evaluations)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for ep in episodes:
        lines.append(f"## {ep.task.task_id} ({ep.task.task_type}) - {'WON' if ep.won else 'failed'} "
                     f"in {len(ep.turns)} turns\n\nTask: {ep.goal}\n")
        for t, turn in enumerate(ep.turns):
            lines.append(f"**Turn {t + 1}** observation: {turn.observation}\n\n"
                         f"response{'' if turn.valid else ' (invalid)'}: `{turn.response_text}`\n")
    write_file(path, "\n".join(lines))  # never through a planted symlink (epo_cli/rundir/writable.py)
