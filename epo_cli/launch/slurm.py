"""Submit a run to SLURM (submitit): one sbatch job whose SLURM tasks are the ranks.

    epo train ... launcher=slurm launcher.num_nodes=2 launcher.num_gpus=8 launcher.partition=gpu

Each task runs `SlurmRank`, which derives RANK / WORLD_SIZE / MASTER_ADDR from the allocation and trains its
rank of the run from the run directory's config.yaml (epo_cli.launch.rank.run_rank). The submitting process
imports neither torch nor DeepSpeed: SlurmRank imports the rank's code only when the task runs it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from epo_cli.errors import UserError
from epo_cli.launch.layout import Layout, check_resume, check_world, clear_rank_records, layout_for
from epo_cli.launch.setup import prepare_run_dir
from epo_cli.rundir.trust import command_line_values
from epo_cli.training.stop import STOP_SIGNALS, exit_code


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


def slurm_executor(cfg: DictConfig, run: Path, layout: Layout) -> Any:
    try:
        import submitit  # optional (epo[sweep])
    except ImportError:
        raise UserError("launcher=slurm needs submitit: pip install submitit (or 'epo[sweep]').") from None
    executor = submitit.SlurmExecutor(folder=str(Path(run) / "slurm"))
    executor.update_parameters(**slurm_parameters(cfg, layout))
    return executor


def submit_slurm(cfg: DictConfig, overrides: list[str]) -> Any:
    """`epo train launcher=slurm ...`: write the run directory and submit one sbatch job whose SLURM tasks
    are the ranks."""
    layout = layout_for(cfg)
    check_world(cfg, layout)
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"launcher=slurm: {' and '.join(missing)} not on PATH. Submit from a SLURM login "
                        "node, or use launcher=deepspeed (launcher.hostfile for several nodes).")
    check_resume(cfg, layout)
    run = prepare_run_dir(cfg, overrides).resolve()
    clear_rank_records(run)
    executor = slurm_executor(cfg, run, layout)
    # settings that can start code come from this command line, not config.yaml (see epo_cli.rundir.trust)
    job = executor.submit(SlurmRank(), str(run), command_line=command_line_values(cfg))
    print(f"submitted SLURM job {job.job_id}: {layout.num_nodes} node(s) x {layout.ranks_per_node} "
          f"{'GPU' if layout.gpu else 'CPU'} rank(s)\n  run directory: {run}\n"
          f"  logs: {run / 'slurm'}/{job.job_id}_<task>_log.out (rank 0: task 0)\n"
          f"  follow: tail -f {run / 'slurm'}/{job.job_id}_0_log.out   cancel: scancel {job.job_id}",
          flush=True)
    return job


class SlurmRank:
    """The callable that launcher=slurm submits (epo_cli.launch.slurm.submit_slurm): one per SLURM task.

    SLURM starts one task per rank (srun); submitit's TorchDistributedEnvironment exports RANK, WORLD_SIZE,
    LOCAL_RANK and MASTER_ADDR/PORT (first node of the allocation) for init_distributed. GPU selection
    stays with LOCAL_RANK (all of a node's GPUs remain visible to each task).

    When the job reaches its time limit or is preempted, submitit calls `checkpoint` and requeues the job;
    SIGTERM (scancel, preemption) and SIGUSR1 (`--signal=USR1@T`) stop every rank after the current step
    with a checkpoint (epo_cli.training.stop). Whichever way a job is started again (submitit's requeue or
    SLURM's own), its ranks resume from the run's latest complete checkpoint.
    """

    def __call__(self, run_dir: str, resume: bool = False, command_line: dict[str, Any] | None = None) -> None:
        import submitit  # optional (epo[sweep]); only SLURM tasks need it

        # here, not at the top: the rank's code imports torch (and sets OMP_NUM_THREADS first), which the
        # submitting process must not
        from epo_cli.launch.rank import rank_error_file, run_rank

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        # requeued by submitit (resume=True) or by SLURM itself (preemption: SLURM_RESTART_COUNT > 0)
        requeued = resume or int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        code = run_rank(Path(run_dir), resume_latest=requeued, command_line=command_line)
        if code in {exit_code(s) for s in STOP_SIGNALS}:
            return  # stopped on a signal with a checkpoint: status.json says so; not a failure
        if code != 0:
            rank = int(os.environ.get("RANK", "0"))
            record = rank_error_file(Path(run_dir), rank)
            raise RuntimeError(f"rank {rank} failed (exit code {code}); see {record}")

    def checkpoint(self, run_dir: str, resume: bool = False, command_line: dict[str, Any] | None = None) -> Any:
        import submitit  # optional, as in __call__

        return submitit.helpers.DelayedSubmission(SlurmRank(), run_dir, True, command_line=command_line)
