"""Load the policy, its tokenizer, the frozen reference and the critic from config.

Real models load from a hub id or a local folder through AutoTokenizer / AutoModelForCausalLM
(trust_remote_code off unless `model.trust_remote_code=true` on this invocation's command line: a run
directory's saved config cannot turn it on, see epo_cli/rundir/folder.py); weights load from safetensors, or
from PyTorch files with the restricted unpickler only (weights_only=True). A local folder is checked first
(epo_cli/rundir/saved_state.check_model_folder: no auto_map without that flag, readable config and tokenizer
files, whole safetensors files whose embedding fits config.json), and what transformers still cannot read
in it is one message naming the folder. `model=tiny` builds a small local model first
(epo_cli/models/tiny.py) and then loads it through the very same path.
"""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from epo_cli.envs.base import EnvSuite
from epo_cli.errors import UserError
from epo_cli.models.packaged import packaged_folder, resolve_source
from epo_cli.models.tiny import build_tiny, cache_root
from epo_cli.rundir.received import model_folder_root, read_json
from epo_cli.rundir.safe_load import refused_message, restricted_torch_load
from epo_cli.rundir.saved_state import COPY_AGAIN, check_model_folder
from epo_cli.rundir.writable import check_output_dir


def resolve_dtype(model_cfg: Any, device: torch.device) -> torch.dtype:
    if model_cfg.dtype == "bf16":
        return torch.bfloat16
    if model_cfg.dtype == "fp32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or Path(path).exists() or path.count("/") != 1


def model_source(model_cfg: Any, suite: EnvSuite, seed: int) -> str:
    """The folder or hub id the policy loads from (building the tiny model, or a packaged model's folder, if
    needed)."""
    source = getattr(model_cfg, "source", "hub")
    if source == "package" and not (getattr(model_cfg, "package", None) and getattr(model_cfg, "package_file", None)):
        raise UserError("model.source=package needs model.package (a PyPI package) and model.package_file (the GGUF "
                        "file inside it), as conf/model/smollm2-135m.yaml sets them; or use model.source=hub.")
    if source != "hub" and getattr(model_cfg, "package", None):
        if resolve_source(model_cfg) == "package":  # a run resolved `auto` when it was composed (launch/setup.py)
            check_output_dir(cache_root(model_cfg), "model.cache_dir (or $EPO_CACHE)")
            return str(packaged_folder(model_cfg, cache_root(model_cfg)))
    if model_cfg.path:
        path = str(model_cfg.path)
        if _looks_local(path):
            local = Path(path).expanduser()
            if not local.is_dir():
                raise UserError(
                    f"Model path '{path}' does not exist (model.path). Pass the folder of a saved model "
                    "(e.g. <run>/final from a finished run) or a hub id such as Qwen/Qwen2.5-3B-Instruct."
                )
            if not (local / "config.json").exists():
                raise UserError(
                    f"Model path '{path}' is not a Hugging Face model folder (no config.json). Pass the "
                    "folder written by save_pretrained, e.g. <run>/final."
                )
            return str(local)
        return path
    check_output_dir(cache_root(model_cfg), "model.cache_dir (or $EPO_CACHE)")  # the tiny model is built there
    return str(build_tiny(model_cfg, suite, seed=0))


