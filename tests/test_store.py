"""The store engine's API behaviour (README.md, docs/format.md): config, create and
open, ids, signatures, put and query, K/V exactness, access counts, shards,
the open-shard bound, flush and reopen, bad input, INT8 storage, the lock.

On-disk format details and crash safety are in tests/test_store_format.py;
the randomized model check is tests/test_store_statemachine.py.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

import hmem
from hmem import Entry, Store, StoreConfig
from hmem.kernels import checksum as crc_kernels
from hmem.kernels.reference import hamming as ref_hamming
from hmem.kernels.reference import projection as ref_projection

MiB = 1 << 20


def gauss(rng: np.random.Generator, n: int, d: int = 16, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((n, d)) * scale).astype(np.float32)


def same_bytes(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def projected_values(keys: np.ndarray, embed_dim: int, hdc_dim: int, seed: int) -> np.ndarray:
    """The float64 value of every output coordinate before the sign test,
    following docs/format.md step by step with the reference's pieces."""
    m = max(64, 1 << (embed_dim - 1).bit_length())
    blocks = -(-hdc_dim // m)
    signs = np.unpackbits(ref_projection.signs_table(seed, m, 3, blocks), bitorder="little").astype(bool)
    s = np.zeros(m)
    for row in keys.astype(np.float64):
        s[:embed_dim] += row
    out = []
    for b in range(blocks):
        v = s.copy()
        for r in range(3):
            flip = signs[(b * 3 + r) * m : (b * 3 + r + 1) * m]
            v[flip] = -v[flip]
            ref_projection.fwht(v)
        out.append(v)
    return np.concatenate(out)[:hdc_dim]


def live_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


# ---- StoreConfig ------------------------------------------------------------------


def test_config_defaults():
    cfg = StoreConfig(embed_dim=64)
    assert cfg.embed_dim == 64
    assert cfg.hdc_dim == 4096
    assert cfg.seed == 0
    assert cfg.max_entries == 0
    assert cfg.max_disk_bytes == 0
    assert cfg.shard_max_bytes == 256 * MiB
    assert cfg.max_open_shards == 256
    assert cfg.quantize_stored is False
    assert cfg.signature_bytes == 512


BAD_CONFIGS = [
    dict(embed_dim=0),
    dict(embed_dim=-1),
    dict(embed_dim=1.5),
    dict(embed_dim=16.0),
    dict(embed_dim="16"),
    dict(embed_dim=None),
    dict(embed_dim=True),
    dict(embed_dim=16, hdc_dim=0),
    dict(embed_dim=16, hdc_dim=100),
    dict(embed_dim=16, hdc_dim=63),
    dict(embed_dim=16, hdc_dim=4095),
    dict(embed_dim=16, hdc_dim=-64),
    dict(embed_dim=16, hdc_dim=4096.0),
    dict(embed_dim=16, hdc_dim=True),
    dict(embed_dim=16, seed=-1),
    dict(embed_dim=16, seed=1 << 64),
    dict(embed_dim=16, seed=True),
    dict(embed_dim=16, seed=0.5),
    dict(embed_dim=16, max_entries=-1),
    dict(embed_dim=16, max_entries=False),
    dict(embed_dim=16, max_entries=1.0),
    dict(embed_dim=16, max_disk_bytes=-1),
    dict(embed_dim=16, max_disk_bytes=True),
    dict(embed_dim=16, shard_max_bytes=0),
    dict(embed_dim=16, shard_max_bytes=-5),
    dict(embed_dim=16, shard_max_bytes=True),
    dict(embed_dim=16, max_open_shards=0),
    dict(embed_dim=16, max_open_shards=-1),
    dict(embed_dim=16, max_open_shards=True),
    dict(embed_dim=16, quantize_stored=1),
    dict(embed_dim=16, quantize_stored="yes"),
    dict(embed_dim=16, quantize_stored=None),
]


@pytest.mark.parametrize("kwargs", BAD_CONFIGS, ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_config_refuses_invalid_values(kwargs, tmp_path):
    with pytest.raises(hmem.InvalidArgumentError) as info:
        StoreConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    bad = [k for k in kwargs if k != "embed_dim"] or ["embed_dim"]
    assert bad[0] in str(info.value)  # the message names the setting
    # Store.create with the same settings refuses too and leaves no store behind.
    with pytest.raises(hmem.InvalidArgumentError):
        Store.create(tmp_path / "s", **kwargs)
    assert not (tmp_path / "s").exists()


def test_config_accepts_numpy_integers_and_limits():
    cfg = StoreConfig(embed_dim=np.int64(8), hdc_dim=np.uint16(64), seed=(1 << 64) - 1)
    assert (cfg.embed_dim, cfg.hdc_dim, cfg.seed) == (8, 64, (1 << 64) - 1)
    assert type(cfg.embed_dim) is int and type(cfg.hdc_dim) is int


def test_create_refuses_config_and_settings_together(tmp_path):
    with pytest.raises(hmem.InvalidArgumentError):
        Store.create(tmp_path / "a", StoreConfig(embed_dim=16), hdc_dim=256)
    with pytest.raises(hmem.InvalidArgumentError):
        Store.create(tmp_path / "b", {"embed_dim": 16})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_config_is_saved_and_used_on_reopen(tmp_path, ref_signature, store_internals):
    cfg = StoreConfig(
        embed_dim=24,
        hdc_dim=512,
        seed=12345,
        max_entries=1000,
        max_disk_bytes=10**9,
        shard_max_bytes=9999,
        max_open_shards=3,
        quantize_stored=True,
    )
    rng = np.random.default_rng(1)
    keys = gauss(rng, 3, 24)
    with Store.create(tmp_path / "s", cfg) as store:
        assert store.config == cfg
        store.put(keys, keys)
    saved = json.loads((tmp_path / "s" / "index.json").read_text())["config"]
    assert saved == {
        "embed_dim": 24,
        "hdc_dim": 512,
        "seed": 12345,
        "max_entries": 1000,
        "max_disk_bytes": 10**9,
        "shard_max_bytes": 9999,
        "max_open_shards": 3,
        "quantize_stored": True,
    }
    with Store.open(tmp_path / "s") as store:
        assert store.config == cfg
        assert store.stats().config == cfg
        assert store_internals.shard_map_limit(store) == 3  # max_open_shards is applied, not only kept
        # the reopened store projects with the saved seed and hdc_dim
        other = gauss(rng, 2, 24)
        store.put(other, other)
        (hit,) = store.query(other, 0, 1, rerank=False)
        assert hit.similarity == 1.0
        assert hit.keys.shape == (2, 24)
        assert np.abs(hit.keys - other).max() <= np.abs(other).max() / 127  # quantized, as saved
    with Store.open(tmp_path / "s", read_only=True) as reader:
        assert reader.config == cfg
    rec = hmem.formats.records.read(tmp_path / "s" / "entries.bin", 2, 64)
    assert same_bytes(rec["signature"][0], ref_signature(keys, 24, 512, 12345))
    assert same_bytes(rec["signature"][1], ref_signature(other, 24, 512, 12345))
    assert not same_bytes(rec["signature"][0], ref_signature(keys, 24, 512, 0))


# ---- create and open ----------------------------------------------------------------------


def test_create_makes_index_entries_and_lock(tmp_path):
    path = tmp_path / "nested" / "store"
    store = Store.create(path, embed_dim=16, hdc_dim=256)
    try:
        assert sorted(live_files(path)) == ["entries.bin", "index.json", "lock"]
        assert (path / "entries.bin").stat().st_size == 0
        doc = json.loads((path / "index.json").read_text())
        assert doc["format"] == "hmem-store" and doc["format_version"] == 1
        assert doc["record_count"] == 0 and doc["shards"] == [] and doc["next_entry_id"] == 1
        assert doc["record_size"] == 40 + 256 // 8
        assert doc["projection"] == {"family": "srht", "generator": "splitmix64", "rounds": 3, "block": 64, "blocks": 4}
        assert store.stats().entries == 0 and store.stats().shards == []
        assert not store.read_only
    finally:
        store.close()


def test_create_in_an_existing_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with Store.create(tmp_path / "empty", embed_dim=8, hdc_dim=64) as store:
        store.put(np.ones((1, 8), np.float32), np.ones((1, 8), np.float32))
    with Store.open(tmp_path / "empty") as store:
        assert store.stats().entries == 1


def test_create_refuses_an_existing_store_or_a_non_empty_directory(tmp_path, snapshot_dir):
    Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256).close()
    before = snapshot_dir(tmp_path / "s")
    with pytest.raises(hmem.StoreExistsError):
        Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    with pytest.raises(hmem.StoreExistsError):
        Store.create(tmp_path / "s", embed_dim=32)
    assert snapshot_dir(tmp_path / "s") == before

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(hmem.StoreExistsError):
        Store.create(tmp_path / "busy", embed_dim=16)
    assert sorted(os.listdir(tmp_path / "busy")) == ["notes.txt"]

    (tmp_path / "afile").write_text("x")
    with pytest.raises(hmem.PathError, match="is a file, not a store directory"):  # a bad path, exit code 10
        Store.create(tmp_path / "afile", embed_dim=16)
    assert (tmp_path / "afile").read_text() == "x"


def test_open_refuses_what_is_not_a_store(tmp_path):
    with pytest.raises(hmem.NotAStoreError):
        Store.open(tmp_path / "missing")
    with pytest.raises(hmem.NotAStoreError):
        Store.open(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "plain").mkdir()
    for read_only in (False, True):
        with pytest.raises(hmem.NotAStoreError):
            Store.open(tmp_path / "plain", read_only=read_only)
    assert os.listdir(tmp_path / "plain") == []  # no lock file made in a non-store
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "index.json").write_text(json.dumps({"format": "something-else", "format_version": 1}))
    with pytest.raises(hmem.NotAStoreError):
        Store.open(tmp_path / "other")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(hmem.PathError, match="is a file, not a store directory"):  # a bad path, exit code 10
        Store.open(tmp_path / "afile")


