"""Episodes: play a batch of them turn by turn (the rollout) and return one sample per turn.

    for each turn, until every episode has ended or hit max_turns:
        prompts  <- PromptBuilder(task, history window, observation, admissible actions)   (all active envs)
        responses <- policy.act(prompts)       one batched generate call (or the scripted expert)
        actions  <- parse_action(response)     invalid turns (missing tags) are flagged for the penalty
        observations <- pool.step(actions)     envs step in parallel worker processes (or in-process)

rollout.overlap=true breaks the lock-step with env workers: the policy generates for the envs
that have answered while the workers step (and reset) the others; same episodes (run_episodes).

Rewards (epo-reference section 4): the task reward `reward_scale * won` is the trajectory's `outcome`
(broadcast to every turn by the estimators); a turn-local `reward` holds the invalid-action penalty and
curriculum subgoal rewards, kept apart so that success is always the true task success.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from epo_cli.envs.base import Task
from epo_cli.rollout.actions import parse_action
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.generation import SamplingConfig, generate
from epo_cli.rollout.prompts import EpisodeMemory, PromptBuilder, format_response
from epo_cli.seeding import derive_seed


class Policy(Protocol):
    """Maps a batch of prompts to responses (token ids)."""

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        ...


@dataclass
class ModelPolicy:
    """A causal LM sampling with `params` (one batched generate call per turn)."""

    model: torch.nn.Module
    tokenizer: Any
    params: SamplingConfig
    vocab_limit: int | None = None
    batch_size: int = 0  # 0 = all prompts at once
    shared_prefill: bool = True  # prefill each distinct prompt once (a GRPO group's first turn)
    generate_seconds: float = 0.0
    generated_tokens: int = 0

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        start = time.perf_counter()
        step = self.batch_size or len(prompts)
        out: list[list[int]] = []
        for i in range(0, len(prompts), step):
            out += generate(self.model, prompts[i:i + step], self.params, self.tokenizer,
                            seeds=seeds[i:i + step] if self.params.temperature > 0 else None,
                            vocab_limit=self.vocab_limit, shared_prefill=self.shared_prefill)
        self.generate_seconds += time.perf_counter() - start
        self.generated_tokens += sum(len(r) for r in out)
        return out

    @classmethod
    def from_rollout(cls, model: torch.nn.Module, tokenizer: Any, rollout: Any, temperature: float,
                     vocab_limit: int | None) -> ModelPolicy:
        """`model` sampling with the rollout.* settings at `temperature`: the one construction used by the
        training rollouts, the training-time evaluation and `epo eval`."""
        params = SamplingConfig(rollout.max_new_tokens, temperature, rollout.top_p, rollout.top_k, rollout.stop)
        return cls(model, tokenizer, params, vocab_limit, rollout.generation_batch_size, rollout.shared_prefill)


@dataclass
class ExpertPolicy:
    """The environment's expert (info["expert_action"]), written in the response format.

    `slip` > 0 makes it a demonstrator whose hand slips: with that chance per turn (seeded per row, like
    model sampling) it keeps the expert's thought but takes another admissible command, chosen uniformly
    (never `help`); the expert answers from any state, so later turns recover from the slip."""

    tokenizer: Any
    slip: float = 0.0

    def act(self, prompts: list[list[int]], infos: list[dict[str, Any]], seeds: list[int]) -> list[list[int]]:
        texts = []
        for info, seed in zip(infos, seeds):
            action = info.get("expert_action") or "look"
            if self.slip > 0:
                rng = random.Random(seed)
                others = [c for c in info.get("admissible_commands") or [] if c not in (action, "help")]
                if others and rng.random() < self.slip:
                    action = rng.choice(others)
            texts.append(format_response(info.get("expert_thought") or "", action))
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
    result: str = ""  # the env's answer to `action` (the next observation); the intrinsic bonus counts it


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
    rollout_s: float = 0.0  # wall time of the whole rollout
    generate_s: float = 0.0  # time inside the policy's generate calls
    env_s: float = 0.0  # env time: resets, plus the time some env was stepping (the pool's busy_seconds)
    env_wait_s: float = 0.0  # time the rollout waited for envs: env time that generation did not hide
    env_steps: int = 0
    generated_tokens: int = 0


@dataclass(frozen=True)
class EpisodeSlot:
    """One episode to play: its task and global ids (the same whichever rank or batch plays it)."""

    task: Task
    traj_id: int  # with (seed, step, turn): the sampling seed of each of its turns
    group_id: int  # the rollouts of one task that GRPO-style estimators compare


def episode_slots(tasks: list[Task], ids: list[int]) -> list[EpisodeSlot]:
    """Slots for episodes that are their own group each (evaluation, demonstrations): `ids` are global."""
    return [EpisodeSlot(task, i, i) for task, i in zip(tasks, ids)]


@dataclass(frozen=True)
class PlayConfig:
    """How episodes are played: prompts, decoding, turn limit, sampling seeds, scheduling."""

    builder: PromptBuilder
    tokenizer: Any  # decodes the responses into action text
    max_turns: int
    seed: int = 0  # the run's seed; with (step, trajectory, turn) it seeds each row's sampling
    step: int = 0
    #: lock-step turns (False) or envs stepping while the policy generates for the others (True)
    overlap: bool = False
    #: how many parts the live envs are split into when overlapping (default: 2 with env workers; 1, i.e.
    #: lock-step, for in-process envs, which cannot step while the policy generates)
    num_waves: int | None = None


def run_episodes(policy: Policy, pool: Any, slots: list[EpisodeSlot],
                 settings: PlayConfig) -> tuple[list[Episode], RolloutStats]:
    """Play every slot's task with `policy` until all episodes end or reach settings.max_turns.

    overlap=False: lock-step turns (generate for every live env, then step them all).
    overlap=True: envs step in the pool's workers while the policy generates for the envs that have
    already answered (see `_play_overlapped`). Both give the same episodes: a row's tokens depend only on
    its prompt and its (trajectory, turn) seed, never on which rows share its generate call.
    """
    stats = RolloutStats()
    start = time.perf_counter()
    # overlapping envs reset as they answer (generation starts with the first ones) where the pool can
    wait_reset = not (settings.overlap and hasattr(pool, "start_reset"))
    play = _Play(policy, pool, slots, settings, stats, wait_reset)
    gen_before = getattr(policy, "generate_seconds", 0.0)
    tok_before = getattr(policy, "generated_tokens", 0)
    if settings.overlap:
        waves = settings.num_waves if settings.num_waves is not None else (2 if getattr(pool, "num_workers", 0) else 1)
        _play_overlapped(play, max(1, waves))
    else:
        _play_lock_step(play)
    busy = getattr(pool, "busy_seconds", None)
    stats.env_s = stats.env_s + busy() if busy is not None else stats.env_wait_s  # resets + steps
    stats.rollout_s = time.perf_counter() - start
    stats.generate_s = getattr(policy, "generate_seconds", 0.0) - gen_before
    stats.generated_tokens = getattr(policy, "generated_tokens", 0) - tok_before
    return play.episodes, stats


class _Play:
    """The state of a batch of episodes being played: each slot's memory, observation and info."""

    def __init__(self, policy: Policy, pool: Any, slots: list[EpisodeSlot], settings: PlayConfig,
                 stats: RolloutStats, wait_reset: bool = True) -> None:
        self.policy, self.pool, self.builder, self.tokenizer = policy, pool, settings.builder, settings.tokenizer
        self.max_turns, self.seed, self.step, self.stats = settings.max_turns, settings.seed, settings.step, stats
        self.episodes = [Episode(slot.task, slot.traj_id, slot.group_id) for slot in slots]
        tasks = [slot.task for slot in slots]
        self.observations: dict[int, str] = {}
        self.infos: dict[int, dict[str, Any]] = {}
        self.memories: dict[int, EpisodeMemory] = {}
        self.actions: dict[int, str] = {}
        self.resetting: set[int] = set()  # slots whose first observation has not arrived yet
        t0 = time.perf_counter()
        if wait_reset:
            for slot, first in enumerate(pool.reset(tasks)):
                self.started(slot, first)
            # resets overlap nothing here: the pool's busy time does not hold them, the wait is env time
            stats.env_s += time.perf_counter() - t0
        else:
            pool.start_reset(tasks)  # the pool's busy time holds the resets
            self.resetting = set(range(len(tasks)))
        stats.env_wait_s += time.perf_counter() - t0

    def started(self, slot: int, first: tuple[str, dict[str, Any]]) -> None:
        """A slot's first observation and info (from its env's reset)."""
        self.observations[slot], self.infos[slot] = first
        self.memories[slot] = EpisodeMemory(task=self.infos[slot].get("goal", ""))
        self.episodes[slot].goal = self.memories[slot].task
        self.resetting.discard(slot)

    def act(self, slots: list[int]) -> dict[int, str]:
        """One generate call for `slots` (each at its own next turn); records the turns, returns the actions."""
        built = [self.builder.build(self.memories[i], self.observations[i],
                                    self.infos[i].get("admissible_commands", [])) for i in slots]
        # per (step, trajectory, turn): independent of batch composition and rank
        seeds = [derive_seed(self.seed, "turn", self.step, self.episodes[i].traj_id, len(self.episodes[i].turns))
                 for i in slots]
        responses = self.policy.act([b.ids for b in built], [self.infos[i] for i in slots], seeds)
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        actions = {}
        for i, prompt, response, text in zip(slots, built, responses, texts):
            action, valid = parse_action(text)
            actions[i] = self.actions[i] = action
            self.episodes[i].turns.append(Turn(prompt.ids, response, text, self.observations[i],
                                               list(self.infos[i].get("admissible_commands", [])), action,
                                               valid, [], prompt.truncated, prompt.obs_trimmed))
        return actions

    def apply(self, slot: int, result: Any) -> bool:
        """Record a slot's step result; True while its episode goes on (not done, turns left)."""
        episode, memory = self.episodes[slot], self.memories[slot]
        memory.observations.append(self.observations[slot])
        memory.actions.append(self.actions.pop(slot))
        episode.turns[-1].subgoals = list(result.info.get("subgoals", []))
        episode.turns[-1].result = result.observation
        self.observations[slot], self.infos[slot] = result.observation, result.info
        if result.info.get("won"):
            episode.won = True
        if result.info.get("truncated") and result.info.get("error"):
            episode.crashed = True
        self.stats.env_steps += 1
        return not result.done and len(episode.turns) < self.max_turns


