"""One Store shared by threads (hmem/store/rwlock.py; docs/architecture.md,
"Threads"): reader threads query, get and list while a writer thread puts,
flushes, evicts, deletes and compacts.  Every result's K/V must be its
entry's own, no error but the documented one (EntryNotFoundError for an id
deleted meanwhile), and the access counts exact at the end.

Puts and flushes run beside queries (intent); the small shard_max_bytes
makes puts seal shards and open new ones, whose memory is the sealed
shards' once no query reads them.  Entries describe themselves: importance = seed, layer = seed % 3, and the
K/V come from the seed, so a reader checks any result by itself.  The
scenario is one script, run in this process with the native kernels and in
a subprocess with the pure-Python reference kernels."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from hmem.store.rwlock import ReadWriteLock

HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)


def _wait_until_blocked_in(thread: threading.Thread, method) -> None:
    """Wait until `thread` is inside `method` (a ReadWriteLock method): its
    innermost Python frame runs that method, whose only waits are the
    lock's own (C calls), so the thread is at the lock, waiting for it.  A
    poll for an event, not for a duration: HANG_GUARD is a hang guard only."""
    code = method.__wrapped__.__code__  # the generator function under @contextmanager
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code is code:
            return
        if not thread.is_alive():
            raise AssertionError(f"{thread.name} ended instead of waiting in {method.__name__}()")
        time.sleep(0.001)
    raise AssertionError(f"{thread.name} never waited in {method.__name__}()")


def _join(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(HANG_GUARD)
        assert not t.is_alive(), f"{t.name} still runs"


SCENARIO = r"""
import collections, json, sys, threading, time
import numpy as np
import hmem

path, seconds, readers, S = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
every_write = sys.argv[5] == "1"  # the load also goes on until a compaction, an eviction and a delete happened
D = 8

def kv(seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1 + seed % 3, D)).astype(np.float32)
    return k, (k * 2 + 1).astype(np.float32)

store = hmem.Store.create(path, embed_dim=D, hdc_dim=1024, shard_max_bytes=20_000, signatures_per_entry=S)
MODES = ("full", "two-stage") + (("spans",) if S > 1 else ())
store.put_many(hmem.Entry(*kv(s), s % 3, float(s)) for s in range(60))
highest = [60]  # seeds below this were put (read without a lock: a hint only)
stop = threading.Event()
errors, seen = [], []
figures = collections.Counter()

def check(r):
    seed = int(r.importance)
    k, v = kv(seed)
    assert r.layer_idx == seed % 3, (r.entry_id, r.layer_idx, seed)
    assert r.keys.tobytes() == k.tobytes() and r.values.tobytes() == v.tobytes(), r.entry_id

def reader(n):
    rng = np.random.default_rng(100 + n)
    counts = collections.Counter()
    try:
        while not stop.is_set():
            seed = int(rng.integers(0, highest[0]))
            q = kv(seed)[0] + 0.01
            mode = MODES[int(rng.integers(0, len(MODES)))]
            if rng.random() < 0.2:
                batch = store.query_many([q, q * 0.5], seed % 3, top_k=3, search=mode)
                results = [r for res in batch for r in res]
            else:
                results = list(store.query(q, seed % 3, top_k=3, rerank=bool(rng.integers(0, 2)), search=mode))
            for r in results:
                check(r)
                counts[r.entry_id] += 1
            figures["queries"] += 1
            if results and rng.random() < 0.2:
                try:
                    got = store.get(results[0].entry_id)
                    check(type("R", (), {"importance": got.info.importance, "layer_idx": got.info.layer_idx,
                                         "keys": got.keys, "values": got.values, "entry_id": got.info.entry_id}))
                except hmem.EntryNotFoundError:  # deleted or evicted since the query: documented
                    figures["gone"] += 1
            if rng.random() < 0.05:
                listing = list(store.entries(seed % 3, limit=5))
                assert all(e.layer_idx == seed % 3 for e in listing)
                store.stats()
    except BaseException as exc:
        errors.append(repr(exc))
        stop.set()
    seen.append(counts)

def writer():
    rng = np.random.default_rng(7)
    seed = 60
    try:
        while not stop.is_set():
            if rng.random() < 0.3:  # one entry at a time: each put may seal the shard it fills
                for s in range(seed, seed + 10):
                    store.put(*kv(s), s % 3, float(s))
            else:
                store.put_many(hmem.Entry(*kv(s), s % 3, float(s)) for s in range(seed, seed + 10))
            seed += 10
            highest[0] = seed
            step = int(rng.integers(0, 10))
            if step < 4:
                store.flush()
            elif step == 4:
                ids = store.entry_ids()
                store.delete(ids[:: 7][:3])
                figures["deletes"] += 1
            elif step == 5:
                store.evict(max(40, len(store.entry_ids()) - 15))
                figures["evictions"] += 1
            elif step == 6:
                store.compact()
                figures["compactions"] += 1
            figures["puts"] += 10
    except BaseException as exc:
        errors.append(repr(exc))
        stop.set()

