"""What choosing Clip-Cov / KL-Cov tokens over the whole mini-batch costs: the update of one household batch
with algo.policy_loss clip, clip_cov and kl_cov, in one process.

    python scripts/bench/bench_cov_selection.py [--model PATH] [--repeats 3] [OVERRIDES...]

One rollout gives the batch; each policy loss then scores and updates that same batch from the same weights
(restored before every run), interleaved (clip, clip_cov, kl_cov, clip, ...). clip_cov and kl_cov run one
no-grad forward per mini-batch before its forward/backward passes (the current policy's log-probs, from
which the tokens are chosen: epo_cli/algos/cov_selection.py); the table shows the update's median CPU
seconds (this process, one torch thread) against clip's.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

from common import scratch_trainer

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

LOSSES = ("clip", "clip_cov", "kl_cov")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a policy folder (e.g. <warm start run>/final)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="config overrides")
    args = parser.parse_args()

    from omegaconf import OmegaConf
    from rich.console import Console

    from epo_cli.algos.losses import LossStack, build_loss_terms
    from epo_cli.compose import compose
    from epo_cli.training.update import PolicyUpdate

    overrides = ["algo=epo", "env.level=small_pick_and_light", "env.prompt_template=compact",
                 "algo.tasks_per_step=4", "algo.group_size=4", "env.max_turns=15", "env.eval_splits=[]",
                 "logger.console=false", "logger.tensorboard=false", "trainer.total_steps=100",
                 *([f"model.path={args.model}"] if args.model else []), *args.overrides]
    cfg = compose(overrides)
    trainer = scratch_trainer(cfg, "bench_cov_selection_")
    total = cfg.trainer.total_steps
    batch = trainer.sample(0, total).batch  # the trainer's own rollout (rl_step's step 1)
    trainer.pool.close()
    tokens = sum(len(r) for r in batch.response_ids)
    print(f"batch: {len(batch)} turn-samples, {tokens} response tokens, mini-batches of {cfg.algo.mini_batch_size}")
    updates = {}  # one update part per policy loss, over the trainer's models (so the same weights)
    for name in LOSSES:
        algo = copy.deepcopy(cfg.algo)
        OmegaConf.set_readonly(algo, False)
        algo.policy_loss = name
        updates[name] = PolicyUpdate(cfg, trainer.dist, trainer.models, LossStack(build_loss_terms(algo)))
    initial = copy.deepcopy(trainer.engine.module.state_dict())
    cpu: dict[str, list[float]] = {name: [] for name in LOSSES}
    for r in range(args.repeats):
        for name in LOSSES:
            trainer.engine.module.load_state_dict(initial)
            update = updates[name]
            # rl_step's steps 2-5 with this policy loss's update part
            b = trainer.advantages(update.score(batch, 0))
            coefs = trainer.coefficients(0, total, b)
            c0 = time.process_time()
            update.run(b, coefs.loss, 0, trainer.entropy.history)
            cpu[name].append(time.process_time() - c0)
            print(f"repeat {r} {name}: update {cpu[name][-1]:.3f} CPU s", flush=True)
    base = statistics.median(cpu["clip"])
    for name in LOSSES:
        med = statistics.median(cpu[name])
        Console().print(f"{name:>9}: update {med:.3f} CPU s (median of {args.repeats})  vs clip {med / base:.2f}x")


if __name__ == "__main__":
    main()
