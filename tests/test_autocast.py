"""model.autocast=bf16: fp32 weights whose forward passes run in bfloat16 (epo_cli/runtime/precision.py).

What it must do: every forward of a run (the hf engine's generation, scoring, the update's forward) computes
its matmuls in bf16 while the weights and their gradients stay fp32; the PPO ratio's two log-probs come from
the same precision, so an update's first mini-batch starts at ratio 1 exactly (a scoring forward in another
precision would not: shown below); a setting that would change nothing is refused with the fix.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from test_update import SGDEngine
from torch import nn

from epo_cli.algos.losses import LossStack, build_loss_terms
from epo_cli.compose import compose
from epo_cli.errors import ConfigError, UserError
from epo_cli.rollout.batch import TurnBatch
from epo_cli.runtime.precision import autocast, autocast_dtype
from epo_cli.training.engine import DistInfo, RolloutModule
from epo_cli.training.forward import collate, policy_forward
from epo_cli.training.models import Models
from epo_cli.training.settings import update_settings
from epo_cli.training.update import PolicyUpdate

from conftest import metrics_rows, one_error, only_run_dir, run_epo

VOCAB = 32
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class MatmulLM(nn.Module):
    """A causal LM of two Linear layers (autocast acts on matmuls) that records its hidden layer's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.seen: list[torch.dtype] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0):  # noqa: ANN001, ANN201
        h = self.mix(self.embed(input_ids)) * attention_mask[..., None]  # bf16 under autocast; padding: 0
        self.seen.append(h.dtype)
        logits = self.head(torch.tanh(h.cumsum(1)))
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def _batch() -> TurnBatch:
    """Four one-turn samples of one group, advantages +-1."""
    g = torch.Generator().manual_seed(0)
    n = 4
    return TurnBatch(
        prompt_ids=[torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (5, 3, 6, 4)],
        response_ids=[torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (3, 4, 2, 5)],
        traj_id=torch.arange(n), group_id=torch.zeros(n, dtype=torch.long), turn_index=torch.zeros(n, dtype=torch.long),
        num_turns=torch.ones(n, dtype=torch.long), reward=torch.zeros(n), outcome=torch.zeros(n),
        valid=torch.ones(n, dtype=torch.bool), won=torch.zeros(n, dtype=torch.bool), task_type=["t"] * n,
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]))


def _update(autocast_to: torch.dtype | None) -> PolicyUpdate:
    """GRPO's update part (policy_clip only, scoring in its own forward) on MatmulLM (seed 0)."""
    cfg = compose(["algo=grpo", "algo.loss_terms=[policy_clip]", "algo.pack_tokens=0",
                   "algo.reuse_scoring_forward=false", "algo.mini_batch_size=4", "algo.micro_batch_size=2"])
    torch.manual_seed(0)
    engine = SGDEngine(MatmulLM(), lr=1e-2)  # the update tests' engine stand-in
    models = Models(SimpleNamespace(pad_token_id=0), VOCAB, False, engine, RolloutModule(engine, None, 0), None,
                    autocast_to=autocast_to)
    return PolicyUpdate(update_settings(cfg), CPU, models, LossStack(build_loss_terms(cfg.algo)))


def test_the_setting_resolves_to_a_dtype_and_refuses_weights_that_are_bf16_already() -> None:
    assert autocast_dtype(SimpleNamespace(autocast="none", dtype="auto"), torch.float32) is None
    assert autocast_dtype(SimpleNamespace(autocast="bf16", dtype="auto"), torch.float32) is torch.bfloat16
    with pytest.raises(UserError, match=r"weights here are bfloat16 \(model.dtype=auto.*Fix: model.dtype=fp32"):
        autocast_dtype(SimpleNamespace(autocast="bf16", dtype="auto"), torch.bfloat16)  # auto on a GPU
    with pytest.raises(ConfigError, match="model.dtype=bf16 makes the weights bf16 already"):
        compose(["model.autocast=bf16", "model.dtype=bf16"])
    with pytest.raises(ConfigError, match="model.autocast"):
        compose(["model.autocast=fp16"])


def test_the_forward_runs_in_bf16_and_its_log_probs_stay_fp32_and_close() -> None:
    """Under autocast the hidden layer is bf16, the log-probs fp32; they differ from fp32's by bf16's rounding
    (nonzero: the autocast acted, small: |d log p| < 0.05 on these logits)."""
    torch.manual_seed(0)
    model = MatmulLM()
    mb = collate(_batch(), [0, 1, 2, 3], 0, CPU.device)
    fp32 = policy_forward(model, mb, 1.0, VOCAB)
    bf16 = policy_forward(model, mb, 1.0, VOCAB, autocast_to=torch.bfloat16)
    assert model.seen == [torch.float32, torch.bfloat16]
    assert bf16.logprobs.dtype == bf16.entropy.dtype == torch.float32
    diff = (bf16.logprobs - fp32.logprobs)[mb.response_mask].abs()
    assert 0 < float(diff.max()) < 0.05


