"""`make demo`'s script in its shrunk mode (--quick): the whole pipeline through the real CLI, warm start ->
GRPO and EPO side by side -> three evaluations on the same tasks -> table, JSON summary and PNG. Its numbers
mean nothing at this size; what is checked is that every step ran as the demo says it does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from epo_cli.launch.setup import compose_for_train

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


@pytest.mark.parametrize("algo", ["grpo", "epo"])
def test_the_demo_preset_composes_for_both_arms_without_warnings(algo: str, recwarn: pytest.WarningsRecorder) -> None:
    cfg, _ = compose_for_train(["experiment=improve_on_teacher", f"algo={algo}", "model.path=/some/warm/final"])
    assert (cfg.env.level, cfg.env.max_turns, cfg.trainer.total_steps) == ("tiny_open_pick_place", 15, 30)
    assert (cfg.algo.name, cfg.algo.tasks_per_step, cfg.algo.group_size, cfg.algo.lr) == (algo, 4, 8, 5e-4)
    assert cfg.model.name == "tiny"
    assert not [str(w.message) for w in recwarn if "no effect" in str(w.message)]


def test_the_demo_warm_start_clones_a_slipping_teacher(recwarn: pytest.WarningsRecorder) -> None:
    cfg, _ = compose_for_train(["experiment=noisy_warm_start"])
    assert (cfg.algo.name, cfg.algo.demo_slip, cfg.env.level, cfg.trainer.total_steps) == \
        ("sft", 0.4, "tiny_open_pick_place", 1600)
    assert not [str(w.message) for w in recwarn if "no effect" in str(w.message)]


@pytest.mark.slow
def test_quick_demo_runs_every_step_and_says_whether_each_arm_reached_the_target(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["level"] == "tiny_open_pick_place"  # the RL preset's level
    assert set(summary["success"]) == {"warm start", "GRPO", "EPO"}
    # the verdict is the arithmetic on the measured rates, not a constant
    warm = summary["success"]["warm start"]["rate"]
    for arm in ("GRPO", "EPO"):
        assert summary["reached_target"][arm] == (summary["success"][arm]["rate"] - warm >= summary["target_gain"])

    # both arms start from the warm start's weights with the same seed; they differ in the algorithm only
    configs = {name: OmegaConf.load(Path(summary["runs"][name]) / "config.yaml") for name in ("grpo", "epo")}
    warm_final = str(Path(summary["runs"]["warm start"]) / "final")
    assert {c.algo.name for c in configs.values()} == {"grpo", "epo"}
    assert {c.model.path for c in configs.values()} == {warm_final}
    assert configs["grpo"].seed == configs["epo"].seed
    assert "entropy_smoothing" in configs["epo"].algo.loss_terms
    assert "entropy_smoothing" not in configs["grpo"].algo.loss_terms

    # all three policies played the same fixed tasks, on the RL level, at the RL turn limit
    evals = [json.loads(p.read_text()) for p in sorted((out / "eval").glob("*/*.json"))]
    assert len(evals) == 3
    assert len({tuple(e["task_id"] for e in ev["per_episode"]) for ev in evals}) == 1
    assert {ev["max_turns"] for ev in evals} == {summary["max_turns"]}

    table = (out / "summary.md").read_text()
    assert "reached warm start + 0.2" in table and "entropy swing" in table
    for label in ("warm start", "GRPO", "EPO"):
        assert f"| {label} |" in table
    assert "did not reach" in proc.stdout or "Both arms reached" in proc.stdout
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
