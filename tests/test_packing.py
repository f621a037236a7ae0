"""Packed micro-batches: the plan, the layout, and packed == padded for losses and gradients (tiny model)."""

from __future__ import annotations

import pytest
import torch

from epo_cli.algos.aggregation import AGGREGATIONS
from epo_cli.algos.losses import LossStack, PolicyOutputs, ValueLoss, build_loss_terms, loss_coefficients
from epo_cli.rollout.batch import TurnBatch
from epo_cli.training.forward import collate, plan_micro_batches, policy_forward, value_forward
from epo_cli.training.packing import PACKED_SDPA, default_budget, enable_packing, plan_packs

torch.set_num_threads(1)


def test_plan_packs_first_fit_decreasing() -> None:
    # lengths 7, 5, 4, 3, 2, 9 with budget 10, taken longest first (ties by row):
    #   9 (row 5) -> pack A (room 1); 7 (row 0) -> pack B (room 3); 5 (row 1) -> pack C (room 5);
    #   4 (row 2) -> C (room 1); 3 (row 3) -> B (room 0); 2 (row 4) -> no pack has room 2 -> pack D
    lengths = [7, 5, 4, 3, 2, 9]
    assert plan_packs(list(range(6)), lengths, 10) == [[5], [0, 3], [1, 2], [4]]
    # a sample longer than the budget still gets a pack of its own
    assert plan_packs([0, 1], [12, 3], 10) == [[0], [1]]
    assert default_budget([3, 8, 5], 4) == 32


def _batch(vocab: int, seed: int = 0) -> TurnBatch:
    """Nine turn-samples of 3 trajectories with varied prompt/response lengths and random scoring data."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = [5, 9, 12, 7, 3, 11, 8, 6, 10]
    response_lens = [4, 1, 6, 3, 5, 2, 7, 4, 3]
    turn_index = [0, 1, 2, 0, 1, 0, 1, 2, 3]
    num_turns = [3, 3, 3, 2, 2, 4, 4, 4, 4]
    traj = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    n = len(prompt_lens)

    def ids(k: int) -> list[int]:
        return torch.randint(3, vocab, (k,), generator=g).tolist()

    batch = TurnBatch(
        prompt_ids=[ids(k) for k in prompt_lens], response_ids=[ids(k) for k in response_lens],
        traj_id=torch.tensor(traj), group_id=torch.zeros(n, dtype=torch.long),
        turn_index=torch.tensor(turn_index), num_turns=torch.tensor(num_turns),
        reward=torch.zeros(n), outcome=torch.zeros(n), valid=torch.ones(n, dtype=torch.bool),
        won=torch.zeros(n, dtype=torch.bool), task_type=["t"] * n,
    )
    # old / reference log-probs near the model's (about -log 1024 ~ -6.9) so ratios are spread around 1
    batch.old_logprobs = [-6.9 + 0.3 * torch.randn(k, generator=g) for k in response_lens]
    batch.ref_logprobs = [-6.9 + 0.3 * torch.randn(k, generator=g) for k in response_lens]
    batch.entropy = [torch.zeros(k) for k in response_lens]
    batch.advantages = torch.randn(n, generator=g)
    batch.old_values = 0.1 * torch.randn(n, generator=g)
    batch.returns = torch.randn(n, generator=g)
    return batch


def _accumulate(model, batch, groups, packed, terms, coefs, modes, critic=None):
    """Sum of the loss stack (and critic value loss) over micro-batches `groups`, as Trainer.update does:
    weights normalised by the whole set's denominators. Returns (loss, value loss, grads, critic grads)."""
    from epo_cli.training.update import row_denominators as _row_denominators

    den = {m: float(d.sum()) for m, d in _row_denominators(batch, modes, 0.9).items()}
    model.zero_grad()
    if critic is not None:
        critic.zero_grad()
    total, vtotal = 0.0, 0.0
    for rows in groups:
        mb = collate(batch, rows, 0, torch.device("cpu"), packed=packed)
        for m in modes:
            u, _ = AGGREGATIONS[m].weights(mb.response_mask, mb.turn_index, mb.num_turns, 0.9)
            mb.weights[m] = u / den[m]
        # a per-turn smoothing reference, NaN (no history) for turn 0
        mb.entropy_ref = torch.where(mb.turn_index == 0, torch.nan, 0.4 + 0.5 * mb.turn_index.float())
        out = policy_forward(model, mb, temperature=0.7, vocab_limit=None)
        out.log_ratio = out.logprobs - mb.old_logprobs  # as PolicyUpdate.train_micro_batch sets it
        loss, _ = terms(mb, out, coefs)
        loss.backward()
        total += float(loss)
        if critic is not None:
            values = value_forward(critic, mb)
            vloss, _ = ValueLoss(0.5)(mb, PolicyOutputs(logprobs=None, entropy=None, values=values))
            vloss.backward()
            vtotal += float(vloss)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    cgrads = {k: p.grad.clone() for k, p in critic.named_parameters()} if critic is not None else {}
    return total, vtotal, grads, cgrads


