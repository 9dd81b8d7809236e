"""Chunks through the public API (hmem/store/chunk_api.py, docs/format.md,
"Chunks"): entries put together under a key and found by it without a scan.

Each part is an ordinary entry (got, queried, listed), the key index is
rebuilt from the shards' metadata (reopen, compaction, repair), eviction and
deletion take a chunk whole, a crashed put leaves every key absent or whole,
a reader's refresh takes new keys, and threads read while one puts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

import hmem
from hmem import Store
from hmem.errors import EntryNotFoundError, InvalidArgumentError

D, HDC, TOKENS = 16, 256, 5
CONFIG = dict(embed_dim=D, hdc_dim=HDC, chunks=True)
HANG_GUARD = 120  # seconds: a join that reaches this has failed


# ---- the chunks the tests put --------------------------------------------------------------


def rows(seed: int, part: int, kind: str, dtype: str, tokens: int = TOKENS) -> np.ndarray:
    """Deterministic rows of one part: float32, or bf16 words (uint16) of finite values."""
    rng = np.random.default_rng([seed, part, kind == "v"])
    floats = rng.standard_normal((tokens, D)).astype(np.float32)
    if dtype == "bf16":
        return (floats.view(np.uint32) >> 16).astype(np.uint16)
    return floats


def chunk(seed: int, parts: int = 3, dtype: str = "f32", meta: dict | None = None, tokens: int = TOKENS) -> list:
    """The parts of chunk `seed`: part p on layer p, importance varying across parts."""
    out = []
    for p in range(parts):
        k, v = rows(seed, p, "k", dtype, tokens), rows(seed, p, "v", dtype, tokens)
        if dtype == "bf16":
            k, v = hmem.Bf16Rows(k), hmem.Bf16Rows(v)
        out.append(hmem.Entry(k, v, p, 0.5 + ((seed * 7 + p * 3) % 5) / 2, dict(meta or {})))
    return out


def check_chunk(store: Store, key: str, seed: int, parts: int = 3, dtype: str = "f32", tokens: int = TOKENS) -> None:
    """Store.chunks.get(key) gives chunk `seed`, part by part, bit-exact."""
    got = store.chunks.get(key)
    assert len(got) == parts, key
    ids = store.chunks.ids(key)
    assert ids is not None and [kv.entry_id for kv in got] == ids
    for p, kv in enumerate(got):
        assert kv.keys.tobytes() == rows(seed, p, "k", dtype, tokens).tobytes(), (key, p)
        assert kv.values.tobytes() == rows(seed, p, "v", dtype, tokens).tobytes(), (key, p)
        assert kv.meta is not None and (kv.meta["chunk_key"], kv.meta["part"], kv.meta["parts"]) == (key, p, parts)


def whole_or_gone(store: Store, ids: dict[str, list[int]]) -> dict[str, bool]:
    """Each key's chunk is either fully live or gone (never partly): {key: live}."""
    live_ids = set(store.entry_ids())
    keys = list(ids)
    held = store.chunks.contains(keys)
    out = {}
    for key, is_held in zip(keys, held):
        live = [i in live_ids for i in ids[key]]
        if is_held:
            assert all(live), (key, ids[key], live)
            assert store.chunks.ids(key) == ids[key]
        else:
            assert not any(live), (key, ids[key], live)
            assert store.chunks.ids(key) is None
        out[key] = is_held
    return out


def key_of(seed: int) -> str:
    return f"model@1@0@{seed:x}@bfloat16"


@pytest.fixture(params=["directory", "memory", "s3"])
def where(request, tmp_path, monkeypatch) -> str:
    """A fresh store location: a directory, memory:// and the local S3 server."""
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    if request.param == "memory":
        import uuid

        monkeypatch.setenv("HMEM_CACHE_DIR", str(tmp_path / "hmem-cache"))
        return f"memory://{uuid.uuid4().hex[:12]}/{request.node.originalname[:40]}"
    return str(tmp_path / "store")


def files(path: str | Path) -> dict[str, bytes]:
    root = Path(path)
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and p.name != "lock"}


