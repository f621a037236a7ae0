"""`epo plan` (epo_cli/analysis/plan.py): the figures against values computed by hand, the fit verdict and the
suggested change, the cost of an iteration, the CLI, bad input, and that it never imports torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from epo_cli.analysis.plan import (
    GIB,
    GPU_RESERVE_GIB,
    Architecture,
    Planner,
    architecture,
    current_setup,
    make_plan,
    model_states,
    policy_activations,
)
from epo_cli.compose import compose
from tests.conftest import REPO, run_epo
from tests.test_recipes import RECIPES

# model=tiny: hidden 64, intermediate 256, 2 layers, 4 heads (head dim 16), 2 KV heads (kv_dim 32), vocab 1024, tied
TINY_LAYER = (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64) + (64 + 32 + 32) + 3 * 64 * 256 + 2 * 64  # = 61,696
TINY_PARAMS = 1024 * 64 + 2 * TINY_LAYER + 64  # embedding + layers + final norm = 188,992


def test_tiny_parameter_count_by_hand_and_as_built() -> None:
    arch, softmax_vocab = architecture(compose(["model=tiny"]).model)
    assert TINY_LAYER == 61_696 and TINY_PARAMS == 188_992
    assert arch.layer_params() == TINY_LAYER and arch.params() == TINY_PARAMS and softmax_vocab == 1024
    assert arch.largest_layer_params() == 1024 * 64
    from transformers import Qwen2Config, Qwen2ForCausalLM  # the model the trainer builds for model=tiny

    built = Qwen2ForCausalLM(Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    assert sum(p.numel() for p in built.parameters()) == TINY_PARAMS


def test_hub_parameter_counts_match_the_published_sizes() -> None:
    expected = {"qwen2.5-0.5b": 0.494e9, "qwen2.5-1.5b": 1.544e9, "qwen2.5-3b": 3.086e9, "qwen2.5-7b": 7.616e9}
    for preset, params in expected.items():
        arch, _ = architecture(compose([f"model={preset}"]).model)
        assert arch.params() == pytest.approx(params, rel=2e-3), preset


def test_model_states_by_hand() -> None:
    P = TINY_PARAMS
    # fp32 on 2 CPU ranks: ZeRO-0 16P; ZeRO-1 weights+grads 8P, master+moments 12P/2; ZeRO-2 grads also /2;
    # ZeRO-3 all /2
    assert model_states(P, 0, 2, "fp32").total == 16 * P
    assert model_states(P, 1, 2, "fp32").total == 8 * P + 6 * P
    s2 = model_states(P, 2, 2, "fp32")
    assert (s2.weights, s2.grads, s2.optimizer) == (4 * P, 2 * P, 6 * P)
    assert model_states(P, 3, 2, "fp32").total == 10 * P
    # bf16 = DeepSpeed's estimators: zero2 2P + 18P/N; zero3 18P/N (+ 4 x largest layer, counted apart)
    assert model_states(P, 2, 8, "bf16").total == pytest.approx(2 * P + 18 * P / 8)
    assert model_states(P, 1, 8, "bf16").total == pytest.approx(4 * P + 16 * P / 8)
    assert model_states(P, 3, 8, "bf16").total == pytest.approx(18 * P / 8)
    off = model_states(P, 2, 8, "bf16", offload_optimizer=True)
    assert off.total == 2 * P and off.host == P * max(4 * 8, 16) * 1.5
    both = model_states(P, 3, 8, "bf16", offload_optimizer=True, offload_param=True)
    assert both.total == 0 and both.host == 18 * P * 1.5


@pytest.mark.parametrize("ranks,nodes", [(1, 1), (8, 1), (16, 2)])
def test_bf16_states_are_deepspeeds_own_estimates(ranks: int, nodes: int) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    arch, _ = architecture(compose(["model=qwen2.5-7b"]).model)
    P, L = arch.params(), arch.largest_layer_params()
    per_node = ranks // nodes
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(P, per_node, nodes, cpu_offload=offload)
        ours = model_states(P, 2, ranks, "bf16", offload_optimizer=offload, nodes=nodes)
        assert ours.total == pytest.approx(gpu, abs=1)
        if offload:
            assert ours.host == pytest.approx(cpu, abs=1)
    for offload, offload_params in ((False, False), (True, False), (True, True)):
        cpu, gpu, largest = estimate_zero3_model_states_mem_needs(P, L, per_node, nodes, cpu_offload=offload,
                                                                  cpu_offload_params=offload_params)
        ours = model_states(P, 3, ranks, "bf16", offload, offload_params, nodes=nodes)
        assert ours.total + 4 * L == pytest.approx(gpu, abs=1) and largest == 4 * L
        if offload:
            assert ours.host == pytest.approx(cpu, abs=1)


def test_activations_and_kv_cache_by_hand() -> None:
    arch = Architecture(64, 256, 2, 4, 2, 1024, tied=True)
    # fp32, micro-batch 2 of 10 prompt + 6 response tokens = 32 tokens; per token and layer 4 x (11 x 64 + 2 x 32 +
    # 4 x 256) = 7,168 bytes; embeddings 32 x 64 x 4; logits at 2 x 6 response tokens x (1024 x 4 + 16 x 1024)
    plain = 32 * 2 * 7168 + 32 * 64 * 4 + 12 * (1024 * 4 + 16 * 1024)
    assert policy_activations(arch, 1024, 2, 10, 6, 4, checkpointing=False) == plain == 712_704
    # checkpointing: each layer keeps its input (64 x 4 bytes per token) and one layer is recomputed at a time
    ckpt = 32 * (2 * 64 * 4 + 7168) + 32 * 64 * 4 + 12 * (1024 * 4 + 16 * 1024)
    assert policy_activations(arch, 1024, 2, 10, 6, 4, checkpointing=True) == ckpt
    cfg = compose(["model=tiny", "algo=grpo", "algo.tasks_per_step=2", "algo.group_size=4", "algo.micro_batch_size=2",
                   "algo.mini_batch_size=8", "rollout.max_prompt_tokens=10", "rollout.max_new_tokens=6"])
    planner = Planner(cfg, gpu_mem_gib=80, device="cpu")
    est = planner.estimate(current_setup(cfg, gpus=2))
    assert est.parts["activations (1 micro-batch)"] == plain
    # KV cache: 8 rollouts / 2 ranks = 4 rows x 16 tokens x 2 layers x (k, v) x kv_dim 32 x 4 bytes
    assert est.parts["rollout KV cache"] == 4 * 16 * 2 * 2 * 32 * 4
    assert est.parts["reference model"] == 4 * TINY_PARAMS  # grpo has a kl term: a full fp32 copy
    assert est.parts["reserve (CUDA, NCCL)"] == 0  # CPU ranks
    states = 4 * TINY_PARAMS + 4 * TINY_PARAMS + 8 * TINY_PARAMS  # ZeRO-0 fp32
    assert est.peak == states + 4 * TINY_PARAMS + max(plain, 4 * 16 * 2 * 2 * 32 * 4)


def test_critic_and_zero3_copies_are_counted() -> None:
    cfg = compose(["model=tiny", "algo=ppo", "deepspeed=zero3", "algo.micro_batch_size=2", "algo.mini_batch_size=8"])
    planner = Planner(cfg, gpu_mem_gib=80, device="cpu")
    est = planner.estimate(current_setup(cfg, gpus=2))
    critic = TINY_PARAMS + 64 + 1  # the backbone (tied: no separate lm_head) and the value head
    assert planner.critic_params == critic
    assert est.parts["critic states"] == pytest.approx(10 * critic)  # fp32 ZeRO-3 on 2 ranks: 20P/2
    assert est.parts["ZeRO-3 inference copy"] == 4 * (TINY_PARAMS + critic)
    assert est.parts["ZeRO-3 gathered layer"] == 4 * 1024 * 64


def test_lora_trains_only_its_adapters_by_hand_and_as_peft_builds_them() -> None:
    # rank 4 on q, k, v, o of model=tiny: per layer 4 x ((64+64) + (64+32) + (64+32) + (64+64)) = 1,792; 2 layers
    adapters = 2 * 4 * (128 + 96 + 96 + 128)
    cfg = compose(["model=tiny", "algo=grpo", "model.lora.rank=4"])
    planner = Planner(cfg, gpu_mem_gib=80, device="cpu")
    assert planner.adapter_params == adapters == 3_584
    est = planner.estimate(current_setup(cfg, gpus=1))
    # fp32 ZeRO-0: the frozen base's weights (4P), the adapters' weights, gradients and Adam moments (16A)
    assert est.parts["policy weights"] == 4 * TINY_PARAMS + 4 * adapters
    assert (est.parts["policy gradients"], est.parts["policy optimizer"]) == (4 * adapters, 8 * adapters)
    assert est.parts["reference model"] == 4 * TINY_PARAMS  # the KL's reference is still a whole copy
    # ZeRO-3 on 2 ranks partitions the frozen base too
    z3 = Planner(compose(["model=tiny", "algo=grpo", "model.lora.rank=4", "deepspeed=zero3",
                          "algo.micro_batch_size=4"]), gpu_mem_gib=80, device="cpu")
    assert z3.estimate(current_setup(z3.cfg, gpus=2)).parts["policy weights"] == 2 * TINY_PARAMS + 2 * adapters
    # parameters offloaded as well: the frozen base's 4P leaves the device for the host (x 1.5, one node), beside
    # the adapters' 18A x 1.5
    off = z3.estimate(dataclasses.replace(current_setup(z3.cfg, gpus=2), offload_param=True, offload_optimizer=True))
    assert off.parts["policy weights"] == 0.0
    assert off.host_per_node == pytest.approx(4 * TINY_PARAMS * 1.5 + 18 * adapters * 1.5)
    import torch  # peft's own count on the model the trainer builds
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from epo_cli.models.loading import apply_lora

    torch.manual_seed(0)
    built = apply_lora(Qwen2ForCausalLM(Qwen2Config(
        vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)), cfg.model.lora)
    assert sum(p.numel() for p in built.parameters() if p.requires_grad) == adapters
    # every linear LoRA can target: gate, up (64 -> 256) and down (256 -> 64) add 3 x 4 x 320 per layer
    mlp = Planner(compose(["model=tiny", "model.lora.rank=4",
                           "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]),
                  gpu_mem_gib=80, device="cpu")
    assert mlp.adapter_params == adapters + 2 * 3 * 4 * 320
    # a module the plan does not know: counted as full fine-tuning, and said
    plan = make_plan(compose(["model=tiny", "model.lora.rank=4", "model.lora.target_modules=[lm_head]"]),
                     gpus=1, device="cpu")
    assert plan.estimate.parts["policy gradients"] == 4 * TINY_PARAMS
    assert any("not modelled" in note for note in plan.notes)


def test_autocast_is_said_not_modelled_and_changes_no_figure() -> None:
    """model.autocast=bf16: the plan counts fp32 forwards and the throughput's rates, and says so."""
    fp32 = make_plan(compose(["model=tiny"]), gpus=1, device="cpu")
    mixed = make_plan(compose(["model=tiny", "model.autocast=bf16"]), gpus=1, device="cpu")
    assert mixed.estimate.parts == fp32.estimate.parts and mixed.time == fp32.time
    added = [n for n in mixed.notes if n not in fp32.notes]
    assert len(added) == 1 and added[0].startswith("model.autocast=bf16 is not modelled"), added


