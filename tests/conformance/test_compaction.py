"""Compaction on every backend: it frees the bytes of deleted entries,
leaves ids, K/V and query results as they were (also after a reopen), and
does what plan_compaction said it would."""

from __future__ import annotations

import hmem
from hmem import Store


def _as_planned(report, plan) -> None:
    """The plan's figures are what compact frees for sure: the shards and
    records it drops; index.json, which then lists fewer shards, shrinks a
    little more."""
    assert report.bytes_before == plan.bytes_before
    assert plan.reclaimable_bytes <= report.bytes_freed
    assert report.bytes_after <= plan.bytes_after_estimate
    assert (report.shards_before, report.shards_after) == (plan.shards_before, plan.shards_after)


def test_compact_frees_deleted_bytes_and_changes_no_result(location, data):
    with Store.create(location.url, **data.config) as store:
        ids = data.fill(store, range(24))
        store.flush()
        gone = sorted(ids)[:10]  # the first shards' entries, all of them: those shards can go whole
        store.delete(gone)
        kept = {i: s for i, s in ids.items() if i not in gone}
        rankings = data.rankings(store, range(24))
        size = store.size()
        plan = store.plan_compaction()
        assert plan.needed and plan.reclaimable_bytes > 0 and plan.evicted_records == 10
        report = store.compact()
        assert report.performed
        _as_planned(report, plan)
        assert report.shards_after == plan.shards_after and report.shards_before == plan.shards_before
        assert store.size() < size
        assert store.size() == size - report.bytes_freed
        data.check_kv(store, kept)
        assert data.rankings(store, range(24)) == rankings
        assert not store.plan_compaction().needed
        after = store.compact()
        assert not after.performed and after.bytes_freed == 0
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, kept)
        assert data.rankings(reader, range(24)) == rankings
        # what compact left: the dead bytes of shards below its dead share
        assert reader.stats().reclaimable_bytes == plan.dead_bytes_left
    verified = hmem.verify(location.url, full=True)
    assert verified.ok, verified.findings


def test_compact_of_evicted_entries_matches_its_plan_and_keeps_new_puts(location, data):
    with Store.create(location.url, **data.config) as store:
        ids = data.fill(store, range(20))
        store.flush()
        plan_evict = store.plan_eviction(8)
        store.evict(8)
        kept = {i: s for i, s in ids.items() if i not in plan_evict.entry_ids}
        plan = store.plan_compaction(min_dead_share=0.0)
        assert plan.reclaimable_bytes == store.stats().reclaimable_bytes
        report = store.compact(min_dead_share=0.0)
        assert report.performed
        _as_planned(report, plan)
        assert report.entries == len(kept)
        assert store.stats().evicted == 0 and store.stats().reclaimable_bytes == 0
        more = data.fill(store, range(100, 104))  # ids go on from where they were
        assert min(more) > max(ids)
    with Store.open(location.url) as store:
        data.check_kv(store, {**kept, **more})
