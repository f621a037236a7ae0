"""Helpers the experiment scripts share (exp_*.py): running the CLI, evaluating a policy on fixed tasks
(evaluate_run, in this process), reading a run's metrics, the entropy-fluctuation statistics and table cells,
the command-line options of a multi-arm x multi-seed study, and the study driver every study trains its runs
with: run_folder / finished_run (where an (arm, seed) run lives and whether it is done), train_once (train it
unless done; an unfinished one is started over), continue_once (a finished run continued to more
iterations), train_logged (the one `epo train` subprocess, console in a .log) and run_jobs (the (arm, seed)
jobs, --jobs at a time, seed-major, the first failure stops the study).

The scripts import it as a sibling module (`python scripts/experiments/exp_*.py` puts scripts/experiments/ on sys.path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from epo_cli.analysis.sweep_summary import mean_pm_std
from epo_cli.config import group_options
from epo_cli.errors import UserError, file_system_message
from epo_cli.evaluation.run import EvalCommandConfig, evaluate_run
from epo_cli.launch.libraries import quiet_libraries

quiet_libraries()  # what every `epo` process does first: evaluations run in this one

#: how a script starts the CLI: this interpreter, so the checkout being run is the one imported
EPO = [sys.executable, "-m", "epo_cli"]


def epo(*args: str, cwd: Path) -> None:
    """Run `epo ARGS` (EPO: this interpreter, so the checkout being run is the one imported); exit on failure.

    Training and sweeps stay subprocesses: a run owns its process (its run-directory lock until it exits, its
    stop signals, torch's and DeepSpeed's process-wide state), and a study's arms train side by side."""
    print("$ epo " + " ".join(args), flush=True)
    proc = subprocess.run([*EPO, *args], cwd=cwd)
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


def seed_cell(xs: list[float]) -> str:
    """A table cell of a statistic over seeds: `mean ± std` (sample std), the value alone for one seed, `-` for
    none (3 decimals; epo_cli.analysis.sweep_summary.mean_pm_std; `mean_std` is the (mean, std) pair)."""
    return mean_pm_std(xs, ".3f", ".3f")


@dataclass(frozen=True)
class Arm:
    """One arm of a study: its label in the tables and its overrides on top of the study's preset."""
    label: str
    overrides: tuple[str, ...]


def study_parser(doc: str, out: str, arms: dict, warm_start_help: str, jobs_help: str) -> argparse.ArgumentParser:
    """The options every multi-arm x multi-seed study takes: --out, --warm-start, --arms, --seeds, --jobs."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--warm-start", help=warm_start_help)
    p.add_argument("--arms", default=",".join(arms), help=f"comma-separated, of {', '.join(arms)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=1, help=jobs_help)
    return p


def check_study_args(p: argparse.ArgumentParser, a: argparse.Namespace, arms: dict, warm_start_recipe: str) -> None:
    """The checks every study's options get, each failure one message (exit code 2): known arms, integer
    seeds (kept as a.seed_list), --iterations and --jobs >= 1, --episodes >= 0, a warm start holding final/."""
    check_arms(p, a.arms, arms)
    try:
        a.seed_list = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {a.seeds!r}")
    for name, least in (("iterations", 1), ("jobs", 1), ("episodes", 0)):
        if getattr(a, name) < least:
            p.error(f"--{name} must be >= {least}, got {getattr(a, name)}")
    recipe = f"the run dir of an `epo train {warm_start_recipe}` (holding final/)"
    if a.warm_start is None:
        p.error(f"--warm-start is required: {recipe}")
    if not (Path(a.warm_start) / "final").is_dir():
        p.error(f"--warm-start {a.warm_start} holds no final/ policy; give {recipe}")


def check_out(p: argparse.ArgumentParser, out: Path) -> None:
    """--out must be a folder this user can write (or one that can be made): one message, exit 2, otherwise."""
    existing = next((d for d in (out, *out.parents) if d.exists()), None)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file, not a folder: give a folder for the study's runs and summary")
    if existing is not None and not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        p.error(f"--out {out}: {existing} is not a writable folder; choose a folder you can write")


def check_experiment(p: argparse.ArgumentParser, experiment: str) -> None:
    """--experiment names one of conf/experiment's presets."""
    options = group_options("experiment", nested=True)
    if experiment not in options:
        p.error(f"--experiment {experiment}: no such preset; choose from {', '.join(options)}")


