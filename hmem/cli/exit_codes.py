"""The command line's exit codes, the error -> exit code table, and the
wording of library hints as commands to run.

The exit codes are part of hmem's interface (scripts and cron jobs test
them): never renumber one.  docs/cli-reference.md lists them, each with the
comment on its line below as its meaning (scripts/cli_reference.py reads
it), and docs/cli.md says more.
"""

from __future__ import annotations

import enum

from hmem import (
    AmbiguousLayoutError,
    BadFileError,
    CorruptStoreError,
    EntryNotFoundError,
    EntryTooLargeError,
    Hint,
    HmemError,
    InvalidArgumentError,
    InvalidTensorError,
    KernelUnavailableError,
    NoSpaceError,
    NotAStoreError,
    ObjectStoreError,
    PathError,
    PermissionDeniedError,
    ReadOnlyStoreError,
    StorageError,
    StoreChangedError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    UnsafeFileError,
    UnsupportedFormatError,
)


class ExitCode(enum.IntEnum):
    OK = 0  # the command did what was asked
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
    UNAVAILABLE = 11  # the object store did not answer, or failed a request after its retries
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
    (ObjectStoreError, ExitCode.UNAVAILABLE),
    (KernelUnavailableError, ExitCode.FAILURE),
    (HmemError, ExitCode.FAILURE),
)


def exit_code_for(exc: BaseException) -> ExitCode:
    for cls, code in ERROR_EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return ExitCode.FAILURE


# The "code" of the JSON error document (docs/cli.md, "Errors as JSON"):
# one stable name per kind of error, finer than the exit code, which the
# document also carries.  Most specific class first: the first match wins.
ERROR_NAMES: tuple[tuple[type[BaseException], str], ...] = (
    (AmbiguousLayoutError, "ambiguous_layout"),
    (BadFileError, "bad_file"),
    (InvalidTensorError, "invalid_tensor"),
    (EntryTooLargeError, "entry_too_large"),
    (InvalidArgumentError, "invalid_argument"),
    (NotAStoreError, "not_a_store"),
    (StoreExistsError, "store_exists"),
    (UnsupportedFormatError, "unsupported_format"),
    (UnsafeFileError, "unsafe_file"),
    (CorruptStoreError, "corrupt_store"),
    (StoreLockedError, "locked"),
    (StoreChangedError, "store_changed"),
    (StoreClosedError, "store_closed"),
    (ReadOnlyStoreError, "read_only_store"),
    (EntryNotFoundError, "entry_not_found"),
    (KernelUnavailableError, "kernel_unavailable"),
    (PermissionDeniedError, "permission_denied"),
    (NoSpaceError, "no_space"),
    (PathError, "bad_path"),
    (ObjectStoreError, "object_store_unavailable"),
    (StorageError, "storage_error"),
    (OSError, "storage_error"),
    (HmemError, "failure"),
)
# Errors the command line itself names (no library class)
USAGE_ERROR = "usage"  # an option or argument Typer refused: unknown, missing, or a bad value
ABORTED = "aborted"
INTERNAL_ERROR = "internal_error"  # a bug in hmem: the traceback is wanted (--debug)
STOPPED = {ExitCode.INTERRUPTED: "interrupted", ExitCode.TERMINATED: "terminated"}


def error_name(exc: BaseException) -> str:
    """The stable name of `exc`'s kind, for the JSON error document."""
    for cls, name in ERROR_NAMES:
        if isinstance(exc, cls):
            return name
    return INTERNAL_ERROR


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
    Hint.REFRESH: "try the command again",
    Hint.ROLL_FORWARD: "run 'hmem verify --repair': it rolls the store forward and keeps every intact entry",
}


def cli_hint(hint: str | None) -> str | None:
    """An error's hint as the command line words it; other hints unchanged."""
    if hint is None:
        return None
    return HINT_WORDING.get(hint, hint)
