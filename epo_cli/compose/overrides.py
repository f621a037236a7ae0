"""The command line's overrides: what Hydra is given, and Hydra's errors in the user's words.

    check_override_forms    what Hydra would accept but drop or change without a word (a group given twice,
                            `~key`, a list of options for one run)
    hydra_overrides         key=value becomes ++key=value, so every key of the typed schemas can be set
    translate_hydra_error   Hydra's exception -> one ConfigError naming the override and the valid choices
    unknown_key_message     an unknown key: the closest valid one, and the keys of its section
    preset_settings         the settings an experiment preset sets, so that messages about them name it
    blame_preset            (blame_preset adds that note)
    check_required          a preset's ${required:...} value the command line did not give

epo_cli/compose/ composes and validates; this module only reads overrides and explains Hydra. Nothing it
imports loads torch.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.config import GROUPS, RENAMED_KEYS, RENAMED_VALUES, config_dir, group_options, schema_at
from epo_cli.envs import env_config_class
from epo_cli.errors import ConfigError


def unknown_key_message(full_key: str, env_name: str) -> str:
    """An unknown key: the closest valid one and the keys of its section (or the new name of a renamed key)."""
    if full_key in RENAMED_KEYS:
        return (f"Unknown config key '{full_key}': it was renamed to {RENAMED_KEYS[full_key]} (a run saved with "
                "the old name still loads). Use that name.")
    parent, _, leaf = full_key.rpartition(".")
    owner = schema_at(parent, env_config_class(env_name))
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


def check_renamed_values(cfg: DictConfig) -> None:
    """A value renamed since (RENAMED_VALUES, e.g. algo.kl.schedule=two_phase): its new name, not the list
    of valid values."""
    for key, renamed in RENAMED_VALUES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and value in renamed:
            raise ConfigError(f"{key}={value} was renamed to {renamed[value]} (a run saved with the old name "
                              f"still loads). Use {key}={renamed[value]}.")


def translate_hydra_error(err: Exception) -> ConfigError:
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
        return ConfigError(unknown_key_message(m.group(1), "household"))
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


def blame_preset(message: str, preset: dict[str, str], warning: bool = False) -> str:
    """`message` with a note naming the preset that set the keys it mentions (the user did not set them).
    `warning`: the message is a warning, so the run goes on and the note only says where the value came from."""
    # a key the message is about, not one of the valid keys or values it lists ("Valid keys in 'env': name, ...")
    about = "\n".join(line for line in message.splitlines() if not line.startswith("Valid "))
    named = [key for key in preset if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", about)]
    if not named:
        return message
    keys = ", ".join(named)
    if warning:
        return (f"{message} (note: {keys} {'is' if len(named) == 1 else 'are'} set by the preset "
                f"{preset[named[0]]}, not on this command line.)")
    if "Unknown config key" in message:  # the user's selection took the key away: only dropping one helps
        message = message.replace("\nFix the override, or run `epo config show` to see every key and its value.", "")
        return (f"{message}\n(note: {keys} {'is' if len(named) == 1 else 'are'} set by the preset "
                f"{preset[named[0]]}, not on this command line: the preset is made for other selections than "
                "this command line's. Drop the preset or the selection that does not fit it.)")
    return (f"{message}\n(note: {keys} {'is' if len(named) == 1 else 'are'} set by the preset {preset[named[0]]}, "
            "not on this command line: the preset does not fit the other selections; drop one of them, or set "
            f"{named[0]}=<value> yourself.)")



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
