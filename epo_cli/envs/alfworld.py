"""env=alfworld: the real ALFWorld text games (TextWorld-PDDL), played with alfworld 0.4.2's engine.

Data, as `alfworld-download` lays it out (under $ALFWORLD_DATA, default ~/.cache/alfworld):

    json_2.1.1/{train,valid_seen,valid_unseen}/<task_type>-<obj>-<mrecep>-<recep>-<scene>/<trial>/
        game.tw-pddl     the game (PDDL problem; the domain and grammar of the installed alfworld, with the
                         goal text written into the grammar)
        traj_data.json   the ALFRED trajectory; the handcoded expert reads its task parameters

Splits: train -> train, eval_in_distribution -> valid_seen, eval_out_of_distribution -> valid_unseen.
Games are skipped the way alfworld's AlfredTWEnv skips them: movable/sliced trajectories, a missing game
file, and games whose "solvable" flag is missing or false.

Task types, numbered as alfworld numbers them (alfred_tw_env.TASK_TYPES), are reported by their short
names; config accepts the number, the short name or alfworld's own name:
    1 pick_and_place (pick_and_place_simple)       4 pick_heat_then_place (..._in_recep)
    2 look_at_obj_in_light                         5 pick_cool_then_place (..._in_recep)
    3 pick_clean_then_place (..._in_recep)         6 pick_two_obj_and_place
A curriculum level is one task type in any of these spellings, or several joined by commas
("pick_clean_then_place,4" is one level); by default a curriculum climbs the configured env.task_types in
alfworld's order (pick_and_place, look_at_obj_in_light, clean, heat, cool, pick_two), which is also a
sensible order of difficulty. Tasks leave Task.level unset (the curriculum tags them).

Info keys: goal, admissible_commands (the engine's list less "help"), won, lost (always False: ALFWorld
has no losing state), task_type, task_id, subgoals (progress events reached at this step, see below),
progress (events reached / (events + 1); 1.0 once won), expert_action (alfworld's
handcoded expert, like its AlfredExpert wrapper: "look" on the first turn and whenever the expert's choice
is not admissible; None if the expert gave up), expert_thought (None), truncated (max_turns reached).

Subgoal events (for `curriculum.subgoal_rewards`) are those of epo_cli/envs/subgoals.py (env=household
reports the same names). Here they are derived from the game's PDDL facts and the task's parameters in
traj_data.json (object_target, parent_target, toggle_target), the way alfworld's handcoded expert tracks
its own subgoals; each is reported once per episode:
    found_target  an object of the target class is in view ("you see ... apple 1")
    picked        the agent holds an object of the target class (holds agent1 'apple 1')
    transformed   clean/heat/cool tasks: the held target object is clean/hot/cool (isclean/ishot/iscool)
    found_lamp    look_at_obj_in_light: the lamp of the task can be used here ("use desklamp 1" admissible)
    placed_first  pick_two_obj_and_place: one more target object is in a receptacle of the goal class than
                  at the start (inreceptacle 'apple 1' 'countertop 1')

alfworld and textworld are imported only inside methods, after ALFWORLD_DATA is set: importing alfworld
creates that folder, and must never create ~/.cache/alfworld behind the user's back.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epo_cli.config import EnvConfig, num
from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.envs.subgoals import SUBGOALS
from epo_cli.envs.textworld_speedups import cache_pddl_translations, fast_textgen_copies, memoize_textworld_parsers
from epo_cli.errors import ConfigError, UserError

#: alfworld's numbering (alfworld.agents.environment.alfred_tw_env.TASK_TYPES) -> (our name, alfworld's name)
TASK_TYPES: dict[int, tuple[str, str]] = {
    1: ("pick_and_place", "pick_and_place_simple"),
    2: ("look_at_obj_in_light", "look_at_obj_in_light"),
    3: ("pick_clean_then_place", "pick_clean_then_place_in_recep"),
    4: ("pick_heat_then_place", "pick_heat_then_place_in_recep"),
    5: ("pick_cool_then_place", "pick_cool_then_place_in_recep"),
    6: ("pick_two_obj_and_place", "pick_two_obj_and_place"),
}
_SHORT_NAME = {alf: short for short, alf in TASK_TYPES.values()}

SPLIT_DIRS = {
    "train": "train",
    "eval_in_distribution": "valid_seen",
    "eval_out_of_distribution": "valid_unseen",
}
DATA_SUBDIR = "json_2.1.1"
_WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
_GOAL = re.compile(r"Your task is to: (.*)")
#: the fact that says a clean/heat/cool task's object is done
_TRANSFORM_FACT = {"pick_clean_then_place": "isclean", "pick_heat_then_place": "ishot",
                   "pick_cool_then_place": "iscool"}


@dataclass
class AlfworldConfig(EnvConfig):
    name: str = "alfworld"
    #: folder holding json_2.1.1/ (as alfworld-download writes it); null: $ALFWORLD_DATA, else
    #: ~/.cache/alfworld
    data_dir: str | None = None
    #: task types to play (ids 1-6 or names); empty: all six
    task_types: list[str] = field(default_factory=list)
    max_turns: int = num(50, ge=1)
    #: worker processes; null = one per CPU (a reset takes ~0.5 s and a step ~10 ms)
    num_workers: int | None = num(None, ge=0, le=1024)
    #: compute info["expert_action"] every step (alfworld's handcoded expert; needs the state's facts; ~20%
    #: of a step): null = where the run reads it (SFT from the expert, `epo eval policy=expert`, the tiny
    #: tokenizer's corpus), not in RL rollouts; true/false = always/never
    expert: bool | None = None
    #: cache TextWorld's grammar parsing and copy its derivation contexts with an exact, specialised deep
    #: copy (same games, same text; steps ~6x faster than stock TextWorld); false = stock TextWorld. Like
    #: cache_pddl it patches TextWorld process-wide, for every env of the process, from the first reset on
    fast_textgen: bool = True
    #: translate each game's PDDL to fast-downward's SAS once per process (TextWorld translates the same
    #: game 4 times per reset) and keep the last `PDDL_CACHE_GAMES` games' translations (same states):
    #: resets ~2.5x faster, a replayed game's ~20x; false = stock TextWorld (envs/textworld_speedups.py)
    cache_pddl: bool = True


def resolve_task_type(value: str | int) -> str:
    """A task type given as an id (1-6), our short name or alfworld's name -> our short name."""
    text = str(value).strip()
    if text.isdigit() and int(text) in TASK_TYPES:
        return TASK_TYPES[int(text)][0]
    if text in _SHORT_NAME:
        return _SHORT_NAME[text]
    if text in {short for short, _ in TASK_TYPES.values()}:
        return text
    valid = ", ".join(f"{i}={short}" for i, (short, _) in TASK_TYPES.items())
    raise ConfigError(f"Unknown ALFWorld task type '{value}'. Valid task types: {valid}.")


