"""GPU check: the trainer's own rollout and update throughput, and the update's model FLOPs utilisation.

    python scripts/gpu_check.py [--out gpu_check.json] [--model qwen2.5-0.5b-random] [--peak-tflops 989]
    python scripts/gpu_check.py --device cpu --model tiny --quick          # the shrunk CPU run (CI)

A Trainer is built as `epo train algo=epo env=household model=<--model>` builds it (DeepSpeed engine,
env workers, rollout policy), and its public RL steps run as Trainer.rl_step runs them (training/trainer.py):
sample (the rollout: the trainer's generation, with the env), score, advantages, coefficients, update
(PolicyUpdate: packed micro-batches through the EPO loss stack, backward, optimizer step). The first
--warmup iterations warm up kernels, allocator and optimizer state; the next one is measured:

    rollout_tokens_per_s   generated tokens / seconds inside the rollout's generate calls
    update_tokens_per_s    tokens the update ran forward and backward (prompt + response of every sample,
                           once per PPO epoch) / update seconds
    mfu_update             model FLOPs of the update / update seconds / peak, with model FLOPs =
                           6 x (non-embedding parameters) x tokens + 6 x (hidden x vocab) x response tokens
                           (logits only at response tokens; attention FLOPs not counted, as in the 6ND rule)
                           and peak = the device's dense bf16 peak from the table below or --peak-tflops;
                           null without one (a CPU)

`epo plan` reads rollout_tokens_per_s and update_tokens_per_s from the JSON file (--out). Defaults: on CUDA
`model=qwen2.5-0.5b-random` (Qwen2.5-0.5B's shapes, random weights, built locally) in bf16 at the sizes
below; without CUDA (or with --device cpu) the shrunk sizes (--quick) and `model=tiny`, fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from common import scratch_trainer  # noqa: E402

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: dense bf16 tensor-core peak (TFLOP/s) by device name; the first matching substring wins
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0),
                    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]
#: the RL iteration's shape: tasks x rollouts per task, turns, new tokens per turn (one mini-batch, so one
#: optimizer step per PPO epoch)
FULL_SIZES = ["algo.tasks_per_step=16", "algo.group_size=8", "env.max_turns=2", "rollout.max_new_tokens=128",
              "algo.mini_batch_size=256", "algo.micro_batch_size=32"]
QUICK_SIZES = ["algo.tasks_per_step=2", "algo.group_size=2", "env.max_turns=2", "rollout.max_new_tokens=8",
               "algo.mini_batch_size=16", "algo.micro_batch_size=8"]


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def update_flops(model, tokens: int, response_tokens: int) -> float:
    """6 x non-embedding parameters x tokens + 6 x (hidden x vocab) x response tokens (see the docstring)."""
    embed = model.get_input_embeddings().weight
    non_embedding = sum(p.numel() for p in model.parameters()) - embed.numel()
    if not model.config.tie_word_embeddings:
        non_embedding -= model.get_output_embeddings().weight.numel()
    return 6.0 * non_embedding * tokens + 6.0 * embed.shape[0] * embed.shape[1] * response_tokens


def measure(trainer, warmup: int, sync) -> dict[str, object]:
    """`warmup` + 1 RL iterations of the trainer's own steps 1-5; the last one's timings and sizes (score_s: the
    scoring pass alone, ~0 where the update's first forward scores the rows: algo.reuse_scoring_forward)."""
    total = trainer.cfg.trainer.total_steps
    for it in range(warmup + 1):
        trainer.set_learning_rates(it, total)
        rollout = trainer.sample(it, total)
        t0 = time.perf_counter()
        scored = trainer.score(rollout.batch, it)
        sync()
        score_s = time.perf_counter() - t0
        batch = trainer.advantages(scored)
        coefs = trainer.coefficients(it, total, batch)
        sync()
        t0 = time.perf_counter()
        result = trainer.update(batch, coefs, it)
        sync()
        update_s = time.perf_counter() - t0
    stats, epochs = rollout.stats, trainer.cfg.algo.ppo_epochs
    tokens = epochs * sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    response_tokens = epochs * sum(len(r) for r in batch.response_ids)
    return {"samples": len(batch), "episodes": len(rollout.episodes), "rollout_s": stats.rollout_s,
            "generate_s": stats.generate_s, "env_s": stats.env_s, "generated_tokens": stats.generated_tokens,
            "prompt_tokens_mean": sum(map(len, batch.prompt_ids)) / max(len(batch), 1),
            "response_tokens_mean": sum(map(len, batch.response_ids)) / max(len(batch), 1), "score_s": score_s,
            "rollout_tokens_per_s": stats.generated_tokens / max(stats.generate_s, 1e-9),
            "update_s": update_s, "update_tokens": tokens, "update_response_tokens": response_tokens,
            "update_tokens_per_s": tokens / update_s,
            "update_metrics": {k: v for k, v in result.metrics.items()
                               if k.startswith(("loss/", "perf/optimizer_steps", "perf/padding_efficiency"))}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="the JSON result file (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="auto: CUDA when available")
    parser.add_argument("--model", default=None,
                        help="a model preset (conf/model): default qwen2.5-0.5b-random on CUDA, tiny on a CPU")
    parser.add_argument("--quick", action="store_true", help="shrunk sizes (the default on a CPU)")
    parser.add_argument("--warmup", type=int, default=1, help="iterations before the measured one")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from the table)")
    parser.add_argument("--attn", default="auto", help="auto (flash_attention_2 if installed, else sdpa) | sdpa | "
                                                       "flash_attention_2")
    parser.add_argument("overrides", nargs="*", help="further config overrides")
    args = parser.parse_args(argv)

    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu for the shrunk CPU check")
    quick = args.quick or not cuda
    model = args.model or ("qwen2.5-0.5b-random" if cuda else "tiny")
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
    attn = args.attn
    if attn == "auto":
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2" if cuda else "sdpa"
        except ImportError:
            attn = "sdpa"
    overrides = ["algo=epo", "env=household", f"model={model}", f"model.attn_implementation={attn}",
                 f"trainer.device={'cuda' if cuda else 'cpu'}", "trainer.total_steps=100", "env.eval_splits=[]",
                 "logger.console=false", "logger.tensorboard=false", "logger.jsonl=false",
                 *(QUICK_SIZES if quick else FULL_SIZES), *([] if cuda else ["model.dtype=fp32"]), *args.overrides]

    from rich.console import Console
    from rich.table import Table

    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if cuda else None)
    from epo_cli.compose import compose

    trainer = scratch_trainer(compose(overrides), "gpu_check_")
    try:
        measured = measure(trainer, args.warmup, torch.cuda.synchronize if cuda else (lambda: None))
        module = trainer.models.engine.module
        flops = update_flops(module, int(measured["update_tokens"]), int(measured["update_response_tokens"]))
        params, dtype = sum(p.numel() for p in module.parameters()), str(next(module.parameters()).dtype)
    finally:
        trainer.pool.close()
        trainer.logger.close()
    achieved = flops / float(measured["update_s"]) / 1e12
    results: dict[str, object] = {
        "device": name, "model": model, "parameters": params, "dtype": dtype, "attn": attn, "quick": quick,
        "torch_version": torch.__version__, "overrides": overrides,
        "rollout_tokens_per_s": measured["rollout_tokens_per_s"],
        "update_tokens_per_s": measured["update_tokens_per_s"],
        "update_achieved_tflops": achieved, "peak_tflops": peak, "mfu_update": achieved / peak if peak else None,
        **{k: v for k, v in measured.items() if k not in ("rollout_tokens_per_s", "update_tokens_per_s")},
    }

    table = Table(title=f"gpu_check on {name} ({model}, {'quick, ' if quick else ''}{attn}, "
                        f"{params / 1e6:.1f}M parameters): the trainer's own steps")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("rollout: generation tokens/s", f"{measured['rollout_tokens_per_s']:.0f}")
    table.add_row("update tokens/s (PolicyUpdate, EPO loss stack)", f"{measured['update_tokens_per_s']:.0f}")
    table.add_row("rollout s (generate s) / update s", f"{measured['rollout_s']:.3f} ({measured['generate_s']:.3f})"
                                                      f" / {measured['update_s']:.3f}")
    table.add_row("update achieved TFLOP/s", f"{achieved:.3f}")
    table.add_row("update MFU", f"{results['mfu_update']:.3f}" if peak else "n/a (no peak for this device)")
    Console().print(table)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
