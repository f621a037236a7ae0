"""Rollout and update overheads of the RL loop, measured in one process against in-process baselines.

    python scripts/bench/bench_rollout.py [--model PATH] [--algo grpo] [--iterations 3] [OVERRIDES...]
    python scripts/bench/bench_rollout.py --modes [--envs household,alfworld] [--iterations 2] [--model PATH]
    python scripts/bench/bench_rollout.py --iteration [--envs alfworld,household] [--iterations 2] [--model PATH]

--modes: the rollout's speed-ups (rollout.overlap, rollout.shared_prefill) on each env, against lock-step
rollouts of the same tasks in the same run (modes interleaved per iteration, so drift in the machine's
load hits all alike). Every mode must play the same episodes as lock-step ("same" column).
overlap ratio = rollout_s / (generate_s + env_s); env_s = resets + time some env was stepping.
ALFWorld plays the shared games (--alfworld-data, default $ALFWORLD_DATA or ../shared/alfworld) with
--alfworld-workers env workers (default 2). household-sleepy: household in as many workers, each step
sleeping --sleep-ms (an env that waits instead of computing: what overlap hides when the CPU is busy).
Targets: overlap ratio <= 0.75 and rollout >= 1.4x faster on ALFWorld with 2 workers;
household not slower. The modes share one Trainer's env workers and replay the same games, so with
env.cache_pddl=true (the default) the first mode of an iteration pays the resets the later ones find
cached: compare modes with `env.cache_pddl=false`, or use --iteration (own workers per variant).

--iteration: whole RL iterations (Trainer.rl_step: rollout, scoring, advantages, update) with the settings
from before the speed-ups ("before": rollout.overlap=false, rollout.shared_prefill=false, algo.pack_tokens=0,
algo.reuse_scoring_forward=false, env.cache_pddl=false and TextWorld's parser cache alone, which is what
env.fast_textgen was before its exact deepcopy), today's defaults ("today") and today's defaults with
rollout.overlap=true ("today+overlap"); "before-stock" (before, stock TextWorld) on request (--variants).
Each variant is its own Trainer (same seed, so the same tasks and, as long as the updates agree, the same
episodes) with its own env workers, which install only that variant's ALFWorld patches (they are
process-wide) and report what they installed; variants are interleaved per iteration.

rollout overhead = wall time of a rollout / (time inside generate + time inside env.step)
update overhead  = loss-stack update time / a plain causal-LM forward+backward(+step) over the same
                   micro-batches (same padded tokens, HF's built-in cross-entropy on all positions)
padding efficiency = real tokens / padded tokens in the update's micro-batches
Targets: rollout overhead <= 1.10, update overhead <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from common import flat_policy, interleaved_iterations, scratch_dir, scratch_trainer, start_from

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


class SleepyEnv:
    """An env whose steps take `delay_s` longer without using the CPU (a remote or I/O-bound env)."""

    def __init__(self, env, delay_s: float) -> None:
        self.env, self.delay_s = env, delay_s

    def reset(self, task):
        time.sleep(5 * self.delay_s)
        return self.env.reset(task)

    def step(self, action):
        time.sleep(self.delay_s)
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


class WrappedSuite:
    """A run's env suite whose envs are wrapped (`wrap`); everything else is the inner suite's. Handed to the
    Trainer as the run's suite, so its env pool (workers included: it is pickled into them) plays the wrapped envs."""

    def __init__(self, suite) -> None:
        self.suite = suite

    def __getattr__(self, name: str):
        if name == "suite":  # unpickling looks up attributes before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.suite, name)

    def make_env(self, reads_expert: bool = True):
        return self.wrap(self.suite.make_env(reads_expert=reads_expert))


class SleepySuite(WrappedSuite):
    def __init__(self, suite, delay_s: float) -> None:
        super().__init__(suite)
        self.delay_s = delay_s

    def wrap(self, env) -> SleepyEnv:
        return SleepyEnv(env, self.delay_s)


#: (name, rollout.overlap, rollout.shared_prefill); the first is the baseline
MODES = [("lock-step", False, False), ("shared prefill", False, True), ("overlap", True, False),
         ("overlap + shared prefill", True, True)]


def env_data(args: argparse.Namespace) -> str:
    shared = [Path(__file__).resolve().parents[2].parent / "shared" / "alfworld", Path("/work/shared/alfworld")]
    found = [str(p) for p in shared if (p / "json_2.1.1").is_dir()]
    return args.alfworld_data or os.environ.get("ALFWORLD_DATA") or (found[0] if found else str(shared[0]))


