"""Data that flows from the rollout to the loss stack.

`TurnBatch`: one sample per turn (verl-agent style). A sample's prompt is the templated observation with a
short history window; its response is what the policy generated at that turn. Per-sample scalars are 1-D
tensors of length N (number of turn-samples); token-level data are lists of 1-D tensors.

`MicroBatch`: a padded slice of a TurnBatch ready for one forward/backward. Layout of `input_ids`:
    [pad .. pad | prompt tokens | response tokens | pad .. pad]
     <---------- P columns ----> <-------- R columns -------->
prompts are left-padded to P columns and responses right-padded to R columns, so the logits that predict
response token r sit at column P - 1 + r for every row (this is also the layout `generate` produces).

A packed MicroBatch (algo.pack_tokens, epo_cli/training/packing.py) also carries a `PackedLayout`: the
model then runs on one row holding its samples end to end, and its outputs are scattered back into the
same [B, R] response layout, so loss terms never see the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


@dataclass
class TurnBatch:
    # --- filled by the rollout -------------------------------------------------------------------------
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    traj_id: Tensor  # [N] long, unique per trajectory within an iteration, identical on any world size
    group_id: Tensor  # [N] long, rollouts of the same task share a group id (GRPO)
    turn_index: Tensor  # [N] long, true 0-based turn index within its trajectory (never a padded position)
    num_turns: Tensor  # [N] long, T_j: number of turns of the sample's trajectory
    reward: Tensor  # [N] float, turn-local reward: -invalid_penalty if invalid, + subgoal reward
    outcome: Tensor  # [N] float, trajectory task reward (reward_scale * won), same for every turn
    valid: Tensor  # [N] bool, the response had a well-formed <action>...</action>
    won: Tensor  # [N] bool, the trajectory solved its task
    task_type: list[str]
    #: the env observation text the policy saw at this turn (before the history window): GiGPO's anchor
    #: state; empty when the batch was not built from episodes (demonstrations)
    anchor_obs: list[str] = field(default_factory=list)
    #: the admissible actions listed in that turn's prompt, one per line (GiGPO's optional anchor refinement)
    admissible: list[str] = field(default_factory=list)
    #: the part of `reward` that is the intrinsic bonus (algo.intrinsic; epo_cli/algos/intrinsic.py), kept
    #: apart for the metrics; None when the run has none
    intrinsic: Tensor | None = None  # [N] float
    #: the rollout engine's log-probs of each response's tokens, when it kept them (the mismatch metrics and
    #: rollout.correction); None for a row it did not generate as is
    engine_logprobs: list[Tensor | None] = field(default_factory=list)  # N x [len(response)]
    # --- filled by the old-policy forward pass (no extra pass for EPO's entropy history) ---------------
    old_logprobs: list[Tensor] = field(default_factory=list)  # N x [len(response)]
    entropy: list[Tensor] = field(default_factory=list)  # N x [len(response)], at sampling temperature
    ref_logprobs: list[Tensor] = field(default_factory=list)  # N x [len(response)], frozen reference
    old_values: Tensor | None = None  # [N] critic value of the turn's prompt (state)
    # --- filled by the advantage estimator -------------------------------------------------------------
    advantages: Tensor | None = None  # [N], broadcast to every response token of the turn
    returns: Tensor | None = None  # [N], critic targets (gae)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_lengths(self) -> Tensor:
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)

    @property
    def is_last_turn(self) -> Tensor:
        return self.turn_index == self.num_turns - 1

    def select(self, index: list[int] | Tensor) -> TurnBatch:
        """A new TurnBatch with the samples at `index` (in that order): every field, tensors indexed, lists
        picked row by row (an empty list, a field not filled in, stays empty; None stays None)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        pick = idx.tolist()

        def rows(value: Tensor | list | None) -> Tensor | list | None:
            if value is None or isinstance(value, Tensor):
                return None if value is None else value[idx]
            return [value[i] for i in pick] if value else []

        return TurnBatch(**{f.name: rows(getattr(self, f.name)) for f in fields(self)})


@dataclass
class PackedLayout:
    """The model-side layout of a packed micro-batch of S samples and L = sum of their lengths tokens."""

    input_ids: Tensor  # [1, L] long, sample s at [cu[s], cu[s+1]): its prompt then its response
    position_ids: Tensor  # [1, L] long, restart at 0 for every sample
    cu_seq_lens: Tensor  # [S+1] int32, cumulative sample lengths (flash-attention varlen convention)
    max_length: int  # longest sample
    #: positions whose logits predict a response token, sample by sample in token order, so they line up
    #: with MicroBatch.response_mask[response_mask] (row-major)
    logits_index: Tensor  # [M] long, M = number of real response tokens
    #: position of each MicroBatch row's last prompt token (the critic's state); 0 for padding rows
    value_index: Tensor  # [B] long


@dataclass
class MicroBatch:
    """Padded tensors for one forward/backward (B rows, P prompt columns, R response columns)."""

    input_ids: Tensor  # [B, P+R] long
    attention_mask: Tensor  # [B, P+R] long, 0 on padding
    position_ids: Tensor  # [B, P+R] long, counts real tokens only (left padding aware)
    response_mask: Tensor  # [B, R] bool, True on real response tokens
    prompt_width: int  # P
    response_ids: Tensor  # [B, R] long
    turn_index: Tensor  # [B] long
    num_turns: Tensor  # [B] long
    old_logprobs: Tensor | None = None  # [B, R]
    rollout_entropy: Tensor | None = None  # [B, R]
    ref_logprobs: Tensor | None = None  # [B, R]
    advantages: Tensor | None = None  # [B]
    returns: Tensor | None = None  # [B]
    old_values: Tensor | None = None  # [B]
    #: smoothing reference entropy per row (EPO); NaN where no history exists yet
    entropy_ref: Tensor | None = None  # [B]
    #: per aggregation mode: token weights already divided by the mini-batch's global denominator, so a
    #: term's loss is (weights * per_token_loss).sum() and summing over micro-batches and ranks gives the
    #: mini-batch aggregate (see epo_cli/algos/aggregation.py)
    weights: dict[str, Tensor] = field(default_factory=dict)  # mode -> [B, R]
    #: rows that are real samples; the rest are padding added so every rank runs the same number of passes
    num_real: int = 0
    #: set for packed micro-batches: the model runs on this layout instead of input_ids/attention_mask
    packed: PackedLayout | None = None
    #: Clip-Cov / KL-Cov: the tokens they act on, chosen over the whole mini-batch (epo_cli/algos/cov_selection.py);
    #: None: the loss chooses within this micro-batch alone
    token_select: Tensor | None = None  # [B, R] bool
    #: rollout.correction: the fixed per-token weights of the policy loss (truncated importance weights
    #: pi_trainer / pi_engine, the sequence mask), set by the update; None: no correction
    correction: Tensor | None = None  # [B, R]
