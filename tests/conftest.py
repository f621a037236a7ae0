"""Shared test set-up: offline, one torch thread, a per-session model cache, and the CLI runner.

The tiny model and its behaviour-cloning warm start are built once per test session (`warm_start`),
through the real CLI, and reused by every integration test that needs a policy that can act.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """../shared next to the checkout (tests read real ALFWorld games there; never copied into the repo)."""
    for candidate in (os.environ.get("EPO_SHARED_DIR"), REPO.parent / "shared", Path("/work/shared")):
        # a folder that really holds the shared material (an empty one may be left by an alfworld import)
        if candidate and (Path(candidate) / "alfworld" / "json_2.1.1").is_dir():
            return Path(candidate)
    return REPO.parent / "shared"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    alfworld = shared_dir() / "alfworld"
    if alfworld.is_dir():
        os.environ.setdefault("ALFWORLD_DATA", str(alfworld))
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


@pytest.fixture(scope="session")
def epo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache private to this test session (tiny tokenizers/models are built here, once)."""
    path = Path(os.environ.get("EPO_TEST_CACHE") or tmp_path_factory.mktemp("epo_cache"))
    os.environ["EPO_CACHE"] = str(path)
    return path


def terminal_signal_dispositions() -> None:
    """preexec_fn: SIGINT and SIGTERM as a process started from a terminal has them.

    A shell without job control starts background commands with SIGINT ignored, and an ignored signal
    stays ignored across exec (Python then installs no KeyboardInterrupt handler), so a test that sends
    a signal to a child must not depend on how the suite itself was started.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def run_cli(args: list[str], cwd: Path, timeout: float = 900, expect: int | None = 0) -> subprocess.CompletedProcess:
    """Run `epo ARGS` in a subprocess exactly as a user would; assert the exit code if `expect` is set."""
    proc = subprocess.run([sys.executable, "-m", "epo_cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())
    if expect is not None and proc.returncode != expect:
        raise AssertionError(f"epo {' '.join(args)} exited {proc.returncode} (expected {expect})\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def only_run_dir(root: Path) -> Path:
    runs = [p for p in root.glob("*/*") if (p / "config.yaml").exists()]
    assert len(runs) == 1, f"expected one run under {root}, found {runs}"
    return runs[0]


#: the warm start every RL integration test starts from: the shipped preset (as `make demo` runs it)
WARM_START_ARGS = ["experiment=warm_start", "trainer.eval_episodes=16", "logger.tensorboard=false"]


@pytest.fixture(scope="session")
def warm_start(epo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run directory of a behaviour-cloned tiny policy (its HF export is <run>/final).

    EPO_TEST_WARM_START=<run dir> reuses one built earlier by WARM_START_ARGS (for iterating on a single
    test; the run is only read).
    """
    reuse = os.environ.get("EPO_TEST_WARM_START")
    if reuse:
        assert (Path(reuse) / "final").is_dir(), f"EPO_TEST_WARM_START={reuse} holds no final/ policy"
        return Path(reuse)
    out = tmp_path_factory.mktemp("warm_start")
    run_cli(["train", *WARM_START_ARGS, f"output_dir={out}", "name=warm"], cwd=out)
    return only_run_dir(out)


@pytest.fixture(scope="session")
def tiny_folder(epo_cache: Path) -> Path:
    """The default tiny model + tokenizer for household, built once (HF folder)."""
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.tiny import build_tiny

    cfg = compose([])
    return build_tiny(cfg.model, make_suite(cfg.env))
