"""The command line's exit codes, the error -> exit code table, and the
wording of library hints as commands to run.

The exit codes are part of hmem's interface (scripts and cron jobs test
them) and are documented in docs/cli.md: never renumber one.
"""

from __future__ import annotations

import enum

from hmem import (
    Hint,
    HmemError,
    InvalidArgumentError,
    KernelUnavailableError,
    NoSpaceError,
    NotAStoreError,
    PathError,
    PermissionDeniedError,
    StoreLockedError,
    UnsupportedFormatError,
)


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1  # the operation failed; nothing more specific applies
    USAGE = 2  # bad options, arguments or input values
    PARTIAL = 3  # done, but some inputs were skipped (see the report)
    PROBLEMS_FOUND = 4  # verify found problems in the store
    NOT_A_STORE = 5  # the path holds no hmem store
    LOCKED = 6  # another process holds the store's write lock
    UNSUPPORTED_FORMAT = 7  # the store's format version is unknown to this hmem
    INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT)
    NO_PERMISSION = 8  # permission denied, or a read-only file system
    NO_SPACE = 9  # no space left on the file system (or the disk quota is used up)
    BAD_PATH = 10  # a path is missing or of the wrong kind (a file for a directory, or the reverse)
    BROKEN_PIPE = 141  # stdout was closed by its reader (128 + SIGPIPE, as for a standard tool)
    TERMINATED = 143  # stopped by SIGTERM (128 + 15), at a consistent point (hmem/cli/signals.py)


# Most specific class first: the first match wins.
ERROR_EXIT_CODES: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (NotAStoreError, ExitCode.NOT_A_STORE),
    (StoreLockedError, ExitCode.LOCKED),
    (UnsupportedFormatError, ExitCode.UNSUPPORTED_FORMAT),
    (InvalidArgumentError, ExitCode.USAGE),
    (PermissionDeniedError, ExitCode.NO_PERMISSION),
    (NoSpaceError, ExitCode.NO_SPACE),
    (PathError, ExitCode.BAD_PATH),
    (KernelUnavailableError, ExitCode.FAILURE),
    (HmemError, ExitCode.FAILURE),
)


def exit_code_for(exc: BaseException) -> ExitCode:
    for cls, code in ERROR_EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return ExitCode.FAILURE


# hmem's errors say what to do in library terms (functions and arguments);
# a shell user is told the command or flag that does the same (docs/cli.md).
HINT_WORDING: dict[str, str] = {
    Hint.VERIFY: "run 'hmem verify'",
    Hint.VERIFY_FULL: "run 'hmem verify --full'",
    Hint.REPAIR: "run 'hmem verify --repair'",
    Hint.VERIFY_THEN_REPAIR: "run 'hmem verify --full', then 'hmem verify --repair'",
    Hint.LOCK_WAIT: "wait for it to finish, or retry with a lock wait such as --lock-wait 30",
    Hint.CREATE: "create one with 'hmem init'",
    Hint.OPEN_AGAIN: "try the command again",
    Hint.ROLL_FORWARD: "run 'hmem verify --repair': it rolls the store forward and keeps every intact entry",
}


def cli_hint(hint: str | None) -> str | None:
    """An error's hint as the command line words it; other hints unchanged."""
    if hint is None:
        return None
    return HINT_WORDING.get(hint, hint)
