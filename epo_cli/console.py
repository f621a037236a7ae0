"""The console that user-facing errors and warnings go to, and the library settings that keep it readable.

Shared by the `epo` command (epo_cli.cli) and the ranks it starts (epo_cli.launch.rank).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

from rich.console import Console

err_console = Console(stderr=True, highlight=False)


def quiet_libraries() -> None:
    """Keep the console for our own progress: no download bars, no accelerator-probing chatter."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    skip_mlflow_in_deepspeed_autotuner()
    if "DS_ACCELERATOR" not in os.environ:
        import torch  # lazy: only needed when the accelerator is not named already

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"


class _AutotunerWithoutMlflow(importlib.abc.MetaPathFinder):
    """Runs `deepspeed.autotuning.autotuner` with `import mlflow` failing, as if mlflow were not installed.

    `import deepspeed` imports its autotuner, which imports mlflow when it can (~1.7 s here, in every `epo`
    process and every rank) only to report `deepspeed --autotuning` experiments to it; epo never runs the
    autotuner, and its own mlflow logger imports mlflow when `logger=mlflow` asks for it.
    """

    TARGET = "deepspeed.autotuning.autotuner"

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            if "mlflow" in sys.modules:  # imported already: nothing to save
                load(module)
                return
            sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
            try:
                load(module)
            finally:
                if sys.modules.get("mlflow", 0) is None:
                    del sys.modules["mlflow"]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def skip_mlflow_in_deepspeed_autotuner() -> None:
    """Install _AutotunerWithoutMlflow (once per process; before deepspeed is imported, else no effect)."""
    if not any(isinstance(finder, _AutotunerWithoutMlflow) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AutotunerWithoutMlflow())
