"""What every launcher does before training starts: compose the run's config and write its run directory.

`epo train OVERRIDES` composes and validates the config once (`compose_for_train`; `epo config show` prints
the same), then either trains in this process (epo_cli.launch.local), or hands the config to
epo_cli.launch.deepspeed (the deepspeed launcher's ranks) or epo_cli.launch.slurm (a SLURM job), which write
the run directory with `prepare_run_dir` before any rank starts. Every rank reads the same config.yaml from
the run directory, so all ranks agree on what runs. Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from epo_cli.checkpoint_paths import latest_tag, locate_resume
from epo_cli.compose import compose, validate
from epo_cli.envs import EnvSuite, make_suite
from epo_cli.errors import ConfigError, UserError
from epo_cli.run_dir import check_lengths, load_run_config, new_run_dir, write_config
from epo_cli.training.stop import signal_name


def compose_for_train(overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """Compose a run's config. `trainer.resume=<run dir>` starts from that run's saved config (the other
    overrides apply on top, e.g. a longer trainer.total_steps) and continues in the same directory."""
    check_lengths(overrides)
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.resume=")), None)
    if resume and resume not in ("auto", "null", "None", ""):
        # a run dir, <run>/checkpoints[/latest|best|step_N]: always THAT run's saved config, never defaults
        target = locate_resume(resume)
        base = load_run_config(target.run)
        rest = [o for o in overrides if not o.startswith("trainer.resume=")]
        groups = [o for o in rest if "." not in o.split("=", 1)[0] and o.split("=", 1)[0] not in ("seed", "name")]
        if groups:
            raise ConfigError(f"When resuming, config groups cannot change ({', '.join(groups)}); only "
                              "section.key=value overrides apply on top of the run's saved config.")
        try:
            merged = OmegaConf.merge(base, OmegaConf.from_dotlist(rest))
        except Exception as err:  # noqa: BLE001 - reported as a config error
            raise ConfigError(f"Invalid override when resuming: {err}") from None
        merged.trainer.resume = str(target.checkpoint)
        merged.run_dir = str(target.run)
        if not any(o.startswith("trainer.stop_after=") for o in rest):
            merged.trainer.stop_after = None  # the earlier stop point is behind us
        return validate(merged), overrides
    return compose(overrides), overrides


def prepare_run_dir(cfg: DictConfig, overrides: list[str], suite: EnvSuite | None = None) -> Path:
    """Create the run directory and save the resolved config (with versions and command) in it. `suite`:
    the run's env suite where this process built it already (launch.local: one per run, handed down)."""
    run = new_run_dir(cfg)
    cfg.run_dir = str(run)
    versions = (suite or make_suite(cfg.env)).versions()
    try:
        write_config(run, cfg, overrides, versions)
    except OSError as err:  # read-only, full, or a file where a folder must go: before any work
        raise UserError(f"Cannot write the run directory {run}: {err.strerror or err} "
                        f"({err.filename or run}). Choose a writable output_dir=DIR (or run_dir=DIR), or free "
                        "disk space.") from None
    return run


def stopped_message(run: Path, signum: int, step: int) -> str:
    tag = latest_tag(run)
    saved = f"the checkpoint {run / 'checkpoints' / tag}" if tag else "no checkpoint (no step had completed)"
    return (f"{signal_name(signum)}: stopped after step {step}; status.json says `stopped`, and {saved} holds "
            f"the run. Continue with: epo train trainer.resume={run}")
