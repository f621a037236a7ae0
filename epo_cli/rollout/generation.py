"""Batched sampling with a KV cache: one call generates a turn's response for every active env.

Why not `model.generate`: each row samples from its own seeded torch.Generator, so a trajectory's
tokens do not depend on which other envs share its batch or rank. A run then gives the same rollouts on
1 or N ranks and after a resume. Rows that reach the stop string or EOS leave the batch (their KV cache
rows are dropped), so long-tailed turns do not cost the whole batch.

Shared prefill: rows with identical prompts (a GRPO group's turn 0: same task, same first observation)
run the prompt through the model once; its KV cache rows are then copied to every row that shares it
(`Cache.batch_select_indices` with repeated indices). Rows are independent in a batch, so this gives the
same tokens as prefilling every row, for less compute.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from epo_cli.errors import UserError


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    stop: str = "</action>"


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x names the KV cache argument `cache`; 4.x `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _output_cache(out) -> object:
    """The KV cache of a forward output (`cache` in transformers 5.x, `past_key_values` in 4.x)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] token ids left-padded with pad_id, and the attention mask (1 on real tokens)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only, so left padding does not shift positions."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _refuse_nonfinite(ok: torch.Tensor) -> None:
    """One message instead of torch.multinomial's traceback when the policy's outputs are nan/inf."""
    if not bool(ok.all()):
        raise UserError("The policy's outputs (logits) hold nan or inf, so no token can be sampled: its weights "
                        "are non-finite (e.g. a model exported by a run that diverged). Use an earlier "
                        "checkpoint or another model.")


def sample_next(logits: torch.Tensor, params: SamplingConfig,
                generators: list[torch.Generator] | None) -> torch.Tensor:
    """One token per row from logits [B, V] (float32) -> [B] long."""
    if params.temperature <= 0:
        _refuse_nonfinite(~torch.isnan(logits))
        return logits.argmax(-1)
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) > params.top_p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    _refuse_nonfinite(torch.isfinite(probs))  # nan or +inf logits (top-k/top-p's -inf ones give 0)
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingConfig,
    tokenizer,
    seeds: list[int] | None = None,
    vocab_limit: int | None = None,
    shared_prefill: bool = True,
    logprobs: list[list[float]] | None = None,
) -> list[list[int]]:
    """Sample a response for each prompt; returns the response token ids (stop string / EOS included).

    seeds: one per prompt; row i samples with torch.Generator seeded by seeds[i] (None: global RNG).
    vocab_limit: sample only among the first `vocab_limit` ids (embedding rows the tokenizer never
    produces); the scoring forward applies the same limit.
    shared_prefill: prefill each distinct prompt once (module docstring).
    logprobs: if given (an empty list), filled with each response token's log-probability under the
    sampling temperature (before top-k/top-p), row by row: a diagnostic; training scores its own.
    """
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    eos_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    cache_kw = _cache_kwarg(model)

    distinct, row_of = _distinct_prompts(prompts) if shared_prefill else (prompts, None)
    ids, mask = left_pad(distinct, pad_id, device)  # [U, P]
    position = positions_from_mask(mask)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
    cache = _output_cache(out)
    logits = out.logits[:, -1].float()  # [U, V]
    if row_of is not None:  # copy each distinct prompt's cache (and its next-token logits) to its rows
        index = torch.tensor(row_of, device=device)  # [B] -> row in the distinct batch
        cache.batch_select_indices(index)
        mask, position, logits = mask[index], position[index], logits[index]
    next_position = position[:, -1] + 1  # [B]
    generators = None
    if seeds is not None:
        generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    responses: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # original index of each live batch row
    if logprobs is not None:
        logprobs[:] = [[] for _ in prompts]
    for _ in range(params.max_new_tokens):
        if vocab_limit is not None:
            logits = logits[:, :vocab_limit]
        tokens = sample_next(logits, params, generators)
        if logprobs is not None:
            scaled = logits / params.temperature if params.temperature > 0 else logits
            picked = scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0].tolist()
            for row, value in zip(rows, picked):
                logprobs[row].append(value)
        keep: list[int] = []
        for b, (row, token) in enumerate(zip(rows, tokens.tolist())):
            responses[row].append(token)
            tail = tokenizer.decode(responses[row][-8:]) if params.stop else ""
            if token not in eos_ids and not (params.stop and params.stop in tail):
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows leave the batch, with their cache rows
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, tokens, next_position = mask[index], tokens[index], next_position[index]
            rows = [rows[b] for b in keep]
            if generators is not None:
                generators = [generators[b] for b in keep]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                    use_cache=True, **{cache_kw: cache})
        cache = _output_cache(out)
        next_position = next_position + 1
        logits = out.logits[:, -1].float()
    return responses


def _distinct_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int] | None]:
    """The distinct prompts (first-seen order) and, per row, the index of its prompt among them; None for
    the index when every prompt is distinct (nothing to share)."""
    first: dict[tuple[int, ...], int] = {}
    row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts):
        return prompts, None
    return [list(p) for p in first], row_of
