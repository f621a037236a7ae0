"""Schedules: coefficient = schedule(step, total_steps), one registry for every coefficient.

progress p = step / total_steps, clamped to [0, 1]; `total_steps` is always the run's own total
(trainer.total_steps), never a hard-coded number (the public EPO code hard-coded 150).

Every schedule is a dataclass of its parameters registered in SCHEDULES; its fields are its settings, and a
config section that holds a schedule's parameters holds them under those same names:

    entropy coefficient lambda   entropy group (EntropyConfig)     build_entropy_schedule   coef, start, end, ...
    EPO phase weight beta_k      algo.phase (PhaseConfig)          build_phase_schedule     gamma, coef, start, ...
    KL weight                    algo.kl.schedule (KL_SCHEDULES)   build_kl_schedule        algo.kl.coef, or
                                                                                            algo.phase.kl_start, ...
    learning-rate multiplier     algo.warmup_ratio, min_lr_ratio   build_lr_schedule        (warmup_cosine)

A section can use every schedule whose parameters it has (`Weight.choices`); config validation checks
that, builds the schedules the run uses (a schedule's __post_init__ checks its own parameters) and reads
their `max_value` (e.g. max beta_k for EPO's smoothing check), so a new schedule is one registered dataclass here.
The KL weight's schedules are a registry of their own (KL_SCHEDULES): each entry says which algo section
holds its parameters (`sections`), since the source article's KL ramp is set next to beta_k's, in algo.phase.

Every schedule has observe(entropy) and state_dict()/load_state_dict() (JSON-serialisable); they are
no-ops except for the stateful adaptive_target, so the training loop can treat all of them alike. This
module imports no torch (config validation reads it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from epo_cli.config import EnvConfig, schema_at
from epo_cli.registry import Registry

#: schedule name -> its dataclass (fields = parameters)
SCHEDULES = Registry("schedule")


def progress(step: int, total_steps: int) -> float:
    return min(max(step / max(total_steps, 1), 0.0), 1.0)


def _two_phase(p: float, share: float, start: float, peak: float, end: float) -> float:
    """Piecewise linear: start -> peak over [0, share], then peak -> end over [share, 1]."""
    if p < share:
        return start + (peak - start) * p / share
    if share >= 1.0:
        return peak
    return peak + (end - peak) * (p - share) / (1.0 - share)


class Schedule:
    """Base: a pure function of (step, total_steps) with no state."""

    def __call__(self, step: int, total_steps: int) -> float:
        raise NotImplementedError

    def observe(self, entropy: float) -> None:
        """Feedback after an RL step (only adaptive schedules use it)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def max_value(self, total_steps: int) -> float:
        """The largest value over a run of `total_steps` steps. Built-ins give it in closed form; this default
        evaluates the schedule at every step (a stateful schedule must override it)."""
        return max(self(step, total_steps) for step in range(total_steps + 1))


def _register(name: str) -> Any:
    """Register a schedule dataclass under `name`; its fields are its parameters."""

    def add(cls: type) -> type:
        cls = dataclass(cls)
        return SCHEDULES.register(name, config=cls)(cls)

    return add


@_register("constant")
class Constant(Schedule):
    coef: float

    def max_value(self, total_steps: int) -> float:
        return self.coef

    def __call__(self, step: int, total_steps: int) -> float:
        return self.coef


@_register("linear")
class Linear(Schedule):
    """start + (end - start) * p."""

    start: float
    end: float

    def __call__(self, step: int, total_steps: int) -> float:
        return self.start + (self.end - self.start) * progress(step, total_steps)

    def max_value(self, total_steps: int) -> float:
        return max(self.start, self.end)


@_register("cosine")
class Cosine(Schedule):
    """Half cosine: end + (start - end) * (1 + cos(pi p)) / 2."""

    start: float
    end: float

    def __call__(self, step: int, total_steps: int) -> float:
        p = progress(step, total_steps)
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * p))

    def max_value(self, total_steps: int) -> float:
        return max(self.start, self.end)