def enough():  # the load ran `seconds` at least and did every kind of work checked, however slow the machine
    done = figures["queries"] > 20 and figures["puts"] > 20
    if every_write:
        done = done and figures["compactions"] and figures["evictions"] and figures["deletes"]
    return done and time.monotonic() >= soak_until

threads = [threading.Thread(target=reader, args=(n,)) for n in range(readers)] + [threading.Thread(target=writer)]
soak_until = time.monotonic() + seconds
give_up = soak_until + 300  # a hang guard: the test fails on the figures, it does not hang
for t in threads:
    t.start()
while not stop.is_set() and not enough() and time.monotonic() < give_up:
    stop.wait(0.05)
stop.set()
for t in threads:
    t.join()
observed = collections.Counter()
for c in seen:
    observed.update(c)
wrong = {}
with store:
    for e in store.entries():
        if e.access_count != observed[e.entry_id]:
            wrong[e.entry_id] = (e.access_count, observed[e.entry_id])
    live = {e.entry_id: e.access_count for e in store.entries()}
with hmem.Store.open(path, read_only=True) as again:  # the counts were flushed by close
    persisted = {e.entry_id: e.access_count for e in again.entries()}
print(json.dumps({"errors": errors, "wrong_counts": {str(k): v for k, v in wrong.items()},
                  "persisted_same": persisted == live, "figures": dict(figures),
                  "counted": sum(live.values())}))
"""


@pytest.mark.stress
@pytest.mark.parametrize("kernels,seconds,signatures", [("native", 4.0, 1), ("reference", 2.0, 1), ("native", 3.0, 4)])
def test_readers_share_a_store_with_a_writer(kernels, seconds, signatures, run_python, tmp_path):
    """Three readers and a writer; with signatures=4 the store keeps span
    signatures and the readers' queries use the span search too."""
    proc = run_python(
        SCENARIO.replace(
            "sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])",
            f"{str(tmp_path / 's')!r}, {seconds}, 3, {signatures}",
        ).replace('sys.argv[5] == "1"', str(kernels == "native")),
        env={"HMEM_KERNELS": kernels},
        timeout=900,  # a hang guard: the scenario ends once its work is done (at most its own 300 s guard later)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == []
    assert report["wrong_counts"] == {}
    assert report["persisted_same"]
    figures = report["figures"]
    # the load really ran: queries and every kind of write, side by side
    assert figures["queries"] > 20 and figures["puts"] > 20, figures
    assert report["counted"] > 0
    if kernels == "native":
        assert figures.get("compactions", 0) and figures.get("evictions", 0) and figures.get("deletes", 0), figures


def test_readers_run_together_and_a_writer_waits_for_them():
    lock = ReadWriteLock()
    all_inside = threading.Event()
    # three readers inside at once: shared really is shared
    inside = threading.Barrier(3, action=all_inside.set, timeout=HANG_GUARD)
    order: list[str] = []
    release = threading.Event()
    errors: list[BaseException] = []

    def read(name):
        try:
            with lock.shared():
                inside.wait()
                assert release.wait(HANG_GUARD)
                order.append(name)
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=read, args=(f"r{i}",)) for i in range(3)]
    for t in readers:
        t.start()
    assert all_inside.wait(HANG_GUARD)

    def write():
        with lock.exclusive():
            order.append("w")

    w = threading.Thread(target=write)
    w.start()
    _wait_until_blocked_in(w, ReadWriteLock.exclusive)  # the writer waits while readers are inside
    assert order == []
    release.set()
    _join(*readers, w)
    assert not errors, errors[0]
    assert order[-1] == "w" and sorted(order[:3]) == ["r0", "r1", "r2"]


def test_a_waiting_writer_goes_before_later_readers():
    lock = ReadWriteLock()
    first_in, let_go = threading.Event(), threading.Event()
    order: list[str] = []

    def first():
        with lock.shared():
            first_in.set()
            if let_go.wait(HANG_GUARD):
                order.append("first reader")

    def write():
        with lock.exclusive():
            order.append("writer")

    def later():
        with lock.shared():
            order.append("later reader")

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(HANG_GUARD)
    w = threading.Thread(target=write)
    w.start()
    _wait_until_blocked_in(w, ReadWriteLock.exclusive)  # waiting now
    b = threading.Thread(target=later)
    b.start()
    _wait_until_blocked_in(b, ReadWriteLock.shared)  # held back behind the waiting writer
    assert order == []
    let_go.set()
    _join(a, w, b)
    assert order == ["first reader", "writer", "later reader"]


