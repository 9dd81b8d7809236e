"""The integration bridge (README.md, "The store": augmented_kv):
Store.augmented_kv puts the retrieved entries' K/V rows, in rank order,
before a sparse-attention cache; numpy in, numpy out and torch in, torch
out, in the cache's dtype and device.

torch is optional for hmem: the tests and cases that need it carry the
``requires_torch`` mark and are skipped without it; the numpy ones always run.
"""

from __future__ import annotations

import numpy as np
import pytest

import hmem
from hmem import AugmentedKV, Segment, Store

try:
    import torch
except ImportError:
    torch = None

requires_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (it is optional for hmem)")

F = np.float32
EMBED = 32


def gauss(rng, n, d=EMBED):
    return rng.standard_normal((n, d)).astype(F)


@pytest.fixture
def filled(tmp_path):
    """A store with entries of 1-5 tokens over layers 0 and 1 (layer 2 empty),
    several shards and one unflushed entry; data: id -> (keys, values, layer)."""
    rng = np.random.default_rng(1)
    store = Store.create(tmp_path / "s", embed_dim=EMBED, hdc_dim=512, seed=3, shard_max_bytes=3000)
    data = {}
    for i in range(15):
        k = gauss(rng, int(rng.integers(1, 6)))
        v = gauss(rng, len(k))
        data[store.put(k, v, layer_idx=i % 2, importance=1.0)] = (k, v, i % 2)
        if i % 4 == 3:
            store.flush()
    try:
        yield store, data
    finally:
        store.close()


def _check_layout(aug, results, cache_k, cache_v, convert):
    """Segments contiguous from 0 in the order of `results`; each segment's
    rows are that result's K/V (converted like the cache); then the cache."""
    assert [s.entry_id for s in aug.segments] == [r.entry_id for r in results]
    start = 0
    for seg, r in zip(aug.segments, results):
        assert seg.start == start and seg.stop == start + r.n_tokens
        assert seg.score == r.score
        start = seg.stop
    assert aug.cache_start == start == sum(r.n_tokens for r in results)
    assert aug.keys.shape == (start + cache_k.shape[0], EMBED) and aug.values.shape == aug.keys.shape
    for seg, r in zip(aug.segments, results):
        assert convert(r.keys, aug.keys[seg.start : seg.stop])
        assert convert(r.values, aug.values[seg.start : seg.stop])
    return start


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rerank", [True, False])
def test_numpy_cache_gets_retrieved_rows_in_rank_order(filled, dtype, rerank):
    store, data = filled
    rng = np.random.default_rng(2)
    for eid in (1, 4, 15):
        k, _, layer = data[eid]
        query = k + 0.1 * gauss(rng, len(k))
        cache_k, cache_v = gauss(rng, 7).astype(dtype), gauss(rng, 7).astype(dtype)
        kept_k, kept_v = cache_k.copy(), cache_v.copy()
        results = store.query(query, layer, 3, rerank=rerank, count_access=False)
        assert len(results) == 3
        aug = store.augmented_kv(query, cache_k, cache_v, layer, 3, rerank=rerank, count_access=False)
        assert isinstance(aug, AugmentedKV) and all(isinstance(s, Segment) for s in aug.segments)
        assert type(aug.keys) is np.ndarray and type(aug.values) is np.ndarray
        assert aug.keys.dtype == dtype and aug.values.dtype == dtype

        def same(retrieved, rows):
            return np.array_equal(np.asarray(retrieved).astype(dtype), rows)

        start = _check_layout(aug, results, cache_k, cache_v, same)
        assert aug.keys[start:].tobytes() == kept_k.tobytes() and aug.values[start:].tobytes() == kept_v.tobytes()
        assert np.array_equal(cache_k, kept_k) and np.array_equal(cache_v, kept_v)  # inputs untouched
        if dtype == np.float32:  # exact rows, no rounding on the way
            for seg in aug.segments:
                k, v, _ = data[seg.entry_id]
                assert aug.keys[seg.start : seg.stop].tobytes() == k.tobytes()
                assert aug.values[seg.start : seg.stop].tobytes() == v.tobytes()


