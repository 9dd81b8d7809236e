"""Token-level re-rank (docs/format.md, "Token re-rank"): the best
candidates by pooled keys ranked again by max-sim, each query row's best
cosine over a candidate's stored key rows, averaged over the query's rows."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

import hmem
from hmem import InvalidArgumentError, Store

# Private on purpose: the scoring function is checked against its
# pure-Python twin below on inputs no store would hold (zero rows, blocks).
from hmem.store import token_scores

DIM = 16


def max_sim_twin(query: np.ndarray, candidate: np.ndarray) -> float:
    """The definition, one cosine at a time in float64."""

    def cosine(a: list[float], b: list[float]) -> float:
        na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
        return 0.0 if na == 0 or nb == 0 else sum(x * y for x, y in zip(a, b)) / (na * nb)

    rows = candidate.astype(np.float64).tolist()
    return sum(max(cosine(q, r) for r in rows) for q in query.astype(np.float64).tolist()) / len(query)


# ---- the score ---------------------------------------------------------------------------


@pytest.mark.parametrize("block", [None, 7, 40])
def test_max_sim_matches_its_pure_python_twin(monkeypatch, block):
    if block is not None:  # candidates split over several products, one larger than a block alone
        monkeypatch.setattr(token_scores, "_BLOCK_ROWS", block)
    rng = np.random.default_rng(3)
    query = rng.standard_normal((5, DIM)).astype(np.float32)
    query[2] = 0  # a zero row: cosine 0 with anything
    candidates = [rng.standard_normal((n, DIM)).astype(np.float32) * rng.uniform(0.1, 10) for n in (1, 3, 12, 50, 2)]
    candidates[1][0] = 0
    got = token_scores.max_sim(query, candidates)
    want = [max_sim_twin(query, c) for c in candidates]
    assert got.shape == (5,) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_max_sim_ties_candidates_with_the_same_rows_and_refuses_empty_ones():
    rng = np.random.default_rng(4)
    query = rng.standard_normal((9, DIM)).astype(np.float32)
    same = rng.standard_normal((30, DIM)).astype(np.float32)
    others = [rng.standard_normal((n, DIM)).astype(np.float32) for n in (5, 17, 64)]
    scores = token_scores.max_sim(query, [others[0], same, others[1], same.copy(), others[2]])
    assert scores[1] == scores[3]
    assert token_scores.max_sim(query, []).shape == (0,)
    with pytest.raises(ValueError, match="at least one row"):
        token_scores.max_sim(query, [same, same[:0]])


# ---- through the store -------------------------------------------------------------------


def _documents(count: int = 40, tokens: int = 32, seed: int = 0) -> list[np.ndarray]:
    """Entries whose means are alike (a large shared component) and whose
    rows are each their own."""
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal(DIM).astype(np.float32) * 4
    return [(shared + rng.standard_normal((tokens, DIM))).astype(np.float32) for _ in range(count)]


def _store_with_a_decoy(store_factory, **config):
    """A store where the query's rows are a few rows of entry `target`
    while entry `decoy` has the query's mean: pooled keys rank the decoy
    first, token-level max-sim the target."""
    store = store_factory(**config)
    keys = _documents()
    rng = np.random.default_rng(9)
    target = 7
    query = keys[target][[3, 11, 20, 27]] + rng.standard_normal((4, DIM)).astype(np.float32) * 0.01
    decoy = rng.standard_normal((32, DIM)).astype(np.float32) * 3
    decoy += query.mean(axis=0) - decoy.mean(axis=0)  # the query's mean exactly, none of its rows
    ids = store.put_many([(k, -k, 0) for k in keys] + [(decoy, decoy, 0)])
    store.flush()
    return store, keys, query, ids[target], ids[-1]


def test_a_token_re_rank_finds_the_entry_that_holds_the_query_rows(store_factory):
    store, keys, query, target, decoy = _store_with_a_decoy(store_factory)
    by_mean = store.query(query, 0, top_k=3, shortlist_factor=20)
    assert by_mean[0].entry_id == decoy and all(r.token_score is None for r in by_mean)
    by_tokens = store.query(query, 0, top_k=3, shortlist_factor=20, token_rerank=41)
    assert by_tokens[0].entry_id == target
    for result in by_tokens:  # each score is max-sim over the entry's stored keys
        assert result.score == result.token_score
        assert result.token_score == pytest.approx(max_sim_twin(query, store.get(result.entry_id).keys), abs=2e-6)
        assert result.cosine is not None
    scores = [r.token_score for r in by_tokens]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("storage_dtype", ["f16", "bf16", "int8"])
def test_a_token_re_rank_scores_the_keys_as_stored(store_factory, storage_dtype):
    store, _, query, target, _ = _store_with_a_decoy(store_factory, storage_dtype=storage_dtype)
    results = store.query(query, 0, top_k=5, shortlist_factor=20, token_rerank=41)
    assert results[0].entry_id == target
    for result in results:  # the keys a reader gets back (decoded), not those put
        assert result.token_score == pytest.approx(max_sim_twin(query, store.get(result.entry_id).keys), abs=2e-6)


def test_the_store_setting_is_the_default_and_a_query_overrides_it(store_factory, tmp_path):
    store, _, query, target, decoy = _store_with_a_decoy(store_factory, name="tok", token_rerank=64)
    assert store.config.token_rerank == 64
    assert store.query(query, 0, top_k=3)[0].entry_id == target
    assert store.query(query, 0, top_k=3, token_rerank=0, shortlist_factor=20)[0].entry_id == decoy
    assert store.query(query, 0, top_k=3, rerank=False)[0].token_score is None  # no re-rank at all
    store.close()
    saved = json.loads((tmp_path / "tok" / "index.json").read_text())["config"]
    assert saved["token_rerank"] == 64
    with Store.open(tmp_path / "tok", read_only=True) as reader:
        assert reader.config.token_rerank == 64
        assert reader.query(query, 0, top_k=3)[0].entry_id == target


def test_a_store_without_the_setting_saves_none(store_factory, tmp_path):
    store_factory(name="plain").close()
    assert "token_rerank" not in json.loads((tmp_path / "plain" / "index.json").read_text())["config"]


def test_a_batch_answers_as_its_queries_alone(store_factory):
    store, keys, query, _, _ = _store_with_a_decoy(store_factory)
    queries = [query, keys[3][:5], keys[20][10:], query[:2]]
    batch = store.query_many(queries, 0, top_k=4, token_rerank=30)
    for q, answer in zip(queries, batch):
        alone = store.query(q, 0, top_k=4, token_rerank=30)
        assert [(r.entry_id, r.token_score) for r in answer] == [(r.entry_id, r.token_score) for r in alone]


def test_a_span_store_re_ranks_by_tokens_too(store_factory):
    store, _, query, target, _ = _store_with_a_decoy(store_factory, signatures_per_entry=4, hdc_dim=1024)
    results = store.query(query, 0, top_k=3, token_rerank=41)
    assert results.search == "spans" and results[0].entry_id == target


def test_an_unflushed_entry_is_scored_from_memory(store_factory):
    store = store_factory()
    keys = _documents(count=6)
    ids = store.put_many([(k, k, 0) for k in keys])
    results = store.query(keys[2][:3], 0, top_k=2, token_rerank=6)
    assert results[0].entry_id == ids[2] and results[0].token_score == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"token_rerank": -1}, "token_rerank"),
        ({"token_rerank": 5000}, "token_rerank"),
        ({"token_rerank": 2.5}, "token_rerank"),
        ({"token_rerank": True}, "token_rerank"),
        ({"token_rerank": 3, "rerank": False}, "needs rerank=True"),
    ],
)
def test_bad_token_re_rank_options_are_clear_errors_and_change_nothing(
    store_factory, snapshot_dir, tmp_path, options, message
):
    store, _, query, _, _ = _store_with_a_decoy(store_factory, name="bad")
    before = snapshot_dir(tmp_path / "bad")
    with pytest.raises(InvalidArgumentError, match=message):
        store.query(query, 0, top_k=3, **options)
    with pytest.raises(InvalidArgumentError, match=message):
        store.query_many([query], 0, top_k=3, **options)
    store.flush()
    assert snapshot_dir(tmp_path / "bad") == before


@pytest.mark.parametrize("value", [-1, 4097, "8", None])
def test_a_bad_store_setting_creates_nothing(tmp_path, value):
    with pytest.raises(InvalidArgumentError, match="token_rerank"):
        Store.create(tmp_path / "s", embed_dim=DIM, token_rerank=value)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def _flip_tensor(root: Path, name: str) -> None:
    """One bit of a tensor's bytes, as a disk would flip it."""
    for shard in sorted(root.glob("shard_*.safetensors")):
        raw = shard.read_bytes()
        (length,) = struct.unpack_from("<Q", raw, 0)
        header = json.loads(raw[8 : 8 + length])
        if name in header:
            start, _ = header[name]["data_offsets"]
            data = bytearray(raw)
            data[8 + length + start] ^= 1
            shard.write_bytes(bytes(data))
            return
    raise AssertionError(f"no shard holds {name}")


