"""`epo plan <overrides>`: will this run fit, and what will an iteration cost, before anything starts.

For the composed config it estimates, per rank (bytes):

    model states     weights, gradients and optimizer state of the policy (and of the critic for PPO), by
                     ZeRO stage and offload: DeepSpeed's estimate_zero2/zero3_model_states_mem_needs_all_live
                     formulas (bf16 on GPU), written out here without torch; fp32 (CPU ranks) by the same
                     accounting with 4-byte weights and gradients (measured: docs/distributed.md)
    gathered layer   ZeRO-3 gathers one layer's full parameters at a time (DeepSpeed's 4 x largest layer)
    inference copy   ZeRO-3 only: the full policy (and critic) copy each rank generates with
                     (epo_cli/training/engine.py: RolloutModule)
    reference        the frozen KL reference, a full copy on every rank (a `kl` loss term)
    activations      one training micro-batch (micro_batch_size x (prompt + response) tokens) of the policy,
                     with or without gradient checkpointing, plus its logits at the response tokens; the
                     critic's micro-batch (prompt tokens, no logits) if larger
    KV cache         the rollout batch on this rank (tasks x group / ranks rows, or rollout.generation_batch_size)
                     at prompt + response tokens
The peak is the persistent part (states, copies, reference) plus the larger of the update's activations and
the rollout's KV cache (they are never alive together), plus a fixed reserve on GPU (CUDA context, NCCL and
allocator slack). It says whether that fits N GPUs of M GiB, and if not, which single change makes it fit.

Then tokens per iteration (all episodes at max_turns: the worst case) and an iteration time from a stated
per-GPU throughput: measured tokens/s from `scripts/gpu_check.py --out FILE` (`--throughput FILE`), scaled
to this model's size, or the documented defaults below. Environment step time is not included.

Lengths default to the config's maxima (rollout.max_prompt_tokens, rollout.max_new_tokens): the worst
case. `--prompt-tokens/--response-tokens` give the lengths a run really sees (e.g. from a run's perf/
metrics). Imports neither torch nor DeepSpeed (tests/test_plan.py checks it).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.config import ModelConfig, config_dir, group_options
from epo_cli.errors import ConfigError, UserError
from epo_cli.rollout.engines import engine_memory
from epo_cli.rundir.received import loads, model_folder_root, read_json, read_text

GIB = 1024**3

# ---- documented defaults ---------------------------------------------------------------------------------

#: GPU memory (GiB) when --gpu-mem is not given: no launcher setting holds it (an 80 GB A100/H100)
DEFAULT_GPU_MEM_GIB = 80.0
#: per-GPU memory a run cannot use for tensors: CUDA context (~0.5-1 GiB), NCCL buffers, allocator slack
GPU_RESERVE_GIB = 2.0
#: update throughput without a measurement: effective bf16 TFLOP/s per GPU of a training pass (~6 FLOPs per
#: parameter and token): about 30-40% of an A100's peak, 15% of an H100's
DEFAULT_UPDATE_TFLOPS = 120.0
#: the largest --gpus, --gpu-mem (GiB) and --prompt-tokens/--response-tokens a plan takes (beyond any machine:
#: 1e26 GPUs or inf GiB would be planned and printed as `fits`, and --json would print non-standard Infinity)
MAX_GPUS = 1_000_000
MAX_GPU_MEM_GIB = 1024.0**2
MAX_PLAN_TOKENS = 100_000_000
#: decoding without a measurement: every decoded token of a step reads all weights once; effective GB/s
#: per GPU (half of an A100-80GB's 2 TB/s)
DEFAULT_DECODE_GBPS = 1000.0
#: the same two defaults for one fp32 CPU rank (--device cpu), measured here with SmolLM2-135M on one thread of
#: a 2-core x86 machine with AVX-512 under load (scripts/bench/bench_real_model.py: update 90 tokens/s = 6 x
#: 0.135e9 x 90 = 73 GFLOP/s; generation 23 tokens/s for 8 rows = 2.9 steps/s x 0.54 GB of weights = 1.5 GB/s)
DEFAULT_CPU_UPDATE_TFLOPS = 0.07
DEFAULT_CPU_DECODE_GBPS = 1.5


# ---- model shapes ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Architecture:
    """A Qwen2-style decoder: the numbers the parameter count and activations need."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int  # embedding rows (the padded vocabulary)
    tied: bool  # lm_head shares the embedding
    qkv_bias: bool = True  # Qwen2 has biases on q, k, v

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def layer_params(self) -> int:
        h, kv, bias = self.hidden, self.kv_dim, int(self.qkv_bias)
        attention = h * h + 2 * h * kv + h * h + bias * (h + 2 * kv)  # q, k, v, o (+ q/k/v biases)
        mlp = 3 * h * self.intermediate  # gate, up, down
        return attention + mlp + 2 * h  # + two RMSNorm weights

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def backbone_params(self) -> int:
        """Embedding, decoder layers and the final norm (the critic's body)."""
        return self.embedding_params() + self.layers * self.layer_params() + self.hidden

    def params(self) -> int:
        return self.backbone_params() + (0 if self.tied else self.embedding_params())

    def largest_layer_params(self) -> int:
        return max(self.embedding_params(), self.layer_params())

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module of a decoder layer, by the name LoRA targets it with."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_adapters(self, rank: int, targets: list[str]) -> tuple[int, list[str], list[str]]:
        """Rank-`rank` LoRA adapters (A: in x r, B: r x out) on every layer's linears that `targets` name (peft's
        matching: the name, or a dotted path ending in it): (parameters, the linears matched, the targets that
        match none of them)."""
        shapes = self.linear_shapes()
        matches = {t: [n for n in shapes if t == n or t.endswith("." + n)] for t in map(str, targets)}
        matched = [n for n in shapes if any(n in found for found in matches.values())]
        unmatched = [t for t, found in matches.items() if not found]
        return self.layers * rank * sum(sum(shapes[n]) for n in matched), matched, unmatched


