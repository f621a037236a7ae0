"""scripts/gpu_check.py keeps working without a GPU: its shrunk CPU run of the trainer's own steps."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_table_by_device_name() -> None:
    peak = _module().peak_tflops
    assert peak("NVIDIA H200") == 989.0
    assert peak("NVIDIA H100 PCIe") == 756.0  # the PCIe card before the SXM entry it also matches
    assert peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak("Some Future GPU") is None


def test_gpu_check_runs_the_trainer_s_own_steps_on_cpu(epo_cache: Path, tmp_path: Path) -> None:
    """The shrunk CPU run (the GPU one cannot run here): the trainer's real rollout and update (PolicyUpdate with
    the EPO loss stack: its own metrics come back) give the figures `epo plan` reads from the result file."""
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--model",
                           "tiny", "--quick", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"device", "model", "rollout_tokens_per_s", "update_tokens_per_s", "mfu_update", "torch_version"} <= set(
        result)
    assert result["device"] == "cpu" and result["model"] == "tiny" and result["quick"] is True
    assert result["mfu_update"] is None  # no peak for a CPU
    assert result["rollout_tokens_per_s"] > 0 and result["generated_tokens"] > 0 and result["samples"] > 0
    assert result["update_tokens_per_s"] > 0 and result["update_tokens"] > 0
    # the update is the trainer's: one optimizer step through the EPO loss stack, packed micro-batches
    update = result["update_metrics"]
    assert {"loss/policy_clip", "loss/kl", "loss/entropy", "loss/entropy_smoothing"} <= set(update)
    assert update["perf/optimizer_steps"] == 1.0 and update["perf/padding_efficiency"] == 1.0
    assert "update tokens/s" in proc.stdout
