"""The embedded household environment (`env=household`): ALFWorld's text game in pure Python.

Real ALFWorld steps at ~15 steps/s and needs a second to reset; this env generates a room from a seed in
microseconds and speaks ALFWorld 0.4.2's text interface, so prompts, action parsers and policies carry
over. Every sentence below was copied from real 0.4.2 games (TextWorld-PDDL with alfworld's alfred.twl2
grammar and alfred.pddl domain): the welcome text, "You arrive at ...", "The fridge 1 is closed.",
"You pick up the X from the Y.", "You move the X to the Y.", "You heat the X using the Y.",
"Nothing happens.", the goal templates, and the admissible list (alphabetically sorted, with `help`,
`inventory` and `look`; `take` only with empty hands from an open receptacle; `move` only to the open
receptacle you stand at; heat/cool/clean only with the microwave/fridge/sinkbasin and an object that allows
it; `use <lamp>` only where the lamp stands). As in ALFWorld, a command outside the admissible list does
nothing, whatever it is.

Deliberate differences from ALFWorld 0.4.2:
  - no slicing, no receptacle objects (pans holding things), no `canContain` table: any portable object
    may be moved into any receptacle; lamps are desklamps standing on a desk/sidetable/dresser;
  - commands are matched after lower-casing and collapsing whitespace (ALFWorld matches them verbatim);
  - the target class appears exactly once (twice for pick_two), so the search is never cut short by a
    spare copy, and it never starts inside a receptacle of the destination class.

Levels (`LEVELS`, easiest first) turn four knobs: task types, number of receptacles, distractor objects and
the share of openable (initially closed) receptacles. Splits: `train` and `eval_in_distribution` use
disjoint seed ranges of the same generator; `eval_out_of_distribution` uses its own seed range and only
target classes that never are the target in the other two splits (`OOD_TARGETS`; they do appear as
distractors there, so their names are not new words, only new goals).

The built-in expert (`info["expert_action"]`) knows only what the episode has shown so far: it visits
receptacles in the order of the `go to` commands in the admissible list, opens closed ones, skips those
whose contents it has seen, remembers where it saw things, then takes the object, transforms it, and
moves it to the first destination receptacle in the same order. It answers from any state, also after
the agent deviated.
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass, field
from typing import Any

from epo_cli.config import EnvConfig, num, one_of
from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.envs.subgoals import SUBGOALS
from epo_cli.errors import ConfigError

#: bumped whenever the same Task would generate a different game (recorded in each run's config.yaml)
GENERATOR_VERSION = "1"

# ----------------------------------------------------------------------------------------------------
# Vocabulary: task types, goals, rooms, objects
# ----------------------------------------------------------------------------------------------------

TASK_TYPES = (
    "pick_and_place",
    "look_at_obj_in_light",
    "pick_clean_then_place",
    "pick_heat_then_place",
    "pick_cool_then_place",
    "pick_two_obj_and_place",
)
#: ALFWorld's own names (its folder names) are accepted in `task_types` too
ALFWORLD_TASK_NAMES = {
    "pick_and_place_simple": "pick_and_place",
    "pick_clean_then_place_in_recep": "pick_clean_then_place",
    "pick_heat_then_place_in_recep": "pick_heat_then_place",
    "pick_cool_then_place_in_recep": "pick_cool_then_place",
}

#: the two goal templates ALFWorld 0.4.2 uses per task type (each about half of its games)
GOALS = {
    "pick_and_place": ("put a {t} in {d}.", "put some {t} on {d}."),
    "look_at_obj_in_light": ("look at {t} under the {d}.", "examine the {t} with the {d}."),
    "pick_clean_then_place": ("put a clean {t} in {d}.", "clean some {t} and put it in {d}."),
    "pick_heat_then_place": ("put a hot {t} in {d}.", "heat some {t} and put it in {d}."),
    "pick_cool_then_place": ("put a cool {t} in {d}.", "cool some {t} and put it in {d}."),
    "pick_two_obj_and_place": ("put two {t} in {d}.", "find two {t} and put them in {d}."),
}

#: task type -> (verb, the only receptacle class that does it); as in alfred.pddl
TRANSFORMS = {
    "pick_clean_then_place": ("clean", "sinkbasin"),
    "pick_heat_then_place": ("heat", "microwave"),
    "pick_cool_then_place": ("cool", "fridge"),
}
CLEANABLE = frozenset("apple bowl butterknife cloth cup dishsponge egg fork kettle knife ladle lettuce mug "
                      "pan plate pot potato soapbar spatula spoon tomato".split())
HEATABLE = frozenset("apple bread cup egg mug plate potato tomato".split())
COOLABLE = frozenset("apple bowl bread cup egg lettuce mug pan plate pot potato tomato winebottle".split())
CAN = {"clean": CLEANABLE, "heat": HEATABLE, "cool": COOLABLE}
LAMP = "desklamp"
LAMP_HOLDERS = ("desk", "dresser", "sidetable")
#: target classes held out of train and eval_in_distribution; at least one fits every task type
OOD_TARGETS = frozenset({"alarmclock", "bread", "ladle", "plunger", "spatula", "statue", "winebottle"})


@dataclass(frozen=True)
class Room:
    openable: dict[str, int]  # receptacle class -> most instances (openable ones start closed)
    fixed: dict[str, int]  # receptacles that are always open (tables, shelves, appliances)
    objects: tuple[str, ...]  # portable object classes found here
    destinations: tuple[str, ...]  # receptacle classes a goal may name


ROOMS = {
    "kitchen": Room(
        {"cabinet": 20, "drawer": 15, "fridge": 1, "microwave": 1},
        {"countertop": 4, "diningtable": 2, "shelf": 6, "stoveburner": 4, "sinkbasin": 1, "garbagecan": 1,
         "coffeemachine": 1, "toaster": 1},
        tuple("apple bowl bread butterknife cup dishsponge egg fork kettle knife ladle lettuce mug pan "
              "peppershaker plate pot potato saltshaker soapbottle spatula spoon tomato winebottle".split()),
        ("cabinet", "drawer", "fridge", "microwave", "countertop", "diningtable", "shelf", "garbagecan",
         "stoveburner"),
    ),
    "bathroom": Room(
        {"cabinet": 12, "drawer": 12},
        {"countertop": 2, "shelf": 4, "sinkbasin": 2, "bathtubbasin": 1, "toilet": 1, "garbagecan": 1,
         "towelholder": 1, "handtowelholder": 1, "toiletpaperhanger": 1},
        tuple("candle cloth dishsponge handtowel plunger scrubbrush soapbar soapbottle spraybottle tissuebox "
              "toiletpaper towel".split()),
        ("cabinet", "drawer", "countertop", "shelf", "toilet", "bathtubbasin", "garbagecan", "sinkbasin"),
    ),
    "bedroom": Room(
        {"drawer": 15, "safe": 1, "cabinet": 6},
        {"bed": 1, "desk": 2, "dresser": 1, "sidetable": 3, "shelf": 8, "garbagecan": 1, "armchair": 1},
        tuple("alarmclock book bowl cd cellphone creditcard keychain laptop mug pen pencil pillow statue "
              "vase watch".split()),
        ("drawer", "safe", "bed", "desk", "dresser", "sidetable", "shelf", "garbagecan", "armchair"),
    ),
    "livingroom": Room(
        {"drawer": 10, "cabinet": 10},
        {"sofa": 1, "armchair": 2, "coffeetable": 1, "sidetable": 3, "dresser": 1, "shelf": 8,
         "garbagecan": 1, "tvstand": 1, "diningtable": 1},
        tuple("book box candle cellphone creditcard keychain laptop newspaper pillow remotecontrol statue "
              "tissuebox vase watch wateringcan".split()),
        ("drawer", "cabinet", "sofa", "armchair", "coffeetable", "sidetable", "dresser", "shelf",
         "garbagecan", "tvstand"),
    ),
}
#: rooms a task type can happen in (heating needs the kitchen's microwave, lamps stand in living spaces)
TASK_ROOMS = {
    "pick_and_place": ("kitchen", "bathroom", "bedroom", "livingroom"),
    "look_at_obj_in_light": ("bedroom", "livingroom"),
    "pick_clean_then_place": ("kitchen", "bathroom"),
    "pick_heat_then_place": ("kitchen",),
    "pick_cool_then_place": ("kitchen",),
    "pick_two_obj_and_place": ("kitchen", "bathroom", "bedroom", "livingroom"),
}

# ----------------------------------------------------------------------------------------------------
# Levels (the curriculum's knobs) and splits
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    name: str
    task_types: tuple[str, ...]
    receptacles: tuple[int, int]  # inclusive range
    distractors: tuple[int, int]  # portable objects besides the target(s)
    closed_share: float  # chance that a receptacle is an openable one (they all start closed)


LEVELS = (
    Level("tiny_open_pick_place", ("pick_and_place",), (2, 4), (0, 2), 0.0),
    Level("small_pick_and_light", ("pick_and_place", "look_at_obj_in_light"), (4, 7), (2, 5), 0.3),
    Level("medium_with_transforms", TASK_TYPES[:5], (7, 11), (4, 8), 0.4),
    Level("large_all_tasks", TASK_TYPES, (12, 18), (8, 14), 0.5),
    Level("alfworld_size_all_tasks", TASK_TYPES, (24, 34), (15, 30), 0.6),
)
#: levels outside the curriculum ladder (not in `levels()`, so neither the staged/adaptive curricula nor the
#: tiny tokenizer's corpus change when one is added); each is a variant of the ladder's knobs for a study
LEVEL_VARIANTS = (
    Level("tiny_closed_pick_place", ("pick_and_place",), (2, 4), (0, 2), 0.5),
    Level("tiny_rarely_closed", ("pick_and_place",), (2, 4), (0, 2), 0.1),
    Level("tiny_closed_3pct", ("pick_and_place",), (2, 4), (0, 2), 0.03),
    Level("tiny_closed_5pct", ("pick_and_place",), (2, 4), (0, 2), 0.05),
    Level("small_open_pick_place", ("pick_and_place",), (5, 8), (2, 4), 0.0),
    Level("medium_open_pick_place", ("pick_and_place",), (8, 12), (3, 6), 0.0),
    Level("tiny_pick_two", ("pick_two_obj_and_place",), (2, 4), (0, 2), 0.0),
    Level("tiny_mixed_two", ("pick_and_place", "pick_two_obj_and_place"), (2, 4), (0, 2), 0.0),
)
LEVEL_BY_NAME = {lvl.name: lvl for lvl in LEVELS + LEVEL_VARIANTS}
DEFAULT_LEVEL = LEVELS[1].name

SPLITS = ("train", "eval_in_distribution", "eval_out_of_distribution")
#: each split draws seeds from its own block, so no seed (hence no Task) is shared between splits
SEEDS_PER_SPLIT = 1_000_000_000
SEED_BASE = {split: i * SEEDS_PER_SPLIT for i, split in enumerate(SPLITS)}


def _unknown(kind: str, name: str, valid: list[str] | tuple[str, ...]) -> ConfigError:
    close = difflib.get_close_matches(name, list(valid), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"Unknown household {kind} '{name}'.{hint} Valid {kind}s: {', '.join(valid)}.")


def get_level(name: str) -> Level:
    if name not in LEVEL_BY_NAME:
        raise _unknown("level", name, list(LEVEL_BY_NAME))
    return LEVEL_BY_NAME[name]


def resolve_task_types(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Canonical task type names (ALFWorld's long names accepted); ConfigError on unknown names."""
    out = []
    for name in names:
        name = ALFWORLD_TASK_NAMES.get(name, name)
        if name not in TASK_TYPES:
            raise _unknown("task type", name, TASK_TYPES)
        out.append(name)
    return tuple(out)


