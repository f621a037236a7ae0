"""Algorithm components: advantage estimators, loss terms, aggregation modes, schedules, entropy state.

Every component a config names lives in a registry next to its code (epo_cli.registry.Registry for those
built from settings: estimators, loss terms, policy losses, schedules; a name -> function table for the
settings-free KL estimators, entropy modes and aggregation modes). `registry_names()` is what config
validation checks names against, so an unknown name fails at config time with the list of valid names.
"""

from __future__ import annotations


def registry_names() -> dict[str, list[str]]:
    """registry (as `one_of(registry=...)` names it in epo_cli/config.py) -> its component names."""
    from epo_cli.algos import advantages, aggregation, losses, schedules

    return {
        "estimators": advantages.ESTIMATORS.names(),
        "loss_terms": losses.LOSS_TERMS.names(),
        "policy_losses": losses.POLICY_LOSSES.names(),
        "kl_estimators": sorted(losses.KL_ESTIMATORS),
        "entropy_modes": sorted(losses.ENTROPY_MODES),
        "aggregations": sorted(aggregation.AGGREGATIONS),
        "schedules": schedules.SCHEDULES.names(),
        "kl_schedules": sorted(schedules.KL_SCHEDULES),
    }