def test_lora_update_costs_two_thirds_of_full_fine_tuning(tmp_path: Path) -> None:
    # a training token costs 6 FLOPs per parameter (2 forward, 2 activation gradients, 2 weight gradients);
    # LoRA's frozen base skips the weight gradients: 4 of 6. Forward-only passes (here the reference) keep theirs.
    base = ["model=qwen2.5-0.5b-random", "algo=grpo", "algo.tasks_per_step=2", "algo.group_size=4",
            "env.max_turns=5", "rollout.max_prompt_tokens=100", "rollout.max_new_tokens=20",
            "algo.mini_batch_size=40", "algo.micro_batch_size=4"]
    result = tmp_path / "gpu_check.json"
    result.write_text(json.dumps({"rollout_tokens_per_s": 100.0, "update_tokens_per_s": 1000.0, "device": "cpu"}))
    full = make_plan(compose(base), gpus=1, device="cpu", throughput_file=str(result))
    lora = make_plan(compose([*base, "model.lora.rank=8"]), gpus=1, device="cpu", throughput_file=str(result))
    # 40 samples x 120 tokens trained; the first mini-batch scored by the update (reuse), the reference forward
    assert full.time["update_and_scoring_s"] == pytest.approx((4800 + 4800 / 3) / 1000)
    assert lora.time["update_and_scoring_s"] == pytest.approx((4800 * 4 / 6 + 4800 / 3) / 1000)
    assert lora.time["generation_s"] == full.time["generation_s"]
    # with checkpointing the recomputed forward (a third) comes on top of either
    ckpt = make_plan(compose([*base, "model.lora.rank=8", "model.gradient_checkpointing=true"]), gpus=1,
                     device="cpu", throughput_file=str(result))
    assert ckpt.time["update_and_scoring_s"] == pytest.approx((4800 * (4 / 6 + 1 / 3) + 4800 / 3) / 1000)