# ---- put, look up, read ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_chunks_round_trip_and_each_part_is_an_ordinary_entry(where, dtype):
    seeds = [1, 2, 3]
    with Store.create(where, storage_dtype=dtype, **CONFIG) as store:
        plain = store.put_many([chunk(100, 1)[0]])  # an entry of no chunk beside them
        ids = store.chunks.put({key_of(s): chunk(s, 3, dtype, meta={"src": f"f{s}", "n": s}) for s in seeds})
        assert list(ids) == [key_of(s) for s in seeds]
        everything = [i for s in seeds for i in ids[key_of(s)]]
        assert len(set(everything)) == 9 and not set(everything) & set(plain)
        for s in seeds:
            key = key_of(s)
            assert ids[key] == list(range(ids[key][0], ids[key][0] + 3))  # consecutive, in part order
            assert store.chunks.ids(key) == ids[key]
            check_chunk(store, key, s, dtype=dtype)
        assert store.chunks.contains([key_of(2), "absent", key_of(1)]) == [True, False, True]
        assert store.chunks.ids("absent") is None
        with pytest.raises(EntryNotFoundError):
            store.chunks.get("absent")
        assert store.chunks.keys() == sorted(key_of(s) for s in seeds)
        listing = {info.key: info for info in store.chunks.listing()}
        assert {k: list(v.entry_ids) for k, v in listing.items()} == ids
        assert all(info.layers == (0, 1, 2) and info.n_tokens == TOKENS for info in listing.values())

        for s in seeds:
            for p, entry_id in enumerate(ids[key_of(s)]):
                got = store.get(entry_id)
                assert got.meta == {"src": f"f{s}", "n": s, "chunk_key": key_of(s), "part": p, "parts": 3}
                assert got.info.layer_idx == p
                if dtype == "f32":
                    assert got.keys.tobytes() == rows(s, p, "k", dtype).tobytes()
                else:  # widened exactly from the words put
                    widened = (rows(s, p, "k", dtype).astype(np.uint32) << 16).view(np.float32)
                    assert got.keys.tobytes() == widened.tobytes()
                query = got.keys
                found = store.query(query, p, top_k=1, count_access=False)
                assert [r.entry_id for r in found] == [entry_id]
                assert entry_id in {info.entry_id for info in store.entries(p)}
                assert entry_id in store.entry_ids(p)
        store.flush()
    with Store.open(where, read_only=True) as reader:
        for s in seeds:
            check_chunk(reader, key_of(s), s, dtype=dtype)


def test_a_key_already_held_is_skipped(tmp_path):
    with Store.create(tmp_path / "s", **CONFIG) as store:
        first = store.chunks.put({key_of(1): chunk(1)})
        before = store.entry_ids()
        again = store.chunks.put({key_of(1): chunk(9, parts=2), key_of(2): chunk(2)})
        assert again[key_of(1)] == first[key_of(1)]
        assert set(store.entry_ids()) == set(before) | set(again[key_of(2)])
        check_chunk(store, key_of(1), 1)  # the first chunk's bytes, not the skipped one's
        check_chunk(store, key_of(2), 2)
        only_held = store.chunks.put({key_of(2): chunk(8)})
        assert only_held == {key_of(2): again[key_of(2)]}
        assert len(store.entry_ids()) == 6


class _Twice(Mapping):
    """A mapping whose iteration names one key twice (what a dict cannot hold)."""

    def __init__(self, key: str, parts: list) -> None:
        self._key, self._parts = key, parts

    def __getitem__(self, key: str) -> list:
        if key != self._key:
            raise KeyError(key)
        return self._parts

    def __iter__(self) -> Iterator[str]:
        return iter([self._key, self._key])

    def __len__(self) -> int:
        return 2


def _bad_puts() -> list[tuple[str, object]]:
    reserved = [chunk(5, 2)[0], chunk(5, 2)[1]._replace(meta={"part": 7})]
    return [
        ("twice", _Twice(key_of(5), chunk(5))),
        ("empty key", {"": chunk(5)}),
        ("non-string key", {5: chunk(5)}),
        ("bytes key", {b"k": chunk(5)}),
        ("long key", {"k" * 1025: chunk(5)}),
        ("non-printable", {"a\nb": chunk(5)}),
        ("nul", {"a\x00b": chunk(5)}),
        ("reserved chunk_key", {key_of(5): [chunk(5, 1)[0]._replace(meta={"chunk_key": "x"})]}),
        ("reserved part", {key_of(5): reserved}),
        ("reserved parts", {key_of(5): [chunk(5, 1)[0]._replace(meta={"parts": 1})]}),
        ("no parts", {key_of(5): []}),
        ("not a mapping", [(key_of(5), chunk(5))]),
        # one bad tensor in the second chunk: the first, good one, is not stored either
        (
            "bad tensor",
            {
                key_of(6): chunk(6),
                key_of(5): [hmem.Entry(np.ones((3, D + 1), np.float32), np.ones((3, D + 1), np.float32))],
            },
        ),
        (
            "nan",
            {
                key_of(6): chunk(6),
                key_of(5): [hmem.Entry(np.full((3, D), np.nan, np.float32), np.ones((3, D), np.float32))],
            },
        ),
    ]


