"""Schedules: coefficient = schedule(step, total_steps).

progress p = step / total_steps, clamped to [0, 1]; `total_steps` is always the run's own total
(trainer.total_steps), never a hard-coded number (the public EPO code hard-coded 150).

    entropy coefficient lambda (EntropyConfig)   ENTROPY_SCHEDULES, build_entropy_schedule
    EPO phase weight beta_k (PhaseConfig)        PHASE_SCHEDULES, build_phase_schedule
    KL weight                                    kl_coefficient, two_phase_kl_weight
    learning rate                                lr_multiplier

Every schedule has observe(entropy) and state_dict()/load_state_dict() (JSON-serialisable); they are
no-ops except for the stateful adaptive_target, so the training loop can treat all of them alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from epo_cli.config import EntropyConfig, KLConfig, PhaseConfig


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


class Constant(Schedule):
    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, step: int, total_steps: int) -> float:
        return self.value


class Linear(Schedule):
    """start + (end - start) * p."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def __call__(self, step: int, total_steps: int) -> float:
        return self.start + (self.end - self.start) * progress(step, total_steps)


class Cosine(Schedule):
    """Half cosine: end + (start - end) * (1 + cos(pi p)) / 2."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def __call__(self, step: int, total_steps: int) -> float:
        p = progress(step, total_steps)
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * p))


class ExpAnneal(Schedule):
    """max(start * decay_rate ** p, end): exponential annealing with a floor."""

    def __init__(self, start: float, decay_rate: float, end: float) -> None:
        self.start, self.decay_rate, self.end = start, decay_rate, end

    def __call__(self, step: int, total_steps: int) -> float:
        return max(self.start * self.decay_rate ** progress(step, total_steps), self.end)


class TwoPhase(Schedule):
    """Source article: start -> peak over the first `share` of training (exploration), then peak -> end."""

    def __init__(self, start: float, peak: float, end: float, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"exploration_share must be in [0, 1] (got {share})")
        self.start, self.peak, self.end, self.share = start, peak, end, share

    def __call__(self, step: int, total_steps: int) -> float:
        return _two_phase(progress(step, total_steps), self.share, self.start, self.peak, self.end)


class AdaptiveTarget(Schedule):
    """Keeps the entropy near a target by feedback (like SAC's temperature tuning, multiplicative):

        after each step: coef <- clip(coef * exp(adapt_lr * (target - H) / target), min_coef, max_coef)

    Entropy below target raises lambda, above lowers it. A coef of exactly 0 stays 0 (multiplicative):
    start from a positive coef.
    """

    def __init__(self, coef: float, target: float, adapt_lr: float, min_coef: float, max_coef: float) -> None:
        if target <= 0:
            raise ValueError(f"adaptive_target needs target > 0 (got {target})")
        self.coef, self.target, self.adapt_lr = coef, target, adapt_lr
        self.min_coef, self.max_coef = min_coef, max_coef

    def __call__(self, step: int, total_steps: int) -> float:
        return self.coef

    def observe(self, entropy: float) -> None:
        step = self.adapt_lr * (self.target - entropy) / self.target
        self.coef = min(max(self.coef * math.exp(step), self.min_coef), self.max_coef)

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])


ENTROPY_SCHEDULES: dict[str, Callable[[EntropyConfig], Schedule]] = {
    "constant": lambda c: Constant(c.coef),
    "linear": lambda c: Linear(c.start, c.end),
    "cosine": lambda c: Cosine(c.start, c.end),
    "exp_anneal": lambda c: ExpAnneal(c.start, c.decay_rate, c.end),
    "two_phase": lambda c: TwoPhase(c.start, c.peak, c.end, c.exploration_share),
    "adaptive_target": lambda c: AdaptiveTarget(c.coef, c.target, c.adapt_lr, c.min_coef, c.max_coef),
}


def build_entropy_schedule(cfg: EntropyConfig) -> Schedule:
    if cfg.schedule not in ENTROPY_SCHEDULES:
        raise KeyError(f"unknown entropy schedule '{cfg.schedule}'; valid: {', '.join(ENTROPY_SCHEDULES)}")
    return ENTROPY_SCHEDULES[cfg.schedule](cfg)


class PaperPhase(Schedule):
    """EPO adaptive phase weight: beta_k = 1 + exp(-gamma * k / floor(K/2)), K = the run's total steps.

    beta_0 = 2; with gamma = 3, beta_{K/2} = 1 + e^-3 ~ 1.05 and beta_K = 1 + e^-6 ~ 1.0025.
    """

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def __call__(self, step: int, total_steps: int) -> float:
        half = max(total_steps // 2, 1)  # K = 1 would give floor(K/2) = 0
        return 1.0 + math.exp(-self.gamma * step / half)


PHASE_SCHEDULES: dict[str, Callable[[PhaseConfig], Schedule]] = {
    "paper": lambda c: PaperPhase(c.gamma),
    "constant": lambda c: Constant(c.value),
    "two_phase": lambda c: TwoPhase(c.beta_start, c.beta_peak, c.beta_end, c.exploration_share),
}


def build_phase_schedule(cfg: PhaseConfig) -> Schedule:
    if cfg.schedule not in PHASE_SCHEDULES:
        raise KeyError(f"unknown phase schedule '{cfg.schedule}'; valid: {', '.join(PHASE_SCHEDULES)}")
    return PHASE_SCHEDULES[cfg.schedule](cfg)


def two_phase_kl_weight(step: int, total_steps: int, cfg: PhaseConfig) -> float:
    """Source article: KL weight 0 while p < exploration_share, then kl_start -> kl_end linearly.

    At p = exploration_share exactly the second phase has begun (weight kl_start).
    """
    p, share = progress(step, total_steps), cfg.exploration_share
    if p < share:
        return 0.0
    if share >= 1.0:
        return cfg.kl_start
    return cfg.kl_start + (cfg.kl_end - cfg.kl_start) * (p - share) / (1.0 - share)


def kl_coefficient(step: int, total_steps: int, kl: KLConfig, phase: PhaseConfig) -> float:
    """KL term coefficient: kl.coef (constant), or the two-phase weight itself (not multiplied by coef)."""
    if kl.schedule == "constant":
        return kl.coef
    if kl.schedule == "two_phase":
        return two_phase_kl_weight(step, total_steps, phase)
    raise KeyError(f"unknown KL schedule '{kl.schedule}' (constant | two_phase)")


def lr_multiplier(step: int, total_steps: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warm-up over W = ceil(warmup_ratio * total) steps ((step+1)/W), then cosine 1 -> min_ratio,
    reaching min_ratio at the last step (total - 1)."""
    # round first: 0.07 * 100 = 7.000000000000001 would otherwise give W = 8
    warmup = math.ceil(round(warmup_ratio * total_steps, 9))
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = total_steps - 1 - warmup
    p = min(max((step - warmup) / decay_steps, 0.0), 1.0) if decay_steps > 0 else 1.0
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
