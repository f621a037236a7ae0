"""Loss terms of the policy update, and how they are combined (EPO objective).

Every term is an nn.Module: forward(mb, out) -> (loss, metrics). A term computes a per-token quantity
x [B, R] and returns sum(w * x) with w = mb.weights[aggregation] [B, R], the token weights already
divided by the mini-batch denominator (see aggregation.py). So summing a term over the micro-batches and
ranks of a mini-batch gives the mini-batch aggregate; its metrics use the same weights, sum the same
way, and are detached.

    policy_clip        PPO clipped surrogate (+ dual clip)                      -> loss/policy_clip
                       or, by algo.policy_loss, Clip-Cov / KL-Cov (arXiv 2505.22617) in its place
    value              clipped critic regression (applied to the critic)        -> loss/value
    entropy            L_H, POSITIVE (the coefficient -lambda carries the sign) -> loss/entropy
    entropy_smoothing  EPO hinge band around the historical entropy             -> loss/entropy_smoothing
    kl                 KL to the frozen reference (k1 | k2 | k3 = low_var_kl)   -> loss/kl
    nll                behaviour cloning, -log p                                 -> loss/nll

EPO objective (arXiv 2509.22576):  L = L_RL - lambda * (L_H - beta_k * L_smooth) + kl_coef * KL,
i.e. coefficients policy_clip 1, entropy -lambda, entropy_smoothing +lambda*beta_k, kl kl_coef
(`loss_coefficients`).

Every term is declared in LOSS_TERMS (epo_cli/algos/registries.py) under its conf/ name (algo.loss_terms)
with its settings, the algo keys they are read from and its coefficient (a function of the weights it
names: `coef=lambda lam, beta: lam * beta`), and implemented here (`@LOSS_TERMS.implement`);
`build_loss_term` and `loss_coefficients` read the registry, so there is no list of names to keep in step.
A term from elsewhere registers itself with its own settings dataclass; its settings are then
algo.components.<name> and its coefficient their `coef` unless it gives one (tests/test_registry.py shows one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from epo_cli.algos.aggregation import weighted_sum
from epo_cli.algos.cov_selection import (
    SelectionRule,
    TokenSelector,
    micro_batch_rows,
    select_tokens,
    selection_mask,
)
from epo_cli.algos.registries import ENTROPY_MODES, KL_ESTIMATORS, LOSS_TERMS, POLICY_LOSSES, coef_weights, own_coef
from epo_cli.config import (
    EntropyTermConfig,
    KLConfig,
    PolicyClipConfig,
    SmoothingConfig,
    ValueConfig,
)
from epo_cli.rollout.batch import MicroBatch


@dataclass
class PolicyOutputs:
    """What the current policy (and critic) say about a micro-batch."""

    logprobs: Tensor  # [B, R] log p(y_i | ...) of the response tokens
    entropy: Tensor  # [B, R] entropy of the full next-token distribution, at the sampling temperature
    values: Tensor | None = None  # [B] critic values (value term only)
    #: log pi_theta - log pi_old of the response tokens, set by the update beside the forward
    #: (PolicyUpdate.train_micro_batch); exp() of it is every policy term's ratio
    log_ratio: Tensor | None = None  # [B, R]


def _weights(mb: MicroBatch, mode: str) -> Tensor:
    if mode not in mb.weights:
        raise KeyError(f"micro-batch has no '{mode}' weights (has: {', '.join(mb.weights) or 'none'})")
    return mb.weights[mode]  # [B, R]


def _require(value: Tensor | None, what: str, term: str) -> Tensor:
    if value is None:
        raise ValueError(f"loss term '{term}' needs {what}, which this micro-batch does not have")
    return value


def _behaviour_corrected(pg: Tensor, mb: MicroBatch) -> Tensor:
    """The per-token policy loss [B, R] times the rollout correction's fixed weights (truncated importance
    weights and/or the sequence mask, epo_cli/algos/rollout_correction.py), where the update set them."""
    return pg if mb.correction is None else pg * mb.correction


class LossTerm(nn.Module):
    """Base class. Subclasses set `name` and `aggregation` and implement forward."""

    name: str = ""
    aggregation: str = "token-mean"

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError


class PolicyClipLoss(LossTerm):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347) with the dual clip for
    negative advantages (Ye et al. 2020, arXiv 1912.09729).

        ratio = exp(logp - old_logp)
        pg    = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        pg    = min(pg, -A * c)            where A < 0 (dual clip c > 1 bounds the loss of a huge ratio)
    """

    name = "policy_clip"

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = 3.0,
        aggregation: str = "token-mean",
    ) -> None:
        super().__init__()
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (got {dual_clip})")
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip
        self.aggregation = aggregation

    def surrogate(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """Per-token clipped surrogate [B, R], which tokens any clip bounds [B, R] bool, the token
        weights [B, R] and the detached diagnostics (without the loss value)."""
        w = _weights(mb, self.aggregation)  # [B, R]
        log_ratio = _require(out.log_ratio, "the log-ratio to the old policy", self.name)  # [B, R]
        pg, pg1, pg2, dual_active, ratio = self._clipped(mb, log_ratio)  # [B, R] each
        with torch.no_grad():
            metrics = {
                "policy/clipfrac": weighted_sum(w, (pg2 > pg1).float()),
                "policy/dual_clipfrac": weighted_sum(w, dual_active.float()),
                # k3 estimator of KL(old || new) (Schulman's blog; cleanrl's approx_kl)
                "policy/approx_kl": weighted_sum(w, (ratio - 1.0) - log_ratio),
            }
        return _behaviour_corrected(pg, mb), (pg2 > pg1) | dual_active, w, metrics

    def _clipped(self, mb: MicroBatch, log_ratio: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(pg, pg1, pg2, dual_active, ratio), each [B, R], for the log-ratio [B, R] to the old policy."""
        adv = _require(mb.advantages, "advantages", self.name)[:, None]  # [B, 1]
        ratio = torch.exp(log_ratio)  # [B, R]
        pg1 = -adv * ratio  # [B, R]
        pg2 = -adv * torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)  # [B, R]
        pg = torch.maximum(pg1, pg2)  # [B, R]
        dual_active = torch.zeros_like(pg, dtype=torch.bool)  # [B, R]
        if self.dual_clip is not None:
            pg3 = -adv * self.dual_clip  # [B, 1]
            dual_active = (adv < 0) & (pg > pg3)
            pg = torch.where(dual_active, pg3.expand_as(pg), pg)
        return pg, pg1, pg2, dual_active, ratio

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        pg, _, w, metrics = self.surrogate(mb, out)  # [B, R], _, [B, R]
        loss = weighted_sum(w, pg)
        return loss, {"loss/policy_clip": loss.detach(), **metrics}


def _choose_within(selector: TokenSelector, mb: MicroBatch, logprobs: Tensor, seed: int) -> Tensor:
    """The selector's tokens chosen within this micro-batch alone (it is the whole mini-batch: unit use, or
    a caller that chose nothing over the mini-batch). [B, R] bool"""
    rows = micro_batch_rows(selector, mb, logprobs, [(0, i) for i in range(mb.response_mask.shape[0])])
    return selection_mask(dict(enumerate(select_tokens(rows, selector.selection_rule(), seed))),
                          list(range(len(rows))), mb.response_mask)


class ClipCovLoss(PolicyClipLoss):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617, Sec. 4.2;
    hyperparameter names and defaults from verl's `clip_cov`).

        cov_i     = (A_i - mean A) * (logp_i - mean logp)            over the mini-batch's real tokens
        candidates: real tokens not already clipped by the PPO clip with clip_cov_lb < cov_i < clip_cov_ub
        selected  = clip_cov_ratio x the mini-batch's real tokens (in expectation), drawn uniformly at random
                    among the candidates (epo_cli/algos/cov_selection.py: chosen over the whole mini-batch,
                    all micro-batches and ranks; verl chooses max(1, floor(ratio x tokens)) per micro-batch)
        loss      = PPO clipped surrogate (as policy_clip, dual clip included), with the gradient of the
                    selected tokens detached (their loss value is kept; verl multiplies them by 0, which
                    gives the same gradient)

    The high-covariance tokens are those whose update lowers the entropy most (paper Eq. 9-10); freezing a
    tiny random share of them is enough to stop the entropy collapse. The trainer hands every micro-batch
    its share of the mini-batch's choice (`mb.token_select`); without one, the micro-batch is taken for the
    whole mini-batch, with the draw seeded by `reseed`.
    """

    name = "policy_clip"

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = 3.0,
        aggregation: str = "token-mean",
        clip_cov_ratio: float = 2e-4,
        clip_cov_lb: float = 1.0,
        clip_cov_ub: float = 5.0,
    ) -> None:
        super().__init__(clip_low, clip_high, dual_clip, aggregation)
        if not 0.0 < clip_cov_ratio <= 1.0:
            raise ValueError(f"clip_cov_ratio must be in (0, 1] (got {clip_cov_ratio})")
        if clip_cov_lb >= clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({clip_cov_lb}) must be < clip_cov_ub ({clip_cov_ub})")
        self.clip_cov_ratio, self.clip_cov_lb, self.clip_cov_ub = clip_cov_ratio, clip_cov_lb, clip_cov_ub
        self.seed = 0

    def reseed(self, seed: int) -> None:
        self.seed = seed

    def selection_rule(self) -> SelectionRule:
        return SelectionRule(self.clip_cov_ratio, (self.clip_cov_lb, self.clip_cov_ub))

    def eligible(self, mb: MicroBatch, logprobs: Tensor) -> Tensor:
        """Real tokens the PPO clip (or dual clip) does not already bound. [B, R] bool"""
        old_logp = _require(mb.old_logprobs, "old_logprobs", self.name)  # [B, R]
        _, pg1, pg2, dual_active, _ = self._clipped(mb, logprobs.detach() - old_logp)
        return mb.response_mask & ~((pg2 > pg1) | dual_active)

    def select(self, mb: MicroBatch, out: PolicyOutputs, ppo_clipped: Tensor | None = None) -> Tensor:
        """Boolean [B, R] of the tokens whose gradient is detached."""
        if mb.token_select is not None:
            return mb.token_select & mb.response_mask
        return _choose_within(self, mb, out.logprobs, self.seed)

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        pg, _, w, metrics = self.surrogate(mb, out)  # [B, R], _, [B, R]
        selected = self.select(mb, out)  # [B, R]
        pg = torch.where(selected, pg.detach(), pg)  # [B, R]
        loss = weighted_sum(w, pg)
        with torch.no_grad():
            metrics["policy/cov_clipfrac"] = weighted_sum(w, selected.float())
        return loss, {"loss/policy_clip": loss.detach(), **metrics}