@pytest.mark.parametrize("name, chunks", _bad_puts(), ids=[name for name, _ in _bad_puts()])
def test_a_bad_put_raises_and_changes_nothing(tmp_path, name, chunks):
    path = tmp_path / "s"
    with Store.create(path, **CONFIG) as store:
        held = store.chunks.put({key_of(1): chunk(1)})
        store.flush()
        before_files, before_ids = files(path), store.entry_ids()
        with pytest.raises(hmem.HmemError) as raised:
            store.chunks.put(chunks)
        assert isinstance(raised.value, (InvalidArgumentError, hmem.InvalidTensorError)), raised.value
        assert str(raised.value)
        assert store.entry_ids() == before_ids
        assert store.chunks.keys() == [key_of(1)] and store.chunks.contains([key_of(5), key_of(6)]) == [False, False]
        assert store.stats().unflushed == 0
        assert files(path) == before_files
        assert store.chunks.put({key_of(2): chunk(2)})[key_of(2)] == [held[key_of(1)][-1] + 1 + i for i in range(3)]
    with Store.open(path, read_only=True) as reader:
        assert reader.chunks.keys() == [key_of(1), key_of(2)]


@pytest.mark.parametrize("bad", ["", 5, "k" * 1025, "a\tb"])
def test_look_ups_check_their_keys(tmp_path, bad):
    with Store.create(tmp_path / "s", **CONFIG) as store:
        store.chunks.put({key_of(1): chunk(1)})
        for call in (
            lambda: store.chunks.contains([bad]),
            lambda: store.chunks.ids(bad),
            lambda: store.chunks.get(bad),
            lambda: store.chunks.delete([bad]),
        ):
            with pytest.raises(InvalidArgumentError):
                call()
        assert store.chunks.keys() == [key_of(1)]


def test_a_store_made_without_chunks_refuses_them(tmp_path):
    path = tmp_path / "s"
    with Store.create(path, embed_dim=D, hdc_dim=HDC) as store:
        assert store.config.chunks is False
        store.put_many(chunk(1))
        store.flush()
        before_files, before_ids = files(path), store.entry_ids()
        with pytest.raises(InvalidArgumentError, match="chunks"):
            store.chunks.put({key_of(1): chunk(1)})
        assert store.entry_ids() == before_ids and store.stats().unflushed == 0
        assert files(path) == before_files
    with Store.open(path) as store:
        with pytest.raises(InvalidArgumentError, match="chunks"):
            store.chunks.put({key_of(1): chunk(1)})
    assert "chunks" not in json.loads((path / "index.json").read_text())["config"]  # older readers open it


def test_chunks_config_is_kept_and_checked(tmp_path):
    with pytest.raises(InvalidArgumentError):
        Store.create(tmp_path / "bad", embed_dim=D, hdc_dim=HDC, chunks="yes")
    Store.create(tmp_path / "s", **CONFIG).close()
    assert json.loads((tmp_path / "s" / "index.json").read_text())["config"]["chunks"] is True
    with Store.open(tmp_path / "s", read_only=True) as reader:
        assert reader.config.chunks is True and reader.chunks.keys() == []


# ---- persistence: reopen, compaction, repair ----------------------------------------------------


def test_the_key_index_is_rebuilt_when_the_store_is_opened_again(where):
    seeds = range(1, 9)
    with Store.create(where, shard_max_bytes=4 << 10, **CONFIG) as store:  # several shards
        ids = {}
        for s in seeds:
            ids.update(store.chunks.put({key_of(s): chunk(s, parts=1 + s % 3)}))
            if s % 3 == 0:
                store.flush()
        assert len(store.stats().shards) > 1
    for read_only in (True, False):
        with Store.open(where, read_only=read_only) as store:
            assert store.chunks.keys() == sorted(key_of(s) for s in seeds)
            for s in seeds:
                assert store.chunks.ids(key_of(s)) == ids[key_of(s)]
                check_chunk(store, key_of(s), s, parts=1 + s % 3)
    with Store.open(where) as store:  # a writer that opened it puts on after them
        more = store.chunks.put({key_of(50): chunk(50)})
        assert more[key_of(50)][0] > max(max(v) for v in ids.values())
        assert store.chunks.put({key_of(3): chunk(99)})[key_of(3)] == ids[key_of(3)]  # held, found in the shards


@pytest.mark.parametrize("repack", [False, True])
def test_keys_find_the_same_bytes_after_compaction(where, repack):
    with Store.create(where, shard_max_bytes=4 << 10, **CONFIG) as store:
        ids = store.chunks.put({key_of(s): chunk(s) for s in range(12)})
        store.flush()
        store.chunks.delete([key_of(s) for s in range(0, 12, 2)])
        report = store.compact(repack=repack)
        assert report.performed
        kept = list(range(1, 12, 2))
        for s in kept:
            assert store.chunks.ids(key_of(s)) == ids[key_of(s)]  # compaction keeps ids
            check_chunk(store, key_of(s), s)
        assert store.chunks.keys() == sorted(key_of(s) for s in kept)
    with Store.open(where, read_only=True) as reader:
        assert reader.chunks.keys() == sorted(key_of(s) for s in kept)
        for s in kept:
            check_chunk(reader, key_of(s), s)
        assert reader.chunks.contains([key_of(0)]) == [False]