@dataclass
class HouseholdConfig(EnvConfig):
    name: str = "household"
    #: curriculum level, easiest first: tiny_open_pick_place | small_pick_and_light | medium_with_transforms |
    #: large_all_tasks | alfworld_size_all_tasks
    level: str = one_of(DEFAULT_LEVEL, tuple(LEVEL_BY_NAME))
    #: restrict to these task types (empty = the level's own types)
    task_types: list[str] = field(default_factory=list)
    #: the expert needs 3-15 steps at the default level (median 8); 30 leaves room to explore
    max_turns: int = num(30, ge=1)
    eval_splits: list[str] = field(
        default_factory=lambda: ["eval_in_distribution", "eval_out_of_distribution"])


# ----------------------------------------------------------------------------------------------------
# World generation: Task -> a room, its contents and a goal (deterministic in the Task)
# ----------------------------------------------------------------------------------------------------


@dataclass
class World:
    goal: str
    task_type: str
    target: str  # object class to find
    dest: str  # receptacle class to put it in, or the lamp class for look_at_obj_in_light
    count: int  # objects to place (2 for pick_two)
    receptacles: list[str]  # sorted like the `go to` commands of the admissible list
    openable: frozenset[str]
    rclass: dict[str, str]
    oclass: dict[str, str]
    contents: dict[str, list[str]]  # receptacle -> objects, in ALFWorld's listing order
    intro: str


