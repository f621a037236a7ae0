"""`model=tiny`: a small Qwen2-architecture causal LM and a BPE tokenizer trained locally, fully offline.

The tokenizer is trained (tokenizers library, byte-level BPE like Qwen's) on the prompt templates, the
response format and text from expert episodes of the configured environment, then wrapped in
PreTrainedTokenizerFast with a Qwen-style chat template. Tokenizer and randomly initialised model are
saved as an ordinary Hugging Face folder in the cache and loaded back through AutoTokenizer /
AutoModelForCausalLM, exactly like a real model.

    folder = build_tiny(cfg.model, suite, seed=0)   # cached: ~/.cache/epo/tiny/<hash>/
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from epo_cli.envs.base import EnvSuite
from epo_cli.rollout.prompts import PROMPT_TEMPLATES, format_response

#: bump when the corpus recipe changes, so cached tokenizers are rebuilt
CORPUS_VERSION = 4
#: the templates in the corpus: a fixed list, so that a template added later (or a plugin's) leaves every
#: tiny tokenizer, and so every tiny run's tokens, as they were
CORPUS_TEMPLATES = ("compact", "alfworld", "scienceworld")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
#: architecture sizes that define a tiny model (part of the cache key)
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "vocab_size", "padded_vocab_size",
             "tie_word_embeddings")


def cache_root(model_cfg: Any) -> Path:
    if model_cfg.cache_dir:
        return Path(model_cfg.cache_dir).expanduser()
    return Path(os.environ.get("EPO_CACHE", Path.home() / ".cache" / "epo"))


def tiny_cache_key(model_cfg: Any, env_name: str, seed: int) -> str:
    sizes = {k: getattr(model_cfg, k) for k in SIZE_KEYS}
    blob = json.dumps({"sizes": sizes, "env": env_name, "seed": seed, "corpus": CORPUS_VERSION},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tokenizer_corpus(suite: EnvSuite, episodes: int | None = None, seed: int = 0) -> list[str]:
    """Text the tokenizer is trained on: templates, response format and expert episodes of `suite`
    (`suite.tokenizer_episodes` of them by default: real simulators are slow)."""
    texts = [t for name in CORPUS_TEMPLATES for t in PROMPT_TEMPLATES[name]]
    rng = random.Random(seed)
    episodes = suite.tokenizer_episodes if episodes is None else episodes
    env = suite.make_env()
    levels = suite.levels() or [None]
    try:
        for i in range(episodes):
            split = suite.splits[i % len(suite.splits)]
            task = suite.sample_tasks(split, 1, rng, level=levels[i % len(levels)])[0]
            obs, info = env.reset(task)
            texts += [obs, info.get("goal", ""), ", ".join(info.get("admissible_commands", []))]
            for _ in range(60):
                action = info.get("expert_action")
                if not action:
                    break
                texts.append(format_response(info.get("expert_thought") or "", action))
                result = env.step(action)
                obs, info = result.observation, result.info
                texts += [obs, ", ".join(info.get("admissible_commands", []))]
                if result.done:
                    break
    finally:
        env.close()
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over `texts`, wrapped as a PreTrainedTokenizerFast with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's normalizer and pre-tokenizer (digits split one by one): AutoTokenizer loads a
    # qwen2 model's tokenizer as Qwen2Tokenizer, which re-installs these, so merges must be learned
    # on the same pre-tokens.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.padding_side = "left"
    return wrapped


def build_tiny(model_cfg: Any, suite: EnvSuite, seed: int = 0) -> Path:
    """Return the cached HF folder of the tiny model for `model_cfg` and this env, building it once."""
    import torch
    from filelock import FileLock
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = cache_root(model_cfg) / "tiny" / f"{suite.name}-{tiny_cache_key(model_cfg, suite.name, seed)}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks or test workers may build the same model at once: one builds, the others wait.
    with FileLock(str(folder) + ".lock"):
        if (folder / "config.json").exists():
            return folder
        tokenizer = train_tokenizer(tokenizer_corpus(suite, seed=seed), model_cfg.vocab_size)
        vocab = max(len(tokenizer), model_cfg.padded_vocab_size or 0)
        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=model_cfg.hidden_size,
            intermediate_size=model_cfg.intermediate_size,
            num_hidden_layers=model_cfg.num_hidden_layers,
            num_attention_heads=model_cfg.num_attention_heads,
            num_key_value_heads=model_cfg.num_key_value_heads,
            max_position_embeddings=model_cfg.max_position_embeddings,
            tie_word_embeddings=model_cfg.tie_word_embeddings,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left over by an interrupted build
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(folder)  # atomic: a half-written folder is never picked up
    return folder