def load_tokenizer(source: str, model_cfg: Any):
    from transformers import AutoTokenizer

    local = Path(source).is_dir()
    if local:
        check_model_folder(Path(source), model_cfg.trust_remote_code, weights=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
    except OSError as err:
        raise UserError(_hub_message(source, err)) from None
    except Exception as err:  # noqa: BLE001 - a local folder's files are data: any failure to read them is theirs
        if not (local or _known_refusal(err)):
            raise
        raise UserError(_unloadable_message(source, err) if _known_refusal(err) else
                        f"The tokenizer files in '{source}' cannot be read: {type(err).__name__}: "
                        f"{_first_line(err)}. Nothing was loaded; copy the folder again from where it came from, "
                        "or pass another model.") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(source: str, model_cfg: Any, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    local = Path(source).is_dir()
    if local:
        check_model_folder(Path(source), model_cfg.trust_remote_code)
        check_model_config(Path(source))
    try:
        with restricted_torch_load():  # a pytorch_model.bin that needs full unpickling: epo's message, naming it
            model, loading = AutoModelForCausalLM.from_pretrained(
                source,
                dtype=dtype,
                trust_remote_code=model_cfg.trust_remote_code,
                attn_implementation=model_cfg.attn_implementation,
                weights_only=True,  # a pytorch_model.bin from elsewhere is never fully unpickled
                output_loading_info=True,  # the weights' names against the model's own (weight_name_problem)
            )
    except OSError as err:
        raise UserError(_hub_message(source, err)) from None
    except pickle.UnpicklingError as err:  # the restricted unpickler refused a weights file
        raise UserError(refused_message(Path(source), err)) from None
    except ImportError as err:  # an attention implementation whose package is missing (see epo_cli/models/attention.py)
        raise UserError(f"model.attn_implementation={model_cfg.attn_implementation} cannot be used here: "
                        f"{str(err).splitlines()[0]} Use model.attn_implementation=sdpa (the default).") from None
    except (ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError) as err:
        if "safetensors" in str(err).lower() or "header" in str(err).lower() or "size mismatch" in str(err):
            raise UserError(f"The model files in '{source}' are corrupt or incomplete: {_first_line(err)}") from None
        if "ignore_mismatched_sizes" in str(err):  # config.json's shapes are not the weights' (the report above)
            raise UserError(f"'{Path(source) / 'config.json'}' does not describe the weights in '{source}': some "
                            "tensors have other shapes than it gives (listed above). Nothing was loaded; copy the "
                            "folder again from where it came from, or pass another model.") from None
        if _known_refusal(err):
            raise UserError(_unloadable_message(source, err)) from None
        if not local:
            raise
        # a local folder's files are data: whatever they make transformers raise is theirs, one message
        raise UserError(f"The model folder '{source}' cannot be loaded: {type(err).__name__}: {_first_line(err)} "
                        "(its config.json or weights are damaged or do not fit each other). Nothing was loaded; "
                        f"{COPY_AGAIN}.") from None
    except Exception as err:  # noqa: BLE001 - safetensors' SafetensorError (a header that lies) has no public base
        if type(err).__name__ != "SafetensorError":
            raise
        raise UserError(f"The model files in '{source}' are corrupt or incomplete: {_first_line(err)}. Nothing "
                        f"was loaded; {COPY_AGAIN}.") from None
    problem = weight_name_problem(model, loading)
    if problem:  # e.g. a renamed embedding: the model would start from random weights there, without a word
        raise UserError(f"The weights in '{source}' do not hold this model's tensors: {problem}. Nothing was "
                        "trained or evaluated; the folder's weights belong to another model or were damaged. "
                        f"{COPY_AGAIN[0].upper()}{COPY_AGAIN[1:]}.")
    bad = nonfinite_parameters(model)
    if bad:  # e.g. the export of a run that diverged: refused before anything samples from it
        raise UserError(f"The model in '{source}' holds non-finite weights (nan or inf, e.g. in {', '.join(bad)}): "
                        "it cannot be sampled from or trained. It was probably exported by a run that diverged; "
                        "use an earlier checkpoint of that run (checkpoint=step_N) or another model.")
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def check_model_config(folder: Path) -> None:
    """What of a local folder's config.json only transformers knows, checked before it builds the model: the
    activation (`hidden_act`) one of its own, the RoPE scaling (`rope_scaling`) of a type it has. One
    UserError naming the file (an unknown name is a KeyError deep inside the model's constructor)."""
    from transformers.activations import ACT2FN


    path = folder / "config.json"
    config = read_json(path, "model config", within=model_folder_root(folder))
    problem = None
    for key in ("hidden_act", "hidden_activation"):
        if isinstance(config.get(key), str) and config[key] not in ACT2FN:
            problem = f"names the activation {key}={config[key]!r}, which transformers does not have (it has e.g. " \
                      f"{', '.join(sorted(ACT2FN)[:6])})"
    scaling = config.get("rope_scaling")
    if problem is None and isinstance(scaling, dict):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (*ROPE_INIT_FUNCTIONS, "default"):
            problem = f"gives rope_scaling of type {kind!r}, which transformers does not have (it has " \
                      f"{', '.join(['default', *sorted(ROPE_INIT_FUNCTIONS)])})"
        elif kind != "default" and not (isinstance(scaling.get("factor"), (int, float))
                                        and not isinstance(scaling.get("factor"), bool) and scaling["factor"] > 0):
            problem = f"gives rope_scaling of type {kind!r} without a factor > 0 (it has {scaling.get('factor')!r})"
    if problem is not None:
        raise UserError(f"'{path}' {problem}. Nothing was loaded from the model folder '{folder}' or written; "
                        f"{COPY_AGAIN}.")


def weight_name_problem(model: nn.Module, loading: dict[str, Any]) -> str | None:
    """The weights' names against the model's own (transformers' loading info): what is missing (the model
    would keep random values there) or unexpected (weights of another model), naming a few of each; None when
    they fit. Excepted by the model's own rules, not by a list of names: a weight the model ties to another
    that the file holds (its tied-weights map, e.g. lm_head.weight to the embedding), and the names its class
    says to ignore when missing or unexpected (_keys_to_ignore_on_load_*). Buffers that are not persistent
    are not weights of the file at all (not in the state dict), so they are never missing."""
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers 5: what this model's config ties
    if tied is None:  # transformers 4: the class's list of names, tied only when the config ties embeddings
        names = getattr(model, "_tied_weights_keys", None) or []
        tied = {name: None for name in names} if getattr(model.config, "tie_word_embeddings", False) else {}

    def ignored(name: str, attribute: str) -> bool:
        return any(re.search(pattern, name) for pattern in getattr(model, attribute, None) or [])

    missing_all = set(loading.get("missing_keys") or [])
    missing = sorted(k for k in missing_all if not ignored(k, "_keys_to_ignore_on_load_missing")
                     and not (k in tied and (tied[k] is None or tied[k] not in missing_all)))
    unexpected = sorted(k for k in set(loading.get("unexpected_keys") or [])
                        if not ignored(k, "_keys_to_ignore_on_load_unexpected"))
    parts = []
    if missing:
        parts.append(f"{len(missing)} of its weights are missing ({', '.join(missing[:4])}"
                     f"{', ...' if len(missing) > 4 else ''})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensors are not weights of it ({', '.join(unexpected[:4])}"
                     f"{', ...' if len(unexpected) > 4 else ''})")
    return "; ".join(parts) or None


def nonfinite_parameters(module: nn.Module, limit: int = 3) -> list[str]:
    """Names of (at most `limit`) parameters holding nan or inf, found in one pass and one device sync.
    ZeRO-3 keeps each rank's share of a parameter in `ds_tensor` (the parameter is a placeholder there)."""
    tensors = []
    for name, p in module.named_parameters():
        shard = getattr(p, "ds_tensor", None)
        tensors.append((name, (p if shard is None else shard).detach()))
    if not tensors:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in tensors]).cpu().tolist()
    return [name for (name, _), ok in zip(tensors, finite) if not ok][:limit]


