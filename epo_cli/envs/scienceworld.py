"""env=scienceworld: ScienceWorld 1.2.3 (30 science tasks, 7,207 variations), a Scala simulator in a JVM.

Splits are ScienceWorld's own variation splits, read from its API: train -> train,
eval_in_distribution -> dev, eval_out_of_distribution -> test. A task is `<task name>/<variation>`.
`sample_tasks` cycles through the configured task names in a shuffled order (each task equally often, so
tasks with hundreds of variations do not crowd out those with ten), then draws a variation of that task.
A curriculum level is a task name (or id such as 1-1), or several joined by commas; by default a
curriculum climbs env.tasks in the order given, one task per level, else `STAGES` (all 30 tasks in four
groups of rising horizon). Tasks leave Task.level unset (the curriculum tags them).

Each env owns a JVM (~0.7 GB, ~4 s to start), started on its first reset; `close()` shuts it down. When its
process dies instead, the JVM exits by itself (py4j's die-on-broken-pipe watches its stdin). The JVM gets
`env.jvm_options` through JAVA_TOOL_OPTIONS (ScienceWorld's launcher takes no JVM flags): by default one
serial GC thread and one CPU per JVM, since every env has a JVM of its own and a JVM sized for the whole
machine spends cores on parallel GC and JIT threads (scripts/bench/bench_envs.py: 20-30% less CPU per step).

Info keys: goal (the task description), admissible_commands, won (score 100), lost (a wrong `focus on`:
score -100, the episode is over), task_type (the task name), task_id, subgoals, progress, expert_action,
expert_thought (None), truncated (max_turns reached), plus
    score             int        ScienceWorld's score, -100..100
    action_templates  list[str]  the action templates ("focus on OBJ", ...), constant per task
    objects           list[str]  the object names the parser knows right now
    num_valid_actions int        how many valid action-object combinations there are now

admissible_commands: ScienceWorld's valid action-object combinations, which run to a thousand in a full
room. They are capped at `max_admissible` (0 = no cap): "look around" and "inventory" always, the rest a
sample drawn from the task's seed and the turn (the same on every run), sorted. The agent may still type any
other action; the list is a hint, not the action space.

reward: the env reward is 1.0 on success either way (the algorithm scales it). "sparse" reports success
only (progress is 0 or 1, subgoals empty); "dense" reports progress = max(score, 0) / 100 and, in
subgoals, the descriptions of ScienceWorld's goal-progress items that became true on this step, for
curricula and intermediate rewards.

expert_action: the next action of ScienceWorld's gold path while the agent has followed it exactly, None
once it deviated (the gold path does not replan).

Two simulator traps are handled here: an ambiguous command makes ScienceWorld wait for a number, so the
env answers "0" (its first reading) itself; "reset task" would restart the simulation under the agent, so
it is refused as an unknown action.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from epo_cli.config import EnvConfig, num, one_of
from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.errors import ConfigError, UserError
from epo_cli.seeding import derive_seed

SPLITS = {"train": "train", "eval_in_distribution": "dev", "eval_out_of_distribution": "test"}
#: always offered when valid (cheap, safe information-gathering actions)
ALWAYS_ADMISSIBLE = ("look around", "inventory")
_REFUSED = {"reset task"}
_UNKNOWN_ACTION = "No known action matches that input."
#: Default curriculum levels when env.tasks is empty: groups of tasks, shortest/simplest first. A heuristic
#: from the tasks' gold-path lengths and the number of sub-procedures they need (find and identify; use one
#: instrument or mix; change a state of matter or measure; grow and breed over many steps).
STAGES: tuple[tuple[str, ...], ...] = (
    ("find-living-thing", "find-non-living-thing", "find-plant", "find-animal", "lifespan-longest-lived",
     "lifespan-shortest-lived", "lifespan-longest-lived-then-shortest-lived", "identify-life-stages-1",
     "identify-life-stages-2"),
    ("use-thermometer", "test-conductivity", "test-conductivity-of-unknown-substances", "power-component",
     "power-component-renewable-vs-nonrenewable-energy", "chemistry-mix",
     "chemistry-mix-paint-secondary-color", "chemistry-mix-paint-tertiary-color",
     "inclined-plane-determine-angle"),
    ("boil", "melt", "freeze", "change-the-state-of-matter-of", "measure-melting-point-known-substance",
     "measure-melting-point-unknown-substance", "inclined-plane-friction-named-surfaces",
     "inclined-plane-friction-unnamed-surfaces"),
    ("grow-plant", "grow-fruit", "mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant"),
)


@dataclass
class ScienceWorldConfig(EnvConfig):
    name: str = "scienceworld"
    #: task names (e.g. boil, find-animal) or ids (e.g. 1-1); empty: all 30
    tasks: list[str] = field(default_factory=list)
    #: ScienceWorld simplifications: "easy" (all of them), "" (none) or a comma list such as
    #: "teleportAction,openDoors"
    simplification: str = "easy"
    max_turns: int = num(30, ge=1)
    #: sparse: success only | dense: also score progress (info.progress) and subgoal events (info.subgoals)
    reward: str = one_of("sparse", ("sparse", "dense"))
    #: worker processes; null = one per CPU (each holds its envs' JVMs, ~0.7 GB each)
    num_workers: int | None = num(None, ge=0, le=1024)
    #: cap on info.admissible_commands (0 = all valid action-object combinations)
    max_admissible: int = num(50, ge=0)
    #: generate the gold path at each reset for info.expert_action: null = where the run reads it (SFT
    #: from the gold paths, `epo eval policy=expert`, the tiny tokenizer's corpus), not in RL rollouts;
    #: true/false = always/never
    expert: bool | None = None
    #: JVM flags for each env's simulator, added to JAVA_TOOL_OPTIONS when it starts ("" = the JVM's defaults)
    jvm_options: str = "-XX:+UseSerialGC -XX:ActiveProcessorCount=1"


def java_problem() -> str | None:
    """Why ScienceWorld cannot start a JVM here, or None if `java` is on PATH and runs."""
    java = shutil.which("java")
    if java is None:
        return "`java` was not found on PATH"
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`{java} -version` failed to run ({err})"
    if done.returncode != 0:
        return f"`{java} -version` exited with code {done.returncode}: {done.stderr.strip()[:200]}"
    return None


def jvm_options_problem(jvm_options: str) -> str | None:
    """What the JVM says about `jvm_options` (passed as start_simulator passes them), or None when it starts
    with them: checked before any env starts, so a bad option is one message naming the setting."""
    java = shutil.which("java")
    if not jvm_options or java is None:
        return None
    saved = os.environ.get("JAVA_TOOL_OPTIONS")
    env = {**os.environ, "JAVA_TOOL_OPTIONS": f"{saved} {jvm_options}" if saved else jvm_options}
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`java -version` with them failed to run ({err})"
    if done.returncode == 0:
        return None
    said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("Picked up")]
    return " ".join(said[:2])[:300] or f"exit code {done.returncode}"


def _task_names() -> list[str]:
    from scienceworld.constants import ID2TASK

    return list(ID2TASK.values())


def resolve_task(name: str) -> str:
    """A task name or id ("1-1", "boil", "task-1-boil") -> ScienceWorld's task name."""
    from scienceworld.utils import infer_task

    resolved = infer_task(str(name).strip())
    if resolved not in _task_names():
        raise ConfigError(f"Unknown ScienceWorld task '{name}'. Valid tasks: {', '.join(_task_names())}.")
    return resolved


