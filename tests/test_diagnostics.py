"""Collapse diagnostics (collapse/* metrics, the collapse alert) against values computed by hand."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from epo_cli.algos.diagnostics import (
    advantage_signal,
    alert_crossings,
    collapse_reasons,
    corridor_counts,
    cross_prompt_mi,
    group_return_std,
    measured_signals,
    state_diversity,
)
from epo_cli.compose import compose
from epo_cli.config import DiagnosticsConfig
from epo_cli.errors import ConfigError
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rundir.folder import read_status, record_alert, write_status
from epo_cli.training.collapse import PairScorer, collapse_alert, mi_subsample, mutual_information

torch.set_num_threads(1)


# ---- mutual information ------------------------------------------------------------------------------------

def test_cross_prompt_mi_by_hand():
    # logp[i, j] = log p(y_i | x_j); |y| = 2, 1, 3 tokens
    #   i = 0: log p(y0|x0) = -1; others -2, -3: log((e^-2 + e^-3) / 2) = log(0.092561) = -2.379885
    #          -> -1 + 2.379885 = 1.379885
    #   i = 1: -2; others -4, -4 -> log mean = -4 -> 2
    #   i = 2: -1; others -1, -1 -> 0 (this response does not depend on its prompt)
    #   MI = (1.379885 + 2 + 0) / (2 + 1 + 3) = 0.563314 nats per token
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -2.0, -4.0], [-1.0, -1.0, -1.0]])
    assert cross_prompt_mi(logp, torch.tensor([2, 1, 3])) == pytest.approx(0.563314, abs=1e-6)
    # no dependence at all: every column the same -> exactly 0
    same = torch.tensor([[-3.0] * 4, [-1.5] * 4, [-7.0] * 4, [-2.0] * 4])
    assert cross_prompt_mi(same, torch.tensor([1, 2, 3, 4])) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="at least 2"):
        cross_prompt_mi(torch.zeros(1, 1), torch.tensor([1]))


VOCAB = 8


class ToyPolicy(nn.Module):
    """A causal LM stand-in: the same next-token logits at every position of a row, either a fixed vector
    (`copy=False`: ignores its input) or 5 x one-hot of the row's first real token (`copy=True`: answers with
    its prompt's first token)."""

    def __init__(self, copy: bool) -> None:
        super().__init__()
        self.copy = copy
        self.bias = nn.Parameter(torch.linspace(-1.0, 1.0, VOCAB))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=None, **_):
        B, L = input_ids.shape
        keep = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else L
        if self.copy:
            first = attention_mask.long().argmax(-1)  # [B] first attended (real) position
            token = input_ids[torch.arange(B), first]  # [B]
            logits = 5.0 * torch.nn.functional.one_hot(token, VOCAB).float()  # [B, V]
        else:
            logits = self.bias.expand(B, VOCAB)
        return SimpleNamespace(logits=logits[:, None, :].expand(B, keep, VOCAB))


def toy_batch(n: int = 4) -> TurnBatch:
    """Sample i: prompt [i+1, 0, 0, ...] (its own first token), response [i+1, i+1]: what the copying policy
    would answer. Trajectories 10+i, one turn each."""
    return TurnBatch(
        prompt_ids=[[i + 1] + [0] * i for i in range(n)], response_ids=[[i + 1, i + 1] for i in range(n)],
        traj_id=torch.arange(10, 10 + n), group_id=torch.zeros(n, dtype=torch.long),
        turn_index=torch.zeros(n, dtype=torch.long), num_turns=torch.ones(n, dtype=torch.long),
        reward=torch.zeros(n), outcome=torch.zeros(n), valid=torch.ones(n, dtype=torch.bool),
        won=torch.zeros(n, dtype=torch.bool), task_type=["t"] * n)


def scorer(model: nn.Module) -> PairScorer:
    return PairScorer(model, pad_id=0, device=torch.device("cpu"), temperature=1.0, vocab_limit=None, packed=False,
                      micro_batch_size=3)


def one_rank(obj):
    return [obj]


