"""Store.query_many: a batch of queries answers exactly as one query per item
made one after another, and the batched top-k kernel (one scan of the layer
for every query, split over threads) agrees with its reference twin."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hmem
from hmem import InvalidArgumentError, threads
from hmem.kernels._native import _hamming as native
from hmem.kernels.reference import hamming as ref
from hmem.store import search


def fill(store, seed: int, n: int = 400, layers: int = 3) -> None:
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(n):
        t = int(rng.integers(1, 5))
        keys = rng.standard_normal((t, 16)).astype(np.float32)
        entries.append(hmem.Entry(keys, -keys, layer_idx=i % layers, importance=float(i % 7)))
    store.put_many(entries)


def queries(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for i in range(count):
        if i % 5 == 4:
            out.append(rng.standard_normal(16).astype(np.float32))  # one vector
        else:
            out.append(rng.standard_normal((int(rng.integers(1, 6)), 16)).astype(np.float32))
    return out


def facts(results: hmem.QueryResults) -> list[tuple]:
    return [
        (r.entry_id, r.layer_idx, r.score, r.similarity, r.cosine, r.access_count, r.keys.tobytes(), r.values.tobytes())
        for r in results
    ]


def twin_stores(store_factory, **config):
    """Two stores with the same config and the same entries."""
    a, b = store_factory("a", **config), store_factory("b", **config)
    for s in (a, b):
        fill(s, seed=7)
    return a, b


@pytest.mark.parametrize("rerank", [True, False])
@pytest.mark.parametrize("hdc_dim", [64, 256])  # 64 bits: many equal distances
def test_batch_equals_one_query_after_another(store_factory, rerank, hdc_dim):
    batch_store, single_store = twin_stores(store_factory, hdc_dim=hdc_dim)
    qs = queries(1, 23)  # not a multiple of the kernel's four queries per pass
    batch = batch_store.query_many(qs, 1, top_k=7, rerank=rerank)
    single = [single_store.query(q, 1, top_k=7, rerank=rerank) for q in qs]
    assert len(batch) == len(qs)
    assert [facts(r) for r in batch] == [facts(r) for r in single]
    # the access counts went up the same way (a later query sees the earlier ones)
    assert [e.access_count for e in batch_store.entries()] == [e.access_count for e in single_store.entries()]
    assert any(r.access_count > 1 for res in batch for r in res)


def test_batch_split_over_threads_equals_one_query_after_another(store_factory, monkeypatch):
    # Private knob: the scan splits across threads only past 65,536 rows a
    # thread; lowered here so that a small layer takes the split and merge.
    monkeypatch.setattr(search, "_ROWS_PER_THREAD", 16)
    monkeypatch.setattr(threads, "cores", lambda: 3)
    batch_store, single_store = twin_stores(store_factory, hdc_dim=64)
    # dead rows inside the ranges: the kernel's alive mask and the merge
    for s in (batch_store, single_store):
        s.delete(s.entry_ids(0)[::3])
    qs = queries(2, 9)
    for k in (1, 5, 200):  # 200 is more than a thread's range holds
        batch = batch_store.query_many(qs, 0, top_k=k, rerank=False, count_access=False)
        single = [single_store.query(q, 0, top_k=k, rerank=False, count_access=False) for q in qs]
        assert [facts(r) for r in batch] == [facts(r) for r in single]


def test_forms_of_the_batch(store_factory):
    store = store_factory()
    fill(store, seed=3)
    qs = queries(4, 6)
    as_matrices = [np.atleast_2d(q) for q in qs[:4]]
    stacked = np.stack([m[:1] for m in as_matrices])  # [4, 1, 16]
    expected = [store.query(m[:1], 2, top_k=3, count_access=False) for m in as_matrices]
    got = store.query_many(stacked, 2, top_k=3, count_access=False)
    assert [facts(r) for r in got] == [facts(r) for r in expected]
    assert store.query_many([], 2) == []
    assert facts(store.query_many(tuple(qs), 2, count_access=False)[0]) == facts(
        store.query(qs[0], 2, count_access=False)
    )
    # a layer with no entries answers every query with nothing
    assert [len(r) for r in store.query_many(qs, 9)] == [0] * len(qs)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((3, 16), dtype=np.float32), "list of token matrices or a 3-d array"),
        (np.zeros(16, dtype=np.float32), "list of token matrices or a 3-d array"),
        (5, "list of token matrices"),
        ("q", "list of token matrices"),
        ([np.zeros((2, 16), np.float32), np.zeros((2, 15), np.float32)], r"queries\[1\]"),
        ([np.zeros((2, 16), np.float32), np.full((1, 16), np.nan, np.float32)], r"queries\[1\]"),
    ],
)
def test_bad_batches_are_refused_before_anything_is_answered(store_factory, bad, match):
    store = store_factory()
    fill(store, seed=5)
    before = [e.access_count for e in store.entries()]
    with pytest.raises(InvalidArgumentError, match=match):
        store.query_many(bad, 0)
    assert [e.access_count for e in store.entries()] == before


def test_bad_arguments_are_refused_before_anything_is_answered(store_factory):
    store = store_factory()
    fill(store, seed=6)
    before = [e.access_count for e in store.entries()]
    qs = queries(6, 3)
    for kwargs in ({"top_k": 0}, {"framework": "jax"}, {"on_damage": "ignore"}, {"shortlist_factor": 0}):
        with pytest.raises(InvalidArgumentError):
            store.query_many(qs, 0, **kwargs)
    with pytest.raises(InvalidArgumentError):
        store.query_many(qs, -1)
    assert [e.access_count for e in store.entries()] == before


def test_closed_store_refuses(store_factory):
    store = store_factory()
    store.close()
    with pytest.raises(hmem.StoreClosedError):
        store.query_many(queries(1, 2), 0)


# ---- the batched kernel against its twin --------------------------------------------


@st.composite
def batch_cases(draw):
    # 130 words: past the 31 vectors an AVX2 byte accumulator holds
    nbytes = 8 * draw(st.sampled_from([1, 2, 3, 8, 9, 130]))
    n = draw(st.integers(0, 300))
    nq = draw(st.integers(0, 9))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # few distinct rows: many equal distances exercise the tie rule
    base = rng.integers(0, 256, (max(1, n // 4), nbytes), dtype=np.uint8)
    sigs = np.ascontiguousarray(base[rng.integers(0, len(base), n)]) if n else np.zeros((0, nbytes), np.uint8)
    qs = rng.integers(0, 256, (nq, nbytes), dtype=np.uint8)
    alive = None if draw(st.booleans()) else (rng.random(n) < 0.7).astype(np.uint8)
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n))
    k = draw(st.integers(1, 40))
    return qs, sigs, alive, k, lo, hi


@settings(max_examples=150)
@given(case=batch_cases())
def test_native_topk_many_matches_the_reference(case, on_every_cpu_path):
    qs, sigs, alive, k, lo, hi = case
    want = ref.topk_many(qs, sigs, alive, k, lo, hi)
    for path, got in on_every_cpu_path(lambda: native.topk_many(qs, sigs, alive, k, lo, hi)).items():
        rows, dists, counts = got
        assert counts.tolist() == want[2].tolist(), path
        for j in range(len(qs)):
            c = int(counts[j])
            assert rows[j, :c].tolist() == want[0][j, :c].tolist(), path
            assert dists[j, :c].tolist() == want[1][j, :c].tolist(), path
            # each query's answer is the single-query kernel's on the same range
            live = None if alive is None else alive[lo:hi]
            one_rows, one_dists = ref.topk(qs[j], sigs[lo:hi], live, k) if hi > lo else ([], [])
            assert rows[j, :c].tolist() == [r + lo for r in list(one_rows)], path


def test_topk_many_errors():
    sigs = np.zeros((10, 16), dtype=np.uint8)
    for kernels in (native, ref):
        with pytest.raises(ValueError, match="bytes"):
            kernels.topk_many(np.zeros((2, 8), np.uint8), sigs, None, 3)
        with pytest.raises(ValueError, match="k must be"):
            kernels.topk_many(np.zeros((2, 16), np.uint8), sigs, None, 0)
        with pytest.raises(ValueError, match="outside"):
            kernels.topk_many(np.zeros((2, 16), np.uint8), sigs, None, 3, 4, 11)
        with pytest.raises(ValueError, match="alive"):
            kernels.topk_many(np.zeros((2, 16), np.uint8), sigs, np.ones(9, np.uint8), 3)


@pytest.mark.parametrize("nbytes", [8, 32, 40, 992, 1024, 1040])
def test_topk_many_counts_every_bit_of_long_signatures(nbytes, on_every_cpu_path):
    # all ones against all zeros: every byte of a lane at its largest count,
    # across the AVX2 byte accumulators' flush every 31 vectors
    sigs = np.full((6, nbytes), 255, dtype=np.uint8)
    sigs[3, -1] = 0  # one row 8 bits nearer
    qs = np.zeros((5, nbytes), dtype=np.uint8)
    for path, (rows, dists, counts) in on_every_cpu_path(lambda: native.topk_many(qs, sigs, None, 2)).items():
        assert counts.tolist() == [2] * 5, path
        assert rows.tolist() == [[3, 0]] * 5, path
        assert dists.tolist() == [[8 * nbytes - 8, 8 * nbytes]] * 5, path


# ---- opening: signature matrices gathered into memory mapped at once -----------------


def test_gather_rows_matches_the_reference():
    rng = np.random.default_rng(3)
    recs = rng.integers(0, 256, (50, 72), dtype=np.uint8)
    src = recs[:, 8:]  # rows further apart than their width, as signatures in records
    rows = np.array([0, 3, 3, 49, 10], dtype=np.int64)
    got, want = np.empty((5, 64), np.uint8), np.empty((5, 64), np.uint8)
    native.gather_rows(src, rows, got)
    ref.gather_rows(src, rows, want)
    assert got.tobytes() == want.tobytes() == src[rows].tobytes()
    for kernels in (native, ref):
        with pytest.raises(ValueError, match="outside"):
            kernels.gather_rows(src, np.array([50], dtype=np.int64), np.empty((1, 64), np.uint8))
        with pytest.raises(ValueError, match="shape"):
            kernels.gather_rows(src, rows, np.empty((4, 64), np.uint8))


def test_large_arrays_are_mapped_writable():
    from hmem import memory

    big = memory.filled_soon((memory.POPULATE_MIN_BYTES // 512 + 1, 512), np.uint8)
    assert big.flags.c_contiguous and big.flags.writeable
    big[:] = 7
    assert int(big[-1, -1]) == 7 and big.shape[1] == 512
    small = memory.filled_soon((3, 4), np.float32)
    assert small.shape == (3, 4) and small.dtype == np.float32


def test_a_store_opened_with_mapped_matrices_answers_the_same(store_factory, tmp_path, monkeypatch):
    from hmem import memory

    store = store_factory("s")
    fill(store, seed=9)
    store.delete(store.entry_ids(1)[::4])
    qs = queries(9, 5)
    store.close()
    with hmem.Store.open(tmp_path / "s", read_only=True) as plain:
        want = [facts(r) for r in plain.query_many(qs, 1, top_k=6)]
    # Private knob: only matrices of 1 MiB and more are mapped at once;
    # lowered so that this small store's layers take that path at open.
    monkeypatch.setattr(memory, "POPULATE_MIN_BYTES", 0)
    with hmem.Store.open(tmp_path / "s", read_only=True) as mapped:
        assert [facts(r) for r in mapped.query_many(qs, 1, top_k=6)] == want
        assert [facts(mapped.query(q, 1, top_k=6)) for q in qs] == want
