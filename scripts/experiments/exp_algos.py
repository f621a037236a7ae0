"""PPO vs GRPO vs PPO+EPO vs GRPO+EPO on household from the warm start: success and entropy stability.

    python scripts/experiments/exp_algos.py --out outputs/exp_algos [--warm-start RUN] [--algos ppo,grpo,epo_ppo,epo]
                                [--seeds 0,1,2] [--steps 20] [--jobs 2] [--episodes 64] [OVERRIDES...]

An ablation sweeps one more key and groups the table by its value (`--vary` names the key to group by):

    python scripts/experiments/exp_algos.py --out outputs/exp_ablation --algos epo --vary algo.loss_terms \
        'algo.loss_terms=[policy_clip,kl,entropy],[policy_clip,kl,entropy,entropy_smoothing]' entropy.coef=0.02

Serves two checks:
- learning check (RL core): from the SFT warm start, do ppo and grpo raise household success above the
  warm start's? Success is measured the same way for every policy: evaluate_run (`epo eval`, in this process)
  on the same fixed tasks of eval_in_distribution at the sampling temperature (1.0) and greedily.
- entropy experiment (EPO): entropy fluctuation of each algorithm: the mean relative step-to-step swing
  |H_t - H_{t-1}| / H_{t-1}, its maximum, and the monitor's sigma; next to final success.
The runs go through `epo sweep` (one subprocess per run, summary over seeds) and the curves through
`epo report`; this script adds the evaluations, the comparison table (Markdown) and a combined PNG.
It has no job loop of its own, so no exp_common study driver: the one `epo sweep` runs every (algo, seed)
itself, --jobs at a time through Hydra's joblib launcher.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from exp_common import epo, eval_rate, fluctuation, rows_of, seed_cell, warm_start_run
from omegaconf import OmegaConf

from epo_cli.rundir.saved_state import load_yaml

ALGO_NAMES = {"ppo": "PPO", "grpo": "GRPO", "gigpo": "GiGPO", "epo_ppo": "PPO+EPO", "epo": "GRPO+EPO"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/exp_algos")
    parser.add_argument("--warm-start", help="run dir of an existing warm start (default: train one)")
    parser.add_argument("--algos", default="ppo,grpo,epo_ppo,epo")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="parallel runs (hydra joblib launcher)")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--vary", help="config key (swept in OVERRIDES) whose value groups the table")
    parser.add_argument("overrides", nargs="*", help="extra overrides for every run")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    warm = warm_start_run(args.warm_start, out)

    sweep_root = out / "sweep"
    if not any(sweep_root.glob("sweeps/*/*/summary.csv")):
        launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}"] if args.jobs > 1 else []
        epo("sweep", "experiment=epo_household", f"algo={args.algos}", f"seed={args.seeds}",
            f"model.path={warm / 'final'}", f"trainer.total_steps={args.steps}", "trainer.eval_every=0",
            "env.eval_splits=[]", "logger=none", f"output_dir={sweep_root}", "sweep.name=algos", *launcher,
            *args.overrides, cwd=out)
    sweep = max(sweep_root.glob("sweeps/*/*"), key=lambda p: p.stat().st_mtime)  # epo sweep's layout
    epo("report", str(sweep), cwd=out)

    base_t1 = eval_rate(warm, out / "eval" / "warm_start", args.episodes, False)
    base_greedy = eval_rate(warm, out / "eval" / "warm_start", args.episodes, True)
    results: dict[str, dict[str, list[float]]] = {}
    for run in sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists()):
        config = load_yaml(run / "config.yaml")
        algo = config.algo.name
        if not (run / "final").exists():
            print(f"skipping unfinished run {run}")
            continue
        rows = rows_of(run)
        group = ALGO_NAMES.get(algo, algo)
        if args.vary:
            value = OmegaConf.select(config, args.vary)
            group += f" {args.vary}={OmegaConf.to_container(value) if OmegaConf.is_config(value) else value}"
        r = results.setdefault(group, {k: [] for k in ("t1", "greedy", "train_first", "train_last", "swing_mean",
                                                      "swing_max", "sigma", "entropy_range")})
        r["t1"].append(eval_rate(run, run / "eval_exp", args.episodes, False))
        r["greedy"].append(eval_rate(run, run / "eval_exp", args.episodes, True))
        r["train_first"].append(rows[0]["rollout/success"])
        r["train_last"].append(statistics.mean(x["rollout/success"] for x in rows[-3:]))
        for k, v in fluctuation(rows).items():
            r[k].append(v)

    lines = [f"Warm start: eval success {base_t1:.3f} (T=1.0), {base_greedy:.3f} (greedy) on {args.episodes} fixed "
             f"eval_in_distribution tasks.", "",
             "| algorithm | runs | eval success T=1.0 | eval success greedy | train success (last 3 iters) | "
             "entropy swing mean | entropy swing max | sigma (monitor) | entropy range / mean |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = [ALGO_NAMES.get(algo, algo) for algo in args.algos.split(",")]
    for group in sorted(results, key=lambda g: (order.index(g.split(" ")[0]) if g.split(" ")[0] in order else 99, g)):
        r = results[group]
        cells = [group, str(len(r["t1"]))] + [
            seed_cell(r[k])
            for k in ("t1", "greedy", "train_last", "swing_mean", "swing_max", "sigma", "entropy_range")]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "results.md").write_text(table + f"\n\nCurves: {sweep / 'plots' / 'index.md'}\n")
    (out / "results.json").write_text(json.dumps({"warm_start": {"t1": base_t1, "greedy": base_greedy},
                                                  "algos": results, "sweep": str(sweep)}, indent=1))
    print(table)
    print(f"\nwritten: {out / 'results.md'}, plots: {sweep / 'plots'}")


if __name__ == "__main__":
    main()
