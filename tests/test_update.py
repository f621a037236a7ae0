"""The update part on its own: a hand-made batch, a toy causal LM, a plain-SGD stand-in for the engine.

What it must do, checked without DeepSpeed, ranks or rollouts: scoring returns values (it never writes into
the batch), one optimizer step over micro-batches equals one step on the mini-batch's loss computed whole,
the update's first forward scores the on-policy rows, and the skipped-update streak counts as documented.
"""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError, replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from epo_cli.algos.aggregation import normalized_weights
from epo_cli.algos.losses import LossStack, NLLLoss, build_loss_terms
from epo_cli.compose import compose
from epo_cli.errors import UserError
from epo_cli.rollout.batch import TurnBatch
from epo_cli.training.engine import DistInfo, RolloutModule
from epo_cli.training.forward import collate, policy_forward
from epo_cli.training.models import Models
from epo_cli.training.settings import update_settings
from epo_cli.training.update import PolicyUpdate, PolicyUpdateSettings, UpdateResult, skip_streak

VOCAB = 24
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class ToyLM(nn.Module):
    """A causal LM in the shape policy_forward expects: position t sees the (unpadded) tokens up to t."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0):  # noqa: ANN001, ANN201
        h = self.embed(input_ids) * attention_mask[..., None]  # padding contributes nothing
        logits = self.head(torch.tanh(h.cumsum(1)))
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


class SGDEngine:
    """The part of a DeepSpeed engine the update calls: forward, train(), backward, step (plain SGD)."""

    def __init__(self, module: nn.Module, lr: float) -> None:
        self.module, self.optimizer = module, torch.optim.SGD(module.parameters(), lr=lr)
        self.steps = 0

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1

    def get_global_grad_norm(self) -> None:
        return None


def _batch() -> TurnBatch:
    """Six turn-samples of 3 trajectories (2 turns each), varied lengths, advantages +-1."""
    g = torch.Generator().manual_seed(0)
    prompt_lens, response_lens = [4, 6, 3, 5, 7, 2], [3, 1, 4, 2, 3, 5]
    n = len(prompt_lens)
    return TurnBatch(
        prompt_ids=[torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in prompt_lens],
        response_ids=[torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in response_lens],
        traj_id=torch.tensor([0, 0, 1, 1, 2, 2]), group_id=torch.zeros(n, dtype=torch.long),
        turn_index=torch.tensor([0, 1, 0, 1, 0, 1]), num_turns=torch.full((n,), 2),
        reward=torch.zeros(n), outcome=torch.zeros(n), valid=torch.ones(n, dtype=torch.bool),
        won=torch.zeros(n, dtype=torch.bool), task_type=["t"] * n,
        advantages=torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 1.0]),
    )


def _toy_models(lr: float) -> Models:
    """ToyLM (seed 0) trained by plain SGD at `lr`; its initial copy as the frozen reference."""
    torch.manual_seed(0)
    model = ToyLM()
    ref = copy.deepcopy(model).requires_grad_(False)
    engine = SGDEngine(model, lr)
    return Models(SimpleNamespace(pad_token_id=0), VOCAB, False, engine, RolloutModule(engine, None, 0), ref)


def _update(*overrides: str, lr: float = 0.5) -> PolicyUpdate:
    """GRPO's update part (policy_clip + kl) with the settings of a composed run config."""
    cfg = compose(["algo=grpo", "algo.pack_tokens=0", "seed=1", *overrides])
    return PolicyUpdate(update_settings(cfg), CPU, _toy_models(lr),
                        LossStack(build_loss_terms(cfg.algo)))


def _coefs(update: PolicyUpdate) -> dict[str, float]:
    """GRPO's coefficients: policy_clip 1, kl at its weight 0.01."""
    return {"policy_clip": 1.0, "kl": 0.01}


def _settings(**changes: object) -> PolicyUpdateSettings:
    """Settings written out, no run config: one epoch of 8-sample mini-batches, 2-sample micro-batches."""
    settings = PolicyUpdateSettings(seed=1, temperature=1.0, sft=False, ppo_epochs=1, mini_batch_size=8,
                                    micro_batch_size=2, pack_tokens=0, lr=0.5, critic_lr=0.5, value_coef=0.5,
                                    turn_decay=0.9, reuse_scoring_forward=False)
    return replace(settings, **changes)


def test_the_part_is_built_from_its_settings_alone_and_weighs_turns_by_their_decay() -> None:
    """No run config: an nll term aggregated turn-decay with settings.turn_decay=0.5. Each trajectory has 2
    turns, Z = 1 + 0.5: turn 0 weighs 1/1.5, turn 1 0.5/1.5, each the mean of its tokens' -log p; the
    denominator is the 3 trajectories' sum of those weights, 3."""
    update = PolicyUpdate(_settings(sft=True, turn_decay=0.5), CPU, _toy_models(0.0),
                          LossStack(nn.ModuleDict({"nll": NLLLoss(aggregation="turn-decay")})))
    batch = update.forward_scores(_batch()).apply(_batch())
    expected = 0.0
    for r in range(len(batch)):
        k = len(batch.response_ids[r])
        logp = policy_forward(update.models.engine.module, collate(batch, [r], 0, CPU.device), 1.0, VOCAB).logprobs
        expected += 0.5 ** int(batch.turn_index[r]) / 1.5 * float(-logp[0, :k].mean()) / 3
    result = update.run(batch, {"nll": 1.0}, step=0)
    assert result.optimizer_steps == 1
    assert result.metrics["loss/nll"] == pytest.approx(expected, rel=1e-5)


