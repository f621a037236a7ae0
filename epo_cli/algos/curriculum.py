"""Curricula: which tasks each iteration trains on, the turn limit, and intermediate rewards.

The training loop asks its curriculum, every iteration:
    sample_tasks(suite, n, rng, step, total)  -> the iteration's tasks (levels chosen by the curriculum)
    max_turns(step, total)                    -> the turn limit (horizon curricula grow it)
    subgoal_coef(step, total)                 -> weight of intermediate rewards (0 = sparse reward only)
and reports back the iteration's true task success per level with `observe(...)` (identical on all
ranks: the statistics are all-reduced first). State survives checkpoints via state_dict().

Options (`curriculum=<name>`, conf/curriculum/<name>.yaml):
    none             tasks of the configured env (or a fixed uniform mix of `curriculum.levels` if given)
    staged           one level at a time, easiest first; promote when the success over the last `window`
                     iterations at the current level reaches `promote_at`, optionally demote below
                     `demote_at`; a `replay_share` of each batch replays earlier levels
    adaptive         every level each iteration, sampled by a score: learning progress (|change in
                     success| between the last two windows) or closeness of success to 0.5 (4p(1-p)),
                     mixed with a uniform `exploration_floor`
    horizon          the turn limit grows linearly from `start_turns` to env.max_turns over `horizon_share`
                     of training (same as `curriculum.horizon=true`, which combines with staged/adaptive)
    subgoal_rewards  sparse task reward plus intermediate rewards (same as `curriculum.subgoal_rewards=true`,
                     which combines with every option above)

What a level means is the env suite's business: the curriculum passes each level string to
`suite.sample_tasks(split, n, rng, level=...)`, and with `curriculum.levels` empty staged and adaptive climb
`suite.curriculum_levels()` (each suite documents its levels there and in its module). Suites that leave
Task.level unset get it set to the level string here, so that the trainer's per-level success
(curriculum/level_success/<level>) comes back under the curriculum's names. Subgoal rewards ask the suite
too (`suite.check_subgoal_rewards()`: an error with the fix, or a warning where the env reports no events).

Each option is registered in `CURRICULA` (an epo_cli.registry.Registry) with its settings dataclass: the
fields it reads from the flat `curriculum` section (conf/curriculum/none.yaml holds every key with its
default). Their ranges and valid values are CurriculumConfig's, checked by `check_curriculum` both when a
config is composed and when a curriculum is built, so the two never disagree.

Metrics (logged after each iteration's `observe`, i.e. the state the next iteration draws from):
curriculum/level (staged: the stage index; adaptive and mixtures: the expected index under the weights),
curriculum/weight/<level>; staged adds curriculum/window_success, window_fill, promotions, demotions;
adaptive adds curriculum/score/<level>. The trainer logs curriculum/level_success/<level> (true task success
per level), rollout/max_turns and rollout/subgoal_coef.

Every decision is a function of the global statistics passed to `observe` and of the rng the trainer seeds
identically on all ranks, so every rank holds the same state; the state is JSON (state_dict()).
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from omegaconf import OmegaConf

from epo_cli.config import CurriculumConfig, check_field_rules
from epo_cli.envs import make_suite
from epo_cli.envs.base import EnvSuite, Task
from epo_cli.envs.household import LEVEL_BY_NAME, resolve_task_types
from epo_cli.errors import ConfigError, UserError
from epo_cli.registry import Registry

#: `curriculum=<name>` -> (settings dataclass, Curriculum class); config validation reads its names()
CURRICULA = Registry("curriculum")

Stats = tuple[float, float]  # (wins, episodes)


def _rate(entries: Sequence[Sequence[float]]) -> float:
    """Episode-weighted success over iterations: sum of wins / sum of episodes."""
    episodes = sum(e for _, e in entries)
    return sum(w for w, _ in entries) / episodes if episodes > 0 else 0.0


def check_curriculum(section: Any, max_turns: int | None = None) -> None:
    """The curriculum section's rules, from one source: the ranges and values CurriculumConfig declares on its
    fields (the same check compose runs on every section), and the two rules that span keys. compose calls it
    on the composed section; each curriculum's settings call it on theirs (a curriculum built in code is held
    to the same rules). `max_turns`: env.max_turns, for the horizon's start."""
    values = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else OmegaConf.to_container(section)
    node = OmegaConf.merge(OmegaConf.structured(CurriculumConfig), values)
    check_field_rules(node, CurriculumConfig, "curriculum.", registries={"curricula": CURRICULA.names()})
    if node.demote_at is not None and node.demote_at >= node.promote_at:
        raise ConfigError(f"curriculum.demote_at={node.demote_at:g} must be below curriculum.promote_at="
                          f"{node.promote_at:g} (else a level is promoted and demoted at once).")
    if max_turns is not None and (node.horizon or node.name == "horizon") and node.start_turns > max_turns:
        raise ConfigError(f"curriculum.start_turns={node.start_turns} is above env.max_turns={max_turns}: the "
                          "horizon would shrink, not grow. Lower start_turns.")