def test_mi_of_a_policy_that_ignores_its_prompt_is_zero():
    mi = mutual_information(scorer(ToyPolicy(copy=False)), toy_batch(), step=0, seed=0, size=4,
                            all_reduce_sum=lambda t: t, all_gather=one_rank)
    assert mi == pytest.approx(0.0, abs=1e-9)


def test_mi_of_a_policy_that_copies_its_prompt():
    # log p(token | x) = 5 - L where the token is x's first token, -L elsewhere (L = log(e^5 + 7)); every
    # y_i = two copies of x_i's first token, distinct per sample:
    #   log p(y_i | x_i) = 2 (5 - L); log p(y_i | x_j) = -2L for j != i, so log mean_j = -2L
    #   MI = sum_i 10 / sum_i 2 = 5 nats per token exactly
    mi = mutual_information(scorer(ToyPolicy(copy=True)), toy_batch(), step=0, seed=0, size=4,
                            all_reduce_sum=lambda t: t, all_gather=one_rank)
    assert mi == pytest.approx(5.0, abs=1e-5)
    # a subsample of 3 of the 4 samples: still 5 (each term is 10 nats over 2 tokens)
    assert mutual_information(scorer(ToyPolicy(copy=True)), toy_batch(), 0, 0, 3, lambda t: t, one_rank) == \
        pytest.approx(5.0, abs=1e-5)


def test_the_mi_subsample_is_a_function_of_seed_step_and_sample_ids_only():
    batch = toy_batch(6)
    first = mi_subsample(batch, step=3, seed=1, size=3, all_gather=one_rank)
    assert len(first) == 3
    reordered = batch.select([5, 3, 1, 0, 2, 4])
    assert mi_subsample(reordered, 3, 1, 3, one_rank) == first
    assert mi_subsample(batch, 4, 1, 3, one_rank) != first or mi_subsample(batch, 3, 2, 3, one_rank) != first