def test_settings_from_a_run_config() -> None:
    """update_settings reads each setting once; the turn decay is algo.turn_decay (EPO: 0.9), the critic's lr
    falls back to algo.lr, and a clamping monitor turns scoring reuse off."""
    settings = update_settings(compose(["algo=epo", "seed=7"]))
    assert (settings.seed, settings.turn_decay, settings.critic_lr) == (7, 0.9, settings.lr)
    assert settings.reuse_scoring_forward and not settings.sft
    clamped = update_settings(compose(["algo=epo", "algo.monitor.action=clamp"]))
    assert not clamped.reuse_scoring_forward
    with pytest.raises(FrozenInstanceError):
        settings.lr = 1.0  # type: ignore[misc]


def test_scoring_returns_the_scores_and_leaves_the_batch_alone() -> None:
    update, batch = _update(), _batch()
    scores = update.forward_scores(batch, skip_policy={1, 3})
    assert batch.old_logprobs == [] and batch.ref_logprobs == [] and batch.old_values is None  # untouched
    for r in range(len(batch)):
        alone = policy_forward(update.models.engine.module, collate(batch, [r], 0, CPU.device), 1.0, VOCAB)
        k = len(batch.response_ids[r])
        if r in (1, 3):  # the update's own first forward scores these
            assert scores.old_logprobs[r] is None and scores.entropy[r] is None
        else:
            assert torch.allclose(scores.old_logprobs[r], alone.logprobs[0, :k], atol=1e-6)
            assert torch.allclose(scores.entropy[r], alone.entropy[0, :k], atol=1e-6)
        assert torch.allclose(scores.ref_logprobs[r], alone.logprobs[0, :k], atol=1e-6)  # ref = the initial policy
    scored = scores.apply(batch)
    assert scored is not batch and scored.old_logprobs is scores.old_logprobs and scored.old_values is None


def test_one_optimizer_step_over_micro_batches_is_a_step_on_the_whole_mini_batch() -> None:
    """Three micro-batches of 2 (weights over the mini-batch's global denominator) give the SGD step of
    the loss computed on all six rows at once: p - lr * grad(L_whole)."""
    update = _update("algo.mini_batch_size=8", "algo.micro_batch_size=2")
    batch = update.forward_scores(_batch()).apply(_batch())
    expected = copy.deepcopy(update.models.engine.module)
    mb = collate(batch, list(range(len(batch))), 0, CPU.device)
    for mode in sorted(update.aggregation_modes()):  # no denominator given: this micro-batch's own sum
        mb.weights[mode] = normalized_weights(mode, mb.response_mask, mb.turn_index, mb.num_turns, 0.9)
    out = policy_forward(expected, mb, 1.0, VOCAB)
    out.log_ratio = out.logprobs - mb.old_logprobs  # as PolicyUpdate.train_micro_batch sets it
    loss, terms = update.loss_stack(mb, out, _coefs(update))
    loss.backward()
    with torch.no_grad():
        for p in expected.parameters():
            p -= 0.5 * p.grad

    result = update.run(batch, _coefs(update), step=0)
    assert result.optimizer_steps == 1 and result.skipped == 0 and update.models.engine.steps == 1
    # the term metrics are the micro-batches' sums: the whole mini-batch's values
    assert result.metrics["loss/policy_clip"] == pytest.approx(float(terms["loss/policy_clip"]), abs=1e-6)
    for got, want in zip(update.models.engine.module.parameters(), expected.parameters()):
        assert torch.allclose(got, want, atol=1e-6)


def test_epochs_and_mini_batches_cover_every_row_once_per_epoch() -> None:
    update = _update("algo.mini_batch_size=2", "algo.micro_batch_size=2", "algo.ppo_epochs=2")
    batch = update.forward_scores(_batch()).apply(_batch())
    for epoch in (0, 1):
        minis = update.mini_batches(batch, step=3, epoch=epoch)
        assert len(minis) == 3 and sorted(r for m in minis for r in m) == list(range(6))
    assert update.mini_batches(batch, 3, 0) != update.mini_batches(batch, 3, 1)  # reshuffled each epoch
    assert update.mini_batches(batch, 3, 0) == update.mini_batches(batch, 3, 0)  # a function of (seed, step)
    result = update.run(batch, _coefs(update), step=3)
    assert result.optimizer_steps == 6 == update.models.engine.steps  # 2 epochs x 3 mini-batches