@pytest.mark.parametrize("read_only", [False, True])
def test_open_refuses_a_lock_wait_that_is_not_a_duration(tmp_path, read_only):
    with Store.create(tmp_path / "s", embed_dim=16) as s:
        s.put(np.ones((2, 16), np.float32), np.ones((2, 16), np.float32))
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "s").iterdir())
    for bad in (float("nan"), -1.0, "5", True, None):
        with pytest.raises(hmem.InvalidArgumentError, match="lock_wait"):
            Store.open(tmp_path / "s", read_only=read_only, lock_wait=bad)
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "s").iterdir()) == before
    with Store.open(tmp_path / "s", read_only=read_only, lock_wait=float("inf")) as s:  # no limit: free at once
        assert len(s.entry_ids()) == 1


@pytest.mark.parametrize("version", [2, 0, "1", None, 1.5])
def test_open_refuses_an_unknown_format_version(tmp_path, rewrite_index, version):
    Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256).close()
    rewrite_index(tmp_path / "s", lambda doc: doc.update(format_version=version))
    for read_only in (False, True):
        with pytest.raises(hmem.UnsupportedFormatError):
            Store.open(tmp_path / "s", read_only=read_only)
    # the lock was let go: restoring the version makes the store usable again
    rewrite_index(tmp_path / "s", lambda doc: doc.update(format_version=1))
    Store.open(tmp_path / "s").close()


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["config"].update(future_setting=1),
        lambda doc: doc["config"].update(hdc_dim=100),
        lambda doc: doc["projection"].update(rounds=4),
        lambda doc: doc["projection"].update(family="dense-gaussian"),
        lambda doc: doc["projection"].update(generator="mt19937"),
    ],
    ids=["unknown-setting", "bad-hdc-dim", "rounds", "family", "generator"],
)
def test_open_refuses_settings_or_a_projection_it_cannot_honour(tmp_path, rewrite_index, edit):
    Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256).close()
    rewrite_index(tmp_path / "s", edit)
    for read_only in (False, True):
        with pytest.raises(hmem.UnsupportedFormatError):
            Store.open(tmp_path / "s", read_only=read_only)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "checksum", "field", "empty", "not-utf8"])
def test_open_refuses_a_damaged_index(tmp_path, damage):
    with Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256) as store:
        store.put(np.ones((2, 16), np.float32), np.ones((2, 16), np.float32))
    path = tmp_path / "s" / "index.json"
    text = path.read_text()
    if damage == "garbage":
        path.write_text("{this is not json")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "checksum":
        doc = json.loads(text)
        doc["checksum"] = "crc32c:00000000" if doc["checksum"] != "crc32c:00000000" else "crc32c:00000001"
        path.write_text(json.dumps(doc))
    elif damage == "field":  # a changed field without a recomputed checksum
        doc = json.loads(text)
        doc["record_count"] = 0
        path.write_text(json.dumps(doc))
    elif damage == "empty":
        path.write_text("")
    else:
        path.write_bytes(b"\xff\xfe\x00garbage")
    for read_only in (False, True):
        with pytest.raises(hmem.CorruptStoreError):
            Store.open(tmp_path / "s", read_only=read_only)


def test_closed_store_refuses_use_and_close_is_idempotent(store_factory):
    store = store_factory()
    k = np.ones((1, 16), np.float32)
    store.put(k, k)
    store.close()
    store.close()
    for call in (lambda: store.put(k, k), lambda: store.query(k, 0), store.flush, store.stats):
        with pytest.raises(hmem.StoreClosedError):
            call()
    reader = Store.open(store.path, read_only=True)
    reader.close()
    with pytest.raises(hmem.StoreClosedError):
        reader.query(k, 0)


def test_context_manager_flushes_and_releases(tmp_path):
    k = np.arange(32, dtype=np.float32).reshape(2, 16)
    with Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256) as store:
        eid = store.put(k, k + 1)
    with Store.open(tmp_path / "s") as store:  # the lock was released
        (hit,) = store.query(k, 0, 1)
        assert hit.entry_id == eid and same_bytes(hit.values, k + 1)


# ---- entry ids ----------------------------------------------------------------------


def test_ids_strictly_increase_and_are_never_reused(tmp_path):
    rng = np.random.default_rng(2)
    ids: list[int] = []

    def one(store):
        k = gauss(rng, 2)
        return store.put(k, k, layer_idx=int(rng.integers(0, 3)))

    def many(store, n):
        return store.put_many([Entry(gauss(rng, 1), gauss(rng, 1), int(rng.integers(0, 3)), 1.0) for _ in range(n)])

    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    ids += [one(store), one(store)]
    ids += many(store, 3)
    store.flush()
    ids += [one(store)]
    ids += many(store, 2)
    assert store.put_many([]) == []
    store.close()
    assert ids == list(range(1, 9))
    for _round in range(3):
        store = Store.open(tmp_path / "s")
        assert store.stats().next_entry_id == ids[-1] + 1
        ids += [one(store)]
        ids += many(store, 2)
        store.flush()
        ids += [one(store)]
        store.close()
    assert ids == sorted(set(ids)) and ids[0] == 1
    with Store.open(tmp_path / "s", read_only=True) as reader:
        recs = hmem.formats.records.read(tmp_path / "s" / "entries.bin", len(ids), 32)
        assert recs["entry_id"].tolist() == ids
        assert reader.stats().entries == len(ids)


_CRASH_PUTS = """
import json, os, sys
import numpy as np
import hmem, hmem.store.writer
lease = int(sys.argv[1]) if len(sys.argv) > 1 else 0
path = {path!r}
store = hmem.Store.open(path)
if {lease}:
    hmem.store.writer.ID_LEASE = {lease}
rng = np.random.default_rng(5)
ids = []
for i in range({n}):
    k = rng.standard_normal((2, 16)).astype(np.float32)
    if i % 3 == 2:
        ids += store.put_many([(k, k, 0, 1.0), (k, k, 1, 2.0)])
    else:
        ids.append(store.put(k, k, layer_idx=i % 2))
print(json.dumps(ids), flush=True)
os._exit(0)  # dies without flush or close
"""


@pytest.mark.parametrize("lease", [0, 3], ids=["default-lease", "tiny-lease"])
def test_ids_handed_out_before_a_crash_are_never_reused(tmp_path, run_python, lease):
    path = tmp_path / "s"
    with Store.create(path, embed_dim=16, hdc_dim=256) as store:
        k = np.ones((1, 16), np.float32)
        flushed = [store.put(k, k), store.put(k, k)]
    proc = run_python(_CRASH_PUTS.format(path=str(path), lease=lease, n=10))
    assert proc.returncode == 0, proc.stderr
    crashed = json.loads(proc.stdout)
    assert len(crashed) == 13 and crashed == sorted(set(crashed)) and crashed[0] > flushed[-1]
    with Store.open(path) as store:
        assert store.stats().entries == 2  # the unflushed puts are gone
        new = store.put(k, k)
        assert new > max(crashed)
        more = store.put_many([(k, k), (k, k)])
        assert more[0] > new and more[1] > more[0]
    with Store.open(path) as store:
        assert store.put(k, k) > more[1]


def test_a_bulk_import_reserves_ids_in_few_commits(tmp_path):
    """Each id reservation is a commit of index.json (two fsyncs): 100,000
    entries in batches of 1,000 take a handful of them, their number
    growing with the log of the ids handed out, not one per batch or two."""
    k = np.ones((1, 16), np.float32)
    with Store.create(tmp_path / "s", embed_dim=16, hdc_dim=128) as store:
        before = store.stats().generation
        ids: list[int] = []
        for _ in range(100):
            ids += store.put_many([(k, k, 0, 1.0)] * 1000)
        commits = store.stats().generation - before
        reserved = store.stats().next_entry_id
        assert ids == list(range(ids[0], ids[0] + 100_000))
    assert commits <= 6  # room 4096, then as many again as handed out (20 commits before)
    assert reserved > ids[-1]
    with Store.open(tmp_path / "s") as store:
        assert store.stats().next_entry_id == ids[-1] + 1  # a clean close gives back the spare ids
        assert store.stats().entries == 100_000


