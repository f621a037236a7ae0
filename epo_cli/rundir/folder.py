"""Run directories: every run leaves a folder that says exactly what ran and what happened.

    outputs/<date>/<time>-<name>/
        config.yaml          the fully resolved config, plus `meta` (versions, command, overrides)
        metrics.jsonl        one JSON object per logged step
        tb/                  TensorBoard events
        checkpoints/step_N/  model/optimizer (DeepSpeed), trainer state, RNG states; `latest` names one
        final/               the trained policy in Hugging Face format (model.path=<run>/final)
        eval/  plots/  samples/   evaluation results, PNG plots, decoded trajectories
        status.json          running | finished | stopped (with the signal) | failed (with the error)
        .epo.lock            while a process writes the run: its lock (see `claim_run_dir`)

One process writes a run directory at a time, and a directory that holds a run is only ever written again to
resume that run: `claim_run_dir` takes the directory's lock (an exclusive flock on .epo.lock, held until the
command ends, then removed; the kernel releases it if the process dies; a launcher's ranks run under their
launcher's claim) and refuses a directory that holds anything
but the files `epo sweep` puts in a job's folder before the job starts, unless the command resumes it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.config import RENAMED_KEYS, RENAMED_VALUES
from epo_cli.errors import ConfigError, UserError
from epo_cli.rundir.received import ReceivedFileError, read_json
from epo_cli.rundir.saved_state import check_saved_config, load_yaml
from epo_cli.rundir.trust import drop_saved_settings
from epo_cli.rundir.writable import (
    UnsafeEntryError,
    check_entries,
    check_opened,
    open_for_writing,
    refuse_unsafe,
    write_file,
)

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
    write_file(run / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(data)))


#: keys that earlier versions saved in config.yaml and that no longer exist: dropped when a run is read,
#: so that its runs can still be resumed and evaluated (they had no effect, or the note says what replaced them)
RETIRED_KEYS = ("trainer.log_every", "algo.dynamic_sampling_metric")
#: keys whose type became int after runs saved them as a float: a saved whole number (1.0) is that int
NOW_INTEGER_KEYS = ("rollout.vllm.kv_cache_gib",)
#: what replaced a retired key that had an effect: warned when a run that relied on it is read
RETIRED_NOTES = {"algo.dynamic_sampling_metric": (
    "algo.dynamic_sampling", "dynamic sampling now keeps the groups the estimator gives a non-zero advantage "
    "(algo.group_filter=signal), not those whose returns or outcomes differ")}


def read_run_config(run: Path, command_line: dict[str, Any] | None = None,
                    overridden: set[str] | frozenset[str] = frozenset()) -> DictConfig:
    """The resolved config a run was started with, brought to today's key names (not yet validated against
    today's schemas: epo_cli.compose.load_run_config does that, above this floor), with the
    settings that can start code (epo_cli.rundir.trust.COMMAND_LINE_ONLY) reset to their defaults (one warning
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
    for old, new in RENAMED_KEYS.items():  # saved before the key was renamed: the same setting, its new name
        section, _, name = old.rpartition(".")
        node = OmegaConf.select(raw, section, default=None)
        new_section, _, new_name = new.rpartition(".")
        new_node = OmegaConf.select(raw, new_section, default=None)
        if isinstance(node, DictConfig) and name in node and not (isinstance(new_node, DictConfig)
                                                                   and new_name in new_node):
            OmegaConf.update(raw, new, node.pop(name), force_add=True)  # the new key may be in another section
    for key, renamed in RENAMED_VALUES.items():  # likewise a value renamed since
        value = OmegaConf.select(raw, key, default=None)
        if isinstance(value, str) and value in renamed:
            OmegaConf.update(raw, key, renamed[value])
    for key in NOW_INTEGER_KEYS:  # any other value is left for the schema to refuse, naming the key
        value = OmegaConf.select(raw, key, default=None)
        if isinstance(value, float) and value.is_integer():
            OmegaConf.update(raw, key, int(value))
    check_saved_config(raw, path)  # every section and key present: a file cut short is refused
    for key in RETIRED_KEYS:
        section, _, name = key.rpartition(".")
        node = OmegaConf.select(raw, section, default=None)
        if isinstance(node, DictConfig) and name in node:
            node.pop(name)
            if key in RETIRED_NOTES and OmegaConf.select(raw, RETIRED_NOTES[key][0], default=False):
                warnings.warn(f"{path} sets {key}, which is retired: {RETIRED_NOTES[key][1]}.", stacklevel=2)
    drop_saved_settings(raw, path, command_line, overridden)
    return raw


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
    try:
        write_file(run / "status.json", text)  # status.json.tmp, renamed over it; never through a symlink
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not (run / "status.json").is_file():
            raise
        (run / "status.json.tmp").unlink(missing_ok=True)
        with open_for_writing(run / "status.json", truncate=False) as f:
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
    try:  # bounded: a FIFO, /dev/zero or a deep nesting is damage like any other
        data = read_json(Path(run) / "status.json", "status", within=Path(run))
    except (OSError, ReceivedFileError):
        return {"status": "unknown"}
    if not isinstance(data, dict) or not isinstance(data.get("status"), str):
        return {"status": "unknown"}
    return data


def override_keys(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The dotted keys that `key=value` overrides set (`++key=value`, `+key=value` too)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


# ----------------------------------------------------------------------------------------------------
# Ownership: one process writes a run directory, and a run is only written again to resume it
# ----------------------------------------------------------------------------------------------------

#: the lock file of a run (or sweep) directory: whoever holds an exclusive flock on it owns the directory
LOCK_NAME = ".epo.lock"
#: what `epo sweep` writes into a job's folder before that job's `epo train` claims it
SWEEP_JOB_FILES = frozenset({".hydra", "sweep_job.json", "train.log", "epo_sweep.log"})
#: what marks a folder as holding a run, in the order a message names them
RUN_FILES = ("config.yaml", "metrics.jsonl", "status.json", "checkpoints", "final")


@dataclass
class Claim:
    """A directory this process owns: the open lock file, and the folders the claim created (removed again
    when nothing else was written into them)."""

    path: Path
    fd: int
    created: list[Path]


_CLAIMS: dict[Path, Claim] = {}


def lock_folder(path: Path, what: str, walk: bool = True) -> Claim:
    """Create `path` if needed and take its lock (an exclusive, non-blocking flock on path/.epo.lock, which
    the kernel releases when the process ends, however it ends). A second process is refused with the pid
    and command of the one that holds it. `what`: "run directory", "sweep directory" or "eval output
    folder", for the messages. The lock file is opened without following a symlink and must be a regular
    file; with `walk`, every entry in the folder must be a real folder or a regular file (check_entries: a
    received run whose checkpoints/latest is a symlink would otherwise be written through by a resume).
    Either is one UnsafeEntryError naming the entry."""
    path = Path(path).expanduser().absolute()
    if path in _CLAIMS:
        return _CLAIMS[path]
    if path.exists() and not path.is_dir():
        raise UserError(f"The {what} '{path}' is a file, not a folder. Choose a folder that does not exist yet.")
    created = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # read-only, full, or a file where a folder must go: before any work
        setting = "output_dir=DIR (or run_dir=DIR)" if what == "run directory" else "hydra.sweep.dir=DIR"
        raise UserError(f"Cannot write the {what} {path}: {err.strerror or err} ({err.filename or path}). Choose "
                        f"a writable {setting}, or free disk space.") from None
    while True:
        fd = _open_lock(path, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise UserError(f"The {what} '{path}' is in use by another epo process ({holder}): one process "
                            f"writes a {what} at a time. Wait for that one to end, or choose another folder.") from None
        if _is_current(fd, path / LOCK_NAME):
            break
        os.close(fd)  # its owner removed that lock file while we opened it: take the one there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {' '.join(['epo', *sys.argv[1:]])[:1000]}\n".encode(), 0)
    claim = Claim(path, fd, created)
    _CLAIMS[path] = claim
    try:  # a received folder's planted symlinks, FIFOs or devices: refused before anything writes there
        if walk:
            check_entries(path)
    except UnsafeEntryError:
        release(claim)
        raise
    return claim


def _open_lock(path: Path, what: str) -> int:
    """The lock file, opened read-write without following a symlink or blocking on a FIFO: a regular file of
    one link, or UnsafeEntryError naming it (a received folder's .epo.lock -> a file outside it would be
    truncated and overwritten with this process's pid)."""
    lock = path / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     0o644)
    except OSError as err:
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UserError(f"The {what} '{path}' is read-only ({err.strerror}): epo writes its lock, "
                            "checkpoints, metrics and status there. Copy it to a writable folder and use the "
                            f"copy (cp -r '{path}' NEW_DIR), or make it writable.") from None
        refuse_unsafe(lock, err)  # a symlink (ELOOP), a FIFO, a folder: named
        raise
    try:
        check_opened(lock, fd)
        os.set_blocking(fd, True)
    except UnsafeEntryError:
        os.close(fd)
        raise
    return fd


def _is_current(fd: int, lock: Path) -> bool:
    """Whether the locked file is still the one at `lock` (release removes it while holding the lock)."""
    try:
        here = os.stat(lock)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_ino, here.st_dev) == (held.st_ino, held.st_dev)


def release_folders() -> None:
    """Release every folder this process claimed (cli.main, when a command ends)."""
    for claim in list(_CLAIMS.values()):
        release(claim)


def release(claim: Claim) -> None:
    """Release one claim: its lock file is removed while still locked (a process that opened it meanwhile
    sees that and takes the next one: `_is_current`), so a run leaves no lock behind; a folder the claim
    created and nothing else wrote into is removed again, with the parents it created."""
    if _CLAIMS.pop(claim.path, None) is None:
        return
    try:
        (claim.path / LOCK_NAME).unlink(missing_ok=True)
        for folder in claim.created:
            folder.rmdir()  # only while empty: stops at the first folder that holds something
    except OSError:  # not empty (the run wrote there), read-only, or already gone: leave it
        pass
    finally:
        os.close(claim.fd)


def foreign_entries(path: Path) -> list[str]:
    """What a folder holds besides its lock and the files a sweep puts in a job's folder."""
    try:
        names = [p.name for p in Path(path).iterdir()]
    except OSError:
        return []
    return sorted(n for n in names if n != LOCK_NAME and n not in SWEEP_JOB_FILES)


def claim_run_dir(cfg: DictConfig, overrides: list[str]) -> Path:
    """Own the run directory of `epo train` before anything is loaded or written (a new dated folder is
    chosen here when run_dir is unset): its lock for the life of this process, and refused
      - when another process holds it (two `epo train` on one run_dir);
      - when it already holds something and this command does not resume it: a finished or stopped run
        (`epo train run_dir=<run>` would overwrite its config, final/ and status and mix its metrics), or
        any other files; `trainer.resume=auto` over a run without a complete checkpoint is refused too
        (it cannot continue that run, and starting over would mix two runs in one folder), while over an
        empty or new folder it starts the run;
      - when trainer.resume=<run> and run_dir=<another folder> disagree (a resume continues in its run).
    Sets cfg.run_dir and returns it."""
    check_resume_run_dir(cfg, overrides)
    resume = cfg.trainer.resume
    resuming = resume is not None and resume != "auto"
    run = Path(new_run_dir(cfg)).expanduser().absolute()
    claim = lock_folder(run, "run directory")
    cfg.run_dir = str(run)
    found = [] if resuming else foreign_entries(run)
    if not found:
        return run
    release(claim)
    shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
    if not any(name in found for name in RUN_FILES):
        raise UserError(f"run_dir '{run}' is not empty (it holds {shown}); a run starts in an empty or new "
                        "folder. Choose another run_dir (or leave it unset for a new dated folder under "
                        "output_dir).")
    if resume == "auto":
        raise UserError(f"trainer.resume=auto found no complete checkpoint in '{run}', which already holds a run "
                        f"({shown}): there is nothing to continue, and starting over there would mix two runs "
                        "in one folder. Start the run in a new run_dir, or remove that folder first if its run "
                        "is not needed.")
    raise UserError(f"run_dir '{run}' already holds a run ({shown}); a run directory is never reused for a new "
                    "run (it would overwrite that run's config, final/ and status, and mix the metrics). To "
                    f"continue that run: epo train trainer.resume={run} (plus overrides such as a larger "
                    "trainer.total_steps). To start a new run: choose another run_dir, or leave it unset.")


def check_resume_run_dir(cfg: DictConfig, overrides: list[str]) -> None:
    """trainer.resume=<run> continues in that run's folder: a run_dir=<another folder> on the same command
    line is refused rather than ignored (`epo config show` and `epo train` alike)."""
    given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.lstrip("+").startswith("run_dir=")), None)
    resume = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("trainer.resume=")), None)
    if not given or given in ("null", "None") or not resume or resume in ("auto", "null", "None"):
        return
    if Path(given).expanduser().resolve() != Path(str(cfg.run_dir)).expanduser().resolve():
        raise ConfigError(f"trainer.resume={resume} continues the run in '{cfg.run_dir}' (its checkpoints, "
                          f"metrics and status are there), so run_dir={given} cannot apply. Drop run_dir= to "
                          "resume; or, to start a new run in that folder from this run's weights, use "
                          f"model.path={cfg.run_dir}/final run_dir={given} without trainer.resume.")