def test_a_damaged_candidate_raises_or_is_skipped(store_factory, tmp_path):
    store, _, query, target, _ = _store_with_a_decoy(store_factory, name="dmg")
    second = store.query(query, 0, top_k=3, shortlist_factor=20, token_rerank=41)[1].entry_id
    store.close()
    _flip_tensor(tmp_path / "dmg", f"k_{second}")
    with Store.open(tmp_path / "dmg", read_only=True) as reader:
        with pytest.raises(hmem.CorruptStoreError, match=f"k_{second}"):
            reader.query(query, 0, top_k=3, shortlist_factor=20, token_rerank=41)
    with Store.open(tmp_path / "dmg", read_only=True) as reader:
        results = reader.query(query, 0, top_k=3, shortlist_factor=20, token_rerank=41, on_damage="skip")
        assert [s.entry_id for s in results.skipped] == [second]
        assert results[0].entry_id == target and second not in [r.entry_id for r in results]


def test_a_store_on_object_storage_re_ranks_as_a_local_one(object_url, tmp_path):
    keys = _documents()
    rng = np.random.default_rng(9)
    query = keys[7][[3, 11, 20, 27]] + rng.standard_normal((4, DIM)).astype(np.float32) * 0.01
    for where in (object_url, tmp_path / "local"):
        with Store.create(where, embed_dim=DIM, hdc_dim=256, shard_max_bytes=4 << 10) as store:
            store.put_many([(k, -k, 0) for k in keys])  # several shards
    with Store.open(object_url, read_only=True) as remote, Store.open(tmp_path / "local", read_only=True) as local:
        a = remote.query(query, 0, top_k=5, token_rerank=40)
        b = local.query(query, 0, top_k=5, token_rerank=40)
        assert [(r.entry_id, r.token_score) for r in a] == [(r.entry_id, r.token_score) for r in b]
        assert a[0].entry_id == b[0].entry_id == local.entry_ids()[7]
