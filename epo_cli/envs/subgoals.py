"""Subgoal events of ALFWorld's six task types, shared by the envs that speak ALFWorld's text.

env=household (the embedded game) and env=alfworld (the real games) report the same events in
info["subgoals"], so intermediate rewards mean the same on both; each env decides for itself when an event
holds (household from its own world state, alfworld from the game's PDDL facts). An event is reported once
per episode, at the step it first holds, and info["progress"] counts them: reached / (events + 1), with
winning as the last step.

    found_target  an object of the target class is in view
    picked        the agent holds an object of the target class
    transformed   clean/heat/cool tasks: the held target object is clean/hot/cool
    found_lamp    look_at_obj_in_light: the task's lamp is found (household: in view; alfworld: it can be
                  used here)
    placed_first  pick_two_obj_and_place: a first target object is put in a receptacle of the goal class
"""

from __future__ import annotations

#: task type -> its subgoal events, in the order an expert reaches them
SUBGOALS: dict[str, tuple[str, ...]] = {
    "pick_and_place": ("found_target", "picked"),
    "look_at_obj_in_light": ("found_target", "picked", "found_lamp"),
    "pick_clean_then_place": ("found_target", "picked", "transformed"),
    "pick_heat_then_place": ("found_target", "picked", "transformed"),
    "pick_cool_then_place": ("found_target", "picked", "transformed"),
    "pick_two_obj_and_place": ("found_target", "picked", "placed_first"),
}
