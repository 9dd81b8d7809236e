"""The store's basic contract on every backend: what is put comes back bit
for bit, by id, by query and in the listing; deletes remove; a reopened
store holds everything committed; a reader sees the last commit."""

from __future__ import annotations

import numpy as np
import pytest

import hmem
from hmem import EntryNotFoundError, Store


def test_put_get_and_query_are_exact(location, data):
    with Store.create(location.url, **data.config) as store:
        keys, values = data.kv(0)
        first = store.put(keys, values, layer_idx=1, importance=2.5)
        ids = {first: 0, **data.fill(store, range(1, 20), layer=1)}
        data.check_kv(store, ids)  # before any flush
        store.flush()
        data.check_kv(store, ids)
        info = store.get(first).info
        assert (info.layer_idx, info.importance, info.n_tokens) == (1, 2.5, 6)
        for entry_id, seed in ids.items():
            best = store.query(data.kv(seed)[0], 1, top_k=3)
            assert best[0].entry_id == entry_id
            assert np.asarray(best[0].keys).tobytes() == data.kv(seed)[0].tobytes()
        assert not list(store.query(data.kv(3)[0], 0, top_k=3))  # layer 0 holds nothing
        assert len(store.stats().shards) >= 3  # the suite's small shards: several exist


def test_entries_list_every_live_entry(location, data):
    with Store.create(location.url, **data.config) as store:
        layer0 = data.fill(store, range(10), layer=0)
        layer2 = data.fill(store, range(10, 16), layer=2, importance=3.0)
        store.flush()
        listing = store.entries()
        assert listing.total == 16
        assert [e.entry_id for e in listing] == sorted({**layer0, **layer2})
        assert [e.entry_id for e in store.entries(2)] == sorted(layer2)
        assert all(e.importance == 3.0 and e.layer_idx == 2 for e in store.entries(2))
        assert store.entry_ids(0) == sorted(layer0)
        assert store.stats().layers == {0: 10, 2: 6}


def test_delete_removes_entries_durably(location, data):
    with Store.create(location.url, **data.config) as store:
        ids = data.fill(store, range(12))
        store.flush()
        gone = sorted(ids)[2:5]
        plan = store.delete(gone)
        assert plan.entry_ids == tuple(gone) and not plan.missing
        with pytest.raises(EntryNotFoundError):
            store.get(gone[0])
        with pytest.raises(EntryNotFoundError):
            store.delete([gone[0]])
        assert store.delete([gone[0]], missing_ok=True).missing == (gone[0],)
        kept = {i: s for i, s in ids.items() if i not in gone}
        data.check_kv(store, kept)
        found = store.query(data.kv(ids[gone[1]])[0], 0, top_k=12)
        assert gone[1] not in [r.entry_id for r in found]
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, kept)


def test_a_reopened_store_holds_everything_committed(location, data):
    with Store.create(location.url, **data.config) as store:
        ids = data.fill(store, range(15))
        store.query(data.kv(4)[0], 0, top_k=1)  # an access count, committed by close
    with Store.open(location.url) as store:
        data.check_kv(store, ids)
        assert store.stats().total_accesses == 1
        more = data.fill(store, range(15, 20))
        assert store.stats().next_entry_id > max(more)
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, {**ids, **more})
        assert reader.read_only
        with pytest.raises(hmem.ReadOnlyStoreError):
            reader.put(*data.kv(99))


def test_a_reader_sees_the_committed_state(location, data):
    writer = Store.create(location.url, **data.config)
    try:
        committed = data.fill(writer, range(8))
        writer.flush()
        data.fill(writer, range(8, 12))  # put, not flushed: no reader sees it
        with Store.open(location.url, read_only=True) as reader:
            data.check_kv(reader, committed)
            assert reader.stats().entries == 8
    finally:
        writer.close()
