"""What a config's sizes imply in memory, checked before anything is allocated.

A setting such as `env.max_turns=1000000000` or `model.hidden_size=1000000` is a valid number, and without
this check it is accepted and then fills the machine's memory for minutes (or ends in an allocator
traceback, or a Rust abort in the tokenizer trainer). Each estimate below is what the settings let epo
hold at once (their limits reached: every turn played, every prompt at its token limit), computed from the
config alone (no torch), and compared with the memory this
process may use (`memory_limit`): the machine's RAM, or less where `ulimit -v` sets an address-space limit.
One ConfigError names the settings, the size they imply and the limit.

    model        the tiny model's parameters x 16 bytes (fp32 weights, gradients and Adam's two moments)
    rollouts     one RL iteration's turn-samples (tasks_per_step x group_size x env.max_turns, x the rounds
                 of dynamic sampling) x the tokens of a turn (prompt + response) x 8 bytes (a token id)
    episodes     the episodes an evaluation keeps (eval episodes x env.max_turns turns, same tokens), and
                 the behaviour-cloning demonstrations (algo.demo_episodes x env.max_turns)
Only what grows with the settings is counted (activations, the reference model and the text of prompts come on
top): a refused config is one whose limits, once reached, cannot fit.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

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


def estimates(cfg: Any) -> list[Estimate]:
    """The estimates that apply to this config (see the module docstring)."""
    out = []
    model, algo, env, rollout = cfg.model, cfg.algo, cfg.env, cfg.rollout
    if not model.path:
        params = tiny_model_parameters(model)
        out.append(Estimate(
            f"the tiny model's {params:.3g} parameters x {BYTES_PER_PARAMETER} bytes (weights, gradients, Adam)",
            params * BYTES_PER_PARAMETER,
            [f"model.{k}={model[k]}" for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                               "vocab_size", "padded_vocab_size") if model[k] is not None],
            "lower the model sizes (see `epo config show` for the defaults)"))
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
    return out


def episodes_estimate(episodes: int, cfg: Any, key: str) -> Estimate:
    """The episodes one evaluation keeps (every turn of every episode, for its scores and samples)."""
    turn_tokens = int(cfg.rollout.max_prompt_tokens) + int(cfg.rollout.max_new_tokens)
    turns = episodes * int(cfg.env.max_turns)
    return Estimate(f"an evaluation's {turns:.3g} turns at most x {turn_tokens} tokens a turn x "
                    f"{BYTES_PER_TOKEN} bytes", turns * turn_tokens * BYTES_PER_TOKEN,
                    [f"{key}={episodes}", f"env.max_turns={cfg.env.max_turns}"], f"lower {key} or env.max_turns")


def check_memory(cfg: Any, extra: list[Estimate] | None = None) -> None:
    """One ConfigError for the first estimate that exceeds the memory this process may use."""
    limit, where = memory_limit()
    for estimate in [*estimates(cfg), *(extra or [])]:
        if estimate.bytes > limit:
            raise ConfigError(
                f"{', '.join(estimate.settings)}: these settings let epo hold up to {shown_bytes(estimate.bytes)} "
                f"({estimate.what}), more than {where} ({shown_bytes(limit)}), so the run could exhaust it. "
                f"Refused before allocating anything: {estimate.fix}.")
