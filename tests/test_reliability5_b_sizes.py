"""Issue 41, class 5: memory refusals that cover every size, and bounds that cover every loop.

Sizes each under their bound but together too large, and sizes the estimate left out (attention heads, LoRA's
rank, the episodes one evaluation generates for at once), used to pass the memory check and end in an
allocator traceback or MemoryError minutes later; `algo.ppo_epochs=1e9` and `env.num_games=1e9` had no
bound (a step or the game generation that never ends) and `rollout.temperature=1e-300` passed the checks
(then non-finite weights were blamed). Each row is now one message before anything is allocated or written;
every row failed on the code before this change.

The machine's memory is fixed at 16 GiB here (the rows must not depend on the machine that runs them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from epo_cli.analysis import memory

from conftest import SmallConfig, one_error, run_epo

GIB = 1024**3
BIG_MODEL = ["model.hidden_size=1024", "model.intermediate_size=4096", "model.num_hidden_layers=16",
             "model.num_attention_heads=16"]

#: (overrides, texts the one message holds)
TOO_LARGE = [
    # each size under its bound, together too large: the rollout batch's KV cache and prefill
    (["algo=grpo", *BIG_MODEL, "algo.tasks_per_step=64", "algo.group_size=64", "env.max_turns=30"],
     ["algo.tasks_per_step=64", "algo.group_size=64", "generating for 4.1e+03 rows at once",
      "rollout.generation_batch_size=N"]),
    # the attention scores of a training micro-batch grow with the heads
    (["model.hidden_size=1024", "model.num_attention_heads=1024"],
     ["model.num_attention_heads=1024", "one training micro-batch", "attention scores"]),
    # LoRA's adapters and their rank-wide intermediates
    (["algo=grpo", "model.lora.rank=1000000"], ["model.lora.rank=1000000", "LoRA's rank-wide intermediates"]),
    (["model.lora.rank=1000000", "model.lora.target_modules=[q_proj,v_proj,down_proj]"],
     ["model.lora.rank=1000000"]),
]

#: (overrides, key, allowed range): counts that drive a loop, and the temperature's floor
UNBOUNDED = [
    (["algo=ppo", "algo.ppo_epochs=1000000000"], "algo.ppo_epochs", "1 <= value <= 100"),
    (["algo=grpo", "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_rounds=1000000000"],
     "algo.dynamic_sampling_max_rounds", "0 <= value <= 100"),
    (["env=textworld", "env.num_games=1000000000"], "env.num_games", "1 <= value <= 100000"),
    (["env=textworld", "env.num_eval_games=1000000000"], "env.num_eval_games", "1 <= value <= 100000"),
    (["env=textworld", "env.quest_length=1000000"], "env.quest_length", "1 <= value <= 100"),
    (["env=textworld", "env.world_size=1000000"], "env.world_size", "1 <= value <= 100"),
    (["trainer.total_steps=100000000000"], "trainer.total_steps", "1 <= value <= 1e+07"),
    (["algo=grpo", "rollout.temperature=1e-300"], "rollout.temperature", "0.01 <= value"),
    (["algo=grpo", "rollout.temperature=0.001"], "rollout.temperature", "0.01 <= value"),
]


@pytest.fixture
def sixteen_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_machine_memory", lambda: 16 * GIB)


@pytest.mark.parametrize(("args", "texts"), TOO_LARGE, ids=[" ".join(a) for a, _ in TOO_LARGE])
@pytest.mark.parametrize("command", [["config", "show"], ["train"]])
def test_sizes_that_cannot_fit_together_are_refused(args: list[str], texts: list[str], command: list[str],
                                                    sixteen_gib: None, tmp_path: Path) -> None:
    proc = run_epo([*command, *args, f"output_dir={tmp_path / 'out'}"], tmp_path, expect=2)
    one_error(proc, *texts, "Refused before allocating anything", "this machine's memory (16.0 GiB)")
    assert not (tmp_path / "out").exists()


def test_eval_episodes_are_counted_with_what_the_model_generates_for_them(sixteen_gib: None,
                                                                         tmp_path: Path) -> None:
    """episodes=200000 of a run with 8 turns: 13.9 GiB of turn tokens passed; the generation's 172 GiB did not."""
    from epo_cli.compose import compose

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(SmallConfig().run())))
    (run / "status.json").write_text('{"status": "finished"}')
    proc = run_epo(["eval", f"run={run}", "episodes=200000", f"out={tmp_path / 'eval'}"], tmp_path, expect=2)
    one_error(proc, "episodes=200000", "generating for 2e+05 rows at once", "Refused before allocating anything")
    assert not (tmp_path / "eval").exists()
    # a scripted policy generates nothing: the same episodes are only their turns (which fit)
    run_epo(["eval", "policy=random", "episodes=200", "env.max_turns=2", f"out={tmp_path / 'random'}"], tmp_path)


@pytest.mark.parametrize(("args", "key", "allowed"), UNBOUNDED, ids=[" ".join(a) for a, _, _ in UNBOUNDED])
def test_every_count_that_drives_a_loop_has_a_bound(args: list[str], key: str, allowed: str,
                                                    tmp_path: Path) -> None:
    proc = run_epo(["config", "show", *args], tmp_path, expect=2)
    one_error(proc, f"Invalid value for '{key}'", f"allowed: {allowed}")


