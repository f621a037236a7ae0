"""Helpers the experiment scripts share (exp_algos.py, exp_entropy.py, exp_explore.py): running the CLI, evaluating
a policy on fixed tasks (evaluate_run, in this process), reading a run's metrics, the entropy-fluctuation
statistics and table cells, and the command-line options of a multi-arm x multi-seed study.

The scripts import it as a sibling module (`python scripts/experiments/exp_*.py` puts scripts/experiments/ on sys.path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from epo_cli.analysis.sweep_summary import mean_pm_std
from epo_cli.errors import UserError
from epo_cli.evaluation.run import EvalCommandConfig, evaluate_run
from epo_cli.launch.libraries import quiet_libraries

quiet_libraries()  # what every `epo` process does first: evaluations run in this one


def epo(*args: str, cwd: Path) -> None:
    """Run `epo ARGS` (this interpreter, so the checkout being run is the one imported); exit on failure.

    Training and sweeps stay subprocesses: a run owns its process (its run-directory lock until it exits, its
    stop signals, torch's and DeepSpeed's process-wide state), and a study's arms train side by side."""
    print("$ epo " + " ".join(args), flush=True)
    proc = subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=cwd)
    if proc.returncode != 0:
        sys.exit(f"epo {args[0]} failed with exit code {proc.returncode}")


def warm_start_run(given: str | None, out: Path) -> Path:
    """The warm start's run directory: `given`, or one trained here by `experiment=warm_start` (once)."""
    if given:
        return Path(given).resolve()
    trained = [p for p in (out / "warm_start").glob("*/*") if (p / "final").exists()]
    if not trained:
        epo("train", "experiment=warm_start", f"output_dir={out / 'warm_start'}", cwd=out)
        trained = [p for p in (out / "warm_start").glob("*/*") if (p / "final").exists()]
    return max(trained, key=lambda p: p.stat().st_mtime)


#: one evaluation at a time in this process: they are CPU-bound Python (env steps, sampling), so two in threads of
#: one process (the arms of exp_entropy.py run in threads) would only take turns on the GIL
_EVALUATING = threading.Lock()


def eval_rate(run: Path, out: Path, episodes: int, greedy: bool, extra: tuple[str, ...] = ()) -> float:
    """Success rate of `run`'s final policy on `episodes` eval_in_distribution tasks, at T=1.0 or greedily.

    Evaluated in this process by evaluate_run (what `epo eval` runs); the result is kept under out/t1 or
    out/greedy and reused when the script runs again. `extra` are more config overrides (e.g. `seed=0`: the
    eval tasks are drawn from the seed, by default the run's own).
    """
    target = out / ("greedy" if greedy else "t1")
    if list(target.glob("*.json")):
        return json.loads(next(target.glob("*.json")).read_text())["success"]["rate"]
    options = EvalCommandConfig(run=run, episodes=episodes, split="eval_in_distribution", greedy=greedy,
                                temperature=None if greedy else 1.0, out=target)
    print(f"$ evaluate {run} ({'greedy' if greedy else 'T=1.0'}, {episodes} episodes{', ' if extra else ''}"
          f"{' '.join(extra)})", flush=True)
    with _EVALUATING:
        try:
            return evaluate_run(options, list(extra)).success_rate
        except UserError as err:  # the same one message `epo eval` would print, then this script stops
            sys.exit(f"evaluation of {run} failed: {err}")


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def fluctuation(rows: list[dict]) -> dict[str, float]:
    """Relative step-to-step entropy swing |H_t - H_{t-1}| / H_{t-1} (mean, max), the monitor's sigma (mean
    over the run) and the entropy range relative to its mean."""
    h = [r["policy/entropy"] for r in rows]
    swings = [abs(b - a) / a for a, b in zip(h, h[1:]) if a > 0]
    return {"swing_mean": statistics.mean(swings) if swings else float("nan"),
            "swing_max": max(swings) if swings else float("nan"),
            "sigma": statistics.mean(r.get("policy/entropy_fluctuation", float("nan")) for r in rows),
            "entropy_range": (max(h) - min(h)) / statistics.mean(h) if h else float("nan")}


def mean_std(xs: list[float]) -> str:
    """`mean ± std` over seeds (sample std), the value alone for one seed, `-` for none (3 decimals)."""
    return mean_pm_std(xs, ".3f", ".3f")


def study_parser(doc: str, out: str, arms: dict, warm_start_help: str, jobs_help: str) -> argparse.ArgumentParser:
    """The options every multi-arm x multi-seed study takes: --out, --warm-start, --arms, --seeds, --jobs."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--warm-start", help=warm_start_help)
    p.add_argument("--arms", default=",".join(arms), help=f"comma-separated, of {', '.join(arms)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=1, help=jobs_help)
    return p


def check_arms(p: argparse.ArgumentParser, chosen: str, arms: dict) -> None:
    """Exit with one message naming every unknown arm and the valid ones."""
    unknown = [k for k in chosen.split(",") if k not in arms]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(arms)}")


def train_once(folder: Path, args: list[str], label: str) -> None:
    """`epo train ARGS output_dir=folder` with its console in folder.log, unless folder holds a finished run
    (a final policy and metrics); an unfinished one is deleted and started again, so a study that was
    interrupted continues where it stopped. Exits with the log's path on failure."""
    import shutil
    import time

    done = [p for p in folder.glob("*/*") if (p / "final").is_dir() and (p / "metrics.jsonl").exists()]
    if done:
        return
    if folder.exists():  # interrupted: its half-written run would be mistaken for a result
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    args = ["train", *args, f"output_dir={folder}"]
    print(f"$ epo {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    log = folder.parent / f"{folder.name}.log"
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=folder, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{label} failed with exit code {proc.returncode}; see {log}")
    print(f"done: {label} ({time.perf_counter() - t0:.0f} s)", flush=True)
