"""Start the ranks of a run with the deepspeed launcher (one or more nodes) and wait for them.

    epo train algo=grpo launcher=deepspeed launcher.num_gpus=8 deepspeed=zero3          one node, 8 GPUs
    epo train ... launcher=deepspeed launcher.num_gpus=8 launcher.num_nodes=2 launcher.hostfile=hosts
    epo train ... launcher=deepspeed launcher.num_procs=2                      2 CPU ranks (no GPU here)

The config was composed and validated once by the `epo train` command. Here the batch layout is checked
against the world size (epo_cli.launch.layout: a bad layout is one message, not one traceback per rank),
the run directory and its config.yaml are written, and the ranks start
`python -m epo_cli.launch.rank --run-dir RUN`. Every rank reads that config.yaml. When the job fails, this
process prints why (from the ranks' records in <run>/ranks/) and where the last complete checkpoint is, and
exits non-zero. SLURM jobs start in epo_cli.launch.slurm.

On a single node the master port is one that is free when this process picks it, and rank 0 listens on it
seconds later: another process can take it in between. Rank 0 then records that the port was taken (before
anything is trained or written), and the ranks start again on a new free port, PORT_ATTEMPTS times at most.
A port the user chose (launcher.master_port), or the fixed one of a multi-node job, is not changed: that
failure is one message naming launcher.master_port.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from epo_cli.errors import Stopped, UserError
from epo_cli.launch.layout import Layout, check_resume, check_world, clear_rank_records, layout_for
from epo_cli.launch.lifecycle import latest_step, record_status, record_stopped, stopped_message
from epo_cli.launch.setup import prepare_run_dir
from epo_cli.rundir import trust
from epo_cli.rundir.checkpoint_paths import latest_tag
from epo_cli.rundir.folder import read_status
from epo_cli.rundir.received import ReceivedFileError, read_json
from epo_cli.runtime.deepspeed_config import PORT_ATTEMPTS, free_port
from epo_cli.training.stop import STOP, Interrupted, exit_code, write_relay

#: launcher.master_port=0 picks a free port on a single node; multi-node jobs need a fixed one
DEFAULT_MASTER_PORT = 29500
#: how many times the ranks start, each on a new free port, when another process took the one picked
def master_port(cfg: DictConfig, layout: Layout) -> int:
    """launcher.master_port; unset (0), the multi-node default, or on one node a port that is free now."""
    lc = cfg.launcher
    return int(lc.master_port) or (DEFAULT_MASTER_PORT if layout.num_nodes > 1 or lc.hostfile else free_port())


def port_picked_here(cfg: DictConfig, layout: Layout) -> bool:
    """The master port is a free one this process picked (not the user's, nor the multi-node default), so a
    port taken before rank 0 listened on it can be replaced by another."""
    return not cfg.launcher.master_port and layout.num_nodes == 1 and not cfg.launcher.hostfile


def rank_environment(layout: Layout, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the launcher and its ranks."""
    env = dict(os.environ if base is None else base)
    if not layout.gpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator: gloo, no CUDA probing
    else:
        env.setdefault("DS_ACCELERATOR", "cuda")
    # The deepspeed launcher leaves OpenMP at all cores per rank: N ranks oversubscribe the CPU.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // layout.ranks_per_node)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def deepspeed_command(cfg: DictConfig, run: Path, layout: Layout, port: int | None = None) -> list[str]:
    """`python -m deepspeed.launcher.runner ... --module epo_cli.launch.rank --run-dir RUN` (= `deepspeed`),
    its master port `port` (default: `master_port`)."""
    lc = cfg.launcher
    port = master_port(cfg, layout) if port is None else port
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner",
           "--num_nodes", str(layout.num_nodes), "--num_gpus", str(layout.ranks_per_node),
           "--master_port", str(port), "--no_local_rank", "--log_level", "warning"]
    if lc.hostfile:
        cmd += ["--hostfile", str(Path(lc.hostfile).expanduser().resolve())]
        if lc.master_addr not in ("127.0.0.1", "localhost", ""):  # else: the first host (ssh hostname -I)
            cmd += ["--master_addr", lc.master_addr]
    cmd += ["--module", "epo_cli.launch.rank", "--run-dir", str(run.resolve())]
    # settings that can start code come from this command line: the ranks' config.yaml cannot set them
    cmd += ["--command-line-settings", trust.encode(trust.command_line_values(cfg))]
    return cmd


