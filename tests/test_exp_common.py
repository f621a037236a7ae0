"""scripts/experiments/exp_common.py's study driver, with a fake `epo` (a tiny script standing in for
`python -m epo_cli`, no training): a finished run is reused, an unfinished one is deleted and trained again,
a failing job stops the study naming its log, and run_jobs runs the jobs n at a time in the order given;
and the studies' shared options (study_parser, check_arms) name bad values."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "experiments"
sys.path.insert(0, str(SCRIPTS))

import exp_common  # noqa: E402  (scripts, importable once scripts/experiments/ is on the path)
import exp_explore  # noqa: E402
import exp_long_horizon  # noqa: E402

#: `epo train KEY=VALUE...`: records its call, prints to its console, then per its overrides: exit=N fails
#: with N, trainer.resume=RUN finishes RUN, stop=1 ends with exit 0 before its last step (no final/), else
#: writes a finished run under output_dir
FAKE_EPO = '''
import pathlib, sys
args = dict(a.split("=", 1) for a in sys.argv[2:])
with open(pathlib.Path(__file__).with_name("calls.txt"), "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
print("fake epo console:", sys.argv[1], args.get("seed"))
if "exit" in args:
    sys.exit(int(args["exit"]))
if "trainer.resume" in args:  # continues the run in that folder: one more metrics row, then its final policy
    run = pathlib.Path(args["trainer.resume"])
    with open(run / "metrics.jsonl", "a") as metrics:
        metrics.write("{}\\n")
    (run / "final").mkdir()
    sys.exit(0)
run = pathlib.Path(args["output_dir"]) / "2026-12-03" / "20-00-00-fake"
run.mkdir(parents=True)
(run / "metrics.jsonl").write_text("{}\\n")
if "stop" not in args:
    (run / "final").mkdir()
'''


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """exp_common.EPO replaced by the fake; returns the file listing its calls (one line each)."""
    fake = tmp_path / "fake" / "epo.py"
    fake.parent.mkdir()
    fake.write_text(FAKE_EPO)
    monkeypatch.setattr(exp_common, "EPO", [sys.executable, str(fake)])
    return fake.with_name("calls.txt")


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_train_once_reuses_a_finished_run_and_starts_an_unfinished_one_over(
        tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture) -> None:
    folder = exp_common.run_folder(tmp_path, "grpo", 2, 0)
    assert folder == tmp_path / "runs" / "grpo" / "it2-seed0"  # the layout every study's outputs are read in
    # an interrupted run: metrics but no final policy, and a file it left behind
    (folder / "2026-12-01" / "10-00-00-old").mkdir(parents=True)
    (folder / "2026-12-01" / "10-00-00-old" / "metrics.jsonl").write_text("{}\n")
    assert exp_common.finished_run(folder) is None

    run = exp_common.train_once(folder, ["seed=0"], "grpo seed 0")
    assert lines(calls) == [f"train seed=0 output_dir={folder}"]
    assert not (folder / "2026-12-01").exists()  # the unfinished run was deleted, not mixed with the new one
    assert run == folder / "2026-12-03" / "20-00-00-fake" == exp_common.finished_run(folder)
    assert (tmp_path / "runs" / "grpo" / "it2-seed0.log").read_text() == "fake epo console: train 0\n"
    out = capsys.readouterr().out
    assert f"$ epo train seed=0 output_dir={folder}\n" in out and "done: grpo seed 0 (" in out

    assert exp_common.train_once(folder, ["seed=0"], "grpo seed 0") == run  # finished: not trained again
    assert len(lines(calls)) == 1 and capsys.readouterr().out == ""


def test_a_failing_job_stops_the_study_with_its_log(tmp_path: Path, calls: Path) -> None:
    jobs = exp_common.seed_major(["a", "b"], [0, 1])
    assert jobs == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]  # every arm's seed 0 first

    def work(job: tuple[str, int]) -> None:
        arm, seed = job
        fail = ["exit=3"] if job == ("b", 0) else []
        exp_common.train_once(exp_common.run_folder(tmp_path, arm, 2, seed), [f"seed={seed}", *fail],
                              f"{arm} seed {seed}")

    with pytest.raises(SystemExit) as stopped:
        exp_common.run_jobs(jobs, work, 1)
    log = tmp_path / "runs" / "b" / "it2-seed0.log"
    assert str(stopped.value.code) == f"b seed 0 failed with exit code 3; see {log}"
    assert log.read_text() == "fake epo console: train 0\n"
    assert len(lines(calls)) == 2  # a seed 0, b seed 0; nothing started after the failure
    assert not (tmp_path / "runs" / "a" / "it2-seed1").exists()


def test_a_run_that_stops_early_is_no_result(tmp_path: Path, calls: Path) -> None:
    folder = exp_common.run_folder(tmp_path, "epo", 2, 1)
    with pytest.raises(SystemExit) as stopped:
        exp_common.train_once(folder, ["seed=1", "stop=1"], "epo seed 1")
    assert str(stopped.value.code) == f"epo seed 1 stopped before its last step; see {folder}.log"


def test_continue_once_resumes_a_copy_at_the_last_learning_rate_once(tmp_path: Path, calls: Path) -> None:
    def finished(iterations: int, lrs: list[float]) -> Path:
        run = exp_common.run_folder(tmp_path / "study", "gigpo", iterations, 0) / "2026-12-03" / f"1{iterations}-x"
        (run / "checkpoints" / "step_2").mkdir(parents=True)
        (run / "final").mkdir()
        (run / "long_horizon").mkdir()  # the study's evaluations of this policy, not the continued one's
        (run / "metrics.jsonl").write_text("".join(f'{{"perf/lr": {lr}}}\n' for lr in lrs))
        return run

    finished(1, [5e-4])
    source = finished(2, [5e-4, 1e-4])
    finished(5, [5e-4] * 5)  # not fewer iterations than the continuation's 4
    unfinished = exp_common.run_folder(tmp_path / "study", "gigpo", 3, 0) / "2026-12-03" / "13-x"
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text("{}\n")
    assert exp_common.longest_shorter_run(tmp_path / "study", "gigpo", 0, below=4) == source
    assert exp_common.longest_shorter_run(tmp_path / "study", "gigpo", 1, below=4) is None

    folder = exp_common.run_folder(tmp_path / "more", "gigpo", 4, 0)
    run = exp_common.continue_once(folder, source, 4, "gigpo seed 0", leave_out=("long_horizon",))
    assert run == folder / "2026-12-03" / "12-x" == exp_common.finished_run(folder)
    assert lines(calls) == [f"train trainer.resume={run} trainer.total_steps=4 algo.lr=0.0001 "
                            "algo.min_lr_ratio=1.0 algo.warmup_ratio=0"]
    assert (run / "checkpoints" / "step_2").is_dir() and not (run / "long_horizon").exists()
    assert len(lines(run / "metrics.jsonl")) == 3  # the source's 2 rows and the continuation's
    assert (source / "final").is_dir() and (source / "long_horizon").is_dir()  # the source is left as it was
    assert len(lines(source / "metrics.jsonl")) == 2

    assert exp_common.continue_once(folder, source, 4, "gigpo seed 0") == run  # done: not continued again
    assert len(lines(calls)) == 1


def test_run_jobs_runs_n_at_a_time_and_returns_results_in_job_order() -> None:
    both_running = threading.Barrier(2, timeout=30)  # passes only if the first two jobs run at the same time
    started = []

    def work(job: int) -> int:
        started.append(job)
        if job < 2:
            both_running.wait()
        return job * 10

    assert exp_common.run_jobs([0, 1, 2, 3], work, 2) == [0, 10, 20, 30]
    assert sorted(started) == [0, 1, 2, 3]

    def fails_at_1(job: int) -> int:
        started.append(job)
        if job == 1:
            raise ValueError("job 1 broke")
        return job

    started.clear()
    with pytest.raises(ValueError, match="job 1 broke"):
        exp_common.run_jobs([0, 1, 2, 3], fails_at_1, 1)
    assert started == [0, 1]  # one at a time, in order; nothing after the failure


@pytest.mark.parametrize("study", [exp_explore, exp_long_horizon], ids=lambda m: m.__name__)
@pytest.mark.parametrize("argv, message", [
    (["--arms", "grpo,nope"], "unknown arm(s) nope"),
    (["--seeds", "0,x"], "comma-separated integers"),
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--episodes", "-1"], "--episodes must be >= 0"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_bad_study_arguments_are_named(study, argv: list[str], message: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "final").mkdir()  # parse_args only checks that the warm start holds a policy folder
    with pytest.raises(SystemExit) as exit_:
        study.parse_args(["--warm-start", str(tmp_path), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_continue_from_needs_an_earlier_study_and_its_own_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "final").mkdir()
    (tmp_path / "study" / "runs").mkdir(parents=True)
    warm = ["--warm-start", str(tmp_path)]
    for argv, message in ((["--continue-from", str(tmp_path / "nowhere")], "holds no runs/: give the --out"),
                          (["--continue-from", str(tmp_path / "study"), "--out", str(tmp_path / "study")],
                           "--continue-from needs its own --out")):
        with pytest.raises(SystemExit) as exit_:
            exp_long_horizon.parse_args([*warm, *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    a = exp_long_horizon.parse_args([*warm, "--continue-from", str(tmp_path / "study"), "--out", str(tmp_path / "b")])
    assert a.continue_from == tmp_path / "study"


@pytest.mark.parametrize("study", [exp_explore, exp_long_horizon], ids=lambda m: m.__name__)
def test_a_missing_or_empty_warm_start_is_named(study, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for argv, message in (([], "--warm-start is required"), (["--warm-start", str(tmp_path)], "holds no final/")):
        with pytest.raises(SystemExit) as exit_:
            study.parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
