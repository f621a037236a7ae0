"""The rollout-engine port (epo_cli/rollout/engines/) and the mismatch math (epo_cli/algos/rollout_correction.py).

- rollout.engine names an engine of the registry or a plugin's "package.module:Class"; an unknown name fails
  at config time with the valid ones, a plugin module that cannot be found names the fix.
- A plugin engine is one module named on the command line: a training run through the real CLI uses it for
  the rollouts (it counts its calls) and logs the mismatch metrics, which for the hf engine are ~0.
- The mismatch metrics and corrections against values computed by hand.
- LoRA weights reach an engine merged (base + B @ A * scale), as peft's merge_and_unload computes them,
  without changing the trained module.
- rollout.engine=vllm without vLLM installed: one message naming the fix.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from epo_cli.algos.rollout_correction import (
    mismatch_metrics_from_sums,
    mismatch_sums,
    sequence_mask,
    token_tis_weights,
)

# ---- config: the registry and plugins --------------------------------------------------------------------


def test_unknown_engine_fails_at_config_time_listing_the_engines() -> None:
    from epo_cli.compose import compose
    from epo_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.engine.*hf, vllm"):
        compose(["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="plugin module 'no_such_pkg.engines' cannot be found"):
        compose(["rollout.engine=no_such_pkg.engines:Mine"])
    assert compose(["rollout.engine=vllm"]).rollout.engine == "vllm"


PLUGIN = '''
from pathlib import Path

from epo_cli.rollout.engines.hf import HFEngine


class CountingEngine(HFEngine):
    """The hf engine, counting its generate and sync calls into a file (the test reads it)."""

    def generate(self, prompts, params, seeds, logprobs=False):
        with open(Path(__file__).parent / "calls.txt", "a") as f:
            f.write("generate\\n")
        return super().generate(prompts, params, seeds, logprobs)

    def sync_weights(self):
        with open(Path(__file__).parent / "calls.txt", "a") as f:
            f.write("sync\\n")
        super().sync_weights()
'''


def test_a_plugin_engine_named_on_the_command_line_generates_the_rollouts(
        epo_cache: Path, tmp_path: Path, small_config, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import run_cli

    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "my_engines.py").write_text(PLUGIN)
    monkeypatch.setenv("PYTHONPATH", f"{plugin_dir}:{Path(__file__).resolve().parent.parent}")
    run = tmp_path / "run"
    run_cli(["train", "algo=grpo", *small_config.rl("trainer.total_steps=2", "env.max_turns=3",
                                                     "algo.tasks_per_step=1", "algo.group_size=2",
                                                     "rollout.max_new_tokens=12"),
             "rollout.engine=my_engines:CountingEngine", "rollout.mismatch_metrics=true", f"run_dir={run}"],
            cwd=tmp_path)
    calls = (plugin_dir / "calls.txt").read_text().split()
    # one sync at start-up and one after each of the 2 updates; each step's turns generate
    assert calls.count("sync") == 3 and calls.count("generate") >= 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/logp_diff_mean" in r]
    assert len(steps) == 2
    for r in steps:  # the hf engine samples from the module the trainer scores with: only rounding differs
        assert 0 <= r["rollout/logp_diff_mean"] <= r["rollout/logp_diff_max"] < 1e-3
        assert r["rollout/tis_truncated_share"] == 0 and r["rollout/seq_masked_share"] == 0
        assert r["perf/sync_s"] >= 0


# ---- the mismatch math, by hand ------------------------------------------------------------------------


def test_token_tis_weights_are_the_ratio_capped() -> None:
    trainer = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.9)]])
    engine = torch.tensor([[math.log(0.25), math.log(0.6), math.log(0.3)]])
    # ratios 0.5/0.25 = 2, 0.3/0.6 = 0.5, 0.9/0.3 = 3 -> capped at 2.5
    weights = token_tis_weights(trainer, engine, cap=2.5)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 2.5]]), atol=1e-6)


def test_sequence_mask_keeps_rows_whose_geometric_mean_ratio_is_within_bounds() -> None:
    # row 0: log-ratios +1, -1 -> mean 0 -> kept; row 1: +1, +1 (padding ignored) -> mean 1 > log 2 -> dropped;
    # row 2: -0.5 only -> |mean| 0.5 < 0.693 -> kept
    trainer = torch.tensor([[1.0, -1.0], [1.0, 1.0], [-0.5, 9.0]])
    engine = torch.zeros(3, 2)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]], dtype=torch.float32)
    assert sequence_mask(trainer, engine, mask, bound=2.0).tolist() == [True, False, True]


def test_mismatch_metrics_by_hand() -> None:
    correction = SimpleNamespace(token_cap=2.0, seq_bound=2.0)
    engine = [[-1.0, -2.0], [-0.5], None, [-3.0, -1.0]]
    trainer = [torch.tensor([-1.0, -1.0]), torch.tensor([-0.5]), torch.tensor([-7.0]), torch.tensor([-3.0])]
    # row 0: log-ratios 0, +1; row 1: 0; row 2: no engine log-probs; row 3: lengths differ -> both left out
    sums = mismatch_sums(engine, trainer, correction)
    assert sums["tokens"] == 3 and sums["rows"] == 2
    assert sums["abs_diff"] == pytest.approx(1.0) and sums["max_abs_diff"] == pytest.approx(1.0)
    assert sums["k3"] == pytest.approx(math.e - 2)  # (e^1 - 1 - 1) + 0 + 0
    assert sums["truncated"] == 1  # row 0's second token: ratio e^1 = 2.72 > the cap 2
    metrics = mismatch_metrics_from_sums(sums, lambda t: t, lambda t: t, "cpu")
    assert metrics["rollout/logp_diff_mean"] == pytest.approx(1 / 3)
    assert metrics["rollout/mismatch_kl"] == pytest.approx((math.e - 2) / 3)
    assert metrics["rollout/tis_truncated_share"] == pytest.approx(1 / 3)
    assert metrics["rollout/seq_masked_share"] == 0.0  # row 0's mean log-ratio 0.5 < log 2


def test_tokens_past_the_cap_and_masked_rows_are_counted() -> None:
    correction = SimpleNamespace(token_cap=2.0, seq_bound=2.0)
    # row 0: log-ratios 1.0 (ratio 2.72 > 2: truncated), 0 -> mean 0.5 (kept); row 1: 0.8, 0.8 (both past
    # the cap, ratio 2.23) -> mean 0.8 > log 2 = 0.693 (masked)
    engine = [[0.0, 0.0], [0.0, 0.0]]
    trainer = [torch.tensor([1.0, 0.0]), torch.tensor([0.8, 0.8])]
    metrics = mismatch_metrics_from_sums(mismatch_sums(engine, trainer, correction), lambda t: t, lambda t: t, "cpu")
    assert metrics["rollout/tis_truncated_share"] == pytest.approx(3 / 4)
    assert metrics["rollout/seq_masked_share"] == pytest.approx(1 / 2)
    assert metrics["rollout/logp_diff_max"] == pytest.approx(1.0)
    assert mismatch_metrics_from_sums(mismatch_sums(None, trainer, correction), lambda t: t, lambda t: t,
                                      "cpu") == {}


# ---- weights an engine receives --------------------------------------------------------------------------


def test_lora_weights_reach_the_engine_merged_without_changing_the_module() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from epo_cli.rollout.engines.vllm_engine import trained_weights

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=50, tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sent = dict(trained_weights(model))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the module is unchanged
    import copy

    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert "lm_head.weight" in sent  # tied: sent explicitly, else vLLM keeps the old head
    assert set(sent) == set(merged)
    for name, tensor in merged.items():
        assert torch.allclose(sent[name], tensor, atol=1e-6), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(sent[q], before["base_model.model." + q.replace(".weight", ".base_layer.weight")])


# ---- vLLM missing ----------------------------------------------------------------------------------------


def test_vllm_missing_is_one_message(epo_cache: Path, tmp_path: Path, small_config,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import run_epo

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is absent
    result = run_epo(["train", "algo=grpo", *small_config.rl("trainer.total_steps=1"), "rollout.engine=vllm",
                      f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, expect=None)
    assert result.returncode != 0
    assert "rollout.engine=vllm needs vLLM" in result.stderr and "make install VLLM=" in result.stderr
    assert "Traceback" not in result.stderr
