"""The store's on-disk format (docs/format.md) and its crash safety (docs/reliability.md):
record bytes, index.json fields and checksum, the lock file, crash points in
a subprocess, torn and flipped bytes, and injected disk faults.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import hmem
from hmem import Store, _io
from hmem.kernels import checksum as crc_kernels

F = np.float32
EMBED, HDC = 16, 256
RECORD = 40 + HDC // 8


def gauss(rng, n, d=EMBED):
    return rng.standard_normal((n, d)).astype(F)


def describe(store) -> dict:
    """Everything a store holds, except put timestamps: stats (evicted
    records counted), every live entry's metadata and K/V, by id.  The
    records' signature bytes are not public: each entry's row carries the
    best hit (id, similarity) for its own keys instead, (its id, 1.0) while
    the stored signature is the one its keys give."""
    st = store.stats()
    rows, kv = [], []
    for info in store.entries():
        got = store.get(info.entry_id)
        (hit,) = store.query(got.keys, info.layer_idx, 1, rerank=False, count_access=False)
        rows.append(
            (
                info.entry_id,
                info.layer_idx,
                info.n_tokens,
                info.importance,
                info.access_count,
                info.shard_idx,
                (hit.entry_id, hit.similarity),
            )
        )
        kv.append((got.keys.tobytes(), got.values.tobytes()))
    return {
        "entries": st.entries,
        "evicted": st.evicted,
        "layers": st.layers,
        "shards": [(s.file, s.entries) for s in st.shards],
        "records": rows,
        "kv": kv,
    }


def state_of(path) -> dict:
    with Store.open(path, read_only=True) as reader:
        return describe(reader)


def assert_clean(path):
    """What a writer's open leaves: no temporary files, no shard the commit
    does not name, entries.bin exactly the committed records, and those
    records hold what index.json says (no pending step left undone)."""
    path = Path(path)
    doc = json.loads((path / "index.json").read_text())
    names = sorted(p.name for p in path.iterdir())
    assert not [n for n in names if n.startswith(".hmem-tmp.")], names
    shard_files = sorted(n for n in names if n.startswith("shard_"))
    assert shard_files == sorted(s["file"] for s in doc["shards"])
    for s in doc["shards"]:
        assert (path / s["file"]).stat().st_size == s["bytes"]
    assert (path / "entries.bin").stat().st_size == doc["record_count"] * doc["record_size"]
    recs = hmem.formats.records.read(path / "entries.bin", doc["record_count"], HDC // 8)  # no pending applied
    assert not hmem.formats.records.damaged(recs).size
    # a reader applies what index.json still lists: it must see entries.bin as it is
    live = recs[recs["shard_idx"] != hmem.formats.records.EVICTED]
    with Store.open(path, read_only=True) as reader:
        assert [
            (e.entry_id, e.layer_idx, e.n_tokens, e.importance, e.created, e.access_count, e.shard_idx)
            for e in reader.entries()
        ] == [
            (
                int(r["entry_id"]),
                int(r["layer_idx"]),
                int(r["n_tokens"]),
                float(r["importance"]),
                int(r["timestamp"]),
                int(r["access_count"]),
                int(r["shard_idx"]),
            )
            for r in live
        ]
        assert reader.stats().evicted == len(recs) - len(live)


# ---- the bytes of a record and of index.json -----------------------------------------


def test_record_bytes_follow_the_documented_layout(tmp_path, read_index):
    rng = np.random.default_rng(1)
    keys = [gauss(rng, 3), gauss(rng, 1)]
    with Store.create(tmp_path / "s", embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=800) as store:
        store.put(keys[0], keys[0], layer_idx=7, importance=0.25)
        store.put(keys[1], keys[1], layer_idx=0xFFFFFFFF, importance=3.0)
        store.query(keys[1], 0xFFFFFFFF, 1)
        store.query(keys[1], 0xFFFFFFFF, 1)
    raw = (tmp_path / "s" / "entries.bin").read_bytes()
    assert len(raw) == 2 * RECORD
    expect = [(1, 7, 3, 0.25, 0, 0), (2, 0xFFFFFFFF, 1, 3.0, 2, 1)]
    for i, (eid, layer, n_tokens, imp, count, shard) in enumerate(expect):
        rec = raw[i * RECORD : (i + 1) * RECORD]
        assert struct.unpack_from("<Q", rec, 0)[0] == eid
        assert struct.unpack_from("<I", rec, 8)[0] == layer
        assert struct.unpack_from("<I", rec, 12)[0] == n_tokens
        assert struct.unpack_from("<f", rec, 16)[0] == imp
        stamp = struct.unpack_from("<Q", rec, 20)[0]
        assert abs(stamp / 1e9 - os.stat(tmp_path / "s" / "index.json").st_mtime) < 600
        assert struct.unpack_from("<I", rec, 28)[0] == count
        assert struct.unpack_from("<I", rec, 32)[0] == shard
        assert struct.unpack_from("<I", rec, 36)[0] == crc_kernels.crc32c(rec[:36] + rec[40:])
    doc = read_index(tmp_path / "s")
    assert doc["record_count"] == 2 and doc["record_size"] == RECORD


def test_index_json_fields_and_checksum(tmp_path, read_index, index_checksum):
    rng = np.random.default_rng(2)
    path = tmp_path / "s"
    store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, seed=3, shard_max_bytes=1000)
    generations = [read_index(path)["generation"]]
    keys = [gauss(rng, 2) for _ in range(5)]
    for k in keys:
        store.put(k, k, layer_idx=1)
    store.flush()
    generations.append(read_index(path)["generation"])
    store.query(keys[0], 1, 2)
    store.flush()
    generations.append(read_index(path)["generation"])
    store.flush()  # nothing to do: no commit
    generations.append(read_index(path)["generation"])
    store.close()
    generations.append(read_index(path)["generation"])
    assert generations[1] > generations[0] and generations[2] == generations[1] + 1
    assert generations[3] == generations[2]
    assert generations[4] >= generations[3]
    doc = read_index(path)
    text = json.loads((path / "index.json").read_text())
    stored = text.pop("checksum")
    assert stored == index_checksum(text) and stored.startswith("crc32c:") and len(stored) == 15
    assert doc["format"] == "hmem-store" and doc["format_version"] == 1
    assert doc["written_by"] == f"hmem {hmem.__version__}"
    assert doc["record_count"] == 5 and doc["next_entry_id"] == 6  # close commits the exact next id
    assert doc["projection"] == {"family": "srht", "generator": "splitmix64", "rounds": 3, "block": 64, "blocks": 4}
    assert len(doc["shards"]) >= 2
    for i, s in enumerate(doc["shards"]):
        assert set(s) == {"file", "bytes", "uid", "entries", "index_crc", "dead_entries", "dead_bytes"}
        assert s["file"] == f"shard_{i:04d}.safetensors"
        assert s["bytes"] == (path / s["file"]).stat().st_size
        assert s["dead_entries"] == 0 and s["dead_bytes"] == 0
        with safe_open(str(path / s["file"]), framework="numpy") as f:
            assert s["index_crc"] == crc_kernels.crc32c(f.get_tensor("hmem_index").tobytes())
            assert len(f.get_tensor("hmem_index")) == s["entries"] + 1
    assert sum(s["entries"] for s in doc["shards"]) == 5
    assert len({s["uid"] for s in doc["shards"]}) == len(doc["shards"])
    assert set(doc["pending"]) == {"record_updates", "renames", "deletes"}


def test_pending_record_updates_carry_the_new_access_counts(tmp_path, read_index, monkeypatch, store_internals):
    rng = np.random.default_rng(3)
    path = tmp_path / "s"
    store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC)
    keys = [gauss(rng, 2) for _ in range(4)]
    for k in keys:
        store.put(k, k)
    store.flush()
    store.query(keys[2], 0, 1)
    store.query(keys[2], 0, 1)
    store.query(keys[0], 0, 1)
    # stop the flush right after its commit: step 4 not done yet
    writes = []
    monkeypatch.setattr(_io, "write_pieces", lambda p, pieces: writes.append(pieces))
    store.flush()
    monkeypatch.undo()
    updates = read_index(path)["pending"]["record_updates"]
    assert updates["position"].tolist() == [0, 2]
    assert updates["access_count"].tolist() == [1, 2]
    assert updates["shard_idx"].tolist() == [0, 0]
    on_disk = hmem.formats.records.read(path / "entries.bin", 4, HDC // 8)
    assert on_disk["access_count"].tolist() == [0, 0, 0, 0]  # not yet written in place
    with Store.open(path, read_only=True) as reader:  # a reader applies them
        assert [e.access_count for e in reader.entries()] == [1, 0, 2, 0]
    # each update's checksum is the one of its record with the new fields
    updated = on_disk.copy()
    updated["access_count"][[0, 2]] = [1, 2]
    assert updates["checksum"].tolist() == hmem.formats.records.checksums(updated[[0, 2]]).tolist()
    store_internals.abandon_writer(store)  # drop the writer without letting it finish step 4
    Store.open(path).close()  # the next writer finishes step 4
    on_disk = hmem.formats.records.read(path / "entries.bin", 4, HDC // 8)
    assert on_disk["access_count"].tolist() == [1, 0, 2, 0]
    assert not hmem.formats.records.damaged(on_disk).size


def test_lock_file_names_its_holder(tmp_path):
    store = Store.create(tmp_path / "s", embed_dim=EMBED, hdc_dim=HDC)
    owner = json.loads((tmp_path / "s" / "lock").read_text())
    assert owner["pid"] == os.getpid() and owner["host"]
    store.close()
    assert (tmp_path / "s" / "lock").read_text() == ""


# ---- crash points ----------------------------------------------------------------------


_FLUSH_SCRIPT = """
import json, sys
import numpy as np
import hmem
store = hmem.Store.open({path!r})
rng = np.random.default_rng(99)
old = np.load({old!r})
for i in (0, 0, 2, 5):
    store.query(old[i], i % 2, 2)            # access counts of old entries change
