"""Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617) against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from test_losses import make_mb

from epo_cli.algos.cov_selection import mini_batch_selection, selection_count
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
    # the log-ratio as the update sets it beside the forward (PolicyUpdate.train_micro_batch)
    return mb, PolicyOutputs(logprobs=out_logp, entropy=torch.zeros(2, 3), log_ratio=out_logp - old)


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


def test_clip_cov_draws_its_token_at_random_with_the_seed():
    # ratio 0.2: n = 0.2 * 5 = 1 token, drawn among the two in-band candidates (0,0) and (1,1)
    candidates = [torch.zeros(2, 3, dtype=torch.bool) for _ in range(2)]
    candidates[0][0, 0] = candidates[1][1, 1] = True
    picks = []
    for seed in range(12):
        mb, out = batch()
        term = ClipCovLoss(clip_cov_ratio=0.2)
        term.reseed(seed)
        selected = term.select(mb, out)
        assert any(torch.equal(selected, c) for c in candidates), (seed, selected)
        term.reseed(seed)  # the same seed draws the same token again
        assert torch.equal(term.select(mb, out), selected)
        picks.append(int(selected[1, 1]))
    assert set(picks) == {0, 1}  # both candidates get drawn over seeds: the draw is random, not fixed


def test_the_count_is_the_ratio_in_expectation():
    # 0.3 * 5 tokens = 1.5: one token, plus a second with probability 0.5 (no floor of one token per
    # micro-batch as verl's max(1, floor(r * N))); KL-Cov takes the top ones: (1,1), then (0,0)
    top1 = torch.tensor([[False, False, False], [False, True, False]])
    top2 = torch.tensor([[True, False, False], [False, True, False]])
    counts = []
    for seed in range(200):
        mb, out = batch()
        term = KLCovLoss(kl_cov_ratio=0.3)
        term.reseed(seed)
        selected = term.select(mb, out)
        assert torch.equal(selected, top1) or torch.equal(selected, top2)
        counts.append(int(selected.sum()))
    # mean of 200 draws of 1 + Bernoulli(0.5): 1.5 +- 0.035 (one standard deviation)
    assert set(counts) == {1, 2} and abs(sum(counts) / len(counts) - 1.5) < 0.15
    assert selection_count(0.3, 5, 7) in (1, 2) and selection_count(0.4, 5, 7) == 2  # 0.4 * 5 = 2 exactly
    assert selection_count(2e-4, 640, 3) in (0, 1)  # 0.128 expected: mostly none, where verl took one


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
    # log ratio (0,0) = +0.1, (1,1) = -0.2, else 0; kl_cov_ratio 0.2: k = 0.2 * 5 = 1 -> (1,1)
    # ratio: (0,0) e^0.1 = 1.105171, (1,1) e^-0.2 = 0.818731, others 1
    # pg = -A * ratio + 1.0 * |log ratio| on (1,1):
    #   row 0: -2.210342, -2, -2;  row 1: 2, 2 * 0.818731 + 0.2 = 1.837462
    #   loss = (-2.210342 - 2 - 2 + 2 + 1.837462) / 5 = -2.37288 / 5 = -0.474576
    # d/dlogp: -A * ratio, plus sign(log ratio) = -1 at (1,1):
    #   row 0: [-2.210342, -2, -2] / 5 = [-0.442068, -0.4, -0.4]
    #   row 1: [2 / 5, (1.637462 - 1) / 5] = [0.4, 0.127492]
    mb, out = batch(log_ratio=[[0.1, 0.0, 0.0], [0.0, -0.2, 0.0]])
    loss, metrics = KLCovLoss(kl_cov_ratio=0.2)(mb, out)
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
    assert term.seed == 5 and stack.token_selector() is term
    assert LossStack(build_loss_terms(AlgoConfig(loss_terms=["policy_clip", "kl"]))).token_selector() is None


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
    assert torch.equal(clip_cov.select(mb, out), expected)
    assert torch.equal(KLCovLoss(kl_cov_ratio=0.2).select(mb, out),
                       torch.tensor([[False, False, False], [False, True, False]]))
    loss, metrics = clip_cov(mb, out)
    close(loss, -0.4)  # the value of the clean batch (test_clip_cov_detaches_the_in_band_tokens)
    close(metrics["policy/cov_clipfrac"], 2 / 5)


# ---- the choice spans the whole mini-batch: micro-batch split and ranks do not change it -----------------------

#: a mini-batch of 8 samples: response lengths, advantages, and per-token (log-prob, log ratio to the old
#: policy), drawn once from a fixed seed; some log ratios are large, so the PPO clip bounds some tokens
LENGTHS = [3, 7, 1, 5, 6, 2, 8, 4]


def mini_batch_data():
    g = torch.Generator().manual_seed(11)
    adv = torch.randn(len(LENGTHS), generator=g)
    logp = [-3 * torch.rand(k, generator=g) for k in LENGTHS]
    log_ratio = [0.4 * torch.randn(k, generator=g) for k in LENGTHS]
    return adv, logp, log_ratio


def passes(rows, split):
    """(rows, micro-batch, current log-probs) of `rows` cut into `split` micro-batches."""
    adv, logp, log_ratio = mini_batch_data()
    size = -(-len(rows) // split)
    for part in [rows[i:i + size] for i in range(0, len(rows), size)]:
        R = max(LENGTHS[r] for r in part)
        mask = torch.zeros(len(part), R, dtype=torch.bool)
        cur = torch.zeros(len(part), R)
        old = torch.zeros(len(part), R)
        for i, r in enumerate(part):
            k = LENGTHS[r]
            mask[i, :k] = True
            cur[i, :k] = logp[r]
            old[i, :k] = logp[r] - log_ratio[r]
        yield part, make_mb(mask, old_logprobs=old, advantages=adv[part]), cur


SELECTORS = {
    # Clip-Cov with a band most tokens reach, and KL-Cov: 36 real tokens, ratio 0.25 -> 9 tokens exactly
    "clip_cov": lambda: ClipCovLoss(clip_cov_ratio=0.25, clip_cov_lb=-10.0, clip_cov_ub=10.0),
    "kl_cov": lambda: KLCovLoss(kl_cov_ratio=0.25),
}


def chosen_tokens(selector, rows, split, reduce=None, gather=None) -> set[tuple[int, int]]:
    chosen = mini_batch_selection(selector, passes(rows, split), lambda r: (r, 0), seed=123,
                                  all_reduce_sum=reduce, all_gather=gather)
    return {(r, pos) for r, mask in chosen.items() for pos in torch.nonzero(mask).flatten().tolist()}


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_the_same_mini_batch_split_1_2_4_ways_selects_the_same_tokens(name):
    rows = list(range(len(LENGTHS)))
    whole = chosen_tokens(SELECTORS[name](), rows, 1)
    assert len(whole) == 9  # 0.25 x 36 tokens: the share is the ratio
    for split in (2, 4):
        assert chosen_tokens(SELECTORS[name](), rows, split) == whole
        # the order of the rows does not matter either (a rank's micro-batches are sorted by length)
        assert chosen_tokens(SELECTORS[name](), rows[::-1], split) == whole
    # KL-Cov's choice is the top 9 covariances of the mini-batch, by hand from the definition
    if name == "kl_cov":
        adv, logp, _ = mini_batch_data()
        mean_a = sum(float(a) * k for a, k in zip(adv, LENGTHS)) / 36
        mean_lp = float(torch.cat(logp).double().sum()) / 36
        cov = sorted(((float(adv[r]) - mean_a) * (float(x) - mean_lp), r, pos)
                     for r in rows for pos, x in enumerate(logp[r].double()))
        assert whole == {(r, pos) for _, r, pos in cov[-9:]}
    # choosing per micro-batch (each alone: verl's scheme, the trainer's before) depends on the split
    per_micro = set()
    for part, mb, cur in passes(rows, 4):
        term = SELECTORS[name]()
        term.reseed(123)
        mask = term.select(mb, PolicyOutputs(logprobs=cur, entropy=torch.zeros_like(cur)))
        per_micro |= {(part[i], pos) for i, pos in torch.nonzero(mask).tolist()}
    assert per_micro != whole


def _rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import json
    import os

    import torch.distributed as dist

    from epo_cli.training.engine import all_gather_objects, all_reduce_sum

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mine = list(range(len(LENGTHS)))[rank::world]  # each rank holds every other sample
        chosen = {name: sorted(chosen_tokens(make(), mine, 2, all_reduce_sum, all_gather_objects))
                  for name, make in SELECTORS.items()}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(chosen, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_select_what_one_rank_selects(tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for name, make in SELECTORS.items():
        both = {tuple(x) for r in (0, 1) for x in json.loads((tmp_path / f"rank{r}.json").read_text())[name]}
        assert len(both) == 9 and both == chosen_tokens(make(), list(range(len(LENGTHS))), 1), name
