"""Packed micro-batches: several turn-samples laid end to end in one row, no padding.

A padded micro-batch (forward.collate) costs rows x longest sample; a packed one costs the sum of the
samples' lengths. Layout of one packed micro-batch (a single row, as flash-attention's varlen kernels and
transformers' DataCollatorWithFlattening use):

    [prompt_0 response_0 | prompt_1 response_1 | ... ]       position ids restart at 0 for every sample
     ^cu[0]               ^cu[1]                 ^cu[S]=L   cu = cumulative sample lengths (int32)

Attention must not cross samples. The attention functions that honour `cu_seq_lens_q/k` do that:
  - `flash_attention_2` / `flash_attention_3` (transformers' varlen path, GPU);
  - `epo_packed_sdpa`, registered here: torch SDPA run causally per sample (exact, and it costs
    sum_s len_s^2 instead of the L^2 of a block-diagonal dense mask, which made a 16-sample row 3-4x slower
    than padding on a CPU). Without `cu_seq_lens` it is plain `sdpa` (generation, padded batches).
The logits are only computed at the positions that predict response tokens (`logits_index`, in sample
order), and the policy's log-probs/entropies are scattered back into the [B, R] layout of MicroBatch, so the
loss terms and their aggregation weights are exactly those of the padded path.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from epo_cli.errors import ConfigError

#: the attention implementation epo registers (SDPA, per packed sample)
PACKED_SDPA = "epo_packed_sdpa"
#: implementations whose attention follows cu_seq_lens (packing is exact with them)
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", PACKED_SDPA)
#: implementations epo can switch to PACKED_SDPA without changing what they compute
SDPA_LIKE = ("sdpa",)

# set while a packed forward runs: the mask builder then skips the [L, L] mask the attention ignores
_IN_PACKED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("epo_packed_forward", default=False)


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    token = _IN_PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_PACKED_FORWARD.reset(token)


def _packed_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None = None,
                 cu_seq_lens_k: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, L, D], key/value [1, H_kv, L, D] -> ([1, L, H, D], None): causal SDPA within each
    sample [cu[s], cu[s+1]); plain SDPA when no cu_seq_lens are given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or kwargs.get("sliding_window") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got a batch of {query.shape[0]}")
    kwargs.pop("is_causal", None)
    bounds = cu_seq_lens_q.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        out, _ = sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end],
                                        value[:, :, start:end], None, is_causal=True, **kwargs)
        outs.append(out)  # [1, len_s, H, D]
    return torch.cat(outs, dim=1), None


def _packed_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    if _IN_PACKED_FORWARD.get():
        return None  # the attention splits by cu_seq_lens; an [L, L] block mask would only cost memory
    return sdpa_mask(*args, **kwargs)


def register_packed_attention() -> None:
    """Register `epo_packed_sdpa` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, _packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)


def _attn_implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def enable_packing(model: nn.Module, pack_tokens: int | None) -> bool:
    """Prepare `model` for packed micro-batches; returns whether the update and scoring pack.

    pack_tokens: None = pack when the model's attention supports it (sdpa is switched to epo_packed_sdpa,
    which computes the same thing), 0 = never, > 0 = pack (a ConfigError if the attention cannot).
    """
    if pack_tokens == 0:
        return False
    impl = _attn_implementation(model)
    if impl in SDPA_LIKE:
        register_packed_attention()
        model.config._attn_implementation = PACKED_SDPA
        impl = PACKED_SDPA
    if impl in VARLEN_IMPLEMENTATIONS:
        return True
    if pack_tokens is None:
        return False
    raise ConfigError(
        f"algo.pack_tokens={pack_tokens} packs samples into one row, which needs an attention that keeps them "
        f"apart (model.attn_implementation: {', '.join(('sdpa', 'flash_attention_2', 'flash_attention_3'))}); "
        f"this model uses '{impl}'. Set model.attn_implementation=sdpa, or algo.pack_tokens=0 for padded "
        "micro-batches."
    )


def plan_packs(rows: list[int], lengths: list[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: `rows` into packs of at most `token_budget` tokens (a longer sample gets a pack
    of its own). Deterministic: ties are broken by row id. Each pack is in ascending row order."""
    packs: list[list[int]] = []
    room: list[int] = []
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        for i, free in enumerate(room):
            if lengths[r] <= free:
                packs[i].append(r)
                room[i] -= lengths[r]
                break
        else:
            packs.append([r])
            room.append(token_budget - lengths[r])
    return [sorted(p) for p in packs]


def default_budget(lengths: list[int], micro_batch_size: int) -> int:
    """pack_tokens=null: micro_batch_size x the longest sample, the size of the padded layout's largest
    micro-batch, so a packed micro-batch never needs more memory than a padded one would."""
    return micro_batch_size * max(lengths + [1])