def test_packed_equals_padded_losses_and_gradients(tiny_folder) -> None:
    """Full EPO loss stack (policy_clip + kl + entropy + entropy_smoothing) and the PPO critic: packed
    micro-batches (one row, position ids restarting, per-sample attention) give the padded path's losses
    and gradients to 1e-5 in fp32. Attention leaking across samples would break this."""
    from transformers import AutoModelForCausalLM

    from epo_cli.compose import compose
    from epo_cli.models.loading import ValueModel, frozen_copy

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="sdpa").float()
    assert enable_packing(model, None) and model.config._attn_implementation == PACKED_SDPA
    critic = ValueModel(frozen_copy(model))
    for p in critic.parameters():
        p.requires_grad_(True)
    torch.nn.init.normal_(critic.head.weight, std=0.1)  # a non-zero head, so backbone gradients are real

    algo = compose(["algo=epo"]).algo
    terms = LossStack(build_loss_terms(algo))
    coefs = loss_coefficients(algo, entropy_coef=0.05, phase_beta=1.5, kl_weight=0.1)
    modes = sorted({t.aggregation for t in terms.terms.values()} | {"seq-mean-token-mean"})
    batch = _batch(model.config.vocab_size)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    rows = list(range(len(batch)))
    padded_groups = plan_micro_batches(rows, lengths, 4)
    packed_groups = plan_packs(rows, lengths, 40)
    assert len(packed_groups) < len(rows) and any(len(g) > 2 for g in packed_groups)

    ref = _accumulate(model, batch, padded_groups, False, terms, coefs, modes, critic)
    got = _accumulate(model, batch, packed_groups, True, terms, coefs, modes, critic)
    assert ref[0] != 0.0 and ref[1] != 0.0
    assert got[0] == pytest.approx(ref[0], abs=1e-5, rel=1e-5)
    assert got[1] == pytest.approx(ref[1], abs=1e-5, rel=1e-5)
    for name in ("policy", "critic"):
        a, b = (ref[2], got[2]) if name == "policy" else (ref[3], got[3])
        assert a.keys() == b.keys() and a
        for k in a:
            assert float(a[k].abs().max()) > 0 or "head" in k, f"{name} {k}: no gradient"
            diff = float((a[k] - b[k]).abs().max())
            assert diff <= 1e-5 * max(1.0, float(a[k].abs().max())), f"{name} {k}: grads differ by {diff}"


