"""Loss terms against hand-computed values (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from epo_cli.algos.aggregation import AGGREGATIONS, normalized_weights
from epo_cli.algos.losses import (
    ENTROPY_MODES,
    KL_ESTIMATORS,
    LOSS_TERMS,
    EntropyLoss,
    EntropySmoothingLoss,
    KLLoss,
    LossStack,
    NLLLoss,
    PolicyClipLoss,
    PolicyOutputs,
    ValueLoss,
    build_loss_terms,
    build_value_term,
    loss_coefficients,
)
from epo_cli.config import AlgoConfig
from epo_cli.rollout.batch import MicroBatch

torch.set_num_threads(1)


def make_mb(mask, turn_index=None, num_turns=None, decay=0.9, **fields) -> MicroBatch:
    """A micro-batch carrying normalised weights for every aggregation mode (one micro-batch = mini-batch)."""
    mask = torch.as_tensor(mask, dtype=torch.bool)
    B, R = mask.shape
    turn_index = torch.zeros(B, dtype=torch.long) if turn_index is None else torch.as_tensor(turn_index)
    num_turns = torch.ones(B, dtype=torch.long) if num_turns is None else torch.as_tensor(num_turns)
    weights = {m: normalized_weights(m, mask, turn_index, num_turns, decay) for m in AGGREGATIONS}
    return MicroBatch(
        input_ids=torch.zeros(B, 1 + R, dtype=torch.long),
        attention_mask=torch.ones(B, 1 + R, dtype=torch.long),
        position_ids=torch.arange(1 + R).expand(B, -1),
        response_mask=mask,
        prompt_width=1,
        response_ids=torch.zeros(B, R, dtype=torch.long),
        turn_index=turn_index,
        num_turns=num_turns,
        weights=weights,
        num_real=B,
        **fields,
    )


def outputs(logprobs, entropy=None, values=None, old=None) -> PolicyOutputs:
    """The current policy's outputs; `old` (the old log-probs): with the log-ratio the update sets beside
    the forward (PolicyUpdate.train_micro_batch), which the policy terms read."""
    logprobs = torch.as_tensor(logprobs, dtype=torch.float32).requires_grad_(True)
    entropy = torch.zeros_like(logprobs) if entropy is None else torch.as_tensor(entropy, dtype=torch.float32)
    log_ratio = None if old is None else logprobs - torch.as_tensor(old, dtype=torch.float32)
    return PolicyOutputs(logprobs=logprobs, entropy=entropy.requires_grad_(True), values=values, log_ratio=log_ratio)


def test_registries():
    # the built-ins (tests may register more, e.g. test_registry.py's toy term)
    builtin = {n for n in LOSS_TERMS.names() if LOSS_TERMS.entry(n).build.__module__.startswith("epo_cli.")}
    assert builtin == {"policy_clip", "value", "entropy", "entropy_smoothing", "kl", "nll"}
    assert ENTROPY_MODES == {
        "token_mean": "token-mean",
        "trajectory": "trajectory",
        "turn_decay": "turn-decay",
    }
    assert {"k1", "k2", "k3", "low_var_kl"} <= set(KL_ESTIMATORS)


# ---------------------------------------------------------------------------------------- policy_clip

# six rows of one token each (token-mean weight 1/6); clip_low 0.2 -> [0.8, ...], clip_high 0.3 -> [..., 1.3]
#   row  A   ratio  pg1=-A*r  pg2=-A*clip(r)  max    dual (-A*3)   final  clipped(pg2>pg1)  dual active
#   1   +1   1.1    -1.1      -1.1            -1.1   -             -1.1   no                -
#   2   +1   1.5    -1.5      -1.3            -1.3   -             -1.3   yes (high side)   -
#   3   +1   0.5    -0.5      -0.8            -0.5   -             -0.5   no                -
#   4   -1   0.5     0.5       0.8             0.8   3             0.8    yes (low side)    no
#   5   -1   1.5     1.5       1.3             1.5   3             1.5    no                no
#   6   -2   4.0     8.0       2.6             8.0   6             6.0    no                yes
# loss = (-1.1 - 1.3 - 0.5 + 0.8 + 1.5 + 6.0)/6 = 5.4/6 = 0.9; clipfrac 2/6; dual_clipfrac 1/6
# approx_kl = mean((r - 1) - log r):
#   1.1: 0.1 - 0.0953102 = 0.0046898;  1.5: 0.5 - 0.4054651 = 0.0945349 (x2)
#   0.5: -0.5 + 0.6931472 = 0.1931472 (x2);  4.0: 3 - 1.3862944 = 1.6137056
#   sum = 2.1937596, /6 = 0.3656266
# d loss / d logp = (-A * r)/6 where the unclipped branch is used, else 0:
#   [-1.1, 0, -0.5, 0, 1.5, 0] / 6
ADV = [1.0, 1.0, 1.0, -1.0, -1.0, -2.0]
RATIO = [1.1, 1.5, 0.5, 0.5, 1.5, 4.0]
OLD_LOGP = -1.0


def _clip_case(dual_clip):
    mb = make_mb(torch.ones(6, 1), advantages=torch.tensor(ADV), old_logprobs=torch.full((6, 1), OLD_LOGP))
    out = outputs([[OLD_LOGP + math.log(r)] for r in RATIO], old=mb.old_logprobs)
    term = PolicyClipLoss(clip_low=0.2, clip_high=0.3, dual_clip=dual_clip)
    return term(mb, out), out


def test_policy_clip_by_hand_with_dual_clip():
    (loss, m), out = _clip_case(dual_clip=3.0)
    assert loss.item() == pytest.approx(0.9, abs=1e-6)
    assert m["loss/policy_clip"].item() == pytest.approx(0.9, abs=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(2 / 6)
    assert m["policy/dual_clipfrac"].item() == pytest.approx(1 / 6)
    assert m["policy/approx_kl"].item() == pytest.approx(2.1937596 / 6, abs=1e-6)
    assert not any(v.requires_grad for v in m.values())
    loss.backward()
    expected = torch.tensor([[-1.1], [0.0], [-0.5], [0.0], [1.5], [0.0]]) / 6
    assert torch.allclose(out.logprobs.grad, expected, atol=1e-6)


def test_policy_clip_without_dual_clip():
    # row 6 keeps 8.0: loss = (5.4 - 6 + 8)/6 = 7.4/6; its gradient is -A*r/6 = 8/6
    (loss, m), out = _clip_case(dual_clip=None)
    assert loss.item() == pytest.approx(7.4 / 6, abs=1e-6)
    assert m["policy/dual_clipfrac"].item() == 0.0
    loss.backward()
    assert out.logprobs.grad[5, 0].item() == pytest.approx(8 / 6, abs=1e-6)


def test_policy_clip_uses_its_aggregation():
    # 2 rows: lengths 1 and 3, A = [1, 0], ratio 1 everywhere -> pg = [-1 | 0, 0, 0]
    # token-mean: -1/4; seq-mean-token-mean: (-1 + 0)/2 = -0.5
    mask = [[1, 0, 0], [1, 1, 1]]
    mb = make_mb(mask, advantages=torch.tensor([1.0, 0.0]), old_logprobs=torch.zeros(2, 3))
    out = outputs(torch.zeros(2, 3), old=mb.old_logprobs)
    assert PolicyClipLoss()(mb, out)[0].item() == pytest.approx(-0.25)
    assert PolicyClipLoss(aggregation="seq-mean-token-mean")(mb, out)[0].item() == pytest.approx(-0.5)


# ---------------------------------------------------------------------------------------------- value


def test_value_clipping_by_hand():
    # clip 0.5; rows (old_v, v, R):
    #   1: (1, 1.2, 2): v inside the clip range, v_clip = 1.2; 0.5*0.8^2 = 0.32; not clipped
    #   2: (0, 2, 0):   v_clip = 0.5; (v-R)^2 = 4 > (v_clip-R)^2 = 0.25 -> 0.5*4 = 2.0; not clipped
    #   3: (0, 2, 3):   v_clip = 0.5; (v-R)^2 = 1 < (v_clip-R)^2 = 6.25 -> 0.5*6.25 = 3.125; clipped
    #   4: padding row (no response token): weight 0
    # loss = (0.32 + 2.0 + 3.125)/3 = 5.445/3 = 1.815; critic/clipfrac = 1/3
    # d/dv: row 1 (1.2 - 2)/3 = -0.8/3; row 2 (2 - 0)/3; row 3 0 (the clipped branch is constant in v)
    mask = [[1, 1], [1, 0], [1, 0], [0, 0]]
    mb = make_mb(
        mask, old_values=torch.tensor([1.0, 0.0, 0.0, 9.0]), returns=torch.tensor([2.0, 0.0, 3.0, 9.0])
    )
    v = torch.tensor([1.2, 2.0, 2.0, 100.0], requires_grad=True)
    loss, m = ValueLoss(clip=0.5)(mb, PolicyOutputs(torch.zeros(4, 2), torch.zeros(4, 2), values=v))
    assert loss.item() == pytest.approx(1.815, abs=1e-6)
    assert m["critic/clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(v.grad, torch.tensor([-0.8 / 3, 2 / 3, 0.0, 0.0]), atol=1e-6)
    assert build_value_term(AlgoConfig()).clip == 0.5


# -------------------------------------------------------------------------------------------- entropy

# same crafted batch as tests/test_aggregation.py: traj 0 (1 turn), traj 1 (3 turns)
ENT_MASK = [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
ENT_H = [[1.0, 3.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0], [1.0, 1.0, 1.0, 5.0]]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mean", 22 / 10),  # (4 + 4 + 6 + 8) / 10 tokens
        ("trajectory", 7 / 3),  # (1/2) * (2 + (4 + 2 + 2)/3)
        ("turn_decay", 18 / 7),  # decay 0.5: (2 + (4 + 0.5*2 + 0.25*2)/1.75) / 2
    ],
)
def test_entropy_modes_by_hand(mode, expected):
    mb = make_mb(ENT_MASK, turn_index=[0, 0, 1, 2], num_turns=[1, 3, 3, 3], decay=0.5)
    loss, m = EntropyLoss(mode)(mb, outputs(torch.zeros(4, 4), ENT_H))
    assert loss.item() == pytest.approx(expected, rel=1e-6)  # positive: the coefficient carries the sign
    assert m["loss/entropy"].item() == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------------------------- entropy smoothing


def test_smoothing_value_and_gradient_below_inside_above():
    # one row, 3 tokens, Href = 1, band [0.5*1, 1.5*1] = [0.5, 1.5], alpha 0.1, trajectory weights 1/3
    #   H = [0.2, 1.0, 2.0]: P = [0.5 - 0.2, 0, 2.0 - 1.5] = [0.3, 0, 0.5]
    #   L = 0.1 * (0.3 + 0 + 0.5)/3 = 0.08/3
    #   dL/dH = alpha * w * [-1, 0, +1] = [-0.1/3, 0, +0.1/3]   (nonzero outside the band)
    mb = make_mb([[1, 1, 1]], entropy_ref=torch.tensor([1.0]))
    out = outputs(torch.zeros(1, 3), [[0.2, 1.0, 2.0]])
    loss, m = EntropySmoothingLoss(alpha=0.1, kappa_low=0.5, kappa_high=1.5)(mb, out)
    assert loss.item() == pytest.approx(0.08 / 3, abs=1e-7)
    assert m["policy/entropy_below_band"].item() == pytest.approx(1 / 3)
    assert m["policy/entropy_above_band"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(out.entropy.grad, torch.tensor([[-0.1 / 3, 0.0, 0.1 / 3]]), atol=1e-8)


def test_smoothing_paper_band_and_nan_rows():
    # paper band kappa = (0, 2), alpha 0.1; row 0 Href = 1 -> band [0, 2]; row 1 Href = NaN -> ignored
    #   row 0 H = [3.0, 1.0]: P = [1.0, 0]; trajectory weights: 2 rows of 1-turn trajectories, d = 1 each
    #   -> w = 1/(1*2)/2 = 1/4 per token of both rows; row 1 zeroed (no reference)
    #   L = 0.1 * (1.0 * 1/4) = 0.025; dL/dH row 0 = [0.1/4, 0], row 1 = [0, 0]
    mb = make_mb([[1, 1], [1, 1]], entropy_ref=torch.tensor([1.0, float("nan")]))
    out = outputs(torch.zeros(2, 2), [[3.0, 1.0], [100.0, 0.0]])
    loss, _ = EntropySmoothingLoss(alpha=0.1)(mb, out)
    assert loss.item() == pytest.approx(0.025, abs=1e-7)
    loss.backward()
    assert torch.allclose(out.entropy.grad, torch.tensor([[0.025, 0.0], [0.0, 0.0]]))


@pytest.mark.parametrize("ref", [None, torch.tensor([float("nan"), float("nan")])])
def test_smoothing_is_zero_with_empty_history(ref):
    mb = make_mb([[1, 1], [1, 0]], entropy_ref=ref)
    out = outputs(torch.zeros(2, 2), [[0.0, 50.0], [3.0, 1.0]])
    loss, m = EntropySmoothingLoss(alpha=0.1, kappa_low=0.5, kappa_high=1.5)(mb, out)
    assert loss.item() == 0.0
    assert loss.requires_grad  # still part of the graph: backward works
    loss.backward()
    assert (out.entropy.grad == 0).all()
    assert m["policy/entropy_below_band"].item() == 0.0


# ------------------------------------------------------------------------------------------------- kl


def test_kl_estimators_by_hand():
    # logr = logp - ref_logp = [0.5, -0.5, 0.0]
    #   k1 = logr
    #   k2 = 0.5 * logr^2 = [0.125, 0.125, 0]
    #   k3 = exp(-logr) - 1 + logr:  0.5 -> 0.6065307 - 0.5 = 0.1065307
    #                               -0.5 -> 1.6487213 - 1.5 = 0.1487213;   0 -> 0
    logr = torch.tensor([0.5, -0.5, 0.0])
    assert torch.allclose(KL_ESTIMATORS["k1"](logr), logr)
    assert torch.allclose(KL_ESTIMATORS["k2"](logr), torch.tensor([0.125, 0.125, 0.0]))
    k3 = torch.tensor([0.1065307, 0.1487213, 0.0])
    assert torch.allclose(KL_ESTIMATORS["k3"](logr), k3, atol=1e-6)
    assert torch.allclose(KL_ESTIMATORS["low_var_kl"](logr), k3, atol=1e-6)
    # extremes: exp(30) - 31 and 29 are both clamped to 10, with a finite (zero) gradient
    big = torch.tensor([-30.0, 30.0, -1000.0], requires_grad=True)
    k = KL_ESTIMATORS["k3"](big)
    assert torch.equal(k.detach(), torch.tensor([10.0, 10.0, 10.0]))
    k.sum().backward()
    assert torch.isfinite(big.grad).all()


def test_kl_term_token_mean():
    # logp - ref = [[0.5, -0.5], [0.0, pad]], k2: (0.125 + 0.125 + 0)/3 tokens = 0.0833333
    mb = make_mb([[1, 1], [1, 0]], ref_logprobs=torch.tensor([[-1.5, -0.5], [-1.0, 0.0]]))
    out = outputs([[-1.0, -1.0], [-1.0, -7.0]])
    loss, m = KLLoss("k2")(mb, out)
    assert loss.item() == pytest.approx(0.25 / 3)
    assert m["policy/kl_ref"].item() == pytest.approx(0.25 / 3)


# ------------------------------------------------------------------------------------------------ nll


def test_nll_by_hand_ignores_padding():
    # logp = [[-1, -2], [-3, pad=-inf]]
    # token-mean: (1 + 2 + 3)/3 = 2; seq-mean-token-mean: (1.5 + 3)/2 = 2.25
    mb = make_mb([[1, 1], [1, 0]])
    out = outputs([[-1.0, -2.0], [-3.0, -float("inf")]])
    loss, m = NLLLoss()(mb, out)
    assert loss.item() == pytest.approx(2.0)
    assert m["loss/nll"].item() == pytest.approx(2.0)
    loss.backward()
    # d/dlogp = -1/3 per real token, 0 on padding (no NaN from the -inf)
    assert torch.allclose(out.logprobs.grad, torch.tensor([[-1 / 3, -1 / 3], [-1 / 3, 0.0]]))
    assert NLLLoss("seq-mean-token-mean")(mb, out)[0].item() == pytest.approx(2.25)


# -------------------------------------------------------------------------------------- stack + coefs


def epo_algo() -> AlgoConfig:
    algo = AlgoConfig(
        name="epo", base="grpo", loss_terms=["policy_clip", "kl", "entropy", "entropy_smoothing"]
    )
    algo.entropy_smoothing.kappa_low, algo.entropy_smoothing.kappa_high = 0.5, 1.5
    return algo


def test_loss_coefficients_by_hand():
    # L = L_RL - lambda*(L_H - beta*L_smooth) + kl*KL with lambda 0.001, beta 2, kl 0.01
    #   entropy -0.001, entropy_smoothing +0.001*2 = 0.002
    coefs = loss_coefficients(epo_algo(), entropy_coef=0.001, phase_beta=2.0, kl_weight=0.01)
    assert coefs == pytest.approx(
        {"policy_clip": 1.0, "kl": 0.01, "entropy": -0.001, "entropy_smoothing": 0.002}
    )
    # monitor clamp: entropy_scale 0.1 -> -0.0001 and 0.0002; value and nll when listed
    algo = AlgoConfig(loss_terms=["nll", "value", "entropy", "entropy_smoothing"])
    coefs = loss_coefficients(algo, 0.001, 2.0, 0.0, entropy_scale=0.1)
    assert coefs == pytest.approx({"nll": 1.0, "value": 0.5, "entropy": -0.0001, "entropy_smoothing": 0.0002})


def test_build_loss_terms_order_and_value_excluded():
    algo = AlgoConfig(loss_terms=["policy_clip", "value", "kl", "entropy"])
    terms = build_loss_terms(algo)
    assert list(terms) == ["policy_clip", "kl", "entropy"]
    assert isinstance(terms["kl"], KLLoss) and terms["kl"].estimator == "low_var_kl"


def test_loss_stack_total_metrics_and_formula():
    algo = epo_algo()
    stack = LossStack(build_loss_terms(algo))
    coefs = loss_coefficients(algo, entropy_coef=0.001, phase_beta=2.0, kl_weight=0.01)
    assert stack.formula(coefs) == "loss = 1*policy_clip + 0.01*kl - 0.001*entropy + 0.002*entropy_smoothing"
    mb = make_mb(
        [[1, 1], [1, 0]],
        advantages=torch.tensor([1.0, -1.0]),
        old_logprobs=torch.tensor([[-1.0, -1.0], [-1.0, 0.0]]),
        ref_logprobs=torch.tensor([[-1.5, -0.5], [-1.0, 0.0]]),
        entropy_ref=torch.tensor([1.0, 1.0]),
    )
    out = outputs([[-1.0, -1.0], [-1.0, 0.0]], [[0.2, 1.0], [2.0, 0.0]], old=mb.old_logprobs)
    total, metrics = stack(mb, out, coefs)
    # ratio 1 everywhere: policy_clip = token-mean(-A) = (-1 - 1 + 1)/3 = -1/3
    # kl k3 at logr [0.5, -0.5, 0]: (0.1065307 + 0.1487213)/3 = 0.0850840
    # entropy token-mean: (0.2 + 1.0 + 2.0)/3 = 3.2/3
    # smoothing (trajectory weights: row 0 tokens 1/4 each, row 1 token 1/2): P = [0.3, 0 | 0.5]
    #   0.1 * (0.3/4 + 0.5/2) = 0.1 * 0.325 = 0.0325
    parts = {"policy_clip": -1 / 3, "kl": 0.2552520 / 3, "entropy": 3.2 / 3, "entropy_smoothing": 0.0325}
    for name, value in parts.items():
        assert metrics[f"loss/{name}"].item() == pytest.approx(value, abs=1e-6)
    expected = sum(coefs[n] * v for n, v in parts.items())
    assert total.item() == pytest.approx(expected, abs=1e-6)
    total.backward()
    assert out.logprobs.grad is not None and out.entropy.grad is not None
    with pytest.raises(KeyError, match="coefficient"):
        stack(mb, out, {"policy_clip": 1.0})
    # a leading negative coefficient
    only = LossStack(build_loss_terms(AlgoConfig(loss_terms=["entropy", "nll"])))
    assert only.formula({"entropy": -0.001, "nll": 1.0}) == "loss = -0.001*entropy + 1*nll"
