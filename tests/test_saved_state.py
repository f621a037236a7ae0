"""A saved state that lies is refused with one message, never trusted or completed from the defaults.

    config.yaml cut short (at several points)     -> `epo eval run=` and `epo train trainer.resume=`: exit 1
    trainer_state.json that lies (step 99, -5, not the folder's step, wrong kinds, damaged JSON)
                                                   -> resume: exit 1 naming the file; nothing moved or written
    trainer.resume=auto run_dir=<run>              -> the run's own config, the command's key=value on top;
                                                      config groups that would change the run: exit 2
    trainer.total_steps at or below the checkpoint's step -> exit 2, saying nothing is left to train
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from epo_cli.rundir.saved_state import ADDED_KEYS, check_saved_config

from conftest import SmallConfig, metrics_rows, run_epo

SFT = ["train", *SmallConfig().sft("trainer.total_steps=3", "trainer.stop_after=2", "trainer.save_every=1")]


@pytest.fixture(scope="module")
def stopped_run(epo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SFT run stopped after step 2 of 3, with checkpoints step_1 and step_2."""
    root = tmp_path_factory.mktemp("saved_state")
    run_epo([*SFT, f"run_dir={root / 'run'}"], cwd=root)
    assert (root / "run" / "checkpoints" / "latest").read_text().strip() == "step_2"
    return root / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run", symlinks=True))


def snapshot(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): (p.read_bytes().hex() if p.is_file() else "dir") for p in sorted(run.rglob("*"))}


