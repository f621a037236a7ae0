"""Start the ranks of a distributed run: the deepspeed launcher (one or more nodes) or SLURM (submitit).

    epo train algo=grpo launcher=deepspeed launcher.num_gpus=8 deepspeed=zero3          one node, 8 GPUs
    epo train ... launcher=deepspeed launcher.num_gpus=8 launcher.num_nodes=2 launcher.hostfile=hosts
    epo train ... launcher=deepspeed launcher.num_procs=2                      2 CPU ranks (no GPU here)
    epo train ... launcher=slurm launcher.num_nodes=2 launcher.num_gpus=8 launcher.partition=gpu

The config was composed and validated once by epo_cli.launch.launch_training. Here the batch layout is
checked against the world size (so a bad layout is one message, not one traceback per rank), the run
directory and its config.yaml are written, and the ranks start `python -m epo_cli.worker --run-dir RUN`.
Every rank reads that config.yaml. When the job fails, this process prints why (from the ranks' records in
<run>/ranks/) and where the last complete checkpoint is, and exits non-zero.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from epo_cli.errors import ConfigError, Stopped, UserError
from epo_cli.run_dir import read_status, write_status

#: launcher.master_port=0 picks a free port on a single node; multi-node jobs need a fixed one
DEFAULT_MASTER_PORT = 29500


@dataclass
class Layout:
    """Where the ranks run: `ranks_per_node` processes on each of `num_nodes` nodes."""

    ranks_per_node: int
    num_nodes: int
    gpu: bool

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.num_nodes


# ---- layout and checks made once, before any rank starts --------------------------------------------------

def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def hostfile_hosts(path: str) -> list[tuple[str, int]]:
    """(host, slots) per line of a deepspeed hostfile ('worker-1 slots=8'; '#' starts a comment)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"launcher.hostfile='{path}' does not exist. Write one line per node, e.g.\n"
                        "  node-1 slots=8\n  node-2 slots=8\n"
                        "(the nodes reach each other by passwordless ssh).")
    hosts = []
    for line in file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = next((int(p.split("=", 1)[1]) for p in parts[1:] if p.startswith("slots=")), None)
        if slots is None:
            raise UserError(f"launcher.hostfile '{path}': line '{line}' has no 'slots=N' "
                            "(the number of GPUs on that node).")
        hosts.append((parts[0], slots))
    if not hosts:
        raise UserError(f"launcher.hostfile '{path}' lists no nodes.")
    return hosts


def layout_for(cfg: DictConfig) -> Layout:
    """Ranks per node and node count from launcher.* and what this machine has."""
    lc = cfg.launcher
    if lc.num_nodes < 1:
        raise ConfigError(f"launcher.num_nodes must be >= 1 (got {lc.num_nodes}).")
    multi_node = lc.num_nodes > 1
    if cfg.trainer.device == "cpu" and lc.num_gpus > 0:
        raise ConfigError(f"launcher.num_gpus={lc.num_gpus} with trainer.device=cpu: for CPU ranks set "
                          "launcher.num_procs=N (and launcher.num_gpus=0).")
    if lc.hostfile:
        hosts = hostfile_hosts(lc.hostfile)
        if len(hosts) < lc.num_nodes:
            raise UserError(f"launcher.num_nodes={lc.num_nodes} but launcher.hostfile '{lc.hostfile}' lists "
                            f"{len(hosts)} node(s).")
    elif multi_node and lc.name == "deepspeed":
        raise ConfigError(f"launcher.num_nodes={lc.num_nodes} needs launcher.hostfile=<file> (one line per "
                          "node: 'node-1 slots=8'), or launcher=slurm inside a SLURM cluster.")
    if lc.name == "slurm":  # the allocation provides the GPUs: nothing to detect on the submitting machine
        gpu = lc.num_gpus > 0
        return Layout(lc.num_gpus if gpu else max(lc.num_procs, 1), lc.num_nodes, gpu)
    local_gpus = _cuda_count() if cfg.trainer.device != "cpu" else 0
    if lc.num_gpus > 0:
        if not lc.hostfile and lc.num_gpus > local_gpus:
            raise UserError(
                f"launcher.num_gpus={lc.num_gpus} but this machine has {local_gpus} CUDA GPU(s). "
                + ("On a machine without GPUs, start CPU ranks with launcher.num_gpus=0 launcher.num_procs=N."
                   if local_gpus == 0 else f"Use launcher.num_gpus={local_gpus} or fewer.")
            )
        return Layout(lc.num_gpus, lc.num_nodes, True)
    if local_gpus > 0 and cfg.trainer.device != "cpu":  # num_gpus=0 on a GPU machine: all its GPUs
        return Layout(local_gpus, lc.num_nodes, True)
    if cfg.trainer.device == "cuda":
        raise UserError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu.")
    if lc.num_procs < 1:
        raise ConfigError(f"launcher.num_procs must be >= 1 (got {lc.num_procs}).")
    return Layout(lc.num_procs, lc.num_nodes, False)


