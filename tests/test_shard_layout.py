"""Where a shard keeps each entry's tensors (docs/format.md, "Shards"): an
entry's keys and values lie side by side (k_i, then v_i), whatever path
put them there (a batch of small entries joined, of equal or different
lengths; large entries one by one; bfloat16 words widened into an f32
store; compaction and repair copying entries over), so that one byte range
holds both and a store on object storage reads them with one request.

These are format tests: they read the shard files' safetensors headers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import hmem
from hmem import Store

DIM = 16


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _assert_pairs_adjacent(store_path: Path, expected_ids: set[int]) -> None:
    """Every entry's v tensor starts where its k tensor ends, and the
    shards' tensors tile their data without gaps."""
    seen = set()
    for shard in sorted(store_path.glob("shard_*.safetensors")):
        header = _header(shard)
        spans = sorted(tuple(t["data_offsets"]) for name, t in header.items() if name != "__metadata__")
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
        for name, tensor in header.items():
            if not name.startswith("k_"):
                continue
            entry_id = int(name[2:])
            value = header[f"v_{entry_id}"]
            assert tensor["dtype"] == value["dtype"] and tensor["shape"] == value["shape"]
            assert value["data_offsets"][0] == tensor["data_offsets"][1], f"entry {entry_id} in {shard.name}"
            seen.add(entry_id)
    assert seen == expected_ids


def _entries(rng, lengths) -> list[tuple[np.ndarray, np.ndarray, int]]:
    return [
        (rng.standard_normal((n, DIM)).astype(np.float32), rng.standard_normal((n, DIM)).astype(np.float32), 0)
        for n in lengths
    ]


# (lengths of one put_many): joined and equal; joined and of different
# lengths; large entries (over 64 KiB each) taken one by one; a single entry
BATCHES = {
    "small, equal": [4] * 50,
    "small, different": [1, 7, 3, 3, 12, 5, 2, 9] * 6,
    "large": [1100, 1300, 1025],
    "one": [6],
}


@pytest.mark.parametrize("storage", ["f32", "f16", "bf16", "int8"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_each_entrys_keys_and_values_lie_side_by_side(tmp_path, storage, batch):
    rng = np.random.default_rng(len(batch))
    entries = _entries(rng, BATCHES[batch])
    path = tmp_path / "s"
    with Store.create(path, embed_dim=DIM, hdc_dim=256, storage_dtype=storage) as store:
        ids = store.put_many(entries)
        store.put_many(_entries(rng, [3, 3]))  # a second part in the same shard
        store.flush()
        every = set(store.entry_ids())
        for entry_id, (keys, values, _) in zip(ids, entries):
            got = store.get(entry_id)
            if storage in ("f32",):
                assert np.array_equal(got.keys, keys) and np.array_equal(got.values, values)
            else:  # what the dtype keeps (docs/format.md, "Storage dtypes")
                assert np.allclose(got.keys, keys, atol=0.05, rtol=0.02)
                assert np.allclose(got.values, values, atol=0.05, rtol=0.02)
    _assert_pairs_adjacent(path, every)
    assert hmem.verify(path, full=True).ok


def test_the_safetensors_package_reads_the_pairs(tmp_path):
    from safetensors.numpy import load_file

    rng = np.random.default_rng(3)
    entries = _entries(rng, [2, 5, 5, 1])
    with Store.create(tmp_path / "s", embed_dim=DIM, hdc_dim=256) as store:
        ids = store.put_many(entries)
        store.flush()
    (shard,) = (tmp_path / "s").glob("shard_*.safetensors")
    tensors = load_file(shard)
    for entry_id, (keys, values, _) in zip(ids, entries):
        assert np.array_equal(tensors[f"k_{entry_id}"], keys) and np.array_equal(tensors[f"v_{entry_id}"], values)


def test_bfloat16_words_widened_into_an_f32_store_lie_side_by_side(tmp_path):
    torch = pytest.importorskip("torch", reason="a bfloat16 cache needs torch (the hf extra)")
    generator = torch.Generator().manual_seed(5)
    # one layer of [batch 1, 2 kv heads, 3100 tokens, 8]: chunks of 1200, 1200 and 700 tokens, over
    # 64 KiB each on average, so prepared one by one and widened as they are copied into the shard
    cache = [
        (
            torch.randn(1, 2, 3100, 8, generator=generator, dtype=torch.float32).to(torch.bfloat16),
            torch.randn(1, 2, 3100, 8, generator=generator, dtype=torch.float32).to(torch.bfloat16),
        )
    ]
    path = tmp_path / "s"
    with Store.create(path, embed_dim=DIM, hdc_dim=256) as store:
        ids = store.put_cache(cache, chunk_tokens=1200)[0]
        store.flush()
        assert len(ids) == 3
        for n, entry_id in enumerate(ids):
            for got, tensor in zip((store.get(entry_id).keys, store.get(entry_id).values), cache[0]):
                want = tensor[0, :, n * 1200 : (n + 1) * 1200].transpose(0, 1).reshape(-1, DIM).float().numpy()
                assert np.array_equal(got, want)
        every = set(store.entry_ids())
    _assert_pairs_adjacent(path, every)


@pytest.mark.parametrize("how", ["compact", "repack", "repair"])
def test_compaction_and_repair_keep_the_pairs_side_by_side(tmp_path, how):
    rng = np.random.default_rng(11)
    path = tmp_path / "s"
    with Store.create(path, embed_dim=DIM, hdc_dim=256, storage_dtype="int8", shard_max_bytes=8 << 10) as store:
        data = {}
        for lengths in ([3] * 20, [1, 4, 9] * 5, [2] * 10):
            batch = _entries(rng, lengths)
            data.update(zip(store.put_many(batch), batch))
            store.flush()
        gone = sorted(data)[::3]
        store.delete(gone)
        if how == "compact":  # every shard with an evicted byte rewritten, one at a time
            assert store.compact(min_dead_share=0.0).performed
        if how == "repack":  # the whole-store rewrite
            assert store.compact(repack=True).performed
    if how == "repair":
        (path / "index.json").unlink()  # rebuilt from the shards
        hmem.repair(path)
    kept = {entry_id: kv for entry_id, kv in data.items() if entry_id not in gone}
    with Store.open(path, read_only=True) as store:
        every = set(store.entry_ids())
        for entry_id, (keys, values, _) in kept.items():
            got = store.get(entry_id)
            assert np.allclose(got.keys, keys, atol=0.05) and np.allclose(got.values, values, atol=0.05)
    if how != "repair":
        assert every == set(kept)
    _assert_pairs_adjacent(path, every)
