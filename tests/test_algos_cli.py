"""The issue-13 algorithms through the CLI (in-process): 2 iterations each on household from the warm start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SmallConfig, metrics_rows, only_run_dir, run_epo

pytestmark = pytest.mark.slow

RL_ARGS = SmallConfig().rl(
    # a learning signal in the first iteration (groups that all fail with no penalty have A = 0):
    # progress events add turn rewards, which GiGPO's step returns discount
    "curriculum.subgoal_rewards=true")


def train(tmp_path: Path, name: str, *args: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    run_epo(["train", *args, f"output_dir={out}", f"name={name}"], cwd=out)
    run = only_run_dir(out)
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    return metrics_rows(run)


@pytest.mark.parametrize("name,args,expect", [
    ("gigpo", ["algo=gigpo"], {"name: gigpo", "estimator: gigpo"}),
    ("epo_gigpo", ["algo=epo", "algo.base=gigpo"], {"name: epo", "estimator: gigpo"}),
    ("clip_cov", ["algo=grpo", "algo.policy_loss=clip_cov", "algo.policy_clip.clip_cov_ratio=0.01"],
     {"policy_loss: clip_cov"}),
    ("kl_cov", ["algo=grpo", "algo.policy_loss=kl_cov", "algo.policy_clip.kl_cov_ratio=0.01"], {"policy_loss: kl_cov"}),
])
def test_two_iterations(warm_start: Path, tmp_path: Path, name: str, args: list[str], expect: set[str]) -> None:
    rows = train(tmp_path, name, *args, f"model.path={warm_start / 'final'}", "trainer.total_steps=2", *RL_ARGS)
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    assert first["loss/policy_clip"] != 0.0 and abs(first["policy/approx_kl"]) < 1e-6  # ratio 1 before any update
    saved = (only_run_dir(tmp_path / name) / "config.yaml").read_text()
    assert all(line in saved for line in expect), (expect, saved)
    if name == "epo_gigpo":
        assert "loss/entropy_smoothing" in first
    # the share is the ratio over the whole mini-batch (here the whole batch, several micro-batches), not one
    # token per micro-batch: 1% of the > 500 tokens, +-1 token of rounding
    if name == "clip_cov":
        # at most the ratio (fewer when fewer tokens lie in the covariance band)
        assert all(0.0 <= r["policy/cov_clipfrac"] <= 0.012 for r in rows)
        assert any(r["policy/cov_clipfrac"] > 0.0 for r in rows)
    if name == "kl_cov":
        assert all(abs(r["policy/kl_cov_frac"] - 0.01) < 0.002 for r in rows), [r["policy/kl_cov_frac"] for r in rows]
        assert first["policy/kl_cov_penalty"] == pytest.approx(0.0, abs=1e-6)  # at step 1 |log ratio| = 0


def test_gigpo_household_experiment_from_the_warm_start(warm_start: Path, tmp_path: Path) -> None:
    rows = train(tmp_path, "gigpo_household", "experiment=gigpo_household", f"model.path={warm_start / 'final'}",
                 "trainer.total_steps=2", "trainer.eval_every=0", "env.eval_splits=[]", "logger.tensorboard=false",
                 "algo.tasks_per_step=2", "env.max_turns=8")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["rollout/samples"] > 0 and "loss/policy_clip" in rows[0]
    saved = (only_run_dir(tmp_path / "gigpo_household") / "config.yaml").read_text()
    assert "name: gigpo_household" in saved and "estimator: gigpo" in saved and "step_weight: 1.0" in saved
