"""Inputs that used to be accepted without a word, and messages that misled, through the CLI.

    silently accepted   a key or group given twice, `~group` / `~key`, an empty value (`model.path=`,
                        `epo eval split=`), tiny-model positions below prompt + response, `sweep.threshold=nan`
                        (tests/test_outside_faults.py)
    messages            Hydra's internal `++key` in parse errors, an interpolation error naming no key,
                        `run_dir` called a config group, a preset's own setting blamed on the user, help text
                        with square brackets lost to rich markup
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import run_epo


def one_error(proc, *texts: str) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for text in texts:
        assert text in proc.stderr, (text, proc.stderr[-3000:])
    return proc.stderr


# ---- silently accepted ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "texts"), [
    (["model=nosuch", "model=tiny"], ["config group 'model' is given twice", "model=nosuch and model=tiny"]),
    (["algo=grpo", "algo=epo"], ["config group 'algo' is given twice"]),
    (["~algo"], ["'~algo' would delete algo", "algo=<option>"]),
    (["~algo.lr"], ["'~algo.lr' would delete algo.lr", "algo.lr=<value>"]),
    (["~model"], ["'~model' would delete model"]),
    (["model.path="], ["'model.path' is empty", "model.path=null"]),
    (["launcher.hostfile="], ["'launcher.hostfile' is empty"]),
    (["trainer.best_metric="], ["'trainer.best_metric' is empty"]),
    (["model.max_position_embeddings=512"], ["model.max_position_embeddings=512 is below",
                                              "max_prompt_tokens + rollout.max_new_tokens = 1088"]),
    (["rollout.max_prompt_tokens=2000"], ["model.max_position_embeddings=2048 is below"]),
])
@pytest.mark.parametrize("command", [["config", "show"], ["train"]])
def test_what_hydra_would_drop_or_change_is_exit_2(args: list[str], texts: list[str], command: list[str],
                                                   tmp_path: Path) -> None:
    proc = run_epo([*command, *args, f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, expect=2)
    one_error(proc, *texts)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["split", "run", "checkpoint", "episodes", "temperature", "greedy", "policy",
                                    "out"])
def test_an_eval_option_without_a_value_is_refused(option: str, tmp_path: Path) -> None:
    proc = run_epo(["eval", "policy=random", f"{option}=", f"output_dir={tmp_path / 'out'}"], cwd=tmp_path,
                   expect=2)
    one_error(proc, f"{option}= has no value")
    assert not (tmp_path / "out").exists()


def test_the_shipped_presets_and_a_normal_command_still_compose(tmp_path: Path) -> None:
    for args in (["experiment=epo_household", "algo=grpo"], ["algo=epo", "algo.lr=0.001", "seed=2"],
                 ["env.simplification=", "env=scienceworld"],  # "" is ScienceWorld's documented "none"
                 ["algo=grpo", "algo=grpo"], ["algo.lr=0.1", "algo.lr=0.2"]):  # a repeat that changes nothing;
        run_epo(["config", "show", *args], cwd=tmp_path)  # a key=value repeated keeps the last, as in Hydra


# ---- messages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override", ["algo.lr=1)", "algo.lr='x", "algo.lr=${oops", "trainer.total_steps=[1,"])
def test_a_parse_error_shows_the_users_override_not_hydras_form(override: str, tmp_path: Path) -> None:
    proc = run_epo(["config", "show", override], cwd=tmp_path, expect=2)
    one_error(proc, "Invalid override")
    assert "++" not in proc.stderr, proc.stderr


def test_an_interpolation_error_names_the_key(tmp_path: Path) -> None:
    proc = run_epo(["config", "show", "algo.group_size=${algo.nosuch}"], cwd=tmp_path, expect=2)
    one_error(proc, "at 'algo.group_size'", "algo.nosuch")
    assert "'?'" not in proc.stderr


@pytest.mark.parametrize("override", ["run_dir@x=1", "seed@pkg=3"])
def test_a_setting_is_not_called_a_config_group(override: str, tmp_path: Path) -> None:
    key = override.split("@")[0]
    proc = run_epo(["config", "show", override], cwd=tmp_path, expect=2)
    one_error(proc, f"'{key}' is a setting, not a config group")


def test_resuming_with_run_dir_does_not_call_it_a_config_group(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from epo_cli.compose import compose

    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "COMPLETE").write_text("1")
    (run / "checkpoints" / "latest").write_text("step_1")
    (run / "checkpoints" / "step_1" / "trainer_state.json").write_text(
        '{"format": "epo-checkpoint/2", "trainer": {"step": 1}, "entropy_history": {}, "monitor": {}}')
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(["trainer.total_steps=1"])))
    proc = run_epo(["train", f"trainer.resume={run}", f"run_dir={tmp_path / 'x'}", "algo=grpo"], cwd=tmp_path,
                   expect=2)
    one_error(proc, "config groups cannot change (algo=grpo)")
    assert "run_dir" not in proc.stderr.split("cannot change")[1].split(")")[0]


@pytest.mark.parametrize(("args", "stream", "key", "preset"), [
    (["experiment=entropy_stress", "algo=sft"], "error", "algo.loss_terms", "experiment=entropy_stress"),
    (["experiment=warm_start", "algo=grpo"], "warning", "algo.demo_episodes", "experiment=warm_start"),
])
def test_a_presets_own_setting_is_named_as_the_presets(args: list[str], stream: str, key: str, preset: str,
                                                        tmp_path: Path) -> None:
    proc = run_epo(["config", "show", *args], cwd=tmp_path, expect=2 if stream == "error" else 0)
    assert f"note: {key} is set by the preset {preset}, not on this command line" in proc.stderr, proc.stderr
    if stream == "warning":  # the run goes on: no advice to drop a selection
        assert "does not fit" not in proc.stderr and "drop one of them" not in proc.stderr
    # the same key given on the command line is the user's own: no note about it
    proc = run_epo(["config", "show", *args, f"{key}={'[nll]' if 'loss_terms' in key else 7}"], cwd=tmp_path,
                   expect=None)
    assert f"note: {key} is set by the preset" not in proc.stderr


@pytest.mark.parametrize("command", ["train", "eval", "sweep", "report", "config show"])
def test_help_text_keeps_its_square_brackets(command: str, tmp_path: Path) -> None:
    """Every bracketed part of a command's docstring reaches its --help (rich markup would eat `[...]`)."""
    import inspect

    import epo_cli.cli as cli

    function = {"train": cli.train, "eval": cli.eval_command, "sweep": cli.sweep, "report": cli.report,
                "config show": cli.config_show}[command]
    bracketed = re.findall(r"\[[^\]]+\]", inspect.getdoc(function) or "")
    proc = run_epo([*command.split(), "--help"], cwd=tmp_path)
    flat = re.sub(r"[\s│]+", " ", proc.stdout)
    for part in bracketed:
        assert re.sub(r"\s+", " ", part) in flat, (part, proc.stdout)
    if command == "eval":
        assert "[checkpoint=best split=S episodes=N greedy=true]" in flat


def test_a_model_with_too_few_positions_for_prompt_and_response_is_one_message() -> None:
    """check_context (epo eval and build_models) with a loaded model's limit: 100 positions hold a 68-token prompt
    and a 32-token response, not a 69-token one (the message names the largest prompt that fits)."""
    from types import SimpleNamespace

    from epo_cli.errors import UserError
    from epo_cli.models.loading import check_context

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100))
    check_context(model, 68, 32, "some/model")
    with pytest.raises(UserError, match=r"'some/model' holds 100 positions .* = 101\. .*max_prompt_tokens=68\)"):
        check_context(model, 69, 32, "some/model")
