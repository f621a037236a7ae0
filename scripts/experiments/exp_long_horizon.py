"""Long-horizon study: on TextWorld's Coin Collector (a chain of 30 rooms with a dead end beside each, one
sparse reward at the far end, episodes of up to 80 turns), what do GRPO, an entropy bonus, EPO, a count bonus
and GiGPO do from the clone of a slipping teacher?

    python scripts/experiments/exp_long_horizon.py --warm-start RUN [--out outputs/exp_long_horizon]
        [--arms grpo,epo,...] [--seeds 0,1,2] [--iterations 40] [--jobs 2] [--episodes 64] [OVERRIDES...]
    python scripts/experiments/exp_long_horizon.py --cost --warm-start RUN --out DIR   # iteration cost, 15/30/60 turns
    python scripts/experiments/exp_long_horizon.py --summary --warm-start RUN --out DIR   # tables of what is done
    python scripts/experiments/exp_long_horizon.py --quick --warm-start RUN --out DIR     # smoke test (tests/)
    python scripts/experiments/exp_long_horizon.py --warm-start RUN --out DIR2 --continue-from DIR --iterations 80
        --arms gigpo [...]   # DIR's finished runs continued to 80 iterations (at the lr they ended with), in DIR2

RUN: an `epo train experiment=coin_warm_start` run. Every run is `epo train experiment=coin_long_horizon
model.path=<RUN>/final seed=S trainer.total_steps=N` plus its arm's overrides (ARMS) and OVERRIDES, in
OUT/runs/<arm>/it<N>-seed<S>/ (its console in the .log beside it); right after it trains, its final policy
plays --episodes fixed unseen games of the target level (eval_in_distribution) and as many with longer chains
(eval_out_of_distribution: level 150, a chain of 50), T=1.0, seed 0, the same games for every policy and the
warm start. Jobs go seed-major (every arm's seed 0 first), --jobs at a time. A finished run or evaluation is
never redone, so an interrupted study continues where it stopped; OUT/summary.* are rewritten after each run,
so a partial study always has its tables.

Written: OUT/summary.md and .json (tables, definitions), OUT/long_horizon.png (training success and policy
entropy per iteration: mean over seeds, min-max band), OUT/entropy_by_turn.png (eval entropy per turn index).

Definitions:
- training curves: exp_explore.py's statistics, imported (moving average, success collapse, entropy event,
  "to W + 0.2", entropy swing, diversity early/late; see its docstring), on the runs' metrics.jsonl.
- eval success: share of the fixed eval games won within the turn limit (mean ± std over seeds).
- episode length: turns per eval episode (a win ends it; otherwise the limit).
- revisits: moves per eval episode into a room already visited in that episode (rooms told apart by the
  "-= Name =-" header TextWorld prints on entering; a move is a turn whose answer names another room).
- dead-end visits: moves per eval episode into a room with a single exit and no coin (the distractors).
- action shares: eval actions by kind: `go` a direction the room does not have, back (the reverse of the
  last move made), on (another exit), look/inventory, other.
- training entropy per turn index: policy/entropy_turn/<t> (the trainer's token-mean entropy of turn t's
  responses in the iteration's rollouts), mean over the first and over the last 5 iterations, 10-turn bins.
- entropy per turn index: mean token entropy (nats/token, the full next-token distribution at T=1.0) of the
  policy's responses at turns 1-10, 11-20, ... of its eval episodes, over the first --entropy-episodes of them:
  does the policy's entropy collapse late in long episodes?
- W (the warm start's value for "to W + 0.2"): mean iteration-1 training success over all runs, as in
  exp_explore; "to W + 0.2" is read on the training success, the gain target (warm + 0.3) on eval success.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import threading
import time
from pathlib import Path

from exp_common import (
    Arm,
    check_experiment,
    check_out,
    check_study_args,
    continue_once,
    finished_run,
    longest_shorter_run,
    rows_of,
    run_folder,
    run_jobs,
    run_logged,
    run_study,
    seed_major,
    study_parser,
    train_once,
)
from exp_explore import GAIN, claims, claims_table, fmt, iterations_to, run_stats
from exp_explore import plot as plot_training

from epo_cli.errors import UserError
from epo_cli.rundir.saved_state import load_yaml

EXPERIMENT = "coin_long_horizon"
TARGET_SPLIT, LONGER_SPLIT = "eval_in_distribution", "eval_out_of_distribution"
ENTROPY_EPISODES = 16  # eval episodes whose every turn is re-scored for the entropy per turn index
TURN_BIN = 10  # turns per entropy bucket
COST_TURNS = (15, 30, 60)
COST_ITERATIONS = 3


COUNT = ("algo.intrinsic.kind=count", "algo.intrinsic.coef=3.0", "algo.intrinsic.decay=1.0")
ARMS = {  # each arm's overrides go on top of experiment=coin_long_horizon (--experiment)
    "grpo": Arm("GRPO", ()),
    # exp_explore's bonus 0.1 destroyed the household policy in every seed; a tenth of it asks whether a
    # little more randomness helps where exploration is the bottleneck
    "grpo_ent": Arm("GRPO + entropy bonus 0.01", ("algo.loss_terms=[policy_clip,kl,entropy]", "entropy.coef=0.01")),
    "epo": Arm("EPO (paper settings)", ("algo=epo",)),
    "epo_bind": Arm("EPO, binding band (alpha 1.0)", ("algo=epo", "algo.loss_terms=[policy_clip,kl,entropy_smoothing]",
                                                      "entropy.coef=1.0", "algo.entropy_smoothing.alpha=1.0")),
    # the episodic count bonus (Yuan et al.'s finding: needed on the Coin Collector), as in exp_explore:
    # 3 / sqrt(N) per turn for the observation reached, counted per group
    "grpo_count": Arm("GRPO + count bonus 3.0", COUNT),
    "epo_count": Arm("EPO + count bonus 3.0", ("algo=epo", *COUNT)),
    "gigpo": Arm("GiGPO", ("algo=gigpo",)),
}
QUICK_ARMS = "grpo,epo_count"
QUICK_OVERRIDES = ["algo.tasks_per_step=2", "algo.group_size=2", "env.max_turns=4", "rollout.max_new_tokens=16",
                   "env.challenge_level=103", "env.num_games=2", "env.num_eval_games=2"]
ROOM = re.compile(r"-= (.+?) =-")
#: overrides that say where the games are: the evaluations need them too (read from the command line only)
GAME_KEYS = ("env.cache_dir=", "env.games_dir=")
_summary_lock = threading.Lock()


# ----------------------------------------------------------------------------------------------------
# what one eval episode did (pure functions of its turns; unit-tested on hand-made episodes)
# ----------------------------------------------------------------------------------------------------

def exits(admissible: list[str]) -> int:
    return sum(a.startswith("go ") for a in admissible)


def walk(first_observation: str, turns: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Moves, revisits and dead-end visits of one episode. turns[i] = (the env's answer to action i, the
    admissible commands before action i). A move is an answer naming another room than the current one;
    a dead end is a room whose next turn offers one exit and no coin (unknown after the episode's last turn)."""
    start = ROOM.search(first_observation)
    room = start.group(1) if start else None
    visited = {room}
    moves = revisits = dead_ends = 0
    for i, (answer, _) in enumerate(turns):
        seen = ROOM.search(answer or "")
        if seen is None or seen.group(1) == room:
            continue
        room = seen.group(1)
        moves += 1
        revisits += room in visited
        visited.add(room)
        if i + 1 < len(turns):
            admissible = turns[i + 1][1]
            dead_ends += exits(admissible) == 1 and "take coin" not in admissible
    return {"moves": moves, "revisits": revisits, "dead_end_visits": dead_ends, "rooms": len(visited)}


