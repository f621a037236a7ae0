"""One rank of a distributed run.

    python -m epo_cli.launch.rank --run-dir outputs/<date>/<time>-<name>

`epo train launcher=deepspeed ...` (epo_cli.launch.deepspeed) composes and validates the config once,
writes <run>/config.yaml, and starts this module on every rank through the deepspeed launcher, which sets
RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Under `launcher=slurm` every SLURM task calls
epo_cli.launch.slurm.SlurmRank instead, which derives the same variables from the SLURM allocation and
calls `run_rank`. Either way all ranks read
the same config.yaml, so they agree on what runs; rank 0 alone logs and writes the run's files.

A rank that fails records why in <run>/ranks/rank<r>.error (JSON) before it exits non-zero: the launcher
then stops the other ranks, and the process that started the job prints that record as the reason. A rank 0
that cannot listen on the master port (another process holds it) records that (`port_taken`) and prints
nothing: `epo train` then starts the ranks again on a new port, or says which port to set.

The rank's run lifecycle (stop handler, status.json, exit code) is epo_cli.launch.lifecycle's, as under
launcher=local; failures are reported by the process that started the ranks.

Test hook (documented because it is read here and nowhere else): EPO_TEST_KILL_RANK="<rank>:<step>" makes
rank <rank> exit abruptly (os._exit(17), no error record, like a crash or an OOM kill) when it starts to
save the checkpoint of step <step>; "<rank>:<step>:hang" makes it sleep there instead (a hung rank). It is a
hook of checkpoint.save's fault-injection seam (`checkpoint.SAVE_HOOKS`). tests/test_distributed.py uses it
to check that a dead or hung rank ends the whole job.
"""

from __future__ import annotations

import os

# Before torch is imported: the deepspeed launcher does not limit OpenMP threads, and N ranks x all cores
# threads make CPU steps several times slower (GPU ranks need few CPU threads too).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch.distributed as torch_dist  # noqa: E402
from rich.markup import escape  # noqa: E402

from epo_cli.analysis.run_summary import print_summary  # noqa: E402
from epo_cli.compose import load_run_config  # noqa: E402
from epo_cli.errors import UserError, err_console  # noqa: E402
from epo_cli.launch.libraries import quiet_libraries  # noqa: E402
from epo_cli.launch.lifecycle import run_training  # noqa: E402
from epo_cli.rundir import trust  # noqa: E402
from epo_cli.rundir.writable import write_file  # noqa: E402
from epo_cli.runtime.deepspeed_config import port_taken  # noqa: E402
from epo_cli.training import checkpoint  # noqa: E402
from epo_cli.training.stop import Interrupted  # noqa: E402
from epo_cli.training.trainer import Trainer  # noqa: E402

KILL_HOOK_ENV = "EPO_TEST_KILL_RANK"


def rank_error_file(run: Path, rank: int) -> Path:
    return Path(run) / "ranks" / f"rank{rank}.error"


def is_timeout(err: BaseException) -> bool:
    """A collective that gave up waiting for another rank (gloo / NCCL / c10d wording)."""
    text = f"{type(err).__name__}: {err}".lower()
    return "timed out" in text or "timeout" in text or "dist_backend_error" in text


def lost_peer(err: BaseException) -> bool:
    """A collective that failed because another rank's connection went away (that rank died)."""
    text = str(err).lower()
    return any(s in text for s in ("connection reset by peer", "connection closed by peer", "broken pipe",
                                   "connection refused"))


def master_port_taken(err: BaseException) -> bool:
    """Rank 0 could not listen on the master port: another process holds it (before anything started)."""
    return port_taken(f"{type(err).__name__}: {err}")


def describe_failure(err: BaseException, timeout_s: float | None) -> str:
    """One readable line for the console: why this rank stopped."""
    first = str(err).splitlines()[0] if str(err) else ""
    if isinstance(err, UserError):
        return str(err)
    if master_port_taken(err):
        return (f"could not listen on the master port {os.environ.get('MASTER_PORT', '?')}: another process holds "
                f"it ({type(err).__name__}: EADDRINUSE)")
    if is_timeout(err):
        return (f"a collective operation waited longer than launcher.timeout_s={timeout_s:g}s for the other "
                f"ranks: another rank is hung or has died ({type(err).__name__}: {first})")
    if lost_peer(err):
        return f"lost the connection to another rank, which has probably died ({type(err).__name__}: {first})"
    return f"{type(err).__name__}: {first}"


