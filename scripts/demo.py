"""`make demo`: does RL learn? A warm start, then GRPO and EPO from it, evaluated on the same fixed tasks.

    python scripts/demo.py [--out outputs/demo] [--quick]

The regime (docs/learning.md): the warm start clones a noisy teacher (the expert on the easiest household
level, tiny_open_pick_place, whose hand slips on 40% of the turns); the clone mixes up names and thoughts,
compounds its mistakes, and solves about 20% of the level at T=1.0 in 15 turns. RL then trains it on the
same level, from its own mistakes. The table says, for each arm, whether it reached the warm start + 0.2.

1. warm start   epo train experiment=WARM_PRESET                        (behaviour cloning, tiny model)
2. RL, 2 arms   epo train experiment=RL_PRESET algo=grpo|epo model.path=<1>/final
                the same seed, so both arms draw the same tasks; side by side (one core each)
3. evaluation   epo eval run=<1|2a|2b> episodes=64 temperature=1.0 seed=0 env.level=... env.max_turns=...
                all three policies on the same 64 fixed tasks of the RL level
4. summary      one table (success with its 95% interval, episode length, entropy first/last, swing) and
                one PNG (training success and entropy per iteration, EPO's band drawn), in <out>/
Each command is printed before it runs, so the demo doubles as a tour of the CLI. `--quick` shrinks every
step (a few SFT and RL steps, a few evaluation episodes) to check the pipeline in a minute: its numbers
mean nothing.

Run again (after it finished, or after a Ctrl-C) with the same --out, the demo says first what it does with
each run it finds there, before anything runs: a finished run is reused (and its evaluation, when its run was
reused too), an interrupted run with a checkpoint is continued (`epo train trainer.resume=<run>`), and
anything else (an interrupted run without a checkpoint, an RL run from another warm start, a damaged folder) is
moved aside to <stage>.old-<time>/ and that stage starts over in a fresh folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from epo_cli.analysis.report import Group, draw_entropy_band, draw_metric, load_run
from epo_cli.rundir.checkpoint_paths import latest_tag
from epo_cli.rundir.folder import read_status, read_yaml_data

console = Console(highlight=False)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

#: the CPU kernels the demo's commands compute with, on any x86-64 machine with AVX2: what moved the demo's
#: numbers between machines was the instruction set torch's, MKL's and oneDNN's kernels pick by themselves
#: (AVX-512 here; measured: AVX2 kernels change the warm start's loss in the 5th digit and then its sampled
#: tokens), not the commits since 901cf2b nor the thread count (both measured: identical tokens). Pinned to
#: AVX2, the tokens are the same on every AVX2 machine; set a variable yourself to choose otherwise.
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def has_avx2() -> bool:
    """Whether this CPU runs AVX2 (x86-64 Linux: /proc/cpuinfo's flags); elsewhere the kernels stay as chosen."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def pin_kernels(env: dict[str, str]) -> dict[str, str]:
    """`env` with PINNED_KERNELS where the CPU has AVX2 (a value already set is kept)."""
    return {**PINNED_KERNELS, **env} if has_avx2() else dict(env)


WARM_PRESET = "noisy_warm_start"
RL_PRESET = "improve_on_teacher"
#: what --quick changes (a pipeline check, not a result)
QUICK_WARM = ["trainer.total_steps=4", "algo.demo_episodes=4", "env.eval_splits=[]"]
QUICK_RL = ["trainer.total_steps=2", "algo.tasks_per_step=2", "algo.group_size=2", "env.max_turns=3",
            "trainer.eval_every=0", "trainer.save_every=0", "rollout.max_new_tokens=16"]
QUICK_EVAL = ["rollout.max_new_tokens=16"]
ARMS = ("grpo", "epo")
#: the gain over the warm start's eval success an arm must reach to count as having learned
TARGET_GAIN = 0.2


#: the promise that the demo's tokens stay as the README's table was measured (tests/test_reliability5_b_demo.py):
#: the warm start shrunk to DIGEST_STEPS steps, evaluated as the demo evaluates on DIGEST_EPISODES episodes, and
#: the SHA-256 of what it played (its episodes and decoded responses). A change that moves the demo's tokens
#: changes it: measure the demo again and update README.md's table and this digest in the same commit.
DIGEST_STEPS, DIGEST_EPISODES = 100, 8
WARM_START_DIGEST = "80bf4e82ace4d3dd3d4f10ce257a71f25dc3fd2bb1e2d5a099cad33ad4a465a0"


def played_digest(eval_folder: Path) -> str:
    """SHA-256 of an evaluation's episodes (task, outcome, turns) and its samples file (the decoded responses)."""
    result = json.loads(next(eval_folder.glob("*.json")).read_text())
    samples = Path(result["samples"]).read_text() if result.get("samples") else ""
    played = json.dumps(result["per_episode"], sort_keys=True) + "\n" + samples.replace(str(eval_folder), "")
    return hashlib.sha256(played.encode()).hexdigest()


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "epo_cli", *args]


