"""What a config's sizes imply in memory, checked before anything is allocated.

A setting such as `env.max_turns=1000000000` or `model.hidden_size=1000000` is a valid number, and without
this check it is accepted and then fills the machine's memory for minutes (or ends in an allocator
traceback, or a Rust abort in the tokenizer trainer). Each estimate below is what the settings let epo
hold at once (their limits reached: every turn played, every prompt at its token limit), computed from the
config alone (no torch), and compared with the memory this
process may use (`memory_limit`): the machine's RAM, or less where `ulimit -v` sets an address-space limit.
One ConfigError names the settings, the size they imply and the limit.

    model        the policy's parameters x 16 bytes (fp32 weights, gradients and Adam's two moments),
                 LoRA's adapters included (model.lora.rank x (in + out) per targeted module and layer)
    generation   the policy's rollout batch at once (tasks_per_step x group_size rows, an evaluation's
                 episodes, or rollout.generation_batch_size): its KV cache at prompt + response tokens, and
                 the prefill's largest working set in one layer (the MLP's SwiGLU tensors, the attention
                 scores rows x heads x prompt^2 where attention is not fused), in 4-byte floats (2 in bf16)
    update       one training micro-batch of the policy: every layer's activations for backward (plan's
                 accounting, epo_cli/analysis/plan.py; LoRA's rank-wide intermediates too) and one layer's
                 attention scores (micro_batch_size x heads x tokens^2)
    rollouts     one RL iteration's turn-samples (tasks_per_step x group_size x env.max_turns, x the rounds
                 of dynamic sampling) x the tokens of a turn (prompt + response) x 8 bytes (a token id)
    episodes     the episodes an evaluation keeps (eval episodes x env.max_turns turns, same tokens), and
                 the behaviour-cloning demonstrations (algo.demo_episodes x env.max_turns)
Only what grows with the settings is counted (the reference model, the text of prompts and Python's own objects
come on top): a refused config is one whose limits, once reached, cannot fit.

The policy's shape is the tiny model's (model.* sizes), or for `model.path=<folder>` the one its config.json
gives (read as bounded data; a config.json that gives none is left to check_model_folder's message). Such a
model trains in this memory on the CPU (trainer.device=cpu, or auto without a GPU driver); elsewhere only its
weights are counted, which from_pretrained loads here before they move to the GPU (`epo plan` sizes the GPU's
share). A hub id's model is counted by its rollouts and episodes only.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epo_cli.analysis.plan import Architecture, architecture, folder_architecture, kv_cache_bytes, policy_activations
from epo_cli.errors import ConfigError, UserError
from epo_cli.runtime.device import gpu_driver_present

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


@dataclass(frozen=True)
class Shape:
    """The policy's shape: the tiny model's (model.* sizes), or that of a model.path `folder`'s config.json."""

    arch: Architecture
    softmax_vocab: int  # the logits the loss softmaxes over (the tokenizer's size)
    folder: Path | None = None


