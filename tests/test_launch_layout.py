"""The launcher's parent process counts GPUs without loading torch (epo_cli.launch.layout._cuda_count; whether
a GPU driver is there at all: epo_cli.runtime.device.gpu_driver_present)."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from epo_cli.launch import layout
from epo_cli.runtime import device


def _fake_python(tmp_path: Path, output: str, code: int = 0) -> str:
    """A stand-in for `python -c <probe>`: prints `output` and exits with `code`."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho '{output}'\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_no_gpu_driver_means_no_gpus_and_no_torch_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(device.shutil, "which", lambda tool: None)
    monkeypatch.setattr(device, "Path", lambda p: Path("/nonexistent-kfd"))

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch was asked although no GPU driver is present")

    monkeypatch.setattr(layout.subprocess, "run", no_probe)
    assert layout._cuda_count() == 0


@pytest.mark.parametrize(("output", "code", "expected"), [("3", 0, 3), ("0", 0, 0), ("garbage", 0, 0),
                                                          ("2", 1, 0)])
def test_with_a_driver_torch_counts_in_a_child_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       output: str, code: int, expected: int) -> None:
    monkeypatch.setattr(device.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(layout.sys, "executable", _fake_python(tmp_path, output, code))
    seen: list[list[str]] = []
    real_run = subprocess.run

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        seen.append(cmd)
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(layout.subprocess, "run", run)
    assert layout._cuda_count() == expected
    assert "import torch" in seen[0][-1]  # the probe runs in the child, never here