# ---- signatures -------------------------------------------------------------------------


_SIG_IN_SUBPROCESS = """
import numpy as np
from hmem.store.projection import Projector
import hmem
rows = np.random.default_rng(77).standard_normal((5, 40)).astype(np.float32)
print(Projector(40, 1024, 987654321).signature(rows).tobytes().hex())
with hmem.Store.create({path!r}, embed_dim=40, hdc_dim=1024, seed=987654321) as s:
    s.put(rows, rows)
"""


def test_signature_is_the_same_in_another_process_and_after_reopen(tmp_path, run_python, ref_signature, read_records):
    proc = run_python(_SIG_IN_SUBPROCESS.format(path=str(tmp_path / "child")), check=True)
    rows = np.random.default_rng(77).standard_normal((5, 40)).astype(np.float32)
    expected = ref_signature(rows, 40, 1024, 987654321)
    assert proc.stdout.strip() == expected.tobytes().hex()
    with Store.create(tmp_path / "mine", embed_dim=40, hdc_dim=1024, seed=987654321) as store:
        store.put(rows, rows)
        store.put(rows * 2, rows)
    mine, child = read_records(tmp_path / "mine"), read_records(tmp_path / "child")
    assert same_bytes(mine["signature"][0], child["signature"][0])
    assert same_bytes(mine["signature"][0], expected)
    assert same_bytes(mine["signature"][1], expected)  # scale does not change a signature
    with Store.open(tmp_path / "mine") as store:
        store.put(rows, rows)
    assert same_bytes(read_records(tmp_path / "mine")["signature"][2], expected)


def test_zero_keys_give_an_all_zero_signature(store_factory, read_records):
    store = store_factory(hdc_dim=512)
    zero = np.zeros((3, 16), np.float32)
    negzero = -zero
    store.put(zero, zero)
    store.put(negzero, zero)
    store.put(np.ones((3, 16), np.float32), zero)
    (hit, *_) = store.query(zero, 0, 3, rerank=False)
    assert hit.entry_id == 1 and hit.similarity == 1.0
    store.flush()
    sigs = read_records(store.path)["signature"]
    assert not sigs[0].any() and not sigs[1].any()
    assert sigs[2].any()