@pytest.mark.parametrize("damage", ["removed", "flipped"])
def test_keys_find_the_same_bytes_after_repair_of_a_lost_index(tmp_path, damage):
    path = tmp_path / "s"
    with Store.create(path, shard_max_bytes=4 << 10, **CONFIG) as store:
        ids = store.chunks.put({key_of(s): chunk(s) for s in range(8)})
    index = path / "index.json"
    if damage == "removed":
        index.unlink()
    else:
        data = bytearray(index.read_bytes())
        data[len(data) // 2] ^= 0xFF
        index.write_bytes(bytes(data))
    with pytest.raises(hmem.HmemError):
        Store.open(path, read_only=True).close()
    report = hmem.repair(path)
    assert report.action != "none", report
    with Store.open(path) as store:
        assert store.config.chunks is True
        assert store.chunks.keys() == sorted(ids)
        for s in range(8):
            assert store.chunks.ids(key_of(s)) == ids[key_of(s)]
            check_chunk(store, key_of(s), s)
        store.chunks.put({key_of(20): chunk(20)})  # the repaired store takes chunks as before
    assert hmem.verify(path, full=True).ok


def _flip_tensor_byte(shard: Path, name: str) -> None:
    """Damage tensor `name` of a shard file (safetensors: 8-byte header size, JSON header, data)."""
    data = bytearray(shard.read_bytes())
    size = int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8 : 8 + size])[name]["data_offsets"]
    data[8 + size + start] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["last part", "shard"])
def test_a_chunk_that_lost_a_part_to_repair_is_absent(tmp_path, damage):
    path = tmp_path / "s"
    with Store.create(path, shard_max_bytes=4 << 10, **CONFIG) as store:  # two entries a shard
        ids = store.chunks.put({key_of(s): chunk(s) for s in range(4)})
    first, second = ids[key_of(0)], ids[key_of(1)]
    assert (first[-1], second[0]) == (3, 4)  # k0's last part shares a shard with k1's first
    shard = next(p for p in path.glob("shard_*.safetensors") if b'"v_3"' in p.read_bytes()[:4096])
    if damage == "last part":
        _flip_tensor_byte(shard, "v_3")  # entry 3 only: k1 stays whole
    else:
        shard.unlink()  # entries 3 and 4: a part of k0 and of k1
    hmem.repair(path)
    with Store.open(path) as store:
        live = set(store.entry_ids())
        assert 3 not in live
        gone = [key_of(0)] if damage == "last part" else [key_of(0), key_of(1)]
        for key in ids:
            if key in gone:
                assert store.chunks.contains([key]) == [False] and store.chunks.ids(key) is None
                with pytest.raises(EntryNotFoundError):
                    store.chunks.get(key)
                assert key not in store.chunks.keys()
            else:
                check_chunk(store, key, int(key.split("@")[3], 16))
        again = store.chunks.put({key_of(0): chunk(40)})  # the key takes a new chunk
        assert again[key_of(0)][0] > 12
        check_chunk(store, key_of(0), 40)
        store.evict(len(store.entry_ids()) - 1)  # eviction copes with the parts left without their chunk
        assert store.chunks.contains([key_of(0)]) in ([True], [False])


# ---- eviction and deletion take a chunk whole -----------------------------------------------


def test_evict_never_leaves_a_chunk_partly_live(tmp_path):
    with Store.create(tmp_path / "s", shard_max_bytes=8 << 10, **CONFIG) as store:
        ids = {}
        for s in range(20):
            ids.update(store.chunks.put({key_of(s): chunk(s, parts=1 + s % 4)}))
        plain = store.put_many([chunk(100 + i, 1)[0]._replace(importance=0.1 + i) for i in range(4)])
        for s in (3, 7, 11):  # accesses change the scores of some parts only
            store.query(rows(s, 0, "k", "f32"), 0, top_k=1)
        total = len(store.entry_ids())
        for target in (total - 1, total - 5, 30, 17, 9, 2, 0):
            plan = store.plan_eviction(target)
            evicted = store.evict(target)
            assert evicted == len(plan.entry_ids)
            if target == total - 1:  # the lowest score is an entry of no chunk: it goes alone
                assert plan.entry_ids == (plain[0],)
            live = store.entry_ids()
            assert len(live) <= target
            assert not set(plan.entry_ids) & set(live)
            whole_or_gone(store, ids)
        assert store.chunks.keys() == [] and store.entry_ids() == []
    with Store.open(tmp_path / "s", read_only=True) as reader:
        assert reader.chunks.keys() == [] and reader.chunks.contains(list(ids)) == [False] * len(ids)


