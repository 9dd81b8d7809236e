"""Large in-memory arrays whose pages the kernel maps when they are made.

Writing into freshly allocated memory faults its pages in one at a time;
on virtual machines each fault is costly (filling 512 MB that way measured
7x slower than having the kernel map it at once, MAP_POPULATE).  Arrays
of at least POPULATE_MIN_BYTES that hmem fills whole right away (the
signature matrices built at open, the rows and records of a bulk put)
come from here, and BufferPool keeps large buffers for reuse.
"""

from __future__ import annotations

import math
import mmap
import threading

import numpy as np

POPULATE_MIN_BYTES = 1 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", None)  # Linux only


def zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.zeros, its pages mapped at once when it is large (anonymous
    memory comes zeroed): for arrays about to be written all over."""
    dt = np.dtype(dtype)
    if _POPULATE is None or math.prod(shape) * dt.itemsize < POPULATE_MIN_BYTES:
        return np.zeros(shape, dtype=dt)
    return filled_soon(shape, dt)


def filled_soon(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array the caller is about to fill whole
    (np.empty where populating is not available or not worth it)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if _POPULATE is None or nbytes == 0 or nbytes < POPULATE_MIN_BYTES:
        return np.empty(shape, dtype=dt)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    except OSError:  # no room to map it whole at once: fault it in as usual
        return np.empty(shape, dtype=dt)
    return np.frombuffer(buf, dtype=dt).reshape(shape)


class BufferPool:
    """Large byte buffers kept for reuse, shared by the process's stores.

    Fresh memory costs more than the copy into it (every page is faulted in
    and zeroed; on virtual machines about 1-3 ms per MB, ten times a copy),
    so the buffers a put copies rows into come back here when the put is
    done, and a store's open-shard memory when the store closes.  The pool
    keeps at most `keep_bytes` of free buffers."""

    GRAIN = 1 << 20  # sizes are rounded up to this, so that buffers fit other uses

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least `nbytes` (its contents undefined).
        Small ones are plain allocations: the allocator reuses those well."""
        if nbytes < POPULATE_MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self._free = [b for b in self._free if b is not best]
                self._free_bytes -= len(best)
                return best
        size = -(-max(nbytes, 1) // self.GRAIN) * self.GRAIN
        return filled_soon((size,), np.uint8)

    def keep_at_least(self, nbytes: int) -> None:
        """Keep at least `nbytes` of free buffers from now on (a process that
        puts large batches over and over: hmem/lmcache/tier.py)."""
        with self._lock:
            self.keep_bytes = max(self.keep_bytes, nbytes)

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer taken from the pool: nothing may use it afterwards."""
        if len(buffer) < POPULATE_MIN_BYTES:
            return
        with self._lock:
            if self._free_bytes + len(buffer) <= self.keep_bytes:
                self._free.append(buffer)
                self._free_bytes += len(buffer)


POOL = BufferPool(256 << 20)  # free buffers kept: a few batches' rows, a closed store's open-shard memory