def test_signature_bits_are_packed_lsb_first(store_factory, read_records, ref_signature):
    rng = np.random.default_rng(3)
    keys = gauss(rng, 4, 16)
    store = store_factory(hdc_dim=256, seed=42)
    store.put(keys, keys)
    store.flush()
    sig = read_records(store.path)["signature"][0]
    assert same_bytes(sig, ref_signature(keys, 16, 256, 42))
    v = projected_values(keys, 16, 256, 42)
    assert np.all(v != 0)  # so the sign test is unambiguous
    bits = np.array([(sig[j // 8] >> (j % 8)) & 1 for j in range(256)], dtype=bool)
    assert np.array_equal(bits, v > 0)
    assert not np.array_equal(np.unpackbits(sig, bitorder="big").astype(bool), v > 0)


def test_similarity_of_identical_and_negated_keys(store_factory):
    rng = np.random.default_rng(4)
    store = store_factory(hdc_dim=1024, seed=9)
    checked = 0
    for _ in range(6):
        keys = gauss(rng, 3, 16)
        if not np.all(projected_values(keys, 16, 1024, 9) != 0):
            continue  # the exact-zero case is covered by the zero-key test
        layer = checked
        store.put(keys, keys, layer_idx=layer)
        store.put(-keys, keys, layer_idx=layer)
        hits = store.query(keys, layer, 2, rerank=False)
        assert [h.similarity for h in hits] == [1.0, 0.0]
        assert [h.score for h in hits] == [1.0, 0.0]
        assert hits[0].entry_id < hits[1].entry_id
        (neg,) = store.query(-keys, layer, 1, rerank=False)
        assert neg.entry_id == hits[1].entry_id and neg.similarity == 1.0
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize("embed_dim,hdc_dim", [(1, 64), (3, 192), (64, 64), (65, 320), (200, 64), (200, 576)])
def test_signatures_for_any_embed_and_hdc_dims(tmp_path, ref_signature, read_records, embed_dim, hdc_dim):
    # the block size m and the block count need not divide anything evenly
    rng = np.random.default_rng(embed_dim * 1000 + hdc_dim)
    keys = [gauss(rng, int(rng.integers(1, 4)), embed_dim) for _ in range(4)]
    with Store.create(tmp_path / "s", embed_dim=embed_dim, hdc_dim=hdc_dim, seed=embed_dim) as store:
        ids = [store.put(k, k) for k in keys]
        for _eid, k in zip(ids, keys):
            assert store.query(k, 0, 1, rerank=False)[0].similarity == 1.0
    recs = read_records(tmp_path / "s")
    assert recs.dtype.itemsize == 40 + hdc_dim // 8
    for rec, k in zip(recs, keys):
        assert same_bytes(rec["signature"], ref_signature(k, embed_dim, hdc_dim, embed_dim))


# ---- query -------------------------------------------------------------------------------


@pytest.mark.parametrize("rerank", [True, False])
@pytest.mark.parametrize("flushed", [False, True])
def test_query_with_an_entrys_own_keys_returns_it_first(store_factory, rerank, flushed):
    rng = np.random.default_rng(5)
    store = store_factory(hdc_dim=512)
    keys = [gauss(rng, int(rng.integers(1, 6))) for _ in range(25)]
    ids = store.put_many([(k, gauss(rng, len(k)), 0, 1.0) for k in keys])
    if flushed:
        store.flush()
    for eid, k in zip(ids, keys):
        hits = store.query(k, 0, 3, rerank=rerank, count_access=False)
        assert hits[0].entry_id == eid
        assert hits[0].similarity == 1.0
        if rerank:
            assert hits[0].cosine == pytest.approx(1.0, abs=1e-6)
        # a one-token query with the mean of the keys has the same signature
        mean = k.astype(np.float64).mean(axis=0).astype(np.float32)
        assert store.query(mean, 0, 1, rerank=rerank, count_access=False)[0].entry_id == eid


def test_layers_are_searched_separately(store_factory):
    rng = np.random.default_rng(6)
    store = store_factory()
    layers = [0, 1, 2, 7, 2**32 - 1]
    by_layer: dict[int, list[int]] = {layer: [] for layer in layers}
    shared = gauss(rng, 2)
    for i in range(30):
        layer = layers[i % len(layers)]
        k = shared if i % 4 == 0 else gauss(rng, 2)
        by_layer[layer].append(store.put(k, k, layer_idx=layer))
    for _flushed in (False, True):
        for layer in layers:
            for rerank in (True, False):
                hits = store.query(shared, layer, 100, rerank=rerank)
                assert sorted(h.entry_id for h in hits) == by_layer[layer]
                assert all(h.layer_idx == layer for h in hits)
        assert store.query(shared, 3, 5) == []
        assert store.query(shared, 2**32 - 2, 5) == []
        assert store.stats().layers == dict.fromkeys(layers, 6)
        store.flush()


def test_empty_store_returns_nothing(store_factory):
    store = store_factory()
    q = np.ones(16, np.float32)
    assert store.query(q, 0, 5) == []
    assert store.query(q, 0, 5, rerank=False) == []
    store.flush()
    assert store.query(q, 0, 1) == []


@pytest.mark.parametrize("rerank", [True, False])
def test_top_k_bounds_and_order(store_factory, rerank):
    rng = np.random.default_rng(7)
    store = store_factory()
    for _ in range(3):
        k = gauss(rng, 2)
        store.put(k, k)
    q = gauss(rng, 1)
    full = store.query(q, 0, 10, rerank=rerank, count_access=False)
    assert len(full) == 3
    scores = [h.score for h in full]
    assert scores == sorted(scores, reverse=True)
    for k in (1, 2, 3):
        part = store.query(q, 0, k, rerank=rerank, count_access=False)
        assert [h.entry_id for h in part] == [h.entry_id for h in full[:k]]


def test_a_huge_top_k_returns_every_entry(store_factory):
    rng = np.random.default_rng(26)
    store = store_factory()
    for _ in range(3):
        k = gauss(rng, 2)
        store.put(k, k)
    for top_k in (10**6, 2**40, 2**64):
        for rerank in (True, False):
            assert len(store.query(k, 0, top_k, rerank=rerank, count_access=False)) == 3


@pytest.mark.parametrize("rerank", [True, False])
def test_ties_go_to_the_lower_entry_id(tmp_path, rerank):
    rng = np.random.default_rng(8)
    dup = gauss(rng, 3)
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    dup_ids = []
    for i in range(12):
        if i % 3 == 1:
            dup_ids.append(store.put(dup, gauss(rng, 3)))
        else:
            k = gauss(rng, 3)
            store.put(k, k)
        if i == 5:
            store.flush()  # duplicates on both sides of a flush
    for reopen in (False, True):
        if reopen:
            store.close()
            store = Store.open(tmp_path / "s")
        hits = store.query(dup, 0, len(dup_ids), rerank=rerank, count_access=False)
        assert [h.entry_id for h in hits] == dup_ids
        assert len({h.score for h in hits}) == 1
        # a narrower top_k keeps the lowest ids
        hits = store.query(dup, 0, 2, rerank=rerank, count_access=False)
        assert [h.entry_id for h in hits] == dup_ids[:2]
    store.close()


def test_zero_vectors_rank_without_nan(store_factory):
    rng = np.random.default_rng(27)
    store = store_factory()
    zero = np.zeros((2, 16), F)
    ids = [store.put(zero if i % 3 == 0 else gauss(rng, 2), gauss(rng, 2)) for i in range(12)]
    store.flush()
    for q in (zero, gauss(rng, 1)):
        hits = store.query(q, 0, 5)
        assert len(hits) == 5
        assert all(np.isfinite(h.score) and np.isfinite(h.cosine) for h in hits)
        for h in hits:
            if h.entry_id in ids[::3]:
                assert h.cosine == 0.0  # a zero pooled key has cosine 0, not NaN
        keyed = [(-h.score, h.entry_id) for h in hits]
        assert keyed == sorted(keyed)
    hits = store.query(zero, 0, 5)
    assert all(h.cosine == 0.0 for h in hits)  # a zero query: every cosine 0, lower ids first
    assert [h.entry_id for h in hits] == sorted(h.entry_id for h in hits)


def test_results_outlive_close(tmp_path):
    rng = np.random.default_rng(28)
    k = gauss(rng, 3)
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    store.put(k, k * 2)
    store.flush()
    (hit,) = store.query(k, 0, 1)
    store.close()
    assert same_bytes(hit.keys, k) and same_bytes(hit.values, k * 2)  # the map lives with the array


def test_rerank_false_ranks_by_signature_similarity(store_factory, ref_signature):
    rng = np.random.default_rng(9)
    store = store_factory(hdc_dim=256, seed=3)
    base = gauss(rng, 1)
    keys, ids = [], []
    for i in range(60):
        # near copies of a common direction: many equal distances
        k = base + gauss(rng, 2, scale=0.5 if i % 2 else 2.0)
        if i % 7 == 0 and keys:
            k = keys[-1]
        keys.append(k)
        ids.append(store.put(k, k, layer_idx=i % 2))
    sigs = np.stack([ref_signature(k, 16, 256, 3) for k in keys])
    layer_of = np.array([i % 2 for i in range(60)])
    for trial in range(6):
        q = base + gauss(rng, 3, scale=1.0)
        layer = trial % 2
        mine = np.flatnonzero(layer_of == layer)
        d = ref_hamming.distances(ref_signature(q, 16, 256, 3), sigs[mine])
        expected = [ids[mine[j]] for j in np.lexsort((mine, d))]
        for top_k in (1, 5, 30, 100):
            hits = store.query(q, layer, top_k, rerank=False, count_access=False)
            assert [h.entry_id for h in hits] == expected[:top_k]
            for h in hits:
                dist = d[list(mine).index(ids.index(h.entry_id))]
                assert h.similarity == h.score == 1 - dist / 256
                assert h.cosine is None
        if trial == 2:
            store.flush()


def test_rerank_orders_a_signature_shortlist_by_pooled_cosine(store_factory, ref_signature):
    rng = np.random.default_rng(10)
    store = store_factory(hdc_dim=256, seed=1)
    base = gauss(rng, 1)
    keys = [base + gauss(rng, int(rng.integers(1, 4)), scale=0.8) for _ in range(50)]
    ids = store.put_many([(k, k) for k in keys])
    pooled = np.stack([k.mean(axis=0, dtype=np.float64).astype(np.float32) for k in keys]).astype(np.float64)
    sigs = np.stack([ref_signature(k, 16, 256, 1) for k in keys])
    store.flush()
    for _trial in range(5):
        q = base + gauss(rng, 2, scale=0.8)
        target = q.mean(axis=0, dtype=np.float64)
        cos = pooled @ target / (np.linalg.norm(pooled, axis=1) * np.linalg.norm(target))
        d = ref_hamming.distances(ref_signature(q, 16, 256, 1), sigs)
        for top_k, factor in ((3, 4), (5, 2), (4, 1)):
            shortlist = np.lexsort((np.arange(50), d))[: top_k * factor]
            hits = store.query(q, 0, top_k, shortlist_factor=factor, count_access=False)
            assert len(hits) == top_k
            got = [ids.index(h.entry_id) for h in hits]
            assert set(got) <= set(shortlist.tolist())
            for h, j in zip(hits, got):
                assert h.score == h.cosine
                assert h.cosine == pytest.approx(cos[j], abs=1e-9)
                assert h.similarity == 1 - d[j] / 256
            scores = [h.score for h in hits]
            assert scores == sorted(scores, reverse=True)
            rest = [j for j in shortlist if j not in got]
            if rest:
                assert min(cos[got]) >= max(cos[rest]) - 1e-9


def test_result_fields(tmp_path):
    rng = np.random.default_rng(11)
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256, shard_max_bytes=2000)
    t0 = time.time_ns()
    k1, v1 = gauss(rng, 3), gauss(rng, 3)
    e1 = store.put(k1, v1, layer_idx=4, importance=0.3)
    k2, v2 = gauss(rng, 5), gauss(rng, 5)
    e2 = store.put(k2, v2, layer_idx=4, importance=np.float32(2.5))
    t1 = time.time_ns()
    for round_ in range(3):
        if round_ == 1:
            store.flush()
        if round_ == 2:
            store.close()
            store = Store.open(tmp_path / "s")
        (hit,) = store.query(k1, 4, 1)
        assert hit.entry_id == e1 and hit.layer_idx == 4
        assert hit.n_tokens == 3
        assert hit.importance == float(np.float32(0.3))
        assert t0 <= hit.timestamp <= t1
        assert hit.access_count == round_ + 1
        assert hit.similarity == 1.0 and hit.score == hit.cosine == pytest.approx(1.0)
        assert hit.shard_idx == 0
        assert same_bytes(hit.keys, k1) and same_bytes(hit.values, v1)
        (hit2,) = store.query(k2, 4, 1, rerank=False)
        assert hit2.entry_id == e2 and hit2.n_tokens == 5 and hit2.importance == 2.5
        assert hit2.cosine is None and hit2.score == hit2.similarity == 1.0
        assert hit2.shard_idx == 1  # the second entry did not fit the first shard
        assert same_bytes(hit2.keys, k2) and same_bytes(hit2.values, v2)
    stamps = hmem.formats.records.read(tmp_path / "s" / "entries.bin", 2, 32)["timestamp"]
    assert stamps[0] == hit.timestamp
    store.close()


# ---- K/V exactness -------------------------------------------------------------------


def test_float32_round_trip_is_bit_exact(tmp_path):
    rng = np.random.default_rng(12)
    specials = np.array(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1.1754942e-38,
            3.4028235e38,
            -3.4028235e38,
            1.0,
            -1.0,
            0.1,
            np.pi,
            65504.0,
            1e-30,
            -7.0,
            2.0**-126,
            123456.789,
        ],
        dtype=np.float32,
    )
    entries = [(gauss(rng, n, scale=s), gauss(rng, n, scale=s)) for n, s in ((1, 1.0), (7, 1e-20), (33, 1e30))]
    entries.append((specials.reshape(1, 16), specials[::-1].reshape(1, 16).copy()))
    entries.append((np.asfortranarray(gauss(rng, 4)), gauss(rng, 8)[::2]))  # non-contiguous input
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    ids = [store.put(k, v) for k, v in entries]

    def check(store):
        for eid, (k, v) in zip(ids, entries):
            hits = store.query(k, 0, len(ids), rerank=False, count_access=False)
            hit = next(h for h in hits if h.entry_id == eid)
            assert hit.keys.dtype == np.float32 and hit.values.dtype == np.float32
            assert np.array_equal(hit.keys, k) and np.array_equal(hit.values, v)
            assert hit.keys.tobytes() == np.ascontiguousarray(k).tobytes()
            assert hit.values.tobytes() == np.ascontiguousarray(v).tobytes()

    check(store)  # from memory
    store.flush()
    check(store)  # from the shard
    store.close()
    with Store.open(tmp_path / "s") as store:
        check(store)
    with Store.open(tmp_path / "s", read_only=True) as store:
        check(store)


def test_stored_data_does_not_alias_the_callers_arrays(store_factory):
    rng = np.random.default_rng(13)
    store = store_factory()
    big = gauss(rng, 8)
    keys, values = big[:4], big[4:]  # C-contiguous views of the caller's buffer
    saved_k, saved_v = keys.copy(), values.copy()
    eid = store.put(keys, values)
    assert keys.flags.writeable and big.flags.writeable  # the caller's arrays stay the caller's
    big[:] = 0.0
    (hit,) = store.query(saved_k, 0, 1, count_access=False)
    assert hit.entry_id == eid
    assert same_bytes(hit.keys, saved_k) and same_bytes(hit.values, saved_v)
    store.flush()
    (hit,) = store.query(saved_k, 0, 1, count_access=False)
    assert same_bytes(hit.keys, saved_k) and same_bytes(hit.values, saved_v)


def test_results_of_unflushed_entries_stay_valid_after_more_puts(store_factory):
    # a result taken before a flush keeps its K/V while later puts fill the next shard
    rng = np.random.default_rng(25)
    store = store_factory(shard_max_bytes=3000)
    k, v = gauss(rng, 4), gauss(rng, 4)
    store.put(k, v)
    (early,) = store.query(k, 0, 1, count_access=False)
    store.flush()
    for _ in range(20):
        other = gauss(rng, 4)
        store.put(other, other * 3)
    (mid,) = store.query(other, 0, 1, count_access=False)
    store.flush()
    for _ in range(20):
        store.put(gauss(rng, 4), gauss(rng, 4))
    store.flush()
    assert same_bytes(early.keys, k) and same_bytes(early.values, v)
    assert same_bytes(mid.keys, other) and same_bytes(mid.values, other * 3)


def test_float16_and_float64_inputs_become_float32(store_factory):
    rng = np.random.default_rng(14)
    store = store_factory()
    k16 = gauss(rng, 3).astype(np.float16)
    v16 = gauss(rng, 3).astype(np.float16)
    k64 = rng.standard_normal((2, 16))
    v64 = rng.standard_normal((2, 16)) * 1e-3
    e16 = store.put(k16, v16)
    e64 = store.put(k64, v64)
    store.flush()
    (h16,) = store.query(k16.astype(np.float32), 0, 1, count_access=False)
    assert h16.entry_id == e16 and h16.keys.dtype == np.float32
    assert same_bytes(h16.keys, k16.astype(np.float32)) and same_bytes(h16.values, v16.astype(np.float32))
    assert np.array_equal(h16.keys.astype(np.float16), k16)  # float16 -> float32 is exact
    (h64,) = store.query(k64, 0, 1, count_access=False)
    assert h64.entry_id == e64 and h64.values.dtype == np.float32
    assert same_bytes(h64.keys, k64.astype(np.float32)) and same_bytes(h64.values, v64.astype(np.float32))
    kbe = gauss(rng, 2).astype(">f4")  # big-endian float32: same numbers, native order on disk
    ebe = store.put(kbe, kbe)
    (hbe,) = store.query(kbe.astype(np.float32), 0, 1, count_access=False)
    assert hbe.entry_id == ebe and same_bytes(hbe.keys, kbe.astype(np.float32))


def test_returned_arrays_are_read_only(store_factory):
    rng = np.random.default_rng(15)
    store = store_factory()
    k = gauss(rng, 2)
    store.put(k, k)
    # before the flush: whatever comes back, changing it does not change the store
    (hit,) = store.query(k, 0, 1)
    if hit.keys.flags.writeable:
        hit.keys[0, 0] = 99.0
    store.flush()
    (hit,) = store.query(k, 0, 1)
    assert same_bytes(hit.keys, k)
    # committed data: read-only views of the shard's memory map, not copies
    for arr in (hit.keys, hit.values):
        assert not arr.flags.writeable and not arr.flags.owndata
        with pytest.raises(ValueError):
            arr[0, 0] = 1.0
    assert same_bytes(store.query(k, 0, 1)[0].keys, k)


def test_torch_tensors_in_and_out(store_factory):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(16)
    store = store_factory()
    k32 = torch.from_numpy(gauss(rng, 3))
    kbf = torch.from_numpy(gauss(rng, 2)).to(torch.bfloat16)
    k16 = torch.from_numpy(gauss(rng, 4)).to(torch.float16)
    ids = [store.put(k, k) for k in (k32, kbf, k16)]
    store.flush()
    for eid, k in zip(ids, (k32, kbf, k16)):
        exact = k.float()
        (hit,) = store.query(exact, 0, 1, framework="torch", count_access=False)
        assert hit.entry_id == eid
        assert isinstance(hit.keys, torch.Tensor) and hit.keys.dtype == torch.float32
        assert torch.equal(hit.keys, exact) and torch.equal(hit.values, exact)
        (np_hit,) = store.query(exact.numpy(), 0, 1, count_access=False)
        assert isinstance(np_hit.keys, np.ndarray) and same_bytes(np_hit.keys, exact.numpy())
    with pytest.raises(hmem.InvalidTensorError):
        store.put(torch.ones((2, 16), dtype=torch.int32), torch.ones((2, 16), dtype=torch.int32))


def test_threads_share_a_store(store_factory):
    import threading

    store = store_factory(shard_max_bytes=2000)
    found: dict[int, np.ndarray] = {}
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for i in range(25):
                k = gauss(rng, 2)
                eid = store.put(k, k, layer_idx=seed)
                found[eid] = k
                if i % 5 == 0:
                    store.query(k, seed, 2)
                if i == 12 and seed == 0:
                    store.flush()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(found) == list(range(1, 101))
    assert store.stats().layers == {0: 25, 1: 25, 2: 25, 3: 25}
    store.flush()
    for eid, k in found.items():
        hits = store.query(k, 0, 1, count_access=False) + [
            h for layer in (1, 2, 3) for h in store.query(k, layer, 1, count_access=False)
        ]
        assert any(h.entry_id == eid and same_bytes(h.keys, k) for h in hits)


# ---- access counts -------------------------------------------------------------------


def test_queries_count_accesses_and_flush_persists_them(tmp_path):
    rng = np.random.default_rng(17)
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    keys = [gauss(rng, 2) for _ in range(6)]
    ids = [store.put(k, k) for k in keys]
    store.flush()
    expected = dict.fromkeys(ids, 0)
    for i in (0, 0, 3, 5, 0):
        hits = store.query(keys[i], 0, 2)
        for h in hits:
            expected[h.entry_id] += 1
            assert h.access_count == expected[h.entry_id]
    assert store.query(keys[1], 0, 3, count_access=False)[0].access_count == expected[ids[1]]
    late = store.put(keys[2], keys[2])  # an unflushed entry counts too
    expected[late] = 0
    for h in store.query(keys[2], 0, 2):
        expected[h.entry_id] += 1
    store.flush()
    recs = hmem.formats.records.read(tmp_path / "s" / "entries.bin", 7, 32)
    assert dict(zip(recs["entry_id"].tolist(), recs["access_count"].tolist())) == expected
    with Store.open(tmp_path / "s", read_only=True) as reader:  # visible beside the writer
        for h in reader.query(keys[0], 0, 7):
            assert h.access_count == expected[h.entry_id]
    store.close()
    with Store.open(tmp_path / "s") as store:
        for h in store.query(keys[0], 0, 7):
            expected[h.entry_id] += 1
            assert h.access_count == expected[h.entry_id]
    recs = hmem.formats.records.read(tmp_path / "s" / "entries.bin", 7, 32)
    assert dict(zip(recs["entry_id"].tolist(), recs["access_count"].tolist())) == expected
    assert not hmem.formats.records.damaged(recs).size


def test_read_only_store_answers_without_counting_and_refuses_writes(tmp_path, snapshot_dir):
    rng = np.random.default_rng(18)
    keys = [gauss(rng, 2) for _ in range(4)]
    with Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256) as store:
        for k in keys:
            store.put(k, k)
        store.query(keys[0], 0, 1)
    before = snapshot_dir(tmp_path / "s")
    reader = Store.open(tmp_path / "s", read_only=True)
    assert reader.read_only
    for _ in range(3):
        (hit,) = reader.query(keys[0], 0, 1)
        assert hit.entry_id == 1 and hit.access_count == 1 and same_bytes(hit.keys, keys[0])
    with pytest.raises(hmem.ReadOnlyStoreError):
        reader.put(keys[0], keys[0])
    with pytest.raises(hmem.ReadOnlyStoreError):
        reader.put_many([(keys[0], keys[0])])
    with pytest.raises(hmem.ReadOnlyStoreError):
        reader.flush()
    assert reader.stats().entries == 4
    # a reader takes no lock: a writer opens beside it
    with Store.open(tmp_path / "s") as writer:
        assert not writer.read_only
    reader.close()
    after = snapshot_dir(tmp_path / "s")
    after.pop("lock"), before.pop("lock")
    assert after == before


# ---- shards ---------------------------------------------------------------------------


def test_puts_roll_over_to_new_shards_within_the_limit(tmp_path):
    rng = np.random.default_rng(19)
    limit = 4096
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256, shard_max_bytes=limit)
    data = {}
    big_ids = []
    for i in range(40):
        n = 64 if i in (10, 11, 25) else int(rng.integers(1, 5))  # 64 tokens: 8 KiB, over the limit
        k, v = gauss(rng, n), gauss(rng, n)
        eid = store.put(k, v, layer_idx=i % 3)
        data[eid] = (k, v)
        if n == 64:
            big_ids.append(eid)
    store.close()
    doc = json.loads((tmp_path / "s" / "index.json").read_text())
    recs = hmem.formats.records.read(tmp_path / "s" / "entries.bin", 40, 32)
    assert len(doc["shards"]) > 5
    assert np.all(np.diff(recs["shard_idx"].astype(np.int64)) >= 0)  # shards fill in put order
    seen = set()
    for idx, info in enumerate(doc["shards"]):
        path = tmp_path / "s" / info["file"]
        assert info["file"] == f"shard_{idx:04d}.safetensors"
        assert path.stat().st_size == info["bytes"]
        tensors = safetensors.numpy.load_file(path)
        owners = sorted(int(name[2:]) for name in tensors if name.startswith("k_"))
        assert owners == sorted(recs["entry_id"][recs["shard_idx"] == idx].tolist())
        assert info["entries"] == len(owners)
        if len(owners) > 1:
            assert info["bytes"] <= limit, info
        if any(eid in big_ids for eid in owners):
            assert len(owners) == 1  # an oversized entry has a shard of its own
        seen.update(owners)
    assert seen == set(data)
    with Store.open(tmp_path / "s") as store:
        for eid, (k, v) in data.items():
            hits = store.query(k, int(recs["layer_idx"][eid - 1]), 3, count_access=False)
            hit = next(h for h in hits if h.entry_id == eid)
            assert same_bytes(hit.keys, k) and same_bytes(hit.values, v)
            assert hit.shard_idx == int(recs["shard_idx"][eid - 1])