def test_evict_takes_the_rest_of_a_chunk_one_part_of_which_scores_lowest(tmp_path):
    with Store.create(tmp_path / "s", **CONFIG) as store:
        low = [e._replace(importance=5.0) for e in chunk(1, parts=4)]
        low[2] = low[2]._replace(importance=0.01)  # one part scores lowest of all
        ids = store.chunks.put({key_of(1): low, key_of(2): [e._replace(importance=3.0) for e in chunk(2, parts=4)]})
        plan = store.plan_eviction(7)
        assert sorted(plan.entry_ids) == ids[key_of(1)]
        assert store.evict(7) == 4
        assert whole_or_gone(store, ids) == {key_of(1): False, key_of(2): True}
        check_chunk(store, key_of(2), 2, parts=4)


def test_deleting_one_part_deletes_its_chunk(where):
    with Store.create(where, **CONFIG) as store:
        ids = store.chunks.put({key_of(s): chunk(s) for s in range(3)})
        plain = store.put(rows(50, 0, "k", "f32"), rows(50, 0, "v", "f32"))
        plan = store.plan_delete([ids[key_of(1)][1]])
        assert sorted(plan.entry_ids) == ids[key_of(1)]
        done = store.delete([ids[key_of(1)][1]])
        assert sorted(done.entry_ids) == ids[key_of(1)] and done.missing == ()
        assert whole_or_gone(store, ids) == {key_of(0): True, key_of(1): False, key_of(2): True}
        with pytest.raises(EntryNotFoundError):
            store.chunks.get(key_of(1))
        with pytest.raises(EntryNotFoundError):
            store.get(ids[key_of(1)][0])
        assert plain in store.entry_ids()
        store.delete([plain])  # an entry of no chunk goes alone
        assert sorted(store.entry_ids()) == sorted(ids[key_of(0)] + ids[key_of(2)])
    with Store.open(where, read_only=True) as reader:
        assert reader.chunks.keys() == [key_of(0), key_of(2)]
        whole_or_gone(reader, ids)


def test_chunks_delete_with_missing_keys(tmp_path):
    path = tmp_path / "s"
    with Store.create(path, **CONFIG) as store:
        ids = store.chunks.put({key_of(s): chunk(s) for s in range(4)})
        store.flush()
        before_files, before_ids = files(path), store.entry_ids()
        with pytest.raises(EntryNotFoundError, match="absent"):
            store.chunks.delete([key_of(0), "absent", key_of(1)])
        assert store.entry_ids() == before_ids and files(path) == before_files
        assert store.chunks.keys() == sorted(ids)
        plan = store.chunks.delete([key_of(0), "absent", key_of(1)], missing_ok=True)
        assert sorted(plan.entry_ids) == sorted(ids[key_of(0)] + ids[key_of(1)])
        assert whole_or_gone(store, ids) == {key_of(0): False, key_of(1): False, key_of(2): True, key_of(3): True}
        with pytest.raises(EntryNotFoundError):  # deleted already
            store.chunks.delete([key_of(0)])
        assert store.chunks.delete([], missing_ok=False).entry_ids == ()
    with Store.open(path, read_only=True) as reader:  # durable when it returned
        assert reader.chunks.keys() == [key_of(2), key_of(3)]


def test_max_disk_bytes_evicts_whole_chunks(tmp_path):
    path = tmp_path / "s"
    with Store.create(path, max_disk_bytes=48 << 10, shard_max_bytes=8 << 10, **CONFIG) as store:
        ids: dict[str, list[int]] = {}
        for s in range(30):
            ids.update(store.chunks.put({key_of(s): chunk(s, parts=1 + s % 4, tokens=12)}))
            assert store.chunks.contains([key_of(s)]) == [True]  # the newest always stays
            whole_or_gone(store, ids)
            if s % 8 == 7:
                store.flush()
                # the limit holds, a shard a put was still sealing in the background counted whole
                assert store.size() <= 48 << 10
        held = whole_or_gone(store, ids)
        assert 0 < sum(held.values()) < len(ids)  # some went, whole
        assert store.stats().limits.evicted > 0
        for s in range(30):
            if held[key_of(s)]:
                check_chunk(store, key_of(s), s, parts=1 + s % 4, tokens=12)
    with Store.open(path, read_only=True) as reader:
        assert whole_or_gone(reader, ids) == held


