"""The real-model study: what RL and EPO do to SmolLM2-135M-Instruct (model=smollm2-135m), end to end.

    python scripts/experiments/exp_real_model.py --out outputs/real_model [--arms grpo,epo,gigpo,grpo_lora]
        [--seeds 0,1,2] [--iterations 20] [--episodes 64] [--jobs 1] [--quick]

1. warm start  epo train experiment=smollm2_warm_start run_dir=<out>/warm_start trainer.resume=auto
2. RL          epo train experiment=smollm2_rl <arm> seed=S model.path=<1>/final run_dir=<out>/runs/<arm>-s<S>
               trainer.resume=auto          (one run per arm and seed, --jobs side by side)
3. evaluation  epo eval experiment=smollm2_household (zero-shot) | run=<1|2> episodes=E temperature=1.0
               seed=EVAL_SEED env.max_turns=EVAL_MAX_TURNS: every policy on the same E fixed unseen tasks
               (eval_in_distribution: tasks the training split never draws) with the same turn limit (the RL
               runs'), one at a time
4. summary     <out>/summary.json, summary.md (success with 95% intervals, gain over the warm start, the
               target, entropy per iteration and per turn, EPO's band) and <out>/real_model.png

Every step is resumable: rerunning the same command skips what is done and continues an interrupted training
run from its last checkpoint (trainer.resume=auto), so the study can be run in parts. Each command is printed
before it runs and its console goes to <out>/logs/. `--quick` shrinks every step to check the pipeline (its
numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from exp_common import say

from epo_cli.loggers.jsonl import read_metrics
from epo_cli.rundir.writable import json_ready

EPO = [sys.executable, "-m", "epo_cli"]
#: the eval tasks' seed: every policy plays the same fixed tasks
EVAL_SEED = 1000
#: every policy is evaluated with the same turn limit, the one RL trains with (experiment=smollm2_rl's
#: env.max_turns): the warm start's own preset allows 15 turns, and a policy given more turns wins more often
EVAL_MAX_TURNS = 10
#: arm -> overrides on top of experiment=smollm2_rl (loss terms named whole: the KL term is off at this scale)
ARMS = {
    "grpo": ("algo=grpo", "algo.loss_terms=[policy_clip]"),
    "epo": ("algo=epo", "algo.loss_terms=[policy_clip,entropy,entropy_smoothing]"),
    "gigpo": ("algo=gigpo", "algo.loss_terms=[policy_clip]"),
    "grpo_lora": ("algo=grpo", "algo.loss_terms=[policy_clip]", "model.lora.rank=16", "algo.lr=1e-4"),
}
LABELS = {"grpo": "GRPO", "epo": "EPO (paper settings)", "gigpo": "GiGPO", "grpo_lora": "GRPO, LoRA r16"}
#: what --quick changes (a pipeline check, not a result)
QUICK_WARM = ("trainer.total_steps=2", "algo.demo_episodes=4", "trainer.save_every=1")
QUICK_RL = ("algo.tasks_per_step=1", "algo.group_size=2", "env.max_turns=2", "rollout.max_new_tokens=8",
            "algo.micro_batch_size=4")
QUICK_EVAL = ("rollout.max_new_tokens=8",)
QUICK_EVAL_TURNS = 2
#: an iteration's parts as the trainer logs them (perf/generate_s and perf/env_s are parts of perf/rollout_s)
PARTS = ("perf/rollout_s", "perf/score_s", "perf/update_s")
#: the issue's target over the warm start's success: every seed at least +0.2, the mean at least +0.3
SEED_GAIN, MEAN_GAIN = 0.2, 0.3


def run_logged(args: list[str], log: Path, cwd: Path) -> None:
    """`epo ARGS`, its console in `log`; exits with one message naming the log when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"$ epo {' '.join(args)}    (console: {log})")
    start = time.time()
    with open(log, "a") as handle:
        proc = subprocess.run([*EPO, *args], cwd=cwd, stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        sys.exit(f"epo {args[0]} failed (exit code {proc.returncode}) after {time.time() - start:.0f} s; its "
                 f"console is in {log}:\n  " + "\n  ".join(tail))
    say(f"  done in {time.time() - start:.0f} s")


def finished(run: Path) -> bool:
    try:
        return json.loads((run / "status.json").read_text())["status"] == "finished" and (run / "final").is_dir()
    except (OSError, ValueError, KeyError):
        return False


def train(run: Path, args: list[str], out: Path) -> Path:
    """Train `run` unless it finished; an interrupted one continues from its last checkpoint."""
    if not finished(run):
        run_logged(["train", *args, f"run_dir={run}", "trainer.resume=auto"], out / "logs" / f"{run.name}.log", out)
    return run


def evaluate(name: str, source: list[str], a: argparse.Namespace) -> dict:
    """The eval JSON of one policy on the study's fixed tasks at the study's turn limit (kept and reused when
    the study runs again; an earlier result at another turn limit is kept too, in eval/<name>/, and not
    reused)."""
    turns = QUICK_EVAL_TURNS if a.quick else EVAL_MAX_TURNS
    for target in (a.out / "eval" / name, a.out / "eval" / f"{name}-t{turns}"):
        for found in sorted(target.glob("*.json")):
            result = json.loads(found.read_text())
            if result.get("max_turns") == turns and result.get("episodes") == a.episodes:
                return result
    extra = QUICK_EVAL if a.quick else ()
    run_logged(["eval", *source, f"episodes={a.episodes}", "temperature=1.0", f"seed={EVAL_SEED}",
                "split=eval_in_distribution", f"env.max_turns={turns}", f"out={target}", *extra],
               a.out / "logs" / f"eval-{target.name}.log", a.out)
    return json.loads(sorted(target.glob("*.json"))[0].read_text())


def training_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if "policy/entropy" in r]


