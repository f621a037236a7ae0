"""Issue 30, class 6: inputs that ended in a traceback, were accepted without a word, or got a misleading
message; each is now one message (exit non-zero, nothing written) or one warning. Every row failed on the
code before this change.

    tracebacks      algo.loss_terms=[], flex_attention on the CPU, model.lora.target_modules=[], stdout on a full
                    device, Ctrl-C in scripts/demo.py and scripts/experiments/exp_explore.py (and a read-only
                    run dir's resume: tests/test_outside_faults.py)
    silent          eval run= with model.path=, algo=[grpo,epo], a level no task of which fits env.max_turns,
                    an unknown trainer.best_metric, improve_on_teacher without model.path, `epo report` on
                    repeated or negative steps
    messages        a file where a folder goes, an unquoted path with a space or a non-ASCII character, eval
                    run='...' in quotes, algo.diagnostics=5, algo.intrinsic.coef unbounded, algo.demo_slip=0.99,
                    a preset's setting blamed on the user, hydra.launcher.n_jobs=abc, algo.demos=
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, SmallConfig, one_error, run_epo, terminal_signal_dispositions


def fake_run(path: Path, metrics: str = '{"step": 1, "rollout/success": 0.0}\n') -> Path:
    from epo_cli.compose import compose

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(compose(SmallConfig().run())))
    (path / "metrics.jsonl").write_text(metrics)
    (path / "status.json").write_text('{"status": "finished"}')
    return path


# ---- config-time: one message, exit 2, nothing written ------------------------------------------------------

CONFIG_ERRORS = [
    (["algo=grpo", "algo.loss_terms=[]"], ["algo.loss_terms is empty", "algo.loss_terms=[policy_clip]"]),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], ["model.lora.target_modules is empty",
                                                            "model.lora.rank=0"]),
    (["algo=[grpo,epo]"], ["selects several options of the config group 'algo'", "epo sweep algo=grpo,epo"]),
    (["trainer.best_metric=eval/nosuch"], ["trainer.best_metric='eval/nosuch' is not a metric",
                                           "eval/eval_in_distribution/success"]),
    (["experiment=improve_on_teacher"], ["model.path must be given on the command line", "model.path=RUN/final"]),
    (["algo.diagnostics=5"], ["'algo.diagnostics' is a section of settings", "algo.diagnostics.enabled="]),
    (["algo=grpo", "algo.intrinsic.kind=count", "algo.intrinsic.coef=1e300"],
     ["algo.intrinsic.coef=1e+300 is above algo.reward_scale=10"]),
    (["algo=sft", "algo.demos="], ["algo.demos is empty", "algo.demos=expert"]),
    (["output_dir=/tmp/é"], ["The value of 'output_dir' holds a space or a non-ASCII character",
                             "'output_dir=\"/tmp/é\"'"]),
    (["output_dir=/tmp/my", "runs"], ["'runs' is not an override", "'output_dir=\"/tmp/my runs\"'"]),
]


@pytest.mark.parametrize(("args", "texts"), CONFIG_ERRORS, ids=[" ".join(a) for a, _ in CONFIG_ERRORS])
@pytest.mark.parametrize("command", [["config", "show"], ["train"]])
def test_a_config_that_used_to_pass_or_mislead_is_one_message(args: list[str], texts: list[str],
                                                              command: list[str], tmp_path: Path) -> None:
    out = [] if any(a.startswith("output_dir") for a in args) else [f"output_dir={tmp_path / 'out'}"]
    proc = run_epo([*command, *args, *out], cwd=tmp_path, expect=2)
    one_error(proc, *texts)
    assert not (tmp_path / "out").exists()


def test_a_presets_setting_is_not_blamed_on_the_user(tmp_path: Path) -> None:
    proc = run_epo(["config", "show", "experiment=improve_on_teacher", "model.path=/x", "env=alfworld"],
                   cwd=tmp_path, expect=2)
    one_error(proc, "Unknown config key 'env.level'", "env.level is set by the preset experiment=improve_on_teacher",
              "Drop the preset or the selection")
    assert "Fix the override" not in proc.stderr and "note: name," not in proc.stderr


def test_the_quoted_and_valid_forms_still_compose(tmp_path: Path) -> None:
    shown = run_epo(["config", "show", "output_dir=\"/tmp/my é runs\"", "experiment=improve_on_teacher",
                     "model.path=/some/final", "trainer.best_metric=eval/eval_in_distribution/success"],
                    cwd=tmp_path).stdout
    assert "output_dir: /tmp/my é runs" in shown and "path: /some/final" in shown
    run_epo(["config", "show", "trainer.best_metric=null", "model.lora.rank=8"], cwd=tmp_path)


@pytest.mark.parametrize(("args", "level", "need"), [
    (["env.level=tiny_open_pick_place", "env.max_turns=3"], "tiny_open_pick_place", 4),
    (["env.level=large_all_tasks", "env.max_turns=2"], "large_all_tasks", 3),
    (["curriculum=staged", "curriculum.levels=[tiny_open_pick_place,tiny_pick_two]", "env.max_turns=5",
      "env.task_types=[pick_two_obj_and_place]"], "tiny_open_pick_place", 6),
])
def test_a_level_no_task_of_which_fits_the_turn_limit_is_a_warning(args: list[str], level: str, need: int,
                                                                   tmp_path: Path) -> None:
    proc = run_epo(["config", "show", *args], cwd=tmp_path)
    warned = [line for line in proc.stderr.splitlines() if "is too few for every task" in line]
    assert len(warned) >= 1 and f"'{level}'" in warned[0] and f"at least {need}" in warned[0], proc.stderr
    quiet = run_epo(["config", "show", "env.level=tiny_open_pick_place", "env.max_turns=4"], cwd=tmp_path)
    assert "too few" not in quiet.stderr


def test_hydra_launcher_settings_are_one_message(tmp_path: Path) -> None:
    proc = run_epo(["sweep", "hydra/launcher=joblib", "hydra.launcher.n_jobs=abc", "seed=0,1",
                    f"output_dir={tmp_path}"], cwd=tmp_path, expect=2)
    one_error(proc, "Invalid value in hydra.launcher.n_jobs=abc", "could not be converted to Integer")
    proc = run_epo(["sweep", "hydra.launcher.n_jobs=2", "seed=0,1", f"output_dir={tmp_path}"], cwd=tmp_path, expect=2)
    one_error(proc, "'hydra.launcher.n_jobs' is not a setting of the selected Hydra launcher", "hydra/launcher=joblib")
    assert not (tmp_path / "sweeps").exists()


# ---- eval's arguments ----------------------------------------------------------------------------------------

def test_eval_run_with_model_path_is_refused_not_ignored(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run")
    proc = run_epo(["eval", f"run={run}", "model.path=/other/model"], cwd=tmp_path, expect=2)
    one_error(proc, "run= and model.path= both name the weights", "model.path=/other/model")


def test_eval_run_in_quotes_is_the_path_inside(tmp_path: Path) -> None:
    from epo_cli.evaluation.run import parse_eval_args

    opts, _ = parse_eval_args(["run='/my runs/a'", 'out="/x y"', "episodes=1e3"])
    assert (opts.run, opts.out, opts.episodes) == (Path("/my runs/a"), Path("/x y"), 1000)
    proc = run_epo(["eval", f"run='{tmp_path / 'nosuch'}'"], cwd=tmp_path, expect=1)
    one_error(proc, f"Run directory '{tmp_path / 'nosuch'}' does not exist")


@pytest.mark.parametrize("command", ["eval", "report"])
def test_a_file_where_a_run_folder_goes_is_called_a_file(command: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    args = ["eval", f"run={blocker}", "policy=random"] if command == "eval" else ["report", str(blocker)]
    proc = run_epo(args, cwd=tmp_path, expect=1)
    one_error(proc, str(blocker), "is a file")
    assert "does not exist" not in proc.stderr


# ---- report ------------------------------------------------------------------------------------------------

def test_report_on_repeated_or_negative_steps_warns_and_plots_one_row_per_step(tmp_path: Path) -> None:
    rows = [(1, 0.1), (2, 0.2), (3, 0.3), (1, 0.5), (2, 0.6), (-1, 0.9)]
    run = fake_run(tmp_path / "run", "".join(json.dumps({"step": s, "rollout/success": v}) + "\n" for s, v in rows))
    proc = run_epo(["report", str(run)], cwd=tmp_path)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert any("logs some steps more than once (1, 2)" in w for w in warnings), proc.stderr
    assert any("step is not a whole number >= 0 (-1)" in w for w in warnings), proc.stderr
    from epo_cli.analysis.report import load_run

    with pytest.warns(UserWarning):
        kept = load_run(run).rows
    assert [(r["step"], r["rollout/success"]) for r in kept] == [(1, 0.5), (2, 0.6), (3, 0.3)]


# ---- what only shows when the command runs ------------------------------------------------------------------

def test_flex_attention_on_the_cpu_is_refused_before_the_run_directory(tmp_path: Path) -> None:
    proc = run_epo(["train", "model.attn_implementation=flex_attention", "trainer.device=cpu",
                    f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, expect=1)
    one_error(proc, "model.attn_implementation=flex_attention cannot be used here", "sdpa")
    assert not (tmp_path / "out").exists()


def test_a_slipping_teacher_that_solves_nothing_is_blamed_not_the_turn_limit(tmp_path: Path, epo_cache: Path) -> None:
    proc = run_epo(["train", *SmallConfig().sft("algo.demo_slip=0.99"), f"output_dir={tmp_path / 'out'}"],
                   cwd=tmp_path, expect=1)
    one_error(proc, "algo.demo_slip=0.99", "Lower algo.demo_slip")


def cli(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=cwd, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, **kwargs)


@pytest.mark.parametrize("args", [["config", "show"], ["--help"], ["train", "--help"]])
def test_stdout_on_a_full_device_is_one_message(args: list[str], tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        proc = cli(args, tmp_path, stdout=full, stderr=subprocess.PIPE)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1, proc.stderr


def interrupt_when(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, "the script ended before it could be interrupted"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # the script alone: it must wait for the epo command it runs, not die


def test_ctrl_c_in_the_demo_is_one_line(tmp_path: Path, epo_cache: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "demo.py"), "--quick", "--out", str(out)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=terminal_signal_dispositions)
    interrupt_when(proc, lambda: any((out / "warm_start").glob("*/*/config.yaml")))
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "interrupted:" in text, text[-3000:]


def test_ctrl_c_in_exp_explore_is_one_line(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    (warm / "final").mkdir(parents=True)  # its runs fail on their own soon after: enough to be interrupted
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "experiments" / "exp_explore.py"), "--quick",
                             "--warm-start", str(warm), "--out", str(tmp_path / "out")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=terminal_signal_dispositions)
    interrupt_when(proc, lambda: any((tmp_path / "out").rglob("*.log")))
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "interrupted:" in text, text[-3000:]


# ---- class 7: the demo's table in a log -------------------------------------------------------------------------

def test_the_demo_table_keeps_one_line_per_row_in_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a file or pipe rich assumed 80 columns and wrapped every cell of the demo's 6-column table."""
    import importlib
    import io

    from rich.console import Console
    from rich.table import Table

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    demo = importlib.import_module("demo")
    log = io.StringIO()
    monkeypatch.setattr(demo, "console", Console(file=log, highlight=False))  # not a terminal
    table = Table(title="epo demo: household (tiny_open_pick_place, 15 turns), 64 fixed tasks, T=1.0")
    for header in ("policy", "eval success [95% CI]", "episode length", "entropy first / last", "entropy swing",
                   "reached warm start + 0.2"):
        table.add_column(header)
    rows = [["warm start", "0.266 [0.17, 0.38]", "13.1", "-", "-", "-"],
            ["GRPO", "0.547 [0.43, 0.66] (+0.281)", "10.2", "0.512 / 0.301", "0.211", "yes"]]
    for row in rows:
        table.add_row(*row)
    demo.print_table(table)
    lines = log.getvalue().splitlines()
    assert max(len(line) for line in lines) > 80  # the width it needs, not the 80 columns of no terminal
    for row in rows:
        assert any(all(cell in line for cell in row) for line in lines), log.getvalue()
    assert any("reached warm start + 0.2" in line for line in lines)