def default_data_dir(configured: str | None) -> tuple[Path, str]:
    """The data folder and where its location came from (for error messages)."""
    if configured:
        return Path(os.path.expandvars(configured)).expanduser(), "env.data_dir"
    if os.environ.get("ALFWORLD_DATA"):
        return Path(os.environ["ALFWORLD_DATA"]).expanduser(), "$ALFWORLD_DATA"
    return Path("~/.cache/alfworld").expanduser(), "the default (~/.cache/alfworld)"


def _import_alfworld(data_dir: Path) -> None:
    """Import alfworld with ALFWORLD_DATA pointing at our data (alfworld.info creates that folder)."""
    os.environ["ALFWORLD_DATA"] = str(data_dir)
    import alfworld.info  # noqa: F401


def _is_solvable(game_file: Path) -> bool | None:
    """The game's "solvable" flag (None if missing). The flag sits at the end of a ~70 kB JSON file, so
    look there first and parse the whole file only if the tail does not say."""
    with open(game_file, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4096))
        tail = f.read().decode("utf-8", errors="replace")
    match = re.search(r'"solvable"\s*:\s*(true|false)\s*[,}]', tail)
    if match:
        return match.group(1) == "true"
    with open(game_file) as f:
        value = json.load(f).get("solvable")
    return None if value is None else bool(value)