def run_study(main: Callable[[], object], what: str = "the study") -> None:
    """A study's command line as `epo`'s: a user error is one `error:` line (exit 2 for a config error, else
    1), a path the file system refuses one line naming it, Ctrl-C one line saying what is kept (exit 130);
    bugs keep their traceback. (The runs got the terminal's Ctrl-C too, and stopped at the end of a step.)"""
    try:
        main()
    except KeyboardInterrupt:
        print(f"\ninterrupted: {what} stopped; its finished runs are kept and reused by the same command with the "
              "same --out (an unfinished run is started over).", file=sys.stderr, flush=True)
        sys.exit(130)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except OSError as err:
        message = file_system_message(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(1)


def check_arms(p: argparse.ArgumentParser, chosen: str, arms: dict) -> None:
    """Exit with one message naming every unknown arm and the valid ones."""
    unknown = [k for k in chosen.split(",") if k not in arms]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(arms)}")


# ----------------------------------------------------------------------------------------------------
# the study driver: every (arm, seed) run of a study is trained, found and scheduled here
# ----------------------------------------------------------------------------------------------------

def say(line: str) -> None:
    """One progress line, written at once (jobs report from parallel threads)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_folder(out: Path, arm: str, iterations: int, seed: int) -> Path:
    """Where one (arm, seed) run of a study trains: OUT/runs/<arm>/it<N>-seed<S>/ (its console beside it,
    it<N>-seed<S>.log); a later invocation with other --iterations gets its own folder."""
    return out / "runs" / arm / f"it{iterations}-seed{seed}"


def is_finished(run: Path) -> bool:
    """A run directory that trained every step: the final policy is exported only then."""
    return (run / "final").is_dir() and (run / "metrics.jsonl").exists()


def finished_run(folder: Path) -> Path | None:
    """The newest finished run `epo train output_dir=folder` made (folder/<date>/<time>-<name>/), or None."""
    done = [p for p in folder.glob("*/*") if is_finished(p)]
    return max(done, key=lambda p: p.stat().st_mtime) if done else None


def run_logged(command: list[str], shown: str, log: Path, label: str, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> float:
    """`command` (a study's training run or evaluation, a subprocess) with its console in `log`. Prints
    `$ <shown>` and `done: <label> (<s> s)`; exits naming the log on failure. Returns the wall time (s)."""
    say(f"$ {shown}")
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{label} failed with exit code {proc.returncode}; see {log}")
    wall = time.perf_counter() - t0
    say(f"done: {label} ({wall:.0f} s)")
    return wall


def train_logged(args: list[str], log: Path, label: str, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> float:
    """`epo train ARGS` with its console in `log` (run_logged): the one place a study starts a training run."""
    args = ["train", *args]
    return run_logged([*EPO, *args], f"epo {' '.join(args)}", log, label, cwd, env)


def train_once(folder: Path, args: list[str], label: str) -> Path:
    """The finished run of `epo train ARGS output_dir=folder` (console in folder.log): trained unless folder
    already holds one; an unfinished one is deleted and started again, so a study that was interrupted
    continues where it stopped. Exits with the log's path on failure."""
    return _once(folder, label, lambda log: train_logged([*args, f"output_dir={folder}"], log, label, cwd=folder))


def _once(folder: Path, label: str, start: Callable[[Path], object]) -> Path:
    """folder's finished run, made by start(<its console log: folder.log>) unless there is one; a half-written
    folder (interrupted) is deleted first, since it would be mistaken for a result."""
    run = finished_run(folder)
    if run is not None:
        return run
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    log = folder.parent / f"{folder.name}.log"
    start(log)
    run = finished_run(folder)
    if run is None:  # exit code 0 without a final policy: stopped early (trainer.stop_after, a stop signal)
        sys.exit(f"{label} stopped before its last step; see {log}")
    return run


def longest_shorter_run(study: Path, arm: str, seed: int, below: int) -> Path | None:
    """The finished run of (arm, seed) with the most iterations under `below` in another study's folder
    (study/runs/<arm>/it<N>-seed<S>/), or None."""
    found = []
    for folder in (study / "runs" / arm).glob(f"it*-seed{seed}"):
        iterations = folder.name[2:].split("-", 1)[0]
        run = finished_run(folder) if iterations.isdigit() and int(iterations) < below else None
        if run is not None:
            found.append((int(iterations), run))
    return max(found)[1] if found else None


def continue_once(folder: Path, source: Path, iterations: int, label: str, leave_out: tuple[str, ...] = ()) -> Path:
    """The finished run `source` continued to `iterations` in folder/ (console in folder.log): a copy of it
    (without its final policy and the folders named in `leave_out`, e.g. a study's evaluations) resumed from
    its last checkpoint with trainer.total_steps=iterations, at the learning rate of its last step held
    constant (its cosine ended there; starting the schedule over would put it back up). Other schedules that
    span total_steps (EPO's phase weights, an annealed coefficient) are stretched over the new total. The
    copy keeps the source's metrics, so curves and statistics span every iteration. Done once, as train_once."""
    copy = folder / source.parent.name / source.name  # the same <date>/<time>-<name> layout

    def start(log: Path) -> None:
        shutil.copytree(source, copy, ignore=lambda where, names: [n for n in names if n in ("final", *leave_out)]
                        if Path(where) == source else [])
        train_logged([f"trainer.resume={copy}", f"trainer.total_steps={iterations}",
                      f"algo.lr={lr}", "algo.min_lr_ratio=1.0", "algo.warmup_ratio=0"],
                     log, label, cwd=folder)

    lr = last_lr(source, label) if finished_run(folder) is None else None  # before anything is copied
    return _once(folder, label, start)


def last_lr(run: Path, label: str) -> float:
    """The learning rate of `run`'s last step (its metrics.jsonl's last perf/lr); exits with one message
    naming the file where there is none (an empty or damaged file, a run logged without perf/lr)."""
    metrics = run / "metrics.jsonl"
    try:
        rows = rows_of(run)
    except (OSError, ValueError, RecursionError) as err:
        sys.exit(f"error: cannot continue {label}: {metrics} cannot be read ({type(err).__name__}: "
                 f"{str(err)[:120]}); train that run again in its study, or continue another")
    last = rows[-1] if rows else None
    lr = last.get("perf/lr") if isinstance(last, dict) else None
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        why = "is empty" if not rows else f"has no positive perf/lr in its last row (got {lr!r})"
        sys.exit(f"error: cannot continue {label}: {metrics} {why}, and a continued run keeps the learning rate "
                 "its source ended with; train that run again in its study, or continue another")
    return float(lr)


Job = TypeVar("Job")
Result = TypeVar("Result")


def run_jobs(jobs: list[Job], work: Callable[[Job], Result], n_jobs: int) -> list[Result]:
    """work(job) for every job, n_jobs at a time (threads: each job's heavy part is a subprocess), started
    in the order given (a study passes seed-major (arm, seed) pairs: every arm gets seed 0 first); the
    results in that order. The first failure (an exception, or a job's sys.exit with its message) stops the
    study: no job starts after it, the running ones end, then it is raised here. Ctrl-C likewise."""
    todo = deque(enumerate(jobs))
    results: dict[int, Result] = {}
    failure: BaseException | None = None
    with ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:  # leaving it waits for the running jobs
        running: dict[Future, int] = {}
        while todo or running:
            while todo and len(running) < max(1, n_jobs):  # a job starts only when one ends, never queued
                index, job = todo.popleft()
                running[pool.submit(work, job)] = index
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                index = running.pop(future)
                if future.exception() is None:
                    results[index] = future.result()
                elif failure is None:
                    failure = future.exception()
                    todo.clear()
    if failure is not None:
        raise failure
    return [results[index] for index in range(len(jobs))]


def seed_major(arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """A study's (arm, seed) jobs, seed-major: every arm's seed 0 first, so a stopped study has all arms."""
    return [(arm, seed) for seed in seeds for arm in arms]