def test_the_update_s_first_forward_scores_the_on_policy_rows() -> None:
    """algo.reuse_scoring_forward: scoring skips the first mini-batch's rows; the update's first forward (the
    rollout's weights) fills in their old log-probs and entropies in the batch it returns: those of a
    separate scoring pass, with the input batch left as it was."""
    update = _update("algo.mini_batch_size=4", "algo.micro_batch_size=2", "algo.ppo_epochs=2")
    batch = _batch()
    assert update.reuses_scoring()
    on_policy = update.on_policy_rows(batch, step=0)
    assert on_policy == set(update.mini_batches(batch, 0, 0)[0]) and len(on_policy) == 4
    separate = update.forward_scores(batch)  # every row, before any update
    scored = update.score(batch, step=0)
    result = update.run(scored, _coefs(update), step=0)
    for r in range(len(batch)):
        assert torch.allclose(result.batch.old_logprobs[r], separate.old_logprobs[r], atol=1e-6)
        assert torch.allclose(result.batch.entropy[r], separate.entropy[r], atol=1e-6)
    assert all(scored.old_logprobs[r] is None for r in on_policy)  # the input batch is not written
    assert result.scored_rows == 4
    assert result.optimizer_steps == 4  # 2 epochs x 2 mini-batches (4 + 2 rows)


def test_skip_streak_counts_consecutive_fully_skipped_updates() -> None:
    def result(skipped: int, steps: int) -> UpdateResult:
        return UpdateResult({}, _batch(), skipped, steps)

    never = lambda: "step_4"  # noqa: E731
    assert skip_streak(0, result(2, 2), 5, never) == 2  # every step skipped: 0 + 2
    assert skip_streak(2, result(1, 1), 5, never) == 3
    assert skip_streak(3, result(1, 2), 5, never) == 0  # one step changed the weights: the streak ends
    with pytest.raises(UserError, match="5 consecutive updates .* Last checkpoint: step_4"):
        skip_streak(3, result(2, 2), 5, never)


COV_LOSSES = {  # ratio 0.5 of the batch's 18 response tokens: 9 chosen (an exact count, no random rounding)
    "clip_cov": ["algo.policy_loss=clip_cov", "algo.policy_clip.clip_cov_ratio=0.5",
                 "algo.policy_clip.clip_cov_lb=-1e6", "algo.policy_clip.clip_cov_ub=1e6"],
    "kl_cov": ["algo.policy_loss=kl_cov", "algo.policy_clip.kl_cov_ratio=0.5"],
}


def _chosen_tokens(loss: str, micro_batch_size: int, reuse: bool) -> set[tuple[int, int]]:
    """(row, response position) of every token the update's micro-batches are told to act on, over one update
    of the whole batch as one mini-batch (train_micro_batch sees them as mb.token_select)."""
    update = _update("algo.mini_batch_size=6", f"algo.micro_batch_size={micro_batch_size}", *COV_LOSSES[loss])
    batch = _batch()
    scored = update.score(batch, step=0) if reuse else update.forward_scores(batch).apply(batch)
    chosen: set[tuple[int, int]] = set()
    train = update.train_micro_batch

    def spy(mb, rows, shared):  # noqa: ANN001, ANN202
        for i, r in enumerate(rows):
            k = len(shared.batch.response_ids[r])
            chosen.update((r, p) for p in torch.nonzero(mb.token_select[i, :k]).flatten().tolist())
        return train(mb, rows, shared)

    update.train_micro_batch = spy
    update.run(scored, _coefs(update), step=0)
    return chosen


@pytest.mark.parametrize("loss", sorted(COV_LOSSES))
def test_cov_losses_choose_their_tokens_over_the_whole_mini_batch(loss: str) -> None:
    """Clip-Cov / KL-Cov: the update scores the mini-batch without gradient first and chooses over all of it,
    so micro-batches of 1, 2 or 6 rows, with the first forward scoring the rows itself or not, act on the
    same 9 tokens (0.5 x 18), not max(1, 0.5 x tokens) per micro-batch."""
    runs = {(m, reuse): _chosen_tokens(loss, m, reuse) for m in (1, 2, 6) for reuse in (False, True)}
    first = runs[(6, False)]
    assert len(first) == 9 and all(chosen == first for chosen in runs.values())
    if loss == "kl_cov":  # the top 9 by cov_i = (A_i - mean A) (logp_i - mean logp), means over the 18 tokens
        update, batch = _update(), _batch()
        rows = list(range(len(batch)))
        with torch.no_grad():
            logp = policy_forward(update.models.engine.module, collate(batch, rows, 0, CPU.device), 1.0,
                                  VOCAB).logprobs
        tokens = [(r, p) for r in rows for p in range(len(batch.response_ids[r]))]
        lp = torch.tensor([float(logp[r, p]) for r, p in tokens], dtype=torch.float64)
        adv = torch.tensor([float(batch.advantages[r]) for r, _ in tokens], dtype=torch.float64)
        # mean A over tokens: (3 + 1 - 4 - 2 + 3 + 5) / 18 = 1/3
        assert float(adv.mean()) == pytest.approx(1 / 3)
        cov = (adv - adv.mean()) * (lp - lp.mean())
        assert first == {tokens[i] for i in torch.topk(cov, 9).indices.tolist()}
