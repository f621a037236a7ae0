"""Files from elsewhere are data, never code (issue 15 item 3).

A crafted pickle (its __reduce__ writes a marker file when anything unpickles it) planted in a run
directory must not run: not through `epo eval run=<dir>`, not through the checks a resume makes before
DeepSpeed's loader, not through a model folder. Everything epo itself writes loads with
torch.load(weights_only=True), the RNG states round-trip exactly, and a run directory's saved
model.trust_remote_code is not honoured.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from epo_cli.errors import UserError
from epo_cli.rundir.safe_load import load_tensors, restricted_torch_load
from epo_cli.training import checkpoint, rng_state

from conftest import SmallConfig, run_epo


class Planted:
    """Unpickling this runs Path.write_text(marker, 'executed'): proof that a file was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (Path.write_text, (self.marker, "executed"))


def plant(path: Path, marker: Path, protocol: int = 2) -> None:
    """Replace `path` with a torch.save'd dict whose value is a Planted object. Protocol 4 (as other tools
    write): torch's restricted unpickler warns about it before refusing, and only epo's message may show."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": Planted(marker), "format": rng_state.RNG_FORMAT}, path, pickle_protocol=protocol)


def only_epos_message(stderr: str) -> bool:
    """A refusal prints epo's one message: no library warning before it."""
    return stderr.count("error:") == 1 and "Warning" not in stderr and "pickle protocol" not in stderr


def test_the_planted_pickle_really_runs_when_unpickled(tmp_path: Path) -> None:
    """The other tests would pass vacuously if the crafted file did nothing: full unpickling runs it."""
    marker = tmp_path / "marker"
    plant(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.read_text() == "executed"


def test_load_tensors_refuses_a_pickle_with_one_message(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    plant(tmp_path / "evil.pt", marker)
    with pytest.raises(UserError, match=r"weights_only=True\) and never unpickles") as info:
        load_tensors(tmp_path / "evil.pt")
    # the file, and the object: Path.write_text pickles as getattr(Path, "write_text"), whose getattr the
    # restricted unpickler reads only for an allowed Enum's members; Path is refused before it is called
    assert "evil.pt" in str(info.value) and "it refers to pathlib.Path" in str(info.value)
    assert not marker.exists()


def test_restricted_block_overrides_callers_that_ask_for_full_unpickling(tmp_path: Path) -> None:
    """DeepSpeed's zero_to_fp32 calls torch.load(weights_only=False); inside the block that is refused."""
    marker = tmp_path / "marker"
    plant(tmp_path / "evil.pt", marker)
    with restricted_torch_load(), pytest.raises(UserError, match="evil.pt' holds objects other than tensors"):
        torch.load(tmp_path / "evil.pt", weights_only=False)
    assert not marker.exists()
    assert torch.load.__module__.startswith("torch")  # restored afterwards


def test_rng_states_round_trip_exactly_through_a_weights_only_file(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()  # and one in numpy's
    torch.save(rng_state.capture(), tmp_path / "rng.pt")
    expected = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
                torch.rand(3).tolist())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    rng_state.restore(torch.load(tmp_path / "rng.pt", weights_only=True), tmp_path / "rng.pt")
    got = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
           torch.rand(3).tolist())
    assert got == expected


class RecordingEngine:
    """Stands in for a DeepSpeed engine: records whether its (fully unpickling) loader was reached."""

    def __init__(self) -> None:
        self.calls = 0

    def load_checkpoint(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self.calls += 1
        return "loaded", {}


#: the smallest trainer_state.json that passes the saved-state checks (epo_cli/rundir/saved_state.py) at step 2
VALID_STATE = {"format": checkpoint.CHECKPOINT_FORMAT, "trainer": {"step": 2}, "entropy_history": {},
               "monitor": {}}


def _checkpoint(tmp_path: Path, state: dict) -> Path:
    folder = tmp_path / "run" / "checkpoints" / "step_2"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps(state))
    (folder / checkpoint.COMPLETE).write_text("2")
    return folder


def test_resume_checks_epos_own_files_before_deepspeed_loads_anything(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    folder = _checkpoint(tmp_path, VALID_STATE)
    plant(folder / "rng_rank0.pt", marker)
    engine = RecordingEngine()
    with pytest.raises(UserError, match="never unpickles") as info:
        checkpoint.load(folder, engine, None, rank=0, algo="grpo")
    assert "rng_rank0.pt" in str(info.value) and "Complete checkpoints of this run" in str(info.value)
    assert not marker.exists() and engine.calls == 0


def test_a_checkpoint_of_the_old_format_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, {"trainer": {"step": 2}})  # written before epo-checkpoint/2
    engine = RecordingEngine()
    with pytest.raises(UserError, match="written before epo-checkpoint/2") as info:
        checkpoint.load(folder, engine, None, rank=0, algo="grpo")
    assert "model.path=<run>/final" in str(info.value) and engine.calls == 0


def test_a_valid_checkpoint_restores_rng_and_reaches_deepspeed(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, VALID_STATE)
    torch.manual_seed(11)
    torch.save(rng_state.capture(), folder / "rng_rank0.pt")
    expected = torch.rand(2).tolist()
    engine = RecordingEngine()
    payload = checkpoint.load(folder, engine, None, rank=0, algo="grpo")
    assert payload == {k: v for k, v in VALID_STATE.items() if k != "format"} and engine.calls == 1
    assert torch.rand(2).tolist() == expected


# ---- trust_remote_code: only from this invocation's command line -------------------------------------------

def _run_dir_trusting_remote_code(tmp_path: Path) -> Path:
    from epo_cli.compose import compose

    run = tmp_path / "shared_run"
    run.mkdir()
    cfg = compose(["model.trust_remote_code=true"])
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    # a complete checkpoint to resume from (resuming a run without one is an error of its own)
    step = run / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "trainer_state.json").write_text(json.dumps({**VALID_STATE, "trainer": {"step": 1}}))
    (run / "checkpoints" / "latest").write_text("step_1")
    return run


