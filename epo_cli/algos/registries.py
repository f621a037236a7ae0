"""The algorithm components a config can name, and everything config validation needs to know about each.

Every registry here is keyed by the names used in conf/; each built-in is declared below with its settings,
the keys it reads, its coefficient (loss terms: a function of the weights it names, `coef_weights`), the
algo.base values it is the `auto` estimator for, and its own cross-field checks. Their code registers itself
where it is written (`@LOSS_TERMS.implement(...)` in losses.py, advantages.py, aggregation.py). This module
imports no torch, so composing and validating a config (`epo config show`, a sweep's parent process, the
launchers) never loads it.

    ESTIMATORS     algo.estimator          advantages.py
    LOSS_TERMS     algo.loss_terms         losses.py
    POLICY_LOSSES  algo.policy_loss        losses.py (the module in the policy_clip slot)
    KL_ESTIMATORS  algo.kl.estimator       losses.py
    ENTROPY_MODES  algo.entropy.mode       the aggregation each mode uses (a value: nothing to implement)
    AGGREGATIONS   *.aggregation           aggregation.py
    GROUP_FILTERS  algo.group_filter       group_filter.py (the groups dynamic sampling keeps)
The schedules (SCHEDULES, KL_SCHEDULES) and the weights a loss term's coefficient may read (WEIGHTS: lambda,
beta_k, the KL weight) live in schedules.py, which needs no torch either.

A component's `check(cfg)` runs at compose time whenever the config names it (after algo.estimator=auto is
resolved); the rules of a whole section (e.g. entropy.min_coef <= max_coef) stay in epo_cli/compose/.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from epo_cli.algos.schedules import WEIGHTS, build_phase_schedule
from epo_cli.config import (
    EntropyTermConfig,
    GAEConfig,
    GiGPOConfig,
    GRPOConfig,
    KLConfig,
    PolicyClipConfig,
    SmoothingConfig,
    ValueConfig,
    is_sft,
)
from epo_cli.errors import ConfigError
from epo_cli.registry import Registry

#: algo.estimator -> fn(batch, *settings, all_reduce_sum=None) -> (advantages [N], returns [N])
ESTIMATORS = Registry("advantage estimator", root="algo")
#: algo.loss_terms -> fn(*its settings) -> LossTerm
LOSS_TERMS = Registry("loss term", root="algo")
#: algo.policy_loss -> fn(PolicyClipConfig) -> the module in the `policy_clip` slot of the loss stack
POLICY_LOSSES = Registry("policy loss", root="algo")
#: algo.kl.estimator -> fn(log_ratio [B, R]) -> per-token KL(p || ref) [B, R]
KL_ESTIMATORS = Registry("KL estimator")
#: algo.entropy.mode -> the aggregation of L_H
ENTROPY_MODES = Registry("entropy mode")
#: aggregation mode -> Aggregation (how per-token values become one number)
AGGREGATIONS = Registry("aggregation")
#: algo.group_filter -> fn(one round's group stats, keep share) -> [(group id, passes)]
GROUP_FILTERS = Registry("group filter", root="algo")


def own_coef(settings: Any) -> float:
    """The coefficient of a term declared without one (Entry.coef None): its own settings' `coef`."""
    return settings.coef


def coef_weights(coef: Callable[..., float] | None) -> tuple[str, ...]:
    """What a loss term's coefficient (Entry.coef) reads: its parameters' names, each one of lam (lambda, the
    entropy group's schedule), beta (beta_k, algo.phase's), kl (the KL weight, algo.kl.schedule) and settings
    (the term's own settings). The loss (losses.loss_coefficients) calls it with them, and compose reads them
    to tell which schedules a run uses."""
    if isinstance(coef, str):  # the string products ("-lambda", "lambda*beta") of earlier versions
        raise ValueError(f"a loss term's coef is a function of the weights it reads, not a string: for "
                         f"coef='{coef}' write e.g. coef=lambda lam, beta: lam * beta (weights: lam, beta, kl)")
    names = tuple(inspect.signature(coef or own_coef).parameters)
    unknown = [n for n in names if n not in (*WEIGHTS, "settings")]
    if unknown:
        raise ValueError(f"a loss term's coef takes {', '.join(unknown)}, which is not a weight; its parameters "
                         f"are named after what it reads: {', '.join(WEIGHTS)} or settings")
    return names


# ----------------------------------------------------------------------------------------------------
# Advantage estimators
# ----------------------------------------------------------------------------------------------------

def _needs_groups(cfg: Any) -> None:
    algo = cfg.algo
    if algo.group_size < 2:
        raise ConfigError(f"algo.estimator={algo.estimator} compares rollouts of the same task and needs "
                          f"algo.group_size >= 2 (got {algo.group_size}).")


