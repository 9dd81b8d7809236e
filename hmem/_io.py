"""The only module that writes, fsyncs, renames, truncates or unlinks files.

Every change to a store goes through these primitives, so that

- the durability protocol lives in one place: new content is written to a
  temporary file, fsynced, renamed over its final name, and the directory
  is fsynced; in-place writes are fsynced before anything depends on them;
- tests can inject faults (``set_fault_hook``: fail the N-th write, fsync or
  rename with ENOSPC or EIO) and crashes (``HMEM_CRASH_AT=name[:n]`` makes
  the n-th pass through ``crash_point(name)`` end the process at once, as a
  power cut would, without flushing or cleaning up anything).

Temporary files start with TEMP_PREFIX; only the store's writer creates
them, so any that exist when a writer opens the store are garbage.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

TEMP_PREFIX = ".hmem-tmp."
CRASH_ENV = "HMEM_CRASH_AT"
CRASH_EXIT_CODE = 86

Buffer = bytes | bytearray | memoryview


class FileRange(NamedTuple):
    """`length` bytes of the file at `path` from `offset`: a part of a new
    file copied from an existing one.  With `check`, the copied bytes are
    passed to it (it raises to stop the write)."""

    path: Path
    offset: int
    length: int
    check: Callable[[memoryview], None] | None = None

_fault_hook: Callable[[str, str], None] | None = None
_crash_hits: dict[str, int] = {}
_temp_counter = itertools.count()


def set_fault_hook(hook: Callable[[str, str], None] | None) -> None:
    """Install `hook(op, path)`, called before every primitive operation
    ("open", "write", "fsync", "rename", "unlink", "truncate", "mkdir");
    it may raise OSError to simulate a failing disk.  None removes it."""
    global _fault_hook
    _fault_hook = hook


def _fault(op: str, path: str | os.PathLike) -> None:
    if _fault_hook is not None:
        _fault_hook(op, os.fspath(path))


def crash_point(name: str) -> None:
    """End the process abruptly here when HMEM_CRASH_AT names this point."""
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    target, _, nth = wanted.partition(":")
    if target != name:
        return
    _crash_hits[name] = _crash_hits.get(name, 0) + 1
    if _crash_hits[name] >= int(nth or 1):
        os._exit(CRASH_EXIT_CODE)


# ---- building blocks ---------------------------------------------------------


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    _fault("open", path)
    return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)


def _write_all(fd: int, path: Path, buffers: Sequence[Buffer], offset: int | None = None) -> int:
    """Write every buffer, in order, at `offset` (or the current position)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    total = 0
    iov_max = 512
    while views:
        _fault("write", path)
        batch = views[:iov_max]
        if offset is None:
            n = os.writev(fd, batch)
        else:
            n = os.pwritev(fd, batch, offset + total)
        total += n
        # drop what was written, keep the rest of a partly written buffer
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return total


def _fsync(fd: int, path: Path) -> None:
    _fault("fsync", path)
    os.fsync(fd)


def fsync_dir(directory: Path) -> None:
    fd = _open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _fsync(fd, directory)
    finally:
        os.close(fd)


# ---- durable operations -------------------------------------------------------


def temp_path(final: Path) -> Path:
    return final.with_name(f"{TEMP_PREFIX}{final.name}.{os.getpid()}.{next(_temp_counter)}")


def write_file(path: Path, parts: Sequence[Buffer | FileRange]) -> int:
    """Create or replace `path` atomically and durably with the parts' bytes
    (buffers, and ranges of other files): a reader sees the old file or the
    whole new one.  Returns the size."""
    tmp = temp_path(path)
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        size = 0
        run: list[Buffer] = []
        for part in parts:
            if isinstance(part, FileRange):
                size += _write_all(fd, tmp, run) + _copy_range(fd, tmp, part)
                run = []
            else:
                run.append(part)
        size += _write_all(fd, tmp, run)
        _fsync(fd, tmp)
    except BaseException:
        os.close(fd)
        _discard(tmp)
        raise
    os.close(fd)
    try:
        _fault("rename", tmp)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(path.parent)
    return size


