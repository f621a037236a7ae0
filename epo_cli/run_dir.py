"""Run directories: every run leaves a folder that says exactly what ran and what happened.

    outputs/<date>/<time>-<name>/
        config.yaml          the fully resolved config, plus `meta` (versions, command, overrides)
        metrics.jsonl        one JSON object per logged step
        tb/                  TensorBoard events
        checkpoints/step_N/  model/optimizer (DeepSpeed), trainer state, RNG states; `latest` names one
        final/               the trained policy in Hugging Face format (model.path=<run>/final)
        eval/  plots/  samples/   evaluation results, PNG plots, decoded trajectories
        status.json          running | finished | stopped (with the signal) | failed (with the error)
"""

from __future__ import annotations

import datetime
import errno
import json
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.compose import validate
from epo_cli.errors import ConfigError, UserError
from epo_cli.saved_state import check_saved_config, load_yaml
from epo_cli.trust import drop_saved_settings

CORE_PACKAGES = ("epo", "torch", "transformers", "deepspeed", "hydra-core", "omegaconf", "tokenizers")


def package_versions(extra: dict[str, str] | None = None) -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in CORE_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions.update(extra or {})
    return versions


#: the longest run name: the folder is "<HH-MM-SS>-<name>" and file systems allow 255 bytes per name
MAX_NAME_CHARS = 200
#: the longest path a run directory may have (Linux PATH_MAX is 4096; files inside need room too)
MAX_PATH_CHARS = 3500


def check_name(name: str, key: str = "name") -> None:
    """A run (or sweep) name becomes a folder name: one clear error instead of an OSError later."""
    if not name or name in (".", ".."):
        raise ConfigError(f"{key}='{name}' is not a usable folder name; give it letters, e.g. {key}=my-run.")
    if "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"{key}='{name[:80]}' contains a path separator; a name is one folder name "
                          "(use output_dir=DIR to choose where runs go).")
    if len(name.encode()) > MAX_NAME_CHARS:
        raise ConfigError(f"{key} is {len(name.encode())} bytes long ('{name[:40]}...'); at most {MAX_NAME_CHARS} "
                          "are accepted (it becomes a folder name). Choose a shorter name.")


def check_path(path: Path, key: str) -> None:
    text = str(path)
    if len(text) > MAX_PATH_CHARS:
        raise ConfigError(f"{key} is {len(text)} characters long ('{text[:40]}...'); at most {MAX_PATH_CHARS} "
                          "are accepted. Choose a shorter directory.")
    for part in path.parts:
        if len(part.encode()) > 255:
            raise ConfigError(f"{key} has a folder name of {len(part.encode())} bytes ('{part[:40]}...'); "
                              "file systems allow at most 255. Choose a shorter directory.")


#: the longest override a command line may carry (a longer one is a paste accident, not a setting)
MAX_OVERRIDE_CHARS = 4096


def check_lengths(overrides: list[str]) -> None:
    """Over-long overrides are one clear error, not an OSError (file name too long) deep in a run."""
    for o in overrides:
        if len(o) > MAX_OVERRIDE_CHARS:
            key = o.split("=", 1)[0][:80]
            raise ConfigError(f"The override for '{key}' is {len(o)} characters long; at most "
                              f"{MAX_OVERRIDE_CHARS} are accepted. Shorten the value (put long lists in a "
                              "config file under conf/ and select it).")


def new_run_dir(cfg: DictConfig) -> Path:
    if cfg.run_dir:
        check_path(Path(cfg.run_dir), "run_dir")
        return Path(cfg.run_dir)
    check_name(str(cfg.name))
    check_path(Path(cfg.output_dir), "output_dir")
    now = datetime.datetime.now()
    return Path(cfg.output_dir) / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S')}-{cfg.name}"


def write_config(run: Path, cfg: DictConfig, overrides: list[str], env_versions: dict[str, str]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    data = OmegaConf.to_container(cfg, resolve=True)
    data["meta"] = {
        "versions": package_versions(env_versions),
        "overrides": list(overrides),
        "command": " ".join(["epo", *sys.argv[1:]]) if sys.argv else "",
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(data)))


#: keys that earlier versions saved in config.yaml and that no longer exist: dropped when a run is read,
#: so that its runs can still be resumed and evaluated (they had no effect, or the note says what replaced them)
RETIRED_KEYS = ("trainer.log_every", "algo.dynamic_sampling_metric")
#: what replaced a retired key that had an effect: warned when a run that relied on it is read
RETIRED_NOTES = {"algo.dynamic_sampling_metric": (
    "algo.dynamic_sampling", "dynamic sampling now keeps the groups the estimator gives a non-zero advantage "
    "(algo.group_filter=signal), not those whose returns or outcomes differ")}