# gae trains a critic: its value loss settings (algo.value) are read only with it
ESTIMATORS.declare("gae", config=GAEConfig, sections=("gae",), reads=("algo.gae", "algo.value"), auto_for=("ppo",))
ESTIMATORS.declare("grpo", config=GRPOConfig, sections=("grpo",), auto_for=("grpo",), check=_needs_groups)
ESTIMATORS.declare("rloo", sections=(), check=_needs_groups)
# its episode-level advantage is GRPO's, with algo.grpo's settings
ESTIMATORS.declare("gigpo", config=GiGPOConfig, sections=("gigpo", "grpo"), auto_for=("gigpo",), check=_needs_groups)


# ----------------------------------------------------------------------------------------------------
# Loss terms: L = L_RL - lambda * (L_H - beta_k * L_smooth) + kl_weight * KL (+ nll, + registered terms)
# Each term's coefficient is a function of the weights it names (`coef_weights`); none: its settings' coef.
# ----------------------------------------------------------------------------------------------------

def _value_needs_a_critic(cfg: Any) -> None:
    if cfg.algo.estimator != "gae":
        raise ConfigError(f"algo.loss_terms has 'value' but algo.estimator={cfg.algo.estimator} trains no critic "
                          "(only gae does): remove 'value' from algo.loss_terms or set algo.estimator=gae.")


def _policy_clip_needs_advantages(cfg: Any) -> None:
    if cfg.algo.estimator == "none":
        raise ConfigError("algo.loss_terms has 'policy_clip' but algo.estimator=none computes no advantages: "
                          "set algo.estimator (gae, grpo, ...) or remove 'policy_clip'.")


def _not_on_demonstrations(term: str, what: str) -> Any:
    """A term that reads what only an RL step computes (`what`) cannot train behaviour cloning."""

    def check(cfg: Any) -> None:
        if is_sft(cfg.algo):
            raise ConfigError(f"algo.loss_terms has '{term}' but algo.base=none trains by behaviour cloning, which "
                              f"computes no {what}: remove '{term}', or give the algorithm an RL base.")

    return check


def _smoothing_band(cfg: Any) -> None:
    """The band must be a band; and warn when alpha * max(beta_k) >= 1. Above the band the objective's
    gradient in H is lambda * (1 - beta_k * alpha): below 1 the smoothing only damps the entropy bonus there
    (the regime EPO's analysis assumes); at or above 1 it outweighs the bonus and pushes entropy down."""
    _not_on_demonstrations("entropy_smoothing", "entropy history")(cfg)
    sm = cfg.algo.entropy_smoothing
    if sm.kappa_low >= sm.kappa_high:
        raise ConfigError(f"The smoothing band needs algo.entropy_smoothing.kappa_low < kappa_high (got "
                          f"{sm.kappa_low:g} and {sm.kappa_high:g}); the paper uses 0.0 and 2.0.")
    beta_max = build_phase_schedule(cfg.algo.phase).max_value(cfg.trainer.total_steps)
    if sm.alpha * beta_max >= 1.0:
        warnings.warn(f"algo.entropy_smoothing.alpha * max beta_k = {sm.alpha} * {beta_max:g} >= 1: above the "
                      "band the smoothing penalty outweighs the entropy bonus and drives entropy down (EPO's "
                      "analysis assumes alpha * beta_max < 1; the paper uses alpha = 0.1).", stacklevel=2)


# policy_clip's settings are those of the policy loss algo.policy_loss names (POLICY_LOSSES below)
LOSS_TERMS.declare("policy_clip", config=PolicyClipConfig, sections=("policy_clip", "policy_loss"),
                   reads=("algo.policy_loss",), coef=lambda: 1.0, check=_policy_clip_needs_advantages)
# the critic's loss, weighted by algo.value.coef (its own settings' coef)
LOSS_TERMS.declare("value", config=ValueConfig, sections=("value",), check=_value_needs_a_critic)
# L_H is positive: the minus makes it a bonus
LOSS_TERMS.declare("entropy", config=EntropyTermConfig, sections=("entropy",), reads=("algo.entropy.mode",),
                   coef=lambda lam: -lam)
LOSS_TERMS.declare("entropy_smoothing", config=SmoothingConfig, sections=("entropy_smoothing",),
                   coef=lambda lam, beta: lam * beta, check=_smoothing_band)
LOSS_TERMS.declare("kl", config=KLConfig, sections=("kl",), reads=("algo.kl.estimator", "algo.kl.aggregation"),
                   coef=lambda kl: kl, check=_not_on_demonstrations("kl", "reference log-probs"))
LOSS_TERMS.declare("nll", sections=("nll_aggregation",), coef=lambda: 1.0)


