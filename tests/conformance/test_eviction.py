"""Eviction on every backend: puts past max_entries or max_disk_bytes
evict the lowest-scored entries to make room; evict() and delete() are
durable when they return (a reader opened then, and the store reopened,
agree); plan_eviction names exactly what evict removes."""

from __future__ import annotations

from hmem import Store


def test_puts_past_max_entries_evict_the_lowest_scored(location, data):
    with Store.create(location.url, max_entries=12, **data.config) as store:
        low = data.fill(store, range(4), importance=0.1)
        high = data.fill(store, range(4, 12), importance=5.0)
        store.flush()
        new = data.fill(store, range(12, 16))  # 16 > 12: the four low ones make room
        assert store.stats().limits.evicted == 4
        kept = {**high, **new}
        data.check_kv(store, kept)
        assert not set(low) & set(store.entry_ids())
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, kept)
        assert reader.stats().entries == 12


def test_puts_past_max_disk_bytes_keep_the_store_under_it(location, new_location, data):
    sized = new_location(location.kind)
    with Store.create(sized.url, **data.config) as store:
        data.fill(store, range(12))
        store.flush()
        limit = 2 * store.size()  # room for about twice twelve entries, on this backend
    seeds: dict[int, int] = {}
    with Store.create(location.url, max_disk_bytes=limit, **data.config) as store:
        for part in range(6):  # about three times what fits
            seeds.update(data.fill(store, range(part * 8, part * 8 + 8)))
            store.flush()
            assert store.size() <= limit
        st = store.stats()
        assert st.limits.evicted > 0 and 0 < st.entries < 48
        newest = data.fill(store, [900])
        store.flush()
        assert set(newest) <= set(store.entry_ids())  # a new entry always stays
        seeds.update(newest)
        kept = {i: seeds[i] for i in store.entry_ids()}
        data.check_kv(store, kept)
    with Store.open(location.url, read_only=True) as reader:
        assert reader.size() <= limit
        data.check_kv(reader, kept)


def test_evict_is_durable_and_matches_its_plan(location, data):
    with Store.create(location.url, **data.config) as store:
        ids = data.fill(store, range(20))
        for seed in (3, 3, 7, 11):  # accesses raise a score
            store.query(data.kv(seed)[0], 0, top_k=1)
        store.flush()
        plan = store.plan_eviction(12)
        assert plan.count == 8 and plan.entries_before == 20
        before = store.entry_ids()
        assert store.evict(12) == 8
        assert sorted(set(before) - set(store.entry_ids())) == sorted(plan.entry_ids)
        assert not {i for i, s in ids.items() if s in (3, 7, 11)} & set(plan.entry_ids)
        kept = {i: s for i, s in ids.items() if i not in plan.entry_ids}
        with Store.open(location.url, read_only=True) as reader:  # durable now, the writer still open
            data.check_kv(reader, kept)
        assert store.plan_eviction(12).count == 0 and store.evict(12) == 0
    with Store.open(location.url) as store:
        data.check_kv(store, kept)
        assert store.stats().evicted == 8


def test_delete_is_durable_before_close(location, data):
    writer = Store.create(location.url, **data.config)
    try:
        ids = data.fill(writer, range(10))
        writer.flush()
        gone = sorted(ids)[::3]
        planned = writer.plan_delete(gone + [999])
        assert planned.entry_ids == tuple(gone) and planned.missing == (999,)
        writer.delete(gone)
        kept = {i: s for i, s in ids.items() if i not in gone}
        with Store.open(location.url, read_only=True) as reader:
            data.check_kv(reader, kept)
    finally:
        writer.close()
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, kept)
