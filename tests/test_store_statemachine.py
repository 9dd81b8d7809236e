"""A randomized model check of the store: Hypothesis drives put, put_many,
query, flush, close/reopen, a writer that dies without flushing, and a
reader beside the writer, and compares every answer with a plain in-memory
model whose signatures come from the pure-Python reference projection.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hmem import Store
from hmem.formats import records as record_format
from hmem.kernels.reference import hamming as ref_hamming
from hmem.kernels.reference import projection as ref_projection

EMBED, HDC, SEED = 16, 256, 11
M = 64
BLOCKS = HDC // M
SIGNS = ref_projection.signs_table(SEED, M, 3, BLOCKS)


def ref_sig(rows: np.ndarray) -> np.ndarray:
    out = np.zeros(HDC // 8, dtype=np.uint8)
    ref_projection.signature(np.ascontiguousarray(rows, dtype=np.float32), SIGNS, M, 3, HDC, out)
    return out


class ModelEntry:
    def __init__(self, keys, values, layer, importance):
        self.keys, self.values, self.layer = keys, values, layer
        self.importance = float(np.float32(importance))
        self.sig = ref_sig(keys)
        self.pooled = keys.mean(axis=0, dtype=np.float64).astype(np.float32).astype(np.float64)
        self.access = 0


# The conftest helpers that count the open shard maps and drop a writer
# unflushed (a killed process): reaching past the public API lives there
# only.  Set for this module below.
INTERNALS = None


@pytest.fixture(scope="module", autouse=True)
def _internals(store_internals):
    global INTERNALS
    INTERNALS = store_internals
    yield
    INTERNALS = None


key_kind = st.sampled_from(["random", "random", "copy", "negated", "zero"])
entry_args = st.tuples(
    st.integers(1, 4), st.integers(0, 2), st.floats(0, 10, width=32), key_kind, st.integers(0, 2**32 - 1)
)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hmem-sm-"))
        self.path = self.dir / "store"
        self.store = Store.create(
            self.path, embed_dim=EMBED, hdc_dim=HDC, seed=SEED, shard_max_bytes=1500, max_open_shards=2
        )
        self.model: dict[int, ModelEntry] = {}
        self.committed: dict[int, ModelEntry] = {}  # the model as of the last flush or close
        self.max_id = 0

    def teardown(self):
        try:
            self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- helpers ------------------------------------------------------------------

    def _keys(self, n, kind, seed):
        rng = np.random.default_rng(seed)
        if kind in ("copy", "negated") and self.model:
            ids = sorted(self.model)
            src = self.model[ids[seed % len(ids)]].keys
            return src.copy() if kind == "copy" else -src
        if kind == "zero":
            return np.zeros((n, EMBED), np.float32)
        return rng.standard_normal((n, EMBED)).astype(np.float32)

    def _make(self, args):
        n, layer, importance, kind, seed = args
        keys = self._keys(n, kind, seed)
        values = np.random.default_rng(seed + 1).standard_normal(keys.shape).astype(np.float32)
        return keys, values, layer, importance

    def _record(self, ids, made):
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        if ids:
            assert ids[0] > self.max_id
            self.max_id = ids[-1]
        for eid, (k, v, layer, imp) in zip(ids, made):
            self.model[eid] = ModelEntry(k, v, layer, imp)

    def _commit_model(self):
        self.committed = copy.deepcopy(self.model)

    # ---- rules -----------------------------------------------------------------------

    @rule(args=entry_args)
    def put(self, args):
        made = self._make(args)
        k, v, layer, imp = made
        self._record([self.store.put(k, v, layer_idx=layer, importance=imp)], [made])

    @rule(batch=st.lists(entry_args, max_size=4))
    def put_many(self, batch):
        made = [self._make(a) for a in batch]
        self._record(self.store.put_many(made), made)

    @rule(
        layer=st.integers(0, 3),
        top_k=st.integers(1, 8),
        rerank=st.booleans(),
        source=st.integers(0, 1000),
        n=st.integers(1, 3),
        noise=st.sampled_from([0.0, 0.3, 3.0]),
    )
    def query(self, layer, top_k, rerank, source, n, noise):
        rng = np.random.default_rng(source)
        mine = sorted(i for i, e in self.model.items() if e.layer == layer)
        if mine and noise < 3.0:
            base = self.model[mine[source % len(mine)]].keys
            q = (base + noise * rng.standard_normal(base.shape)).astype(np.float32)
        else:
            q = rng.standard_normal((n, EMBED)).astype(np.float32)
        hits = self.store.query(q, layer, top_k, rerank=rerank)
        ids = np.array(mine, dtype=np.int64)
        d = ref_hamming.distances(ref_sig(q), np.stack([self.model[i].sig for i in mine])) if mine else np.zeros(0)
        by_sig = [int(ids[j]) for j in np.lexsort((ids, d))]
        got = [h.entry_id for h in hits]
        dist = dict(zip(mine, d.tolist()))
        if not rerank:
            assert got == by_sig[:top_k]
        else:
            shortlist = by_sig[: 4 * top_k]
            assert len(got) == min(top_k, len(mine))
            assert set(got) <= set(shortlist)
            target = q.mean(axis=0, dtype=np.float64)

            def cos(i):
                p = self.model[i].pooled
                norm = np.linalg.norm(p) * np.linalg.norm(target)
                return float(p @ target / norm) if norm > 0 else 0.0

            for h in hits:
                assert abs(h.cosine - cos(h.entry_id)) <= 1e-9
            scores = [(-h.score, h.entry_id) for h in hits]
            assert scores == sorted(scores)
            rest = [i for i in shortlist if i not in got]
            if got and rest:
                assert min(cos(i) for i in got) >= max(cos(i) for i in rest) - 1e-9
        for h in hits:
            e = self.model[h.entry_id]
            e.access += 1
            assert h.layer_idx == layer and h.n_tokens == len(e.keys)
            assert h.similarity == 1 - dist[h.entry_id] / HDC
            assert h.access_count == e.access
            assert h.importance == e.importance
            assert h.keys.dtype == np.float32 and h.keys.tobytes() == e.keys.tobytes()
            assert h.values.tobytes() == e.values.tobytes()

    @rule()
    def flush(self):
        self.store.flush()
        self._commit_model()

    @rule()
    def close_and_reopen(self):
        self.store.close()
        self.store = Store.open(self.path)
        self._commit_model()
        self._check_counts_on_disk()

    @rule()
    def writer_dies(self):
        # the writer vanishes without flushing or closing (as a killed process
        # would): the next writer sees the last commit
        INTERNALS.abandon_writer(self.store)
        self.store = Store.open(self.path)
        self.model = copy.deepcopy(self.committed)
        self._check_counts_on_disk()

    @precondition(lambda self: self.committed)
    @rule(pick=st.integers(0, 1000))
    def reader_sees_the_last_commit(self, pick):
        with Store.open(self.path, read_only=True) as reader:
            st_ = reader.stats()
            assert st_.entries == len(self.committed)
            ids = sorted(self.committed)
            e = self.committed[ids[pick % len(ids)]]
            hits = reader.query(e.keys, e.layer, len(self.committed), rerank=False)
            assert {h.entry_id for h in hits} == {i for i, x in self.committed.items() if x.layer == e.layer}
            for h in hits:
                assert h.access_count == self.committed[h.entry_id].access  # a reader does not count
                assert h.keys.tobytes() == self.committed[h.entry_id].keys.tobytes()

    # ---- invariants ----------------------------------------------------------------------

    def _check_counts_on_disk(self):
        # a writer just opened: what it sees, and what entries.bin holds
        # (read with the format module; the open finished every pending step)
        ids = sorted(self.model)
        infos = list(self.store.entries())
        assert [e.entry_id for e in infos] == ids
        assert [e.access_count for e in infos] == [self.model[i].access for i in ids]
        assert self.store.stats().evicted == 0
        doc = json.loads((self.path / "index.json").read_text())
        recs = record_format.read(self.path / "entries.bin", doc["record_count"], HDC // 8)
        assert recs["entry_id"].tolist() == ids
        assert recs["access_count"].tolist() == [self.model[i].access for i in ids]
        assert [bytes(s) for s in recs["signature"]] == [self.model[i].sig.tobytes() for i in ids]
        assert not record_format.damaged(recs).size
        if self.model:
            assert self.store.stats().next_entry_id > self.max_id

    @invariant()
    def stats_match_the_model(self):
        st_ = self.store.stats()
        assert st_.entries == len(self.model)
        layers: dict[int, int] = {}
        for e in self.model.values():
            layers[e.layer] = layers.get(e.layer, 0) + 1
        assert st_.layers == dict(sorted(layers.items()))
        assert INTERNALS.open_shard_maps(self.store) <= 2
        # every entry's tensors are in exactly one shard, and shards are never
        # empty: each sealed shard holds its entries, the rest are in the open
        # one (the next shard index, not sealed yet so not in stats)
        shards = st_.shards
        assert all(s.entries >= 1 for s in shards)
        per_shard: dict[int, int] = {}
        for e in self.store.entries():
            per_shard[e.shard_idx] = per_shard.get(e.shard_idx, 0) + 1
        for s in shards:
            assert per_shard.pop(s.index, 0) == s.entries - s.dead_entries
        assert set(per_shard) <= {len(shards)}
        assert sum(s.entries for s in shards) + per_shard.get(len(shards), 0) == len(self.model)


TestStoreMachine = StoreMachine.TestCase
# ~18 s here (the suite keeps under 10 minutes); the "thorough" profile
# (HYPOTHESIS_PROFILE=thorough) runs its own, larger count.
_profile_examples = settings.default.max_examples
TestStoreMachine.settings = settings(
    max_examples=_profile_examples if _profile_examples >= 1000 else 100, stateful_step_count=40, deadline=None
)

TestStoreMachine.pytestmark = [pytest.mark.stress]  # the quick subset leaves it out (-m "not stress")
