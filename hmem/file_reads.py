"""Opening a store's files to read them.

A store may come from an untrusted source (docs/security.md): its files are
read only when they are regular files, never through a symbolic link, and a
file is read whole only up to a bound.  (Writing is hmem/_io.py's alone.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hmem.errors import Hint, UnsafeFileError

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NON_BLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO named like a store file must not hang the open
_CLOSE_ON_EXEC = getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path) -> int:
    """A file descriptor to read the store file at `path`.  A symbolic link
    or anything but a regular file is refused (UnsafeFileError): hmem
    reads nothing outside the store, whatever its files say."""
    try:
        fd = os.open(path, os.O_RDONLY | _NO_FOLLOW | _NON_BLOCK | _CLOSE_ON_EXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafeFileError(
                f"{path.name} in {path.parent} is a symbolic link; hmem opens no file through a link", hint=Hint.VERIFY
            ) from None
        raise exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path.name} in {path.parent} is not a regular file", hint=Hint.VERIFY)
    return fd


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a store file of at most `limit` bytes (open_regular)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeFileError(
                f"{path.name} in {path.parent} is {size} bytes, more than the {limit} a store "
                "file of its kind can hold",
                hint=Hint.VERIFY,
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            # The file's size, not the bound: read(n) reserves n bytes before
            # it reads (the bound of index.json is 1 GiB).
            return f.read(size)
    finally:
        os.close(fd)
