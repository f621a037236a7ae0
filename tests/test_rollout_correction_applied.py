"""rollout.correction.mode: the rollout/training mismatch correction applied in the policy loss (issue 40,
item 3), against values computed by hand, then through the update part and the CLI.

    log_ratio_t = log pi_trainer(y_t) - log pi_engine(y_t),  w_t = min(exp(log_ratio_t), token_cap)
    row kept by the sequence mask iff |mean_t log_ratio_t| <= log(seq_bound)
    pg_t <- pg_t * w_t (tis), * [row kept] (mask), both (tis_and_mask); none: unchanged
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from epo_cli.algos.losses import PolicyClipLoss
from epo_cli.algos.rollout_correction import correction_weights
from tests.conftest import SmallConfig, metrics_rows, run_epo
from tests.test_losses import make_mb, outputs
from tests.test_update import _batch, _update

TRAINER = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
# row 0: log-ratios [0.5, -1.0] (mean -0.25: kept); row 1: [1.0] (mean 1 > log 2: masked); row 2: the engine
# kept no log-probs (weight 1); row 3: padding (weight 1)
ENGINE = [torch.tensor([-1.5, -1.0]), torch.tensor([-2.0]), None, None]


def test_none_is_no_weights() -> None:
    assert correction_weights("none", TRAINER, ENGINE, MASK, cap=1.5, bound=2.0) is None


def test_token_tis_weights_by_hand() -> None:
    w = correction_weights("tis", TRAINER, ENGINE, MASK, cap=1.5, bound=2.0)
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0],  # exp(0.5) = 1.6487 capped at 1.5
                             [1.5, 1.0, 1.0],  # exp(1.0) = 2.718 capped
                             [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(w, expected, atol=1e-6)


def test_sequence_mask_by_hand() -> None:
    w = correction_weights("mask", TRAINER, ENGINE, MASK, cap=1.5, bound=2.0)
    assert w.tolist() == [[1.0] * 3, [0.0] * 3, [1.0] * 3, [1.0] * 3]
    both = correction_weights("tis_and_mask", TRAINER, ENGINE, MASK, cap=1.5, bound=2.0)
    assert torch.allclose(both[0], torch.tensor([1.5, math.exp(-1.0), 1.0]), atol=1e-6)
    assert both[1].tolist() == [0.0] * 3


def test_a_row_whose_engine_log_probs_have_another_length_is_not_corrected() -> None:
    w = correction_weights("tis_and_mask", TRAINER, [torch.tensor([-9.0, -9.0, -9.0])] + ENGINE[1:], MASK,
                           cap=1.5, bound=2.0)
    assert w[0].tolist() == [1.0] * 3


def test_the_policy_loss_multiplies_the_weights_in_by_hand() -> None:
    # ratio 1 (logp = old), A = [1, -1]: pg = [-1, -1 | 1]; weights [2, 0.5 | 3] -> token-mean (-2 - 0.5 + 3)/3
    mb = make_mb([[1, 1], [1, 0]], advantages=torch.tensor([1.0, -1.0]), old_logprobs=torch.zeros(2, 2))
    mb.correction = torch.tensor([[2.0, 0.5], [3.0, 7.0]])  # the padding token's weight never counts
    loss, metrics = PolicyClipLoss()(mb, outputs(torch.zeros(2, 2), old=mb.old_logprobs))
    assert loss.item() == pytest.approx(0.5 / 3, abs=1e-6)
    assert metrics["policy/clipfrac"].item() == 0.0  # the diagnostics are not reweighted


def _policy_only(update) -> dict[str, float]:  # noqa: ANN001
    return {name: 1.0 if name == "policy_clip" else 0.0 for name in update.loss_stack.terms}


def _scored(update):  # noqa: ANN001, ANN202
    """The batch scored by a separate pass (no reuse): its old log-probs are known before the update."""
    return update.forward_scores(_batch()).apply(_batch())


def test_token_tis_scales_the_policy_loss_through_the_update() -> None:
    """One mini-batch, ratio 1: engine log-probs log(1.5) below the trainer's on every token give w = 1.5
    (under the cap 2), so the policy loss is 1.5 times the uncorrected one; mode none ignores them."""
    plain_update = _update("algo.mini_batch_size=8", "algo.micro_batch_size=2")
    scored = _scored(plain_update)
    engine = [lp - math.log(1.5) for lp in scored.old_logprobs]
    plain = plain_update.run(replace(scored, engine_logprobs=engine), _policy_only(plain_update), step=0).metrics
    update = _update("algo.mini_batch_size=8", "algo.micro_batch_size=2", "rollout.correction.mode=tis")
    tis = update.run(replace(_scored(update), engine_logprobs=engine), _policy_only(update), step=0).metrics
    assert plain["loss/policy_clip"] != 0.0
    assert tis["loss/policy_clip"] == pytest.approx(1.5 * plain["loss/policy_clip"], rel=1e-5)


def test_the_sequence_mask_drops_a_row_through_the_update() -> None:
    update = _update("algo.mini_batch_size=8", "algo.micro_batch_size=2", "rollout.correction.mode=mask")
    scored = _scored(update)
    engine = [lp - (1.0 if r == 0 else 0.0) for r, lp in enumerate(scored.old_logprobs)]  # row 0: exp(1) > 2
    masked = update.run(replace(scored, engine_logprobs=engine), _policy_only(update), step=0).metrics
    # ratio 1: pg = -A per token; the token-mean over every token, row 0's weighted 0
    n_tokens = sum(len(r) for r in scored.response_ids)
    kept = sum(float(-scored.advantages[r]) * len(scored.response_ids[r]) for r in range(1, len(scored.response_ids)))
    assert masked["loss/policy_clip"] == pytest.approx(kept / n_tokens, rel=1e-5)


@pytest.mark.timeout(300)
def test_a_run_with_the_correction_on_keeps_the_engine_s_log_probs_and_logs_the_mismatch(tmp_path: Path,
                                                                                        epo_cache: Path) -> None:
    run = tmp_path / "run"
    run_epo(["train", *SmallConfig().rl("algo=grpo", "trainer.total_steps=1", "rollout.correction.mode=tis_and_mask",
                                        "rollout.max_new_tokens=16"), f"run_dir={run}"], cwd=tmp_path)
    (row,) = metrics_rows(run)
    # the hf engine's log-probs come from the module the trainer scores with: a rounding-sized difference
    assert 0.0 <= row["rollout/logp_diff_max"] < 1e-3
    assert row["rollout/seq_masked_share"] == 0.0
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