def policy_shape(model: Any) -> Shape | None:
    """The tiny model's shape; a model.path folder's from its config.json, read as bounded data (a regular file,
    symlinks only inside the folder or its hub cache repository: epo_cli/rundir/received.py); None for a hub id,
    or a config.json that gives no shape (check_model_folder names what is wrong before anything loads)."""
    if not model.path:
        return Shape(*architecture(model))
    folder = Path(str(model.path)).expanduser()
    if not folder.is_dir():
        return None
    try:
        arch = folder_architecture(folder)
    except (UserError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Shape(arch, arch.vocab, folder)


def _size_settings(model: Any, shape: Shape, keys: tuple[str, ...]) -> list[str]:
    """Where the sizes `keys` come from, as a message names them: model.<key>=N, or model.path's config.json."""
    if shape.folder is None:
        return [f"model.{k}={model[k]}" for k in keys if model[k] is not None]
    arch = shape.arch
    sizes = {"hidden_size": arch.hidden, "intermediate_size": arch.intermediate, "num_hidden_layers": arch.layers,
             "num_attention_heads": arch.heads, "vocab_size": arch.vocab}
    return [f"model.path={model.path} (its config.json: {', '.join(f'{k}={sizes[k]}' for k in keys if k in sizes)})"]


def _smaller_model(shape: Shape) -> str:
    return "the model sizes" if shape.folder is None else "the model (a smaller model.path)"


def _on_the_cpu(cfg: Any) -> bool:
    """The run trains and generates in this machine's memory: trainer.device=cpu, or auto without a GPU driver."""
    device = cfg.trainer.device
    return device == "cpu" or (device == "auto" and not gpu_driver_present())


def lora_parameters(model: Any, arch: Architecture | None = None) -> tuple[int, int]:
    """(parameters, targeted modules per layer) of the LoRA adapters on the policy (`arch`; the tiny model's by
    default): A (rank x in) and B (out x rank) for each targeted module of every layer; (0, 0) at rank 0."""
    rank = int(model.lora.rank)
    if rank <= 0:
        return 0, 0
    arch = arch if arch is not None else architecture(model)[0]
    params, matched, _ = arch.lora_adapters(rank, list(model.lora.target_modules))
    return params, len(matched)


def _lora_settings(model: Any) -> list[str]:
    return [f"model.lora.rank={model.lora.rank}"] if int(model.lora.rank) > 0 else []


def _float_bytes(model: Any) -> int:
    """Bytes of an activation: 2 where the model may run in bf16 (a lower bound), else 4 (fp32)."""
    return 4 if model.dtype == "fp32" else 2


def generation_estimate(cfg: Any, rows: int, rows_text: list[str], fix: str, shape: Shape | None = None) -> Estimate:
    """The policy (`shape`; the tiny model's by default) generating for `rows` sequences at once
    (rollout.generation_batch_size caps them)."""
    model, rollout = cfg.model, cfg.rollout
    if int(rollout.generation_batch_size):
        rows, rows_text = min(rows, int(rollout.generation_batch_size)), [
            f"rollout.generation_batch_size={rollout.generation_batch_size}"]
    shape = shape if shape is not None else Shape(*architecture(model))
    arch = shape.arch
    width = _float_bytes(model)
    prompt, response = int(rollout.max_prompt_tokens), int(rollout.max_new_tokens)
    kv = kv_cache_bytes(arch, rows, prompt, response, width)
    mlp = rows * prompt * 3 * arch.intermediate * width  # gate, up and their product, one layer at a time
    scores = rows * arch.heads * prompt * prompt * width if model.attn_implementation == "eager" else 0.0
    layer = max(mlp, scores)  # the prefill's logits: the last token's only
    return Estimate(f"generating for {rows:.3g} rows at once: their KV cache at {prompt} + {response} tokens and "
                    "a layer's prefill", kv + layer,
                    [*rows_text, f"rollout.max_prompt_tokens={prompt}",
                     *_size_settings(model, shape, ("num_hidden_layers", "hidden_size", "intermediate_size"))],
                    f"{fix}, or set rollout.generation_batch_size=N to generate for N at a time")


def update_estimate(cfg: Any, shape: Shape | None = None) -> Estimate:
    """One training micro-batch of the policy (`shape`; the tiny model's by default): activations kept for
    backward, one layer's scores."""
    model, algo, rollout = cfg.model, cfg.algo, cfg.rollout
    shape = shape if shape is not None else Shape(*architecture(model))
    arch, softmax_vocab = shape.arch, shape.softmax_vocab
    width = _float_bytes(model)
    micro = int(algo.micro_batch_size)
    prompt, response = int(rollout.max_prompt_tokens), int(rollout.max_new_tokens)
    tokens = micro * (prompt + response)
    acts = policy_activations(arch, softmax_vocab, micro, prompt, response, width, bool(model.gradient_checkpointing))
    scores = micro * arch.heads * (prompt + response) ** 2 * width  # softmax(QK^T) where attention is not fused
    _, targeted = lora_parameters(model, arch)
    lora = tokens * arch.layers * targeted * int(model.lora.rank) * width  # x @ A per module, kept for backward
    return Estimate(f"one training micro-batch of {tokens:.3g} tokens: activations for backward, a layer's "
                    "attention scores" + (", LoRA's rank-wide intermediates" if lora else ""),
                    acts + scores + lora,
                    [f"algo.micro_batch_size={micro}",
                     *_size_settings(model, shape, ("num_attention_heads", "num_hidden_layers", "hidden_size",
                                                    "intermediate_size")), *_lora_settings(model)],
                    f"lower algo.micro_batch_size, {_smaller_model(shape)}, model.lora.rank or "
                    "rollout.max_prompt_tokens")


def estimates(cfg: Any, eval_rows: int | None = None) -> list[Estimate]:
    """The estimates that apply to this config (see the module docstring); `eval_rows` the episodes one
    evaluation plays at once (default trainer.eval_episodes, where the run evaluates)."""
    out = []
    model, algo, env, rollout = cfg.model, cfg.algo, cfg.env, cfg.rollout
    shape = policy_shape(model)
    here = shape is not None and (shape.folder is None or _on_the_cpu(cfg))  # its training states in this memory
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "padded_vocab_size")
    if shape is not None and not here:  # a folder's model on a GPU: the weights from_pretrained loads here first
        params, width = shape.arch.params(), _float_bytes(model)
        out.append(Estimate(f"the model's {params:.3g} parameters in {width}-byte floats, loaded in this memory "
                            "before they move to the GPU", params * width,
                            [*_size_settings(model, shape, sizes), f"model.dtype={model.dtype}"],
                            "pass a smaller model.path"))
    if here:
        params = shape.arch.params()
        adapters, _ = lora_parameters(model, shape.arch)
        tiny = "tiny " if shape.folder is None else ""
        out.append(Estimate(
            f"the {tiny}model's {params + adapters:.3g} parameters x {BYTES_PER_PARAMETER} bytes (weights, "
            "gradients, Adam)", (params + adapters) * BYTES_PER_PARAMETER,
            _size_settings(model, shape, sizes) + _lora_settings(model),
            "lower the model sizes (see `epo config show` for the defaults)" if shape.folder is None else
            "pass a smaller model.path, or train it on a GPU (trainer.device=cuda; `epo plan` sizes that)"))
        if algo.base != "none" or algo.demos == "expert":
            out.append(update_estimate(cfg, shape))
        if algo.base != "none":
            rows = int(algo.tasks_per_step) * int(algo.group_size)
            out.append(generation_estimate(cfg, rows, [f"algo.tasks_per_step={algo.tasks_per_step}",
                                                       f"algo.group_size={algo.group_size}"],
                                           "lower algo.tasks_per_step or algo.group_size", shape))
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
    if here and (eval_rows is not None or int(cfg.trainer.eval_every) > 0):
        key = "episodes" if eval_rows is not None else "trainer.eval_episodes"
        rows = eval_rows if eval_rows is not None else int(cfg.trainer.eval_episodes)
        out.append(generation_estimate(cfg, rows, [f"{key}={rows}"], f"lower {key}", shape))
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
