"""Where the ranks of a distributed run go, and the checks made once before any of them starts.

`layout_for` turns launcher.* (and the GPUs this machine has) into ranks per node x nodes; `check_world`
and `check_resume` fail with one message here instead of one traceback per rank. Both launchers
(epo_cli.launch.deepspeed and epo_cli.launch.slurm) start from them. Nothing here imports torch or
DeepSpeed: the process that starts the ranks only reads the config, the run directory and checkpoint paths.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from epo_cli.config import is_sft
from epo_cli.errors import ConfigError, UserError
from epo_cli.rundir.checkpoint_paths import check_world_size, resolve_resume
from epo_cli.runtime.deepspeed_config import deepspeed_config
from epo_cli.runtime.device import gpu_driver_present


@dataclass
class Layout:
    """Where the ranks run: `ranks_per_node` processes on each of `num_nodes` nodes."""

    ranks_per_node: int
    num_nodes: int
    gpu: bool

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.num_nodes


def _cuda_count() -> int:
    """CUDA GPUs this process may use. Without a GPU driver (no /dev/nvidia*, no ROCm /dev/kfd) none, at once;
    otherwise torch counts them in a child process (CUDA_VISIBLE_DEVICES, MIG and ROCm as the ranks will see
    them), so this process never loads torch."""
    if not gpu_driver_present():
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def hostfile_hosts(path: str) -> list[tuple[str, int]]:
    """(host, slots) per line of a deepspeed hostfile ('worker-1 slots=8'; '#' starts a comment)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"launcher.hostfile='{path}' does not exist. Write one line per node, e.g.\n"
                        "  node-1 slots=8\n  node-2 slots=8\n"
                        "(the nodes reach each other by passwordless ssh).")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"launcher.hostfile '{path}' cannot be read as text ({type(err).__name__}). Write one "
                        "line per node, e.g. 'node-1 slots=8'.") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        given = [p.split("=", 1)[1] for p in parts[1:] if p.startswith("slots=")]
        extra = [p for p in parts[1:] if not p.startswith("slots=")]
        if len(given) != 1 or extra or not given[0].isdigit() or int(given[0]) < 1 or "=" in parts[0]:
            raise UserError(f"launcher.hostfile '{path}', line {number}: '{line[:200]}' is not '<host> slots=N' "
                            "(N >= 1: the GPUs or processes on that node), e.g. 'node-1 slots=8'.")
        hosts.append((parts[0], int(given[0])))
    if len({host for host, _ in hosts}) != len(hosts):
        raise UserError(f"launcher.hostfile '{path}' lists a node twice; list each node once with its slots.")
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
    deepspeed_config(cfg, layout.world_size, "cuda" if layout.gpu else "cpu")  # ConfigError: batch vs world size
    if not is_sft(cfg.algo) and cfg.algo.tasks_per_step % layout.world_size:
        w = layout.world_size
        raise ConfigError(
            f"algo.tasks_per_step={cfg.algo.tasks_per_step} must be divisible by the number of ranks ({w}) "
            f"so that every GRPO group stays whole on one rank (e.g. algo.tasks_per_step="
            f"{-(-cfg.algo.tasks_per_step // w) * w})."
        )


def check_resume(cfg: DictConfig, layout: Layout) -> None:
    """A ZeRO checkpoint reloads only on the world size that saved it: say so before any rank starts."""
    if not cfg.trainer.resume or (cfg.trainer.resume == "auto" and not cfg.run_dir):
        return
    folder = resolve_resume(cfg.trainer.resume, Path(cfg.run_dir or "."))
    if folder is not None:
        check_world_size(folder, layout.world_size)


def clear_rank_records(run: Path) -> None:
    """Failure records of an earlier attempt (a resume reuses the run directory) must not be reported."""
    shutil.rmtree(Path(run) / "ranks", ignore_errors=True)
