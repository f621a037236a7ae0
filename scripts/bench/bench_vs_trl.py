"""epo vs TRL's GRPOTrainer: time per GRPO iteration on the same model, prompts and batch shape.

    python scripts/bench/bench_vs_trl.py [--model PATH] [--prompts 4] [--group 8] [--max-new-tokens 64]
                                   [--iterations 3] [--quick]

Single-turn on purpose (household with env.max_turns=1), the only setting TRL's GRPOTrainer supports:
each iteration takes `--prompts` tasks x `--group` completions, generates at temperature 1.0, scores them
(reward = 10 * won from the household env, the same for both), and makes one update with a KL term to
the frozen reference (beta 0.01, one PPO epoch, the whole batch in one micro-batch). epo runs first and
records its prompts (decoded); TRL then trains on exactly those prompts in the same order.

Each side runs in its own child process (one torch thread each, same environment), one after the other
in this command; the first iteration of each warms up and is not timed. Printed: median seconds per
iteration, generated tokens per iteration and the per-token time, and the ratios epo / TRL. Both stop
only at EOS or the token limit (TRL cannot stop at a string; `--epo-stop` keeps epo's </action> stop).
Target: <= 0.8.

TRL is an optional dependency: `pip install 'epo[bench]'` (make install includes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import scratch_dir, scratch_trainer

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KL_BETA = 0.01
LR = 1e-5


def epo_overrides(args: argparse.Namespace) -> list[str]:
    """The epo run that matches TRL's GRPO step (one update over the whole batch, KL 0.01)."""
    batch = args.prompts * args.group
    return [
        "algo=grpo", "env=household", "env.max_turns=1", "env.eval_splits=[]", "env.prompt_template=compact",
        f"algo.tasks_per_step={args.prompts}", f"algo.group_size={args.group}",
        f"algo.mini_batch_size={batch}", f"algo.micro_batch_size={batch}", "algo.ppo_epochs=1",
        f"algo.kl.coef={KL_BETA}", f"algo.lr={LR}", "algo.warmup_ratio=0.0", "algo.min_lr_ratio=1.0",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0",
        # TRL stops only at EOS or the token limit; epo's </action> stop would make its work smaller
        *([] if args.epo_stop else ["rollout.stop=''"]),
        f"trainer.total_steps={args.iterations + 1}", "trainer.eval_every=0", "trainer.save_every=0",
        "logger.console=false", "logger.tensorboard=false", f"seed={args.seed}",
        *([f"model.path={args.model}"] if args.model else []),
    ]


def run_epo(args: argparse.Namespace, out: Path) -> None:
    """Child: epo's own training step (Trainer.rl_step), timed per iteration; writes prompts + tasks."""
    import dataclasses

    import torch

    from epo_cli.compose import compose
    from epo_cli.models.loading import model_source

    torch.set_num_threads(1)
    cfg = compose(epo_overrides(args))
    trainer = scratch_trainer(cfg, "bench_vs_trl_epo_")
    seconds, tokens, samples = [], [], []

    def record(rollout, step: int) -> None:  # the trainer's own rollout, prompts kept for TRL
        for ep in rollout.episodes:
            samples.append({"prompt": trainer.models.tokenizer.decode(ep.turns[0].prompt_ids),
                            "task": dataclasses.asdict(ep.task)})
        tokens.append(rollout.stats.generated_tokens)

    trainer.on_rollout.append(record)
    for step in range(args.iterations + 1):
        t0 = time.perf_counter()
        trainer.rl_step(step, cfg.trainer.total_steps)
        seconds.append(time.perf_counter() - t0)
    trainer.pool.close()
    folder = str(model_source(cfg.model, trainer.suite, cfg.seed))  # the folder the trainer loaded
    out.write_text(json.dumps({"seconds": seconds, "tokens": tokens, "samples": samples, "model": folder}))


