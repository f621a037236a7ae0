"""Non-finite weights stop a run with one message, before anything samples from them or saves them.

A learning rate far too large (or an update that overflowed) can turn the policy's weights into nan/inf
while the loss and gradient of that update were still finite, so DeepSpeed's overflow check never fires;
the next rollout then fails deep inside sampling. `check_finite_weights` runs after every update, before
the step's checkpoint: the run stops naming the step and the likely cause, and the last complete
checkpoint (of an earlier, finite step) is what a resume continues from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from epo_cli.errors import UserError
from epo_cli.models.loading import nonfinite_parameters


@dataclass(frozen=True)
class LikelyCauses:
    """This run's values of the settings that most often make weights non-finite (cut by training/settings.py)."""

    lr: float  # algo.lr
    grad_clip: float  # algo.grad_clip (0: none)
    reward_scale: float | None  # algo.reward_scale; None for behaviour cloning (algo=sft), which has no reward

    def text(self) -> str:
        causes = [f"a learning rate too large for this model (algo.lr={self.lr:g}; the algo presets suit "
                  "model=tiny, 0.5B-7B models want 1e-6..1e-5)"]
        if self.grad_clip == 0:
            causes.append("no gradient clipping (algo.grad_clip=0)")
        if self.reward_scale is not None:
            causes.append(f"a large reward scale (algo.reward_scale={self.reward_scale:g})")
        return "; ".join(causes)


def nonfinite_message(step: int, names: list[str], causes: LikelyCauses, latest: str | None, run: Path) -> str:
    where = f" (e.g. {', '.join(names)})" if names else " (on another rank)"
    last = (f"The last complete checkpoint, {run / 'checkpoints' / latest}, holds finite weights from before; "
            f"after fixing the cause continue with `epo train trainer.resume={run}` and the new setting."
            if latest else "No checkpoint had been saved yet; start a new run after fixing the cause.")
    return (f"Training stopped at step {step}: its update made the policy weights non-finite (nan or inf)"
            f"{where}, so nothing of this step was saved. Likely cause: {causes.text()}. {last}")


def check_finite_weights(module: nn.Module, step: int, causes: LikelyCauses, run: Path, latest: str | None,
                         reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """UserError when any rank's weights hold nan/inf after the update of `step` (1-based: the step that
    just ran). `reduce_max` (the all-reduce of a distributed run) makes every rank stop together."""
    names = nonfinite_parameters(module)
    flag = torch.tensor(1 if names else 0, dtype=torch.long)
    if reduce_max is not None:
        device = next(module.parameters()).device
        flag = reduce_max(flag.to(device)).cpu()
    if int(flag):
        raise UserError(nonfinite_message(step, names, causes, latest, run))
