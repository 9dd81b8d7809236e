"""Storage dtypes (docs/format.md, "Storage dtypes"): f16 and bf16 stores keep
K/V that came in those dtypes bit-exact at half the disk of f32, through
put, query, get, compaction, verify and repair; overflow is refused and
stores nothing; f32 and int8 stores keep their old config."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hmem
from hmem.store.storage import from_bf16_words, to_bf16_words

DIM = 64


def rows_of(storage: str, rng: np.random.Generator, tokens: int = 8) -> np.ndarray:
    """float32 rows whose values the storage dtype holds exactly."""
    rows = (rng.standard_normal((tokens, DIM)) * 3).astype(np.float32)
    if storage == "f16":
        return rows.astype(np.float16).astype(np.float32)
    if storage == "bf16":
        return from_bf16_words(to_bf16_words(rows))
    return rows


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_rows_of_the_storage_dtype_round_trip_bit_exact(tmp_path, storage):
    rng = np.random.default_rng(1)
    puts = {}
    with hmem.Store.create(
        tmp_path / "s", embed_dim=DIM, hdc_dim=256, storage_dtype=storage, shard_max_bytes=8192
    ) as store:
        for i in range(30):
            k, v = rows_of(storage, rng), rows_of(storage, rng)
            puts[store.put(k, v, layer_idx=i % 3)] = (k, v)
            if i == 10:
                store.flush()
        for entry_id, (k, v) in puts.items():  # from the open shard and from sealed ones
            got = store.get(entry_id)
            assert got.keys.dtype == np.float32 and np.array_equal(got.keys, k) and np.array_equal(got.values, v)
        [best] = store.query(puts[5][0], layer_idx=store.get(5).info.layer_idx, top_k=1)
        assert best.entry_id == 5 and np.array_equal(best.keys, puts[5][0])
        store.evict(20)
        store.compact()
        live = store.entry_ids()
    assert hmem.verify(tmp_path / "s", full=True).ok
    with hmem.Store.open(tmp_path / "s", read_only=True) as reader:
        assert reader.config.storage_dtype == storage and reader.entry_ids() == live
        for entry_id in live:
            got = reader.get(entry_id)
            assert np.array_equal(got.keys, puts[entry_id][0]) and np.array_equal(got.values, puts[entry_id][1])


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_half_dtype_stores_take_about_half_the_disk(tmp_path, storage):
    rng = np.random.default_rng(2)
    sizes = {}
    for kind in ("f32", storage):
        with hmem.Store.create(tmp_path / kind, embed_dim=DIM, storage_dtype=kind) as store:
            for _ in range(20):
                store.put(rows_of(storage, rng, 256), rows_of(storage, rng, 256))
        sizes[kind] = hmem.Store.open(tmp_path / kind, read_only=True).size()
    assert sizes[storage] <= 0.52 * sizes["f32"], sizes


@pytest.mark.parametrize("storage, value", [("f16", 70000.0), ("bf16", 3.4e38)])
def test_overflow_is_refused_and_stores_nothing(tmp_path, storage, value):
    rng = np.random.default_rng(3)
    with hmem.Store.create(tmp_path / "s", embed_dim=DIM, storage_dtype=storage) as store:
        kept = store.put(rows_of(storage, rng), rows_of(storage, rng))
        store.flush()
        before = store.stats()
        big = rows_of(storage, rng)
        big[2, 7] = value
        with pytest.raises(hmem.InvalidTensorError, match="too large for the store's storage_dtype"):
            store.put_many([(rows_of(storage, rng), rows_of(storage, rng)), (big, rows_of(storage, rng))])
        assert store.entry_ids() == [kept]
        assert store.stats().next_entry_id == before.next_entry_id


def test_torch_half_inputs_round_trip(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is optional for hmem")
    g = torch.Generator().manual_seed(4)
    for storage, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        keys = torch.randn(16, DIM, generator=g).to(dtype)
        values = torch.randn(16, DIM, generator=g).to(dtype)
        with hmem.Store.create(tmp_path / storage, embed_dim=DIM, storage_dtype=storage) as store:
            entry_id = store.put(keys, values)
            store.flush()
            got = store.get(entry_id)
        assert torch.equal(torch.from_numpy(np.array(got.keys)).to(dtype), keys)
        assert torch.equal(torch.from_numpy(np.array(got.values)).to(dtype), values)


@settings(max_examples=200)
@given(
    st.lists(
        st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0**127), max_value=2.0**127),
        min_size=1,
        max_size=64,
    )
)
def test_bf16_rounding_is_round_to_nearest_even(values):
    rows = np.array(values, dtype=np.float32)
    words = to_bf16_words(rows)
    for x, w in zip(rows.tolist(), words.tolist()):
        bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
        upper, lower = bits >> 16, bits & 0xFFFF
        want = upper + (1 if lower > 0x8000 or (lower == 0x8000 and upper & 1) else 0)
        assert w == want & 0xFFFF
    assert np.array_equal(to_bf16_words(from_bf16_words(words)), words)  # bf16 -> f32 -> bf16 is exact


def test_int8_keeps_its_old_name_and_old_configs_open(tmp_path):
    assert hmem.StoreConfig(embed_dim=8, quantize_stored=True).storage_dtype == "int8"
    assert hmem.StoreConfig(embed_dim=8, storage_dtype="int8").quantize_stored
    with pytest.raises(hmem.InvalidArgumentError, match="storage_dtype must be one of"):
        hmem.StoreConfig(embed_dim=8, storage_dtype="fp8")
    with pytest.raises(hmem.InvalidArgumentError, match="quantize_stored means"):
        hmem.StoreConfig(embed_dim=8, quantize_stored=True, storage_dtype="bf16")
    for storage, named in (("f32", False), ("int8", False), ("bf16", True), ("f16", True)):
        with hmem.Store.create(tmp_path / storage, embed_dim=8, storage_dtype=storage):
            pass
        config = json.loads((tmp_path / storage / "index.json").read_text())["config"]
        # f32 and int8 stores write their config as releases before storage_dtype did
        assert ("storage_dtype" in config) == named
        with hmem.Store.open(tmp_path / storage, read_only=True) as reader:
            assert reader.config.storage_dtype == storage


def test_repair_of_a_bf16_store_keeps_the_rest_bit_exact(tmp_path):
    rng = np.random.default_rng(5)
    puts = {}
    with hmem.Store.create(
        tmp_path / "s", embed_dim=DIM, hdc_dim=256, storage_dtype="bf16", shard_max_bytes=4096
    ) as store:
        for _ in range(12):
            k, v = rows_of("bf16", rng), rows_of("bf16", rng)
            puts[store.put(k, v)] = (k, v)
    shards = sorted((tmp_path / "s").glob("shard_*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()  # one shard lost
    report = hmem.repair(tmp_path / "s")
    assert report.action == "rewritten" and report.entries_kept < len(puts)
    with hmem.Store.open(tmp_path / "s", read_only=True) as reader:
        assert len(reader.entry_ids()) == report.entries_kept
        for entry_id in reader.entry_ids():
            got = reader.get(entry_id)
            assert np.array_equal(got.keys, puts[entry_id][0]) and np.array_equal(got.values, puts[entry_id][1])
    assert hmem.verify(tmp_path / "s", full=True).ok
