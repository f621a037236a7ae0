"""Entropy state kept across RL steps: EPO's smoothing reference, the fluctuation monitor, and the
response-diversity metric. All state is JSON-serialisable (state_dict / load_state_dict) for resumes.

Order in the training loop at RL step k:
    sums, counts = step_statistics(batch.entropy, batch.turn_index, max_turns)   # rollout entropies,
    sums, counts = all_reduce_sum(sums), all_reduce_sum(counts)                   # no extra forward pass
    mb.entropy_ref = history.reference(mb.turn_index)      # uses steps 0..k-1 only (NaN at k = 0)
    ... update ...
    history.update(sums, counts)                           # then record step k
    monitor.update(batch-mean entropy)
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
from torch import Tensor

from epo_cli.config import MonitorConfig, SmoothingConfig


def step_statistics(entropy: list[Tensor], turn_index: Tensor, max_turns: int) -> tuple[Tensor, Tensor]:
    """Per-turn token-entropy sums and token counts of one rollout, each [max_turns] float64.

    Keyed by each sample's TRUE turn index, so a short episode never shifts the turns of longer ones.
    float64 so that sums over many tokens and ranks stay exact enough after all-reduce.
    """
    sums = torch.zeros(max_turns, dtype=torch.float64)
    counts = torch.zeros(max_turns, dtype=torch.float64)
    if not entropy:
        return sums, counts
    turns = turn_index.long().cpu()  # [N]
    if turns.min() < 0 or turns.max() >= max_turns:
        raise ValueError(f"turn indices must be in [0, {max_turns}); got {turns.min()}..{turns.max()}")
    row_sums = torch.stack([e.detach().double().sum().cpu() for e in entropy])  # [N]
    row_counts = torch.tensor([float(e.numel()) for e in entropy], dtype=torch.float64)  # [N]
    return sums.index_add_(0, turns, row_sums), counts.index_add_(0, turns, row_counts)


class _Stream:
    """History of one scalar (the batch mean, or one turn's mean): cumulative | window | ema."""

    def __init__(self, mode: str, window: int, ema_decay: float) -> None:
        if mode not in ("cumulative", "window", "ema"):
            raise ValueError(f"unknown entropy history '{mode}' (cumulative | window | ema)")
        self.mode, self.ema_decay = mode, ema_decay
        self.n = 0  # steps recorded
        self.total = 0.0  # cumulative: sum of all step means
        self.recent: deque[float] = deque(maxlen=max(window, 1))  # window: the last `window` means
        self.ema = 0.0  # ema: e <- d*e + (1-d)*H, initialised at the first H

    def add(self, h: float) -> None:
        self.ema = h if self.n == 0 else self.ema_decay * self.ema + (1.0 - self.ema_decay) * h
        self.n += 1
        self.total += h
        self.recent.append(h)

    def value(self) -> float:
        if self.n == 0:
            return math.nan
        if self.mode == "cumulative":
            return self.total / self.n
        if self.mode == "window":
            return sum(self.recent) / len(self.recent)
        return self.ema

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self.total, "recent": list(self.recent), "ema": self.ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.total, self.ema = int(state["n"]), float(state["total"]), float(state["ema"])
        self.recent.clear()
        self.recent.extend(float(x) for x in state["recent"])


class EntropyHistory:
    """EPO smoothing reference Hbar_ref(k) (arXiv 2509.22576 Sec. 3).

    Each RL step appends the batch-mean token entropy (and, for per_turn, each turn's mean). The
    reference is the mean of all past step means (cumulative: the paper's choice), of the last `window`
    ones, or their EMA. per_turn keeps one history per TRUE turn index; a turn never seen falls back to
    the global reference.
    """

    def __init__(self, cfg: SmoothingConfig, max_turns: int) -> None:
        if cfg.reference not in ("global", "per_turn"):
            raise ValueError(f"unknown smoothing reference '{cfg.reference}' (global | per_turn)")
        self.reference_mode, self.max_turns = cfg.reference, max_turns
        self.history_kind, self.window, self.ema_decay = cfg.history, cfg.window, cfg.ema_decay
        self.global_stream = self._new_stream()
        self.turn_streams: dict[int, _Stream] = {}

    def _new_stream(self) -> _Stream:
        return _Stream(self.history_kind, self.window, self.ema_decay)

    @property
    def num_steps(self) -> int:
        """k: RL steps recorded so far."""
        return self.global_stream.n

    def update(self, sums: Tensor, counts: Tensor) -> None:
        """Record one RL step from per-turn entropy sums and token counts ([max_turns], all ranks)."""
        sums_l = [float(x) for x in sums.tolist()]
        counts_l = [float(x) for x in counts.tolist()]
        total_count = sum(counts_l)
        if total_count <= 0:
            return  # no response token this step: nothing to learn about the entropy
        self.global_stream.add(sum(sums_l) / total_count)
        for t, (s, c) in enumerate(zip(sums_l, counts_l)):
            if c > 0:
                self.turn_streams.setdefault(t, self._new_stream()).add(s / c)

    def reference(self, turn_index: Tensor) -> Tensor:
        """Href [B] float32 for rows at these true turn indices; NaN while the history is empty."""
        glob = self.global_stream.value()
        if self.reference_mode == "global":
            return torch.full((len(turn_index),), glob, dtype=torch.float32)
        refs = [self.turn_streams[t].value() if t in self.turn_streams else glob for t in turn_index.tolist()]
        return torch.tensor(refs, dtype=torch.float32).reshape(len(turn_index))

    def state_dict(self) -> dict[str, Any]:
        return {
            "global": self.global_stream.state_dict(),
            # JSON object keys are strings
            "turns": {str(t): s.state_dict() for t, s in sorted(self.turn_streams.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_stream = self._new_stream()
        self.global_stream.load_state_dict(state["global"])
        self.turn_streams = {}
        for t, s in state["turns"].items():
            self.turn_streams[int(t)] = self._new_stream()
            self.turn_streams[int(t)].load_state_dict(s)


class FluctuationMonitor:
    """Entropy fluctuation monitor (source article): an EMA of the entropy's deviation from its recent mean.

        sigma_{t+1} = a * sigma_t + (1 - a) * |H_t - mean(H_{t-k+1..t})|     sigma_0 = 0, k = window
        swing_t     = |H_t - H_{t-1}| / H_{t-1}                             0 at the first step
        alert       = sigma / mean(H_{t-k+1..t}) > threshold

    The mean runs over the last k values including H_t.
    """

    def __init__(self, cfg: MonitorConfig) -> None:
        self.decay, self.threshold = cfg.decay, cfg.threshold
        self.recent: deque[float] = deque(maxlen=max(cfg.window, 1))
        self.sigma = 0.0
        self.prev: float | None = None
        self.alert = False

    def _after(self, h: float) -> tuple[float, float, bool]:
        """(mean of the recent entropies, sigma, alert) once `h` is observed; the monitor is not changed."""
        recent = [*self.recent, float(h)][-(self.recent.maxlen or 1):]
        mean = sum(recent) / len(recent)
        sigma = self.decay * self.sigma + (1.0 - self.decay) * abs(h - mean)
        return mean, sigma, mean > 0 and sigma / mean > self.threshold

    def would_alert(self, h: float) -> bool:
        """The alert `update(h)` will raise, without observing `h` (a clamp decides before the update)."""
        return self._after(h)[2]

    def update(self, h: float) -> dict[str, float]:
        _, self.sigma, self.alert = self._after(h)
        self.recent.append(float(h))
        # a previous entropy of exactly 0 makes the relative swing undefined: report 0
        swing = abs(h - self.prev) / self.prev if self.prev else 0.0
        self.prev = float(h)
        return {
            "policy/entropy_fluctuation": self.sigma,
            "policy/entropy_swing": swing,
            "policy/entropy_alert": float(self.alert),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "prev": self.prev, "recent": list(self.recent), "alert": self.alert}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sigma = float(state["sigma"])
        self.prev = None if state["prev"] is None else float(state["prev"])
        self.recent.clear()
        self.recent.extend(float(x) for x in state["recent"])
        self.alert = bool(state["alert"])


def _normalise_action(action: str) -> str:
    return " ".join(action.lower().split())


def response_diversity(trajectories: list[tuple[int, list[str]]], n: int = 2) -> dict[str, float]:
    """Distinct-action shares, per group of rollouts of the same task, averaged over groups.

    trajectories: (group id, actions of one trajectory in order). Per group:
        distinct_actions = |distinct actions| / |actions|
        diversity        = |distinct action n-grams| / |n-grams|   (n-grams within a trajectory)
    Actions are compared lower-cased with whitespace collapsed. Groups with no action (no n-gram) are
    left out of the respective average; a metric with no group at all is 0.
    """
    groups: dict[int, list[list[str]]] = {}
    for gid, actions in trajectories:
        groups.setdefault(gid, []).append([_normalise_action(a) for a in actions])
    action_shares, ngram_shares = [], []
    for trajs in groups.values():
        actions = [a for traj in trajs for a in traj]
        ngrams = [tuple(traj[i : i + n]) for traj in trajs for i in range(len(traj) - n + 1)]
        if actions:
            action_shares.append(len(set(actions)) / len(actions))
        if ngrams:
            ngram_shares.append(len(set(ngrams)) / len(ngrams))

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return {"rollout/distinct_actions": mean(action_shares), "rollout/diversity": mean(ngram_shares)}