class ThreadGroup:
    """all_gather / all_reduce_sum between threads that play the ranks of one process group."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world)

    def gather(self, rank: int, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def reduce(self, rank: int, t):
        return sum(self.gather(rank, t.clone()))


def test_mi_on_two_ranks_equals_one_rank():
    # each "rank" holds half the samples and scores half the pairs; the [m, m] matrix is summed
    batch, policy = toy_batch(6), ToyPolicy(copy=True)
    with torch.no_grad():
        policy.bias.zero_()
    one = mutual_information(scorer(policy), batch, 2, 5, 5, lambda t: t, one_rank)
    group, results = ThreadGroup(2), {}

    def run(rank: int) -> None:
        mine = batch.select([r for r in range(6) if r % 2 == rank])
        results[rank] = mutual_information(scorer(policy), mine, 2, 5, 5, lambda t: group.reduce(rank, t),
                                           lambda o: group.gather(rank, o), rank, 2)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[0] == results[1] == pytest.approx(one, abs=1e-9)


# ---- the per-iteration signals -----------------------------------------------------------------------------

def test_group_return_std_advantage_signal_and_state_diversity_by_hand():
    # group 0: returns 10, 0 -> population std 5; group 1: -0.1, -0.1 -> 0; group 2: 1, 2, 3 -> sqrt(2/3)
    returns = [(0, 10.0), (0, 0.0), (1, -0.1), (1, -0.1), (2, 1.0), (2, 2.0), (2, 3.0)]
    total, groups, zero = group_return_std(returns)
    assert total == pytest.approx(5.0 + math.sqrt(2 / 3)) and (groups, zero) == (3, 1)
    assert advantage_signal(torch.tensor([0.0, 0.5, -1e-7, -2.0, 0.0])) == (2, 5)
    visits = [
        (0, "s", "go north"), (0, "s", "Go  North"), (0, "s", "take key"),  # 3 visits, 2 distinct: (2-1)/2 = 0.5
        (0, "t", "look"),  # visited once: not a shared state
        (1, "s", "look"), (1, "s", "look"),  # group 1's own "s": 2 visits, 1 action: 0
        (2, "u", "a"), (2, "u", "b"),  # 2 visits, 2 actions: 1
    ]
    assert state_diversity(visits) == (pytest.approx(1.5), 3)


def test_corridor_counts_by_hand():
    # band (0.5, 2) x Href; sample entropies (token means): 0.1, 0.5, 3.0, 0.25, 1.0 at turns 0, 0, 0, 1, 1
    # Href per sample: 1, 1, 1, 0.4, NaN (no reference: not counted)
    #   turn 0: 0.1 < 0.5 (below), 0.5 inside, 3.0 > 2 (above) -> [3, 1, 1]
    #   turn 1: 0.25 vs band (0.2, 0.8): inside -> [1, 0, 0]
    entropy = [torch.tensor([0.0, 0.2]), torch.tensor([0.5]), torch.tensor([2.0, 4.0]), torch.tensor([0.25]),
               torch.tensor([1.0])]
    counts = corridor_counts(entropy, torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1.0, 1.0, 1.0, 0.4, math.nan]),
                             0.5, 2.0, max_turns=3)
    assert counts.tolist() == [[3, 1, 1], [1, 0, 0], [0, 0, 0]]


# ---- the alert -----------------------------------------------------------------------------------------------

def test_collapse_reasons_follow_the_thresholds():
    s = DiagnosticsConfig(alert_entropy_low=0.5, alert_entropy_high=2.0, alert_mi=0.05, alert_diversity=0.2)
    assert collapse_reasons({"policy/entropy": 0.1}, s) == {}  # no reference yet (first step)
    assert collapse_reasons({"policy/entropy": 0.1, "policy/entropy_ref": 0.15}, s) == {}
    low = collapse_reasons({"policy/entropy": 0.07, "policy/entropy_ref": 0.15}, s)  # 0.07 < 0.5 x 0.15 = 0.075
    assert list(low) == ["entropy_low"] and "entropy 0.07 < 0.5 x" in low["entropy_low"]
    high = collapse_reasons({"policy/entropy": 0.31, "policy/entropy_ref": 0.15}, s)  # 0.31 > 2 x 0.15 = 0.3
    assert list(high) == ["entropy_high"] and "> 2 x" in high["entropy_high"]
    both = collapse_reasons({"collapse/mi": 0.01, "collapse/state_diversity": 0.1}, s)
    assert both["mi"].startswith("MI 0.01 < 0.05") and both["diversity"].startswith("state diversity")
    off = DiagnosticsConfig(alert_entropy_low=None, alert_entropy_high=None, alert_mi=None, alert_diversity=None)
    assert collapse_reasons({"policy/entropy": 9.0, "policy/entropy_ref": 0.1, "collapse/mi": 0.0}, off) == {}
    # what a step measures: entropy once a reference exists, MI in its steps, each only with its threshold on
    assert measured_signals({"policy/entropy": 0.1}, s) == set()
    assert measured_signals({"policy/entropy": 0.1, "policy/entropy_ref": 0.2, "collapse/mi": 0.3}, s) == {
        "entropy_low", "entropy_high", "mi"}
    assert measured_signals({"collapse/mi": 0.3, "collapse/state_diversity": 0.5}, DiagnosticsConfig()) == {"mi"}


def test_the_alert_fires_on_crossings_not_on_every_step_beyond():
    s = DiagnosticsConfig(alert_mi=0.05)  # entropy: 0.5x / 2x of the reference; diversity off
    beyond: list[str] = []
    fired = []
    steps = [  # (entropy, reference, MI or None): entropy falls for good from step 2; MI measured at 1, 3, 5
        (1.0, 1.0, 0.2), (0.4, 1.0, None), (0.3, 0.9, 0.01), (0.2, 0.8, None), (0.2, 0.7, 0.3), (0.6, 0.7, None),
        (0.3, 0.7, None)]
    levels = []
    for h, ref, mi in steps:  # steps 1..7
        metrics = {"policy/entropy": h, "policy/entropy_ref": ref, **({"collapse/mi": mi} if mi is not None else {})}
        reasons = collapse_reasons(metrics, s)
        beyond, crossed = alert_crossings(beyond, reasons, measured_signals(metrics, s), s)
        fired.append(crossed)
        levels.append(bool(beyond))
    # step 2: 0.4 < 0.5 x 1.0 crosses; steps 3-5 stay below (0.3 < 0.45, 0.2 < 0.4, 0.2 < 0.35): no new alert;
    # step 6: 0.6 >= 0.35, back within; step 7: 0.3 < 0.35 crosses again. MI: 0.01 < 0.05 crosses at step 3,
    # keeps its verdict at step 4 (not measured), is back within at step 5.
    assert fired == [[], ["entropy_low"], ["mi"], [], [], [], ["entropy_low"]]
    assert levels == [False, True, True, True, True, False, True]
    # a signal whose threshold is turned off is dropped (a run resumed with another setting)
    assert alert_crossings(["mi"], {}, set(), DiagnosticsConfig(alert_mi=None)) == ([], [])


def test_collapse_alert_warns_and_notes_it_in_status_json(tmp_path: Path):
    write_status(tmp_path, "running")
    warned: list[str] = []
    s = DiagnosticsConfig(alert_mi=0.05)
    assert collapse_alert({"collapse/mi": 0.2}, s, 3, [], warned.append, tmp_path) == ({"collapse/alert": 0.0}, [])
    metrics, beyond = collapse_alert({"collapse/mi": 0.01}, s, 4, [], warned.append, tmp_path)
    assert metrics == {"collapse/alert": 1.0} and beyond == ["mi"]
    # still beyond: on, but no second warning nor note
    assert collapse_alert({"collapse/mi": 0.02}, s, 5, beyond, warned.append, tmp_path) == (
        {"collapse/alert": 1.0}, ["mi"])
    assert collapse_alert({"collapse/mi": 0.02}, s, 6, [], warned.append, None) == (
        {"collapse/alert": 1.0}, ["mi"])  # rank > 0: warns (the logger shows rank 0's only), writes nothing
    assert len(warned) == 2 and warned[0].startswith("collapse alert at step 4: MI 0.01 < 0.05")
    status = read_status(tmp_path)
    assert status["status"] == "running" and status["alerts"]["collapse"]["first_step"] == 4
    assert status["alerts"]["collapse"]["count"] == 1
    record_alert(tmp_path, "collapse", 7, ["x"])
    write_status(tmp_path, "finished", step=9)  # the end of the run keeps the alerts
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 9
    assert status["alerts"]["collapse"] == {"first_step": 4, "last_step": 7, "count": 2, "reasons": ["x"]}
    assert collapse_alert({"collapse/mi": 0.0}, DiagnosticsConfig(enabled=False), 8, ["mi"], warned.append,
                          None) == ({}, [])


# ---- settings ------------------------------------------------------------------------------------------------

def test_diagnostics_settings():
    cfg = compose(["algo=grpo"])
    d = cfg.algo.diagnostics
    assert d.enabled and d.mi_every == 0 and d.mi_samples == 16 and d.alert_diversity is None
    with pytest.raises(ConfigError, match="alert_entropy_low=2 must be below alert_entropy_high=2"):
        compose(["algo=grpo", "algo.diagnostics.alert_entropy_low=2"])
    with pytest.raises(ConfigError, match="algo.diagnostics.mi_samples': 1 is out of range"):
        compose(["algo=grpo", "algo.diagnostics.mi_every=1", "algo.diagnostics.mi_samples=1"])
    with pytest.warns(UserWarning, match="mi_samples=8: no effect .*mi_every=0"):
        compose(["algo=grpo", "algo.diagnostics.mi_samples=8"])
    with pytest.warns(UserWarning, match="mi_every=2: no effect .*enabled=false"):
        compose(["algo=grpo", "algo.diagnostics.enabled=false", "algo.diagnostics.mi_every=2"])
    off = compose(["algo=grpo", "algo.diagnostics.alert_entropy_high=null"])
    assert off.algo.diagnostics.alert_entropy_high is None
