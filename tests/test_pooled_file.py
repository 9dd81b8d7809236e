"""pooled.bin (hmem/formats/pooled.py): each record's pooled key beside it,
so that a re-rank reads one file instead of a shard per candidate.

Re-rank answers must not depend on the file: with it, without it, with
damaged, stale or foreign rows, the results are the same (ids and cosines,
bit for bit).  Format tests read and write the file's bytes directly, as
docs/format.md lays them out."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import hmem
from hmem.kernels.reference import checksum as ref_checksum

DIM, HDC = 8, 256
ROW = 12 + 4 * DIM  # docs/format.md, "Pooled keys"
ROW_DTYPE = np.dtype([("entry_id", "<u8"), ("checksum", "<u4"), ("key", "<f4", (DIM,))])


@pytest.fixture
def rng():
    return np.random.default_rng(21)


def fill(path, rng, n=60, flushes=3, **config):
    keys = rng.standard_normal((n, 3, DIM)).astype(np.float32)
    with hmem.Store.create(path, embed_dim=DIM, hdc_dim=HDC, **config) as store:
        for part in np.array_split(np.arange(n), flushes):
            store.put_many(hmem.Entry(keys[i], keys[i] + 1, 0) for i in part)
            store.flush()
    return keys


def answers(path, queries, **options):
    with hmem.Store.open(path, read_only=True) as store:
        return [
            [(r.entry_id, r.cosine, r.similarity) for r in store.query(q, 0, top_k=4, count_access=False, **options)]
            for q in queries
        ]


def rows_of(path):
    return np.fromfile(path / "pooled.bin", dtype=ROW_DTYPE)


def flip(shard, tensor: str) -> None:
    """Flip a bit of one tensor's bytes in a shard file."""
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start = 8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]
    raw[start] ^= 0x08
    shard.write_bytes(bytes(raw))


def crc_of(row) -> int:
    raw = row.tobytes()
    return ref_checksum.crc32c(raw[:8] + raw[12:])


def test_rows_hold_each_records_pooled_key_in_record_order(tmp_path, rng):
    keys = fill(tmp_path / "s", rng)
    rows = rows_of(tmp_path / "s")
    with hmem.Store.open(tmp_path / "s", read_only=True) as store:
        ids = store.entry_ids()
    assert rows["entry_id"].tolist() == ids
    # the pooled key is the float32 mean of the keys, summed in float64
    assert np.array_equal(rows["key"], keys.astype(np.float64).mean(axis=1).astype(np.float32))
    assert [int(r["checksum"]) for r in rows] == [crc_of(r) for r in rows]
    assert (tmp_path / "s" / "pooled.bin").stat().st_size == len(ids) * ROW


def test_answers_do_not_depend_on_the_file(tmp_path, rng):
    keys = fill(tmp_path / "s", rng)
    queries = [keys[i] + 0.1 for i in (0, 7, 33, 59)]
    want = answers(tmp_path / "s", queries)
    shutil.copytree(tmp_path / "s", tmp_path / "without")
    (tmp_path / "without" / "pooled.bin").unlink()  # a store from before pooled.bin
    assert answers(tmp_path / "without", queries) == want
    many = hmem.Store.open(tmp_path / "without", read_only=True)
    with many:
        got = many.query_many(queries, 0, top_k=4, count_access=False)
        assert [[(r.entry_id, r.cosine, r.similarity) for r in res] for res in got] == want


@pytest.mark.parametrize("damage", ["key-flipped", "other-id", "zeros", "truncated", "foreign-bytes"])
def test_unusable_rows_are_read_from_the_shards(tmp_path, rng, damage):
    keys = fill(tmp_path / "s", rng)
    queries = [keys[i] for i in range(0, 60, 6)]
    want = answers(tmp_path / "s", queries)
    path = tmp_path / "s" / "pooled.bin"
    rows = rows_of(tmp_path / "s")
    if damage == "key-flipped":
        raw = bytearray(path.read_bytes())
        for i in range(0, len(rows), 2):
            raw[i * ROW + 12 + 3] ^= 0x40
        path.write_bytes(bytes(raw))
    elif damage == "other-id":  # rows of another entry, correctly sealed: a stale file
        rows = np.roll(rows, 1)
        path.write_bytes(rows.tobytes())
    elif damage == "zeros":
        path.write_bytes(bytes(len(rows) * ROW))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: 5 * ROW + 7])
    else:
        path.write_bytes(os.urandom(len(rows) * ROW + 3))
    assert answers(tmp_path / "s", queries) == want


def test_a_stale_row_with_the_next_id_is_overwritten_before_its_commit(tmp_path, rng):
    # A flush cut short after writing pooled.bin leaves rows past the commit
    # whose entry ids the next puts are given again (their ids were never
    # committed).  The next writer cuts them off as it opens (and its flush
    # writes over that place before its commit in any case).
    fill(tmp_path / "s", rng, n=20, flushes=1)
    with hmem.Store.open(tmp_path / "s") as store:
        next_ids = np.arange(store.stats().next_entry_id, store.stats().next_entry_id + 10, dtype=np.uint64)
    stale = np.zeros(10, dtype=ROW_DTYPE)
    stale["entry_id"] = next_ids
    stale["key"] = 1000.0
    stale["checksum"] = [crc_of(r) for r in stale]
    with open(tmp_path / "s" / "pooled.bin", "ab") as f:
        f.write(stale.tobytes())
    more = rng.standard_normal((10, 3, DIM)).astype(np.float32)
    with hmem.Store.open(tmp_path / "s") as store:
        assert (tmp_path / "s" / "pooled.bin").stat().st_size == 20 * ROW
        ids = store.put_many(hmem.Entry(k, k, 0) for k in more)
    rows = rows_of(tmp_path / "s")
    by_id = dict(zip(rows["entry_id"].tolist(), rows["key"]))
    for entry_id, k in zip(ids, more):
        assert np.array_equal(by_id[entry_id], k.astype(np.float64).mean(axis=0).astype(np.float32))
    queries = [more[i] for i in range(10)]
    shutil.copytree(tmp_path / "s", tmp_path / "without")
    (tmp_path / "without" / "pooled.bin").unlink()
    assert answers(tmp_path / "s", queries) == answers(tmp_path / "without", queries)


