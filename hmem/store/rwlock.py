"""A readers-writer lock for one Store's state, shared by its threads.

Reads (queries, get, entries) hold it shared and run side by side;
writes that change what reads have already met (evict, delete, compact,
close, a put that must evict) hold it exclusively, so a reader sees the
state after some whole number of writes, never half of one.  A waiting
exclusive writer goes first: readers that arrive after it wait, so a
stream of queries cannot starve it.  ``intent`` is for a write whose
changes to memory are each safe for readers to meet (put and flush: docs/
architecture.md, "Threads"), and for reads that must see no write under
way (stats, the plans): it excludes every other write, no read.

Built only from re-entrant locks taken in ``with`` statements and
non-blocking tries, never from counters kept in Python: a KeyboardInterrupt
landing anywhere in these lines (the command line's signals, the tests'
interrupts) leaves at worst a lock held by the interrupted thread itself,
which that thread takes again freely, never one that makes it wait.

- ``_writers``: held by every write, exclusive or intent;
- ``_turnstile``: held by an exclusive write from before it waits for the
  readers; a reader passes through it first, so it waits behind the writer;
- ``_slots``: a reader holds one; an exclusive write holds them all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

SLOTS = 32  # readers at once; more wait for a slot


class ReadWriteLock:
    """Shared for readers, exclusive or intent for one writer (module docstring)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self._writers = threading.RLock()
        self._turnstile = threading.RLock()
        self._slots = [threading.RLock() for _ in range(slots)]

    def _slot(self) -> threading.RLock:
        """A reader slot, acquired: a free one, else wait for one."""
        for slot in self._slots:
            if slot.acquire(blocking=False):
                return slot
        slot = self._slots[threading.get_ident() % len(self._slots)]
        slot.acquire()
        return slot

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._turnstile:  # behind a waiting or running exclusive write
            pass
        slot = self._slot()
        try:
            yield
        finally:
            slot.release()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._writers, self._turnstile:
            held = 0
            try:
                for slot in self._slots:  # every reader gone, none let in
                    held += slot.acquire()  # True: counted in the same step as taken
                yield
            finally:
                for slot in self._slots[:held]:
                    slot.release()

    @contextmanager
    def intent(self) -> Iterator[None]:
        with self._writers:
            yield