def _listing(names: list[str]) -> str:
    """ALFWorld's list: 'a x 1', 'a x 1, and a y 2', 'a x, a y, and a z'; always 'a' (it writes 'a egg')."""
    if not names:
        return "nothing"
    items = [f"a {n}" for n in names]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _order_key(name: str) -> tuple[str, int]:
    # ALFWorld lists things by class, higher numbers first: "a knife 2, a knife 1, a mug 3"
    cls, num = name.rsplit(" ", 1)
    return cls, -int(num)


def _pick_target(task_type: str, split: str, rng: random.Random) -> tuple[str, str]:
    """(room kind, target class) for this task type; OOD targets only in the OOD split, never elsewhere."""
    ood = split == "eval_out_of_distribution"
    options = []
    for kind in TASK_ROOMS[task_type]:
        objs = ROOMS[kind].objects
        if task_type in TRANSFORMS:
            objs = tuple(o for o in objs if o in CAN[TRANSFORMS[task_type][0]])
        pool = [o for o in objs if (o in OOD_TARGETS) == ood]
        if pool:
            options.append((kind, pool))
    kind, pool = rng.choice(options)
    return kind, rng.choice(pool)


def generate(task: Task, default_level: str = DEFAULT_LEVEL) -> World:
    """Build the game of `task`. Pure function of (seed, split, level, task_type)."""
    level = get_level(task.level or default_level)
    (task_type,) = resolve_task_types([task.task_type])
    # a string seed goes through sha512 in `random`, so the game does not depend on PYTHONHASHSEED
    rng = random.Random(f"household-v{GENERATOR_VERSION}/{task.split}/{level.name}/{task_type}/{task.seed}")
    kind, target = _pick_target(task_type, task.split, rng)
    room = ROOMS[kind]
    left = {**room.openable, **room.fixed}  # instances still available per class
    classes: list[str] = []

    def add(cls: str) -> None:
        classes.append(cls)
        left[cls] -= 1

    def draw(pool: list[str]) -> str:
        # openable classes with probability closed_share: the level's "share of closed receptacles"
        opens = [c for c in pool if c in room.openable and left[c] > 0]
        fixed = [c for c in pool if c not in room.openable and left[c] > 0]
        if opens and (not fixed or rng.random() < level.closed_share):
            return rng.choice(opens)
        return rng.choice(fixed)

    # the receptacles the task needs: the destination (or a lamp holder) and the transforming appliance
    transform = TRANSFORMS.get(task_type)
    if task_type == "look_at_obj_in_light":
        dest = LAMP
        add(rng.choice([c for c in LAMP_HOLDERS if c in room.fixed]))
        lamp_holder = classes[0]
    else:
        dests = [c for c in room.destinations if not transform or c != transform[1]]
        dest = draw(dests)
        add(dest)
        lamp_holder = None
    if transform and transform[1] not in classes:
        add(transform[1])
    # one receptacle of another class, so that the target has somewhere to start from
    add(draw([c for c in left if c != dest]))
    n_total = rng.randint(*level.receptacles)
    while len(classes) < n_total and any(v > 0 for v in left.values()):
        add(draw(list(left)))

    counts: dict[str, int] = {}
    contents: dict[str, list[str]] = {}
    for cls in classes:
        counts[cls] = counts.get(cls, 0) + 1
        contents[f"{cls} {counts[cls]}"] = []
    names = list(contents)
    ocount: dict[str, int] = {}

    def place(cls: str, where: list[str]) -> None:
        ocount[cls] = ocount.get(cls, 0) + 1
        contents[rng.choice(where)].append(f"{cls} {ocount[cls]}")

    starts = [r for r in names if r.rsplit(" ", 1)[0] != dest]  # never already where the goal wants it
    for _ in range(2 if task_type == "pick_two_obj_and_place" else 1):
        place(target, starts)
    if lamp_holder:
        place(LAMP, [r for r in names if r.rsplit(" ", 1)[0] == lamp_holder])
    others = [o for o in room.objects if o != target]
    for _ in range(rng.randint(*level.distractors)):
        place(rng.choice(others), names)
    goal = rng.choice(GOALS[task_type]).format(t=target, d=dest)
    return make_world(task_type, target, dest, contents, room.openable, goal)