class KLCovLoss(LossTerm):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617, Sec. 4.2; names and defaults from verl's `kl_cov`, ratio
    2e-3 as the paper's 7B setting).

        cov_i    = (A_i - mean A) * (logp_i - mean logp)             over the mini-batch's real tokens
        selected = the top kl_cov_ratio share (in expectation) of the mini-batch's real tokens by cov, chosen
                   over the whole mini-batch (epo_cli/algos/cov_selection.py; verl: the top
                   max(1, floor(ratio x tokens)) of each micro-batch)
        loss_i   = -A_i * ratio_i + ppo_kl_coef * |logp_i - old_logp_i| * [i selected]

    No ratio clip (the paper's KL-Cov objective): the KL penalty on the high-covariance tokens takes its
    place, so algo.policy_clip.clip_low / clip_high / dual_clip do not apply.
    """

    name = "policy_clip"

    def __init__(self, aggregation: str = "token-mean", kl_cov_ratio: float = 2e-3, ppo_kl_coef: float = 1.0) -> None:
        super().__init__()
        if not 0.0 < kl_cov_ratio <= 1.0:
            raise ValueError(f"kl_cov_ratio must be in (0, 1] (got {kl_cov_ratio})")
        self.aggregation, self.kl_cov_ratio, self.ppo_kl_coef = aggregation, kl_cov_ratio, ppo_kl_coef
        self.seed = 0

    def reseed(self, seed: int) -> None:
        self.seed = seed  # the stochastic rounding of the count

    def selection_rule(self) -> SelectionRule:
        return SelectionRule(self.kl_cov_ratio)

    def eligible(self, mb: MicroBatch, logprobs: Tensor) -> Tensor:
        return mb.response_mask

    def select(self, mb: MicroBatch, out: PolicyOutputs) -> Tensor:
        """Boolean [B, R] of the penalised tokens."""
        if mb.token_select is not None:
            return mb.token_select & mb.response_mask
        return _choose_within(self, mb, out.logprobs, self.seed)

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        w = _weights(mb, self.aggregation)  # [B, R]
        adv = _require(mb.advantages, "advantages", self.name)[:, None]  # [B, 1]
        log_ratio = _require(out.log_ratio, "the log-ratio to the old policy", self.name)  # [B, R]
        ratio = torch.exp(log_ratio)  # [B, R]
        selected = self.select(mb, out)  # [B, R]
        pg = _behaviour_corrected(-adv * ratio + self.ppo_kl_coef * log_ratio.abs() * selected, mb)  # [B, R]
        loss = weighted_sum(w, pg)
        with torch.no_grad():
            metrics = {
                "loss/policy_clip": loss.detach(),
                "policy/approx_kl": weighted_sum(w, (ratio - 1.0) - log_ratio),
                "policy/kl_cov_frac": weighted_sum(w, selected.float()),
                "policy/kl_cov_penalty": weighted_sum(w, log_ratio.abs() * selected),
            }
        return loss, metrics


@POLICY_LOSSES.implement("clip")
def _clip(pc: PolicyClipConfig) -> LossTerm:
    return PolicyClipLoss(pc.clip_low, pc.clip_high, pc.dual_clip, pc.aggregation)


@POLICY_LOSSES.implement("clip_cov")
def _clip_cov(pc: PolicyClipConfig) -> LossTerm:
    return ClipCovLoss(pc.clip_low, pc.clip_high, pc.dual_clip, pc.aggregation, pc.clip_cov_ratio, pc.clip_cov_lb,
                       pc.clip_cov_ub)


@POLICY_LOSSES.implement("kl_cov")
def _kl_cov(pc: PolicyClipConfig) -> LossTerm:
    return KLCovLoss(pc.aggregation, pc.kl_cov_ratio, pc.ppo_kl_coef)


@LOSS_TERMS.implement("policy_clip")
def _policy_clip(pc: PolicyClipConfig, policy_loss: str) -> LossTerm:
    """The policy-gradient slot: the policy loss algo.policy_loss names, with algo.policy_clip's settings."""
    return POLICY_LOSSES.build(policy_loss, pc)


class ValueLoss(LossTerm):
    """Clipped value regression (PPO2, as in baselines/verl), one value per turn-sample:

        v_clip = old_v + clamp(v - old_v, -clip, clip)
        loss   = 0.5 * max((v - R)^2, (v_clip - R)^2)     mean over the mini-batch's real rows

    The row weight is sum_i w_seq-mean-token-mean[b, i] = 1/N for each of the N real rows.
    """

    name = "value"
    aggregation = "seq-mean-token-mean"

    def __init__(self, clip: float = 0.5) -> None:
        super().__init__()
        self.clip = clip

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        w_row = _weights(mb, self.aggregation).sum(-1)  # [B]
        v = _require(out.values, "values from the critic", self.name)  # [B]
        old_v = _require(mb.old_values, "old_values", self.name)  # [B]
        ret = _require(mb.returns, "returns", self.name)  # [B]
        v_clip = old_v + torch.clamp(v - old_v, -self.clip, self.clip)  # [B]
        err = (v - ret) ** 2  # [B]
        err_clip = (v_clip - ret) ** 2  # [B]
        loss = weighted_sum(w_row, 0.5 * torch.maximum(err, err_clip))
        with torch.no_grad():
            metrics = {
                "loss/value": loss.detach(),
                "critic/clipfrac": weighted_sum(w_row, (err_clip > err).float()),
            }
        return loss, metrics


class EntropyLoss(LossTerm):
    """L_H, the aggregated token entropy, returned POSITIVE (its coefficient -lambda makes it a bonus).

    trajectory mode is EPO Eq. 2 (arXiv 2509.22576): L_H = (1/B) sum_j (1/T_j) sum_t (1/|y_jt|) sum_i H_jti.
    token_mean is verl's entropy bonus; turn_decay weights turn t by decay^t (source article variant).
    """

    name = "entropy"

    def __init__(self, mode: str = "token_mean") -> None:
        super().__init__()
        self.mode = mode
        self.aggregation = ENTROPY_MODES[mode]  # KeyError listing the modes

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        w = _weights(mb, self.aggregation)  # [B, R]
        loss = weighted_sum(w, out.entropy)
        return loss, {"loss/entropy": loss.detach()}


class EntropySmoothingLoss(LossTerm):
    """EPO entropy smoothing (arXiv 2509.22576 Sec. 3): a hinge band around the historical entropy.

        P_i      = relu(kappa_low * Href - H_i) + relu(H_i - kappa_high * Href)      Href = mb.entropy_ref [B]
        L_smooth = alpha * aggregate(P)

    Differentiable in H: dL/dH_i = -alpha*w_i below the band, +alpha*w_i above it, 0 inside. (The public
    EPO code built P from constants, so its gradient was zero.) Rows whose Href is NaN (no history yet)
    contribute 0; with no reference at all the loss is an exact 0 that still backpropagates.
    """

    name = "entropy_smoothing"

    def __init__(
        self,
        alpha: float = 0.1,
        kappa_low: float = 0.0,
        kappa_high: float = 2.0,
        aggregation: str = "trajectory",
    ) -> None:
        super().__init__()
        if kappa_low > kappa_high:
            raise ValueError(f"kappa_low ({kappa_low}) must be <= kappa_high ({kappa_high})")
        self.alpha, self.kappa_low, self.kappa_high = alpha, kappa_low, kappa_high
        self.aggregation = aggregation

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        H = out.entropy  # [B, R]
        w = _weights(mb, self.aggregation)  # [B, R]
        href = mb.entropy_ref if mb.entropy_ref is not None else torch.full(H.shape[:1], float("nan"))
        href = href.to(H)  # [B]
        has_ref = ~torch.isnan(href)  # [B]
        w = w * has_ref[:, None]  # [B, R] rows without a reference weigh 0
        href = torch.where(has_ref, href, torch.zeros_like(href))[:, None]  # [B, 1]
        low, high = self.kappa_low * href, self.kappa_high * href  # [B, 1]
        penalty = torch.relu(low - H) + torch.relu(H - high)  # [B, R]
        loss = self.alpha * weighted_sum(w, penalty)
        with torch.no_grad():
            metrics = {
                "loss/entropy_smoothing": loss.detach(),
                "policy/entropy_below_band": weighted_sum(w, (H < low).float()),
                "policy/entropy_above_band": weighted_sum(w, (H > high).float()),
            }
        return loss, metrics


def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2


def _kl_k3(log_ratio: Tensor) -> Tensor:
    # ref/p - log(ref/p) - 1 with log(ref/p) = -log_ratio (verl's low_var_kl). The inner clamp keeps
    # exp finite (exp overflow -> inf * 0 = NaN gradient); the outer one is verl's [-10, 10].
    neg = torch.clamp(-log_ratio, -20.0, 20.0)
    return torch.clamp(torch.exp(neg) - neg - 1.0, -10.0, 10.0)


# per-token KL(p || ref) estimators of log_ratio = logp - ref_logp (Schulman, "Approximating KL")
for _name, _estimator in (("k1", _kl_k1), ("k2", _kl_k2), ("k3", _kl_k3), ("low_var_kl", _kl_k3)):
    KL_ESTIMATORS.implement(_name, _estimator)


class KLLoss(LossTerm):
    """KL to the frozen reference policy as a loss term (GRPO, Shao et al. 2024; verl use_kl_loss)."""

    name = "kl"

    def __init__(self, estimator: str = "low_var_kl", aggregation: str = "token-mean") -> None:
        super().__init__()
        self.estimate = KL_ESTIMATORS[estimator]  # KeyError listing the estimators
        self.estimator = estimator
        self.aggregation = aggregation

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        w = _weights(mb, self.aggregation)  # [B, R]
        ref = _require(mb.ref_logprobs, "ref_logprobs", self.name)  # [B, R]
        kl = self.estimate(out.logprobs - ref)  # [B, R]
        loss = weighted_sum(w, kl)
        return loss, {"loss/kl": loss.detach(), "policy/kl_ref": loss.detach()}


class NLLLoss(LossTerm):
    """Behaviour cloning: -log p(y) of the demonstrated response tokens."""

    name = "nll"

    def __init__(self, aggregation: str = "token-mean") -> None:
        super().__init__()
        self.aggregation = aggregation

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        w = _weights(mb, self.aggregation)  # [B, R]
        loss = weighted_sum(w, -out.logprobs)
        return loss, {"loss/nll": loss.detach()}


@LOSS_TERMS.implement("value")
def _value(v: ValueConfig) -> LossTerm:
    return ValueLoss(v.clip)


@LOSS_TERMS.implement("entropy")
def _entropy(e: EntropyTermConfig) -> LossTerm:
    return EntropyLoss(e.mode)


@LOSS_TERMS.implement("entropy_smoothing")
def _entropy_smoothing(sm: SmoothingConfig) -> LossTerm:
    return EntropySmoothingLoss(sm.alpha, sm.kappa_low, sm.kappa_high, sm.aggregation)


@LOSS_TERMS.implement("kl")
def _kl(kl: KLConfig) -> LossTerm:
    return KLLoss(kl.estimator, kl.aggregation)


@LOSS_TERMS.implement("nll")
def _nll(aggregation: str) -> LossTerm:
    return NLLLoss(aggregation)


def build_loss_term(name: str, algo: Any) -> LossTerm:
    """The term registered as `name`, built from its own settings in `algo`."""
    entry = LOSS_TERMS.entry(name)
    return entry.build(*entry.settings(algo))


def build_loss_terms(algo: Any) -> nn.ModuleDict:
    """The policy's terms in the order of algo.loss_terms; `value` is skipped (it trains the critic)."""
    return nn.ModuleDict({name: build_loss_term(name, algo) for name in algo.loss_terms if name != "value"})


def build_value_term(algo: Any) -> LossTerm:
    return build_loss_term("value", algo)


def required_aggregations(terms: nn.ModuleDict | list[LossTerm]) -> list[str]:
    """Weight modes the micro-batches must carry for these terms (turn-decay uses algo.turn_decay)."""
    modules = terms.values() if isinstance(terms, nn.ModuleDict) else terms
    return sorted({term.aggregation for term in modules})


class LossStack(nn.Module):
    """total = sum_i coefs[name_i] * loss_i over the configured terms, plus all their metrics."""

    def __init__(self, terms: nn.ModuleDict) -> None:
        super().__init__()
        self.terms = terms

    def reseed(self, seed: int) -> None:
        """Seed the terms that draw random numbers (Clip-Cov), so a run is reproducible and resumable."""
        for term in self.terms.values():
            if hasattr(term, "reseed"):
                term.reseed(seed)

    def token_selector(self) -> TokenSelector | None:
        """The term that acts on tokens chosen over the mini-batch (Clip-Cov, KL-Cov), if any."""
        return next((t for t in self.terms.values() if hasattr(t, "selection_rule")), None)

    def forward(
        self, mb: MicroBatch, out: PolicyOutputs, coefs: dict[str, float]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        missing = [name for name in self.terms if name not in coefs]
        if missing:
            raise KeyError(f"no coefficient for loss term(s) {missing}")
        total = out.logprobs.new_zeros(())
        metrics: dict[str, Tensor] = {}
        for name, term in self.terms.items():
            loss, term_metrics = term(mb, out)
            total = total + coefs[name] * loss
            metrics.update(term_metrics)
        return total, metrics

    def formula(self, coefs: dict[str, float]) -> str:
        """E.g. 'loss = 1*policy_clip + 0.01*kl - 0.001*entropy + 0.002*entropy_smoothing'."""
        parts = []
        for i, name in enumerate(self.terms):
            c = coefs[name]
            sign = ("-" if c < 0 else "") if i == 0 else (" - " if c < 0 else " + ")
            parts.append(f"{sign}{abs(c):g}*{name}")
        return "loss = " + ("".join(parts) if parts else "0")


@dataclass(frozen=True)
class TermCoefficients:
    """Each of algo.loss_terms with what its coefficient reads, taken from the algo section once
    (`term_coefficients`); `at` gives one step's coefficients from the schedules' values."""

    terms: tuple[tuple[str, Callable[..., float], tuple[str, ...], Any], ...]  # (name, coef, reads, own settings)

    def at(self, entropy_coef: float, phase_beta: float, kl_weight: float,
           entropy_scale: float = 1.0) -> dict[str, float]:
        """Each term's coefficient in L = L_RL - lambda * (L_H - beta_k * L_smooth) + kl_weight * KL (see
        `loss_coefficients`)."""
        weights = {"lam": entropy_coef * entropy_scale, "beta": phase_beta, "kl": kl_weight}
        return {name: float(coef(**{weight: {**weights, "settings": settings}[weight] for weight in reads}))
                for name, coef, reads, settings in self.terms}


def term_coefficients(algo: Any) -> TermCoefficients:
    """algo.loss_terms' coefficient rules: each registry entry's `coef` and the weights it names, with the
    term's own settings where it reads them (ValueError: a term without a coef whose settings have none)."""
    terms = []
    for name in algo.loss_terms:
        entry = LOSS_TERMS.entry(name)
        reads = coef_weights(entry.coef)
        settings = entry.settings(algo) if "settings" in reads else ()
        if entry.coef is None and not (settings and hasattr(settings[0], "coef")):
            raise ValueError(f"loss term '{name}' declares no coef, so it is weighted by its own settings' `coef`: "
                             "its settings class needs that field (its coefficient in the loss)")
        terms.append((name, entry.coef or own_coef, reads, settings[0] if settings else None))
    return TermCoefficients(tuple(terms))


def loss_coefficients(
    algo: Any, entropy_coef: float, phase_beta: float, kl_weight: float, entropy_scale: float = 1.0
) -> dict[str, float]:
    """Each term's coefficient in L = L_RL - lambda * (L_H - beta_k * L_smooth) + kl_weight * KL, for
    algo.loss_terms: its registry entry's `coef` (epo_cli/algos/registries.py) called with the weights it
    names. The built-ins':

        policy_clip 1   value value.coef   entropy -lambda   entropy_smoothing lambda * beta_k   kl kl_weight   nll 1

    entropy_coef = lambda (entropy schedule), phase_beta = beta_k (phase schedule), kl_weight = the KL
    coefficient at this step. entropy_scale multiplies lambda, so both entropy-driven terms (the fluctuation
    monitor's `clamp` action passes monitor.clamp_scale while it alerts; 1 otherwise). `settings` is the
    term's own settings; a term declared without a coef is weighted by their `coef` (the critic's value.coef,
    or a term outside the EPO objective). The trainer reads the rules once (`term_coefficients`).
    """
    return term_coefficients(algo).at(entropy_coef, phase_beta, kl_weight, entropy_scale)
