"""Micro-batches and the forward passes shared by scoring (old policy) and training.

The old log-probs and entropies of a rollout come from `policy_forward`, the very function the update
uses, on the same layout (padded, or packed: see MicroBatch and packing.py), so the PPO ratio is 1 (to
rounding) before the first update, and exactly 1 where the update reuses its own forward (trainer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epo_cli.algos.losses import PolicyOutputs
from epo_cli.rollout.batch import MicroBatch, PackedLayout, TurnBatch
from epo_cli.rollout.generation import positions_from_mask
from epo_cli.runtime.precision import autocast
from epo_cli.training.packing import packed_forward


def plan_micro_batches(rows: list[int], lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """Split `rows` into micro-batches of similar length (less padding), at most micro_batch_size each."""
    ordered = sorted(rows, key=lambda r: lengths[r])
    return [ordered[i:i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def collate(batch: TurnBatch, rows: list[int], pad_id: int, device: torch.device,
            num_rows: int | None = None, packed: bool = False) -> MicroBatch:
    """The samples `rows` of `batch` as a MicroBatch; `num_rows` > len(rows) appends padding rows
    (no real tokens, zero weight) so that every rank runs the same number of passes.

    packed=False: prompts left-padded, responses right-padded ([B, P+R], see MicroBatch).
    packed=True: the samples end to end in one row (PackedLayout); the [B, R] response fields are the same.
    """
    num_rows = max(num_rows or len(rows), 1)
    prompts = [batch.prompt_ids[r] for r in rows]
    responses = [batch.response_ids[r] for r in rows]
    P = max([len(p) for p in prompts] + [1])
    R = max([len(r) for r in responses] + [1])
    response_ids = torch.full((num_rows, R), pad_id, dtype=torch.long)
    response_mask = torch.zeros((num_rows, R), dtype=torch.bool)
    for i, r in enumerate(responses):
        response_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, :len(r)] = True

    def token_field(values: list[torch.Tensor]) -> torch.Tensor | None:
        if not values:
            return None
        out = torch.zeros((num_rows, R), dtype=torch.float32)
        for i, r in enumerate(rows):
            if values[r] is not None:  # None: a row the update's first forward scores (scoring reuse)
                out[i, :len(values[r])] = values[r]
        return out.to(device)

    def row_field(values: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor | None:
        if values is None:
            return None
        out = torch.zeros((num_rows,), dtype=dtype)
        out[:len(rows)] = values[rows].to(dtype)
        return out.to(device)

    layout = None
    if packed:
        layout, input_ids, attention, position_ids = _packed_layout(prompts, responses, num_rows, pad_id, device)
        prompt_width = 0
    else:
        input_ids = torch.full((num_rows, P + R), pad_id, dtype=torch.long)
        attention = torch.zeros((num_rows, P + R), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            input_ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
            input_ids[i, P:P + len(r)] = response_ids[i, :len(r)]
            attention[i, P - len(p):P + len(r)] = 1
        for i in range(len(rows), num_rows):  # padding rows: one attended token so attention stays finite
            attention[i, P - 1] = 1
        position_ids = positions_from_mask(attention)
        prompt_width = P
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        position_ids=position_ids.to(device),
        response_mask=response_mask.to(device),
        prompt_width=prompt_width,
        response_ids=response_ids.to(device),
        turn_index=row_field(batch.turn_index, torch.long),
        num_turns=row_field(batch.num_turns, torch.long).clamp(min=1),
        old_logprobs=token_field(batch.old_logprobs),
        rollout_entropy=token_field(batch.entropy),
        ref_logprobs=token_field(batch.ref_logprobs),
        advantages=row_field(batch.advantages),
        returns=row_field(batch.returns),
        old_values=row_field(batch.old_values),
        num_real=len(rows),
        packed=layout,
    )


def _packed_layout(prompts: list[list[int]], responses: list[list[int]], num_rows: int, pad_id: int,
                   device: torch.device) -> tuple[PackedLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples end to end in one row; (layout, input_ids [1, L], attention [1, L], position_ids [1, L])."""
    ids: list[int] = []
    positions: list[int] = []
    bounds = [0]
    logits_index: list[int] = []
    value_index = [0] * num_rows
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = len(ids)
        ids += p + r
        positions += range(len(p) + len(r))
        # the logit at position j predicts token j + 1: response token k is predicted at start + |p| - 1 + k
        logits_index += range(start + len(p) - 1, start + len(p) - 1 + len(r))
        value_index[i] = start + len(p) - 1
        bounds.append(len(ids))
    attention = torch.ones((1, max(len(ids), 1)), dtype=torch.long)
    if not ids:  # a padding micro-batch: one token, attended by itself only, that no loss reads
        ids, positions, bounds = [pad_id], [0], [0, 1]
        attention.zero_()
    input_ids = torch.tensor([ids], dtype=torch.long)
    position_ids = torch.tensor([positions], dtype=torch.long)
    layout = PackedLayout(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        cu_seq_lens=torch.tensor(bounds, dtype=torch.int32, device=device),
        max_length=max(b - a for a, b in zip(bounds[:-1], bounds[1:])),
        logits_index=torch.tensor(logits_index, dtype=torch.long, device=device),
        value_index=torch.tensor(value_index, dtype=torch.long, device=device),
    )
    return layout, input_ids, attention, position_ids


