"""Scoring + update time of one household batch: padded vs packed micro-batches, with and without the
scoring reuse (the update's first mini-batch scoring its own samples), in one process.

    python scripts/bench/bench_update.py [--model PATH] [--algo epo] [--repeats 3] [--no-large] [--out F.json] \
        [OVERRIDES]

One rollout of the tiny model gives the batch; every variant scores and updates that same batch from the
same weights (restored before each run), interleaved (A B C D A B C D ...) so machine noise hits all alike.
Each variant is its own Trainer composed with its settings (padded: algo.pack_tokens=0, so the attention is
the plain sdpa of such a run; reuse: algo.reuse_scoring_forward), its parts checked to hold them, and a reuse
variant's updates checked to score rows themselves (the count only reuse makes).
Models: `tiny` (model=tiny: hidden 64, 2 layers, 1k vocab) and `large`, a random-init Qwen2 shrunk for a
CPU (hidden 128, 4 layers, a 16k-row embedding: ~3M parameters) that shares the tiny tokenizer, so it
updates on the very same token ids.
Printed per variant: median scoring and update CPU seconds of this process (one torch thread: the work done,
which other processes on a shared machine disturb far less than wall time; wall times are in the JSON and
the last column), scoring share of the two, real tokens per CPU second (the batch's prompt+response tokens /
(scoring + update)), padding efficiency (real / computed tokens), and the speed-up against `padded` (the
layout before packing, with a separate scoring pass).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

from common import flat_policy, scratch_trainer

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

VARIANTS = {  # name -> (packed micro-batches, scoring reuse)
    "padded": (False, False),
    "packed": (True, False),
    "padded+reuse": (False, True),
    "packed+reuse": (True, True),
}
LARGE = ["model.hidden_size=128", "model.intermediate_size=512", "model.num_hidden_layers=4",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.padded_vocab_size=16384"]


def variant_overrides(variant: str) -> list[str]:
    """The settings a variant's Trainer is composed with: padded is algo.pack_tokens=0 (packed: the default,
    which packs where the attention allows), and algo.reuse_scoring_forward on or off."""
    packed, reuse = VARIANTS[variant]
    return [*([] if packed else ["algo.pack_tokens=0"]), f"algo.reuse_scoring_forward={str(reuse).lower()}"]


def _trainer(overrides: list[str]):
    from epo_cli.compose import compose

    return scratch_trainer(compose(overrides), "bench_update_")


def check_variant_reached(variant: str, trainer) -> None:
    """The variant's Trainer packs and reuses as the variant says (its parts, built from its settings)."""
    packed, reuse = VARIANTS[variant]
    clamps = trainer.cfg.algo.monitor.action == "clamp"  # a clamp keeps the reuse off (it needs every entropy)
    held = (trainer.models.packing, trainer.policy_update.reuses_scoring())
    if held != (packed, reuse and not clamps):
        raise SystemExit(f"bench_update: variant '{variant}' wants packed={packed}, reuse={reuse and not clamps}, "
                         f"but its Trainer's parts hold packed={held[0]}, reuse={held[1]}")


def _measure(trainer, batch, variant: str) -> dict[str, float]:
    """Score and update `batch` with the trainer's own steps (2-5 of rl_step); seconds and padding efficiency."""
    total = trainer.cfg.trainer.total_steps
    t0, c0 = time.perf_counter(), time.process_time()
    b = trainer.score(batch, 0)
    score_s, score_cpu = time.perf_counter() - t0, time.process_time() - c0
    b = trainer.advantages(b)
    coefs = trainer.coefficients(0, total, b)
    t0, c0 = time.perf_counter(), time.process_time()
    result = trainer.update(b, coefs, 0)
    update_s, update_cpu = time.perf_counter() - t0, time.process_time() - c0
    # the one count only scoring reuse makes: rows the update's own forward scored
    if (result.scored_rows > 0) != trainer.policy_update.reuses_scoring():
        raise SystemExit(f"bench_update: variant '{variant}' scored {result.scored_rows} rows in its update, "
                         f"with reuse {trainer.policy_update.reuses_scoring()}")
    return {"score_s": score_s, "update_s": update_s, "score_cpu_s": score_cpu, "update_cpu_s": update_cpu,
            "padding_efficiency": result.metrics["perf/padding_efficiency"],
            "reused_share": result.scored_rows / len(b)}