def entropy_stats(rows: list[dict]) -> dict:
    """The entropy over the run (first, last, min, max), its step-to-step swing, the iteration at which it
    first fell below half its start, and (EPO) the iterations at which the band bound (a non-zero penalty)."""
    h = [r["policy/entropy"] for r in rows]
    swings = [abs(b - x) / x for x, b in zip(h, h[1:]) if x > 0]
    half = next((r["step"] for r in rows if r["policy/entropy"] < h[0] / 2), None) if h else None
    bound = [r["step"] for r in rows if r.get("loss/entropy_smoothing", 0.0) > 0]
    return {"first": h[0] if h else math.nan, "last": h[-1] if h else math.nan, "min": min(h, default=math.nan),
            "max": max(h, default=math.nan), "swing_mean": statistics.mean(swings) if swings else math.nan,
            "halved_at": half, "band_bound_steps": bound}


def per_turn_entropy(rows: list[dict]) -> dict[str, list[float]]:
    """policy/entropy_turn/<t> of the first and last iterations (a turn index absent from a row is skipped)."""
    def of(row: dict) -> dict[int, float]:
        return {int(k.rsplit("/", 1)[1]): v for k, v in row.items() if k.startswith("policy/entropy_turn/")}
    if not rows:
        return {}
    first, last = of(rows[0]), of(rows[-1])
    return {"first": [first[t] for t in sorted(first)], "last": [last[t] for t in sorted(last)]}


def rate(result: dict) -> float:
    return result["success"]["rate"]


def cell(result: dict) -> str:
    s = result["success"]
    return f"{s['rate']:.3f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}] ({s['wins']}/{s['n']})"


