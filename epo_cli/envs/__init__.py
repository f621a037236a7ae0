"""Environment registry: `env=<name>` -> suite class and config schema, imported when first used.

Suites for real simulators import their packages only inside methods, so composing a config or listing
options never needs alfworld, scienceworld or textworld installed.
"""

from __future__ import annotations

from typing import Any

from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.registry import Registry

#: env=<name> -> its EnvSuite class (config: its settings schema), by "module:name"
ENV_SUITES = Registry("environment")
ENV_SUITES.register("household", "epo_cli.envs.household:HouseholdSuite",
                    config="epo_cli.envs.household:HouseholdConfig")
ENV_SUITES.register("alfworld", "epo_cli.envs.alfworld:AlfworldSuite", config="epo_cli.envs.alfworld:AlfworldConfig")
ENV_SUITES.register("scienceworld", "epo_cli.envs.scienceworld:ScienceWorldSuite",
                    config="epo_cli.envs.scienceworld:ScienceWorldConfig")
ENV_SUITES.register("textworld", "epo_cli.envs.textworld_games:TextWorldSuite",
                    config="epo_cli.envs.textworld_games:TextWorldConfig")


def env_config_class(name: str) -> type:
    """The dataclass schema of `env=<name>` (ConfigError listing the environments for an unknown name)."""
    return ENV_SUITES.config_class(name)


def make_suite(env_cfg: Any) -> EnvSuite:
    """Build the suite named by `env_cfg.name` (cheap; call `.check()` before running). One per run: whether
    an env computes its expert (env.expert=null: where it is read) is told to the suite's make_env, by the
    EnvPool that builds the envs (`reads_expert`)."""
    return ENV_SUITES.build(env_cfg.name, env_cfg)


__all__ = ["ENV_SUITES", "Env", "EnvSuite", "StepResult", "Task", "env_config_class", "make_suite"]
