"""Metric sinks (rank 0 only), one module per sink that a `logger=` option adds:

    logger.py   MetricsLogger: every step's metrics to the sinks logger.* turns on; `logger=default` is the
                rich console, metrics.jsonl and TensorBoard, `logger=none` metrics.jsonl only
    jsonl.py    metrics.jsonl: reading it back (reports, sweeps) and cutting it at a resumed step
    wandb.py    `logger=wandb`: Weights & Biases (optional package)
    mlflow.py   `logger=mlflow`: MLflow (optional package)

Metric names (one scheme everywhere; see README "Metrics"):
    policy/entropy               token-mean entropy of the rollout's responses (at the sampling temperature)
    policy/entropy_turn/<t>      token-mean entropy of turn t's responses
    policy/entropy_fluctuation   sigma of the fluctuation monitor; policy/entropy_swing, policy/entropy_alert
    policy/entropy_ref           EPO smoothing reference (historical mean entropy)
    policy/clipfrac  policy/approx_kl  policy/kl_ref   PPO diagnostics and KL to the reference policy
    policy/cov_clipfrac  policy/kl_cov_frac  policy/kl_cov_penalty   Clip-Cov / KL-Cov token shares
    loss/<term>  coef/<name>     each loss term's value and coefficient (coef/beta is EPO's phase weight)
    rollout/success  rollout/success/<task_type>  rollout/episode_len  rollout/invalid_rate
    rollout/truncated  rollout/diversity  rollout/distinct_actions
    rollout/groups_dropped  rollout/groups_topped_up  rollout/sampling_rounds   (dynamic sampling)
    critic/explained_variance  critic/value_mean   (ppo)
    eval/<split>/success  eval/<split>/episode_len  eval/success (the first eval split)
    perf/tokens_per_s  perf/env_steps_per_s  perf/rollout_s  perf/update_s  perf/grad_norm  perf/lr
"""
