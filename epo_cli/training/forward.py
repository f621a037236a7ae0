"""Micro-batches and the forward passes shared by scoring (old policy) and training.

The old log-probs and entropies of a rollout come from `policy_forward`, the very function the update
uses, on the same padded layout (see MicroBatch), so the PPO ratio is exactly 1 before the first update.
"""

from __future__ import annotations

import torch
from torch import nn

from epo_cli.algos.losses import PolicyOutputs
from epo_cli.rollout.batch import MicroBatch, TurnBatch
from epo_cli.rollout.generation import positions_from_mask


def plan_micro_batches(rows: list[int], lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """Split `rows` into micro-batches of similar length (less padding), at most micro_batch_size each."""
    ordered = sorted(rows, key=lambda r: lengths[r])
    return [ordered[i:i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def collate(batch: TurnBatch, rows: list[int], pad_id: int, device: torch.device,
            num_rows: int | None = None) -> MicroBatch:
    """Pad the samples `rows` of `batch` into a MicroBatch; `num_rows` > len(rows) appends padding rows
    (no real tokens, zero weight) so that every rank runs the same number of passes."""
    num_rows = max(num_rows or len(rows), 1)
    prompts = [batch.prompt_ids[r] for r in rows]
    responses = [batch.response_ids[r] for r in rows]
    P = max([len(p) for p in prompts] + [1])
    R = max([len(r) for r in responses] + [1])
    input_ids = torch.full((num_rows, P + R), pad_id, dtype=torch.long)
    attention = torch.zeros((num_rows, P + R), dtype=torch.long)
    response_mask = torch.zeros((num_rows, R), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[i, P - len(p):P + len(r)] = 1
        response_mask[i, :len(r)] = True
    for i in range(len(rows), num_rows):  # padding rows: one attended token so attention stays finite
        attention[i, P - 1] = 1

    def token_field(values: list[torch.Tensor]) -> torch.Tensor | None:
        if not values:
            return None
        out = torch.zeros((num_rows, R), dtype=torch.float32)
        for i, r in enumerate(rows):
            out[i, :len(values[r])] = values[r]
        return out.to(device)

    def row_field(values: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor | None:
        if values is None:
            return None
        out = torch.zeros((num_rows,), dtype=dtype)
        out[:len(rows)] = values[rows].to(dtype)
        return out.to(device)

    idx = torch.tensor(rows, dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        position_ids=positions_from_mask(attention).to(device),
        response_mask=response_mask.to(device),
        prompt_width=P,
        response_ids=input_ids[:, P:].to(device),
        turn_index=row_field(batch.turn_index, torch.long),
        num_turns=row_field(batch.num_turns, torch.long).clamp(min=1),
        old_logprobs=token_field(batch.old_logprobs),
        rollout_entropy=token_field(batch.entropy),
        ref_logprobs=token_field(batch.ref_logprobs),
        advantages=row_field(batch.advantages),
        returns=row_field(batch.returns),
        old_values=row_field(batch.old_values),
        num_real=len(idx),
    )


def policy_forward(model: nn.Module, mb: MicroBatch, temperature: float = 1.0,
                   vocab_limit: int | None = None, with_entropy: bool = True) -> PolicyOutputs:
    """Log-probs [B, R] of the response tokens and the entropy [B, R] of the full next-token
    distribution, both at the sampling temperature."""
    R = mb.response_mask.shape[1]
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False, logits_to_keep=R + 1)
    logits = out.logits[:, :-1]  # [B, R, V]: column P-1+r predicts response token r
    if vocab_limit is not None:
        logits = logits[..., :vocab_limit]
    logp_all = torch.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)  # [B, R, V]
    logprobs = logp_all.gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)  # [B, R]
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logprobs)  # [B, R]
    mask = mb.response_mask
    return PolicyOutputs(logprobs=logprobs * mask, entropy=entropy * mask)


def value_forward(critic: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Critic values [B] at each row's last prompt token (the turn's state)."""
    P = mb.prompt_width
    return critic(mb.input_ids[:, :P], mb.attention_mask[:, :P], mb.position_ids[:, :P])