def summarize(a: argparse.Namespace, zero: dict, warm: dict, results: dict[str, dict[int, dict]]) -> dict:
    base = rate(warm)
    arms = {}
    for arm, by_seed in results.items():
        rates = [rate(r["eval"]) for r in by_seed.values()]
        arms[arm] = {
            "label": LABELS[arm], "overrides": list(ARMS[arm]), "seeds": sorted(by_seed),
            "success": {s: r["eval"]["success"] for s, r in by_seed.items()},
            "mean": statistics.mean(rates), "std": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            "gain_mean": statistics.mean(rates) - base,
            "target_met": all(x >= base + SEED_GAIN for x in rates) and statistics.mean(rates) >= base + MEAN_GAIN
            and len(rates) >= 3,
            "entropy": {s: r["entropy"] for s, r in by_seed.items()},
            "entropy_by_turn": {s: r["by_turn"] for s, r in by_seed.items()},
            "train_success": {s: r["train_success"] for s, r in by_seed.items()},
            "iteration_s": {s: r["iteration_s"] for s, r in by_seed.items()},
            "parts_s": {s: r["parts_s"] for s, r in by_seed.items()},
        }
    return {"episodes": a.episodes, "eval_seed": EVAL_SEED, "iterations": a.iterations, "quick": a.quick,
            "eval_max_turns": QUICK_EVAL_TURNS if a.quick else EVAL_MAX_TURNS,
            "zero_shot": {k: zero[k] for k in ("success", "invalid_rate", "admissible_rate", "response_tokens",
                                               "episode_len") if k in zero},
            "warm_start": {k: warm[k] for k in ("success", "invalid_rate", "admissible_rate", "response_tokens",
                                                "episode_len") if k in warm},
            "arms": arms}


