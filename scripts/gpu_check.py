"""GPU check: generation and update throughput, the update's model FLOPs utilisation, and one real EPO iteration.

    python scripts/gpu_check.py [--out gpu_check.json] [--peak-tflops 989] [--quick]

On CUDA (bf16, `model=qwen2.5-0.5b-random`: Qwen2.5-0.5B's shapes with random weights, built locally):
  1. generation tokens/s: batched sampling with the KV cache (epo_cli.rollout.generation.generate);
  2. update tokens/s and MFU: packed micro-batches through the EPO loss stack (policy_clip + kl + entropy +
     entropy_smoothing), backward and AdamW, on synthetic turn-samples. MFU = model FLOPs / time / peak with
     model FLOPs = 6 x (non-embedding parameters) x tokens + 6 x (hidden x vocab) x response tokens (the
     logits are only computed at response tokens; attention FLOPs are not counted, as in the 6ND rule);
     peak = the device's dense bf16 peak from the table below, or --peak-tflops;
  3. one `epo train algo=epo env=household` iteration through the real CLI (DeepSpeed engine, env,
     rollout, scoring, update): its perf/* metrics, the overlap ratio (perf/overlap_ratio) if logged.
Without CUDA, or with --quick, everything runs shrunk (tiny sizes, fp32, a few tokens) so CI keeps the
script working; MFU is then not reported (no peak for a CPU). Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: dense bf16 tensor-core peak (TFLOP/s) by device name; the first matching substring wins
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0),
                    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]
QUICK_MODEL = ["model.hidden_size=64", "model.intermediate_size=256", "model.num_hidden_layers=2",
               "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.padded_vocab_size=null",
               "model.max_position_embeddings=2048"]
#: (generation batch, prompt tokens, new tokens, update samples, response tokens, pack budget)
FULL_SIZES = dict(gen_batch=64, prompt=512, new_tokens=128, samples=64, response=64, pack_tokens=16384)
QUICK_SIZES = dict(gen_batch=4, prompt=32, new_tokens=8, samples=8, response=8, pack_tokens=256)


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def load_model(overrides: list[str], device, attn: str):
    """The policy as the trainer loads it (model config group, local build, packing attention)."""
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.loading import load_causal_lm, load_tokenizer, model_source, resolve_dtype
    from epo_cli.training.packing import enable_packing

    cfg = compose([*overrides, "algo=epo", f"model.attn_implementation={attn}"])
    source = model_source(cfg.model, make_suite(cfg.env), cfg.seed)
    tokenizer = load_tokenizer(source, cfg.model)
    model = load_causal_lm(source, cfg.model, resolve_dtype(cfg.model, device)).to(device)
    if not enable_packing(model, None):
        raise SystemExit(f"attention '{attn}' cannot pack samples; use --attn sdpa")
    return cfg, model, tokenizer


def bench_generation(model, tokenizer, sizes: dict, device) -> dict[str, float]:
    import torch

    from epo_cli.rollout.generation import SamplingConfig, generate

    vocab = len(tokenizer)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (sizes["prompt"],), generator=g).tolist() for _ in range(sizes["gen_batch"])]
    params = SamplingConfig(max_new_tokens=sizes["new_tokens"], temperature=1.0, stop="")
    model.eval()
    with torch.no_grad():
        generate(model, prompts[:2], SamplingConfig(max_new_tokens=2, stop=""), tokenizer, vocab_limit=vocab)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = generate(model, prompts, params, tokenizer, seeds=list(range(len(prompts))), vocab_limit=vocab)
        _sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r) for r in out)
    return {"generate_s": seconds, "generated_tokens": tokens, "gen_tokens_per_s": tokens / seconds}


def _synthetic_batch(vocab: int, sizes: dict):
    """Turn-samples of 4 trajectories with prompts and responses around the configured lengths."""
    import torch

    from epo_cli.rollout.batch import TurnBatch

    g = torch.Generator().manual_seed(1)
    n, P, R = sizes["samples"], sizes["prompt"], sizes["response"]
    prompt_lens = [max(2, P // 2 + int(x)) for x in torch.randint(0, P // 2 + 1, (n,), generator=g)]
    response_lens = [max(1, R // 2 + int(x)) for x in torch.randint(0, R // 2 + 1, (n,), generator=g)]
    per_traj = max(1, n // 4)
    turn = [i % per_traj for i in range(n)]
    return TurnBatch(
        prompt_ids=[torch.randint(3, vocab, (k,), generator=g).tolist() for k in prompt_lens],
        response_ids=[torch.randint(3, vocab, (k,), generator=g).tolist() for k in response_lens],
        traj_id=torch.tensor([i // per_traj for i in range(n)]), group_id=torch.zeros(n, dtype=torch.long),
        turn_index=torch.tensor(turn), num_turns=torch.full((n,), per_traj), reward=torch.zeros(n),
        outcome=torch.zeros(n), valid=torch.ones(n, dtype=torch.bool), won=torch.zeros(n, dtype=torch.bool),
        task_type=["t"] * n, advantages=torch.randn(n, generator=g),
    )


def bench_update(cfg, model, tokenizer, sizes: dict, device, peak: float | None) -> dict[str, float]:
    """Scoring (no grad) + one optimizer step over packed micro-batches with the EPO loss stack."""
    import torch

    from epo_cli.algos.aggregation import AGGREGATIONS
    from epo_cli.algos.losses import LossStack, build_loss_terms, loss_coefficients
    from epo_cli.training.forward import collate, policy_forward
    from epo_cli.training.packing import plan_packs
    from epo_cli.training.update import row_denominators

    algo = cfg.algo
    vocab = len(tokenizer)
    batch = _synthetic_batch(vocab, sizes)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    packs = plan_packs(list(range(len(batch))), lengths, sizes["pack_tokens"])
    terms = LossStack(build_loss_terms(algo)).to(device)
    coefs = loss_coefficients(algo, 0.001, 2.0, algo.kl.coef)
    modes = sorted({t.aggregation for t in terms.terms.values()})
    den = {m: float(d.sum()) for m, d in row_denominators(batch, modes, algo.entropy.decay).items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    def score() -> None:
        model.eval()
        batch.old_logprobs, batch.entropy, batch.ref_logprobs = [], [], []  # filled in below
        old, entropy = [torch.empty(0)] * len(batch), [torch.empty(0)] * len(batch)
        with torch.no_grad():
            for rows in packs:
                out = policy_forward(model, collate(batch, rows, tokenizer.pad_token_id, device, packed=True),
                                     vocab_limit=vocab)
                for i, r in enumerate(rows):
                    k = len(batch.response_ids[r])
                    old[r], entropy[r] = out.logprobs[i, :k].float().cpu(), out.entropy[i, :k].float().cpu()
        batch.old_logprobs, batch.entropy = old, entropy
        batch.ref_logprobs = [x - 0.01 for x in old]  # a reference a little away from the policy

    def update() -> float:
        model.train()
        total = 0.0
        for rows in packs:
            mb = collate(batch, rows, tokenizer.pad_token_id, device, packed=True)
            for m in modes:
                u, _ = AGGREGATIONS[m].weights(mb.response_mask, mb.turn_index, mb.num_turns, algo.entropy.decay)
                mb.weights[m] = u / den[m]
            mb.entropy_ref = torch.full(mb.turn_index.shape, 1.0, device=device)
            loss, _ = terms(mb, policy_forward(model, mb, vocab_limit=vocab), coefs)
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    score()
    update()  # warm-up (kernels, allocator, optimizer state)
    _sync(device)
    t0 = time.perf_counter()
    score()
    _sync(device)
    score_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = update()
    _sync(device)
    update_s = time.perf_counter() - t0

    tokens = sum(lengths)
    response_tokens = sum(len(r) for r in batch.response_ids)
    embed = model.get_input_embeddings().weight
    non_embedding = sum(p.numel() for p in model.parameters()) - embed.numel()
    if not model.config.tie_word_embeddings:
        non_embedding -= model.get_output_embeddings().weight.numel()
    flops = 6 * non_embedding * tokens + 6 * embed.shape[0] * embed.shape[1] * response_tokens
    out = {"update_samples": len(batch), "update_tokens": tokens, "packs": len(packs), "score_s": score_s,
           "update_s": update_s, "update_tokens_per_s": tokens / update_s, "loss": loss,
           "model_tflops_per_step": flops / 1e12, "achieved_tflops": flops / update_s / 1e12}
    if peak:
        out["peak_tflops"] = peak
        out["mfu"] = flops / update_s / (peak * 1e12)
    return out


def real_iteration(overrides: list[str], quick: bool, attn: str, workdir: Path) -> dict[str, float]:
    """One `epo train algo=epo env=household` iteration through the CLI; its metrics row."""
    small = ["algo.tasks_per_step=1", "algo.group_size=2", "env.max_turns=2", "rollout.max_new_tokens=8",
             "algo.mini_batch_size=16", "algo.micro_batch_size=8"] if quick else []
    args = [sys.executable, "-m", "epo_cli", "train", "algo=epo", "env=household", *overrides, *small,
            f"model.attn_implementation={attn}", "trainer.total_steps=1", "env.eval_splits=[]",
            "logger.tensorboard=false", "logger.console=false", f"output_dir={workdir}", "name=gpu_check"]
    proc = subprocess.run(args, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise SystemExit(f"epo train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    metrics = next(workdir.glob("*/*gpu_check/metrics.jsonl"))
    row = json.loads(metrics.read_text().splitlines()[-1])
    return {k: v for k, v in row.items() if k.startswith("perf/") or k in ("rollout/samples", "loss/policy_clip")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="shrunk sizes (the default without CUDA)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from the table)")
    parser.add_argument("--attn", default="auto", help="auto (flash_attention_2 if installed, else sdpa) | sdpa | "
                                                       "flash_attention_2")
    parser.add_argument("--skip-train", action="store_true", help="skip the real `epo train` iteration")
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    cuda = torch.cuda.is_available()
    quick = args.quick or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        print("no CUDA device: running the shrunk CPU check (tiny sizes, fp32)")
    attn = args.attn
    if attn == "auto":
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2" if cuda else "sdpa"
        except ImportError:
            attn = "sdpa"
    overrides = ["model=qwen2.5-0.5b-random", *(QUICK_MODEL if quick else [])]
    if not cuda:
        overrides.append("model.dtype=fp32")
    sizes = QUICK_SIZES if quick else FULL_SIZES
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if cuda else None)

    cfg, model, tokenizer = load_model(overrides, device, attn)
    params = sum(p.numel() for p in model.parameters())
    results: dict[str, object] = {"device": name, "quick": quick, "attn": attn, "dtype": str(model.dtype),
                                  "parameters": params, "sizes": sizes}
    results["generation"] = bench_generation(model, tokenizer, sizes, device)
    results["update"] = bench_update(cfg, model, tokenizer, sizes, device, peak)
    del model
    if cuda:
        torch.cuda.empty_cache()
    if not args.skip_train:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            results["train_iteration"] = real_iteration(overrides, quick, attn, Path(tmp))

    table = Table(title=f"gpu_check on {name} ({'quick, ' if quick else ''}{attn}, {params / 1e6:.1f}M parameters)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    gen, upd = results["generation"], results["update"]
    table.add_row("generation tokens/s", f"{gen['gen_tokens_per_s']:.0f}")
    table.add_row("update tokens/s (packed, EPO loss stack)", f"{upd['update_tokens_per_s']:.0f}")
    table.add_row("scoring forward s / update s", f"{upd['score_s']:.3f} / {upd['update_s']:.3f}")
    table.add_row("update achieved TFLOP/s", f"{upd['achieved_tflops']:.3f}")
    table.add_row("update MFU", f"{upd['mfu']:.3f}" if "mfu" in upd else "n/a (no peak for this device)")
    train = results.get("train_iteration") or {}
    for key in ("perf/rollout_s", "perf/generate_s", "perf/env_s", "perf/score_s", "perf/update_s",
                "perf/gen_tokens_per_s", "perf/padding_efficiency", "perf/scoring_reused", "perf/overlap_ratio"):
        if key in train:
            table.add_row(f"epo train: {key}", f"{train[key]:.3f}")
    if train and "perf/overlap_ratio" not in train:
        table.add_row("epo train: perf/overlap_ratio", "not logged by this version")
    Console().print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
