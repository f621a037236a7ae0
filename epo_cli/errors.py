"""Errors meant for users: one clear message with the fix, a non-zero exit code, no traceback.

Raise `UserError` for anything the user can fix (bad override, missing data, Java missing, a model path
that does not exist, a corrupt checkpoint). Bugs stay ordinary exceptions and keep their traceback.
"""

from __future__ import annotations

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
