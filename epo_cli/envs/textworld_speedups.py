"""Speed-ups of TextWorld's PDDL engine for env=alfworld (env.fast_textgen, env.cache_pddl): process-wide,
idempotent patches that leave every game's text and states as stock TextWorld makes them.

    memoize_textworld_parsers   cache the parse trees of grammar snippets and logic queries (~2/3 of a step)
    fast_textgen_copies         an exact, specialised deepcopy for the grammar derivation (~2/3 of a step)
    cache_pddl_translations     translate each game's PDDL to SAS once instead of 4 times per reset

textworld and fast_downward are imported only inside the functions: importing this module needs neither.
"""

from __future__ import annotations

import copy
import copyreg
import functools
from collections import OrderedDict
from typing import Any


def memoize_textworld_parsers() -> None:
    """Cache TextWorld's parsing of grammar snippets and logic queries (idempotent, process-wide).

    TextWorld's PDDL engine re-parses the same short strings (command templates, feedback rules, rule
    conditions) with a tatsu parser at every step: about 2/3 of an ALFWorld step. A parse depends on the
    text alone, so the trees are cached and every caller gets a deep copy (callers mutate them); the game
    text is unchanged (tests compare whole trajectories with and without the cache).
    """
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic as logic

    for module in (textgen, logic):
        original = module._parse_and_convert
        if getattr(original, "epo_memoized", False):
            continue
        cached = functools.lru_cache(maxsize=8192)(original)

        def parse(*args: Any, _cached: Any = cached, _original: Any = original, **kwargs: Any) -> Any:
            try:
                tree = _cached(*args, **kwargs)
                # fast_textgen_copies' exact deepcopy once it is installed (same copies), else copy's
                deepcopy = textgen.deepcopy if getattr(textgen.deepcopy, "epo_exact", False) else copy.deepcopy
                return deepcopy(tree)
            except TypeError:  # an unhashable argument: parse as TextWorld would
                return _original(*args, **kwargs)

        parse.epo_memoized = True  # type: ignore[attr-defined]
        module._parse_and_convert = parse


def _exact_deepcopy() -> Any:
    """A `copy.deepcopy` for the objects TextWorld's grammar derivation copies: the same result, ~5x faster.

    It returns what `copy.deepcopy` returns (new objects, the same sharing between them, through the same
    memo): lists and dicts are rebuilt item by item; `EntityInfo`, `Placeholder` and `Variable` (slotted
    classes without a __dict__) get their set slots copied; the five grammar symbol classes (plain classes)
    get their `__dict__` copied; str, int, float, bool and None are returned as they are. That is exactly
    what `copy.deepcopy` does with these exact types (it rebuilds such objects with `cls.__new__` and a deep
    copy of their slots or `__dict__`), minus its generic `__reduce_ex__` dispatch, as long as none of them
    has a copy hook or a copyreg reducer: checked here (None if one has). Any other type, subclasses and
    tuples included, goes to `copy.deepcopy` with the same memo.
    """
    from textworld.envs.pddl import textgen
    from textworld.generator.game import EntityInfo
    from textworld.logic import Placeholder, Variable

    atomic = {str, int, float, bool, type(None)}
    slotted = {cls: tuple(cls.__slots__) for cls in (EntityInfo, Placeholder, Variable)}
    symbols = {textgen.TerminalSymbol, textgen.NonterminalSymbol, textgen.EvalSymbol, textgen.ListSymbol,
               textgen.ConditionalSymbol}
    if any(cls.__dictoffset__ for cls in slotted):  # instances with a __dict__ besides their slots
        return None
    if any(cls in copyreg.dispatch_table for cls in (*slotted, *symbols)):  # a registered reducer
        return None
    hooks = {"__deepcopy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__getnewargs__",
             "__getnewargs_ex__"}
    for cls in (*slotted, *symbols):  # what makes the shortcut exact; checked, not assumed
        if any(hook in vars(klass) for klass in cls.__mro__[:-1] for hook in hooks):
            return None
    missing = object()

    def deepcopy(x: Any, memo: dict[int, Any] | None = None) -> Any:
        cls = type(x)
        if cls in atomic:
            return x
        if memo is None:
            memo = {}
        found = memo.get(id(x), missing)
        if found is not missing:
            return found
        # (atomic items are inlined: deepcopy returns them as they are)
        if cls is list:
            y: Any = []
            memo[id(x)] = y
            y.extend([item if type(item) in atomic else deepcopy(item, memo) for item in x])
        elif cls is dict:
            y = {}
            memo[id(x)] = y
            for key, value in x.items():
                y[key if type(key) in atomic else deepcopy(key, memo)] = (
                    value if type(value) in atomic else deepcopy(value, memo))
        elif cls in slotted:
            y = cls.__new__(cls)
            memo[id(x)] = y
            for slot in slotted[cls]:
                value = getattr(x, slot, missing)
                if value is not missing:
                    setattr(y, slot, value if type(value) in atomic else deepcopy(value, memo))
        elif cls in symbols:
            y = cls.__new__(cls)
            memo[id(x)] = y
            y.__dict__.update(deepcopy(x.__dict__, memo))
        else:  # tuples (deepcopy's identity rules for them) and anything unexpected
            return copy.deepcopy(x, memo)
        return y

    return deepcopy


