"""Damage and recovery on every backend: verify names a damaged shard's
entries and a missing small file; repair keeps every intact entry and
drops only the damaged; what an interrupted writer leaves is reported and
then removed by the next writer."""

from __future__ import annotations

import pytest

import hmem
from hmem import CorruptStoreError, Store

SEEDS = range(24)


def _store(location, data) -> dict[int, int]:
    with Store.create(location.url, **data.config) as store:
        ids = data.fill(store, SEEDS[:12])
        store.flush()
        ids.update(data.fill(store, SEEDS[12:]))
    assert hmem.verify(location.url, full=True).ok
    return ids


def test_a_damaged_shard_is_named_and_repair_keeps_every_intact_entry(location, data):
    ids = _store(location, data)
    shards = location.shard_names()
    assert len(shards) >= 4
    # a byte three quarters into one shard: the keys or values of one of its
    # entries (its header and entry index come first, pooled keys last)
    damaged_shard = shards[len(shards) // 2]
    location.flip_byte(damaged_shard, len(location.read(damaged_shard)) * 3 // 4)
    report = hmem.verify(location.url, full=True)
    assert not report.ok
    damaged = {f.entry_id for f in report.problems if f.entry_id is not None}
    assert damaged and {f.code for f in report.problems} == {"tensor.checksum"}, report.problems
    with Store.open(location.url, read_only=True) as reader:
        infos = {e.entry_id: e for e in reader.entries()}
        shard_idx = {infos[i].shard_idx for i in damaged}
        assert len(shard_idx) == 1  # one shard's entries, named by the shard's file
        named = reader.stats().shards[shard_idx.pop()].file
        assert {f.file for f in report.problems} == {named}
        for entry_id in damaged:
            with pytest.raises(CorruptStoreError):
                reader.get(entry_id)
        intact = {i: s for i, s in ids.items() if i not in damaged}
        for entry_id, seed in intact.items():  # every other entry still reads
            assert reader.get(entry_id).keys.tobytes() == data.kv(seed)[0].tobytes()
    fixed = hmem.repair(location.url)
    assert fixed.entries_kept == len(intact)
    assert {entry_id for entry_id, _ in fixed.dropped} == damaged
    report = hmem.verify(location.url, full=True)
    assert report.ok, report.findings
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, intact)
        for entry_id, seed in intact.items():
            assert reader.query(data.kv(seed)[0], 0, top_k=1)[0].entry_id == entry_id


def test_a_missing_shard_is_named_and_repair_keeps_the_others(location, data):
    ids = _store(location, data)
    with Store.open(location.url, read_only=True) as reader:
        shard_of = {e.entry_id: e.shard_idx for e in reader.entries()}
        shard_files = {s.file: s.index for s in reader.stats().shards}
    location.delete(location.shard_names()[1])
    report = hmem.verify(location.url)
    assert not report.ok
    # named as the store's shard file (on object storage also as its object: remote.missing)
    lost = {shard_files[f.file] for f in report.problems if f.file in shard_files}
    assert len(lost) == 1, report.problems
    gone = {i for i, shard in shard_of.items() if shard in lost}
    assert gone
    fixed = hmem.repair(location.url)
    assert fixed.entries_kept == len(ids) - len(gone)
    report = hmem.verify(location.url, full=True)
    assert report.ok, report.findings
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, {i: s for i, s in ids.items() if i not in gone})


def _lose_the_records(location, data) -> str:
    """Delete where the records live: a directory's entries.bin; on object
    storage the state object that carries them (the last snapshot)."""
    _store(location, data)
    lost = location.records_file_names()[0]
    location.delete(lost)
    return lost


def test_a_missing_small_file_is_reported(location, data):
    lost = _lose_the_records(location, data)
    report = hmem.verify(location.url)
    assert not report.ok
    assert lost in {f.file for f in report.problems}, report.problems


def test_a_missing_small_file_is_refused_as_damage(location, data, tmp_path):
    _lose_the_records(location, data)
    # a host of its own: this one keeps the state objects it read, and
    # opens from its copy (docs/format.md, "The working copy")
    elsewhere = {"cache_dir": str(tmp_path / "other-host")} if location.on_object_storage else None
    for _ in range(2):  # the same answer each time: nothing will change it
        with pytest.raises(CorruptStoreError):
            Store.open(location.url, read_only=True, storage_options=elsewhere).close()


def _leave_leftovers(location) -> set[str]:
    """What a writer that stopped before its commit leaves (docs/format.md):
    in a directory a shard file no commit names and a temporary file; on
    object storage a shard object and a state object no manifest names."""
    shard = location.shard_names()[-1]
    body = location.read(shard)
    if location.on_object_storage:
        names = {f"shards/{'7' * 32}.safetensors", f"state/{'9' * 12}-0badf00d.bin"}
    else:
        number = max(int(name[len("shard_") : -len(".safetensors")]) for name in location.shard_names())
        names = {f"shard_{number + 1:04d}.safetensors", ".hmem-tmp.entries.bin.1.1"}
    for name in names:
        location.write(name, body)
    return names


@pytest.mark.parametrize("cleaner", ["writer", "repair"])
def test_leftovers_of_an_interrupted_writer_are_reported_then_removed(location, data, cleaner):
    ids = _store(location, data)
    before = set(location.names())
    leftovers = _leave_leftovers(location)
    report = hmem.verify(location.url)
    assert {f.code for f in report.problems} <= {"file.orphan", "file.temp", "remote.orphan"}
    assert {f.file for f in report.problems} == leftovers, report.problems
    with Store.open(location.url, read_only=True) as reader:  # a reader reads past them
        data.check_kv(reader, ids)
    if cleaner == "repair":
        hmem.repair(location.url)
    else:
        with Store.open(location.url) as store:
            if location.on_object_storage:
                # a writer's open leaves objects alone; the next compaction removes them
                assert set(store.plan_compaction().orphan_files) == leftovers
                store.compact()
            data.check_kv(store, ids)
    assert not leftovers & set(location.names())
    report = hmem.verify(location.url, full=True)
    assert report.ok, report.findings
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, ids)
    if cleaner == "writer":
        assert set(location.names()) - before <= {"lease.json"}  # nothing else new