def test_a_key_whose_chunk_went_names_the_chunk_put_again(tmp_path):
    path = tmp_path / "s"
    with Store.create(path, **CONFIG) as store:
        old = store.chunks.put({key_of(1): chunk(1), key_of(2): chunk(2)})
        store.flush()
        store.chunks.delete([key_of(1)])
        assert store.chunks.contains([key_of(1)]) == [False]
        new = store.chunks.put({key_of(1): chunk(11, parts=2)})
        assert new[key_of(1)][0] > max(old[key_of(2)]) and not set(new[key_of(1)]) & set(old[key_of(1)])
        check_chunk(store, key_of(1), 11, parts=2)
        store.evict(0)
        assert store.chunks.keys() == []
        third = store.chunks.put({key_of(1): chunk(21, parts=4)})
        check_chunk(store, key_of(1), 21, parts=4)
    for compacted in (False, True):  # the old chunks' metadata is in the shards until compaction
        with Store.open(path) as store:
            assert store.chunks.ids(key_of(1)) == third[key_of(1)]
            check_chunk(store, key_of(1), 21, parts=4)
            assert store.chunks.keys() == [key_of(1)]
            if not compacted:
                store.compact(repack=True)


# ---- crashes ----------------------------------------------------------------------------


CRASH_WRITER = """
import sys
import numpy as np
import hmem
from hmem import _io

D, TOKENS = {D}, {TOKENS}

def rows(seed, part, kind):
    rng = np.random.default_rng([seed, part, kind == "v"])
    return rng.standard_normal((TOKENS, D)).astype(np.float32)

def chunk(seed, parts):
    return [hmem.Entry(rows(seed, p, "k"), rows(seed, p, "v"), p, 1.0) for p in range(parts)]

record = {record!r}
if record:
    seen = []
    real = _io.crash_point
    def point(name):
        seen.append(name)
        real(name)
    _io.crash_point = point
store = hmem.Store.open({path!r})
for number, batch in enumerate({batches!r}):
    store.chunks.put({{"k%d" % s: chunk(s, 1 + s % 3) for s in batch}})
    if number == 1:  # a delete of one part (its flush commits the puts so far), then more puts
        store.delete([store.chunks.ids("k2")[1]])
store.flush()
store.close()
if record:
    print(" ".join(seen))
"""

CRASH_FLUSHED = [1, 2, 4]  # committed before the crashing run
CRASH_BATCHES = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]


def _crash_base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    with Store.create(base, shard_max_bytes=3 << 10, **CONFIG) as store:
        store.chunks.put({f"k{s}": chunk(s, 1 + s % 3) for s in CRASH_FLUSHED})
    return base


def _check_after_crash(path: Path, expect_all: bool) -> None:
    with Store.open(path) as store:  # a writer: finishes or drops what the crash left
        keys = [f"k{s}" for s in CRASH_FLUSHED + sum(CRASH_BATCHES, [])]
        held = dict(zip(keys, store.chunks.contains(keys)))
        assert held["k1"] and held["k4"], held  # committed before the run
        for key, is_held in held.items():
            s = int(key[1:])
            parts = 1 + s % 3
            ids = store.chunks.ids(key)
            if is_held:
                assert ids is not None and len(ids) == parts and set(ids) <= set(store.entry_ids())
                check_chunk(store, key, s, parts=parts)
            else:
                assert ids is None
                with pytest.raises(EntryNotFoundError):
                    store.chunks.get(key)
        if expect_all:
            assert all(held[k] for k in held if k != "k2") and not held["k2"]
        live = set(store.entry_ids())
        listed = {i for info in store.chunks.listing() for i in info.entry_ids}
        assert listed == live  # no part of a chunk left without its key, nor the reverse
    assert hmem.verify(path, full=True).ok


@pytest.mark.stress
def test_a_crash_at_any_point_of_a_put_and_flush_leaves_each_key_absent_or_whole(tmp_path, run_python):
    import shutil

    base = _crash_base(tmp_path)
    code = CRASH_WRITER.format(D=D, TOKENS=TOKENS, path=str(tmp_path / "run"), batches=CRASH_BATCHES, record=True)
    shutil.copytree(base, tmp_path / "run")
    reference = run_python(code, check=True)
    seen = reference.stdout.split()
    _check_after_crash(tmp_path / "run", expect_all=True)
    passes: dict[str, int] = {}
    for name in seen:
        passes[name] = passes.get(name, 0) + 1
    assert {"flush.committed", "delete.marked"} <= set(passes), passes
    crashes = 0
    for name, count in sorted(passes.items()):
        for n in range(1, count + 1):
            run = tmp_path / f"crash-{name}-{n}"
            shutil.copytree(base, run)
            proc = run_python(
                CRASH_WRITER.format(D=D, TOKENS=TOKENS, path=str(run), batches=CRASH_BATCHES, record=False),
                env={"HMEM_CRASH_AT": f"{name}:{n}"},
            )
            assert proc.returncode == 86, (name, n, proc.returncode, proc.stderr)
            _check_after_crash(run, expect_all=False)
            crashes += 1
    assert crashes >= 4


