"""The environment contract every simulator speaks (household, alfworld, scienceworld, textworld).

An *episode* is specified by a `Task` (enough to rebuild exactly the same game: an id, a seed, a split).
An `Env` plays one episode at a time through text: `reset(task)` then `step(action)` until `done`.
An `EnvSuite` is what a config names (`env=household`): it checks its prerequisites, lists or samples
tasks per split and level, and builds `Env` instances (also inside worker processes, so it must pickle).

Info keys every env fills (others may add more):
    goal                 str        the task instruction ("put a clean apple in fridge.")
    admissible_commands  list[str]  actions the game accepts now (ALFWorld's term)
    won                  bool       the task is solved (the only source of task reward)
    lost                 bool       the episode failed for good (e.g. ScienceWorld's wrong `focus on`)
    task_type            str        e.g. "pick_and_place" or a ScienceWorld task name
    task_id              str
    subgoals             list[str]  progress events reached by this step (for intermediate rewards)
    progress             float      0..1, how much of the task is done (for intermediate rewards)
    expert_action        str | None the expert's next action from this state (behaviour cloning)
    expert_thought       str | None a short rationale for it, used inside <think>..</think>
Info keys of a step that ended an episode without a verdict (may be absent; absent means False/none):
    truncated            bool       the episode was cut short, neither won nor lost: the env's own turn cap
                                    (alfworld, scienceworld, textworld), or the env pool answering for a
                                    worker that crashed or hung (envs/pool.py, with `error`); the rollout's
                                    own turn limit (env.max_turns) needs neither
    error                str        why the pool cut it (with `truncated`: the rollout marks the episode crashed)
"""

from __future__ import annotations

import random
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One episode's specification; two envs reset with equal Tasks play the same game."""

    task_id: str
    task_type: str
    seed: int
    split: str = "train"
    level: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class StepResult:
    observation: str
    reward: float  # the env's own reward: 1.0 on success, 0 otherwise (scaled by the algorithm)
    done: bool
    info: dict[str, Any]


class Env(ABC):
    """A single text game. Not thread-safe; one per worker slot."""

    @abstractmethod
    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start `task`; return the first observation and the info dict (see module docstring)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one text action. Unknown/inadmissible actions are not errors: the game answers
        "Nothing happens." (ALFWorld convention) and the episode goes on."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release external resources (JVMs, game processes)."""


class EnvSuite(ABC):
    """A family of tasks behind one config option (`env=<name>`).

    Subclasses set `name` and `config_class` (a dataclass extending `EnvConfig` in epo_cli.config)
    and are registered in `epo_cli.envs.ENV_SUITES`. Constructing a suite must be cheap and must not
    import heavy optional packages; `check()` does the expensive validation. What curricula need to know
    about an env (its default levels, whether and when it reports subgoal events) comes from the suite
    too (`curriculum_levels()`, `reports_subgoals`, `check_subgoal_rewards()`), never from env names.
    """

    name: str = ""
    #: Names of the splits `sample_tasks` accepts. Conventional: train, eval_in_distribution,
    #: eval_out_of_distribution.
    splits: tuple[str, ...] = ("train", "eval_in_distribution", "eval_out_of_distribution")
    #: expert episodes played to train the tiny model's tokenizer on this env's text (slow envs: few)
    tokenizer_episodes: int = 8
    #: whether the envs report progress events in info["subgoals"] (curriculum.subgoal_rewards reads them)
    reports_subgoals: bool = True

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def check(self) -> None:  # noqa: B027 - optional hook, most suites need no check
        """Raise `epo_cli.errors.UserError` with the fix if the env cannot run here
        (missing data directory, Java missing, package not installed)."""

    @abstractmethod
    def make_env(self, reads_expert: bool = True) -> Env:
        """Build one environment instance. Called in worker processes too. `reads_expert=False`: the caller
        never reads info["expert_action"] (RL rollouts), so an env may skip computing it (`wants_expert`)."""

    def wants_expert(self, reads_expert: bool) -> bool:
        """Whether an env computes its expert: env.expert=true|false as given; null (the default, or a suite
        without the setting) where the caller reads it."""
        setting = getattr(self.cfg, "expert", None)
        return reads_expert if setting is None else bool(setting)

    @abstractmethod
    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        """Draw `n` tasks of `split` (optionally restricted to a curriculum level) using `rng` only,
        so the draw is reproducible. For evaluation splits callers pass a fixed-seed rng."""

    def levels(self) -> list[str]:
        """The suite's named levels from easiest to hardest (empty if the suite has none)."""
        return []

    def curriculum_levels(self) -> list[str]:
        """The levels a staged or adaptive curriculum climbs when `curriculum.levels` is empty, easiest
        first; each is a string `sample_tasks(..., level=...)` accepts. Empty: the suite has no sensible
        default, and the user must list them. Default: `levels()`."""
        return self.levels()

    def check_subgoal_rewards(self) -> None:
        """Called when `curriculum.subgoal_rewards` is on. Raise `epo_cli.errors.ConfigError` with the fix
        if this configuration hides events the env could report (e.g. a sparse reward setting); warn if the
        env reports none at all (`reports_subgoals` false), since the option then adds no reward."""
        if not self.reports_subgoals:
            warnings.warn(f"env={self.name} reports no subgoal events (info['subgoals'] is empty), so "
                          "curriculum.subgoal_rewards=true adds no reward there.", stacklevel=3)

    def versions(self) -> dict[str, str]:
        """Versions of the packages this env depends on, recorded in each run's config.yaml."""
        return {}
