"""From a composed config to running ranks: this process (local), the deepspeed launcher, SLURM; one rank;
sweeps of many runs.

    setup.py      compose a run's config (resume included) and write its run directory: every launcher
    local.py      train in this process (a world of one)
    layout.py     ranks per node x nodes, and the checks made once before any rank starts
    deepspeed.py  start the ranks with the deepspeed launcher and report why a job failed
    slurm.py      submit the ranks as one SLURM job (submitit)
    rank.py       one rank: `python -m epo_cli.launch.rank --run-dir RUN` (or a SLURM task)
    sweep.py      `epo sweep`: Hydra multirun, one `epo train` subprocess per job
    libraries.py  the library settings every epo process applies first (quiet_libraries)

Starting, stopping and the run's status.json are the run lifecycle's (epo_cli/launch/lifecycle.py), used
by local.py and rank.py alike.

Nothing is imported here: `python -m epo_cli.launch.rank` must set OMP_NUM_THREADS before torch loads.
"""