#: the fewest turns that can win a household task of each type, by the rules (the agent starts at no receptacle;
#: `go to` the object's place, `take` it, transform it or not, `go to` the destination, `move` it there):
#: pick_and_place 4; look_at_obj_in_light 3 (the lamp may stand where the object lies); clean/heat/cool 5 (the
#: object may lie in the sink, microwave or fridge); pick_two 6 (two takes and two moves, with two `go to`s at
#: least). Lower bounds: the expert's shortest wins on 1200 generated tasks each are 4, 3, 5, 6, 6 and 8.
HOUSEHOLD_MIN_TURNS = {"pick_and_place": 4, "look_at_obj_in_light": 3, "pick_clean_then_place": 5,
                       "pick_heat_then_place": 5, "pick_cool_then_place": 5, "pick_two_obj_and_place": 6}


def check_levels_fit(cfg: Any) -> None:
    """A household level none of whose tasks can be won within env.max_turns trains on nothing but failures
    (every episode is truncated, every reward 0): one warning naming the level and the turns it needs (a
    warning, not an error: a pipeline check with a few turns is such a run on purpose). Checked for env.level,
    algo.demo_level and the curriculum's levels (curriculum=staged|adaptive)."""
    if cfg.env.name != "household":
        return
    named = [("env.level", cfg.env.level)]
    if cfg.algo.demo_level:
        named.append(("algo.demo_level", cfg.algo.demo_level))
    if cfg.curriculum.name in ("staged", "adaptive"):
        named += [("curriculum.levels", level) for level in cfg.curriculum.levels]
    short = {}  # level -> (the keys that name it, the turns its shortest win takes)
    for key, level in named:
        if level not in LEVEL_BY_NAME:
            continue  # the env's own check names the valid levels
        types = resolve_task_types(list(cfg.env.task_types)) or LEVEL_BY_NAME[level].task_types
        need = min(HOUSEHOLD_MIN_TURNS.get(t, 1) for t in types)
        if cfg.env.max_turns < need:
            short.setdefault(level, ([], need))[0].append(key)
    if short:
        levels = ", ".join(f"'{level}' ({', '.join(keys)}: its shortest win takes {need} turns)"
                           for level, (keys, need) in short.items())
        most = max(need for _, need in short.values())
        warnings.warn(f"env.max_turns={cfg.env.max_turns} is too few for every task of the household level"
                      f"{'s' if len(short) > 1 else ''} {levels}, so every episode there ends unsolved and nothing "
                      f"can be learned. Raise env.max_turns (at least {most}; the expert's median is about 8).",
                      stacklevel=4)


_S = TypeVar("_S", bound="CommonCurriculumConfig")


