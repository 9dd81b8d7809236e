"""Span signatures (signatures_per_entry > 1): an entry keeps, beside the
signature of its mean key, the signatures and mean keys of its tokens cut
into spans, and a span search finds the entry that holds a few query
tokens (docs/format.md, "Span signatures")."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

import hmem
from hmem import InvalidArgumentError, Store, StoreConfig

# Private on purpose: span_bounds is checked against the rule docs/format.md
# fixes, and the span signatures against the store's own projection of
# each span computed alone (no public API exposes either).
from hmem.store.projection import Projector, span_bounds

DIM = 16
HDC = 1024  # span signatures take its first 512 bits


def _long_entries(count: int, tokens: int, seed: int = 0) -> list[np.ndarray]:
    """Keys with a large component every entry shares: their mean keys are
    alike, while each token is an entry's own, and so is each sentence (a
    component shared by runs of 8 tokens), as in real keys."""
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal(DIM).astype(np.float32) * 3
    out = []
    for _ in range(count):
        sentences = np.repeat(rng.standard_normal((-(-tokens // 8), DIM)), 8, axis=0)[:tokens]
        out.append((shared + sentences + rng.standard_normal((tokens, DIM))).astype(np.float32))
    return out


def _filled(store_factory, name: str = "s", spans: int = 8, count: int = 60, tokens: int = 96, **config):
    config.setdefault("hdc_dim", HDC)
    store = store_factory(name, embed_dim=DIM, signatures_per_entry=spans, **config)
    keys = _long_entries(count, tokens)
    ids = store.put_many([(k, -k, 0) for k in keys])
    return store, keys, ids


def _span_rows(j: int, n: int, spans: int, layout: str) -> tuple[int, int]:
    """Rows first..end-1 of span j of n rows (docs/format.md, "Span
    signatures"), written out from the rule there."""
    if layout == "overlapping":  # two of spans + 1 equal parts, one part apart
        lo = min(j * n // (spans + 1), n - 1)
        return lo, max((j + 2) * n // (spans + 1), lo + 1)
    lo = min(j * n // spans, n - 1)
    return lo, max((j + 1) * n // spans, lo + 1)


def _span_query(keys: np.ndarray, start: int, length: int, seed: int = 1) -> np.ndarray:
    noise = np.random.default_rng(seed).standard_normal((length, DIM)).astype(np.float32) * 0.05
    return keys[start : start + length] + noise


# ---- the config ---------------------------------------------------------------


def test_a_store_without_spans_saves_its_config_as_before(store_factory, tmp_path):
    store_factory("plain", embed_dim=DIM).close()
    config = json.loads((tmp_path / "plain" / "index.json").read_text())["config"]
    assert "signatures_per_entry" not in config  # older hmem releases keep opening it
    store_factory("spans", embed_dim=DIM, signatures_per_entry=4).close()
    config = json.loads((tmp_path / "spans" / "index.json").read_text())["config"]
    assert config["signatures_per_entry"] == 4
    assert Store.open(tmp_path / "spans", read_only=True).config.signatures_per_entry == 4


def test_span_layout_is_saved_and_a_store_saved_before_it_reads_as_disjoint(store_factory, tmp_path):
    """New span stores name their layout (an older hmem refuses them rather
    than cutting their spans the old way); a disjoint store is saved as every
    span store was before layouts existed, and such a config reads as
    disjoint."""
    store_factory("new", embed_dim=DIM, signatures_per_entry=4).close()
    config = json.loads((tmp_path / "new" / "index.json").read_text())["config"]
    assert config["span_layout"] == "overlapping"
    store_factory("old", embed_dim=DIM, signatures_per_entry=4, span_layout="disjoint").close()
    config = json.loads((tmp_path / "old" / "index.json").read_text())["config"]
    assert "span_layout" not in config
    assert Store.open(tmp_path / "old", read_only=True).config.span_layout == "disjoint"
    assert Store.open(tmp_path / "new", read_only=True).config.span_layout == "overlapping"


def test_a_bad_span_layout_is_refused_and_creates_nothing(tmp_path):
    with pytest.raises(InvalidArgumentError, match="span_layout"):
        Store.create(tmp_path / "s", embed_dim=DIM, signatures_per_entry=4, span_layout="halves")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("bad", [0, -1, 65, 2.5, True, "8"])
def test_a_bad_signatures_per_entry_is_refused_and_creates_nothing(tmp_path, bad):
    with pytest.raises(InvalidArgumentError, match="signatures_per_entry"):
        Store.create(tmp_path / "s", embed_dim=DIM, signatures_per_entry=bad)
    assert not (tmp_path / "s").exists()


def test_span_search_on_a_store_without_spans_is_refused(store_factory):
    store = store_factory(embed_dim=DIM)
    store.put(np.ones((3, DIM), np.float32), np.ones((3, DIM), np.float32))
    with pytest.raises(InvalidArgumentError, match="signatures_per_entry"):
        store.query(np.ones((2, DIM), np.float32), 0, 1, search="spans")


def test_record_and_pooled_row_sizes(store_factory, tmp_path):
    """Each record carries 7 span signatures of 64 bytes; each row of
    pooled.bin the mean key and 7 span means; each shard's p tensor is
    [8, embed_dim]."""
    store, keys, ids = _filled(store_factory, count=5)
    store.flush()
    doc = json.loads((tmp_path / "s" / "index.json").read_text())
    assert doc["record_size"] == 40 + HDC // 8 + 7 * 64
    assert (tmp_path / "s" / "entries.bin").stat().st_size == 5 * doc["record_size"]
    assert (tmp_path / "s" / "pooled.bin").stat().st_size == 5 * (12 + 4 * 8 * DIM)
    shard = load_file(str(tmp_path / "s" / doc["shards"][0]["file"]))
    pooled = shard[f"p_{ids[2]}"]
    assert pooled.shape == (8, DIM)
    np.testing.assert_allclose(pooled[0], keys[2].mean(axis=0), rtol=1e-5, atol=1e-5)
    for j in range(7):  # docs/format.md: span j of 96 rows covers rows j * 96 // 8 up to (j + 2) * 96 // 8
        lo, hi = j * 96 // 8, (j + 2) * 96 // 8
        np.testing.assert_allclose(pooled[1 + j], keys[2][lo:hi].mean(axis=0), rtol=1e-5, atol=1e-5)


# ---- the spans ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=8),
    st.integers(1, 63),
    st.sampled_from(["overlapping", "disjoint"]),
)
def test_span_bounds_cover_each_entry_in_order(lengths, spans, layout):
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    first, end = span_bounds(starts, spans, layout=layout)
    for e, n in enumerate(lengths):
        lo, hi = first[e] - starts[e], end[e] - starts[e]
        assert [(int(a), int(b)) for a, b in zip(lo, hi)] == [_span_rows(j, n, spans, layout) for j in range(spans)]
        assert np.all(lo >= 0) and np.all(hi <= n) and np.all(hi > lo)  # inside the entry, never empty
        assert np.all(np.diff(lo) >= 0)  # in token order
        assert set(range(n)) == {t for a, b in zip(lo, hi) for t in range(a, b)}  # every row in some span
        if layout == "disjoint" and n >= spans:  # a partition of the entry's rows
            assert lo[0] == 0 and hi[-1] == n and np.array_equal(hi[:-1], lo[1:])
        if layout == "overlapping" and n > spans:  # each span shares its second part with the next one's first
            assert lo[0] == 0 and hi[-1] == n and np.all(hi[:-1] > lo[1:]) and np.array_equal(hi[:-2], lo[2:])


def _has_sink(k: np.ndarray) -> bool:
    """docs/format.md: the first row is a sink when its norm is more than 3x
    the mean norm of the other rows (float64)."""
    norms = np.linalg.norm(k.astype(np.float64), axis=1)
    return len(k) > 1 and norms[0] > 3.0 * norms[1:].mean()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from([1.0, 2.5, 20.0])), min_size=1, max_size=12),
    st.integers(2, 9),
    st.integers(0, 2**32),
    st.sampled_from(["overlapping", "disjoint"]),
)
@pytest.mark.stress
def test_span_signatures_are_the_signature_prefixes_of_the_span_means(
    tmp_path_factory, shapes, per_entry, seed, layout
):
    """Each record's span j is the first 512 bits of the signature of span
    j's rows (the rows after a sink first row), computed one span at a time,
    whichever way put_many prepared the batch; the p tensor holds the span
    means."""
    rng = np.random.default_rng(seed)
    keys = []
    for n, first_row_scale in shapes:
        k = rng.standard_normal((n, DIM)).astype(np.float32)
        k[0] *= first_row_scale  # x20: a sink (left out of the spans); x2.5: not one
        keys.append(k)
    path = tmp_path_factory.mktemp("spans") / "s"
    with Store.create(path, embed_dim=DIM, hdc_dim=HDC, signatures_per_entry=per_entry, span_layout=layout) as store:
        store.put_many([(k, k, 0) for k in keys])
    records = hmem.formats.records.read(path / "entries.bin", len(keys), store.config)
    shard = load_file(str(path / json.loads((path / "index.json").read_text())["shards"][0]["file"]))
    projector = Projector(DIM, HDC, 0)
    for e, k in enumerate(keys):
        assert np.array_equal(records["signature"][e], projector.signature(k))
        own = k[1:] if _has_sink(k) else k
        spans = per_entry - 1
        for j in range(spans):  # docs/format.md, "Span signatures"
            lo, hi = _span_rows(j, len(own), spans, layout)
            want = projector.signature(np.ascontiguousarray(own[lo:hi]))[:64]
            assert np.array_equal(records["spans"][e, j], want), (e, j)
            pooled = shard[f"p_{int(records['entry_id'][e])}"]
            np.testing.assert_allclose(pooled[1 + j], own[lo:hi].mean(axis=0), rtol=1e-5, atol=1e-5)


def test_large_entries_get_the_same_spans_as_small_ones(store_factory, store_internals, read_records, tmp_path):
    """put_many prepares entries of 64 KiB and more one by one; their span
    signatures and pooled keys are those of the joined batch path."""
    rng = np.random.default_rng(3)
    big = [rng.standard_normal((1200, DIM)).astype(np.float32) for _ in range(3)]
    joined = store_factory("joined", embed_dim=DIM, hdc_dim=HDC, signatures_per_entry=6)
    alone = store_factory("alone", embed_dim=DIM, hdc_dim=HDC, signatures_per_entry=6)
    assert not store_internals.prepared_joined(alone, [(k, k, 0) for k in big])
    alone.put_many([(k, k, 0) for k in big])
    for k in big:
        joined.put_many([(k[:600], k[:600], 0), (k, k, 0)])  # joined: small entries beside it
    joined.flush()
    alone.flush()
    a, j = read_records(tmp_path / "alone"), read_records(tmp_path / "joined")
    assert np.array_equal(a["spans"], j["spans"][1::2])
    assert np.array_equal(a["signature"], j["signature"][1::2])


# ---- queries ------------------------------------------------------------------


@pytest.mark.parametrize("layout, start, length", [("overlapping", 39, 18), ("disjoint", 42, 10)])
def test_a_few_tokens_find_the_entry_that_holds_them(store_factory, layout, start, length):
    """A query of about three quarters of span 3's rows (overlapping: 18 of
    rows 36-59; disjoint: 10 of rows 41-53) finds its entry, where the
    entries' mean keys are alike."""
    store, keys, ids = _filled(store_factory, span_layout=layout)
    lo, hi = _span_rows(3, 96, 7, layout)
    assert lo <= start and start + length <= hi and length >= 0.75 * (hi - lo)
    found_spans = found_mean = 0
    for e in range(0, 60, 3):
        query = _span_query(keys[e], start, length, seed=e)
        spans = store.query(query, 0, 1, count_access=False)
        mean = store.query(query, 0, 1, count_access=False, search="full")
        found_spans += spans[0].entry_id == ids[e]
        found_mean += mean[0].entry_id == ids[e]
        if spans[0].entry_id == ids[e]:
            np.testing.assert_array_equal(spans[0].keys, keys[e])  # the K/V exactly as put
            np.testing.assert_array_equal(spans[0].values, -keys[e])
    assert found_spans == 20
    assert found_mean <= 10  # the mean keys are alike: mean pooling loses most of them


def test_a_whole_entry_still_finds_itself(store_factory):
    store, keys, ids = _filled(store_factory)
    for e in range(0, 60, 7):
        assert store.query(keys[e], 0, 1)[0].entry_id == ids[e]
        assert store.query(keys[e], 0, 1)[0].cosine == pytest.approx(1.0)


def test_scores_without_rerank_are_span_similarities(store_factory):
    store, keys, ids = _filled(store_factory)
    results = store.query(keys[4][2:20], 0, 5, rerank=False)  # 18 of the 24 rows of span 0
    assert results[0].entry_id == ids[4]
    assert all(r.cosine is None and 0.0 <= r.similarity <= 1.0 for r in results)
    assert [r.similarity for r in results] == sorted((r.similarity for r in results), reverse=True)


def test_query_many_answers_as_single_queries(store_factory):
    store, keys, ids = _filled(store_factory)
    queries = [_span_query(keys[e], 5 * e % 80, 12, seed=e) for e in range(0, 60, 5)]
    many = store.query_many(queries, 0, 4, count_access=False)
    for query, batch in zip(queries, many):
        single = store.query(query, 0, 4, count_access=False)
        assert [r.entry_id for r in batch] == [r.entry_id for r in single]
        assert [r.score for r in batch] == [r.score for r in single]


def test_entries_shorter_than_the_spans_are_found(store_factory):
    store = store_factory(embed_dim=DIM, hdc_dim=HDC, signatures_per_entry=9)
    rng = np.random.default_rng(5)
    keys = [rng.standard_normal((n, DIM)).astype(np.float32) for n in (1, 2, 3, 5, 8, 9, 30)]
    ids = store.put_many([(k, k, 0) for k in keys])
    for k, entry_id in zip(keys, ids):
        assert store.query(k, 0, 1)[0].entry_id == entry_id
        lo, hi = _span_rows(7, len(k), 8, "overlapping")  # the last span, which every entry has, however short
        best = store.query(k[lo:hi], 0, 1)[0]
        assert best.entry_id == entry_id and best.cosine == pytest.approx(1.0, abs=1e-6)


def test_evicted_entries_leave_the_span_search(store_factory):
    store, keys, ids = _filled(store_factory)
    query = _span_query(keys[7], 27, 18)  # 18 of the 24 rows of span 2 (rows 24-47)
    assert store.query(query, 0, 1)[0].entry_id == ids[7]
    store.delete(ids[:30])  # more than a quarter of the layer: its matrix is packed
    assert ids[7] not in [r.entry_id for r in store.query(query, 0, 30)]
    query = _span_query(keys[45], 30, 10)
    assert store.query(query, 0, 1)[0].entry_id == ids[45]


# ---- the rest still holds -------------------------------------------------------


def _answers(store, keys) -> list[list[int]]:
    return [
        [r.entry_id for r in store.query(_span_query(keys[e], 20, 10, seed=e), 0, 3, count_access=False)]
        for e in range(0, 60, 4)
    ]


@pytest.mark.parametrize("layout", ["overlapping", "disjoint"])
def test_reopen_compact_and_repair_keep_the_answers(store_factory, tmp_path, layout):
    """...and the layout: repair takes the config from the shards, which
    save it as index.json does (a disjoint store without the key)."""
    store, keys, ids = _filled(store_factory, span_layout=layout)
    store.delete(ids[50:])
    before = _answers(store, keys)
    store.close()
    with Store.open(tmp_path / "s") as reopened:
        assert _answers(reopened, keys) == before
        reopened.compact()
        assert _answers(reopened, keys) == before
    report = hmem.verify(tmp_path / "s", full=True)
    assert report.ok, report.findings
    (tmp_path / "s" / "pooled.bin").unlink()  # re-rank reads each candidate's p tensor from its shard
    with Store.open(tmp_path / "s", read_only=True) as reopened:
        assert _answers(reopened, keys) == before
    (tmp_path / "s" / "index.json").unlink()
    hmem.repair(tmp_path / "s")
    with Store.open(tmp_path / "s", read_only=True) as repaired:
        assert repaired.config.signatures_per_entry == 8 and repaired.config.span_layout == layout
        assert _answers(repaired, keys) == before
        assert hmem.verify(tmp_path / "s", full=True).ok


def test_verify_finds_a_damaged_span_signature(store_factory, tmp_path):
    store, keys, ids = _filled(store_factory, count=4)
    store.close()
    size = json.loads((tmp_path / "s" / "index.json").read_text())["record_size"]
    with open(tmp_path / "s" / "entries.bin", "r+b") as f:  # a flipped bit in record 2's last span
        f.seek(3 * size - 1)
        byte = f.read(1)[0]
        f.seek(3 * size - 1)
        f.write(bytes([byte ^ 1]))
    report = hmem.verify(tmp_path / "s")
    assert not report.ok
    assert any("checksum" in finding.message for finding in report.findings)


def test_the_cli_creates_a_store_with_spans(tmp_path):
    from typer.testing import CliRunner

    from hmem.cli.app import app

    result = CliRunner().invoke(app, ["init", str(tmp_path / "s"), "-d", "16", "--signatures-per-entry", "5", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["signatures_per_entry"] == 5
    assert StoreConfig.from_dict(json.loads((tmp_path / "s" / "index.json").read_text())["config"]).spans == 4
    result = CliRunner().invoke(
        app, ["init", str(tmp_path / "d"), "-d", "16", "--signatures-per-entry", "5", "--span-layout", "disjoint"]
    )
    assert result.exit_code == 0, result.output
    assert Store.open(tmp_path / "d", read_only=True).config.span_layout == "disjoint"
    result = CliRunner().invoke(
        app, ["init", str(tmp_path / "bad"), "-d", "16", "--signatures-per-entry", "5", "--span-layout", "halves"]
    )
    assert result.exit_code != 0 and "span_layout" in result.output and not (tmp_path / "bad").exists()


def test_many_entries_tied_on_every_span_come_in_entry_order(store_factory):
    """When the best rows of the span matrix belong to few entries (here 60
    entries alike on all 9 rows), the span search scans again for more
    rows: it still returns top_k distinct entries, ties to the lower id."""
    store = store_factory(embed_dim=DIM, hdc_dim=HDC, signatures_per_entry=9)
    rng = np.random.default_rng(8)
    alike = rng.standard_normal((27, DIM)).astype(np.float32)
    others = [rng.standard_normal((27, DIM)).astype(np.float32) for _ in range(30)]
    ids = store.put_many([(alike, alike, 0)] * 60 + [(k, k, 0) for k in others])
    results = store.query(alike, 0, 50, rerank=False, count_access=False)
    assert [r.entry_id for r in results] == ids[:50]
    reranked = store.query(alike, 0, 50, count_access=False)
    assert [r.entry_id for r in reranked] == ids[:50]


@pytest.mark.parametrize("layout", ["overlapping", "disjoint"])
def test_a_span_counts_only_for_queries_it_could_hold(store_factory, layout):
    """Entry A has a span (span 3 of its 70 rows: 17 rows overlapping, 10
    disjoint) whose mean is exactly the query's mean; entry B is the query
    itself, slightly changed.  A query of 40 tokens is longer than twice
    that span: B, its near copy, comes first.  A query of 5 tokens with the
    same mean is held by A's span."""
    store = store_factory(embed_dim=DIM, hdc_dim=HDC, signatures_per_entry=8, span_layout=layout)
    rng = np.random.default_rng(11)
    query = rng.standard_normal((40, DIM)).astype(np.float32) + 2.0
    a = rng.standard_normal((70, DIM)).astype(np.float32)
    lo, hi = _span_rows(3, 70, 7, layout)
    assert hi - lo < 20  # shorter than half the long query
    a[lo:hi] = query.mean(axis=0)
    b = query + rng.standard_normal(query.shape).astype(np.float32) * 0.3
    id_a, id_b = store.put_many([(a, a, 0), (b, b, 0)])
    long_answer = store.query(query, 0, 2, count_access=False)
    assert [r.entry_id for r in long_answer] == [id_b, id_a]
    short = np.repeat(query.mean(axis=0, keepdims=True), 5, axis=0)
    short_answer = store.query(short, 0, 2, count_access=False)
    assert short_answer[0].entry_id == id_a and short_answer[0].cosine == pytest.approx(1.0, abs=1e-6)
    assert store.query(short, 0, 2, count_access=False, search="full")[0].entry_id == id_b  # mean pooling misses A


def test_the_cli_queries_by_span(store_factory, tmp_path):
    from typer.testing import CliRunner

    from hmem.cli.app import app

    store, keys, ids = _filled(store_factory)
    store.close()
    query = tmp_path / "q.npy"
    np.save(query, _span_query(keys[9], 39, 18))
    runner = CliRunner()
    spans = runner.invoke(app, ["query", str(tmp_path / "s"), "--query", str(query), "-l", "0", "-k", "1", "--json"])
    assert spans.exit_code == 0, spans.output
    assert json.loads(spans.output)["results"][0]["entry_id"] == ids[9]
    mean = runner.invoke(
        app, ["query", str(tmp_path / "s"), "--query", str(query), "-l", "0", "-k", "1", "--search", "full", "--json"]
    )
    assert mean.exit_code == 0, mean.output
    stats = runner.invoke(app, ["stats", str(tmp_path / "s")])
    assert "8 signatures per entry" in stats.output
