"""Issue 41, class 6: `epo plan`, `epo sweep`, `epo report`, `epo eval` and the shell meet the CLI's standard.

Each row was a traceback or a silent wrong answer: `epo config show >&-` (AttributeError on a closed stdout),
`epo sweep 'seed=range(0,10,0)'` and `'seed=interval(0,1)'` without optuna (Hydra's tracebacks), `epo report` on
values of 1e308 (matplotlib's arange ValueError), `epo eval run=<run> experiment=...` (ConfigKeyError), and for
`epo plan`: a --throughput file naming "../algo/grpo" (loaded conf/algo/grpo.yaml as a model), config.json heads
0 or 1e999 (ZeroDivisionError, OverflowError), --gpu-mem inf ("fits", --json printed Infinity), --gpus 1e26
(planned), and `trainer.resume=<run>` (planned the default config without a word). Now each is one message
(exit non-zero, no traceback), a warning, or the right plan. Every row failed on the code before this change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SmallConfig, one_error, run_epo


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two SFT steps with a checkpoint (responses of 16 tokens: not the default 64)."""
    root = tmp_path_factory.mktemp("run")
    run = root / "sft"
    run_epo(["train", *SmallConfig().sft("trainer.save_every=1"), f"run_dir={run}"], root)
    return run


# ---- the shell -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["config", "show"], ["plan", "--json"], ["train", "--help"]])
def test_a_closed_stdout_is_one_message(args: list[str], tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=tmp_path, capture_output=False,
                          stderr=subprocess.PIPE, stdout=None, text=True, timeout=300, env=os.environ.copy(),
                          preexec_fn=lambda: os.close(1))
    assert proc.returncode == 1, proc.stderr
    one_error(proc, "the standard output is closed")


# ---- epo sweep and epo report ----------------------------------------------------------------------------------

SWEEPS = [
    (["seed=range(0,10,0)"], ["seed=range(0,10,0): a range's step cannot be 0", "seed=range(0,10)"]),
    (["seed=range(0.5,2,0)"], ["a range's step cannot be 0"]),
    (["seed=interval(0,1)"], ["seed=interval(0,1): an interval has no list of values", "hydra/sweeper=optuna"]),
    (["algo.lr=tag(log,interval(1e-5,1e-3))"], ["an interval has no list of values"]),
]


@pytest.mark.parametrize(("args", "texts"), SWEEPS, ids=[" ".join(a) for a, _ in SWEEPS])
def test_a_sweep_the_basic_sweeper_cannot_run_is_one_message(args: list[str], texts: list[str],
                                                              tmp_path: Path) -> None:
    proc = run_epo(["sweep", *args, f"output_dir={tmp_path / 'out'}"], tmp_path, expect=2)
    one_error(proc, *texts)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["1e308", "-1e308", "1.7976931348623157e308"])
def test_report_on_values_no_axis_holds_warns_and_plots_the_rest(value: str, trained_run: Path,
                                                                  tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "rollout/success": float(value) if step == 2 else 0.5, "policy/entropy": 1.0})
        + "\n" for step in (1, 2, 3)))
    (run / "status.json").write_text('{"status": "finished"}')
    proc = run_epo(["report", str(run)], tmp_path)
    assert "Traceback" not in proc.stderr
    assert "rollout/success has values beyond +-1e+100 at step(s) 2" in proc.stderr, proc.stderr
    assert (run / "plots" / "index.md").is_file()


# ---- epo eval ----------------------------------------------------------------------------------------------------

def test_eval_of_a_run_with_an_experiment_preset_is_one_message(trained_run: Path, tmp_path: Path) -> None:
    proc = run_epo(["eval", f"run={trained_run}", "experiment=warm_start", f"out={tmp_path / 'eval'}"], tmp_path,
                   expect=2)
    one_error(proc, "experiment=warm_start: an experiment preset sets a whole training config", "Fix:")
    assert not (tmp_path / "eval").exists()


# ---- epo plan ----------------------------------------------------------------------------------------------------

