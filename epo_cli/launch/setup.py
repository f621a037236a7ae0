"""What every launcher does before training starts: compose the run's config and write its run directory.

`epo train OVERRIDES` composes and validates the config once (`compose_for_train`; `epo config show` prints
the same), then either trains in this process (epo_cli.launch.local), or hands the config to
epo_cli.launch.deepspeed (the deepspeed launcher's ranks) or epo_cli.launch.slurm (a SLURM job), which write
the run directory with `prepare_run_dir` before any rank starts. Every rank reads the same config.yaml from
the run directory, so all ranks agree on what runs. Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.compose import compose, load_run_config, validate
from epo_cli.config import GROUPS
from epo_cli.envs import EnvSuite, make_suite
from epo_cli.errors import ConfigError, UserError, err_console
from epo_cli.models.packaged import resolve_source
from epo_cli.rundir.checkpoint_paths import ResumeTarget, latest_tag, locate_resume, resolve_checkpoint
from epo_cli.rundir.folder import check_lengths, new_run_dir, override_keys, write_config
from epo_cli.rundir.saved_state import check_resume_step, read_trainer_state


def compose_for_train(overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """Compose a run's config. Resuming (`trainer.resume=<run dir | checkpoint>`, or `trainer.resume=auto
    run_dir=<dir>` when that directory has a checkpoint) starts from THAT run's saved config, never the
    defaults: its `section.key=value` overrides apply on top (e.g. a longer trainer.total_steps) and it
    continues in the same directory. The saved state is checked whole first (epo_cli/rundir/saved_state.py)."""
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
        conflicts = groups_that_disagree(groups, base, dotted)
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


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


_ABSENT = object()
#: keys that name a run rather than configure it: a resume may always differ in them
IDENTITY_KEYS = ("name", "run_dir", "output_dir", "trainer.resume", "trainer.stop_after")


def groups_that_disagree(groups: list[str], saved: DictConfig, dotted: list[str]) -> list[str]:
    """`group=option` selections of a command that resumes a run with trainer.resume=auto must describe that
    run: every setting of a selected group's section (for `experiment=`, every setting the preset changes)
    must equal the run's saved value, unless an override of the command sets it anyway. Returns
    'key: the run has A, this command B' for each that does not (empty: the command is the run's own).
    The groups are composed with the command's `dotted` overrides: a preset's ${required:...} value (e.g.
    model.path) is one of them, and those keys are the command's anyway."""
    overridden = override_keys(dotted)
    with warnings.catch_warnings():  # the run's own compose (validate, below) warns once; these only compare
        warnings.simplefilter("ignore")
        selected, defaults = compose([*groups, *dotted]), compose([])
    chosen, base, run = (_leaves(OmegaConf.to_container(c, resolve=True)) for c in (selected, defaults, saved))
    sections = {g.split("=", 1)[0].lstrip("+~") for g in groups} - {"experiment"}
    out = []
    for key, value in chosen.items():
        in_section = key.split(".")[0] in sections
        if key in overridden or key.startswith(IDENTITY_KEYS) or not (in_section or value != base.get(key)):
            continue
        if run.get(key, _ABSENT) != value:
            out.append(f"{key}: the run has {run.get(key, 'nothing')!r}, this command {value!r}")
    return out



def hydra_free(overrides: list[str]) -> list[str]:
    """`++key=value` / `+key=value` (Hydra's forms) as the plain `key=value` OmegaConf's dotlist reads."""
    return [o.lstrip("+") for o in overrides]


def prepare_run_dir(cfg: DictConfig, overrides: list[str], suite: EnvSuite | None = None) -> Path:
    """Create the run directory and save the resolved config (with versions and command) in it. `suite`:
    the run's env suite where this process built it already (launch.local: one per run, handed down)."""
    run = new_run_dir(cfg)
    cfg.run_dir = str(run)
    if cfg.model.source == "auto":  # decided once, saved below: every rank and every resume loads the same copy
        cfg.model.source = resolve_source(cfg.model)
        err_console.print(f"model.source=auto: loading {cfg.model.name} from the "
                          + ("hub" if cfg.model.source == "hub" else f"package {cfg.model.package}"))
    versions = (suite or make_suite(cfg.env)).versions()
    try:
        write_config(run, cfg, overrides, versions)
    except OSError as err:  # read-only, full, or a file where a folder must go: before any work
        raise UserError(f"Cannot write the run directory {run}: {err.strerror or err} "
                        f"({err.filename or run}). Choose a writable output_dir=DIR (or run_dir=DIR), or free "
                        "disk space.") from None
    return run
