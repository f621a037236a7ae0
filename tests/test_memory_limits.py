"""Inputs cannot exhaust memory (issue 30, class 4): a size that cannot fit is refused before anything is
allocated, with one message naming the settings, the size they imply and the memory there is
(epo_cli/analysis/memory.py); a sweep says how many jobs it starts and refuses more than sweep.max_jobs.

Every row used to be accepted (then gigabytes and growing, an allocator traceback or a Rust abort), or, for
`episodes=1e6`, refused as "not a number".
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, one_error, run_epo

HUGE = 1_000_000_000

#: (overrides, what the message names): each setting alone implies far more than any machine's memory
SIZES = [
    (["algo=grpo", f"env.max_turns={HUGE}"], f"env.max_turns={HUGE}"),
    (["algo=grpo", f"algo.group_size={HUGE}"], f"algo.group_size={HUGE}"),
    (["algo=grpo", f"algo.tasks_per_step={HUGE}"], f"algo.tasks_per_step={HUGE}"),
    (["algo=sft", f"env.max_turns={HUGE}"], f"env.max_turns={HUGE}"),
    ([f"model.num_hidden_layers={HUGE}"], f"model.num_hidden_layers={HUGE}"),
    (["model.hidden_size=1000000"], "model.hidden_size=1000000"),
    ([f"model.vocab_size={HUGE}"], f"model.vocab_size={HUGE}"),
    ([f"trainer.eval_episodes={HUGE}"], f"trainer.eval_episodes={HUGE}"),
]


@pytest.mark.parametrize(("args", "named"), SIZES, ids=[" ".join(a) for a, _ in SIZES])
@pytest.mark.parametrize("command", [["config", "show"], ["train"]])
def test_a_size_that_cannot_fit_is_refused_before_anything_is_allocated(args: list[str], named: str,
                                                                       command: list[str], tmp_path: Path) -> None:
    proc = run_epo([*command, *args, f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, expect=2)
    one_error(proc, named, "Refused before allocating anything", "this machine's memory")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("episodes", ["1000000", "1e6", "1e20", "100000000000000000000"])
def test_eval_episodes_that_cannot_fit_are_refused_before_any_task_is_drawn(episodes: str, tmp_path: Path) -> None:
    proc = run_epo(["eval", "policy=random", f"episodes={episodes}", f"output_dir={tmp_path / 'out'}"],
                   cwd=tmp_path, expect=2)
    one_error(proc, f"episodes={int(float(episodes))}", "Refused before allocating anything")
    assert not (tmp_path / "out").exists()


def test_the_default_and_shipped_configs_fit(tmp_path: Path) -> None:
    for args in ([], ["algo=grpo"], ["experiment=epo_household"], ["experiment=noisy_warm_start"]):
        run_epo(["config", "show", *args], cwd=tmp_path)


def limited(megabytes: int):
    """preexec_fn: an address-space limit (ulimit -v) for the child."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))
    return apply


@pytest.mark.parametrize("args", [["train", "model.hidden_size=1000000"], ["train", f"model.vocab_size={HUGE}"],
                                  ["train", "algo=grpo", f"algo.group_size={HUGE}"],
                                  # fits this machine (~2.4 GiB of parameters and Adam), not a 1 GiB limit
                                  ["config", "show", "model.vocab_size=2500000"]])
def test_under_a_small_ulimit_the_child_gets_the_message_not_a_memory_error(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "epo_cli", *args, f"output_dir={tmp_path / 'out'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env, preexec_fn=limited(1024))
    assert proc.returncode == 2, proc.stderr[-3000:]
    one_error(proc, "Refused before allocating anything", "address-space limit (ulimit -v)")
    assert "MemoryError" not in proc.stderr and "memory allocation" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---- sweeps --------------------------------------------------------------------------------------------------

def test_a_sweep_past_the_job_limit_is_refused_with_its_job_count(tmp_path: Path) -> None:
    proc = run_epo(["sweep", "seed=range(0,100000)", f"output_dir={tmp_path}"], cwd=tmp_path, expect=2)
    one_error(proc, "would start 100000 jobs", "sweep.max_jobs=1000", "sweep.max_jobs=100000")
    proc = run_epo(["sweep", "algo=grpo,epo", "seed=0,1,2", "sweep.max_jobs=5", f"output_dir={tmp_path}"],
                   cwd=tmp_path, expect=2)
    one_error(proc, "would start 6 jobs", "sweep.max_jobs=5")
    proc = run_epo(["sweep", "seed=0,1", "sweep.max_jobs=none", f"output_dir={tmp_path}"], cwd=tmp_path, expect=2)
    one_error(proc, "sweep.max_jobs must be a whole number")
    assert not (tmp_path / "sweeps").exists()


@pytest.mark.parametrize(("overrides", "count"), [
    (["seed=range(0,100000)"], 100000), (["seed=range(0,10,3)"], 4), (["algo.lr=range(0,1,0.25)"], 4),
    (["algo=grpo,epo", "seed=0,1,2"], 6), (["seed=choice(1,2)", "trainer.total_steps=5"], 2), (["seed=1"], 1),
    (["hydra/sweeper=optuna", "hydra.sweeper.n_trials=7", "algo.lr=interval(0.001,0.01)"], 7),
    (["hydra/sweeper=optuna", "algo.lr=interval(0.001,0.01)"], None),
])
def test_the_job_count_is_read_from_the_overrides_without_listing_them(overrides: list[str], count: int | None) -> None:
    from epo_cli.launch.sweep import _parse, job_count

    assert job_count(_parse(overrides)) == count
