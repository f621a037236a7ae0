"""What one RL iteration of the real model costs on this CPU, part by part, and what each of the RL preset's
cuts buys (issue 39, item 5): `experiment=smollm2_rl` (the GRPO arm of the real-model study) against the same
preset with one setting changed, each an iteration of the trainer's own steps (scripts/gpu_check.py's
`measure`: sample, score, advantages, coefficients, update) from the same weights, seed and tasks.

    python scripts/bench/bench_real_iteration.py --model <warm start run>/final [--settings preset,lora_16]
        [--repeats 2] [--json out.json] [OVERRIDES...]

The preset runs first, between the rounds and last; with --repeats 2 the second round runs the settings in the
reverse order (preset, A, B, C, preset, C, B, A, preset), so that a steady drift in the machine's load hits each
setting's mean as it hits the preset's. Every ratio is a setting's mean against the mean of the preset's runs,
whose spread is printed (the machine's drift). Parts:

    generate s   inside the engine's generate calls (prefill + decoding), of the rollout
    env s        the environment's resets and steps, of the rollout
    score s      the old policy's scoring pass (~0 where the update's first forward scores the rows)
    update s     forward + backward + optimizer step of every mini-batch
    iteration s  rollout + score + update

Beside each measured ratio, the ratio `epo plan --device cpu` predicts for the same change, from a throughput
file holding the preset's measured tokens/s and each setting's measured prompt and response lengths: where the
two disagree, the plan does not model that setting's cost.

Episodes are sampled, so two settings play the same tasks but not the same turns: the per-token rates are the
fair comparison, the iteration time is what a user waits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from common import scratch_dir, scratch_trainer  # noqa: E402
from exp_real_model import ARMS  # noqa: E402

#: the real-model study's GRPO arm
PRESET = ["experiment=smollm2_rl", *ARMS["grpo"], "env.eval_splits=[]", "logger.console=false",
          "logger.tensorboard=false", "logger.jsonl=false", "trainer.save_every=0"]
#: setting -> the overrides that undo one of the preset's cuts (or take one more: lora_16)
SETTINGS = {
    "preset": [],
    "history_3": ["env.history_length=3", "rollout.max_prompt_tokens=768"],  # three past turns, not one
    "template_alfworld": ["env.prompt_template=alfworld", "rollout.max_prompt_tokens=768"],  # the long prompt
    "group_8": ["algo.group_size=8"],  # 2 tasks x 8 rollouts: twice the episodes
    "no_scoring_reuse": ["algo.reuse_scoring_forward=false"],  # a separate scoring forward
    "kl_on": ["algo.loss_terms=[policy_clip,kl]", "algo.kl.coef=0.01"],  # GRPO's KL: a reference forward
    "lora_16": ["model.lora.rank=16", "algo.lr=1e-4"],  # LoRA instead of full fine-tuning
    "bf16_autocast": ["model.autocast=bf16"],  # fp32 weights, every forward in bf16 (mixed precision)
    "lora_16_bf16": ["model.lora.rank=16", "algo.lr=1e-4", "model.autocast=bf16"],  # both cuts
}
PARTS = ("generate_s", "env_s", "score_s", "update_s")


def measure_setting(name: str, model: str, overrides: list[str]) -> dict:
    """One RL iteration of the preset with setting `name`, in a scratch run directory; its timings and sizes."""
    from gpu_check import measure

    from epo_cli.compose import compose

    cfg = compose([*PRESET, f"model.path={model}", *SETTINGS[name], *overrides])
    trainer = scratch_trainer(cfg, f"bench_real_{name}_")
    try:
        result = measure(trainer, 0, lambda: None)
    finally:
        trainer.pool.close()
        trainer.logger.close()
        del trainer
        gc.collect()
    result["iteration_s"] = result["rollout_s"] + result["score_s"] + result["update_s"]
    result["config"] = cfg
    return result


def planned_iteration_s(cfg, throughput: Path, prompt: float, response: float) -> float:
    """`epo plan --device cpu --throughput FILE` for this config at these lengths: its iteration seconds."""
    from epo_cli.analysis.plan import make_plan

    plan = make_plan(cfg, 1, None, "cpu", str(throughput), max(1, round(prompt)), max(1, round(response)))
    return float(plan.time["iteration_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the policy folder (the real-model study's warm start final/)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the settings, alternating order")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="further config overrides, applied to every setting")
    args = parser.parse_args()
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    if not Path(args.model, "config.json").is_file():
        parser.error(f"--model {args.model}: not a model folder (no config.json); give a warm start's final/")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    settings = [n for n in names if n != "preset"]
    order = ["preset"]
    for round_ in range(args.repeats):
        order += [*(settings if round_ % 2 == 0 else settings[::-1]), "preset"]
    results: dict[str, list[dict]] = {}
    for i, name in enumerate(order):
        r = measure_setting(name, args.model, args.overrides)
        results.setdefault(name, []).append(r)
        print(f"[{i + 1}/{len(order)}] {name}: " + json.dumps(
            {k: round(v, 2) for k, v in r.items() if isinstance(v, float | int) and not isinstance(v, bool)}),
            flush=True)

    presets = results["preset"]
    base = {k: sum(r[k] for r in presets) / len(presets) for k in (*PARTS, "iteration_s")}
    first = presets[0]
    throughput = scratch_dir("bench_real_plan_") / "throughput.json"
    throughput.write_text(json.dumps({"device": "cpu", "rollout_tokens_per_s": first["rollout_tokens_per_s"],
                                      "update_tokens_per_s": first["update_tokens_per_s"]}))
    planned = {name: planned_iteration_s(rs[0]["config"], throughput, rs[0]["prompt_tokens_mean"],
                                         rs[0]["response_tokens_mean"]) for name, rs in results.items()}
    rows = []
    for name in dict.fromkeys(order):
        runs = results[name]
        r = {k: sum(x[k] for x in runs) / len(runs) for k in (*PARTS, "iteration_s", "samples",
                                                              "prompt_tokens_mean", "response_tokens_mean",
                                                              "rollout_tokens_per_s", "update_tokens_per_s")}
        r["setting"], r["overrides"] = name, SETTINGS[name]
        r["ratio_iteration"] = r["iteration_s"] / base["iteration_s"]
        r["ratio_planned"] = planned[name] / planned["preset"]
        rows.append(r)

    print(f"\npreset measured {len(presets)} times: " + ", ".join(f"{r['iteration_s']:.1f}" for r in presets) +
          " s (the machine's drift)")
    print("\n| setting | samples | prompt tokens | generate s | env s | score s | update s | iteration s | "
          "vs preset | plan's ratio | update tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['samples']:.0f} | {r['prompt_tokens_mean']:.0f} | {r['generate_s']:.1f} | "
              f"{r['env_s']:.2f} | {r['score_s']:.1f} | {r['update_s']:.1f} | {r['iteration_s']:.1f} | "
              f"{r['ratio_iteration']:.2f}x | {r['ratio_planned']:.2f}x | {r['update_tokens_per_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "overrides": args.overrides, "rows": rows,
                                               "preset_runs_s": [x["iteration_s"] for x in presets]},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