def _task_type_of(trial_dir: Path) -> str | None:
    """Our task type name for a trial: from the folder name (<task_type>-...), else from traj_data.json."""
    prefix = trial_dir.parent.name.split("-")[0]
    if prefix in _SHORT_NAME:
        return _SHORT_NAME[prefix]
    with open(trial_dir / "traj_data.json") as f:
        return _SHORT_NAME.get(json.load(f).get("task_type"))


class AlfworldSuite(EnvSuite):
    name = "alfworld"
    config_class = AlfworldConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self._games: dict[str, list[tuple[str, str]]] = {}  # split -> [(task_id, task_type)], sorted

    # -- data ------------------------------------------------------------------------------------------

    def data_dir(self) -> Path:
        path, _ = default_data_dir(self.cfg.data_dir)
        if path.name == DATA_SUBDIR:  # pointed at json_2.1.1 itself
            path = path.parent
        return path

    @property
    def splits(self) -> tuple[str, ...]:  # type: ignore[override]
        """The splits present in the data folder (a partial download may lack valid_unseen); all three
        when none is, so that asking for any of them explains how to get the data."""
        root = self.data_dir() / DATA_SUBDIR
        present = tuple(split for split, folder in SPLIT_DIRS.items() if (root / folder).is_dir())
        return present or tuple(SPLIT_DIRS)

    def task_types(self) -> list[str]:
        """The configured task types (short names) in alfworld's order; all six if none are configured."""
        chosen = {resolve_task_type(t) for t in self.cfg.task_types} if self.cfg.task_types else None
        return [short for short, _ in TASK_TYPES.values() if chosen is None or short in chosen]

    def _missing_data(self, what: str) -> UserError:
        path, source = default_data_dir(self.cfg.data_dir)
        return UserError(
            f"ALFWorld games not found: {what}.\n"
            f"The data folder is {path} (from {source}); it must hold {DATA_SUBDIR}/<split>/<task>/<trial>/"
            "game.tw-pddl and traj_data.json, with splits train, valid_seen (eval_in_distribution) and "
            "valid_unseen (eval_out_of_distribution).\n"
            "Fix: on a machine with network access run `pip install 'alfworld==0.4.2' && alfworld-download` "
            "(it writes to $ALFWORLD_DATA, default ~/.cache/alfworld), or point `env.data_dir=/path/to/data` "
            "(or ALFWORLD_DATA) at a folder that holds the games."
        )

    def games(self, split: str) -> list[tuple[str, str]]:
        """(task_id, task_type) of every playable game of `split` among the configured task types.
        task_id is the trial folder relative to json_2.1.1: 'train/pick_and_place_simple-.../trial_...'."""
        if split not in SPLIT_DIRS:
            raise ConfigError(f"Unknown ALFWorld split '{split}'. Valid splits: {', '.join(SPLIT_DIRS)}.")
        if split not in self._games:
            root = self.data_dir() / DATA_SUBDIR
            split_dir = root / SPLIT_DIRS[split]
            if not split_dir.is_dir():
                raise self._missing_data(f"{split_dir} does not exist")
            wanted = set(self.task_types())
            found = []
            for dirpath, _, files in os.walk(split_dir):
                if "traj_data.json" not in files or "game.tw-pddl" not in files:
                    continue
                if "movable" in dirpath or "Sliced" in dirpath:  # unsupported, as in AlfredTWEnv
                    continue
                trial = Path(dirpath)
                task_type = _task_type_of(trial)
                if task_type in wanted and _is_solvable(trial / "game.tw-pddl"):
                    found.append((trial.relative_to(root).as_posix(), task_type))
            self._games[split] = sorted(found)
        return self._games[split]

    # -- EnvSuite --------------------------------------------------------------------------------------

    def check(self) -> None:
        import importlib.util

        missing = [m for m in ("alfworld", "textworld") if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(
                f"env=alfworld needs the {', '.join(missing)} package(s). "
                "Fix: pip install 'alfworld==0.4.2' (or `pip install 'epo[envs]'`)."
            )
        self.task_types()  # validates the names
        for split in dict.fromkeys([self.cfg.train_split, *self.cfg.eval_splits]):
            if not self.games(split):
                split_dir = self.data_dir() / DATA_SUBDIR / SPLIT_DIRS[split]
                raise self._missing_data(
                    f"{split_dir} has no solvable games of the task types {', '.join(self.task_types())}"
                )

    def levels(self) -> list[str]:
        """Task types in alfworld's order (roughly easiest first); a curriculum level is one task type."""
        return self.task_types()

    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        games = self.games(split)
        if level is not None:  # one task type, or several separated by commas
            allowed = {resolve_task_type(part) for part in level.split(",")}
            games = [g for g in games if g[1] in allowed]
        if not games:
            what = f"no games of split {split}" + (f" and level {level}" if level else "")
            raise self._missing_data(what)
        # Without replacement while the split lasts, then further full passes: every game before any repeat.
        picked: list[tuple[str, str]] = []
        while len(picked) < n:
            picked.extend(rng.sample(games, min(len(games), n - len(picked))))
        return [Task(task_id, task_type, rng.randrange(2**31), split) for task_id, task_type in picked]

    def make_env(self, reads_expert: bool = True) -> Env:
        return AlfworldEnv(self.data_dir(), max_turns=self.cfg.max_turns, expert=self.wants_expert(reads_expert),
                           fast_textgen=self.cfg.fast_textgen, cache_pddl=self.cfg.cache_pddl)

    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        found = {}
        for package in ("alfworld", "textworld", "fast-downward-textworld"):
            try:
                found[package] = version(package)
            except PackageNotFoundError:
                pass
        return found


def _facts(state: Any) -> set[tuple[str, tuple[str, ...]]]:
    """The state's PDDL facts as (predicate, arguments): ('inreceptacle', ('apple 1', 'countertop 1'))."""
    return {(fact.name, tuple(name.strip() for name in fact.names)) for fact in state["facts"] or []}


def _object_class(name: str) -> str:
    """'apple 1' -> 'apple' (objects and receptacles are named '<class> <number>')."""
    return name.split(" ")[0]


@contextlib.contextmanager
def _expert_randomness(rng: random.Random) -> Iterator[None]:
    """The handcoded expert breaks ties with the module-level `random`; give it this env's generator for
    the call, so its choices depend on the task's seed only (not on which envs share the process)."""
    from alfworld.agents.expert import handcoded_expert

    saved = handcoded_expert.random
    handcoded_expert.random = rng  # a Random instance has the same choice() the expert uses
    try:
        yield
    finally:
        handcoded_expert.random = saved


class AlfworldEnv(Env):
    """One ALFWorld game at a time; the TextWorld engine is built on the first reset and reused."""

    def __init__(self, data_dir: Path, max_turns: int, expert: bool = True,
                 fast_textgen: bool = True, cache_pddl: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.max_turns = max_turns
        self.use_expert = expert
        self.fast_textgen = fast_textgen
        self.cache_pddl = cache_pddl
        self._tw: Any = None  # textworld environment with alfworld's demangler
        self._expert: Any = None
        self._task: Task | None = None
        self._rng = random.Random(0)
        self._goal = ""
        self._turn = 0
        self._expert_action: str | None = None
        self._targets: dict[str, str] = {}  # object_target, parent_target, toggle_target (lower case)
        self._reached: set[str] = set()
        self._placed_at_start = 0

    def _game_file(self, task: Task) -> Path:
        return self.data_dir / DATA_SUBDIR / task.task_id / "game.tw-pddl"

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        game_file = self._game_file(task)
        if not game_file.is_file():
            raise UserError(f"ALFWorld game {task.task_id} not found at {game_file}; check env.data_dir.")
        _import_alfworld(self.data_dir)
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
        from alfworld.agents.expert import HandCodedTWAgent

        if self._tw is None:
            if self.fast_textgen:
                memoize_textworld_parsers()
                fast_textgen_copies()
            if self.cache_pddl:
                cache_pddl_translations()
            infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=True)
            self._tw = textworld.start(str(game_file), request_infos=infos,
                                       wrappers=[AlfredDemangler(shuffle=False)])
        else:
            self._tw.load(str(game_file))
        state = self._tw.reset()
        self._task, self._turn = task, 0
        self._rng = random.Random(task.seed)
        intro = state.feedback
        match = _GOAL.search(intro)
        self._goal = match.group(1).strip() if match else ""
        self._expert_action = None
        with open(game_file.parent / "traj_data.json") as f:
            params = json.load(f)["pddl_params"]
        self._targets = {k: str(params.get(k) or "").lower() for k in ("object_target", "parent_target",
                                                                      "toggle_target")}
        self._reached = set()
        self._placed_at_start = self._placed_count(_facts(state))
        if self.use_expert:
            # As alfworld's AlfredExpert: the expert reads the intro (the receptacles), then says "look".
            self._expert = HandCodedTWAgent(max_steps=200)
            self._expert.reset(str(game_file))  # reads traj_data.json next to the game file
            self._expert.observe(intro)
            self._expert_action = "look"
        observation = intro.replace(_WELCOME, "").strip()
        return observation, self._info(state, truncated=False, events=self._new_events(state))

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        action = action.strip()
        state, _, _ = self._tw.step(action)
        self._turn += 1
        won = bool(state["won"])
        if self.use_expert:
            self._expert_action = self._next_expert_action(state, action)
        truncated = not won and self._turn >= self.max_turns
        info = self._info(state, truncated, events=self._new_events(state))
        return StepResult(state.feedback, 1.0 if won else 0.0, won or truncated, info)

    def _next_expert_action(self, state: Any, last_action: str) -> str | None:
        if self._expert_action is None:  # the expert gave up earlier in this episode
            return None
        try:
            with _expert_randomness(self._rng):
                action = self._expert.act(state, 0, state["won"], last_action)
        except Exception:  # noqa: BLE001 - HandCodedAgentTimeout and the expert's own bugs
            return None
        return action if action in state["admissible_commands"] else "look"

    # -- subgoal events (see the module docstring) -------------------------------------------------------

    def _placed_count(self, facts: set[tuple[str, tuple[str, ...]]]) -> int:
        """How many target objects are in receptacles of the goal class."""
        wanted = (self._targets["object_target"], self._targets["parent_target"])
        return sum(predicate == "inreceptacle" and tuple(map(_object_class, args)) == wanted
                   for predicate, args in facts)

    def _new_events(self, state: Any) -> list[str]:
        """The task's subgoal events that hold now for the first time in this episode."""
        task_type = self._task.task_type
        target, toggle = self._targets["object_target"], self._targets["toggle_target"]
        facts = _facts(state)
        held_targets = [args[-1] for predicate, args in facts  # holds(agent1, 'apple 1')
                        if predicate == "holds" and _object_class(args[-1]) == target]
        feedback = state.feedback.lower()
        holds = {
            "found_target": "you see" in feedback and re.search(rf"\b{re.escape(target)} \d+\b", feedback),
            "picked": bool(held_targets),
            "transformed": task_type in _TRANSFORM_FACT
            and any((_TRANSFORM_FACT[task_type], (name,)) in facts for name in held_targets),
            "found_lamp": bool(toggle) and any(re.fullmatch(rf"use {re.escape(toggle)} \d+", command)
                                               for command in state["admissible_commands"]),
            "placed_first": self._placed_count(facts) > self._placed_at_start,
        }
        events = [name for name in SUBGOALS[task_type] if holds[name] and name not in self._reached]
        self._reached.update(events)
        return events

    def _info(self, state: Any, truncated: bool, events: list[str]) -> dict[str, Any]:
        won = bool(state["won"])
        return {
            "goal": self._goal,
            "admissible_commands": [c for c in state["admissible_commands"] if c != "help"],
            "won": won,
            "lost": False,
            "task_type": self._task.task_type,
            "task_id": self._task.task_id,
            "subgoals": events,
            "progress": 1.0 if won else len(self._reached) / (len(SUBGOALS[self._task.task_type]) + 1),
            "expert_action": self._expert_action,
            "expert_thought": None,
            "truncated": truncated,
        }

    def close(self) -> None:
        if self._tw is not None:
            with contextlib.suppress(Exception):
                self._tw.close()
            self._tw = None