def show(args: list[str]) -> None:
    console.print(f"\n[bold cyan]$ epo {' '.join(args)}[/]", soft_wrap=True)


def epo(args: list[str], cwd: Path) -> None:
    """Run one epo command in the foreground (its own progress on the terminal); stop on failure."""
    show(args)
    proc = subprocess.Popen(command(args), cwd=cwd)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the command got the terminal's Ctrl-C too: let it save and stop
        finish([proc])
        raise
    if code != 0:
        sys.exit(code)


def finish(procs: list[subprocess.Popen]) -> None:
    """After a Ctrl-C (which the epo commands receive as well, from the terminal): wait for them to finish
    their step and save it (epo_cli.training.stop); a second Ctrl-C ends them at once."""
    try:
        for proc in procs:
            proc.wait()
    except KeyboardInterrupt:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def only_run(root: Path) -> Path:
    runs = [p for p in root.glob("*/*") if (p / "config.yaml").exists()]
    if len(runs) != 1:
        sys.exit(f"expected one run under {root}, found {len(runs)}: use a fresh --out")
    return runs[0]


@dataclass
class Stage:
    """What a (re)run of the demo does with one stage's folder (warm_start/, grpo/, epo/): `action` is fresh (no
    run there: train one), reuse (a finished run), resume (an interrupted run with a checkpoint: continue it)
    or again (what is there cannot be used: moved aside, then trained afresh)."""

    root: Path
    action: str
    run: Path | None = None
    why: str = ""


def is_finished(run: Path) -> bool:
    return (run / "final").is_dir() and read_status(run).get("status") == "finished"


def find_stage(root: Path, model_path: Path | None = None) -> Stage:
    """The stage at `root`: its one run's state (an RL stage's run must start from `model_path`)."""
    if not root.exists():
        return Stage(root, "fresh")
    runs = [p for p in root.glob("*/*") if (p / "config.yaml").is_file()]
    if len(runs) != 1:
        return Stage(root, "again", why=f"it holds {len(runs)} runs, not one")
    run = runs[0]
    try:
        config = _read_config(run)
        started_from, total = config["model"]["path"], int(config["trainer"]["total_steps"])
    except Exception:  # noqa: BLE001 - a damaged config.yaml: the run cannot be reused
        return Stage(root, "again", run, "its config.yaml cannot be read")
    if model_path is not None and started_from != str(model_path):
        return Stage(root, "again", run, f"it started from {started_from}, not from this warm start")
    if is_finished(run):
        return Stage(root, "reuse", run)
    try:
        tag = latest_tag(run) or ""
    except Exception:  # noqa: BLE001 - a damaged checkpoints/latest: nothing to continue from
        tag = ""
    if tag.startswith("step_") and tag[len("step_"):].isdigit():
        if int(tag[len("step_"):]) < total:
            return Stage(root, "resume", run)
        return Stage(root, "again", run, "its last checkpoint is its last step, but its final policy is missing")
    return Stage(root, "again", run, "it stopped before its first checkpoint")


def say_stage(name: str, stage: Stage) -> None:
    """One line, before anything runs, saying what the demo does with this stage."""
    text = {"fresh": "trains a new run",
            "reuse": f"reuses the finished run {stage.run}",
            "resume": f"continues the interrupted run {stage.run} from its last checkpoint",
            "again": f"starts over in a fresh folder ({stage.why}; the old one is kept as "
                     f"{stage.root.name}.old-<time>/)"}[stage.action]
    console.print(f"[bold]{name}:[/] {text}", soft_wrap=True)