def test_a_run_that_does_not_fit_gets_the_cheapest_single_fix() -> None:
    # 7B under ZeRO-0 in bf16 holds 20 bytes/param = 152 GB per GPU; ZeRO-1 on 8 GPUs brings the states to
    # 4P + 16P/8 = 6P = 46 GB, which with the reference (2P) and short sequences fits 80 GiB
    cfg = compose(["model=qwen2.5-7b", "algo=grpo", "deepspeed=zero0", "launcher=deepspeed", "launcher.num_gpus=8",
                   "algo.micro_batch_size=1", "algo.mini_batch_size=64", "algo.tasks_per_step=8",
                   "rollout.max_prompt_tokens=512", "rollout.max_new_tokens=64"])
    plan = make_plan(cfg, gpu_mem_gib=80)
    assert plan.gpus == 8 and not plan.estimate.fits
    assert plan.estimate.peak / GIB > 150
    assert plan.suggestions[0]["change"] == "deepspeed=zero1"
    assert plan.suggestions[0]["peak_gib"] <= 80
    # each suggestion really fits when applied
    applied = make_plan(compose([*cfg_overrides(cfg), "deepspeed=zero1"]), gpu_mem_gib=80)
    assert applied.estimate.fits and applied.estimate.peak / GIB == pytest.approx(plan.suggestions[0]["peak_gib"])