@_register("exp_anneal")
class ExpAnneal(Schedule):
    """max(start * decay_rate ** p, end): exponential annealing with a floor."""

    start: float
    decay_rate: float
    end: float

    def __call__(self, step: int, total_steps: int) -> float:
        return max(self.start * self.decay_rate ** progress(step, total_steps), self.end)

    def max_value(self, total_steps: int) -> float:
        return max(self.start, self.end)  # decay_rate <= 1: it falls from start


@_register("two_phase")
class TwoPhase(Schedule):
    """Source article: start -> peak over the first `exploration_share` of training, then peak -> end."""

    start: float
    peak: float
    end: float
    exploration_share: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.exploration_share <= 1.0:
            raise ValueError(f"exploration_share must be in [0, 1] (got {self.exploration_share})")

    def __call__(self, step: int, total_steps: int) -> float:
        return _two_phase(progress(step, total_steps), self.exploration_share, self.start, self.peak, self.end)

    def max_value(self, total_steps: int) -> float:
        return max(self.start, self.peak, self.end)


@_register("delayed_linear")
class DelayedLinear(Schedule):
    """Source article's KL weight: 0 while p < exploration_share, then start -> end linearly.

    At p = exploration_share exactly the second phase has begun (weight `start`).
    """

    start: float
    end: float
    exploration_share: float

    def __call__(self, step: int, total_steps: int) -> float:
        return _delayed_linear(progress(step, total_steps), self.exploration_share, self.start, self.end)

    def max_value(self, total_steps: int) -> float:
        return max(self.start, self.end, 0.0)


def _delayed_linear(p: float, share: float, start: float, end: float) -> float:
    """0 while p < share, then start -> end linearly over [share, 1]."""
    if p < share:
        return 0.0
    if share >= 1.0:
        return start
    return start + (end - start) * (p - share) / (1.0 - share)


@_register("adaptive_target")
class AdaptiveTarget(Schedule):
    """Keeps the entropy near a target by feedback (like SAC's temperature tuning, multiplicative):

        after each step: coef <- clip(coef * exp(adapt_lr * (target - H) / target), min_coef, max_coef)

    Entropy below target raises lambda, above lowers it. A coef of exactly 0 stays 0 (multiplicative):
    start from a positive coef.
    """

    coef: float
    target: float
    adapt_lr: float
    min_coef: float
    max_coef: float

    def __post_init__(self) -> None:
        if self.target <= 0:
            raise ValueError(f"adaptive_target needs target > 0 (got {self.target})")

    def __call__(self, step: int, total_steps: int) -> float:
        return self.coef

    def observe(self, entropy: float) -> None:
        step = self.adapt_lr * (self.target - entropy) / self.target
        self.coef = min(max(self.coef * math.exp(step), self.min_coef), self.max_coef)

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])

    def max_value(self, total_steps: int) -> float:
        return max(self.coef, self.max_coef)  # feedback may drive it up to max_coef


