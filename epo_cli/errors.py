"""Errors meant for users: one clear message with the fix, a non-zero exit code, no traceback; and the
console those messages and warnings go to.

Raise `UserError` for anything the user can fix (bad override, missing data, Java missing, a model path
that does not exist, a corrupt checkpoint). Bugs stay ordinary exceptions and keep their traceback.
`err_console` is where the `epo` command (epo_cli.cli) and the ranks it starts (epo_cli.launch.rank) print
them (the library settings that keep it readable: epo_cli/launch/libraries.py).
"""

from __future__ import annotations

import errno

from rich.console import Console

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
# The console: where user errors and warnings are shown
# ----------------------------------------------------------------------------------------------------

err_console = Console(stderr=True, highlight=False)
