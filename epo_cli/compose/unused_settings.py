"""Settings this run does not read: one warning line per reason when a setting was changed from its default
but nothing the run uses reads it (e.g. algo.gigpo.step_weight under algo.estimator=grpo).

Which keys a part of the run reads comes from where that part is declared, never from a table here:
    a component          its registry entry (Entry.reads, or where its settings are); used when the key that
                         names it does and that key is read itself (algo.policy_loss only with policy_clip)
    a loss coefficient   each weight of schedules.WEIGHTS (lambda, beta_k, the KL weight) is read when a term
                         in algo.loss_terms names it (its Entry.coef's parameters); of its section, only the
                         parameters of the schedule it names
    a switch             the `switches` of the schema section that holds it (epo_cli/config.py: Switch)
A key no part claims is read by the training loop itself and never warned about. Nothing here loads torch.

Top to bottom: warn_unused_settings lists the parts (_parts), finds those this run uses (_used_parts, a fixpoint),
then groups each changed setting (_changed_settings) that no used part reads (_is_read) by its reason (_reason).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.algos.registries import LOSS_TERMS, coef_weights
from epo_cli.algos.schedules import WEIGHTS, schedule_parameters
from epo_cli.config import RunConfig, Switch, schema_at, section_schema
from epo_cli.envs import env_config_class
from epo_cli.registry import Registry


@dataclass
class _Part:
    """Something that reads `keys` (a key names itself and every key under it) only when this run uses it:
    a component, used when the key `choice[0]` names it (`choice[1]`) and that key is read itself; or
    anything else, used when `on`."""

    keys: tuple[str, ...]
    choice: tuple[str, str] | None = None
    on: bool = False
    why: str = ""  # why it is not used, for a part without a choice


def warn_unused_settings(cfg: DictConfig, named: list[tuple[str, str, list[str]]],
                         registries: dict[str, Registry]) -> None:
    """One warning line per reason when settings were changed from their defaults but nothing this run uses
    reads them (e.g. algo.gigpo.step_weight under algo.estimator=grpo, or algo.entropy_smoothing.alpha when
    algo.loss_terms has no entropy_smoothing term). A key that no part claims is read by the core: never
    warned about. `named`: (key, registry, names) for each key that names components; `registries`: the
    registries by the names the schemas give them."""
    parts = _parts(cfg, named, registries)
    used = _used_parts(cfg, parts)
    unread: dict[str, list[str]] = {}  # reason -> the settings it explains, in the parts' order
    for leaf, value in _changed_settings(cfg, parts):
        if not _is_read(leaf, parts, used):
            unread.setdefault(_reason(leaf, cfg, parts, used), []).append(f"{leaf}={value}")
    for why, settings in unread.items():
        warnings.warn(f"{', '.join(dict.fromkeys(settings))}: no effect in this run ({why}).", stacklevel=3)


def _parts(cfg: DictConfig, named: list[tuple[str, str, list[str]]], registries: dict[str, Registry]) -> list[_Part]:
    """Everything that reads settings only when this run uses it: the components the registries hold (an
    entry's `reads`; `named` lists the keys that name them), the schedules of the loss's weights, and the
    schemas' switches."""
    parts = []
    for key, registry, _ in named:
        if registry in ("schedules", "kl_schedules"):
            continue  # the keys a schedule reads are its parameters in its section: see the weights below
        for name in registries[registry].names():
            reads = tuple(k for k in registries[registry].reads(name) if not k.startswith("algo.components."))
            if reads:  # algo.components.<name>: compose warns about those
                parts.append(_Part(reads, choice=(key, name)))
    for name, weight in WEIGHTS.items():  # lambda: the entropy group; beta: algo.phase; kl: algo.kl.schedule's
        weighted = [term for term in LOSS_TERMS.names() if name in coef_weights(LOSS_TERMS.entry(term).coef)]
        terms = " and ".join(f"'{term}'" for term in weighted)
        many = len(weighted) > 1
        parts.append(_Part((weight.key,), on=any(term in cfg.algo.loss_terms for term in weighted),
                           why=f"{weight.symbol} weights only the {terms} term{'s' if many else ''}, and "
                               f"{'neither is' if many else 'it is not'} in algo.loss_terms"))
        for schedule in weight.choices():
            reads = tuple(f"{weight.section(schedule)}.{p}" for p in schedule_parameters(schedule, weight.registry))
            parts.append(_Part(reads, choice=(weight.key, schedule)))
    parts += [_Part(switch.keys, on=switch.on(cfg), why=switch.why(cfg)) for switch in switches(cfg)]
    return parts


def switches(cfg: DictConfig) -> list[Switch]:
    """The switch rules of every section of the schemas (a section's `switches`), each section before those
    it holds."""
    found: list[Switch] = []

    def walk(schema: type) -> None:
        found.extend(getattr(schema, "switches", ()))
        for f in fields(schema):
            nested = env_config_class(cfg.env.name) if (schema is RunConfig and f.name == "env") else section_schema(f)
            if nested is not None:
                walk(nested)

    walk(RunConfig)
    return found


def _used_parts(cfg: DictConfig, parts: list[_Part]) -> set[int]:
    """The indices of the parts this run uses: a part without a choice when it is `on`, a component when its
    key names it and that key is read. Repeated until nothing more is added, since a component may be named
    by a key that only another part reads (algo.policy_loss is read only with policy_clip)."""
    used: set[int] = set()
    grew = True
    while grew:
        grew = False
        for i, part in enumerate(parts):
            if i not in used and (part.on if part.choice is None
                                  else _chosen(part, cfg) and _is_read(part.choice[0], parts, used)):
                used.add(i)
                grew = True
    return used


def _is_read(key: str, parts: list[_Part], used: set[int]) -> bool:
    """Whether this run reads `key`: no part claims it (the training loop reads it), or a used part does."""
    owners = _owners(key, parts)
    return not owners or any(i in used for i in owners)


def _owners(key: str, parts: list[_Part]) -> list[int]:
    """The indices of the parts that read `key` (one of their keys is `key` or a section above it)."""
    return [i for i, part in enumerate(parts) if any(_covers(k, key) for k in part.keys)]


def _covers(owner: str, key: str) -> bool:
    """Whether a part that reads `owner` reads `key`: the same key, or a key in the section `owner`."""
    return key == owner or key.startswith(owner + ".")


def _chosen(part: _Part, cfg: DictConfig) -> bool:
    """Whether `part` is a component that its key names in this run (used or not: that key may be unread)."""
    return part.choice is not None and part.choice[1] in _names(OmegaConf.select(cfg, part.choice[0]))


def _names(value: Any) -> list[str]:
    """The component names a naming key's value gives: one name, or each of a list's."""
    return [str(v) for v in value] if OmegaConf.is_list(value) else [str(value)]


def _changed_settings(cfg: DictConfig, parts: list[_Part]) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every setting under the parts' keys whose value is not its schema default, in
    the order the parts name them (a setting under two of their keys comes twice)."""
    for key in dict.fromkeys(k for part in parts for k in part.keys):
        for leaf, default in _leaves(key, cfg.env.name):
            value = OmegaConf.select(cfg, leaf)
            if value != default:
                yield leaf, value


def _leaves(key: str, env_name: str) -> list[tuple[str, Any]]:
    """(dotted key, schema default) of `key` or, for a section, of every key under it."""
    parent, _, leaf = key.rpartition(".")
    owner = schema_at(parent, env_config_class(env_name))
    if owner is None:
        return []
    field = {f.name: f for f in fields(owner)}.get(leaf)
    if field is None:
        return []
    nested = schema_at(key, env_config_class(env_name))
    if nested is not None:
        return [pair for f in fields(nested) for pair in _leaves(f"{key}.{f.name}", env_name)]
    default = field.default if field.default is not MISSING else field.default_factory()  # type: ignore[misc]
    return [(key, default)]


def _reason(key: str, cfg: DictConfig, parts: list[_Part], used: set[int], seen: frozenset[str] = frozenset()) -> str:
    """Why no part this run uses reads `key`. When an unused owner is named by its key but that key is read by
    nothing, that key's own reason is the answer (`seen`: the keys already on this path)."""
    unused = [parts[i] for i in _owners(key, parts) if i not in used]
    named = [part.choice[0] for part in unused if _chosen(part, cfg) and part.choice[0] not in seen]  # type: ignore[index]
    if named:
        return "; ".join(dict.fromkeys(_reason(choice, cfg, parts, used, seen | {key}) for choice in named))
    return _why_unused(unused, cfg)


def _why_unused(unused: list[_Part], cfg: DictConfig) -> str:
    """The reasons of unused parts in one text: the choices that would read the key first (`read only with
    algo.estimator=gigpo|grpo`), then each list that lacks a name and each other part's own `why`."""
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
