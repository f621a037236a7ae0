"""Schedules against hand-computed values (arithmetic in the comments)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from epo_cli.algos.schedules import (
    KL_SCHEDULES,
    SCHEDULES,
    WEIGHTS,
    build_entropy_schedule,
    build_kl_schedule,
    build_lr_schedule,
    build_phase_schedule,
    schedule_parameters,
)
from epo_cli.config import AlgoConfig, EntropyConfig, KLConfig, PhaseConfig

torch.set_num_threads(1)


def test_registry_names():
    # one registry serves lambda and beta_k; the KL weight's names are its own
    assert set(SCHEDULES.names()) == {"constant", "linear", "cosine", "exp_anneal", "two_phase", "adaptive_target",
                                      "delayed_linear", "paper", "warmup_cosine"}
    assert set(KL_SCHEDULES) == {"constant", "phase_kl_ramp"}
    # a section can use the schedules whose parameters it holds: the entropy group has no gamma (paper) nor
    # warm-up keys; algo.phase has no decay_rate (exp_anneal) nor adaptive_target's keys
    assert set(WEIGHTS["lam"].choices()) == {
        "constant", "linear", "cosine", "exp_anneal", "two_phase", "adaptive_target", "delayed_linear"}
    assert set(WEIGHTS["beta"].choices()) == {"paper", "constant", "two_phase", "linear", "cosine", "delayed_linear"}
    assert WEIGHTS["kl"].choices() == ["constant", "phase_kl_ramp"]
    # each KL schedule's parameters are in the section its entry names: algo.kl.coef, algo.phase's KL ramp
    assert [WEIGHTS["kl"].section(name) for name in ("constant", "phase_kl_ramp")] == ["algo.kl", "algo.phase"]
    assert schedule_parameters("phase_kl_ramp", KL_SCHEDULES) == ["kl_start", "kl_end", "exploration_share"]


def test_a_section_holds_a_schedules_parameters_under_its_argument_names():
    # linear start 0.1 -> end 0.5: step 5 of 10 -> 0.3, in algo.phase as in the entropy group
    assert build_phase_schedule(PhaseConfig(schedule="linear", start=0.1, end=0.5))(5, 10) == pytest.approx(0.3)
    assert build_entropy_schedule(EntropyConfig(schedule="linear", start=0.1, end=0.5))(5, 10) == pytest.approx(0.3)
    for weight in WEIGHTS.values():  # every parameter of every schedule a section can name is a key there
        for name in weight.choices():
            section = {"entropy": EntropyConfig, "algo.phase": PhaseConfig, "algo.kl": KLConfig}[weight.section(name)]
            assert set(schedule_parameters(name, weight.registry)) <= set(section.__dataclass_fields__)


# ------------------------------------------------------------------------------------------- beta_k


@pytest.mark.parametrize("K", [150, 20])
def test_paper_phase_even_K(K):
    # beta_k = 1 + exp(-3 k / (K/2)): k = 0 -> 1 + e^0 = 2; k = K/2 -> 1 + e^-3; k = K -> 1 + e^-6
    beta = build_phase_schedule(PhaseConfig(schedule="paper", gamma=3.0))
    assert beta(0, K) == 2.0
    assert beta(K // 2, K) == pytest.approx(1 + math.exp(-3))  # ~1.0498
    assert beta(K, K) == pytest.approx(1 + math.exp(-6))  # ~1.0025


def test_paper_phase_odd_and_tiny_K():
    beta = build_phase_schedule(PhaseConfig(schedule="paper", gamma=3.0))
    # K = 151: floor(151/2) = 75, so k = 75 gives 1 + e^-3
    assert beta(75, 151) == pytest.approx(1 + math.exp(-3))
    # K = 1: floor(1/2) = 0 -> use 1: k = 1 gives 1 + e^-3
    assert beta(1, 1) == pytest.approx(1 + math.exp(-3))


def test_constant_phase():
    assert build_phase_schedule(PhaseConfig(schedule="constant", coef=1.5))(37, 100) == 1.5


# ---------------------------------------------------------------------------------------- two-phase

# the source article: beta 0.1 -> 0.5 over the first 30%, then 0.5 -> 0.2; KL 0, then 0.2 -> 0.8
ARTICLE = PhaseConfig(
    schedule="two_phase",
    exploration_share=0.3,
    start=0.1,
    peak=0.5,
    end=0.2,
    kl_start=0.2,
    kl_end=0.8,
)


@pytest.mark.parametrize(
    "step, beta, kl",
    [
        (0, 0.1, 0.0),  # start
        (15, 0.3, 0.0),  # p 0.15: 0.1 + 0.4 * 0.15/0.3 = 0.3; still exploring: KL 0
        (30, 0.5, 0.2),  # p 0.3: peak; the second phase starts at kl_start
        (65, 0.35, 0.5),  # p 0.65: 0.5 - 0.3 * 0.35/0.7 = 0.35; KL 0.2 + 0.6 * 0.5 = 0.5
        (100, 0.2, 0.8),  # end
    ],
)
def test_two_phase_article_numbers(step, beta, kl):
    assert build_phase_schedule(ARTICLE)(step, 100) == pytest.approx(beta)
    kl_weight = build_kl_schedule(AlgoConfig(kl=KLConfig(schedule="phase_kl_ramp"), phase=ARTICLE))
    assert kl_weight(step, 100) == pytest.approx(kl)


def test_constant_kl_coefficient():
    assert build_kl_schedule(AlgoConfig(kl=KLConfig(coef=0.01), phase=ARTICLE))(5, 100) == 0.01


# ---------------------------------------------------------------------------------- entropy schedules


def test_constant_entropy():
    s = build_entropy_schedule(EntropyConfig(schedule="constant", coef=0.001))
    assert s(0, 10) == s(10, 10) == 0.001


def test_linear_entropy():
    # 0.01 -> 0 over 10 steps: step 2 -> 0.01 * 0.8 = 0.008; step 5 -> 0.005; step 10 -> 0
    s = build_entropy_schedule(EntropyConfig(schedule="linear", start=0.01, end=0.0))
    assert [s(k, 10) for k in (0, 2, 5, 10)] == pytest.approx([0.01, 0.008, 0.005, 0.0])


def test_cosine_entropy():
    # end + (start - end)(1 + cos(pi p))/2: p 0.2 -> 0.005 * (1 + 0.8090170) = 0.0090451; p 0.5 -> 0.005
    s = build_entropy_schedule(EntropyConfig(schedule="cosine", start=0.01, end=0.0))
    assert [s(k, 10) for k in (0, 2, 5, 10)] == pytest.approx([0.01, 0.0090451, 0.005, 0.0], abs=1e-7)


def test_exp_anneal_entropy():
    # start * 0.1 ** p: p 0.5 -> 0.01 * 0.3162278 = 0.0031623; p 1 -> 0.001; floored at end
    s = build_entropy_schedule(EntropyConfig(schedule="exp_anneal", start=0.01, decay_rate=0.1, end=0.0005))
    assert [s(k, 10) for k in (0, 5, 10)] == pytest.approx([0.01, 0.0031623, 0.001], abs=1e-7)
    floored = build_entropy_schedule(
        EntropyConfig(schedule="exp_anneal", start=0.01, decay_rate=0.1, end=0.002)
    )
    assert floored(10, 10) == 0.002


def test_two_phase_entropy():
    # 0.001 -> 0.005 over 30%, then -> 0: p 0.05 -> 0.001 + 0.004/6 = 0.0016667; p 0.3 -> 0.005;
    # p 0.65 -> 0.005 - 0.005 * 0.5 = 0.0025; p 1 -> 0
    s = build_entropy_schedule(
        EntropyConfig(schedule="two_phase", start=0.001, peak=0.005, end=0.0, exploration_share=0.3)
    )
    assert [s(k, 20) for k in (0, 1, 6, 13, 20)] == pytest.approx(
        [0.001, 0.0016667, 0.005, 0.0025, 0.0], abs=1e-7
    )


def test_adaptive_target_moves_and_round_trips():
    cfg = EntropyConfig(
        schedule="adaptive_target", coef=0.01, target=0.5, adapt_lr=0.1, min_coef=0.0, max_coef=0.011
    )
    s = build_entropy_schedule(cfg)
    assert s(0, 10) == 0.01
    # H = 0.25 below target: coef * exp(0.1 * (0.5 - 0.25)/0.5) = 0.01 * e^0.05 = 0.0105127 (up)
    s.observe(0.25)
    assert s(1, 10) == pytest.approx(0.01 * math.exp(0.05))
    # H = 1.0 above target: * exp(0.1 * (0.5 - 1)/0.5) = * e^-0.1 -> 0.01 * e^-0.05 = 0.0095123 (down)
    s.observe(1.0)
    assert s(2, 10) == pytest.approx(0.01 * math.exp(-0.05))
    state = json.loads(json.dumps(s.state_dict()))
    restored = build_entropy_schedule(cfg)
    restored.load_state_dict(state)
    assert restored(3, 10) == s(3, 10)
    # H = 0: * e^0.1 -> 0.0095123 * 1.1051709 = 0.0105127, then again -> 0.0116 > max: clipped at 0.011
    s.observe(0.0)
    s.observe(0.0)
    assert s(4, 10) == 0.011


def test_stateless_schedules_share_the_interface():
    s = build_entropy_schedule(EntropyConfig(schedule="linear"))
    s.observe(0.3)  # no-op
    assert s.state_dict() == {}


# ---------------------------------------------------------------------------------------------- lr


def lr_multiplier(step: int, total: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    return build_lr_schedule(AlgoConfig(warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio))(step, total)


def test_lr_multiplier_by_hand():
    # total 12, warmup 0.25 -> W = 3: steps 0, 1, 2 -> 1/3, 2/3, 1
    # then cosine over steps 3..11 (8 intervals): step 3 -> 1; step 7 -> p 0.5 -> 0.2 + 0.8 * 0.5 = 0.6;
    # step 11 (the last) -> 0.2
    got = [lr_multiplier(k, 12, 0.25, 0.2) for k in (0, 1, 2, 3, 7, 11)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 0.6, 0.2])


def test_lr_warmup_length_is_robust_to_float_error():
    # 0.07 * 100 = 7.000000000000001 in floating point; W must still be 7, so step 6 -> 7/7 = 1
    assert lr_multiplier(6, 100, 0.07, 0.2) == 1.0
    # no warm-up: step 0 starts the cosine at 1
    assert lr_multiplier(0, 100, 0.0, 0.2) == 1.0


def test_max_value_by_hand():
    """max_value: the largest value over a run (EPO's alpha * max beta_k check reads it at config time)."""
    K = 10
    assert SCHEDULES.build("paper", gamma=3.0).max_value(K) == 2.0  # beta_0 = 1 + exp(0)
    assert SCHEDULES.build("constant", coef=0.7).max_value(K) == 0.7
    assert SCHEDULES.build("linear", start=0.2, end=0.5).max_value(K) == 0.5
    assert SCHEDULES.build("cosine", start=0.5, end=0.1).max_value(K) == 0.5
    assert SCHEDULES.build("exp_anneal", start=0.005, decay_rate=0.1, end=0.0001).max_value(K) == 0.005
    assert SCHEDULES.build("two_phase", start=0.1, peak=0.5, end=0.2, exploration_share=0.3).max_value(K) == 0.5
    assert SCHEDULES.build("delayed_linear", start=0.2, end=0.8, exploration_share=0.3).max_value(K) == 0.8
    # feedback may raise coef up to max_coef
    assert SCHEDULES.build("adaptive_target", coef=0.001, target=0.5, adapt_lr=0.1, min_coef=0.0,
                           max_coef=0.05).max_value(K) == 0.05
    assert SCHEDULES.build("warmup_cosine", warmup_ratio=0.1, min_lr_ratio=0.2).max_value(K) == 1.0


def test_default_max_value_evaluates_every_step():
    from epo_cli.algos.schedules import Schedule

    class Down(Schedule):
        def __call__(self, step: int, total_steps: int) -> float:
            return 3.0 * (1 - step / total_steps)  # steps 0..4 of 4: 3, 2.25, 1.5, 0.75, 0

    assert Down().max_value(4) == 3.0
