"""Curricula: which tasks each iteration trains on, the turn limit, and intermediate rewards.

The training loop asks its curriculum, every iteration:
    sample_tasks(suite, n, rng, step, total)  -> the iteration's tasks (levels chosen by the curriculum)
    max_turns(step, total)                    -> the turn limit (horizon curricula grow it)
    subgoal_coef(step, total)                 -> weight of intermediate rewards (0 = sparse reward only)
and reports back the iteration's true task success per level with `observe(...)` (identical on all
ranks: the statistics are all-reduced first). State survives checkpoints via state_dict().
"""

from __future__ import annotations

import random
from typing import Any

from epo_cli.envs.base import EnvSuite, Task


class Curriculum:
    """`curriculum=none`: tasks of the configured env/level, fixed turn limit, optional subgoal rewards."""

    def __init__(self, cfg: Any, env_cfg: Any) -> None:
        self.cfg = cfg
        self.env_cfg = env_cfg

    def sample_tasks(self, suite: EnvSuite, n: int, rng: random.Random, step: int, total: int) -> list[Task]:
        return suite.sample_tasks(self.env_cfg.train_split, n, rng)

    def max_turns(self, step: int, total: int) -> int:
        return self.env_cfg.max_turns

    def subgoal_coef(self, step: int, total: int) -> float:
        """Linear decay to 0 at `subgoal_decay_share` of training, so the final objective is sparse."""
        if not self.cfg.subgoal_rewards:
            return 0.0
        share = self.cfg.subgoal_decay_share
        if share is None:
            return self.cfg.subgoal_coef
        progress = step / max(total, 1)
        return self.cfg.subgoal_coef * max(0.0, 1.0 - progress / share) if share > 0 else 0.0

    def observe(self, step: int, success_by_level: dict[str, tuple[float, float]]) -> None:
        """Global (wins, episodes) per level for this iteration."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def build_curriculum(cfg: Any) -> Curriculum:
    return Curriculum(cfg.curriculum, cfg.env)
