"""A run's saved state is checked whole before it is used, or refused with one message.

    config.yaml          every section and key of the schemas present (a file cut short is not completed
                         from the defaults), then the same types and ranges as on the command line (validate)
    trainer_state.json   a JSON object of epo's checkpoint format; trainer.step an int >= 0 that matches the
                         checkpoint folder's step_N and its COMPLETE marker; the counters and the state of
                         each part (entropy history, monitor, schedule, curriculum) of the right kinds
    resuming             the checkpoint's step below trainer.total_steps (else nothing would train); with
                         trainer.resume=auto, the command's config-group selections agree with the run

Torch-free: `epo train` checks all of it before the run directory is touched or any rank starts.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.compose import compose
from epo_cli.config import RunConfig
from epo_cli.envs import ENV_SUITES, env_config_class
from epo_cli.errors import ConfigError, UserError

#: written into trainer_state.json by epo_cli.training.checkpoint.save
CHECKPOINT_FORMAT = "epo-checkpoint/2"
#: keys added to the schemas after runs were saved without them: filled from their defaults (none yet; a key
#: added to the schemas goes here, so that older runs still resume and evaluate)
ADDED_KEYS: tuple[str, ...] = ()


# ---- config.yaml ---------------------------------------------------------------------------------------------

def _expected_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of `schema` (nested sections walked; dict-valued fields are one key)."""
    out = []
    for f in fields(schema):
        made = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
        if is_dataclass(made):
            out.append(prefix + f.name)
            out += _expected_keys(type(made), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def check_saved_config(raw: DictConfig, path: Path) -> None:
    """Every section and key of the schemas (the env's by env.name) must be in a saved config: a file cut
    short would otherwise be completed silently from today's defaults. One UserError listing what is missing."""
    env_name = OmegaConf.select(raw, "env.name", default=None)
    if env_name not in ENV_SUITES:
        raise UserError(f"'{path}' is not a complete run config: env.name is "
                        f"{'missing' if env_name is None else repr(env_name)} (one of {', '.join(ENV_SUITES)}). "
                        "Nothing was loaded; restore the file from a copy of the run.")
    expected = [k for k in _expected_keys(RunConfig) if k != "env" and not k.startswith("env.")]
    expected += ["env"] + [f"env.{k}" for k in _expected_keys(env_config_class(str(env_name)))]
    missing = [k for k in expected if k not in ADDED_KEYS and OmegaConf.select(raw, k, default=MISSING) is MISSING]
    if missing:
        sections = sorted({k.split(".")[0] for k in missing})
        raise UserError(f"'{path}' is not a complete run config: {len(missing)} setting(s) are missing (e.g. "
                        f"{', '.join(missing[:5])}; in {', '.join(sections)}), as in a file cut short. Nothing "
                        "was loaded or taken from the defaults; restore the file from a copy of the run.")


# ---- trainer_state.json --------------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _trainer_problem(trainer: Any) -> str | None:
    """What is wrong with the `trainer` counters of a trainer_state.json, or None."""
    if not isinstance(trainer, Mapping):
        return "`trainer` is not an object"
    known = {"step", "consecutive_skips", "best_value", "best_step", "logger_ids", "collapse_signals"}
    if set(trainer) - known:
        return f"`trainer` has unknown entries {sorted(set(trainer) - known)}"
    step = trainer.get("step")
    if not _is_int(step) or step < 0:
        return f"`trainer.step` is {step!r}, not a whole number >= 0"
    if not _is_int(trainer.get("consecutive_skips", 0)) or trainer.get("consecutive_skips", 0) < 0:
        return f"`trainer.consecutive_skips` is {trainer.get('consecutive_skips')!r}, not a whole number >= 0"
    best_value, best_step = trainer.get("best_value"), trainer.get("best_step")
    if best_value is not None and (not isinstance(best_value, (int, float)) or isinstance(best_value, bool)
                                   or not math.isfinite(best_value)):
        return f"`trainer.best_value` is {best_value!r}, not a finite number or null"
    if best_step is not None and (not _is_int(best_step) or not 0 < best_step <= step):
        return f"`trainer.best_step` is {best_step!r}, not a step between 1 and trainer.step ({step})"
    ids = trainer.get("logger_ids", {})
    if not isinstance(ids, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ids.items()):
        return "`trainer.logger_ids` is not an object of strings"
    signals = trainer.get("collapse_signals", [])
    if not isinstance(signals, list) or not all(isinstance(s, str) for s in signals):
        return "`trainer.collapse_signals` is not a list of strings"
    return None


def _folder_step(folder: Path) -> int | None:
    name = folder.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint folder, checked whole (see the module docstring); UserError naming
    the file and the problem. Returns the payload without its `format` entry."""
    path = Path(folder) / "trainer_state.json"
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"'{path}' is unreadable ({type(err).__name__}: {str(err).splitlines()[0][:200]}); the "
                        "checkpoint cannot be resumed. Resume from another checkpoint of the run "
                        "(trainer.resume=<run>/checkpoints/step_N); nothing was modified.") from None
    if not isinstance(payload, dict):
        raise UserError(f"'{path}' is not a JSON object (it holds a {type(payload).__name__}); the checkpoint "
                        "cannot be resumed. Resume from another checkpoint of the run "
                        "(trainer.resume=<run>/checkpoints/step_N); nothing was modified.")
    found = payload.get("format")
    if found != CHECKPOINT_FORMAT:
        raise UserError(
            f"Checkpoint '{folder}' has format {found or 'none (written before epo-checkpoint/2)'}, and this "
            f"epo reads {CHECKPOINT_FORMAT}: older checkpoints kept pickled RNG states, which epo no longer "
            "unpickles. Start a new run from its weights instead: model.path=<run>/final (or evaluate it with "
            "`epo eval run=<run> checkpoint=<step_N>`, which reads weights only)."
        )
    problem = _trainer_problem(payload.get("trainer"))
    if problem is None:
        step = payload["trainer"]["step"]
        named = _folder_step(Path(folder))
        marker = Path(folder) / "COMPLETE"
        marked = marker.read_text().strip() if marker.is_file() else ""
        if named is not None and step != named:
            problem = f"`trainer.step` is {step} but the folder is {Path(folder).name}"
        elif marked.isdigit() and int(marked) != step:
            problem = f"`trainer.step` is {step} but its COMPLETE marker says step {marked}"
    for part in ("entropy_history", "monitor", "entropy_schedule", "curriculum"):
        if problem is None and not isinstance(payload.get(part, {}), Mapping):
            problem = f"`{part}` is not an object"
    if problem is None and ("entropy_history" not in payload or "monitor" not in payload):
        problem = "`entropy_history` or `monitor` is missing"
    if problem is not None:
        raise UserError(f"'{path}' does not describe this checkpoint: {problem}. It was damaged or edited; "
                        "resume from another checkpoint of the run (trainer.resume=<run>/checkpoints/step_N). "
                        "Nothing was loaded or modified.")
    payload.pop("format")
    return payload


@contextlib.contextmanager
def refusing_damaged(folder: Path) -> Iterator[None]:
    """Restoring the parts' states from a checked payload: an entry of the wrong shape deep inside one (that
    the checks above do not know) is still one message naming the file, not a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise UserError(f"'{Path(folder) / 'trainer_state.json'}' holds a state this epo cannot restore "
                        f"({type(err).__name__}: {str(err)[:200]}). Resume from another checkpoint of the run "
                        "(trainer.resume=<run>/checkpoints/step_N); nothing was modified.") from None


