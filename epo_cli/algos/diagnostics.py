"""Collapse diagnostics: the math of the collapse/* signals (values in, numbers out; the training loop
gathers the inputs and all-reduces the sums, epo_cli/training/collapse.py).

Entropy alone does not show a collapse: a policy can keep its entropy while its responses stop depending on
what it sees ("template collapse", RAGEN-2, arXiv 2604.06268), and groups whose rollouts all scored the same
feed the regularisers nothing but their own pull. Each function returns sums and counts, so that a value
over all ranks is sum(sums) / sum(counts).

    cross_prompt_mi     collapse/mi: how much responses depend on their prompt (nats per token)
    group_return_std    collapse/reward_std, collapse/zero_std_groups: the spread of returns in each group
    advantage_signal    collapse/adv_signal_share: the share of turn-samples with a non-zero advantage
    corridor_counts     collapse/corridor_above|below[_turn/<t>]: samples outside EPO's band
    state_diversity     collapse/state_diversity: distinct actions taken from one state within a group
    collapse_reasons    the `collapse` alert: which signals are beyond their thresholds
    alert_crossings     ... and which crossed into it this step (the alert fires on those)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from epo_cli.algos.group_filter import SIGNAL_TOL


def cross_prompt_mi(logp: Tensor, lengths: Tensor) -> float:
    """Cross-prompt estimate of the mutual information between prompts and responses, per token.

    logp [m, m] float64: logp[i, j] = log p(y_i | x_j), the log-probability of response i (all its tokens)
    after prompt j, for m turn-samples (x_i, y_i) of one policy. lengths [m]: |y_i| in tokens.

        MI = sum_i [ log p(y_i | x_i) - log( mean_{j != i} p(y_i | x_j) ) ] / sum_i |y_i|

    The mean over the OTHER prompts of the subsample stands in for the marginal p(y_i). A policy that answers
    the same whatever it sees has p(y_i | x_j) = p(y_i | x_i) for every j: MI = 0. (Per sample the term can be
    negative; the sum over samples is >= 0 in expectation.)
    """
    m = logp.shape[0]
    if m < 2:
        raise ValueError(f"cross_prompt_mi needs at least 2 samples (got {m})")
    lp = logp.double()
    off = ~torch.eye(m, dtype=torch.bool)  # [m, m]
    others = torch.where(off, lp, torch.full_like(lp, -math.inf))  # [m, m]
    log_marginal = torch.logsumexp(others, dim=1) - math.log(m - 1)  # [m]
    return float((lp.diagonal() - log_marginal).sum() / lengths.double().sum().clamp(min=1.0))


def group_return_std(returns: Iterable[tuple[int, float]], tol: float = SIGNAL_TOL) -> tuple[float, int, int]:
    """(sum over groups of the population std of their trajectories' returns, groups, groups whose std <= tol).

    returns: (group id, return of one trajectory) for every trajectory."""
    by_group: dict[int, list[float]] = {}
    for g, ret in returns:
        by_group.setdefault(g, []).append(ret)
    total, zero = 0.0, 0
    for xs in by_group.values():
        mean = math.fsum(xs) / len(xs)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
        total += std
        zero += std <= tol
    return total, len(by_group), zero


def advantage_signal(advantages: Tensor, tol: float = SIGNAL_TOL) -> tuple[int, int]:
    """(turn-samples with |A| > tol, turn-samples). The rest only feed the KL and entropy terms."""
    return int((advantages.abs() > tol).sum()), int(advantages.numel())


def corridor_counts(entropy: list[Tensor], turn_index: Tensor, href: Tensor, kappa_low: float, kappa_high: float,
                    max_turns: int) -> Tensor:
    """Per turn index t: [samples, samples above the band, samples below it] ([max_turns, 3] float64).

    A sample's entropy is the mean over its response tokens; EPO's band at its turn is
    [kappa_low x Href, kappa_high x Href] (href [N]: the reference of each sample's turn, NaN while there is no
    history: those samples are counted in no row). Samples without response tokens are left out."""
    out = torch.zeros(max_turns, 3, dtype=torch.float64)
    for e, t, h in zip(entropy, turn_index.tolist(), href.tolist()):
        if e.numel() == 0 or math.isnan(h) or not 0 <= t < max_turns:
            continue
        mean = float(e.double().mean())
        out[t, 0] += 1
        out[t, 1] += mean > kappa_high * h
        out[t, 2] += mean < kappa_low * h
    return out


def state_diversity(visits: Iterable[tuple[int, Any, str]]) -> tuple[float, int]:
    """(sum over shared states of (distinct actions - 1) / (turns - 1), shared states).

    visits: (group id, state key, action) for every turn. A shared state is one a group's turns reached at
    least twice (several rollouts of the task, or one coming back). Its diversity is 0 when every visit took
    the same action and 1 when every visit took a different one, whatever the number of visits. Actions are
    compared lower-cased with whitespace collapsed."""
    actions: dict[tuple[int, Any], list[str]] = {}
    for g, state, action in visits:
        actions.setdefault((g, state), []).append(" ".join(action.lower().split()))
    total, shared = 0.0, 0
    for acts in actions.values():
        if len(acts) < 2:
            continue
        total += (len(set(acts)) - 1) / (len(acts) - 1)
        shared += 1
    return total, shared


#: the signals the collapse alert watches, each with its threshold in algo.diagnostics
ALERT_SIGNALS = {"entropy_low": "alert_entropy_low", "entropy_high": "alert_entropy_high", "mi": "alert_mi",
                 "diversity": "alert_diversity"}


def collapse_reasons(metrics: Mapping[str, float], settings: Any) -> dict[str, str]:
    """The signals beyond their thresholds in this step's metrics, each with why (empty: none), from
    algo.diagnostics' thresholds (null: that check is off):

        entropy_low, entropy_high  policy/entropy < alert_entropy_low x Href or > alert_entropy_high x Href
                                   (Href = policy/entropy_ref, the mean of the past steps' entropies: EPO's
                                   reference)
        mi                         collapse/mi < alert_mi (only in steps that measured it)
        diversity                  collapse/state_diversity < alert_diversity
    """
    reasons = {}
    h, ref = metrics.get("policy/entropy"), metrics.get("policy/entropy_ref")
    if h is not None and ref is not None and ref > 0:
        if settings.alert_entropy_low is not None and h < settings.alert_entropy_low * ref:
            reasons["entropy_low"] = f"entropy {h:.4g} < {settings.alert_entropy_low:g} x its reference {ref:.4g}"
        if settings.alert_entropy_high is not None and h > settings.alert_entropy_high * ref:
            reasons["entropy_high"] = f"entropy {h:.4g} > {settings.alert_entropy_high:g} x its reference {ref:.4g}"
    mi = metrics.get("collapse/mi")
    if mi is not None and settings.alert_mi is not None and mi < settings.alert_mi:
        reasons["mi"] = f"MI {mi:.4g} < {settings.alert_mi:g} nats/token (responses stop depending on prompts)"
    div = metrics.get("collapse/state_diversity")
    if div is not None and settings.alert_diversity is not None and div < settings.alert_diversity:
        reasons["diversity"] = f"state diversity {div:.4g} < {settings.alert_diversity:g}"
    return reasons


def measured_signals(metrics: Mapping[str, float], settings: Any) -> set[str]:
    """The alert's signals this step's metrics measure, among those whose threshold is on (MI: only the
    steps that measure it; entropy: once a reference exists)."""
    present = {"entropy_low": metrics.get("policy/entropy") is not None and
               (metrics.get("policy/entropy_ref") or 0) > 0,
               "mi": metrics.get("collapse/mi") is not None,
               "diversity": metrics.get("collapse/state_diversity") is not None}
    present["entropy_high"] = present["entropy_low"]
    return {s for s, key in ALERT_SIGNALS.items() if present[s] and getattr(settings, key) is not None}


def alert_crossings(beyond_before: Iterable[str], reasons: Mapping[str, str], measured: set[str],
                    settings: Any) -> tuple[list[str], list[str]]:
    """(the signals beyond their thresholds after this step, those that crossed into it this step), sorted.

    The alert fires on a crossing, not on every step a signal stays beyond: in a long run whose entropy falls
    for good, `entropy_low` fires once. A signal this step does not measure (MI between its measurements)
    keeps its last verdict; one whose threshold is off is dropped. `reasons`: collapse_reasons of the step."""
    on = {s for s, key in ALERT_SIGNALS.items() if getattr(settings, key) is not None}
    before = set(beyond_before) & on
    now = (before - measured) | set(reasons)
    return sorted(now), sorted(set(reasons) - before)