def train_entropy_by_turn(rows: list[dict], last: int = 5) -> list[dict]:
    """Training entropy per turn index: policy/entropy_turn/<t> (t from 0) of the last `last` iterations, in
    TURN_BIN-turn bins (each iteration's turn value counted once)."""
    per_turn = [(int(k.rsplit("/", 1)[1]) + 1, v) for r in rows[-last:] for k, v in r.items()
                if k.startswith("policy/entropy_turn/")]
    return by_turn_bins(per_turn)


REVERSE = {"go east": "go west", "go west": "go east", "go north": "go south", "go south": "go north"}
ACTION_KINDS = ("no such exit", "back", "on", "look/inventory", "other")


def action_kinds(turns: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Counts of an episode's actions by kind; turns[i] = (action i, the admissible commands before it).
    no such exit: `go` a direction the room does not have; back: the reverse of the last move made; on:
    another exit; look/inventory; other (take coin, examine, anything else)."""
    counts = dict.fromkeys(ACTION_KINDS, 0)
    last_move = None
    for action, admissible in turns:
        if action in ("look", "inventory"):
            kind = "look/inventory"
        elif action.startswith("go ") and action not in admissible:
            kind = "no such exit"
        elif action.startswith("go "):
            kind = "back" if last_move and REVERSE.get(last_move) == action else "on"
            last_move = action
        else:
            kind = "other"
        counts[kind] += 1
    return counts


def by_turn_bins(per_turn: list[tuple[int, float]], width: int = TURN_BIN) -> list[dict]:
    """[(turn index from 1, value)] -> [{turns: 'a-b', mean, n}] per bin of `width` turns, in order."""
    bins: dict[int, list[float]] = {}
    for t, v in per_turn:
        bins.setdefault((t - 1) // width, []).append(v)
    return [{"turns": f"{b * width + 1}-{(b + 1) * width}", "mean": statistics.fmean(vs), "n": len(vs)}
            for b, vs in sorted(bins.items())]


# ----------------------------------------------------------------------------------------------------
# evaluation of one policy (a subprocess: `--eval-one`), through the same calls as `epo eval`
# ----------------------------------------------------------------------------------------------------

def response_entropies(model, tokenizer, turns: list[tuple[list[int], list[int]]], batch: int = 16) -> list[float]:
    """Mean next-token entropy over each (prompt ids, response ids)'s response tokens (nats/token; the
    distribution sampled at T=1.0, restricted to the tokenizer's vocabulary like the policy's sampling)."""
    import torch

    vocab = len(tokenizer)
    out = []
    for i in range(0, len(turns), batch):
        chunk = turns[i:i + batch]
        width = max(len(p) + len(r) for p, r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, (p, r) in enumerate(chunk):
            ids[j, :len(p) + len(r)] = torch.tensor(p + r)
            mask[j, :len(p) + len(r)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits[..., :vocab].float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)  # [B, width]: the entropy of the token after each position
        for j, (p, r) in enumerate(chunk):
            out.append(float(entropy[j, len(p) - 1:len(p) + len(r) - 1].mean()) if r else float("nan"))
    return out


def eval_one(run: Path, split: str, levels: tuple[int, int], episodes: int, max_turns: int, entropy_episodes: int,
             overrides: list[str]) -> dict:
    """Play `episodes` fixed games of `split` with run's final policy (T=1.0, seed 0) and measure them (module
    docstring). levels = (target, longer chains): eval_in_distribution plays the first, eval_out_of_distribution
    the second. `overrides`: where the games are (env.cache_dir is read from the command line only)."""
    import torch

    from epo_cli.envs import make_suite
    from epo_cli.envs.pool import EnvPool
    from epo_cli.evaluation.run import EvalCommandConfig, build_policy, eval_config
    from epo_cli.evaluation.split import eval_tasks, evaluate_split
    from epo_cli.rollout.prompts import PromptBuilder, chat_encoder

    torch.set_num_threads(1)
    opts = EvalCommandConfig(run=run, split=split, episodes=episodes, temperature=1.0)
    # the warm start's own config names its shorter chains and few eval games: every policy plays the same
    cfg = eval_config(opts, ["seed=0", f"env.challenge_level={levels[0]}", f"env.challenge_ood_level={levels[1]}",
                             f"env.num_eval_games={episodes}", f"env.max_turns={max_turns}", "env.num_workers=0",
                             *overrides])
    suite = make_suite(cfg.env)
    suite.check()
    policy, tokenizer, _ = build_policy(opts, cfg, suite, 1.0, torch.device("cpu"))
    builder = PromptBuilder(cfg.env.prompt_template, cfg.env.history_length, cfg.rollout.max_prompt_tokens,
                            chat_encoder(tokenizer, cfg.env.system_prompt))
    tasks = eval_tasks(suite, split, episodes, cfg.seed)
    pool = EnvPool(suite, num_workers=0, step_timeout_s=cfg.env.step_timeout_s, reads_expert=False)
    started = time.perf_counter()
    try:
        with torch.no_grad():
            _, played = evaluate_split(policy, pool, builder, tokenizer, split, tasks, list(range(len(tasks))),
                                       max_turns, cfg.seed)
    finally:
        pool.close()
    per_episode = []
    for ep in played:
        walked = walk(ep.turns[0].observation if ep.turns else "", [(t.result, t.admissible) for t in ep.turns])
        kinds = action_kinds([(t.action, t.admissible) for t in ep.turns])
        per_episode.append({"task_id": ep.task.task_id, "won": ep.won, "turns": len(ep.turns), **walked,
                            "actions": kinds})
    scored = [(t + 1, (turn.prompt_ids, turn.response_ids)) for ep in played[:entropy_episodes]
              for t, turn in enumerate(ep.turns)]
    with torch.no_grad():
        entropies = response_entropies(policy.model, tokenizer, [pair for _, pair in scored])
    per_turn = [(t, h) for (t, _), h in zip(scored, entropies) if not math.isnan(h)]
    mean = lambda key: statistics.fmean(e[key] for e in per_episode)  # noqa: E731
    turns_played = max(1, sum(e["turns"] for e in per_episode))
    level = levels[0] if split == TARGET_SPLIT else levels[1]
    return {"run": str(run), "split": split, "level": level, "episodes": len(per_episode), "max_turns": max_turns,
            "success": mean("won"), "episode_len": mean("turns"), "revisits": mean("revisits"),
            "dead_end_visits": mean("dead_end_visits"), "moves": mean("moves"),
            "entropy": statistics.fmean(h for _, h in per_turn) if per_turn else None,
            "entropy_by_turn": by_turn_bins(per_turn), "per_episode": per_episode,
            # share of all eval actions of each kind (action_kinds)
            "action_shares": {k: sum(e["actions"][k] for e in per_episode) / turns_played
                              for k in ACTION_KINDS},
            "play_s": time.perf_counter() - started}


def evaluate(run: Path, split: str, level: int, a: argparse.Namespace) -> dict:
    """eval_one's result for (run, split, level), computed once (in a subprocess) and kept in run/long_horizon/."""
    path = run / "long_horizon" / f"{split}-L{level}-n{a.episodes}-T{a.eval_turns}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        args = ["--eval-one", str(run), "--split", split, "--levels", *map(str, a.levels), "--episodes",
                str(a.episodes), "--max-turns", str(a.eval_turns), "--entropy-episodes", str(a.entropy_episodes),
                "--json", str(path), *(f"--override={o}" for o in a.overrides if o.startswith(GAME_KEYS))]
        run_logged([sys.executable, __file__, *args], f"eval {run.name} {split} level {level}",
                   path.parent / f"{path.stem}.log", f"evaluation of {run} on {split}")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------
