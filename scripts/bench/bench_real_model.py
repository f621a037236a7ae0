"""bfloat16 against float32 on the CPU for SmolLM2-135M-Instruct (model=smollm2-135m): speed and the log-prob
difference it causes, for the three things an iteration does with the model, measured in one run on the same
inputs (real prompts of the real-model regime, experiment=smollm2_household, and responses sampled from it):

    score      forward over prompt + response, log-probs of the response tokens (the scoring pass)
    update     forward + backward of the same rows (the update's micro-batch)
    generate   KV-cached sampling of `--new-tokens` tokens (transformers' generate, greedy)

bf16 = torch.autocast("cpu", dtype=torch.bfloat16) around float32 weights (what a mixed-precision trainer
does); ratios are bf16 speed over fp32 speed, each the best of --repeats, interleaved to share the machine's
noise. The log-prob difference is per response token: mean and max |logp_bf16 - logp_fp32|.

    python scripts/bench/bench_real_model.py [--rows 8] [--repeats 3] [--new-tokens 24] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from omegaconf import OmegaConf

from epo_cli.compose import compose
from epo_cli.envs import make_suite
from epo_cli.launch.libraries import quiet_libraries
from epo_cli.models.loading import load_causal_lm, load_tokenizer, model_source
from epo_cli.rollout.prompts import EpisodeMemory, PromptBuilder, chat_encoder


def real_prompts(cfg, tokenizer, rows: int) -> list[list[int]]:
    """First-turn prompts of `rows` distinct training tasks, built as the trainer builds them."""
    import random

    suite = make_suite(cfg.env)
    builder = PromptBuilder(cfg.env.prompt_template, cfg.env.history_length, cfg.rollout.max_prompt_tokens,
                            chat_encoder(tokenizer, cfg.env.system_prompt))
    env = suite.make_env()
    prompts = []
    try:
        for task in suite.sample_tasks(cfg.env.train_split, rows, random.Random(0), level=cfg.env.level):
            obs, info = env.reset(task)
            built = builder.build(EpisodeMemory(task=info.get("goal", "")), obs, info.get("admissible_commands", []))
            prompts.append(built.ids)
    finally:
        env.close()
    return prompts


def padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def response_logprobs(model, ids, mask, n_response: int) -> torch.Tensor:
    # ids/mask: [B, L] left-padded prompt + response; returns [B, n_response] log-probs of the response tokens
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position).logits[:, -n_response - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -n_response:, None]).squeeze(-1)


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    quiet_libraries()
    torch.set_num_threads(a.threads)
    cfg = compose(["experiment=smollm2_household", "model.source=package"])
    source = model_source(cfg.model, make_suite(cfg.env), 0)
    tokenizer = load_tokenizer(source, cfg.model)
    model = load_causal_lm(source, OmegaConf.merge(cfg.model, {"gradient_checkpointing": False}), torch.float32)
    model.eval()
    prompts = real_prompts(cfg, tokenizer, a.rows)
    ids, mask = padded(prompts, tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.no_grad():  # the responses scored below: sampled once from the fp32 model, as a rollout would
        full = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new_tokens, do_sample=True,
                              temperature=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)
    n = full.shape[1] - ids.shape[1]
    full_mask = torch.cat([mask, torch.ones(len(prompts), n, dtype=mask.dtype)], 1)
    tokens = int(full_mask.sum())
    print(f"SmolLM2-135M-Instruct ({source}), {a.rows} rows, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens + {n} response tokens, {a.threads} thread(s)")

    best: dict[tuple[str, str], float] = {}
    logps: dict[str, torch.Tensor] = {}
    for _ in range(a.repeats):
        for dtype in ("fp32", "bf16"):  # interleaved: both see the same machine noise
            with torch.no_grad(), autocast(dtype):
                t = time.perf_counter()
                logps[dtype] = response_logprobs(model, full, full_mask, n)
                best[("score", dtype)] = min(best.get(("score", dtype), 1e9), time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            with autocast(dtype):
                loss = -response_logprobs(model, full, full_mask, n).mean()
            loss.backward()
            best[("update", dtype)] = min(best.get(("update", dtype), 1e9), time.perf_counter() - t)
            with torch.no_grad(), autocast(dtype):
                t = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new_tokens,
                               min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                best[("generate", dtype)] = min(best.get(("generate", dtype), 1e9), time.perf_counter() - t)
    diff = (logps["bf16"] - logps["fp32"]).abs()
    print(f"{'part':<10}{'fp32 tok/s':>12}{'bf16 tok/s':>12}{'bf16/fp32':>11}")
    for part in ("score", "update", "generate"):
        count = a.rows * a.new_tokens if part == "generate" else tokens
        f, b = count / best[(part, "fp32")], count / best[(part, "bf16")]
        print(f"{part:<10}{f:>12.1f}{b:>12.1f}{b / f:>10.2f}x")
    print(f"score log-prob |bf16 - fp32| per response token: mean {diff.mean():.4f}, max {diff.max():.4f} "
          f"(ratio exp(mean diff) - 1 = {float(diff.mean().exp() - 1):.2%})")


if __name__ == "__main__":
    main()
