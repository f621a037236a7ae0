"""The console that user-facing errors and warnings go to, and the library settings that keep it readable.

Shared by the `epo` command (epo_cli.cli) and the ranks it starts (epo_cli.launch.rank).
"""

from __future__ import annotations

import os

from rich.console import Console

err_console = Console(stderr=True, highlight=False)


def quiet_libraries() -> None:
    """Keep the console for our own progress: no download bars, no accelerator-probing chatter."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "DS_ACCELERATOR" not in os.environ:
        import torch  # lazy: only needed when the accelerator is not named already

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
