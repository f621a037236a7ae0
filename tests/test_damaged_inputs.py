"""Damaged or hostile inputs (issue 15 item 5): metrics.jsonl lines, checkpoint pruning, disk errors,
demonstration files, over-long names and values, bad sweep options.

Unit tests run in-process; the CLI tests (marked slow) run `epo` as a user would.
"""

from __future__ import annotations

import errno
import json
import warnings
from pathlib import Path

import pytest

from epo_cli.errors import ConfigError, UserError
from epo_cli.loggers.jsonl import read_metrics, truncate_metrics_file
from epo_cli.rollout.demos import read_jsonl
from epo_cli.rundir import checkpoint_paths as checkpoint

from conftest import SmallConfig, run_epo

GOOD_ROWS = [{"step": 1, "loss/nll": 0.5}, {"step": 2, "loss/nll": 0.4}, {"step": 3, "loss/nll": 0.3}]


def _metrics_file(run: Path, tail: str) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(GOOD_ROWS[0]), "{garbled", json.dumps(GOOD_ROWS[1]), "[1, 2]", '{"step": "x"}',
             json.dumps(GOOD_ROWS[2])]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)


# ---- metrics.jsonl -----------------------------------------------------------------------------------------

def test_bad_metrics_lines_are_skipped_with_one_warning(tmp_path: Path) -> None:
    _metrics_file(tmp_path, '{"step": 4, "loss/n')  # a last line cut short by a kill
    with pytest.warns(UserWarning) as caught:
        rows = read_metrics(tmp_path)
    assert rows == GOOD_ROWS
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "skipped 4 unreadable lines" in message and "lines 2, 4, 5, 7" in message and "\n" not in message


def test_truncating_for_a_resume_drops_bad_lines_and_later_steps(tmp_path: Path) -> None:
    _metrics_file(tmp_path, '{"step": 4, "loss/n')
    with pytest.warns(UserWarning):
        truncate_metrics_file(tmp_path, after_step=2)
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == GOOD_ROWS[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten file is clean: no warning any more
        assert read_metrics(tmp_path) == GOOD_ROWS[:2]


@pytest.mark.slow
def test_report_reads_a_run_whose_last_line_is_truncated(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _metrics_file(run, '{"step": 4, "policy/entro')
    proc = run_epo(["report", str(run)], cwd=tmp_path)
    assert "Traceback" not in proc.stderr
    warning_lines = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert len(warning_lines) == 1 and "skipped 4 unreadable lines" in warning_lines[0], proc.stderr
    assert (run / "plots" / "index.md").exists()


# ---- checkpoint pruning --------------------------------------------------------------------------------------

def _fake_checkpoints(run: Path, steps: list[int]) -> Path:
    root = run / "checkpoints"
    for step in steps:
        folder = root / f"step_{step}"
        folder.mkdir(parents=True)
        for name in ("mp_rank_00_model_states.pt", "trainer_state.json", "rng_rank0.pt"):
            (folder / name).write_text("x")
        (folder / checkpoint.COMPLETE).write_text(str(step))
    return root


def test_pruning_interrupted_midway_leaves_no_folder_that_looks_complete(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_checkpoints(tmp_path, [1, 2, 3, 4])

    def killed_while_deleting(path: Path, ignore_errors: bool = False) -> None:
        next(Path(path).iterdir()).unlink()  # one file is gone, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune(root, keep=2, keep_tags={"step_4"})
    # step_1 was being deleted: it no longer exists under its name, nor counts as complete anywhere
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_2", "step_3", "step_4"]
    assert not (root / "step_1").exists() and (root / ".pruned-step_1").exists()
    assert not (root / ".pruned-step_1" / checkpoint.COMPLETE).exists()
    with pytest.raises(UserError, match="incomplete"):
        checkpoint.resolve_checkpoint(tmp_path, "step_1")

    monkeypatch.undo()
    checkpoint.prune(root, keep=2, keep_tags={"step_4"})  # the next save finishes the job
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]


def test_pruning_removes_the_marker_before_any_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_checkpoints(tmp_path, [1, 2])
    seen: list[bool] = []

    def record(path: Path, ignore_errors: bool = False) -> None:
        seen.append((Path(path) / checkpoint.COMPLETE).exists())
        _rm(Path(path))

    monkeypatch.setattr(checkpoint.shutil, "rmtree", record)
    checkpoint.prune(root, keep=1, keep_tags=set())
    assert seen == [False] and [p.name for p in root.iterdir()] == ["step_2"]


def _rm(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


# ---- disk full / read-only -------------------------------------------------------------------------------

def test_disk_errors_are_recognised() -> None:
    assert checkpoint.is_disk_error(OSError(errno.ENOSPC, "No space left on device"))
    assert checkpoint.is_disk_error(OSError(errno.EROFS, "Read-only file system"))
    assert checkpoint.is_disk_error(RuntimeError("[enforce fail at inline_container.cc:659] . "
                                                 "PytorchStreamWriter failed writing file data/0: file write failed"))
    assert not checkpoint.is_disk_error(OSError(errno.ENOENT, "No such file"))
    assert not checkpoint.is_disk_error(RuntimeError("shape mismatch"))


@pytest.mark.slow
def test_full_disk_while_checkpointing_fails_cleanly(warm_start_short: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ENOSPC: the checkpoint of step 2 writes its RNG states into /dev/full (root ignores chmod, not a
    full disk; a planted symlink to /dev/full is refused as a planted entry since issue 41), so the write that
    fails is the checkpoint's own."""
    run = tmp_path / "run"
    from epo_cli.training import checkpoint as saving  # torch: imported by the test that needs it

    real_write = saving.write_file

    def full_disk_at_step_2(path: Path, data: str | bytes, atomic: bool = True) -> None:
        if path.name != "rng_rank0.pt" or path.parent.name != "step_2":
            return real_write(path, data, atomic)
        with open("/dev/full", "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())

    monkeypatch.setattr(saving, "write_file", full_disk_at_step_2)
    proc = run_epo(["train", "algo=grpo", f"model.path={warm_start_short / 'final'}",
                    *SmallConfig().run("env.max_turns=6"), "algo.tasks_per_step=2", "algo.group_size=2",
                    "trainer.save_every=1", "trainer.total_steps=3", f"run_dir={run}"], cwd=tmp_path, expect=1)
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Could not write to the run directory" in errors[0], proc.stderr[-3000:]
    assert "step_1" in proc.stderr and f"trainer.resume={run}" in proc.stderr
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "Could not write" in status["error"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert (run / "checkpoints" / "step_1" / checkpoint.COMPLETE).exists()
    assert not (run / "checkpoints" / "step_2" / checkpoint.COMPLETE).exists()
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step_1"]


@pytest.mark.slow
def test_an_unwritable_output_dir_is_one_message(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # where a directory must go (root ignores chmod)
    proc = run_epo(["train", f"output_dir={blocker / 'runs'}", "trainer.total_steps=1"], cwd=tmp_path, expect=1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Cannot write the run directory" in errors[0] and "Traceback" not in proc.stderr
    assert blocker.read_text() == "not a folder"


# ---- demonstration files -------------------------------------------------------------------------------------

GOOD_STEP = {"observation": "You are in a room.", "admissible_commands": ["look"], "thought": "", "action": "look"}


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps({"task_id": "t"}), "`steps` is missing"),
    (json.dumps({"steps": []}), "`steps` must be a non-empty list"),
    (json.dumps({"steps": "look"}), "`steps` must be a non-empty list"),
    (json.dumps({"steps": ["look"]}), "`steps[0]` must be an object (got str)"),
    (json.dumps({"steps": [GOOD_STEP, {"observation": "x"}]}), "`steps[1].action` is missing"),
    (json.dumps({"steps": [{**GOOD_STEP, "action": 3}]}), "`steps[0].action` must be a string (got int)"),
    (json.dumps({"steps": [{**GOOD_STEP, "action": "  "}]}), "`steps[0].action` is empty"),
    (json.dumps({"steps": [{**GOOD_STEP, "observation": None}]}), "`steps[0].observation` is missing"),
    (json.dumps({"steps": [{**GOOD_STEP, "thought": ["x"]}]}), "`steps[0].thought` must be a string"),
    (json.dumps({"steps": [{**GOOD_STEP, "admissible_commands": "look"}]}),
     "`steps[0].admissible_commands` must be a list of strings"),
    (json.dumps({"goal": 5, "steps": [GOOD_STEP]}), "`goal` must be a string (got int)"),
    (json.dumps({"steps": [{**GOOD_STEP, "observation": "x" * 100_001}]}),
     "`steps[0].observation` is 100001 characters long"),
])
def test_demonstrations_are_validated_field_by_field(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"goal": "g", "steps": [GOOD_STEP]}) + "\n\n" + line + "\n")
    with pytest.raises(UserError) as err:
        read_jsonl(path)
    assert f"{path}:3 is not a trajectory record: {problem}" in str(err.value)  # line 3: after a blank line


def test_good_demonstrations_load(tmp_path: Path) -> None:
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"goal": "g", "steps": [GOOD_STEP, {"observation": "o", "action": "a"}]}) + "\n")
    assert read_jsonl(path)[0]["steps"][1]["action"] == "a"


