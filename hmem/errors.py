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


class UnsafeFileError(CorruptStoreError):
    """A store file is a symbolic link or not a regular file: hmem opens no
    file through a link, so nothing outside the store is read or written."""


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
    REFRESH = "take the newest commit with Store.refresh(), or open the store again"
    ROLL_FORWARD = "roll the store forward to what its files hold with hmem.repair(path): every intact entry is kept"


class EntryNotFoundError(HmemError, KeyError):
    """No live entry has this id: it was never given, or it was evicted or deleted."""


class BadFileError(HmemError):
    """An import file that is skipped, with the reason."""


class AmbiguousLayoutError(BadFileError):
    """An import file's tensors read under more than one layout (heads as
    many as tokens) and nothing says which: `layouts` are the ones that fit;
    the caller gives one (docs/cli.md, "Naming conventions and layouts")."""

    def __init__(self, message: str, *, layouts: tuple[str, ...] = (), hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.layouts = layouts


# ---- the file system refused an operation ------------------------------------------------

import errno as _errno  # noqa: E402  (this part was added after the module's first import)
import os as _os  # noqa: E402


class StorageError(HmemError, OSError):
    """The file system refused or failed an operation: `path` names the file
    (also as `filename`), `errno` and `strerror` say why, as for any OSError,
    so ``except OSError`` still catches it.  A store keeps its last commit
    (docs/reliability.md, "OS errors")."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        errno: int | None = None,
        strerror: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.path = path
        self.errno, self.strerror, self.filename = errno, strerror, path

    def __reduce__(self) -> tuple:  # OSError's own would rebuild it from (errno, strerror, filename)
        state = {
            "hint": self.hint,
            "path": self.path,
            "errno": self.errno,
            "strerror": self.strerror,
            "filename": self.filename,
        }
        return type(self), (self.message,), state


class PermissionDeniedError(StorageError):
    """Permission denied (EACCES, EPERM) or a read-only file system (EROFS);
    the message says which, and so does `read_only_fs`."""

    @property
    def read_only_fs(self) -> bool:
        return self.errno == _errno.EROFS


class NoSpaceError(StorageError):
    """No space left on the file system (ENOSPC) or the disk quota is used up (EDQUOT)."""


class PathError(StorageError):
    """A missing path (ENOENT) or one of the wrong kind: a file where a
    directory is needed (ENOTDIR) or the reverse (EISDIR), a name too long
    (ENAMETOOLONG), a loop of symbolic links (ELOOP)."""


class ObjectStoreError(StorageError):
    """A request to object storage failed: the server did not answer within
    the timeout, or answered with an error after the retries.  Nothing
    committed changed; the same call may be tried again."""


_PERMISSION = {_errno.EACCES, _errno.EPERM, _errno.EROFS}
_NO_SPACE = {_errno.ENOSPC, getattr(_errno, "EDQUOT", _errno.ENOSPC)}
_PATH = {_errno.ENOENT, _errno.ENOTDIR, _errno.EISDIR, _errno.ENAMETOOLONG, _errno.ELOOP}
_KEPT = "nothing committed is lost"


def _storage_hint(code: int | None, path: str, writing: bool) -> str:
    folder = _os.path.dirname(path) or "."
    if code == _errno.EROFS:
        return "remount the file system read-write; reading the store still works"
    if code in _PERMISSION:
        return f"check the permissions of {folder} and its files" if writing else f"check that you may read {path}"
    if code == _errno.ENOSPC:
        return f"free space on that file system, then retry; {_KEPT}"
    if code in _NO_SPACE:
        return f"raise the disk quota or free space, then retry; {_KEPT}"
    return {
        _errno.ENOENT: f"check that {folder} exists",
        _errno.ENOTDIR: "a part of the path is a file, not a directory",
        _errno.EISDIR: "give the path of a file, not of a directory",
        _errno.ENAMETOOLONG: "give a shorter path",
        _errno.ELOOP: "the path has a loop of symbolic links",
    }.get(code or 0, "check the disk and the file system, then retry" + (f"; {_KEPT}" if writing else ""))


def storage_error(exc: OSError, operation: str, path: str | _os.PathLike[str], *, writing: bool = True) -> StorageError:
    """`exc` as the StorageError of its errno, with the message "cannot
    {operation} {path}: {strerror}" and what to do next.  A StorageError is
    returned as it is.  hmem/_io.py (writes) and the readers of a store's
    files use this, so every OS error has one wording."""
    if isinstance(exc, StorageError):
        return exc
    shown = _os.fspath(path)
    strerror = exc.strerror or str(exc) or type(exc).__name__
    code = exc.errno
    cls = (
        PermissionDeniedError
        if code in _PERMISSION
        else NoSpaceError
        if code in _NO_SPACE
        else PathError
        if code in _PATH
        else StorageError
    )
    return cls(
        f"cannot {operation} {shown}: {strerror}",
        path=shown,
        errno=code,
        strerror=strerror,
        hint=_storage_hint(code, shown, writing),
    )
