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

from common import interleaved_iterations, scratch_dir, scratch_trainer

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


def compare_modes(env: str, args: argparse.Namespace) -> list[tuple[str, dict[str, float], bool]]:
    """Each mode's mean rollout figures on `env`, and whether it played the same episodes as lock-step."""
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.loading import model_source

    overrides = [f"algo={args.algo}", *env_overrides(env, args), f"algo.tasks_per_step={args.tasks}",
                 f"algo.group_size={args.group_size}", "env.eval_splits=[]", "logger.console=false",
                 "logger.tensorboard=false", "trainer.total_steps=100", "model=tiny"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    cfg = compose([*overrides, *args.overrides])
    suite = make_suite(cfg.env)
    if env == "household-sleepy":  # steps that wait without computing: what overlap can hide on a busy CPU
        model_source(cfg.model, suite, cfg.seed)  # the tiny model, built (once) on the plain envs
        suite = SleepySuite(suite, args.sleep_ms / 1000)
    trainer = scratch_trainer(cfg, f"bench_rollout_{env}_", suite)
    try:
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
                cfg.rollout.overlap, cfg.rollout.shared_prefill = overlap, prefill
                trainer.sampler.overlap = overlap  # the sampler reads rollout.overlap when it is built
                policy = trainer.models.sampling_policy(cfg.rollout)  # reads rollout.shared_prefill
                rollout = trainer.sampler.sample(policy, it, cfg.trainer.total_steps)
                episodes, stats = rollout.episodes, rollout.stats
                first_prompts = [ep.turns[0].prompt_ids for ep in episodes if ep.turns]
                played[name] = [(ep.traj_id, [(t.response_ids, t.observation) for t in ep.turns]) for ep in episodes]
                for key in sums[name]:
                    sums[name][key] += getattr(stats, key) / args.iterations
                print(f"  {env} iteration {it} {name}: rollout {stats.rollout_s:.2f}s (generate "
                      f"{stats.generate_s:.2f}s, env {stats.env_s:.2f}s, waited {stats.env_wait_s:.2f}s), "
                      f"{stats.env_steps} steps", flush=True)
            reference = played[MODES[0][0]]
            for name in played:
                same[name] &= played[name] == reference
        prefill = time_first_turn(trainer, first_prompts)
    finally:
        trainer.pool.close()  # the process group stays: DeepSpeed keeps its groups for the next Trainer
    print(f"  {env} first-turn generate call ({len(first_prompts)} rows, {len(set(map(tuple, first_prompts)))} "
          f"distinct prompts), best of 5: {prefill[False]:.3f}s plain, {prefill[True]:.3f}s shared prefill "
          f"({prefill[False] / prefill[True]:.2f}x)", flush=True)
    return [(name, sums[name], same[name]) for name, _, _ in MODES]


def time_first_turn(trainer, prompts: list[list[int]]) -> dict[bool, float]:
    """Best-of-5 wall time of one generate call over a rollout's first-turn prompts, with and without
    shared prefill (interleaved): the saving, without the rest of the rollout's noise."""
    from epo_cli.rollout.generation import generate

    policy = trainer.models.sampling_policy(trainer.cfg.rollout)
    seeds = list(range(len(prompts)))
    best = {False: float("inf"), True: float("inf")}
    for _ in range(5):
        for shared in (False, True):
            t0 = time.perf_counter()
            generate(policy.model, prompts, policy.params, policy.tokenizer, seeds=seeds,
                     vocab_limit=policy.vocab_limit, shared_prefill=shared)
            best[shared] = min(best[shared], time.perf_counter() - t0)
    return best


def print_modes(results: dict[str, list[tuple[str, dict[str, float], bool]]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench_rollout --modes ({args.algo}, {args.tasks}x{args.group_size} envs, "
                        f"{args.iterations} iterations, means)")
    for column in ("env", "mode", "rollout s", "generate s", "env s", "waited s", "overlap ratio",
                   "speed-up vs lock-step", "same episodes"):
        table.add_column(column, justify="left" if column in ("env", "mode") else "right")
    for env, rows in results.items():
        base = rows[0][1]["rollout_s"]
        for name, m, same in rows:
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
#: settings each variant prints, as the Trainer resolved them
SHOWN_SETTINGS = ["rollout.overlap", "rollout.shared_prefill", "algo.pack_tokens", "algo.reuse_scoring_forward",
                  "env.fast_textgen", "env.cache_pddl", "env.expert", "env.num_workers"]


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
    """Each variant's mean iteration figures on `env`, how many iterations it played the same episodes as
    the first variant, its resolved settings and what its env workers installed."""
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
            print(f"  {env} iteration {it} {name}: {metrics['iteration_s']:.2f}s = rollout "
                  f"{metrics['perf/rollout_s']:.2f}s (generate {metrics['perf/generate_s']:.2f}s, env "
                  f"{metrics['perf/env_s']:.2f}s) + score {metrics['perf/score_s']:.2f}s + update "
                  f"{metrics['perf/update_s']:.2f}s; {env_steps[name]} env steps, "
                  f"{int(metrics['rollout/samples'])} samples, success {metrics.get('rollout/success', 0.0):.2f}",
                  flush=True)

        sums = interleaved_iterations(trainers, args.iterations, keys, show)
        # per iteration: whether each variant played the same episodes as the reference (the first)
        same = {name: [mine == first for mine, first in zip(played[name], played[variants[0]])] for name in variants}
        settings = {name: {key: _select(trainers[name].cfg, key) for key in SHOWN_SETTINGS} for name in variants}
    finally:
        for trainer in trainers.values():
            trainer.pool.close()  # the process group stays: DeepSpeed keeps its groups for the next Trainer
    probes: dict[str, list[dict]] = {name: [] for name in variants}
    for path in sorted(probe_dir.glob("*.json")):
        probe = json.loads(path.read_text())
        probes[probe.pop("variant")].append(probe)
    for name in variants:
        print(f"  {env} {name}: {settings[name]}" + (f"; env workers: {probes[name]}" if probes[name] else ""),
              flush=True)
    return {name: {"means": sums[name], "same": same[name], "settings": settings[name], "workers": probes[name]}
            for name in variants}


def _select(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def same_column(same: list[bool]) -> str:
    """'3/3', or '2/3 (not 2)': in how many iterations a variant played the same episodes as the reference,
    and which did not (later iterations start from weights the variants' updates changed slightly
    differently: packed vs padded sums round differently, and one flipped sampled token changes an episode)."""
    text = f"{sum(same)}/{len(same)}"
    differing = [str(i) for i, ok in enumerate(same) if not ok]
    return text + (f" (not {','.join(differing)})" if differing else "")


def print_iterations(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench_rollout --iteration ({args.algo}, {args.tasks}x{args.group_size} envs, "
                        f"{args.iterations} iterations, means)")
    columns = ("env", "variant", "iteration s", "rollout s", "generate s", "env s", "waited s", "overlap ratio",
               "score s", "update s", "padding eff.", "scoring reused", "vs " + args.variants.split(",")[0].strip(),
               "same episodes")
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
                          f"{base / m['iteration_s']:.2f}x", same_column(row["same"]))
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder of a warm-started policy (default: tiny random model)")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--modes", action="store_true", help="compare the rollout modes (see above)")
    parser.add_argument("--iteration", action="store_true",
                        help="compare whole RL iterations: before the speed-ups, today, today + overlap (see above)")
    parser.add_argument("--variants", default="before,today,today+overlap",
                        help="--iteration: variants to run, the first is the reference "
                             f"({', '.join(ITERATION_VARIANTS)})")
    parser.add_argument("--quick", action="store_true",
                        help="--iteration: household only, 2x2 envs, 3 turns, 16 new tokens, 1 iteration "
                             "(a smoke test)")
    parser.add_argument("--json", help="--iteration: write the figures to this file")
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

    if args.iteration:
        import json

        import torch

        if args.quick:
            args.envs = args.envs or "household"
            args.tasks, args.group_size, args.iterations, args.household_turns = 2, 2, 1, 3
        results = {env.strip(): compare_iterations(env.strip(), args) for env in args.envs.split(",")}
        print_iterations(results, args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        torch.distributed.destroy_process_group()
        return

    if args.modes:
        results = {}
        for env in args.envs.split(","):
            results[env] = compare_modes(env.strip(), args)
        print_modes(results, args)
        import torch

        torch.distributed.destroy_process_group()
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
