"""Named components: a `Registry` maps a name used in conf/ to the component and to everything config
validation needs to know about it, so that adding a component never means teaching compose a new table.

An entry (`Entry`) carries:
    build     the component: a class, a function or a plain value; "package.module:name" is imported when it
              is first used; None while only declared (see below)
    config    its own settings dataclass (None: it takes none)
    sections  the algo keys its settings are read from (None: algo.components.<name>; (): it takes none)
    reads     the config keys only this component reads (a key names itself and every key under it), for
              the "no effect in this run" warnings; default: where its settings are
    check     its rules that span keys: check(cfg) at compose time whenever the config names it (raise
              ConfigError, or warn)
    coef      loss terms: its coefficient in the loss, a function of the weights its parameters name (lam, beta,
              kl: the schedules' values this step; settings: its own settings), e.g. `lambda lam, beta: lam * beta`;
              None: its settings' `coef` (epo_cli.algos.registries.coef_weights)
    auto_for  advantage estimators: the algo.base values for which algo.estimator=auto picks it

Config validation reads only this metadata, so it never imports a component's code (nor torch). That is why
the built-in algorithm components are declared in epo_cli/algos/registries.py and implemented where their
code is:

    LOSS_TERMS.declare("kl", config=KLConfig, sections=("kl",), coef=lambda kl: kl)   # algos/registries.py
    @LOSS_TERMS.implement("kl")                                                # epo_cli/algos/losses.py
    def _kl(kl: KLConfig) -> LossTerm: ...

A component registered from anywhere else does both at once:

    @LOSS_TERMS.register("toy", config=ToyConfig)
    def _toy(settings: ToyConfig) -> LossTerm: ...

An unknown name fails at config time listing the valid ones (`entry`). A registry is also a read-only
mapping from names to components (`AGGREGATIONS["trajectory"]`). This module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from epo_cli.errors import ConfigError


@dataclass(frozen=True)
class Entry:
    name: str
    build: Any = None
    config: Any = None
    sections: tuple[str, ...] | None = None
    reads: tuple[str, ...] | None = None
    check: Callable[[Any], None] | None = None
    coef: Callable[..., float] | None = None
    auto_for: tuple[str, ...] = ()

    def settings(self, algo: Any) -> tuple[Any, ...]:
        """The settings this component is built from, read from an algo config (DictConfig or dataclass)."""
        if self.sections is not None:
            return tuple(_select(algo, key) for key in self.sections)
        node = (algo.components or {}).get(self.name)
        if self.config is None:
            return ()
        if node is None:  # no section given (e.g. an AlgoConfig built in code): the defaults
            return (self.config(),)
        return (self.config(**node) if isinstance(node, dict) else node,)


def _select(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _resolve(value: Any) -> Any:
    """"package.module:name" -> that object (imported now); anything else as it is."""
    if isinstance(value, str) and ":" in value and value.split(":", 1)[0].replace(".", "").isidentifier():
        module, _, name = value.partition(":")
        return getattr(importlib.import_module(module), name)
    return value


class Registry(Mapping[str, Any]):
    """One kind of component (estimator, loss term, schedule, curriculum ...), keyed by its conf/ name.

    `root`: the config section a component's settings sections are relative to ("algo"), for the keys it
    reads by default (Entry.reads)."""

    def __init__(self, kind: str, root: str | None = None) -> None:
        self.kind = kind
        self.root = root
        self._entries: dict[str, Entry] = {}

    # ---- adding components ----------------------------------------------------------------------------------
    def declare(self, name: str, **fields: Any) -> None:
        """Add `name` with its config-side metadata; its code registers itself later with `implement`."""
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = Entry(name, **fields)

    def implement(self, name: str, build: Any = None) -> Any:
        """Attach the component to a declared name; a decorator when `build` is not given."""

        def attach(component: Any) -> Any:
            if name not in self._entries:
                raise ValueError(f"{self.kind} '{name}' is implemented but not declared")
            entry = self._entries[name]
            if entry.build is not None and entry.build is not component:
                raise ValueError(f"{self.kind} '{name}' is implemented twice")
            self._entries[name] = dataclasses.replace(entry, build=component)
            return component

        return attach if build is None else attach(build)

    def register(self, name: str, build: Any = None, **fields: Any) -> Any:
        """Declare and implement `name` at once; a decorator when `build` is not given (a class or a
        factory function), else the component itself (a value, or "package.module:name")."""

        def add(component: Any) -> Any:
            known = self._entries.get(name)
            if known is not None and known.build is not component:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = Entry(name, component, **fields)
            return component

        return add if build is None else add(build)

    # ---- reading them ---------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, name: str) -> Any:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} '{name}'; valid: {', '.join(self._entries)}")
        return self.target(name)

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise ConfigError(f"Unknown {self.kind} '{name}'. Valid: {', '.join(self.names())}.")
        return self._entries[name]

    def target(self, name: str) -> Any:
        """The component registered as `name` (imported now if it was given as "package.module:name")."""
        entry = self.entry(name)
        if entry.build is None:
            raise RuntimeError(f"{self.kind} '{name}' is declared but its code was never registered "
                               "(Registry.implement): import the module that implements it")
        component = _resolve(entry.build)
        if component is not entry.build:
            self._entries[name] = entry = dataclasses.replace(entry, build=component)
        return component

    def config_class(self, name: str) -> type | None:
        entry = self.entry(name)
        config = _resolve(entry.config)
        if config is not entry.config:
            self._entries[name] = dataclasses.replace(entry, config=config)
        return config

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.target(name)(*args, **kwargs)

    def reads(self, name: str) -> tuple[str, ...]:
        """The config keys only `name` reads (Entry.reads, else where its settings are)."""
        entry = self.entry(name)
        if entry.reads is not None:
            return entry.reads
        if self.root is None:
            return ()
        if entry.sections is not None:
            return tuple(f"{self.root}.{section}" for section in entry.sections)
        return (f"{self.root}.components.{name}",) if entry.config is not None else ()
