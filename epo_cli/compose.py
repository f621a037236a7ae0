"""Composition and validation of a run's config: Hydra over conf/, merged into the schemas of config.py.

`compose(overrides)` runs Hydra's compose API over conf/, then `validate` merges the result into the
dataclass schemas (the env section into the schema of env.name). Any unknown key, unknown group option or
wrong type fails here, before any work starts, with one `ConfigError` that names the key and the valid
choices. `check_field_rules` then checks each field's declared range and valid values, with the names of
the component registries (epo_cli.algos.registry_names, epo_cli.curriculum.CURRICULA);
`_check_components` checks the settings of the selected components (algo.components.<name>, a schedule's
parameters); `_check_consistency` checks the rules that span keys and warns (one line) about settings the
run would not read.

This module sits above config.py, the component packages (algos, envs, curriculum) and their registries,
so none of them imports it: config -> errors; algos, envs -> config; compose -> config, algos, envs,
curriculum.
"""

from __future__ import annotations

import difflib
import re
import warnings
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import BooleanNode, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from epo_cli.config import (
    GROUPS,
    TINY_SIZE_KEYS,
    AlgoConfig,
    EntropyConfig,
    GAEConfig,
    KLConfig,
    LauncherConfig,
    LoraConfig,
    ModelConfig,
    PhaseConfig,
    PolicyClipConfig,
    RunConfig,
    SmoothingConfig,
    ValueConfig,
    check_field_rules,
    check_number_sizes,
    config_dir,
    group_options,
)
from epo_cli.curriculum import CURRICULA
from epo_cli.envs import env_config_class
from epo_cli.errors import ConfigError
from epo_cli.rollout.prompts import get_template


def _schema_for(cfg: DictConfig) -> DictConfig:
    """The structured schema for this composition: the env schema depends on `env.name`."""
    schema = OmegaConf.structured(RunConfig)
    env_name = OmegaConf.select(cfg, "env.name", default="household")
    schema.env = OmegaConf.structured(env_config_class(env_name))
    return schema


def _dataclass_at(key_path: str, env_name: str) -> type | None:
    """The schema dataclass that owns the node at `key_path` (e.g. 'trainer' or 'algo.kl')."""
    node: Any = RunConfig
    for part in [p for p in key_path.split(".") if p]:
        if not is_dataclass(node):
            return None
        if node is RunConfig and part == "env":
            node = env_config_class(env_name)
            continue
        match = {f.name: f for f in fields(node)}.get(part)
        if match is None:
            return None
        node = match.default_factory() if match.default_factory is not None else None  # type: ignore[misc]
        node = type(node) if is_dataclass(node) else None
    return node


def _unknown_key_message(full_key: str, env_name: str) -> str:
    parent, _, leaf = full_key.rpartition(".")
    owner = _dataclass_at(parent, env_name)
    valid = [f.name for f in fields(owner)] if owner is not None else []
    where = f"'{parent}'" if parent else "the top level"
    msg = f"Unknown config key '{full_key}'."
    close = difflib.get_close_matches(leaf, valid, n=1)
    if close:
        msg += f" Did you mean '{(parent + '.') if parent else ''}{close[0]}'?"
    if valid:
        msg += f"\nValid keys in {where}: {', '.join(valid)}."
    if parent in GROUPS or parent == "":
        msg += "\nFix the override, or run `epo config show` to see every key and its value."
    return msg