def test_flush_seals_the_open_shard(tmp_path):
    k = np.ones((1, 16), np.float32)
    with Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256) as store:
        for i in range(3):
            store.put(k * (i + 1), k)
            store.flush()
        assert [s.entries for s in store.stats().shards] == [1, 1, 1]
        store.flush()  # nothing new: no new shard
        assert len(store.stats().shards) == 3
    assert sorted(p.name for p in (tmp_path / "s").glob("shard_*")) == [
        "shard_0000.safetensors",
        "shard_0001.safetensors",
        "shard_0002.safetensors",
    ]


@pytest.mark.parametrize("quantized", [False, True])
def test_shards_are_standard_safetensors(tmp_path, quantized):
    rng = np.random.default_rng(20)
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256, quantize_stored=quantized)
    data = {}
    for i in range(5):
        k, v = gauss(rng, i + 1), gauss(rng, i + 1)
        data[store.put(k, v)] = (k, v)
    store.close()
    doc = json.loads((tmp_path / "s" / "index.json").read_text())
    (info,) = doc["shards"]
    path = tmp_path / "s" / info["file"]
    tensors = safetensors.numpy.load_file(path)
    kinds = ("k", "v", "p", "ks", "vs") if quantized else ("k", "v", "p")
    assert set(tensors) == {f"{kind}_{eid}" for eid in data for kind in kinds} | {"hmem_index"}
    for eid, (k, v) in data.items():
        pooled = k.mean(axis=0, dtype=np.float64).astype(np.float32)
        assert same_bytes(tensors[f"p_{eid}"], pooled)
        if quantized:
            assert tensors[f"k_{eid}"].dtype == np.int8 and tensors[f"ks_{eid}"].dtype == np.float32
            assert tensors[f"ks_{eid}"].shape == (len(k),)
            deq = tensors[f"k_{eid}"].astype(np.float32) * tensors[f"ks_{eid}"][:, None]
            assert np.all(np.abs(deq - k) <= tensors[f"ks_{eid}"][:, None] * 0.5001 + 1e-30)
        else:
            assert same_bytes(tensors[f"k_{eid}"], k) and same_bytes(tensors[f"v_{eid}"], v)
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        names = set(f.keys())
        assert names == set(tensors)
        assert meta["format"] == "hmem-shard" and meta["format_version"] == "1"
        assert meta["shard_uid"] == info["uid"] and len(info["uid"]) == 32
        assert {key for key in meta if key.startswith("crc32c:")} == {f"crc32c:{n}" for n in names}
        for name in names:
            t = f.get_tensor(name)
            assert meta[f"crc32c:{name}"] == f"{crc_kernels.crc32c(np.ascontiguousarray(t).tobytes()):08x}"
            assert same_bytes(t, tensors[name])
    # the data region: hmem_index at offset 0, then every F32 tensor, then every I8 tensor
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    assert (8 + n) % 8 == 0
    assert header["hmem_index"]["dtype"] == "I64" and header["hmem_index"]["data_offsets"][0] == 0
    spans = {
        dt: [spec["data_offsets"] for spec in header.values() if spec["dtype"] == dt] for dt in ("I64", "F32", "I8")
    }
    assert max(e for _, e in spans["I64"]) <= min(s_ for s_, _ in spans["F32"])
    if quantized:
        assert max(e for _, e in spans["F32"]) <= min(s_ for s_, _ in spans["I8"])
    for start, _ in spans["F32"]:
        assert (8 + n + start) % 4 == 0
    # hmem_index, as docs/format.md lays it out
    index = tensors["hmem_index"]
    assert index.dtype == np.int64 and index.shape == (len(data) + 1, 12)
    uid = int(info["uid"], 16)
    halves = np.array([uid >> 64, uid & (2**64 - 1)], dtype=np.uint64).view(np.int64)
    assert index[0, 0] == int.from_bytes(b"HMEMIDX1", "little") == 0x315844494D454D48
    assert index[0, 1] == 1 and index[0, 2] == len(data)
    assert index[0, 3] == halves[0] and index[0, 4] == halves[1]
    assert index[0, 5:].tolist() == [-1] * 7
    assert info["index_crc"] == crc_kernels.crc32c(index.tobytes())
    assert index[1:, 0].tolist() == sorted(data)
    for row, eid in zip(index[1:], sorted(data)):
        assert row[1] == len(data[eid][0])
        for col, kind in enumerate(("k", "v", "p", "ks", "vs")):
            name = f"{kind}_{eid}"
            if kind in kinds:
                assert row[2 + col] == header[name]["data_offsets"][0]
                assert row[7 + col] == int(meta[f"crc32c:{name}"], 16)
            else:
                assert row[2 + col] == -1 and row[7 + col] == -1


