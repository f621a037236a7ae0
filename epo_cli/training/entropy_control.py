"""The entropy state an RL run carries from step to step: the per-turn entropy history whose references
centre EPO's smoothing band, the fluctuation monitor, and the entropy coefficient's schedule (the adaptive
one observes each step's entropy). rl_step reads it for the coefficients (step 4) and after the update
(step 6), and updates it in step 7; a checkpoint saves it (`state_dict`). It is built from its parts (the
Trainer builds them from their config sections), so a test hands it a history, monitor and schedule directly.

    metrics = control.reference_metrics()                   # policy/entropy_ref, before this step's entropies
    lam = control.schedule(step, total)                     # lambda
    clamp = control.clamps_now(batch, width)                # algo.monitor.action=clamp: the verdict, in advance
    stats = control.statistics(batch, step, width, warn)    # all-reduced per-turn sums, the monitor's verdict
    control.observe(stats)                                  # history <- this step; the schedule observes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from epo_cli.algos.entropy import EntropyHistory, FluctuationMonitor
from epo_cli.algos.schedules import Schedule
from epo_cli.rollout.batch import TurnBatch
from epo_cli.training.step_metrics import entropy_statistics


@dataclass
class EntropyStats:
    """One step's rollout entropies over all ranks."""

    sums: Tensor  # [width] per-turn sums of token entropies
    counts: Tensor  # [width] per-turn token counts
    mean: float  # the token-mean entropy (policy/entropy)
    alert: bool  # the fluctuation monitor's verdict
    metrics: dict[str, float] = field(default_factory=dict)  # policy/entropy*, the monitor's metrics


class EntropyControl:
    def __init__(self, history: EntropyHistory, monitor: FluctuationMonitor, schedule: Schedule,
                 clamps: bool) -> None:
        """`clamps`: the monitor's alert clamps this step's entropy terms (algo.monitor.action=clamp)."""
        self.history, self.monitor, self.schedule, self.clamps = history, monitor, schedule, clamps

    def reference_metrics(self) -> dict[str, float]:
        """policy/entropy_ref: the smoothing band's centre (global reference) for this update, once known."""
        return {"policy/entropy_ref": self.history.global_stream.value()} if self.history.num_steps else {}

    def clamps_now(self, batch: TurnBatch, width: int) -> bool:
        """Whether this step's entropy terms are clamped: algo.monitor.action=clamp and the monitor will alert
        on `batch`'s entropies (the coefficients need the verdict before the update; `statistics`, after it,
        records it). Collectives when clamping (the config says so on every rank): every rank calls it."""
        if not self.clamps:
            return False
        if any(h is None for h in batch.entropy):  # PolicyUpdate.reuses_scoring() is False under a clamp
            raise ValueError("the clamp's verdict needs every row scored before the update")
        mean = entropy_statistics(batch.entropy, batch.turn_index, width)[2]
        return self.monitor.would_alert(mean)

    def statistics(self, batch: TurnBatch, step: int, width: int, warn: Callable[[str], None]) -> EntropyStats:
        """This step's entropy statistics (all ranks: collectives) and the monitor's update; an alert is
        warned about."""
        sums, counts, mean, metrics = entropy_statistics(batch.entropy, batch.turn_index, width)
        metrics.update(self.monitor.update(mean))
        if self.monitor.alert:
            warn(f"entropy fluctuation above algo.monitor.threshold at step {step + 1} "
                 f"(sigma={metrics['policy/entropy_fluctuation']:.4f})"
                 + (": entropy terms clamped for this step" if self.clamps else ""))
        return EntropyStats(sums, counts, mean, self.monitor.alert, metrics)

    def observe(self, stats: EntropyStats) -> None:
        """After the update: the history records this step (its references use steps 0..k-1 only, Href(k));
        the entropy schedule sees this step's entropy."""
        self.history.update(stats.sums, stats.counts)
        self.schedule.observe(stats.mean)

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_history": self.history.state_dict(), "monitor": self.monitor.state_dict(),
                "entropy_schedule": self.schedule.state_dict()}

    def load_state_dict(self, payload: dict[str, Any]) -> None:
        self.history.load_state_dict(payload["entropy_history"])
        self.monitor.load_state_dict(payload["monitor"])
        self.schedule.load_state_dict(payload.get("entropy_schedule", {}))
