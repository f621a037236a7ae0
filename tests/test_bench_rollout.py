"""bench_rollout times what its rows name: every mode and variant reaches the part it names, and its episode
comparison compares rollouts from the same weights.

The CLI tests run the real script under a driver that watches, from outside the bench, every call of the
sampler's `run_episodes` (epo_cli.training.group_sampler): the rollout's overlap setting as the sampler passes
it, the policy's shared prefill and a hash of the weights it plays with. Before these checks, --modes set an
attribute nothing read (`trainer.sampler.overlap`), so its "overlap" rows played lock-step, and --iteration
compared episodes played from weights that the variants' updates had rounded differently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "bench"

#: runs bench_rollout.main() with argv[2:], writing each run_episodes call to argv[1] (JSON lines)
DRIVER = '''
import hashlib, json, sys
sys.path.insert(0, {scripts!r})

def main():
    import torch
    import epo_cli.training.group_sampler as group_sampler

    out = open(sys.argv[1], "w")
    real = group_sampler.run_episodes

    def watched(policy, pool, slots, play):
        engine = getattr(policy, "engine", None)
        prefill = policy.shared_prefill if hasattr(policy, "shared_prefill") else engine.shared_prefill
        model = policy.model
        weights = torch.cat([p.detach().flatten().float() for p in model.parameters()]).numpy().tobytes()
        out.write(json.dumps({{"step": play.step, "overlap": play.overlap, "shared_prefill": prefill,
                               "weights": hashlib.sha1(weights).hexdigest()}}) + "\\n")
        out.flush()
        return real(policy, pool, slots, play)

    group_sampler.run_episodes = watched
    sys.argv = ["bench_rollout.py", *sys.argv[2:]]
    import bench_rollout
    bench_rollout.main()

if __name__ == "__main__":
    main()
'''


def run_watched(tmp_path: Path, args: list[str], scripts: Path = SCRIPTS) -> tuple[subprocess.CompletedProcess,
                                                                                   list[dict]]:
    """bench_rollout.py `args` under the driver: (the process, every run_episodes call it made)."""
    driver, calls = tmp_path / "driver.py", tmp_path / "calls.jsonl"
    driver.write_text(DRIVER.format(scripts=str(scripts)))
    proc = subprocess.run([sys.executable, str(driver), str(calls), *args], capture_output=True, text=True,
                          timeout=600)
    return proc, [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


@pytest.mark.slow
def test_modes_reach_the_sampler_and_the_policy(tmp_path: Path, epo_cache: Path) -> None:
    """--modes: each mode's rollout is played with that mode's overlap and shared prefill, and says so."""
    out = tmp_path / "modes.json"
    proc, calls = run_watched(tmp_path, ["--modes", "--envs", "household", "--iterations", "1", "--tasks", "1",
                                         "--group-size", "2", "--household-turns", "2", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    played = [(c["overlap"], c["shared_prefill"]) for c in calls]
    # MODES, in order: lock-step, shared prefill, overlap, overlap + shared prefill
    assert played == [(False, False), (False, True), (True, False), (True, True)]
    rows = json.loads(out.read_text())["household"]
    for name, row in rows.items():
        overlap = "overlap" in name
        assert row["reached"]["sampler.settings.overlap"] is overlap, name
        assert row["reached"]["policy.shared_prefill"] is ("shared prefill" in name), name
        calls_of = row["reached"]["pool_calls"]
        assert (calls_of["submit"] > 0, calls_of["step"] > 0) == (overlap, not overlap), name
        assert row["same"] is True, name


@pytest.mark.slow
def test_iteration_variants_play_from_the_same_weights(tmp_path: Path, epo_cache: Path) -> None:
    """--iteration: every iteration of every variant starts from the reference's weights, so its episodes are
    comparable (small micro- and mini-batches make the padded and packed updates round differently)."""
    out = tmp_path / "iteration.json"
    proc, calls = run_watched(tmp_path, ["--iteration", "--envs", "household", "--iterations", "2", "--tasks", "2",
                                         "--group-size", "2", "--household-turns", "3", "--variants",
                                         "before,today", "--json", str(out), "rollout.max_new_tokens=16",
                                         "algo.mini_batch_size=4", "algo.micro_batch_size=2"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # variants interleaved: before, today in iteration 0; today, before in iteration 1
    assert [c["step"] for c in calls] == [0, 0, 1, 1]
    assert [c["shared_prefill"] for c in calls] == [False, True, True, False]
    assert not any(c["overlap"] for c in calls)
    for step in (0, 1):
        assert len({c["weights"] for c in calls if c["step"] == step}) == 1, f"iteration {step}: other weights"
    rows = json.loads(out.read_text())["household"]
    assert rows["before"]["reached"] == {"sampler.settings.overlap": False, "policy.shared_prefill": False,
                                         "models.packing": False, "update.reuses_scoring": False}
    assert rows["today"]["reached"] == {"sampler.settings.overlap": False, "policy.shared_prefill": True,
                                        "models.packing": True, "update.reuses_scoring": True}
    assert rows["today"]["same"] == [True, True]
    assert len(rows["today"]["updates"]) == 2  # each iteration's update compared with before's


def test_a_mode_that_did_not_reach_its_part_stops_the_bench() -> None:
    """check_mode_reached names the mode and what its parts held (no Trainer: stand-ins for the parts)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_rollout
    finally:
        sys.path.remove(str(SCRIPTS))

    class Settings:
        overlap = False

    class Sampler:
        settings = Settings()

    class Policy:
        shared_prefill = True

    lock_step = {"reset": 1, "start_reset": 0, "step": 3, "submit": 0, "collect": 0}
    bench_rollout.check_mode_reached("shared prefill", False, True, Sampler(), Policy(), lock_step)  # reached
    with pytest.raises(SystemExit, match="mode 'overlap'.*settings.overlap is False.*lock-step calls"):
        bench_rollout.check_mode_reached("overlap", True, True, Sampler(), Policy(), lock_step)
    # iteration 0: the reference stepped 2e-6 at most, this variant not at all; iteration 1: 1e-7 apart
    assert bench_rollout.update_column([
        {"max_step": 2e-6, "own_max_step": 0.0, "max_diff": 2e-6, "share_differing": 0.25},
        {"max_step": 1e-5, "own_max_step": 1e-5, "max_diff": 1e-7, "share_differing": 0.0}]) \
        == "1.00; 25.000% (no step: 0)"