# ---- resuming ------------------------------------------------------------------------------------------------

def check_resume_step(step: int, total_steps: int, folder: Path) -> None:
    """A checkpoint at or beyond trainer.total_steps leaves nothing to train: say so instead of 'finished'."""
    if step >= total_steps:
        raise ConfigError(f"The checkpoint {folder} is at step {step} and trainer.total_steps={total_steps}: nothing "
                          f"is left to train. To continue, pass a larger trainer.total_steps (e.g. "
                          f"trainer.total_steps={step + max(1, total_steps)}); to use the trained policy, "
                          "evaluate the run (`epo eval run=<run>`).")


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


#: keys that name a run rather than configure it: a resume may always differ in them
IDENTITY_KEYS = ("name", "run_dir", "output_dir", "trainer.resume", "trainer.stop_after")


def groups_that_disagree(groups: list[str], saved: DictConfig, overridden: set[str]) -> list[str]:
    """`group=option` selections of a command that resumes a run with trainer.resume=auto must describe that
    run: every setting of a selected group's section (for `experiment=`, every setting the preset changes)
    must equal the run's saved value, unless an override of the command sets it anyway. Returns
    'key: the run has A, this command B' for each that does not (empty: the command is the run's own)."""
    selected, defaults = compose(groups), compose([])
    chosen, base, run = (_leaves(OmegaConf.to_container(c, resolve=True)) for c in (selected, defaults, saved))
    sections = {g.split("=", 1)[0].lstrip("+~") for g in groups} - {"experiment"}
    out = []
    for key, value in chosen.items():
        in_section = key.split(".")[0] in sections
        if key in overridden or key.startswith(IDENTITY_KEYS) or not (in_section or value != base.get(key)):
            continue
        if run.get(key, MISSING) != value:
            out.append(f"{key}: the run has {run.get(key, 'nothing')!r}, this command {value!r}")
    return out
