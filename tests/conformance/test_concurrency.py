"""One writer at a time, and readers that see whole commits, on every
backend: a second writer is refused while one holds the store (its lock,
or on object storage its lease) and gets it once that one closes; readers
running beside a writer that puts and flushes only ever see a committed
number of entries, each entry exact, and on object storage pick up each
new commit with ``refresh()``."""

from __future__ import annotations

import threading

import pytest

from hmem import Store, StoreLockedError

READERS = 3
ROUNDS = 6
PER_ROUND = 4


def test_a_second_writer_is_refused_while_one_holds_the_store(location, data):
    first = Store.create(location.url, **data.config)
    try:
        ids = data.fill(first, range(5))
        first.flush()
        with pytest.raises(StoreLockedError):
            Store.open(location.url, lock_wait=0)
        with Store.open(location.url, read_only=True) as reader:  # readers need no lock
            data.check_kv(reader, ids)
        data.fill(first, range(5, 7))  # the holder goes on writing
        first.flush()
    finally:
        first.close()
    with Store.open(location.url, lock_wait=0) as second:  # given back at close, not left to expire
        assert len(second.entry_ids()) == 7
        with pytest.raises(StoreLockedError):
            Store.open(location.url, lock_wait=0)


class _Progress:
    """Which commit each reader has looked at since: the writer waits until
    every reader has read after its last commit before it writes again, so
    every commit is met by every reader (an event, not a duration)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.commit = 0  # commits made so far
        self.done = False
        self.seen = [-1] * READERS  # per reader: the last commit it read after (-1: none yet)

    def committed(self) -> None:
        with self.cond:
            self.commit += 1
            self.cond.notify_all()

    def wait_for_readers(self, guard: float) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: min(self.seen) >= self.commit, guard), "a reader stopped reading"

    def read_started(self) -> int:
        with self.cond:
            return self.commit

    def read_done(self, reader: int, started_at: int) -> None:
        with self.cond:
            self.seen[reader] = max(self.seen[reader], started_at)
            self.cond.notify_all()


def test_readers_beside_a_writer_see_only_whole_commits(location, data, conformance):
    writer = Store.create(location.url, **data.config)
    seeds: dict[int, int] = data.fill(writer, range(PER_ROUND))
    writer.flush()
    committed_counts = {PER_ROUND}  # every count a commit ever held
    progress = _Progress()
    failures: list[BaseException] = []
    seen_counts: list[set[int]] = [set() for _ in range(READERS)]

    def read(reader_no: int) -> None:
        # object storage: one reader that refreshes; a directory: a reader per look (each opens the last commit)
        held = Store.open(location.url, read_only=True) if location.on_object_storage else None
        try:
            while True:
                started_at = progress.read_started()
                finished = progress.done
                if held is not None:
                    held.refresh()
                    store = held
                else:
                    store = Store.open(location.url, read_only=True)
                try:
                    ids = store.entry_ids()
                    seen_counts[reader_no].add(len(ids))
                    assert len(ids) in committed_counts, (len(ids), committed_counts)
                    newest = ids[-1]
                    found = store.query(data.kv(seeds[newest])[0], 0, top_k=len(ids))
                    assert found[0].entry_id == newest and {r.entry_id for r in found} == set(ids)
                    got = store.get(newest)
                    assert got.keys.tobytes() == data.kv(seeds[newest])[0].tobytes()
                finally:
                    if store is not held:
                        store.close()
                progress.read_done(reader_no, started_at)
                if finished:
                    return
        except BaseException as exc:
            failures.append(exc)
            with progress.cond:
                progress.seen[reader_no] = 1 << 30  # never waited for again
                progress.cond.notify_all()
        finally:
            if held is not None:
                held.close()

    threads = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(READERS)]
    for thread in threads:
        thread.start()
    try:
        for round_ in range(1, ROUNDS + 1):
            progress.wait_for_readers(conformance.hang_guard)
            first = round_ * PER_ROUND
            new = data.fill(writer, range(first, first + PER_ROUND))
            seeds.update(new)  # before the flush: a reader can only meet them after it
            committed_counts.add(len(seeds))
            writer.flush()
            progress.committed()
        progress.wait_for_readers(conformance.hang_guard)
    finally:
        progress.done = True
        for thread in threads:
            thread.join(conformance.hang_guard)
        writer.close()
    assert not failures, failures
    # every reader met every commit: the counts of all of them, and no other
    for counts in seen_counts:
        assert counts == committed_counts
