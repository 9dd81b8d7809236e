"""Store management (docs/format.md, docs/reliability.md): evict and plan_eviction with the
documented score and tie rule, the max_entries and max_disk_bytes limits,
compact and plan_compaction (layout, content, orphans, thresholds, readers
opened before), and crash points of evict and compact in a subprocess.

The randomized model check of evict/compact is
tests/test_compaction_statemachine.py; INT8 storage is in
tests/test_quantize_kernels.py and the bridge in tests/test_bridge.py.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import time as real_time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hmem
from hmem import Entry, Store, _io
from hmem.formats.records import EVICTED

F = np.float32
EMBED, HDC = 16, 256
RECORD = 40 + HDC // 8
POOLED_ROW = 12 + 4 * EMBED  # an entry's row of pooled.bin (docs/format.md)
SHARD_RE = re.compile(r"^shard_(\d{4,})\.safetensors$")


def gauss(rng, n, d=EMBED):
    return rng.standard_normal((n, d)).astype(F)


class FakeClock:
    """Stands in for time.time_ns, where put timestamps come from: they are
    `now`; the rest of the time module is the real one."""

    def __init__(self, now: int = 1_000_000) -> None:
        self.now = now
        self.calls = 0

    def time_ns(self) -> int:
        self.calls += 1
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(real_time, "time_ns", c.time_ns)
    return c


def score(importance: float, access: int) -> float:
    """The documented score: importance x (1 + ln(1 + access_count))."""
    return float(np.float32(importance)) * (1.0 + math.log1p(access))


class Model:
    """What the store should hold: id -> fields, plus the documented eviction order."""

    def __init__(self) -> None:
        self.entries: dict[int, dict] = {}

    def add(self, eid, keys, values, layer, importance, ts):
        self.entries[eid] = dict(
            keys=keys, values=values, layer=layer, importance=float(np.float32(importance)), ts=ts, access=0
        )

    def order(self) -> list[int]:
        """Live ids, first to evict first: lowest score, then older timestamp, then lower id."""
        return sorted(
            self.entries,
            key=lambda i: (score(self.entries[i]["importance"], self.entries[i]["access"]), self.entries[i]["ts"], i),
        )

    def evict(self, count: int) -> list[int]:
        victims = self.order()[: max(0, count)]
        for i in victims:
            del self.entries[i]
        return victims


def live_ids(store, layers=None) -> set[int]:
    """Every live entry id, through the public query API (no access counted)."""
    out = set()
    for layer in layers if layers is not None else store.stats().layers:
        q = np.ones((1, store.config.embed_dim), F)
        out.update(h.entry_id for h in store.query(q, layer, 1 << 20, rerank=False, count_access=False))
    return out


def own_hit(store, entry_id: int) -> tuple[int, float]:
    """(id, similarity) of the best hit for an entry's own keys (read back with
    get), no access counted.  It stands in for the entry's signature, which
    the public API does not show: (entry_id, 1.0) while the stored signature
    is the one its keys give (F32); a signature that changed moves it."""
    entry = store.get(entry_id)
    (hit,) = store.query(entry.keys, entry.info.layer_idx, 1, rerank=False, count_access=False)
    return hit.entry_id, hit.similarity


def store_state(store, path, snapshot_dir):
    """The files, the stats, every live entry's metadata (access counts, shard
    and put time included) and signature stand-in, and every live K/V."""
    st = store.stats()
    files = snapshot_dir(path)
    files.pop("lock", None)
    entries = []
    for info in store.entries():
        got = store.get(info.entry_id)
        entries.append((info, own_hit(store, info.entry_id), got.keys.tobytes(), got.values.tobytes()))
    return (
        files,
        (
            st.entries,
            st.evicted,
            st.unflushed,
            st.layers,
            st.next_entry_id,
            st.total_accesses,
            [(s.file, s.bytes, s.entries, s.dead_entries, s.dead_bytes) for s in st.shards],
        ),
        entries,
    )


def answers(store, queries, top_k=6):
    """Every field of every result of `queries` (both rankings), except the shard index."""
    out = []
    for q, layer in queries:
        for rerank in (False, True):
            for h in store.query(q, layer, top_k, rerank=rerank, count_access=False):
                out.append(
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
                        h.keys.tobytes(),
                        h.values.tobytes(),
                    )
                )
    return out


def live_records(store) -> dict[int, tuple]:
    """id -> what compaction must keep of each live entry: its metadata (all
    but the shard), its signature (as own_hit sees it) and its K/V."""
    out = {}
    for e in store.entries():
        got = store.get(e.entry_id)
        out[e.entry_id] = (
            e.layer_idx,
            e.n_tokens,
            e.importance,
            e.created,
            e.access_count,
            own_hit(store, e.entry_id),
            got.keys.tobytes(),
            got.values.tobytes(),
        )
    return out


def mtimes(path: Path) -> dict[str, tuple[int, int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size, p.stat().st_ino) for p in path.iterdir()}


def assert_compact_layout(path: Path, shard_max_bytes: int):
    """Shards named shard_0000.. in order, within shard_max_bytes unless a
    shard holds one entry, entries.bin exactly the committed (live) records."""
    doc = json.loads((path / "index.json").read_text())
    shard_files = sorted(p.name for p in path.iterdir() if SHARD_RE.match(p.name))
    assert shard_files == [f"shard_{i:04d}.safetensors" for i in range(len(doc["shards"]))]
    assert [s["file"] for s in doc["shards"]] == shard_files
    for s in doc["shards"]:
        size = (path / s["file"]).stat().st_size
        assert size == s["bytes"]
        assert s["dead_entries"] == 0 and s["dead_bytes"] == 0
        assert size <= shard_max_bytes or s["entries"] == 1, (s, shard_max_bytes)
    assert (path / "entries.bin").stat().st_size == doc["record_count"] * doc["record_size"]
    assert not [p.name for p in path.iterdir() if p.name.startswith(_io.TEMP_PREFIX)]
    recs = hmem.formats.records.read(path / "entries.bin", doc["record_count"], doc["config"]["hdc_dim"] // 8)
    assert not (recs["shard_idx"] == EVICTED).any()
    assert recs["entry_id"].tolist() == sorted(recs["entry_id"].tolist())
    assert not hmem.formats.records.damaged(recs).size
    return doc, recs


# ---- evict and plan_eviction ------------------------------------------------------------


def test_evict_follows_score_then_older_timestamp_then_lower_id(store_factory, clock):
    rng = np.random.default_rng(1)
    store = store_factory(shard_max_bytes=2000)
    model = Model()

    def put(importance, ts, layer=0):
        clock.now = ts
        k = gauss(rng, 2)
        eid = store.put(k, -k, layer_idx=layer, importance=importance)
        model.add(eid, k, -k, layer, importance, ts)
        return eid

    # equal scores: the clock runs backwards, so later (higher) ids are older
    a, b, c = put(1.0, 300), put(1.0, 200), put(1.0, 100)
    # equal scores and one timestamp (one put_many): lower id first
    clock.now = 50
    batch = [(gauss(rng, 1), gauss(rng, 1), 1, 1.0) for _ in range(3)]
    d, e, f = store.put_many(batch)
    for eid, (k, v, layer, imp) in zip((d, e, f), batch):
        model.add(eid, k, v, layer, imp, 50)
    low = put(0.5, 10_000)  # the lowest score goes first whatever its age
    # access counts raise the score: 1.0 x (1 + ln 2) > 1.5 > 1.0
    accessed = put(1.0, 1)
    mid = put(1.5, 1)
    hit = store.query(model.entries[accessed]["keys"], 0, 1, rerank=False)
    assert hit[0].entry_id == accessed
    model.entries[accessed]["access"] = 1
    store.flush()
    expected = [low, d, e, f, c, b, a, mid, accessed]
    assert model.order() == expected  # the model agrees with the rule as written
    assert store.plan_eviction(0).entry_ids == tuple(expected)
    for target in range(len(expected) - 1, -1, -1):
        plan = store.plan_eviction(target)
        assert plan.entry_ids == (expected[len(expected) - 1 - target],)
        assert plan.count == 1 and plan.entries_before == target + 1 and plan.target_entries == target
        assert store.evict(target) == 1
        assert live_ids(store, [0, 1]) == set(expected[len(expected) - target :])
    assert store.stats().entries == 0 and store.stats().evicted == len(expected)


def test_ties_within_one_put_many_go_to_the_lower_id(store_factory):
    rng = np.random.default_rng(2)
    store = store_factory()
    first = store.put(gauss(rng, 1), gauss(rng, 1), importance=2.0)
    batch = [Entry(gauss(rng, 2), gauss(rng, 2), i % 2, 1.0) for i in range(8)]
    ids = store.put_many(batch)
    infos = list(store.entries())
    assert [e.entry_id for e in infos] == [first, *ids]
    assert len({e.created for e in infos[1:]}) == 1  # one put_many, one timestamp
    # equal score, equal timestamp: only the id decides, the lower first
    plan = store.plan_eviction(4)
    assert plan.entry_ids == tuple(ids[:5])
    assert store.evict(6) == 3
    assert live_ids(store) == {first, *ids[3:]}
    assert store.evict(1) == 5
    assert live_ids(store) == {first}


def test_evict_matches_the_model_on_random_stores(tmp_path, clock):
    rng = np.random.default_rng(3)
    for trial in range(4):
        store = Store.create(tmp_path / f"s{trial}", embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=1500)
        model = Model()
        for _ in range(int(rng.integers(10, 30))):
            clock.now = int(rng.integers(0, 4))  # many equal timestamps
            n = int(rng.integers(1, 4))
            batch = [
                (
                    gauss(rng, int(rng.integers(1, 4))),
                    None,
                    int(rng.integers(0, 2)),
                    float(rng.choice([0.25, 0.5, 1.0, 2.0])),
                )
                for _ in range(n)
            ]
            batch = [(k, k * 3, layer, imp) for k, _, layer, imp in batch]
            ids = store.put_many(batch) if n > 1 else [store.put(*batch[0])]
            for eid, (k, v, layer, imp) in zip(ids, batch):
                model.add(eid, k, v, layer, imp, clock.now)
            if rng.random() < 0.5:
                store.flush()
        for _ in range(15):  # accesses change scores
            eid = int(rng.choice(list(model.entries)))
            e = model.entries[eid]
            for h in store.query(e["keys"], e["layer"], int(rng.integers(1, 4)), rerank=bool(rng.random() < 0.5)):
                model.entries[h.entry_id]["access"] += 1
        while model.entries:
            target = int(rng.integers(0, len(model.entries) + 2))
            expected = model.order()[: max(0, len(model.entries) - target)]
            plan = store.plan_eviction(target)
            assert list(plan.entry_ids) == expected
            assert store.evict(target) == len(expected)
            model.evict(len(expected))
            assert live_ids(store, [0, 1]) == set(model.entries)
            if target == 0:
                break
        store.close()


def test_evict_target_bounds(store_factory, snapshot_dir):
    rng = np.random.default_rng(4)
    store = store_factory()
    ids = [store.put(gauss(rng, 2), gauss(rng, 2), importance=1.0 + i) for i in range(5)]
    store.flush()
    before = store_state(store, store.path, snapshot_dir)
    for target in (5, 6, 10**9):
        assert store.plan_eviction(target).entry_ids == ()
        assert store.plan_eviction(target).bytes_reclaimable == 0
        assert store.evict(target) == 0
        assert store_state(store, store.path, snapshot_dir) == before
    assert store.evict(np.int64(3)) == 2  # numpy integers are integers
    assert live_ids(store) == set(ids[2:])
    assert store.evict(0) == 3
    assert live_ids(store) == set() and store.stats().entries == 0 and store.stats().evicted == 5
    assert store.query(np.ones(EMBED, F), 0, 10) == []


@pytest.mark.parametrize("target", [-1, -(2**70), 1.5, 2.0, "3", None, True, False, np.float64(1.0), [1]])
def test_evict_refuses_a_bad_target_and_changes_nothing(store_factory, snapshot_dir, target):
    rng = np.random.default_rng(5)
    store = store_factory()
    for i in range(4):
        store.put(gauss(rng, 2), gauss(rng, 2), importance=float(i))
    store.flush()
    store.put(gauss(rng, 1), gauss(rng, 1))  # an unflushed entry too
    before = store_state(store, store.path, snapshot_dir)
    with pytest.raises(hmem.InvalidArgumentError):
        store.evict(target)
    assert store_state(store, store.path, snapshot_dir) == before
    with pytest.raises(hmem.InvalidArgumentError):
        store.plan_eviction(target)
    assert store_state(store, store.path, snapshot_dir) == before
    assert store.stats().entries == 5


def test_plan_eviction_changes_nothing_and_counts_the_bytes(store_factory, snapshot_dir):
    rng = np.random.default_rng(6)
    store = store_factory(shard_max_bytes=1500)
    data = {}
    for i in range(12):
        k = gauss(rng, int(rng.integers(1, 6)))
        data[store.put(k, k, layer_idx=i % 2, importance=float(i % 4))] = k
    store.query(data[1], 0, 3)
    store.flush()
    store.query(data[2], 1, 2)  # an unflushed access count too
    before = store_state(store, store.path, snapshot_dir)
    plans = [store.plan_eviction(t) for t in range(12, -1, -1)]
    assert store_state(store, store.path, snapshot_dir) == before
    for count, plan in enumerate(plans):
        assert plan.count == count and plan.entries_before == 12
        assert plan.entry_ids == plans[-1].entry_ids[:count]  # one order, any prefix
        # at least the tensors themselves (keys, values, pooled key)
        tensors = sum(2 * 4 * data[i].size + 4 * EMBED for i in plan.entry_ids)
        assert plan.bytes_reclaimable >= tensors
        assert (plan.lowest_score is None) == (count == 0)
    assert [p.bytes_reclaimable for p in plans] == sorted(p.bytes_reclaimable for p in plans)
    plan = store.plan_eviction(7)
    reclaimable = store.stats().reclaimable_bytes
    assert store.evict(7) == 5
    # what the plan promised is what the store now counts as reclaimable (a shard
    # left without live entries frees its header too: at most 1 KiB a shard)
    promised = reclaimable + plan.bytes_reclaimable + 5 * (RECORD + POOLED_ROW)
    assert promised <= store.stats().reclaimable_bytes <= promised + 1024 * len(store.stats().shards)
    assert live_ids(store) == set(data) - set(plan.entry_ids)


def test_evicted_entries_never_come_back(tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "s"
    store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=1500)
    data = {}
    for i in range(20):
        k = gauss(rng, int(rng.integers(1, 4)))
        data[store.put(k, k + 1, layer_idx=i % 3, importance=float(i % 5))] = (k, i % 3)
    store.flush()
    plan = store.plan_eviction(9)
    assert store.evict(9) == 11
    gone = set(plan.entry_ids)

    def check(s):
        for _eid, (k, layer) in data.items():
            for rerank in (True, False):
                got = {h.entry_id for h in s.query(k, layer, 100, rerank=rerank, count_access=False)}
                assert got == {i for i, (_, lay) in data.items() if lay == layer} - gone
        assert s.stats().entries == 9

    check(store)
    store.close()
    with Store.open(path) as store:
        check(store)
        assert store.compact().performed
        check(store)
        assert store.stats().evicted == 0
    with Store.open(path, read_only=True) as reader:
        check(reader)
    with Store.open(path) as store:
        check(store)


def test_evict_is_durable_when_it_returns(tmp_path, run_python):
    rng = np.random.default_rng(8)
    path = tmp_path / "s"
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC) as store:
        ids = [store.put(gauss(rng, 2), gauss(rng, 2), importance=float(i)) for i in range(6)]
    code = f"""