def _play_lock_step(play: _Play) -> None:
    active = list(range(len(play.episodes)))
    for _ in range(play.max_turns):
        if not active:
            break
        actions = play.act(active)
        t0 = time.perf_counter()
        results = play.pool.step(actions)
        play.stats.env_wait_s += time.perf_counter() - t0
        active = [i for i in active if play.apply(i, results[i])]


def _play_overlapped(play: _Play, num_waves: int) -> None:
    """Generate for the envs that have answered while the others step in the pool's workers.

    The live envs are worked in about `num_waves` parts: the first generate call takes 1/num_waves of them
    (so the workers have something to step while the policy generates for the rest); afterwards the
    policy generates as soon as a part's worth of envs has answered (or nothing else is in flight), for
    all that have. Batch composition then depends on timing, the episodes do not (run_episodes).
    """
    waiting = [i for i in range(len(play.episodes)) if i not in play.resetting]  # observed, no action yet
    in_flight: set[int] = set(play.resetting)
    live = len(play.episodes)
    if play.max_turns <= 0:  # no turn to play: only the resets to wait for
        waiting, live = [], 0
    while waiting or in_flight:
        part = -(-live // num_waves)  # ceil
        if waiting and (not in_flight or len(waiting) >= part):
            batch = sorted(waiting)[:part] if not in_flight else sorted(waiting)
            waiting = [i for i in waiting if i not in batch]
            actions = play.act(batch)
            t0 = time.perf_counter()
            play.pool.submit(actions)
            play.stats.env_wait_s += time.perf_counter() - t0
            in_flight.update(actions)
            continue
        t0 = time.perf_counter()
        results = play.pool.collect(sorted(in_flight), wait_all=False)
        play.stats.env_wait_s += time.perf_counter() - t0
        for slot in sorted(results):
            in_flight.discard(slot)
            if slot in play.resetting:
                play.started(slot, results[slot])
                if play.max_turns > 0:
                    waiting.append(slot)
            elif play.apply(slot, results[slot]):
                waiting.append(slot)
            else:
                live -= 1


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
