"""Algorithm components: advantage estimators, loss terms, aggregation modes, schedules, entropy state.

Every component a config names lives in a registry (epo_cli.registry.Registry): the algorithm's are
declared in epo_cli/algos/registries.py, the schedules in schedules.py, neither of which imports torch.
`REGISTRIES` is what config validation reads (names, and what each entry says about its component), so an
unknown name fails at config time with the list of valid names, without loading the components' code.
"""

from __future__ import annotations

from epo_cli.algos.registries import (
    AGGREGATIONS,
    ENTROPY_MODES,
    ESTIMATORS,
    GROUP_FILTERS,
    KL_ESTIMATORS,
    LOSS_TERMS,
    POLICY_LOSSES,
)
from epo_cli.algos.schedules import KL_SCHEDULES, SCHEDULES
from epo_cli.registry import Registry

#: the registries as `one_of(registry=...)` names them in epo_cli/config.py
REGISTRIES: dict[str, Registry] = {
    "estimators": ESTIMATORS,
    "loss_terms": LOSS_TERMS,
    "policy_losses": POLICY_LOSSES,
    "kl_estimators": KL_ESTIMATORS,
    "entropy_modes": ENTROPY_MODES,
    "aggregations": AGGREGATIONS,
    "schedules": SCHEDULES,
    "kl_schedules": KL_SCHEDULES,
    "group_filters": GROUP_FILTERS,
}
