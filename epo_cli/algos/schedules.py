"""Schedules: coefficient = schedule(step, total_steps), one registry for every coefficient.

progress p = step / total_steps, clamped to [0, 1]; `total_steps` is always the run's own total
(trainer.total_steps), never a hard-coded number (the public EPO code hard-coded 150).

Every schedule is a dataclass of its parameters registered in SCHEDULES; its fields are its settings. A
coefficient's config section names the schedule (`schedule: ...`) and holds its parameters, under the
schedule's field names or the section's own names for them (the `*_KEYS` maps below):

    entropy coefficient lambda   entropy group (EntropyConfig)     build_entropy_schedule   ENTROPY_KEYS
    EPO phase weight beta_k      algo.phase (PhaseConfig)          build_phase_schedule     PHASE_KEYS
    KL weight                    algo.kl.schedule (KL_SCHEDULES)   build_kl_schedule
    learning-rate multiplier     algo.warmup_ratio, min_lr_ratio   build_lr_schedule        (warmup_cosine)

A section can use every schedule whose parameters it has (`usable_schedules`); config validation checks
that, builds the schedules the run uses (a schedule's __post_init__ checks its own parameters) and reads
their `max_value` (e.g. max beta_k for EPO's smoothing check), so a new schedule is one registered dataclass here.

Every schedule has observe(entropy) and state_dict()/load_state_dict() (JSON-serialisable); they are
no-ops except for the stateful adaptive_target, so the training loop can treat all of them alike. This
module imports no torch (config validation reads it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

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
    value: float

    def max_value(self, total_steps: int) -> float:
        return self.value

    def __call__(self, step: int, total_steps: int) -> float:
        return self.value


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
        p, share = progress(step, total_steps), self.exploration_share
        if p < share:
            return 0.0
        if share >= 1.0:
            return self.start
        return self.start + (self.end - self.start) * (p - share) / (1.0 - share)

    def max_value(self, total_steps: int) -> float:
        return max(self.start, self.end, 0.0)


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
# Where each coefficient's schedule finds its parameters
# ----------------------------------------------------------------------------------------------------

#: entropy group: schedule parameter -> its key there (the others under their own names)
ENTROPY_KEYS = {"value": "coef"}
#: algo.phase: schedule parameter -> its key there
PHASE_KEYS = {"start": "beta_start", "peak": "beta_peak", "end": "beta_end"}
#: algo.kl.schedule -> (schedule, algo section of its parameters, parameter -> key there)
KL_SCHEDULES = Registry("KL schedule")
KL_SCHEDULES.register("constant", ("constant", "kl", {"value": "coef"}))
# the KL ramp of algo.phase: 0 while exploring, then kl_start -> kl_end
KL_SCHEDULES.register("two_phase", ("delayed_linear", "phase", {"start": "kl_start", "end": "kl_end"}))


def coefficient_schedule(factor: str, cfg: Any) -> tuple[str, str, str, dict[str, str]]:
    """Where a loss coefficient's schedule is read (a factor of a loss term's coefficient, Entry.coef):
    (the key naming the schedule, the schedule, the section holding its parameters, parameter -> key there).
    lambda is the entropy group's schedule, beta algo.phase's, kl the one algo.kl.schedule names."""
    if factor == "lambda":
        return "entropy.schedule", cfg.entropy.schedule, "entropy", ENTROPY_KEYS
    if factor == "beta":
        return "algo.phase.schedule", cfg.algo.phase.schedule, "algo.phase", PHASE_KEYS
    if factor == "kl":
        name, section, keys = KL_SCHEDULES[cfg.algo.kl.schedule]
        return "algo.kl.schedule", name, f"algo.{section}", keys
    raise ValueError(f"no schedule for the coefficient factor '{factor}'")


def parameter_keys(name: str, keys: dict[str, str] | None = None) -> dict[str, str]:
    """Schedule `name`'s parameters -> the section keys they are read from."""
    keys = keys or {}
    return {f.name: keys.get(f.name, f.name) for f in fields(SCHEDULES.config_class(name))}


def usable_schedules(section_keys: list[str], keys: dict[str, str] | None = None) -> list[str]:
    """The schedules whose every parameter a section with these keys holds."""
    return [n for n in SCHEDULES.names() if set(parameter_keys(n, keys).values()) <= set(section_keys)]


def build_schedule(name: str, section: Any, keys: dict[str, str] | None = None) -> Schedule:
    """Schedule `name` with its parameters read from `section` (a config node or dataclass)."""
    return SCHEDULES.build(name, **{p: getattr(section, k) for p, k in parameter_keys(name, keys).items()})


def build_entropy_schedule(cfg: Any) -> Schedule:
    """lambda, from the entropy group (EntropyConfig)."""
    return build_schedule(cfg.schedule, cfg, ENTROPY_KEYS)


def build_phase_schedule(cfg: Any) -> Schedule:
    """beta_k, from algo.phase (PhaseConfig)."""
    return build_schedule(cfg.schedule, cfg, PHASE_KEYS)


def build_kl_schedule(algo: Any) -> Schedule:
    """The KL weight, from algo.kl.schedule: kl.coef (constant), or algo.phase's two-phase KL ramp itself
    (not multiplied by coef)."""
    name, section, keys = KL_SCHEDULES[algo.kl.schedule]
    return build_schedule(name, getattr(algo, section), keys)


def build_lr_schedule(algo: Any) -> Schedule:
    """The learning-rate multiplier, from algo.warmup_ratio and algo.min_lr_ratio."""
    return build_schedule("warmup_cosine", algo)
