"""A run's config and run directory, and `launcher=local`: training in this process.

`epo train OVERRIDES` composes and validates the config once (`compose_for_train`), then either trains
here (`run_local`, which creates the run directory and saves the resolved config there), or hands the
config to epo_cli.launch.deepspeed (the deepspeed launcher's ranks) or epo_cli.launch.slurm (a SLURM job),
which write the run directory with `prepare_run_dir` before any rank starts. Every rank reads the same
config.yaml from the run directory, so all ranks agree on what runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from epo_cli.analysis.run_summary import print_summary
from epo_cli.compose import compose, validate
from epo_cli.config import GROUPS
from epo_cli.envs import make_suite
from epo_cli.errors import ConfigError, Stopped, UserError
from epo_cli.models.loading import check_attention, planned_device
from epo_cli.run_dir import check_lengths, load_run_config, new_run_dir, override_keys, write_config, write_status
from epo_cli.saved_state import check_resume_step, groups_that_disagree, read_trainer_state
from epo_cli.training.checkpoint import ResumeTarget, latest_tag, locate_resume, resolve_checkpoint
from epo_cli.training.stop import STOP, Interrupted, exit_code, signal_name
from epo_cli.training.trainer import Trainer


def compose_for_train(overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """Compose a run's config. Resuming (`trainer.resume=<run dir | checkpoint>`, or `trainer.resume=auto
    run_dir=<dir>` when that directory has a checkpoint) starts from THAT run's saved config, never the
    defaults: its `section.key=value` overrides apply on top (e.g. a longer trainer.total_steps) and it
    continues in the same directory. The saved state is checked whole first (epo_cli/saved_state.py)."""
    check_lengths(overrides)
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.resume=")), None)
    if resume == "auto":
        target = auto_resume_target(overrides)
    elif resume and resume not in ("null", "None", ""):
        target = locate_resume(resume)  # a run dir, <run>/checkpoints[/latest|best|step_N]
    else:
        target = None
    if target is None:
        return compose(overrides), overrides
    return resumed_config(target, overrides, auto=resume == "auto"), overrides


def auto_resume_target(overrides: list[str]) -> ResumeTarget | None:
    """trainer.resume=auto: the run in run_dir=<dir> and its latest complete checkpoint, or None (a fresh
    start: no run_dir, or no checkpoint there yet)."""
    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("run_dir=")), None)
    if not run_dir or run_dir in ("null", "None"):
        return None
    run = Path(run_dir).expanduser()
    if not (run / "config.yaml").is_file() or not latest_tag(run):
        return None
    return ResumeTarget(run.resolve(), resolve_checkpoint(run.resolve()))


def resumed_config(target: ResumeTarget, overrides: list[str], auto: bool = False) -> DictConfig:
    """The config that continues `target`: the run's saved config with the command's overrides on top."""
    rest = [o for o in overrides if not o.startswith("trainer.resume=")]
    groups = [o for o in rest if o.split("=", 1)[0].lstrip("+~") in GROUPS or "/" in o.split("=", 1)[0]]
    dotted = [o for o in rest if o not in groups]
    state = read_trainer_state(target.checkpoint)  # before anything is loaded or written
    base = load_run_config(target.run, overridden=override_keys(rest))
    if groups and not auto:
        raise ConfigError(f"When resuming, config groups cannot change ({', '.join(groups)}); only "
                          "section.key=value overrides apply on top of the run's saved config.")
    if groups:  # auto: a preemptible job reruns its own command; its groups must describe the run
        conflicts = groups_that_disagree(groups, base, override_keys(dotted))
        if conflicts:
            raise ConfigError(f"trainer.resume=auto continues the run in {target.run} with its own config, and "
                              f"this command's config groups ({', '.join(groups)}) would change it:\n  "
                              + "\n  ".join(conflicts[:8]) + "\nDrop those selections (or set single keys "
                              "with section.key=value), or start a new run in another run_dir.")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(hydra_free(dotted)))
    except Exception as err:  # noqa: BLE001 - reported as a config error
        raise ConfigError(f"Invalid override when resuming: {err}") from None
    merged.trainer.resume = str(target.checkpoint)
    merged.run_dir = str(target.run)
    if not any(o.startswith("trainer.stop_after=") for o in rest):
        merged.trainer.stop_after = None  # the earlier stop point is behind us
    cfg = validate(merged)
    check_resume_step(state["trainer"]["step"], cfg.trainer.total_steps, target.checkpoint)
    return cfg


def hydra_free(overrides: list[str]) -> list[str]:
    """`++key=value` / `+key=value` (Hydra's forms) as the plain `key=value` OmegaConf's dotlist reads."""
    return [o.lstrip("+") for o in overrides]


def prepare_run_dir(cfg: DictConfig, overrides: list[str]) -> Path:
    """Create the run directory and save the resolved config (with versions and command) in it."""
    run = new_run_dir(cfg)
    cfg.run_dir = str(run)
    versions = make_suite(cfg.env).versions()
    try:
        write_config(run, cfg, overrides, versions)
    except OSError as err:  # read-only, full, or a file where a folder must go: before any work
        raise UserError(f"Cannot write the run directory {run}: {err.strerror or err} "
                        f"({err.filename or run}). Choose a writable output_dir=DIR (or run_dir=DIR), or free "
                        "disk space.") from None
    return run


def run_local(cfg: DictConfig, overrides: list[str]) -> dict:
    """Train in this process (a world of one)."""
    resuming = bool(cfg.trainer.resume) and cfg.run_dir and (Path(cfg.run_dir) / "config.yaml").exists()
    check_attention(cfg.model, planned_device(cfg.trainer.device))  # before the run directory is written
    STOP.install()  # SIGTERM/SIGINT/SIGUSR1: finish the step, checkpoint it, exit 128+N
    try:
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


def stopped_message(run: Path, signum: int, step: int) -> str:
    tag = latest_tag(run)
    saved = f"the checkpoint {run / 'checkpoints' / tag}" if tag else "no checkpoint (no step had completed)"
    return (f"{signal_name(signum)}: stopped after step {step}; status.json says `stopped`, and {saved} holds "
            f"the run. Continue with: epo train trainer.resume={run}")


def _latest_step(run: Path) -> int | None:
    tag = latest_tag(run)
    return int(tag.split("_", 1)[1]) if tag and tag.startswith("step_") else None


def _best_effort_status(run: Path, status: str, **fields: object) -> None:
    """A failed write of status.json (the disk that is full) must not hide the error being reported."""
    try:
        write_status(run, status, **fields)
    except OSError:
        pass
