"""Settings that can start or load code are honoured only from the command line (epo_cli/rundir/trust.py).

Table-driven over epo_cli.rundir.trust.COMMAND_LINE_ONLY: a received run directory whose config.yaml sets one of them
to a hostile value is evaluated (`epo eval run=<dir>`) and resumed (`epo train trainer.resume=<dir>`) with the
default instead and one warning naming the setting; the same value given on the command line is honoured.
Both commands run through the CLI up to the point where the config is used (the environment suite for
eval, the trainer for a resume), where the test records the config and ends the command. One end-to-end
case runs ScienceWorld for real: a saved JVM option never reaches the JVM.
"""

from __future__ import annotations

import importlib.util
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from epo_cli.errors import UserError
from epo_cli.rundir.trust import COMMAND_LINE_ONLY, _default

from conftest import run_epo

#: setting -> (the config groups it needs, a hostile value as a saved config would hold it)
HOSTILE: dict[str, tuple[list[str], str]] = {
    "model.trust_remote_code": ([], "true"),
    "env.jvm_options": (["env=scienceworld"], "-javaagent:/somewhere/agent.jar"),
    "env.games_dir": (["env=textworld"], "/somewhere/games"),
    "env.cache_dir": (["env=textworld"], "/somewhere/cache"),
    "launcher.hostfile": ([], "/somewhere/hostfile"),
    "logger.mlflow.tracking_uri": ([], "http://collector.example:5000"),
}


def test_the_table_covers_every_command_line_only_setting() -> None:
    assert set(HOSTILE) == {s.key for s in COMMAND_LINE_ONLY}


def received_run(tmp_path: Path, key: str) -> Path:
    """A run directory as someone else may have written it: its config.yaml sets `key` to the hostile value,
    and it has a complete checkpoint (what a resume needs to get as far as the trainer)."""
    from epo_cli.compose import compose

    select, value = HOSTILE[key]
    run = tmp_path / "received"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "COMPLETE").write_text("1")
    (run / "checkpoints" / "latest").write_text("step_1")
    (run / "checkpoints" / "step_1" / "trainer_state.json").write_text(
        '{"format": "epo-checkpoint/2", "trainer": {"step": 1}, "entropy_history": {}, "monitor": {}}')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. launcher.hostfile under launcher=local: "no effect"
        cfg = compose([*select, f"{key}={value}"])
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run


class Captured(UserError):
    """Ends the command once the config it would run with is recorded."""


def capture_config(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record the config `epo eval` builds its environments from and `epo train` hands to the trainer."""
    import epo_cli.evaluation.run
    import epo_cli.launch.local

    seen: dict[str, Any] = {}

    def record(cfg: Any, *args: Any, **kwargs: Any) -> None:
        seen["cfg"] = cfg
        raise Captured("config captured")

    monkeypatch.setattr(epo_cli.evaluation.run, "make_suite", lambda env_cfg, **kw: record(seen.get("eval_cfg")))
    monkeypatch.setattr(epo_cli.evaluation.run, "eval_config", _wrap(epo_cli.evaluation.run.eval_config, seen))
    monkeypatch.setattr(epo_cli.launch.local, "run_local", record)
    return seen


def _wrap(function: Any, seen: dict[str, Any]) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        seen["eval_cfg"] = function(*args, **kwargs)
        return seen["eval_cfg"]
    return wrapped


COMMANDS = {
    "eval": lambda run: ["eval", f"run={run}", "policy=random", "episodes=1"],
    "resume": lambda run: ["train", f"trainer.resume={run}"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("key", list(HOSTILE))
def test_a_saved_setting_that_can_start_code_is_dropped_with_a_warning(key: str, command: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = received_run(tmp_path, key)
    select, value = HOSTILE[key]
    known, default = _default(key, select[0].split("=")[1] if select else "household")
    assert known
    seen = capture_config(monkeypatch)
    proc = run_epo(COMMANDS[command](run), cwd=tmp_path, expect=1)
    assert "config captured" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert OmegaConf.select(seen["cfg"], key) == default  # the saved value did not reach the run
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:") and key in line]
    assert len(warned) == 1 and "honoured only from the command line" in warned[0], proc.stderr[-2000:]
    assert value.strip("'") in warned[0]

    # the same value on this command line is honoured, without the warning
    seen.clear()
    proc = run_epo([*COMMANDS[command](run), f"{key}={value}"], cwd=tmp_path, expect=1)
    assert "config captured" in proc.stderr, proc.stderr[-2000:]
    given = OmegaConf.select(seen["cfg"], key)
    assert str(given).lower() == value, (given, value)
    assert "honoured only from the command line" not in proc.stderr


def test_ranks_get_every_setting_from_their_launcher_not_from_config_yaml(tmp_path: Path) -> None:
    """The deepspeed launcher passes its own values of all these settings; a rank applies them over the
    config.yaml it reads (which a resumed, received run may have written)."""
    from epo_cli.compose import compose, load_run_config
    from epo_cli.launch.deepspeed import deepspeed_command
    from epo_cli.launch.layout import layout_for
    from epo_cli.rundir.trust import decode

    run = received_run(tmp_path, "model.trust_remote_code")
    cfg = compose(["algo=grpo", "launcher=deepspeed", "launcher.num_procs=2"])
    cmd = deepspeed_command(cfg, run, layout_for(cfg))
    settings = decode(cmd[cmd.index("--command-line-settings") + 1])
    assert settings == {"model.trust_remote_code": False, "launcher.hostfile": None,
                        "logger.mlflow.tracking_uri": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the launcher's values decide: no warning about the saved one
        assert load_run_config(run, command_line=settings).model.trust_remote_code is False
    with pytest.raises(ValueError, match="JSON object"):
        decode('{"algo.lr": 1}')  # only these settings travel this way


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("scienceworld") is None or shutil.which("java") is None,
                    reason="scienceworld or Java not installed")
def test_a_saved_jvm_option_never_reaches_the_jvm(tiny_folder: Path, tmp_path: Path) -> None:
    """The probe's case, for real: a saved option that would make the JVM write a file (as -javaagent would
    run a jar) does not reach ScienceWorld's JVM; given on the command line, it does. (The random policy
    needs only a tokenizer: the household tiny model's, so no ScienceWorld tokenizer is trained here.)"""
    from epo_cli.compose import compose

    marker = tmp_path / "jvm.log"
    option = f"-Xlog:gc:file={marker}"
    run = tmp_path / "received"
    run.mkdir()
    cfg = compose(["env=scienceworld", f"env.jvm_options='{option}'"])
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    args = ["eval", f"run={run}", "policy=random", "episodes=1", "env.max_turns=2", "env.num_workers=0",
            f"model.path={tiny_folder}", f"out={tmp_path / 'eval'}"]
    proc = run_epo(args, cwd=tmp_path)
    assert "env.jvm_options" in proc.stderr and not marker.exists(), proc.stderr[-2000:]
    run_epo([*args, f"env.jvm_options='{option}'"], cwd=tmp_path)
    assert marker.exists()  # the option does reach the JVM from the command line: the check above can fail