def test_open_shards_stay_within_max_open_shards(tmp_path, store_internals):
    rng = np.random.default_rng(21)
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256, shard_max_bytes=1200, max_open_shards=2)
    data = {}
    for i in range(14):
        k = gauss(rng, 3)
        data[store.put(k, k, layer_idx=i % 2)] = k
    store.close()
    store = Store.open(tmp_path / "s")
    try:
        assert len(store.stats().shards) >= 7
        kept = []
        with store_internals.watch_shard_maps(store) as counts:  # open after every shard mapped
            for _ in range(2):
                for eid, k in data.items():
                    for rerank in (True, False):
                        hits = store.query(k, (eid - 1) % 2, 7, rerank=rerank)
                        assert hits[0].entry_id == eid
                        assert store_internals.open_shard_maps(store) <= 2
                        kept.append((hits[0], k))
        assert counts and max(counts) == 2
        # arrays handed out earlier stay valid after their shard left the cache
        for hit, k in kept:
            assert same_bytes(hit.keys, k) and same_bytes(hit.values, k)
    finally:
        store.close()


def test_open_may_map_more_shards_than_the_store_setting(tmp_path, store_internals):
    # A store made when the default was 4 keeps 4 in its config; open() may
    # give this process a larger bound without changing the store.
    rng = np.random.default_rng(22)
    with Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256, shard_max_bytes=1200, max_open_shards=2) as store:
        data = {store.put(k, k, layer_idx=0): k for k in (gauss(rng, 3) for _ in range(12))}
    for read_only in (True, False):
        with Store.open(tmp_path / "s", read_only=read_only, max_open_shards=8) as store:
            assert store.config.max_open_shards == 2  # the store's setting, unchanged
            assert store_internals.shard_map_limit(store) == 8
            for eid, k in data.items():
                assert store.query(k, 0, 3)[0].entry_id == eid
            assert 2 < store_internals.open_shard_maps(store) <= 8
    assert json.loads((tmp_path / "s" / "index.json").read_text())["config"]["max_open_shards"] == 2
    for bad in (0, -1, 1 << 17, 2.5, True, "8"):
        with pytest.raises(hmem.InvalidArgumentError, match="max_open_shards"):
            Store.open(tmp_path / "s", max_open_shards=bad)
    with Store.open(tmp_path / "s") as store:  # a refused open took no lock and left nothing behind
        assert store_internals.shard_map_limit(store) == 2


# ---- flush and reopen -------------------------------------------------------------------