def _model_folder(tmp_path: Path, **changes: object) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1024, **changes}
    (folder / "config.json").write_text(json.dumps(config).replace('"INF"', "1e999"))
    return folder


PLAN_ERRORS = [
    (["--gpu-mem", "inf"], ["--gpu-mem inf: needs a number of GiB per GPU above 0"]),
    (["--gpu-mem", "1e999"], ["--gpu-mem inf"]),
    (["--gpu-mem", "nan"], ["--gpu-mem nan"]),
    (["--gpus", "100000000000000000000000000"], ["--gpus 100000000000000000000000000: needs a whole number from 1"]),
    (["--prompt-tokens", "100000000000000000000"], ["--prompt-tokens 100000000000000000000: needs a whole number"]),
]


@pytest.mark.parametrize(("args", "texts"), PLAN_ERRORS, ids=[" ".join(a) for a, _ in PLAN_ERRORS])
def test_plan_options_beyond_any_machine_are_one_message(args: list[str], texts: list[str], tmp_path: Path) -> None:
    proc = run_epo(["plan", "model=tiny", "--json", *args], tmp_path, expect=2)
    one_error(proc, *texts)
    assert proc.stdout == ""


@pytest.mark.parametrize(("changes", "why"), [
    ({"num_attention_heads": 0}, "num_attention_heads=0 is not a whole number"),
    ({"num_attention_heads": "INF"}, "num_attention_heads=inf is not a whole number"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0 is not a whole number"),
    ({"hidden_size": 1e300}, "hidden_size=1e+300 is not a whole number"),
    ({"num_attention_heads": 3}, "must be divisible by num_attention_heads=3"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers='two' is not a whole number"),
])
def test_plan_of_a_model_config_with_impossible_sizes_is_one_message(changes: dict[str, object], why: str,
                                                                     tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, **changes)
    proc = run_epo(["plan", f"model.path={folder}"], tmp_path, expect=2)
    one_error(proc, f"{folder / 'config.json'} is not a readable model config", why)


@pytest.mark.parametrize("name", ["../algo/grpo", "../model/tiny", "/etc/passwd", "tiny/../../algo/ppo"])
def test_a_throughput_file_names_only_models_of_conf_model(name: str, tmp_path: Path) -> None:
    throughput = tmp_path / "throughput.json"
    throughput.write_text(json.dumps({"model": name, "rollout_tokens_per_s": 100.0, "update_tokens_per_s": 200.0}))
    proc = run_epo(["plan", "model=tiny", "--json", "--throughput", str(throughput)], tmp_path)
    assert "Traceback" not in proc.stderr
    plan = json.loads(proc.stdout)
    assert "not scaled (the file names no model this tool knows)" in plan["time"]["throughput_source"]
    assert plan["time"]["update_tokens_per_s_per_gpu"] == 200.0


def test_plan_json_is_standard_json(tmp_path: Path) -> None:
    proc = run_epo(["plan", "model=tiny", "--json", "--gpu-mem", "1048576"], tmp_path)
    json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_plan_of_a_resumed_run_plans_that_run(trained_run: Path, tmp_path: Path) -> None:
    more = "trainer.total_steps=4"  # the run finished its 2 steps: a resume continues to more
    plan = json.loads(run_epo(["plan", f"trainer.resume={trained_run}", more, "--json"], tmp_path).stdout)
    assert plan["response_tokens"] == 16  # the run's rollout.max_new_tokens, not the default 64
    proc = run_epo(["plan", f"trainer.resume={trained_run}", more], tmp_path)
    assert f"planning the resumed run {trained_run}" in proc.stdout
    proc = run_epo(["plan", f"trainer.resume={tmp_path / 'nosuch'}"], tmp_path, expect=None)
    assert proc.returncode != 0
    one_error(proc, str(tmp_path / "nosuch"))


def test_the_plan_module_still_imports_no_torch() -> None:
    code = ("import sys; import epo_cli.analysis.plan as p; p.run_plan; from epo_cli.launch.setup import "
            "compose_for_train; print([m for m in ('torch', 'deepspeed') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
