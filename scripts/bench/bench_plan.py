"""`epo plan` against measured memory: 2 CPU ranks, ZeRO-0..3, one training step of the real pieces.

    OMP_NUM_THREADS=1 python scripts/bench/bench_plan.py                      # tiny and mid models, ZeRO 0-3
    python scripts/bench/bench_plan.py --algo ppo --models mid --stages 2,3    # with the critic
    python scripts/bench/bench_plan.py --models mid --stages 3 --micro 4 --prompt 96 --response 32

For each model size and ZeRO stage, 2 ranks start under the deepspeed launcher (CPU, fp32) and each rank
builds what a GRPO run's update holds, with the package's own functions: the policy (a Qwen2 model of the
`model.*` sizes, as model=tiny builds it), the KL reference (epo_cli.models.loading.frozen_copy), under ZeRO-3
the inference copy (epo_cli.training.engine.inference_copy), the DeepSpeed engine (build_engine, the config of
`deepspeed=zeroN`); `--algo ppo` adds the critic as training builds it (a ValueModel of a copy of the policy,
its own engine, its ZeRO-3 copy). It then runs two optimizer steps of micro-batches of random tokens through the
update's forward (epo_cli.training.forward.policy_forward: logits at the response tokens, fp32 log-softmax,
entropy), a reference forward, a clipped-ratio-free loss (-logprob - 0.001 x entropy + KL) and
engine.backward/step (and the critic's value_forward, squared error, backward/step).

Measured per rank:
    model states  every tensor the engine and its optimizer hold after the second step's backward (weights or
                  their ZeRO-3 partition, gradients, fp32 partitions, Adam moments, buckets), de-duplicated by
                  storage (bench_zero.count_memory)
    peak total    ru_maxrss at the end minus ru_maxrss just before the model is built (imports, the process
                  group and the allocator's start-up are not the run's), with glibc returning freed blocks to the
                  system (MALLOC_MMAP_THRESHOLD_=65536) so that RSS follows live memory
and `epo plan` for the same config (device cpu: fp32, no GPU reserve; 2 ranks; the bench's token lengths):
its model states (policy weights + gradients + optimizer) and its peak. The table prints both and their ratio.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: model sizes (model.* overrides); vocab = embedding rows
MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "mid": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=1024, padded_vocab_size=32768),
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=1024, padded_vocab_size=151936),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,mid")
    p.add_argument("--algo", default="grpo", choices=("grpo", "ppo"), help="ppo: also the critic and its engine")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per rank per optimizer step")
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def overrides(args: argparse.Namespace, model: str, stage: int) -> list[str]:
    sizes = [f"model.{k}={v}" for k, v in MODELS[model].items()]
    mini = args.micro * args.ranks * args.accumulation
    return ["model=tiny", *sizes, f"algo={args.algo}", f"deepspeed=zero{stage}", "trainer.device=cpu",
            f"algo.micro_batch_size={args.micro}", f"algo.mini_batch_size={mini}",
            f"algo.tasks_per_step={args.ranks}", "algo.group_size=2", "rollout.generation_batch_size=1",
            f"rollout.max_prompt_tokens={args.prompt}", f"rollout.max_new_tokens={args.response}"]


def child(args: argparse.Namespace) -> None:
    import resource

    import torch
    from bench_zero import count_memory
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from epo_cli.compose import compose
    from epo_cli.models.loading import ValueModel, frozen_copy
    from epo_cli.rollout.batch import MicroBatch
    from epo_cli.training.engine import build_engine, inference_copy, init_distributed
    from epo_cli.training.forward import policy_forward, value_forward
    from epo_cli.training.settings import engine_settings

    torch.set_num_threads(1)
    cfg = compose(overrides(args, args.model, args.stage))
    dist = init_distributed(cfg.trainer.device, cfg.launcher.timeout_s)
    m = cfg.model
    vocab = m.padded_vocab_size or m.vocab_size
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux reports KiB)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings, attn_implementation="sdpa"))
    ref = frozen_copy(model)
    template = inference_copy(model, args.stage)  # noqa: F841 - held, as RolloutModule holds it
    critic = None
    if args.algo == "ppo":  # as epo_cli/training/models.py builds it
        critic = ValueModel(frozen_copy(model))
        for p in critic.parameters():
            p.requires_grad_(True)
    engine = build_engine(model, engine_settings(cfg, dist), lr=1e-5)
    if critic is not None:
        critic_template = inference_copy(critic, args.stage)  # noqa: F841 - held, as the critic's RolloutModule
        critic = build_engine(critic, engine_settings(cfg, dist), lr=1e-5)
    P, R, B = args.prompt, args.response, args.micro
    gen = torch.Generator().manual_seed(dist.rank)
    states: dict[str, float] = {}
    for step in range(2):
        for _ in range(args.accumulation):
            ids = torch.randint(0, m.vocab_size, (B, P + R), generator=gen)
            mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids),
                            position_ids=torch.arange(P + R).expand(B, -1),
                            response_mask=torch.ones(B, R, dtype=torch.bool), prompt_width=P,
                            response_ids=ids[:, P:], turn_index=torch.zeros(B, dtype=torch.long),
                            num_turns=torch.ones(B, dtype=torch.long))
            with torch.no_grad():
                ref_logprobs = policy_forward(ref, mb, vocab_limit=m.vocab_size, with_entropy=False).logprobs
            out = policy_forward(engine, mb, vocab_limit=m.vocab_size)  # as the trainer: the tokenizer's logits
            log_ratio = ref_logprobs - out.logprobs
            kl = (log_ratio.exp() - log_ratio - 1).mean()  # k3 (low_var_kl)
            loss = -out.logprobs.mean() - 0.001 * out.entropy.mean() + 0.01 * kl
            engine.backward(loss / args.accumulation, scale_wrt_gas=False)
            if critic is not None:  # the critic's update: values at the last prompt token against a target
                value_loss = (value_forward(critic, mb) - 1.0).pow(2).mean()
                critic.backward(value_loss / args.accumulation, scale_wrt_gas=False)
        if step == 1:
            states = count_memory(engine)
            if critic is not None:
                states = {k: v + count_memory(critic)[k] for k, v in states.items()}
        engine.step()
        if critic is not None:
            critic.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    Path(args.out, f"rank{dist.rank}.json").write_text(json.dumps({"states": states, "peak": peak}))
    torch.distributed.barrier()


def run_world(args: argparse.Namespace, model: str, stage: int) -> list[dict[str, Any]]:
    from epo_cli.launch.deepspeed import run_cpu_world

    with tempfile.TemporaryDirectory(prefix="bench_plan") as tmp:
        # MALLOC_MMAP_THRESHOLD_: every block above 64 KiB is its own mapping, returned to the system when freed,
        # so the peak RSS is the peak of live memory (glibc's default keeps freed blocks of up to 32 MiB in its
        # heap: a cache, as PyTorch's CUDA allocator keeps reserved memory, which max_memory_allocated leaves out)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   MALLOC_MMAP_THRESHOLD_="65536")
        script = [str(Path(__file__).resolve()), "--child", "--out", tmp, "--model", model, "--stage", str(stage),
                  "--micro", str(args.micro), "--accumulation", str(args.accumulation), "--prompt", str(args.prompt),
                  "--response", str(args.response), "--ranks", str(args.ranks), "--algo", args.algo]
        run_cpu_world(script, args.ranks, env, check=True, stdout=subprocess.DEVNULL)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.ranks)]


def planned(args: argparse.Namespace, model: str, stage: int) -> tuple[float, float, int]:
    """`epo plan`'s model states and peak per rank for this config (fp32 CPU ranks), and the parameter count."""
    from epo_cli.analysis.plan import Planner, current_setup
    from epo_cli.compose import compose

    cfg = compose(overrides(args, model, stage))
    planner = Planner(cfg, gpu_mem_gib=1e6, device="cpu")
    setup = current_setup(cfg, args.ranks)
    return planner.model_states_bytes(setup), planner.estimate(setup).peak, planner.params


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    mib = 1024 * 1024
    rows = []
    what = "GRPO update (policy + KL reference)" if args.algo == "grpo" else "PPO update (policy, KL reference, critic)"
    print(f"2 CPU ranks, fp32, {what}, micro-batch {args.micro} x "
          f"({args.prompt} + {args.response}) tokens, {args.accumulation} micro-batches per step")
    print(f"{'model':<9}{'params':>9}{'stage':>6}{'states MiB':>12}{'plan':>9}{'ratio':>7}"
          f"{'peak MiB':>10}{'plan':>9}{'ratio':>7}")
    for model in args.models.split(","):
        for stage in [int(s) for s in args.stages.split(",")]:
            ranks = run_world(args, model, stage)
            measured_states = max(r["states"]["total"] for r in ranks)
            measured_peak = max(r["peak"] for r in ranks)
            plan_states, plan_peak, params = planned(args, model, stage)
            row = dict(model=model, algo=args.algo, params=params, stage=stage, states=measured_states,
                       plan_states=plan_states, peak=measured_peak, plan_peak=plan_peak)
            rows.append(row)
            print(f"{model:<9}{params / 1e6:>8.1f}M{stage:>6}{measured_states / mib:>12.1f}{plan_states / mib:>9.1f}"
                  f"{plan_states / measured_states:>7.2f}{measured_peak / mib:>10.1f}{plan_peak / mib:>9.1f}"
                  f"{plan_peak / measured_peak:>7.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
