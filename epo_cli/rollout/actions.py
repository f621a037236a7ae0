"""Action parser: the text inside <action>...</action>, and whether the turn is well-formed.

A turn is valid when its response has a <think>...</think> block followed by exactly one non-empty
<action>...</action> block (epo-reference section 4). Invalid turns are penalised by
`algo.invalid_action_penalty`; whatever text they produced is still sent to the environment, which
answers "Nothing happens." to anything it does not understand (verl-agent behaviour).
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def parse_action(response: str) -> tuple[str, bool]:
    """Return (action text to send to the env, valid flag)."""
    actions = _ACTION.findall(response)
    if len(actions) == 1 and actions[0].strip():
        action = " ".join(actions[0].split()).lower()
        think = _THINK.search(response)
        valid = think is not None and think.end() <= response.find("<action>")
        return action, valid
    if actions:  # several action blocks: take the last non-empty one, but the turn is invalid
        candidates = [a for a in actions if a.strip()]
        return (" ".join(candidates[-1].split()).lower() if candidates else ""), False
    # No tags: send the tail of the text (truncated to a sane length); the env will not understand it.
    return " ".join(response.replace("<action>", " ").split())[-100:].lower(), False