def cfg_overrides(cfg) -> list[str]:
    return ["model=qwen2.5-7b", "algo=grpo", "launcher=deepspeed", "launcher.num_gpus=8", "algo.micro_batch_size=1",
            "algo.mini_batch_size=64", "algo.tasks_per_step=8", "rollout.max_prompt_tokens=512",
            "rollout.max_new_tokens=64"]


def test_activation_bound_run_is_fixed_by_a_smaller_micro_batch() -> None:
    # already ZeRO-3 with checkpointing: what is left to trade is the micro-batch (logits of 32 x 512 tokens)
    cfg = compose(["experiment=paper/epo_alfworld_grpo_epo_3b"])
    plan = make_plan(cfg, gpus=8, gpu_mem_gib=80)
    assert not plan.estimate.fits
    assert plan.suggestions[0]["change"] == "algo.micro_batch_size=16"
    fixed = make_plan(compose(["experiment=paper/epo_alfworld_grpo_epo_3b", "algo.micro_batch_size=16"]), gpus=8,
                      gpu_mem_gib=80)
    assert fixed.estimate.fits
    # more GPUs are only offered in layouts `epo train` accepts: 16 tasks per step split evenly over the ranks
    assert not any(f["change"].startswith("--gpus 32") for f in plan.suggestions)


def test_iteration_cost_from_a_gpu_check_file(tmp_path: Path) -> None:
    cfg = compose(["model=qwen2.5-0.5b-random", "algo=grpo", "algo.tasks_per_step=2", "algo.group_size=4",
                   "env.max_turns=5", "rollout.max_prompt_tokens=100", "rollout.max_new_tokens=20",
                   "algo.mini_batch_size=40", "algo.micro_batch_size=4", "algo.reuse_scoring_forward=false"])
    result = tmp_path / "gpu_check.json"
    result.write_text(json.dumps({"rollout_tokens_per_s": 100.0, "update_tokens_per_s": 1000.0,
                                  "model": "qwen2.5-0.5b-random", "device": "test"}))
    plan = make_plan(cfg, gpus=1, throughput_file=str(result))
    t = plan.tokens
    assert (t["episodes"], t["turn_samples"], t["generated_tokens"], t["prefill_tokens"]) == (8, 40, 800, 4000)
    assert "scaled from qwen2.5-0.5b-random" in plan.time["throughput_source"]  # the same model: factor 1
    # generation: 800 decoded tokens at 100/s, and the 4000 prompt tokens' prefill as forward-only (a third of
    # a training token) at 1000/s; update: 40 x 120 trained tokens, plus the old policy's scoring (no reuse) and
    # the reference, 2 x 4800 / 3 forward-only tokens, at 1000 tokens/s
    assert plan.time["generation_s"] == pytest.approx(8.0 + 4000 / 3 / 1000)
    assert plan.time["update_and_scoring_s"] == pytest.approx((4800 + 2 * 4800 / 3) / 1000)
    # a file measured on the CPU, for a GPU plan (and a CUDA one for a CPU plan): said in a note
    for measured, device, warned in (("cpu", "gpu", True), ("cuda:0", "gpu", False), ("cuda", "cpu", True)):
        result.write_text(json.dumps({"rollout_tokens_per_s": 100.0, "update_tokens_per_s": 1000.0,
                                      "model": "qwen2.5-0.5b-random", "device": measured}))
        notes = make_plan(cfg, gpus=1, device=device, throughput_file=str(result)).notes
        assert any("measured on" in note for note in notes) == warned, (measured, device, notes)
    # without a file: 120 effective TFLOP/s over 6 FLOPs per parameter and token, per GPU; 2 GPUs halve the time
    default = make_plan(cfg, gpus=1)
    assert default.time["update_tokens_per_s_per_gpu"] == pytest.approx(120e12 / (6 * default.params))
    two = make_plan(cfg, gpus=2)
    assert two.time["update_and_scoring_s"] == pytest.approx(default.time["update_and_scoring_s"] / 2)
    # a CPU rank's defaults: 0.07 TFLOP/s of training, and decoding that reads the fp32 weights at 1.5 GB/s for
    # all 8 rows of a step
    cpu = make_plan(cfg, gpus=1, device="cpu")
    assert cpu.time["throughput_source"] == "default (cpu)" and default.time["throughput_source"] == "default (gpu)"
    assert cpu.time["update_tokens_per_s_per_gpu"] == pytest.approx(0.07e12 / (6 * cpu.params))
    assert cpu.time["rollout_tokens_per_s_per_gpu"] == pytest.approx(8 / (4 * cpu.params / 1.5e9))


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_of_each_recipe_on_80_and_24_gib(recipe: str) -> None:
    for gib in (80, 24):
        plan = make_plan(compose([f"experiment={recipe}"]), gpus=8, gpu_mem_gib=gib)
        parts = plan.estimate.parts
        unshardable = parts["ZeRO-3 inference copy"] + parts["reference model"] + parts["reserve (CUDA, NCCL)"]
        if not (plan.estimate.fits or plan.suggestions):  # only where the full per-rank copies alone exceed it
            assert unshardable > 0.9 * gib * GIB and any("full copies" in n for n in plan.notes), recipe
        for fix in plan.suggestions:
            assert fix["peak_gib"] <= gib


