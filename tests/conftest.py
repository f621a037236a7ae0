"""Shared test set-up: offline, one torch thread, a per-session model cache, and the CLI runners.

`run_epo` runs an `epo` command inside the test process (most integration tests: same parsing, same
error handling as the console script, without ~10 s of imports per command); `run_cli` runs it in a
subprocess exactly as a user would (tests about the process itself: exit codes of the real console script,
signals, launchers). `small_config` holds the overrides every short integration run shares. The tiny
model's behaviour-cloning warm starts are built once per test session: `warm_start` (the shipped
1600-step preset, for tests that assert on success or learning) and `warm_start_short` (a few SFT steps:
a policy that answers in the response format, for tests that only need one that acts).

`make test` runs the suite in two pytest-xdist workers (`-n 2 --dist loadfile`: a file's tests stay on one
worker, so its module fixtures are built once). Session fixtures that cost minutes (the warm starts) are
built once for all workers (`build_once`), and `pytest_collection_modifyitems` orders the files so that
one worker starts building the warm start while the other runs files that do not need it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """../shared next to the checkout (tests read real ALFWorld games there; never copied into the repo)."""
    for candidate in (os.environ.get("EPO_SHARED_DIR"), REPO.parent / "shared", Path("/work/shared")):
        # a folder that really holds the shared material (an empty one may be left by an alfworld import)
        if candidate and (Path(candidate) / "alfworld" / "json_2.1.1").is_dir():
            return Path(candidate)
    return REPO.parent / "shared"


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands out whole files in the order pytest_collection_modifyitems leaves them (its default
    # reorders them by test count, which would start the warm-start files late and on both workers)
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False
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


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary folder of this test session that every xdist worker shares (a worker's own basetemp
    is a subfolder of it; without xdist it is the basetemp itself)."""
    base = tmp_path_factory.getbasetemp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # also seen by a pytest that a test starts: check the name
    return base.parent if worker and base.name == f"popen-{worker}" else base


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[], Path]) -> Path:
    """`build()` once per test session, also when xdist runs the session in several worker processes: the
    first worker to ask builds under a file lock and records the path; the others wait for it and reuse
    it. A failed build records nothing, so a later request fails on its own build."""
    root = session_root(tmp_path_factory)
    record = root / f"{name}.path"
    with FileLock(str(root / f"{name}.lock")):
        if record.exists():
            return Path(record.read_text())
        path = build()
        record.write_text(str(path))
        return path


#: the files that take minutes here (the rest take seconds), longest first: with two xdist workers, starting
#: the long files first lets the workers finish together (only the order changes, never what runs)
LONG_FILES = ("test_stop_and_resume.py", "test_distributed.py", "test_alfworld.py", "test_exp_entropy.py",
              "test_sweep.py", "test_train.py", "test_cli_errors.py", "test_overlap.py", "test_config.py")
#: the session fixtures that build a warm start (minutes of SFT)
WARM_START_FIXTURES = ("warm_start", "warm_start_short")


#: files that start vLLM inside the test process: they run after every other file, since vLLM's in-process engine
#: replaces torch.distributed's group of one that in-process `epo` runs share (a later run_epo on that worker
#: failed with "Group ... is not registered")
IN_PROCESS_VLLM_FILES = ("test_vllm_engine.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the files (each file's tests keep their order): one file that needs a warm start first, so
    that a worker starts building it at once; then the files that need none, while it builds; then the
    other files that need one; the IN_PROCESS_VLLM_FILES last. Within each group the LONG_FILES come first,
    longest first. Every xdist worker collects and orders the same way (the order is a function of the
    collected items only)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path.name, []).append(item)

    def needs_warm_start(name: str) -> bool:
        return any(f in item.fixturenames for item in files[name] for f in WARM_START_FIXTURES)

    def by_length(names: list[str]) -> list[str]:
        rank = {name: i for i, name in enumerate(LONG_FILES)}
        return sorted(names, key=lambda name: rank.get(name, len(LONG_FILES)))  # stable: the rest in order

    last = [name for name in IN_PROCESS_VLLM_FILES if name in files]
    warm = by_length([name for name in files if needs_warm_start(name) and name not in last])
    other = by_length([name for name in files if not needs_warm_start(name) and name not in last])
    order = warm[:1] + other + warm[1:] + last
    items[:] = [item for name in order for item in files[name]]