@dataclass(frozen=True)
class CommonCurriculumConfig:
    """What every curriculum reads: the growing turn limit and the subgoal rewards, which any option
    combines with (`curriculum.horizon=true`, `curriculum.subgoal_rewards=true`). Their rules are
    CurriculumConfig's (check_curriculum)."""

    horizon: bool
    start_turns: int
    horizon_share: float
    subgoal_rewards: bool
    subgoal_coef: float
    subgoal_decay_share: float | None

    @classmethod
    def of(cls: type[_S], section: Any) -> _S:
        """This class's fields, read by name from the flat `curriculum` section (CurriculumConfig or yaml)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})

    def __post_init__(self) -> None:
        check_curriculum(self)


@dataclass(frozen=True)
class StagedCurriculumConfig(CommonCurriculumConfig):
    """curriculum=staged: promotion window and thresholds, and the replay share of earlier levels."""

    window: int
    promote_at: float
    demote_at: float | None
    replay_share: float


@dataclass(frozen=True)
class AdaptiveCurriculumConfig(CommonCurriculumConfig):
    """curriculum=adaptive: the score's window and signal, and the uniform exploration floor."""

    window: int
    adaptive_signal: str
    exploration_floor: float


def _own_keys(settings: type) -> tuple[str, ...]:
    """The curriculum keys only this option reads (for the "no effect" warnings): its settings beyond the
    ones every curriculum shares (those are gated by curriculum.horizon / subgoal_rewards)."""
    shared = {f.name for f in dataclasses.fields(CommonCurriculumConfig)}
    return tuple(f"curriculum.{f.name}" for f in dataclasses.fields(settings) if f.name not in shared)