def test_the_lock_is_reentrant():
    lock = ReadWriteLock()
    with lock.exclusive():
        with lock.exclusive():
            with lock.shared():  # a write that reads
                pass
        with lock.intent():
            pass
    with lock.shared():
        with lock.shared():  # a read inside a read does not wait for a writer
            pass
    done = threading.Event()

    def write():
        with lock.exclusive():
            done.set()

    t = threading.Thread(target=write)
    t.start()
    _join(t)
    assert done.is_set()  # nothing is left held


def test_an_interrupt_inside_the_lock_never_blocks_the_interrupted_thread():
    # A KeyboardInterrupt may land on any line of the lock (a signal in the
    # command line): what it leaves held, this thread takes again.
    import sys

    lock = ReadWriteLock()
    for mode in ("shared", "exclusive", "intent"):
        for n in range(1, 40):
            seen = [0]

            def hook(frame, event, arg):
                if not frame.f_code.co_filename.endswith("rwlock.py"):
                    return None
                seen[0] += 1
                if seen[0] == n:
                    sys.settrace(None)
                    raise KeyboardInterrupt
                return hook

            sys.settrace(hook)
            try:
                with getattr(lock, mode)():
                    pass
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            with lock.shared(), lock.exclusive(), lock.intent():  # none of these waits
                pass


def test_scans_of_several_threads_give_the_same_results():
    # while one thread's scan has the pool, another runs its ranges itself
    from hmem import threads

    ranges = [(0, 10), (10, 20), (20, 30)]
    started, go = threading.Event(), threading.Event()

    def slow(lo, hi):
        if lo == 0:
            started.set()
            assert go.wait(HANG_GUARD)  # the first scan holds the pool until the second is done
        return list(range(lo, hi))

    first: list = []
    t = threading.Thread(target=lambda: first.append(threads.run_ranges(slow, ranges)))
    t.start()
    assert started.wait(HANG_GUARD)
    ran_on: set[int] = set()

    def quick(lo, hi):
        ran_on.add(threading.get_ident())
        return list(range(lo, hi))

    second = threads.run_ranges(quick, ranges)  # while the first is under way
    go.set()
    _join(t)
    assert second == first[0] == [list(range(10)), list(range(10, 20)), list(range(20, 30))]
    assert ran_on == {threading.get_ident()}  # every range on the calling thread: the pool was busy


def test_intent_lets_readers_in_and_keeps_writers_out():
    lock = ReadWriteLock()
    holding, let_go = threading.Event(), threading.Event()
    order: list[str] = []

    def flush():
        with lock.intent():
            holding.set()
            if let_go.wait(HANG_GUARD):
                order.append("flush")

    def put():
        with lock.exclusive():
            order.append("put")

    f = threading.Thread(target=flush)
    f.start()
    assert holding.wait(HANG_GUARD)
    done = threading.Event()

    def reader():
        with lock.shared():
            done.set()

    r = threading.Thread(target=reader)
    r.start()
    _join(r)
    assert done.is_set()  # a read runs while the flush holds intent
    p = threading.Thread(target=put)
    p.start()
    _wait_until_blocked_in(p, ReadWriteLock.exclusive)  # a write waits for it
    assert order == []
    let_go.set()
    _join(f, p)
    assert order == ["flush", "put"]


@pytest.mark.parametrize("signatures", [1, 3])
def test_first_queries_of_many_threads_on_a_fresh_open_agree(tmp_path, signatures):
    """A layer's signature matrix is made at its first query, once, whichever
    thread gets there first (hmem/store/search.py, LayerIndex.defer): many
    threads starting on a freshly opened store, each layer in another
    order, answer exactly as one thread does; puts and evictions on a
    layer nobody queried yet keep it right."""
    import numpy as np

    import hmem

    rng = np.random.default_rng(11)
    layers, dim = 6, 16
    with hmem.Store.create(tmp_path / "s", embed_dim=dim, hdc_dim=512, signatures_per_entry=signatures) as store:
        store.put_many(
            [
                (
                    rng.standard_normal((5, dim), dtype=np.float32),
                    rng.standard_normal((5, dim), dtype=np.float32),
                    i % layers,
                )
                for i in range(600)
            ]
        )
    queries = rng.standard_normal((8, dim), dtype=np.float32)

    def answers(store, order) -> dict:
        return {
            (layer, j): [r.entry_id for r in store.query(q, layer, top_k=4, count_access=False)]
            for layer in order
            for j, q in enumerate(queries)
        }

    with hmem.Store.open(tmp_path / "s", read_only=True) as store:
        expected = answers(store, range(layers))
    with hmem.Store.open(tmp_path / "s", read_only=True) as store:
        got: list[dict] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(4, timeout=HANG_GUARD)

        def run(seed: int) -> None:
            order = np.random.default_rng(seed).permutation(layers).tolist()
            try:
                barrier.wait()
                got.append(answers(store, order))
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        _join(*workers)
        assert not errors, errors[0]
        assert len(got) == 4 and all(g == expected for g in got)
    with hmem.Store.open(tmp_path / "s") as writer:  # a writer changes layers no query has touched
        extra = writer.put(queries[0][None, :].repeat(3, axis=0), queries[0][None, :].repeat(3, axis=0), 2)
        evicted = writer.entry_ids(3)[:50]
        writer.delete(evicted)
        assert writer.query(queries[0], 2, top_k=1)[0].entry_id == extra
        assert not {r.entry_id for r in writer.query(queries[1], 3, top_k=100)} & set(evicted)


