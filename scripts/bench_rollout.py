"""Rollout and update overheads of the RL loop, measured in one process against in-process baselines.

    python scripts/bench_rollout.py [--model PATH] [--algo grpo] [--iterations 3] [OVERRIDES...]
    python scripts/bench_rollout.py --modes [--envs household,alfworld] [--iterations 2] [--model PATH]

--modes: the rollout's speed-ups (rollout.overlap, rollout.shared_prefill) on each env, against lock-step
rollouts of the same tasks in the same run (modes interleaved per iteration, so drift in the machine's
load hits all alike). Every mode must play the same episodes as lock-step ("same" column).
overlap ratio = rollout_s / (generate_s + env_s); env_s = resets + time some env was stepping.
ALFWorld plays the shared games (--alfworld-data, default $ALFWORLD_DATA or ../shared/alfworld) with
--alfworld-workers env workers (default 2). household-sleepy: household in as many workers, each step
sleeping --sleep-ms (an env that waits instead of computing: what overlap hides when the CPU is busy).
Targets (issue 12): overlap ratio <= 0.75 and rollout >= 1.4x faster on ALFWorld with 2 workers;
household not slower.

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


class SleepyEnv:
    """An env whose steps take `delay_s` longer without using the CPU (a remote or I/O-bound env)."""

    def __init__(self, env, delay_s: float) -> None:
        self.env, self.delay_s = env, delay_s

    def reset(self, task):
        time.sleep(5 * self.delay_s)
        return self.env.reset(task)

    def step(self, action):
        time.sleep(self.delay_s)
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


class SleepySuite:
    def __init__(self, suite, delay_s: float) -> None:
        self.suite, self.delay_s = suite, delay_s

    def make_env(self) -> SleepyEnv:
        return SleepyEnv(self.suite.make_env(), self.delay_s)


#: (name, rollout.overlap, rollout.shared_prefill); the first is the baseline
MODES = [("lock-step", False, False), ("shared prefill", False, True), ("overlap", True, False),
         ("overlap + shared prefill", True, True)]


def env_overrides(env: str, args: argparse.Namespace) -> list[str]:
    if env.startswith("household"):
        workers = args.household_workers if env == "household" else args.alfworld_workers
        return ["env=household", "env.level=small_pick_and_light", "env.prompt_template=compact",
                f"env.num_workers={workers}", "env.max_turns=15"]
    shared = [Path(__file__).resolve().parents[1].parent / "shared" / "alfworld", Path("/work/shared/alfworld")]
    found = [str(p) for p in shared if (p / "json_2.1.1").is_dir()]
    data = args.alfworld_data or os.environ.get("ALFWORLD_DATA") or (found[0] if found else str(shared[0]))
    return ["env=alfworld", f"env.data_dir={data}", f"env.num_workers={args.alfworld_workers}",
            f"env.max_turns={args.alfworld_turns}", "env.expert=false"]


def compare_modes(env: str, args: argparse.Namespace) -> list[tuple[str, dict[str, float], bool]]:
    """Each mode's mean rollout figures on `env`, and whether it played the same episodes as lock-step."""
    from epo_cli.compose import compose
    from epo_cli.training.trainer import Trainer

    overrides = [f"algo={args.algo}", *env_overrides(env, args), f"algo.tasks_per_step={args.tasks}",
                 f"algo.group_size={args.group_size}", "env.eval_splits=[]", "logger.console=false",
                 "logger.tensorboard=false", "trainer.total_steps=100", "model=tiny"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    cfg = compose([*overrides, *args.overrides])
    run = Path(tempfile.mkdtemp(prefix=f"bench_rollout_{env}_"))
    cfg.run_dir = str(run)
    trainer = Trainer(cfg, run)
    if env == "household-sleepy":  # steps that wait without computing: what overlap can hide on a busy CPU
        from epo_cli.envs.pool import EnvPool

        trainer.pool.close()
        trainer.pool = EnvPool(SleepySuite(trainer.suite, args.sleep_ms / 1000), num_workers=args.alfworld_workers)
    try:
        # start the workers and build every slot's env before timing (a one-off cost of the first rollout)
        import random

        n = args.tasks * args.group_size
        trainer.pool.reset(trainer.suite.sample_tasks(cfg.env.train_split, n, random.Random(0)))
        sums = {name: {"rollout_s": 0.0, "generate_s": 0.0, "env_s": 0.0, "env_wait_s": 0.0} for name, _, _ in MODES}
        same = {name: True for name, _, _ in MODES}
        for it in range(args.iterations):
            order = MODES if it % 2 == 0 else MODES[::-1]
            played = {}
            for name, overlap, prefill in order:
                cfg.rollout.overlap, cfg.rollout.shared_prefill = overlap, prefill
                episodes, _, stats = trainer.rollout(it, cfg.trainer.total_steps)
                first_prompts = [ep.turns[0].prompt_ids for ep in episodes if ep.turns]
                played[name] = [(ep.traj_id, [(t.response_ids, t.observation) for t in ep.turns]) for ep in episodes]
                for key in sums[name]:
                    sums[name][key] += getattr(stats, key) / args.iterations
                print(f"  {env} iteration {it} {name}: rollout {stats.rollout_s:.2f}s (generate "
                      f"{stats.generate_s:.2f}s, env {stats.env_s:.2f}s, waited {stats.env_wait_s:.2f}s), "
                      f"{stats.env_steps} steps", flush=True)
            reference = played[MODES[0][0]]
            for name in played:
                same[name] &= played[name] == reference
        prefill = time_first_turn(trainer, first_prompts)
    finally:
        trainer.pool.close()  # the process group stays: DeepSpeed keeps its groups for the next Trainer
    print(f"  {env} first-turn generate call ({len(first_prompts)} rows, {len(set(map(tuple, first_prompts)))} "
          f"distinct prompts), best of 5: {prefill[False]:.3f}s plain, {prefill[True]:.3f}s shared prefill "
          f"({prefill[False] / prefill[True]:.2f}x)", flush=True)
    return [(name, sums[name], same[name]) for name, _, _ in MODES]


def time_first_turn(trainer, prompts: list[list[int]]) -> dict[bool, float]:
    """Best-of-5 wall time of one generate call over a rollout's first-turn prompts, with and without
    shared prefill (interleaved): the saving, without the rest of the rollout's noise."""
    from epo_cli.rollout.generation import generate

    policy = trainer._model_policy(trainer.cfg.rollout.temperature)
    seeds = list(range(len(prompts)))
    best = {False: float("inf"), True: float("inf")}
    for _ in range(5):
        for shared in (False, True):
            t0 = time.perf_counter()
            generate(policy.model, prompts, policy.params, policy.tokenizer, seeds=seeds,
                     vocab_limit=policy.vocab_limit, shared_prefill=shared)
            best[shared] = min(best[shared], time.perf_counter() - t0)
    return best


def print_modes(results: dict[str, list[tuple[str, dict[str, float], bool]]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench_rollout --modes ({args.algo}, {args.tasks}x{args.group_size} envs, "
                        f"{args.iterations} iterations, means)")
    for column in ("env", "mode", "rollout s", "generate s", "env s", "waited s", "overlap ratio",
                   "speed-up vs lock-step", "same episodes"):
        table.add_column(column, justify="left" if column in ("env", "mode") else "right")
    for env, rows in results.items():
        base = rows[0][1]["rollout_s"]
        for name, m, same in rows:
            ratio = m["rollout_s"] / max(m["generate_s"] + m["env_s"], 1e-9)
            table.add_row(env, name, f"{m['rollout_s']:.2f}", f"{m['generate_s']:.2f}", f"{m['env_s']:.2f}",
                          f"{m['env_wait_s']:.2f}", f"{ratio:.3f}", f"{base / m['rollout_s']:.2f}x",
                          "yes" if same else "NO")
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder of a warm-started policy (default: tiny random model)")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--modes", action="store_true", help="compare the rollout modes (see above)")
    parser.add_argument("--envs", default="household,alfworld", help="--modes: envs to run, comma-separated")
    parser.add_argument("--tasks", type=int, default=4, help="--modes: algo.tasks_per_step")
    parser.add_argument("--group-size", type=int, default=4, help="--modes: algo.group_size")
    parser.add_argument("--alfworld-data", help="--modes: ALFWorld games folder")
    parser.add_argument("--alfworld-workers", type=int, default=2)
    parser.add_argument("--alfworld-turns", type=int, default=10)
    parser.add_argument("--household-workers", type=int, default=0)
    parser.add_argument("--sleep-ms", type=float, default=40.0,
                        help="--modes: env household-sleepy (household with --alfworld-workers workers): each step "
                             "sleeps this long (a reset 5x), like ALFWorld's ~15 steps/s but without the CPU")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    if args.modes:
        results = {}
        for env in args.envs.split(","):
            results[env] = compare_modes(env.strip(), args)
        print_modes(results, args)
        import torch

        torch.distributed.destroy_process_group()
        return

    import torch
    from rich.console import Console
    from rich.table import Table

    from epo_cli.algos.advantages import compute_advantages
    from epo_cli.compose import compose
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
        batch.advantages, batch.returns = compute_advantages(batch, algo)
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
