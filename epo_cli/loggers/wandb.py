"""`logger=wandb`: log to Weights & Biases (WANDB_MODE=offline works without network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epo_cli.errors import UserError


def start_wandb(wc: Any, run: Path, config: Any, run_ids: dict[str, str]) -> Any:
    """Start (or, with run_ids["wandb"] from a checkpoint, resume) the W&B run of `run`; records its id."""
    try:
        import wandb  # optional (epo[loggers]) and slow to import
    except ImportError:
        raise UserError("logger=wandb needs wandb: pip install 'epo[loggers]'.") from None
    wandb_run = wandb.init(project=wc.project, entity=wc.entity, mode=wc.mode, dir=str(run), name=run.name,
                           id=run_ids.get("wandb"), resume="allow", config=config)
    run_ids["wandb"] = wandb_run.id
    return wandb_run
