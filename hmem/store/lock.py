"""The single-writer lock of a store.

An exclusive ``flock`` on ``<store>/lock``: the kernel releases it when the
holder exits or dies, so a crashed writer never leaves a stale lock.  The
holder writes an owner record (pid, host, command, start time) into the file
so that a refused writer can say who holds the lock.  Readers take no lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hmem import _io
from hmem.errors import Hint, HmemError, StoreLockedError
from hmem.formats.store_files import LOCK_FILE

_POLL_SECONDS = 0.05


def _owner_record() -> bytes:
    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:200],
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    ).encode()


OWNER_RECORD_BYTES = 4096  # an owner record is a few hundred bytes; a larger lock file is not read


def read_owner(store_dir: Path) -> dict | None:
    """The owner record of the lock file, if one is readable."""
    try:
        data = json.loads(_io.read_regular(store_dir / LOCK_FILE, OWNER_RECORD_BYTES) or b"null")
    except (OSError, ValueError, RecursionError, HmemError):  # any bytes may be there: docs/security.md
        return None
    return data if isinstance(data, dict) else None


def _settled_owner(store_dir: Path) -> dict | None:
    """The owner record, waiting a moment for a holder that has just taken
    the lock and not yet written it; failing that, the holder's pid as the
    kernel's lock table (Linux /proc/locks) gives it."""
    for _ in range(10):
        owner = read_owner(store_dir)
        if owner:
            return owner
        time.sleep(0.01)
    pid = _flock_holder(store_dir / LOCK_FILE)
    return {"pid": pid} if pid is not None else None


def _flock_holder(path: Path) -> int | None:
    """Pid holding a FLOCK write lock on `path`, from /proc/locks."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks") as table:
            for line in table:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
                if (
                    len(fields) >= 6
                    and fields[1] == "FLOCK"
                    and fields[3] == "WRITE"
                    and fields[5].rsplit(":", 1)[-1] == str(inode)
                ):
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


def writer_at_work(store_dir: Path) -> int | None:
    """The pid of the process holding the store's write lock now, if one
    does (the kernel's lock table; nothing is locked or written): its
    temporary files and uncommitted bytes are work in progress, not what an
    interrupted writer left.  This process is not one: what it verifies
    while it holds the lock (repair does) is judged as it lies."""
    try:
        if not (store_dir / LOCK_FILE).is_file():
            return None
    except OSError:
        return None
    pid = _flock_holder(store_dir / LOCK_FILE)
    return pid if pid != os.getpid() else None


def describe_owner(owner: dict | None) -> str:
    if not owner:
        return "another process"
    if set(owner) == {"pid"}:
        return f"pid {owner['pid']} (just taking the lock)"
    return (
        f"pid {owner.get('pid', '?')} on {owner.get('host', '?')} "
        f"({owner.get('command', '?')}, since {owner.get('since', '?')})"
    )


class WriterLock:
    """Holds the exclusive write lock of one store until ``release``."""

    def __init__(self, store_dir: Path, *, wait_seconds: float = 0.0) -> None:
        self.path = store_dir / LOCK_FILE
        fd = _io.open_lock_file(self.path)
        deadline = time.monotonic() + max(0.0, wait_seconds)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    owner = describe_owner(_settled_owner(store_dir))
                    raise StoreLockedError(
                        f"{store_dir} is locked for writing by {owner}",
                        hint=Hint.LOCK_WAIT,
                    ) from None
                time.sleep(_POLL_SECONDS)
        self._fd: int | None = fd
        try:
            _io.rewrite_fd(fd, self.path, _owner_record())
        except BaseException:
            self.release()
            raise
        _io.crash_point("lock.taken")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _io.rewrite_fd(fd, self.path, b"")
        except OSError:
            pass  # the owner record is advisory; the flock is what counts
        finally:
            os.close(fd)  # closing the descriptor releases the flock
