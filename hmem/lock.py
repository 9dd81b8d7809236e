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
from hmem.errors import StoreLockedError

LOCK_FILE = "lock"
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


def read_owner(store_dir: Path) -> dict | None:
    """The owner record of the lock file, if one is readable."""
    try:
        data = json.loads((store_dir / LOCK_FILE).read_text() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe_owner(owner: dict | None) -> str:
    if not owner:
        return "another process"
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
                    owner = describe_owner(read_owner(store_dir))
                    raise StoreLockedError(
                        f"{store_dir} is locked for writing by {owner}",
                        hint="wait for it to finish, or retry with a lock wait such as --lock-wait 30",
                    ) from None
                time.sleep(_POLL_SECONDS)
        self._fd: int | None = fd
        try:
            _io.rewrite_fd(fd, self.path, _owner_record())
        except BaseException:
            self.release()
            raise

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
