"""The rollout engine: play a batch of episodes turn by turn and return one sample per turn.

    for each turn, until every episode has ended or hit max_turns:
        prompts  <- PromptBuilder(task, history window, observation, admissible actions)   (all active envs)
        responses <- policy.act(prompts)       one batched generate call (or the scripted expert)
        actions  <- parse_action(response)     invalid turns (missing tags) are flagged for the penalty
        observations <- pool.step(actions)     envs step in parallel worker processes (or in-process)

Rewards (epo-reference section 4): the task reward `reward_scale * won` is the trajectory's `outcome`
(broadcast to every turn by the estimators); a turn-local `reward` holds the invalid-action penalty and
curriculum subgoal rewards, kept apart so that success is always the true task success.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from epo_cli.envs.base import Task
from epo_cli.rollout.actions import parse_action
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.generation import SamplingParams, generate
from epo_cli.rollout.prompts import EpisodeMemory, PromptBuilder, format_response


class Policy(Protocol):
    """Maps a batch of prompts to responses (token ids)."""

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        ...


@dataclass
class ModelPolicy:
    """A causal LM sampling with `params` (one batched generate call per turn)."""

    model: torch.nn.Module
    tokenizer: Any
    params: SamplingParams
    vocab_limit: int | None = None
    batch_size: int = 0  # 0 = all prompts at once
    generate_seconds: float = 0.0
    generated_tokens: int = 0

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        start = time.perf_counter()
        step = self.batch_size or len(prompts)
        out: list[list[int]] = []
        for i in range(0, len(prompts), step):
            out += generate(self.model, prompts[i:i + step], self.params, self.tokenizer,
                            seeds=seeds[i:i + step] if self.params.temperature > 0 else None,
                            vocab_limit=self.vocab_limit)
        self.generate_seconds += time.perf_counter() - start
        self.generated_tokens += sum(len(r) for r in out)
        return out


@dataclass
class ExpertPolicy:
    """The environment's expert (info["expert_action"]), written in the response format."""

    tokenizer: Any

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        texts = [format_response(i.get("expert_thought") or "", i.get("expert_action") or "look") for i in infos]
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]


@dataclass
class Turn:
    prompt_ids: list[int]
    response_ids: list[int]
    response_text: str
    observation: str
    admissible: list[str]
    action: str
    valid: bool
    subgoals: list[str]
    truncated_prompt: bool
    obs_trimmed: bool


@dataclass
class Episode:
    task: Task
    traj_id: int
    group_id: int
    goal: str = ""
    turns: list[Turn] = field(default_factory=list)
    won: bool = False
    crashed: bool = False  # a worker died/hung and the episode was truncated

    @property
    def actions(self) -> list[str]:
        return [t.action for t in self.turns]


@dataclass
class RolloutStats:
    rollout_s: float = 0.0
    generate_s: float = 0.0
    env_s: float = 0.0
    env_steps: int = 0
    generated_tokens: int = 0


def turn_seed(base_seed: int, step: int, traj_id: int, turn: int) -> int:
    """A per-(step, trajectory, turn) sampling seed, independent of batch composition and rank."""
    return ((base_seed * 1_000_003 + step * 10_007 + traj_id) * 1_009 + turn) & 0x7FFFFFFF


