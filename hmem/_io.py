"""The only module that writes, fsyncs, renames, truncates or unlinks files.

Every change to a store goes through these primitives, so that

- the durability protocol lives in one place: new content is written to a
  temporary file, fsynced, renamed over its final name, and the directory
  is fsynced; in-place writes are fsynced before anything depends on them;
- an OSError becomes the StorageError of its errno, naming the operation
  and the file (a temporary file's as the write of its final file);
- tests can inject faults (``set_fault_hook``: fail the N-th write, fsync or
  rename with ENOSPC or EIO) and crashes (``HMEM_CRASH_AT=name[:n]`` makes
  the n-th pass through ``crash_point(name)`` end the process at once, as a
  power cut would, without flushing or cleaning up anything), and stop a
  process at named points (``HMEM_PAUSE_AT=name[:n][,name[:n]...]``: each
  n-th pass stops it with SIGSTOP, so that a test's signal lands exactly
  there, whatever else the machine is doing; SIGCONT resumes it).

Temporary files start with TEMP_PREFIX; only the store's writer creates
them, so any that exist when a writer opens the store are garbage.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
import signal
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from hmem.errors import Hint, StorageError, UnsafeFileError, storage_error
from hmem.file_reads import open_regular, read_regular  # noqa: F401  (read through _io by the formats)

TEMP_PREFIX = ".hmem-tmp."
CRASH_ENV = "HMEM_CRASH_AT"
PAUSE_ENV = "HMEM_PAUSE_AT"
CRASH_EXIT_CODE = 86

Buffer = bytes | bytearray | memoryview


class FileRange(NamedTuple):
    """`length` bytes of the file at `path` from `offset`, copied into a new
    file; `check`, if given, sees them first (it raises to stop the write)."""

    path: Path
    offset: int
    length: int
    check: Callable[[memoryview], None] | None = None


_fault_hook: Callable[[str, str], None] | None = None
_point_passes: dict[tuple[str, str], int] = {}  # (variable, point) -> passes counted
_temp_counter = itertools.count()


def set_fault_hook(hook: Callable[[str, str], None] | None) -> None:
    """Install `hook(op, path)`, called before every primitive operation
    ("open", "write", "fsync", "rename", "unlink", "truncate", "mkdir"); it
    may raise OSError, as a failing disk would.  None removes it."""
    global _fault_hook
    _fault_hook = hook


_VERBS = {"fsync": "sync", "unlink": "remove", "mkdir": "create the directory"}  # others: the op's name


@contextlib.contextmanager
def _errors(op: str, path: Path) -> Iterator[None]:
    """The fault hook (not for reads), then the body; an OSError becomes the StorageError of its errno."""
    try:
        if _fault_hook is not None and op != "read":
            _fault_hook(op, os.fspath(path))
        yield
    except StorageError:
        raise
    except OSError as exc:
        name, verb = path.name, _VERBS.get(op, op)
        if name.startswith(TEMP_PREFIX) and (m := re.fullmatch(r"(.+)\.\d+\.\d+", name[len(TEMP_PREFIX) :])):
            name, verb = m.group(1), "write"  # temp_path's name: the error is the write of its final file
        raise storage_error(exc, verb, path.with_name(name), writing=op != "read") from exc


def crash_point(name: str) -> None:
    """End the process abruptly here when HMEM_CRASH_AT names this point;
    stop it here (until a SIGCONT) when HMEM_PAUSE_AT does."""
    if _asked_at(CRASH_ENV, name):
        os._exit(CRASH_EXIT_CODE)
    if _asked_at(PAUSE_ENV, name):
        # to this thread: a stop sent to the process may be taken by another
        # thread while this one runs on past the point
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _asked_at(variable: str, name: str) -> bool:
    """Whether this pass through point `name` is one that the environment
    variable's comma-separated ``name[:n]`` items ask for (n: 1 if left out)."""
    items = (item.partition(":") for item in os.environ.get(variable, "").split(","))
    wanted = [int(nth or 1) for target, _, nth in items if target == name]
    if not wanted:
        return False
    key = (variable, name)
    passes = _point_passes[key] = _point_passes.get(key, 0) + 1
    return passes in wanted