#: the hub presets' models (their config.json): no network at plan time. model=smollm2-135m's package copy
#: (model.source=package) has the same shape as its hub id
HUB_ARCHITECTURES: dict[str, Architecture] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": Architecture(576, 1536, 30, 9, 3, 49152, tied=True, qkv_bias=False),
    "Qwen/Qwen2.5-0.5B-Instruct": Architecture(896, 4864, 24, 14, 2, 151936, tied=True),
    "Qwen/Qwen2.5-1.5B-Instruct": Architecture(1536, 8960, 28, 12, 2, 151936, tied=True),
    "Qwen/Qwen2.5-3B-Instruct": Architecture(2048, 11008, 36, 16, 2, 151936, tied=True),
    "Qwen/Qwen2.5-7B-Instruct": Architecture(3584, 18944, 28, 28, 4, 152064, tied=False),
}


def architecture(model: Any) -> tuple[Architecture, int]:
    """The model's shape and the number of logits the loss softmaxes over (the tokenizer's size), from the
    model config: the tiny model's sizes, a local directory's config.json, or the hub table above."""
    if not model.path:
        vocab = model.padded_vocab_size or model.vocab_size
        arch = Architecture(model.hidden_size, model.intermediate_size, model.num_hidden_layers,
                            model.num_attention_heads, model.num_key_value_heads, vocab,
                            bool(model.tie_word_embeddings))
        return arch, model.vocab_size
    folder = Path(str(model.path)).expanduser()
    if (folder / "config.json").is_file():
        try:
            arch = folder_architecture(folder)
        except (UserError, ValueError, KeyError, TypeError, AttributeError) as err:
            reason = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
            raise ConfigError(f"{folder / 'config.json'} is not a readable model config ({reason}); "
                              "fix the file or point model.path at the model's directory.") from None
        return arch, arch.vocab
    if model.path in HUB_ARCHITECTURES:
        arch = HUB_ARCHITECTURES[model.path]
        return arch, arch.vocab
    known = ", ".join(HUB_ARCHITECTURES)
    raise ConfigError(f"epo plan does not know the shape of model.path={model.path}: give a local directory "
                      f"that holds its config.json, or one of the hub models it knows ({known}).")


def folder_architecture(folder: Path) -> Architecture:
    """The shape a model folder's config.json gives, read as bounded data (a regular file; symlinks only inside
    the folder or its hub cache repository: epo_cli/rundir/received.py). ReceivedFileError (a UserError) where
    the file cannot be read, ValueError, KeyError, TypeError or AttributeError where it gives no shape."""
    return config_architecture(read_json(folder / "config.json", "model config", within=model_folder_root(folder)))


def config_architecture(hf: dict[str, Any]) -> Architecture:
    """The shape a model's config.json (`hf`, parsed) gives; ValueError, KeyError, TypeError or AttributeError
    where it gives none."""
    sizes = {key: _model_size(hf, key) for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "vocab_size")}
    sizes["num_key_value_heads"] = _model_size(hf, "num_key_value_heads", sizes["num_attention_heads"])
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if sizes["hidden_size"] % heads or heads % kv_heads:
        raise ValueError(f"hidden_size={sizes['hidden_size']} must be divisible by num_attention_heads="
                         f"{heads}, and that by num_key_value_heads={kv_heads}")
    return Architecture(sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"], heads,
                        kv_heads, sizes["vocab_size"], bool(hf.get("tie_word_embeddings", False)),
                        bool(hf.get("attention_bias", True)))


#: the largest size a model config.json may give (a hidden size, a layer or head count, a vocabulary)
MAX_MODEL_SIZE = 2**31 - 1


