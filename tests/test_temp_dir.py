"""Tests leave nothing in the system temp directory: conftest gives each test process a private one and fails a
test that leaves files there (tests/conftest.py: private_temp_dir, leaves_no_temp_files)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CONFTEST = Path(__file__).resolve().parent / "conftest.py"


def test_the_temp_dir_is_the_sessions_own(private_temp_dir: Path) -> None:
    assert Path(tempfile.gettempdir()) == private_temp_dir == Path(os.environ["TMPDIR"])
    assert "system_tmp" in private_temp_dir.name


def test_a_test_that_leaves_a_temp_folder_fails(tmp_path: Path) -> None:
    """A module with one test that leaves a mkdtemp() folder behind and one that cleans up: the module's last
    test errors at teardown naming the module and the folder (pytest counts its call as passed); nothing
    stays behind."""
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "test_leaky.py").write_text(
        "import tempfile, shutil\n"
        "def test_leaves_a_folder():\n    tempfile.mkdtemp(prefix='bench_iteration_leak_')\n"
        "def test_cleans_up():\n    shutil.rmtree(tempfile.mkdtemp(prefix='tidy_'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_leaky.py",
                           f"--basetemp={tmp_path / 'basetemp'}"], cwd=suite, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 passed, 1 error" in out and "bench_iteration_leak_" in out and "write under tmp_path" in out, out
    assert "the tests of test_leaky left" in out, out
    leftovers = [p.name for p in (tmp_path / "basetemp").glob("system_tmp-*/*")]
    assert not [n for n in leftovers if not n.startswith(("torchinductor_", "pymp-"))], leftovers
