"""Environment registry: `env=<name>` -> (config schema, suite class), imported lazily.

Suites for real simulators import their packages only inside methods, so composing a config or listing
options never needs alfworld, scienceworld or textworld installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import OmegaConf

from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.errors import ConfigError

#: name -> "module:SuiteClass:ConfigClass"
ENV_SUITES: dict[str, str] = {
    "household": "epo_cli.envs.household:HouseholdSuite:HouseholdConfig",
    "alfworld": "epo_cli.envs.alfworld:AlfworldSuite:AlfworldConfig",
    "scienceworld": "epo_cli.envs.scienceworld:ScienceWorldSuite:ScienceWorldConfig",
    "textworld": "epo_cli.envs.textworld_games:TextWorldSuite:TextWorldConfig",
}


def _load(name: str, which: int) -> Any:
    if name not in ENV_SUITES:
        raise ConfigError(f"Unknown environment '{name}'. Valid environments: {', '.join(ENV_SUITES)}.")
    module, *classes = ENV_SUITES[name].split(":")
    return getattr(importlib.import_module(module), classes[which])


def env_config_class(name: str) -> type:
    """The dataclass schema of `env=<name>`."""
    return _load(name, 1)


def make_suite(env_cfg: Any, reads_expert: bool = True) -> EnvSuite:
    """Build the suite named by `env_cfg.name` (cheap; call `.check()` before running).

    `reads_expert=False`: the caller never reads info["expert_action"] (RL rollouts), so an env whose
    `expert` setting is null (the default: "where the run reads it") skips computing it; an explicit
    env.expert=true|false is kept as given."""
    if not reads_expert and getattr(env_cfg, "expert", False) is None:
        env_cfg = OmegaConf.merge(env_cfg, {"expert": False})
    return _load(env_cfg.name, 0)(env_cfg)


__all__ = ["ENV_SUITES", "Env", "EnvSuite", "StepResult", "Task", "env_config_class", "make_suite"]
