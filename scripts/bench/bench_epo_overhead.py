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

from common import scratch_dir

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

    from epo_cli.algos.advantages import compute_advantages
    from epo_cli.algos.entropy import step_statistics
    from epo_cli.algos.losses import LossStack, build_loss_terms, loss_coefficients
    from epo_cli.compose import compose
    from epo_cli.training.trainer import Trainer
    from epo_cli.training.update import PolicyUpdate

    overrides = ["experiment=epo_household", "logger.console=false", "logger.tensorboard=false"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    cfg = compose([*overrides, *args.overrides])
    run = scratch_dir("bench_epo_")
    cfg.run_dir = str(run)
    trainer = Trainer(cfg, run)
    algo = cfg.algo

    rollout = trainer.sampler.sample(trainer.models.sampling_policy(cfg.rollout), 0, cfg.trainer.total_steps)
    batch = trainer.update.score(rollout.batch).apply(rollout.batch)
    batch.advantages, batch.returns = compute_advantages(batch, algo)
    # a non-empty history, so the smoothing term does its full work
    sums, counts = step_statistics(batch.entropy, batch.turn_index, cfg.env.max_turns)
    trainer.entropy.history.update(sums, counts)

    # two update parts on the same models: the EPO loss stack, and it without its entropy terms
    updates = {"epo": (trainer.update, list(algo.loss_terms))}
    base_terms = [t for t in algo.loss_terms if t not in ("entropy", "entropy_smoothing")]
    algo.loss_terms = base_terms
    updates["grpo"] = (PolicyUpdate(cfg, trainer.dist, trainer.models, LossStack(build_loss_terms(algo))), base_terms)
    times: dict[str, list[float]] = {"epo": [], "grpo": []}
    for rep in range(args.repeats + 1):
        for name in ("grpo", "epo") if rep % 2 else ("epo", "grpo"):
            update, terms = updates[name]
            algo.loss_terms = terms  # the update part reads cfg.algo (e.g. whether entropies are needed)
            coefs = loss_coefficients(algo, 0.001, 1.5, algo.kl.coef)
            t0 = time.perf_counter()
            update.run(batch, coefs, step=rep, history=trainer.entropy.history)
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
