"""The update part, shared by RL and SFT: the scoring forward, then the optimisation of the loss stack.

    batch = update.score(batch, step)              # no grad: old/ref log-probs, entropies, values
    ... advantages, coefficients ...
    result = update.run(batch, coefs, step, history)
        ppo_epochs x mini-batches (one `optimizer_step` each) x micro-batches (`micro_batches` collates them
        with their weights; Clip-Cov/KL-Cov first choose their tokens over the whole mini-batch,
        `token_selection`). Each micro-batch is `train_micro_batch`: forward, log-ratio, the rollout
        correction's weights, loss = sum_i coef_i * term_i, engine.backward; `critic_backward`.
    result.metrics, result.batch (every row scored), result.skipped / optimizer_steps (`skip_streak`)

Scoring reuse (algo.reuse_scoring_forward) is this part's own business: `score` leaves the rows of the first
mini-batch unscored (their old log-probs and entropies are None), because the update's first forward, made
with the very weights that played the rollout, scores them; `run` fills them in, and its result's batch has
every row scored. One rule decides it (`unscored`: old log-probs None), one helper does it (`score_with`).
Callers pass the batch along and never see which rows those were. Measured gain: the whole scoring forward
when the mini-batch holds the batch (perf/score_s 0 on the presets; docs/performance.md).

Its settings (`PolicyUpdateSettings`) are cut once from the run config (training/settings.py); the part never
reads the config itself, so a test builds it from its settings, models and loss stack alone.

Every rank runs the same number of micro-batches per optimizer step (empty ones where it has fewer rows),
and each aggregation mode's denominator is global over the mini-batch, so 1 rank and N ranks compute the
same update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from epo_cli.algos.aggregation import AGGREGATIONS, normalized_weights
from epo_cli.algos.cov_selection import mini_batch_selection, selection_mask
from epo_cli.algos.entropy import EntropyHistory
from epo_cli.algos.losses import LossStack, PolicyOutputs, required_aggregations
from epo_cli.algos.rollout_correction import correction_weights
from epo_cli.errors import UserError
from epo_cli.rollout.batch import MicroBatch, TurnBatch
from epo_cli.seeding import derive_seed
from epo_cli.training.engine import (
    DistInfo,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum,
    grad_norm,
    set_lr,
    step_was_skipped,
)
from epo_cli.training.forward import collate, plan_micro_batches, policy_forward, value_forward
from epo_cli.training.models import Models
from epo_cli.training.packing import default_budget, plan_packs
from epo_cli.training.step_metrics import UpdateTally, critic_metrics


@dataclass(frozen=True)
class PolicyUpdateSettings:
    """What the update part reads, fixed for the run (training/settings.py cuts it from the run config)."""

    seed: int  # the run's seed: mini-batch splits and Clip-Cov's draws are derived from it
    temperature: float  # rollout.temperature: log-probs and entropies at the sampling temperature
    sft: bool  # behaviour cloning: one epoch, the whole batch as one mini-batch
    ppo_epochs: int
    mini_batch_size: int  # samples per optimizer step (global, over all ranks)
    micro_batch_size: int  # samples per forward/backward pass (padded micro-batches; also packing's default)
    pack_tokens: int  # token budget of a packed micro-batch (0: micro_batch_size's default budget)
    lr: float  # the policy's peak learning rate (the lr schedule multiplies it)
    critic_lr: float  # the critic's (algo.value.lr, else algo.lr)
    value_coef: float  # the critic's loss weight (algo.value.coef)
    turn_decay: float  # the turn-decay aggregation: turn t of an episode weighs turn_decay ** t
    reuse_scoring_forward: bool  # the update's first forward may score the first mini-batch (`reuses_scoring`)
    correction: str = "none"  # rollout.correction.mode: the rollout/training mismatch correction the loss applies
    token_cap: float = 2.0  # rollout.correction.token_cap: the truncated importance weight's cap
    seq_bound: float = 2.0  # rollout.correction.seq_bound: the sequence mask's bound on the geometric-mean ratio


@dataclass
class Scores:
    """What the scoring forward computes for each row of a batch (token lists: N x [len(response)])."""

    old_logprobs: list[Tensor | None]  # the rollout policy's log-probs (None: rows skipped, see `score`)
    entropy: list[Tensor | None]  # its token entropies, at the sampling temperature (None likewise)
    ref_logprobs: list[Tensor]  # the frozen reference's log-probs (empty list: no reference)
    old_values: Tensor | None  # [N] critic values (None: no critic)

    def apply(self, batch: TurnBatch) -> TurnBatch:
        """`batch` with these scores."""
        return replace(batch, old_logprobs=self.old_logprobs, entropy=self.entropy,
                       ref_logprobs=self.ref_logprobs, old_values=self.old_values)


@dataclass
class UpdateResult:
    metrics: dict[str, float]  # loss/<term>, policy/clipfrac, ..., perf/optimizer_steps, critic/*
    batch: TurnBatch  # the batch trained on, every row scored (those `score` left to the update filled in)
    skipped: int  # optimizer steps skipped for a non-finite loss or gradient
    optimizer_steps: int
    scored_rows: int = 0  # rows this rank's update scored itself (scoring reuse): perf/scoring_reused


@dataclass
class _UpdateInputs:
    """What every mini-batch step of one update shares."""

    batch: TurnBatch
    coefs: dict[str, float]
    history: EntropyHistory | None  # the entropy references of entropy_smoothing (None: no smoothing term)
    lengths: list[int]  # prompt + response tokens of each row (micro-batch planning)
    modes: list[str]  # the aggregation modes of the loss terms, sorted (the same order on every rank)
    row_denominators: dict[str, Tensor]  # each row's share of each mode's denominator


class PolicyUpdate:
    """Scores and trains `models` (policy engine, critic engine) with `loss_stack` (+ `value_term`)."""

    def __init__(self, settings: PolicyUpdateSettings, dist: DistInfo, models: Models, loss_stack: LossStack,
                 value_term: Any | None = None) -> None:
        self.settings = settings
        self.dist, self.models, self.loss_stack, self.value_term = dist, models, loss_stack, value_term

    # ---- planning -------------------------------------------------------------------------------------
    def plan_micro_batches(self, rows: list[int], lengths: list[int]) -> list[list[int]]:
        """The passes over `rows`: packs up to the token budget (algo.pack_tokens), or padded micro-batches of
        micro_batch_size samples of similar length."""
        settings = self.settings
        if not self.models.packing:
            return plan_micro_batches(rows, lengths, settings.micro_batch_size)
        budget = settings.pack_tokens or default_budget(lengths, settings.micro_batch_size)
        return plan_packs(rows, lengths, budget)

    def mini_batches(self, batch: TurnBatch, step: int, epoch: int) -> list[list[int]]:
        """This rank's rows of each global mini-batch. The split depends only on (seed, step, epoch) and
        the samples' global ids, so 1 rank and N ranks form the same global mini-batches."""
        # (random key, global id): a tie of keys is broken by the id, never by the rank or row
        keys = [(derive_seed(self.settings.seed, "minibatch", step, epoch, t, i), t, i)
                for t, i in zip(batch.traj_id.tolist(), batch.turn_index.tolist())]
        everyone = all_gather_objects(keys)
        ordered = sorted((k, rank, row) for rank, ks in enumerate(everyone) for row, k in enumerate(ks))
        size = self.settings.mini_batch_size
        out: list[list[int]] = [[] for _ in range(max(1, math.ceil(len(ordered) / size)))]
        for pos, (_, rank, row) in enumerate(ordered):
            if rank == self.dist.rank:
                out[pos // size].append(row)
        return out

    def reuses_scoring(self) -> bool:
        """Whether the update's first forward scores its own samples (see `score`); False when that
        is not provably the rollout's policy or not wanted:
          - settings.reuse_scoring_forward false (algo.reuse_scoring_forward=false, or algo.monitor.action=clamp:
            this step's coefficients need every entropy before the update);
          - dropout anywhere in the policy (a training-mode forward would differ from the rollout's policy)."""
        return self.settings.reuse_scoring_forward and not has_dropout(self.models.engine.module)

    def on_policy_rows(self, batch: TurnBatch, step: int) -> set[int]:
        """This rank's samples whose old log-probs the update's own forward can provide: those of the first
        mini-batch of the first epoch, which the update reaches before any optimizer step, with the weights
        that played the rollout (empty unless reuses_scoring()). Collective when reusing: every rank calls it."""
        return set(self.mini_batches(batch, step, 0)[0]) if self.reuses_scoring() else set()

    def set_learning_rates(self, multiplier: float) -> None:
        """The policy's and the critic's learning rates times `multiplier` (the lr schedule's, this step)."""
        set_lr(self.models.engine, self.settings.lr * multiplier)
        if self.models.critic_engine is not None:
            set_lr(self.models.critic_engine, self.settings.critic_lr * multiplier)

    @property
    def learning_rate(self) -> float:
        return self.models.engine.optimizer.param_groups[0]["lr"]

    # ---- scoring --------------------------------------------------------------------------------------
    def score(self, batch: TurnBatch, step: int) -> TurnBatch:
        """A new batch: `batch` with the scoring forward's outputs (old log-probs and entropies, reference
        log-probs, critic values; no grad). With scoring reuse, the rows of step `step`'s first mini-batch
        keep None as old log-probs and entropies: `run`'s first forward scores them (see the module
        docstring). Collectives: every rank calls it."""
        return self.forward_scores(batch, skip_policy=self.on_policy_rows(batch, step)).apply(batch)

    def forward_scores(self, batch: TurnBatch, skip_policy: set[int] | None = None) -> Scores:
        """Old-policy log-probs and entropy (+ reference log-probs, critic values), no grad. Rows in
        `skip_policy` get only the reference and critic passes (their old log-probs and entropies: None)."""
        models, device = self.models, self.dist.device
        n = len(batch)
        skip_policy = skip_policy or set()
        scores = Scores([None] * n, [None] * n,
                        [torch.empty(0)] * n if models.ref_model is not None else [],
                        torch.zeros(n) if models.critic is not None else None)
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        scored = [r for r in range(n) if r not in skip_policy]
        passes = [(rows, True) for rows in self.plan_micro_batches(scored, lengths)]
        if models.ref_model is not None or scores.old_values is not None:
            passes += [(rows, False) for rows in self.plan_micro_batches(sorted(skip_policy), lengths)]
        temperature = self.settings.temperature
        with torch.no_grad():
            for rows, with_policy in passes:
                mb = collate(batch, rows, models.tokenizer.pad_token_id, device, packed=models.packing)
                out = policy_forward(models.policy.module, mb, temperature, models.vocab_limit,
                                     autocast_to=models.autocast_to) if with_policy else None
                ref = (policy_forward(models.ref_model, mb, temperature, models.vocab_limit, with_entropy=False,
                                      autocast_to=models.autocast_to)
                       if models.ref_model is not None else None)
                for i, r in enumerate(rows):
                    k = len(batch.response_ids[r])
                    if out is not None:
                        scores.old_logprobs[r] = out.logprobs[i, :k].float().cpu()
                        scores.entropy[r] = out.entropy[i, :k].float().cpu()
                    if ref is not None:
                        scores.ref_logprobs[r] = ref.logprobs[i, :k].float().cpu()
                if scores.old_values is not None:
                    values = value_forward(models.critic.module, mb, models.autocast_to)
                    scores.old_values[rows] = values[:len(rows)].float().cpu()
        return scores

    # ---- the update -----------------------------------------------------------------------------------
    def aggregation_modes(self) -> set[str]:
        modes = set(required_aggregations(self.loss_stack.terms))
        if self.value_term is not None:
            modes.add(self.value_term.aggregation)
        return modes

    def run(self, batch: TurnBatch, coefs: dict[str, float], step: int,
            history: EntropyHistory | None = None) -> UpdateResult:
        """ppo_epochs x mini-batches x micro-batches (`train_micro_batch`); one optimizer step per mini-batch
        (SFT: one epoch, the whole batch as one mini-batch). `batch` is not changed; the returned batch has
        every row scored (those `score` left to the update's first forward filled in)."""
        settings = self.settings
        on_policy = {r for r, logprobs in enumerate(batch.old_logprobs) if logprobs is None}
        # its own lists: the first forward fills in the rows `score` left (scoring reuse)
        batch = replace(batch, old_logprobs=list(batch.old_logprobs), entropy=list(batch.entropy))
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        # sorted: each mode's denominator is one all-reduce, and a set's order (str hashes are salted per
        # process) differs between ranks, which would pair up different modes' sums
        modes = sorted(self.aggregation_modes())
        shared = _UpdateInputs(batch, coefs, history, lengths, modes,
                               row_denominators(batch, modes, settings.turn_decay))
        tally = UpdateTally()
        self.models.engine.train()
        for epoch in range(1 if settings.sft else settings.ppo_epochs):
            minis = [list(range(len(batch)))] if settings.sft else self.mini_batches(batch, step, epoch)
            if epoch == 0 and not on_policy <= set(minis[0]):
                raise ValueError("rows without old log-probs outside the first mini-batch: score the batch with "
                                 "PolicyUpdate.score(batch, step) of the same step")
            for mini, rows in enumerate(minis):
                step_metrics: dict[str, float] = {}
                for micro_rows, mb in self.micro_batches(shared, rows, (step, epoch, mini), tally):
                    for k, v in self.train_micro_batch(mb, micro_rows, shared).items():
                        step_metrics[k] = step_metrics.get(k, 0.0) + float(v)
                self.optimizer_step(step_metrics, tally)
        metrics = tally.metrics()
        if batch.old_values is not None and batch.returns is not None:
            metrics.update(critic_metrics(batch.old_values, batch.returns, self.dist.device))
        return UpdateResult(metrics, batch, tally.skipped, tally.optimizer_steps, scored_rows=len(on_policy))

    def train_micro_batch(self, mb: MicroBatch, rows: list[int], shared: _UpdateInputs) -> dict[str, Any]:
        """One micro-batch: the policy's forward, the ratio, the named loss terms and their sum, backward (then
        the critic's); returns the terms' metrics. The inner loop of cleanrl's ppo.py, one micro-batch at a time."""
        engine, batch = self.models.engine, shared.batch
        scores_itself = unscored(batch, rows)  # scoring reuse: this forward is the rows' old policy
        out = policy_forward(engine, mb, self.settings.temperature, self.models.vocab_limit,
                             with_entropy=self.needs_entropy() or scores_itself,
                             autocast_to=self.models.autocast_to)  # logprobs, entropy [B, R]
        if scores_itself:
            score_with(out, mb, rows, batch)
        if mb.old_logprobs is not None:  # (SFT has no old policy)
            out.log_ratio = out.logprobs - mb.old_logprobs  # [B, R] log pi_theta / pi_old: exp() is the ratio
            mb.correction = correction_weights(self.settings.correction, mb.old_logprobs,
                                               [batch.engine_logprobs[r] for r in rows] if batch.engine_logprobs
                                               else [], mb.response_mask, self.settings.token_cap,
                                               self.settings.seq_bound)  # [B, R] or None (mode none)
        # loss = sum_i coef_i * term_i over algo.loss_terms, e.g. 1*policy_clip + kl_w*kl - lam*entropy
        #        + lam*beta_k*entropy_smoothing (LossStack.formula logs this step-0 line)
        loss, metrics = self.loss_stack(mb, out, shared.coefs)
        # DeepSpeed averages gradients over ranks; the aggregation weights already normalise globally
        engine.backward(loss * self.dist.world_size, scale_wrt_gas=False)
        if self.models.critic_engine is not None:
            metrics.update(self.critic_backward(mb, self.dist.world_size))
        return metrics

    def micro_batches(self, shared: _UpdateInputs, rows: list[int], position: tuple[int, int, int],
                      tally: UpdateTally) -> Iterator[tuple[list[int], MicroBatch]]:
        """This rank's `rows` of a global mini-batch as (rows, micro-batch) pairs, collated one at a time,
        carrying their aggregation weights (each mode's denominator global over the mini-batch: all ranks),
        Clip-Cov/KL-Cov's chosen tokens and EPO's entropy references. Every rank yields as many (empty ones
        where it has fewer rows). `position` is (step, epoch, mini-batch index). Collectives."""
        device, decay = self.dist.device, self.settings.turn_decay
        micro = self.plan_micro_batches(rows, shared.lengths)
        n_micro = int(all_reduce_max(torch.tensor(len(micro))).item())
        micro += [[] for _ in range(n_micro - len(micro))]
        denominators = {mode: float(all_reduce_sum(shared.row_denominators[mode][rows].sum().to(device))
                                    .clamp(min=1e-12)) for mode in shared.modes}
        chosen = self.token_selection(shared, micro, position)  # Clip-Cov / KL-Cov (else None)
        for m in micro:
            mb = collate(shared.batch, m, self.models.tokenizer.pad_token_id, device, num_rows=max(len(m), 1),
                         packed=self.models.packing)
            mb.token_select = None if chosen is None else selection_mask(chosen, m, mb.response_mask)
            for mode in shared.modes:
                mb.weights[mode] = normalized_weights(mode, mb.response_mask, mb.turn_index, mb.num_turns,
                                                      decay, denominator=denominators[mode]).to(device)
            if shared.history is not None and "entropy_smoothing" in self.loss_stack.terms:
                mb.entropy_ref = shared.history.reference(mb.turn_index.cpu()).to(device)
            tally.real_tokens += int(mb.attention_mask.sum())
            tally.padded_tokens += mb.attention_mask.numel()
            yield m, mb

    def optimizer_step(self, step_metrics: dict[str, float], tally: UpdateTally) -> None:
        """engine.step() (and the critic's) after a mini-batch's micro-batches; the skip and gradient-norm
        record, and the step's term metrics summed over ranks, into `tally`. Collective."""
        engine, device = self.models.engine, self.dist.device
        engine.step()
        if self.models.critic_engine is not None:
            self.models.critic_engine.step()
        if step_was_skipped(engine):
            tally.skipped += 1
        norm = grad_norm(engine)
        if norm is not None:
            tally.grad_norms.append(norm)
        names = sorted(step_metrics)
        reduced = all_reduce_sum(torch.tensor([step_metrics[k] for k in names], dtype=torch.float64,
                                              device=device)).tolist() if names else []
        tally.add_step(dict(zip(names, reduced)))

    def token_selection(self, shared: _UpdateInputs, micro: list[list[int]],
                        position: tuple[int, int, int]) -> dict[int, Tensor] | None:
        """Clip-Cov / KL-Cov: row -> the tokens [k] bool the loss acts on, chosen over the whole mini-batch (all
        micro-batches and ranks; epo_cli/algos/cov_selection.py) from the current policy's log-probs, scored
        first without gradient; None for the other policy losses. Collectives: every rank calls it."""
        selector = self.loss_stack.token_selector()
        if selector is None:
            return None
        batch = shared.batch
        return mini_batch_selection(selector, (self._current_logprobs(shared, m) for m in micro if m),
                                    lambda r: (int(batch.traj_id[r]), int(batch.turn_index[r])),
                                    derive_seed(self.settings.seed, "cov_select", *position), all_reduce_sum,
                                    all_gather_objects)

    def _current_logprobs(self, shared: _UpdateInputs, rows: list[int]) -> tuple[list[int], MicroBatch, Tensor]:
        """(rows, their micro-batch, the current policy's log-probs [B, R]), no grad: what the backward loop's
        forward of this micro-batch will compute. Rows the first forward scores (scoring reuse) have no old
        log-probs yet: these are theirs (the weights are the rollout's, the ratio is 1)."""
        models = self.models
        mb = collate(shared.batch, rows, models.tokenizer.pad_token_id, self.dist.device, packed=models.packing)
        with torch.no_grad():
            logprobs = policy_forward(models.engine, mb, self.settings.temperature, models.vocab_limit,
                                      with_entropy=False, autocast_to=models.autocast_to).logprobs
        if unscored(shared.batch, rows):
            mb.old_logprobs = logprobs
        return rows, mb, logprobs

    def needs_entropy(self) -> bool:
        """Whether the loss stack reads the token entropies (its entropy or entropy_smoothing term)."""
        return any(t in self.loss_stack.terms for t in ("entropy", "entropy_smoothing"))

    def critic_backward(self, mb: MicroBatch, world: int) -> dict[str, Any]:
        """The value loss's forward and backward on the critic engine; its metrics."""
        values = value_forward(self.models.critic_engine, mb, self.models.autocast_to)
        vloss, vmetrics = self.value_term(mb, PolicyOutputs(logprobs=None, entropy=None, values=values))
        self.models.critic_engine.backward(self.settings.value_coef * vloss * world, scale_wrt_gas=False)
        return vmetrics


# ---- scoring reuse: one rule (a row whose old log-probs are None is scored by its first forward) -------------

def unscored(batch: TurnBatch, rows: list[int]) -> bool:
    """Whether the micro-batch of `rows` is one `score` left to the update (scoring reuse). Such rows are only
    in the first mini-batch of the first epoch (`run` checks), so all of a micro-batch's rows are, or none."""
    return bool(rows) and bool(batch.old_logprobs) and batch.old_logprobs[rows[0]] is None


def score_with(out: PolicyOutputs, mb: MicroBatch, rows: list[int], batch: TurnBatch) -> None:
    """This forward, made with the weights that played the rollout, is the old policy of `rows`: its detached
    log-probs and entropies become theirs, in `mb` (ratio exactly 1) and in `batch` (later epochs and the
    entropy statistics)."""
    mb.old_logprobs = out.logprobs.detach()
    mb.rollout_entropy = out.entropy.detach()
    for i, r in enumerate(rows):
        k = len(batch.response_ids[r])
        batch.old_logprobs[r] = mb.old_logprobs[i, :k].float().cpu()
        batch.entropy[r] = mb.rollout_entropy[i, :k].float().cpu()


def skip_streak(streak: int, result: UpdateResult, limit: int, last_checkpoint: Callable[[], str | None]) -> int:
    """Consecutive skipped optimizer steps, over updates whose every step was skipped (0 after an update that
    changed the weights); at `limit` the run stops with a message naming the last checkpoint."""
    streak = streak + result.skipped if result.skipped == result.optimizer_steps else 0
    if streak >= limit:
        raise UserError(
            f"Training stopped: {streak} consecutive updates had a non-finite loss or gradient "
            f"(trainer.max_nonfinite_skips={limit}); the weights were not changed by them. Last checkpoint: "
            f"{last_checkpoint() or 'none'}. Lower algo.lr or check the reward scale, then resume with "
            "trainer.resume=<run dir>.")
    return streak


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward of `model` is random (dropout layers, attention dropout)."""
    config = getattr(model, "config", None)
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def row_denominators(batch: TurnBatch, modes: list[str], decay: float) -> dict[str, Tensor]:
    """Each sample's contribution d to every aggregation mode's denominator ([N] float64 per mode),
    from the sample metadata alone (no padding of token ids needed)."""
    lengths = batch.response_lengths
    mask = torch.arange(max(int(lengths.max()), 1) if len(lengths) else 1)[None, :] < lengths[:, None]
    num_turns = batch.num_turns.clamp(min=1)
    return {mode: AGGREGATIONS[mode].weights(mask, batch.turn_index, num_turns, decay)[1].double()
            for mode in modes}