def _model_inputs(mb: MicroBatch) -> dict[str, Any]:
    """Keyword arguments of the model's forward for this micro-batch's layout."""
    pk = mb.packed
    if pk is None:
        return dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
    # attention_mask=None: the samples are kept apart by cu_seq_lens (varlen attention), see packing.py
    return dict(input_ids=pk.input_ids, attention_mask=None, position_ids=pk.position_ids,
                cu_seq_lens_q=pk.cu_seq_lens, cu_seq_lens_k=pk.cu_seq_lens,
                max_length_q=pk.max_length, max_length_k=pk.max_length)


def policy_forward(model: nn.Module, mb: MicroBatch, temperature: float = 1.0,
                   vocab_limit: int | None = None, with_entropy: bool = True,
                   autocast_to: torch.dtype | None = None) -> PolicyOutputs:
    """Log-probs [B, R] of the response tokens and the entropy [B, R] of the full next-token
    distribution, both at the sampling temperature (padded or packed micro-batch, same outputs). The model's
    forward runs under autocast to `autocast_to` (model.autocast, epo_cli/runtime/precision.py); the softmax
    and what follows it in fp32."""
    mask = mb.response_mask  # [B, R]
    if mb.packed is None:
        R = mask.shape[1]
        with autocast(autocast_to, mb.input_ids.device):
            out = model(**_model_inputs(mb), use_cache=False, logits_to_keep=R + 1)
        logits = out.logits[:, :-1]  # [B, R, V]: column P-1+r predicts response token r
        targets = mb.response_ids  # [B, R]
    else:
        with packed_forward(), autocast(autocast_to, mb.input_ids.device):
            out = model(**_model_inputs(mb), use_cache=False, logits_to_keep=mb.packed.logits_index)
        logits = out.logits[0]  # [M, V]: the response tokens of all samples, in order
        targets = mb.response_ids[mask]  # [M]
    if vocab_limit is not None:
        logits = logits[..., :vocab_limit]
    logp_all = torch.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)  # [B, R, V] | [M, V]
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, R] | [M]
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logprobs)  # same
    if mb.packed is not None:  # back to the [B, R] layout the loss terms use (row-major = sample order)
        logprobs = logprobs.new_zeros(mask.shape).masked_scatter(mask, logprobs)  # [B, R]
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)  # [B, R]
    return PolicyOutputs(logprobs=logprobs * mask, entropy=entropy * mask)


def value_forward(critic: nn.Module, mb: MicroBatch, autocast_to: torch.dtype | None = None) -> torch.Tensor:
    """Critic values [B] at each row's last prompt token (the turn's state); the forward under autocast to
    `autocast_to` (model.autocast)."""
    if mb.packed is None:
        P = mb.prompt_width
        with autocast(autocast_to, mb.input_ids.device):
            return critic(mb.input_ids[:, :P], mb.attention_mask[:, :P], mb.position_ids[:, :P])
    inputs = _model_inputs(mb)
    with packed_forward(), autocast(autocast_to, mb.input_ids.device):
        return critic(inputs.pop("input_ids"), inputs.pop("attention_mask"), inputs.pop("position_ids"),
                      value_index=mb.packed.value_index, **inputs)
