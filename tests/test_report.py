"""`epo report`: the EPO reference recomputed from logged entropies (by hand), seed bands, and PNGs written
through the CLI that load as images and show the data (not blank)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from epo_cli.analysis.report import entropy_reference, mean_band

from conftest import SmallConfig, metrics_rows, only_run_dir, run_cli, run_epo

PLOTS = ("entropy.png", "entropy_fluctuation.png", "success.png", "kl.png", "coefficients.png", "lr.png",
         "collapse.png", "entropy_turns.png")
#: matplotlib's first two line colours (C0, C1)
C0, C1 = (31, 119, 180), (255, 127, 14)


def _rows(entropies: list[float]) -> list[dict]:
    return [{"step": i + 1, "policy/entropy": h} for i, h in enumerate(entropies)]


@pytest.mark.parametrize("history, expected", [
    ("cumulative", [1.0, 1.5, 2.0]),  # mean of all past steps
    ("window", [1.0, 1.5, 2.5]),      # mean of the last 2
    ("ema", [1.0, 1.5, 2.25]),        # e <- 0.5 e + 0.5 H, from the first H
])
def test_entropy_reference_uses_only_past_steps(history: str, expected: list[float]) -> None:
    steps, refs = entropy_reference(_rows([1.0, 2.0, 3.0, 4.0]),
                                    {"history": history, "window": 2, "ema_decay": 0.5})
    assert list(steps) == [1, 2, 3, 4]
    assert math.isnan(refs[0]) and list(refs[1:]) == pytest.approx(expected)


def test_mean_band_over_seeds() -> None:
    a = (np.array([1.0, 2.0]), np.array([1.0, 3.0]))
    b = (np.array([1.0, 2.0, 3.0]), np.array([3.0, 5.0, 7.0]))
    steps, mean, std = mean_band([a, b])
    assert list(steps) == [1, 2, 3]
    assert list(mean) == [2.0, 4.0, 7.0] and list(std) == [1.0, 1.0, 0.0]


# ---- through the CLI --------------------------------------------------------------------------------------

def _fake_run(path: Path, overrides: list[str], seed: int) -> None:
    """A run folder as training leaves it: config.yaml (really composed) and metrics.jsonl."""
    from epo_cli.compose import compose

    path.mkdir(parents=True)
    cfg = OmegaConf.to_container(compose(overrides), resolve=True)
    cfg["meta"] = {"overrides": overrides}
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    (path / "sweep_job.json").write_text(json.dumps({"job": 0, "overrides": overrides}))
    rng = np.random.default_rng(seed)
    f = 1.0 + 0.5 * seed  # configurations (and seeds) differ, so their lines do not hide each other
    lines = []
    for step in range(1, 21):
        h = 2.0 - 0.05 * f * step + 0.1 * rng.standard_normal()
        row = {"step": step, "policy/entropy": h, "policy/entropy_fluctuation": 0.01 * f * step,
               "policy/entropy_swing": abs(0.05 * rng.standard_normal()),
               "rollout/success": min(1, 0.03 * f * step), "policy/kl_ref": 0.001 * f * step,
               "coef/lambda": 0.001, "coef/beta": 1 + math.exp(-step / 5), "perf/lr": 1e-4 * f}
        row.update({"collapse/reward_std": 3 - 0.1 * f * step, "collapse/zero_std_groups": 0.02 * f * step,
                    "collapse/adv_signal_share": 1 - 0.02 * f * step, "collapse/state_diversity": 0.5 / f,
                    "collapse/corridor_above": 0.01 * f * step, "collapse/corridor_below": 0.005 * f * step,
                    "collapse/alert": float(step in (7, 8, 9, 15) and seed == 1),
                    **{f"policy/entropy_turn/{t}": h * (1 - 0.1 * t) for t in range(5) if step > t}})
        if step % 5 == 0:
            row.update({"eval/eval_in_distribution/success": 0.02 * f * step, "eval/success": 0.02 * f * step,
                        "eval/eval_out_of_distribution/success": 0.01 * f * step, "collapse/mi": 0.3 / f})
        lines.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "status.json").write_text(json.dumps({"status": "finished"}))


def _pixels_near(img: np.ndarray, colour: tuple[int, int, int], tol: int = 40) -> int:
    return int((np.abs(img[..., :3].astype(int) - np.array(colour)).sum(-1) < tol).sum())


@pytest.mark.slow
def test_report_of_a_sweep_with_seeds(tmp_path: Path) -> None:
    from PIL import Image

    sweep = tmp_path / "sweep"
    for job, (alpha, seed) in enumerate([(0.05, 0), (0.05, 1), (0.1, 0), (0.1, 1)]):
        _fake_run(sweep / f"{job}-run", ["algo=epo", f"algo.entropy_smoothing.alpha={alpha}", f"seed={seed}"],
                  seed=job)  # configuration 2 has the larger factors
    proc = run_epo(["report", str(sweep)], cwd=tmp_path)
    assert "2 configurations" in proc.stdout
    out = sweep / "plots"
    for name in PLOTS:
        img = np.asarray(Image.open(out / name).convert("RGB"))
        assert img.shape[0] > 100 and img.shape[1] > 100
        assert img.std() > 10, f"{name} looks blank"
        if name == "entropy_turns.png":  # heatmaps (viridis), one per configuration: checked below
            continue
        if name == "coefficients.png":  # equal coefficients: the second line covers the first
            assert _pixels_near(img, C0) + _pixels_near(img, C1) > 200, f"{name}: no data drawn"
            continue
        assert _pixels_near(img, C0) > 200, f"{name}: no line of the first configuration"
        assert _pixels_near(img, C1) > 200, f"{name}: no line of the second configuration"
    index = (out / "index.md").read_text()
    for name in PLOTS:
        assert f"]({name})" in index
    assert "algo.entropy_smoothing.alpha=0.05" in index and "algo.entropy_smoothing.alpha=0.1" in index
    assert "not logged" not in index
    # the run of seed 1 (job 1) had the collapse alert on at steps 7-9 and 15: one line names where it went on
    assert index.count("**Collapse alert**") == 1 and "in `1-run` from steps 7, 15 (on for 4 steps;" in index
    # the per-turn heatmaps: two panels (configurations), each with 5 turns x 20 steps of colour
    img = np.asarray(Image.open(out / "entropy_turns.png").convert("RGB")).astype(int)
    vivid = (img.max(-1) - img.min(-1)) > 60  # viridis cells are saturated; axes, text and background are grey
    assert vivid.sum() > 5000, "entropy_turns.png: no heatmap drawn"


@pytest.mark.slow
def test_report_of_one_run_and_errors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run, ["algo=grpo"], seed=0)
    # the real console script (a smoke test of `epo report`; the other tests here run it in-process)
    run_cli(["report", str(run), "--out", str(tmp_path / "figs")], cwd=tmp_path)
    assert all((tmp_path / "figs" / name).exists() for name in PLOTS)
    assert "Collapse alert" not in (tmp_path / "figs" / "index.md").read_text()  # seed 0: no alert
    proc = run_epo(["report", str(tmp_path / "nowhere")], cwd=tmp_path, expect=None)
    assert proc.returncode == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_collapse_panel_from_a_real_run(warm_start_short: Path, tmp_path: Path) -> None:
    from PIL import Image

    # MI every iteration on 4 samples; an MI threshold no policy meets (the entropy checks off), so MI is beyond
    # it at both steps: the alert is on at both and fires once, at the crossing (step 1)
    proc = run_epo(["train", "algo=epo", f"model.path={warm_start_short / 'final'}", "trainer.total_steps=2",
                    *SmallConfig().rl(), "algo.diagnostics.mi_every=1", "algo.diagnostics.mi_samples=4",
                    "algo.diagnostics.alert_mi=1000", "algo.diagnostics.alert_entropy_low=null",
                    "algo.diagnostics.alert_entropy_high=null", f"output_dir={tmp_path}", "name=real"], cwd=tmp_path)
    run = only_run_dir(tmp_path)
    rows = metrics_rows(run)
    assert [r["collapse/alert"] for r in rows] == [1.0, 1.0]
    for key in ("collapse/mi", "collapse/reward_std", "collapse/zero_std_groups", "collapse/adv_signal_share",
                "policy/entropy_turn/0"):
        assert all(key in r for r in rows), key
    assert "collapse/corridor_above" in rows[1]  # from the second step on: a reference exists
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "finished" and status["alerts"]["collapse"]["first_step"] == 1
    assert status["alerts"]["collapse"]["last_step"] == 1 and status["alerts"]["collapse"]["count"] == 1
    assert "MI" in status["alerts"]["collapse"]["reasons"][0]
    console = proc.stdout + proc.stderr
    assert console.count("collapse alert at step") == 1 and "collapse alert at step 1: MI" in console
    run_epo(["report", str(run)], cwd=tmp_path)
    for name in ("collapse.png", "entropy_turns.png"):
        img = np.asarray(Image.open(run / "plots" / name).convert("RGB"))
        assert img.shape[0] > 300 and img.std() > 10, f"{name} looks blank"
    assert _pixels_near(np.asarray(Image.open(run / "plots" / "collapse.png").convert("RGB")), C0) > 200
    index = (run / "plots" / "index.md").read_text()
    assert f"**Collapse alert** in `{run.name}` from step 1 (on for 2 steps;" in index and "](collapse.png)" in index
