"""What a commit leaves, on every backend: a fresh Store opens it, verify
finds nothing, the same puts give the same figures wherever the store
lives, and a copy to any other backend reads the same."""

from __future__ import annotations

import hmem
from hmem import Store


def _same_puts(store: Store, data) -> dict[int, int]:
    ids = data.fill(store, range(12))
    store.flush()
    ids.update(data.fill(store, range(12, 20), layer=1))
    store.delete(sorted(ids)[:3])
    store.query(data.kv(5)[0], 0, top_k=2)
    store.flush()
    return {i: s for i, s in ids.items() if i not in sorted(ids)[:3]}


def test_a_commit_opens_in_a_fresh_store_and_verifies(location, data):
    writer = Store.create(location.url, **data.config)
    try:
        ids = _same_puts(writer, data)
        # the commit as it lies, the writer still open
        report = hmem.verify(location.url, full=True)
        assert report.ok, report.findings
        assert report.records == 20 and report.shards == len(writer.stats().shards)
        with Store.open(location.url, read_only=True) as reader:
            data.check_kv(reader, ids)
            assert data.rankings(reader, range(20)) == data.rankings(writer, range(20))
    finally:
        writer.close()
    report = hmem.verify(location.url, full=True)
    assert report.ok and not report.problems, report.findings
    with Store.open(location.url) as store:
        data.check_kv(store, ids)


def test_the_same_puts_give_the_same_figures_on_every_backend(location, new_location, data):
    reference = new_location("directory")
    with Store.create(reference.url, **data.config) as store:
        expected_ids = _same_puts(store, data)
    with Store.create(location.url, **data.config) as store:
        assert _same_puts(store, data) == expected_ids
    with Store.open(reference.url, read_only=True) as ref, Store.open(location.url, read_only=True) as got:
        want, have = ref.stats(), got.stats()
        assert have.format_version == want.format_version == hmem.FORMAT_VERSION
        assert (have.entries, have.evicted, have.layers) == (want.entries, want.evicted, want.layers)
        assert [(s.entries, s.bytes, s.dead_entries) for s in have.shards] == [
            (s.entries, s.bytes, s.dead_entries) for s in want.shards
        ]
        assert (have.live_bytes, have.reclaimable_bytes) == (want.live_bytes, want.reclaimable_bytes)
        assert (have.total_accesses, have.next_entry_id) == (want.total_accesses, want.next_entry_id)
        assert have.config == want.config
        # the same files, but for the length of index.json's times and a
        # directory's commit.stamp (40 bytes), which object storage does without
        assert abs(got.size() - ref.size()) <= 64
        assert [e.entry_id for e in got.entries(sort="score")] == [e.entry_id for e in ref.entries(sort="score")]
        assert data.rankings(got, range(20)) == data.rankings(ref, range(20))
        assert (have.remote is not None) == location.on_object_storage


def test_a_copy_to_every_other_backend_reads_the_same(location, new_location, data):
    with Store.create(location.url, **data.config) as store:
        ids = _same_puts(store, data)
    with Store.open(location.url, read_only=True) as source:
        expected = data.rankings(source, range(20))
        accesses = source.stats().total_accesses
    for kind in ("directory", "memory", "s3"):
        target = new_location(kind)
        report = hmem.copy_store(location.url, target.url)
        assert (report.entries, report.records) == (len(ids), 20)
        with Store.open(target.url, read_only=True) as copy:
            data.check_kv(copy, ids)
            assert data.rankings(copy, range(20)) == expected
            assert copy.stats().total_accesses == accesses
        assert hmem.verify(target.url, full=True).ok, kind