def make_world(task_type: str, target: str, dest: str, contents: dict[str, list[str]],
               openable_classes: Any, goal: str) -> World:
    """A World from its parts (receptacle -> object names like "apple 1"); tests build rooms by hand."""
    names = list(contents)
    rclass = {r: r.rsplit(" ", 1)[0] for r in names}
    oclass = {o: o.rsplit(" ", 1)[0] for objs in contents.values() for o in objs}
    intro = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around "
             f"you, you see {_listing(sorted(names, key=_order_key))}.\n\nYour task is to: {goal}")
    return World(goal=goal, task_type=task_type, target=target, dest=dest,
                 count=2 if task_type == "pick_two_obj_and_place" else 1, receptacles=sorted(names),
                 openable=frozenset(r for r in names if rclass[r] in openable_classes), rclass=rclass,
                 oclass=oclass, contents={r: sorted(objs, key=_order_key) for r, objs in contents.items()},
                 intro=intro)


# ----------------------------------------------------------------------------------------------------
# The game
# ----------------------------------------------------------------------------------------------------

NOTHING = "Nothing happens."
HELP = (
    "Available commands:\n"
    "  look:                             look around your current location\n"
    "  inventory:                        check your current inventory\n"
    "  go to (receptacle):               move to a receptacle\n"
    "  open (receptacle):                open a receptacle\n"
    "  close (receptacle):               close a receptacle\n"
    "  take (object) from (receptacle):  take an object from a receptacle\n"
    "  move (object) to (receptacle):  place an object in or on a receptacle\n"
    "  examine (something):              examine a receptacle or an object\n"
    "  use (object):                     use an object\n"
    "  heat (object) with (receptacle):  heat an object using a receptacle\n"
    "  clean (object) with (receptacle): clean an object using a receptacle\n"
    "  cool (object) with (receptacle):  cool an object using a receptacle\n"
    "  slice (object) with (object):     slice an object using a sharp object\n"
)
class HouseholdEnv(Env):
    """One household game at a time: reset(task), then step(command) until done."""

    def __init__(self, default_level: str = DEFAULT_LEVEL) -> None:
        self.default_level = default_level
        self.w: World | None = None

    # -- episode -------------------------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return self.reset_to(generate(task, self.default_level), task)

    def reset_to(self, world: World, task: Task) -> tuple[str, dict[str, Any]]:
        """Start playing `world` (a generated one, or one built by hand with `make_world`)."""
        self.task = task
        self.w = w = world
        self.contents = {r: list(objs) for r, objs in w.contents.items()}  # the mutable copy
        self.here: str | None = None
        self.held: str | None = None
        self.opened: set[str] = set()
        self.checked: set[str] = set()  # receptacles whose contents the agent has been shown
        self.states: dict[str, set[str]] = {"clean": set(), "heat": set(), "cool": set()}
        self.lamp_on = False
        self.won = False
        self.reached: set[str] = set()
        self.events: list[str] = []
        self.transform = TRANSFORMS.get(w.task_type)
        self.dest_recs = [r for r in w.receptacles if w.rclass[r] == w.dest]
        self._refresh()
        return w.intro, self._info()

    def step(self, action: str) -> StepResult:
        if self.w is None:
            raise RuntimeError("HouseholdEnv.step() called before reset()")
        self.events = []
        op = None if self.won else self.ops.get(" ".join(str(action).lower().split()))
        obs = NOTHING if op is None else op[0](*op[1:])
        reward = 0.0
        if op is not None and not self.won and self._check_won():
            self.won, reward = True, 1.0
        self._refresh()
        return StepResult(obs, reward, self.won, self._info())

    def _info(self) -> dict[str, Any]:
        w = self.w
        assert w is not None
        events = SUBGOALS[w.task_type]
        progress = 1.0 if self.won else len(self.reached) / (len(events) + 1)
        return {
            "goal": w.goal,
            "admissible_commands": list(self.admissible),
            "won": self.won,
            "lost": False,
            "task_type": w.task_type,
            "task_id": self.task.task_id,
            "level": self.task.level or self.default_level,
            "subgoals": list(self.events),
            "progress": progress,
            "expert_action": self.expert[0],
            "expert_thought": self.expert[1],
        }

    def _event(self, name: str) -> None:
        if name not in self.reached and name in SUBGOALS[self.w.task_type]:
            self.reached.add(name)
            self.events.append(name)

    # -- what can be done here (ALFWorld's admissible commands) ---------------------------------------

    def _accessible(self, r: str) -> bool:
        return r not in self.w.openable or r in self.opened

    def _refresh(self) -> None:
        """Recompute the admissible commands (with the operation each one runs) and the expert's move."""
        w, here, held = self.w, self.here, self.held
        ops: dict[str, tuple] = {f"go to {r}": (self._goto, r) for r in w.receptacles if r != here}
        ops["help"] = (self._help,)
        ops["inventory"] = (self._inventory,)
        ops["look"] = (self._look,)
        if here is not None:
            ops[f"examine {here}"] = (self._examine_receptacle, here)
            if here in w.openable:
                ops[f"close {here}" if here in self.opened else f"open {here}"] = (
                    (self._close if here in self.opened else self._open), here)
            open_here = self._accessible(here)
            for obj in self.contents[here]:
                if w.oclass[obj] == LAMP:
                    ops[f"use {obj}"] = (self._use, obj)
                elif held is None and open_here:
                    ops[f"take {obj} from {here}"] = (self._take, obj, here)
            if held is not None:
                ops[f"examine {held}"] = (self._examine_object, held)
                if open_here:
                    ops[f"move {held} to {here}"] = (self._move, held, here)
                for verb, cls in TRANSFORMS.values():
                    if w.rclass[here] == cls and w.oclass[held] in CAN[verb]:
                        ops[f"{verb} {held} with {here}"] = (self._transform, verb, held, here)
        self.ops = ops
        self.admissible = sorted(ops)
        self.expert = (None, None) if self.won else self._expert()

    # -- the operations (each returns ALFWorld's feedback) --------------------------------------------

    def _describe(self, r: str) -> str:
        if r in self.w.openable and r not in self.opened:
            return f"The {r} is closed."
        self.checked.add(r)
        objs = self.contents[r]
        for obj in objs:
            cls = self.w.oclass[obj]
            if cls == self.w.target:
                self._event("found_target")
            elif cls == LAMP:
                self._event("found_lamp")
        if r in self.w.openable:
            return f"The {r} is open. In it, you see {_listing(objs)}."
        return f"On the {r}, you see {_listing(objs)}."

    def _goto(self, r: str) -> str:
        self.here = r
        return f"You arrive at {r}. {self._describe(r)}"

    def _open(self, r: str) -> str:
        self.opened.add(r)
        return f"You open the {r}. {self._describe(r)}"

    def _close(self, r: str) -> str:
        self.opened.discard(r)
        return f"You close the {r}."

    def _take(self, obj: str, r: str) -> str:
        self.contents[r].remove(obj)
        self.held = obj
        if self.w.oclass[obj] == self.w.target:
            self._event("picked")
        return f"You pick up the {obj} from the {r}."

    def _move(self, obj: str, r: str) -> str:
        objs = self.contents[r]
        objs.append(obj)
        objs.sort(key=_order_key)
        self.held = None
        if self.w.oclass[obj] == self.w.target and self.w.rclass[r] == self.w.dest:
            self._event("placed_first")
        return f"You move the {obj} to the {r}."

    def _transform(self, verb: str, obj: str, r: str) -> str:
        self.states[verb].add(obj)
        if verb in ("heat", "cool"):  # heating undoes cooling and vice versa (alfred.pddl)
            self.states["cool" if verb == "heat" else "heat"].discard(obj)
        if self.transform and verb == self.transform[0] and self.w.oclass[obj] == self.w.target:
            self._event("transformed")
        return f"You {verb} the {obj} using the {r}."

    def _use(self, lamp: str) -> str:
        self.lamp_on = True  # ALFWorld's toggle leaves `isToggled` set, and always says "turn on"
        return f"You turn on the {lamp}."

    def _help(self) -> str:
        return HELP

    def _inventory(self) -> str:
        return f"You are carrying: a {self.held}." if self.held else "You are not carrying anything."

    def _look(self) -> str:
        if self.here is None:  # what 0.4.2 prints before the first `go to`, although the intro listed all
            return "You are in the middle of a room. Looking quickly around you, you see nothing."
        return f"You are facing the {self.here}. Next to it, you see nothing."

    def _examine_receptacle(self, r: str) -> str:
        return self._describe(r)

    def _examine_object(self, obj: str) -> str:
        clean, hot, cool = (obj in self.states[k] for k in ("clean", "heat", "cool"))
        if clean and (hot or cool):
            return f"This is a {'hot' if hot else 'cool'} and clean {obj}."
        if hot or clean or cool:
            return f"This is a {'hot' if hot else 'clean' if clean else 'cold'} {obj}."
        return f"There's nothing special about {obj}."

    # -- goal ----------------------------------------------------------------------------------------

    def _done(self, obj: str) -> bool:
        """The object is a target in the state the goal asks for (clean/hot/cool)."""
        return self.w.oclass[obj] == self.w.target and (
            self.transform is None or obj in self.states[self.transform[0]])

    def _check_won(self) -> bool:
        w = self.w
        if w.task_type == "look_at_obj_in_light":
            return (self.lamp_on and self.held is not None and w.oclass[self.held] == w.target
                    and self.here is not None and any(w.oclass[o] == LAMP for o in self.contents[self.here]))
        return any(sum(self._done(o) for o in self.contents[r]) >= w.count for r in self.dest_recs)

    # -- the expert: no hidden knowledge, only what the episode has shown ----------------------------

    def _destination(self) -> str:
        """The first destination receptacle in `go to` order, or (pick_two) the one already holding most."""
        best, most = self.dest_recs[0], 0
        for r in self.dest_recs:
            n = sum(self._done(o) for o in self.contents[r]) if r in self.checked else 0
            if n > most:
                best, most = r, n
        return best

    def _search(self, what: str) -> tuple[str, str]:
        """Next step of the systematic search: open the closed receptacle I stand at, else go to the
        first receptacle (in `go to` order) whose contents I have not seen."""
        here = self.here
        if here is not None and here not in self.checked:
            return f"open {here}", f"open it to look for the {what}"
        for r in self.w.receptacles:
            if r not in self.checked:
                return f"go to {r}", f"look for the {what}"
        raise AssertionError("expert: nothing left to search")  # generate() always hides things somewhere

    def _expert(self) -> tuple[str, str]:
        w, here, held, t = self.w, self.here, self.held, self.w.target
        if held is not None and w.oclass[held] != t:  # hands full with the wrong thing: put it down here
            if not self._accessible(here):
                return f"open {here}", f"put down the {w.oclass[held]}"
            return f"move {held} to {here}", f"put down the {w.oclass[held]}"
        if held is not None:
            if self.transform and held not in self.states[self.transform[0]]:
                verb, app_cls = self.transform
                app = next(r for r in w.receptacles if w.rclass[r] == app_cls)
                if here != app:
                    return f"go to {app}", f"{verb} the {t} with the {app_cls}"
                return f"{verb} {held} with {here}", f"{verb} the {t}"
            if w.task_type == "look_at_obj_in_light":
                lamp = next((r for r in w.receptacles if r in self.checked
                             and any(w.oclass[o] == LAMP for o in self.contents[r])), None)
                if lamp is None:
                    return self._search(LAMP)
                if here != lamp:
                    return f"go to {lamp}", f"look at the {t} under the {LAMP}"
                obj = next(o for o in self.contents[here] if w.oclass[o] == LAMP)
                return f"use {obj}", f"turn on the {LAMP}"
            dst = self._destination()
            if here != dst:
                return f"go to {dst}", f"put the {t} in the {w.dest}"
            if not self._accessible(dst):
                return f"open {dst}", f"open the {w.dest} to put the {t} in"
            return f"move {held} to {dst}", f"put the {t} in the {w.dest}"
        # empty hands: fetch a target I have seen, else keep searching. (A finished target would have won
        # the game, except the first of two, which stays where the second one goes.)
        skip = self._destination() if w.count > 1 else None
        known = [(r, o) for r in w.receptacles if r in self.checked and r != skip for o in self.contents[r]
                 if w.oclass[o] == t]
        if not known:
            return self._search(t if w.count == 1 or self.reached.isdisjoint({"placed_first"})
                                else f"second {t}")
        r, obj = next(((r, o) for r, o in known if r == here), known[0])
        if here != r:
            return f"go to {r}", f"go get the {t}"
        if not self._accessible(r):
            return f"open {r}", f"open the {w.rclass[r]} to take the {t}"
        return f"take {obj} from {r}", f"take the {t}"


