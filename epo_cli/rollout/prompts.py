"""Prompt builder (turn-level samples with a history window) and the response format.

Each turn's prompt = instructions + the task + the last `history_length` (observation, action) pairs +
the current observation + the admissible actions (verl-agent's ALFWorld template). The prompt length
therefore stays roughly constant over a 50-turn episode. If a prompt would exceed
`rollout.max_prompt_tokens`, the history window shrinks first; the task and the instructions are never
cut. Only if the prompt is still too long with no history at all is the current observation trimmed in
its middle. Both events are counted (rollout/truncated, rollout/obs_trimmed).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from epo_cli.errors import ConfigError, UserError
from epo_cli.registry import Registry

#: env.prompt_template name -> (template for the first turn, template for later turns)
PROMPT_TEMPLATES = Registry("prompt template")
for _name, _pair in {
    # The same information as `alfworld` without the prose (a third of the tokens), ordered so that what
    # the next action depends on most (the task, then the observation) sits right before the response:
    # small models on CPU learn to copy from a nearly fixed relative position far sooner than by a
    # content look-up across a long prompt. The response format is taught by the demonstrations.
    "compact": (
        "Actions: [{admissible}]\nObservation: {observation}\nTask: {task}",
        "History ({step_count} steps so far):{history}\nActions: [{admissible}]\n"
        "Observation: {observation}\nTask: {task}",
    ),
    # For a small pretrained instruct model (SmolLM2-135M): `compact`'s information with the task first and
    # the response format spelled out last, right before the answer (with env.system_prompt saying the same).
    "instruct": (
        "Task: {task}\nObservation: {observation}\nAdmissible actions: {admissible}\n"
        "Answer with <think>a short thought</think><action>one admissible action</action>.",
        "Task: {task}\nLast {history_count} of {step_count} steps:{history}\nObservation: {observation}\n"
        "Admissible actions: {admissible}\n"
        "Answer with <think>a short thought</think><action>one admissible action</action>.",
    ),
    "alfworld": (
        "You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task}\n"
        "Your current observation is: {observation}\n"
        "Your admissible actions of the current situation are: [{admissible}].\n\n"
        "Now it's your turn to take an action.\n"
        "You should first reason step-by-step about the current situation. This reasoning process MUST be "
        "enclosed within <think> </think> tags.\n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and "
        "present it within <action> </action> tags.",
        "You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task}\n"
        "Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
        "{history_count} observations and the corresponding actions you took: {history}\n"
        "You are now at step {current_step} and your current observation is: {observation}\n"
        "Your admissible actions of the current situation are: [{admissible}].\n\n"
        "Now it's your turn to take an action.\n"
        "You should first reason step-by-step about the current situation. This reasoning process MUST be "
        "enclosed within <think> </think> tags.\n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and "
        "present it within <action> </action> tags.",
    ),
    "scienceworld": (
        "You are an expert agent playing ScienceWorld, a text-based science experiment environment. "
        "Your task is to: {task}\n"
        "Your current observation is: {observation}\n"
        "Your valid actions of the current situation include: [{admissible}].\n\n"
        "Now it's your turn to take an action.\n"
        "First reason step-by-step inside <think> </think> tags, then give exactly one action inside "
        "<action> </action> tags.",
        "You are an expert agent playing ScienceWorld, a text-based science experiment environment. "
        "Your task is to: {task}\n"
        "Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
        "{history_count} observations and the corresponding actions you took: {history}\n"
        "You are now at step {current_step} and your current observation is: {observation}\n"
        "Your valid actions of the current situation include: [{admissible}].\n\n"
        "Now it's your turn to take an action.\n"
        "First reason step-by-step inside <think> </think> tags, then give exactly one action inside "
        "<action> </action> tags.",
    ),
}.items():
    PROMPT_TEMPLATES.register(_name, _pair)


def chat_encoder(tokenizer: Any, system_prompt: str | None = None) -> Callable[[str], list[int]]:
    """text -> token ids of [a system turn,] a chat user turn plus the assistant header (the model's chat
    template; env.system_prompt)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def encode(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template([*system, {"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a mapping

    return encode


def format_response(thought: str, action: str) -> str:
    """The response format the policy is trained to produce."""
    return f"<think>{thought}</think><action>{action}</action>"


#: the {fields} a template may use (render fills all of them; on the first turn the history is empty)
TEMPLATE_FIELDS = ("task", "observation", "admissible", "step_count", "history_count", "history", "current_step")


def check_literal_template(text: str) -> None:
    """A literal template is data: plain {field} names from TEMPLATE_FIELDS only (str.format would otherwise
    read attributes and items of the values, `{task.__class__...}`), and its braces balanced ({{ and }} for
    literal ones). One ConfigError naming the problem."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as err:
        raise ConfigError(f"env.prompt_template is not a valid template ({err}); write literal braces as {{{{ "
                          "and }}.") from None
    for _, field_name, _, _ in parsed:
        if field_name is None:
            continue
        if field_name not in TEMPLATE_FIELDS:
            raise ConfigError(f"env.prompt_template uses {{{field_name}}}, which is not one of its fields: "
                              f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (plain names only; literal "
                              "braces are written {{ and }}).")


def get_template(name_or_text: str) -> tuple[str, str]:
    """A template by name, or a literal template (one string containing `{observation}`, checked by
    check_literal_template)."""
    if name_or_text in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[name_or_text]
    if "{observation}" in name_or_text:
        check_literal_template(name_or_text)
        return name_or_text, name_or_text
    raise ConfigError(
        f"Unknown prompt template '{name_or_text}' (env.prompt_template). Valid names: "
        f"{', '.join(PROMPT_TEMPLATES)}; or a literal template containing {{observation}}."
    )


@dataclass
class EpisodeMemory:
    """What one episode has shown so far: the task and every (observation, action) pair."""

    task: str
    observations: list[str] = field(default_factory=list)  # observation before each turn
    actions: list[str] = field(default_factory=list)  # action sent at each turn


@dataclass
class BuiltPrompt:
    text: str
    ids: list[int]
    history_used: int  # pairs of history actually shown
    truncated: bool  # the history window had to shrink
    obs_trimmed: bool  # even without history the observation had to be trimmed


class PromptBuilder:
    """Renders a turn's prompt with the chat template and enforces the prompt-length budget."""

    def __init__(self, template: str, history_length: int, max_prompt_tokens: int,
                 encode_chat: Callable[[str], list[int]]) -> None:
        self.first, self.later = get_template(template)
        self.history_length = history_length
        self.max_prompt_tokens = max_prompt_tokens
        self.encode_chat = encode_chat  # text -> chat-templated token ids (user turn + assistant header)

    def render(self, memory: EpisodeMemory, observation: str, admissible: list[str], window: int) -> str:
        step = len(memory.actions)
        admissible_text = ", ".join(f"'{a}'" for a in admissible)
        if step == 0 or window == 0:  # every field has a value, also for a literal template's first turn
            return self.first.format(task=memory.task, observation=observation, admissible=admissible_text,
                                     step_count=step, history_count=0, history="", current_step=step + 1)
        start = max(0, step - window)
        history = "".join(
            f"\n[Observation {i + 1}: '{memory.observations[i]}', Action {i + 1}: '{memory.actions[i]}']"
            for i in range(start, step)
        )
        return self.later.format(
            task=memory.task, step_count=step, history_count=step - start, history=history,
            current_step=step + 1, observation=observation, admissible=admissible_text,
        )

    def build(self, memory: EpisodeMemory, observation: str, admissible: list[str]) -> BuiltPrompt:
        window = min(self.history_length, len(memory.actions))
        for w in range(window, -1, -1):  # shrink the history first; never the task
            text = self.render(memory, observation, admissible, w)
            ids = self.encode_chat(text)
            if len(ids) <= self.max_prompt_tokens:
                return BuiltPrompt(text, ids, w, truncated=w < window, obs_trimmed=False)
        # Still too long without any history: trim the middle of the observation (keeps its start, which
        # names the location, and its end), then, as a last resort, the admissible list's tail.
        keep = len(observation)
        while keep > 16:
            keep //= 2
            short = observation[: keep // 2] + " ... " + observation[-keep // 2:]
            text = self.render(memory, short, admissible, 0)
            ids = self.encode_chat(text)
            if len(ids) <= self.max_prompt_tokens:
                return BuiltPrompt(text, ids, 0, truncated=window > 0, obs_trimmed=True)
        n = len(admissible)
        while n > 1:
            n //= 2
            text = self.render(memory, observation[:16], admissible[:n], 0)
            ids = self.encode_chat(text)
            if len(ids) <= self.max_prompt_tokens:
                return BuiltPrompt(text, ids, 0, truncated=window > 0, obs_trimmed=True)
        raise UserError(
            f"rollout.max_prompt_tokens={self.max_prompt_tokens} cannot even hold the task and the "
            "instructions; raise rollout.max_prompt_tokens."
        )