def check_world(cfg: DictConfig, layout: Layout) -> None:
    """The batch layout must split over the world: one clear message here instead of one per rank."""
    import torch

    from epo_cli.training.engine import deepspeed_config

    device = torch.device("cuda" if layout.gpu else "cpu")
    deepspeed_config(cfg, layout.world_size, device)  # ConfigError: mini/micro batch vs world size
    if cfg.algo.name != "sft" and cfg.algo.tasks_per_step % layout.world_size:
        w = layout.world_size
        raise ConfigError(
            f"algo.tasks_per_step={cfg.algo.tasks_per_step} must be divisible by the number of ranks ({w}) "
            f"so that every GRPO group stays whole on one rank (e.g. algo.tasks_per_step="
            f"{-(-cfg.algo.tasks_per_step // w) * w})."
        )


def check_resume(cfg: DictConfig, layout: Layout) -> None:
    """A ZeRO checkpoint reloads only on the world size that saved it: say so before any rank starts."""
    from epo_cli.training import checkpoint

    if not cfg.trainer.resume or (cfg.trainer.resume == "auto" and not cfg.run_dir):
        return
    folder = checkpoint.resolve_resume(cfg.trainer.resume, Path(cfg.run_dir or "."))
    if folder is not None:
        checkpoint.check_world_size(folder, layout.world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---- deepspeed launcher -----------------------------------------------------------------------------------

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


def deepspeed_command(cfg: DictConfig, run: Path, layout: Layout) -> list[str]:
    """`python -m deepspeed.launcher.runner ... --module epo_cli.worker --run-dir RUN` (= `deepspeed`)."""
    lc = cfg.launcher
    multi_node = layout.num_nodes > 1
    port = lc.master_port or (DEFAULT_MASTER_PORT if multi_node or lc.hostfile else _free_port())
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner",
           "--num_nodes", str(layout.num_nodes), "--num_gpus", str(layout.ranks_per_node),
           "--master_port", str(port), "--no_local_rank", "--log_level", "warning"]
    if lc.hostfile:
        cmd += ["--hostfile", str(Path(lc.hostfile).expanduser().resolve())]
        if lc.master_addr not in ("127.0.0.1", "localhost", ""):  # else: the first host (ssh hostname -I)
            cmd += ["--master_addr", lc.master_addr]
    cmd += ["--module", "epo_cli.worker", "--run-dir", str(run.resolve())]
    if cfg.model.trust_remote_code:  # from this command line: the ranks' config.yaml cannot turn it on
        cmd.append("--trust-remote-code")
    return cmd


def launch_ranks(cfg: DictConfig, overrides: list[str]) -> None:
    """`epo train launcher=deepspeed|slurm ...`: start (or submit) the ranks of this run."""
    layout = layout_for(cfg)
    check_world(cfg, layout)
    if cfg.launcher.name == "slurm":
        submit_slurm(cfg, overrides, layout)
        return
    from epo_cli.launch import prepare_run_dir

    check_resume(cfg, layout)  # before prepare_run_dir rewrites the run's config.yaml
    run = prepare_run_dir(cfg, overrides).resolve()
    clear_rank_records(run)
    write_status(run, "running")  # not an earlier attempt's `stopped`/`failed`, whatever happens next
    cmd = deepspeed_command(cfg, run, layout)
    kind = f"{layout.ranks_per_node} GPU(s)" if layout.gpu else f"{layout.ranks_per_node} CPU rank(s) (gloo)"
    print(f"launching {layout.world_size} ranks: {layout.num_nodes} node(s) x {kind}, run directory {run}",
          file=sys.stderr, flush=True)
    code = _run_ranks(cmd, layout, run)
    status = read_status(run)
    if status.get("status") == "stopped" and status.get("signal"):  # every rank stopped after one step
        from epo_cli.launch import stopped_message
        from epo_cli.training.stop import exit_code

        signum = int(getattr(signal, str(status["signal"]), signal.SIGTERM))
        raise Stopped(stopped_message(run, signum, int(status.get("step") or 0)), exit_code(signum))
    if code != 0:
        message = failure_message(run, code, layout.world_size)
        write_status(run, "failed", error=message, exit_code=code)
        raise UserError(message, exit_code=code if 0 < code < 126 else 1)