# the study
# ----------------------------------------------------------------------------------------------------

def levels(a: argparse.Namespace) -> tuple[int, int]:
    """(target level, longer-chain level) of the study's runs (the RL preset with the overrides)."""
    from epo_cli.envs.textworld_games import ood_level
    from epo_cli.launch.setup import compose_for_train

    cfg = compose_for_train([f"experiment={a.experiment}", *a.overrides])[0]
    given = cfg.env.challenge_ood_level
    return int(cfg.env.challenge_level), int(given) if given is not None else ood_level(cfg.env.challenge,
                                                                                          int(cfg.env.challenge_level))


def job(key: str, seed: int, a: argparse.Namespace, out: Path, warm: Path) -> None:
    """Train one arm's seed (unless done), evaluate its policy on both eval splits, rewrite the summary."""
    folder, label = run_folder(out, key, a.iterations, seed), f"{key} seed {seed}"
    if a.continue_from:  # the other study's run of this arm and seed, continued to a.iterations
        source = longest_shorter_run(a.continue_from, key, seed, below=a.iterations)
        if source is None:
            sys.exit(f"--continue-from {a.continue_from}: no finished run of {label} with fewer than "
                     f"{a.iterations} iterations in {a.continue_from / 'runs' / key}; train it there first")
        run = continue_once(folder, source, a.iterations, label, leave_out=("long_horizon",))
    else:
        run = train_once(folder, [f"experiment={a.experiment}", *ARMS[key].overrides, f"model.path={warm / 'final'}",
                                  f"seed={seed}", f"trainer.total_steps={a.iterations}", "logger=none", *a.overrides],
                         label)
    if a.episodes:
        for split, level in zip((TARGET_SPLIT, LONGER_SPLIT), a.levels):
            evaluate(run, split, level, a)
    with _summary_lock:
        summarize(a, out, warm)


