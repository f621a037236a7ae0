"""Entropy history, fluctuation monitor and diversity against hand-computed values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from epo_cli.algos.entropy import EntropyHistory, FluctuationMonitor, response_diversity, step_statistics
from epo_cli.config import MonitorConfig, SmoothingConfig

torch.set_num_threads(1)


def history(reference="global", mode="cumulative", window=10, ema_decay=0.9, max_turns=4) -> EntropyHistory:
    cfg = SmoothingConfig(reference=reference, history=mode, window=window, ema_decay=ema_decay)
    return EntropyHistory(cfg, max_turns=max_turns)


def one_value(h: float, max_turns: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics of a step whose only token (turn 0) has entropy h."""
    return step_statistics([torch.tensor([h])], torch.tensor([0]), max_turns)


# A rollout where trajectory A ended after 1 turn and trajectory B ran 3 turns:
#   A t0: H = [1, 3]          B t0: H = [2]       B t1: H = [4, 4]      B t2: H = [6, 6, 6]
# per true turn: t0 sum 1+3+2 = 6 over 3 tokens (mean 2); t1 8 / 2 (mean 4); t2 18 / 3 (mean 6); t3 none
# batch mean = (6 + 8 + 18) / 8 = 32/8 = 4
ENTROPY = [
    torch.tensor([1.0, 3.0]),
    torch.tensor([2.0]),
    torch.tensor([4.0, 4.0]),
    torch.tensor([6.0, 6.0, 6.0]),
]
TURNS = torch.tensor([0, 0, 1, 2])


def test_step_statistics_by_true_turn_index():
    sums, counts = step_statistics(ENTROPY, TURNS, max_turns=4)
    assert sums.tolist() == [6.0, 8.0, 18.0, 0.0]
    assert counts.tolist() == [3.0, 2.0, 3.0, 0.0]
    with pytest.raises(ValueError, match="turn indices"):
        step_statistics(ENTROPY, torch.tensor([0, 0, 1, 4]), max_turns=4)


def test_per_turn_references_stay_aligned_when_episodes_end_early():
    h = history(reference="per_turn")
    h.update(*step_statistics(ENTROPY, TURNS, max_turns=4))
    # turn 2's reference uses only turn-2 tokens (6), not a position shifted by the short episode;
    # turn 3 was never seen: global fallback 4
    assert h.reference(torch.tensor([0, 1, 2, 3])).tolist() == [2.0, 4.0, 6.0, 4.0]
    g = history(reference="global")
    g.update(*step_statistics(ENTROPY, TURNS, max_turns=4))
    assert g.reference(torch.tensor([0, 1, 2, 3])).tolist() == [4.0] * 4


@pytest.mark.parametrize("reference", ["global", "per_turn"])
def test_empty_history_is_nan(reference):
    h = history(reference=reference)
    assert h.num_steps == 0
    assert torch.isnan(h.reference(torch.tensor([0, 2]))).all()
    h.update(torch.zeros(4), torch.zeros(4))  # a step without tokens records nothing
    assert h.num_steps == 0


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        # step means 1, 2, 6
        ("cumulative", {}, [1.0, 1.5, 3.0]),  # 1; (1+2)/2; (1+2+6)/3 = 3
        ("window", {"window": 2}, [1.0, 1.5, 4.0]),  # 1; (1+2)/2; (2+6)/2 = 4
        ("ema", {"ema_decay": 0.5}, [1.0, 1.5, 3.75]),  # 1 (init); 0.5*1 + 0.5*2; 0.5*1.5 + 0.5*6
    ],
)
def test_history_modes_by_hand(mode, kwargs, expected):
    h = history(mode=mode, **kwargs)
    got = []
    for value in (1.0, 2.0, 6.0):
        h.update(*one_value(value))
        got.append(h.reference(torch.tensor([0])).item())
    assert got == pytest.approx(expected)


def test_per_turn_cumulative_counts_only_steps_where_the_turn_appeared():
    h = history(reference="per_turn")
    # step 1: turn 0 sum 2 over 2 tokens (mean 1), turn 1 sum 3 over 1 token (mean 3); batch mean 5/3
    h.update(torch.tensor([2.0, 3.0, 0.0, 0.0]), torch.tensor([2.0, 1.0, 0.0, 0.0]))
    # step 2: only turn 0, mean 2; batch mean 2
    h.update(torch.tensor([4.0, 0.0, 0.0, 0.0]), torch.tensor([2.0, 0.0, 0.0, 0.0]))
    # t0: (1 + 2)/2 = 1.5; t1: 3 (one step); unseen t3: global (5/3 + 2)/2 = 11/6
    assert h.reference(torch.tensor([0, 1, 3])).tolist() == pytest.approx([1.5, 3.0, 11 / 6])


