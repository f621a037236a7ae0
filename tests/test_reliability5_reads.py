"""Issue 41, class 2: every received file is bounded data.

Files read from a run dir, a model folder or named on the command line were read whatever they were: a FIFO
hung with no output, a symlink to /dev/zero was read until MemoryError, 200000 nested brackets were a
RecursionError traceback. One reader (epo_cli/rundir/received.py) reads them now: a regular file only
(symlinks only inside the folder), a size cap per kind, a JSON nesting cap, one message naming the file and
the limit. The table runs every reader against every damage in-process (each under a timeout: a FIFO would
hang it), then a few rows through the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epo_cli.errors import UserError
from epo_cli.rundir import received
from epo_cli.rundir.received import MAX_JSON_DEPTH, ReceivedFileError, read_bytes, read_json

from conftest import one_error, run_cli

DEEP = "[" * 200_000 + "]" * 200_000


def plant_fifo(path: Path, folder: Path) -> None:
    os.mkfifo(path)


def plant_zero(path: Path, folder: Path) -> None:
    path.symlink_to("/dev/zero")


def plant_outside(path: Path, folder: Path) -> None:
    secret = folder.parent / f"outside-{path.name}"
    secret.write_text(path.read_text() if path.exists() else "{}")
    path.unlink(missing_ok=True)
    path.symlink_to(secret)


def plant_deep(path: Path, folder: Path) -> None:
    path.write_text(DEEP)


def plant_huge(path: Path, folder: Path) -> None:
    with open(path, "wb") as f:  # sparse: costs no disk
        f.truncate(received.LIMITS["trainer state"] + 1 if path.suffix != ".jsonl" else received.LIMITS["metrics"] + 1)


DAMAGES: dict[str, Callable[[Path, Path], None]] = {
    "FIFO": plant_fifo, "symlink to /dev/zero": plant_zero, "symlink outside the folder": plant_outside,
    "200000 nested brackets": plant_deep, "sparse file over the cap": plant_huge,
}


# ---- the reader itself ---------------------------------------------------------------------------------------

@pytest.mark.timeout(20)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_the_reader_refuses_each_damage_with_one_message(damage: str, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / "trainer_state.json"
    path.write_text("{}")
    path.unlink()
    DAMAGES[damage](path, folder)
    with pytest.raises(ReceivedFileError) as info:
        read_json(path, "trainer state", within=folder)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert any(limit in message for limit in ("64 MiB", f"{MAX_JSON_DEPTH} levels")), message


def test_the_reader_reads_real_files_and_symlinks_inside_the_folder(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "a").write_text('{"x": [1, {"y": "[[[["}]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "blobs" / "a")
    assert read_json(tmp_path / "link.json", "model config", within=tmp_path) == {"x": [1, {"y": "[[[["}]}
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    (tmp_path / "nested.json").write_text(nested)
    assert read_json(tmp_path / "nested.json", "model config") == json.loads(nested)
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "missing", "status")


# ---- every reader of a received file, against every damage ------------------------------------------------------

def _trainer_state(folder: Path) -> Any:
    from epo_cli.rundir.saved_state import read_trainer_state

    return read_trainer_state(folder)


def _yaml(folder: Path) -> Any:
    from epo_cli.rundir.saved_state import load_yaml

    return load_yaml(folder / "config.yaml")


def _metrics(folder: Path) -> Any:
    from epo_cli.loggers.jsonl import read_metrics

    return read_metrics(folder)


def _status(folder: Path) -> Any:
    from epo_cli.rundir.folder import read_status

    status = read_status(folder)
    if status == {"status": "unknown"}:  # damage reads as unknown, as documented: refused, not read
        raise UserError("status unknown")
    return status


def _pointer(folder: Path) -> Any:
    from epo_cli.rundir.checkpoint_paths import read_pointer

    return read_pointer(folder / "latest")


def _header(folder: Path) -> Any:
    from epo_cli.rundir.saved_state import safetensors_shapes

    return safetensors_shapes(folder / "model.safetensors")


def _throughput(folder: Path) -> Any:
    from epo_cli.analysis.plan import read_throughput

    return read_throughput(str(folder / "throughput.json"), 10**8)


def _demos(folder: Path) -> Any:
    from epo_cli.rollout.demos import read_jsonl

    return read_jsonl(folder / "demos.jsonl")


def _sweep_record(folder: Path) -> Any:
    from epo_cli.analysis.sweep_summary import read_json_file

    with pytest.warns(UserWarning, match="sweep.json"):
        if read_json_file(folder / "sweep.json", "going on without it") is None:
            raise UserError("refused with a warning")


#: reader -> (the file it reads, what it raises for a file it refuses)
READERS: dict[str, tuple[str, Callable[[Path], Any], type[Exception]]] = {
    "trainer_state.json": ("trainer_state.json", _trainer_state, UserError),
    "config.yaml": ("config.yaml", _yaml, ValueError),
    "metrics.jsonl": ("metrics.jsonl", _metrics, UserError),
    "status.json": ("status.json", _status, UserError),
    "checkpoints/latest": ("latest", _pointer, UserError),
    "safetensors header": ("model.safetensors", _header, ValueError),
    "plan --throughput": ("throughput.json", _throughput, UserError),
    "algo.demos": ("demos.jsonl", _demos, UserError),
    "sweep.json": ("sweep.json", _sweep_record, UserError),
}


def _deep_safetensors(path: Path) -> None:
    header = DEEP.encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_every_damage_at_once(reader: str, damage: str, tmp_path: Path) -> None:
    name, read, error = READERS[reader]
    folder = tmp_path / "received"
    folder.mkdir()
    path = folder / name
    if damage == "200000 nested brackets" and name == "model.safetensors":
        _deep_safetensors(path)
    elif damage == "200000 nested brackets" and name == "config.yaml":
        path.write_text("a: " + DEEP)  # YAML's flow sequences nest the same way
    else:
        DAMAGES[damage](path, folder)
    if damage == "200000 nested brackets" and name == "metrics.jsonl":  # one bad line: skipped, named
        with pytest.warns(UserWarning, match="skipped 1 unreadable line"):
            assert read(folder) == []
        return
    if damage == "200000 nested brackets" and name in ("latest", "config.yaml"):
        with pytest.raises((UserError, ValueError, Exception)) as info:  # not JSON: its own refusal, no recursion
            read(folder)
        assert not isinstance(info.value, RecursionError)
        return
    with pytest.raises(error) as info:
        read(folder)
    assert not isinstance(info.value, RecursionError)


# ---- through the CLI ---------------------------------------------------------------------------------------

def _replace(folder: Path, name: str, damage: str) -> None:
    path = folder / name
    path.unlink()
    DAMAGES[damage](path, folder)


CLI_ROWS = {
    "eval run=, config.yaml a FIFO": (
        "run", "config.yaml", "FIFO", lambda d: ["eval", f"run={d}", "policy=random", "episodes=1"]),
    "resume, trainer_state.json -> /dev/zero": (
        "run", "checkpoints/step_1/trainer_state.json", "symlink to /dev/zero",
        lambda d: ["train", f"trainer.resume={d}", "trainer.total_steps=2"]),
    "resume, trainer_state.json nested 200000 deep": (
        "run", "checkpoints/step_1/trainer_state.json", "200000 nested brackets",
        lambda d: ["train", f"trainer.resume={d}", "trainer.total_steps=2"]),
    "report, metrics.jsonl -> /dev/zero": (
        "run", "metrics.jsonl", "symlink to /dev/zero", lambda d: ["report", str(d), "--out", str(d.parent / "r")]),
    "eval model.path=, config.json a FIFO": (
        "model", "config.json", "FIFO", lambda d: ["eval", f"model.path={d}", "episodes=1"]),
    "eval model.path=, config.json -> /dev/zero": (
        "model", "config.json", "symlink to /dev/zero", lambda d: ["eval", f"model.path={d}", "episodes=1"]),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("row", list(CLI_ROWS))
def test_a_received_file_that_is_not_bounded_data_is_one_message(row: str, saved_run: Path, tiny_folder: Path,
                                                                 tmp_path: Path) -> None:
    kind, name, damage, command = CLI_ROWS[row]
    folder = tmp_path / "received"
    shutil.copytree(saved_run if kind == "run" else tiny_folder, folder)
    _replace(folder, name, damage)
    proc = run_cli(command(folder), cwd=tmp_path, timeout=200, expect=None)
    assert proc.returncode != 0
    one_error(proc, Path(name).name)


@pytest.mark.timeout(120)
def test_plan_refuses_a_throughput_file_nested_200000_deep(tmp_path: Path) -> None:
    (tmp_path / "throughput.json").write_text(DEEP)
    proc = run_cli(["plan", "--throughput", str(tmp_path / "throughput.json")], cwd=tmp_path, timeout=100,
                   expect=None)
    assert proc.returncode != 0
    one_error(proc, "throughput.json")