def collect(out: Path, arms: list[str], a: argparse.Namespace) -> list[dict]:
    runs = []
    for key in arms:
        for seed in a.seed_list:
            run = finished_run(run_folder(out, key, a.iterations, seed))
            if run is None:
                continue
            band = load_yaml(run / "config.yaml").algo.entropy_smoothing
            rows = rows_of(run)
            stats = run_stats(rows, (float(band.kappa_low), float(band.kappa_high)))
            record = {"arm": key, "seed": seed, "run": str(run), **stats,
                      "train_episode_len": [r.get("rollout/episode_len") for r in rows],
                      "train_entropy_by_turn": {"first": train_entropy_by_turn(rows[:5]),
                                                "last": train_entropy_by_turn(rows)},
                      "iteration_s": statistics.fmean(r.get("perf/rollout_s", 0) + r.get("perf/score_s", 0)
                                                      + r.get("perf/update_s", 0) for r in rows)}
            for name, split, level in (("target", TARGET_SPLIT, a.levels[0]), ("longer", LONGER_SPLIT, a.levels[1])):
                path = run / "long_horizon" / f"{split}-L{level}-n{a.episodes}-T{a.eval_turns}.json"
                if path.exists():
                    record[name] = {k: v for k, v in json.loads(path.read_text()).items() if k != "per_episode"}
            runs.append(record)
    return runs


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample std over seeds (None, None without a value; std 0 for one: JSON-ready)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def arm_summary(rs: list[dict], threshold: float) -> dict:
    reached = [k for k in (iterations_to(r["success"], threshold) for r in rs) if k is not None]
    s = {"runs": len(rs), "seeds": [r["seed"] for r in rs], "reached": len(reached),
         "iterations_to_gain": statistics.fmean(reached) if reached else None,
         "entropy_first": statistics.fmean(r["entropy"][0] for r in rs),
         "entropy_last": statistics.fmean(r["entropy"][-1] for r in rs),
         "success_collapses": sum(r["success_collapses"] for r in rs),
         "entropy_events": sum(r["entropy_events"] for r in rs),
         "iteration_s": statistics.fmean(r["iteration_s"] for r in rs)}
    for k in ("final_success", "swing_mean", "swing_max", "diversity_early", "diversity_late", "diversity_drop",
              "diversity_drop_after_12", "success_step_change"):
        s[k] = statistics.fmean(r[k] for r in rs)
    for split in ("target", "longer"):
        for k in ("success", "episode_len", "moves", "revisits", "dead_end_visits", "entropy"):
            s[f"{split}_{k}"], s[f"{split}_{k}_std"] = mean_std([r[split][k] for r in rs if split in r])
        s[f"{split}_per_seed"] = [r[split]["success"] for r in rs if split in r]
        shares = [r[split]["action_shares"] for r in rs if split in r]
        s[f"{split}_action_shares"] = ({kind: statistics.fmean(sh[kind] for sh in shares) for kind in ACTION_KINDS}
                                       if shares else None)
    return s


