"""Issue 41, class 3: a model folder is whole or refused.

A folder whose weights do not hold the model's tensors (a safetensors file with the embedding renamed, a
pytorch_model.bin of other tensors) trained or evaluated a randomly initialised model without a word;
tokenizer files that were not regular files were skipped (another tokenizer was used); safetensors header
lies, config.json head counts of 0, an unknown activation or RoPE scaling, and a pytorch_model.bin whose
restricted load raised TypeError were tracebacks; `model.path=<a file>` said "does not exist". The restricted
unpickler ran BUILD on an allowed Enum's member (renaming it for the whole process), and every refusal of a
planted pickle quoted torch's advice that `weights_only=False` "will likely succeed". Each is one message now,
naming the file (epo_cli/rundir/saved_state.py, epo_cli/models/loading.py, epo_cli/rundir/safe_load.py).
"""

from __future__ import annotations

import collections
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from epo_cli.errors import UserError
from epo_cli.rundir.safe_load import load_tensors, restricted_torch_load
from epo_cli.rundir.saved_state import safetensors_shapes

from conftest import SmallConfig, one_error, run_cli, run_epo

# ---- safetensors header lies (in-process) ------------------------------------------------------------------


def write_safetensors(path: Path, header: dict[str, Any] | str, data: bytes) -> None:
    text = header if isinstance(header, str) else json.dumps(header)
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode() + data)


def entry(offsets: list[int], shape: list[int], dtype: str = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


#: header (as JSON text or a dict), data bytes, what the message says
HEADER_LIES: dict[str, tuple[Any, bytes, str]] = {
    "an unknown dtype": ({"w": entry([0, 8], [2], "F99")}, b"\0" * 8, "dtype 'F99'"),
    "offsets shorter than the shape": ({"w": entry([0, 4], [2])}, b"\0" * 4, "needs 8 bytes"),
    "offsets backwards": ({"w": entry([8, 0], [2])}, b"\0" * 8, "data offsets [8, 0]"),
    "a negative shape": ({"w": entry([0, 0], [-1])}, b"", "negative size"),
    "two tensors overlapping": ({"a": entry([0, 8], [2]), "b": entry([4, 12], [2])}, b"\0" * 12, "overlap"),
    "a gap before a tensor": ({"a": entry([4, 12], [2])}, b"\0" * 12, "overlap or leave a gap"),
    "trailing bytes": ({"w": entry([0, 8], [2])}, b"\0" * 16, "bytes follow the last tensor"),
    "cut short": ({"w": entry([0, 8], [2])}, b"\0" * 4, "cut short"),
    "one name twice": ('{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                       '"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', b"\0" * 16, "'w' twice"),
    "metadata that is not strings": ({"__metadata__": {"a": 1}, "w": entry([0, 8], [2])}, b"\0" * 8, "__metadata__"),
    "a header nested 200000 deep": ("[" * 200_000 + "]" * 200_000, b"", "levels deep"),
}


@pytest.mark.parametrize("lie", list(HEADER_LIES))
def test_a_safetensors_header_that_lies_is_refused_naming_the_lie(lie: str, tmp_path: Path) -> None:
    header, data, says = HEADER_LIES[lie]
    write_safetensors(tmp_path / "model.safetensors", header, data)
    with pytest.raises(ValueError) as info:
        safetensors_shapes(tmp_path / "model.safetensors")
    assert says in str(info.value), str(info.value)


def test_a_true_header_is_read() -> None:
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        save_file({"a": torch.zeros(3, 2), "b": torch.ones(5, dtype=torch.bfloat16)}, str(path))
        assert safetensors_shapes(path) == {"a": [3, 2], "b": [5]}


# ---- the restricted unpickler: BUILD on an Enum member, and epo's own words ----------------------------------------

class Rebuilt:
    """Pickles as `function(*args)` followed by BUILD with `state`."""

    def __init__(self, function: Any, args: tuple[Any, ...], state: dict[str, Any]) -> None:
        self.function, self.args, self.state = function, args, state

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (self.function, self.args, self.state)


def _zero_stage() -> Any:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum


ENUM_BUILDS: dict[str, Callable[[], Rebuilt]] = {
    "getattr(ZeroStageEnum, 'gradients') + BUILD": lambda: Rebuilt(getattr, (_zero_stage(), "gradients"),
                                                                   {"_name_": "hacked", "_value_": 99}),
    "ZeroStageEnum(2) + BUILD": lambda: Rebuilt(_zero_stage(), (2,), {"_name_": "hacked", "_value_": 99}),
}


@pytest.mark.parametrize("form", list(ENUM_BUILDS))
def test_build_on_an_allowed_enum_member_is_refused_and_the_member_is_untouched(form: str, tmp_path: Path) -> None:
    stage = _zero_stage()
    torch.save({"zero_stage": ENUM_BUILDS[form]()}, tmp_path / "shard.pt")
    for load in (lambda: load_tensors(tmp_path / "shard.pt"),
                 lambda: torch.load(tmp_path / "shard.pt", weights_only=False)):  # as DeepSpeed asks, overridden
        with restricted_torch_load(), pytest.raises(UserError) as info:
            load()
        assert "shard.pt" in str(info.value) and "will likely succeed" not in str(info.value)
    assert stage.gradients.name == "gradients" and stage.gradients.value == 2
    assert stage(2) is stage.gradients and stage["gradients"] is stage.gradients


#: crafted files whose restricted load raises something else than UnpicklingError (or is refused by it)
ODD_LOADS: dict[str, Callable[[], Any]] = {
    "OrderedDict(5): TypeError": lambda: {"a": Rebuilt(collections.OrderedDict, (5,), {})},
    "a REDUCE of an allowed global with a bad argument: ValueError": lambda: Rebuilt(_zero_stage(), (12345,), {}),
    "os.system: refused global": lambda: {"a": Rebuilt(__import__("os").system, ("true",), {})},
}


@pytest.mark.parametrize("row", list(ODD_LOADS))
def test_every_failed_restricted_load_is_one_message_in_epos_words(row: str, tmp_path: Path) -> None:
    torch.save(ODD_LOADS[row](), tmp_path / "weights.pt")
    with pytest.raises(UserError) as info:
        load_tensors(tmp_path / "weights.pt")
    message = str(info.value)
    assert "weights.pt" in message and "\n" not in message
    assert "will likely succeed" not in message and "weights_only=False" not in message


# ---- model folders through the CLI -------------------------------------------------------------------------------

def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def rename_embedding(folder: Path) -> None:
    tensors = _safetensors(folder)
    tensors["model.embed_tokens_renamed.weight"] = tensors.pop("model.embed_tokens.weight")
    _save(folder, tensors)


def pickle_of_other_tensors(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"encoder.weight": torch.zeros(2, 2)}, folder / "pytorch_model.bin")


def pickle_raising_type_error(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"a": Rebuilt(collections.OrderedDict, (5,), {})}, folder / "pytorch_model.bin")