import os, hmem
store = hmem.Store.open({str(path)!r})
print(store.evict(2), flush=True)
os._exit(0)  # no close, no flush
"""
    proc = run_python(code, check=True)
    assert proc.stdout.strip() == "4"
    with Store.open(path) as store:
        assert live_ids(store) == set(ids[4:])
        assert store.stats().evicted == 4


def test_evict_and_plan_on_a_read_only_store(tmp_path):
    rng = np.random.default_rng(9)
    path = tmp_path / "s"
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC) as store:
        for i in range(3):
            store.put(gauss(rng, 1), gauss(rng, 1), importance=float(i))
    with Store.open(path, read_only=True) as reader:
        assert reader.plan_eviction(1).entry_ids == (1, 2)
        with pytest.raises(hmem.ReadOnlyStoreError):
            reader.evict(1)
        with pytest.raises(hmem.ReadOnlyStoreError):
            reader.compact()
    with Store.open(path) as store:
        assert store.stats().entries == 3


# ---- limits --------------------------------------------------------------------------------


@pytest.mark.stress
def test_max_entries_evicts_the_lowest_scored_first(tmp_path, clock):
    rng = np.random.default_rng(10)
    limit = 7
    store = Store.create(tmp_path / "s", embed_dim=EMBED, hdc_dim=HDC, max_entries=limit, shard_max_bytes=1500)
    model = Model()
    try:
        for step in range(60):
            clock.now = int(rng.integers(0, 5))
            n = int(rng.choice([1, 1, 2, 3, limit]))
            batch = [
                (gauss(rng, int(rng.integers(1, 3))), None, 0, float(rng.choice([0.5, 1.0, 2.0]))) for _ in range(n)
            ]
            batch = [(k, -k, layer, imp) for k, _, layer, imp in batch]
            over = len(model.entries) + n - limit
            expected_victims = model.order()[: max(0, over)]
            ids = store.put_many(batch) if n > 1 or step % 2 else [store.put(*batch[0])]
            model.evict(len(expected_victims))
            for eid, (k, v, layer, imp) in zip(ids, batch):
                model.add(eid, k, v, layer, imp, clock.now)
            assert store.stats().entries == len(model.entries) <= limit
            assert live_ids(store, [0]) == set(model.entries)
            if rng.random() < 0.3:
                store.flush()
            if rng.random() < 0.4:
                e = model.entries[int(rng.choice(list(model.entries)))]
                for h in store.query(e["keys"], 0, 2, rerank=False):
                    model.entries[h.entry_id]["access"] += 1
        store.close()
        with Store.open(tmp_path / "s") as again:
            assert live_ids(again, [0]) == set(model.entries)
            for eid, e in model.entries.items():
                (h,) = [
                    h for h in again.query(e["keys"], 0, limit, rerank=False, count_access=False) if h.entry_id == eid
                ]
                assert h.keys.tobytes() == e["keys"].tobytes() and h.values.tobytes() == e["values"].tobytes()
    finally:
        store.close()


def test_a_batch_larger_than_max_entries_is_refused(store_factory, snapshot_dir):
    rng = np.random.default_rng(11)
    store = store_factory(max_entries=3)
    store.put(gauss(rng, 1), gauss(rng, 1))
    store.flush()
    store.put(gauss(rng, 1), gauss(rng, 1))
    before = store_state(store, store.path, snapshot_dir)
    batch = [(gauss(rng, 1), gauss(rng, 1)) for _ in range(4)]
    with pytest.raises(hmem.EntryTooLargeError):
        store.put_many(batch)
    assert store_state(store, store.path, snapshot_dir) == before
    assert store.put_many(batch[:3]) == [3, 4, 5]  # a batch of exactly max_entries fits
    assert live_ids(store) == {3, 4, 5}


def test_an_entry_that_can_never_fit_the_disk_is_refused(store_factory, snapshot_dir):
    rng = np.random.default_rng(12)
    limit = 40_000
    store = store_factory(max_disk_bytes=limit)
    for _ in range(3):
        store.put(gauss(rng, 2), gauss(rng, 2))
    store.flush()
    store.put(gauss(rng, 1), gauss(rng, 1))
    before = store_state(store, store.path, snapshot_dir)
    huge = gauss(rng, limit // (8 * EMBED))  # its keys and values alone are the whole limit
    with pytest.raises(hmem.EntryTooLargeError):
        store.put(huge, huge)
    assert store_state(store, store.path, snapshot_dir) == before
    pieces = [gauss(rng, 40) for _ in range(6)]  # each fits, not all together
    store.put(pieces[0], pieces[0])
    before = store_state(store, store.path, snapshot_dir)
    with pytest.raises(hmem.EntryTooLargeError):
        store.put_many([(p, p) for p in pieces])
    assert store_state(store, store.path, snapshot_dir) == before
    assert store.stats().entries == 5


def _disk_run(tmp_path, clock, *, limit, flush_every, queries, seed, steps, precious_every=0):
    """Puts entries into a store with max_disk_bytes=limit; yields after every flush."""
    rng = np.random.default_rng(seed)
    store = Store.create(tmp_path / f"disk{seed}", embed_dim=EMBED, hdc_dim=HDC, max_disk_bytes=limit)
    model = Model()
    try:
        for i in range(steps):
            clock.now = 1000 + i
            k = gauss(rng, int(rng.integers(1, 5)))
            imp = 100.0 if precious_every and i % precious_every == 0 else float(rng.random())
            order = model.order()
            eid = store.put(k, k, importance=imp)
            live = live_ids(store, [0])
            gone = set(model.entries) - live
            assert eid in live
            # whatever went, went in eviction order
            assert gone == set(order[: len(gone)]), (gone, order[: len(gone)])
            model.evict(len(gone))
            model.add(eid, k, k, 0, imp, clock.now)
            if gone:
                # the put made room and compacted: evicted records stay behind only
                # while they are below the dead share (half the records)
                st_ = store.stats()
                assert st_.evicted < max(1, st_.entries) and st_.entries == len(model.entries)
                assert store.size() < limit
            if queries and rng.random() < 0.3:
                for h in store.query(k, 0, 5):
                    model.entries[h.entry_id]["access"] += 1
            if i % flush_every == 0:
                store.flush()
                yield store, model, i
    finally:
        store.close()


def test_disk_limit_evicts_the_lowest_scored_and_compacts(tmp_path, clock):
    limit = 60_000
    checked = 0
    for store, model, i in _disk_run(
        tmp_path, clock, limit=limit, flush_every=4, queries=False, seed=13, steps=160, precious_every=8
    ):
        if i < 150:
            continue
        checked += 1
        assert store.stats().next_entry_id - 1 - len(model.entries) > 40  # the limit was reached many times
        # every important entry survived, intact
        precious = [eid for eid, e in model.entries.items() if e["importance"] == 100.0]
        assert len(precious) == i // 8 + 1 >= 19
        hits = {h.entry_id: h for h in store.query(np.ones(EMBED, F), 0, 200, rerank=False, count_access=False)}
        for eid in precious:
            assert hits[eid].keys.tobytes() == model.entries[eid]["keys"].tobytes()
    assert checked


def test_disk_limit_counts_evicted_bytes_until_compaction(store_factory):
    rng = np.random.default_rng(14)
    limit = 50_000
    store = store_factory(max_disk_bytes=limit)
    data = {}
    while store.size() < 38_000:
        k = gauss(rng, 4)
        data[store.put(k, k, importance=1.0)] = k
        store.flush()
    assert store.stats().evicted == 0
    size = store.size()
    store.evict(3)
    assert store.size() >= size  # evicted bytes stay until compaction
    assert store.stats().evicted == len(data) - 3
    survivors = live_ids(store)
    # fill up to the limit: the put that would pass it compacts, which frees
    # enough that no live entry has to go
    puts = 0
    while store.stats().evicted:
        k = gauss(rng, 4)
        data[store.put(k, k, importance=1.0)] = k
        puts += 1
        assert store.size() <= limit
    assert puts > 1 and survivors <= live_ids(store)
    assert store.stats().entries == 3 + puts
    assert store.size() < size


@pytest.mark.stress
def test_disk_limit_holds_after_every_put_and_flush(tmp_path):
    limit = 30_000
    for seed in range(6):
        rng = np.random.default_rng(seed)
        with Store.create(tmp_path / f"s{seed}", embed_dim=EMBED, hdc_dim=HDC, max_disk_bytes=limit) as store:
            for i in range(120):
                k = gauss(rng, int(rng.integers(1, 5)))
                if i % 2:
                    store.query(k, 0, 1000)  # every live entry's access count changes
                store.put(k, k, importance=float(rng.random()))
                store.flush()
                assert store.size() <= limit, f"seed {seed}, put {i}: {store.size()} bytes on disk, limit {limit}"


# ---- compaction ------------------------------------------------------------------------------


def _mixed_store(path, rng, *, n=24, shard_max_bytes=1500, evict_to=None, **config):
    store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=shard_max_bytes, **config)
    data = {}
    for i in range(n):
        tokens = 14 if i % 9 == 4 else int(rng.integers(1, 4))  # a few larger than a shard
        k = gauss(rng, tokens)
        data[store.put(k, k * 0.5, layer_idx=i % 3, importance=float(rng.choice([0.5, 1.0, 2.0])))] = (k, i % 3)
        if i % 5 == 4:
            store.flush()
    for eid in list(data)[::4]:
        store.query(data[eid][0], data[eid][1], 3)
    store.flush()
    if evict_to is not None:
        store.evict(evict_to)
    return store, data


def test_compaction_rewrites_live_entries_only(tmp_path, snapshot_dir):
    rng = np.random.default_rng(15)
    path = tmp_path / "s"
    store, data = _mixed_store(path, rng, evict_to=14)
    try:
        queries = [(k, layer) for k, layer in data.values()] + [(gauss(rng, 2), layer) for layer in range(3)]
        before_answers = answers(store, queries)
        before_records = live_records(store)
        st0 = store.stats()
        assert st0.evicted == 10 and st0.entries == 14 and len(st0.shards) >= 5
        # leftovers hmem made, and a foreign file
        (path / "shard_0099.safetensors").write_bytes(b"\0" * 4000)
        (path / ".hmem-tmp.x").write_bytes(b"partial")
        (path / "notes.txt").write_text("mine")
        st1 = store.stats()
        assert st1.orphan_files == [".hmem-tmp.x", "shard_0099.safetensors"]
        assert st1.foreign_files == ["notes.txt"]
        plan = store.plan_compaction()
        assert plan.needed and plan.evicted_records == 10
        assert set(plan.orphan_files) == {".hmem-tmp.x", "shard_0099.safetensors"}
        assert plan.reclaimable_bytes >= 4000 + 7 + 10 * RECORD
        size = store.size()
        report = store.compact(min_dead_share=0.0)  # every evicted byte (10 of 24 records: below the default share)
        assert report.performed and report.records_dropped == 10 and report.orphans_removed == 2
        assert report.entries == 14 and report.shards_before == len(st0.shards)
        assert report.shards_after == len(store.stats().shards) < len(st0.shards)
        assert store.size() < size
        assert (path / "notes.txt").read_text() == "mine"
        assert not (path / "shard_0099.safetensors").exists() and not (path / ".hmem-tmp.x").exists()
        st2 = store.stats()
        assert st2.orphan_files == [] and st2.foreign_files == ["notes.txt"]
        assert st2.entries == 14 and st2.evicted == 0 and st2.layers == st0.layers
        doc, recs = assert_compact_layout(path, 1500)
        assert doc["record_count"] == st2.entries == len(recs)
        assert set(recs["entry_id"].tolist()) == set(before_records)
        assert live_records(store) == before_records
        assert answers(store, queries) == before_answers
        assert store.stats().next_entry_id == st0.next_entry_id
        assert any(s.entries == 1 and s.bytes > 1500 for s in st2.shards)  # the oversized ones
        store.close()
        for read_only in (True, False):
            with Store.open(path, read_only=read_only) as again:
                assert live_records(again) == before_records
                assert answers(again, queries) == before_answers
        assert (path / "notes.txt").read_text() == "mine"
    finally:
        store.close()


def test_plan_compaction_changes_nothing(tmp_path, snapshot_dir):
    rng = np.random.default_rng(16)
    path = tmp_path / "s"
    store, _ = _mixed_store(path, rng, evict_to=10)
    try:
        store.put(gauss(rng, 2), gauss(rng, 2))  # unflushed
        (path / ".hmem-tmp.y").write_bytes(b"yy")
        before, times = store_state(store, path, snapshot_dir), mtimes(path)
        plan = store.plan_compaction()
        assert plan.needed and plan.evicted_records > 0 and plan.orphan_files == (".hmem-tmp.y",)
        assert plan.shards_before == len(store.stats().shards) + 1  # the open shard counts
        assert 0 < plan.reclaimable_share < 1 and plan.bytes_before == store.size()
        assert plan.bytes_after_estimate == plan.bytes_before - plan.reclaimable_bytes
        assert store_state(store, path, snapshot_dir) == before and mtimes(path) == times
    finally:
        store.close()


def test_compaction_below_the_threshold_does_nothing(tmp_path, snapshot_dir):
    rng = np.random.default_rng(17)
    path = tmp_path / "s"
    store, _ = _mixed_store(path, rng, evict_to=22)
    try:
        plan = store.plan_compaction(min_dead_share=0.0)
        assert plan.needed and 0 < plan.reclaimable_share < 0.5
        before, times = store_state(store, path, snapshot_dir), mtimes(path)
        for threshold in (plan.reclaimable_share + 1e-9, 0.5, 1.0):
            report = store.compact(min_reclaim_share=threshold, min_dead_share=0.0)
            assert not report.performed and "threshold" in report.reason
            assert report.bytes_freed == 0
            assert store_state(store, path, snapshot_dir) == before and mtimes(path) == times
        for bad in (-0.1, 1.5, float("nan")):
            with pytest.raises(hmem.InvalidArgumentError):
                store.compact(min_reclaim_share=bad)
        assert store_state(store, path, snapshot_dir) == before and mtimes(path) == times
        assert store.compact(min_reclaim_share=plan.reclaimable_share, min_dead_share=0.0).performed
        assert store.stats().evicted == 0
    finally:
        store.close()


def test_compacting_a_compact_store_is_a_no_op(tmp_path, snapshot_dir):
    rng = np.random.default_rng(18)
    path = tmp_path / "s"
    store, _ = _mixed_store(path, rng, evict_to=12)
    try:
        assert store.compact(min_dead_share=0.0).performed  # every evicted byte freed
        store.query(gauss(rng, 1), 0, 2)  # an access count is no reason to compact
        store.flush()
        before, times = store_state(store, path, snapshot_dir), mtimes(path)
        plan = store.plan_compaction()
        assert not plan.needed and plan.reclaimable_bytes == 0 and plan.shards_after == plan.shards_before
        for threshold in (0.0, 0.5):
            report = store.compact(min_reclaim_share=threshold)
            assert not report.performed and "already compact" in report.reason
            assert report.bytes_before == report.bytes_after and report.bytes_freed == 0
            assert store_state(store, path, snapshot_dir) == before and mtimes(path) == times
    finally:
        store.close()


def test_compaction_of_a_store_with_nothing_live(tmp_path):
    rng = np.random.default_rng(19)
    path = tmp_path / "s"
    store, data = _mixed_store(path, rng, evict_to=0)
    try:
        report = store.compact()
        assert report.performed and report.entries == 0 and report.shards_after == 0
        assert sorted(p.name for p in path.iterdir()) == [
            "commit.stamp",
            "entries.bin",
            "index.json",
            "lock",
            "pooled.bin",
        ]
        assert (path / "entries.bin").stat().st_size == 0 and (path / "pooled.bin").stat().st_size == 0
        k = gauss(rng, 2)
        eid = store.put(k, k, layer_idx=0)
        assert eid > max(data)
        store.close()
        with Store.open(path) as again:
            (h,) = again.query(k, 0, 5)
            assert h.entry_id == eid and h.keys.tobytes() == k.tobytes()
    finally:
        store.close()


def test_compaction_merges_small_shards_of_frequent_flushes(store_factory):
    rng = np.random.default_rng(20)
    store = store_factory(shard_max_bytes=6000)
    data = {}
    for _i in range(12):
        k = gauss(rng, 2)
        data[store.put(k, k, layer_idx=0)] = k
        store.flush()  # one shard per flush
    assert len(store.stats().shards) == 12
    queries = [(k, 0) for k in data.values()]
    before = answers(store, queries, top_k=12)
    report = store.compact(repack=True)  # merging small shards is the whole-store rewrite's job
    assert report.performed and report.records_dropped == 0 and 1 < report.shards_after < 12
    assert_compact_layout(store.path, 6000)
    assert answers(store, queries, top_k=12) == before
    assert store.size() == report.bytes_after < report.bytes_before


# Many random stores: compaction keeps every answer, and neither the data
# files (shards, entries.bin, leftovers) nor the whole store grow.
@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 30),
    shard_max=st.sampled_from([900, 1500, 4000, 1 << 20]),
    flush_p=st.sampled_from([0.0, 0.3, 1.0]),
    keep=st.floats(0, 1.2),
    orphan=st.booleans(),
    quantized=st.booleans(),
    repack=st.booleans(),
)
@pytest.mark.stress
def test_compaction_keeps_every_answer_and_never_grows_the_data(
    seed, n, shard_max, flush_p, keep, orphan, quantized, repack
):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s"
        store = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=shard_max, quantize_stored=quantized)
        try:
            data = {}
            for i in range(n):
                k = gauss(rng, int(rng.integers(1, 12)))
                data[store.put(k, -k, layer_idx=i % 2, importance=float(rng.integers(0, 3)))] = (k, i % 2)
                if rng.random() < flush_p:
                    store.flush()
                if rng.random() < 0.2:
                    store.query(k, i % 2, 2)
            store.evict(int(keep * n))
            if orphan:
                (path / "shard_0777.safetensors").write_bytes(b"x" * int(rng.integers(0, 3000)))
            store.flush()
            queries = [(k, layer) for k, layer in data.values()][:10]
            before = answers(store, queries, top_k=n)
            records = live_records(store)
            data_bytes = {p.name: p.stat().st_size for p in path.iterdir() if p.name not in ("index.json", "lock")}
            size = store.size()
            # the whole-store rewrite, or the incremental one freeing every evicted byte
            report = store.compact(repack=repack, min_dead_share=0.0)
            after_bytes = {p.name: p.stat().st_size for p in path.iterdir() if p.name not in ("index.json", "lock")}
            assert sum(after_bytes.values()) <= sum(data_bytes.values())
            assert store.size() <= size
            assert answers(store, queries, top_k=n) == before
            assert live_records(store) == records
            assert store.stats().evicted == 0 and store.stats().entries == len(records)
            if report.performed:
                assert_compact_layout(path, shard_max)
            again = store.compact()
            assert not again.performed and "already compact" in again.reason
            store.close()
            with Store.open(path, read_only=True) as reader:
                assert answers(reader, queries, top_k=n) == before
        finally:
            store.close()


def test_compaction_never_grows_the_store(store_factory):
    # a compaction that frees next to nothing: the commit must not keep the
    # finished renames and deletes (it once grew the store by ~90 bytes a shard)
    rng = np.random.default_rng(21)
    store = store_factory(shard_max_bytes=3000)
    for _ in range(12):
        store.put(gauss(rng, 2), gauss(rng, 2))
    store.flush()
    assert len(store.stats().shards) >= 5 and not store.plan_compaction().needed
    (store.path / ".hmem-tmp.x").write_bytes(b"x")  # a one-byte leftover
    before = store.size()
    report = store.compact()
    assert report.performed
    assert store.size() <= before, f"{before} bytes before compaction, {store.size()} after"


def test_a_reader_opened_before_compaction_never_returns_wrong_data(tmp_path):
    rng = np.random.default_rng(22)
    path = tmp_path / "s"
    writer = Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=1200, max_open_shards=2)
    data = {}
    for i in range(18):
        k = gauss(rng, int(rng.integers(1, 4)))
        data[writer.put(k, k * 2, layer_idx=i % 2, importance=float(i % 3))] = (k, i % 2)
        if i % 4 == 3:
            writer.flush()
    writer.flush()
    reader = Store.open(path, read_only=True)
    try:
        early = []
        for eid in list(data)[:3]:
            k, layer = data[eid]
            early += reader.query(k, layer, 3, rerank=False)
        gone = set(writer.plan_eviction(8).entry_ids)
        writer.evict(8)
        assert writer.compact().performed
        # arrays handed out before stay correct
        for h in early:
            k = data[h.entry_id][0]
            assert h.keys.tobytes() == k.tobytes() and h.values.tobytes() == (k * 2).tobytes()
        outcomes = {"ok": 0, "refused": 0}
        for k, layer in data.values():
            for rerank in (False, True):
                try:
                    hits = reader.query(k, layer, 4, rerank=rerank)
                except (hmem.StoreChangedError, hmem.CorruptStoreError) as exc:
                    assert str(exc)
                    outcomes["refused"] += 1
                    continue
                outcomes["ok"] += 1
                for h in hits:
                    want = data[h.entry_id][0]
                    assert h.keys.tobytes() == want.tobytes() and h.values.tobytes() == (want * 2).tobytes()
        assert sum(outcomes.values()) == 2 * len(data)
        with Store.open(path, read_only=True) as fresh:
            assert fresh.stats().entries == 8 and fresh.stats().evicted == 0
            for k, layer in data.values():
                hits = fresh.query(k, layer, 20, rerank=False)
                assert {h.entry_id for h in hits} == {i for i, (_, lay) in data.items() if lay == layer} - gone
                for h in hits:
                    want = data[h.entry_id][0]
                    assert h.keys.tobytes() == want.tobytes() and h.values.tobytes() == (want * 2).tobytes()
    finally:
        reader.close()
        writer.close()


# ---- crash points of evict and compact ----------------------------------------------------------


def describe(store) -> dict:
    """Everything a store holds: stats (evicted records counted), every live
    entry's metadata (not its shard) and signature stand-in, live K/V."""
    st_ = store.stats()
    rows, kv = [], {}
    for e in store.entries():
        rows.append(
            (e.entry_id, e.layer_idx, e.n_tokens, e.importance, e.created, e.access_count, own_hit(store, e.entry_id))
        )
        got = store.get(e.entry_id)
        kv[e.entry_id] = (got.keys.tobytes(), got.values.tobytes())
    return {
        "entries": st_.entries,
        "evicted": st_.evicted,
        "layers": st_.layers,
        "shards": [(s.file, s.entries, s.dead_entries) for s in st_.shards],
        "records": rows,
        "kv": kv,
    }


