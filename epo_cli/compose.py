"""Composition and validation of a run's config: Hydra over conf/, merged into the schemas of config.py.

`compose(overrides)` runs Hydra's compose API over conf/, then `validate` merges the result into the
dataclass schemas (the env section into the schema of env.name). Any unknown key, unknown group option or
wrong type fails here, before any work starts, with one `ConfigError` that names the key and the valid
choices. Then, in order:
    check_field_rules       each field's declared range and valid values (registry fields: the names the
                            registries hold)
    _check_sections         the rules that span the keys of a section (batch sizes, model shape, ZeRO, the
                            curriculum's: epo_cli.training.curriculum.check_curriculum)
    _check_components       each component the config names: its registry entry's `check`; the coefficient
                            schedules; algo.components.<name> against the component's settings dataclass
    _warn_unused_settings   one line per reason when a changed setting is read by nothing this run uses: the
                            keys each component reads come from its registry entry (Entry.reads, its
                            coefficient's schedule), the rest from `_switches`
No table here names a component: a new estimator, loss term or schedule is seen through its registry entry.

This module sits above config.py, the component packages (algos, envs, curriculum) and their registries,
so none of them imports it: config -> errors; algos, envs -> config; compose -> config, algos, envs,
curriculum. Nothing it imports loads torch.
"""

from __future__ import annotations

import difflib
import re
import warnings
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

from omegaconf import BooleanNode, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from epo_cli.algos import REGISTRIES
from epo_cli.algos.registries import ESTIMATORS, LOSS_TERMS, coef_factors
from epo_cli.algos.schedules import (
    KL_SCHEDULES,
    build_schedule,
    coefficient_schedule,
    parameter_keys,
    usable_schedules,
)
from epo_cli.config import (
    GROUPS,
    TINY_SIZE_KEYS,
    ModelConfig,
    RunConfig,
    check_field_rules,
    check_number_sizes,
    config_dir,
    group_options,
    is_sft,
    parse_bool,
)
from epo_cli.envs import env_config_class
from epo_cli.errors import ConfigError
from epo_cli.registry import Registry
from epo_cli.rollout.prompts import get_template
from epo_cli.training.curriculum import CURRICULA, check_curriculum, check_levels_fit
from epo_cli.training.memory import check_memory