def test_flush_then_reopen_gives_back_everything(tmp_path, read_records, ref_signature):
    rng = np.random.default_rng(22)
    path = tmp_path / "s"
    store = Store.create(path, embed_dim=32, hdc_dim=512, seed=11, shard_max_bytes=6000)
    keys = []
    for i in range(30):
        k = gauss(rng, int(rng.integers(1, 6)), 32)
        keys.append(k)
        store.put(k, gauss(rng, len(k), 32), layer_idx=i % 4, importance=float(i) / 7)
    queries = [(keys[i], i % 4) for i in range(0, 30, 3)]
    for q, layer in queries[:4]:
        store.query(q, layer, 3)
    store.flush()

    def snapshot(s):
        st = s.stats()
        results = []
        for q, layer in queries:
            for rerank in (True, False):
                for h in s.query(q, layer, 4, rerank=rerank, count_access=False):
                    results.append(
                        (
                            h.entry_id,
                            h.layer_idx,
                            h.score,
                            h.similarity,
                            h.cosine,
                            h.n_tokens,
                            h.importance,
                            h.timestamp,
                            h.access_count,
                            h.shard_idx,
                            h.keys.tobytes(),
                            h.values.tobytes(),
                        )
                    )
        shards = [(sh.index, sh.file, sh.bytes, sh.entries) for sh in st.shards]
        return (st.entries, st.evicted, st.layers, shards), results

    state, results = snapshot(store)
    assert state[0] == 30 and state[2] == {0: 8, 1: 8, 2: 7, 3: 7} and len(state[3]) > 3
    assert (
        store.size() == store.stats().bytes_on_disk == sum(p.stat().st_size for p in path.iterdir() if p.name != "lock")
    )
    recs = read_records(path)
    # entries.bin holds what the writer holds: every entry's metadata, and
    # the signature the format defines for its keys (ids 1.. in put order)
    in_memory = list(store.entries())
    assert len(in_memory) == len(recs) == 30
    assert [
        (
            int(r["entry_id"]),
            int(r["layer_idx"]),
            int(r["n_tokens"]),
            float(r["importance"]),
            int(r["timestamp"]),
            int(r["access_count"]),
            int(r["shard_idx"]),
        )
        for r in recs
    ] == [
        (e.entry_id, e.layer_idx, e.n_tokens, e.importance, e.created, e.access_count, e.shard_idx) for e in in_memory
    ]
    assert [e.entry_id for e in in_memory] == list(range(1, 31))
    for r, k in zip(recs, keys):
        assert same_bytes(r["signature"], ref_signature(k, 32, 512, 11))
    assert not hmem.formats.records.damaged(recs).size
    with Store.open(path, read_only=True) as reader:  # beside the writer, after flush
        assert snapshot(reader) == (state, results)
    next_id = store.stats().next_entry_id
    store.close()
    for mode in (True, False):
        with Store.open(path, read_only=mode) as again:
            assert snapshot(again) == (state, results)
            assert list(again.entries()) == in_memory
    again_recs = read_records(path)
    assert again_recs.tobytes() == recs.tobytes()
    with Store.open(path) as store:
        assert store.put(keys[0], keys[0]) == next_id == 31


# ---- bad input ----------------------------------------------------------------------------

F = np.float32
GOOD = np.ones((4, 16), F)


def _nan():
    a = np.ones((4, 16), F)
    a[2, 3] = np.nan
    return a


def _inf(sign=1):
    a = np.ones((4, 16), F)
    a[0, 0] = sign * np.inf
    return a


BAD_PUTS = [
    ("shape-mismatch", dict(keys=GOOD, values=np.ones((3, 16), F)), hmem.InvalidTensorError),
    ("shape-mismatch-dim", dict(keys=GOOD, values=np.ones((4, 17), F)), hmem.InvalidTensorError),
    ("wrong-embed-dim", dict(keys=np.ones((4, 8), F), values=np.ones((4, 8), F)), hmem.InvalidTensorError),
    ("empty", dict(keys=np.ones((0, 16), F), values=np.ones((0, 16), F)), hmem.InvalidTensorError),
    ("nan-keys", dict(keys=_nan(), values=GOOD), hmem.InvalidTensorError),
    ("nan-values", dict(keys=GOOD, values=_nan()), hmem.InvalidTensorError),
    ("inf", dict(keys=_inf(), values=GOOD), hmem.InvalidTensorError),
    ("-inf-values", dict(keys=GOOD, values=_inf(-1)), hmem.InvalidTensorError),
    ("overflow-float64", dict(keys=np.full((1, 16), 1e300), values=np.ones((1, 16))), hmem.InvalidTensorError),
    ("int-dtype", dict(keys=np.ones((4, 16), np.int32), values=np.ones((4, 16), np.int32)), hmem.InvalidTensorError),
    ("bool-dtype", dict(keys=np.ones((4, 16), bool), values=GOOD), hmem.InvalidTensorError),
    ("complex-dtype", dict(keys=np.ones((4, 16), np.complex64), values=GOOD), hmem.InvalidTensorError),
    ("object-dtype", dict(keys=np.ones((4, 16), object), values=GOOD), hmem.InvalidTensorError),
    ("3-d", dict(keys=np.ones((2, 4, 16), F), values=np.ones((2, 4, 16), F)), hmem.InvalidTensorError),
    ("1-d", dict(keys=np.ones(16, F), values=np.ones(16, F)), hmem.InvalidTensorError),
    ("0-d", dict(keys=np.float32(1), values=np.float32(1)), hmem.InvalidTensorError),
    ("list", dict(keys=[[1.0] * 16], values=[[1.0] * 16]), hmem.InvalidTensorError),
    ("none", dict(keys=None, values=GOOD), hmem.InvalidTensorError),
    ("negative-layer", dict(keys=GOOD, values=GOOD, layer_idx=-1), hmem.InvalidArgumentError),
    ("huge-layer", dict(keys=GOOD, values=GOOD, layer_idx=2**32), hmem.InvalidArgumentError),
    ("float-layer", dict(keys=GOOD, values=GOOD, layer_idx=1.0), hmem.InvalidArgumentError),
    ("bool-layer", dict(keys=GOOD, values=GOOD, layer_idx=True), hmem.InvalidArgumentError),
    ("str-layer", dict(keys=GOOD, values=GOOD, layer_idx="1"), hmem.InvalidArgumentError),
    ("negative-importance", dict(keys=GOOD, values=GOOD, importance=-0.5), hmem.InvalidArgumentError),
    ("nan-importance", dict(keys=GOOD, values=GOOD, importance=float("nan")), hmem.InvalidArgumentError),
    ("inf-importance", dict(keys=GOOD, values=GOOD, importance=float("inf")), hmem.InvalidArgumentError),
    ("huge-importance", dict(keys=GOOD, values=GOOD, importance=1e39), hmem.InvalidArgumentError),
    ("str-importance", dict(keys=GOOD, values=GOOD, importance="high"), hmem.InvalidArgumentError),
    ("none-importance", dict(keys=GOOD, values=GOOD, importance=None), hmem.InvalidArgumentError),
]


def _store_state(store, path, snapshot_dir):
    st = store.stats()
    files = snapshot_dir(path)
    files.pop("lock", None)
    return files, (st.entries, st.unflushed, st.layers, st.next_entry_id, len(st.shards))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # float64 1e300 -> inf
@pytest.mark.parametrize("name,kwargs,error", BAD_PUTS, ids=[c[0] for c in BAD_PUTS])
def test_bad_put_raises_and_writes_nothing(store_factory, snapshot_dir, name, kwargs, error):
    store = store_factory()
    k = np.full((2, 16), 0.5, F)
    store.put(k, k, layer_idx=3)
    store.flush()
    store.put(k, k)  # one unflushed entry too
    before = _store_state(store, store.path, snapshot_dir)
    with pytest.raises(error) as info:
        store.put(**kwargs)
    assert isinstance(info.value, hmem.InvalidArgumentError) and isinstance(info.value, ValueError)
    assert _store_state(store, store.path, snapshot_dir) == before
    with pytest.raises(error):  # put_many: the bad entry stores none of the good ones
        store.put_many([(k, k), Entry(**kwargs), (k, k)])
    assert _store_state(store, store.path, snapshot_dir) == before
    store.flush()
    assert store.stats().entries == 2 and store.stats().layers == {0: 1, 3: 1}
    assert store.put(k, k) == 3  # the failed puts took no id
    store.flush()
    recs = hmem.formats.records.read(store.path / "entries.bin", 3, 32)
    assert recs["entry_id"].tolist() == [1, 2, 3]


def test_put_many_checks_every_entry_before_storing_any(store_factory, snapshot_dir):
    store = store_factory()
    good = np.ones((2, 16), F)
    store.put(good, good)
    store.flush()
    before = _store_state(store, store.path, snapshot_dir)
    batch = [Entry(good, good, 0, 1.0) for _ in range(5)] + [Entry(good, good, 0, -1.0)]
    with pytest.raises(hmem.InvalidArgumentError, match="entry 5"):
        store.put_many(batch)
    with pytest.raises(hmem.InvalidTensorError, match="entry 1"):
        store.put_many(iter([(good, good), (good, _nan()), (good, good)]))
    with pytest.raises((TypeError, hmem.InvalidArgumentError)):
        store.put_many([(good, good), (good,)])
    assert _store_state(store, store.path, snapshot_dir) == before
    ids = store.put_many(batch[:5])
    assert ids == [2, 3, 4, 5, 6]