def state_of(path) -> dict:
    with Store.open(path, read_only=True) as reader:
        return describe(reader)


def assert_clean(path: Path):
    doc = json.loads((path / "index.json").read_text())
    names = sorted(p.name for p in path.iterdir())
    assert not [n for n in names if n.startswith(_io.TEMP_PREFIX)], names
    assert sorted(n for n in names if SHARD_RE.match(n)) == sorted(s["file"] for s in doc["shards"])
    for s in doc["shards"]:
        assert (path / s["file"]).stat().st_size == s["bytes"]
    assert (path / "entries.bin").stat().st_size == doc["record_count"] * doc["record_size"]
    recs = hmem.formats.records.read(path / "entries.bin", doc["record_count"], HDC // 8)
    assert not hmem.formats.records.damaged(recs).size
    # nothing pending left undone: a reader (which applies what index.json
    # still lists) sees exactly the records entries.bin holds
    live = recs[recs["shard_idx"] != EVICTED]
    with Store.open(path, read_only=True) as reader:
        assert [
            (e.entry_id, e.layer_idx, e.n_tokens, e.importance, e.created, e.access_count, e.shard_idx)
            for e in reader.entries()
        ] == [
            (
                int(r["entry_id"]),
                int(r["layer_idx"]),
                int(r["n_tokens"]),
                float(r["importance"]),
                int(r["timestamp"]),
                int(r["access_count"]),
                int(r["shard_idx"]),
            )
            for r in live
        ]
        assert reader.stats().evicted == len(recs) - len(live)


_EVICT_SCRIPT = """
import json, numpy as np, hmem
data = np.load({data!r})
store = hmem.Store.open({path!r})
for i in (0, 3, 3, 7):
    store.query(data[i], i % 2, 2)  # access counts change the scores
print(json.dumps(store.plan_eviction(5).entry_ids), flush=True)
print(store.evict(5), flush=True)
store.close()
print("done", flush=True)
"""

_COMPACT_SCRIPT = """
import numpy as np, hmem
store = hmem.Store.open({path!r})
report = store.compact(repack=True)  # one commit: the old or the new state (test_crash_faults.py covers the steps)
print(report.performed, flush=True)
store.close()
print("done", flush=True)
"""


def _crash_store(path: Path, *, evicted: bool) -> np.ndarray:
    rng = np.random.default_rng(23)
    data = np.stack([gauss(rng, 2) for _ in range(12)])
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=1400) as store:
        for i, k in enumerate(data):
            store.put(k, -k, layer_idx=i % 2, importance=float(1 + i % 3))
            if i % 5 == 4:
                store.flush()
        store.query(data[5], 1, 1)
        if evicted:
            store.evict(7)
    np.save(path.parent / "data.npy", data)
    return data