def test_packed_outputs_map_back_to_each_sample(tiny_folder) -> None:
    """Per-token log-probs/entropies of a packed row equal each sample run alone (no neighbour leaks in)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="sdpa").float().eval()
    enable_packing(model, None)
    batch = _batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        packed = policy_forward(model, collate(batch, [2, 0, 5], 0, torch.device("cpu"), packed=True))
        for i, r in enumerate([2, 0, 5]):
            alone = policy_forward(model, collate(batch, [r], 0, torch.device("cpu")))
            k = len(batch.response_ids[r])
            torch.testing.assert_close(packed.logprobs[i, :k], alone.logprobs[0, :k], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(packed.entropy[i, :k], alone.entropy[0, :k], atol=1e-5, rtol=1e-5)
            assert float(packed.logprobs[i, k:].abs().sum()) == 0.0  # padding positions stay 0


def test_padding_micro_batch_has_no_tokens(tiny_folder) -> None:
    """An empty packed micro-batch (ranks with fewer passes) runs, weighs nothing, and backpropagates."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="sdpa").float()
    enable_packing(model, None)
    mb = collate(_batch(model.config.vocab_size), [], 0, torch.device("cpu"), packed=True)
    assert mb.num_real == 0 and int(mb.attention_mask.sum()) == 0 and mb.input_ids.numel() == 1
    out = policy_forward(model, mb)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert out.logprobs.shape == mb.response_mask.shape


def test_unsupported_attention_is_a_config_error(tiny_folder) -> None:
    from transformers import AutoModelForCausalLM

    from epo_cli.errors import ConfigError

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="eager")
    assert enable_packing(model, None) is False  # auto: padded micro-batches, as before
    assert enable_packing(model, 0) is False
    with pytest.raises(ConfigError, match="algo.pack_tokens=0"):
        enable_packing(model, 512)


def test_exported_model_does_not_need_epo(tiny_folder, tmp_path) -> None:
    """The packing attention is a runtime choice: a saved policy loads anywhere, with its plain attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="sdpa")
    enable_packing(model, None)
    model.save_pretrained(tmp_path / "final")
    assert PACKED_SDPA not in (tmp_path / "final" / "config.json").read_text()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert again.config._attn_implementation != PACKED_SDPA


@pytest.mark.parametrize("overrides,message", [
    (["algo.pack_tokens=-1"], "'algo.pack_tokens': -1 is out of range; allowed: 0 <= value"),
    (["algo.pack_tokens=512", "model.attn_implementation=eager"], "model.attn_implementation=sdpa"),
])
def test_bad_packing_config_is_a_config_error(overrides: list[str], message: str) -> None:
    from epo_cli.compose import compose
    from epo_cli.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        compose(overrides)
    compose(["algo.pack_tokens=0", "model.attn_implementation=eager"])  # padded: any attention is fine


@pytest.mark.slow
def test_cli_packed_and_reused_equals_padded(warm_start, tmp_path) -> None:
    """Through `epo train`: packed micro-batches + scoring reuse (the defaults) against padded micro-batches
    with a separate scoring pass give the same iteration (same rollout, same losses), and the packed run
    computes no padding."""
    from conftest import SmallConfig, metrics_rows, only_run_dir, run_epo

    common = ["algo=epo", f"model.path={warm_start / 'final'}", "trainer.total_steps=1",
              *SmallConfig().run("algo.tasks_per_step=2", "algo.group_size=4", "trainer.eval_every=0")]
    rows = {}
    for name, extra in (("packed", []), ("padded", ["algo.pack_tokens=0", "algo.reuse_scoring_forward=false"])):
        out = tmp_path / name
        out.mkdir()
        run_epo(["train", *common, *extra, f"output_dir={out}", f"name={name}"], cwd=out)
        rows[name] = metrics_rows(only_run_dir(out))[0]
    packed, padded = rows["packed"], rows["padded"]
    assert packed["perf/padding_efficiency"] == 1.0 and padded["perf/padding_efficiency"] < 0.99
    assert packed["perf/scoring_reused"] > 0 and padded["perf/scoring_reused"] == 0.0
    assert packed["rollout/samples"] == padded["rollout/samples"]
    for key in ("loss/policy_clip", "loss/kl", "loss/entropy", "policy/entropy", "policy/clipfrac"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