class ScienceWorldSuite(EnvSuite):
    name = "scienceworld"
    config_class = ScienceWorldConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        #: task -> split -> variations; read from ScienceWorld's API once (needs a JVM), then pickled along
        self._variations: dict[str, dict[str, list[int]]] = {}

    def task_names(self) -> list[str]:
        names = [resolve_task(t) for t in self.cfg.tasks] if self.cfg.tasks else _task_names()
        return list(dict.fromkeys(names))

    def check(self) -> None:
        import importlib.util

        if importlib.util.find_spec("scienceworld") is None:
            raise UserError("env=scienceworld needs the scienceworld package. "
                            "Fix: pip install 'scienceworld==1.2.3' (or `pip install 'epo[envs]'`).")
        problem = java_problem()
        if problem:
            raise UserError(
                f"ScienceWorld needs Java: {problem}. Its simulator runs in a Java virtual machine.\n"
                "Fix: install Java 17 (Debian/Ubuntu: `sudo apt-get install openjdk-17-jre-headless`; "
                "conda: `conda install -c conda-forge openjdk=17`; macOS: `brew install openjdk@17`) and "
                "put its bin/ folder on PATH, so that `java -version` works in the shell that runs epo."
            )
        if self.cfg.reward not in ("sparse", "dense"):
            raise ConfigError(
                f"Invalid value '{self.cfg.reward}' for 'env.reward'. Valid values: sparse, dense.")
        if self.cfg.max_admissible < 0:
            raise ConfigError("env.max_admissible must be >= 0 (0 = no cap).")
        unknown = [s for s in str(self.cfg.simplification).split(",") if s and s not in SIMPLIFICATIONS]
        if unknown:
            raise ConfigError(f"env.simplification: unknown simplification(s) {', '.join(unknown)}. Valid: "
                              f"{', '.join(SIMPLIFICATIONS)} (a comma list without spaces, or \"\" for none).")
        self.task_names()  # validates the names
        rejected = jvm_options_problem(self.cfg.jvm_options)
        if rejected:
            raise ConfigError(f"env.jvm_options='{self.cfg.jvm_options}' is refused by the JVM: {rejected}. Fix "
                              "the options, or set env.jvm_options='' for the JVM's defaults.")

    def curriculum_levels(self) -> list[str]:
        """env.tasks in the order given, one task per level; with env.tasks empty, `STAGES` (all 30 tasks in
        four groups of rising horizon; a level of several tasks joins them with commas)."""
        if self.cfg.tasks:
            return [str(t) for t in self.cfg.tasks]
        return [",".join(group) for group in STAGES]

    def check_subgoal_rewards(self) -> None:
        """Progress events come only with env.reward=dense."""
        if self.cfg.reward != "dense":
            raise ConfigError("curriculum.subgoal_rewards=true on env=scienceworld needs its progress events, "
                              "which it reports only with env.reward=dense. Fix: add env.reward=dense.")

    def variations(self) -> dict[str, dict[str, list[int]]]:
        """Variation ids per task and split, from ScienceWorld's API (starts one JVM the first time)."""
        missing = [t for t in self.task_names() if t not in self._variations]
        if missing:
            sim = start_simulator(self.cfg.jvm_options)
            try:
                for task in missing:
                    sim.load(task, 0, "")
                    self._variations[task] = {
                        "train": sim.get_variations_train(),
                        "eval_in_distribution": sim.get_variations_dev(),
                        "eval_out_of_distribution": sim.get_variations_test(),
                    }
            finally:
                _shutdown(sim)
        return {t: self._variations[t] for t in self.task_names()}

    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        if split not in SPLITS:
            raise ConfigError(f"Unknown ScienceWorld split '{split}'. Valid splits: {', '.join(SPLITS)}.")
        names = self.task_names()
        if level is not None:  # one task name, or several separated by commas
            names = [resolve_task(part) for part in level.split(",")]
            unknown = set(names) - set(self.task_names())
            if unknown:
                raise ConfigError(
                    f"Curriculum level {level!r} names tasks not in env.tasks: {sorted(unknown)}")
        table = self.variations()
        tasks: list[Task] = []
        order: list[str] = []
        while len(tasks) < n:
            if not order:
                order = rng.sample(names, len(names))
            name = order.pop(0)
            variation = rng.choice(table[name][split])
            tasks.append(Task(f"{name}/{variation}", name, rng.randrange(2**31), split))
        return tasks

    def make_env(self, reads_expert: bool = True) -> Env:
        cfg = self.cfg
        return ScienceWorldGame(simplification=cfg.simplification, max_turns=cfg.max_turns,
                                dense=cfg.reward == "dense", max_admissible=cfg.max_admissible,
                                expert=self.wants_expert(reads_expert), jvm_options=cfg.jvm_options)

    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return {"scienceworld": version("scienceworld")}
        except PackageNotFoundError:
            return {}