def launch_ranks(cfg: DictConfig, overrides: list[str]) -> None:
    """`epo train launcher=deepspeed ...`: start the ranks of this run and wait for them."""
    layout = layout_for(cfg)
    check_world(cfg, layout)
    check_resume(cfg, layout)  # before prepare_run_dir rewrites the run's config.yaml
    run = prepare_run_dir(cfg, overrides).resolve()
    kind = f"{layout.ranks_per_node} GPU(s)" if layout.gpu else f"{layout.ranks_per_node} CPU rank(s) (gloo)"
    print(f"launching {layout.world_size} ranks: {layout.num_nodes} node(s) x {kind}, run directory {run}",
          file=sys.stderr, flush=True)
    checkpoint_before = latest_tag(run)  # a resumed run's; a newer one means the ranks got past start-up
    ports: list[int] = []
    while True:
        clear_rank_records(run)
        record_status(run, "running")  # not an earlier attempt's `stopped`/`failed`, whatever happens next
        ports.append(master_port(cfg, layout))
        code = _run_ranks(deepspeed_command(cfg, run, layout, ports[-1]), layout, run, ports[-1])
        taken = code != 0 and master_port_was_taken(run) and latest_tag(run) == checkpoint_before
        again = taken and port_picked_here(cfg, layout) and len(ports) < PORT_ATTEMPTS
        if not again or STOP.signum is not None:  # a stop signal during the attempt is the user's answer
            break
        print(f"the master port {ports[-1]} was taken by another process before rank 0 listened on it (nothing "
              f"had started): starting the ranks again on a new free port (attempt {len(ports) + 1} of "
              f"{PORT_ATTEMPTS})", file=sys.stderr, flush=True)
    if taken:
        message = port_taken_message(cfg, layout, ports)
        record_status(run, "failed", error=message, exit_code=1)  # what `epo train` exits with (the ranks: killed)
        raise UserError(message)
    status = read_status(run)
    if status.get("status") == "stopped" and status.get("signal"):  # every rank stopped after one step
        signum = int(getattr(signal, str(status["signal"]), signal.SIGTERM))
        raise Stopped(stopped_message(run, signum, int(status.get("step") or 0)), exit_code(signum))
    if code != 0:
        message = failure_message(run, code, layout.world_size)
        record_status(run, "failed", error=message, exit_code=code)
        raise UserError(message, exit_code=code if 0 < code < 126 else 1)


#: where DeepSpeed's CPU allreduce keeps its POSIX shared-memory buffers (shm_open: a tmpfs, i.e. RAM)
SHM_DIR = Path("/dev/shm")


def remove_allreduce_buffers(port: int) -> None:
    """Remove the shared-memory buffers of the ranks that used master port `port`.

    With every rank on one node, DeepSpeed's CPU allreduce maps one ~69 MB buffer per rank,
    deepspeed_allreduce_buffer_<uid>_<master addr>_<port>_<rank>, and never unlinks it (its shm.cpp
    unlinks only on a failed create): each 2-rank run left ~140 MB of RAM behind until reboot, and a day
    of tests filled a 24 GB machine's /dev/shm. Only this attempt's port is matched: another job's live
    buffers stay."""
    for path in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        path.unlink(missing_ok=True)


def run_cpu_world(script: list[str], ranks: int, env: dict[str, str], log_level: str = "error",
                  **run_options: Any) -> subprocess.CompletedProcess:
    """`script` (a Python file and its arguments) as `ranks` CPU ranks of one world, started by DeepSpeed's
    launcher on a free master port, its allreduce buffers removed afterwards: for the benchmarks and the
    distributed tests' harness, whose ranks run their own code. subprocess.run's result (run_options go to it)."""
    port = free_port()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
           "--master_port", str(port), "--no_local_rank", "--log_level", log_level, *script]
    try:
        return subprocess.run(cmd, env={**env, "DS_ACCELERATOR": "cpu"}, **run_options)
    finally:
        remove_allreduce_buffers(port)


def _run_ranks(cmd: list[str], layout: Layout, run: Path, port: int | None = None) -> int:
    """Run the deepspeed launcher and its ranks in their own session, so that a terminal's Ctrl-C (or a
    SIGTERM to `epo train`) reaches this process only: the first signal is relayed to every rank through
    <run>/ranks/stop.json (the deepspeed launcher would kill the ranks mid-step); a second one kills the
    whole session at once.

    The ranks' temp files go to a folder of their own, removed once they are gone: DeepSpeed probes its ops
    at start-up by compiling in mkdtemp() folders, and a rank killed meanwhile (a taken port, a second
    signal, a dead rank's job) would leave them in the system temp directory. The allreduce buffers of
    master port `port` go too (remove_allreduce_buffers)."""
    scratch = tempfile.mkdtemp(prefix="epo-ranks-")
    try:
        proc = subprocess.Popen(cmd, env={**rank_environment(layout), "TMPDIR": scratch}, start_new_session=True)
        return _wait_for_ranks(proc, run)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if port is not None:
            remove_allreduce_buffers(port)


