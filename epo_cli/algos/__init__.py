"""Algorithm components: advantage estimators, loss terms, aggregation modes, schedules, entropy state.

Every component a config names lives in a registry; `registry_names()` is what config validation checks
names against, so an unknown name fails at config time with the list of valid names.
"""

from __future__ import annotations


def registry_names() -> dict[str, list[str]]:
    from epo_cli.algos import advantages, aggregation, losses, schedules

    return {
        "estimators": sorted(advantages.ESTIMATORS),
        "loss_terms": sorted(losses.LOSS_TERMS),
        "policy_losses": sorted(losses.POLICY_LOSSES),
        "kl_estimators": sorted(losses.KL_ESTIMATORS),
        "entropy_modes": sorted(losses.ENTROPY_MODES),
        "aggregations": sorted(aggregation.AGGREGATIONS),
        "entropy_schedules": sorted(schedules.ENTROPY_SCHEDULES),
        "phase_schedules": sorted(schedules.PHASE_SCHEDULES),
    }
