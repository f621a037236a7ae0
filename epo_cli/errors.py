"""Errors meant for users: one clear message with the fix, a non-zero exit code, no traceback; and the
console those messages and warnings go to, kept readable.

Raise `UserError` for anything the user can fix (bad override, missing data, Java missing, a model path
that does not exist, a corrupt checkpoint). Bugs stay ordinary exceptions and keep their traceback.
`err_console` is where the `epo` command (epo_cli.cli) and the ranks it starts (epo_cli.launch.rank) print
them; `quiet_libraries()`, called first in every such process, keeps other libraries' chatter off it.
"""

from __future__ import annotations

import errno
import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

from rich.console import Console

from epo_cli.training.device import device_type

#: Exit code for configuration errors (like argparse/typer usage errors).
EXIT_CONFIG = 2
#: Exit code for other user-fixable problems (missing data, missing Java, bad checkpoint, ...).
EXIT_USER = 1


class UserError(Exception):
    """A problem the user can fix; `str(err)` is the whole message, including the fix."""

    def __init__(self, message: str, exit_code: int = EXIT_USER) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ConfigError(UserError):
    """A config problem (unknown key or option, wrong type, inconsistent settings): exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=EXIT_CONFIG)


class Stopped(Exception):
    """The run stopped cleanly because it was asked to (a signal): `str(err)` says where and how to
    continue; the exit code is 128 + the signal number (143 SIGTERM, 130 SIGINT)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


#: errno values of a file system refusing a path: the user's environment, never a bug of epo's
FILE_SYSTEM_ERRNOS = {
    errno.EACCES: "permission denied: make it writable (or readable), or choose another folder",
    errno.EPERM: "operation not permitted: make it writable, or choose another folder",
    errno.EROFS: "the file system is read-only: choose a folder on a writable one",
    errno.ENOSPC: "the disk is full: free some space",
    errno.EDQUOT: "the disk quota is exceeded: free some space",
    errno.ENOTDIR: "part of that path is a file where a folder must be: choose another path",
    errno.EISDIR: "it is a folder where a file must be: choose another path",
    errno.EEXIST: "something already exists there: choose another path",
    errno.ENOENT: "it does not exist",
    errno.ENAMETOOLONG: "the path is too long: choose a shorter one",
}


def file_system_message(err: OSError) -> str | None:
    """One line for an OSError a file system raised about a named path (None for any other OSError: sockets,
    timeouts and the like keep their traceback)."""
    if err.filename is None or err.errno not in FILE_SYSTEM_ERRNOS:
        return None
    where = f"'{err.filename}'" + (f" -> '{err.filename2}'" if err.filename2 else "")
    return f"Cannot use {where}: {FILE_SYSTEM_ERRNOS[err.errno]} ({err.strerror or 'errno ' + str(err.errno)})."


# ----------------------------------------------------------------------------------------------------
# The console: where user errors and warnings are shown, and what keeps it readable
# ----------------------------------------------------------------------------------------------------

err_console = Console(stderr=True, highlight=False)


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