def env_overrides(env: str, args: argparse.Namespace) -> list[str]:
    if env.startswith("household"):
        workers = args.household_workers if env == "household" else args.alfworld_workers
        return ["env=household", "env.level=small_pick_and_light", "env.prompt_template=compact",
                f"env.num_workers={workers}", f"env.max_turns={args.household_turns}"]
    return ["env=alfworld", f"env.data_dir={env_data(args)}", f"env.num_workers={args.alfworld_workers}",
            f"env.max_turns={args.alfworld_turns}", f"env.expert={str(args.alfworld_expert).lower()}"]


class CountingPool:
    """The run's env pool, counting the calls the rollout makes: lock-step turns call `step`, overlapped ones
    `submit` and `collect` (and `start_reset` where the pool has it). Everything else is the pool's own."""

    COUNTED = ("reset", "start_reset", "step", "submit", "collect")

    def __init__(self, pool) -> None:
        self.pool = pool
        self.calls = dict.fromkeys(self.COUNTED, 0)

    def __getattr__(self, name: str):
        if name in ("pool", "calls"):  # not set yet
            raise AttributeError(name)
        attr = getattr(self.pool, name)
        if name not in self.COUNTED:
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def prefill_of(policy) -> bool | None:
    """Whether `policy` (what Models.sampling_policy returns) prefills shared prompts once: its own setting,
    or its rollout engine's."""
    if hasattr(policy, "shared_prefill"):
        return policy.shared_prefill
    return getattr(getattr(policy, "engine", None), "shared_prefill", None)


def check_mode_reached(name: str, overlap: bool, prefill: bool, sampler, policy, calls: dict[str, int]) -> None:
    """The mode's settings are those of the parts that played, and the pool saw only that mode's calls:
    overlap submits steps (never `step`), lock-step steps (never `submit`)."""
    problems = []
    if sampler.settings.overlap != overlap:
        problems.append(f"the sampler's settings.overlap is {sampler.settings.overlap}")
    if prefill_of(policy) != prefill:
        problems.append(f"the policy's shared prefill is {prefill_of(policy)}")
    if overlap and (calls["submit"] == 0 or calls["step"] > 0):
        problems.append(f"the env pool saw lock-step calls {calls}")
    if not overlap and (calls["step"] == 0 or calls["submit"] > 0):
        problems.append(f"the env pool saw overlapped calls {calls}")
    if problems:
        raise SystemExit(f"bench_rollout --modes: mode '{name}' (overlap={overlap}, shared_prefill={prefill}) "
                         f"did not reach its parts: {'; '.join(problems)}")