@requires_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_cache_gets_torch_rows_of_its_dtype_and_device(filled, dtype):
    store, data = filled
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(3)
    k, _, layer = data[6]
    for query in (torch.from_numpy(k), k, torch.from_numpy(k).to(tdtype)):
        cache_k = torch.from_numpy(gauss(rng, 5)).to(tdtype)
        cache_v = torch.from_numpy(gauss(rng, 5)).to(tdtype)
        kept_k, kept_v = cache_k.clone(), cache_v.clone()
        results = store.query(query, layer, 4, count_access=False)
        aug = store.augmented_kv(query, cache_k, cache_v, layer, 4, count_access=False)
        assert isinstance(aug.keys, torch.Tensor) and isinstance(aug.values, torch.Tensor)
        assert aug.keys.dtype == tdtype and aug.values.dtype == tdtype
        assert aug.keys.device == cache_k.device and aug.values.device == cache_v.device

        def same(retrieved, rows):
            return torch.equal(torch.from_numpy(np.array(retrieved)).to(tdtype), rows)

        start = _check_layout(aug, results, cache_k, cache_v, same)
        assert torch.equal(aug.keys[start:], kept_k) and torch.equal(aug.values[start:], kept_v)
        assert results[0].entry_id == 6 and aug.segments[0].entry_id == 6
        if dtype == "float32":
            assert aug.keys[: aug.segments[0].stop].numpy().tobytes() == k.tobytes()


# Caches are built inside the tests (torch may be missing at collection).
_EMPTY_LAYER_CACHES = [
    pytest.param(lambda: (np.zeros((3, EMBED), F), np.ones((3, EMBED), F)), id="numpy-float32"),
    pytest.param(lambda: (np.zeros((3, EMBED), np.float16), np.ones((3, EMBED), np.float16)), id="numpy-float16"),
    pytest.param(
        lambda: (torch.zeros(2, EMBED, dtype=torch.bfloat16), torch.ones(2, EMBED, dtype=torch.bfloat16)),
        id="torch-bfloat16",
        marks=requires_torch,
    ),
]


@pytest.mark.parametrize("make_cache", _EMPTY_LAYER_CACHES)
def test_nothing_retrieved_gives_back_the_very_same_cache(filled, make_cache):
    store, data = filled
    q = np.ones(EMBED, F)
    cache_k, cache_v = make_cache()
    aug = store.augmented_kv(q, cache_k, cache_v, 2, 5)  # layer 2 holds nothing
    assert aug.keys is cache_k and aug.values is cache_v
    assert aug.segments == () and aug.cache_start == 0


def test_an_empty_store_gives_back_the_very_same_cache(tmp_path):
    q = np.ones(EMBED, F)
    with Store.create(tmp_path / "empty", embed_dim=EMBED, hdc_dim=512) as empty:
        ck, cv = np.zeros((1, EMBED), F), np.zeros((1, EMBED), F)
        aug = empty.augmented_kv(q, ck, cv, 0, 3)
        assert aug.keys is ck and aug.values is cv and aug.segments == ()


def test_an_empty_cache_gets_just_the_retrieved_rows(filled):
    store, data = filled
    k, v, layer = data[3]
    aug = store.augmented_kv(k, np.zeros((0, EMBED), F), np.zeros((0, EMBED), F), layer, 1, rerank=False)
    assert [s.entry_id for s in aug.segments] == [3] and aug.cache_start == len(k)
    assert aug.keys.tobytes() == k.tobytes() and aug.values.tobytes() == v.tobytes()


def test_top_k_past_the_layer_size_returns_the_whole_layer(filled):
    store, data = filled
    layer0 = {i for i, (_, _, lay) in data.items() if lay == 0}
    aug = store.augmented_kv(np.ones(EMBED, F), np.zeros((2, EMBED), F), np.zeros((2, EMBED), F), 0, 100)
    assert {s.entry_id for s in aug.segments} == layer0
    assert aug.cache_start == sum(len(data[i][0]) for i in layer0)
    assert aug.keys.shape[0] == aug.cache_start + 2