def entropy_curve(evals: list[dict]) -> list[tuple[str, float]]:
    """Mean over seeds of each turn bin's entropy (bins present in every seed)."""
    bins = [e["entropy_by_turn"] for e in evals]
    if not bins:
        return []
    common = [b["turns"] for b in bins[0] if all(any(x["turns"] == b["turns"] for x in other) for other in bins)]
    return [(t, statistics.fmean(next(x["mean"] for x in other if x["turns"] == t) for other in bins)) for t in common]


def table(summary: dict, warm: dict, threshold: float) -> str:
    def pm(s: dict, key: str, spec: str = ".3f") -> str:
        return "-" if s.get(key) is None else f"{s[key]:{spec}} ± {s[key + '_std']:{spec}}"

    lines = ["| arm | seeds | eval success, target level | eval success, longer chains | episode length (target) "
             "| moves / revisits / dead-end visits per episode (target) | training success, last 5 "
             f"| to W + {GAIN} = {threshold:.3f} (seeds; mean iteration) | entropy first / last | entropy swing mean "
             "| diversity early / late | success collapses | entropy events |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if warm:
        t, lo = warm.get("target", {}), warm.get("longer", {})
        lines.append(f"| warm start | | {fmt(t.get('success'))} | {fmt(lo.get('success'))} "
                     f"| {fmt(t.get('episode_len'), '.1f')} | {fmt(t.get('moves'), '.1f')} / "
                     f"{fmt(t.get('revisits'), '.1f')} / "
                     f"{fmt(t.get('dead_end_visits'), '.1f')} | W = {threshold - GAIN:.3f} "
                     f"| | {fmt(t.get('entropy'), '.3f')} (eval) | | | | |")
    for key, s in summary.items():
        to = f"{s['reached']}/{s['runs']}" + (f"; {s['iterations_to_gain']:.1f}" if s["iterations_to_gain"] else "")
        lines.append(f"| {ARMS[key].label} | {s['runs']} | {pm(s, 'target_success')} | {pm(s, 'longer_success')} "
                     f"| {fmt(s['target_episode_len'], '.1f')} | {fmt(s['target_moves'], '.1f')} / "
                     f"{fmt(s['target_revisits'], '.1f')} / "
                     f"{fmt(s['target_dead_end_visits'], '.1f')} | {s['final_success']:.3f} | {to} "
                     f"| {s['entropy_first']:.3f} / {s['entropy_last']:.3f} | {fmt(s['swing_mean'], '.2f')} "
                     f"| {fmt(s['diversity_early'])} / {fmt(s['diversity_late'])} | {s['success_collapses']} "
                     f"| {s['entropy_events']} |")
    return "\n".join(lines)


def plot(runs: list[dict], arms: list[str], summary_evals: dict, warm: dict, out: Path) -> None:
    """long_horizon.png (exp_explore's training curves) and entropy_by_turn.png (eval entropy per turn index)."""
    plot_training(runs, arms, out / "long_horizon.png", ARMS,
                  "Coin Collector: mean over seeds, band = min-max over seeds")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(8, 4))
    # each arm in the color of its training curve (long_horizon.png), the warm start in black
    series = [("warm start", [warm["target"]], "black")] if warm.get("target") else []
    series += [(ARMS[k].label, v, colors(arms.index(k))) for k, v in summary_evals.items() if v]
    for label, evals, color in series:
        curve = entropy_curve(evals)
        ax.plot([t for t, _ in curve], [h for _, h in curve], marker="o", color=color, label=label)
    ax.set_xlabel("turn index (eval episodes, target level)")
    ax.set_ylabel("response entropy (nats/token)")
    ax.legend(fontsize=7)
    fig.savefig(out / "entropy_by_turn.png", dpi=80, bbox_inches="tight")
    plt.close(fig)