def _wait_for_ranks(proc: subprocess.Popen, run: Path) -> int:
    """Wait for the deepspeed launcher `proc`, relaying a stop signal and ending an attempt whose port was
    taken; its exit code."""

    def kill_now(signum: int) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass

    STOP.on_second = kill_now
    STOP.install("asking every rank to stop after the current step with a checkpoint")
    relayed = False
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if STOP.signum is not None and not relayed:
                    write_relay(run, STOP.signum)
                    relayed = True
                if master_port_was_taken(run):
                    # nothing has started: end the other ranks now, not after the deepspeed launcher's
                    # 30 s grace for a rank that is still waiting to connect to the master port
                    kill_now(0)
                    return proc.wait()
    except (KeyboardInterrupt, Interrupted) as err:
        kill_now(0)
        proc.wait()
        signum = err.signum if isinstance(err, Interrupted) else int(signal.SIGINT)
        record_stopped(run, signum, latest_step(run), abandoned="a second signal killed the ranks during a step")
        raise
    finally:
        STOP.uninstall()
        STOP.on_second = None


def read_rank_records(run: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted((Path(run) / "ranks").glob("rank*.error")):
        try:
            records.append(read_json(path, "sweep record", within=Path(run)))
        except (OSError, ReceivedFileError):
            continue  # half written, or not a record epo wrote: the launcher reports what it has
    records = [r for r in records if isinstance(r, dict) and isinstance(r.get("time", 0.0), (int, float))]
    return sorted(records, key=lambda r: r.get("time", 0.0))


def master_port_was_taken(run: Path) -> bool:
    """Whether rank 0 could not listen on the master port (its failure record says so: epo_cli.launch.rank)."""
    return any(r.get("port_taken") for r in read_rank_records(run))


def port_taken_message(cfg: DictConfig, layout: Layout, ports: list[int]) -> str:
    """Why the ranks did not start when another process held the master port, and what to set."""
    if port_picked_here(cfg, layout):  # PORT_ATTEMPTS free ports, each taken before rank 0 listened on it
        return (f"The master port was taken by another process before rank 0 listened on it, {len(ports)} times "
                f"(free ports picked: {', '.join(map(str, ports))}); nothing was trained. Set "
                "launcher.master_port=<a port no other process uses> and run again.")
    if cfg.launcher.master_port:
        what = f"launcher.master_port={ports[-1]} is taken by another process"
    else:
        what = f"The master port {ports[-1]} (the multi-node default for launcher.master_port=0) is taken"
    fix = " on the first node" if layout.num_nodes > 1 or cfg.launcher.hostfile else ", or 0 to have one picked"
    return (f"{what}: rank 0 cannot listen on it; nothing was trained. Set launcher.master_port=<a port no other "
            f"process uses>{fix}.")


def failure_message(run: Path, code: int, world_size: int) -> str:
    """Why the job ended, from the ranks' records: the cause first (a crash beats the timeouts and lost
    connections it causes on the other ranks), then where to resume from."""
    records = read_rank_records(run)
    causes = [r for r in records if not r.get("peer", r.get("timeout"))]
    silent = sorted(set(range(world_size)) - {int(r["rank"]) for r in records})
    silent_text = f"rank {silent[0]}" if len(silent) == 1 else (f"ranks {silent}" if silent else "a rank")
    if causes and causes[0].get("user_error"):  # the rank's message already says what to fix
        return f"rank {causes[0]['rank']}: {causes[0]['message']}"
    if causes:
        first = causes[0]
        why = f"rank {first['rank']} failed: {first['message'].rstrip('.')}"
    elif records and all(r.get("timeout") for r in records):
        waiting = ", ".join(str(r["rank"]) for r in records)
        why = (f"rank(s) {waiting} waited longer than launcher.timeout_s for {silent_text}, which is hung (a "
               "deadlock, a stuck environment) or was killed without an error")
    else:
        # the launcher's code is that of the first failed rank its poll found, which may be a rank that
        # lost the connection to this one a moment later: it is named as the launcher's, not this rank's
        why = (f"{silent_text} ended without a Python error (a crash, a kill signal or running out of memory; "
               f"the launcher exited with code {code}{_signal_note(code)}, the first failed rank's it saw)")
        if records:
            why += f"; rank(s) {', '.join(str(r['rank']) for r in records)} then lost the connection to it"
    latest = latest_tag(run)
    resume = (f"The last complete checkpoint is {run / 'checkpoints' / latest}; continue with: "
              f"epo train trainer.resume={run}" if latest else "No checkpoint was completed.")
    return (f"Distributed training failed: {why}. The launcher stopped the other ranks (exit code {code}).\n"
            f"{resume}\nRank error records (with tracebacks): {run / 'ranks'}; rank output is above.")


def _signal_note(code: int) -> str:
    """' (SIGKILL: e.g. out of memory)' for exit codes that encode a signal: 128+N from a shell, -N from
    Popen, 256-N when the deepspeed launcher passes a rank's -N on through sys.exit."""
    signum = -code if code < 0 else code - 128 if 128 < code <= 192 else 256 - code if code > 192 else 0
    if signum <= 0:
        return ""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return ""
    return f" ({name}: e.g. out of memory)" if signum == signal.SIGKILL else f" ({name})"