# `horizon` and `subgoal_rewards` are `none` with a flag turned on by their yaml
@CURRICULA.register("none", config=CommonCurriculumConfig, reads=())
@CURRICULA.register("horizon", config=CommonCurriculumConfig, reads=())
@CURRICULA.register("subgoal_rewards", config=CommonCurriculumConfig, reads=())
class Curriculum:
    """`curriculum=none` (and the base of the others): tasks of the configured env, fixed turn limit,
    optional subgoal rewards. With `curriculum.levels` set it draws every task from a uniform mix of them."""

    name = "none"
    settings_class: type[CommonCurriculumConfig] = CommonCurriculumConfig
    #: staged/adaptive need levels: with curriculum.levels empty they take the suite's curriculum_levels()
    needs_levels = False

    def __init__(self, section: Any, env_section: Any, levels: Sequence[str] = ()) -> None:
        """section: the curriculum's config section (read once into its frozen settings); env_section: the
        env's, of which only the train split and the turn limit are kept."""
        self.settings = self.settings_class.of(section)
        self.train_split: str = env_section.train_split
        self.env_max_turns: int = int(env_section.max_turns)
        self.levels = [str(level).strip() for level in levels]
        dupes = sorted({lv for lv in self.levels if self.levels.count(lv) > 1})
        if dupes:
            raise ConfigError(f"curriculum.levels lists {dupes} more than once; each level must appear once.")
        check_curriculum(self.settings, self.env_max_turns)
        if self.needs_levels and not self.levels:
            raise ConfigError(f"curriculum={self.name} needs at least one level (curriculum.levels).")
        self._levels_checked = False  # checked against the suite on the first draw (not state: cheap to redo)

    # -- what the trainer calls ------------------------------------------------------------------------------
    def sample_tasks(self, suite: EnvSuite, n: int, rng: random.Random, step: int, total: int) -> list[Task]:
        if not self.levels:
            return suite.sample_tasks(self.train_split, n, rng)
        return self._draw(suite, self._choose_levels(n, rng), rng)

    def max_turns(self, step: int, total: int) -> int:
        """With `curriculum.horizon` on, the turn limit grows linearly from start_turns (step 0) to
        env.max_turns (at horizon_share of training), rounded to the nearest turn: short episodes first, so
        the early, mostly random policy gets its (rare) successes from short solutions and the rollout
        costs less while little is learned. Otherwise env.max_turns."""
        start, end = self.settings.start_turns, self.env_max_turns
        if not self.settings.horizon:
            return end
        span = self.settings.horizon_share * total
        progress = 1.0 if span <= 0 else min(1.0, step / span)
        return int(math.floor(start + (end - start) * progress + 0.5))

    def subgoal_coef(self, step: int, total: int) -> float:
        """Linear decay to 0 at `subgoal_decay_share` of training, so the final objective is sparse."""
        if not self.settings.subgoal_rewards:
            return 0.0
        share = self.settings.subgoal_decay_share
        if share is None:
            return self.settings.subgoal_coef
        progress = step / max(total, 1)
        return self.settings.subgoal_coef * max(0.0, 1.0 - progress / share) if share > 0 else 0.0

    def observe(self, step: int, success_by_level: dict[str, Stats]) -> None:
        """Global (wins, episodes) per level for this iteration (levels not in the list are ignored)."""

    def metrics(self) -> dict[str, float]:
        if not self.levels:
            return {}
        weights = self.level_weights()
        out = {f"curriculum/weight/{lv}": w for lv, w in zip(self.levels, weights)}
        out["curriculum/level"] = self.level_index()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "levels": list(self.levels)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a checkpoint from before curricula kept state
            return
        # names compare by the class they build: `horizon` and `subgoal_rewards` are flags on `none` (a
        # checkpoint of a horizon run from before that change says "horizon")
        saved_name = state.get("name", self.name)
        same_kind = saved_name in CURRICULA and CURRICULA.entry(saved_name).build is type(self)
        if state.get("levels", self.levels) != self.levels or not same_kind:
            raise UserError(
                f"The checkpoint's curriculum ({state.get('name')}, levels {state.get('levels')}) differs "
                f"from the configured one ({self.name}, levels {self.levels}); resume with the same "
                "curriculum settings, or start a new run from the exported model (model.path=<run>/final).")

    # -- level mixture -------------------------------------------------------------------------------------
    def level_weights(self) -> list[float]:
        """Probability of each level for the next draw."""
        return [1.0 / len(self.levels)] * len(self.levels) if self.levels else []

    def level_index(self) -> float:
        """curriculum/level: the expected level index of the next draw (the index itself for staged)."""
        return sum(i * w for i, w in enumerate(self.level_weights()))

    def _choose_levels(self, n: int, rng: random.Random) -> list[int]:
        """Level index of each of the n task slots, drawn independently from level_weights()."""
        cumulative, acc = [], 0.0
        for w in self.level_weights():
            acc += w
            cumulative.append(acc)
        out = []
        for _ in range(n):
            u = rng.random() * acc
            out.append(next((i for i, c in enumerate(cumulative) if u < c), len(cumulative) - 1))
        return out

    def _draw(self, suite: EnvSuite, slots: list[int], rng: random.Random) -> list[Task]:
        """Tasks for the given level index per slot: one suite call per level (in level order, so the draw
        depends on the rng only), then placed back in slot order."""
        self._check_levels(suite)
        drawn: dict[int, list[Task]] = {}
        for i, level in enumerate(self.levels):
            count = slots.count(i)
            if count:
                tasks = suite.sample_tasks(self.train_split, count, rng, level=level)
                # suites whose levels are task types leave Task.level unset: tag it so per-level success
                # comes back under the curriculum's names
                drawn[i] = [t if t.level is not None else dataclasses.replace(t, level=level) for t in tasks]
        return [drawn[i].pop(0) for i in slots]

    def _check_levels(self, suite: EnvSuite) -> None:
        """Every level must be one the suite can draw from: fail at the first iteration, not at promotion."""
        if self._levels_checked:
            return
        for level in self.levels:
            try:
                (task,) = suite.sample_tasks(self.train_split, 1, random.Random(0), level=level)
            except UserError as err:
                raise ConfigError(f"curriculum level '{level}' is not valid for env={suite.name}: {err}") \
                    from None
            if task.level is not None and task.level != level:
                raise ConfigError(f"env={suite.name} reports level '{task.level}' for curriculum level "
                                  f"'{level}'; write the level exactly as the env names it.")
        self._levels_checked = True