# ---- building blocks ---------------------------------------------------------


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    # Never through a symbolic link, never a file another name shares (a hard
    # link), never a named pipe (opened non-blocking, then refused): a store's
    # files cannot make hmem write outside it (docs/security.md).  (The store
    # directory itself may be a link: the user named it.)
    if flags & os.O_DIRECTORY:
        with _errors("open", path):
            return os.open(path, flags | os.O_CLOEXEC, mode)
    with _errors("open", path):
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
        except OSError:
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
                raise UnsafeFileError(
                    f"{path.name} in {path.parent} is a symbolic link or not a regular file; "
                    "hmem writes no file through a link",
                    hint=Hint.VERIFY,
                ) from None
            raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path.name} in {path.parent} is not a regular file", hint=Hint.VERIFY)
        raise UnsafeFileError(
            f"{path.name} in {path.parent} has {st.st_nlink} names (hard links); hmem writes "
            "no file in place that another name shares",
            hint="copy the store directory and use the copy, whose files are its own",
        )
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _write_all(fd: int, path: Path, buffers: Sequence[Buffer], offset: int | None = None) -> int:
    """Write every buffer, in order, at `offset` (or the current position)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    total = 0
    while views:
        batch = views[:512]  # IOV_MAX buffers a call at most
        with _errors("write", path):
            n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + total)
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


# A file's bytes reach the page cache far faster from several threads than
# from one on some machines (virtual ones: measured 0.13-0.35 GB/s from one
# thread, 2.4 GB/s from eight, docs/benchmarks.md), so a large run of
# buffers is written as pieces at their offsets, a thread each.
_PARALLEL_MIN_BYTES = 16 << 20
_PARALLEL_PIECE_BYTES = 8 << 20
_PARALLEL_THREADS = 8


def _write_run(fd: int, path: Path, buffers: Sequence[Buffer], at: int) -> int:
    """Write the buffers, in order, at the current position `at` of a file
    being made, and leave the position after them; a run of at least
    _PARALLEL_MIN_BYTES in pieces written at once."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    total = sum(len(v) for v in views)
    if total < _PARALLEL_MIN_BYTES:
        return _write_all(fd, path, views)
    count = min(_PARALLEL_THREADS, total // _PARALLEL_PIECE_BYTES)
    pieces: list[tuple[int, list[memoryview]]] = []
    start, piece, room = 0, [], -(-total // count)
    for view in views:
        while len(view):
            take = view[:room]
            piece.append(take)
            view, room = view[len(take) :], room - len(take)
            if not room:
                pieces.append((start, piece))
                start += sum(len(v) for v in piece)
                piece, room = [], -(-total // count)
    if piece:
        pieces.append((start, piece))
    errors: list[BaseException] = []

    def write(offset: int, part: list[memoryview]) -> None:
        try:
            _write_all(fd, path, part, at + offset)
        except BaseException as exc:  # raised by the caller, once every piece is done
            errors.append(exc)

    threads = [threading.Thread(target=write, args=piece_at, name="hmem-write") for piece_at in pieces]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    with _errors("write", path):
        os.lseek(fd, at + total, os.SEEK_SET)
    return total


def _fsync(fd: int, path: Path) -> None:
    with _errors("fsync", path):
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
    whole new one.  Written under a temporary name, fsynced, renamed over
    `path`, then the directory fsynced; on failure the temporary file is
    removed.  Returns the size."""
    tmp = temp_path(path)
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    open_fd = True
    try:
        size = 0
        run: list[Buffer] = []
        for part in parts:
            if isinstance(part, FileRange):
                size += _write_run(fd, tmp, run, size) + _copy_range(fd, tmp, part)
                run = []
            else:
                run.append(part)
        size += _write_run(fd, tmp, run, size)
        _fsync(fd, tmp)
        open_fd = False
        os.close(fd)
        with _errors("rename", tmp):
            os.replace(tmp, path)
    except BaseException:
        if open_fd:
            os.close(fd)
        _discard(tmp)
        raise
    fsync_dir(path.parent)
    return size


_COPY_BLOCK = 8 << 20


def _copy_range(fd: int, path: Path, part: FileRange) -> int:
    """Append `part` to the open file.  Ranges to check go through memory
    (read, check, write: the bytes are read once either way); others are
    copied inside the kernel where it offers copy_file_range."""
    with _errors("read", part.path):
        src = open_regular(part.path)
    try:
        if part.check is not None:
            with _errors("read", part.path):
                data = os.pread(src, part.length, part.offset) if part.length else b""
            if len(data) != part.length:
                raise OSError(f"{part.path} ended {part.length - len(data)} bytes early")
            part.check(memoryview(data))
            return _write_all(fd, path, [data])
        offset, left = part.offset, part.length
        while left:
            with _errors("write", path):  # the fault hook; the copy's own errors fall back below
                try:
                    n = os.copy_file_range(src, fd, left, offset)
                except (AttributeError, OSError):  # not on this kernel or file system
                    n = -1
            if n < 0:
                with _errors("read", part.path):
                    block = os.pread(src, min(left, _COPY_BLOCK), offset)
                n = _write_all(fd, path, [block]) if block else 0
            if n == 0:
                raise OSError(f"{part.path} ended {left} bytes early")
            offset += n
            left -= n
    finally:
        os.close(src)
    return part.length


def read_ranges(ranges: Sequence[FileRange]) -> bytes:
    """The bytes of the ranges, one after another (each file opened once)."""
    fds: dict[Path, int] = {}
    out = bytearray()
    try:
        for part in ranges:
            fd = fds.get(part.path)
            if fd is None:
                with _errors("read", part.path):
                    fd = fds[part.path] = open_regular(part.path)
            with _errors("read", part.path):
                data = os.pread(fd, part.length, part.offset)
            if len(data) != part.length:
                raise OSError(f"{part.path} ended {part.length - len(data)} bytes early")
            out += data
    finally:
        for fd in fds.values():
            os.close(fd)
    return bytes(out)


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):  # best effort: the next writer removes leftovers anyway
        os.unlink(path)


def write_at(path: Path, offset: int, buffers: Iterable[Buffer], *, create: bool = False) -> None:
    """Write the buffers back to back from `offset` of an existing file (or
    a new one when `create`), then fsync it.  Each buffer is written before
    the next is asked for, so a generator may make them one at a time in
    one reused buffer (a flush writes its new records so)."""
    flags = os.O_WRONLY | (os.O_CREAT if create else 0)
    existed = path.exists()
    fd = _open(path, flags)
    try:
        at = offset
        for buffer in buffers:
            at += _write_all(fd, path, [buffer], at)
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
        # One error context for the whole loop: the pieces are small (a
        # flush writes each access count it persists as a 12-byte piece)
        # and a context of their own cost more than their writes.  The
        # fault hook still sees every write.
        with _errors("write", path):
            for i, (offset, data) in enumerate(pieces):
                if i and _fault_hook is not None:
                    _fault_hook("write", os.fspath(path))
                view = memoryview(data).cast("B")
                while view:
                    n = os.pwrite(fd, view, offset)
                    if n <= 0:
                        raise OSError(errno.EIO, "a write wrote nothing")
                    view, offset = view[n:], offset + n
        _fsync(fd, path)
    finally:
        os.close(fd)


def truncate(path: Path, size: int) -> None:
    fd = _open(path, os.O_WRONLY)
    try:
        with _errors("truncate", path):
            os.ftruncate(fd, size)
        _fsync(fd, path)
    finally:
        os.close(fd)


def rename(src: Path, dst: Path) -> None:
    rename_many([(src, dst)])


def unlink(path: Path) -> None:
    """Remove `path` if it exists."""
    unlink_many([path])


def rename_many(pairs: Sequence[tuple[Path, Path]]) -> None:
    """Rename each pair (all in one directory), then fsync the directory once."""
    for src, dst in pairs:
        with _errors("rename", src):
            os.replace(src, dst)
    if pairs:
        fsync_dir(pairs[0][1].parent)


def link(src: Path, dst: Path) -> None:
    """Give the file `src` the new name `dst` (a hard link, in the same
    directory; `dst` must not exist), then fsync the directory: compaction
    moves a whole shard to another index this way, with no byte copied."""
    with _errors("link", dst):
        os.link(src, dst, follow_symlinks=False)
    fsync_dir(dst.parent)


def unlink_many(paths: Sequence[Path]) -> None:
    """Remove the files that exist (all in one directory), then fsync the
    directory once."""
    removed = False
    for path in paths:
        with _errors("unlink", path), contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed = True
    if removed:
        fsync_dir(paths[0].parent)


def make_dir(path: Path, mode: int = 0o777) -> None:
    """Create `path` (and missing parents; `mode`, less the umask, for
    `path` itself) and make the new entry durable."""
    with _errors("mkdir", path):
        existed = path.exists()
        path.mkdir(parents=True, exist_ok=True, mode=mode)
    if not existed:
        fsync_dir(path.parent)


# ---- the lock file ------------------------------------------------------------------


def open_lock_file(path: Path) -> int:
    """Open (creating if needed) the store's lock file; returns the fd."""
    return _open(path, os.O_RDWR | os.O_CREAT)


def rewrite_fd(fd: int, path: Path, data: bytes) -> None:
    """Replace the whole content of an open file (the lock's owner record)."""
    with _errors("truncate", path):
        os.ftruncate(fd, 0)
    _write_all(fd, path, [data], 0)


# ---- the local cache of a store on object storage ---------------------------------
# These files are copies of objects that stay on the object store: losing
# them loses nothing, so they are written without fsync.


def open_cache_file(path: Path, size: int) -> int:
    """Create a sparse file of `size` bytes (a shard fetched range by range);
    returns its fd, open for reading and writing."""
    fd = _open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with _errors("truncate", path):
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_cache_at(fd: int, path: Path, offset: int, data: Buffer) -> None:
    """Write fetched bytes into a cache file at `offset` (no fsync)."""
    _write_all(fd, path, [data], offset)


def write_cache_file(path: Path, data: Buffer) -> None:
    """Create or replace a whole cache file (no fsync): written to a
    temporary file renamed over `path`, so another process finds the old
    file, the new one or none, never half of one."""
    tmp = temp_path(path)
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _write_all(fd, tmp, [data], 0)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    with _errors("rename", tmp):
        os.replace(tmp, path)


def make_private_dir(parent: Path, prefix: str) -> Path:
    """A new directory under `parent` only this user may enter, its name
    `prefix` followed by random characters."""
    import tempfile

    with _errors("mkdir", parent):
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def remove_tree(path: Path) -> None:
    """Remove a cache directory and everything in it (never through links)."""
    import shutil

    with _errors("unlink", path), contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
