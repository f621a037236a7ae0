"""The group sampler (step 1 of an RL iteration) on its own: a toy env, a toy policy, no model and no ranks.

The toy policy opens the door when its row's sampling seed is even, so an episode's fate depends only on
(seed, step, trajectory, turn): what the sampler must keep independent of the rank that plays it.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest

from epo_cli.algos.advantages import AdvantageEstimator
from epo_cli.algos.curriculum import build_curriculum
from epo_cli.compose import compose
from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.envs.pool import EnvPool
from epo_cli.errors import UserError
from epo_cli.rollout.prompts import PromptBuilder
from epo_cli.training.group_sampler import GroupSampler, Rollout
from epo_cli.training.settings import sampler_settings


class DoorEnv(Env):
    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.task, self.turn = task, 0
        return f"A closed door ({task.task_id}).", self._info(False)

    def step(self, action: str) -> StepResult:
        self.turn += 1
        won = action == "open door"
        return StepResult(f"Turn {self.turn}.", float(won), won, self._info(won))

    def _info(self, won: bool) -> dict[str, Any]:
        return {"won": won, "goal": f"open the door of {self.task.task_id}",
                "admissible_commands": ["open door", "wait"]}


class DoorSuite(EnvSuite):
    name = "door"

    def make_env(self) -> Env:
        return DoorEnv()

    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        return [Task(f"door{rng.randrange(10**6)}", "door", rng.randrange(1000), split) for _ in range(n)]


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [bytes(x).decode() for x in ids]


class CoinPolicy:
    """Opens the door on an even sampling seed, else waits."""

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        return [list(f"<action>{'open door' if s % 2 == 0 else 'wait'}</action>".encode()) for s in seeds]


@functools.lru_cache
def _config(*overrides: str) -> Any:
    return compose(["algo=grpo", "algo.tasks_per_step=4", "algo.group_size=2", "env.max_turns=2", "seed=5",
                    "algo.reward_scale=10", *overrides])


def _sampler(pool: EnvPool, rank: int = 0, world_size: int = 1, *overrides: str) -> GroupSampler:
    cfg = _config(*overrides)
    suite = pool.suite
    builder = PromptBuilder("compact", 2, 4096, lambda text: list(text.encode()))
    estimator = AdvantageEstimator.from_config(cfg.algo) if cfg.algo.estimator != "none" else None
    return GroupSampler(sampler_settings(cfg), rank, world_size, suite, pool,
                        build_curriculum(cfg, suite), builder, ByteTokenizer(), estimator)


def _trace(rollout: Rollout) -> list:
    return [(ep.task.task_id, ep.traj_id, ep.group_id, ep.won, ep.actions) for ep in rollout.episodes]


@pytest.fixture
def pool():
    with EnvPool(DoorSuite(None), num_workers=0) as pool:
        yield pool


def test_a_round_is_whole_groups_with_global_ids(pool: EnvPool) -> None:
    sampler = _sampler(pool)
    first = sampler.play_round(CoinPolicy(), step=3, total=10, round_index=0)
    # 4 tasks x 2 rollouts; trajectory (g, k) has id g * group_size + k, its group g
    assert [(ep.traj_id, ep.group_id) for ep in first.episodes] == [(t, t // 2) for t in range(8)]
    assert len({ep.task.task_id for ep in first.episodes}) == 4  # a group shares its task
    assert all(a.task == b.task for a, b in zip(first.episodes[::2], first.episodes[1::2]))
    batch = first.batch
    assert len(batch) == sum(len(ep.turns) for ep in first.episodes) == first.stats.env_steps
    # the task reward is reward_scale * won on every turn of the trajectory; one turn-local reward per turn
    assert batch.outcome.tolist() == [10.0 * ep.won for ep in first.episodes for _ in ep.turns]
    assert first.metrics == {}
    # round 1 continues the global ids: groups 4..7, trajectories 8..15, and draws other tasks
    second = sampler.play_round(CoinPolicy(), step=3, total=10, round_index=1)
    assert [(ep.traj_id, ep.group_id) for ep in second.episodes] == [(t, t // 2) for t in range(8, 16)]
    assert {ep.task.task_id for ep in second.episodes}.isdisjoint({ep.task.task_id for ep in first.episodes})


def test_ranks_play_their_share_of_groups_and_the_same_episodes(pool: EnvPool) -> None:
    """Two ranks play groups 0-1 and 2-3 of the same draw; together they are the one-rank rollout."""
    alone = _sampler(pool).sample(CoinPolicy(), 3, 10)
    halves = [_sampler(pool, rank, 2).sample(CoinPolicy(), 3, 10) for rank in (0, 1)]
    assert [sorted({ep.group_id for ep in h.episodes}) for h in halves] == [[0, 1], [2, 3]]
    assert _trace(halves[0]) + _trace(halves[1]) == _trace(alone)
    assert len({ep.won for ep in alone.episodes}) == 2  # the toy policy both wins and loses here
    with pytest.raises(UserError, match="tasks_per_step=4 must be divisible by the number of ranks \\(3\\)"):
        _sampler(pool, 0, 3).sample(CoinPolicy(), 3, 10)


def test_dynamic_sampling_keeps_the_first_groups_with_signal(pool: EnvPool) -> None:
    """Rounds are played until 4 groups have signal (or the rounds run out); the batch holds the first 4 such
    groups in play order, and every round's episodes count for the rollout metrics. Here a group has signal
    (GRPO gives it a non-zero advantage) exactly when one of its two episodes wins: no turn rewards."""
    dynamic = _sampler(pool, 0, 1, "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_rounds=5")
    rollout = dynamic.sample(CoinPolicy(), 3, 10)
    # the same rounds played one by one (a round is a function of its index alone)
    rounds = [_sampler(pool).play_round(CoinPolicy(), 3, 10, r) for r in range(6)]
    played = [(ep.group_id, ep.won) for r in rounds for ep in r.episodes]
    signal = [g for g in dict.fromkeys(g for g, _ in played) if len({w for h, w in played if h == g}) == 2]
    needed = next(r for r in range(6) if len([g for g in signal if g < 4 * (r + 1)]) >= 4)  # rounds - 1
    assert needed >= 1  # some groups had no signal, so more than one round was played
    assert sorted(set(rollout.batch.group_id.tolist())) == signal[:4]
    assert _trace(rollout) == [t for r in rounds[:needed + 1] for t in _trace(r)]
    assert rollout.stats.env_steps == sum(r.stats.env_steps for r in rounds[:needed + 1])
    no_signal = 4 * (needed + 1) - len([g for g in signal if g < 4 * (needed + 1)])
    assert rollout.metrics == {"rollout/groups_dropped": float(no_signal), "rollout/groups_topped_up": 0.0,
                               "rollout/sampling_rounds": float(needed)}