def run_trl(args: argparse.Namespace, epo_result: Path, out: Path) -> None:
    """Child: TRL's GRPOTrainer on epo's prompts (same order), timed per optimizer step by a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.envs.base import Task
    from epo_cli.rollout.actions import parse_action

    torch.set_num_threads(1)
    recorded = json.loads(epo_result.read_text())
    env = make_suite(compose(epo_overrides(args)).env).make_env()

    def household_reward(prompts: list[str], completions: list[str], task: list[dict], **_: object) -> list[float]:
        rewards = []
        for completion, spec in zip(completions, task):
            env.reset(Task(**spec))
            rewards.append(10.0 * float(env.step(parse_action(completion)[0]).info["won"]))
        return rewards

    # TRL repeats each prompt `num_generations` times itself: keep one row per group, in epo's order
    rows = recorded["samples"][:: args.group]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "task": r["task"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(recorded["model"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(recorded["model"], dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(scratch_dir("bench_vs_trl_trl_")), per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1, num_generations=args.group, max_completion_length=args.max_new_tokens,
        max_steps=args.iterations + 1, num_iterations=1, beta=KL_BETA, learning_rate=LR, lr_scheduler_type="constant",
        temperature=1.0, top_p=1.0, shuffle_dataset=False, use_cpu=True, bf16=False, fp16=False,
        logging_steps=10_000, save_strategy="no", report_to=[], seed=args.seed, dataloader_num_workers=0,
        disable_dropout=True, max_grad_norm=1.0,
    )
    seconds: list[float] = []
    tokens: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: object, **__: object) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: object, **__: object) -> None:
            seconds.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=model, reward_funcs=household_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    original_generate = trainer._generate

    def counting_generate(*a: object, **k: object):  # completion tokens actually generated
        result = original_generate(*a, **k)
        completion_ids = result[1] if isinstance(result, tuple) else result["completion_ids"]
        tokens.append(sum(len(c) for c in completion_ids))
        return result

    trainer._generate = counting_generate
    trainer.train()
    out.write_text(json.dumps({"seconds": seconds, "tokens": tokens}))


def _child(side: str, args: argparse.Namespace, workdir: Path) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--workdir", str(workdir), "--prompts", str(args.prompts),
           "--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens),
           "--iterations", str(args.iterations), "--seed", str(args.seed), *(["--epo-stop"] if args.epo_stop else [])]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the {side} side failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((workdir / f"{side}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder (default: the tiny model, random weights)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epo-stop", action="store_true",
                        help="keep epo's </action> stop string (less work for epo than for TRL)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape for CI: 2 x 2, 8 tokens, 1 iteration")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--side", choices=["epo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.group, args.max_new_tokens, args.iterations = 2, 2, 8, 1
    if args.side:
        workdir = Path(args.workdir)
        if args.side == "epo":
            run_epo(args, workdir / "epo.json")
        else:
            run_trl(args, workdir / "epo.json", workdir / "trl.json")
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("TRL is not installed: pip install 'epo[bench]' (or trl) into this environment, then rerun.")

    workdir = scratch_dir("bench_vs_trl_")
    results = {side: _child(side, args, workdir) for side in ("epo", "trl")}
    print(f"GRPO iteration: {args.prompts} prompts x {args.group} completions, <= {args.max_new_tokens} new "
          f"tokens, 1 update with KL; median of {args.iterations} after 1 warm-up")
    summary = {}
    for side, r in results.items():
        s = statistics.median(r["seconds"][1:])
        tok = statistics.median(r["tokens"][1:])
        summary[side] = {"s_per_iter": s, "tokens_per_iter": tok, "ms_per_token": 1000 * s / max(tok, 1)}
        print(f"  {side:4s} {s:8.3f} s/iteration  {tok:7.0f} generated tokens/iteration  "
              f"{summary[side]['ms_per_token']:7.2f} ms per generated token")
    summary["ratio_s_per_iter"] = summary["epo"]["s_per_iter"] / summary["trl"]["s_per_iter"]
    summary["ratio_ms_per_token"] = summary["epo"]["ms_per_token"] / summary["trl"]["ms_per_token"]
    print(f"epo / TRL time per iteration: {summary['ratio_s_per_iter']:.3f}  (target <= 0.8); "
          f"per generated token: {summary['ratio_ms_per_token']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