def clear_stage(stage: Stage) -> None:
    """Move an unusable stage folder aside (never deleted: it may hold something the user wants)."""
    if stage.action == "again":
        stage.root.rename(stage.root.with_name(f"{stage.root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))


def metrics_rows(run: Path | None) -> list[dict]:
    path = run / "metrics.jsonl" if run else None
    if not path or not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    return rows


@dataclass
class Arm:
    """One RL run started in the background; its console output goes to a log file."""

    name: str
    args: list[str]
    root: Path
    log: Path
    proc: subprocess.Popen | None = None
    run: Path | None = None
    rows: list[dict] = field(default_factory=list)
    total: int | None = None  # trainer.total_steps, from the run's config once it exists

    done: bool = False  # a finished run reused: nothing to start

    def start(self, cwd: Path) -> None:
        if self.done:
            return
        show(self.args)
        console.print(f"  (output: {self.log})")
        self.proc = subprocess.Popen(command(self.args), cwd=cwd, stdout=self.log.open("a"), stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        if self.run is None:
            runs = [p for p in self.root.glob("*/*") if (p / "config.yaml").exists()]
            self.run = runs[0] if runs else None
            self.total = _read_config(self.run)["trainer"]["total_steps"] if self.run else None
        self.rows = metrics_rows(self.run)
        if self.done:
            return 0
        return self.proc.poll() if self.proc else None


def run_arms(arms: list[Arm], cwd: Path) -> None:
    """Start every arm at once and show their iterations as they come; stop all if one fails."""
    for arm in arms:
        arm.start(cwd)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[last]}")]
    try:
        follow(arms, columns)
    except KeyboardInterrupt:
        finish([arm.proc for arm in arms if arm.proc is not None])
        raise


def follow(arms: list[Arm], columns: list) -> None:
    """Show the arms' iterations as they come until all have finished; stop all if one fails."""
    with Progress(*columns, console=console) as progress:
        tasks = {arm.name: progress.add_task(f"{arm.name:>5}", total=None, last="starting") for arm in arms}
        while True:
            codes = [arm.poll() for arm in arms]
            for arm in arms:
                last = arm.rows[-1] if arm.rows else None
                text = (f"train success {last.get('rollout/success', float('nan')):.2f}  "
                        f"entropy {last.get('policy/entropy', float('nan')):.3f}") if last else "starting"
                progress.update(tasks[arm.name], total=arm.total, completed=len(arm.rows), last=text)
            failed = [arm for arm, code in zip(arms, codes) if code not in (None, 0)]
            if failed:
                for arm in arms:
                    if arm.proc and arm.proc.poll() is None:
                        arm.proc.terminate()
                for arm in failed:
                    console.print(f"[bold red]{arm.name} failed[/] (exit {arm.proc.returncode}); last lines of "
                                  f"{arm.log}:\n" + "\n".join(arm.log.read_text().splitlines()[-15:]))
                sys.exit(failed[0].proc.returncode)
            if all(code == 0 for code in codes):
                break
            time.sleep(1.0)


def evaluate(label: str, run: Path, out: Path, opts: list[str], cwd: Path, reuse: bool = False) -> dict:
    """`epo eval` as a user types it, and its JSON: the demo is a tour of the command line, so it runs the
    command itself (scripts/experiments/ call epo_cli.evaluation.run.evaluate_run in-process instead).
    `reuse`: the run was reused, so an earlier evaluation of it with the same options is reused too."""
    folder = out / label
    earlier = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if reuse and len(earlier) == 1:
        result = json.loads(earlier[0].read_text())
        if result.get("run") == str(run) and result.get("command", "").endswith(" ".join([*opts, f"out={folder}"])):
            console.print(f"\n{label}: reusing the evaluation {earlier[0]}", soft_wrap=True)
            return result
    if folder.exists():  # an evaluation of another run or with other options: made again
        folder.rename(folder.with_name(f"{folder.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    epo(["eval", f"run={run}", *opts, f"out={folder}"], cwd)
    return json.loads(next(folder.glob("*.json")).read_text())


def entropy_swing(rows: list[dict]) -> float:
    """Mean relative step-to-step change of the policy entropy, |H_k - H_{k-1}| / H_{k-1}."""
    h = [r["policy/entropy"] for r in rows if "policy/entropy" in r]
    swings = [abs(b - a) / a for a, b in zip(h, h[1:]) if a > 0]
    return sum(swings) / len(swings) if swings else float("nan")


def target_verdict(success: float, warm: float) -> str:
    """Whether an arm's eval success reached the warm start's + TARGET_GAIN, with the gain it got."""
    gain = success - warm
    return f"{'yes' if gain >= TARGET_GAIN - 1e-9 else 'no'} ({gain:+.3f})"


def summary_rows(results: dict[str, dict], runs: dict[str, list[dict]], warm_label: str) -> list[list[str]]:
    """The summary table's rows: policy, success [95% CI], episode length, entropy first/last, swing, and
    whether it reached the warm start + TARGET_GAIN."""
    warm = results[warm_label]["success"]["rate"]
    out = []
    for label, result in results.items():
        lo, hi = result["success"]["ci95"]
        rows = runs.get(label, [])
        h = [r["policy/entropy"] for r in rows if "policy/entropy" in r]
        out.append([label, f"{result['success']['rate']:.3f} [{lo:.2f}, {hi:.2f}]",
                    f"{result['episode_len']['mean']:.1f}",
                    f"{h[0]:.3f} / {h[-1]:.3f}" if h else "",
                    f"{entropy_swing(rows):.3f}" if len(h) > 1 else "",
                    "" if label == warm_label else target_verdict(result["success"]["rate"], warm)])
    return out


def plot(runs: dict[str, Path], warm_success: float, path: Path) -> None:
    """Training success and policy entropy per iteration of every arm, EPO's band [kappa_low, kappa_high] x
    Href drawn around the EPO run's own reference (epo_cli.analysis.report draws both)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    groups = [Group(label, [load_run(run)]) for label, run in runs.items()]
    fig, (ax_success, ax_entropy) = plt.subplots(1, 2, figsize=(12, 4.2))
    draw_metric(ax_success, groups, "rollout/success", "training success per iteration (rollouts, T=1.0)")
    ax_success.axhline(warm_success, color="gray", linestyle=":", label=f"warm start, eval {warm_success:.2f}")
    ax_success.legend(fontsize=7)
    draw_metric(ax_entropy, groups, "policy/entropy", "policy entropy (nats/token)")
    draw_entropy_band(ax_entropy, groups)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def print_table(table: Table) -> None:
    """The summary table, one line per row also in a log: on a terminal rich fits it to the window; elsewhere
    (a file, a pipe, CI) rich would assume 80 columns and wrap every cell, so it gets the width it needs."""
    if console.is_terminal:
        console.print(table)
        return
    wide = Console(file=console.file, highlight=False, width=10_000, color_system=None)
    wide.print(table, crop=False)


def main() -> None:
    # every epo command the demo starts inherits the pinned kernels; set here, not at import, so that a test
    # importing this script leaves its own process's environment (and the subprocesses it starts) as they were
    os.environ.update(pin_kernels(dict(os.environ)))
    try:
        run_demo()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted:[/] every run stopped at the end of a step with its checkpoint; run the "
                      "demo again with the same --out (`make demo`) to continue where it stopped.")
        sys.exit(130)


def run_demo() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo")
    parser.add_argument("--episodes", type=int, default=64, help="evaluation episodes per policy")
    parser.add_argument("--quick", action="store_true", help="a pipeline check in about a minute (no result)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    episodes = 4 if args.quick else args.episodes
    common = ["logger.tensorboard=false"] if args.quick else []

    # 0. what is there from an earlier demo in this folder (said before anything runs)
    warm_stage = find_stage(out / "warm_start")
    say_stage("warm start", warm_stage)
    stages = {}
    for algo in ARMS:
        if warm_stage.action == "reuse":
            stages[algo] = find_stage(out / algo, warm_stage.run / "final")
        else:  # a new or continued warm start: RL runs from an earlier one are not its arms
            stages[algo] = Stage(out / algo, "again" if (out / algo).exists() else "fresh",
                                 why="the warm start is trained again")
        say_stage(algo.upper(), stages[algo])

    # 1. warm start
    clear_stage(warm_stage)
    if warm_stage.action == "resume":
        epo(["train", f"trainer.resume={warm_stage.run}"], out)
    elif warm_stage.action != "reuse":
        epo(["train", f"experiment={WARM_PRESET}", *common, *(QUICK_WARM if args.quick else []),
             f"output_dir={out / 'warm_start'}"], out)
    warm = only_run(out / "warm_start")

    # 2. GRPO and EPO from it, side by side: same seed, same tasks
    arms = []
    for algo in ARMS:
        stage = stages[algo]
        clear_stage(stage)
        rl_args = ["train", f"experiment={RL_PRESET}", f"algo={algo}", f"model.path={warm / 'final'}", *common,
                   *(QUICK_RL if args.quick else []), f"output_dir={out / algo}"]
        if stage.action == "resume":
            rl_args = ["train", f"trainer.resume={stage.run}"]
        arms.append(Arm(algo, rl_args, out / algo, out / f"{algo}.log", done=stage.action == "reuse"))
    rl_start = time.perf_counter()
    run_arms(arms, out)
    rl_seconds = time.perf_counter() - rl_start
    runs = {arm.name: only_run(arm.root) for arm in arms}

    # 3. all three on the same fixed tasks of the RL level, at the training temperature
    level, max_turns = _rl_env(runs["grpo"])
    opts = [f"episodes={episodes}", "temperature=1.0", "seed=0", "split=eval_in_distribution",
            f"env.level={level}", f"env.max_turns={max_turns}", *(QUICK_EVAL if args.quick else [])]
    results = {"warm start": evaluate("warm_start", warm, out / "eval", opts, out, warm_stage.action == "reuse")}
    for arm in arms:
        results[arm.name.upper()] = evaluate(arm.name, runs[arm.name], out / "eval", opts, out, arm.done)

    # 4. summary
    table = Table(title=f"epo demo: household ({level}, {max_turns} turns), {episodes} fixed tasks, T=1.0")
    header = ["policy", "eval success [95% CI]", "episode length", "entropy first / last", "entropy swing",
              f"reached warm start + {TARGET_GAIN}"]
    for h in header:
        table.add_column(h, justify="left" if h == "policy" else "right")
    rows = summary_rows(results, {arm.name.upper(): metrics_rows(runs[arm.name]) for arm in arms}, "warm start")
    for row in rows:
        table.add_row(*row)
    print_table(table)
    warm_rate = results["warm start"]["success"]["rate"]
    reached = {arm.name.upper(): results[arm.name.upper()]["success"]["rate"] - warm_rate >= TARGET_GAIN - 1e-9
               for arm in arms}
    missed = [name for name, ok in reached.items() if not ok]
    if missed:
        console.print(f"[bold]{' and '.join(missed)} did not reach the warm start + {TARGET_GAIN} "
                      f"({warm_rate + TARGET_GAIN:.3f}) in {_total_steps(runs['grpo'])} iterations.[/] "
                      "docs/learning.md says why.")
    else:
        console.print(f"[bold]Both arms reached the warm start + {TARGET_GAIN} ({warm_rate + TARGET_GAIN:.3f}).[/]")
    png = out / "demo.png"
    plot({arm.name.upper(): runs[arm.name] for arm in arms}, results["warm start"]["success"]["rate"], png)
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    (out / "summary.json").write_text(json.dumps({
        "level": level, "max_turns": max_turns, "episodes": episodes, "rl_seconds": round(rl_seconds, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
        "success": {k: v["success"] for k, v in results.items()},
        "episode_len": {k: v["episode_len"]["mean"] for k, v in results.items()},
        "target_gain": TARGET_GAIN, "reached_target": reached,
        "runs": {"warm start": str(warm), **{k: str(v) for k, v in runs.items()}}}, indent=2))
    console.print(f"warm start run: {warm}")
    for name, run in runs.items():
        console.print(f"{name.upper():>4} run:       {run}  (samples: {run / 'samples'})")
    console.print(f"plot:           {png}\nsummary:        {out / 'summary.md'}")
    console.print(f"RL wall time:   {rl_seconds:.0f} s (both arms side by side)")
    console.print(f"total time:     {time.perf_counter() - start:.0f} s")


def _read_config(run: Path) -> dict:
    return read_yaml_data(run / "config.yaml")


def _total_steps(run: Path) -> int:
    return int(_read_config(run)["trainer"]["total_steps"])


def _rl_env(run: Path) -> tuple[str, int]:
    """The level and turn limit an RL run trained with (its saved config)."""
    env = _read_config(run)["env"]
    return env["level"], int(env["max_turns"])


if __name__ == "__main__":
    main()