def test_a_store_without_the_file_gains_rows_for_new_entries(tmp_path, rng):
    fill(tmp_path / "s", rng, n=30, flushes=1)
    (tmp_path / "s" / "pooled.bin").unlink()
    more = rng.standard_normal((5, 3, DIM)).astype(np.float32)
    with hmem.Store.open(tmp_path / "s") as store:
        ids = store.put_many(hmem.Entry(k, k, 0) for k in more)
    rows = rows_of(tmp_path / "s")
    assert len(rows) == 35
    assert rows["entry_id"][:30].tolist() == [0] * 30  # a hole: never used (its checksum fails)
    assert rows["entry_id"][30:].tolist() == ids
    with hmem.Store.open(tmp_path / "s") as store:
        assert [r.entry_id for r in store.query(more[2], 0, top_k=1)] == [ids[2]]
        store.compact()  # nothing to reclaim: compaction does not run, the hole stays
    assert len(rows_of(tmp_path / "s")) == 35


def test_compaction_and_repair_write_the_file_anew(tmp_path, rng):
    keys = fill(tmp_path / "s", rng, n=80, flushes=4)
    with hmem.Store.open(tmp_path / "s") as store:
        store.delete(list(range(1, 80, 3)))
        store.compact(min_dead_share=0.0)  # a third evicted: below the default share
        live = store.entry_ids()
    rows = rows_of(tmp_path / "s")
    assert rows["entry_id"].tolist() == live
    assert [int(r["checksum"]) for r in rows] == [crc_of(r) for r in rows]
    means = keys.astype(np.float64).mean(axis=1).astype(np.float32)
    assert np.array_equal(rows["key"], means[np.array(live) - 1])  # ids start at 1, in put order
    (tmp_path / "s" / "pooled.bin").write_bytes(b"junk")
    assert "pooled.partial" in {f.code for f in hmem.verify(tmp_path / "s").findings}
    flip(tmp_path / "s" / "shard_0000.safetensors", f"k_{live[0]}")  # damage: repair rewrites the store
    report = hmem.repair(tmp_path / "s")
    assert report.action == "rewritten" and report.dropped
    with hmem.Store.open(tmp_path / "s", read_only=True) as store:
        kept = store.entry_ids()
    assert kept == live[1:]
    rows = rows_of(tmp_path / "s")
    assert rows["entry_id"].tolist() == kept
    assert np.array_equal(rows["key"], means[np.array(kept) - 1])
    assert "pooled.partial" not in {f.code for f in hmem.verify(tmp_path / "s").findings}


def test_readers_see_rows_flushed_after_they_opened(tmp_path, rng):
    keys = fill(tmp_path / "s", rng, n=20, flushes=1)
    writer = hmem.Store.open(tmp_path / "s")
    with writer:
        first = answers(tmp_path / "s", [keys[3]])
        more = rng.standard_normal((30, 3, DIM)).astype(np.float32)
        writer.put_many(hmem.Entry(k, k, 0) for k in more)
        # the writer's own queries read unflushed keys from the open shard
        mine = [(r.entry_id, r.cosine) for r in writer.query(more[4], 0, top_k=3, count_access=False)]
        writer.flush()
        after = [(r.entry_id, r.cosine) for r in writer.query(more[4], 0, top_k=3, count_access=False)]
        assert after == mine
    assert answers(tmp_path / "s", [keys[3]])[0][0][0] == first[0][0][0]


def test_a_linked_file_is_not_followed(tmp_path, rng):
    keys = fill(tmp_path / "s", rng)
    queries = [keys[i] for i in (1, 2, 3)]
    want = answers(tmp_path / "s", queries)
    real = tmp_path / "s" / "pooled.bin"
    decoy = tmp_path / "decoy.bin"
    rows = rows_of(tmp_path / "s")
    rows["key"] = -rows["key"]  # sealed rows that would reverse every cosine
    rows["checksum"] = [crc_of(r) for r in rows]
    decoy.write_bytes(rows.tobytes())
    real.unlink()
    real.symlink_to(decoy)
    assert answers(tmp_path / "s", queries) == want  # read-only: the link is not followed
    with pytest.raises(hmem.UnsafeFileError):
        hmem.Store.open(tmp_path / "s")  # a writer refuses a store whose own file is a link


def test_a_damaged_shard_key_does_not_matter_while_the_file_holds_it(tmp_path, rng):
    keys = fill(tmp_path / "s", rng, n=10, flushes=1)
    want = answers(tmp_path / "s", [keys[4]])
    flip(tmp_path / "s" / "shard_0000.safetensors", "p_5")
    assert answers(tmp_path / "s", [keys[4]]) == want  # the key comes from pooled.bin: the shard's is not read
    with hmem.Store.open(tmp_path / "s", read_only=True) as store:
        # a query that skips damage reads every candidate's key from its shard
        found = store.query(keys[4], 0, top_k=4, on_damage="skip", count_access=False)
        assert 5 in [s.entry_id for s in found.skipped]
    (tmp_path / "s" / "pooled.bin").unlink()
    with hmem.Store.open(tmp_path / "s", read_only=True) as store, pytest.raises(hmem.CorruptStoreError, match="p_5"):
        store.query(keys[4], 0, top_k=4, count_access=False)
