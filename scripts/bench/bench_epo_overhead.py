"""What EPO adds to the update step: the same rollout batch updated with and without the EPO terms.

    python scripts/bench/bench_epo_overhead.py [--model PATH] [--repeats 6] [OVERRIDES...]

Both variants run in this process on the same batch, interleaved (A B A B ...) so machine noise hits
both alike: `grpo` = [policy_clip, kl]; `epo` = [policy_clip, kl, entropy, entropy_smoothing] (the
entropy of the full next-token distribution in the forward pass, the nested-mean entropy term, the
smoothing hinge against the history). Target: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import scratch_trainer

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder of a warm-started policy (default: tiny random model)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import torch

    from epo_cli.algos.losses import LossStack, build_loss_terms
    from epo_cli.compose import compose
    from epo_cli.training.update import PolicyUpdate

    overrides = ["experiment=epo_household", "logger.console=false", "logger.tensorboard=false"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    cfg = compose([*overrides, *args.overrides])
    trainer = scratch_trainer(cfg, "bench_epo_")
    total = cfg.trainer.total_steps

    # the trainer's own steps 1-5 give the batch, every row scored (the update's result), and a non-empty
    # entropy history (step 6), so the smoothing term does its full work
    batch = trainer.advantages(trainer.score(trainer.sample(0, total).batch, 0))
    coefs = trainer.coefficients(0, total, batch)
    batch = trainer.update(batch, coefs, 0).batch
    trainer.entropy.observe(trainer.entropy.statistics(batch, 0, trainer.turn_width(0, total), print))

    # two update parts on the same models: the EPO loss stack, and it without its entropy terms
    terms = build_loss_terms(cfg.algo)
    grpo = LossStack(torch.nn.ModuleDict({name: term for name, term in terms.items()
                                          if name not in ("entropy", "entropy_smoothing")}))
    updates = {"epo": trainer.policy_update,
               "grpo": PolicyUpdate(cfg, trainer.dist, trainer.models, grpo)}
    times: dict[str, list[float]] = {"epo": [], "grpo": []}
    for rep in range(args.repeats + 1):
        for name in ("grpo", "epo") if rep % 2 else ("epo", "grpo"):
            t0 = time.perf_counter()
            updates[name].run(batch, coefs.loss, step=rep, history=trainer.entropy.history)
            if rep > 0:  # the first round warms up allocator and caches
                times[name].append(time.perf_counter() - t0)
    epo_s, base_s = statistics.median(times["epo"]), statistics.median(times["grpo"])
    print(f"batch: {len(batch)} turn-samples; update time median of {args.repeats}: "
          f"grpo {base_s:.3f}s, epo {epo_s:.3f}s")
    print(f"EPO update-step overhead ratio (epo / grpo): {epo_s / base_s:.3f}  (target <= 1.05)")
    trainer.pool.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