#: every registry a `one_of(registry=...)` field may name
_REGISTRIES: dict[str, Registry] = {**REGISTRIES, "curricula": CURRICULA}


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
        node = match.default_factory() if match.default_factory is not MISSING else None  # type: ignore[misc]
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
        folder, option = m.group(1), m.group(2)
        group, _, sub = folder.partition("/")  # a preset in a subfolder: experiment=paper/<name>
        prefix = f"{sub}/" if sub else ""
        options = [prefix + o for o in group_options(folder)] if (config_dir() / folder).is_dir() else []
        close = difflib.get_close_matches(prefix + option, options, n=1)
        hint = f" Did you mean '{group}={close[0]}'?" if close else ""
        return ConfigError(
            f"Unknown option '{prefix}{option}' for config group '{group}'.{hint}\n"
            f"Valid options{f' in {folder}/' if sub else f' for {group}'}: {', '.join(options)}."
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
    quote = re.search(r"(?:LexerNoViableAltException|token recognition error)[^\n]*?([\w.+/~\-]+)=(.*)", text)
    if quote and re.search(r"[^\x21-\x7e]", quote.group(2)):
        key, value = quote.group(1).lstrip("+"), quote.group(2).strip()
        return ConfigError(f"The value of '{key}' holds a space or a non-ASCII character, which an override must "
                           f"quote. Quote it twice, once for the shell and once for the override: "
                           f"'{key}=\"{value}\"' (a path with a space given unquoted is split into two arguments "
                           "by the shell).")
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
    for i, o in enumerate(overrides):
        key = o.split("=", 1)[0]
        if "=" not in o and not key.startswith("~"):
            before = overrides[i - 1] if i else ""
            hint = (f" If it is the rest of a value with a space ({before} {o}), quote the value: "
                    f"'{before.split('=', 1)[0]}=\"{before.split('=', 1)[1]} {o}\"'." if "=" in before else "")
            raise ConfigError(f"'{o}' is not an override: overrides look like group=option or "
                              f"section.key=value.{hint}")
        if key.startswith("~"):
            what = key[1:]
            fix = (f"choose one of its options ({what}=<option>)" if what in GROUPS else
                   f"set it ({what}=<value>, or {what}=null where null is allowed)")
            raise ConfigError(f"'{o}' would delete {what}, which every run has: its defaults would come back "
                              f"without a word. To change it, {fix}.")
        plain = key.lstrip("+")
        is_group = plain in GROUPS or "/" in plain
        value = o.split("=", 1)[1].strip() if "=" in o else ""
        if is_group and value.startswith("[") and not plain.startswith("hydra"):
            raise ConfigError(f"'{o}' selects several options of the config group '{plain}'; a run takes one (Hydra "
                              f"would merge them into one config without a word). Choose one ({plain}=<option>); "
                              f"to run each, use a sweep: epo sweep {plain}={value.strip('[]')}.")
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
        # a ${required:...} value is the command line's to give, not a setting of the preset
        return [] if REQUIRED.match(str(node)) else [prefix.rstrip(".")]

    return {key: f"experiment={chosen[-1]}" for key in leaves(data, "") if key not in given}


def blame_preset(message: str, preset: dict[str, str]) -> str:
    """`message` with a note naming the preset that set the keys it mentions (the user did not set them)."""
    # a key the message is about, not one of the valid keys or values it lists ("Valid keys in 'env': name, ...")
    about = "\n".join(line for line in message.splitlines() if not line.startswith("Valid "))
    named = [key for key in preset if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", about)]
    if not named:
        return message
    keys = ", ".join(named)
    if "Unknown config key" in message:  # the user's selection took the key away: only dropping one helps
        message = message.replace("\nFix the override, or run `epo config show` to see every key and its value.", "")
        return (f"{message}\n(note: {keys} {'is' if len(named) == 1 else 'are'} set by the preset "
                f"{preset[named[0]]}, not on this command line: the preset is made for other selections than "
                "this command line's. Drop the preset or the selection that does not fit it.)")
    return (f"{message}\n(note: {keys} {'is' if len(named) == 1 else 'are'} set by the preset {preset[named[0]]}, "
            "not on this command line: the preset does not fit the other selections; drop one of them, or set "
            f"{named[0]}=<value> yourself.)")


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
        raise ConfigError(_unknown_key_message(err.full_key, env_name)) from None
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
    registries = {key: registry.names() for key, registry in _REGISTRIES.items()}
    check_field_rules(cfg, RunConfig, registries=registries, schemas={"env": env_config_class(env_name)})
    if cfg.algo.estimator == "auto":
        cfg.algo.estimator = _auto_estimator(cfg.algo.base)
    _check_sections(cfg)
    _check_components(cfg, registries)
    _warn_unused_settings(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg


#: a value a preset leaves to the command line: `key: ${required:what to give}` (e.g. the policy to start from)
REQUIRED = re.compile(r"^\$\{required:(.*)\}$", re.S)


def check_required(raw: DictConfig, prefix: str = "") -> None:
    """A `${required:...}` value the command line did not replace: one ConfigError naming the key and what
    to give (e.g. experiment=improve_on_teacher without model.path would train a random model)."""
    for key in raw:
        node = raw._get_node(key)
        if isinstance(node, DictConfig):
            check_required(node, f"{prefix}{key}.")
        elif OmegaConf.is_interpolation(raw, key):
            found = REQUIRED.match(str(node._value()))
            if found:
                what = found.group(1).strip().strip("\"'")
                raise ConfigError(f"{prefix}{key} must be given on the command line: {what}.")


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
        owner = _dataclass_at(parent, "household")
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


def _check_sections(cfg: DictConfig) -> None:
    """Rules that span the keys of a section (each field's own range is declared next to it and checked
    before this; a component's own rules are its registry entry's `check`)."""
    algo = cfg.algo
    if not algo.loss_terms:
        raise ConfigError("algo.loss_terms is empty: the policy would have no loss to train on. Give at least one "
                          f"term, e.g. algo.loss_terms=[{'nll' if is_sft(algo) else 'policy_clip'}] (terms: "
                          f"{', '.join(LOSS_TERMS.names())}).")
    if not str(algo.demos).strip():
        raise ConfigError("algo.demos is empty. Give algo.demos=expert (demonstrations played by the env's expert) "
                          "or the path of a JSONL file of trajectories.")
    if algo.intrinsic.coef > algo.reward_scale:
        raise ConfigError(f"algo.intrinsic.coef={algo.intrinsic.coef:g} is above algo.reward_scale="
                          f"{algo.reward_scale:g}, the reward of a success: a single new observation would pay "
                          "more than solving the task, which teaches wandering. Use a value <= algo.reward_scale "
                          "(the default bonus is 0.1).")
    if cfg.model.lora.rank > 0 and not cfg.model.lora.target_modules:
        raise ConfigError(f"model.lora.target_modules is empty while model.lora.rank={cfg.model.lora.rank}: LoRA "
                          "would adapt no layer. Name the modules (default [q_proj,k_proj,v_proj,o_proj]), or set "
                          "model.lora.rank=0 for full fine-tuning.")
    check_best_metric(cfg)
    if not is_sft(algo) and algo.estimator == "none":
        raise ConfigError(f"algo={algo.name} needs an advantage estimator; set algo.estimator.")
    if is_sft(algo) and algo.estimator != "none":
        raise ConfigError(f"algo.base=none trains by behaviour cloning on demonstrations, which have no rollouts "
                          f"to estimate advantages from, so algo.estimator={algo.estimator} cannot be used: give "
                          "the algorithm an RL base (algo.base=ppo|grpo|gigpo), or train algo=sft.")
    if algo.mini_batch_size % algo.micro_batch_size:
        raise ConfigError(
            f"algo.mini_batch_size={algo.mini_batch_size} must be divisible by algo.micro_batch_size="
            f"{algo.micro_batch_size} (each optimizer step is a whole number of micro-batches on every rank); "
            f"e.g. algo.mini_batch_size={-(-algo.mini_batch_size // algo.micro_batch_size) * algo.micro_batch_size}.")
    if algo.dynamic_sampling and algo.group_size < 2:
        raise ConfigError("algo.dynamic_sampling=true filters groups of rollouts of the same task and needs "
                          f"algo.group_size >= 2 (got {algo.group_size}); use it with grpo, rloo or gigpo.")
    diag = algo.diagnostics
    if diag.alert_entropy_low is not None and diag.alert_entropy_high is not None \
            and diag.alert_entropy_low >= diag.alert_entropy_high:
        raise ConfigError(f"algo.diagnostics.alert_entropy_low={diag.alert_entropy_low:g} must be below "
                          f"alert_entropy_high={diag.alert_entropy_high:g} (the alert band around the reference).")
    if algo.pack_tokens and cfg.model.attn_implementation not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"algo.pack_tokens={algo.pack_tokens} needs an attention that keeps packed samples apart "
                          f"(model.attn_implementation=sdpa | flash_attention_2 | flash_attention_3, got "
                          f"'{cfg.model.attn_implementation}'); or set algo.pack_tokens=0 for padded micro-batches.")
    if cfg.entropy.min_coef > cfg.entropy.max_coef:
        raise ConfigError(f"entropy.min_coef={cfg.entropy.min_coef:g} must be <= entropy.max_coef="
                          f"{cfg.entropy.max_coef:g}.")
    check_curriculum(cfg.curriculum, cfg.env.max_turns)
    check_levels_fit(cfg)
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
                          "are ignored (the model's own config.json defines its shape).", stacklevel=3)
    ds = cfg.deepspeed
    if ds.offload_param and ds.zero_stage != 3:
        raise ConfigError(f"deepspeed.offload_param=true needs deepspeed.zero_stage=3 (got {ds.zero_stage}): "
                          "only ZeRO-3 partitions the parameters it would offload.")
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer=true needs deepspeed.zero_stage >= 1 (ZeRO-0 keeps the "
                          "optimizer on the device).")
    tr = cfg.trainer
    if tr.stop_after is not None and tr.stop_after >= tr.total_steps:
        warnings.warn(f"trainer.stop_after={tr.stop_after} >= trainer.total_steps={tr.total_steps}: the run "
                      "ends at total_steps first, so stop_after has no effect.", stacklevel=3)
    get_template(cfg.env.prompt_template)  # ConfigError listing the template names
    check_memory(cfg)  # last: the sizes are known to be consistent


# ----------------------------------------------------------------------------------------------------
# Components: the config names them (a `one_of(registry=...)` field); their registry entries say the rest
# ----------------------------------------------------------------------------------------------------

def _named_components(cfg: DictConfig) -> list[tuple[str, str, list[str]]]:
    """(key, registry, the component names its value holds) for every field of the schemas (algo.components'
    included) whose values are names in a registry (`one_of(registry=...)`)."""
    found = []

    def walk(node: Any, schema: type, prefix: str) -> None:
        for f in fields(schema):
            nested = env_config_class(cfg.env.name) if (schema is RunConfig and f.name == "env") else _section_class(f)
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


def _section_class(f: Any) -> type | None:
    """The schema of a field that is a section (a dataclass made by its default_factory), else None."""
    if f.default_factory is MISSING:
        return None
    made = f.default_factory()
    return type(made) if is_dataclass(made) else None


def _own_settings_class(name: str) -> type | None:
    for registry in (LOSS_TERMS, ESTIMATORS):
        if name in registry and registry.entry(name).sections is None:
            return registry.config_class(name)
    return None


def _check_components(cfg: DictConfig, registries: dict[str, list[str]]) -> None:
    """The components the config names: each coefficient's schedule must find its parameters in its section
    and is built (its own checks); every named component's registry entry runs its `check`; and
    algo.components.<name> (a component registered with its own settings) is merged into its settings
    dataclass and checked with the same field rules as every schema."""
    for factor in ("lambda", "beta"):
        _check_schedule(cfg, factor)
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


def _check_schedule(cfg: DictConfig, factor: str) -> None:
    """A coefficient's schedule must find all its parameters among its section's keys, and take them."""
    key, name, section, keys = coefficient_schedule(factor, cfg)
    schema = _dataclass_at(section, "household")
    section_keys = [f.name for f in fields(schema)]
    usable = usable_schedules(section_keys, keys)
    if name not in usable:
        missing = [k for k in parameter_keys(name, keys).values() if k not in section_keys]
        raise ConfigError(f"{key}={name} takes {', '.join(missing)}, which the '{section}' section has no key "
                          f"for. Schedules it can use: {', '.join(usable)}.")
    try:
        build_schedule(name, OmegaConf.select(cfg, section), keys)
    except ValueError as err:
        raise ConfigError(f"{key}={name}: {err}.") from None


# ----------------------------------------------------------------------------------------------------
# Settings this run does not read
# ----------------------------------------------------------------------------------------------------

@dataclass
class _Part:
    """Something that reads `keys` (a key names itself and every key under it) only when this run uses it:
    a component, used when the key `choice[0]` names it (`choice[1]`) and that key is read itself; or
    anything else, used when `on`."""

    keys: tuple[str, ...]
    choice: tuple[str, str] | None = None
    on: bool = False
    why: str = ""  # why it is not used, for a part without a choice


def _switches(cfg: DictConfig) -> list[tuple[tuple[str, ...], bool, str]]:
    """Settings read only when a switch of the schema is on: (keys, is it on, why not). A component's own
    settings are not listed here: its registry entry says which keys it reads."""
    algo, cur, launcher, env, diag = cfg.algo, cfg.curriculum, cfg.launcher.name, cfg.env, cfg.algo.diagnostics
    no_rollouts = f"algo={algo.name} plays no rollouts to reward"
    in_process = "env.num_workers=0 steps the envs in the training process, so no worker runs meanwhile"
    return [
        (("algo.demos",), is_sft(algo), f"algo={algo.name} does not behaviour-clone"),
        (("algo.demo_episodes", "algo.demo_level", "algo.demo_slip"), is_sft(algo) and algo.demos == "expert",
         "algo.demos is a file: its trajectories are the data" if is_sft(algo)
         else f"algo={algo.name} does not behaviour-clone"),
        (("algo.dynamic_sampling_max_rounds", "algo.group_filter"), algo.dynamic_sampling,
         "algo.dynamic_sampling=false"),
        (tuple(f"algo.diagnostics.{k}" for k in ("mi_every", "alert_entropy_low", "alert_entropy_high",
                                                  "alert_diversity")),
         diag.enabled, "algo.diagnostics.enabled=false"),
        (("algo.diagnostics.mi_samples", "algo.diagnostics.alert_mi"), diag.enabled and diag.mi_every > 0,
         "algo.diagnostics.mi_every=0 never measures MI" if diag.enabled else "algo.diagnostics.enabled=false"),
        (("algo.intrinsic.kind",), not is_sft(algo), no_rollouts),
        (("algo.intrinsic.coef", "algo.intrinsic.decay"), not is_sft(algo) and algo.intrinsic.kind != "none",
         no_rollouts if is_sft(algo) else "algo.intrinsic.kind=none adds no bonus"),
        (("algo.monitor.clamp_scale",), algo.monitor.action == "clamp", f"algo.monitor.action={algo.monitor.action}"),
        (("model.lora.alpha", "model.lora.dropout", "model.lora.target_modules"), cfg.model.lora.rank > 0,
         "model.lora.rank=0 fine-tunes all weights"),
        (("launcher.num_gpus", "launcher.num_nodes", "launcher.num_procs", "launcher.hostfile"), launcher != "local",
         "launcher=local runs one process; start ranks with launcher=deepspeed or launcher=slurm"),
        (("launcher.partition", "launcher.time_min", "launcher.cpus_per_task", "launcher.account"),
         launcher == "slurm", "these configure launcher=slurm"),
        (("rollout.overlap", "env.step_timeout_s"), env.num_workers != 0, in_process),
        (("curriculum.start_turns", "curriculum.horizon_share"), cur.horizon or cur.name == "horizon",
         "curriculum.horizon=false"),
        (("curriculum.subgoal_coef", "curriculum.subgoal_decay_share"),
         cur.subgoal_rewards or cur.name == "subgoal_rewards", "curriculum.subgoal_rewards=false"),
    ]


def _parts(cfg: DictConfig) -> list[_Part]:
    """Everything that reads settings only when this run uses it: the components the registries hold (an
    entry's `reads`), the schedules of the loss coefficients, and the switches above."""
    parts = []
    for key, registry, _ in _named_components(cfg):
        if registry in ("schedules", "kl_schedules"):
            continue  # the keys a schedule reads depend on its section: see the coefficients below
        for name in _REGISTRIES[registry].names():
            reads = tuple(k for k in _REGISTRIES[registry].reads(name) if not k.startswith("algo.components."))
            if reads:  # algo.components.<name>: _check_components warns about those
                parts.append(_Part(reads, choice=(key, name)))
    for factor in ("lambda", "beta", "kl"):  # the loss coefficients' schedules: entropy group, algo.phase, KL
        key, _, section, keys = coefficient_schedule(factor, cfg)
        weighted = [name for name in LOSS_TERMS.names() if factor in coef_factors(LOSS_TERMS.entry(name).coef)[1]]
        terms = " and ".join(f"'{name}'" for name in weighted)
        many = len(weighted) > 1
        parts.append(_Part((key,), on=any(name in cfg.algo.loss_terms for name in weighted),
                           why=f"{factor} weights only the {terms} term{'s' if many else ''}, and "
                               f"{'neither is' if many else 'it is not'} in algo.loss_terms"))
        if factor == "kl":
            for name in KL_SCHEDULES.names():
                schedule, where, kl_keys = KL_SCHEDULES[name]
                reads = tuple(f"algo.{where}.{k}" for k in parameter_keys(schedule, kl_keys).values())
                parts.append(_Part(reads, choice=(key, name)))
        else:
            section_keys = [f.name for f in fields(_dataclass_at(section, "household"))]
            for name in usable_schedules(section_keys, keys):
                reads = tuple(f"{section}.{k}" for k in parameter_keys(name, keys).values())
                parts.append(_Part(reads, choice=(key, name)))
    parts += [_Part(keys, on=on, why=why) for keys, on, why in _switches(cfg)]
    return parts


def _covers(owner: str, key: str) -> bool:
    return key == owner or key.startswith(owner + ".")


def _names(value: Any) -> list[str]:
    return [str(v) for v in value] if OmegaConf.is_list(value) else [str(value)]


def _warn_unused_settings(cfg: DictConfig) -> None:
    """One warning line per reason when settings were changed from their defaults but nothing this run uses
    reads them (e.g. algo.gigpo.step_weight under algo.estimator=grpo, or algo.entropy_smoothing.alpha when
    algo.loss_terms has no entropy_smoothing term). A key that no part claims is read by the core: never
    warned about."""
    parts = _parts(cfg)
    used: set[int] = set()

    def owners(key: str) -> list[int]:
        return [i for i, part in enumerate(parts) if any(_covers(k, key) for k in part.keys)]

    def read(key: str) -> bool:
        return not owners(key) or any(i in used for i in owners(key))

    def chosen(part: _Part) -> bool:
        return part.choice is not None and part.choice[1] in _names(OmegaConf.select(cfg, part.choice[0]))

    grew = True
    while grew:  # a part may be named by a key that only another part reads (algo.policy_loss: policy_clip)
        grew = False
        for i, part in enumerate(parts):
            if i not in used and (part.on if part.choice is None else chosen(part) and read(part.choice[0])):
                used.add(i)
                grew = True

    def reason(key: str, seen: frozenset[str] = frozenset()) -> str:
        unused = [parts[i] for i in owners(key) if i not in used]
        # named, but by a key nothing reads: that key's reason is this one's
        named = [part.choice[0] for part in unused if chosen(part) and part.choice[0] not in seen]  # type: ignore[index]
        if named:
            return "; ".join(dict.fromkeys(reason(choice, seen | {key}) for choice in named))
        alternatives: dict[str, list[str]] = {}  # choice key -> the names that would read it
        texts = []
        for part in unused:
            if part.choice is None:
                texts.append(part.why)
            elif OmegaConf.is_list(OmegaConf.select(cfg, part.choice[0])):
                texts.append(f"'{part.choice[1]}' is not in {part.choice[0]}")
            else:
                alternatives.setdefault(part.choice[0], []).append(part.choice[1])
        if alternatives:
            texts.insert(0, "read only with " + " or ".join(f"{k}={'|'.join(v)}" for k, v in alternatives.items()))
        return "; ".join(dict.fromkeys(texts))

    unread: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for part in parts for k in part.keys):
        for leaf, default in _leaves(key, cfg.env.name):
            value = OmegaConf.select(cfg, leaf)
            if value != default and not read(leaf):
                unread.setdefault(reason(leaf), []).append(f"{leaf}={value}")
    for why, settings in unread.items():
        warnings.warn(f"{', '.join(dict.fromkeys(settings))}: no effect in this run ({why}).", stacklevel=3)


def _leaves(key: str, env_name: str) -> list[tuple[str, Any]]:
    """(dotted key, schema default) of `key` or, for a section, of every key under it."""
    parent, _, leaf = key.rpartition(".")
    owner = _dataclass_at(parent, env_name)
    if owner is None:
        return []
    field = {f.name: f for f in fields(owner)}.get(leaf)
    if field is None:
        return []
    nested = _dataclass_at(key, env_name)
    if nested is not None:
        return [pair for f in fields(nested) for pair in _leaves(f"{key}.{f.name}", env_name)]
    default = field.default if field.default is not MISSING else field.default_factory()  # type: ignore[misc]
    return [(key, default)]