@pytest.fixture(scope="session")
def epo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache private to this test session, shared by its xdist workers (tiny tokenizers/models
    are built here once; epo_cli.models.tiny builds each under a file lock and renames it into place)."""
    path = Path(os.environ.get("EPO_TEST_CACHE") or session_root(tmp_path_factory) / "epo_cache")
    path.mkdir(parents=True, exist_ok=True)
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


@dataclass
class CliResult:
    """What `run_epo` returns: the fields of subprocess.CompletedProcess that tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


#: Python's own warning filters (what a fresh `epo` process starts with; pytest installs others)
PYTHON_DEFAULT_WARNING_FILTERS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                                  ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                                  ("ignore", ResourceWarning, None)]
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: the signals epo installs handlers for (epo_cli.training.stop) and the env pool's workers change
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def isolated_process_state(cwd: Path) -> Iterator[None]:
    """Run a command as if in a fresh process, then put back everything it may change process-wide.

    A command changes: the working directory, os.environ (the world-of-one RANK/MASTER_PORT variables
    init_distributed sets; they must not reach later tests' subprocesses, which would take them for a
    launcher's), torch's thread count, deterministic-algorithms flag, default dtype and RNGs, Python's and
    numpy's RNGs, signal handlers, warning filters and display (cli.main replaces warnings.showwarning),
    logging handlers (Hydra's multirun configures logging), Hydra's global state and sys.argv. The
    in-process torch.distributed group of one stays initialised on purpose: DeepSpeed cannot initialise a
    second one after it is destroyed, and init_distributed reuses an initialised group.
    """
    import numpy as np
    import torch
    from hydra.core.global_hydra import GlobalHydra

    saved_cwd, saved_env, saved_argv = os.getcwd(), dict(os.environ), list(sys.argv)
    saved_torch = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_default_dtype(),
                   torch.is_grad_enabled(), torch.get_rng_state())
    saved_rng = (random.getstate(), np.random.get_state())
    saved_signals = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                     if isinstance(lg, logging.Logger))]
    saved_logging = [(lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers]
    GlobalHydra.instance().clear()
    os.chdir(cwd)
    try:
        with warnings.catch_warnings():  # restores filters and showwarning; entering resets "once" registries
            warnings.resetwarnings()
            for action, category, module in reversed(PYTHON_DEFAULT_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv[:] = saved_argv
        threads, deterministic, warn_only, dtype, grad, torch_rng = saved_torch
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(torch_rng)
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        for lg, handlers, level, propagate, disabled in saved_logging:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        GlobalHydra.instance().clear()


def run_epo(args: list[str], cwd: Path, expect: int | None = 0) -> CliResult:
    """Run `epo ARGS` in this process through cli.main (the console script's entry point: same parsing,
    same one-line user errors and exit codes); an uncaught exception is printed as its traceback with exit
    code 1, as Python does. Assert the exit code if `expect` is set."""
    from epo_cli.cli import main

    out, err = io.StringIO(), io.StringIO()
    with isolated_process_state(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv[:] = ["epo", *args]
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 - a bug: reported like the interpreter reports it
            traceback.print_exc()
            code = 1
    # rich decides on colours when a console is made (cli.err_console: at import, perhaps on a terminal
    # under `pytest -s`); a subprocess writing into a pipe never colours, so neither does this result
    proc = CliResult(args, code, ANSI_ESCAPE.sub("", out.getvalue()), ANSI_ESCAPE.sub("", err.getvalue()))
    if expect is not None and code != expect:
        raise AssertionError(f"epo {' '.join(args)} (in-process) exited {code} (expected {expect})\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def one_error(proc: CliResult | subprocess.CompletedProcess, *texts: str) -> str:
    """The command's single `error:` line, which the output must accompany with each of `texts`; no
    traceback anywhere (the contract for every refusal of bad input)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for text in texts:
        assert text in proc.stderr, (text, proc.stderr[-3000:])
    return errors[0]


#: the bytes of a file outside every folder epo writes (`outside`): a test checks them unchanged afterwards
PRECIOUS = b"someone else's file: never written by epo\n"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside every folder epo writes, holding PRECIOUS, which a test checks byte for byte afterwards
    (a planted symlink points at it)."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(PRECIOUS)
    return path


@pytest.fixture
def lock_holder() -> Iterator[Callable[..., subprocess.Popen]]:
    """`lock_holder(folder, command="epo train")` starts a process that holds the folder's lock as a running
    epo command does (flock on <folder>/.epo.lock, its pid and command written in it); killed after the test."""
    procs = []

    def hold(folder: Path, command: str = "epo train") -> subprocess.Popen:
        code = ("import fcntl, os, sys, time; p = sys.argv[1]; os.makedirs(p, exist_ok=True); "
                "fd = os.open(os.path.join(p, '.epo.lock'), os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
                "os.write(fd, b'pid %d: ' % os.getpid() + sys.argv[2].encode()); print('held', flush=True); "
                "time.sleep(120)")
        proc = subprocess.Popen([sys.executable, "-c", code, str(folder), command], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def read_only_view(source: Path, view: Path) -> Iterator[Path]:
    """`source` seen at `view` (which must not exist) read-only: a read-only bind mount as root (root ignores
    permissions), else a copy whose permissions forbid writing, given back when the block ends. Skips the
    test where root may not mount."""
    if os.geteuid() != 0:
        shutil.copytree(source, view)
        for path in [view, *view.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield view
        finally:
            for path in [view, *view.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
        return
    view.mkdir()
    if subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True).returncode != 0 or \
            subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(view)], capture_output=True)
        pytest.skip("running as root without permission to mount: no way to make a read-only folder")
    try:
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


#: set by init_distributed for a world of one; they must not leak into later tests' subprocesses (which
#: would take them for a launcher's and join this process's store on its port)
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def world_of_one_env() -> Iterator[None]:
    """For a Trainer built in this process: DIST_ENV removed before the block, and what the block's world of
    one set in it replaced by what was there before."""
    saved = {key: os.environ.pop(key, None) for key in DIST_ENV}
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


@pytest.fixture(scope="module")
def in_process_world() -> Iterator[None]:
    """The trainers of a module share one in-process world of one (DeepSpeed cannot be initialised again after
    its group is destroyed); its environment variables are removed when the module ends (world_of_one_env)."""
    with world_of_one_env():
        yield


def only_run_dir(root: Path) -> Path:
    runs = [p for p in root.glob("*/*") if (p / "config.yaml").exists()]
    assert len(runs) == 1, f"expected one run under {root}, found {runs}"
    return runs[0]


def metrics_rows(run: Path) -> list[dict]:
    """The rows of `run`'s metrics.jsonl, read by epo's own reader (epo_cli.loggers.jsonl.read_metrics); a line
    it would skip (truncated, not a row) fails the test instead of a warning."""
    from epo_cli.loggers.jsonl import read_metrics

    assert (Path(run) / "metrics.jsonl").is_file(), f"{run} has no metrics.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return read_metrics(run)


def merge_overrides(base: list[str], extra: tuple[str, ...]) -> list[str]:
    """`base` with `extra` on top: an override in `extra` replaces the one for the same key in `base`."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(extra)


@dataclass(frozen=True)
class SmallConfig:
    """The overrides short integration runs share, so that test files do not each keep a copy.

    run: the easiest household level (the one the warm starts are trained on), compact prompts, 8 turns,
         no evaluation splits, no TensorBoard. rl: + 2 tasks x 4 rollouts per iteration in one mini-batch,
         no periodic evaluation, a checkpoint every 2 steps. sft: + 2 steps of behaviour cloning on 2 expert
         demonstrations, with short responses. Each takes further overrides, which replace a shared one
         for the same key.
    """

    base: tuple[str, ...] = ("env.level=tiny_open_pick_place", "env.prompt_template=compact", "env.max_turns=8",
                             "env.eval_splits=[]", "logger.tensorboard=false")
    rl_shape: tuple[str, ...] = ("algo.tasks_per_step=2", "algo.group_size=4", "algo.mini_batch_size=512",
                                 "algo.micro_batch_size=16", "trainer.eval_every=0", "trainer.save_every=2")
    sft_shape: tuple[str, ...] = ("algo=sft", "trainer.total_steps=2", "algo.demo_episodes=2",
                                  "rollout.max_new_tokens=16")

    def run(self, *extra: str) -> list[str]:
        return merge_overrides(list(self.base), extra)

    def rl(self, *extra: str) -> list[str]:
        return merge_overrides([*self.base, *self.rl_shape], extra)

    def sft(self, *extra: str) -> list[str]:
        return merge_overrides([*self.sft_shape, *self.base], extra)


@pytest.fixture(scope="session")
def small_config() -> SmallConfig:
    return SmallConfig()


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory: pytest.TempPathFactory, epo_cache: Path) -> Path:
    """A 1-step SFT run: a complete ZeRO-0 checkpoint (step_1/mp_rank_00_model_states.pt), final/ and metrics.
    Shared by the session: a test copies it before changing anything."""
    root = tmp_path_factory.mktemp("saved_run")
    run_epo(["train", *SmallConfig().sft("trainer.total_steps=1", "trainer.save_every=1"),
             f"run_dir={root / 'run'}"], cwd=root)
    return root / "run"


#: the warm start of the RL integration tests that assert on success or learning (and of the resume and
#: rank-equality tests): the shipped preset, as `make demo` runs it
WARM_START_ARGS = ["experiment=warm_start", "trainer.eval_episodes=16", "logger.tensorboard=false"]
#: the warm start of tests that only need a policy that acts: the same preset cut to 300 SFT steps on fewer
#: demonstrations (its answers parse; invalid_rate 0 on 16 evaluation episodes, success 0)
WARM_START_SHORT_ARGS = [*WARM_START_ARGS, "trainer.total_steps=300", "algo.demo_episodes=64",
                         "trainer.eval_episodes=4"]


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

    def build() -> Path:
        out = tmp_path_factory.mktemp("warm_start")
        run_epo(["train", *WARM_START_ARGS, f"output_dir={out}", "name=warm"], cwd=out)
        return only_run_dir(out)

    return build_once(tmp_path_factory, "warm_start", build)


@pytest.fixture(scope="session")
def warm_start_short(request: pytest.FixtureRequest, epo_cache: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run directory (<run>/final) of a policy that acts: it answers in the response format, which is all
    the tests that use it need (they never assert on success). That is the full warm start where this
    session has one anyway (a test of it requests `warm_start`, or EPO_TEST_WARM_START names one): building
    a second policy would only add time. Otherwise a few SFT steps of the preset (WARM_START_SHORT_ARGS;
    it does not win yet, so its episodes run to the turn limit); EPO_TEST_WARM_START_SHORT=<run dir>
    reuses one built earlier."""
    reuse = os.environ.get("EPO_TEST_WARM_START_SHORT")
    if reuse:
        assert (Path(reuse) / "final").is_dir(), f"EPO_TEST_WARM_START_SHORT={reuse} holds no final/ policy"
        return Path(reuse)
    if os.environ.get("EPO_TEST_WARM_START") or any("warm_start" in getattr(item, "fixturenames", ())
                                                    for item in request.session.items):
        return request.getfixturevalue("warm_start")

    def build() -> Path:
        out = tmp_path_factory.mktemp("warm_start_short")
        run_epo(["train", *WARM_START_SHORT_ARGS, f"output_dir={out}", "name=warm_short"], cwd=out)
        return only_run_dir(out)

    return build_once(tmp_path_factory, "warm_start_short", build)


@pytest.fixture(scope="session")
def tiny_folder(epo_cache: Path) -> Path:
    """The default tiny model + tokenizer for household, built once (HF folder)."""
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.tiny import build_tiny

    cfg = compose([])
    return build_tiny(cfg.model, make_suite(cfg.env))


# ---- the system temp directory: tests leave nothing there ---------------------------------------------------

#: what libraries keep in the temp directory on purpose, not files a test forgot: torch's compile cache folder
#: (created when torch's compiler modules load), multiprocessing's per-process folder (removed at exit)
TEMP_DIR_CACHES = ("torchinductor_", "pymp-")


@pytest.fixture(scope="session", autouse=True)
def private_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This process's system temp directory (tempfile.gettempdir(), TMPDIR for the subprocesses tests start)
    is a folder of the test session, one per xdist worker: whatever a test leaves there is found by
    `leaves_no_temp_files` (the machine's /tmp is shared with everything else and cannot be watched
    reliably), and pytest removes old sessions' folders."""
    folder = session_root(tmp_path_factory) / f"system_tmp-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    folder.mkdir(parents=True, exist_ok=True)
    saved = (os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), str(folder)
    yield folder
    tempfile.tempdir = saved[1]
    os.environ.pop("TMPDIR") if saved[0] is None else os.environ.update(TMPDIR=saved[0])


@pytest.fixture(scope="module", autouse=True)
def leaves_no_temp_files(request: pytest.FixtureRequest, private_temp_dir: Path) -> Iterator[None]:
    """A test module's tests (and the scripts and processes they start) must write under their own tmp_path,
    never into the system temp directory: anything new there once the module's fixtures are torn down (a
    module-scoped env pool keeps its workers' folders until then) is an error of the module's last test,
    and is removed so the next module is not blamed for it."""
    before = set(os.listdir(private_temp_dir))
    yield
    left = sorted(name for name in set(os.listdir(private_temp_dir)) - before
                  if not name.startswith(TEMP_DIR_CACHES))
    for name in left:
        path = private_temp_dir / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if left:
        pytest.fail(f"the tests of {request.module.__name__} left {left} in the system temp directory; write "
                    "under tmp_path instead", pytrace=False)