def _translate_hydra_error(err: Exception) -> ConfigError:
    # hydra_overrides turned key=value into Hydra's ++key=value: show the user's own override, not that
    text = re.sub(r"(?<![\w+])\+\+(?=[\w/])", "", str(err))
    m = re.search(r"Could not find '([\w\-/.]+)/([\w\-.]+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        options = group_options(group) if (config_dir() / group).is_dir() else []
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" Did you mean '{group}={close[0]}'?" if close else ""
        return ConfigError(
            f"Unknown option '{option}' for config group '{group}'.{hint}\n"
            f"Valid options for {group}: {', '.join(options)}."
        )
    m = re.search(r"Could not override '([\w.\-]+)'", text)
    if m:
        return ConfigError(_unknown_key_message(m.group(1), "household"))
    m = re.search(r"config group '([\w.\-]+)' does not exist", text)
    if m and m.group(1) not in GROUPS:
        return ConfigError(f"'{m.group(1)}' is a setting, not a config group: write {m.group(1)}=<value> (the "
                           f"`@package` form is for config groups only: {', '.join(GROUPS)}).")
    m = re.search(r"Could not append to config\. An item is already at '([\w.\-]+)'", text)
    if m:
        return ConfigError(f"'{m.group(1)}' already exists: override it without the leading '+'.")
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return ConfigError(
        f"Invalid override: {first}\nOverrides look like `group=option` or `section.key=value`, "
        "e.g. `algo=epo trainer.total_steps=20`."
    )


def hydra_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Value overrides become `++key=value` so that every key of the typed schemas can be set, also when
    the selected yaml does not spell it out (e.g. algo.entropy_smoothing.alpha under algo=grpo); unknown
    keys are then reported by the schema merge, with the valid keys. Group selections stay as they are."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        is_group = key in GROUPS or "/" in key or key.startswith("hydra")
        out.append(o if ("=" not in o or o.startswith(("+", "~")) or is_group) else f"++{o}")
    return out


def check_override_forms(overrides: list[str] | tuple[str, ...]) -> None:
    """What Hydra would accept but drop or change without a word: a config group given twice with different
    options (the last one wins, so `model=nosuch model=tiny` never reports `nosuch`), and `~key` / `~group`
    (a deleted group or key comes back from the schema's defaults: `~algo` would train SFT). A `key=value`
    given twice keeps the last, as in Hydra (scripts append their own overrides to a shared list)."""
    seen: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0]
        if key.startswith("~"):
            what = key[1:]
            fix = (f"choose one of its options ({what}=<option>)" if what in GROUPS else
                   f"set it ({what}=<value>, or {what}=null where null is allowed)")
            raise ConfigError(f"'{o}' would delete {what}, which every run has: its defaults would come back "
                              f"without a word. To change it, {fix}.")
        plain = key.lstrip("+")
        is_group = plain in GROUPS or "/" in plain
        if is_group and plain in seen and "=" in o and seen[plain].split("=", 1)[1] != o.split("=", 1)[1]:
            raise ConfigError(f"The config group '{plain}' is given twice ({seen[plain]} and {o}); only the last "
                              "would count. Choose one option.")
        seen[plain] = o


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
        raise _translate_hydra_error(err) from None
    except Exception as err:  # hydra's own exceptions (missing option, bad override grammar)
        if type(err).__module__.startswith("hydra"):
            raise _translate_hydra_error(err) from None
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
        warnings.warn(blame_preset(str(w.message), preset), w.category, stacklevel=2)
    return cfg