_COPY_BLOCK = 8 << 20


def _copy_range(fd: int, path: Path, part: FileRange) -> int:
    """Append `part` to the open file.  Ranges to check go through memory
    (read, check, write: the bytes are read once either way); others are
    copied inside the kernel where it offers copy_file_range."""
    src = os.open(part.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if part.check is not None:
            data = os.pread(src, part.length, part.offset) if part.length else b""
            if len(data) != part.length:
                raise OSError(f"{part.path} ended {part.length - len(data)} bytes early")
            part.check(memoryview(data))
            return _write_all(fd, path, [data])
        offset, left = part.offset, part.length
        while left:
            _fault("write", path)
            try:
                n = os.copy_file_range(src, fd, left, offset)
            except (AttributeError, OSError):  # not on this kernel or file system
                block = os.pread(src, min(left, _COPY_BLOCK), offset)
                n = _write_all(fd, path, [block]) if block else 0
            if n == 0:
                raise OSError(f"{part.path} ended {left} bytes early")
            offset += n
            left -= n
    finally:
        os.close(src)
    return part.length


def _discard(path: Path) -> None:
    # Best effort after a failure: the next writer removes leftovers anyway.
    try:
        os.unlink(path)
    except OSError:
        pass


def write_at(path: Path, offset: int, buffers: Sequence[Buffer], *, create: bool = False) -> None:
    """Write the buffers at `offset` of an existing file (or a new one when
    `create`) and fsync it."""
    flags = os.O_WRONLY | (os.O_CREAT if create else 0)
    existed = path.exists()
    fd = _open(path, flags)
    try:
        _write_all(fd, path, buffers, offset)
        _fsync(fd, path)
    finally:
        os.close(fd)
    if create and not existed:
        fsync_dir(path.parent)


def write_pieces(path: Path, pieces: Sequence[tuple[int, Buffer]]) -> None:
    """Write each (offset, bytes) piece in place, then fsync once."""
    if not pieces:
        return
    fd = _open(path, os.O_WRONLY)
    try:
        for offset, data in pieces:
            _write_all(fd, path, [data], offset)
        _fsync(fd, path)
    finally:
        os.close(fd)


def truncate(path: Path, size: int) -> None:
    fd = _open(path, os.O_WRONLY)
    try:
        _fault("truncate", path)
        os.ftruncate(fd, size)
        _fsync(fd, path)
    finally:
        os.close(fd)


def rename(src: Path, dst: Path) -> None:
    _fault("rename", src)
    os.replace(src, dst)
    fsync_dir(dst.parent)


def unlink(path: Path, *, missing_ok: bool = True) -> None:
    _fault("unlink", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return
    fsync_dir(path.parent)


def rename_many(pairs: Sequence[tuple[Path, Path]]) -> None:
    """Rename each pair (all in one directory), then fsync the directory once."""
    for src, dst in pairs:
        _fault("rename", src)
        os.replace(src, dst)
    if pairs:
        fsync_dir(pairs[0][1].parent)


def unlink_many(paths: Sequence[Path]) -> None:
    """Remove the files that exist (all in one directory), then fsync the
    directory once."""
    removed = False
    for path in paths:
        _fault("unlink", path)
        try:
            os.unlink(path)
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        fsync_dir(paths[0].parent)


def make_dir(path: Path) -> None:
    """Create `path` (and missing parents) and make the new entry durable."""
    _fault("mkdir", path)
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    if not existed:
        fsync_dir(path.parent)


# ---- the lock file ------------------------------------------------------------------


def open_lock_file(path: Path) -> int:
    """Open (creating if needed) the store's lock file; returns the fd."""
    return _open(path, os.O_RDWR | os.O_CREAT)


def rewrite_fd(fd: int, path: Path, data: bytes) -> None:
    """Replace the whole content of an open file (the lock's owner record)."""
    _fault("truncate", path)
    os.ftruncate(fd, 0)
    _write_all(fd, path, [data], 0)