def test_cli_table_and_json(tmp_path: Path) -> None:
    proc = run_epo(["plan", "experiment=paper/gigpo_alfworld_1.5b", "--gpus", "8", "--gpu-mem", "24"], tmp_path)
    assert "8 GPUs x 24 GiB" in proc.stdout and "peak" in proc.stdout
    # a CPU plan speaks of CPU ranks, not GPUs
    proc = run_epo(["plan", "model=tiny", "algo=grpo", "--device", "cpu", "--gpu-mem", "16"], tmp_path)
    assert "1 CPU rank x 16 GiB: fits" in proc.stdout and "per GPU" not in proc.stdout, proc.stdout
    proc = run_epo(["plan", "model=tiny", "algo=grpo", "--json", "--device", "cpu"], tmp_path)
    data = json.loads(proc.stdout)
    assert data["params"] == TINY_PARAMS and data["precision"] == "fp32" and data["gpus"] == 1
    assert data["estimate"]["fits"] is True and data["estimate"]["peak_gib"] > 0
    # the launcher's world size is the default
    data = json.loads(run_epo(["plan", "model=tiny", "algo=grpo", "launcher=deepspeed", "launcher.num_gpus=4",
                               "--json"], tmp_path).stdout)
    assert data["gpus"] == 4 and data["estimate"]["parts"]["reserve (CUDA, NCCL)"] == GPU_RESERVE_GIB * GIB


def test_bad_input_is_one_clear_message(tmp_path: Path) -> None:
    proc = run_epo(["plan", "model=tiny", "algo=grpo", "--throughput", str(tmp_path / "none.json")], tmp_path,
                   expect=None)
    assert proc.returncode != 0 and "no such file" in proc.stderr and "gpu_check.py" in proc.stderr
    assert "Traceback" not in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"rollout_tokens_per_s": "fast"}')
    proc = run_epo(["plan", "algo=grpo", "--throughput", str(bad)], tmp_path, expect=None)
    assert proc.returncode != 0 and "not a gpu_check result" in proc.stderr
    proc = run_epo(["plan", "model=qwen2.5-3b", "model.path=some/unknown-model", "algo=grpo"], tmp_path, expect=None)
    assert proc.returncode != 0 and "does not know the shape" in proc.stderr and "config.json" in proc.stderr
    proc = run_epo(["plan", "algo=grpo", "--gpus", "0"], tmp_path, expect=None)
    assert proc.returncode != 0 and "--gpus 0" in proc.stderr


def test_plan_imports_no_torch() -> None:
    code = ("import sys; from epo_cli.compose import compose; from epo_cli.analysis.plan import make_plan, render; "
            "render(make_plan(compose(['experiment=paper/epo_alfworld_ppo_epo_3b']), gpu_mem_gib=24)); "
            "bad = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "does not fit" in proc.stdout