def fast_textgen_copies() -> None:
    """Give TextWorld's grammar derivation an exact, faster deep copy (idempotent, process-wide).

    textworld.envs.pddl.textgen deep-copies a derivation context (the placeholders' EntityInfos and the
    action's Placeholder -> Variable mapping) for every grammar symbol it expands, and every production's
    symbols: about 2/3 of an ALFWorld step, nearly all in `copy.deepcopy`'s generic machinery. The module's
    `deepcopy` name is pointed at `_exact_deepcopy()`, which returns the very objects `copy.deepcopy` would
    (see there), so nothing TextWorld mutates is shared; the text is unchanged (tests compare whole
    trajectories with and without it). If a TextWorld update gives those classes copy hooks, nothing is
    patched.
    """
    from textworld.envs.pddl import textgen

    if getattr(textgen.deepcopy, "epo_exact", False):
        return
    fast = _exact_deepcopy()
    if fast is None:
        return
    fast.epo_exact = True
    textgen.deepcopy = fast


#: games whose PDDL translations `cache_pddl_translations` keeps (two translations a game, ~1 MB each)
PDDL_CACHE_GAMES = 8


def cache_pddl_translations() -> None:
    """Translate each game's PDDL to SAS once (idempotent, process-wide): the last PDDL_CACHE_GAMES games.

    TextWorld's PddlState translates the domain + problem with fast_downward.pddl2sas twice (plain, and
    optimised for replanning), and a reset builds two PddlStates of the same game (in `load` and again in
    `reset`): 4 translations, ~90% of a reset, where 2 distinct ones suffice. A translation is a pure
    function of (domain, problem, optimize): pddl2sas sets all the translator options it uses before
    translating, and its result (the normalised PDDL task and the SAS text) is only read afterwards
    (PddlState reads the task's actions, types, objects and initial facts; the SAS text is a str), so the
    cached result is shared. Verbose calls (TW_PDDL_DEBUG) are not cached, so they still print. (pddl2sas
    also overwrites sys.argv with the translator's fake arguments; a cache hit finds it already done.)
    """
    import fast_downward

    if getattr(fast_downward.pddl2sas, "epo_cached", False):
        return
    original = fast_downward.pddl2sas
    cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        if verbose:
            return original(domain, problem, verbose=verbose, optimize=optimize)
        key = (domain, problem, bool(optimize))
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        result = cache[key] = original(domain, problem, verbose=verbose, optimize=optimize)
        while len(cache) > 2 * PDDL_CACHE_GAMES:
            cache.popitem(last=False)
        return result

    pddl2sas.epo_cached = True  # type: ignore[attr-defined]
    pddl2sas.cache = cache  # type: ignore[attr-defined]
    pddl2sas.original = original  # type: ignore[attr-defined]
    fast_downward.pddl2sas = pddl2sas