@pytest.mark.parametrize("mode", ["cumulative", "window", "ema"])
def test_history_state_round_trip(mode):
    h = history(reference="per_turn", mode=mode, window=2, ema_decay=0.5)
    h.update(*step_statistics(ENTROPY, TURNS, max_turns=4))
    h.update(*one_value(3.0))
    restored = history(reference="per_turn", mode=mode, window=2, ema_decay=0.5)
    restored.load_state_dict(json.loads(json.dumps(h.state_dict())))
    turns = torch.tensor([0, 1, 2, 3])
    assert torch.equal(restored.reference(turns), h.reference(turns))
    for x in (h, restored):  # and they keep evolving identically
        x.update(*one_value(9.0))
    assert torch.equal(restored.reference(turns), h.reference(turns))
    assert restored.num_steps == 3


# --------------------------------------------------------------------------------------------- monitor


def test_fluctuation_monitor_by_hand():
    # a = 0.5, k = 2, threshold 0.2; H = 1, 2, 1
    #   t0: window [1], mean 1, |1 - 1| = 0: sigma = 0; swing 0 (first step); 0/1 -> no alert
    #   t1: window [1, 2], mean 1.5, |2 - 1.5| = 0.5: sigma = 0.5*0 + 0.5*0.5 = 0.25;
    #       swing |2 - 1|/1 = 1; 0.25/1.5 = 0.167 <= 0.2 -> no alert
    #   t2: window [2, 1], mean 1.5, |1 - 1.5| = 0.5: sigma = 0.5*0.25 + 0.5*0.5 = 0.375;
    #       swing |1 - 2|/2 = 0.5; 0.375/1.5 = 0.25 > 0.2 -> alert
    cfg = MonitorConfig(decay=0.5, window=2, threshold=0.2)
    mon = FluctuationMonitor(cfg)
    expected = [(0.0, 0.0, 0.0), (0.25, 1.0, 0.0), (0.375, 0.5, 1.0)]
    restored = None
    for i, (h, (sigma, swing, alert)) in enumerate(zip([1.0, 2.0, 1.0], expected)):
        before = mon.state_dict()
        assert mon.would_alert(h) == bool(alert) and mon.state_dict() == before  # the verdict in advance
        m = mon.update(h)
        assert m["policy/entropy_fluctuation"] == pytest.approx(sigma)
        assert m["policy/entropy_swing"] == pytest.approx(swing)
        assert m["policy/entropy_alert"] == alert
        if i == 1:  # resume after step t1: the restored monitor must give t2's values too
            restored = FluctuationMonitor(cfg)
            restored.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert restored.update(1.0) == pytest.approx(m)
    assert mon.alert is True


# ------------------------------------------------------------------------------------------- diversity


def test_response_diversity_by_hand():
    # group 0: ["go north", "take key", "go north"] and ["Go  North", "open door"] (same action, normalised)
    #   actions 5, distinct {go north, take key, open door} = 3 -> 0.6
    #   bigrams: (gn, tk), (tk, gn) | (gn, od) -> 3, all distinct -> 1.0
    # group 1: ["look", "look", "look"]: actions 3, distinct 1 -> 1/3; bigrams (l,l) x2, distinct 1 -> 0.5
    # averages: distinct_actions (0.6 + 1/3)/2 = 0.4666667; diversity (1 + 0.5)/2 = 0.75
    trajs = [
        (0, ["go north", "take key", "go north"]),
        (0, ["Go  North", "open door"]),
        (1, ["look", "look", "look"]),
    ]
    m = response_diversity(trajs, n=2)
    assert m["rollout/distinct_actions"] == pytest.approx(0.7 / 1.5)
    assert m["rollout/diversity"] == pytest.approx(0.75)
    assert response_diversity([]) == {"rollout/distinct_actions": 0.0, "rollout/diversity": 0.0}
    # trajectories shorter than n have no n-gram: left out of that average
    assert response_diversity([(0, ["a"]), (1, ["a", "b"])], n=2)["rollout/diversity"] == 1.0
    assert not math.isnan(response_diversity([(0, ["a"])], n=2)["rollout/diversity"])
