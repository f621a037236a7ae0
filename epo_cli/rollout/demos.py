"""Expert demonstrations for behaviour cloning (`algo=sft`).

Demonstrations come from the env's expert, played on the fly through the same rollout engine and prompt
builder as RL (so SFT prompts are exactly RL prompts), or from a JSONL file of trajectories:

    {"task_id": "...", "task_type": "pick_and_place", "goal": "put some apple on countertop.",
     "steps": [{"observation": "...", "admissible_commands": ["go to cabinet 1", ...],
                "thought": "find the apple", "action": "go to cabinet 1"}, ...]}

one trajectory per line; `thought` may be empty. Played expert episodes are written in this format to
<run>/demos.jsonl, so they can be reused (`algo.demos=<run>/demos.jsonl`) or edited.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from epo_cli.errors import UserError
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.prompts import EpisodeMemory, PromptBuilder, format_response
from epo_cli.rollout.rollout import Episode


def episodes_to_records(episodes: list[Episode]) -> list[dict]:
    """Text records (the JSONL format above) of played episodes."""
    records = []
    for ep in episodes:
        steps = [{"observation": turn.observation, "admissible_commands": turn.admissible,
                  "thought": turn.response_text.split("</think>")[0].replace("<think>", ""),
                  "action": turn.action} for turn in ep.turns]
        records.append({"task_id": ep.task.task_id, "task_type": ep.task.task_type, "goal": ep.goal,
                        "won": ep.won, "steps": steps})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Demonstration file '{path}' does not exist (algo.demos). Pass a JSONL file of "
                        "trajectories (format in epo_cli/rollout/demos.py) or algo.demos=expert.")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            assert isinstance(rec["steps"], list) and all("action" in s and "observation" in s for s in rec["steps"])
        except (json.JSONDecodeError, KeyError, AssertionError, TypeError):
            raise UserError(f"{path}:{n} is not a trajectory record: expected JSON with a `steps` list of "
                            "{observation, admissible_commands, thought, action}.") from None
        records.append(rec)
    if not records:
        raise UserError(f"Demonstration file '{path}' holds no trajectories.")
    return records


def records_to_batch(records: list[dict], builder: PromptBuilder, tokenizer: Any) -> TurnBatch:
    """Turn-level SFT samples: prompt from the same builder as RL, response = expert's formatted turn."""
    prompt_ids, response_ids, task_type = [], [], []
    traj, turn_index, num_turns = [], [], []
    for j, rec in enumerate(records):
        memory = EpisodeMemory(task=rec.get("goal", ""))
        steps = rec["steps"]
        for t, step in enumerate(steps):
            prompt = builder.build(memory, step["observation"], step.get("admissible_commands", []))
            response = format_response(step.get("thought", ""), step["action"])
            prompt_ids.append(prompt.ids)
            response_ids.append(tokenizer.encode(response, add_special_tokens=False))
            task_type.append(rec.get("task_type", "unknown"))
            traj.append(j)
            turn_index.append(t)
            num_turns.append(len(steps))
            memory.observations.append(step["observation"])
            memory.actions.append(step["action"])
    n = len(prompt_ids)
    return TurnBatch(
        prompt_ids=prompt_ids, response_ids=response_ids,
        traj_id=torch.tensor(traj, dtype=torch.long), group_id=torch.tensor(traj, dtype=torch.long),
        turn_index=torch.tensor(turn_index, dtype=torch.long),
        num_turns=torch.tensor(num_turns, dtype=torch.long),
        reward=torch.zeros(n), outcome=torch.zeros(n), valid=torch.ones(n, dtype=torch.bool),
        won=torch.ones(n, dtype=torch.bool), task_type=task_type,
    )