def summarize(a: argparse.Namespace, out: Path, warm: Path) -> dict:
    arms = a.arms.split(",")
    runs = collect(out, arms, a)
    warm_evals = {}
    for name, split, level in (("target", TARGET_SPLIT, a.levels[0]), ("longer", LONGER_SPLIT, a.levels[1])):
        path = warm / "long_horizon" / f"{split}-L{level}-n{a.episodes}-T{a.eval_turns}.json"
        if path.exists():
            warm_evals[name] = {k: v for k, v in json.loads(path.read_text()).items() if k != "per_episode"}
    if not runs:
        return {}
    w = a.warm_success if a.warm_success is not None else statistics.fmean(r["first_success"] for r in runs)
    threshold = w + GAIN
    summary = {k: arm_summary([r for r in runs if r["arm"] == k], threshold) for k in arms
               if any(r["arm"] == k for r in runs)}
    evals = {k: [r["target"] for r in runs if r["arm"] == k and "target" in r] for k in summary}
    plot(runs, arms, evals, warm_evals, out)
    done = ", ".join(f"{k} {s['runs']}" for k, s in summary.items())
    continued = (f" (the runs of `{a.continue_from}` continued to {a.iterations} at the learning rate they ended "
                 "with)" if a.continue_from else "")
    settings = (f"`experiment={a.experiment}` from `{warm}/final`, {a.iterations} iterations{continued}, seeds "
                f"{a.seeds}, overrides {a.overrides or 'none'}; eval: {a.episodes} fixed unseen games per policy at "
                f"level {a.levels[0]} (target) and {a.levels[1]} (longer chains), {a.eval_turns} turns, T=1.0, seed 0. "
                f"Runs done per arm: {done}.")
    by_turn = "\n".join(f"| {label} | " + " | ".join(f"{t}: {h:.3f}" for t, h in entropy_curve(ev)) + " |"
                        for label, ev in ([("warm start", [warm_evals["target"]])] if "target" in warm_evals else [])
                        + [(ARMS[k].label, v) for k, v in evals.items() if v])
    train_turns = "\n".join(
        f"| {ARMS[k].label} | {when} | " + " | ".join(f"{t}: {h:.3f}" for t, h in entropy_curve(
            [{"entropy_by_turn": r["train_entropy_by_turn"][when]} for r in runs if r["arm"] == k])) + " |"
        for k in summary for when in ("first", "last"))
    shares = [("warm start", warm_evals["target"].get("action_shares"))] if "target" in warm_evals else []
    shares += [(ARMS[k].label, s["target_action_shares"]) for k, s in summary.items()]
    action_table = "\n".join(f"| {label} | " + " | ".join(fmt(sh[kind], ".0%") for kind in ACTION_KINDS) + " |"
                             for label, sh in shares if sh)
    definitions = __doc__.split("Definitions", 1)[1].split("\n", 1)[1].strip()
    md = (f"{settings}\n\n{table(summary, warm_evals, threshold)}\n\nEntropy per turn index (eval, target level, "
          f"mean over seeds):\n\n| policy | turns: nats/token |\n|---|---|\n{by_turn}\n\n"
          "Training entropy per turn index (policy/entropy_turn/<t>, first and last 5 iterations, mean over seeds):"
          f"\n\n| arm | iterations | turns: nats/token |\n|---|---|---|\n{train_turns}\n\n"
          "Eval actions by kind (target level, mean over seeds):\n\n"
          f"| policy | {' | '.join(ACTION_KINDS)} |\n|---|{'---|' * len(ACTION_KINDS)}\n{action_table}\n\n"
          "The literature's claims measured again (exp_explore.py's definitions, on these runs; where both arms "
          f"ran):\n\n{claims_table(claims(summary, ARMS))}\n\n"
          f"Definitions:\n\n{definitions}\n\n"
          "![success and entropy](long_horizon.png)\n![entropy per turn index](entropy_by_turn.png)\n")
    (out / "summary.md").write_text(md)
    payload = {"settings": settings, "warm_success": w, "threshold": threshold, "levels": list(a.levels),
               "warm_eval": warm_evals, "iterations": a.iterations, "eval_episodes": a.episodes,
               "arms": {k: {"label": ARMS[k].label, "overrides": list(ARMS[k].overrides), **s}
                        for k, s in summary.items()},
               "runs": runs}
    (out / "summary.json").write_text(json.dumps(payload, indent=1))
    return payload