@CURRICULA.register("staged", config=StagedCurriculumConfig, reads=_own_keys(StagedCurriculumConfig))
class StagedCurriculum(Curriculum):
    """One level at a time, easiest first, with promotion, optional demotion and replay of earlier levels.

    Promotion/demotion look at the current level's success over its last `window` iterations (episode-
    weighted); the window restarts at every level change, so each decision rests on `window` fresh
    iterations. Replay: each iteration replays floor(replay_share * n + u) tasks (u ~ U[0,1) from the
    trainer's rng, so the expected share is exactly replay_share), each from an earlier level chosen
    uniformly; replayed episodes do not count towards promotion.
    """

    name = "staged"
    settings_class = StagedCurriculumConfig
    needs_levels = True

    def __init__(self, section: Any, env_section: Any, levels: Sequence[str] = ()) -> None:
        super().__init__(section, env_section, levels)
        self.stage = 0
        self.window: list[list[float]] = []  # [wins, episodes] of the current level, one entry per iteration
        self.promotions = 0
        self.demotions = 0
        self.last_success: dict[str, float] = {}

    def level_weights(self) -> list[float]:
        weights = [0.0] * len(self.levels)
        replay = self.settings.replay_share if self.stage > 0 else 0.0
        weights[self.stage] = 1.0 - replay
        for i in range(self.stage):
            weights[i] = replay / self.stage
        return weights

    def level_index(self) -> float:
        return float(self.stage)

    def _choose_levels(self, n: int, rng: random.Random) -> list[int]:
        slots = [self.stage] * n
        if self.stage > 0 and self.settings.replay_share > 0:
            k = min(n, math.floor(self.settings.replay_share * n + rng.random()))
            for pos in rng.sample(range(n), k):
                slots[pos] = rng.randrange(self.stage)
        return slots

    def observe(self, step: int, success_by_level: dict[str, Stats]) -> None:
        for level, (wins, episodes) in success_by_level.items():
            if episodes > 0 and level in self.levels:
                self.last_success[level] = wins / episodes
        wins, episodes = success_by_level.get(self.levels[self.stage], (0.0, 0.0))
        if episodes <= 0:  # only replay this iteration (possible for tiny batches): nothing to judge
            return
        self.window = [*self.window, [float(wins), float(episodes)]][-self.settings.window:]
        if len(self.window) < self.settings.window:
            return
        success = _rate(self.window)
        if success >= self.settings.promote_at and self.stage < len(self.levels) - 1:
            self.stage, self.window, self.promotions = self.stage + 1, [], self.promotions + 1
        elif self.settings.demote_at is not None and success < self.settings.demote_at and self.stage > 0:
            self.stage, self.window, self.demotions = self.stage - 1, [], self.demotions + 1

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({
            "curriculum/promotions": float(self.promotions),
            "curriculum/demotions": float(self.demotions),
            "curriculum/window_fill": float(len(self.window)),
        })
        if self.window:
            out["curriculum/window_success"] = _rate(self.window)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "stage": self.stage, "window": [list(e) for e in self.window],
                "promotions": self.promotions, "demotions": self.demotions,
                "last_success": dict(self.last_success)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if not state:
            return
        self.stage = int(state["stage"])
        self.window = [[float(w), float(e)] for w, e in state["window"]]
        self.promotions, self.demotions = int(state["promotions"]), int(state["demotions"])
        self.last_success = {str(k): float(v) for k, v in state.get("last_success", {}).items()}


