"""The threads hmem's kernels run on: one per core this process may use.

Kernels that scan large arrays release the GIL; a scan split into
contiguous ranges, one per thread, runs on every core.  One pool serves the
whole process, made on first use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=cores(), thread_name_prefix="hmem-scan")
        return _pool


def split(n: int, min_per_thread: int) -> list[tuple[int, int]]:
    """[0, n) as contiguous ranges, one per thread: as many as there are
    cores, but none shorter than `min_per_thread` (one range when n is small)."""
    parts = max(1, min(cores(), n // max(1, min_per_thread)))
    bounds = [n * t // parts for t in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


_scans = 0  # run_ranges calls under way, in every thread


def run_ranges(fn: Callable[[int, int], T], ranges: list[tuple[int, int]]) -> list[T]:
    """fn(lo, hi) of every range, the results in the ranges' order; all but
    the first range run on the pool while the calling thread runs the first.
    While another thread's call is under way (threads sharing a Store,
    each querying), the cores are busy already: the calling thread runs
    every range itself, one after another, and the results are the same."""
    global _scans
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    with _pool_lock:
        busy = _scans > 0
        _scans += 1
    try:
        if busy:
            return [fn(lo, hi) for lo, hi in ranges]
        futures = [_executor().submit(fn, lo, hi) for lo, hi in ranges[1:]]
        first = fn(*ranges[0])
        return [first, *(f.result() for f in futures)]
    finally:
        with _pool_lock:
            _scans -= 1