def check_some_loss_term(cfg: Any) -> None:
    """algo.loss_terms names at least one of the terms above (compose runs this with the sections' rules)."""
    algo = cfg.algo
    if not algo.loss_terms:
        raise ConfigError("algo.loss_terms is empty: the policy would have no loss to train on. Give at least one "
                          f"term, e.g. algo.loss_terms=[{'nll' if is_sft(algo) else 'policy_clip'}] (terms: "
                          f"{', '.join(LOSS_TERMS.names())}).")


# ----------------------------------------------------------------------------------------------------
# Policy losses (the module in the policy_clip slot), KL estimators, entropy modes, aggregations
# ----------------------------------------------------------------------------------------------------

def _in_the_policy_clip_slot(cfg: Any) -> None:
    algo = cfg.algo
    if "policy_clip" not in algo.loss_terms:
        raise ConfigError(f"algo.policy_loss={algo.policy_loss} replaces the policy_clip term, which is not in "
                          f"algo.loss_terms {list(algo.loss_terms)}; add it or leave algo.policy_loss=clip.")


def _clip_cov_range(cfg: Any) -> None:
    _in_the_policy_clip_slot(cfg)
    pc = cfg.algo.policy_clip
    if pc.clip_cov_lb >= pc.clip_cov_ub:
        raise ConfigError(f"algo.policy_clip.clip_cov_lb ({pc.clip_cov_lb}) must be < clip_cov_ub ({pc.clip_cov_ub}).")


def _kl_cov_has_no_clip(cfg: Any) -> None:
    _in_the_policy_clip_slot(cfg)
    warnings.warn("algo.policy_loss=kl_cov has no ratio clip (its KL penalty on the high-covariance tokens takes "
                  "the clip's place): algo.policy_clip.clip_low, clip_high and dual_clip are not used.", stacklevel=2)


def _policy_clip_keys(*names: str) -> tuple[str, ...]:
    return tuple(f"algo.policy_clip.{name}" for name in names)


# all three read algo.policy_clip; each only its own keys of it
_CLIP = ("clip_low", "clip_high", "dual_clip", "aggregation")
POLICY_LOSSES.declare("clip", config=PolicyClipConfig, sections=("policy_clip",), reads=_policy_clip_keys(*_CLIP))
POLICY_LOSSES.declare("clip_cov", config=PolicyClipConfig, sections=("policy_clip",), check=_clip_cov_range,
                      reads=_policy_clip_keys(*_CLIP, "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
POLICY_LOSSES.declare("kl_cov", config=PolicyClipConfig, sections=("policy_clip",), check=_kl_cov_has_no_clip,
                      reads=_policy_clip_keys("aggregation", "kl_cov_ratio", "ppo_kl_coef"))

for _name in ("k1", "k2", "k3", "low_var_kl"):  # low_var_kl is k3 (verl's name)
    KL_ESTIMATORS.declare(_name)

ENTROPY_MODES.register("token_mean", "token-mean")  # verl's entropy bonus
ENTROPY_MODES.register("trajectory", "trajectory")  # EPO Eq. 2: tokens -> turns -> trajectories
ENTROPY_MODES.register("turn_decay", "turn-decay", reads=("algo.turn_decay",))  # turn t weighs decay^t

for _name in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "trajectory"):
    AGGREGATIONS.declare(_name)
AGGREGATIONS.declare("turn-decay", reads=("algo.turn_decay",))


# ----------------------------------------------------------------------------------------------------
# Group filters: the groups algo.dynamic_sampling keeps (the rest are replaced by fresh rounds)
# ----------------------------------------------------------------------------------------------------

def _signal_needs_group_advantages(cfg: Any) -> None:
    algo = cfg.algo
    if algo.dynamic_sampling and algo.estimator == "gae":
        raise ConfigError("algo.dynamic_sampling=true with algo.group_filter=signal keeps the groups the estimator "
                          "gives a non-zero advantage, but gae has no groups: its advantages come from the critic "
                          "and are non-zero for every group. Use algo.group_filter=top_variance (return variance), "
                          "a group estimator (grpo, rloo, gigpo), or algo.dynamic_sampling=false.")


def _filters_nothing(cfg: Any) -> None:
    if cfg.algo.dynamic_sampling:
        warnings.warn("algo.dynamic_sampling=true with algo.group_filter=none: no group is ever dropped, so no "
                      "round is ever replayed (no effect).", stacklevel=2)


GROUP_FILTERS.declare("signal", reads=(), check=_signal_needs_group_advantages)
GROUP_FILTERS.declare("top_variance", reads=("algo.group_filter_keep",))
GROUP_FILTERS.declare("none", reads=(), check=_filters_nothing)
