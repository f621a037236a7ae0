"""`launcher=local`: training in this process (a world of one), after epo_cli.launch.setup composed the
config; the run directory is written here, or, when resuming, once the checkpoint has loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from epo_cli.analysis.run_summary import print_summary
from epo_cli.checkpoint_paths import latest_tag
from epo_cli.envs import make_suite
from epo_cli.errors import Stopped
from epo_cli.launch.setup import prepare_run_dir, stopped_message
from epo_cli.models.attention import check_attention, planned_device
from epo_cli.run_dir import write_status
from epo_cli.training.stop import STOP, Interrupted, exit_code, signal_name
from epo_cli.training.trainer import Trainer


def run_local(cfg: DictConfig, overrides: list[str]) -> dict:
    """Train in this process (a world of one)."""
    resuming = bool(cfg.trainer.resume) and cfg.run_dir and (Path(cfg.run_dir) / "config.yaml").exists()
    check_attention(cfg.model, planned_device(cfg.trainer.device))  # before the run directory is written
    STOP.install()  # SIGTERM/SIGINT/SIGUSR1: finish the step, checkpoint it, exit 128+N
    try:
        suite = make_suite(cfg.env)  # the run's one env suite, handed down
        if resuming:
            # load the checkpoint first: if it is unusable, the run directory stays exactly as it was
            run = Path(cfg.run_dir)
            trainer = Trainer(cfg, run, suite)
            prepare_run_dir(cfg, overrides, suite)
        else:
            run = prepare_run_dir(cfg, overrides, suite)
        try:
            trainer = trainer if resuming else Trainer(cfg, run, suite)
            metrics = trainer.train()
        except (KeyboardInterrupt, Interrupted) as err:
            signum = err.signum if isinstance(err, Interrupted) else 2
            _best_effort_status(run, "stopped", step=_latest_step(run), signal=signal_name(signum),
                                abandoned="a second signal abandoned the step in progress",
                                resume=f"epo train trainer.resume={run}")
            raise
        except BaseException as err:
            _best_effort_status(run, "failed", error=f"{type(err).__name__}: {err}")
            raise
    finally:
        STOP.uninstall()
    if trainer.state.step < cfg.trainer.total_steps and trainer.stop_signal:
        raise Stopped(stopped_message(run, trainer.stop_signal, trainer.state.step), exit_code(trainer.stop_signal))
    print_summary(cfg, run, metrics)
    sys.stdout.flush()
    return metrics


def _latest_step(run: Path) -> int | None:
    tag = latest_tag(run)
    return int(tag.split("_", 1)[1]) if tag and tag.startswith("step_") else None


def _best_effort_status(run: Path, status: str, **fields: object) -> None:
    """A failed write of status.json (the disk that is full) must not hide the error being reported."""
    try:
        write_status(run, status, **fields)
    except OSError:
        pass
