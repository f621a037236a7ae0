"""The rollout/training mismatch: how far the rollout engine's log-probs are from the trainer's, and the
corrections the peers ship for it.

The engine that samples (vLLM, or the hf engine's KV-cache decode) and the trainer's scoring forward compute
the same policy with different kernels, so pi_engine(y_t) != pi_trainer(y_t) token by token. The samples
come from pi_engine while PPO's ratio uses pi_trainer_old as the behaviour policy: the gradient is biased by
the difference. Per token, with log_ratio_t = log pi_trainer(y_t) - log pi_engine(y_t) and
ratio_t = exp(log_ratio_t):

    token TIS weight   w_t = min(ratio_t, C)               (Yao et al. 2025, "Your efficient RL framework
                                                             secretly brings you off-policy RL training";
                                                             verl: rollout_is_threshold, default C = 2)
    sequence mask      keep row iff 1/B <= exp(mean_t log_ratio_t) <= B   (verl's geometric mask, B = 2)
    KL estimate        KL(pi_engine || pi_trainer) ~ mean_t [(ratio_t - 1) - log_ratio_t]   (k3, >= 0;
                                                             samples from pi_engine)

Metrics of one step (all ranks' tokens): rollout/logp_diff_mean and rollout/logp_diff_max (|log_ratio_t|),
rollout/mismatch_kl (k3), rollout/tis_truncated_share (tokens with ratio_t > C), rollout/seq_masked_share
(rows the sequence mask would drop); they are logged whether or not a correction is applied.

rollout.correction.mode applies them (`correction_weights`, off by default): `tis` multiplies each token's
policy loss by w_t, `mask` zeroes the rows outside the sequence bound, `tis_and_mask` does both (verl's
rollout_is=token with rollout_rs=geometric). The policy terms multiply the weights in before aggregating
(epo_cli/algos/losses.py: _behaviour_corrected), as verl multiplies rollout_is_weights into pg_losses; the
clip fraction and approx_kl are not reweighted. This module imports no config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

#: rollout.correction.mode: what the policy loss applies
CORRECTION_MODES = ("none", "tis", "mask", "tis_and_mask")

#: the sums one rank contributes; all-reduced by sum except logp_diff_max (max)
SUM_KEYS = ("tokens", "abs_diff", "k3", "truncated", "rows", "masked")


def token_tis_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, cap: float) -> Tensor:
    """min(pi_trainer / pi_engine, cap) per token (no gradient: a fixed weight on the policy loss)."""
    return (trainer_logprobs.detach() - engine_logprobs).exp().clamp(max=cap)


def sequence_mask(trainer_logprobs: Tensor, engine_logprobs: Tensor, response_mask: Tensor, bound: float) -> Tensor:
    """[B] bool: rows whose geometric-mean ratio exp(mean_t log_ratio_t) over their response tokens
    (response_mask [B, R]) lies within [1/bound, bound]. A row without tokens is kept."""
    log_ratio = (trainer_logprobs.detach() - engine_logprobs) * response_mask
    mean = log_ratio.sum(-1) / response_mask.sum(-1).clamp(min=1)
    limit = torch.log(torch.tensor(bound, dtype=mean.dtype))
    return mean.abs() <= limit


def correction_weights(mode: str, trainer_logprobs: Tensor, engine_logprobs: Sequence[Tensor | None],
                       response_mask: Tensor, cap: float, bound: float) -> Tensor | None:
    """The fixed weights [B, R] the policy loss multiplies in for `mode` (CORRECTION_MODES; None for "none"):
    token TIS weights min(ratio_t, cap), times 0 on the rows the sequence mask drops. `trainer_logprobs`
    [B, R] are the old policy's (the scoring forward's), `engine_logprobs` the engine's per row (a row
    without them, None or of another length, keeps weight 1: nothing to correct it by; padding rows too)."""
    if mode == "none":
        return None
    B, R = trainer_logprobs.shape
    engine = torch.zeros_like(trainer_logprobs)  # [B, R]
    known = torch.zeros(B, dtype=torch.bool, device=trainer_logprobs.device)  # [B]
    for i, row in enumerate(engine_logprobs[:B]):
        n = int(response_mask[i].sum())
        if row is not None and len(row) == n:
            engine[i, :n] = row.to(engine)
            known[i] = True
    mask = response_mask & known[:, None]  # [B, R] the tokens with both log-probs
    weights = torch.ones_like(trainer_logprobs)  # [B, R]
    if mode in ("tis", "tis_and_mask"):
        weights = torch.where(mask, token_tis_weights(trainer_logprobs, engine, cap), weights)
    if mode in ("mask", "tis_and_mask"):
        kept = sequence_mask(trainer_logprobs, engine, mask, bound) | ~known  # [B]
        weights = weights * kept[:, None].to(weights)
    return weights


def mismatch_sums(engine_logprobs: Sequence[Tensor | Sequence[float] | None] | None, trainer_logprobs: Sequence[Tensor],
                  correction: Any) -> dict[str, float]:
    """This rank's sums for the mismatch metrics (SUM_KEYS, plus `max_abs_diff`). Rows without the engine's
    log-probs (None) or whose lengths differ from the trainer's are left out. `correction`: token_cap, seq_bound."""
    sums = dict.fromkeys(SUM_KEYS, 0.0) | {"max_abs_diff": 0.0}
    if engine_logprobs is None:
        return sums
    log_cap, log_bound = torch.log(torch.tensor(float(correction.token_cap), dtype=torch.float64)), \
        torch.log(torch.tensor(float(correction.seq_bound), dtype=torch.float64))
    for engine, trainer in zip(engine_logprobs, trainer_logprobs):
        if engine is None or trainer is None or len(engine) != len(trainer) or len(engine) == 0:
            continue
        log_ratio = trainer.detach().double().cpu() - torch.as_tensor(engine, dtype=torch.float64)
        sums["tokens"] += len(engine)
        sums["abs_diff"] += float(log_ratio.abs().sum())
        sums["max_abs_diff"] = max(sums["max_abs_diff"], float(log_ratio.abs().max()))
        sums["k3"] += float((log_ratio.exp() - 1 - log_ratio).sum())
        sums["truncated"] += float((log_ratio > log_cap).sum())
        sums["rows"] += 1
        sums["masked"] += float(log_ratio.mean().abs() > log_bound)
    return sums


def mismatch_metrics_from_sums(sums: dict[str, float], all_reduce_sum: Callable[[Tensor], Tensor],
                               all_reduce_max: Callable[[Tensor], Tensor], device: Any) -> dict[str, float]:
    """The step's rollout/... mismatch metrics from every rank's sums (collectives: every rank calls it); {}
    when no rank had a row to compare."""
    total = all_reduce_sum(torch.tensor([sums[k] for k in SUM_KEYS], dtype=torch.float64, device=device)).cpu()
    largest = float(all_reduce_max(torch.tensor(sums["max_abs_diff"], dtype=torch.float64, device=device)))
    tokens, _, k3, truncated, rows, masked = total.tolist()
    if tokens == 0:
        return {}
    return {"rollout/logp_diff_mean": total[1].item() / tokens, "rollout/logp_diff_max": largest,
            "rollout/mismatch_kl": k3 / tokens, "rollout/tis_truncated_share": truncated / tokens,
            "rollout/seq_masked_share": masked / rows}
