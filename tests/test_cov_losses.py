"""Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617) against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from test_losses import make_mb

from epo_cli.algos.losses import (
    POLICY_LOSSES,
    ClipCovLoss,
    KLCovLoss,
    LossStack,
    PolicyClipLoss,
    PolicyOutputs,
    build_loss_terms,
)
from epo_cli.compose import compose
from epo_cli.config import AlgoConfig
from epo_cli.errors import ConfigError

torch.set_num_threads(1)

# Two rows, 5 real tokens (row 1's last position is padding). A = [2, -2] per row.
#   mean A over real tokens = (3*2 + 2*(-2)) / 5 = 0.4  -> A - mean: row 0 1.6, row 1 -2.4
#   logp = row 0 [-0.1, -1.1, -3.1], row 1 [-0.1, -3.1]; mean = -7.5/5 = -1.5
#   logp - mean: row 0 [1.4, 0.4, -1.6], row 1 [1.4, -1.6]
#   cov: row 0 [2.24, 0.64, -2.56], row 1 [-3.36, 3.84]
#   in the Clip-Cov band (1, 5): (0,0) 2.24 and (1,1) 3.84;  KL-Cov's top-1: (1,1), top-2: (1,1), (0,0)
MASK = [[1, 1, 1], [1, 1, 0]]
LOGP = [[-0.1, -1.1, -3.1], [-0.1, -3.1, 0.0]]
ADV = torch.tensor([2.0, -2.0])


def batch(log_ratio=None):
    logp = torch.tensor(LOGP)
    old = logp - (torch.zeros(2, 3) if log_ratio is None else torch.tensor(log_ratio))
    mb = make_mb(MASK, old_logprobs=old, advantages=ADV)
    out_logp = logp.clone().requires_grad_(True)
    return mb, PolicyOutputs(logprobs=out_logp, entropy=torch.zeros(2, 3))


def close(x, expected, atol=1e-5):
    assert torch.allclose(x.detach().double(), torch.tensor(expected, dtype=torch.float64), atol=atol), (x, expected)


def test_clip_cov_detaches_the_in_band_tokens():
    # ratio 0.4: n = max(1, floor(0.4 * 5)) = 2 -> both in-band tokens (0,0) and (1,1) are detached
    # ratio = 1 everywhere: pg = -A, d pg / d logp = -A; token-mean weight 1/5
    #   grad row 0: [-2/5, -2/5, -2/5] with (0,0) detached -> [0, -0.4, -0.4]
    #   grad row 1: [+2/5, +2/5, pad]  with (1,1) detached -> [0.4, 0, 0]
    # the loss value is kept: mean(-A) = -(3*2 - 2*2)/5 = -0.4
    mb, out = batch()
    term = ClipCovLoss(clip_cov_ratio=0.4)
    loss, metrics = term(mb, out)
    loss.backward()
    close(loss, -0.4)
    close(out.logprobs.grad, [[0.0, -0.4, -0.4], [0.4, 0.0, 0.0]])
    close(metrics["policy/cov_clipfrac"], 2 / 5)
    close(metrics["policy/clipfrac"], 0.0)


def test_clip_cov_draws_one_token_with_the_seeded_generator():
    # default ratio 2e-4: n = max(1, floor(2e-4 * 5)) = 1 of the two candidates, in row-major order
    # [(0,0), (1,1)], the one at torch.randperm(2, generator=seed)[0]
    picks = set()
    for seed in range(8):
        mb, out = batch()
        term = ClipCovLoss()
        term.reseed(seed)
        selected = term.select(mb, out, torch.zeros(2, 3, dtype=torch.bool))
        first = int(torch.randperm(2, generator=torch.Generator().manual_seed(seed))[0])
        expected = torch.zeros(2, 3, dtype=torch.bool)
        expected[[(0, 0), (1, 1)][first]] = True
        assert torch.equal(selected, expected), seed
        picks.add(first)
        # the same seed draws the same token again
        term.reseed(seed)
        assert torch.equal(term.select(mb, out, torch.zeros(2, 3, dtype=torch.bool)), expected)
    assert picks == {0, 1}  # both candidates get drawn over seeds: the draw is random, not fixed


def test_clip_cov_skips_tokens_the_ppo_clip_already_clipped():
    # (0,0): log ratio 0.5 -> ratio e^0.5 = 1.6487 > 1 + 0.2 with A = 2 > 0: pg2 = -2.4 > pg1 = -3.297, clipped
    # (its cov is unchanged: cov uses the current logp). Candidates left: (1,1) only, so with ratio 0.4
    # (n = 2) only (1,1) is detached.  Gradients: (0,0) clipped -> 0; (1,1) detached -> 0; others -A/5.
    mb, out = batch(log_ratio=[[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss, metrics = ClipCovLoss(clip_cov_ratio=0.4)(mb, out)
    loss.backward()
    close(out.logprobs.grad, [[0.0, -0.4, -0.4], [0.4, 0.0, 0.0]])
    close(metrics["policy/cov_clipfrac"], 1 / 5)
    close(metrics["policy/clipfrac"], 1 / 5)
    # value: (-2.4 - 2 - 2 + 2 + 2) / 5 = -0.48
    close(loss, -0.48)


def test_clip_cov_without_candidates_is_the_ppo_clip():
    # a band no token reaches: Clip-Cov equals policy_clip in value and gradient
    mb, out = batch(log_ratio=[[0.5, 0.0, 0.0], [0.0, -0.3, 0.0]])
    loss, _ = ClipCovLoss(clip_cov_lb=10.0, clip_cov_ub=20.0)(mb, out)
    loss.backward()
    mb2, out2 = batch(log_ratio=[[0.5, 0.0, 0.0], [0.0, -0.3, 0.0]])
    ref, _ = PolicyClipLoss()(mb2, out2)
    ref.backward()
    close(loss, float(ref.detach()))
    close(out.logprobs.grad, out2.logprobs.grad.tolist())


def test_kl_cov_penalises_the_top_covariance_token():
    # log ratio (0,0) = +0.1, (1,1) = -0.2, else 0; kl_cov_ratio 2e-3: k = max(1, floor(0.01)) = 1 -> (1,1)
    # ratio: (0,0) e^0.1 = 1.105171, (1,1) e^-0.2 = 0.818731, others 1
    # pg = -A * ratio + 1.0 * |log ratio| on (1,1):
    #   row 0: -2.210342, -2, -2;  row 1: 2, 2 * 0.818731 + 0.2 = 1.837462
    #   loss = (-2.210342 - 2 - 2 + 2 + 1.837462) / 5 = -2.37288 / 5 = -0.474576
    # d/dlogp: -A * ratio, plus sign(log ratio) = -1 at (1,1):
    #   row 0: [-2.210342, -2, -2] / 5 = [-0.442068, -0.4, -0.4]
    #   row 1: [2 / 5, (1.637462 - 1) / 5] = [0.4, 0.127492]
    mb, out = batch(log_ratio=[[0.1, 0.0, 0.0], [0.0, -0.2, 0.0]])
    loss, metrics = KLCovLoss()(mb, out)
    loss.backward()
    close(loss, -0.474576)
    close(out.logprobs.grad, [[-0.442068, -0.4, -0.4], [0.4, 0.127492, 0.0]])
    close(metrics["policy/kl_cov_frac"], 1 / 5)
    close(metrics["policy/kl_cov_penalty"], 0.2 / 5)


def test_kl_cov_top_two_with_a_smaller_coefficient():
    # kl_cov_ratio 0.4: k = 2 -> (1,1) and (0,0); ppo_kl_coef 0.5
    #   grad (0,0) = (-2.210342 + 0.5 * sign(0.1)) / 5 = -1.710342 / 5 = -0.342068
    #   grad (1,1) = (1.637462 + 0.5 * sign(-0.2)) / 5 = 1.137462 / 5 = 0.227492
    mb, out = batch(log_ratio=[[0.1, 0.0, 0.0], [0.0, -0.2, 0.0]])
    loss, metrics = KLCovLoss(kl_cov_ratio=0.4, ppo_kl_coef=0.5)(mb, out)
    loss.backward()
    close(out.logprobs.grad, [[-0.342068, -0.4, -0.4], [0.4, 0.227492, 0.0]])
    close(metrics["policy/kl_cov_frac"], 2 / 5)


def test_policy_loss_registry_and_builder():
    assert POLICY_LOSSES.names() == ["clip", "clip_cov", "kl_cov"]
    algo = AlgoConfig(loss_terms=["policy_clip", "kl"])
    for name, cls in (("clip", PolicyClipLoss), ("clip_cov", ClipCovLoss), ("kl_cov", KLCovLoss)):
        algo.policy_loss = name
        assert type(build_loss_terms(algo)["policy_clip"]) is cls
    algo.policy_loss = "clip_cov"
    algo.policy_clip.clip_cov_ratio, algo.policy_clip.clip_cov_lb, algo.policy_clip.clip_cov_ub = 0.01, 0.5, 2.0
    terms = build_loss_terms(algo)
    term = terms["policy_clip"]
    assert (term.clip_cov_ratio, term.clip_cov_lb, term.clip_cov_ub) == (0.01, 0.5, 2.0)
    stack = LossStack(terms)
    stack.reseed(5)
    assert torch.equal(term.generator.get_state(), torch.Generator().manual_seed(5).get_state())


def test_cov_configs():
    cfg = compose(["algo=grpo", "algo.policy_loss=clip_cov"])
    assert cfg.algo.policy_clip.clip_cov_ratio == 2e-4 and cfg.algo.policy_clip.clip_cov_lb == 1.0
    assert cfg.algo.policy_clip.clip_cov_ub == 5.0
    with pytest.warns(UserWarning, match="no ratio clip"):
        cfg = compose(["algo=grpo", "algo.policy_loss=kl_cov"])
    assert cfg.algo.policy_clip.kl_cov_ratio == 2e-3 and cfg.algo.policy_clip.ppo_kl_coef == 1.0


@pytest.mark.parametrize("overrides,needle", [
    (["algo=grpo", "algo.policy_loss=clipcov"], "Did you mean 'clip_cov'"),
    (["algo=sft", "algo.policy_loss=clip_cov"], "not in algo.loss_terms"),
    (["algo=grpo", "algo.policy_loss=clip_cov", "algo.policy_clip.clip_cov_ratio=0"], "0 < value <= 1"),
    (["algo=grpo", "algo.policy_loss=clip_cov", "algo.policy_clip.clip_cov_lb=6"], "must be < clip_cov_ub"),
    (["algo=grpo", "algo.policy_loss=kl_cov", "algo.policy_clip.kl_cov_ratio=2"], "0 < value <= 1"),
    (["algo=grpo", "algo.policy_loss=kl_cov", "algo.policy_clip.ppo_kl_coef=-1"], "0 <= value"),
])
def test_bad_cov_config_is_one_clear_error(overrides, needle):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_a_non_finite_log_prob_at_padding_changes_no_selection(bad):
    # row 1's last position is padding; a masked log-softmax can leave anything there. The covariance
    # means run over real tokens only, so the selections stay those of the clean batch: Clip-Cov's two
    # in-band tokens (0,0) and (1,1) (the old (x * mask).sum() made every covariance NaN: no candidate at
    # all), and KL-Cov's top-1 (1,1) (with NaN covariances topk picked a wrong token).
    mb, out = batch()
    with torch.no_grad():
        out.logprobs[1, 2] = bad
    clip_cov = ClipCovLoss(clip_cov_ratio=0.4)
    expected = torch.tensor([[True, False, False], [False, True, False]])
    assert torch.equal(clip_cov.select(mb, out, torch.zeros(2, 3, dtype=torch.bool)), expected)
    assert torch.equal(KLCovLoss().select(mb, out), torch.tensor([[False, False, False], [False, True, False]]))
    loss, metrics = clip_cov(mb, out)
    close(loss, -0.4)  # the value of the clean batch (test_clip_cov_detaches_the_in_band_tokens)
    close(metrics["policy/cov_clipfrac"], 2 / 5)