def preset_settings(overrides: list[str] | tuple[str, ...]) -> dict[str, str]:
    """{dotted key: "experiment=<name>"} for the settings an experiment preset on this command line sets
    itself (and no override of the command sets), so messages about them can say where they came from."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "experiment" and "=" in o]
    path = config_dir() / "experiment" / f"{chosen[-1]}.yaml" if chosen else None
    if path is None or not path.is_file():
        return {}
    data = OmegaConf.to_container(OmegaConf.load(path))
    data.pop("defaults", None)
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}

    def leaves(node: Any, prefix: str) -> list[str]:
        if isinstance(node, dict):
            return [k for key, value in node.items() for k in leaves(value, f"{prefix}{key}.")]
        return [prefix.rstrip(".")]

    return {key: f"experiment={chosen[-1]}" for key in leaves(data, "") if key not in given}


def blame_preset(message: str, preset: dict[str, str]) -> str:
    """`message` with a note naming the preset that set the keys it mentions (the user did not set them)."""
    named = [key for key in preset if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message)]
    if not named:
        return message
    keys = ", ".join(named)
    return (f"{message}\n(note: {keys} {'is' if len(named) == 1 else 'are'} set by the preset {preset[named[0]]}, "
            "not on this command line: the preset does not fit the other selections; drop one of them, or set "
            f"{named[0]}=<value> yourself.)")


def validate(raw: DictConfig) -> DictConfig:
    """Merge a composed config into the typed schemas and check cross-field consistency."""
    from epo_cli.algos import registry_names  # the component modules import torch: only when validating

    env_name = str(OmegaConf.select(raw, "env.name", default="household"))
    OmegaConf.set_struct(raw, False)
    raw.pop("hydra", None)
    check_number_sizes(OmegaConf.to_container(raw, resolve=False))  # before the merge: see its docstring
    try:
        schema = _schema_for(raw)
        _check_booleans(schema, raw, "")
        cfg = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(cfg)
    except ConfigError:
        raise
    except ConfigKeyError as err:
        raise ConfigError(_unknown_key_message(err.full_key, env_name)) from None
    except ValidationError as err:
        expected = _expected_type(err)
        raise ConfigError(
            f"Wrong type for config key '{err.full_key}': {str(err).splitlines()[0]}."
            + (f" Expected {expected}." if expected else "")
        ) from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or _unresolvable_key(raw)
        where = f"at '{key}'" if key else "(a ${...} interpolation)"
        raise ConfigError(f"Invalid config value {where}: {str(err).splitlines()[0]}") from None
    registries = {**registry_names(), "curricula": CURRICULA.names()}
    check_field_rules(cfg, RunConfig, registries=registries, schemas={"env": env_config_class(env_name)})
    _check_consistency(cfg)
    _check_components(cfg, registries)
    OmegaConf.set_readonly(cfg, False)
    return cfg


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
    """A true/false setting must be given as true or false: OmegaConf would turn `env.cache_pddl=3` (or
    `=yes`, `=1`) into true without a word, so anything but a bool (or null where null is allowed) is a
    type error here, before the merge."""
    if not isinstance(raw, DictConfig):
        return
    for key in schema:
        if key not in raw:
            continue
        node, given = schema._get_node(key), raw._get_node(key)
        if isinstance(node, BooleanNode):
            value = given._value()
            if value is not None and not isinstance(value, bool) and not OmegaConf.is_interpolation(raw, key):
                raise ConfigError(f"Wrong type for config key '{prefix}{key}': {value!r} is not a bool. "
                                  f"Expected true or false{' (or null)' if node._is_optional() else ''}.")
        elif isinstance(node, DictConfig):
            _check_booleans(node, given, f"{prefix}{key}.")


def _expected_type(err: ValidationError) -> str | None:
    try:
        parent, _, leaf = err.full_key.rpartition(".")
        owner = _dataclass_at(parent, "household")
        if owner is None:
            return None
        hint = {f.name: f.type for f in fields(owner)}.get(leaf)
        return str(hint) if hint else None
    except Exception:
        return None


def _check_smoothing_weight(algo: Any) -> None:
    """Warn when alpha * max(beta_k) >= 1. Above the band the objective's gradient in H is
    lambda * (1 - beta_k * alpha): below 1 the smoothing only damps the entropy bonus there (the regime EPO's
    analysis assumes); at or above 1 it outweighs the bonus and pushes entropy down."""
    phase = algo.phase
    # the schedules algo.phase can take (its keys hold their parameters); every one of them is covered
    ramp = max(phase.beta_start, phase.beta_end)  # linear, cosine and delayed_linear end at their ends
    beta_max = {"paper": 2.0, "constant": phase.value, "linear": ramp, "cosine": ramp, "delayed_linear": ramp,
                "two_phase": max(phase.beta_start, phase.beta_peak, phase.beta_end)}.get(phase.schedule)
    alpha = algo.entropy_smoothing.alpha
    if beta_max is not None and alpha * beta_max >= 1.0:
        warnings.warn(f"algo.entropy_smoothing.alpha * max beta_k = {alpha} * {beta_max:g} >= 1: above the band "
                      "the smoothing penalty outweighs the entropy bonus and drives entropy down (EPO's analysis "
                      "assumes alpha * beta_max < 1; the paper uses alpha = 0.1).", stacklevel=2)


def _check_policy_loss(algo: Any) -> None:
    """Rules of the clip_cov / kl_cov policy losses that span keys (their ranges sit on the fields)."""
    if algo.policy_loss == "clip":
        return
    if "policy_clip" not in algo.loss_terms:
        raise ConfigError(f"algo.policy_loss={algo.policy_loss} replaces the policy_clip term, which is not in "
                          f"algo.loss_terms {list(algo.loss_terms)}; add it or leave algo.policy_loss=clip.")
    pc = algo.policy_clip
    if algo.policy_loss == "clip_cov" and pc.clip_cov_lb >= pc.clip_cov_ub:
        raise ConfigError(f"algo.policy_clip.clip_cov_lb ({pc.clip_cov_lb}) must be < clip_cov_ub ({pc.clip_cov_ub}).")
    if algo.policy_loss == "kl_cov":
        warnings.warn("algo.policy_loss=kl_cov has no ratio clip (its KL penalty on the high-covariance tokens "
                      "takes the clip's place): algo.policy_clip.clip_low, clip_high and dual_clip are not used.",
                      stacklevel=2)


def _check_components(cfg: DictConfig, registries: dict[str, list[str]]) -> None:
    """Settings of the selected components that their registries define: each coefficient's schedule must
    find its parameters in its section, and algo.components.<name> (a component registered with its own
    settings) is merged into its settings dataclass and checked with the same field rules as every schema."""
    from epo_cli.algos.advantages import ESTIMATORS
    from epo_cli.algos.losses import LOSS_TERMS
    from epo_cli.algos.schedules import ENTROPY_KEYS, PHASE_KEYS

    algo = cfg.algo
    _check_schedule("entropy", cfg.entropy, EntropyConfig, ENTROPY_KEYS)
    _check_schedule("algo.phase", algo.phase, PhaseConfig, PHASE_KEYS)
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


def _check_schedule(where: str, section: Any, schema: type, keys: dict[str, str]) -> None:
    """A coefficient's schedule must find all its parameters among its section's keys."""
    from epo_cli.algos.schedules import parameter_keys, usable_schedules

    section_keys = [f.name for f in fields(schema)]
    usable = usable_schedules(section_keys, keys)
    if section.schedule not in usable:
        missing = [k for k in parameter_keys(section.schedule, keys).values() if k not in section_keys]
        raise ConfigError(f"{where}.schedule={section.schedule} takes {', '.join(missing)}, which the '{where}' "
                          f"section has no key for. Schedules it can use: {', '.join(usable)}.")


def _check_consistency(cfg: DictConfig) -> None:
    """Rules that span keys (each field's own range is declared next to it and checked before this)."""
    algo = cfg.algo
    if algo.estimator == "auto":
        algo.estimator = {"ppo": "gae", "grpo": "grpo", "gigpo": "gigpo", "none": "none"}[algo.base]
    _check_policy_loss(algo)
    if algo.name != "sft" and algo.estimator == "none":
        raise ConfigError(f"algo={algo.name} needs an advantage estimator; set algo.estimator.")
    if algo.estimator in ("grpo", "rloo", "gigpo") and algo.group_size < 2:
        raise ConfigError(
            f"algo.estimator={algo.estimator} compares rollouts of the same task and needs "
            f"algo.group_size >= 2 (got {algo.group_size})."
        )
    # loss terms the estimator cannot feed would be silently skipped or see no advantages
    if "value" in algo.loss_terms and algo.estimator != "gae":
        raise ConfigError(f"algo.loss_terms has 'value' but algo.estimator={algo.estimator} trains no critic "
                          "(only gae does): remove 'value' from algo.loss_terms or set algo.estimator=gae.")
    if "policy_clip" in algo.loss_terms and algo.estimator == "none":
        raise ConfigError("algo.loss_terms has 'policy_clip' but algo.estimator=none computes no advantages: "
                          "set algo.estimator (gae, grpo, ...) or remove 'policy_clip'.")
    if algo.mini_batch_size % algo.micro_batch_size:
        raise ConfigError(
            f"algo.mini_batch_size={algo.mini_batch_size} must be divisible by algo.micro_batch_size="
            f"{algo.micro_batch_size} (each optimizer step is a whole number of micro-batches on every rank); "
            f"e.g. algo.mini_batch_size={-(-algo.mini_batch_size // algo.micro_batch_size) * algo.micro_batch_size}.")
    sm = algo.entropy_smoothing
    if sm.kappa_low >= sm.kappa_high:
        raise ConfigError(f"The smoothing band needs algo.entropy_smoothing.kappa_low < kappa_high (got "
                          f"{sm.kappa_low:g} and {sm.kappa_high:g}); the paper uses 0.0 and 2.0.")
    if algo.dynamic_sampling and algo.group_size < 2:
        raise ConfigError("algo.dynamic_sampling=true drops groups whose rollouts all scored the same and needs "
                          f"algo.group_size >= 2 (got {algo.group_size}); use it with grpo, rloo or gigpo.")
    if algo.pack_tokens and cfg.model.attn_implementation not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"algo.pack_tokens={algo.pack_tokens} needs an attention that keeps packed samples apart "
                          f"(model.attn_implementation=sdpa | flash_attention_2 | flash_attention_3, got "
                          f"'{cfg.model.attn_implementation}'); or set algo.pack_tokens=0 for padded micro-batches.")
    if "entropy_smoothing" in algo.loss_terms:
        _check_smoothing_weight(algo)
    if cfg.entropy.min_coef > cfg.entropy.max_coef:
        raise ConfigError(f"entropy.min_coef={cfg.entropy.min_coef:g} must be <= entropy.max_coef="
                          f"{cfg.entropy.max_coef:g}.")
    cur = cfg.curriculum
    if cur.demote_at is not None and cur.demote_at >= cur.promote_at:
        raise ConfigError(f"curriculum.demote_at={cur.demote_at:g} must be below curriculum.promote_at="
                          f"{cur.promote_at:g} (else a level is promoted and demoted at once).")
    if (cur.horizon or cur.name == "horizon") and cur.start_turns > cfg.env.max_turns:
        raise ConfigError(f"curriculum.start_turns={cur.start_turns} is above env.max_turns="
                          f"{cfg.env.max_turns}: the horizon would shrink, not grow. Lower start_turns.")
    model = cfg.model
    if model.hidden_size % model.num_attention_heads or model.num_attention_heads % model.num_key_value_heads:
        raise ConfigError(f"model.hidden_size={model.hidden_size} must be divisible by model.num_attention_heads="
                          f"{model.num_attention_heads}, and that by model.num_key_value_heads="
                          f"{model.num_key_value_heads}.")
    context = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    if not model.path and model.max_position_embeddings < context:
        raise ConfigError(f"model.max_position_embeddings={model.max_position_embeddings} is below "
                          f"rollout.max_prompt_tokens + rollout.max_new_tokens = {context}: a prompt and its "
                          f"response would not fit the tiny model's positions. Raise it (e.g. "
                          f"model.max_position_embeddings={max(2048, context)}) or lower the token limits.")
    if model.padded_vocab_size is not None and model.padded_vocab_size < model.vocab_size:
        raise ConfigError(f"model.padded_vocab_size={model.padded_vocab_size} is below model.vocab_size="
                          f"{model.vocab_size}: the embedding needs a row per token. Raise it or set null.")
    if model.path:
        changed = [f.name for f in fields(ModelConfig) if f.name in TINY_SIZE_KEYS and model[f.name] != f.default]
        if changed:
            warnings.warn(f"model.path is set, so the tiny-model sizes {', '.join('model.' + k for k in changed)} "
                          "are ignored (the model's own config.json defines its shape).", stacklevel=2)
    ds = cfg.deepspeed
    if ds.offload_param and ds.zero_stage != 3:
        raise ConfigError(f"deepspeed.offload_param=true needs deepspeed.zero_stage=3 (got {ds.zero_stage}): "
                          "only ZeRO-3 partitions the parameters it would offload.")
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer=true needs deepspeed.zero_stage >= 1 (ZeRO-0 keeps the "
                          "optimizer on the device).")
    _warn_unused_settings(cfg)
    tr = cfg.trainer
    if tr.stop_after is not None and tr.stop_after >= tr.total_steps:
        warnings.warn(f"trainer.stop_after={tr.stop_after} >= trainer.total_steps={tr.total_steps}: the run "
                      "ends at total_steps first, so stop_after has no effect.", stacklevel=2)
    get_template(cfg.env.prompt_template)  # ConfigError listing the template names