def test_the_shipped_presets_still_fit_sixteen_gib(sixteen_gib: None, tmp_path: Path) -> None:
    for args in ([], ["algo=grpo"], ["algo=ppo"], ["experiment=epo_household"], ["experiment=warm_start"],
                 ["experiment=coin_long_horizon"], ["algo=grpo", "model.lora.rank=8"]):
        run_epo(["config", "show", *args], tmp_path)


def test_the_estimates_by_hand() -> None:
    """LoRA's adapters and the KV cache, counted by hand for the default tiny model (hidden 64, 2 layers, 4
    heads, 2 KV heads: kv_dim 32, intermediate 256)."""
    from epo_cli.compose import compose

    cfg = compose(["algo=grpo", "model.lora.rank=8", "model.dtype=fp32", "algo.tasks_per_step=3",
                   "algo.group_size=2"])
    # q (64+64) + k (64+32) + v (64+32) + o (64+64) = 448 features x rank 8 x 2 layers
    assert memory.lora_parameters(cfg.model) == (448 * 8 * 2, 4)
    generation = memory.generation_estimate(cfg, 6, ["rows"], "fix")
    kv = 6 * (1024 + 64) * 2 * 2 * 32 * 4  # rows x tokens x layers x (k, v) x kv_dim x fp32
    mlp = 6 * 1024 * 3 * 256 * 4  # rows x prompt x (gate, up, product) x intermediate x fp32
    assert generation.bytes == kv + mlp


def _model_folder(path: Path, **sizes: int | bool) -> Path:
    """A model folder as the estimate reads it: its config.json alone."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", **sizes}))
    return path


def test_a_model_folder_is_counted_by_the_shape_its_config_json_gives(tmp_path: Path) -> None:
    """model.path=<folder> was counted by its rollouts only. Its config.json's shape, by hand: hidden 64, 2 layers,
    4 heads, 2 KV heads (kv_dim 32), intermediate 256, 1000 tokens, tied embeddings. On the CPU: parameters x 16
    and the update and generation; on a GPU only the bf16 weights from_pretrained loads in this memory first."""
    from epo_cli.compose import compose

    folder = _model_folder(tmp_path / "model", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    layer = (64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 2 * 32) + 3 * 64 * 256 + 2 * 64  # q k v o + biases, MLP, norms
    params = 1000 * 64 + 2 * layer + 64  # embeddings (tied), layers, final norm
    assert params == 187_456
    on_cpu = memory.estimates(compose(["algo=grpo", f"model.path={folder}", "trainer.device=cpu"]))
    assert on_cpu[0].bytes == params * 16
    assert f"model.path={folder} (its config.json: hidden_size=64, intermediate_size=256, num_hidden_layers=2, " \
           "vocab_size=1000)" in on_cpu[0].settings
    assert [e.what.split(" ")[0] for e in on_cpu[1:3]] == ["one", "generating"]  # the update, the rollout batch
    on_gpu = memory.estimates(compose(["algo=grpo", f"model.path={folder}", "trainer.device=cuda"]))
    assert on_gpu[0].bytes == params * 2 and "before they move to the GPU" in on_gpu[0].what
    assert not any(e.what.startswith(("one training", "generating")) for e in on_gpu)


@pytest.mark.parametrize(("device", "text"), [("cpu", "parameters x 16 bytes"),
                                              ("cuda", "in 2-byte floats, loaded in this memory")])
def test_a_model_folder_too_large_for_this_machine_is_refused(device: str, text: str, sixteen_gib: None,
                                                              tmp_path: Path) -> None:
    """A folder of a 70B model's shape (passed before: only its rollouts were counted)."""
    folder = _model_folder(tmp_path / "model", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    proc = run_epo(["config", "show", f"model.path={folder}", f"trainer.device={device}"], tmp_path, expect=2)
    one_error(proc, f"model.path={folder} (its config.json: hidden_size=8192", text, "Refused before allocating "
              "anything", "this machine's memory (16.0 GiB)")


@pytest.mark.parametrize("args, text", [
    (["eval", "policy=random", "temperature=1e-300", "episodes=1"],
     "temperature=1e-300 is out of range; allowed: 0.01 <= value"),
    (["eval", "policy=random", "rollout.eval_temperature=1e-300", "episodes=1"],
     "rollout.eval_temperature=1e-300 is out of range; allowed: 0 (greedy) or 0.01 <= value"),
    (["train", "rollout.eval_temperature=0.001", "trainer.total_steps=1"],
     "rollout.eval_temperature=0.001 is out of range"),
])
def test_a_temperature_below_the_floor_is_refused_everywhere(args: list[str], text: str, tmp_path: Path) -> None:
    """rollout.temperature's floor (0.01) holds for `epo eval temperature=` and rollout.eval_temperature too
    (0 stays greedy): 1e-300 made every logit overflow and the error then blamed non-finite weights."""
    one_error(run_epo(args, tmp_path, expect=2), text)