# ---- a reader's refresh --------------------------------------------------------------------


def test_a_reader_sees_new_keys_after_refresh(where):
    writer = Store.create(where, shard_max_bytes=4 << 10, **CONFIG)
    try:
        writer.chunks.put({key_of(1): chunk(1)})
        writer.flush()
        with Store.open(where, read_only=True) as reader:
            assert reader.refresh() is False  # nothing new
            held = reader.chunks.get(key_of(1))
            held_bytes = [kv.keys.tobytes() + kv.values.tobytes() for kv in held]
            writer.chunks.put({key_of(2): chunk(2), key_of(3): chunk(3)})
            assert reader.chunks.contains([key_of(2)]) == [False]  # put, not committed
            writer.flush()
            assert reader.chunks.contains([key_of(2), key_of(3)]) == [False, False]  # committed, not taken
            assert reader.chunks.keys() == [key_of(1)]
            assert reader.refresh() is True
            assert reader.chunks.contains([key_of(1), key_of(2), key_of(3)]) == [True, True, True]
            assert reader.chunks.keys() == [key_of(1), key_of(2), key_of(3)]
            check_chunk(reader, key_of(2), 2)
            assert reader.refresh() is False
            # what it read before the refresh is still readable and unchanged
            assert [kv.keys.tobytes() + kv.values.tobytes() for kv in held] == held_bytes
            check_chunk(reader, key_of(1), 1)

            # the writer deletes and compacts: the reader's old commit names shards that go
            writer.chunks.delete([key_of(2)])
            writer.compact(repack=True)
            held = reader.chunks.get(key_of(3))
            assert reader.chunks.contains([key_of(2)]) == [True]  # its commit still has it
            assert reader.refresh() is True
            assert reader.chunks.contains([key_of(2), key_of(3)]) == [False, True]
            assert [kv.keys.tobytes() for kv in held] == [rows(3, p, "k", "f32").tobytes() for p in range(3)]
            check_chunk(reader, key_of(3), 3)
            check_chunk(reader, key_of(1), 1)
    finally:
        writer.close()


def test_refresh_is_nothing_for_a_writer(tmp_path):
    with Store.create(tmp_path / "s", **CONFIG) as store:
        store.chunks.put({key_of(1): chunk(1)})
        store.flush()
        assert store.refresh() is False
        assert store.chunks.contains([key_of(1)]) == [True]


# ---- threads -----------------------------------------------------------------------------


def test_threads_read_chunks_while_one_puts_and_flushes(tmp_path):
    seeds = range(40)
    with Store.create(tmp_path / "s", shard_max_bytes=8 << 10, **CONFIG) as store:
        put: list[int] = []  # seeds whose put returned, in order
        done = threading.Event()
        errors: list[BaseException] = []
        reads = [0, 0]

        def writer() -> None:
            try:
                for s in seeds:
                    store.chunks.put({key_of(s): chunk(s, parts=1 + s % 3)})
                    put.append(s)
                    if s % 4 == 3:
                        store.flush()
            except BaseException as exc:  # reported by the test
                errors.append(exc)
            finally:
                done.set()

        def reader(slot: int) -> None:
            try:
                while True:
                    finished = done.is_set()
                    known = len(put)
                    # every key, also those being put: a key is held only once its chunk reads whole
                    held = store.chunks.contains([key_of(s) for s in seeds] + ["never"])
                    assert held[:known] == [True] * known and held[-1] is False
                    for s in [s for s in seeds if held[s]][-3:] + [s for s in seeds[known : known + 2] if held[s]]:
                        check_chunk(store, key_of(s), s, parts=1 + s % 3)
                        reads[slot] += 1
                    if finished:
                        return
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_GUARD)
        assert not any(thread.is_alive() for thread in threads)
        assert not errors, errors
        assert all(reads)
        assert store.chunks.keys() == sorted(key_of(s) for s in seeds)


# ---- read_into: a chunk straight into the caller's buffers -------------------------------------------


