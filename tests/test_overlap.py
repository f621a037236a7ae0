"""Overlapped rollout (rollout.overlap): same episodes as lock-step, whatever the number of env workers.

The env here answers with text that repeats the action it got, takes 2-5 turns (by task seed) and sleeps
a little per step, as a slow real env: any difference in a generated token shows in the next prompt, and
the overlapped schedule really interleaves (episodes end at different turns, answers come back at
different times).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import pytest

from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.envs.pool import EnvPool
from epo_cli.rollout.episodes import EpisodeSlot, ModelPolicy, PlayConfig, run_episodes
from epo_cli.rollout.generation import SamplingConfig
from epo_cli.rollout.prompts import PromptBuilder, chat_encoder

from conftest import metrics_rows, only_run_dir, run_epo


class EchoEnv(Env):
    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.task, self.turn = task, 0
        self.length = 2 + task.seed % 4
        return f"You are in room {task.task_id}.", self._info()

    def step(self, action: str) -> StepResult:
        time.sleep(0.01 * (1 + self.task.seed % 3))
        self.turn += 1
        won = "cabinet" in action
        obs = f"You did {action[:40]!r} at turn {self.turn}."
        return StepResult(obs, float(won), won or self.turn >= self.length, self._info(won))

    def _info(self, won: bool = False) -> dict[str, Any]:
        return {"won": won, "lost": False, "goal": f"open the cabinet in {self.task.task_id}",
                "admissible_commands": ["open cabinet 1", "look"]}


class EchoSuite(EnvSuite):
    name = "echo"

    def make_env(self) -> Env:
        return EchoEnv()

    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        return [Task(f"r{i}", "echo", rng.randrange(1000), split) for i in range(n)]


def _trace(episodes: list) -> list:
    return [(ep.traj_id, ep.won, [(t.prompt_ids, t.response_ids, t.observation, t.action) for t in ep.turns])
            for ep in episodes]


@pytest.fixture(scope="module")
def tiny_policy(tiny_folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_folder)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    return tok, model


def _play(tiny_policy, num_workers: int, overlap: bool, num_waves: int | None = None,
          temperature: float = 1.0) -> tuple[list, Any]:
    tok, model = tiny_policy
    tasks = EchoSuite(None).sample_tasks("train", 3, random.Random(1))
    tasks = [t for t in tasks for _ in range(2)]  # groups of 2, as GRPO plays them
    policy = ModelPolicy(model, tok, SamplingConfig(max_new_tokens=12, temperature=temperature))
    builder = PromptBuilder("compact", 2, 256, chat_encoder(tok))
    with EnvPool(EchoSuite(None), num_workers=num_workers, step_timeout_s=30) as pool:
        slots = [EpisodeSlot(task, traj_id=i, group_id=i // 2) for i, task in enumerate(tasks)]
        settings = PlayConfig(builder, tok, max_turns=4, seed=3, step=1, overlap=overlap, num_waves=num_waves)
        episodes, stats = run_episodes(policy, pool, slots, settings)
    return _trace(episodes), stats


@pytest.mark.slow
def test_overlapped_rollout_equals_lock_step_for_any_worker_count(tiny_policy) -> None:
    reference, stats = _play(tiny_policy, 0, overlap=False)
    lengths = [len(turns) for _, _, turns in reference]
    assert len(set(lengths)) > 1  # episodes end at different turns: the schedule really interleaves
    assert stats.env_steps == sum(lengths) and stats.generate_s > 0
    # 2 and 3 parts; at 0 workers too (forced: in-process envs step at submit), which mixes batch company most
    for num_workers, waves in ((0, 2), (0, 3), (1, 2), (2, 2), (2, 3)):
        trace, stats = _play(tiny_policy, num_workers, overlap=True, num_waves=waves)
        assert trace == reference, (num_workers, waves)
        assert stats.env_steps == sum(lengths)
    assert _play(tiny_policy, 2, overlap=False)[0] == reference


@pytest.mark.slow
def test_overlapped_rollout_greedy_and_default_waves(tiny_policy) -> None:
    reference, _ = _play(tiny_policy, 0, overlap=False, temperature=0.0)
    trace, stats = _play(tiny_policy, 2, overlap=True, temperature=0.0)  # default: 2 waves with workers
    assert trace == reference
    # the env time is the time some env was stepping (each step sleeps >= 10 ms), not the time waited
    assert stats.env_s >= 0.01 * stats.env_steps / 2
    assert stats.env_wait_s <= stats.rollout_s


def test_shared_prefill_gives_the_same_tokens_and_logprobs(tiny_policy) -> None:
    """A GRPO group's first turn: identical prompts are prefilled once and their KV cache copied to each
    row; the tokens and their log-probs are those of prefilling every row."""
    import torch

    from epo_cli.rollout.generation import generate

    tok, model = tiny_policy
    a = tok.encode("Task: put a mug in desk. You are in the middle of a room.")
    b = tok.encode("Observation: You arrive at cabinet 1. The cabinet 1 is closed.")
    prompts = [a, a, a, b, b, a[:5]]  # two groups (3 and 2 rows) and a shorter prompt: left padding differs
    seeds = [11, 12, 13, 14, 15, 16]
    params = SamplingConfig(max_new_tokens=10, temperature=1.0, stop="</action>")
    prefill_rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: prefill_rows.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        plain_lp: list[list[float]] = []
        plain = generate(model, prompts, params, tok, seeds=seeds, shared_prefill=False, logprobs=plain_lp)
        plain_prefill, prefill_rows[:] = prefill_rows[0], []
        shared_lp: list[list[float]] = []
        shared = generate(model, prompts, params, tok, seeds=seeds, shared_prefill=True, logprobs=shared_lp)
        shared_prefill = prefill_rows[0]
    finally:
        hook.remove()
    assert plain_prefill[0] == 6 and shared_prefill[0] == 3  # 3 distinct prompts ran through the model
    assert shared == plain
    assert len(set(map(tuple, plain[:3]))) > 1  # the group's rows still sample differently (own seeds)
    for x, y in zip(shared_lp, plain_lp):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


@pytest.mark.slow
def test_overlap_through_the_cli_trains_on_the_same_rollouts(warm_start_short: Path, tmp_path: Path) -> None:
    """`epo train ... env.num_workers=2 rollout.overlap=true` logs the same rollout metrics and loss as the
    lock-step run (same episodes), plus the overlap ratio."""
    rows = {}
    for overlap in ("false", "true"):
        out = tmp_path / overlap
        run_epo(["train", "algo=grpo", f"model.path={warm_start_short / 'final'}", "env.num_workers=2",
                 f"rollout.overlap={overlap}", "algo.tasks_per_step=2", "algo.group_size=2", "env.max_turns=4",
                 "trainer.total_steps=1", "env.eval_splits=[]", "logger.tensorboard=false", f"output_dir={out}"],
                cwd=tmp_path)
        rows[overlap] = metrics_rows(only_run_dir(out))[0]
    same_keys = [k for k in rows["false"] if k.startswith(("rollout/", "loss/", "policy/"))]
    assert "rollout/episode_len" in same_keys and "loss/policy_clip" in same_keys
    assert {k: rows["true"][k] for k in same_keys} == {k: rows["false"][k] for k in same_keys}
    for row in rows.values():
        # a ratio of times: positive and finite; how far above 1 the rollout's own overhead takes it depends on load
        assert 0 < row["perf/overlap_ratio"] < math.inf and row["perf/env_s"] > 0
