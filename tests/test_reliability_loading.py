"""Issue 30, classes 1-3: a checkpoint never runs code, and received files cannot hang or crash epo.

1. The restricted unpickler reads an allowed Enum's member in both of Python's pickle forms
   (`EnumClass(value)`, and `getattr(EnumClass, "NAME")` as Python 3.11.0-3.11.4 write it: Debian 12's
   3.11.2 writes DeepSpeed's ZeRO shards that way), and no other getattr.
2. A planted pickle in any file of a checkpoint (DeepSpeed's model and optimizer states, the critic's, epo's
   own files) or a model folder never runs, for `trainer.resume=<run>`, `trainer.resume=auto`, `epo eval run=`
   and `model.path=`; a checkpoint written by another algorithm or model shape is refused naming the difference.
3. A YAML alias bomb in config.yaml does not hang eval, report or resume; a damaged model folder (empty
   safetensors, tokenizer.json without added_tokens, config.json disagreeing with the weights, auto_map) is one
   message naming the file, for `epo eval run=`, `epo eval model.path=` and `epo train model.path=`.

Every refusal: exit non-zero, one `error:` line naming the file, no traceback, and nothing written.
"""

from __future__ import annotations

import collections
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from epo_cli.errors import UserError
from epo_cli.rundir import saved_state
from epo_cli.rundir.safe_load import load_tensors, restricted_torch_load
from epo_cli.rundir.saved_state import load_yaml

from conftest import SmallConfig, run_cli, run_epo

# ---- crafted pickles -----------------------------------------------------------------------------------------
# Each class pickles as one call: unpickling it fully makes that call. Nested, they build any expression.


class Imported:
    """Pickles as __import__(name)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (__import__, (self.name,))


class Attribute:
    """Pickles as getattr(owner, name): the form Python 3.11.2 gives an Enum member, crafted for any owner."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):  # noqa: ANN204
        return (getattr, (self.owner, self.name))

    def __call__(self, *args: Any) -> None:  # pickle wants a callable where a call's function goes
        raise AssertionError("only pickled, never called")


class Call:
    """Pickles as function(*args)."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self):  # noqa: ANN204
        return (self.function, self.args)


def os_system_payload(marker: Path) -> Call:
    """getattr(__import__("os"), "system")("touch <marker>"): runs a shell command when fully unpickled."""
    return Call(Attribute(Imported("os"), "system"), f"touch '{marker}'")


def plant(path: Path, marker: Path) -> None:
    """Replace `path` with a torch.save'd dict that runs `touch <marker>` when unpickled (pickle protocol 2,
    as torch.save and DeepSpeed write: the GLOBAL opcodes the restricted unpickler reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    torch.save({"module": os_system_payload(marker), "optimizer_state_dict": {}}, path)


