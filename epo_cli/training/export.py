"""The final policy of a finished run as a Hugging Face folder (<run>/final): what `epo eval`, a later
warm start (`model.path=<run>/final`) and any transformers code load."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from epo_cli.models.loading import frozen_copy


def export_policy(module: nn.Module, tokenizer: Any, folder: Path) -> None:
    """Write `module` (LoRA adapters merged into a plain model) and `tokenizer` to `folder`, replacing it."""
    if hasattr(module, "merge_and_unload"):  # LoRA: export a plain model
        module = frozen_copy(module).merge_and_unload()
    shutil.rmtree(folder, ignore_errors=True)
    module.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
