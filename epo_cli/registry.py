"""Named components: a `Registry` maps a name used in conf/ to (settings dataclass, constructor).

A component registers itself where it is defined, so adding one touches that module and its yaml:

    LOSS_TERMS = Registry("loss term")

    @dataclass
    class ToyConfig:
        weight: float = num(1.0, ge=0)

    @LOSS_TERMS.register("toy", config=ToyConfig)
    class ToyLoss(LossTerm): ...

Config validation reads `names()` (an unknown name fails at config time listing the valid ones) and
`config_class(name)` (the component's own settings, checked by the same field rules as every schema);
`build(name, settings, ...)` constructs it. This module imports nothing heavy, so the config layer can
read a registry's names without importing torch.

Where a component's settings live in the algo section: a new component's under `algo.components.<name>`
(validated at compose time against `config`); a built-in may name the algo keys it has always read
(`sections=("gae",)`: the yaml keys and CLI overrides from before the registry keep working).
`Entry.settings(algo)` reads them, in the order the constructor takes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epo_cli.errors import ConfigError


@dataclass(frozen=True)
class Entry:
    name: str
    config: type | None  # the component's own settings dataclass (None: it takes none)
    build: Callable[..., Any]
    #: algo keys holding its settings (None: algo.components.<name>; (): it takes none)
    sections: tuple[str, ...] | None = None

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


class Registry:
    """One kind of component (estimator, loss term, schedule, curriculum ...), keyed by its conf/ name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, *, config: type | None = None,
                 sections: tuple[str, ...] | None = None) -> Callable[[Any], Any]:
        """Decorator: register a class or factory function under `name` (a name may be taken once)."""

        def add(build: Any) -> Any:
            if name in self._entries and self._entries[name].build is not build:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = Entry(name, config, build, sections)
            return build

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise ConfigError(f"Unknown {self.kind} '{name}'. Valid: {', '.join(self.names())}.")
        return self._entries[name]

    def config_class(self, name: str) -> type | None:
        return self.entry(name).config

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.entry(name).build(*args, **kwargs)