# ----------------------------------------------------------------------------------------------------
# the cost of one iteration at 15, 30 and 60 turns
# ----------------------------------------------------------------------------------------------------

def cost(a: argparse.Namespace, out: Path, warm: Path) -> None:
    """GRPO for COST_ITERATIONS iterations at each turn limit; the mean time of each part per iteration."""
    rows_out = []
    for turns in COST_TURNS:
        run = train_once(out / "cost" / f"T{turns}",
                         [f"experiment={a.experiment}", f"model.path={warm / 'final'}", "seed=0",
                          f"trainer.total_steps={COST_ITERATIONS}", "logger=none", f"env.max_turns={turns}",
                          *a.overrides], f"cost at {turns} turns")
        rows = rows_of(run)
        part = {k: statistics.fmean(r[f"perf/{k}_s"] for r in rows) for k in ("rollout", "generate", "env", "score",
                                                                               "update")}
        turns_done = statistics.fmean(r["rollout/samples"] for r in rows)
        rows_out.append({"max_turns": turns, "turn_samples": turns_done,
                         "episode_len": statistics.fmean(r["rollout/episode_len"] for r in rows),
                         "iteration_s": part["rollout"] + part["score"] + part["update"], **part})
    lines = ["| max_turns | turn samples per iteration | episode length | iteration s | rollout s (generation / env) "
             "| scoring s | update s | s per turn sample |", "|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['max_turns']} | {r['turn_samples']:.0f} | {r['episode_len']:.1f} | {r['iteration_s']:.1f} "
                     f"| {r['rollout']:.1f} ({r['generate']:.1f} / {r['env']:.1f}) | {r['score']:.1f} "
                     f"| {r['update']:.1f} | {r['iteration_s'] / r['turn_samples']:.3f} |")
    md = "\n".join(lines)
    (out / "cost.md").write_text(md + "\n")
    (out / "cost.json").write_text(json.dumps(rows_out, indent=1))
    print(md)