#: ScienceWorld's simplifications (ScienceWorldEnv.get_possible_simplifications, plus "easy" for all of them)
SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                   "noElectricalAction")


def start_simulator(jvm_options: str) -> Any:
    """A ScienceWorldEnv whose JVM starts with `jvm_options` (through JAVA_TOOL_OPTIONS, restored after)."""
    from scienceworld import ScienceWorldEnv

    saved = os.environ.get("JAVA_TOOL_OPTIONS")
    if jvm_options:
        os.environ["JAVA_TOOL_OPTIONS"] = f"{saved} {jvm_options}" if saved else jvm_options
    try:
        # We end episodes at max_turns ourselves; ScienceWorld's own step limit must never fire first.
        return ScienceWorldEnv("", envStepLimit=10**6)
    except Exception as err:  # noqa: BLE001 - the JVM refused its options, or did not start at all
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        _collect_half_made_simulator(err)
        raise UserError(f"ScienceWorld's Java VM did not start (env.jvm_options='{jvm_options}'): {first}. Check "
                        "the options (`java <options> -version` shows what the JVM says), or set "
                        "env.jvm_options='' for the JVM's defaults.") from None
    finally:
        if saved is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = saved


def _collect_half_made_simulator(err: BaseException) -> None:
    """A ScienceWorldEnv whose JVM did not start is only referenced from the exception's frames; its __del__
    then fails (it never got a gateway) and Python would print that as an "Exception ignored" traceback
    after epo's message. Collect it now, with that one report silenced."""
    import gc
    import sys

    err.__traceback__ = None
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _shutdown(sim: Any) -> None:
    """Stop a ScienceWorldEnv's JVM and wait for it; kill it if it lingers."""
    process = getattr(getattr(sim, "_gateway", None), "java_process", None)
    with contextlib.suppress(Exception):
        sim.close()
    if process is not None:
        try:
            process.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a JVM that ignores shutdown is killed
            process.kill()
            process.wait(timeout=10)
    # ScienceWorldEnv.__del__ calls close() again; make that a no-op on a dead gateway.
    with contextlib.suppress(Exception):
        sim.close = lambda: None


