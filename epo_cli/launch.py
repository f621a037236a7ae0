"""From a command line to running ranks.

`epo train OVERRIDES` composes and validates the config once, creates the run directory and saves the
resolved config there, then runs the training in this process (`launcher=local`), or starts the ranks
with the deepspeed launcher (`launcher=deepspeed`), or submits the job to SLURM (`launcher=slurm`).
Every rank reads the same config.yaml from the run directory, so all ranks agree on what runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from epo_cli.config import compose, validate
from epo_cli.errors import ConfigError
from epo_cli.run_dir import load_run_config, new_run_dir, write_config, write_status


def compose_for_train(overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """Compose a run's config. `trainer.resume=<run dir>` starts from that run's saved config (the other
    overrides apply on top, e.g. a longer trainer.total_steps) and continues in the same directory."""
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.resume=")), None)
    if resume and resume not in ("auto", "null", "None") and (Path(resume) / "config.yaml").exists():
        base = load_run_config(Path(resume))
        rest = [o for o in overrides if not o.startswith("trainer.resume=")]
        groups = [o for o in rest if "." not in o.split("=", 1)[0] and o.split("=", 1)[0] not in ("seed", "name")]
        if groups:
            raise ConfigError(f"When resuming, config groups cannot change ({', '.join(groups)}); only "
                              "section.key=value overrides apply on top of the run's saved config.")
        try:
            merged = OmegaConf.merge(base, OmegaConf.from_dotlist(rest))
        except Exception as err:  # noqa: BLE001 - reported as a config error
            raise ConfigError(f"Invalid override when resuming: {err}") from None
        merged.trainer.resume = resume
        merged.run_dir = str(Path(resume))
        if not any(o.startswith("trainer.stop_after=") for o in rest):
            merged.trainer.stop_after = None  # the earlier stop point is behind us
        return validate(merged), overrides
    return compose(overrides), overrides


def launch_training(overrides: list[str]) -> None:
    cfg, overrides = compose_for_train(overrides)
    if cfg.launcher.name == "local":
        run_local(cfg, overrides)
    else:
        from epo_cli.distributed_launch import launch_ranks

        launch_ranks(cfg, overrides)


def prepare_run_dir(cfg: DictConfig, overrides: list[str]) -> Path:
    from epo_cli.envs import make_suite

    run = new_run_dir(cfg)
    cfg.run_dir = str(run)
    write_config(run, cfg, overrides, make_suite(cfg.env).versions())
    return run


def run_local(cfg: DictConfig, overrides: list[str]) -> dict:
    """Train in this process (a world of one, or one rank started by a launcher)."""
    from epo_cli.summary import print_summary
    from epo_cli.training.trainer import Trainer

    resuming = bool(cfg.trainer.resume) and cfg.run_dir and (Path(cfg.run_dir) / "config.yaml").exists()
    if resuming:
        # load the checkpoint first: if it is unusable, the run directory stays exactly as it was
        run = Path(cfg.run_dir)
        trainer = Trainer(cfg, run)
        prepare_run_dir(cfg, overrides)
    else:
        run = prepare_run_dir(cfg, overrides)
    try:
        trainer = trainer if resuming else Trainer(cfg, run)
        metrics = trainer.train()
    except BaseException as err:
        write_status(run, "failed", error=f"{type(err).__name__}: {err}")
        raise
    print_summary(cfg, run, metrics)
    sys.stdout.flush()
    return metrics
