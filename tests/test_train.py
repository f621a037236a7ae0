"""Training through the CLI on the tiny model and the household env: SFT, PPO, GRPO, EPO, resume.

The RL runs start from the session's behaviour-cloned warm starts and are kept to a few iterations of a
few short episodes. Commands run in-process (conftest.run_epo), except the resume-equality test, which
runs the real console script (conftest.run_cli).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SmallConfig, metrics_rows, only_run_dir, run_cli, run_epo

pytestmark = pytest.mark.slow

#: a small, fast RL shape on the level the warm start was trained on (conftest.SmallConfig.rl)
RL_ARGS = SmallConfig().rl()


def train(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    run_cli(["train", *args, f"output_dir={out}", f"name={name}"], cwd=out)
    return only_run_dir(out)


def train_in_process(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    run_epo(["train", *args, f"output_dir={out}", f"name={name}"], cwd=out)
    return only_run_dir(out)


def test_sft_loss_falls_and_beats_random_admissible(warm_start: Path, tmp_path: Path) -> None:
    rows = metrics_rows(warm_start)
    first = sum(r["loss/nll"] for r in rows[:20]) / 20
    last = sum(r["loss/nll"] for r in rows[-20:]) / 20
    assert last < 0.25 * first, (first, last)
    assert (warm_start / "final" / "config.json").exists() and (warm_start / "demos.jsonl").exists()
    # the same 32 evaluation tasks, played greedily by the warm start and by a random admissible policy
    results = {}
    for policy in ("model", "random"):
        out = tmp_path / policy
        run_epo(["eval", f"run={warm_start}", f"policy={policy}", "episodes=32", "greedy=true",
                 f"out={out}"], cwd=tmp_path)
        results[policy] = json.loads(next(out.glob("*.json")).read_text())["success"]["rate"]
    assert results["model"] > results["random"], results


@pytest.mark.parametrize("algo", ["grpo", "ppo", "epo"])
def test_two_rl_iterations(warm_start_short: Path, tmp_path: Path, algo: str) -> None:
    run = train_in_process(tmp_path, algo, f"algo={algo}", f"model.path={warm_start_short / 'final'}",
                           "trainer.total_steps=2", *RL_ARGS,
                           *(["algo.tasks_per_step=8", "algo.group_size=1"] if algo == "ppo" else []))
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    for key in ("rollout/success", "policy/entropy", "loss/policy_clip", "policy/kl_ref", "perf/update_s",
                "rollout/episode_len", "rollout/invalid_rate", "policy/clipfrac"):
        assert key in first, key
    # the scoring forward is the training forward: before the first update the ratio is exactly 1
    assert abs(first["policy/approx_kl"]) < 1e-6 and first["policy/clipfrac"] == 0.0
    assert first["policy/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the reference is the warm start
    if algo == "ppo":
        assert "critic/explained_variance" in first and "loss/value" in first
    if algo == "epo":
        assert "loss/entropy_smoothing" in first and first["coef/beta"] == pytest.approx(2.0)
        assert "policy/entropy_ref" not in first and rows[1]["policy/entropy_ref"] == pytest.approx(
            first["policy/entropy"], rel=1e-6)  # step 2's reference is step 1's entropy (cumulative mean)
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    assert (run / "final" / "config.json").exists()
    saved = (run / "config.yaml").read_text()
    assert "versions:" in saved and "deepspeed:" in saved and f"name: {algo}" in saved


def test_resume_gives_the_same_metrics(warm_start: Path, tmp_path: Path) -> None:
    """4 iterations straight == 2 iterations, stop, resume, 2 more (EPO: entropy history in checkpoint)."""
    args = ["algo=epo", f"model.path={warm_start / 'final'}", "trainer.total_steps=4", *RL_ARGS]
    straight = train(tmp_path, "straight", *args)
    split = train(tmp_path, "split", *args, "trainer.stop_after=2")
    assert json.loads((split / "status.json").read_text())["status"] == "stopped"
    assert [r["step"] for r in metrics_rows(split)] == [1, 2]
    run_cli(["train", f"trainer.resume={split}"], cwd=tmp_path)
    a, b = metrics_rows(straight), metrics_rows(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if key.startswith("perf/"):
                continue  # timings
            assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (ra["step"], key)
    state = json.loads((split / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["entropy_history"]["global"]  # the EPO history is part of the checkpoint


def test_corrupt_checkpoint_is_a_clear_error(warm_start_short: Path, tmp_path: Path) -> None:
    run = train_in_process(tmp_path, "broken", "algo=grpo", f"model.path={warm_start_short / 'final'}",
                           "trainer.total_steps=2", *RL_ARGS)
    ckpt = run / "checkpoints" / "step_2" / "mp_rank_00_model_states.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = run_epo(["train", f"trainer.resume={run}", "trainer.total_steps=3"], cwd=tmp_path, expect=1)
    assert "corrupt" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing saved was touched


def test_sft_from_a_jsonl_file_of_trajectories(warm_start_short: Path, tmp_path: Path) -> None:
    """algo.demos=<file>: the warm start's own demos.jsonl (the documented format) trains through the CLI."""
    demos = tmp_path / "demos.jsonl"
    demos.write_text("\n".join((warm_start_short / "demos.jsonl").read_text().splitlines()[:20]) + "\n")
    run = train_in_process(tmp_path, "from_file", "algo=sft", f"algo.demos={demos}", "env.level=tiny_open_pick_place",
                           "env.prompt_template=compact", "trainer.total_steps=3", "env.eval_splits=[]",
                           "logger.tensorboard=false")
    assert [r["step"] for r in metrics_rows(run)] == [1, 2, 3]
    assert not (run / "demos.jsonl").exists()  # nothing was played: the file was the data
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "x"}\n')
    proc = run_epo(["train", "algo=sft", f"algo.demos={bad}", "trainer.total_steps=1", f"output_dir={tmp_path}"],
                   cwd=tmp_path, expect=1)
    assert "bad.jsonl:1 is not a trajectory record" in proc.stderr and "Traceback" not in proc.stderr


def test_run_saved_with_a_retired_key_still_loads(tmp_path: Path) -> None:
    """trainer.log_every (never read) was removed; runs saved with it can still be resumed and evaluated."""
    from omegaconf import OmegaConf

    from epo_cli.compose import compose, load_run_config
    from epo_cli.config import ConfigError

    saved = OmegaConf.to_container(compose(["algo=grpo"]), resolve=True)
    saved["trainer"]["log_every"] = 1
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    cfg = load_run_config(tmp_path)
    assert "log_every" not in cfg.trainer and cfg.algo.name == "grpo"
    with pytest.raises(ConfigError, match="trainer.log_every"):  # as an override it is an unknown key
        compose(["trainer.log_every=2"])
