"""`launcher=local`: training in this process (a world of one), after epo_cli.launch.setup composed the
config; the run directory is written here, or, when resuming, once the checkpoint has loaded. The run's
lifecycle (stop handler, status.json, exit code) is epo_cli.launch.lifecycle's, as on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from epo_cli.analysis.run_summary import print_summary
from epo_cli.envs import make_suite
from epo_cli.launch.lifecycle import run_training
from epo_cli.launch.setup import prepare_run_dir
from epo_cli.models.attention import check_attention
from epo_cli.runtime.device import device_type
from epo_cli.training.trainer import Trainer


def run_local(cfg: DictConfig, overrides: list[str]) -> dict:
    """Train in this process (a world of one)."""
    resuming = bool(cfg.trainer.resume) and cfg.run_dir and (Path(cfg.run_dir) / "config.yaml").exists()
    check_attention(cfg.model, device_type(cfg.trainer.device))  # before the run directory is written
    resumed: list[Trainer] = []  # the Trainer built before the run directory is rewritten (resuming)
    suite = None

    def open_run() -> Path:
        nonlocal suite
        suite = make_suite(cfg.env)  # the run's one env suite, handed down
        if not resuming:
            return prepare_run_dir(cfg, overrides, suite)
        # load the checkpoint first: if it is unusable, the run directory stays exactly as it was
        resumed.append(Trainer(cfg, Path(cfg.run_dir), suite))
        prepare_run_dir(cfg, overrides, suite)
        return Path(cfg.run_dir)

    ending = run_training(open_run, lambda run: resumed[0] if resumed else Trainer(cfg, run, suite),
                          is_main=True, reports_failure=True)
    if ending.stop_signal:
        raise ending.stopped()
    print_summary(cfg, ending.run, ending.metrics)
    sys.stdout.flush()
    return ending.metrics
