"""Reading finished (or interrupted) runs: the end-of-run table, sweep summaries, `epo report` plots; and
planning one before it starts (`epo plan`).

    run_summary.py    the table printed at the end of a run
    sweep_summary.py  per-run results and their aggregates over seeds (`epo sweep summarize`)
    report.py         PNG plots and an index page for runs and sweeps (`epo report`)
    plan.py           memory per rank, fit verdict and time per iteration of a config (`epo plan`)
"""
