"""Metric sinks: rich console, metrics.jsonl, TensorBoard, Weights & Biases, MLflow (rank 0 only).

Metric names (one scheme everywhere; see README "Metrics"):
    policy/entropy               token-mean entropy of the rollout's responses (at the sampling temperature)
    policy/entropy_turn/<t>      token-mean entropy of turn t's responses
    policy/entropy_fluctuation   sigma of the fluctuation monitor; policy/entropy_swing, policy/entropy_alert
    policy/entropy_ref           EPO smoothing reference (historical mean entropy)
    policy/clipfrac  policy/approx_kl  policy/kl_ref   PPO diagnostics and KL to the reference policy
    policy/cov_clipfrac  policy/kl_cov_frac  policy/kl_cov_penalty   Clip-Cov / KL-Cov token shares
    loss/<term>  coef/<name>     each loss term's value and coefficient (coef/beta is EPO's phase weight)
    rollout/success  rollout/success/<task_type>  rollout/episode_len  rollout/invalid_rate
    rollout/truncated  rollout/diversity  rollout/distinct_actions
    rollout/groups_dropped  rollout/groups_topped_up  rollout/sampling_rounds   (dynamic sampling)
    critic/explained_variance  critic/value_mean   (ppo)
    eval/<split>/success  eval/<split>/episode_len  eval/success (the first eval split)
    perf/tokens_per_s  perf/env_steps_per_s  perf/rollout_s  perf/update_s  perf/grad_norm  perf/lr
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console

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
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run / "tb"))
        if lc.wandb.enabled:
            self._wandb = self._start_wandb(lc.wandb)
        if lc.mlflow.enabled:
            self._mlflow = self._start_mlflow(lc.mlflow)

    # ---- integrations -----------------------------------------------------------------------------------
    def _start_wandb(self, wc: Any):
        try:
            import wandb
        except ImportError:
            from epo_cli.errors import UserError

            raise UserError("logger=wandb needs wandb: pip install 'epo[loggers]'.") from None
        run = wandb.init(project=wc.project, entity=wc.entity, mode=wc.mode, dir=str(self.run),
                         name=self.run.name, id=self.run_ids.get("wandb"), resume="allow",
                         config=_plain(self.cfg))
        self.run_ids["wandb"] = run.id
        return run

    def _start_mlflow(self, mc: Any):
        try:
            import mlflow
        except ImportError:
            from epo_cli.errors import UserError

            raise UserError("logger=mlflow needs mlflow: pip install 'epo[loggers]'.") from None
        # default: a local SQLite store in the run directory (MLflow 3 retired the plain file store)
        mlflow.set_tracking_uri(mc.tracking_uri or f"sqlite:///{(self.run / 'mlflow.db').resolve()}")
        if mlflow.get_experiment_by_name(mc.experiment) is None:
            mlflow.create_experiment(mc.experiment, artifact_location=(self.run / "mlartifacts").resolve().as_uri())
        mlflow.set_experiment(mc.experiment)
        resumed = "mlflow" in self.run_ids
        active = mlflow.start_run(run_id=self.run_ids.get("mlflow"), run_name=self.run.name)
        self.run_ids["mlflow"] = active.info.run_id
        if not resumed:  # params are immutable in MLflow: log them once
            flat = _flatten(_plain(self.cfg))
            mlflow.log_params({k: str(v)[:250] for k, v in list(flat.items())[:200]})
        return mlflow

    # ---- logging ------------------------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float], total: int | None = None) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and not isinstance(v, str)}
        if self.cfg.logger.jsonl:
            with open(self.run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **{k: _json_num(v) for k, v in clean.items()}}) + "\n")
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
            self.console.print(f"[cyan]step {where}[/]  {shown}{alert}", soft_wrap=True)
            if total and self.console.is_terminal:
                self._show_progress(step, total)

    def _show_progress(self, step: int, total: int) -> None:
        """A live bar under the metric lines: steps done, elapsed time, time left."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

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


def _parse_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) of every readable line of a metrics.jsonl. A line that is not a JSON object with an
    integer `step` (a write cut short by a kill or a full disk, a hand edit) is skipped with one warning."""
    rows, bad = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError:  # json.JSONDecodeError is a ValueError
            bad.append(n)
            continue
        rows.append((line, row))
    if bad:
        where = f"line {bad[0]}" if len(bad) == 1 else f"lines {', '.join(map(str, bad[:5]))}" + (
            "..." if len(bad) > 5 else "")
        warnings.warn(f"{path}: skipped {len(bad)} unreadable {'line' if len(bad) == 1 else 'lines'} ({where}: "
                      "truncated or not a JSON object with a 'step')", stacklevel=3)
    return rows


def truncate_metrics_file(run: Path, after_step: int) -> None:
    """Drop metrics.jsonl lines logged after `after_step` (a resumed run re-logs them), and unreadable lines."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return
    kept = [line for line, row in _parse_rows(path) if row["step"] <= after_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)  # a crash while rewriting leaves the old file, not half of it


def read_metrics(run: Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for _, row in _parse_rows(path)]


def _json_num(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


def _plain(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if hasattr(cfg, "_metadata") else cfg


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix.rstrip(".")] = d
    return out


def is_tty() -> bool:
    return sys.stdout.isatty()