def test_a_put_runs_beside_a_query_under_way_and_an_eviction_waits_for_it(tmp_path):
    """A query under way is held inside the store's shared lock (private
    state: the only way to freeze a query at a known point); a put and a
    flush complete meanwhile, and the query, which took its layer's view
    before them, still sees only the entries of its moment; an eviction
    (exclusive) waits until the query ends."""
    import numpy as np

    import hmem

    rng = np.random.default_rng(3)
    rows = [rng.standard_normal((2, 8)).astype(np.float32) for _ in range(40)]
    with hmem.Store.create(tmp_path / "s", embed_dim=8, hdc_dim=512) as store:
        store.put_many((r, r + 1) for r in rows[:20])
        layer = store._state.search_index.layers[0]  # the view a query takes first (hmem/store/search.py)
        in_query, done = threading.Event(), threading.Event()
        seen: list[int] = []

        def query_under_way():
            with store._state.lock.shared():
                view = layer.view
                in_query.set()
                if done.wait(HANG_GUARD):
                    seen.append(view.n)

        reader = threading.Thread(target=query_under_way)
        reader.start()
        assert in_query.wait(HANG_GUARD)
        put_done = threading.Event()

        def write():
            store.put_many((r, r + 1) for r in rows[20:])
            store.flush()
            put_done.set()

        writer = threading.Thread(target=write)
        writer.start()
        _join(writer)  # a put that waited for the query would wait for ever: the guard ends it
        assert put_done.is_set()  # did not wait for the query
        evicting = threading.Thread(target=lambda: store.evict(10))
        evicting.start()
        _wait_until_blocked_in(evicting, ReadWriteLock.exclusive)  # an eviction waits for the query
        done.set()
        _join(reader, evicting)
        assert seen == [20]  # a put publishes a new view; the query's stays as taken
        assert len(store.entry_ids()) == 10
        for r in store.query(rows[35], 0, top_k=3):
            assert r.keys.tobytes() == rows[r.entry_id - 1].tobytes()


def test_a_sealed_shard_s_memory_is_reused_only_once_nothing_reads_it():
    """The open shard's memory goes back to the spares when its builder is
    freed, not when it is sealed: a query that took the builder before the
    seal copies its entries out intact, whatever the next shard writes."""
    import gc

    import numpy as np

    from hmem.store.shard_builder import Arena, ShardBuilder, SpareSegments

    spares = SpareSegments()

    def builder(index, fill):
        b = ShardBuilder(index, f"{index:032x}", "", Arena(spares))
        b.add_entries(
            np.array([1]),
            np.array([4]),
            {"k": [np.full((4, 8), fill, np.float32)], "v": [np.full((4, 8), -fill, np.float32)]},
        )
        return b

    held = builder(0, 1.0)  # a query holds it, as hmem/store/reading.py does while copying
    first = held.get(1, "k")
    following = builder(1, 2.0)  # the next shard: it must not get `held`'s memory
    assert np.all(first == 1.0) and np.all(following.get(1, "k") == 2.0)
    address = first.__array_interface__["data"][0]
    del first
    gc.collect()
    another = builder(3, 4.0)
    assert another.get(1, "k").__array_interface__["data"][0] != address  # still held
    del held  # the query is done: its memory goes to the spares, and the next shard takes it
    reused = builder(2, 3.0)
    assert reused.get(1, "k").__array_interface__["data"][0] == address
    assert np.all(reused.get(1, "k") == 3.0) and np.all(following.get(1, "k") == 2.0)
    assert np.all(another.get(1, "k") == 4.0)
    spares.release()