def record_failure(run: Path, rank: int, err: BaseException, timeout_s: float | None) -> None:
    """Write this rank's failure record (never raises: the original error matters more)."""
    try:
        path = rank_error_file(run, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "rank": rank,
            "type": type(err).__name__,
            "message": describe_failure(err, timeout_s),
            "timeout": is_timeout(err),
            # a consequence of another rank's failure, not a cause: the launcher reports the cause first
            "peer": is_timeout(err) or lost_peer(err),
            "user_error": isinstance(err, UserError),
            "port_taken": master_port_taken(err),  # the launcher starts the ranks again on a new port
            "time": time.time(),
            "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-8000:],
        }
        write_file(path, json.dumps(payload, indent=1))
    except Exception:  # noqa: BLE001 - best effort
        pass


def install_test_hook(rank: int) -> None:
    """EPO_TEST_KILL_RANK="<rank>:<step>[:hang]": see the module docstring."""
    spec = os.environ.get(KILL_HOOK_ENV, "")
    if not spec:
        return
    parts = spec.split(":")
    target_rank, target_step = int(parts[0]), int(parts[1])
    hang = len(parts) > 2 and parts[2] == "hang"
    if rank != target_rank:
        return

    def die_or_hang(run: Path, step: int) -> None:
        if step == target_step:
            print(f"[{KILL_HOOK_ENV}] rank {rank} {'hangs' if hang else 'dies'} while saving step {step}",
                  file=sys.stderr, flush=True)
            if hang:
                while True:
                    time.sleep(60)
            os._exit(17)

    checkpoint.SAVE_HOOKS.append(die_or_hang)


def run_rank(run: Path, resume_latest: bool = False, command_line: dict[str, Any] | None = None) -> int:
    """Train this rank of the run in `run`; returns the process exit code. `resume_latest`: continue from
    the run's latest complete checkpoint if it has one (a requeued SLURM job). `command_line`: the launching
    invocation's values of the settings that can start code (epo_cli.rundir.trust: config.yaml cannot set them)."""
    quiet_libraries()
    run = Path(run).resolve()
    rank = int(os.environ.get("RANK", "0"))
    timeout_s: float | None = None
    try:
        cfg = load_run_config(run, command_line=command_line or {})
        cfg.run_dir = str(run)  # absolute: every rank (and node) names the same folder
        if resume_latest:
            cfg.trainer.resume = "auto"
        timeout_s = float(cfg.launcher.timeout_s)
        install_test_hook(rank)
        # every rank: a signal or the launcher's relay stops all ranks after the same step
        ending = run_training(lambda: run, lambda run: Trainer(cfg, run), is_main=rank == 0, reports_failure=False)
    except BaseException as err:  # noqa: BLE001 - every way out of a rank is recorded
        if isinstance(err, Interrupted):  # a second signal: the step in progress is abandoned (status.json)
            return err.exit_code
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        record_failure(run, rank, err, timeout_s)
        if master_port_taken(err):  # the process that started the ranks reports it, or starts them again
            return 1
        if isinstance(err, UserError) or is_timeout(err) or lost_peer(err):  # one line; bugs keep a traceback
            message = escape(describe_failure(err, timeout_s))
            err_console.print(f"[bold red]error (rank {rank}):[/] {message}", soft_wrap=True)
            return err.exit_code if isinstance(err, UserError) else 1
        traceback.print_exc()
        return 1
    finally:
        _leave_process_group()
    if ending.stop_signal:
        return ending.exit_code  # stopped with a checkpoint; the launching process reports it
    if rank == 0:
        print_summary(cfg, run, ending.metrics)
    sys.stdout.flush()
    return 0


def _leave_process_group() -> None:
    try:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m epo_cli.launch.rank", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    parser.add_argument("--command-line-settings", default=None,
                        help="JSON: the launching command line's values of the settings that can start code "
                             "(epo_cli.rundir.trust; config.yaml cannot set them)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # older launchers
    args = parser.parse_args(argv)
    sys.exit(run_rank(Path(args.run_dir), command_line=trust.decode(args.command_line_settings)))


if __name__ == "__main__":
    main()