def test_an_update_in_bf16_starts_at_ratio_one_and_keeps_fp32_weights_and_gradients() -> None:
    """Scoring and the update's forward share the precision: the first mini-batch's log-ratio is exactly 0
    (approx_kl 0, nothing clipped). Scored in fp32 and updated in bf16 it is not (the rounding of one precision
    against the other), which is why every forward of a run enters the same autocast."""
    update = _update(torch.bfloat16)
    batch = update.forward_scores(_batch()).apply(_batch())
    result = update.run(batch, {"policy_clip": 1.0}, step=0)
    assert result.metrics["policy/approx_kl"] == 0.0 and result.metrics["policy/clipfrac"] == 0.0
    module = update.models.engine.module
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(s is torch.bfloat16 for s in module.seen)

    mixed = _update(torch.bfloat16)
    mixed.models.autocast_to = None  # score in fp32 ...
    scored = mixed.forward_scores(_batch()).apply(_batch())
    mixed.models.autocast_to = torch.bfloat16  # ... and update in bf16
    assert mixed.run(scored, {"policy_clip": 1.0}, step=0).metrics["policy/approx_kl"] > 0


def test_the_hf_engine_generates_in_bf16_and_evaluation_builds_it_so(tiny_folder) -> None:  # noqa: ANN001
    """`epo eval`'s engine (evaluation_policy) of a run with model.autocast=bf16 generates with bf16 matmuls
    (the attention's output projection, hooked), and with model.autocast=none in fp32."""
    from epo_cli.models.loading import load_causal_lm, load_tokenizer
    from epo_cli.rollout.engines.build import evaluation_policy
    from epo_cli.rollout.generation import SamplingConfig

    cfg = compose([f"model.path={tiny_folder}"])
    tokenizer = load_tokenizer(str(tiny_folder), cfg.model)
    model = load_causal_lm(str(tiny_folder), cfg.model, torch.float32).eval()
    seen: list[torch.dtype] = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    prompt = tokenizer("go to the kitchen")["input_ids"]
    for setting, dtype in (("none", torch.float32), ("bf16", torch.bfloat16)):
        seen.clear()
        cfg.model.autocast = setting
        engine = evaluation_policy(model, tokenizer, cfg, str(tiny_folder), 1.0).engine
        engine.generate([prompt], SamplingConfig(max_new_tokens=3), seeds=[0])
        assert seen and set(seen) == {dtype}, (setting, seen)


def test_a_cpu_without_bf16_instructions_is_warned_about(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """/proc/cpuinfo's flags decide: avx512_bf16 or amx_bf16 -> no warning; neither -> one warning naming the
    cost and the fix; no flags line (not x86) or no file -> unknown, no warning."""
    import epo_cli.runtime.precision as precision

    cfg = SimpleNamespace(autocast="bf16", dtype="auto")
    cases = {"flags\t\t: fpu avx2 avx512f avx512_bf16\n": True, "flags\t\t: fpu avx2 avx512f\n": False,
             "processor\t: 0\n": None}
    for text, has in cases.items():
        (tmp_path / "cpuinfo").write_text(text)
        assert precision.cpu_has_bf16(tmp_path / "cpuinfo") is has
    assert precision.cpu_has_bf16(tmp_path / "missing") is None
    for has in (True, None, False):
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda has=has: has)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert precision.autocast_dtype(cfg, torch.float32, "cpu") is torch.bfloat16
            precision.autocast_dtype(cfg, torch.float32, "cuda")  # a GPU: the CPU's flags say nothing
        assert [str(w.message) for w in caught if "emulated" in str(w.message)] == (
            [] if has is not False else [next(str(w.message) for w in caught)])
        if has is False:
            assert "model.autocast=none is faster here" in str(caught[0].message)


def test_autocast_is_nothing_for_none() -> None:
    with autocast(None, "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(torch.bfloat16, "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16


def test_train_and_eval_through_the_cli_in_bf16(tmp_path, small_config, epo_cache) -> None:  # noqa: ANN001
    """The tiny model, 2 RL iterations with model.autocast=bf16: the hf engine generates and the update trains
    (finite losses, the setting saved in the run's config), and `epo eval` of the run plays in the same
    precision; next to it, model.dtype=bf16 with autocast is one error naming the fix."""
    run_epo(["train", *small_config.rl("algo=grpo", "trainer.total_steps=2", "model.autocast=bf16"),
             f"output_dir={tmp_path}", "name=bf16"], cwd=tmp_path)
    run = only_run_dir(tmp_path)
    rows = [r for r in metrics_rows(run) if "loss/policy_clip" in r]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss/policy_clip"])) for r in rows)
    assert "autocast: bf16" in (run / "config.yaml").read_text()
    out = run_epo(["eval", f"run={run}", "episodes=2", f"out={tmp_path / 'eval'}"], cwd=tmp_path)
    assert "success" in out.stdout
    refused = run_epo(["train", *small_config.rl("algo=grpo", "model.autocast=bf16", "model.dtype=bf16"),
                       f"output_dir={tmp_path / 'refused'}"], cwd=tmp_path, expect=2)
    one_error(refused, "model.dtype=fp32")