@pytest.mark.parametrize("flushed", [True, False])
def test_read_into_fills_the_callers_buffers_bit_exact(tmp_path, flushed):
    path = tmp_path / "s"
    with Store.create(path, **CONFIG) as store:
        store.chunks.put({key_of(1): chunk(1, parts=3), key_of(2): chunk(2, parts=2)})
        if flushed:
            store.flush()
        stored = store.chunks.get(key_of(1))
        keys_out = [np.zeros_like(part.keys) for part in stored]
        values_out = [np.zeros_like(part.values) for part in stored]
        store.chunks.read_into(key_of(1), keys_out, values_out)
        for part, k, v in zip(stored, keys_out, values_out):
            assert np.array_equal(k, part.keys) and np.array_equal(v, part.values)


def test_read_into_refuses_wrong_buffers_and_unknown_keys(tmp_path):
    path = tmp_path / "s"
    with Store.create(path, **CONFIG) as store:
        store.chunks.put({key_of(1): chunk(1, parts=2)})
        store.flush()
        part = store.chunks.get(key_of(1))[0]
        good = [np.zeros_like(part.keys) for _ in range(2)]
        with pytest.raises(hmem.InvalidArgumentError, match="2 parts"):
            store.chunks.read_into(key_of(1), good[:1], good[:1])
        with pytest.raises(hmem.InvalidArgumentError, match="bytes"):
            store.chunks.read_into(key_of(1), [np.zeros(3, np.uint8)] * 2, good)
        with pytest.raises(hmem.InvalidArgumentError, match="writable"):
            store.chunks.read_into(key_of(1), [bytes(part.keys.nbytes)] * 2, good)
        wide = np.zeros((part.keys.shape[0], 2 * part.keys.shape[1]), dtype=part.keys.dtype)
        with pytest.raises(hmem.InvalidArgumentError, match="contiguous"):  # every other column: not one run
            store.chunks.read_into(key_of(1), [wide[:, ::2]] * 2, good)
        assert not wide.any()
        with pytest.raises(hmem.EntryNotFoundError):
            store.chunks.read_into(key_of(9), good, good)


def test_read_into_a_damaged_tensor_raises(tmp_path):
    path = tmp_path / "s"
    with Store.create(path, **CONFIG) as store:
        store.chunks.put({key_of(1): chunk(1, parts=2)})
        ids = store.chunks.ids(key_of(1))
        shape = store.chunks.get(key_of(1))[0].keys
    shard = next(path.glob("shard_*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-200] ^= 0x01  # inside the last tensor data (the last part's values)
    shard.write_bytes(bytes(data))
    with Store.open(path, read_only=True) as reader:
        out = [np.zeros_like(shape) for _ in ids]
        with pytest.raises(hmem.CorruptStoreError, match="checksum"):
            reader.chunks.read_into(key_of(1), out, [np.zeros_like(shape) for _ in ids])


@pytest.mark.parametrize("mapped", [True, False])
def test_read_into_reads_the_readers_commit_after_a_writer_compacts(tmp_path, mapped):
    """A reader that has not refreshed reads its own commit: a shard file
    compaction replaced under the same name is not read in its place (its
    tensors lie elsewhere and would fail their checksums)."""
    path = tmp_path / "s"
    writer = Store.create(path, shard_max_bytes=4 << 10, **CONFIG)
    try:
        writer.chunks.put({key_of(s): chunk(s) for s in range(8)})
        writer.flush()
        with Store.open(path, read_only=True) as reader:
            if mapped:  # the reader's shard files are open before the compaction
                for s in range(8):
                    check_chunk(reader, key_of(s), s)
            names = {p.name: p.stat().st_ino for p in path.glob("shard_*.safetensors")}
            writer.chunks.delete([key_of(s) for s in range(0, 8, 2)])
            assert writer.compact(repack=True).performed
            replaced = {
                p.name
                for p in path.glob("shard_*.safetensors")
                if names.get(p.name, p.stat().st_ino) != p.stat().st_ino
            }
            assert replaced, "compaction wrote no shard under a name the reader's commit uses"
            for s in range(1, 8, 2):
                parts = reader.chunks.get(key_of(s)) if mapped else None
                keys_out = [np.zeros((TOKENS, D), np.float32) for _ in range(3)]
                values_out = [np.zeros((TOKENS, D), np.float32) for _ in range(3)]
                try:
                    reader.chunks.read_into(key_of(s), keys_out, values_out)
                except hmem.StoreChangedError:
                    assert not mapped  # a file it never opened is gone: it must take the newest commit
                    assert reader.refresh() is True
                    reader.chunks.read_into(key_of(s), keys_out, values_out)
                for p in range(3):
                    assert keys_out[p].tobytes() == rows(s, p, "k", "f32").tobytes(), (s, p)
                    assert values_out[p].tobytes() == rows(s, p, "v", "f32").tobytes(), (s, p)
                    if parts is not None:
                        assert parts[p].keys.tobytes() == keys_out[p].tobytes()
    finally:
        writer.close()