def write_markdown(summary: dict, path: Path) -> None:
    z, w = summary["zero_shot"], summary["warm_start"]
    lines = [f"# Real model (SmolLM2-135M-Instruct): {summary['episodes']} fixed unseen tasks, T=1.0, "
             f"at most {summary['eval_max_turns']} turns",
             "", "| policy | success [95% CI] | admissible actions | invalid turns | response tokens |",
             "|---|---|---|---|---|"]
    for name, r in (("zero-shot", z), ("warm start", w)):
        lines.append(f"| {name} | {cell(r)} | {r.get('admissible_rate', {}).get('rate', math.nan):.2f} | "
                     f"{r['invalid_rate']['rate']:.2f} | {r.get('response_tokens', {}).get('mean', math.nan):.1f} |")
    lines += ["", f"| arm | seeds | success per seed [95% CI] | mean ± std | gain | target (each +{SEED_GAIN}, "
              f"mean +{MEAN_GAIN}) | entropy first -> last (min) | halved at | band bound | s/iteration |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in summary["arms"].values():
        per_seed = "; ".join(f"{s['rate']:.3f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]"
                             for s in arm["success"].values())
        ent = "; ".join(f"{e['first']:.3f} -> {e['last']:.3f} ({e['min']:.3f})" for e in arm["entropy"].values())
        halved = ", ".join(str(e["halved_at"]) for e in arm["entropy"].values())
        bound = ", ".join(str(len(e["band_bound_steps"])) for e in arm["entropy"].values())
        its = ", ".join(f"{v:.0f}" for v in arm["iteration_s"].values())
        met = "met" if arm["target_met"] else "not met"
        lines.append(f"| {arm['label']} | {len(arm['seeds'])} | {per_seed} | {arm['mean']:.3f} ± {arm['std']:.3f} | "
                     f"{arm['gain_mean']:+.3f} | {met} | {ent} | {halved} | {bound} | {its} |")
    path.write_text("\n".join(lines) + "\n")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_h) = plt.subplots(1, 2, figsize=(11, 4))
    for i, data in enumerate(summary["arms"].values()):
        color = f"C{i}"
        for key, ax in (("train_success", ax_s), ("entropy", ax_h)):
            curves = [v for v in data[key].values()] if key == "train_success" else \
                [v["curve"] for v in data["entropy"].values()]
            n = min(len(c) for c in curves)
            if n == 0:
                continue
            mean = [statistics.mean(c[t] for c in curves) for t in range(n)]
            lo = [min(c[t] for c in curves) for t in range(n)]
            hi = [max(c[t] for c in curves) for t in range(n)]
            ax.plot(range(1, n + 1), mean, color=color, label=f"{data['label']} ({len(curves)} seeds)")
            ax.fill_between(range(1, n + 1), lo, hi, color=color, alpha=0.2)
    ax_s.axhline(summary["warm_start"]["success"]["rate"], color="gray", ls="--", label="warm start (eval)")
    ax_s.set(xlabel="iteration", ylabel="training success (rollout/success)", title="success (band: seed range)")
    ax_h.set(xlabel="iteration", ylabel="policy/entropy (nats/token)", title="entropy (band: seed range)")
    ax_s.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/real_model"))
    p.add_argument("--warm-start", type=Path, help="a finished experiment=smollm2_warm_start run (else trained here)")
    p.add_argument("--arms", default="grpo,epo,gigpo", help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--jobs", type=int, default=1, help="RL runs side by side (each takes one core's worth)")
    p.add_argument("--quick", action="store_true", help="shrink every step: a pipeline check")
    a = p.parse_args()
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {a.seeds!r}")
    for name in ("iterations", "episodes", "jobs"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warm_start and not finished(a.warm_start):
        p.error(f"--warm-start {a.warm_start} is not a finished run holding final/ (epo train "
                "experiment=smollm2_warm_start)")
    try:
        a.out.mkdir(parents=True, exist_ok=True)
        a.out = a.out.resolve()
    except OSError as err:
        p.error(f"--out {a.out} cannot be used as a folder: {err.strerror or err}")

    try:
        warm_args = ["experiment=smollm2_warm_start", *(QUICK_WARM if a.quick else ())]
        warm = a.warm_start.resolve() if a.warm_start else train(a.out / "warm_start", warm_args, a.out)
        jobs = [(arm, seed) for seed in seeds for arm in arms]  # seed-major: every arm's seed 0 first

        def train_arm(job: tuple[str, int]) -> Path:
            arm, seed = job
            return train(a.out / "runs" / f"{arm}-s{seed}",
                         ["experiment=smollm2_rl", *ARMS[arm], f"seed={seed}", f"model.path={warm / 'final'}",
                          f"trainer.total_steps={a.iterations}", "trainer.save_every=2", "trainer.keep_checkpoints=1",
                          *(QUICK_RL if a.quick else ())], a.out)

        # training first (the jobs share the cores), then every evaluation, one at a time; after a run fails
        # or is stopped, no queued run starts (pool.map has submitted them all)
        stopped = threading.Event()

        def train_unless_stopped(job: tuple[str, int]) -> None:
            if stopped.is_set():
                return
            try:
                train_arm(job)
            except BaseException:
                stopped.set()
                raise

        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            list(pool.map(train_unless_stopped, jobs))
        zero = evaluate("zero_shot", ["experiment=smollm2_household"], a)
        warm_eval = evaluate("warm_start", [f"run={warm}"], a)
        say(f"zero-shot {cell(zero)}; warm start {cell(warm_eval)}")

        def one(job: tuple[str, int]) -> tuple[str, int, dict]:
            arm, seed = job
            run = a.out / "runs" / f"{arm}-s{seed}"
            result = evaluate(run.name, [f"run={run}"], a)
            rows = training_rows(run)
            entropy = {**entropy_stats(rows), "curve": [r["policy/entropy"] for r in rows]}
            return arm, seed, {"eval": result, "entropy": entropy, "by_turn": per_turn_entropy(rows),
                               "train_success": [r.get("rollout/success", math.nan) for r in rows],
                               "iteration_s": statistics.mean(sum(r.get(k, 0.0) for k in PARTS) for r in rows)
                               if rows else math.nan,
                               "parts_s": {k: statistics.mean(r.get(k, 0.0) for r in rows) if rows else math.nan
                                           for k in (*PARTS, "perf/generate_s", "perf/env_s")}}

        results: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
        for arm, seed, data in map(one, jobs):
            results[arm][seed] = data
            say(f"{LABELS[arm]} seed {seed}: {cell(data['eval'])}")
        summary = summarize(a, zero, warm_eval, results)
        (a.out / "summary.json").write_text(json.dumps(json_ready(summary), indent=1, allow_nan=False) + "\n")
        write_markdown(summary, a.out / "summary.md")
        plot(summary, a.out / "real_model.png")
        say((a.out / "summary.md").read_text())
        say(f"summary: {a.out / 'summary.json'}, {a.out / 'summary.md'}, {a.out / 'real_model.png'}")
    except KeyboardInterrupt:
        sys.exit("interrupted: what finished is kept; run the same command again to continue")


if __name__ == "__main__":
    main()
