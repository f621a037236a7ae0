"""Environment registry: `env=<name>` -> suite class and config schema, imported when first used.

Suites for real simulators import their packages only inside methods, so composing a config or listing
options never needs alfworld, scienceworld or textworld installed.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

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


def make_suite(env_cfg: Any, reads_expert: bool = True) -> EnvSuite:
    """Build the suite named by `env_cfg.name` (cheap; call `.check()` before running).

    `reads_expert=False`: the caller never reads info["expert_action"] (RL rollouts), so an env whose
    `expert` setting is null (the default: "where the run reads it") skips computing it; an explicit
    env.expert=true|false is kept as given."""
    if not reads_expert and getattr(env_cfg, "expert", False) is None:
        env_cfg = OmegaConf.merge(env_cfg, {"expert": False})
    return ENV_SUITES.build(env_cfg.name, env_cfg)


__all__ = ["ENV_SUITES", "Env", "EnvSuite", "StepResult", "Task", "env_config_class", "make_suite"]