def test_the_planted_file_really_runs_when_fully_unpickled(tmp_path: Path) -> None:
    """The tests below would pass vacuously if the crafted file did nothing."""
    marker = tmp_path / "marker"
    plant(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


# ---- 1. Enum members in both pickle forms, and no other getattr ------------------------------------------------

def _zero_stage() -> Any:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum


@pytest.mark.parametrize("form", ["EnumClass(value)", "getattr(EnumClass, NAME)"])
def test_an_allowed_enum_member_loads_in_both_pickle_forms(form: str, tmp_path: Path) -> None:
    stage = _zero_stage()
    crafted = Call(stage, 2) if form == "EnumClass(value)" else Attribute(stage, "gradients")
    torch.save({"zero_stage": crafted, "loss": torch.ones(2)}, tmp_path / "shard.pt")
    opcodes = (tmp_path / "shard.pt").read_bytes()
    assert (b"getattr" in opcodes) == form.startswith("getattr")  # the form really is the one named
    assert load_tensors(tmp_path / "shard.pt")["zero_stage"] is stage.gradients
    with restricted_torch_load():  # as DeepSpeed asks for it: weights_only=False, overridden
        assert torch.load(tmp_path / "shard.pt", weights_only=False)["zero_stage"] is stage.gradients


def _getattr_rows() -> dict[str, Any]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    return {
        # reaches a shell: refused at the import of os, before getattr
        "getattr(os, 'system')('touch marker')": (lambda marker: os_system_payload(marker), "__import__"),
        # allowed owners, but not an Enum member: refused by the getattr guard itself
        "getattr(ZeroStageEnum, 'mro')()": (lambda marker: Call(Attribute(_zero_stage(), "mro")), "getattr("),
        "getattr(ZeroStageEnum, '_member_map_')": (lambda marker: Attribute(_zero_stage(), "_member_map_"),
                                                   "getattr("),
        "getattr(LossScaler, 'update_scale')": (lambda marker: Attribute(LossScaler, "update_scale"), "getattr("),
        "getattr(OrderedDict, 'fromkeys')": (lambda marker: Attribute(collections.OrderedDict, "fromkeys"),
                                             "getattr("),
        "getattr(_rebuild_tensor_v2, '__globals__')": (
            lambda marker: Attribute(torch._utils._rebuild_tensor_v2, "__globals__"), "getattr("),
    }


@pytest.mark.parametrize("row", list(_getattr_rows()))
def test_a_getattr_of_anything_else_is_refused_with_one_message(row: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    build, detail = _getattr_rows()[row]
    torch.save({"state": build(marker)}, tmp_path / "shard.pt")
    with pytest.raises(UserError) as info:
        load_tensors(tmp_path / "shard.pt")
    message = str(info.value)
    assert "shard.pt" in message and "never unpickles" in message and detail in message, message
    assert "\n" not in message and not marker.exists()
    with restricted_torch_load(), pytest.raises(UserError):  # also where DeepSpeed asks for full unpickling
        torch.load(tmp_path / "shard.pt", weights_only=False)
    assert not marker.exists()


# ---- runs to resume, evaluate and damage -----------------------------------------------------------------------

ONE_STEP = ("trainer.total_steps=1", "trainer.save_every=1")


@pytest.fixture(scope="module")
def runs(epo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-step runs: grpo (ZeRO-0: model and optimizer states in mp_rank_00_model_states.pt), ppo under
    ZeRO-2 (optimizer shards, a critic/ with its own) and epo (no critic, like grpo)."""
    root = tmp_path_factory.mktemp("reliability_runs")
    made = {}
    for name, extra in (("grpo", ["algo=grpo"]), ("ppo_zero2", ["algo=ppo", "deepspeed=zero2"]),
                        ("epo", ["algo=epo"])):
        run_epo(["train", *extra, *SmallConfig().rl(*ONE_STEP), f"run_dir={root / name}"], cwd=root)
        made[name] = root / name
    return made


def received(run: Path, tmp_path: Path, name: str = "received") -> Path:
    """A copy of `run`, as a run directory received from elsewhere."""
    copy = tmp_path / name
    shutil.copytree(run, copy)
    return copy


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time: what "nothing written" compares."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_message(proc: Any, *words: str) -> None:
    """Exit non-zero, one `error:` line that holds `words`, no traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    text = proc.stderr[proc.stderr.index("error:"):]
    for word in words:
        assert word in text, text


RESUME_PATHS = {
    "resume": lambda run: ["train", f"trainer.resume={run}", "trainer.total_steps=2"],
    "resume=auto": lambda run: ["train", "trainer.resume=auto", f"run_dir={run}", "trainer.total_steps=2"],
}
#: (run, file in checkpoints/step_1): every file a resume reads
CHECKPOINT_FILES = [
    ("grpo", "mp_rank_00_model_states.pt"),  # ZeRO-0: module and optimizer states
    ("ppo_zero2", "mp_rank_00_model_states.pt"),
    ("ppo_zero2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("ppo_zero2", "critic/mp_rank_00_model_states.pt"),
    ("ppo_zero2", "critic/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("grpo", "rng_rank0.pt"),
    ("grpo", "trainer_state.json"),  # epo's own payload is JSON: a pickle there is refused as unreadable
]


# ---- 2. a planted pickle never runs --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path", list(RESUME_PATHS))
@pytest.mark.parametrize("source,file", CHECKPOINT_FILES)
def test_a_planted_checkpoint_file_never_runs_on_resume(runs: dict[str, Path], tmp_path: Path, source: str,
                                                         file: str, path: str) -> None:
    run, marker = received(runs[source], tmp_path), tmp_path / "marker"
    plant(run / "checkpoints" / "step_1" / file, marker)
    before = snapshot(run)
    proc = run_epo(RESUME_PATHS[path](run), cwd=tmp_path, expect=None)
    assert not marker.exists(), "the planted pickle ran"
    assert_one_message(proc, Path(file).name)
    assert snapshot(run) == before


#: the files `epo eval run=<run> checkpoint=step_1` reads: ZeRO-0 module states, ZeRO-2 shards (consolidated)
EVAL_FILES = [("grpo", "mp_rank_00_model_states.pt"), ("ppo_zero2", "mp_rank_00_model_states.pt"),
              ("ppo_zero2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")]


@pytest.mark.slow
@pytest.mark.parametrize("source,file", EVAL_FILES)
def test_a_planted_checkpoint_file_never_runs_on_eval(runs: dict[str, Path], tmp_path: Path, source: str,
                                                       file: str) -> None:
    run, marker = received(runs[source], tmp_path), tmp_path / "marker"
    plant(run / "checkpoints" / "step_1" / file, marker)
    before = snapshot(run)
    proc = run_epo(["eval", f"run={run}", "checkpoint=step_1", "episodes=1"], cwd=tmp_path, expect=None)
    assert not marker.exists(), "the planted pickle ran"
    assert_one_message(proc, file)
    assert snapshot(run) == before


MODEL_PATH_COMMANDS = {
    "eval model.path=": lambda folder, tmp: ["eval", f"model.path={folder}", "env.level=tiny_open_pick_place",
                                             "episodes=1", f"out={tmp / 'out'}"],
    "train model.path=": lambda folder, tmp: ["train", f"model.path={folder}", *SmallConfig().sft(*ONE_STEP),
                                              f"run_dir={tmp / 'out'}"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(MODEL_PATH_COMMANDS))
def test_a_planted_weights_file_in_a_model_folder_never_runs(runs: dict[str, Path], tmp_path: Path,
                                                              command: str) -> None:
    folder, marker = tmp_path / "model", tmp_path / "marker"
    shutil.copytree(runs["grpo"] / "final", folder)
    (folder / "model.safetensors").unlink()
    plant(folder / "pytorch_model.bin", marker)
    proc = run_epo(MODEL_PATH_COMMANDS[command](folder, tmp_path), cwd=tmp_path, expect=None)
    assert not marker.exists(), "the planted pickle ran"
    assert_one_message(proc, str(folder / "pytorch_model.bin"), "never unpickles")
    out = tmp_path / "out"
    if command.startswith("train"):  # its run directory is written before the weights load: it says `failed`
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "status.json"]
        assert json.loads((out / "status.json").read_text())["status"] == "failed"
    else:
        assert not out.exists()


# ---- 2. a checkpoint of another kind of run ------------------------------------------------------------------

def _swap_in(run: Path, other: Path) -> None:
    """Replace the run's step_1 by another run's (a folder copied between runs)."""
    shutil.rmtree(run / "checkpoints" / "step_1")
    shutil.copytree(other / "checkpoints" / "step_1", run / "checkpoints" / "step_1")


def _forget_writer(run: Path) -> None:
    """trainer_state.json as checkpoints saved before `written_by` was recorded have it."""
    state_file = run / "checkpoints" / "step_1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state.pop("written_by")
    state_file.write_text(json.dumps(state))


#: (the run resumed, the run whose step_1 is swapped in or None, extra overrides, prepare, words of the message)
OTHER_WRITER = {
    "a ppo step (critic/) in a grpo run": ("grpo", "ppo_zero2", [], None, ["algo=ppo", "this run is algo=grpo",
                                                                          "critic/"]),
    "a grpo step (no critic/) in a ppo run": ("ppo_zero2", "grpo", [], None, ["algo=grpo", "no critic"]),
    "an epo step in a grpo run": ("epo", "grpo", [], None, ["written by algo=grpo", "this run is algo=epo"]),
    "another hidden size": ("grpo", None, ["model.hidden_size=32"], None, ["hidden_size=64",
                                                                            "this run's hidden_size=32"]),
    "another hidden size, older checkpoint": ("grpo", None, ["model.hidden_size=32"], _forget_writer,
                                              ["size mismatch", "embed_tokens"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("row", list(OTHER_WRITER))
def test_a_checkpoint_of_another_algorithm_or_shape_is_refused(runs: dict[str, Path], tmp_path: Path,
                                                                row: str) -> None:
    target, other, extra, prepare, words = OTHER_WRITER[row]
    run = received(runs[target], tmp_path)
    if other is not None:
        _swap_in(run, runs[other])
    if prepare is not None:
        prepare(run)
    before = snapshot(run)
    proc = run_epo(["train", f"trainer.resume={run}", "trainer.total_steps=2", *extra], cwd=tmp_path, expect=None)
    assert_one_message(proc, str(run / "checkpoints" / "step_1"), *words)
    assert snapshot(run) == before


@pytest.mark.slow
def test_eval_of_a_checkpoint_of_another_shape_is_one_message(runs: dict[str, Path], tmp_path: Path) -> None:
    run = received(runs["grpo"], tmp_path)
    before = snapshot(run)
    proc = run_epo(["eval", f"run={run}", "checkpoint=step_1", "model.hidden_size=32", "episodes=1"], cwd=tmp_path,
                   expect=None)
    assert_one_message(proc, str(run / "checkpoints" / "step_1"), "64] there and", "32] here")
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_zero2_checkpoint_with_its_enum_resumes(runs: dict[str, Path], tmp_path: Path) -> None:
    """The control of the rows above: the restricted loader reads DeepSpeed's own states (ZeroStageEnum,
    pickled as getattr on Python 3.11.2), its critic's included, and the run goes on."""
    run = received(runs["ppo_zero2"], tmp_path)
    run_epo(["train", f"trainer.resume={run}", "trainer.total_steps=2"], cwd=tmp_path)
    assert (run / "checkpoints" / "step_2" / "COMPLETE").exists()


# ---- 3. a YAML alias bomb ------------------------------------------------------------------------------------

def alias_bomb(levels: int = 9) -> str:
    """"Billion laughs": nine lines whose aliases stand for 9**9 (387 million) strings."""
    lines = ["lol0: &lol0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_load_yaml_refuses_an_alias_bomb_at_once(tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"aliases \(\*name\) expand it to \d+ values"):
        load_yaml(tmp_path / "bomb.yaml")
    assert time.perf_counter() - started < 5


def test_load_yaml_reads_a_few_aliases_and_refuses_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "small.yaml").write_text("base: &base {lr: 0.1, steps: 2}\nrun: *base\n")
    assert load_yaml(tmp_path / "small.yaml").run.lr == 0.1
    (tmp_path / "cycle.yaml").write_text("a: &a [1, *a]\n")
    with pytest.raises(ValueError, match="refers to a node that contains it"):
        load_yaml(tmp_path / "cycle.yaml")
    monkeypatch.setattr(saved_state, "MAX_YAML_VALUES", 50)  # the limit counts values, aliased or not
    (tmp_path / "big.yaml").write_text(f"a: [{', '.join(['1'] * 50)}]\n")  # 1 + 1 + 1 + 50 values
    with pytest.raises(ValueError, match="expand it to 53 values, more than the 50"):
        load_yaml(tmp_path / "big.yaml")


def _with_bomb(run: Path) -> None:
    config = run / "config.yaml"
    config.write_text(config.read_text() + alias_bomb())


BOMB_COMMANDS = {
    "eval": lambda run: ["eval", f"run={run}", "episodes=1"],
    "resume": lambda run: ["train", f"trainer.resume={run}", "trainer.total_steps=2"],
    "resume=auto": lambda run: ["train", "trainer.resume=auto", f"run_dir={run}", "trainer.total_steps=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(BOMB_COMMANDS))
def test_an_alias_bomb_in_config_yaml_is_one_message_not_a_hang(runs: dict[str, Path], tmp_path: Path,
                                                                 command: str) -> None:
    run = received(runs["grpo"], tmp_path)
    _with_bomb(run)
    before = snapshot(run)
    proc = run_cli(BOMB_COMMANDS[command](run), cwd=tmp_path, timeout=120, expect=None)  # today: minutes, growing
    assert_one_message(proc, "config.yaml", "alias")
    assert snapshot(run) == before


@pytest.mark.slow
def test_report_reads_a_run_whose_config_yaml_is_an_alias_bomb(runs: dict[str, Path], tmp_path: Path) -> None:
    run = received(runs["grpo"], tmp_path)
    _with_bomb(run)
    proc = run_cli(["report", str(run), "--out", str(tmp_path / "report")], cwd=tmp_path, timeout=120)
    warned = [line for line in proc.stderr.splitlines() if "config.yaml" in line and "alias" in line]
    assert warned and all(line.startswith("warning:") for line in warned), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and list((tmp_path / "report").iterdir())


# ---- 3. a damaged model folder -------------------------------------------------------------------------------

def _edit_json(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


#: damage done to a model folder, the file the message names, and words of the message
DAMAGE = {
    "empty model.safetensors": (lambda f: (f / "model.safetensors").write_bytes(b""), "model.safetensors",
                                "empty (0 bytes)"),
    "model.safetensors cut short": (lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:5000]), "model.safetensors", "cut short"),
    "tokenizer.json without added_tokens": (lambda f: _edit_json(f / "tokenizer.json",
                                                                 lambda d: d.pop("added_tokens")),
                                            "tokenizer.json", "`added_tokens`"),
    "config.json vocab_size not the weights'": (lambda f: _edit_json(f / "config.json",
                                                                     lambda d: d.update(vocab_size=500)),
                                                "config.json", "vocab_size=500"),
    "config.json with auto_map": (lambda f: _edit_json(f / "config.json", lambda d: d.update(
        auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})), "config.json",
                                  "model.trust_remote_code=true"),
    "tokenizer_config.json with auto_map": (lambda f: _edit_json(f / "tokenizer_config.json", lambda d: d.update(
        auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})), "tokenizer_config.json",
                                            "model.trust_remote_code=true"),
}
FOLDER_COMMANDS = {
    "eval run=": lambda run, tmp: ["eval", f"run={run}", "episodes=1"],
    # the model.path= commands of the planted-weights test, given the run's exported model
    **{name: (lambda run, tmp, command=command: command(run / "final", tmp))
       for name, command in MODEL_PATH_COMMANDS.items()},
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(FOLDER_COMMANDS))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_model_folder_is_one_message_naming_the_file(runs: dict[str, Path], tmp_path: Path,
                                                                damage: str, command: str) -> None:
    run = received(runs["grpo"], tmp_path)
    do, file, words = DAMAGE[damage]
    do(run / "final")
    before = snapshot(run)
    proc = run_epo(FOLDER_COMMANDS[command](run, tmp_path), cwd=tmp_path, expect=None)
    assert_one_message(proc, str(run / "final" / file), words)
    assert snapshot(run) == before and not (tmp_path / "out").exists()