def _completed_subgoals(progress_text: str) -> dict[tuple[str, str], str]:
    """Parse ScienceWorld's goal-progress table: {(section, index): description} of the true items."""
    done: dict[tuple[str, str], str] = {}
    section = ""
    for line in progress_text.splitlines():
        if line.rstrip().endswith("Subgoals:"):
            section = line.strip()
            continue
        parts = [p.strip() for p in line.split("\t")]
        if len(parts) >= 4 and parts[0].isdigit() and parts[1] == "true":
            done[(section, parts[0])] = parts[3] or parts[2]
    return done


class ScienceWorldGame(Env):
    """One ScienceWorld episode at a time, in this env's own JVM."""

    def __init__(self, simplification: str = "easy", max_turns: int = 30, dense: bool = False,
                 max_admissible: int = 50, expert: bool = True,
                 jvm_options: str = ScienceWorldConfig.jvm_options) -> None:
        self.simplification = simplification
        self.max_turns = max_turns
        self.dense = dense
        self.max_admissible = max_admissible
        self.use_expert = expert
        self.jvm_options = jvm_options
        self._sim: Any = None
        self._task: Task | None = None
        self._goal = ""
        self._templates: list[str] = []
        self._gold: list[str] = []
        self._gold_index: int | None = 0  # None once the agent left the gold path
        self._subgoals_done: dict[tuple[str, str], str] = {}
        self._turn = 0

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        if self._sim is None:
            self._sim = start_simulator(self.jvm_options)
        name, _, variation = task.task_id.rpartition("/")
        self._sim.load(name, int(variation), self.simplification, generateGoldPath=self.use_expert)
        observation, _ = self._sim.reset()
        self._task, self._turn = task, 0
        self._goal = self._sim.get_task_description().replace("Task Description:", "").strip()
        self._templates = self._sim.get_possible_actions()
        self._gold = self._sim.get_gold_action_sequence() if self.use_expert else []
        self._gold_index = 0 if self.use_expert else None
        self._subgoals_done = _completed_subgoals(self._sim.get_goal_progress()) if self.dense else {}
        score = int(round(100 * self._sim.server.getScore()))
        return observation, self._info(score, [], truncated=False)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        action = " ".join(action.split())
        server = self._sim.server  # the lean path: ScienceWorldEnv.step also fetches look/inventory/task text
        if action in _REFUSED:
            observation = _UNKNOWN_ACTION
        else:
            observation = server.step(action)
            if observation.startswith("Ambiguous request"):
                observation = server.step("0")  # take the first reading instead of waiting for a number
        self._turn += 1
        score = int(round(100 * server.getScore()))
        won, lost = score >= 100, score < 0
        done = bool(server.getCompleted()) or won or lost
        self._advance_expert(action)
        new_subgoals: list[str] = []
        if self.dense:
            now = _completed_subgoals(self._sim.get_goal_progress())
            new_subgoals = [desc for key, desc in now.items() if key not in self._subgoals_done]
            self._subgoals_done = now
        truncated = not done and self._turn >= self.max_turns
        return StepResult(observation, 1.0 if won else 0.0, done or truncated,
                          self._info(score, new_subgoals, truncated))

    def _advance_expert(self, action: str) -> None:
        if self._gold_index is None:
            return
        if self._gold_index < len(self._gold) and action == self._gold[self._gold_index]:
            self._gold_index += 1
        else:
            self._gold_index = None

    def _admissible(self) -> tuple[list[str], int]:
        valid = [a for a in dict.fromkeys(self._sim.server.getValidActionObjectCombinations())
                 if a not in _REFUSED]
        if not self.max_admissible or len(valid) <= self.max_admissible:
            return sorted(valid), len(valid)
        keep = [a for a in ALWAYS_ADMISSIBLE if a in valid]
        rest = [a for a in valid if a not in keep]
        rng = random.Random(derive_seed(self._task.seed, "admissible_sample", self._turn))  # same on every run
        keep += rng.sample(rest, max(0, self.max_admissible - len(keep)))
        return sorted(keep), len(valid)

    def _info(self, score: int, new_subgoals: list[str], truncated: bool) -> dict[str, Any]:
        admissible, num_valid = self._admissible()
        won = score >= 100
        expert = None
        if self._gold_index is not None and self._gold_index < len(self._gold):
            expert = self._gold[self._gold_index]
        return {
            "goal": self._goal,
            "admissible_commands": admissible,
            "won": won,
            "lost": score < 0,
            "task_type": self._task.task_type,
            "task_id": self._task.task_id,
            "subgoals": new_subgoals,
            "progress": max(score, 0) / 100 if self.dense else float(won),
            "expert_action": expert,
            "expert_thought": None,
            "truncated": truncated,
            "score": score,
            "action_templates": self._templates,
            "objects": self._sim.get_possible_objects(),
            "num_valid_actions": num_valid,
        }

    def close(self) -> None:
        if self._sim is not None:
            _shutdown(self._sim)
            self._sim = None
