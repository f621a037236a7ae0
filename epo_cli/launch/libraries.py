"""The library settings every epo process applies first (the `epo` command, epo_cli.cli, and each rank it
starts, epo_cli.launch.rank), so that the console (epo_cli.errors.err_console) shows epo's own progress and
messages: no download bars, no accelerator-probing chatter, no mlflow import that nothing asked for.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

from epo_cli.runtime.device import device_type


def quiet_libraries() -> None:
    """Keep the console for our own progress: no download bars, no accelerator-probing chatter. Cheap: it
    imports nothing heavy (`epo --help` and `epo config show` never import torch)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not any(isinstance(finder, _DeepSpeedImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedImport())


def name_the_accelerator() -> None:
    """DS_ACCELERATOR=cuda or cpu, unless set: DeepSpeed then skips probing for accelerators (and its
    "Setting accelerator to CPU" warning)."""
    if "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = device_type("auto")  # imports torch: deepspeed, the only reader, does anyway


class _DeepSpeedImport(importlib.abc.MetaPathFinder):
    """Two settings applied when `deepspeed` is first imported, wherever that happens (installed by
    quiet_libraries at every process start):

    - DS_ACCELERATOR is named (name_the_accelerator) just before deepspeed reads it;
    - `deepspeed.autotuning.autotuner` runs with `import mlflow` failing, as if mlflow were not installed:
      `import deepspeed` imports its autotuner, which imports mlflow when it can (~1.7 s here, in every
      `epo` process and every rank) only to report `deepspeed --autotuning` experiments to it. epo never
      runs the autotuner, and its own mlflow logger imports mlflow when `logger=mlflow` asks for it.

    It finds no module itself (it returns None or the ordinary PathFinder's spec), so imports are unchanged
    otherwise.
    """

    AUTOTUNER = "deepspeed.autotuning.autotuner"

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "deepspeed":
            name_the_accelerator()
            return None
        if name != self.AUTOTUNER:
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
