"""The table printed at the end of a run: what it reached and where its files are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROWS = (
    ("eval/success", "eval success (first eval split)"),
    ("rollout/success", "train rollout success"),
    ("policy/entropy", "policy entropy (token mean)"),
    ("policy/entropy_fluctuation", "entropy fluctuation (sigma)"),
    ("loss/nll", "nll loss"),
    ("loss/policy_clip", "policy loss"),
    ("policy/kl_ref", "KL to reference"),
    ("rollout/episode_len", "episode length"),
    ("rollout/invalid_rate", "invalid-action rate"),
)


def print_summary(cfg: Any, run: Path, metrics: dict[str, float]) -> None:
    console = Console(highlight=False)
    table = Table(title=f"{cfg.algo.name} on {cfg.env.name}: final metrics", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label in ROWS:
        if key in metrics:
            table.add_row(label, f"{metrics[key]:.4g}")
    for key in sorted(metrics):
        if key.startswith("eval/") and key.endswith("/success") and key != "eval/success":
            table.add_row(key, f"{metrics[key]:.4g}")
    console.print(table)
    console.print(f"run directory: {run}", soft_wrap=True)
    console.print(f"  config.yaml, metrics.jsonl, tb/ (tensorboard --logdir {run / 'tb'}), checkpoints/, final/",
                  soft_wrap=True)