# ---- names, paths and override lengths -------------------------------------------------------------------

def test_name_and_path_checks() -> None:
    from epo_cli.rundir.folder import check_lengths, check_name, check_path

    check_name("epo-household_1")
    for bad, why in [("x" * 201, "at most 200"), ("a/b", "path separator"), ("..", "not a usable"),
                     ("", "not a usable")]:
        with pytest.raises(ConfigError, match=why):
            check_name(bad)
    with pytest.raises(ConfigError, match="255"):
        check_path(Path("/tmp") / ("d" * 256), "output_dir")
    with pytest.raises(ConfigError, match="at most 3500"):
        check_path(Path("/" + "/".join(["d" * 100] * 40)), "run_dir")
    with pytest.raises(ConfigError, match="'model.path' is 5011"):
        check_lengths(["model.path=" + "p" * 5000])


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["name=" + "n" * 300], "name is 300 bytes long"),
    (["output_dir=" + "o" * 300], "folder name of 300 bytes"),
    (["model.path=" + "m" * 5000], "at most 4096"),
    (["sweep.name=" + "s" * 300], "sweep.name is 300 bytes long"),
])
def test_over_long_names_and_values_are_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    command = "sweep" if args[0].startswith("sweep.") else "train"
    proc = run_epo([command, *args, "trainer.total_steps=1"], cwd=tmp_path, expect=2)
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # nothing was created


# ---- sweeps ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["algo=grpo,nosuch"], "Unknown option 'nosuch' for config group 'algo'"),
    (["algo=grpo", "seed=0,x"], "Wrong type for config key 'seed'"),
    (["algo=grpo", "trainer.total_steps=2,0"], "'trainer.total_steps': 0 is out of range; allowed: 1 <= value"),
    (["algo=grpo", "hydra/launcher=nosuch"], "Unknown option 'nosuch' for 'hydra/launcher'"),
])
def test_bad_sweep_options_exit_2_and_leave_no_sweep_directory(tmp_path: Path, args: list[str],
                                                                message: str) -> None:
    out = tmp_path / "out"
    proc = run_epo(["sweep", *args, f"output_dir={out}"], cwd=tmp_path, expect=2)
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists() and not (tmp_path / "outputs").exists()
