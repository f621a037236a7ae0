"""MetricsLogger: each logged step's metrics to the sinks that logger.* turns on (rank 0 only).

logger.console (a rich line per step, a progress bar on terminals), logger.jsonl (<run>/metrics.jsonl,
epo_cli.loggers.jsonl), logger.tensorboard (<run>/tb), logger.wandb.enabled (epo_cli.loggers.wandb) and
logger.mlflow.enabled (epo_cli.loggers.mlflow). Metric names: see epo_cli/loggers/__init__.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from epo_cli.loggers.jsonl import open_metrics, row_line
from epo_cli.loggers.mlflow import start_mlflow
from epo_cli.loggers.wandb import start_wandb

#: the metrics shown on the console line, in order
CONSOLE_KEYS = ("rollout/success", "eval/success", "policy/entropy", "loss/nll", "loss/policy_clip",
                "policy/kl_ref", "rollout/episode_len", "perf/update_s")
SHORT = {"rollout/success": "succ", "eval/success": "eval", "policy/entropy": "H", "loss/nll": "nll",
         "loss/policy_clip": "pg", "policy/kl_ref": "kl", "rollout/episode_len": "len", "perf/update_s": "upd_s"}


class MetricsLogger:
    def __init__(self, cfg: Any, run: Path, enabled: bool, resume_ids: dict[str, str] | None = None) -> None:
        self.enabled = enabled
        self.cfg = cfg
        self.run = run
        self.console = Console(stderr=False, highlight=False)
        self.run_ids: dict[str, str] = dict(resume_ids or {})
        self._tb = self._wandb = self._mlflow = None
        self._progress = None  # a live progress bar, on terminals only
        if not enabled:
            return
        lc = cfg.logger
        if lc.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is heavy and optional here

            self._tb = SummaryWriter(str(run / "tb"))
        if lc.wandb.enabled:
            self._wandb = start_wandb(lc.wandb, run, _plain(cfg), self.run_ids)
        if lc.mlflow.enabled:
            self._mlflow = start_mlflow(lc.mlflow, run, _plain(cfg), self.run_ids)

    # ---- logging ------------------------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float], total: int | None = None) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and not isinstance(v, str)}
        if self.cfg.logger.jsonl:
            with open_metrics(self.run) as f:  # never through a planted symlink (loggers/jsonl.py)
                f.write(row_line(step, clean))
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            safe = {k.replace("/", "."): v for k, v in clean.items() if math.isfinite(v)}
            self._mlflow.log_metrics(safe, step=step)
        if self.cfg.logger.console:
            shown = "  ".join(f"{SHORT[k]}={clean[k]:.3g}" for k in CONSOLE_KEYS if k in clean)
            where = f"{step}/{total}" if total else str(step)
            alert = "  [bold red]entropy alert[/]" if clean.get("policy/entropy_alert") else ""
            alert += "  [bold red]collapse alert[/]" if clean.get("collapse/alert") else ""
            self.console.print(f"[cyan]step {where}[/]  {shown}{alert}", soft_wrap=True)
            if total and self.console.is_terminal:
                self._show_progress(step, total)

    def _show_progress(self, step: int, total: int) -> None:
        """A live bar under the metric lines: steps done, elapsed time, time left."""
        if self._progress is None:
            self._progress = Progress(TextColumn(f"[bold]{self.run.name}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                      console=self.console)
            self._progress.start()
            self._task = self._progress.add_task("train", total=total, completed=step - 1)
        self._progress.update(self._task, completed=step)

    def info(self, message: str) -> None:
        if self.enabled and self.cfg.logger.console:
            self.console.print(message, soft_wrap=True)

    def warn(self, message: str) -> None:
        if self.enabled:
            Console(stderr=True).print(f"[bold yellow]warning:[/] {message}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def _plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if hasattr(cfg, "_metadata") else cfg

