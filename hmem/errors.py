"""Every error hmem raises.

One class per condition.  Each carries a message that says what happened and,
where there is one, a ``hint`` that says what to do next; the command line
prints both on one line and maps the class to a documented exit code.
"""

from __future__ import annotations


class HmemError(Exception):
    """Base of every error hmem raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class InvalidArgumentError(HmemError, ValueError):
    """An argument is out of range, of the wrong type or inconsistent."""


class KernelUnavailableError(HmemError, ImportError):
    """hmem's compiled kernels are missing or an unknown kernel set was asked for."""


class NotAStoreError(HmemError):
    """The path holds no hmem store (no readable index.json)."""


class StoreExistsError(HmemError):
    """A store (or other files) already exists where a new store was asked for."""


class UnsupportedFormatError(HmemError):
    """The store was written in a format version or with settings this hmem cannot honour."""


class CorruptStoreError(HmemError):
    """A store file fails its checks; `verify` reports every problem, `verify --repair` salvages."""


class StoreLockedError(HmemError):
    """Another process holds the store's write lock."""


class StoreChangedError(HmemError):
    """A writer changed the store while a reader was loading it; open it again."""


class StoreClosedError(HmemError):
    """The store was closed; open it again to use it."""


class ReadOnlyStoreError(HmemError):
    """A write was asked of a store opened read-only."""


class InvalidTensorError(InvalidArgumentError):
    """A K/V or query tensor has the wrong type, dtype, shape or non-finite values."""


class EntryTooLargeError(InvalidArgumentError):
    """An entry can never fit the store's limits."""


class Hint:
    """What to do next, in the library's own terms.  Errors carry these
    exact strings as their hint; the command line words each as the command
    to run (hmem/cli/exit_codes.py), so a library user is never told about a
    flag and a shell user never about a function."""

    VERIFY = "check the store with hmem.verify(path)"
    VERIFY_FULL = "check every tensor with hmem.verify(path, full=True)"
    REPAIR = "salvage what passes its checksums with hmem.repair(path)"
    VERIFY_THEN_REPAIR = "see the damage with hmem.verify(path, full=True), then hmem.repair(path)"
    LOCK_WAIT = "wait for the writer to finish, or open with lock_wait=SECONDS to wait for it"
    CREATE = "create one with Store.create(path, embed_dim=...)"
    OPEN_AGAIN = "open the store again"


class EntryNotFoundError(HmemError, KeyError):
    """No live entry has this id: it was never given, or it was evicted or deleted."""


class BadFileError(HmemError):
    """An import file that is skipped, with the reason."""