def load_run_config(run: Path, command_line: dict[str, Any] | None = None,
                    overridden: set[str] | frozenset[str] = frozenset()) -> DictConfig:
    """The resolved config a run was started with (validated again against today's schemas), with the
    settings that can start code (epo_cli.trust.COMMAND_LINE_ONLY) reset to their defaults (one warning
    each) or set to what `command_line` (this invocation's own values for them, e.g. from a launcher's
    flags) says; the caller's overrides (`overridden`: their keys, which get no warning) apply on top."""
    path = Path(run) / "config.yaml"
    if not path.exists():
        raise UserError(f"'{run}' is not a run directory (no config.yaml). Pass the folder `epo train` made, "
                        "e.g. outputs/<date>/<time>-<name>.")
    try:  # a safe loader (a python/object tag is an error, never run), its aliases' expansion bounded
        raw = load_yaml(path)
    except Exception as err:  # noqa: BLE001 - yaml and omegaconf errors alike: the file is damaged
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"'{path}' is not a readable run config ({type(err).__name__}: {first}); nothing was "
                        "loaded. Restore it from a copy of the run, or start a new run.") from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"'{path}' is not a run config (expected a mapping of sections); nothing was loaded.")
    raw.pop("meta", None)
    check_saved_config(raw, path)  # every section and key present: a file cut short is refused
    for key in RETIRED_KEYS:
        section, _, name = key.rpartition(".")
        node = OmegaConf.select(raw, section, default=None)
        if isinstance(node, DictConfig) and name in node:
            node.pop(name)
            if key in RETIRED_NOTES and OmegaConf.select(raw, RETIRED_NOTES[key][0], default=False):
                warnings.warn(f"{path} sets {key}, which is retired: {RETIRED_NOTES[key][1]}.", stacklevel=2)
    drop_saved_settings(raw, path, command_line, overridden)
    return validate(raw)


def read_yaml_data(path: Path) -> Any:
    """A YAML file of a run (safe loader) as plain data, or None with a one-line warning if it is damaged:
    for readers such as `epo report` that can go on without it."""
    try:
        return OmegaConf.to_container(load_yaml(path))
    except Exception as err:  # noqa: BLE001 - yaml and omegaconf errors alike
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        warnings.warn(f"'{path}' is unreadable ({type(err).__name__}: {first}); going on without it.",
                      stacklevel=2)
        return None


def write_status(run: Path, status: str, **fields: Any) -> None:
    """status.json, replaced atomically (a reader never sees half a file); the alerts recorded so far
    (record_alert) are kept. On a full disk no new file can be written, so the existing status.json is
    rewritten in place instead (its block is already allocated): a run that fails because the disk filled up
    still says `failed`."""
    payload = {"status": status, "time": datetime.datetime.now().isoformat(timespec="seconds"), **fields}
    alerts = read_status(run).get("alerts")
    if alerts and "alerts" not in payload:
        payload["alerts"] = alerts
    text = json.dumps(payload, indent=2)
    tmp = run / "status.json.tmp"
    try:
        tmp.write_text(text)
        tmp.replace(run / "status.json")
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not (run / "status.json").is_file():
            raise
        tmp.unlink(missing_ok=True)
        with open(run / "status.json", "r+") as f:
            f.write(text)
            f.truncate()


def record_alert(run: Path, kind: str, step: int, reasons: list[str]) -> None:
    """Note an alert of `kind` at `step` in status.json: alerts.<kind> = {first_step, last_step, count, reasons
    (the last ones)}; the status itself is unchanged."""
    current = read_status(run)
    alerts = current.get("alerts") if isinstance(current.get("alerts"), dict) else {}
    entry = alerts.get(kind) if isinstance(alerts.get(kind), dict) else {"first_step": step, "count": 0}
    entry.update(last_step=step, count=int(entry.get("count", 0)) + 1, reasons=reasons)
    alerts[kind] = entry
    fields = {k: v for k, v in current.items() if k not in ("status", "time", "alerts")}
    write_status(run, str(current.get("status", "running")), **fields, alerts=alerts)


def read_status(run: Path) -> dict[str, Any]:
    """status.json as a mapping; {"status": "unknown"} when it is missing or damaged (also a JSON value that
    is not an object, or a status that is not a string)."""
    try:
        data = json.loads((Path(run) / "status.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"status": "unknown"}
    if not isinstance(data, dict) or not isinstance(data.get("status"), str):
        return {"status": "unknown"}
    return data


def override_keys(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The dotted keys that `key=value` overrides set (`++key=value`, `+key=value` too)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
