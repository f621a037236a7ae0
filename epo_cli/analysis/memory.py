"""What a config's sizes imply in memory, checked before anything is allocated.

A setting such as `env.max_turns=1000000000` or `model.hidden_size=1000000` is a valid number, and without
this check it is accepted and then fills the machine's memory for minutes (or ends in an allocator
traceback, or a Rust abort in the tokenizer trainer). Each estimate below is what the settings let epo
hold at once (their limits reached: every turn played, every prompt at its token limit), computed from the
config alone (no torch), and compared with the memory this
process may use (`memory_limit`): the machine's RAM, or less where `ulimit -v` sets an address-space limit.
One ConfigError names the settings, the size they imply and the limit.

    model        the tiny model's parameters x 16 bytes (fp32 weights, gradients and Adam's two moments),
                 LoRA's adapters included (model.lora.rank x (in + out) per targeted module and layer)
    generation   the tiny model's rollout batch at once (tasks_per_step x group_size rows, an evaluation's
                 episodes, or rollout.generation_batch_size): its KV cache at prompt + response tokens, and
                 the prefill's largest working set in one layer (the MLP's SwiGLU tensors, the attention
                 scores rows x heads x prompt^2 where attention is not fused), in 4-byte floats (2 in bf16)
    update       one training micro-batch of the tiny model: every layer's activations for backward (plan's
                 accounting, epo_cli/analysis/plan.py; LoRA's rank-wide intermediates too) and one layer's
                 attention scores (micro_batch_size x heads x tokens^2)
    rollouts     one RL iteration's turn-samples (tasks_per_step x group_size x env.max_turns, x the rounds
                 of dynamic sampling) x the tokens of a turn (prompt + response) x 8 bytes (a token id)
    episodes     the episodes an evaluation keeps (eval episodes x env.max_turns turns, same tokens), and
                 the behaviour-cloning demonstrations (algo.demo_episodes x env.max_turns)
Only what grows with the settings is counted (the reference model, the text of prompts and Python's own objects
come on top): a refused config is one whose limits, once reached, cannot fit. A model from model.path is
counted by its rollouts and episodes only (its shape is known once its folder is read).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

from epo_cli.analysis.plan import architecture, kv_cache_bytes, policy_activations
from epo_cli.errors import ConfigError

#: bytes a trained parameter takes at least: fp32 weight, its gradient, and Adam's two moments
BYTES_PER_PARAMETER = 16
#: bytes a token of a stored turn takes at least (its int64 id; log-probs, masks and text come on top)
BYTES_PER_TOKEN = 8


def memory_limit() -> tuple[int, str]:
    """(bytes, what that is): the memory this process may use. The address-space limit (`ulimit -v`) where one
    is set below the machine's memory, else the machine's memory (psutil; /proc/meminfo without it)."""
    total = _machine_memory()
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and 0 < soft < total:
        return soft, "this process's address-space limit (ulimit -v)"
    return total, "this machine's memory"


def _machine_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil is a dependency; /proc/meminfo where it is missing
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read this machine's memory size")


def shown_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.3g} PiB"


@dataclass
class Estimate:
    """What a group of settings implies: `bytes` at least, for `what`, from `settings` (key=value texts)."""

    what: str
    bytes: float
    settings: list[str]
    fix: str


def tiny_model_parameters(model: Any) -> int:
    """Parameters of the tiny model (Qwen2 architecture) that model.* sizes build (epo_cli/models/tiny.py)."""
    h, inter, layers = int(model.hidden_size), int(model.intermediate_size), int(model.num_hidden_layers)
    heads, kv_heads = int(model.num_attention_heads), int(model.num_key_value_heads)
    vocab = int(model.padded_vocab_size or model.vocab_size)
    kv_dim = h // max(heads, 1) * kv_heads
    attention = h * h + 2 * h * kv_dim + h * h + h + 2 * kv_dim  # q, k, v, o; q/k/v biases
    per_layer = attention + 3 * h * inter + 2 * h  # gate, up, down; two RMSNorms
    embeddings = vocab * h * (1 if model.tie_word_embeddings else 2)
    return embeddings + layers * per_layer + h


def _module_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one tiny-model decoder layer, by module name."""
    h, inter = int(model.hidden_size), int(model.intermediate_size)
    kv_dim = h // max(int(model.num_attention_heads), 1) * int(model.num_key_value_heads)
    return {"q_proj": (h, h), "k_proj": (h, kv_dim), "v_proj": (h, kv_dim), "o_proj": (h, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def lora_parameters(model: Any) -> tuple[int, int]:
    """(parameters, targeted modules per layer) of the LoRA adapters on the tiny model: A (rank x in) and B
    (out x rank) for each targeted module of every layer; (0, 0) at rank 0."""
    rank = int(model.lora.rank)
    if rank <= 0:
        return 0, 0
    shapes = _module_shapes(model)
    targets = [name for name in shapes if any(str(t) == name or str(t).endswith("." + name)
                                              for t in model.lora.target_modules)]
    width = sum(sum(shapes[name]) for name in targets)
    return rank * width * int(model.num_hidden_layers), len(targets)


def _lora_settings(model: Any) -> list[str]:
    return [f"model.lora.rank={model.lora.rank}"] if int(model.lora.rank) > 0 else []


def _float_bytes(model: Any) -> int:
    """Bytes of an activation: 2 where the model may run in bf16 (a lower bound), else 4 (fp32)."""
    return 4 if model.dtype == "fp32" else 2


def _architecture(model: Any) -> Any:
    return architecture(model)


def generation_estimate(cfg: Any, rows: int, rows_text: list[str], fix: str) -> Estimate:
    """The tiny model generating for `rows` sequences at once (rollout.generation_batch_size caps them)."""
    model, rollout = cfg.model, cfg.rollout
    if int(rollout.generation_batch_size):
        rows, rows_text = min(rows, int(rollout.generation_batch_size)), [
            f"rollout.generation_batch_size={rollout.generation_batch_size}"]
    arch, _ = _architecture(model)
    width = _float_bytes(model)
    prompt, response = int(rollout.max_prompt_tokens), int(rollout.max_new_tokens)
    kv = kv_cache_bytes(arch, rows, prompt, response, width)
    mlp = rows * prompt * 3 * arch.intermediate * width  # gate, up and their product, one layer at a time
    scores = rows * arch.heads * prompt * prompt * width if model.attn_implementation == "eager" else 0.0
    layer = max(mlp, scores)  # the prefill's logits: the last token's only
    return Estimate(f"generating for {rows:.3g} rows at once: their KV cache at {prompt} + {response} tokens and "
                    "a layer's prefill", kv + layer,
                    [*rows_text, f"rollout.max_prompt_tokens={prompt}", f"model.num_hidden_layers={arch.layers}",
                     f"model.hidden_size={arch.hidden}", f"model.intermediate_size={arch.intermediate}"],
                    f"{fix}, or set rollout.generation_batch_size=N to generate for N at a time")


def update_estimate(cfg: Any) -> Estimate:
    """One training micro-batch of the tiny model (activations kept for backward, one layer's scores)."""

    model, algo, rollout = cfg.model, cfg.algo, cfg.rollout
    arch, softmax_vocab = _architecture(model)
    width = _float_bytes(model)
    micro = int(algo.micro_batch_size)
    prompt, response = int(rollout.max_prompt_tokens), int(rollout.max_new_tokens)
    tokens = micro * (prompt + response)
    acts = policy_activations(arch, softmax_vocab, micro, prompt, response, width, bool(model.gradient_checkpointing))
    scores = micro * arch.heads * (prompt + response) ** 2 * width  # softmax(QK^T) where attention is not fused
    _, targeted = lora_parameters(model)
    lora = tokens * arch.layers * targeted * int(model.lora.rank) * width  # x @ A per module, kept for backward
    return Estimate(f"one training micro-batch of {tokens:.3g} tokens: activations for backward, a layer's "
                    "attention scores" + (", LoRA's rank-wide intermediates" if lora else ""),
                    acts + scores + lora,
                    [f"algo.micro_batch_size={micro}", f"model.num_attention_heads={arch.heads}",
                     f"model.num_hidden_layers={arch.layers}", f"model.hidden_size={arch.hidden}",
                     f"model.intermediate_size={arch.intermediate}", *_lora_settings(model)],
                    "lower algo.micro_batch_size, the model sizes, model.lora.rank or rollout.max_prompt_tokens")


def estimates(cfg: Any, eval_rows: int | None = None) -> list[Estimate]:
    """The estimates that apply to this config (see the module docstring); `eval_rows` the episodes one
    evaluation plays at once (default trainer.eval_episodes, where the run evaluates)."""
    out = []
    model, algo, env, rollout = cfg.model, cfg.algo, cfg.env, cfg.rollout
    if not model.path:
        params = tiny_model_parameters(model)
        adapters, _ = lora_parameters(model)
        out.append(Estimate(
            f"the tiny model's {params + adapters:.3g} parameters x {BYTES_PER_PARAMETER} bytes (weights, "
            "gradients, Adam)", (params + adapters) * BYTES_PER_PARAMETER,
            [f"model.{k}={model[k]}" for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                               "vocab_size", "padded_vocab_size") if model[k] is not None]
            + _lora_settings(model),
            "lower the model sizes (see `epo config show` for the defaults)"))
        if algo.base != "none" or algo.demos == "expert":
            out.append(update_estimate(cfg))
        if algo.base != "none":
            rows = int(algo.tasks_per_step) * int(algo.group_size)
            out.append(generation_estimate(cfg, rows, [f"algo.tasks_per_step={algo.tasks_per_step}",
                                                       f"algo.group_size={algo.group_size}"],
                                           "lower algo.tasks_per_step or algo.group_size"))
    turn_tokens = int(rollout.max_prompt_tokens) + int(rollout.max_new_tokens)
    token_text = (f"x {turn_tokens} tokens a turn (rollout.max_prompt_tokens + rollout.max_new_tokens) x "
                  f"{BYTES_PER_TOKEN} bytes")
    if algo.base != "none":
        rounds = 1 + (int(algo.dynamic_sampling_max_rounds) if algo.dynamic_sampling else 0)
        samples = int(algo.tasks_per_step) * int(algo.group_size) * int(env.max_turns) * rounds
        settings = [f"algo.tasks_per_step={algo.tasks_per_step}", f"algo.group_size={algo.group_size}",
                    f"env.max_turns={env.max_turns}"]
        if rounds > 1:
            settings.append(f"1 + algo.dynamic_sampling_max_rounds={rounds}")
        out.append(Estimate(f"one RL iteration's {samples:.3g} turn-samples {token_text}",
                            samples * turn_tokens * BYTES_PER_TOKEN, settings,
                            "lower env.max_turns, algo.tasks_per_step or algo.group_size"))
    elif algo.demos == "expert":
        samples = int(algo.demo_episodes) * int(env.max_turns)
        out.append(Estimate(f"the demonstrations' {samples:.3g} turns at most {token_text}",
                            samples * turn_tokens * BYTES_PER_TOKEN,
                            [f"algo.demo_episodes={algo.demo_episodes}", f"env.max_turns={env.max_turns}"],
                            "lower algo.demo_episodes or env.max_turns"))
    out.append(episodes_estimate(int(cfg.trainer.eval_episodes), cfg, "trainer.eval_episodes"))
    if not model.path and (eval_rows is not None or int(cfg.trainer.eval_every) > 0):
        key = "episodes" if eval_rows is not None else "trainer.eval_episodes"
        rows = eval_rows if eval_rows is not None else int(cfg.trainer.eval_episodes)
        out.append(generation_estimate(cfg, rows, [f"{key}={rows}"], f"lower {key}"))
    return out


def episodes_estimate(episodes: int, cfg: Any, key: str) -> Estimate:
    """The episodes one evaluation keeps (every turn of every episode, for its scores and samples)."""
    turn_tokens = int(cfg.rollout.max_prompt_tokens) + int(cfg.rollout.max_new_tokens)
    turns = episodes * int(cfg.env.max_turns)
    return Estimate(f"an evaluation's {turns:.3g} turns at most x {turn_tokens} tokens a turn x "
                    f"{BYTES_PER_TOKEN} bytes", turns * turn_tokens * BYTES_PER_TOKEN,
                    [f"{key}={episodes}", f"env.max_turns={cfg.env.max_turns}"], f"lower {key} or env.max_turns")


def check_memory(cfg: Any, extra: list[Estimate] | None = None, eval_rows: int | None = None) -> None:
    """One ConfigError for the first estimate that exceeds the memory this process may use (`eval_rows`: the
    episodes an `epo eval` plays at once)."""
    limit, where = memory_limit()
    for estimate in [*estimates(cfg, eval_rows), *(extra or [])]:
        if estimate.bytes > limit:
            raise ConfigError(
                f"{', '.join(estimate.settings)}: these settings let epo hold up to {shown_bytes(estimate.bytes)} "
                f"({estimate.what}), more than {where} ({shown_bytes(limit)}), so the run could exhaust it. "
                f"Refused before allocating anything: {estimate.fix}.")
