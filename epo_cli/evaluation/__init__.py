"""Evaluation: a policy plays a split's fixed tasks and is scored, the same way for the trainer and `epo eval`.

    split.py   evaluate_split (play and score one split; the trainer's periodic evaluation calls it too),
               score_episodes (success with 95% intervals), the scripted baselines, the samples file
    run.py     evaluate_run: a run's checkpoint or a model folder, evaluated in this process; and the `epo eval`
               command around it (its arguments, the JSON and samples it writes, the table it prints)

Nothing is imported here: `epo --help` loads no torch (split.py and run.py do).
"""
