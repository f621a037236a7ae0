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
from epo_cli.rollout.episodes import Episode
from epo_cli.rollout.prompts import EpisodeMemory, PromptBuilder, format_response
from epo_cli.rundir.received import loads, read_text


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


#: the longest text a demonstration field may hold (a larger one is a corrupt or hostile file)
MAX_FIELD_CHARS = 100_000
EXPECTED = ("expected one JSON object per line: {\"task_id\": str, \"task_type\": str, \"goal\": str, "
            "\"steps\": [{\"observation\": str, \"admissible_commands\": [str, ...], \"thought\": str, "
            "\"action\": str}, ...]} (format in epo_cli/rollout/demos.py)")


def _text(value: Any, where: str, required: bool, allow_empty: bool = True) -> str | None:
    """The problem with a text field, or None when it is fine."""
    if value is None:
        return f"`{where}` is missing" if required else None
    if not isinstance(value, str):
        return f"`{where}` must be a string (got {type(value).__name__})"
    if not allow_empty and not value.strip():
        return f"`{where}` is empty"
    if len(value) > MAX_FIELD_CHARS:
        return f"`{where}` is {len(value)} characters long (at most {MAX_FIELD_CHARS})"
    return None


def record_problem(rec: Any) -> str | None:
    """What is wrong with one decoded trajectory record, field by field (None: nothing)."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    for key in ("task_id", "task_type", "goal"):
        problem = _text(rec.get(key), key, required=False)
        if problem:
            return problem
    steps = rec.get("steps")
    if steps is None:
        return "`steps` is missing"
    if not isinstance(steps, list) or not steps:
        return "`steps` must be a non-empty list of turns"
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            return f"`steps[{i}]` must be an object (got {type(step).__name__})"
        problem = (_text(step.get("observation"), f"steps[{i}].observation", required=True)
                   or _text(step.get("action"), f"steps[{i}].action", required=True, allow_empty=False)
                   or _text(step.get("thought"), f"steps[{i}].thought", required=False))
        if problem:
            return problem
        admissible = step.get("admissible_commands", [])
        if not isinstance(admissible, list) or not all(isinstance(a, str) for a in admissible):
            return f"`steps[{i}].admissible_commands` must be a list of strings"
    return None


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():  # a FIFO or a device is refused by the reader below, naming it
        raise UserError(f"Demonstration file '{path}' does not exist (algo.demos). Pass a JSONL file of "
                        "trajectories (format in epo_cli/rollout/demos.py) or algo.demos=expert.")
    records = []
    try:
        text = read_text(path, "demonstrations")  # bounded: epo_cli/rundir/received.py
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"Demonstration file '{path}' cannot be read as UTF-8 text: {err}.") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = loads(line)  # with the nesting cap
        except ValueError as err:  # json.JSONDecodeError, or a number too large to parse
            problem = f"not valid JSON ({str(err).splitlines()[0]})"
        else:
            problem = record_problem(rec)
        if problem:
            raise UserError(f"{path}:{n} is not a trajectory record: {problem}; {EXPECTED}.")
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