#: what transformers says when a folder's config names code (auto_map) or an architecture it does not know
_CUSTOM_CODE = ("trust_remote_code", "custom code")
_UNKNOWN_ARCHITECTURE = ("does not recognize this architecture", "Unrecognized configuration class",
                         "Unrecognized model", "model_type")


def _known_refusal(err: Exception) -> bool:
    """transformers refusing a folder (its code, its architecture); other errors are bugs and keep their traceback."""
    return any(s in str(err) for s in _CUSTOM_CODE + _UNKNOWN_ARCHITECTURE)


def _unloadable_message(source: str, err: Exception) -> str:
    text = str(err)
    if any(s in text for s in _CUSTOM_CODE):
        return (f"'{source}' holds its own model code (auto_map in its config.json), which must run to load it; "
                "epo runs a model folder's code only when this command line says model.trust_remote_code=true "
                "(a saved config cannot). Pass it if you trust that code, or use another model.")
    return (f"'{source}' is not a model transformers can load: {text.splitlines()[0]} Pass a folder written "
            "by save_pretrained of a supported architecture (e.g. <run>/final), or a hub id.")


def _first_line(err: Exception) -> str:
    return (str(err).splitlines() or [""])[0][:300]


def check_context(model: nn.Module, max_prompt_tokens: int, max_new_tokens: int, source: str) -> None:
    """A prompt (rollout.max_prompt_tokens) and its response (rollout.max_new_tokens) must fit the model's
    positions (config.max_position_embeddings), checked when the model is known, before it runs."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    need = max_prompt_tokens + max_new_tokens
    if isinstance(limit, int) and limit < need:
        raise UserError(f"The model in '{source}' holds {limit} positions (max_position_embeddings), fewer than "
                        f"rollout.max_prompt_tokens + rollout.max_new_tokens = {need}. Lower them (e.g. "
                        f"rollout.max_prompt_tokens={max(1, limit - max_new_tokens)}).")


def _hub_message(source: str, err: Exception) -> str:
    return (
        f"Could not load the model or tokenizer '{source}': {str(err).splitlines()[0]}\n"
        "Without network access, download the model on a machine that has it (huggingface-cli download "
        f"{source} --local-dir DIR), copy DIR here and pass model.path=DIR; or use model=tiny."
    )


def apply_lora(model: nn.Module, lora_cfg: Any) -> nn.Module:
    """Wrap the policy with LoRA adapters (peft) when model.lora.rank > 0."""
    if lora_cfg.rank <= 0:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("model.lora.rank > 0 needs peft: pip install 'epo[lora]' (or pip install peft).") from None
    config = LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:  # peft: a target name that matches no module of this model
        if "not found in the base model" not in str(err) and "Target modules" not in str(err):
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(f"model.lora.target_modules={list(lora_cfg.target_modules)} matches no module of this model. "
                        f"Its linear layers are named: {', '.join(linear)}. Fix: "
                        f"model.lora.target_modules=[{','.join(linear[:4])}] (or some of them).") from None


class ValueModel(nn.Module):
    """Critic for PPO: the policy's architecture with a scalar head on the last hidden state.

    The value of a turn-sample is read at its last prompt token: it estimates the return from the state
    (the prompt) before the turn's response is generated.
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        self.backbone = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        hidden = causal_lm.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)  # start from V = 0: no initial bias in the advantages
        nn.init.zeros_(self.head.bias)
        self.config = causal_lm.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, value_index: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        # input_ids/attention_mask/position_ids: [B, P] (left-padded prompts) -> values [B]
        # packed (epo_cli/training/packing.py): [1, L] and value_index [B], the states' positions in the row;
        # kwargs: the packed layout's cu_seq_lens for the attention
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, **kwargs).last_hidden_state
        state = hidden[:, -1] if value_index is None else hidden[0, value_index]  # [B, H]
        return self.head(state.to(self.head.weight.dtype)).squeeze(-1).float()


def frozen_copy(model: nn.Module) -> nn.Module:
    """An independent, frozen, eval-mode copy (the KL reference policy)."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