def test_a_saved_trust_remote_code_is_not_honoured(tmp_path: Path) -> None:
    from epo_cli.evaluation.run import EvalCommandConfig, eval_config
    from epo_cli.launch.setup import compose_for_train

    run = _run_dir_trusting_remote_code(tmp_path)
    with pytest.warns(UserWarning, match="honoured only from the command line, not from a saved config"):
        cfg = eval_config(EvalCommandConfig(run=run), [])
    assert cfg.model.trust_remote_code is False
    with pytest.warns(UserWarning, match="model.trust_remote_code=true on the command line"):
        cfg, _ = compose_for_train([f"trainer.resume={run}"])
    assert cfg.model.trust_remote_code is False
    # the command line of this invocation may still ask for it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert eval_config(EvalCommandConfig(run=run), ["model.trust_remote_code=true"]).model.trust_remote_code is True
        cfg, _ = compose_for_train([f"trainer.resume={run}", "model.trust_remote_code=true"])
    assert cfg.model.trust_remote_code is True


def test_ranks_get_trust_remote_code_from_the_launcher_not_from_config_yaml(tmp_path: Path) -> None:
    from epo_cli.compose import compose
    from epo_cli.launch.deepspeed import deepspeed_command
    from epo_cli.launch.layout import layout_for
    from epo_cli.rundir.trust import decode

    for trust in (False, True):
        cfg = compose(["algo=grpo", "launcher=deepspeed", "launcher.num_procs=2",
                       f"model.trust_remote_code={str(trust).lower()}"])
        cmd = deepspeed_command(cfg, tmp_path / "run", layout_for(cfg))
        settings = decode(cmd[cmd.index("--command-line-settings") + 1])
        assert settings["model.trust_remote_code"] is trust


# ---- through the CLI ---------------------------------------------------------------------------------------

SFT_RUN = ["train", *SmallConfig().sft("trainer.save_every=1", "trainer.eval_every=0")]