def test_retrieval_through_the_bridge_counts_as_an_access(filled):
    store, data = filled
    k, _, layer = data[5]
    before = {r.entry_id: r.access_count for r in store.query(k, layer, 3, count_access=False)}
    aug = store.augmented_kv(k, np.zeros((1, EMBED), F), np.zeros((1, EMBED), F), layer, 3)
    after = {r.entry_id: r.access_count for r in store.query(k, layer, 3, count_access=False)}
    assert [s.entry_id for s in aug.segments] == list(before)
    assert after == {i: c + 1 for i, c in before.items()}


def test_quantized_store_gives_the_dequantized_rows(tmp_path):
    rng = np.random.default_rng(4)
    with Store.create(tmp_path / "q", embed_dim=EMBED, hdc_dim=512, quantize_stored=True) as store:
        ids = [store.put(gauss(rng, 3), gauss(rng, 3)) for _ in range(4)]
        q = gauss(rng, 2)
        results = store.query(q, 0, 2, count_access=False)
        aug = store.augmented_kv(q, np.zeros((1, EMBED), F), np.zeros((1, EMBED), F), 0, 2, count_access=False)
        assert [s.entry_id for s in aug.segments] == [r.entry_id for r in results]
        assert {s.entry_id for s in aug.segments} <= set(ids)
        for seg, r in zip(aug.segments, results):
            assert aug.keys[seg.start : seg.stop].tobytes() == r.keys.tobytes()
            assert aug.values[seg.start : seg.stop].tobytes() == r.values.tobytes()


def _bad_caches():
    """pytest params of make(), which returns (cache_k, cache_v); the torch ones need torch."""

    def good():
        return np.zeros((4, EMBED), F)

    def t():
        return torch.zeros(4, EMBED)

    numpy_cases = [
        ("wrong-embed-dim", lambda: (np.zeros((4, EMBED + 1), F), np.zeros((4, EMBED + 1), F))),
        ("wrong-embed-dim-v", lambda: (good(), np.zeros((4, EMBED - 1), F))),
        ("3-d", lambda: (np.zeros((1, 4, EMBED), F), np.zeros((1, 4, EMBED), F))),
        ("1-d", lambda: (np.zeros(EMBED, F), np.zeros(EMBED, F))),
        ("rows-differ", lambda: (good(), np.zeros((5, EMBED), F))),
        ("list", lambda: (good().tolist(), good().tolist())),
        ("none", lambda: (None, good())),
    ]
    torch_cases = [
        ("3-d-torch", lambda: (torch.zeros(1, 4, EMBED), torch.zeros(1, 4, EMBED))),
        ("rows-differ-torch", lambda: (t(), torch.zeros(3, EMBED))),
        ("numpy-k-torch-v", lambda: (good(), t())),
        ("torch-k-numpy-v", lambda: (t(), good())),
    ]
    return [pytest.param(make, id=name) for name, make in numpy_cases] + [
        pytest.param(make, id=name, marks=requires_torch) for name, make in torch_cases
    ]


@pytest.mark.parametrize("make_cache", _bad_caches())
def test_bad_caches_are_refused_before_anything_is_retrieved(filled, make_cache):
    store, data = filled
    cache_k, cache_v = make_cache()
    k, _, layer = data[2]
    accesses = store.stats().total_accesses
    with pytest.raises(hmem.InvalidTensorError):
        store.augmented_kv(k, cache_k, cache_v, layer, 3)
    assert store.stats().total_accesses == accesses


def test_a_bad_query_is_refused(filled):
    store, _ = filled
    cache = np.zeros((2, EMBED), F)
    with pytest.raises(hmem.InvalidTensorError):
        store.augmented_kv(np.ones(EMBED + 1, F), cache, cache, 0, 3)
    with pytest.raises(hmem.InvalidArgumentError):
        store.augmented_kv(np.ones(EMBED, F), cache, cache, 0, 0)