# ----------------------------------------------------------------------------------------------------
# The suite: what `env=household` names
# ----------------------------------------------------------------------------------------------------


class HouseholdSuite(EnvSuite):
    name = "household"
    tokenizer_episodes = 60  # thousands of steps per second: a rich corpus costs nothing
    config_class = HouseholdConfig

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg if cfg is not None else HouseholdConfig())
        self.default_level = get_level(str(getattr(self.cfg, "level", DEFAULT_LEVEL))).name
        self.task_types = resolve_task_types(list(getattr(self.cfg, "task_types", None) or []))

    def check(self) -> None:
        get_level(self.default_level)

    def make_env(self, reads_expert: bool = True) -> HouseholdEnv:  # its expert is cheap: always computed
        return HouseholdEnv(self.default_level)

    def levels(self) -> list[str]:
        return [lvl.name for lvl in LEVELS]

    def versions(self) -> dict[str, str]:
        return {"household_generator": GENERATOR_VERSION}

    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        if split not in SPLITS:
            raise _unknown("split", split, SPLITS)
        lvl = get_level(level or self.default_level)
        types = self.task_types or lvl.task_types
        tasks = []
        for _ in range(n):
            task_type = rng.choice(types)
            seed = SEED_BASE[split] + rng.randrange(SEEDS_PER_SPLIT)
            tasks.append(Task(task_id=f"household/{split}/{lvl.name}/{task_type}/{seed}", task_type=task_type,
                              seed=seed, split=split, level=lvl.name))
        return tasks