# ----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = study_parser(__doc__, "outputs/exp_long_horizon", ARMS,
                     "run dir of an `epo train experiment=coin_warm_start` (holding final/), required",
                     "runs (each with its evaluations) at the same time")
    p.add_argument("--iterations", type=int, default=40, help="RL iterations per run")
    p.add_argument("--experiment", default=EXPERIMENT, help="the RL preset every arm starts from")
    p.add_argument("--episodes", type=int, default=64, help="fixed eval games per policy and split (0: none)")
    p.add_argument("--eval-turns", type=int, help="turn limit of the evaluations (default: the preset's max_turns)")
    p.add_argument("--entropy-episodes", type=int, default=ENTROPY_EPISODES)
    p.add_argument("--warm-success", type=float, help="W for 'to W + 0.2' (default: mean iteration-1 success)")
    p.add_argument("--quick", action="store_true", help=f"smoke test: arms {QUICK_ARMS}, one seed, 2 tiny "
                   "iterations on chains of 3; its numbers mean nothing")
    p.add_argument("--cost", action="store_true", help=f"only measure one iteration's parts at {COST_TURNS} turns")
    p.add_argument("--summary", action="store_true", help="only rewrite the summary from what is done")
    p.add_argument("--continue-from", type=Path, help="another study's --out: continue each of its finished runs "
                   "(the one with the most iterations below --iterations) to --iterations here, at the learning "
                   "rate it ended with (exp_common.continue_once)")
    p.add_argument("overrides", nargs="*", help="extra overrides for every run")
    a = p.parse_args(argv)
    if a.quick:
        a.arms, a.seeds, a.episodes, a.entropy_episodes = QUICK_ARMS, a.seeds.split(",")[0], 2, 2
        a.iterations = 3 if a.continue_from else 2  # a quick study continued: one iteration more
        a.overrides = [*QUICK_OVERRIDES, *a.overrides]
    check_study_args(p, a, ARMS, "experiment=coin_warm_start")
    check_out(p, a.out)
    check_experiment(p, a.experiment)
    from epo_cli.launch.setup import compose_for_train

    try:  # the overrides every run takes, checked before any folder is made
        compose_for_train([f"experiment={a.experiment}", *a.overrides])
    except UserError as err:
        p.error(f"the overrides {' '.join(a.overrides) or '(none)'}: {err}")
    if a.continue_from is not None:
        a.continue_from = a.continue_from.resolve()
        if not (a.continue_from / "runs").is_dir():
            p.error(f"--continue-from {a.continue_from} holds no runs/: give the --out of an earlier study")
        if a.continue_from == a.out.resolve():
            p.error("--continue-from needs its own --out: the continued runs and their summary go to a new folder")
    if a.entropy_episodes < 1:
        p.error(f"--entropy-episodes must be >= 1, got {a.entropy_episodes}")
    return a


def main(argv: list[str] | None = None) -> None:
    if argv is None and "--eval-one" in sys.argv:  # a worker: one evaluation, written as JSON
        w = argparse.ArgumentParser()
        for name, kind in (("--eval-one", Path), ("--split", str), ("--episodes", int), ("--max-turns", int),
                           ("--entropy-episodes", int), ("--json", Path)):
            w.add_argument(name, type=kind, required=True)
        w.add_argument("--levels", type=int, nargs=2, required=True)
        w.add_argument("--override", action="append", default=[])
        e = w.parse_args()
        result = eval_one(e.eval_one, e.split, tuple(e.levels), e.episodes, e.max_turns, e.entropy_episodes,
                          e.override)
        e.json.write_text(json.dumps(result, indent=1))
        return
    a = parse_args(argv)
    out, warm = a.out.resolve(), Path(a.warm_start).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if a.cost:
        cost(a, out, warm)
        return
    from epo_cli.launch.setup import compose_for_train

    a.levels = levels(a)
    if a.eval_turns is None:
        a.eval_turns = int(compose_for_train([f"experiment={a.experiment}", *a.overrides])[0].env.max_turns)
    start = time.perf_counter()
    if not a.summary:
        if a.episodes:  # the warm start first: every later summary has its row
            for split, level in zip((TARGET_SPLIT, LONGER_SPLIT), a.levels):
                evaluate(warm, split, level, a)
        run_jobs(seed_major(a.arms.split(","), a.seed_list), lambda j: job(*j, a, out, warm), a.jobs)
    payload = summarize(a, out, warm)
    print((out / "summary.md").read_text() if payload else "no finished runs yet")
    print(f"written: {out / 'summary.md'} ({(time.perf_counter() - start) / 60:.1f} min)")


if __name__ == "__main__":
    run_study(main, "the long-horizon study")