def _warn_unused_settings(cfg: DictConfig) -> None:
    """One warning when a setting was changed from its default but nothing in this run reads it (e.g.
    algo.entropy_smoothing.alpha under algo=grpo, whose loss has no smoothing term)."""
    algo = cfg.algo
    terms = list(algo.loss_terms)
    checks = [  # (section, its schema, the keys only that part reads (None: all), is it used, why not)
        ("algo.entropy_smoothing", SmoothingConfig, ("alpha", "kappa_low", "kappa_high", "aggregation"),
         "entropy_smoothing" in terms, "'entropy_smoothing' is not in algo.loss_terms"),
        ("entropy", EntropyConfig, None, "entropy" in terms or "entropy_smoothing" in terms,
         "lambda weights only the 'entropy' and 'entropy_smoothing' terms, and neither is in algo.loss_terms"),
        ("algo.policy_clip", PolicyClipConfig, None, "policy_clip" in terms, "'policy_clip' is not in algo.loss_terms"),
        ("algo.kl", KLConfig, ("coef", "estimator", "aggregation"), "kl" in terms, "'kl' is not in algo.loss_terms"),
        ("algo.value", ValueConfig, None, algo.estimator == "gae", f"algo.estimator={algo.estimator} has no critic"),
        ("algo.gae", GAEConfig, None, algo.estimator == "gae", f"algo.estimator={algo.estimator} is not gae"),
        ("algo", AlgoConfig, ("demos", "demo_episodes", "demo_level"), algo.name == "sft",
         f"algo={algo.name} does not behaviour-clone"),
        ("model.lora", LoraConfig, ("alpha", "dropout", "target_modules"), cfg.model.lora.rank > 0,
         "model.lora.rank=0 fine-tunes all weights"),
        ("launcher", LauncherConfig, ("num_gpus", "num_nodes", "num_procs", "hostfile"), cfg.launcher.name != "local",
         "launcher=local runs one process; start ranks with launcher=deepspeed or launcher=slurm"),
        ("launcher", LauncherConfig, ("partition", "time_min", "cpus_per_task", "account"),
         cfg.launcher.name == "slurm", "these configure launcher=slurm"),
    ]
    for section, schema, names, used, why in checks:
        if used:
            continue
        node, defaults = OmegaConf.select(cfg, section), schema()
        changed = [n for n in (names or [f.name for f in fields(schema)]) if node[n] != getattr(defaults, n)]
        if changed:
            warnings.warn(f"{', '.join(f'{section}.{n}={node[n]}' for n in changed)}: no effect in this run "
                          f"({why}).", stacklevel=3)