def _model_size(hf: dict[str, Any], key: str, default: Any = None) -> int:
    """config.json's `key` as a whole number from 1 to MAX_MODEL_SIZE (ValueError naming the key otherwise: 0
    heads would divide by zero, 1e999 is inf)."""
    value = hf.get(key, default) if default is not None else hf[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or not 1 <= value <= MAX_MODEL_SIZE:
        raise ValueError(f"{key}={value!r} is not a whole number from 1 to {MAX_MODEL_SIZE}")
    return int(value)


# ---- memory ------------------------------------------------------------------------------------------------

@dataclass
class States:
    """Model states of one engine on one rank (bytes), and the host memory offload needs per node."""

    weights: float
    grads: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


#: DeepSpeed's additional_buffer_factor: host memory for offloaded states is their size x this
HOST_BUFFER_FACTOR = 1.5


def model_states(params: int, stage: int, ranks: int, precision: str, offload_optimizer: bool = False,
                 offload_param: bool = False, nodes: int = 1) -> States:
    """Weights, gradients and Adam state of `params` parameters on one of `ranks` ranks.

    bf16 (DeepSpeed's accounting, per parameter): 2 bytes of 16-bit weights, 2 of 16-bit gradients, 4 of fp32
    gradients, 4 of fp32 master weights, 8 of Adam moments. ZeRO-2 partitions all but the weights:
    2P + 18P/N (estimate_zero2_model_states_mem_needs without offload); ZeRO-3 the weights too: 18P/N (its zero3
    estimate without the largest-layer term, which is `gathered layer` here); ZeRO-1 keeps the 16-bit gradients
    whole: 4P + 16P/N; ZeRO-0 holds all 20P. Offloaded optimizer: the device keeps the 16-bit weights (ZeRO-1/2)
    or their partition (ZeRO-3); the host P x max(4N, 16) x 1.5 (ZeRO-1/2) or 16P x 1.5 per node (ZeRO-3);
    offloaded parameters as well: nothing but the gathered layer on the device, 18P x 1.5 per node on the host.

    fp32 (CPU ranks): 4-byte weights and gradients, no separate gradient copy; ZeRO-1 and up partition the
    Adam moments (8) and DeepSpeed's fp32 master partition (4), ZeRO-2 also the gradients, ZeRO-3 also the
    weights: ZeRO-0 16P, ZeRO-1 8P + 12P/N, ZeRO-2 4P + 16P/N, ZeRO-3 20P/N.
    """
    P, N = float(params), float(ranks)
    per_node_factor = HOST_BUFFER_FACTOR / nodes  # host memory shared by a node's ranks
    if precision == "bf16":
        if stage == 0:
            return States(2 * P, 2 * P + 4 * P, 12 * P)
        if stage in (1, 2):
            if offload_optimizer:
                return States(2 * P, 0.0, 0.0, host=P * max(4 * N, 16) * HOST_BUFFER_FACTOR)
            grads = (2 * P if stage == 1 else 2 * P / N) + 4 * P / N
            return States(2 * P, grads, 12 * P / N)
        if offload_param and offload_optimizer:
            return States(0.0, 0.0, 0.0, host=18 * P * per_node_factor)
        if offload_optimizer:
            return States(2 * P / N, 0.0, 0.0, host=16 * P * per_node_factor)
        return States(2 * P / N, 4 * P / N, 12 * P / N)
    # fp32
    if stage == 0:
        return States(4 * P, 4 * P, 8 * P)
    weights = 4 * P / N if stage == 3 else 4 * P
    grads = 4 * P / N if stage >= 2 else 4 * P
    if offload_optimizer:  # the same host accounting as bf16 (DeepSpeed's 16-18 bytes x 1.5 per node)
        host = (18 if offload_param else 16) * P * per_node_factor
        return States(0.0 if offload_param else weights, 0.0, 0.0, host=host)
    return States(weights, grads, 12 * P / N)


def activation_bytes_per_token_layer(arch: Architecture, width: int) -> float:
    """Bytes one decoder layer saves for backward per token (HF Qwen2, fused attention: no seq x seq scores).
    Per token, in elements: two RMSNorms (input, normalised output, fp32 statistics: ~3h each), q after RoPE (h),
    k and v (kv_dim each) and their GQA repeats for attention (2h), the attention output (h), the o_proj input
    (h), and the SwiGLU MLP's gate, act(gate), up and their product (4 x intermediate)."""
    return width * (11 * arch.hidden + 2 * arch.kv_dim + 4 * arch.intermediate)


def policy_activations(arch: Architecture, softmax_vocab: int, micro: int, prompt: int, response: int, width: int,
                       checkpointing: bool) -> float:
    """One training micro-batch of the policy: decoder activations and the loss's logits.

    Without checkpointing every layer's activations stay alive until backward; with it, only each layer's input
    (hidden x width) plus one layer recomputed at a time. The logits are computed at the response tokens only
    (epo_cli/training/forward.py: logits_to_keep): the lm_head output (width bytes over the padded vocabulary)
    and the fp32 log-softmax, its exp and their product (3 x 4 bytes over the tokenizer's vocabulary), plus the
    fp32 copy of the logits the softmax reads (4 bytes)."""
    tokens = micro * (prompt + response)
    per_layer = activation_bytes_per_token_layer(arch, width)
    if checkpointing:
        decoder = tokens * (arch.layers * arch.hidden * width + per_layer)
    else:
        decoder = tokens * arch.layers * per_layer
    embeddings = tokens * arch.hidden * width
    logits = micro * response * (arch.vocab * width + 16 * softmax_vocab)
    return decoder + embeddings + logits


def critic_activations(arch: Architecture, micro: int, prompt: int, width: int, checkpointing: bool) -> float:
    """One training micro-batch of the critic: the backbone over the prompt tokens, no logits."""
    tokens = micro * prompt
    per_layer = activation_bytes_per_token_layer(arch, width)
    if checkpointing:
        return tokens * (arch.layers * arch.hidden * width + per_layer) + tokens * arch.hidden * width
    return tokens * arch.layers * per_layer + tokens * arch.hidden * width


def kv_cache_bytes(arch: Architecture, rows: int, prompt: int, response: int, width: int) -> float:
    """Keys and values of every layer for `rows` sequences of prompt + response tokens."""
    return rows * (prompt + response) * arch.layers * 2 * arch.kv_dim * width


# ---- the plan ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What the estimate depends on; a suggestion is a Setup with one field changed."""

    stage: int
    offload_optimizer: bool
    offload_param: bool
    checkpointing: bool
    micro: int
    gpus: int
    nodes: int = 1


@dataclass
class Estimate:
    """Per-rank bytes of each part, their peak, and the verdict against the GPU memory."""

    parts: dict[str, float]
    peak: float
    host_per_node: float
    fits: bool


@dataclass
class Plan:
    config_name: str
    model: str
    params: int
    critic_params: int
    precision: str
    gpus: int
    gpu_mem_gib: float
    prompt_tokens: int
    response_tokens: int
    setup: Setup
    estimate: Estimate
    suggestions: list[dict[str, Any]] = field(default_factory=list)
    tokens: dict[str, float] = field(default_factory=dict)
    time: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    device: str = "gpu"  # gpu | cpu (fp32 CPU ranks): what a "device" of the output is

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["estimate"]["parts_gib"] = {k: v / GIB for k, v in self.estimate.parts.items()}
        out["estimate"]["peak_gib"] = self.estimate.peak / GIB
        return out


class Planner:
    """The estimate for one composed config, re-evaluated for the single changes that might make it fit."""

    def __init__(self, cfg: DictConfig, gpu_mem_gib: float, device: str, prompt: int | None = None,
                 response: int | None = None) -> None:
        self.cfg = cfg
        self.arch, self.softmax_vocab = architecture(cfg.model)
        self.device = device
        chosen = str(cfg.deepspeed.precision)
        self.precision = ("bf16" if device == "gpu" else "fp32") if chosen == "auto" else chosen
        self.width = 2 if self.precision == "bf16" else 4
        self.gpu_mem = gpu_mem_gib * GIB
        self.reserve = GPU_RESERVE_GIB * GIB if device == "gpu" else 0.0
        self.prompt = int(prompt if prompt is not None else cfg.rollout.max_prompt_tokens)
        self.response = int(response if response is not None else cfg.rollout.max_new_tokens)
        algo = cfg.algo
        self.has_critic = algo.estimator == "gae"
        self.has_reference = "kl" in algo.loss_terms
        self.params = self.arch.params()
        # LoRA: the base weights are frozen (no gradients, no optimizer state), the adapters train; None where
        # model.lora.target_modules names a module the plan does not know (then counted as full fine-tuning)
        lora = cfg.model.lora
        adapters, _, unmatched = self.arch.lora_adapters(int(lora.rank), list(lora.target_modules))
        self.adapter_params = adapters if lora.rank > 0 and not unmatched else None
        self.critic_params = self.arch.backbone_params() + self.arch.hidden + 1 if self.has_critic else 0

    def estimate(self, s: Setup) -> Estimate:
        algo, rollout = self.cfg.algo, self.cfg.rollout
        trained = self.params if self.adapter_params is None else self.adapter_params
        policy = model_states(trained, s.stage, s.gpus, self.precision, s.offload_optimizer, s.offload_param,
                              s.nodes)
        # LoRA's frozen base: its weights only, at the working width (ZeRO-3 partitions them); offloaded with
        # the parameters, they live on the host instead, a node holding its ranks' partitions (with DeepSpeed's
        # buffer factor, as model_states counts the trained ones)
        frozen = 0.0 if self.adapter_params is None else self.width * self.params
        parts = {"policy weights": policy.weights + (0.0 if s.offload_param else
                                                     frozen / (s.gpus if s.stage == 3 else 1)),
                 "policy gradients": policy.grads, "policy optimizer": policy.optimizer}
        host = policy.host + (frozen * HOST_BUFFER_FACTOR / s.nodes if s.offload_param else 0.0)
        if self.has_critic:
            critic = model_states(self.critic_params, s.stage, s.gpus, self.precision, s.offload_optimizer,
                                  s.offload_param, s.nodes)
            parts["critic states"] = critic.total
            host += critic.host
        parts["ZeRO-3 gathered layer"] = 4.0 * self.arch.largest_layer_params() if s.stage == 3 else 0.0
        parts["ZeRO-3 inference copy"] = (self.width * (self.params + self.critic_params)) if s.stage == 3 else 0.0
        parts["reference model"] = self.width * self.params if self.has_reference else 0.0
        acts = policy_activations(self.arch, self.softmax_vocab, s.micro, self.prompt, self.response, self.width,
                                  s.checkpointing)
        if self.has_critic:
            acts = max(acts, critic_activations(self.arch, s.micro, self.prompt, self.width, s.checkpointing))
        rows = rollout.generation_batch_size or math.ceil(algo.tasks_per_step * algo.group_size / s.gpus)
        kv = kv_cache_bytes(self.arch, rows, self.prompt, self.response, self.width)
        parts["activations (1 micro-batch)"] = acts
        parts.update(engine_memory(rollout, self.width * self.params, kv, self.gpu_mem, self.device))
        kv = parts["rollout KV cache"]  # rollout.engine=vllm: its memory (rollout/engines/__init__.py)
        parts["reserve (CUDA, NCCL)"] = self.reserve
        persistent = sum(v for k, v in parts.items()
                         if k not in ("activations (1 micro-batch)", "rollout KV cache"))
        peak = persistent + max(acts, kv)
        return Estimate(parts, peak, host, peak <= self.gpu_mem)

    def model_states_bytes(self, s: Setup) -> float:
        """Weights, gradients and optimizer of policy and critic (what the CPU validation counts)."""
        e = self.estimate(s)
        return sum(e.parts[k] for k in ("policy weights", "policy gradients", "policy optimizer")) + \
            e.parts.get("critic states", 0.0)

    def changes(self, s: Setup) -> list[list[tuple[str, dict[str, Any]]]]:
        """The kinds of change, cheapest first (a higher ZeRO stage costs some communication; checkpointing ~1/3
        more compute; a smaller micro-batch, the same results more slowly; offload, PCIe traffic; more GPUs,
        money), each a list of (override, Setup fields) from its mildest value on."""
        mini = self.cfg.algo.mini_batch_size
        kinds: list[list[tuple[str, dict[str, Any]]]] = [
            [(f"deepspeed=zero{stage}", {"stage": stage}) for stage in range(s.stage + 1, 4)],
            [("model.gradient_checkpointing=true", {"checkpointing": True})] if not s.checkpointing else [],
            [(f"algo.micro_batch_size={m}", {"micro": m}) for m in (s.micro // 2**i for i in range(1, 12))
             if m >= 1 and mini % (m * s.gpus) == 0],
            [("deepspeed.offload_optimizer=true", {"offload_optimizer": True})]
            if s.stage >= 1 and not s.offload_optimizer else [],
            [("deepspeed=zero3_offload (parameters and optimizer on the host)",
              {"stage": 3, "offload_optimizer": True, "offload_param": True})] if not s.offload_param else [],
            [(f"--gpus {g} (launcher.num_gpus x launcher.num_nodes)", {"gpus": g})
             for g in (s.gpus * 2**i for i in range(1, 10))  # layouts `epo train` accepts (whole groups per rank)
             if self.cfg.algo.tasks_per_step % g == 0 and mini % (s.micro * g) == 0],
        ]
        return [k for k in kinds if k]

    def suggestions(self, s: Setup) -> list[dict[str, Any]]:
        """Single changes that make a non-fitting setup fit, cheapest kind first, each at its mildest value; when
        none does, the pairs of changes that do."""
        kinds = self.changes(s)
        found: list[dict[str, Any]] = []
        for kind in kinds:
            for label, fields_ in kind:
                est = self.estimate(replace(s, **fields_))
                if est.fits:
                    found.append({"change": label, "peak_gib": est.peak / GIB})
                    break
        if found:
            return found
        for i, first in enumerate(kinds):
            for second in kinds[i + 1:]:
                hit = next(((a, b, est) for a in first for b in second
                            if (est := self.estimate(replace(s, **{**a[1], **b[1]}))).fits), None)
                if hit is not None:
                    found.append({"change": f"{hit[0][0]} + {hit[1][0]}", "peak_gib": hit[2].peak / GIB})
        return found


def current_setup(cfg: DictConfig, gpus: int) -> Setup:
    ds = cfg.deepspeed
    return Setup(int(ds.zero_stage), bool(ds.offload_optimizer), bool(ds.offload_param),
                 bool(cfg.model.gradient_checkpointing or ds.activation_checkpointing), int(cfg.algo.micro_batch_size),
                 gpus, int(cfg.launcher.num_nodes))


def default_gpus(cfg: DictConfig) -> int:
    """The launcher's world size: launcher=local is one process; deepspeed/slurm run num_gpus per node (or, where
    num_gpus=0 means "this machine's GPUs", num_procs CPU ranks) on num_nodes nodes."""
    launcher = cfg.launcher
    if launcher.name == "local":
        return 1
    per_node = launcher.num_gpus or launcher.num_procs
    return int(per_node * launcher.num_nodes)


# ---- tokens and time ------------------------------------------------------------------------------------------

def read_throughput(path: str | None, arch_params: int, device: str = "gpu") -> tuple[dict[str, float], str]:
    """Per-GPU (per CPU rank) tokens/s (rollout = generated tokens, update = trained tokens) and where they come
    from: a scripts/gpu_check.py result file, scaled from the model it measured to this one (update ~ 1/params,
    decoding ~ 1/weight bytes), or the device's defaults (DEFAULT_UPDATE_TFLOPS / DEFAULT_DECODE_GBPS, on a CPU
    DEFAULT_CPU_*; the rollout rate 0 means: derived from the decode bandwidth in iteration_cost)."""
    if path is None:
        tflops = DEFAULT_UPDATE_TFLOPS if device == "gpu" else DEFAULT_CPU_UPDATE_TFLOPS
        update = tflops * 1e12 / (6 * arch_params)
        return {"update_tokens_per_s": update, "rollout_tokens_per_s": 0.0}, f"default ({device})"
    file = Path(path).expanduser()
    try:
        data = loads(read_text(file, "throughput"))  # bounded: epo_cli/rundir/received.py
        measured = {k: float(data[k]) for k in ("rollout_tokens_per_s", "update_tokens_per_s")}
    except FileNotFoundError:
        raise ConfigError(f"--throughput {path}: no such file. Write one with `python scripts/gpu_check.py "
                          f"--out {path}` on the GPU machine, or leave the option out for the defaults.") from None
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--throughput {path} is not a gpu_check result (needs numbers rollout_tokens_per_s "
                          f"and update_tokens_per_s; {type(err).__name__}: {err}). Rewrite it with "
                          "`python scripts/gpu_check.py --out FILE`.") from None
    if not all(math.isfinite(v) for v in measured.values()) or min(measured.values()) <= 0:
        raise ConfigError(f"--throughput {path}: tokens/s must be positive numbers, got {measured}.")
    source = f"measured ({file.name})"
    measured_model = data.get("model")
    measured_params = None
    # a name from the file is looked up among conf/model's own options only: "../algo/grpo" names no model
    if isinstance(measured_model, str) and measured_model in group_options("model"):
        model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                    OmegaConf.load(config_dir() / "model" / f"{measured_model}.yaml"))
        measured_params = architecture(model_cfg)[0].params()
    if measured_params:
        scale = measured_params / arch_params
        measured = {k: v * scale for k, v in measured.items()}
        source += f", scaled from {measured_model} ({measured_params / 1e9:.2f}B params) by {scale:.3g}"
    else:
        source += ", not scaled (the file names no model this tool knows)"
    return measured, source


def throughput_device(path: str | None) -> str | None:
    """The device type (cuda | cpu) a gpu_check result file was measured on; None without a readable one."""
    if path is None:
        return None
    try:
        device = loads(read_text(Path(path).expanduser(), "throughput")).get("device")
    except (OSError, ValueError, AttributeError):
        return None
    return str(device).split(":")[0] if device else None


def iteration_cost(planner: Planner, s: Setup, throughput: dict[str, float], rows_per_rank: int) -> tuple[dict, dict]:
    """Tokens of one iteration (every episode at max_turns) and the time they take on s.gpus GPUs."""
    cfg, algo = planner.cfg, planner.cfg.algo
    envs = algo.tasks_per_step * algo.group_size
    samples = envs * cfg.env.max_turns
    P, R = planner.prompt, planner.response
    tokens = {"episodes": envs, "max_turns": cfg.env.max_turns, "turn_samples": samples, "prefill_tokens": samples * P,
              "generated_tokens": samples * R, "update_tokens": samples * (P + R) * algo.ppo_epochs}
    recompute = 4 / 3 if s.checkpointing else 1.0  # a checkpointed layer runs its forward twice
    # forward-only passes cost a third of a training pass: the old policy's scoring (the first mini-batch's
    # is reused from the update when algo.reuse_scoring_forward), the reference, the critic's values
    reused = min(1.0, algo.mini_batch_size / max(samples, 1)) if algo.reuse_scoring_forward else 0.0
    forward_only = samples * (P + R) * ((1 - reused) + (1 if planner.has_reference else 0)) / 3
    critic = 0.0
    if planner.has_critic:
        critic = samples * P * (algo.ppo_epochs * recompute + 1 / 3)
    # a training pass is ~6 FLOPs per parameter and token: 2 forward, 2 for the activations' gradients, 2 for
    # the weights' gradients; LoRA's frozen base skips the last (the adapters' own are negligible)
    lora = 4 / 6 if planner.adapter_params is not None else 1.0
    train_equiv = tokens["update_tokens"] * (recompute - 1 + lora) + forward_only + critic
    update_tps = throughput["update_tokens_per_s"]
    rollout_tps = throughput["rollout_tokens_per_s"]
    if rollout_tps <= 0:  # default: decoding reads the weights once per step for all rows of the rank
        gbps = DEFAULT_DECODE_GBPS if planner.device == "gpu" else DEFAULT_CPU_DECODE_GBPS
        step_s = planner.width * planner.params / (gbps * 1e9)
        rollout_tps = rows_per_rank / step_s
    # generation: decoding at the rollout rate, the prompts' prefill as forward-only tokens at the update rate
    rollout_s = (tokens["generated_tokens"] / rollout_tps + tokens["prefill_tokens"] / 3 / update_tps) / s.gpus
    update_s = train_equiv / (update_tps * s.gpus)
    time = {"rollout_tokens_per_s_per_gpu": rollout_tps, "update_tokens_per_s_per_gpu": update_tps,
            "generation_s": rollout_s, "update_and_scoring_s": update_s, "iteration_s": rollout_s + update_s,
            "run_hours": (rollout_s + update_s) * cfg.trainer.total_steps / 3600}
    return tokens, time


def make_plan(cfg: DictConfig, gpus: int | None = None, gpu_mem_gib: float | None = None, device: str = "gpu",
              throughput_file: str | None = None, prompt: int | None = None, response: int | None = None) -> Plan:
    """The whole plan for a composed, validated config."""
    if device not in ("gpu", "cpu"):
        raise ConfigError(f"--device {device}: use gpu (bf16 where precision is auto) or cpu (fp32 CPU ranks).")
    gpus = default_gpus(cfg) if gpus is None else gpus
    if not 1 <= gpus <= MAX_GPUS:
        raise ConfigError(f"--gpus {gpus}: needs a whole number from 1 to {MAX_GPUS}.")
    gpu_mem_gib = DEFAULT_GPU_MEM_GIB if gpu_mem_gib is None else gpu_mem_gib
    if not (math.isfinite(gpu_mem_gib) and 0 < gpu_mem_gib <= MAX_GPU_MEM_GIB):
        raise ConfigError(f"--gpu-mem {gpu_mem_gib:g}: needs a number of GiB per GPU above 0 and at most "
                          f"{MAX_GPU_MEM_GIB:.0f}.")
    for flag, value in (("--prompt-tokens", prompt), ("--response-tokens", response)):
        if value is not None and not 1 <= value <= MAX_PLAN_TOKENS:
            raise ConfigError(f"{flag} {value}: needs a whole number of tokens from 1 to {MAX_PLAN_TOKENS}.")
    planner = Planner(cfg, gpu_mem_gib, device, prompt, response)
    setup = current_setup(cfg, gpus)
    estimate = planner.estimate(setup)
    plan = Plan(str(cfg.name), str(cfg.model.path or cfg.model.name), planner.params, planner.critic_params,
                planner.precision, gpus, gpu_mem_gib, planner.prompt, planner.response, setup, estimate,
                device=device)
    if not estimate.fits:
        plan.suggestions = planner.suggestions(setup)
        if not plan.suggestions:
            full = {k: estimate.parts[k] for k in ("ZeRO-3 inference copy", "reference model") if estimate.parts[k]}
            plan.notes.append("nothing here shrinks the full copies every rank holds (" +
                              ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in full.items()) +
                              f"): with the reserve they need {(sum(full.values()) + planner.reserve) / GIB:.1f} GiB "
                              "of each GPU. Use GPUs with more memory, or a run without the KL reference "
                              "(no `kl` in algo.loss_terms).")
    throughput, source = read_throughput(throughput_file, planner.params, device)
    measured_on = throughput_device(throughput_file)
    if measured_on is not None and (measured_on == "cuda") != (device == "gpu"):
        plan.notes.append(f"the throughput file was measured on {measured_on} and this plan is for {device} "
                          "ranks: its time estimate carries that device's speed (run scripts/gpu_check.py on the "
                          "machine you plan for).")
    rows = cfg.rollout.generation_batch_size or math.ceil(cfg.algo.tasks_per_step * cfg.algo.group_size / gpus)
    plan.tokens, plan.time = iteration_cost(planner, setup, throughput, rows)
    plan.time["throughput_source"] = source
    if cfg.algo.tasks_per_step % gpus:
        plan.notes.append(f"algo.tasks_per_step={cfg.algo.tasks_per_step} is not divisible by {gpus} ranks: "
                          "`epo train` refuses this layout.")
    if cfg.algo.mini_batch_size % (cfg.algo.micro_batch_size * gpus):
        plan.notes.append(f"algo.mini_batch_size={cfg.algo.mini_batch_size} is not divisible by micro_batch_size x "
                          f"ranks = {cfg.algo.micro_batch_size * gpus}: `epo train` refuses this layout.")
    if cfg.model.lora.rank > 0 and planner.adapter_params is None:
        plan.notes.append(f"LoRA on model.lora.target_modules={list(cfg.model.lora.target_modules)} is not "
                          "modelled (a module the plan does not know): the estimate is for full fine-tuning "
                          "(an upper bound).")
    elif cfg.model.lora.rank > 0:
        plan.notes.append(f"LoRA rank {cfg.model.lora.rank}: {planner.adapter_params / 1e6:.2f}M trained "
                          "parameters (gradients and Adam state); the base's weights frozen.")
    if cfg.model.autocast != "none":
        plan.notes.append(f"model.autocast={cfg.model.autocast} is not modelled: memory is counted for fp32 forwards "
                          "(an upper bound) and the time at the throughput's rates, fp32's unless the throughput "
                          "file was measured with autocast on (on this CPU it measured update 1.75x, generation "
                          "1.27x faster: docs/learning.md, \"A real model\").")
    if setup.stage == 0 and planner.precision == "bf16":
        plan.notes.append("ZeRO-0 in bf16 is counted unpartitioned (20 bytes/param); DeepSpeed's bf16 optimizer "
                          "partitions its fp32 state, so the real figure can be lower.")
    return plan


