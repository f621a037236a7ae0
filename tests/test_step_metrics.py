"""The metric assembly of a training step (epo_cli/training/step_metrics.py) against hand-computed values,
in a world of one process (the all-reduces are the identity there)."""

from __future__ import annotations

import math

import pytest
import torch

from epo_cli.envs.base import Task
from epo_cli.rollout.episodes import Episode, RolloutStats, Turn
from epo_cli.training.step_metrics import (
    UpdateTally,
    critic_metrics,
    level_results,
    perf_metrics,
    reduce_sums,
    rollout_metrics,
    rollout_sums,
)


def _episode(level: str, group: int, won: bool, actions: list[str], valid: list[bool]) -> Episode:
    turns = [Turn([1], [2], "", "obs", [], a, v, [], False, False) for a, v in zip(actions, valid)]
    return Episode(Task(f"t{group}", "pick", 0, level=level), traj_id=group, group_id=group, turns=turns, won=won)


def test_rollout_sums_reduce_to_success_lengths_and_level_counts() -> None:
    episodes = [_episode("easy", 0, True, ["go", "take"], [True, True]),
                _episode("easy", 1, False, ["go", "go", "look"], [True, False, True]),
                _episode("hard", 2, True, ["take"], [True])]
    stats = RolloutStats(generated_tokens=30, env_steps=6)
    reduced = reduce_sums(rollout_sums(episodes, stats), torch.device("cpu"))
    # 2 of 3 won; lengths 2, 3, 1 -> 2; 1 invalid turn of 6
    assert reduced["rollout/success"] == pytest.approx(2 / 3)
    assert reduced["rollout/episode_len"] == pytest.approx(2.0)
    assert reduced["rollout/invalid_rate"] == pytest.approx(1 / 6)
    assert reduced["perf/generated_tokens"] == 30.0 and reduced["perf/env_steps"] == 6.0  # counters: sums
    assert level_results(reduced) == {"easy": (1.0, 2.0), "hard": (1.0, 1.0)}
    metrics = rollout_metrics(reduced)
    assert metrics["curriculum/level_success/easy"] == 0.5 and metrics["curriculum/level_success/hard"] == 1.0
    # the raw counters and throughput inputs are not metrics themselves
    assert not [k for k in metrics if k.startswith(("perf/", "curriculum/level_wins", "curriculum/level_episodes"))]


def test_perf_metrics_throughputs() -> None:
    stats = RolloutStats(rollout_s=3.0, generate_s=2.0, env_s=2.0, env_wait_s=1.0)
    out = perf_metrics(stats, {"perf/generated_tokens": 100.0, "perf/env_steps": 8.0}, 0.5, 1.5, 1e-4)
    assert out["perf/gen_tokens_per_s"] == 50.0 and out["perf/env_steps_per_s"] == 4.0
    assert out["perf/overlap_ratio"] == pytest.approx(3.0 / 4.0)  # 3 s of wall time for 4 s of work
    assert (out["perf/score_s"], out["perf/update_s"], out["perf/lr"]) == (0.5, 1.5, 1e-4)


def test_update_tally_means_over_optimizer_steps() -> None:
    tally = UpdateTally(real_tokens=30, padded_tokens=40, skipped=1, grad_norms=[1.0, 3.0])
    tally.add_step({"loss/policy_clip": 0.2, "policy/clipfrac": 0.1})
    tally.add_step({"loss/policy_clip": 0.4, "policy/clipfrac": 0.0})
    out = tally.metrics()
    assert out["loss/policy_clip"] == pytest.approx(0.3) and out["policy/clipfrac"] == pytest.approx(0.05)
    assert out["perf/optimizer_steps"] == 2.0 and out["perf/skipped_updates"] == 1.0
    assert out["perf/padding_efficiency"] == 0.75 and out["perf/grad_norm"] == 2.0


def test_critic_explained_variance_by_hand() -> None:
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])
    values = torch.tensor([1.0, 2.0, 2.0, 5.0])
    # errors r - v = 0, 0, 1, -1: Var = 0.5 (mean 0); Var(returns) = 1.25 -> 1 - 0.5/1.25 = 0.6
    out = critic_metrics(values, returns, torch.device("cpu"))
    assert out["critic/explained_variance"] == pytest.approx(0.6)
    assert out["critic/value_mean"] == pytest.approx(2.5)
    constant = critic_metrics(values, torch.ones(4), torch.device("cpu"))  # no variance to explain
    assert math.isnan(constant["critic/explained_variance"])
