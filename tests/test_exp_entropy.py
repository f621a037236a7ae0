"""scripts/experiments/exp_entropy.py: its band statistics against hand-computed values, and (slow) its quick mode
through the real `epo sweep` and `epo eval` path, producing a table and a PNG with plausible contents."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "experiments"
sys.path.insert(0, str(SCRIPTS))

import exp_entropy  # noqa: E402  (a script, importable once scripts/ is on the path)


def test_reference_is_the_mean_of_the_earlier_iterations() -> None:
    assert exp_entropy.reference([1.0, 3.0, 1.0, 0.5]) == pytest.approx([1.0, 2.0, 5.0 / 3.0])
    assert exp_entropy.reference([0.7]) == []


def test_out_of_band_counts_iterations_outside_kappa_times_reference() -> None:
    h = [1.0, 3.0, 1.0, 0.5]
    # band (0.5, 1.5): k=1 ref 1 -> [0.5, 1.5], 3 out; k=2 ref 2 -> [1, 3], 1 in; k=3 ref 5/3 -> [5/6, 5/2], 0.5 out
    assert exp_entropy.out_of_band(h, 0.5, 1.5) == pytest.approx(2.0 / 3.0)
    # the paper's band (0, 2): only k=1 (3 > 2) is out
    assert exp_entropy.out_of_band(h, 0.0, 2.0) == pytest.approx(1.0 / 3.0)
    assert exp_entropy.out_of_band([1.0, 2.0], 0.0, 2.0) == 0.0  # on the bound is inside
    assert math.isnan(exp_entropy.out_of_band([1.0], 0.0, 2.0))  # no iteration has a reference


def test_entropy_stats_start_end_min_max() -> None:
    stats = exp_entropy.entropy_stats([1.0, 2.0, 3.0, 4.0, 5.0, 0.5], 0.0, 2.0)
    # end = mean of the last 5 = (2+3+4+5+0.5)/5; kappa_low = 0 lets nothing fall below the band, and each
    # H_k <= 2 x mean(H_0..H_{k-1}) (2 <= 2, 3 <= 3, 4 <= 4, 5 <= 5)
    assert stats == pytest.approx({"h_start": 1.0, "h_end": 2.9, "h_min": 0.5, "h_max": 5.0,
                                   "out_of_band": 0.0})


def test_preset_composes_without_warnings_and_each_arm_changes_what_it_names() -> None:
    from epo_cli.launch.setup import compose_for_train

    def compose(key: str) -> dict:
        cfg = compose_for_train(["experiment=entropy_stress", *exp_entropy.ARMS[key].overrides])[0]
        return OmegaConf.to_container(cfg.algo) | {"entropy_coef": cfg.entropy.coef}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        base = compose("grpo_bonus")
    assert base["name"] == "grpo" and base["loss_terms"] == ["policy_clip", "kl", "entropy"]
    assert base["entropy_coef"] > 0 and base["policy_loss"] == "clip"
    assert compose("grpo")["loss_terms"] == ["policy_clip", "kl"]
    assert compose("clip_higher")["policy_clip"]["clip_high"] > base["policy_clip"]["clip_high"]
    assert compose("clip_cov")["policy_loss"] == "clip_cov" and compose("kl_cov")["policy_loss"] == "kl_cov"
    for key, alpha in (("epo", 0.1), ("epo_bind", 1.0)):
        epo = compose(key)
        assert epo["name"] == "epo" and epo["loss_terms"][-1] == "entropy_smoothing"
        assert epo["entropy_smoothing"]["alpha"] == alpha and epo["entropy_coef"] == base["entropy_coef"]
        assert (epo["lr"], epo["tasks_per_step"], epo["group_size"]) == (
            base["lr"], base["tasks_per_step"], base["group_size"])


@pytest.mark.slow
def test_quick_study_writes_table_and_curves(tmp_path: Path, warm_start: Path) -> None:
    out = tmp_path / "study"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "exp_entropy.py"), "--quick", "--warm-start",
                           str(warm_start), "--out", str(out)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    runs = {r["arm"]: r for r in results["runs"]}
    assert sorted(runs) == ["epo_bind", "grpo_bonus"]
    for r in runs.values():
        assert len(r["entropy"]) == 2 and all(math.isfinite(h) and h > 0 for h in r["entropy"])
        assert 0.0 <= r["t1"] <= 1.0 and 0.0 <= r["greedy"] <= 1.0
        assert r["h_min"] <= r["h_start"] <= r["h_max"] and r["h_min"] <= r["h_end"] <= r["h_max"]
        assert r["out_of_band"] in (0.0, 1.0)  # one iteration with a reference
    # the share of tokens above the band comes from the smoothing term: EPO arms only, a share of tokens
    assert "tokens_above_band" not in runs["grpo_bonus"] and 0.0 <= runs["epo_bind"]["tokens_above_band"] <= 1.0
    # what ran is what each arm asks for
    bonus = OmegaConf.load(Path(runs["grpo_bonus"]["run"]) / "config.yaml")
    bind = OmegaConf.load(Path(runs["epo_bind"]["run"]) / "config.yaml")
    assert list(bonus.algo.loss_terms) == ["policy_clip", "kl", "entropy"] and bonus.algo.name == "grpo"
    assert "entropy_smoothing" in bind.algo.loss_terms and bind.algo.entropy_smoothing.alpha == 1.0
    assert bonus.entropy.coef == bind.entropy.coef > 0
    # every policy played the same fixed eval tasks (eval seed 0, not the run's seed)
    evals = [json.loads(p.read_text()) for p in out.rglob("t1/*.json")]
    assert len(evals) == 3 and len({tuple(e["task_id"] for e in ev["per_episode"]) for ev in evals}) == 1
    assert {ev["max_turns"] for ev in evals} == {bonus.env.max_turns}  # the warm start's own limit is longer

    table = (out / "results.md").read_text()
    for label in ("warm start (SFT)", exp_entropy.ARMS["grpo_bonus"].label, exp_entropy.ARMS["epo_bind"].label):
        assert f"| {label} |" in table
    png = (out / "entropy_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "sweeps" / "grpo_bonus" / "seeds-0" / "summary.csv").exists()