def bench_model(name: str, overrides: list[str], batch, repeats: int) -> dict[str, dict[str, float]]:
    """Each variant's median figures on the model `overrides` name: one Trainer per variant, composed with its
    settings (the same seed, so the same initial weights, checked), restored to them before each run."""
    import torch

    trainers = {variant: _trainer([*overrides, *variant_overrides(variant)]) for variant in VARIANTS}
    initial = {}
    for variant, trainer in trainers.items():
        check_variant_reached(variant, trainer)
        critic = trainer.models.critic_engine
        modules = [trainer.engine.module] + ([critic.module] if critic else [])
        initial[variant] = [copy.deepcopy(m.state_dict()) for m in modules]
    first = flat_policy(next(iter(trainers.values())))
    if not all(torch.equal(flat_policy(t), first) for t in trainers.values()):
        raise SystemExit(f"bench_update: the variants' {name} models start from different weights")
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant, trainer in trainers.items():
            critic = trainer.models.critic_engine
            modules = [trainer.engine.module] + ([critic.module] if critic else [])
            for m, state in zip(modules, initial[variant]):
                m.load_state_dict(state)
            trainer.models.refresh()
            runs[variant].append(_measure(trainer, batch, variant))
            print(f"{name} repeat {r} {variant}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[variant][-1].items()))
    for trainer in trainers.values():
        trainer.pool.close()
    tokens = sum(len(p) + len(q) for p, q in zip(batch.prompt_ids, batch.response_ids))
    out = {}
    for variant, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("score_s", "update_s", "score_cpu_s", "update_cpu_s")}
        cpu = med["score_cpu_s"] + med["update_cpu_s"]
        out[variant] = {**med, "total_s": med["score_s"] + med["update_s"], "total_cpu_s": cpu,
                        "scoring_share": med["score_cpu_s"] / cpu, "tokens_per_cpu_s": tokens / cpu,
                        "padding_efficiency": rs[0]["padding_efficiency"], "reused_share": rs[0]["reused_share"]}
    for v in out.values():
        v["speedup_vs_padded"] = out["padded"]["total_cpu_s"] / v["total_cpu_s"]
        v["wall_speedup_vs_padded"] = out["padded"]["total_s"] / v["total_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder of a warm-started tiny policy: plays the rollout and is the "
                                            "tiny model (default: the tiny random model)")
    parser.add_argument("--algo", default="epo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-large", action="store_true", help="only the tiny model")
    parser.add_argument("--no-tiny", action="store_true", help="only the large model")
    parser.add_argument("--large-repeats", type=int, default=1, help="repeats for the large model")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    base = [f"algo={args.algo}", "env.level=small_pick_and_light", "env.prompt_template=compact",
            "algo.tasks_per_step=4", "algo.group_size=4", "env.max_turns=15", "env.eval_splits=[]",
            "logger.console=false", "logger.tensorboard=false", "trainer.total_steps=100", *args.overrides]
    tiny = [*base, f"model.path={args.model}"] if args.model else base
    roller = _trainer(tiny)
    batch = roller.sample(0, roller.cfg.trainer.total_steps).batch  # the training loop's own rollout
    roller.pool.close()
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    print(f"batch: {len(batch)} turn-samples, {sum(lengths)} tokens, lengths {min(lengths)}-{max(lengths)}")

    results = {"samples": len(batch), "tokens": sum(lengths), "models": {}}
    models = {"tiny": tiny, "large": [*base, *LARGE]}
    for name, skip in (("tiny", args.no_tiny), ("large", args.no_large)):
        if skip:
            models.pop(name)
    for name, overrides in models.items():
        repeats = args.repeats if name == "tiny" else args.large_repeats
        results["models"][name] = bench_model(name, overrides, batch, repeats)

    table = Table(title=f"bench_update ({args.algo}, {len(batch)} samples, median of {args.repeats} (tiny) / "
                        f"{args.large_repeats} (large) runs)")
    for col in ("model", "variant", "scoring CPU s", "update CPU s", "scoring share", "tokens/CPU s",
                "padding eff.", "reused", "vs padded (CPU)", "vs padded (wall)"):
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    for name, variants in results["models"].items():
        for variant, v in variants.items():
            table.add_row(name, variant, f"{v['score_cpu_s']:.2f}", f"{v['update_cpu_s']:.2f}",
                          f"{v['scoring_share']:.2f}", f"{v['tokens_per_cpu_s']:.0f}", f"{v['padding_efficiency']:.3f}",
                          f"{v['reused_share']:.2f}", f"{v['speedup_vs_padded']:.2f}x",
                          f"{v['wall_speedup_vs_padded']:.2f}x")
    Console().print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
