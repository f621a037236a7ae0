"""Composition and validation of a run's config: Hydra over conf/, merged into the schemas of config.py.

`compose(overrides)` runs Hydra's compose API over conf/ (the overrides are read, and Hydra's errors
explained, by epo_cli/compose/overrides.py), then `validate` merges the result into the dataclass schemas (the env
section into the schema of env.name). Any unknown key, unknown group option or wrong type fails here, before
any work starts, with one `ConfigError` that names the key and the valid choices. Then, in order:
    check_field_rules       each field's declared range and valid values (registry fields: the names the
                            registries hold)
    _check_rules            the rules that span keys: each schema section's `rules` (config.py, each defined
                            next to its section: batch sizes, model shape, ZeRO, ...), then those that need more
                            than the schemas (_RULES_BEYOND_THE_SCHEMAS: at least one loss term, best_metric, the
                            curriculum's, the prompt template, the memory estimate); a new rule is one function
                            next to its section, listed in its `rules`
    _check_components       each component the config names: its registry entry's `check`; the schedules of
                            the loss's weights; algo.components.<name> against the component's settings dataclass
    warn_unused_settings    one line per reason when a changed setting is read by nothing this run uses
                            (epo_cli/compose/unused_settings.py: registry entries, the weights' schedules, and the
                            schema sections' `switches`)
No table here names a component: a new estimator, loss term or schedule is seen through its registry entry.

This module sits above config.py, the component packages (algos, envs, curriculum) and their registries,
so none of them imports it: config -> errors; algos, envs -> config; compose -> config, algos, envs,
curriculum. Nothing it imports loads torch.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import BooleanNode, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from epo_cli.algos import REGISTRIES
from epo_cli.algos.curriculum import CURRICULA, check_curriculum, check_levels_fit
from epo_cli.algos.registries import ESTIMATORS, LOSS_TERMS, check_some_loss_term
from epo_cli.algos.schedules import WEIGHTS, Weight, build_schedule, schedule_parameters, section_keys
from epo_cli.analysis.memory import check_memory
from epo_cli.compose.overrides import (
    blame_preset,
    check_override_forms,
    check_renamed_values,
    check_required,
    hydra_overrides,
    preset_settings,
    translate_hydra_error,
    unknown_key_message,
)
from epo_cli.compose.unused_settings import warn_unused_settings
from epo_cli.config import (
    Rule,
    RunConfig,
    check_field_rules,
    check_number_sizes,
    config_dir,
    parse_bool,
    schema_at,
    section_schema,
)
from epo_cli.envs import env_config_class
from epo_cli.errors import ConfigError
from epo_cli.registry import Registry
from epo_cli.rollout.engines import ROLLOUT_ENGINES, register_plugin_engine
from epo_cli.rollout.prompts import get_template
from epo_cli.rundir.folder import read_run_config

#: every registry a `one_of(registry=...)` field may name
_REGISTRIES: dict[str, Registry] = {**REGISTRIES, "curricula": CURRICULA, "rollout_engines": ROLLOUT_ENGINES}


def _schema_for(cfg: DictConfig) -> DictConfig:
    """The structured schema for this composition: the env schema depends on `env.name`."""
    schema = OmegaConf.structured(RunConfig)
    env_name = OmegaConf.select(cfg, "env.name", default="household")
    schema.env = OmegaConf.structured(env_config_class(env_name))
    return schema


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose conf/ with `overrides` and validate it against the schemas. Raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_override_forms(overrides)
    preset = preset_settings(overrides)
    overrides = hydra_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            raw = hydra_compose(config_name="config", overrides=overrides)
    except OmegaConfBaseException as err:  # e.g. interpolation errors while composing
        raise translate_hydra_error(err) from None
    except Exception as err:  # hydra's own exceptions (missing option, bad override grammar)
        if type(err).__module__.startswith("hydra"):
            raise translate_hydra_error(err) from None
        raise
    finally:
        GlobalHydra.instance().clear()
    if not preset:
        return validate(raw)
    with warnings.catch_warnings(record=True) as caught:  # a preset's own settings are named as such
        warnings.simplefilter("always")
        try:
            cfg = validate(raw)
        except ConfigError as err:
            raise ConfigError(blame_preset(str(err), preset)) from None
    for w in caught:
        warnings.warn(blame_preset(str(w.message), preset, warning=True), w.category, stacklevel=2)
    return cfg




def validate(raw: DictConfig) -> DictConfig:
    """Merge a composed config into the typed schemas, check every rule, and warn about settings nothing in
    this run reads."""
    env_name = str(OmegaConf.select(raw, "env.name", default="household"))
    OmegaConf.set_struct(raw, False)
    raw.pop("hydra", None)
    check_number_sizes(OmegaConf.to_container(raw, resolve=False))  # before the merge: see its docstring
    check_required(raw)
    try:
        schema = _schema_for(raw)
        _check_booleans(schema, raw, "")
        cfg = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(cfg)
    except ConfigError:
        raise
    except ConfigKeyError as err:
        raise ConfigError(unknown_key_message(err.full_key, env_name)) from None
    except ValidationError as err:
        section = None if err.full_key else _section_given_a_value(schema, raw, "")
        if section is not None:
            raise ConfigError(section) from None
        expected = _expected_type(err)
        raise ConfigError(
            f"Wrong type for config key '{err.full_key}': {str(err).splitlines()[0]}."
            + (f" Expected {expected}." if expected else "")
        ) from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or _unresolvable_key(raw)
        where = f"at '{key}'" if key else "(a ${...} interpolation)"
        raise ConfigError(f"Invalid config value {where}: {str(err).splitlines()[0]}") from None
    register_plugin_engine(str(cfg.rollout.engine))  # rollout.engine=package.module:Class (a plugin)
    check_renamed_values(cfg)
    registries = {key: registry.names() for key, registry in _REGISTRIES.items()}
    check_field_rules(cfg, RunConfig, registries=registries, schemas={"env": env_config_class(env_name)})
    if cfg.algo.estimator == "auto":
        cfg.algo.estimator = _auto_estimator(cfg.algo.base)
    _check_rules(cfg)
    _check_components(cfg, registries)
    warn_unused_settings(cfg, _named_components(cfg), _REGISTRIES)
    OmegaConf.set_readonly(cfg, False)
    return cfg





def load_run_config(run: Path, command_line: dict[str, Any] | None = None,
                    overridden: set[str] | frozenset[str] = frozenset()) -> DictConfig:
    """The config saved in run directory `run`, validated again against today's schemas
    (epo_cli.rundir.folder.read_run_config says what is upgraded and what is reset on the way)."""
    return validate(read_run_config(run, command_line, overridden))

def _section_given_a_value(schema: Any, raw: Any, prefix: str) -> str | None:
    """The message for a section set to a plain value (`algo.diagnostics=5`), which OmegaConf reports with
    an empty key; None if there is none."""
    if not isinstance(schema, DictConfig) or not isinstance(raw, DictConfig):
        return None
    for key in schema:
        if key not in raw:
            continue
        node, given = schema._get_node(key), raw._get_node(key)
        if isinstance(node, DictConfig) and not isinstance(given, DictConfig) and given._value() is not None:
            keys = ", ".join(str(k) for k in node)
            return (f"'{prefix}{key}' is a section of settings ({keys}), not a value: {prefix}{key}="
                    f"{given._value()!r} cannot be used. Set one of its keys, e.g. {prefix}{key}.{next(iter(node))}"
                    "=<value>.")
        found = _section_given_a_value(node, given, f"{prefix}{key}.")
        if found:
            return found
    return None


def _unresolvable_key(raw: DictConfig) -> str | None:
    """The dotted key whose ${...} interpolation fails to resolve (OmegaConf's resolve error names none)."""
    def walk(node: Any, prefix: str) -> str | None:
        for key in node:
            path = f"{prefix}{key}"
            if OmegaConf.is_interpolation(node, key):
                try:
                    node[key]
                except OmegaConfBaseException:
                    return path
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                found = walk(child, path + ".")
                if found:
                    return found
        return None

    try:
        return walk(raw, "")
    except Exception:  # noqa: BLE001 - only a better message is at stake
        return None


def _check_booleans(schema: DictConfig, raw: Any, prefix: str) -> None:
    """Every true/false setting given is checked by the one rule (config.parse_bool) before the merge:
    OmegaConf would turn `env.cache_pddl=3` (or `=yes`, `=1`) into true without a word."""
    if not isinstance(raw, DictConfig):
        return
    for key in schema:
        if key not in raw:
            continue
        node, given = schema._get_node(key), raw._get_node(key)
        if isinstance(node, BooleanNode):
            if not OmegaConf.is_interpolation(raw, key):
                parse_bool(f"{prefix}{key}", given._value(), node._is_optional())
        elif isinstance(node, DictConfig):
            _check_booleans(node, given, f"{prefix}{key}.")


def _expected_type(err: ValidationError) -> str | None:
    try:
        parent, _, leaf = err.full_key.rpartition(".")
        owner = schema_at(parent, env_config_class("household"))
        if owner is None:
            return None
        hint = {f.name: f.type for f in fields(owner)}.get(leaf)
        return str(hint) if hint else None
    except Exception:
        return None


#: what an evaluation logs per split (eval/<split>/<name>; epo_cli.rollout.episodes.episode_metrics), besides
#: success/<task type>; trainer.best_metric picks the checkpoint whose value of one of them is highest
EVAL_METRICS = ("success", "episode_len", "invalid_rate", "truncated", "obs_trimmed", "crashed")


def check_best_metric(cfg: DictConfig) -> None:
    """trainer.best_metric must be a metric an evaluation logs (a name that never appears would keep no
    `best` checkpoint without a word): eval/success (the first split's) or eval/<split>/<metric>."""
    name = cfg.trainer.best_metric
    if name is None or name == "eval/success":
        return
    parts = str(name).split("/")
    splits = list(cfg.env.eval_splits)
    if len(parts) >= 3 and parts[0] == "eval" and parts[1] in splits and \
            (parts[2] in EVAL_METRICS and len(parts) == 3 or parts[2] == "success" and len(parts) == 4):
        return
    examples = ["eval/success", *(f"eval/{split}/success" for split in splits[:2])]
    raise ConfigError(f"trainer.best_metric='{name}' is not a metric an evaluation logs, so no `best` checkpoint "
                      f"would ever be kept. Use eval/success or eval/<split>/<metric> (splits in env.eval_splits: "
                      f"{', '.join(splits) or 'none'}; metrics: {', '.join(EVAL_METRICS)}, success/<task type>), "
                      f"e.g. {' or '.join(examples)}; or trainer.best_metric=null for none.")


def _auto_estimator(base: str) -> str:
    """algo.estimator=auto: the estimator whose registry entry names this algo.base (Entry.auto_for)."""
    chosen = [name for name in ESTIMATORS.names() if base in ESTIMATORS.entry(name).auto_for]
    return chosen[0] if chosen else "none"


#: the rules of sections that need more than the schemas, each in the module that owns what it checks (config.py
#: imports none of them); run after the sections' own `rules`, the memory estimate last (the sizes are consistent)
_RULES_BEYOND_THE_SCHEMAS: tuple[Rule, ...] = (
    check_some_loss_term,  # the loss-term registry's names
    check_best_metric,  # trainer.best_metric: the metrics an evaluation logs
    lambda cfg: check_curriculum(cfg.curriculum, cfg.env.max_turns),
    check_levels_fit,
    lambda cfg: get_template(cfg.env.prompt_template),  # ConfigError listing the template names
    check_memory,
)


def section_rules(schema: type, env_schema: type) -> list[Rule]:
    """The `rules` of `schema` and of every section under it (the env section's from `env_schema`), in the
    schemas' order."""
    found = list(getattr(schema, "rules", ()))
    for f in fields(schema):
        nested = env_schema if (schema is RunConfig and f.name == "env") else section_schema(f)
        if nested is not None:
            found += section_rules(nested, env_schema)
    return found


def _check_rules(cfg: DictConfig) -> None:
    """The rules that span keys (each field's own range is checked before this; a component's own rules are
    its registry entry's `check`): each section's `rules`, then those beyond the schemas."""
    for rule in (*section_rules(RunConfig, env_config_class(cfg.env.name)), *_RULES_BEYOND_THE_SCHEMAS):
        rule(cfg)


# ----------------------------------------------------------------------------------------------------
# Components: the config names them (a `one_of(registry=...)` field); their registry entries say the rest
# ----------------------------------------------------------------------------------------------------

def _named_components(cfg: DictConfig) -> list[tuple[str, str, list[str]]]:
    """(key, registry, the component names its value holds) for every field of the schemas (algo.components'
    included) whose values are names in a registry (`one_of(registry=...)`)."""
    found = []

    def walk(node: Any, schema: type, prefix: str) -> None:
        for f in fields(schema):
            nested = env_config_class(cfg.env.name) if (schema is RunConfig and f.name == "env") else section_schema(f)
            if nested is not None and f.name in node:
                walk(node[f.name], nested, f"{prefix}{f.name}.")
            elif f.metadata.get("registry") and node.get(f.name) is not None:
                value = node[f.name]
                names = [str(v) for v in value] if OmegaConf.is_list(value) else [str(value)]
                found.append((prefix + f.name, f.metadata["registry"], names))

    walk(cfg, RunConfig, "")
    for name in cfg.algo.components:
        schema = _own_settings_class(name)
        if schema is not None and isinstance(cfg.algo.components[name], DictConfig):
            walk(cfg.algo.components[name], schema, f"algo.components.{name}.")
    return found


def _own_settings_class(name: str) -> type | None:
    for registry in (LOSS_TERMS, ESTIMATORS):
        if name in registry and registry.entry(name).sections is None:
            return registry.config_class(name)
    return None


def _check_components(cfg: DictConfig, registries: dict[str, list[str]]) -> None:
    """The components the config names: the schedule of each weight of the loss (lambda, beta_k, the KL
    weight) must find its parameters in its section and is built (its own checks); every named component's
    registry entry runs its `check`; and algo.components.<name> (a component registered with its own
    settings) is merged into its settings dataclass and checked with the same field rules as every schema."""
    for weight in WEIGHTS.values():
        _check_schedule(cfg, weight)
    algo = cfg.algo
    selected = [(name, LOSS_TERMS.entry(name)) for name in algo.loss_terms]
    if algo.estimator in ESTIMATORS:
        selected.append((algo.estimator, ESTIMATORS.entry(algo.estimator)))
    own = {name: entry.config for name, entry in selected if entry.sections is None and entry.config is not None}
    with_own = sorted(name for reg in (LOSS_TERMS, ESTIMATORS) for name in reg.names()
                      if reg.entry(name).sections is None)
    for name in list(algo.components):
        if name not in with_own:
            raise ConfigError(f"algo.components.{name}: no registered component '{name}' takes its settings from "
                              f"algo.components (the built-ins have their own algo sections). Components that "
                              f"do: {', '.join(with_own) or 'none'}.")
        if name not in own:
            warnings.warn(f"algo.components.{name}: no effect in this run ('{name}' is neither in algo.loss_terms "
                          "nor algo.estimator).", stacklevel=3)
    for name, schema in own.items():
        algo.components[name] = _component_settings(algo.components.get(name), name, schema, registries)
    checked = set()
    for _, registry, names in _named_components(cfg):
        for name in names:
            if name in _REGISTRIES[registry] and (registry, name) not in checked:  # not the extras auto, none
                checked.add((registry, name))
                check = _REGISTRIES[registry].entry(name).check
                if check is not None:
                    check(cfg)


def _component_settings(node: Any, name: str, schema: type, registries: dict[str, list[str]]) -> DictConfig:
    """algo.components.<name> merged into the component's settings dataclass and checked."""
    key = f"algo.components.{name}"
    try:
        defaults = OmegaConf.structured(schema)
        check_number_sizes(OmegaConf.to_container(node) if node is not None else {}, key + ".")
        _check_booleans(defaults, node, key + ".")
        merged = OmegaConf.merge(defaults, node if node is not None else {})
    except ConfigKeyError as err:
        valid = [f.name for f in fields(schema)]
        close = difflib.get_close_matches(str(err.key), valid, n=1)
        hint = f" Did you mean '{key}.{close[0]}'?" if close else ""
        raise ConfigError(f"Unknown config key '{key}.{err.key}'.{hint}\nValid keys in '{key}': "
                          f"{', '.join(valid)}.") from None
    except ValidationError as err:
        raise ConfigError(f"Wrong type for config key '{key}.{err.key}': {str(err).splitlines()[0]}.") from None
    check_field_rules(merged, schema, key + ".", registries)
    return merged


def _check_schedule(cfg: DictConfig, weight: Weight) -> None:
    """A weight's schedule must find all its parameters among its section's keys (its arguments' names), and
    take them."""
    name = OmegaConf.select(cfg, weight.key)
    section, usable = weight.section(name), weight.choices()
    if name not in usable:
        missing = [p for p in schedule_parameters(name, weight.registry) if p not in section_keys(section)]
        raise ConfigError(f"{weight.key}={name} takes {', '.join(missing)}, which the '{section}' section has no "
                          f"key for. Schedules it can use: {', '.join(usable)}.")
    try:
        build_schedule(name, OmegaConf.select(cfg, section), weight.registry)
    except ValueError as err:
        raise ConfigError(f"{weight.key}={name}: {err}.") from None
