"""conftest.run_epo, the in-process runner most integration tests use: it must give what the console script
gives (same metrics, same exit codes and messages) and leave no process-wide state behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from conftest import SmallConfig, merge_overrides, metrics_rows, only_run_dir, run_cli, run_epo


def test_merge_overrides_replaces_shared_keys_and_keeps_the_rest() -> None:
    assert merge_overrides(["a=1", "b.c=2", "d=3"], ("b.c=5", "e=6")) == ["a=1", "d=3", "b.c=5", "e=6"]
    rl = SmallConfig().rl("env.max_turns=6")
    assert "env.max_turns=6" in rl and "env.max_turns=8" not in rl and "algo.group_size=4" in rl


def _process_state() -> dict:
    return {"cwd": os.getcwd(), "env": dict(os.environ), "threads": torch.get_num_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "signals": {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)},
            "rng": torch.get_rng_state()}


@pytest.mark.slow
def test_in_process_run_equals_the_console_script(warm_start_short: Path, small_config: SmallConfig,
                                                  tmp_path: Path) -> None:
    """One GRPO iteration (sampling, scoring, update, checkpoint) through run_epo and through the real
    console script: every logged number that is not a timing is the same, and the test process's state
    (cwd, environment, torch threads and flags, signal handlers, RNG) is as it was."""
    args = ["train", "algo=grpo", f"model.path={warm_start_short / 'final'}", "trainer.total_steps=1",
            *small_config.rl()]
    before = _process_state()
    rows = {}
    for name, runner in (("in_process", run_epo), ("subprocess", run_cli)):
        out = tmp_path / name
        out.mkdir()
        proc = runner([*args, f"output_dir={out}", "name=same"], cwd=out)
        assert "rollout/success" in proc.stdout or "step 1/1" in proc.stdout, proc.stdout[-2000:]
        rows[name] = metrics_rows(only_run_dir(out))[0]
    after = _process_state()
    assert torch.equal(before.pop("rng"), after.pop("rng"))
    assert before == after
    keys = {k for k in rows["subprocess"] if not k.startswith("perf/") and k not in ("time", "elapsed_s")}
    assert keys == {k for k in rows["in_process"] if not k.startswith("perf/") and k not in ("time", "elapsed_s")}
    assert "loss/policy_clip" in keys and "rollout/episode_len" in keys
    assert {k: rows["in_process"][k] for k in keys} == {k: rows["subprocess"][k] for k in keys}


def test_in_process_user_error_and_bug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user error is its one-line message and exit code; a bug is a traceback and exit 1, as in a process."""
    proc = run_epo(["train", "trainer.total_stepz=1"], cwd=tmp_path, expect=2)
    assert proc.stderr.startswith("error: Unknown config key 'trainer.total_stepz'") and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # it ran in tmp_path: nothing written there (nor anywhere else)

    import epo_cli.launch.local

    def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(epo_cli.launch.local, "run_local", broken)
    proc = run_epo(["train"], cwd=tmp_path, expect=1)
    assert "Traceback" in proc.stderr and "RuntimeError: a bug" in proc.stderr
