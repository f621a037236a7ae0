"""Play a policy on a household level the way RL does and describe what happens (no training).

    python scripts/experiments/rollout_probe.py <run>/final tiny_closed_pick_place [--groups 8 --n 8 --turns 15]

G groups x n rollouts of G train tasks at T=1.0 (RL's rollout), then: success, how many groups have reward
variance (the only ones GRPO learns from), mean episode length, what the policy does on arriving at a
closed receptacle, how often it opens one, and the anatomy of its failures: the share of turns whose action
is not in the admissible list, the per-turn hazard of a first such action, the kind of that first mistake,
and how often an admissible action follows a non-admissible one (recovery). Last, each episode is replayed
in a fresh env to split its turns three ways: the expert's action at that state (the built-in expert
answers from any state), another admissible command (what a slipping teacher does), or not admissible.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from epo_cli.envs.household import HouseholdConfig, HouseholdSuite
from epo_cli.envs.pool import EnvPool
from epo_cli.rollout.episodes import EpisodeSlot, ModelPolicy, PlayConfig, run_episodes
from epo_cli.rollout.generation import SamplingConfig
from epo_cli.rollout.prompts import PromptBuilder, chat_encoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="an HF folder, e.g. <run>/final")
    parser.add_argument("level")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="rollouts per task")
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--split", default="train")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--template", default="compact")
    args = parser.parse_args()

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    suite = HouseholdSuite(HouseholdConfig(level=args.level))
    tasks = suite.sample_tasks(args.split, args.groups, random.Random(args.seed))
    slots = [EpisodeSlot(tasks[g], g * args.n + k, g) for g in range(args.groups) for k in range(args.n)]
    policy = ModelPolicy(model, tok, SamplingConfig(64, args.temperature, 1.0, 0, "</action>"), len(tok))
    settings = PlayConfig(PromptBuilder(args.template, 2, 1024, chat_encoder(tok)), tok, args.turns, seed=args.seed)
    start = time.perf_counter()
    with torch.no_grad():
        episodes, _ = run_episodes(policy, EnvPool(suite, num_workers=0), slots, settings)
    seconds = time.perf_counter() - start

    wins = collections.defaultdict(list)
    for ep in episodes:
        wins[ep.group_id].append(ep.won)
    with_variance = sum(0 < sum(w) < len(w) for w in wins.values())
    turns = [t for ep in episodes for t in ep.turns]
    bad = sum(t.action not in t.admissible for t in turns)
    arrivals = [t for t in turns if t.observation.startswith("You arrive") and "is closed." in t.observation]
    at_closed = collections.Counter("open" if t.action.startswith("open") else t.action.split(" ")[0] for t in arrivals)
    opened = sum(any(t.action.startswith("open") and t.action in t.admissible for t in ep.turns) for ep in episodes)
    length = statistics.mean(len(ep.turns) for ep in episodes)
    print(f"{args.level}: success {statistics.mean(ep.won for ep in episodes):.3f}, groups with reward variance "
          f"{with_variance}/{args.groups}, mean episode length {length:.1f}, {seconds:.0f} s")
    print(f"  episodes that opened a receptacle: {opened}/{len(episodes)}; "
          f"on arriving at a closed one: {dict(at_closed)}")
    print(f"  non-admissible actions: {bad}/{len(turns)} turns ({bad / max(len(turns), 1):.2f})")

    clean = clean_bad = after = after_ok = 0
    first_kind: collections.Counter[str] = collections.Counter()
    for ep in episodes:
        derailed = False
        for i, t in enumerate(ep.turns):
            ok = t.action in t.admissible
            if not derailed:
                clean += 1
                clean_bad += not ok
                if not ok and not ep.won:
                    verb = t.action.split(" ")[0]
                    rooms = {a[6:] for a in t.admissible if a.startswith("go to ")}
                    first_kind["go to a receptacle not in the room" if verb == "go" and t.action[6:] not in rooms
                               else verb] += 1
            elif ep.turns[i - 1].action not in ep.turns[i - 1].admissible:
                after += 1
                after_ok += ok
            derailed |= not ok
    print(f"  hazard of a first non-admissible action: {clean_bad}/{clean} turns "
          f"({clean_bad / max(clean, 1):.3f} per turn)")
    print(f"  first mistake of the failed episodes: {dict(first_kind)}")
    print(f"  admissible right after a non-admissible action: {after_ok}/{after} ({after_ok / max(after, 1):.3f})")
    kinds = expert_agreement(suite, episodes)
    total = max(sum(kinds.values()), 1)
    print("  turns that take the expert's action / another admissible one / a non-admissible one: "
          + " / ".join(f"{kinds[k] / total:.2f}" for k in ("expert", "other admissible", "not admissible")))


def expert_agreement(suite: HouseholdSuite, episodes: list) -> collections.Counter[str]:
    """Replay every episode's actions in a fresh env and count, per turn, whether the action was the expert's
    at that state, another admissible command, or not admissible."""
    kinds: collections.Counter[str] = collections.Counter()
    for ep in episodes:
        env = suite.make_env()
        _, info = env.reset(ep.task)
        for t in ep.turns:
            kinds["expert" if t.action == info["expert_action"] else
                  "other admissible" if t.action in info["admissible_commands"] else "not admissible"] += 1
            info = env.step(t.action).info
    return kinds


if __name__ == "__main__":
    main()
