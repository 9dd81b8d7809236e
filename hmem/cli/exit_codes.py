"""The command line's exit codes and the error -> exit code table.

These numbers are part of hmem's interface (scripts and cron jobs test
them) and are documented in docs/cli.md: never renumber one.
"""

from __future__ import annotations

import enum

from hmem import errors


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


# Most specific class first: the first match wins.
ERROR_EXIT_CODES: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (errors.NotAStoreError, ExitCode.NOT_A_STORE),
    (errors.StoreLockedError, ExitCode.LOCKED),
    (errors.UnsupportedFormatError, ExitCode.UNSUPPORTED_FORMAT),
    (errors.InvalidArgumentError, ExitCode.USAGE),
    (errors.KernelUnavailableError, ExitCode.FAILURE),
    (errors.HmemError, ExitCode.FAILURE),
)


def exit_code_for(exc: BaseException) -> ExitCode:
    for cls, code in ERROR_EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return ExitCode.FAILURE
