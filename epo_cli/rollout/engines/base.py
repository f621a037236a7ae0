"""The port every rollout engine implements, what builds one, and the episodes' Policy on top of it.

    engine = build_rollout_engine(EngineContext(...))       # rollout.engine names it
    out = engine.generate(prompts, params, seeds)           # tokens (stop string / EOS included) + log-probs
    ... the update trains the policy ...
    engine.sync_weights()                                   # take the updated weights (every rank calls it)

An engine promises which tokens a row gets (its `promises`); the trainer relies on none beyond "row i is a
sample of the current policy at params.temperature, seeded by seeds[i]". The log-probs it returns are those
of the sampled tokens under the sampling temperature (before top-k/top-p), the trainer's definition of the
old policy's log-probs, so that the two can be compared token by token (rollout/logp_diff_*).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from epo_cli.rollout.generation import SamplingConfig


@dataclass
class Generation:
    """One generate call's output, row by row."""

    tokens: list[list[int]]  # response token ids (the stop string's last token / EOS included)
    logprobs: list[list[float]]  # each token's log-probability under the sampling temperature (engine's own)


@dataclass
class EngineContext:
    """Everything an engine may be built from; each engine reads what it needs."""

    policy: Any  # training.engine.RolloutModule: `.module` (the weights that generate/score), `.refresh()`
    tokenizer: Any
    vocab_limit: int  # sample only among the first vocab_limit ids (the tokenizer's size)
    rollout: Any  # the rollout config section (rollout.*)
    source: str  # the folder or hub id the policy was loaded from (an engine that loads its own copy reads it)
    dtype: Any  # the policy's torch dtype
    device: Any  # this rank's torch device
    max_model_len: int  # rollout.max_prompt_tokens + rollout.max_new_tokens
    seed: int  # the run's seed
    lora: bool  # the policy is a LoRA (peft) model: weights to sync are merged
    autocast_to: Any = None  # model.autocast's torch dtype for a torch engine's forward (None: the weights')


class RolloutEngine(ABC):
    """Generates the rollouts' tokens for one rank. Subclasses say what they promise (`promises`)."""

    #: what the engine guarantees about a row's tokens (shown by `epo plan` and the docs)
    promises: str = ""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int] | None,
                 logprobs: bool = False) -> Generation:
        """One response per prompt; row i sampled with seeds[i] (None: greedy or the global RNG). logprobs:
        fill Generation.logprobs (else it holds empty lists)."""

    @abstractmethod
    def sync_weights(self) -> None:
        """Take the policy's current weights (after an update, a resume). Every rank calls it (ZeRO-3 gathers
        the partitions: a collective)."""

    def before_update(self) -> None:
        """Free what the update may need (e.g. vLLM's KV cache on a GPU it shares with training)."""
        return None

    def after_update(self) -> None:
        """Take back what `before_update` freed."""
        return None

    def close(self) -> None:
        """Free the engine's resources (end of the run)."""
        return None


@dataclass
class EnginePolicy:
    """episodes.Policy on a RolloutEngine: one generate call per turn (per `batch_size` prompts), sampling
    with `params`. It keeps the engine's log-probs of each (prompt, response) it produced, for the mismatch
    metrics (`logprobs_of`)."""

    engine: RolloutEngine
    tokenizer: Any
    params: SamplingConfig
    batch_size: int = 0  # 0 = all prompts at once
    keep_logprobs: bool = False
    generate_seconds: float = 0.0
    generated_tokens: int = 0
    _logprobs: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = field(default_factory=dict, repr=False)

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        start = time.perf_counter()
        step = self.batch_size or len(prompts)
        out: list[list[int]] = []
        for i in range(0, len(prompts), step):
            chunk = prompts[i:i + step]
            result = self.engine.generate(chunk, self.params,
                                          seeds[i:i + step] if self.params.temperature > 0 else None,
                                          logprobs=self.keep_logprobs)
            out += result.tokens
            if self.keep_logprobs:
                for prompt, tokens, logprobs in zip(chunk, result.tokens, result.logprobs):
                    self._logprobs[(tuple(prompt), tuple(tokens))] = logprobs
        self.generate_seconds += time.perf_counter() - start
        self.generated_tokens += sum(len(r) for r in out)
        return out

    def logprobs_of(self, prompt: list[int], response: list[int]) -> list[float] | None:
        """The engine's log-probs of `response` after `prompt`, if this policy generated it."""
        return self._logprobs.get((tuple(prompt), tuple(response)))

    # what scripts that call rollout.generation.generate directly read (scripts/bench/bench_rollout.py)
    @property
    def model(self) -> Any:
        return getattr(self.engine, "module", None)

    @property
    def vocab_limit(self) -> int | None:
        return getattr(self.engine, "vocab_limit", None)


def sampling_config(rollout: Any, temperature: float) -> SamplingConfig:
    """The sampling settings of rollout.* at `temperature` (training rollouts, evaluation, `epo eval`)."""
    return SamplingConfig(rollout.max_new_tokens, temperature, rollout.top_p, rollout.top_k, rollout.stop)


class FixedWeights:
    """The `policy` of an EngineContext for a model nothing trains (`epo eval`): its module, nothing to gather."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def refresh(self) -> None:
        return None