BAD_QUERIES = [
    ("top_k-0", dict(top_k=0), hmem.InvalidArgumentError),
    ("top_k-negative", dict(top_k=-3), hmem.InvalidArgumentError),
    ("top_k-float", dict(top_k=2.0), hmem.InvalidArgumentError),
    ("top_k-bool", dict(top_k=True), hmem.InvalidArgumentError),
    ("top_k-str", dict(top_k="3"), hmem.InvalidArgumentError),
    ("top_k-none", dict(top_k=None), hmem.InvalidArgumentError),
    ("framework", dict(framework="jax"), hmem.InvalidArgumentError),
    ("framework-none", dict(framework=None), hmem.InvalidArgumentError),
    ("negative-layer", dict(layer_idx=-1), hmem.InvalidArgumentError),
    ("huge-layer", dict(layer_idx=2**32), hmem.InvalidArgumentError),
    ("shortlist-0", dict(shortlist_factor=0), hmem.InvalidArgumentError),
    ("wrong-dim", dict(query=np.ones((2, 8), F)), hmem.InvalidTensorError),
    ("wrong-dim-vector", dict(query=np.ones(17, F)), hmem.InvalidTensorError),
    ("nan", dict(query=_nan()), hmem.InvalidTensorError),
    ("inf", dict(query=_inf()), hmem.InvalidTensorError),
    ("int", dict(query=np.ones((2, 16), np.int64)), hmem.InvalidTensorError),
    ("3-d", dict(query=np.ones((1, 2, 16), F)), hmem.InvalidTensorError),
    ("empty", dict(query=np.ones((0, 16), F)), hmem.InvalidTensorError),
    ("list", dict(query=[1.0] * 16), hmem.InvalidTensorError),
]


@pytest.mark.parametrize("name,override,error", BAD_QUERIES, ids=[c[0] for c in BAD_QUERIES])
def test_bad_query_raises_and_counts_nothing(store_factory, snapshot_dir, name, override, error):
    store = store_factory()
    k = np.ones((2, 16), F)
    store.put(k, k)
    store.flush()
    before = _store_state(store, store.path, snapshot_dir)
    args = dict(query=k, layer_idx=0, top_k=3)
    args.update(override)
    with pytest.raises(error) as info:
        store.query(**args)
    assert isinstance(info.value, ValueError)
    assert _store_state(store, store.path, snapshot_dir) == before
    store.flush()
    assert store.query(k, 0, 1, count_access=False)[0].access_count == 0


# ---- INT8 storage --------------------------------------------------------------------------


def test_int8_reads_are_within_half_a_scale(tmp_path, read_records):
    rng = np.random.default_rng(23)
    rows = [gauss(rng, 5, 32, scale=s) for s in (1.0, 1e-3, 1e4, 1e-30)]
    spiky = gauss(rng, 3, 32)
    spiky[1, 7] = 1e6
    spiky[2] = 0.0  # a zero row
    rows.append(spiky)
    rows.append(np.zeros((2, 32), F))
    rows.append(np.array([[127.0] * 16 + [-127.0] * 16, [0.5] * 32], F))
    q = Store.create(tmp_path / "q", embed_dim=32, hdc_dim=512, seed=5, quantize_stored=True)
    plain = Store.create(tmp_path / "f", embed_dim=32, hdc_dim=512, seed=5)
    ids = []
    for k in rows:
        v = (k[::-1] * 0.5).copy()
        ids.append(q.put(k, v))
        plain.put(k, v)

    def check(store):
        for eid, k in zip(ids, rows):
            v = (k[::-1] * 0.5).copy()
            hits = store.query(k, 0, len(ids), rerank=False, count_access=False)
            hit = next(h for h in hits if h.entry_id == eid)
            for got, want in ((hit.keys, k), (hit.values, v)):
                assert got.dtype == np.float32 and got.shape == want.shape
                scale = (np.abs(want).max(axis=1) / np.float32(127)).astype(np.float32)
                tol = scale / 2 + 4 * np.spacing(np.abs(want).max(axis=1))
                assert np.all(np.abs(got.astype(np.float64) - want) <= tol[:, None])
                zero = ~want.any(axis=1)
                assert not got[zero].any()

    check(q)
    q.close()
    plain.close()
    with Store.open(tmp_path / "q") as again:
        check(again)
    qs, fs = read_records(tmp_path / "q"), read_records(tmp_path / "f")
    assert np.array_equal(qs["signature"], fs["signature"])
    # an exactly representable row comes back exactly
    with Store.open(tmp_path / "q", read_only=True) as again:
        hit = next(h for h in again.query(rows[-1], 0, 10, rerank=False) if h.entry_id == ids[-1])
        assert np.array_equal(hit.keys[0], rows[-1][0])


def test_int8_uses_about_a_quarter_of_the_disk(tmp_path):
    rng = np.random.default_rng(24)
    data = [(gauss(rng, 32, 256), gauss(rng, 32, 256)) for _ in range(8)]
    sizes = {}
    for quantized in (False, True):
        path = tmp_path / str(quantized)
        with Store.create(path, embed_dim=256, hdc_dim=256, quantize_stored=quantized) as store:
            store.put_many(data)
        sizes[quantized] = sum(p.stat().st_size for p in path.glob("shard_*.safetensors"))
    assert sizes[True] / sizes[False] < 0.3
    assert sizes[True] / sizes[False] > 0.2  # the scales and pooled keys are still there


# ---- the writer lock -------------------------------------------------------------------------


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    try:
        for _ in range(2):
            with pytest.raises(hmem.StoreLockedError, match=f"pid {os.getpid()}"):
                Store.open(tmp_path / "s")
        with pytest.raises(hmem.StoreLockedError):
            Store.open(tmp_path / "s", lock_wait=0.2)
        with Store.open(tmp_path / "s", read_only=True) as reader:
            assert reader.stats().entries == 0
        k = np.ones((1, 16), F)
        store.put(k, k)  # the holder still writes
    finally:
        store.close()
    with Store.open(tmp_path / "s") as store:
        assert store.stats().entries == 1


def test_a_writer_dropped_unclosed_lets_its_lock_go(tmp_path):
    store = Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256)
    with pytest.raises(hmem.StoreLockedError):
        Store.open(tmp_path / "s")
    del store
    gc.collect()
    with Store.open(tmp_path / "s") as again:  # the collected store's lock is gone
        assert again.stats().entries == 0


_HOLD_LOCK = """
import os, sys, time
import hmem
store = hmem.Store.open({path!r})
print(os.getpid(), flush=True)
line = sys.stdin.readline()
if line.strip() == "close":
    store.close()
    print("closed", flush=True)
    time.sleep(3600)  # alive until the test kills it
else:
    os._exit(0)
"""


@pytest.mark.parametrize("ending", ["close", "die"])
def test_writer_lock_across_processes(tmp_path, ending):
    import subprocess

    path = tmp_path / "s"
    with Store.create(path, embed_dim=16, hdc_dim=256) as store:
        store.put(np.ones((1, 16), F), np.ones((1, 16), F))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK.format(path=str(path))],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child_pid = int(proc.stdout.readline())
        with pytest.raises(hmem.StoreLockedError) as info:
            Store.open(path)
        assert f"pid {child_pid}" in str(info.value)
        with Store.open(path, read_only=True) as reader:  # readers open beside the writer
            assert reader.stats().entries == 1
        proc.stdin.write(ending + "\n")
        proc.stdin.flush()
        if ending == "close":
            assert proc.stdout.readline().strip() == "closed"
            assert proc.poll() is None  # the holder process is still alive
        else:
            proc.wait(timeout=120)  # a hang guard only
        with Store.open(path) as store:  # no lock wait: the lock was given back (or died with its holder)
            store.put(np.ones((1, 16), F), np.ones((1, 16), F))
            assert store.stats().entries == 2
    finally:
        proc.kill()
        proc.wait()


def test_a_writer_in_another_process_is_refused_while_this_one_holds_the_lock(tmp_path, run_python):
    path = tmp_path / "s"
    store = Store.create(path, embed_dim=16, hdc_dim=256)
    try:
        code = f"""
import hmem
try:
    hmem.Store.open({str(path)!r})
except hmem.StoreLockedError as exc:
    print("LOCKED", exc)
with hmem.Store.open({str(path)!r}, read_only=True) as r:
    print("READ", r.stats().entries)
"""
        proc = run_python(code, check=True)
        assert "LOCKED" in proc.stdout and f"pid {os.getpid()}" in proc.stdout
        assert "READ 0" in proc.stdout
    finally:
        store.close()