@_register("paper")
class PaperPhase(Schedule):
    """EPO adaptive phase weight: beta_k = 1 + exp(-gamma * k / floor(K/2)), K = the run's total steps.

    beta_0 = 2; with gamma = 3, beta_{K/2} = 1 + e^-3 ~ 1.05 and beta_K = 1 + e^-6 ~ 1.0025.
    """

    gamma: float

    def __call__(self, step: int, total_steps: int) -> float:
        half = max(total_steps // 2, 1)  # K = 1 would give floor(K/2) = 0
        return 1.0 + math.exp(-self.gamma * step / half)

    def max_value(self, total_steps: int) -> float:
        return 2.0  # beta_0 = 1 + exp(0)


@_register("warmup_cosine")
class WarmupCosine(Schedule):
    """Learning-rate multiplier: linear warm-up over W = ceil(warmup_ratio * total) steps ((step+1)/W),
    then cosine 1 -> min_lr_ratio, reaching min_lr_ratio at the last step (total - 1)."""

    warmup_ratio: float
    min_lr_ratio: float

    def __call__(self, step: int, total_steps: int) -> float:
        # round first: 0.07 * 100 = 7.000000000000001 would otherwise give W = 8
        warmup = math.ceil(round(self.warmup_ratio * total_steps, 9))
        if step < warmup:
            return (step + 1) / warmup
        decay_steps = total_steps - 1 - warmup
        p = min(max((step - warmup) / decay_steps, 0.0), 1.0) if decay_steps > 0 else 1.0
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    def max_value(self, total_steps: int) -> float:
        return 1.0


# ----------------------------------------------------------------------------------------------------
# The KL weight's schedules; the weights of the loss; building a schedule from its section
# ----------------------------------------------------------------------------------------------------

@dataclass
class KLRamp(Schedule):
    """The source article's KL weight, set in algo.phase next to its beta_k: 0 while p < exploration_share,
    then kl_start -> kl_end linearly (delayed_linear, under algo.phase's names for it)."""

    kl_start: float
    kl_end: float
    exploration_share: float

    def __call__(self, step: int, total_steps: int) -> float:
        return _delayed_linear(progress(step, total_steps), self.exploration_share, self.kl_start, self.kl_end)

    def max_value(self, total_steps: int) -> float:
        return max(self.kl_start, self.kl_end, 0.0)


#: algo.kl.schedule -> the schedule of the KL weight; `sections`: the algo section that holds its parameters
KL_SCHEDULES = Registry("KL schedule", root="algo")
KL_SCHEDULES.register("constant", Constant, config=Constant, sections=("kl",))  # algo.kl.coef
KL_SCHEDULES.register("phase_kl_ramp", KLRamp, config=KLRamp, sections=("phase",))  # algo.phase's KL ramp


def schedule_parameters(name: str, registry: Registry = SCHEDULES) -> list[str]:
    """Schedule `name`'s parameters: its dataclass's fields, which are the keys it reads in its section."""
    return [f.name for f in fields(registry.config_class(name))]


def section_keys(section: str) -> list[str]:
    """The keys of a schema section outside env (e.g. 'algo.phase')."""
    schema = schema_at(section, EnvConfig)
    return [f.name for f in fields(schema)] if schema is not None else []


@dataclass(frozen=True)
class Weight:
    """A weight a loss term's coefficient may read: `key` names its schedule, a name in `registry`."""

    symbol: str  # in messages
    key: str
    registry: Registry

    def section(self, name: str) -> str:
        """The section that holds schedule `name`'s parameters: the key's own, unless its registry entry names
        one (a KL schedule's `sections`)."""
        sections = self.registry.entry(name).sections
        return f"{self.registry.root}.{sections[0]}" if sections else self.key.rpartition(".")[0]

    def choices(self) -> list[str]:
        """The schedules `key` can name: those whose every parameter their section has a key for."""
        return [name for name in self.registry.names()
                if set(schedule_parameters(name, self.registry)) <= set(section_keys(self.section(name)))]


#: the weights a loss term's coefficient may read, by the names of its parameters (Entry.coef; besides
#: `settings`, the term's own): lambda (the entropy group), beta_k (algo.phase), the KL weight (algo.kl.schedule)
WEIGHTS = {"lam": Weight("lambda", "entropy.schedule", SCHEDULES),
           "beta": Weight("beta", "algo.phase.schedule", SCHEDULES),
           "kl": Weight("kl", "algo.kl.schedule", KL_SCHEDULES)}


def build_schedule(name: str, section: Any, registry: Registry = SCHEDULES) -> Schedule:
    """Schedule `name` with its parameters read from `section` (a config node or dataclass)."""
    return registry.build(name, **{p: getattr(section, p) for p in schedule_parameters(name, registry)})


def build_entropy_schedule(cfg: Any) -> Schedule:
    """lambda, from the entropy group (EntropyConfig)."""
    return build_schedule(cfg.schedule, cfg)


def build_phase_schedule(cfg: Any) -> Schedule:
    """beta_k, from algo.phase (PhaseConfig)."""
    return build_schedule(cfg.schedule, cfg)


def build_kl_schedule(algo: Any) -> Schedule:
    """The KL weight, from algo.kl.schedule: algo.kl.coef (constant), or algo.phase's KL ramp (phase_kl_ramp)."""
    section = KL_SCHEDULES.entry(algo.kl.schedule).sections[0]
    return build_schedule(algo.kl.schedule, getattr(algo, section), KL_SCHEDULES)


def build_lr_schedule(algo: Any) -> Schedule:
    """The learning-rate multiplier, from algo.warmup_ratio and algo.min_lr_ratio."""
    return build_schedule("warmup_cosine", algo)
