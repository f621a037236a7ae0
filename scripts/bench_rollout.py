"""Rollout and update overheads of the RL loop, measured in one process against in-process baselines.

    python scripts/bench_rollout.py [--model PATH] [--algo grpo] [--iterations 3] [OVERRIDES...]

rollout overhead = wall time of a rollout / (time inside generate + time inside env.step)
update overhead  = loss-stack update time / a plain causal-LM forward+backward(+step) over the same
                   micro-batches (same padded tokens, HF's built-in cross-entropy on all positions)
padding efficiency = real tokens / padded tokens in the update's micro-batches
Targets (issue): rollout overhead <= 1.10, update overhead <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder of a warm-started policy (default: tiny random model)")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from epo_cli.algos.advantages import ESTIMATORS
    from epo_cli.config import compose
    from epo_cli.training.forward import collate, plan_micro_batches
    from epo_cli.training.trainer import Trainer

    overrides = [f"algo={args.algo}", "env.level=small_pick_and_light", "env.prompt_template=compact",
                 "algo.tasks_per_step=4", "algo.group_size=4", "env.max_turns=15", "env.eval_splits=[]",
                 "logger.console=false", "logger.tensorboard=false", "trainer.total_steps=100"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    cfg = compose([*overrides, *args.overrides])
    run = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    cfg.run_dir = str(run)
    trainer = Trainer(cfg, run)
    algo = cfg.algo

    rollout_ratio, update_ratio, efficiencies = [], [], []
    for it in range(args.iterations):
        _, batch, stats = trainer.rollout(it, cfg.trainer.total_steps)  # the training loop's own rollout
        rollout_ratio.append(stats.rollout_s / (stats.generate_s + stats.env_s))
        trainer.score(batch)
        batch.advantages, batch.returns = ESTIMATORS[algo.estimator](batch, algo)
        coefs = {name: 1.0 for name in algo.loss_terms}

        t0 = time.perf_counter()
        metrics = trainer.update(batch, coefs, step=it)
        update_s = time.perf_counter() - t0
        efficiencies.append(metrics["perf/padding_efficiency"])

        # baseline: plain forward+backward+step of the causal LM over the same micro-batches
        engine, pad = trainer.engine, trainer.tokenizer.pad_token_id
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        t0 = time.perf_counter()
        for rows in trainer.mini_batches(batch, it, 0):
            for micro in plan_micro_batches(rows, lengths, algo.micro_batch_size):
                mb = collate(batch, micro, pad, trainer.dist.device)
                labels = mb.input_ids.masked_fill(mb.attention_mask == 0, -100)
                loss = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                              position_ids=mb.position_ids, labels=labels).loss
                engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        plain_s = time.perf_counter() - t0
        update_ratio.append(update_s / plain_s)
        print(f"iteration {it}: rollout {stats.rollout_s:.2f}s (generate {stats.generate_s:.2f}s, env "
              f"{stats.env_s:.3f}s), update {update_s:.2f}s vs plain {plain_s:.2f}s, {len(batch)} samples")

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    table = Table(title=f"bench_rollout ({args.algo}, {args.iterations} iterations)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("rollout overhead", f"{mean(rollout_ratio):.3f}", "<= 1.10")
    table.add_row("update overhead", f"{mean(update_ratio):.3f}", "<= 1.15")
    table.add_row("padding efficiency", f"{mean(efficiencies):.3f}", "")
    Console().print(table)
    trainer.pool.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
