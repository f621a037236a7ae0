"""The sampler: counter-based noise and inverse-CDF sampling against the distributions they must draw from.

Every draw here is a function of (seed, token position), so these tests are deterministic; the tolerances are
chi-square critical values at p = 0.001, which a correct sampler passes for all but ~1 in 1000 seed sets and
a sampler off by a token, a temperature or a renormalisation fails by orders of magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch

from epo_cli.errors import UserError
from epo_cli.rollout.generation import SamplingConfig, counter_uniforms, sample_next, seed_keys

CPU = torch.device("cpu")
#: chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 7: 24.32, 19: 43.82}


def chi_square(counts: list[int], expected_probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected_probs))


def draw(logits_row: list[float], params: SamplingConfig, n: int, position: int = 0) -> torch.Tensor:
    """n samples of one distribution: n rows with seeds 0..n-1 at `position`."""
    logits = torch.tensor([logits_row] * n)
    return sample_next(logits, params, counter_uniforms(seed_keys(list(range(n)), CPU), position))


def test_greedy_is_argmax_whatever_the_noise() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    uniforms = torch.tensor([0.999, 0.001], dtype=torch.float64)
    assert sample_next(logits, SamplingConfig(temperature=0), uniforms).tolist() == [1, 0]
    assert sample_next(logits, SamplingConfig(temperature=0), None).tolist() == [1, 0]


def test_inverse_cdf_picks_the_token_whose_cumulative_mass_holds_the_uniform() -> None:
    # probabilities 0.1, 0.2, 0.3, 0.4 (logits = their logs): cumulative 0.1, 0.3, 0.6, 1.0
    logits = torch.tensor([[math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]] * 6)
    uniforms = torch.tensor([0.05, 0.1001, 0.2999, 0.31, 0.61, 1 - 1e-16], dtype=torch.float64)
    assert sample_next(logits, SamplingConfig(temperature=1.0), uniforms).tolist() == [0, 1, 1, 2, 3, 3]


def test_a_zero_probability_token_is_never_drawn_even_at_the_edges() -> None:
    # token 3 is masked (-inf): a uniform at the very top must still land on token 2, the last possible one
    logits = torch.tensor([[0.0, 0.0, 0.0, float("-inf")]] * 3)
    uniforms = torch.tensor([1e-17, 0.5, 1.0 - 2 ** -53], dtype=torch.float64)
    assert sample_next(logits, SamplingConfig(temperature=1.0), uniforms).tolist() == [0, 1, 2]


def test_uniforms_depend_only_on_the_row_seed_and_the_position() -> None:
    together = counter_uniforms(seed_keys([5, 7, 2**40 + 7, 9], CPU), 3)
    alone = counter_uniforms(seed_keys([7], CPU), 3)
    assert together[1].item() == alone[0].item()
    assert together[1].item() != together[2].item()  # the seed's high bits count
    assert counter_uniforms(seed_keys([7], CPU), 4).item() != alone.item()
    assert together.dtype == torch.float64 and bool(((together > 0) & (together < 1)).all())


def test_uniforms_are_uniform_and_uncorrelated_across_seeds_and_positions() -> None:
    keys = seed_keys(list(range(400)), CPU)
    grid = torch.stack([counter_uniforms(keys, t) for t in range(100)], dim=1)  # [seed, position]
    counts = torch.histc(grid.float(), bins=20, min=0, max=1).long().tolist()
    assert chi_square(counts, [0.05] * 20) < CHI2_999[19]
    # neighbours in position and in seed: correlation ~ N(0, 1/sqrt(n)), n ~ 40000: |r| < 0.02 is 4 sigma
    by_position = torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1]
    by_seed = torch.corrcoef(torch.stack([grid[:-1].flatten(), grid[1:].flatten()]))[0, 1]
    assert abs(by_position.item()) < 0.02 and abs(by_seed.item()) < 0.02
    assert grid.flatten().unique().numel() == grid.numel()


def test_temperature_sampling_matches_the_softmax() -> None:
    logits = [1.0, 0.0, -0.5, 2.0, 0.3]
    temperature = 0.7
    weights = [math.exp(x / temperature) for x in logits]  # by hand: softmax(logits / T)
    expected = [w / sum(weights) for w in weights]
    samples = draw(logits, SamplingConfig(temperature=temperature), 20000, position=5)
    counts = torch.bincount(samples, minlength=5).tolist()
    assert chi_square(counts, expected) < CHI2_999[4]


def test_top_k_never_samples_outside_the_k_and_renormalises_inside() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=generator).tolist()
    k = 4
    top = sorted(range(40), key=lambda i: -logits[i])[:k]
    samples = draw(logits, SamplingConfig(temperature=1.0, top_k=k), 20000)
    assert set(samples.tolist()) == set(top)
    weights = [math.exp(logits[i]) for i in top]
    counts = torch.bincount(samples, minlength=40)[top].tolist()
    assert chi_square(counts, [w / sum(weights) for w in weights]) < CHI2_999[k - 1]


@pytest.mark.parametrize(("top_p", "kept"), [(0.45, [0]), (0.75, [0, 1]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_exactly_the_smallest_set_reaching_p(top_p: float, kept: list[int]) -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 (shuffled in the vocabulary); cumulative 0.5, 0.8, 0.95, 1.0:
    # the kept set is the most likely tokens up to and including the one whose mass crosses p
    probs = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
    order = [2, 0, 3, 1]  # by probability
    logits = [math.log(probs[i]) for i in range(4)]
    samples = draw(logits, SamplingConfig(temperature=1.0, top_p=top_p), 20000, position=1)
    kept_ids = [order[i] for i in kept]
    assert set(samples.tolist()) == set(kept_ids)
    if len(kept_ids) > 1:
        mass = sum(probs[i] for i in kept_ids)
        counts = torch.bincount(samples, minlength=4)[kept_ids].tolist()
        assert chi_square(counts, [probs[i] / mass for i in kept_ids]) < CHI2_999[len(kept_ids) - 1]


def test_vocab_limited_logits_draw_only_below_the_limit() -> None:
    # generate slices the logits to the vocabulary limit before sampling; the sampler never indexes past them
    logits = torch.zeros(5000, 10)
    logits[:, 8:] = 50.0  # the padded vocabulary would win every draw
    samples = sample_next(logits[:, :8], SamplingConfig(temperature=1.0),
                          counter_uniforms(seed_keys(list(range(5000)), CPU), 0))
    assert int(samples.max()) <= 7
    assert chi_square(torch.bincount(samples, minlength=8).tolist(), [1 / 8] * 8) < CHI2_999[7]


def test_without_seeds_the_global_rng_draws() -> None:
    logits = torch.zeros(64, 10)
    torch.manual_seed(3)
    a = sample_next(logits, SamplingConfig(temperature=1.0), None)
    torch.manual_seed(3)
    b = sample_next(logits, SamplingConfig(temperature=1.0), None)
    assert a.tolist() == b.tolist() and len(set(a.tolist())) > 3


def test_nonfinite_logits_are_refused_only_for_checked_rows() -> None:
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [float("inf"), 0.0]])
    for temperature in (1.0, 0.0):
        params = SamplingConfig(temperature=temperature)
        with pytest.raises(UserError, match="nan or inf"):
            sample_next(logits[:2], params, None)
        # finished rows (check=False) are ignored: their samples are never used
        tokens = sample_next(logits[:2], params, None, check=torch.tensor([True, False]))
        assert 0 <= int(tokens[1]) <= 1
    with pytest.raises(UserError, match="nan or inf"):
        sample_next(logits[2:], SamplingConfig(temperature=1.0), None)
