"""scripts/gpu_check.py keeps working without a GPU: its shrunk CPU run, end to end through `epo train`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_gpu_check_runs_shrunk_on_cpu(epo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--quick", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert result["generation"]["generated_tokens"] > 0 and result["generation"]["gen_tokens_per_s"] > 0
    update = result["update"]
    assert update["update_tokens"] > 0 and update["update_tokens_per_s"] > 0 and update["loss"] == update["loss"]
    train = result["train_iteration"]
    assert train["perf/padding_efficiency"] == 1.0  # packed micro-batches in the real trainer
    assert train["perf/update_s"] > 0 and train["rollout/samples"] > 0
    assert "update tokens/s" in proc.stdout
