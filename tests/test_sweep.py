"""`epo sweep`: aggregation over seeds by hand, the summary of an interrupted sweep, and real sweeps through
the CLI (grid, one failing job, optuna) whose jobs each train in their own subprocess."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from epo_cli.analysis.sweep_summary import (
    RunResult,
    SweepSummaryConfig,
    aggregate,
    format_mean_std,
    mean_pm_std,
    mean_std,
    run_result,
    summarize,
)

from conftest import SmallConfig, run_epo

#: a job that trains for 2 steps and evaluates 1 episode at the end (~20 s here)
TINY = SmallConfig().sft("trainer.eval_episodes=1", "env.eval_splits=[eval_in_distribution]")


# ---- aggregation (hand-computed) ---------------------------------------------------------------------------

def _run(overrides: list[str], status: str = "finished", **values: float) -> RunResult:
    return RunResult(path=Path("/x"), job=0, overrides=overrides, status=status, **values)


def test_mean_plus_minus_std_is_formatted_in_one_place() -> None:
    """The sweep table, `epo report` and the study scripts: mean ± sample std of the finite values."""
    assert mean_pm_std([0.5, 0.7, 0.9]) == "0.7 ± 0.2"
    assert mean_pm_std([0.5, 0.7, 0.9], ".3f", ".3f") == "0.700 ± 0.200"
    assert mean_pm_std([0.25, math.nan]) == "0.25"  # one finite value: the value alone
    assert mean_pm_std([]) == mean_pm_std([math.inf]) == "-"
    assert format_mean_std(1234.5, 0.0123) == "1.23e+03 ± 0.012"


def test_mean_std_is_the_sample_std() -> None:
    assert mean_std([0.5, 0.7, 0.9]) == pytest.approx((0.7, 0.2))  # sqrt((0.04 + 0 + 0.04) / 2)
    mean, std = mean_std([0.3, math.nan])
    assert mean == 0.3 and math.isnan(std)
    assert all(math.isnan(x) for x in mean_std([]))


def test_aggregate_groups_by_everything_but_seed() -> None:
    runs = [
        _run(["algo=epo", "seed=0"], success=0.5, entropy_fluctuation=0.1, entropy_swing=0.02,
             steps_to_threshold=3.0),
        _run(["algo=epo", "seed=1"], success=0.7, entropy_fluctuation=0.2, entropy_swing=0.04,
             steps_to_threshold=5.0),
        # never reached the threshold
        _run(["seed=2", "algo=epo"], success=0.9, entropy_fluctuation=0.3, entropy_swing=0.06),
        _run(["algo=grpo", "seed=0"], success=0.25, steps_to_threshold=math.nan),
        _run(["algo=grpo", "seed=1"], status="failed"),
    ]
    epo, grpo = aggregate(runs)
    assert epo.label == "algo=epo" and grpo.label == "algo=grpo"
    assert (epo.runs, epo.finished, epo.failed, epo.seeds) == (3, 3, 0, ["0", "1", "2"])
    assert (epo.success_mean, epo.success_std) == pytest.approx((0.7, 0.2))
    assert (epo.entropy_fluctuation_mean, epo.entropy_fluctuation_std) == pytest.approx((0.2, 0.1))
    assert (epo.entropy_swing_mean, epo.entropy_swing_std) == pytest.approx((0.04, 0.02))
    # steps to threshold: over the runs that reached it (3 and 5): mean 4, std sqrt(2)
    assert (epo.steps_to_threshold_mean, epo.steps_to_threshold_std) == pytest.approx((4.0, math.sqrt(2)))
    assert epo.reached_threshold == "2/3"
    # the failed run counts as a run, not in the means
    assert (grpo.runs, grpo.finished, grpo.failed, grpo.success_mean) == (2, 1, 1, 0.25)
    assert math.isnan(grpo.success_std) and grpo.reached_threshold == "0/1"


def test_run_result_reads_the_metrics() -> None:
    rows = [
        {"step": 1, "rollout/success": 0.2, "policy/entropy_fluctuation": 0.0, "policy/entropy_swing": 0.0},
        {"step": 2, "rollout/success": 0.6, "policy/entropy_fluctuation": 0.3, "policy/entropy_swing": "nan"},
        {"step": 3, "rollout/success": 0.7, "eval/success": 0.25, "policy/entropy_fluctuation": 0.6,
         "policy/entropy_swing": 0.1},
        {"step": 4, "rollout/success": 0.9, "eval/success": 0.75},
    ]
    r = run_result(rows, 0.5, "rollout/success", path=Path("/x"), job=0, overrides=[], status="finished")
    # eval/success wins over rollout/success: final 0.75, first reaching 0.5 at step 4
    assert (r.success, r.success_metric, r.steps_to_threshold) == (0.75, "eval/success", 4.0)
    assert r.entropy_fluctuation == pytest.approx(0.3) and r.entropy_swing == pytest.approx(0.05)
    assert (r.objective, r.last_step) == (0.9, 4)
    no_eval = [{k: v for k, v in row.items() if k != "eval/success"} for row in rows]
    r = run_result(no_eval, 0.5, path=Path("/x"), job=0, overrides=[], status="finished")
    assert (r.success, r.success_metric, r.steps_to_threshold) == (0.9, "rollout/success", 2.0)


def _job(sweep: Path, name: str, overrides: list[str], status: dict | None, rows: list[dict]) -> None:
    job = sweep / name
    job.mkdir()
    (job / "sweep_job.json").write_text(json.dumps({"job": int(name.split("-")[0]), "overrides": overrides}))
    if status is not None:
        (job / "status.json").write_text(json.dumps(status))
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summarize_an_interrupted_sweep(tmp_path: Path) -> None:
    _job(tmp_path, "0-seed-0", ["seed=0"], {"status": "finished"}, [{"step": 1, "eval/success": 1.0}])
    _job(tmp_path, "1-seed-1", ["seed=1"], {"status": "running"}, [{"step": 1, "eval/success": 0.0}])
    _job(tmp_path, "2-seed-2", ["seed=2"], None, [])
    (group,) = summarize(tmp_path, SweepSummaryConfig())
    assert (group.runs, group.finished, group.success_mean) == (3, 1, 1.0)
    with open(tmp_path / "runs.csv") as f:
        statuses = [row["status"] for row in csv.DictReader(f)]
    assert statuses == ["finished", "unfinished (running)", "unfinished (unknown)"]
    assert "unfinished (running)" in (tmp_path / "summary.md").read_text()


# ---- real sweeps through the CLI -------------------------------------------------------------------------

def _sweep_dir(root: Path) -> Path:
    (path,) = (root / "sweeps").glob("*/*")
    return path


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_grid_sweep_of_three_runs(epo_cache: Path, tmp_path: Path) -> None:
    # algo.kl.coef is a schema key that algo=sft's yaml does not spell out: hydra must still accept it
    proc = run_epo(["sweep", *TINY, "algo.kl.coef=0.01,0.02,0.03", f"output_dir={tmp_path}"], cwd=tmp_path)
    sweep = _sweep_dir(tmp_path)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0-algo.kl.coef-0.01", "1-algo.kl.coef-0.02", "2-algo.kl.coef-0.03"]
    for job in jobs:  # each job is a normal run directory
        assert json.loads((sweep / job / "status.json").read_text())["status"] == "finished"
        assert (sweep / job / "config.yaml").exists() and (sweep / job / "final" / "config.json").exists()
    summary = _csv(sweep / "summary.csv")
    assert len(summary) == 3
    assert [row["label"] for row in summary] == [f"algo.kl.coef=0.0{i}" for i in (1, 2, 3)]
    assert all(row["finished"] == "1" and row["success_metric"] == "eval/success" for row in summary)
    assert "algo.kl.coef=0.02" in proc.stdout  # the table is printed too
    from omegaconf import OmegaConf

    assert OmegaConf.load(sweep / jobs[1] / "config.yaml").algo.kl.coef == 0.02
    # summarize rebuilds the same table from the run folders
    first = (sweep / "summary.csv").read_text()
    (sweep / "summary.csv").unlink()
    run_epo(["sweep", "summarize", str(sweep)], cwd=tmp_path)
    assert (sweep / "summary.csv").read_text() == first
    # and the report plots real sweep folders
    run_epo(["report", str(sweep)], cwd=tmp_path)
    assert (sweep / "plots" / "success.png").exists() and (sweep / "plots" / "index.md").exists()


@pytest.mark.slow
def test_sweep_with_a_failing_job_summarises_the_others(epo_cache: Path, tmp_path: Path) -> None:
    # a demonstration file that does not exist fails inside training, not when the config is composed
    run_epo(["sweep", *TINY, "algo.demos=expert,/nonexistent/demos.jsonl", f"output_dir={tmp_path}"],
            cwd=tmp_path)
    sweep = _sweep_dir(tmp_path)
    runs = {row["job"]: row for row in _csv(sweep / "runs.csv")}
    assert runs["0"]["status"] == "finished"
    assert runs["1"]["status"] == "failed" and "/nonexistent/demos.jsonl" in runs["1"]["error"]
    failed = next(p for p in sweep.iterdir() if p.name.startswith("1-"))
    status = json.loads((failed / "status.json").read_text())
    assert status["status"] == "failed" and status["exit_code"] != 0 and status["log_tail"]
    job = json.loads((failed / "sweep_job.json").read_text())
    # the worst value for sweep.direction=maximize (-inf), which standard JSON writes as null
    assert job["objective"]["value"] is None
    summary = _csv(sweep / "summary.csv")
    assert [(row["finished"], row["failed"]) for row in summary] == [("1", "0"), ("0", "1")]
    assert "/nonexistent/demos.jsonl" in (sweep / "summary.md").read_text()


@pytest.mark.slow
def test_optuna_sweep_of_two_trials(epo_cache: Path, tmp_path: Path) -> None:
    no_eval = [a for a in TINY if not a.startswith(("env.eval_splits", "trainer.eval_episodes"))]
    run_epo(["sweep", *no_eval, "env.eval_splits=[]", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
             "hydra.sweeper.n_jobs=1", "hydra.sweeper.sampler.seed=0", "algo.lr=interval(1e-4,1e-2)",
             "sweep.metric=loss/nll", "sweep.direction=minimize", f"output_dir={tmp_path}"], cwd=tmp_path)
    sweep = _sweep_dir(tmp_path)
    values = [json.loads(p.read_text())["objective"]["value"] for p in sorted(sweep.glob("*/sweep_job.json"))]
    assert len(values) == 2 and all(math.isfinite(v) for v in values)
    from omegaconf import OmegaConf

    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert best.best_value == pytest.approx(min(values))
    summary = _csv(sweep / "summary.csv")
    assert len(summary) == 2
    assert sorted(float(r["objective_mean"]) for r in summary) == pytest.approx(sorted(values))


def test_sweep_user_errors(tmp_path: Path) -> None:
    proc = run_epo(["sweep", "trainer.total_stepz=1,2"], cwd=tmp_path, expect=None)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "total_steps" in proc.stderr
    proc = run_epo(["sweep", "sweep.metrik=x"], cwd=tmp_path, expect=None)
    assert proc.returncode == 2 and "sweep.metric" in proc.stderr
    proc = run_epo(["sweep", "summarize", str(tmp_path / "none")], cwd=tmp_path, expect=None)
    assert proc.returncode == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_slurm_preset_composes_with_the_submitit_launcher() -> None:
    from hydra import compose, initialize_config_dir

    from epo_cli.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=epo_slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.nodes, launcher.partition) == (1, 1, "gpu")