ids = []
for i in range(9):
    k = rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32)
    ids.append(store.put(k, k * 2, layer_idx=i % 3, importance=i / 4))
store.query(old[1], 1, 1)
print(json.dumps(ids), flush=True)
store.flush()
print("flushed", flush=True)
store.close()
"""

CRASH_POINTS = [
    ("flush.shards_written", "old"),
    ("flush.records_written", "old"),
    ("flush.committed", "new"),
    ("flush.updates_written", "new"),
]


def _old_store(path: Path) -> np.ndarray:
    """A store with flushed entries over several shards and some access counts."""
    rng = np.random.default_rng(7)
    old = np.stack([gauss(rng, 2) for _ in range(6)])
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=1400) as store:
        for i, k in enumerate(old):
            store.put(k, -k, layer_idx=i % 2, importance=1.0 + i)
        store.query(old[3], 1, 1)
    np.save(path.parent / "old.npy", old)
    return old


@pytest.mark.parametrize("point,expect", CRASH_POINTS, ids=[p for p, _ in CRASH_POINTS])
def test_a_crash_during_flush_leaves_the_old_or_the_new_state(tmp_path, run_python, point, expect):
    path = tmp_path / "s"
    _old_store(path)
    old_state = state_of(path)
    assert old_state["entries"] == 6 and len(old_state["shards"]) >= 2
    # the state after the flush, from the same work done without a crash on a copy
    shutil.copytree(path, tmp_path / "copy")
    script = _FLUSH_SCRIPT.format(path=str(tmp_path / "copy"), old=str(tmp_path / "old.npy"))
    done = run_python(script, check=True)
    assert done.stdout.splitlines()[-1] == "flushed"
    new_state = state_of(tmp_path / "copy")
    assert new_state["entries"] == 15
    assert [r[4] for r in new_state["records"][:6]] != [r[4] for r in old_state["records"]]

    crashed = run_python(
        _FLUSH_SCRIPT.format(path=str(path), old=str(tmp_path / "old.npy")), env={"HMEM_CRASH_AT": point}
    )
    assert crashed.returncode == _io.CRASH_EXIT_CODE, crashed.stderr
    assert "flushed" not in crashed.stdout
    handed_out = json.loads(crashed.stdout.splitlines()[0])

    # a reader first (it must cope with the leftovers), then a writer
    expected = old_state if expect == "old" else new_state
    assert state_of(path) == expected
    store = Store.open(path)
    try:
        assert describe(store) == expected
    finally:
        store.close()
    assert_clean(path)
    assert state_of(path) == expected

    with Store.open(path) as store:
        k = np.full((2, EMBED), 0.25, F)
        eid = store.put(k, k, layer_idx=1)
        assert eid > max(handed_out)
        store.flush()
        (hit,) = store.query(k, 1, 1, rerank=False)
        assert hit.entry_id == eid and np.array_equal(hit.keys, k)
        assert store.stats().entries == expected["entries"] + 1
    assert_clean(path)
    after = state_of(path)
    assert after["records"][:-1] == expected["records"] and after["kv"][:-1] == expected["kv"]


def test_a_crash_leaves_nothing_a_reader_trips_on(tmp_path, run_python):
    # leftovers (a temporary file, an uncommitted shard, a torn record tail)
    # are invisible to a reader and removed by the next writer
    path = tmp_path / "s"
    _old_store(path)
    before = state_of(path)
    crashed = run_python(
        _FLUSH_SCRIPT.format(path=str(path), old=str(tmp_path / "old.npy")),
        env={"HMEM_CRASH_AT": "flush.records_written"},
    )
    assert crashed.returncode == _io.CRASH_EXIT_CODE
    doc = json.loads((path / "index.json").read_text())
    extra = sorted(p.name for p in path.glob("shard_*") if p.name not in {s["file"] for s in doc["shards"]})
    assert extra  # the crash left uncommitted shards behind
    assert (path / "entries.bin").stat().st_size > doc["record_count"] * RECORD
    (path / ".hmem-tmp.index.json.1234.0").write_bytes(b"half a commit")
    assert state_of(path) == before
    assert (path / ".hmem-tmp.index.json.1234.0").exists()  # a reader removes nothing
    Store.open(path).close()
    assert_clean(path)
    assert state_of(path) == before


@pytest.mark.stress
def test_truncating_an_uncommitted_tail_anywhere_recovers_the_committed_state(tmp_path, run_python):
    path = tmp_path / "s"
    _old_store(path)
    committed = state_of(path)
    crashed = run_python(
        _FLUSH_SCRIPT.format(path=str(path), old=str(tmp_path / "old.npy")),
        env={"HMEM_CRASH_AT": "flush.records_written"},
    )
    assert crashed.returncode == _io.CRASH_EXIT_CODE
    doc = json.loads((path / "index.json").read_text())
    committed_size = doc["record_count"] * RECORD
    full = (path / "entries.bin").read_bytes()
    assert len(full) == committed_size + 9 * RECORD
    for size in range(committed_size, len(full) + 1):  # every byte of the tail
        (path / "entries.bin").write_bytes(full[:size])
        with Store.open(path, read_only=True) as reader:
            assert describe(reader) == committed
        with Store.open(path) as writer:  # a writer cuts the tail
            assert describe(writer) == committed
        assert (path / "entries.bin").stat().st_size == committed_size
    assert_clean(path)
    with Store.open(path) as store:
        k = np.ones((1, EMBED), F)
        store.put(k, k)
    assert state_of(path)["entries"] == 7


@pytest.mark.parametrize("cut", [1, RECORD // 2, RECORD])
def test_a_truncated_committed_record_is_refused(tmp_path, cut):
    path = tmp_path / "s"
    _old_store(path)
    data = (path / "entries.bin").read_bytes()
    (path / "entries.bin").write_bytes(data[:-cut])
    for read_only in (True, False):
        with pytest.raises(hmem.CorruptStoreError):
            Store.open(path, read_only=read_only)
    (path / "entries.bin").write_bytes(data)
    Store.open(path).close()  # the failed writer let go of the lock


def test_a_flipped_bit_in_a_committed_record_is_refused(tmp_path):
    path = tmp_path / "s"
    rng = np.random.default_rng(4)
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC) as store:
        for _ in range(3):
            k = gauss(rng, 2)
            store.put(k, k)
    data = (path / "entries.bin").read_bytes()
    for offset in range(RECORD, 2 * RECORD):  # every byte of the second record
        bad = bytearray(data)
        bad[offset] ^= 1 << (offset % 8)
        (path / "entries.bin").write_bytes(bytes(bad))
        for read_only in (True, False):
            with pytest.raises(hmem.CorruptStoreError, match="checksum"):
                Store.open(path, read_only=read_only)
    (path / "entries.bin").write_bytes(data)
    with Store.open(path) as store:
        assert store.stats().entries == 3


@pytest.mark.parametrize(
    "damage", ["flip-keys", "flip-values", "flip-pooled", "flip-index", "truncate", "replace", "missing"]
)
def test_damaged_shard_data_is_never_returned(tmp_path, damage):
    path = tmp_path / "s"
    rng = np.random.default_rng(5)
    keys = [gauss(rng, 3) for _ in range(4)]
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC) as store:
        for k in keys:
            store.put(k, k + 1)
    shard = path / "shard_0000.safetensors"
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    if damage == "truncate":
        raw = raw[:-4]
    elif damage == "missing":
        raw = None
    elif damage == "replace":  # a valid shard of another store in its place
        other = tmp_path / "other"
        with Store.create(other, embed_dim=EMBED, hdc_dim=HDC) as o:
            for k in keys:
                o.put(k, k + 1)
        raw = bytearray((other / "shard_0000.safetensors").read_bytes())
    else:
        name = {"flip-keys": "k_2", "flip-values": "v_2", "flip-pooled": "p_2", "flip-index": "hmem_index"}[damage]
        start = 8 + n + header[name]["data_offsets"][0]
        raw[start + (8 * 12 + 5 if damage == "flip-index" else 5)] ^= 0x10  # index: entry 1's row
    if raw is None:
        shard.unlink()
    else:
        shard.write_bytes(bytes(raw))
    if damage == "flip-pooled":
        (path / "pooled.bin").unlink()  # else the re-rank takes the key from there, never reading the shard's
    for read_only in (True, False):
        with Store.open(path, read_only=read_only) as store:
            with pytest.raises((hmem.CorruptStoreError, hmem.StoreChangedError)):
                store.query(keys[1], 0, 4, rerank=damage == "flip-pooled")


def test_a_missing_entries_file_is_refused(tmp_path):
    path = tmp_path / "s"
    _old_store(path)
    (path / "entries.bin").unlink()
    for read_only in (True, False):
        with pytest.raises(hmem.CorruptStoreError):
            Store.open(path, read_only=read_only)


def test_access_counts_saturate_at_the_u32_limit(tmp_path):
    path = tmp_path / "s"
    k = np.ones((1, EMBED), F)
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC) as store:
        store.put(k, k)
    recs = hmem.formats.records.read(path / "entries.bin", 1, HDC // 8)
    recs["access_count"] = 0xFFFFFFFF - 1
    hmem.formats.records.seal(recs)
    (path / "entries.bin").write_bytes(recs.tobytes())
    with Store.open(path) as store:
        assert [store.query(k, 0, 1)[0].access_count for _ in range(3)] == [0xFFFFFFFF] * 3
    with Store.open(path, read_only=True) as reader:
        assert reader.query(k, 0, 1)[0].access_count == 0xFFFFFFFF


# ---- injected disk faults -----------------------------------------------------------------


def _prepared_writer(path: Path):
    rng = np.random.default_rng(6)
    store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=1400)
    keys = [gauss(rng, 2) for _ in range(8)]
    for i, k in enumerate(keys[:4]):
        store.put(k, k, layer_idx=i % 2)
    store.query(keys[0], 0, 1)
    store.flush()
    for i, k in enumerate(keys[4:]):
        store.put(k, k * 3, layer_idx=i % 2)  # spans a shard rollover
    store.query(keys[0], 0, 2)
    store.query(keys[1], 1, 1)
    return store, keys


class _Fault:
    def __init__(self, op: str, nth: int) -> None:
        self.op, self.nth, self.calls, self.fired = op, nth, 0, False
        self.index_replaced = False

    def __call__(self, op: str, path: str) -> None:
        if op == self.op and not self.fired:
            self.calls += 1
            if self.calls == self.nth:
                self.fired = True
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        if op == "rename" and os.path.basename(path).startswith(".hmem-tmp.index.json"):
            self.index_replaced = True


@pytest.mark.stress
@pytest.mark.parametrize("op", ["write", "fsync", "rename", "open"])
def test_a_failing_disk_during_flush_keeps_the_committed_state(tmp_path, op, store_internals):
    outcomes = []
    for nth in range(1, 60):
        path = tmp_path / f"{op}-{nth}"
        # the shards the puts fill are written by the flush's own wait for
        # them, in this thread: the n-th operation is the same one on every
        # run, however busy the machine (on their own thread, some may have
        # been written before the fault hook was in place, some not)
        with store_internals.seals_in_the_writers_thread():
            store, keys = _prepared_writer(path)
        try:
            old = state_of(path)
            fault = _Fault(op, nth)
            _io.set_fault_hook(fault)
            try:
                store.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                failed = True
            else:
                failed = False
            finally:
                _io.set_fault_hook(None)
            if not failed and not fault.fired:
                assert nth > 1  # the flush does this operation at least once
                new = describe(store)
                assert state_of(path) == new
                outcomes.append("ok")
                break
            if failed:
                # the store on disk still opens (the failing writer holds the lock)
                seen = state_of(path)
                with pytest.raises(hmem.StoreLockedError):
                    Store.open(path)
                # the disk is fine again: a retried flush stores everything
                store.flush()
            new = describe(store)
            assert new["entries"] == 8
            assert state_of(path) == new
            if not failed:
                # a shard's file whose fsync or rename failed on the seal's
                # path is written again from memory by the same flush
                outcomes.append("written-again")
            elif seen == old:
                outcomes.append("before-commit")
            else:
                # only once index.json was renamed into place (a later step
                # failed) may the new commit be visible
                assert fault.index_replaced and seen == new, f"{op} #{nth}"
                outcomes.append("after-commit")
            (hit,) = store.query(keys[6], 0, 1, count_access=False)
            assert np.array_equal(hit.keys, keys[6]) and np.array_equal(hit.values, keys[6] * 3)
            store.close()
            with Store.open(path) as again:
                assert describe(again) == new
            assert_clean(path)
        finally:
            _io.set_fault_hook(None)
            store.close()
    print(op, outcomes)
    assert outcomes[-1] == "ok" and "before-commit" in outcomes
    assert len(outcomes) >= 2


def _shard_files_cannot_be_written(op: str, path: str) -> None:
    """A disk full for shard files: every write of one fails with ENOSPC."""
    if op == "write" and os.path.basename(path).startswith(_io.TEMP_PREFIX + "shard_"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_a_failing_disk_during_put_rollover_loses_nothing_acknowledged(tmp_path):
    # A put that seals the open shard hits a full disk: the shard's file is
    # written on the seal's thread, which fails; the next put that must
    # wait for it writes it again from memory, fails too and raises (its
    # own entry not stored).  The store stays consistent, and once the disk
    # recovers the next put writes the shard and everything is flushed.
    path = tmp_path / "s"
    rng = np.random.default_rng(8)
    store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=1400)
    try:
        stored = {}
        for _ in range(2):
            k = gauss(rng, 2)
            stored[store.put(k, k)] = k
        k = gauss(rng, 2)
        _io.set_fault_hook(_shard_files_cannot_be_written)
        try:
            with pytest.raises(OSError) as caught:
                for _ in range(5):  # one of these seals the first shard, a later one waits for it
                    k = gauss(rng, 2)
                    stored[store.put(k, k)] = k
            assert caught.value.errno == errno.ENOSPC
        finally:
            _io.set_fault_hook(None)
        for _ in range(3):
            k = gauss(rng, 2)
            stored[store.put(k, k)] = k
        store.flush()
        assert store.stats().entries == len(stored)
        assert sum(s.entries for s in store.stats().shards) == len(stored)
        for eid, k in stored.items():
            hit = next(h for h in store.query(k, 0, 20, rerank=False, count_access=False) if h.entry_id == eid)
            assert np.array_equal(hit.keys, k)
        store.close()
        with Store.open(path) as again:
            assert again.stats().entries == len(stored)
            for eid, k in stored.items():
                hit = next(h for h in again.query(k, 0, 20, rerank=False, count_access=False) if h.entry_id == eid)
                assert np.array_equal(hit.keys, k) and np.array_equal(hit.values, k)
        assert_clean(path)
    finally:
        _io.set_fault_hook(None)
        store.close()


def test_a_failing_disk_during_a_put_many_rollover_leaves_no_orphan_tensors(tmp_path):
    import safetensors.numpy

    path = tmp_path / "s"
    rng = np.random.default_rng(9)
    store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=3000)  # two or three entries a shard
    try:
        k = gauss(rng, 2)
        stored = {store.put(k, k): k}
        batch = [gauss(rng, 2) for _ in range(6)]
        # The batch seals the open shard (its file fails on the seal's
        # thread), then a shard of its own, which waits for the first: its
        # file written again fails too, and the batch is taken back.
        _io.set_fault_hook(_shard_files_cannot_be_written)
        try:
            with pytest.raises(OSError) as caught:
                store.put_many([(b, b) for b in batch])
            assert caught.value.errno == errno.ENOSPC
        finally:
            _io.set_fault_hook(None)
        assert store.stats().entries == 1
        for _ in range(4):
            k = gauss(rng, 2)
            stored[store.put(k, k)] = k
        store.close()
        with Store.open(path) as again:
            st = again.stats()
            assert st.entries == len(stored)
            for eid, k in stored.items():  # what queries return is right...
                hit = next(h for h in again.query(k, 0, 20, rerank=False, count_access=False) if h.entry_id == eid)
                assert np.array_equal(hit.keys, k)
            owners: dict[int, int] = {}
            for sh in st.shards:
                names = safetensors.numpy.load_file(path / sh.file)
                for name in names:
                    if name.startswith("k_"):
                        owners[int(name[2:])] = owners.get(int(name[2:]), 0) + 1
            # ...but every entry's tensors must be in exactly one shard, and nothing else
            assert owners == dict.fromkeys(stored, 1)
            assert sum(sh.entries for sh in st.shards) == len(stored)
    finally:
        _io.set_fault_hook(None)
        store.close()