CRASHES = [
    ("evict", "evict.marked", "old"),
    ("evict", "flush.shards_written", "old"),
    ("evict", "flush.records_written", "old"),
    ("evict", "flush.committed", "new"),
    ("evict", "flush.updates_written", "new"),
    ("compact", "compact.shards_written", "old"),
    ("compact", "compact.records_written", "old"),
    ("compact", "compact.committed", "new"),
    ("compact", "compact.finished", "new"),
]


@pytest.mark.stress
@pytest.mark.parametrize("op,point,expect", CRASHES, ids=[f"{o}-{p}" for o, p, _ in CRASHES])
def test_a_crash_during_evict_or_compact_leaves_the_old_or_the_new_state(tmp_path, run_python, op, point, expect):
    path = tmp_path / "s"
    data = _crash_store(path, evicted=op == "compact")
    template = _EVICT_SCRIPT if op == "evict" else _COMPACT_SCRIPT
    old = state_of(path)
    # the state after the operation: the same work, uninterrupted, on a copy
    shutil.copytree(path, tmp_path / "copy")
    done = run_python(template.format(path=str(tmp_path / "copy"), data=str(tmp_path / "data.npy")), check=True)
    assert done.stdout.splitlines()[-1] == "done"
    new = state_of(tmp_path / "copy")
    assert new != old
    if op == "evict":
        assert old["evicted"] == 0 and new["evicted"] == 7 and new["entries"] == 5
    else:
        assert old["evicted"] == 5 and new["evicted"] == 0 and new["entries"] == old["entries"] == 7
        assert len(new["shards"]) < len(old["shards"])

    crashed = run_python(template.format(path=str(path), data=str(tmp_path / "data.npy")), env={"HMEM_CRASH_AT": point})
    assert crashed.returncode == _io.CRASH_EXIT_CODE, crashed.stderr
    assert "done" not in crashed.stdout
    expected = new if expect == "new" else old
    assert state_of(path) == expected  # a reader copes with what the crash left
    store = Store.open(path)
    try:
        assert describe(store) == expected
    finally:
        store.close()
    assert_clean(path)
    assert state_of(path) == expected

    # queries are right, and the store keeps working: put, flush, evict, compact
    live = {r[0] for r in expected["records"]}
    with Store.open(path) as store:
        for i, k in enumerate(data):
            hits = store.query(k, i % 2, 12, rerank=False, count_access=False)
            assert {h.entry_id for h in hits} == {r[0] for r in expected["records"] if r[1] == i % 2}
            for h in hits:
                assert h.keys.tobytes() == data[h.entry_id - 1].tobytes()
                assert h.values.tobytes() == (-data[h.entry_id - 1]).tobytes()
        k = np.full((2, EMBED), 0.25, F)
        eid = store.put(k, k, layer_idx=1, importance=50.0)
        store.flush()
        victims = store.plan_eviction(len(live)).entry_ids
        assert len(victims) == 1 and victims[0] != eid
        assert store.evict(len(live)) == 1
        report = store.compact(min_dead_share=0.0)
        assert report.performed and store.stats().entries == len(live)
        (hit,) = [h for h in store.query(k, 1, 20, rerank=False) if h.entry_id == eid]
        assert hit.keys.tobytes() == k.tobytes()
    assert_clean(path)
    assert_compact_layout(path, 1400)
    after = state_of(path)
    assert set(after["kv"]) == (live | {eid}) - set(victims)
    assert after["entries"] == len(live) and after["evicted"] == 0