@pytest.fixture(scope="module")
def trained_run(epo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("safe")
    run_epo([*SFT_RUN, f"run_dir={root / 'run'}"], cwd=root)
    return root / "run"


@pytest.mark.slow
def test_everything_epo_writes_loads_weights_only(trained_run: Path) -> None:
    files = sorted(trained_run.rglob("*.pt"))
    assert {p.name for p in files} >= {"mp_rank_00_model_states.pt", "rng_rank0.pt"}
    for path in files:
        torch.load(path, weights_only=True)  # raises if anything in it needs full unpickling
    assert (trained_run / "final" / "model.safetensors").exists()
    assert not list((trained_run / "final").glob("*.bin"))


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "shared"
    shutil.copytree(run, copy)
    return copy


@pytest.mark.slow
def test_eval_of_a_run_dir_does_not_unpickle_a_planted_checkpoint(trained_run: Path, tmp_path: Path) -> None:
    run, marker = _copy(trained_run, tmp_path), tmp_path / "marker"
    for name in ("mp_rank_00_model_states.pt", "rng_rank0.pt"):
        plant(run / "checkpoints" / "step_2" / name, marker, protocol=4)
    proc = run_epo(["eval", f"run={run}", "checkpoint=latest", "episodes=1"], cwd=tmp_path, expect=1)
    assert "never unpickles" in proc.stderr and "mp_rank_00_model_states.pt" in proc.stderr
    assert "Traceback" not in proc.stderr and only_epos_message(proc.stderr), proc.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_eval_of_a_final_folder_with_a_planted_bin_does_not_unpickle(trained_run: Path, tmp_path: Path) -> None:
    run, marker = _copy(trained_run, tmp_path), tmp_path / "marker"
    (run / "final" / "model.safetensors").unlink()
    plant(run / "final" / "pytorch_model.bin", marker, protocol=4)
    proc = run_epo(["eval", f"run={run}", "episodes=1"], cwd=tmp_path, expect=None)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "never unpickles" in proc.stderr and only_epos_message(proc.stderr), proc.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_resume_refuses_a_planted_rng_file_before_deepspeed_runs(trained_run: Path, tmp_path: Path) -> None:
    run, marker = _copy(trained_run, tmp_path), tmp_path / "marker"
    plant(run / "checkpoints" / "step_2" / "rng_rank0.pt", marker, protocol=4)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = run_epo(["train", f"trainer.resume={run}", "trainer.total_steps=3"], cwd=tmp_path, expect=1)
    assert "rng_rank0.pt" in proc.stderr and "never unpickles" in proc.stderr and "Traceback" not in proc.stderr
    assert only_epos_message(proc.stderr), proc.stderr
    assert not marker.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_rank_takes_trust_remote_code_from_its_launcher_flag_only(tmp_path: Path) -> None:
    from epo_cli.compose import load_run_config

    run = _run_dir_trusting_remote_code(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the flag decides: no warning about the saved value
        assert load_run_config(run, command_line={"model.trust_remote_code": True}).model.trust_remote_code is True
        assert load_run_config(run, command_line={"model.trust_remote_code": False}).model.trust_remote_code is False


@pytest.mark.parametrize("text", ['a: !!python/object/apply:os.system ["touch {marker}"]\n', "algo: [unclosed\n",
                                  "- just\n- a list\n"])
def test_a_hostile_or_damaged_config_yaml_is_one_message(tmp_path: Path, text: str) -> None:
    from epo_cli.evaluation.run import EvalCommandConfig, eval_config

    marker = tmp_path / "marker"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(text.format(marker=marker))
    with pytest.raises(UserError, match="config.yaml' is not a") as info:
        eval_config(EvalCommandConfig(run=run), [])
    assert "nothing was loaded" in str(info.value) and not marker.exists()


def test_report_reads_a_run_with_a_damaged_config_yaml_without_it(tmp_path: Path) -> None:
    from epo_cli.analysis.report import load_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algo: [unclosed\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "policy/entropy": 0.5}\n')
    with pytest.warns(UserWarning, match="config.yaml' is unreadable"):
        data = load_run(run)
    assert data.config == {} and data.overrides == [] and len(data.rows) == 1