def run_episodes(
    policy: Policy,
    pool: Any,
    tasks: list[Task],
    traj_ids: list[int],
    group_ids: list[int],
    builder: PromptBuilder,
    tokenizer: Any,
    max_turns: int,
    seed: int = 0,
    step: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Episode], RolloutStats]:
    """Play `tasks` (slot i plays tasks[i]) with `policy` until all episodes end or reach max_turns."""
    stats = RolloutStats()
    start = time.perf_counter()
    episodes = [Episode(task, t, g) for task, t, g in zip(tasks, traj_ids, group_ids)]
    t0 = time.perf_counter()
    first = pool.reset(tasks)
    stats.env_s += time.perf_counter() - t0
    observations = {i: obs for i, (obs, _) in enumerate(first)}
    infos = {i: info for i, (_, info) in enumerate(first)}
    memories = {i: EpisodeMemory(task=infos[i].get("goal", "")) for i in range(len(tasks))}
    for i, ep in enumerate(episodes):
        ep.goal = memories[i].task
    active = [i for i in range(len(tasks))]
    gen_before = getattr(policy, "generate_seconds", 0.0)
    tok_before = getattr(policy, "generated_tokens", 0)

    for turn in range(max_turns):
        if not active:
            break
        built = [builder.build(memories[i], observations[i], infos[i].get("admissible_commands", []))
                 for i in active]
        seeds = [turn_seed(seed, step, episodes[i].traj_id, turn) for i in active]
        responses = policy.act([b.ids for b in built], [infos[i] for i in active], seeds)
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        actions = {}
        for i, prompt, response, text in zip(active, built, responses, texts):
            action, valid = parse_action(text)
            actions[i] = action
            episodes[i].turns.append(Turn(prompt.ids, response, text, observations[i],
                                          list(infos[i].get("admissible_commands", [])), action, valid, [],
                                          prompt.truncated, prompt.obs_trimmed))
        t0 = time.perf_counter()
        results = pool.step(actions)
        stats.env_s += time.perf_counter() - t0
        stats.env_steps += len(actions)
        still_active = []
        for i in active:
            result = results[i]
            memories[i].observations.append(observations[i])
            memories[i].actions.append(actions[i])
            episodes[i].turns[-1].subgoals = list(result.info.get("subgoals", []))
            observations[i], infos[i] = result.observation, result.info
            if result.info.get("won"):
                episodes[i].won = True
            if result.info.get("truncated") and result.info.get("error"):
                episodes[i].crashed = True
            if not result.done:
                still_active.append(i)
        active = still_active
        if on_progress is not None:
            on_progress(turn + 1, len(active))

    stats.rollout_s = time.perf_counter() - start
    stats.generate_s = getattr(policy, "generate_seconds", 0.0) - gen_before
    stats.generated_tokens = getattr(policy, "generated_tokens", 0) - tok_before
    return episodes, stats


def episodes_to_batch(
    episodes: list[Episode],
    reward_scale: float,
    invalid_penalty: float,
    subgoal_reward: float = 0.0,
) -> TurnBatch:
    """Flatten episodes into turn-samples with the reward convention of the module docstring."""
    prompt_ids, response_ids, task_type, anchor_obs, admissible = [], [], [], [], []
    traj, group, turn_index, num_turns, reward, outcome, valid, won = [], [], [], [], [], [], [], []
    for ep in episodes:
        T = len(ep.turns)
        for t, turn in enumerate(ep.turns):
            prompt_ids.append(turn.prompt_ids)
            response_ids.append(turn.response_ids)
            task_type.append(ep.task.task_type)
            anchor_obs.append(turn.observation)
            admissible.append("\n".join(turn.admissible))
            traj.append(ep.traj_id)
            group.append(ep.group_id)
            turn_index.append(t)
            num_turns.append(T)
            reward.append(-invalid_penalty * (not turn.valid) + subgoal_reward * len(turn.subgoals))
            outcome.append(reward_scale * float(ep.won))
            valid.append(turn.valid)
            won.append(ep.won)
    return TurnBatch(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        traj_id=torch.tensor(traj, dtype=torch.long),
        group_id=torch.tensor(group, dtype=torch.long),
        turn_index=torch.tensor(turn_index, dtype=torch.long),
        num_turns=torch.tensor(num_turns, dtype=torch.long),
        reward=torch.tensor(reward, dtype=torch.float32),
        outcome=torch.tensor(outcome, dtype=torch.float32),
        valid=torch.tensor(valid, dtype=torch.bool),
        won=torch.tensor(won, dtype=torch.bool),
        task_type=task_type,
        anchor_obs=anchor_obs,
        admissible=admissible,
    )


def episode_metrics(episodes: list[Episode]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each rollout/* metric, to all-reduce across ranks; the metric is sum / count, or
    the plain sum where count is 0 (counters such as rollout/truncated)."""
    sums: dict[str, tuple[float, float]] = {}

    def add(key: str, value: float, count: float = 1.0) -> None:
        s, c = sums.get(key, (0.0, 0.0))
        sums[key] = (s + value, c + count)

    by_type: dict[str, list[bool]] = defaultdict(list)
    for ep in episodes:
        add("rollout/success", float(ep.won))
        add("rollout/episode_len", float(len(ep.turns)))
        add("rollout/invalid_rate", float(sum(not t.valid for t in ep.turns)), float(len(ep.turns)))
        add("rollout/truncated", float(sum(t.truncated_prompt for t in ep.turns)), 0.0)
        add("rollout/obs_trimmed", float(sum(t.obs_trimmed for t in ep.turns)), 0.0)
        add("rollout/crashed", float(ep.crashed))
        by_type[ep.task.task_type].append(ep.won)
    for task_type, wins in by_type.items():
        add(f"rollout/success/{task_type}", float(sum(wins)), float(len(wins)))
    return sums