# ---- output ----------------------------------------------------------------------------------------------------

def _gib(value: float) -> str:
    return f"{value / GIB:,.2f}"


def render(plan: Plan) -> None:
    """The plan as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    s, e = plan.setup, plan.estimate
    unit = "GPU" if plan.device == "gpu" else "CPU rank"
    units = f"{plan.gpus} {unit}{'s' if plan.gpus != 1 else ''}"
    title = (f"epo plan: {plan.config_name} - {plan.model} ({plan.params / 1e9:.3g}B params"
             f"{f', critic {plan.critic_params / 1e9:.3g}B' if plan.critic_params else ''}), {plan.precision}, "
             f"ZeRO-{s.stage}{' +offload optimizer' if s.offload_optimizer else ''}"
             f"{' +offload params' if s.offload_param else ''}, micro-batch {s.micro}, "
             f"checkpointing {'on' if s.checkpointing else 'off'}, {units}, "
             f"prompt {plan.prompt_tokens} + response {plan.response_tokens} tokens")
    table = Table(title=title, title_justify="left")
    table.add_column("per rank")
    table.add_column("GiB", justify="right")
    for name, value in e.parts.items():
        table.add_row(name, _gib(value))
    table.add_row("[bold]peak[/] (persistent + max(activations, KV cache))", f"[bold]{_gib(e.peak)}[/]")
    if e.host_per_node:
        table.add_row("host memory per node (offload)", _gib(e.host_per_node))
    console.print(table)
    verdict = "[green]fits[/]" if e.fits else "[red]does not fit[/]"
    console.print(f"{units} x {plan.gpu_mem_gib:g} GiB: {verdict} "
                  f"({_gib(e.peak)} of {plan.gpu_mem_gib:g} GiB per {unit})")
    if not e.fits:
        if plan.suggestions:
            single = " + " not in plan.suggestions[0]["change"]
            fixes = Table(title=("single changes" if single else "no single change fits; pairs of changes") +
                          " that make it fit (cheapest first)", title_justify="left")
            fixes.add_column("change")
            fixes.add_column("peak GiB", justify="right")
            for i, sug in enumerate(plan.suggestions):
                fixes.add_row(("[bold]" if i == 0 else "") + sug["change"], f"{sug['peak_gib']:,.2f}")
            console.print(fixes)
        else:
            console.print("No single change or pair of changes makes it fit: shorten rollout.max_prompt_tokens / "
                          "max_new_tokens, or use GPUs with more memory.")
    t, tm = plan.tokens, plan.time
    cost = Table(title=f"one iteration (every episode at max_turns; throughput: {tm['throughput_source']})",
                 title_justify="left")
    cost.add_column("quantity")
    cost.add_column("value", justify="right")
    cost.add_row("episodes x max turns = turn-samples", f"{t['episodes']:,} x {t['max_turns']} = {t['turn_samples']:,}")
    cost.add_row("prefill / generated tokens", f"{t['prefill_tokens']:,} / {t['generated_tokens']:,}")
    cost.add_row("update tokens (x ppo_epochs)", f"{t['update_tokens']:,}")
    cost.add_row(f"tokens/s per {unit}: rollout / update",
                 f"{tm['rollout_tokens_per_s_per_gpu']:,.3g} / {tm['update_tokens_per_s_per_gpu']:,.3g}")
    cost.add_row("generation + update = iteration (s)",
                 f"{tm['generation_s']:,.0f} + {tm['update_and_scoring_s']:,.0f} = {tm['iteration_s']:,.0f}")
    cost.add_row("trainer.total_steps iterations (h), env time not included", f"{tm['run_hours']:,.1f}")
    console.print(cost)
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {note}")


def run_plan(cfg: DictConfig, gpus: int | None, gpu_mem: float | None, device: str, throughput: str | None,
             prompt: int | None, response: int | None, as_json: bool) -> Plan:
    """`epo plan`: estimate and print the plan of a composed, validated config (the caller composes it as `epo
    train` would: a resumed run's own config for trainer.resume=<run>)."""
    if cfg.trainer.resume and not as_json:
        print(f"planning the resumed run {cfg.run_dir} (its config.yaml, with this command's overrides on top)")
    plan = make_plan(cfg, gpus, gpu_mem, device, throughput, prompt, response)
    if as_json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
    else:
        render(plan)
    return plan