def one_error(proc: Any, *texts: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for text in texts:
        assert text in proc.stderr, (text, proc.stderr[-3000:])


# ---- config.yaml ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0.25, 0.5, 0.75, 0.99])
@pytest.mark.parametrize("command", ["eval", "resume"])
def test_a_config_yaml_cut_short_is_refused(stopped_run: Path, tmp_path: Path, keep: float, command: str) -> None:
    run = copy_of(stopped_run, tmp_path)
    text = (run / "config.yaml").read_text()
    settings = text[: text.index("\nmeta:")]  # the sections; `meta` (versions, command) comes last
    cut = settings[: int(len(settings) * keep)]
    cut = cut[: cut.rfind("\n") + 1]  # at a line end: still valid YAML, only the rest is missing
    (run / "config.yaml").write_text(cut)
    before = snapshot(run)
    args = {"eval": ["eval", f"run={run}", "policy=random", "episodes=1"],
            "resume": ["train", f"trainer.resume={run}"]}[command]
    proc = run_epo(args, cwd=tmp_path, expect=1)
    one_error(proc, "is not a complete run config", "config.yaml")
    assert snapshot(run) == before


def test_every_schema_key_is_checked_and_a_complete_config_passes(stopped_run: Path) -> None:
    raw = OmegaConf.load(stopped_run / "config.yaml")
    raw.pop("meta")
    check_saved_config(raw, stopped_run / "config.yaml")  # the run's own, complete file
    # a key added to the schemas is listed there, so older runs still load, with its default
    assert ADDED_KEYS == ("rollout.correction.mode", "model.autocast")
    older = raw.copy()
    del older.rollout.correction["mode"]  # a run saved before the keys existed
    del older.model["autocast"]
    check_saved_config(older, stopped_run / "config.yaml")
    del raw.rollout["num_samples_to_save"]  # one key of the last section: what a cut leaves
    from epo_cli.errors import UserError

    with pytest.raises(UserError, match="rollout.num_samples_to_save"):
        check_saved_config(raw, stopped_run / "config.yaml")


def test_a_run_saved_before_the_added_keys_evaluates_and_resumes(stopped_run: Path, tmp_path: Path) -> None:
    """Through the CLI: a run whose config.yaml predates ADDED_KEYS (e.g. a real-model study's run saved before
    model.autocast existed) loads its model for `epo eval` and resumes, each key at its default."""
    run = copy_of(stopped_run, tmp_path)
    older = OmegaConf.load(run / "config.yaml")
    del older.model["autocast"]
    del older.rollout.correction["mode"]
    OmegaConf.save(older, run / "config.yaml")
    run_epo(["eval", f"run={run}", "episodes=1", f"out={tmp_path / 'eval'}"], cwd=tmp_path)
    run_epo(["train", f"trainer.resume={run}"], cwd=tmp_path)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_3"


# ---- trainer_state.json --------------------------------------------------------------------------------------

def _lie(state: dict, how: str) -> str | dict:
    t = state["trainer"]
    if how == "damaged json":
        return '{"format": "epo-checkpoint/2", "trainer": {"st'
    changes = {"step 99": {"step": 99}, "step -5": {"step": -5}, "step text": {"step": "2"},
               "step true": {"step": True}, "best_step beyond step": {"best_step": 7},
               "best_value nan": {"best_value": "NaN"}, "unknown counter": {"epochs": 3}}
    if how in changes:
        return {**state, "trainer": {**t, **changes[how]}}
    if how == "no trainer":
        return {k: v for k, v in state.items() if k != "trainer"}
    if how == "monitor not an object":
        return {**state, "monitor": [1, 2]}
    if how == "not an object":
        return "[1, 2, 3]"
    if how == "written_by not an object":
        return {**state, "written_by": "grpo"}
    if how == "written_by model of lists":
        return {**state, "written_by": {**state["written_by"], "model": {"hidden_size": [64]}}}
    raise AssertionError(how)


LIES = ["damaged json", "step 99", "step -5", "step text", "step true", "best_step beyond step", "best_value nan",
        "unknown counter", "no trainer", "monitor not an object", "not an object", "written_by not an object",
        "written_by model of lists"]


@pytest.mark.parametrize("how", LIES)
def test_a_trainer_state_that_lies_is_refused(stopped_run: Path, tmp_path: Path, how: str) -> None:
    run = copy_of(stopped_run, tmp_path)
    path = run / "checkpoints" / "step_2" / "trainer_state.json"
    lie = _lie(json.loads(path.read_text()), how)
    path.write_text(lie if isinstance(lie, str) else json.dumps(lie).replace('"NaN"', "NaN"))
    before = snapshot(run)
    proc = run_epo(["train", f"trainer.resume={run}"], cwd=tmp_path, expect=None)
    assert proc.returncode in (1, 2), proc.stderr[-2000:]
    one_error(proc, "trainer_state.json")
    assert snapshot(run) == before  # nothing superseded, saved or rewritten


def test_a_step_that_does_not_match_its_folder_is_named(stopped_run: Path, tmp_path: Path) -> None:
    run = copy_of(stopped_run, tmp_path)
    path = run / "checkpoints" / "step_1" / "trainer_state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "trainer": {**state["trainer"], "step": 2}}))
    proc = run_epo(["train", f"trainer.resume={run / 'checkpoints' / 'step_1'}"], cwd=tmp_path, expect=1)
    one_error(proc, "`trainer.step` is 2 but the folder is step_1")


# ---- resuming: auto, total_steps -----------------------------------------------------------------------------

def _captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import epo_cli.launch.local

    seen: dict[str, Any] = {}

    def record(cfg: Any, overrides: list[str]) -> None:
        seen["cfg"] = cfg

    monkeypatch.setattr(epo_cli.launch.local, "run_local", record)
    return seen


def test_auto_uses_the_runs_own_config_with_the_overrides_on_top(stopped_run: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = copy_of(stopped_run, tmp_path)
    seen = _captured(monkeypatch)
    run_epo(["train", "trainer.resume=auto", f"run_dir={run}", "algo.lr=0.0005", "seed=3"], cwd=tmp_path)
    cfg, saved = seen["cfg"], OmegaConf.load(run / "config.yaml")
    assert cfg.algo.name == "sft" and cfg.algo.demo_episodes == saved.algo.demo_episodes == 2  # the run's own
    assert cfg.rollout.max_new_tokens == 16 and cfg.env.max_turns == 8  # not the defaults (64, 30)
    assert cfg.algo.lr == 0.0005 and cfg.seed == 3  # the command's overrides on top
    assert cfg.trainer.resume == str(run.resolve() / "checkpoints" / "step_2")
    # the command that started the run, rerun as a preemptible job does: its groups describe the run
    run_epo(["train", *SFT[1:], "trainer.resume=auto", f"run_dir={run}"], cwd=tmp_path)
    assert seen["cfg"].trainer.resume.endswith("step_2")


def test_auto_refuses_groups_that_would_change_the_run(stopped_run: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run = copy_of(stopped_run, tmp_path)
    _captured(monkeypatch)
    proc = run_epo(["train", "algo=grpo", "trainer.resume=auto", f"run_dir={run}"], cwd=tmp_path, expect=2)
    one_error(proc, "trainer.resume=auto continues the run", "algo.name: the run has 'sft', this command 'grpo'")
    # no checkpoint yet (a job preempted before its first save): auto is a fresh start with this command
    fresh = tmp_path / "fresh"
    seen = _captured(monkeypatch)
    run_epo(["train", "algo=grpo", "trainer.resume=auto", f"run_dir={fresh}"], cwd=tmp_path)
    assert seen["cfg"].algo.name == "grpo"


def test_auto_resumes_for_real(stopped_run: Path, tmp_path: Path) -> None:
    run = copy_of(stopped_run, tmp_path)
    proc = run_epo(["train", "trainer.resume=auto", f"run_dir={run}"], cwd=tmp_path)
    assert "at step 2" in proc.stdout
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    assert [row["step"] for row in metrics_rows(run)] == [1, 2, 3]


@pytest.mark.parametrize("total", [1, 2])
def test_total_steps_at_or_below_the_checkpoint_is_refused(stopped_run: Path, tmp_path: Path, total: int) -> None:
    run = copy_of(stopped_run, tmp_path)
    before = snapshot(run)
    proc = run_epo(["train", f"trainer.resume={run}", f"trainer.total_steps={total}"], cwd=tmp_path, expect=2)
    one_error(proc, "is at step 2", f"trainer.total_steps={total}", "nothing is left to train")
    assert snapshot(run) == before


def test_auto_with_a_preset_that_requires_a_value_compares_with_the_command_s_value(tmp_path: Path) -> None:
    """A preset's ${required:...} key (experiment=improve_on_teacher's model.path) is given by the command
    itself; comparing the groups used to compose them without it and refused every such resume (the real-model
    study could not continue with its own command)."""
    from epo_cli.compose import compose
    from epo_cli.launch.setup import groups_that_disagree

    command = ["model.path=/runs/warm/final", "trainer.total_steps=40", f"run_dir={tmp_path}"]
    saved = compose(["experiment=improve_on_teacher", *command])
    assert groups_that_disagree(["experiment=improve_on_teacher"], saved, command) == []
    saved.env.max_turns = 9  # what the preset sets, and the run does not have
    assert groups_that_disagree(["experiment=improve_on_teacher"], saved, command) == [
        "env.max_turns: the run has 9, this command 15"]


@pytest.mark.parametrize(("saved", "loads"), [(1.0, True), (4.0, True), (1.5, False)])
def test_a_key_now_integer_saved_as_a_whole_float_still_loads(saved: float, loads: bool, stopped_run: Path,
                                                              tmp_path: Path) -> None:
    """rollout.vllm.kv_cache_gib became an int after runs saved it as 1.0 (the warm start of the real-model
    study could not be evaluated); a whole number loads as that int, anything else is refused naming it."""
    from epo_cli.compose import load_run_config
    from epo_cli.errors import UserError

    run = copy_of(stopped_run, tmp_path)
    raw = OmegaConf.load(run / "config.yaml")
    raw.rollout.vllm.kv_cache_gib = saved
    (run / "config.yaml").write_text(OmegaConf.to_yaml(raw))
    if loads:
        assert load_run_config(run).rollout.vllm.kv_cache_gib == int(saved)
    else:
        with pytest.raises(UserError, match="rollout.vllm.kv_cache_gib"):
            load_run_config(run)