def planted_pickle(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"a": Rebuilt(__import__("os").system, ("true",), {})}, folder / "pytorch_model.bin")


def tokenizer_to_dev_zero(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("/dev/zero")


def tokenizer_config_to_dev_zero(folder: Path) -> None:
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").symlink_to("/dev/zero")


def name_twice(folder: Path) -> None:
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    text = json.dumps(header)[:-1] + f', "{name}": ' + json.dumps(header[name]) + "}"
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + length:])


def config_edit(**values: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(values)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


#: damage -> (the file the message names, words it holds)
FOLDER_ROWS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "embedding renamed in model.safetensors": (rename_embedding, "model.embed_tokens.weight", "are missing"),
    "pytorch_model.bin of other tensors": (pickle_of_other_tensors, "encoder.weight", "not weights of it"),
    "pytorch_model.bin whose restricted load raises TypeError": (pickle_raising_type_error, "pytorch_model.bin",
                                                                 "TypeError"),
    "tokenizer.json -> /dev/zero": (tokenizer_to_dev_zero, "tokenizer.json", "/dev/zero"),
    "tokenizer_config.json -> /dev/zero": (tokenizer_config_to_dev_zero, "tokenizer_config.json",
                                           "/dev/zero"),
    "safetensors header names a tensor twice": (name_twice, "model.safetensors", "twice"),
    "config.json num_attention_heads 0": (config_edit(num_attention_heads=0), "config.json", "num_attention_heads"),
    "config.json unknown hidden_act": (config_edit(hidden_act="nosuch"), "config.json", "hidden_act='nosuch'"),
    "config.json unknown rope_scaling": (config_edit(rope_scaling={"rope_type": "nosuch", "factor": 2.0}),
                                         "config.json", "rope_scaling"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("row", list(FOLDER_ROWS))
def test_a_model_folder_that_is_not_whole_is_refused_by_eval(row: str, tiny_folder: Path, tmp_path: Path) -> None:
    damage, named, says = FOLDER_ROWS[row]
    folder = Path(shutil.copytree(tiny_folder, tmp_path / "model"))
    damage(folder)
    proc = run_cli(["eval", f"model.path={folder}", "episodes=1", f"out={tmp_path / 'out'}"], cwd=tmp_path,
                   timeout=200, expect=None)
    assert proc.returncode != 0
    one_error(proc, named, says)
    assert not list((tmp_path / "out").glob("*.json"))


TRAIN = SmallConfig().sft("trainer.total_steps=1", "trainer.save_every=0")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("row", ["embedding renamed in model.safetensors", "pytorch_model.bin of other tensors"])
def test_weights_that_load_but_do_not_fit_the_model_are_refused_by_train(row: str, tiny_folder: Path,
                                                                         tmp_path: Path) -> None:
    damage, named, says = FOLDER_ROWS[row]
    folder = Path(shutil.copytree(tiny_folder, tmp_path / "model"))
    damage(folder)
    proc = run_cli(["train", *TRAIN, f"model.path={folder}", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                   timeout=200, expect=None)
    assert proc.returncode != 0
    one_error(proc, named, says)
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.timeout(240)
def test_a_planted_pickle_is_refused_in_epos_words(tiny_folder: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_folder, tmp_path / "model"))
    planted_pickle(folder)
    proc = run_cli(["eval", f"model.path={folder}", "episodes=1", f"out={tmp_path / 'out'}"], cwd=tmp_path,
                   timeout=200, expect=None)
    assert proc.returncode != 0
    one_error(proc, "never unpickles")
    assert "will likely succeed" not in proc.stderr and "weights_only=False" not in proc.stderr


@pytest.mark.parametrize("command", ["train", "eval"])
def test_model_path_that_is_a_file_says_so(command: str, tiny_folder: Path, tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    shutil.copy(tiny_folder / "model.safetensors", file)
    args = [*TRAIN, f"run_dir={tmp_path / 'run'}"] if command == "train" else ["episodes=1"]
    proc = run_epo([command, f"model.path={file}", *args], cwd=tmp_path, expect=None)
    assert proc.returncode != 0
    one_error(proc, "is a file, not a model folder")
    assert "does not exist" not in proc.stderr


def test_a_tied_model_without_its_tied_weight_still_loads(tiny_folder: Path, tmp_path: Path) -> None:
    """The rule's exception: a weight the model ties to another the file holds (lm_head to the embedding)."""
    from types import SimpleNamespace

    from epo_cli.models.loading import load_causal_lm

    folder = Path(shutil.copytree(tiny_folder, tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    assert config.get("tie_word_embeddings"), "the tiny model ties its embeddings (this test's premise)"
    tensors = _safetensors(folder)
    tensors.pop("lm_head.weight", None)
    _save(folder, tensors)
    cfg = SimpleNamespace(trust_remote_code=False, attn_implementation="sdpa", gradient_checkpointing=False)
    model = load_causal_lm(str(folder), cfg, torch.float32)
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", list(ENUM_BUILDS))
def test_eval_of_a_checkpoint_with_build_on_an_enum_member_is_one_message(form: str, saved_run: Path,
                                                                        tmp_path: Path) -> None:
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    states = run / "checkpoints" / "step_1" / "mp_rank_00_model_states.pt"
    module = load_tensors(states)["module"]
    states.unlink()
    torch.save({"module": module, "zero_stage": ENUM_BUILDS[form]()}, states)
    proc = run_cli(["eval", f"run={run}", "checkpoint=step_1", "episodes=1"], cwd=tmp_path, timeout=200, expect=None)
    assert proc.returncode != 0
    one_error(proc, "mp_rank_00_model_states.pt", "never unpickles")
    assert "will likely succeed" not in proc.stderr and "weights_only=False" not in proc.stderr
