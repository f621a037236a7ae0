"""Settings that can start or load code: honoured only from the command line of the current invocation.

A run directory is data that anyone may have written (runs are shared, copied and downloaded), so its saved
config.yaml must not be able to run anything on the machine that resumes or evaluates it. Each setting in
COMMAND_LINE_ONLY reaches code: a saved value that differs from the schema's default is dropped (one
warning naming it and how to pass it), and the value comes from this invocation's command line or the
default. Distributed ranks read config.yaml too, so their launcher hands them the launching invocation's
values of these settings (`command_line_values`, `--command-line-settings` of epo_cli.launch.rank).

Everything else a config holds is data: names looked up in epo's registries, numbers and paths of data
files (model weights as safetensors or with the restricted unpickler, tokenizers without remote code, JSON
demonstrations, ALFWorld's PDDL and JSON, prompt templates restricted to their {fields}); `_target_`
and other Hydra instantiation keys do not exist in the schemas and are refused as unknown keys.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.config import RunConfig
from epo_cli.envs import ENV_SUITES, env_config_class


@dataclass(frozen=True)
class CommandLineOnly:
    key: str  # dotted config key
    reaches: str  # the code it can start or load


COMMAND_LINE_ONLY: tuple[CommandLineOnly, ...] = (
    CommandLineOnly("model.trust_remote_code",
                    "runs Python code from the model's repository (its config's auto_map)"),
    CommandLineOnly("env.jvm_options",
                    "is added to JAVA_TOOL_OPTIONS of ScienceWorld's JVM (-javaagent:<jar> runs that jar)"),
    CommandLineOnly("env.games_dir", "holds the TextWorld game programs the interpreter runs"),
    CommandLineOnly("env.cache_dir", "is where TextWorld game programs are read back from and run"),
    CommandLineOnly("launcher.hostfile", "names the hosts the deepspeed launcher runs commands on over ssh"),
    CommandLineOnly("logger.mlflow.tracking_uri",
                    "picks the server MLflow sends the run to, and by its scheme the plugin that stores it"),
)


def _default(key: str, env_name: str) -> tuple[bool, Any]:
    """(the schema has this key, its default) for a config whose env is `env_name`."""
    node: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is RunConfig and part == "env":
            node = env_config_class(env_name) if env_name in ENV_SUITES else None
            continue
        match = {f.name: f for f in fields(node)}.get(part) if is_dataclass(node) else None
        if match is None:
            return False, None
        value = match.default_factory() if match.default_factory is not MISSING else match.default
        if i == len(parts) - 1:
            return True, value
        node = type(value) if is_dataclass(value) else None
    return False, None


def drop_saved_settings(raw: DictConfig, source: Path, command_line: dict[str, Any] | None = None,
                        overridden: set[str] | frozenset[str] = frozenset()) -> None:
    """In a saved config `raw` (read from `source`), put every COMMAND_LINE_ONLY setting back to its default,
    or to `command_line`'s value (a launcher's flags for its ranks). One warning for each saved value that
    is dropped, except for keys in `overridden`: this invocation's overrides set them anyway."""
    env_name = str(OmegaConf.select(raw, "env.name", default="household"))
    given = command_line or {}
    for setting in COMMAND_LINE_ONLY:
        known, default = _default(setting.key, env_name)
        if not known:
            continue
        saved = OmegaConf.select(raw, setting.key, default=default)
        if saved != default and setting.key not in given and setting.key not in overridden:
            warnings.warn(f"{source} sets {setting.key}={_text(saved)}, which {setting.reaches}: it is honoured "
                          f"only from the command line, not from a saved config, so it is {_text(default)} (the "
                          f"default) here. Pass {setting.key}={_text(saved)} on the command line if you trust it.",
                          stacklevel=3)
        OmegaConf.update(raw, setting.key, given.get(setting.key, default), force_add=True)


def _text(value: Any) -> str:
    """A value as it is written in an override (true, null, 'a b')."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = str(value)
    return f"'{text}'" if (not text or any(c.isspace() for c in text)) else text


def command_line_values(cfg: DictConfig) -> dict[str, Any]:
    """This invocation's values of the COMMAND_LINE_ONLY settings its config has (they came from its command
    line or are defaults): what a launcher passes on to its ranks, which read them from config.yaml otherwise."""
    out = {}
    for setting in COMMAND_LINE_ONLY:
        value = OmegaConf.select(cfg, setting.key, default=MISSING)
        if value is not MISSING:
            out[setting.key] = value
    return out


def encode(values: dict[str, Any]) -> str:
    return json.dumps(values, sort_keys=True)


def decode(text: str | None) -> dict[str, Any]:
    values = json.loads(text) if text else {}
    known = {s.key for s in COMMAND_LINE_ONLY}
    if not isinstance(values, dict) or set(values) - known:
        raise ValueError(f"--command-line-settings takes a JSON object of {sorted(known)}, got {text!r}")
    return values