def compare_modes(env: str, args: argparse.Namespace) -> list[tuple[str, dict[str, float], bool, dict]]:
    """Each mode's mean rollout figures on `env`, whether it played the same episodes as lock-step, and what
    its parts held (sampler and policy settings, the env pool's calls)."""
    from dataclasses import replace

    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.loading import model_source
    from epo_cli.training.group_sampler import GroupSampler

    overrides = [f"algo={args.algo}", *env_overrides(env, args), f"algo.tasks_per_step={args.tasks}",
                 f"algo.group_size={args.group_size}", "env.eval_splits=[]", "logger.console=false",
                 "logger.tensorboard=false", "trainer.total_steps=100", "model=tiny"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    # one Trainer per rollout.shared_prefill value (the rollout policy reads it when the Trainer builds its
    # models), composed like `epo train`'s; their weights are the same (same seed, no update here)
    trainers = {}
    for prefill in (False, True):
        cfg = compose([*overrides, *args.overrides, f"rollout.shared_prefill={str(prefill).lower()}"])
        suite = make_suite(cfg.env)
        if env == "household-sleepy":  # steps that wait without computing: what overlap can hide on a busy CPU
            model_source(cfg.model, suite, cfg.seed)  # the tiny model, built (once) on the plain envs
            suite = SleepySuite(suite, args.sleep_ms / 1000)
        trainers[prefill] = scratch_trainer(cfg, f"bench_rollout_{env}_", suite)
    trainer = trainers[False]  # its env pool plays every mode (the other's never starts a worker)
    try:
        # each mode: a sampler built with that mode's overlap (replace on the Trainer's frozen settings, before
        # the sampler is built) on the shared env pool, counting its calls, and the policy of the Trainer with
        # that mode's shared prefill
        pools = {name: CountingPool(trainer.pool) for name, _, _ in MODES}
        samplers = {name: GroupSampler(replace(trainers[prefill].sampler.settings, overlap=overlap), trainer.dist.rank,
                                       trainer.dist.world_size, trainer.suite, pools[name], trainer.curriculum,
                                       trainer.builder, trainer.models.tokenizer)
                    for name, overlap, prefill in MODES}
        policies = {name: trainers[prefill].models.sampling_policy()
                    for name, _, prefill in MODES}
        # start the workers and build every slot's env before timing (a one-off cost of the first rollout)
        import random

        n = args.tasks * args.group_size
        trainer.pool.reset(trainer.suite.sample_tasks(cfg.env.train_split, n, random.Random(0)))
        sums = {name: {"rollout_s": 0.0, "generate_s": 0.0, "env_s": 0.0, "env_wait_s": 0.0} for name, _, _ in MODES}
        same = {name: True for name, _, _ in MODES}
        for it in range(args.iterations):
            order = MODES if it % 2 == 0 else MODES[::-1]
            played = {}
            for name, overlap, prefill in order:
                before = dict(pools[name].calls)
                rollout = samplers[name].sample(policies[name], it, cfg.trainer.total_steps)
                calls = {k: v - before[k] for k, v in pools[name].calls.items()}
                check_mode_reached(name, overlap, prefill, samplers[name], policies[name], calls)
                episodes, stats = rollout.episodes, rollout.stats
                first_prompts = [ep.turns[0].prompt_ids for ep in episodes if ep.turns]
                played[name] = [(ep.traj_id, [(t.response_ids, t.observation) for t in ep.turns]) for ep in episodes]
                for key in sums[name]:
                    sums[name][key] += getattr(stats, key) / args.iterations
                print(f"  {env} iteration {it} {name}: rollout {stats.rollout_s:.2f}s (generate "
                      f"{stats.generate_s:.2f}s, env {stats.env_s:.2f}s, waited {stats.env_wait_s:.2f}s), "
                      f"{stats.env_steps} steps; env pool calls {calls}", flush=True)
            reference = played[MODES[0][0]]
            for name in played:
                same[name] &= played[name] == reference
        prefill = time_first_turn(trainer, first_prompts)
    finally:
        for each in trainers.values():
            each.pool.close()  # the process group stays: DeepSpeed keeps its groups for the next Trainer
    print(f"  {env} first-turn generate call ({len(first_prompts)} rows, {len(set(map(tuple, first_prompts)))} "
          f"distinct prompts), best of 5: {prefill[False]:.3f}s plain, {prefill[True]:.3f}s shared prefill "
          f"({prefill[False] / prefill[True]:.2f}x)", flush=True)
    reached = {name: {"sampler.settings.overlap": samplers[name].settings.overlap,
                      "policy.shared_prefill": prefill_of(policies[name]), "pool_calls": pools[name].calls}
               for name, _, _ in MODES}
    return [(name, sums[name], same[name], reached[name]) for name, _, _ in MODES]


def time_first_turn(trainer, prompts: list[list[int]]) -> dict[bool, float]:
    """Best-of-5 wall time of one generate call over a rollout's first-turn prompts, with and without
    shared prefill (interleaved): the saving, without the rest of the rollout's noise."""
    from epo_cli.rollout.generation import generate

    policy = trainer.models.sampling_policy()
    seeds = list(range(len(prompts)))
    best = {False: float("inf"), True: float("inf")}
    for _ in range(5):
        for shared in (False, True):
            t0 = time.perf_counter()
            generate(policy.model, prompts, policy.params, policy.tokenizer, seeds=seeds,
                     vocab_limit=policy.vocab_limit, shared_prefill=shared)
            best[shared] = min(best[shared], time.perf_counter() - t0)
    return best


def print_modes(results: dict[str, list[tuple[str, dict[str, float], bool, dict]]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench_rollout --modes ({args.algo}, {args.tasks}x{args.group_size} envs, "
                        f"{args.iterations} iterations, means)")
    for column in ("env", "mode", "rollout s", "generate s", "env s", "waited s", "overlap ratio",
                   "speed-up vs lock-step", "same episodes"):
        table.add_column(column, justify="left" if column in ("env", "mode") else "right")
    for env, rows in results.items():
        base = rows[0][1]["rollout_s"]
        for name, m, same, _ in rows:
            ratio = m["rollout_s"] / max(m["generate_s"] + m["env_s"], 1e-9)
            table.add_row(env, name, f"{m['rollout_s']:.2f}", f"{m['generate_s']:.2f}", f"{m['env_s']:.2f}",
                          f"{m['env_wait_s']:.2f}", f"{ratio:.3f}", f"{base / m['rollout_s']:.2f}x",
                          "yes" if same else "NO")
    Console(width=160).print(table)


# ----------------------------------------------------------------------------------------------------------
# --iteration: whole RL iterations, before the speed-ups / today / today + overlap
# ----------------------------------------------------------------------------------------------------------

#: the rollout and update speed-ups switched off (all envs)
BEFORE = ["rollout.overlap=false", "rollout.shared_prefill=false", "algo.pack_tokens=0",
          "algo.reuse_scoring_forward=false"]
#: ALFWorld's env speed-ups switched off; "before" then installs TextWorld's parser cache alone in its
#: workers (env.fast_textgen as it was before the exact deepcopy joined it)
BEFORE_ALFWORLD = ["env.fast_textgen=false", "env.cache_pddl=false"]
#: name -> (overrides, ALFWorld-only overrides, install the parser cache alone in the env workers)
ITERATION_VARIANTS = {
    "before": (BEFORE, BEFORE_ALFWORLD, True),
    "before-stock": (BEFORE, BEFORE_ALFWORLD, False),
    "today": ([], [], False),
    "today+overlap": (["rollout.overlap=true"], [], False),
}
#: settings each variant prints, from its config
SHOWN_SETTINGS = ["env.fast_textgen", "env.cache_pddl", "env.expert", "env.num_workers"]


def modes_wanted(cfg) -> dict[str, bool]:
    """What a variant's config asks of the parts that each speed-up lives in."""
    algo = cfg.algo
    return {"sampler.settings.overlap": bool(cfg.rollout.overlap),
            "policy.shared_prefill": bool(cfg.rollout.shared_prefill),
            "models.packing": algo.pack_tokens != 0,  # null packs where the attention allows (sdpa: tiny)
            "update.reuses_scoring": bool(algo.reuse_scoring_forward) and algo.monitor.action != "clamp"}


def modes_reached(trainer) -> dict[str, bool]:
    """What the Trainer's parts hold, read from the parts (the policy as Trainer.sample builds it)."""
    return {"sampler.settings.overlap": trainer.sampler.settings.overlap,
            "policy.shared_prefill": prefill_of(trainer.models.sampling_policy()),
            "models.packing": trainer.models.packing,
            "update.reuses_scoring": trainer.policy_update.reuses_scoring()}


def patches_wanted(cfg, parser_cache_only: bool) -> dict[str, bool]:
    """The ALFWorld patches a variant's env workers must report (textworld_patches)."""
    return {"parser_cache": bool(cfg.env.fast_textgen) or parser_cache_only,
            "exact_deepcopy": bool(cfg.env.fast_textgen), "pddl_cache": bool(cfg.env.cache_pddl)}


def check_reached(name: str, wanted: dict[str, bool], reached: dict[str, bool], what: str) -> None:
    wrong = {key: reached.get(key) for key in wanted if reached.get(key) != wanted[key]}
    if wrong:
        raise SystemExit(f"bench_rollout --iteration: variant '{name}' asks for {wanted}, but its {what} hold "
                         f"{wrong}: its row would time something else")


def textworld_patches() -> dict[str, bool]:
    """Which of epo's ALFWorld patches this process has installed (the env workers report these)."""
    import sys

    if "textworld.envs.pddl.textgen" not in sys.modules:
        return {}
    import fast_downward
    import textworld.logic as logic
    from textworld.envs.pddl import textgen

    return {"parser_cache": bool(getattr(textgen._parse_and_convert, "epo_memoized", False)
                                 and getattr(logic._parse_and_convert, "epo_memoized", False)),
            "exact_deepcopy": bool(getattr(textgen.deepcopy, "epo_exact", False)),
            "pddl_cache": bool(getattr(fast_downward.pddl2sas, "epo_cached", False))}


class ProbeEnv:
    """An env that installs the parser cache alone first (when asked) and, after each reset, writes which
    ALFWorld patches its process has, to `probe_dir/<variant>-<pid>.json`."""

    def __init__(self, env, variant: str, parser_cache_only: bool, probe_dir: str) -> None:
        self.env, self.variant, self.parser_cache_only, self.probe_dir = env, variant, parser_cache_only, probe_dir

    def reset(self, task):
        if self.parser_cache_only:
            from epo_cli.envs.textworld_speedups import memoize_textworld_parsers

            memoize_textworld_parsers()  # idempotent; without fast_textgen_copies it copies with copy.deepcopy
        out = self.env.reset(task)
        import json

        path = Path(self.probe_dir) / f"{self.variant}-{os.getpid()}.json"
        path.write_text(json.dumps({"variant": self.variant, "pid": os.getpid(), **textworld_patches()}))
        return out

    def step(self, action):
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


class ProbeSuite(WrappedSuite):
    """What the env pool's workers get (pickled into each): the variant's suite, its envs wrapped in ProbeEnv."""

    def __init__(self, suite, variant: str, parser_cache_only: bool, probe_dir: str) -> None:
        super().__init__(suite)
        self.variant, self.parser_cache_only, self.probe_dir = variant, parser_cache_only, probe_dir

    def wrap(self, env) -> ProbeEnv:
        return ProbeEnv(env, self.variant, self.parser_cache_only, self.probe_dir)


def iteration_overrides(env: str, args: argparse.Namespace) -> list[str]:
    overrides = [f"algo={args.algo}", *env_overrides(env, args), f"algo.tasks_per_step={args.tasks}",
                 f"algo.group_size={args.group_size}", "env.eval_splits=[]", "logger.console=false",
                 "logger.tensorboard=false", "trainer.total_steps=100", "model=tiny"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.quick:
        overrides.append("rollout.max_new_tokens=16")
    return overrides


def compare_iterations(env: str, args: argparse.Namespace) -> dict[str, dict]:
    """Each variant's mean iteration figures on `env`, per iteration whether it played the same episodes as
    the first variant and how its update compares, what its parts and env workers hold, and its settings.

    Every iteration of every variant starts from the first variant's weights and optimizer state
    (common.start_from, untimed): the episodes must then agree exactly (a difference is a speed-up changing
    what is played), and each update is compared with the first variant's from the same point."""
    import json
    import random

    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.loading import model_source
    from epo_cli.training.trainer import Trainer

    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in ITERATION_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; valid: {', '.join(ITERATION_VARIANTS)}")
    probe_dir = scratch_dir(f"bench_iteration_probe_{env}_")
    trainers: dict[str, Trainer] = {}
    played: dict[str, list] = {name: [] for name in variants}  # per iteration
    env_steps: dict[str, int] = {}
    updates: dict[str, list[dict[str, float]]] = {name: [] for name in variants}  # per iteration
    reused: dict[str, list[float]] = {name: [] for name in variants}  # perf/scoring_reused per iteration
    wanted: dict[str, dict[str, bool]] = {}
    try:
        for name in variants:
            common, alfworld_only, parser_cache_only = ITERATION_VARIANTS[name]
            overrides = [*iteration_overrides(env, args), *common, *(alfworld_only if env == "alfworld" else [])]
            cfg = compose([*overrides, *args.overrides])
            suite = make_suite(cfg.env)
            if env == "alfworld":  # this variant's own workers, with only its patches
                model_source(cfg.model, suite, cfg.seed)  # the tiny model, built (once) on the plain envs
                suite = ProbeSuite(suite, name, parser_cache_only, str(probe_dir))
            trainer = scratch_trainer(cfg, f"bench_iteration_{env}_{name}_", suite)
            trainers[name] = trainer
            wanted[name] = modes_wanted(cfg)
            check_reached(name, wanted[name], modes_reached(trainer), "parts")

            def capture(rollout, step: int, _name: str = name) -> None:
                played[_name].append([(ep.traj_id, [(t.response_ids, t.observation) for t in ep.turns])
                                      for ep in rollout.episodes])
                env_steps[_name] = rollout.stats.env_steps

            trainer.on_rollout.append(capture)  # rl_step's own rollout, its episodes kept for the comparison
        # start the workers and build every slot's env before timing (a one-off cost of the first rollout);
        # other tasks than the iterations' (a PDDL cache does not start warm)
        n = args.tasks * args.group_size
        for trainer in trainers.values():
            trainer.pool.reset(trainer.suite.sample_tasks(trainer.cfg.env.train_split, n, random.Random(12345)))
        keys = ["iteration_s", "perf/rollout_s", "perf/generate_s", "perf/env_s", "perf/env_wait_s",
                "perf/score_s", "perf/update_s", "perf/padding_efficiency", "perf/scoring_reused"]

        def show(it: int, name: str, metrics: dict[str, float]) -> None:
            reused[name].append(metrics["perf/scoring_reused"])
            print(f"  {env} iteration {it} {name}: {metrics['iteration_s']:.2f}s = rollout "
                  f"{metrics['perf/rollout_s']:.2f}s (generate {metrics['perf/generate_s']:.2f}s, env "
                  f"{metrics['perf/env_s']:.2f}s) + score {metrics['perf/score_s']:.2f}s + update "
                  f"{metrics['perf/update_s']:.2f}s; {env_steps[name]} env steps, "
                  f"{int(metrics['rollout/samples'])} samples, success {metrics.get('rollout/success', 0.0):.2f}",
                  flush=True)

        reference = trainers[variants[0]]
        start: list = []  # the reference's weights at the start of the iteration

        def prepare(it: int) -> None:
            """Before iteration `it`: compare the last iteration's updates, then start every variant from the
            reference's weights and optimizer state."""
            if start:
                ref_step = flat_policy(reference) - start[0]
                scale = float(ref_step.abs().max())
                for name, trainer in trainers.items():
                    own_step = flat_policy(trainer) - start[0]
                    diff = (own_step - ref_step).abs()
                    updates[name].append({"max_step": scale, "own_max_step": float(own_step.abs().max()),
                                          "max_diff": float(diff.max()),
                                          "share_differing": float((diff > 0.01 * scale).double().mean())})
            if it < args.iterations:
                start_from(reference, [t for t in trainers.values() if t is not reference])
                start[:] = [flat_policy(reference)]

        sums = interleaved_iterations(trainers, args.iterations, keys, show, prepare)
        # per iteration: whether each variant played the same episodes as the reference (the first)
        same = {name: [mine == first for mine, first in zip(played[name], played[variants[0]])] for name in variants}
        differences = {name: [None if ok else first_difference(mine, first)
                              for ok, mine, first in zip(same[name], played[name], played[variants[0]])]
                       for name in variants}
        settings = {name: {key: _select(trainers[name].cfg, key) for key in SHOWN_SETTINGS} for name in variants}
        reached = {name: modes_reached(trainers[name]) for name in variants}
        patches = {name: patches_wanted(trainers[name].cfg, ITERATION_VARIANTS[name][2]) for name in variants
                   if env == "alfworld"}
    finally:
        for trainer in trainers.values():
            trainer.pool.close()  # the process group stays: DeepSpeed keeps its groups for the next Trainer
    probes: dict[str, list[dict]] = {name: [] for name in variants}
    for path in sorted(probe_dir.glob("*.json")):
        probe = json.loads(path.read_text())
        probes[probe.pop("variant")].append(probe)
    for name in variants:
        # scoring reuse is the one mode that leaves a count in the metrics: rows the update scored itself
        if any((share > 0) != wanted[name]["update.reuses_scoring"] for share in reused[name]):
            raise SystemExit(f"bench_rollout --iteration: variant '{name}' wants scoring reuse "
                             f"{wanted[name]['update.reuses_scoring']}, but its updates scored {reused[name]} of "
                             "their rows themselves")
        if env == "alfworld":
            if not probes[name]:
                raise SystemExit(f"bench_rollout --iteration: no env worker of variant '{name}' reported its patches")
            for probe in probes[name]:
                check_reached(name, patches[name], probe, f"env worker {probe['pid']}")
        print(f"  {env} {name}: parts {reached[name]}; {settings[name]}"
              + (f"; env workers: {probes[name]}" if probes[name] else ""), flush=True)
    return {name: {"means": sums[name], "same": same[name], "differences": differences[name],
                   "updates": updates[name], "reached": reached[name],
                   "settings": settings[name], "workers": probes[name]} for name in variants}


def _select(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def first_difference(mine: list, reference: list) -> str:
    """Where two rollouts (lists of (traj_id, [(response_ids, observation) per turn])) first differ."""
    for (traj, turns), (_, ref_turns) in zip(mine, reference):
        for k, ((response, observation), (ref_response, ref_observation)) in enumerate(zip(turns, ref_turns)):
            if response != ref_response:
                return f"trajectory {traj} turn {k}: response"
            if observation != ref_observation:
                return f"trajectory {traj} turn {k}: observation"
        if len(turns) != len(ref_turns):
            return f"trajectory {traj}: {len(turns)} turns, not {len(ref_turns)}"
    return "the episodes' order or count"


def same_column(same: list[bool]) -> str:
    """'3/3', or '2/3 (not 2)': in how many iterations a variant played the same episodes as the reference,
    from the same weights (common.start_from), and which did not."""
    text = f"{sum(same)}/{len(same)}"
    differing = [str(i) for i, ok in enumerate(same) if not ok]
    return text + (f" (not {','.join(differing)})" if differing else "")


def update_column(updates: list[dict[str, float]]) -> str:
    """The largest difference between a variant's update and the reference's from the same point, as a share
    of the reference's largest step, and the share of weights whose steps differ by more than 1% of it (worst
    iteration)."""
    if not updates:
        return "-"
    worst = max(u["max_diff"] / max(u["max_step"], 1e-30) for u in updates)
    share = max(u["share_differing"] for u in updates)
    # a variant that did not move where the reference did (e.g. a gradient that is exactly 0 here, rounding
    # noise there)
    still = [str(i) for i, u in enumerate(updates) if u.get("own_max_step", 1.0) == 0 < u["max_step"]]
    return f"{worst:.2f}; {100 * share:.3f}%" + (f" (no step: {','.join(still)})" if still else "")


def print_iterations(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    reference = args.variants.split(",")[0].strip()
    table = Table(title=f"bench_rollout --iteration ({args.algo}, {args.tasks}x{args.group_size} envs, "
                        f"{args.iterations} iterations, means; every iteration starts from {reference}'s weights)")
    columns = ("env", "variant", "iteration s", "rollout s", "generate s", "env s", "waited s", "overlap ratio",
               "score s", "update s", "padding eff.", "scoring reused", "vs " + reference, "same episodes",
               "update vs " + reference)
    for column in columns:
        table.add_column(column, justify="left" if column in ("env", "variant") else "right")
    for env, rows in results.items():
        base = next(iter(rows.values()))["means"]["iteration_s"]
        for name, row in rows.items():
            m = row["means"]
            ratio = m["perf/rollout_s"] / max(m["perf/generate_s"] + m["perf/env_s"], 1e-9)
            table.add_row(env, name, f"{m['iteration_s']:.2f}", f"{m['perf/rollout_s']:.2f}",
                          f"{m['perf/generate_s']:.2f}", f"{m['perf/env_s']:.2f}", f"{m['perf/env_wait_s']:.2f}",
                          f"{ratio:.3f}", f"{m['perf/score_s']:.2f}", f"{m['perf/update_s']:.2f}",
                          f"{m['perf/padding_efficiency']:.3f}", f"{m['perf/scoring_reused']:.2f}",
                          f"{base / m['iteration_s']:.2f}x", same_column(row["same"]),
                          "-" if name == reference else update_column(row["updates"]))
    Console(width=220).print(table)
    print("update vs the reference: the largest difference between a variant's step and the reference's from the "
          "same weights and optimizer state, in units of the reference's largest step; then the share of weights "
          "whose steps differ by more than 1% of that step (rounding: Adam's step is about lr wherever the gradient "
          "is well above its eps, whatever its rounding, and magnifies the rounding of near-zero gradients)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder of a warm-started policy (default: tiny random model)")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--iterations", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--modes", action="store_true", help="compare the rollout modes (see above)")
    parser.add_argument("--iteration", action="store_true",
                        help="compare whole RL iterations: before the speed-ups, today, today + overlap (see above)")
    parser.add_argument("--variants", default="before,today,today+overlap",
                        help="--iteration: variants to run, the first is the reference "
                             f"({', '.join(ITERATION_VARIANTS)})")
    parser.add_argument("--quick", action="store_true",
                        help="--iteration: household only, 2x2 envs, 3 turns, 16 new tokens, 1 iteration "
                             "unless --iterations (a smoke test)")
    parser.add_argument("--json", help="--modes, --iteration: write the figures to this file")
    parser.add_argument("--envs", default=None,
                        help="--modes, --iteration: envs to run, comma-separated (default household,alfworld; "
                             "--quick: household)")
    parser.add_argument("--tasks", type=int, default=4, help="--modes, --iteration: algo.tasks_per_step")
    parser.add_argument("--group-size", type=int, default=4, help="--modes, --iteration: algo.group_size")
    parser.add_argument("--alfworld-data", help="--modes, --iteration: ALFWorld games folder")
    parser.add_argument("--alfworld-workers", type=int, default=2)
    parser.add_argument("--alfworld-turns", type=int, default=10)
    parser.add_argument("--alfworld-expert", action="store_true",
                        help="env.expert=true (the expert on every step, ~20%% of a step); the benchmarks play "
                             "with env.expert=false, which is what RL rollouts use under the default env.expert=null")
    parser.add_argument("--household-workers", type=int, default=0)
    parser.add_argument("--household-turns", type=int, default=15)
    parser.add_argument("--sleep-ms", type=float, default=40.0,
                        help="--modes: env household-sleepy (household with --alfworld-workers workers): each step "
                             "sleeps this long (a reset 5x), like ALFWorld's ~15 steps/s but without the CPU")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.envs is None and not args.quick:
        args.envs = "household,alfworld"
    if args.iterations is None:
        args.iterations = 1 if args.quick and args.iteration else 3

    if args.iteration:
        import json

        import torch

        if args.quick:
            args.envs = args.envs or "household"
            args.tasks, args.group_size, args.household_turns = 2, 2, 3
        results = {env.strip(): compare_iterations(env.strip(), args) for env in args.envs.split(",")}
        print_iterations(results, args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        torch.distributed.destroy_process_group()
        differing = [f"{env} {name} iteration {it} ({row['differences'][it]})" for env, rows in results.items()
                     for name, row in rows.items() for it, ok in enumerate(row["same"]) if not ok]
        if differing:
            raise SystemExit("bench_rollout --iteration: from the same weights, these played other episodes than "
                             f"the reference: {'; '.join(differing)}. A speed-up changed what is played.")
        return

    if args.modes:
        results = {}
        for env in args.envs.split(","):
            results[env] = compare_modes(env.strip(), args)
        print_modes(results, args)
        differing = [f"{env} {name}" for env, rows in results.items() for name, _, same, _ in rows if not same]
        if args.json:
            import json

            Path(args.json).write_text(json.dumps(
                {env: {name: {"means": m, "same": same, "reached": reached} for name, m, same, reached in rows}
                 for env, rows in results.items()}, indent=1))
        import torch

        torch.distributed.destroy_process_group()
        if differing:
            raise SystemExit(f"bench_rollout --modes: these played other episodes than lock-step: "
                             f"{', '.join(differing)}. A rollout mode changed what is played.")
        return

    import torch
    from rich.console import Console
    from rich.table import Table

    from epo_cli.compose import compose
    from epo_cli.training.forward import collate, plan_micro_batches

    overrides = [f"algo={args.algo}", "env.level=small_pick_and_light", "env.prompt_template=compact",
                 "algo.tasks_per_step=4", "algo.group_size=4", "env.max_turns=15", "env.eval_splits=[]",
                 "logger.console=false", "logger.tensorboard=false", "trainer.total_steps=100"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    cfg = compose([*overrides, *args.overrides])
    trainer = scratch_trainer(cfg, "bench_rollout_")
    algo, total = cfg.algo, cfg.trainer.total_steps

    rollout_ratio, update_ratio, efficiencies = [], [], []
    for it in range(args.iterations):
        # the trainer's own steps 1-5 (Trainer.rl_step's sample, score, advantages, coefficients, update)
        trainer.set_learning_rates(it, total)
        rollout = trainer.sample(it, total)
        stats = rollout.stats
        rollout_ratio.append(stats.rollout_s / (stats.generate_s + stats.env_s))
        batch = trainer.advantages(trainer.score(rollout.batch, it))
        coefs = trainer.coefficients(it, total, batch)

        t0 = time.perf_counter()
        result = trainer.update(batch, coefs, it)
        update_s = time.perf_counter() - t0
        efficiencies.append(result.metrics["perf/padding_efficiency"])
        batch = result.batch  # every row scored

        # baseline: plain forward+backward+step of the causal LM over the same micro-batches
        engine, pad = trainer.engine, trainer.models.tokenizer.pad_token_id
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        t0 = time.perf_counter()
        for rows in trainer.policy_update.mini_batches(batch, it, 0):
            for micro in plan_micro_batches(rows, lengths, algo.micro_batch_size):
                mb = collate(batch, micro, pad, trainer.dist.device)
                labels = mb.input_ids.masked_fill(mb.attention_mask == 0, -100)
                loss = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                              position_ids=mb.position_ids, labels=labels).loss
                engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        plain_s = time.perf_counter() - t0
        update_ratio.append(update_s / plain_s)
        print(f"iteration {it}: rollout {stats.rollout_s:.2f}s (generate {stats.generate_s:.2f}s, env "
              f"{stats.env_s:.3f}s), update {update_s:.2f}s vs plain {plain_s:.2f}s, {len(batch)} samples")

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    table = Table(title=f"bench_rollout ({args.algo}, {args.iterations} iterations)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("rollout overhead", f"{mean(rollout_ratio):.3f}", "<= 1.10")
    table.add_row("update overhead", f"{mean(update_ratio):.3f}", "<= 1.15")
    table.add_row("padding efficiency", f"{mean(efficiencies):.3f}", "")
    Console().print(table)
    trainer.pool.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
