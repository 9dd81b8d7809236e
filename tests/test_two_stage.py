"""The two-stage search (hmem/store/search.py): a scan of each signature's
prefix for SURVIVORS_PER_PLACE x k rows, ranked again on the whole
signature.  Checked against a plain-numpy rendering of the same rule, with
query and query_many, after puts and evictions, and its "auto" switch.

The expected ranking needs each entry's signature: it is computed with the
store's projection (the format fixes it, docs/format.md "Signatures"), and
the tests shrink the module's constants to make two stages differ from one
on a small store."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hmem
from hmem.kernels import hamming as hamming_kernels
from hmem.kernels.reference import hamming as ref
from hmem.store import search as search_module

DIM, HDC = 8, 1024


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.fixture
def few_survivors(monkeypatch):
    # one survivor per shortlist place: on a store of a few hundred entries
    # stage one then really changes shortlists; a 256-bit prefix of the
    # 1024-bit signatures, whatever hmem's defaults
    monkeypatch.setattr(search_module, "SURVIVORS_PER_PLACE", 1)
    monkeypatch.setattr(search_module, "PREFIX_BYTES", 32)
    return 1


def fill(path, n, rng, layer=0):
    keys = rng.standard_normal((n, 2, DIM)).astype(np.float32)
    store = hmem.Store.create(path, embed_dim=DIM, hdc_dim=HDC)
    ids = store.put_many(hmem.Entry(keys[i], keys[i] * 2, layer) for i in range(n))
    return store, dict(zip(ids, keys))


def popcounts(sigs, q):
    # unpackbits, not np.bitwise_count: NumPy 1.x (the oldest hmem accepts) lacks it
    return np.unpackbits(np.ascontiguousarray(sigs ^ q), axis=1).sum(axis=1)


@pytest.fixture
def expected(ref_signature):
    known: dict[tuple, np.ndarray] = {}

    def signature(store, rows):
        key = (store.config.hdc_dim, rows.tobytes())
        if key not in known:
            known[key] = ref_signature(rows, DIM, store.config.hdc_dim, store.config.seed)
        return known[key]

    def rank(store, keys_by_id, query, k, survivors_per_place, two_stage=True):
        return _expected(lambda rows: signature(store, rows), keys_by_id, query, k, survivors_per_place, two_stage)

    return rank


def _expected(signature, keys_by_id, query, k, survivors_per_place, two_stage):
    """Entry ids of the k best by the documented rule: (prefix distance, id)
    keeps survivors_per_place * k, then (full distance, id) keeps k."""
    ids = np.array(sorted(keys_by_id), dtype=np.int64)
    sigs = np.stack([signature(keys_by_id[i]) for i in ids])
    q = signature(query)
    if two_stage:
        p = search_module.PREFIX_BYTES
        d = popcounts(sigs[:, :p], q[:p])
        keep = np.lexsort((ids, d))[: survivors_per_place * k]
        ids, sigs = ids[keep], sigs[keep]
    d = popcounts(sigs, q)
    return ids[np.lexsort((ids, d))[:k]].tolist()


def test_two_stage_ranks_as_documented(tmp_path, rng, few_survivors, expected):
    store, keys = fill(tmp_path / "s", 400, rng)
    with store:
        differs = 0
        for _ in range(12):
            query = rng.standard_normal((3, DIM)).astype(np.float32)
            got = [
                r.entry_id for r in store.query(query, 0, top_k=6, rerank=False, search="two-stage", count_access=False)
            ]
            assert got == expected(store, keys, query, 6, few_survivors)
            full = [r.entry_id for r in store.query(query, 0, top_k=6, rerank=False, search="full", count_access=False)]
            assert full == expected(store, keys, query, 6, few_survivors, two_stage=False)
            differs += got != full
        assert differs  # with 6 survivors of 400 some shortlists change: the mode is in effect


def test_query_many_equals_query_in_two_stages(tmp_path, rng, few_survivors, expected):
    store, keys = fill(tmp_path / "s", 300, rng)
    with store:
        queries = [rng.standard_normal((2, DIM)).astype(np.float32) for _ in range(9)]
        for rerank in (False, True):
            many = store.query_many(queries, 0, top_k=4, rerank=rerank, search="two-stage", count_access=False)
            for query, results in zip(queries, many):
                one = store.query(query, 0, top_k=4, rerank=rerank, search="two-stage", count_access=False)
                assert [(r.entry_id, r.score) for r in results] == [(r.entry_id, r.score) for r in one]


def test_prefixes_follow_puts_and_evictions(tmp_path, rng, few_survivors, expected):
    store, keys = fill(tmp_path / "s", 200, rng)
    with store:
        query = rng.standard_normal((2, DIM)).astype(np.float32)
        store.query(query, 0, top_k=5, rerank=False, search="two-stage")  # the prefix matrix is made here
        more = rng.standard_normal((150, 2, DIM)).astype(np.float32)
        keys.update(zip(store.put_many(hmem.Entry(m, m, 0) for m in more), more))
        # delete enough that the layer's matrix is packed (dead rows > a quarter)
        gone = sorted(keys)[::2]
        store.delete(gone)
        for entry_id in gone:
            del keys[entry_id]
        for _ in range(5):
            query = rng.standard_normal((2, DIM)).astype(np.float32)
            got = [r.entry_id for r in store.query(query, 0, top_k=5, rerank=False, search="two-stage")]
            assert got == expected(store, keys, query, 5, few_survivors)
            many = store.query_many([query, query], 0, top_k=5, rerank=False, search="two-stage")
            assert [[r.entry_id for r in res] for res in many] == [got, got]
    with hmem.Store.open(tmp_path / "s", read_only=True) as reopened:  # built fresh at open: the same answer
        assert [r.entry_id for r in reopened.query(query, 0, top_k=5, rerank=False, search="two-stage")] == got


def test_auto_takes_two_stages_on_large_layers_only(tmp_path, rng, few_survivors, expected, monkeypatch):
    store, keys = fill(tmp_path / "s", 300, rng)
    with store:
        queries = [rng.standard_normal((2, DIM)).astype(np.float32) for _ in range(8)]

        def ids(mode):
            return [
                [r.entry_id for r in store.query(q, 0, top_k=4, rerank=False, search=mode, count_access=False)]
                for q in queries
            ]

        def searched(top_k=4):  # what "auto" chose, as the results say
            return store.query(queries[0], 0, top_k=top_k, rerank=False, search="auto", count_access=False).search

        full, two = ids("full"), ids("two-stage")
        assert full != two
        assert ids("auto") == full and searched() == "full"  # 300 entries: below TWO_STAGE_MIN_ROWS
        monkeypatch.setattr(search_module, "TWO_STAGE_MIN_ROWS", 300)
        assert ids("auto") == two and searched() == "two-stage"
        assert store.query_many(queries[:2], 0, top_k=4, rerank=False, count_access=False)[1].search == "two-stage"
        # a shortlist of more than a quarter of the layer's survivors: one stage
        many = store.query(queries[0], 0, top_k=80, rerank=False, search="auto", count_access=False)
        assert [r.entry_id for r in many] == expected(store, keys, queries[0], 80, few_survivors, two_stage=False)
        assert many.search == "full"


def test_short_signatures_take_one_stage(tmp_path, rng, few_survivors, expected):
    keys = rng.standard_normal((100, 1, DIM)).astype(np.float32)
    # 512 bits: the 256-bit prefix would be half the signature, little saving
    with hmem.Store.create(tmp_path / "s", embed_dim=DIM, hdc_dim=512) as store:
        store.put_many(hmem.Entry(k, k, 0) for k in keys)
        query = rng.standard_normal((1, DIM)).astype(np.float32)
        assert [r.entry_id for r in store.query(query, 0, top_k=5, search="two-stage")] == [
            r.entry_id for r in store.query(query, 0, top_k=5, search="full")
        ]


def test_bad_search_mode_is_refused_and_counts_nothing(tmp_path, rng):
    store, keys = fill(tmp_path / "s", 20, rng)
    with store:
        before = store.stats().total_accesses
        for bad in ("fast", None, 2):
            with pytest.raises(hmem.InvalidArgumentError, match="search"):
                store.query(keys[1], 0, search=bad)
            with pytest.raises(hmem.InvalidArgumentError, match="search"):
                store.query_many([keys[1]], 0, search=bad)
        assert store.stats().total_accesses == before


def test_full_scan_on_every_core_equals_one_scan(tmp_path, rng, monkeypatch, expected):
    # a layer split into ranges, one per core, merges to the one-range answer
    store, keys = fill(tmp_path / "s", 500, rng)
    with store:
        queries = [rng.standard_normal((2, DIM)).astype(np.float32) for _ in range(6)]
        one = [[r.entry_id for r in store.query(q, 0, top_k=7, rerank=False, search="full")] for q in queries]
        monkeypatch.setattr(search_module, "_ROWS_PER_THREAD", 16)
        monkeypatch.setattr(search_module.threads, "cores", lambda: 3)
        split = [[r.entry_id for r in store.query(q, 0, top_k=7, rerank=False, search="full")] for q in queries]
        assert split == one
        assert split == [expected(store, keys, q, 7, 1, two_stage=False) for q in queries]


@pytest.mark.parametrize("seed", range(30))
def test_topk_row_range_matches_the_reference(seed, on_every_cpu_path):
    rng = np.random.default_rng(seed)
    n, nbytes = int(rng.integers(0, 90)), 8 * int(rng.integers(1, 6))
    base = rng.integers(0, 256, (max(1, n // 3), nbytes), dtype=np.uint8)  # repeated rows: ties
    sigs = np.ascontiguousarray(base[rng.integers(0, len(base), n)]) if n else np.zeros((0, nbytes), np.uint8)
    alive = None if seed % 2 else (rng.random(n) < 0.7).astype(np.uint8)
    lo = int(rng.integers(0, n + 1))
    hi = int(rng.integers(lo, n + 1))
    k = int(rng.integers(1, 20))
    q = rng.integers(0, 256, nbytes, dtype=np.uint8)
    want = ref.topk(q, sigs, alive, k, lo, hi)
    for path, (rows, dists) in on_every_cpu_path(lambda: hamming_kernels.topk(q, sigs, alive, k, lo, hi)).items():
        assert rows.tolist() == want[0].tolist(), path
        assert dists.tolist() == want[1].tolist(), path
        assert all(lo <= r < hi for r in rows.tolist())


def test_topk_row_range_errors():
    sigs = np.zeros((10, 16), dtype=np.uint8)
    for kernels in (hamming_kernels, ref):
        with pytest.raises(ValueError, match="outside"):
            kernels.topk(np.zeros(16, np.uint8), sigs, None, 3, 4, 11)
        with pytest.raises(ValueError, match="outside"):
            kernels.topk(np.zeros(16, np.uint8), sigs, None, 3, 5, 4)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
@pytest.mark.stress
def test_best_rows_are_the_lexsort_order_whatever_the_ties(data):
    # search._best orders (distance, row) pairs with one sort of combined
    # keys: it must pick and order exactly as np.lexsort does, ties included
    from hmem.store.search import _best

    n = data.draw(st.integers(0, 300))
    rows = np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n, unique=True)), dtype=np.int64)
    dists = np.array(data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), dtype=np.int32)
    k = data.draw(st.integers(1, 320))
    got_rows, got_dists = _best(rows, dists, k)
    order = np.lexsort((rows, dists))[:k]
    assert got_rows.tolist() == rows[order].tolist() and got_dists.tolist() == dists[order].tolist()
    assert got_dists.dtype == dists.dtype