@CURRICULA.register("adaptive", config=AdaptiveCurriculumConfig, reads=_own_keys(AdaptiveCurriculumConfig))
class AdaptiveCurriculum(Curriculum):
    """Every level is drawn each iteration with probability

        w_i = floor / L + (1 - floor) * s_i / sum_j s_j          (uniform if all s_j = 0)

    where s_i is the level's score from its last 2*window iterations in which it was played:
        progress   s = |success(last window) - success(the window before)|: the absolute learning progress
                   (Matiisen et al. 2017; Portelas et al. 2020); with fewer than 2*window entries the history
                   is split in two halves (older/newer);
        closeness  s = 4 p (1 - p), p = success over the last window: 1 at p = 0.5, 0 at p = 0 or 1. GRPO
                   learns only from groups with mixed outcomes, which are likeliest at p = 0.5.
    A level without enough history (progress: < 2 entries, closeness: none) scores 1, the highest score,
    so every level gets measured early; `exploration_floor` keeps every level in play afterwards.
    """

    name = "adaptive"
    settings_class = AdaptiveCurriculumConfig
    needs_levels = True

    def __init__(self, section: Any, env_section: Any, levels: Sequence[str] = ()) -> None:
        super().__init__(section, env_section, levels)
        #: per level: [wins, episodes] of the iterations it was played in, the last 2*window of them
        self.history: dict[str, list[list[float]]] = {lv: [] for lv in self.levels}
        self.weights = self._weights()

    def score(self, level: str) -> float | None:
        """The level's score, or None while its history is too short to tell."""
        h, window = self.history[level], self.settings.window
        if self.settings.adaptive_signal == "closeness":
            if not h:
                return None
            p = _rate(h[-window:])
            return 4.0 * p * (1.0 - p)
        if len(h) < 2:
            return None
        half = len(h) // 2 if len(h) < 2 * window else window
        return abs(_rate(h[-half:]) - _rate(h[:-half][-half:]))

    def _weights(self) -> list[float]:
        scores = [self.score(lv) for lv in self.levels]
        scores = [1.0 if s is None else s for s in scores]
        total, floor, k = sum(scores), self.settings.exploration_floor, len(self.levels)
        if total <= 0:
            return [1.0 / k] * k
        return [floor / k + (1.0 - floor) * s / total for s in scores]

    def level_weights(self) -> list[float]:
        return list(self.weights)

    def observe(self, step: int, success_by_level: dict[str, Stats]) -> None:
        for level, (wins, episodes) in success_by_level.items():
            if episodes > 0 and level in self.history:
                entries = [*self.history[level], [float(wins), float(episodes)]]
                self.history[level] = entries[-2 * self.settings.window:]
        self.weights = self._weights()

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        for level in self.levels:
            s = self.score(level)
            if s is not None:
                out[f"curriculum/score/{level}"] = s
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "history": {k: [list(e) for e in v] for k, v in self.history.items()},
                "weights": list(self.weights)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if not state:
            return
        saved = state["history"]
        self.history = {lv: [[float(w), float(e)] for w, e in saved.get(lv, [])] for lv in self.levels}
        self.weights = [float(w) for w in state["weights"]]


def build_curriculum(cfg: Any, suite: EnvSuite | None = None) -> Curriculum:
    """The curriculum named by cfg.curriculum.name; `suite` supplies default levels and checks subgoal
    rewards (built from cfg.env if not given: cheap, suites do their expensive work in check())."""
    ccfg, env_cfg = cfg.curriculum, cfg.env
    entry = CURRICULA.entry(ccfg.name)
    levels = list(ccfg.levels or [])
    needs_levels = not levels and entry.build.needs_levels
    if suite is None and (needs_levels or ccfg.subgoal_rewards):
        suite = make_suite(env_cfg)
    if needs_levels:
        levels = list(suite.curriculum_levels())
        if not levels:
            raise ConfigError(f"curriculum={ccfg.name} needs levels and env={env_cfg.name} defines none. "
                              "Fix: set curriculum.levels=[...] (easiest first).")
    if ccfg.subgoal_rewards:
        suite.check_subgoal_rewards()
    return entry.build(ccfg, env_cfg, levels)
