"""Submit a run to SLURM (submitit): one sbatch job whose SLURM tasks are the ranks.

    epo train ... launcher=slurm launcher.num_nodes=2 launcher.num_gpus=8 launcher.partition=gpu

Each task runs epo_cli.launch.rank.SlurmRank, which derives RANK / WORLD_SIZE / MASTER_ADDR from the
allocation and trains its rank of the run from the run directory's config.yaml.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from epo_cli.errors import UserError
from epo_cli.launch.layout import Layout, check_resume, check_world, clear_rank_records, layout_for
from epo_cli.launch.local import prepare_run_dir
from epo_cli.launch.rank import SlurmRank
from epo_cli.trust import command_line_values


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


def sbatch_script(cfg: DictConfig, run: Path, layout: Layout) -> str:
    """The sbatch file that launcher=slurm submits (for inspection; nothing is submitted)."""
    executor = slurm_executor(cfg, run, layout)
    return executor._make_submission_file_text("python -u -m submitit.core._submit <folder>", "<uid>")


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
    # settings that can start code come from this command line, not config.yaml (see epo_cli.trust)
    job = executor.submit(SlurmRank(), str(run), command_line=command_line_values(cfg))
    print(f"submitted SLURM job {job.job_id}: {layout.num_nodes} node(s) x {layout.ranks_per_node} "
          f"{'GPU' if layout.gpu else 'CPU'} rank(s)\n  run directory: {run}\n"
          f"  logs: {run / 'slurm'}/{job.job_id}_<task>_log.out (rank 0: task 0)\n"
          f"  follow: tail -f {run / 'slurm'}/{job.job_id}_0_log.out   cancel: scancel {job.job_id}",
          flush=True)
    return job
