"""Opening a store's files to read them.

A store may come from an untrusted source (docs/security.md): its files are
read only when they are regular files, never through a symbolic link, and a
file is read whole only up to a bound.  (Writing is hmem/_io.py's alone.)
A file's apparent size is no bound on its own: a sparse file claims any
size for free, so what sizes work is the data really there (data_bytes).
"""

from __future__ import annotations

import errno
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


_SEEK_DATA = getattr(os, "SEEK_DATA", None)
_SEEK_HOLE = getattr(os, "SEEK_HOLE", None)


def data_bytes(fd: int, end: int | None = None, *, start: int = 0) -> int:
    """Bytes of data really present in bytes [`start`, `end`) (default: the
    whole file) of the open file `fd`: their length less the holes.

    hmem writes its files without holes, so a sparse file is a crafted or
    damaged one (or a copy made with ``cp --sparse=always``, whose holes
    stand for runs of zeros): a count or size taken from the apparent size
    alone would cost time and memory for bytes that are not there
    (docs/security.md, "Bounded memory and time").  The holes are found
    with SEEK_DATA / SEEK_HOLE, one pair of calls per run of data, so the
    cost grows with the data present, never with the apparent size; where
    the system has no such seek, the allocated blocks (st_blocks) bound it."""
    st = os.fstat(fd)
    end = st.st_size if end is None else min(end, st.st_size)
    if end <= start:
        return 0
    if _SEEK_DATA is None or _SEEK_HOLE is None:
        return min(end - start, st.st_blocks * 512)
    present, at = 0, start
    position = os.lseek(fd, 0, os.SEEK_CUR)  # the seeks move it: put back for the caller's reads
    try:
        while at < end:
            try:
                begin = os.lseek(fd, at, _SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data past `at`: a hole up to the end
                    break
                raise
            if begin >= end:
                break
            at = min(os.lseek(fd, begin, _SEEK_HOLE), end)
            present += at - begin
    except OSError:  # a file system without the seeks: its allocated blocks bound the data
        return min(end - start, st.st_blocks * 512)
    finally:
        os.lseek(fd, position, os.SEEK_SET)
    return present


# What holes a shard may have: a copy made with ``cp --sparse=always`` turns
# runs of zero bytes (an all-zero tensor) into holes, and such a shard reads
# correctly (a hole reads as zeros).  hmem itself never makes holes, and the
# work on a shard (verify's scan, a copy, CRCs) goes over its whole size, so
# its holes may amount to at most its data present plus this slack: that work
# stays within twice the data really there, and a shard that is mostly holes
# (a crafted size claimed for free) is damaged (docs/security.md).
HOLE_SLACK_BYTES = 1 << 20


def too_sparse(fd: int) -> str | None:
    """Why the open shard `fd` has more holes than HOLE_SLACK_BYTES allows
    (its holes past its data present plus the slack), or None."""
    size = os.fstat(fd).st_size
    if size <= HOLE_SLACK_BYTES:
        return None  # even all holes would cost little
    present = data_bytes(fd)
    if size - present <= present + HOLE_SLACK_BYTES:
        return None
    return f"is {size} bytes but only {present} of them are data (the rest are holes, which hmem never writes)"


def leading_data(fd: int) -> int:
    """Where the first hole of the open file `fd` starts (its size when it
    has none): the bytes a damaged sparse file can be read as, from its
    start, without reading a hole."""
    size = os.fstat(fd).st_size
    if _SEEK_HOLE is None:
        return size
    position = os.lseek(fd, 0, os.SEEK_CUR)
    try:
        return min(os.lseek(fd, 0, _SEEK_HOLE), size)
    except OSError:
        return size
    finally:
        os.lseek(fd, position, os.SEEK_SET)