def _run_ranks(cmd: list[str], layout: Layout, run: Path) -> int:
    """Run the deepspeed launcher and its ranks in their own session, so that a terminal's Ctrl-C (or a
    SIGTERM to `epo train`) reaches this process only: the first signal is relayed to every rank through
    <run>/ranks/stop.json (the deepspeed launcher would kill the ranks mid-step); a second one kills the
    whole session at once."""
    from epo_cli.training.stop import STOP, Interrupted, signal_name, write_relay

    proc = subprocess.Popen(cmd, env=rank_environment(layout), start_new_session=True)

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
    except (KeyboardInterrupt, Interrupted) as err:
        kill_now(0)
        proc.wait()
        signum = err.signum if isinstance(err, Interrupted) else int(signal.SIGINT)
        write_status(run, "stopped", signal=signal_name(signum),
                     abandoned="a second signal killed the ranks during a step",
                     checkpoint=_latest_tag(run), resume=f"epo train trainer.resume={run}")
        raise
    finally:
        STOP.uninstall()
        STOP.on_second = None


def _latest_tag(run: Path) -> str | None:
    from epo_cli.training.checkpoint import latest_tag

    return latest_tag(run)


def clear_rank_records(run: Path) -> None:
    """Failure records of an earlier attempt (a resume reuses the run directory) must not be reported."""
    shutil.rmtree(Path(run) / "ranks", ignore_errors=True)


def read_rank_records(run: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted((Path(run) / "ranks").glob("rank*.error")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(records, key=lambda r: r.get("time", 0.0))


def failure_message(run: Path, code: int, world_size: int) -> str:
    """Why the job ended, from the ranks' records: the cause first (a crash beats the timeouts and lost
    connections it causes on the other ranks), then where to resume from."""
    from epo_cli.training.checkpoint import latest_tag

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
        why = (f"{silent_text} exited with code {code}{_signal_note(code)} without a Python error (a crash, "
               "a kill signal or running out of memory)")
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


# ---- SLURM (submitit) -------------------------------------------------------------------------------------

def slurm_parameters(cfg: DictConfig, layout: Layout) -> dict[str, Any]:
    """sbatch parameters: one task per rank (srun), GPUs per node, and the job's wall-clock limit."""
    lc = cfg.launcher
    params: dict[str, Any] = {
        "job_name": f"epo-{cfg.name}",
        "nodes": layout.num_nodes,
        "ntasks_per_node": layout.ranks_per_node,
        "cpus_per_task": lc.cpus_per_task,
        "time": lc.time_min,
        # one failed task ends the step (the others would otherwise wait for launcher.timeout_s)
        "srun_args": ["--kill-on-bad-exit=1"],
        "setup": [f"export OMP_NUM_THREADS={max(1, lc.cpus_per_task)}",
                  f"export DS_ACCELERATOR={'cuda' if layout.gpu else 'cpu'}"],
        "signal_delay_s": 120,
    }
    if layout.gpu:
        params["gpus_per_node"] = layout.ranks_per_node
    if lc.partition:
        params["partition"] = lc.partition
    if lc.account:
        params["account"] = lc.account
    return params


def slurm_executor(cfg: DictConfig, run: Path, layout: Layout):
    try:
        import submitit
    except ImportError:
        raise UserError("launcher=slurm needs submitit: pip install submitit (or 'epo[sweep]').") from None
    executor = submitit.SlurmExecutor(folder=str(Path(run) / "slurm"))
    executor.update_parameters(**slurm_parameters(cfg, layout))
    return executor


def sbatch_script(cfg: DictConfig, run: Path, layout: Layout) -> str:
    """The sbatch file that launcher=slurm submits (for inspection; nothing is submitted)."""
    executor = slurm_executor(cfg, run, layout)
    return executor._make_submission_file_text("python -u -m submitit.core._submit <folder>", "<uid>")


def submit_slurm(cfg: DictConfig, overrides: list[str], layout: Layout) -> Any:
    """Write the run directory and submit one sbatch job whose SLURM tasks are the ranks."""
    from epo_cli.launch import prepare_run_dir
    from epo_cli.worker import SlurmRank

    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"launcher=slurm: {' and '.join(missing)} not on PATH. Submit from a SLURM login "
                        "node, or use launcher=deepspeed (launcher.hostfile for several nodes).")
    check_resume(cfg, layout)
    run = prepare_run_dir(cfg, overrides).resolve()
    clear_rank_records(run)
    executor = slurm_executor(cfg, run, layout)
    trust = {"trust_remote_code": True} if cfg.model.trust_remote_code else {}  # see deepspeed_command
    job = executor.submit(SlurmRank(), str(run), **trust)
    print(f"submitted SLURM job {job.job_id}: {layout.num_nodes} node(s) x {layout.ranks_per_node} "
          f"{'GPU' if layout.gpu else 'CPU'} rank(s)\n  run directory: {run}\n"
          f"  logs: {run / 'slurm'}/{job.job_id}_<task>_log.out (rank 0: task 0)\n"
          f"  follow: tail -f {run / 'slurm'}/{job.job_id}_0_log.out   cancel: scancel {job.job_id}",
          flush=True)
    return job
