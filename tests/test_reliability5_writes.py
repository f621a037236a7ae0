"""Issue 41, class 1: nothing is written through a received file.

A run dir received from elsewhere may hold `.epo.lock`, `checkpoints/latest` or any other entry epo writes as
a symlink to a file outside it, a FIFO or a device. Every file epo creates or rewrites in a run, sweep or eval
folder is opened without following symlinks (epo_cli/rundir/writable.py), a folder is checked entry by entry
when it is claimed, and a non-regular entry is refused with one message naming it; the file outside stays
byte-identical. Two `epo eval` into one `out=` cannot both write it: one writer per output folder.

Every CLI row used to be accepted (exit 0, the outside file truncated and overwritten with a pid and a
command, or the second eval's results mixed in) or was a traceback (a FIFO or /dev/full as the lock).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from epo_cli.rundir.writable import UnsafeEntryError, check_entries, open_for_writing, write_file

from conftest import PRECIOUS, SmallConfig, one_error, run_cli, run_epo

SFT = SmallConfig().sft("trainer.total_steps=1", "trainer.save_every=1")


def received(run: Path, target: Path) -> Path:
    shutil.copytree(run, target)
    return target


# ---- the writer itself (in-process) --------------------------------------------------------------------------

PLANTS: dict[str, Callable[[Path, Path], None]] = {
    "symlink to a file outside": lambda entry, outside: entry.symlink_to(outside),
    "symlink to /dev/full": lambda entry, outside: entry.symlink_to("/dev/full"),
    "dangling symlink": lambda entry, outside: entry.symlink_to(outside.parent / "nothing-yet"),
    "FIFO": lambda entry, outside: os.mkfifo(entry),
    "hard link to a file outside": lambda entry, outside: os.link(outside, entry),
    "folder": lambda entry, outside: entry.mkdir(),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plant", list(PLANTS))
@pytest.mark.parametrize("how", ["atomic", "in place", "append"])
def test_the_writer_refuses_every_planted_entry_and_names_it(plant: str, how: str, tmp_path: Path,
                                                             outside: Path) -> None:
    entry = tmp_path / "status.json"
    PLANTS[plant](entry, outside)
    with pytest.raises(UnsafeEntryError) as info:
        if how == "append":
            with open_for_writing(entry, append=True) as f:
                f.write("x")
        else:
            write_file(entry, "x", atomic=how == "atomic")
    assert str(entry) in str(info.value) and "\n" not in str(info.value)
    assert outside.read_bytes() == PRECIOUS
    assert not (outside.parent / "nothing-yet").exists()


@pytest.mark.timeout(30)
def test_a_planted_temp_file_is_refused_too(tmp_path: Path, outside: Path) -> None:
    (tmp_path / "config.yaml.tmp").symlink_to(outside)
    with pytest.raises(UnsafeEntryError, match="config.yaml.tmp"):
        write_file(tmp_path / "config.yaml", "a: 1\n")
    assert outside.read_bytes() == PRECIOUS and not (tmp_path / "config.yaml").exists()


def test_the_writer_writes_and_replaces_regular_files(tmp_path: Path) -> None:
    write_file(tmp_path / "a.json", "one")
    write_file(tmp_path / "a.json", "two")
    write_file(tmp_path / "b.bin", b"\x00\x01", atomic=False)
    with open_for_writing(tmp_path / "m.jsonl", append=True) as f:
        f.write("1\n")
    with open_for_writing(tmp_path / "m.jsonl", append=True) as f:
        f.write("2\n")
    assert (tmp_path / "a.json").read_text() == "two" and (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "m.jsonl").read_text() == "1\n2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin", "m.jsonl"]


def test_check_entries_names_the_first_planted_entry_deep_in_a_folder(tmp_path: Path, outside: Path) -> None:
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_2" / "rng_rank0.pt").symlink_to(outside)
    with pytest.raises(UnsafeEntryError, match="rng_rank0.pt"):
        check_entries(tmp_path)
    (tmp_path / "checkpoints" / "step_2" / "rng_rank0.pt").unlink()
    (tmp_path / "final").symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(UnsafeEntryError, match="final"):
        check_entries(tmp_path)


# ---- through the CLI ---------------------------------------------------------------------------------------

def _lock_to(target: str) -> Callable[[Path, Path], None]:
    def plant(folder: Path, outside: Path) -> None:
        (folder / ".epo.lock").symlink_to(outside if target == "outside" else target)
    return plant


def _fifo_lock(folder: Path, outside: Path) -> None:
    os.mkfifo(folder / ".epo.lock")


def _latest_to_outside(folder: Path, outside: Path) -> None:
    (folder / "checkpoints" / "latest").unlink()
    (folder / "checkpoints" / "latest").symlink_to(outside)


def _status_to_outside(folder: Path, outside: Path) -> None:
    (folder / "status.json").unlink()
    (folder / "status.json").symlink_to(outside)


def _plots_index_to_outside(folder: Path, outside: Path) -> None:
    (folder / "plots").mkdir(exist_ok=True)
    (folder / "plots" / "index.md").symlink_to(outside)


#: (what the folder is, how it is planted, the command, the entry the message names)
CLI_ROWS = {
    "new run, .epo.lock -> outside file": (
        "empty", _lock_to("outside"), lambda d: ["train", *SFT, f"run_dir={d}"], ".epo.lock"),
    "new run, .epo.lock a FIFO": ("empty", _fifo_lock, lambda d: ["train", *SFT, f"run_dir={d}"], ".epo.lock"),
    "new run, .epo.lock -> /dev/full": (
        "empty", _lock_to("/dev/full"), lambda d: ["train", *SFT, f"run_dir={d}"], ".epo.lock"),
    "resume=<run>, .epo.lock -> outside file": (
        "run", _lock_to("outside"), lambda d: ["train", f"trainer.resume={d}", "trainer.total_steps=2"], ".epo.lock"),
    "resume=auto, .epo.lock -> outside file": (
        "run", _lock_to("outside"),
        lambda d: ["train", *SFT, "trainer.resume=auto", f"run_dir={d}", "trainer.total_steps=2"], ".epo.lock"),
    "resume=<run>, checkpoints/latest -> outside file": (
        "run", _latest_to_outside, lambda d: ["train", f"trainer.resume={d}/checkpoints/step_1",
                                              "trainer.total_steps=2"], "latest"),
    "resume=<run>, status.json -> outside file": (
        "run", _status_to_outside, lambda d: ["train", f"trainer.resume={d}", "trainer.total_steps=2"],
        "status.json"),
    "report, plots/index.md -> outside file": (
        "run", _plots_index_to_outside, lambda d: ["report", str(d)], "index.md"),
    "sweep, .epo.lock -> outside file": (
        "empty", _lock_to("outside"), lambda d: ["sweep", "algo=sft", "seed=0,1", f"hydra.sweep.dir={d}"],
        ".epo.lock"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("row", list(CLI_ROWS))
def test_a_planted_entry_is_refused_and_the_outside_file_stays_identical(row: str, saved_run: Path, tmp_path: Path,
                                                                         outside: Path) -> None:
    kind, plant, command, named = CLI_ROWS[row]
    folder = tmp_path / "received"
    if kind == "run":
        received(saved_run, folder)
    else:
        folder.mkdir()
    plant(folder, outside)
    proc = run_cli(command(folder), cwd=tmp_path, timeout=200, expect=None)
    assert proc.returncode != 0
    message = one_error(proc, named, "epo never writes through")
    assert str(folder) in message
    assert outside.read_bytes() == PRECIOUS
    if kind == "run":  # nothing of the run was rewritten either
        assert (folder / "config.yaml").read_bytes() == (saved_run / "config.yaml").read_bytes()
        assert (folder / "metrics.jsonl").read_bytes() == (saved_run / "metrics.jsonl").read_bytes()


# ---- one writer per eval output folder -------------------------------------------------------------------------

EVAL = ["eval", "policy=random", "episodes=1", "env.level=tiny_open_pick_place", "env.max_turns=2"]


@pytest.mark.timeout(200)
def test_a_second_eval_into_one_out_folder_is_refused(lock_holder, tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = lock_holder(out, command="epo eval")
    proc = run_cli([*EVAL, f"model.path={tiny_folder}", f"out={out}"], cwd=tmp_path, timeout=180, expect=1)
    one_error(proc, str(out), "in use by another epo process", f"pid {holder.pid}")
    assert sorted(p.name for p in out.iterdir()) == [".epo.lock"]  # nothing of the second eval was written


@pytest.mark.timeout(200)
def test_eval_into_a_folder_with_a_planted_lock_writes_nothing_outside(tiny_folder: Path, tmp_path: Path,
                                                                       outside: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".epo.lock").symlink_to(outside)
    proc = run_cli([*EVAL, f"model.path={tiny_folder}", f"out={out}"], cwd=tmp_path, timeout=180, expect=None)
    assert proc.returncode != 0
    one_error(proc, ".epo.lock", "epo never writes through")
    assert outside.read_bytes() == PRECIOUS
    assert sorted(p.name for p in out.iterdir()) == [".epo.lock"]


def test_an_eval_releases_its_out_folder_when_it_ends(tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_epo([*EVAL, f"model.path={tiny_folder}", f"out={out}"], cwd=tmp_path)
    run_epo([*EVAL, f"model.path={tiny_folder}", f"out={out}"], cwd=tmp_path)  # the first one's lock is gone
    assert not (out / ".epo.lock").exists() and len(list(out.glob("*.json"))) == 1
