"""A randomized model check of store management: Hypothesis drives puts
(single and batched, past max_entries), queries, evict, plan_eviction,
compact, flush, close/reopen and a writer that dies without flushing, and
compares every answer with a plain in-memory model.  The model ranks
queries with the pure-Python reference projection and Hamming distance, and
evicts by the documented rule: lowest importance x (1 + ln(1 + accesses))
first, then the older timestamp, then the lower id.  Put timestamps come
from a fake clock so that equal and out-of-order timestamps happen.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import tempfile
import time as real_time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hmem
from hmem import Store
from hmem.kernels.reference import hamming as ref_hamming
from hmem.kernels.reference import projection as ref_projection

EMBED, HDC, SEED = 16, 256, 7
M = 64
SIGNS = ref_projection.signs_table(SEED, M, 3, HDC // M)
RECORD = 40 + HDC // 8
MAX_ENTRIES = 10
SHARD_MAX = 1500
SHARD_RE = re.compile(r"^shard_(\d{4,})\.safetensors$")


def ref_sig(rows: np.ndarray) -> np.ndarray:
    out = np.zeros(HDC // 8, dtype=np.uint8)
    ref_projection.signature(np.ascontiguousarray(rows, dtype=np.float32), SIGNS, M, 3, HDC, out)
    return out


class FakeClock:
    """Stands in for time.time_ns, where put timestamps come from."""

    def __init__(self) -> None:
        self.now = 1000

    def time_ns(self) -> int:
        return self.now


class ModelEntry:
    def __init__(self, keys, values, layer, importance, ts):
        self.keys, self.values, self.layer, self.ts = keys, values, layer, ts
        self.importance = float(np.float32(importance))
        self.sig = ref_sig(keys)
        self.access = 0

    def eviction_key(self, eid):
        return (self.importance * (1.0 + math.log1p(self.access)), self.ts, eid)


# The conftest helper that drops a writer unflushed (a killed process):
# reaching past the public API lives there only.  Set for this module below.
INTERNALS = None


@pytest.fixture(scope="module", autouse=True)
def _internals(store_internals):
    global INTERNALS
    INTERNALS = store_internals
    yield
    INTERNALS = None


key_kind = st.sampled_from(["random", "random", "copy", "negated", "zero"])
entry_args = st.tuples(
    st.integers(1, 4),
    st.integers(0, 2),
    st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0, 3.5]),
    key_kind,
    st.integers(0, 2**32 - 1),
)


class CompactionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hmem-csm-"))
        self.path = self.dir / "store"
        self.store = Store.create(
            self.path,
            embed_dim=EMBED,
            hdc_dim=HDC,
            seed=SEED,
            max_entries=MAX_ENTRIES,
            shard_max_bytes=SHARD_MAX,
            max_open_shards=2,
        )
        self.model: dict[int, ModelEntry] = {}
        self.gone: set[int] = set()  # ids evicted (never to be returned again)
        self.dead = 0  # evicted records still in entries.bin
        self.committed = (copy.deepcopy(self.model), set(), 0)
        self.max_id = 0
        # last, so that teardown (which puts it back) runs whenever it was swapped
        self.clock = FakeClock()
        self.real_time_ns = real_time.time_ns
        real_time.time_ns = self.clock.time_ns

    def teardown(self):
        try:
            self.store.close()
        finally:
            real_time.time_ns = self.real_time_ns
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

    def _order(self) -> list[int]:
        return sorted(self.model, key=lambda i: self.model[i].eviction_key(i))

    def _model_evict(self, count: int) -> list[int]:
        victims = self._order()[: max(0, count)]
        for i in victims:
            del self.model[i]
        self.gone.update(victims)
        self.dead += len(victims)
        return victims

    def _insert(self, made, call):
        over = len(self.model) + len(made) - MAX_ENTRIES
        before = set(self.model)
        victims = self._model_evict(over) if made else []
        ids = call()
        assert ids == sorted(ids) and len(set(ids)) == len(ids) == len(made)
        if ids:
            assert ids[0] > self.max_id
            self.max_id = ids[-1]
        for eid, (k, v, layer, imp) in zip(ids, made):
            self.model[eid] = ModelEntry(k, v, layer, imp, self.clock.now)
        assert before - set(self.model) == set(victims)

    def _commit_model(self):
        self.committed = (copy.deepcopy(self.model), set(self.gone), self.dead)

    def _state(self):
        st_ = self.store.stats()
        return st_.entries, st_.evicted, st_.unflushed, st_.layers, st_.next_entry_id

    # ---- rules -----------------------------------------------------------------------

    @rule(t=st.integers(0, 3))
    def set_clock(self, t):
        self.clock.now = 1000 + 10 * t  # may go back: later ids with older timestamps

    @rule(args=entry_args)
    def put(self, args):
        made = [self._make(args)]
        k, v, layer, imp = made[0]
        self._insert(made, lambda: [self.store.put(k, v, layer_idx=layer, importance=imp)])

    @rule(batch=st.lists(entry_args, max_size=4))
    def put_many(self, batch):
        made = [self._make(a) for a in batch]
        self._insert(made, lambda: self.store.put_many(made))

    @rule(seed=st.integers(0, 1000))
    def put_more_than_max_entries(self, seed):
        made = [self._make((1, 0, 1.0, "random", seed + i)) for i in range(MAX_ENTRIES + 1)]
        before = self._state()
        with pytest.raises(hmem.EntryTooLargeError):
            self.store.put_many(made)
        assert self._state() == before

    @rule(
        layer=st.integers(0, 3),
        top_k=st.integers(1, 8),
        source=st.integers(0, 1000),
        n=st.integers(1, 3),
        noise=st.sampled_from([0.0, 0.3, 3.0]),
    )
    def query(self, layer, top_k, source, n, noise):
        rng = np.random.default_rng(source)
        mine = sorted(i for i, e in self.model.items() if e.layer == layer)
        if mine and noise < 3.0:
            base = self.model[mine[source % len(mine)]].keys
            q = (base + noise * rng.standard_normal(base.shape)).astype(np.float32)
        else:
            q = rng.standard_normal((n, EMBED)).astype(np.float32)
        hits = self.store.query(q, layer, top_k, rerank=False)
        ids = np.array(mine, dtype=np.int64)
        d = ref_hamming.distances(ref_sig(q), np.stack([self.model[i].sig for i in mine])) if mine else np.zeros(0)
        expected = [int(ids[j]) for j in np.lexsort((ids, d))][:top_k]
        assert [h.entry_id for h in hits] == expected
        dist = dict(zip(mine, d.tolist()))
        for h in hits:
            assert h.entry_id not in self.gone
            e = self.model[h.entry_id]
            e.access += 1
            assert h.similarity == 1 - dist[h.entry_id] / HDC
            assert h.access_count == e.access and h.importance == e.importance and h.timestamp == e.ts
            assert h.keys.dtype == np.float32 and h.keys.tobytes() == e.keys.tobytes()
            assert h.values.tobytes() == e.values.tobytes()

    @rule(keep=st.integers(0, MAX_ENTRIES + 2))
    def plan_eviction(self, keep):
        target = keep
        before = self._state()
        plan = self.store.plan_eviction(target)
        assert list(plan.entry_ids) == self._order()[: max(0, len(self.model) - target)]
        assert plan.entries_before == len(self.model)
        assert self._state() == before

    @rule(keep=st.integers(0, MAX_ENTRIES + 2))
    def evict(self, keep):
        target = keep
        expected = self._order()[: max(0, len(self.model) - target)]
        assert self.store.evict(target) == len(expected)
        assert self._model_evict(len(expected)) == expected
        self._commit_model()  # evict flushes: durable when it returns

    @rule(share=st.sampled_from([0.0, 0.5, 1.0]), repack=st.booleans())
    def compact(self, share, repack):
        # incremental (a shard whose dead bytes reach `share` of it goes or is
        # rewritten; evicted records go once they are `share` of the records),
        # or the whole-store repack
        report = self.store.compact(min_dead_share=share, repack=repack)
        assert report.performed == (report.reason not in ("already compact", "no shard past the dead share"))
        assert report.entries == len(self.model)
        assert report.records_dropped in (0, self.dead)
        if repack or share == 0.0:
            assert report.records_dropped == self.dead
        if not report.performed:
            assert self.dead == 0 or share > 0.0
        self.dead -= report.records_dropped
        if report.performed:
            self._commit_model()  # compaction flushes first; a no-op compaction writes nothing
        doc = json.loads((self.path / "index.json").read_text())
        files = sorted(p.name for p in self.path.iterdir() if SHARD_RE.match(p.name))
        assert files == [f"shard_{i:04d}.safetensors" for i in range(len(doc["shards"]))]
        for s in doc["shards"]:
            assert s["bytes"] <= SHARD_MAX or s["entries"] == 1
            if report.performed:  # no shard left without live entries
                assert s["dead_entries"] < s["entries"]
        if report.performed:  # nor one the compaction should have freed
            assert not self.store.plan_compaction(min_dead_share=share, repack=repack).needed or repack
        records = len(self.model) + self.dead
        assert (self.path / "entries.bin").stat().st_size == records * RECORD == doc["record_count"] * RECORD

    @rule()
    def flush(self):
        self.store.flush()
        self._commit_model()

    @rule()
    def close_and_reopen(self):
        self.store.close()
        self.store = Store.open(self.path)
        self._commit_model()

    @rule()
    def writer_dies(self):
        # a killed writer: the next one sees the last commit (evictions by a
        # put past max_entries are undone unless flushed; evict's are not)
        INTERNALS.abandon_writer(self.store)
        self.store = Store.open(self.path)
        model, gone, dead = self.committed
        self.model, self.gone, self.dead = copy.deepcopy(model), set(gone), dead

    @precondition(lambda self: self.committed[0])
    @rule()
    def reader_sees_the_last_commit(self):
        model, gone, _ = self.committed
        with Store.open(self.path, read_only=True) as reader:
            assert reader.stats().entries == len(model)
            for layer in {e.layer for e in model.values()}:
                hits = reader.query(np.ones(EMBED, np.float32), layer, 100, rerank=False)
                assert {h.entry_id for h in hits} == {i for i, e in model.items() if e.layer == layer}
                for h in hits:
                    assert h.keys.tobytes() == model[h.entry_id].keys.tobytes()

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def stats_match_the_model(self):
        st_ = self.store.stats()
        assert st_.entries == len(self.model) <= MAX_ENTRIES
        assert st_.evicted == self.dead
        layers: dict[int, int] = {}
        for e in self.model.values():
            layers[e.layer] = layers.get(e.layer, 0) + 1
        assert st_.layers == dict(sorted(layers.items()))
        infos = list(self.store.entries())
        live = [e.entry_id for e in infos]
        assert live == self.store.entry_ids() == sorted(self.model)
        assert not self.gone & set(live)
        assert [e.access_count for e in infos] == [self.model[i].access for i in sorted(self.model)]
        assert [(e.layer_idx, e.importance, e.created) for e in infos] == [
            (self.model[i].layer, self.model[i].importance, self.model[i].ts) for i in sorted(self.model)
        ]


TestCompactionMachine = CompactionMachine.TestCase
TestCompactionMachine.pytestmark = [pytest.mark.stress]
# ~18 s here (the suite keeps under 10 minutes); the "thorough" profile
# (HYPOTHESIS_PROFILE=thorough) runs its own, larger count.
_profile_examples = settings.default.max_examples
TestCompactionMachine.settings = settings(
    max_examples=_profile_examples if _profile_examples >= 1000 else 100, stateful_step_count=50, deadline=None
)
