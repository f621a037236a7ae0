"""EntropyControl, the entropy state rl_step carries from step to step, on hand-made batches (one rank)."""

from __future__ import annotations

import pytest
import torch

from epo_cli.algos.entropy import EntropyHistory, FluctuationMonitor
from epo_cli.algos.schedules import Constant
from epo_cli.compose import compose
from epo_cli.config import MonitorConfig, SmoothingConfig
from epo_cli.rollout.batch import TurnBatch
from epo_cli.training.entropy_control import EntropyControl
from epo_cli.training.settings import entropy_control


def _batch(entropies: list[list[float]], turns: list[int]) -> TurnBatch:
    n = len(turns)
    return TurnBatch(
        prompt_ids=[[1]] * n, response_ids=[[2] * len(e) for e in entropies], traj_id=torch.zeros(n, dtype=torch.long),
        group_id=torch.zeros(n, dtype=torch.long), turn_index=torch.tensor(turns), num_turns=torch.full((n,), 2),
        reward=torch.zeros(n), outcome=torch.zeros(n), valid=torch.ones(n, dtype=torch.bool),
        won=torch.zeros(n, dtype=torch.bool), task_type=["t"] * n, entropy=[torch.tensor(e) for e in entropies],
    )


def test_statistics_observe_and_the_reference() -> None:
    control = entropy_control(compose(["algo=epo", "env.max_turns=4"]))
    assert control.reference_metrics() == {}  # no step recorded yet: no band
    warnings: list[str] = []
    # turn 0: tokens 1, 2 and 3 -> sum 6, count 3 (mean 2); turn 1: token 4 -> mean 4; all: 10 / 4 = 2.5
    stats = control.statistics(_batch([[1.0, 2.0], [3.0], [4.0]], [0, 0, 1]), step=0, width=4, warn=warnings.append)
    assert stats.sums.tolist() == [6.0, 4.0, 0.0, 0.0] and stats.counts.tolist() == [3.0, 1.0, 0.0, 0.0]
    assert stats.mean == pytest.approx(2.5) and stats.metrics["policy/entropy"] == pytest.approx(2.5)
    assert stats.metrics["policy/entropy_turn/0"] == pytest.approx(2.0)
    assert stats.metrics["policy/entropy_turn/1"] == pytest.approx(4.0)
    assert "policy/entropy_turn/2" not in stats.metrics  # no token at turn 2
    assert not stats.alert and warnings == []
    control.observe(stats)
    assert control.history.num_steps == 1
    assert control.reference_metrics() == {"policy/entropy_ref": pytest.approx(2.5)}  # the step's mean, recorded
    # a second step at mean 1.0: the cumulative reference is (2.5 + 1.0) / 2
    control.observe(control.statistics(_batch([[1.0]], [0]), step=1, width=4, warn=warnings.append))
    assert control.reference_metrics()["policy/entropy_ref"] == pytest.approx(1.75)


def test_an_alert_is_warned_and_the_state_round_trips() -> None:
    cfg = compose(["algo=epo", "env.max_turns=4", "algo.monitor.threshold=0.01", "algo.monitor.action=clamp"])
    control, warnings = entropy_control(cfg), []
    for step, value in enumerate([1.0, 3.0, 0.5]):  # swings far above 1% of the mean
        stats = control.statistics(_batch([[value]], [0]), step, 4, warnings.append)
        control.observe(stats)
    assert stats.alert and warnings and "entropy terms clamped" in warnings[-1] and "at step 3" in warnings[-1]
    restored = entropy_control(cfg)
    restored.load_state_dict(control.state_dict())
    assert restored.state_dict() == control.state_dict()
    assert set(control.state_dict()) == {"entropy_history", "monitor", "entropy_schedule"}  # checkpoint keys


def test_the_clamp_verdict_in_advance_is_the_one_the_statistics_record() -> None:
    """algo.monitor.action=clamp: the coefficients need the monitor's verdict on this step's entropies before
    the update; `clamps_now` gives it without changing the monitor, and `statistics` after the update records
    the same verdict. Without a clamp there is no verdict in advance (and no collective)."""
    cfg = compose(["algo=epo", "env.max_turns=4", "algo.monitor.threshold=0.01", "algo.monitor.action=clamp"])
    control, warnings = entropy_control(cfg), []
    verdicts = []
    for step, value in enumerate([1.0, 3.0, 0.5]):
        batch = _batch([[value]], [0])
        before = control.monitor.state_dict()
        verdicts.append(control.clamps_now(batch, 4))
        assert control.monitor.state_dict() == before
        stats = control.statistics(batch, step, 4, warnings.append)
        assert stats.alert == verdicts[-1]
        control.observe(stats)
    assert verdicts == [False, True, True]  # |3 - 2| / 2 = 0.5 of the mean after the first swing
    unclamped = entropy_control(compose(["algo=epo", "env.max_turns=4", "algo.monitor.threshold=0.01"]))
    assert not unclamped.clamps_now(_batch([[3.0]], [0]), 4)


def test_built_from_its_parts_without_a_run_config() -> None:
    """A history of 2 turn slots, a monitor that alerts beyond 1% and clamps, a constant lambda: the verdict in
    advance follows the monitor (the second value, 3, swings |3 - 2| / 2 = 0.5 of the mean) and lambda is the
    schedule's."""
    control = EntropyControl(EntropyHistory(SmoothingConfig(), max_turns=2),
                             FluctuationMonitor(MonitorConfig(threshold=0.01, action="clamp")), Constant(0.25),
                             clamps=True)
    assert control.schedule(3, 10) == 0.25
    first = _batch([[1.0]], [0])
    assert not control.clamps_now(first, 2)
    control.observe(control.statistics(first, 0, 2, print))
    assert control.clamps_now(_batch([[3.0]], [0]), 2)
