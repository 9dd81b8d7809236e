"""Stores on object storage through the library, against a real local S3
server (moto in server mode, started by tests/conftest.py on 127.0.0.1):
docs/format.md, "Stores on object storage".

What must hold: the same results as a local store; a warm query makes no
request; one writer at a time (the lease), and a writer that lost its
lease cannot commit; readers see whole commits and pick up new ones; a
failed request is a clean error that leaves the committed state as it
was; verify and repair work on the objects.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

import hmem
from hmem import (
    CorruptStoreError,
    InvalidArgumentError,
    NotAStoreError,
    StorageError,
    Store,
    StoreChangedError,
    StoreExistsError,
    StoreLockedError,
)

DIM = 32
FAST = {"timeout": 5, "max_retries": 1}  # a stopped server: refused at once, not waited for
HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)


def _in_thread(fn):
    """fn() on a thread of its own: what it returns or raises, or a failure
    once it has run HANG_GUARD seconds (a hang guard, not a time limit)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD)
    assert not thread.is_alive(), f"still running after {HANG_GUARD} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _expire_lease(server, url: str) -> None:
    """The lease a writer left behind runs out now: its expiry is moved into
    the past, as the time passing would (docs/format.md, "The writer's lease")."""
    lease = json.loads(server.objects(_prefix(url))["lease.json"])
    server.put_object(_prefix(url), "lease.json", json.dumps({**lease, "expires": 0}).encode())


def _kv(seed: int, tokens: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((tokens, DIM)).astype(np.float32),
        rng.standard_normal((tokens, DIM)).astype(np.float32),
    )


def _fill(store: Store, seeds, layer: int = 0) -> dict[int, int]:
    """Put one entry per seed; returns id -> seed."""
    ids = store.put_many([(*_kv(seed), layer) for seed in seeds])
    return dict(zip(ids, seeds))


def _check_kv(store: Store, id_to_seed: dict[int, int]) -> None:
    assert sorted(store.entry_ids()) == sorted(id_to_seed)
    for entry_id, seed in id_to_seed.items():
        keys, values = _kv(seed)
        got = store.get(entry_id)
        assert np.array_equal(got.keys, keys) and np.array_equal(got.values, values)


def _manifest(s3_server, url: str) -> dict:
    prefix = url[len("s3://hmem-tests/") :]
    return json.loads(s3_server.objects(prefix)["manifest.json"])


def _prefix(url: str) -> str:
    return url[len("s3://hmem-tests/") :]


# ---- the basics ------------------------------------------------------------------------


def test_round_trip_matches_a_local_store(s3_url, tmp_path):
    seeds = range(40)
    with (
        Store.create(s3_url, embed_dim=DIM, hdc_dim=512) as remote,
        Store.create(tmp_path / "local", embed_dim=DIM, hdc_dim=512) as local,
    ):
        assert _fill(remote, seeds) == _fill(local, seeds)
        remote.flush()
    with Store.open(s3_url, read_only=True) as reader, Store.open(tmp_path / "local", read_only=True) as local:
        _check_kv(reader, dict(zip(local.entry_ids(), seeds)))
        for seed in (3, 17, 39):
            query = _kv(seed)[0]
            a, b = reader.query(query, 0, top_k=5), local.query(query, 0, top_k=5)
            assert [r.entry_id for r in a] == [r.entry_id for r in b]
            assert [r.score for r in a] == pytest.approx([r.score for r in b])
        st = reader.stats()
        assert st.path == s3_url and st.entries == 40 and st.remote is not None
        assert st.remote.url == s3_url and st.remote.gets >= 2 and st.remote.puts == 0


def _elsewhere(tmp_path, host: str = "reader-host") -> dict:
    """storage_options of a process on another host: its own cache directory."""
    return {"cache_dir": str(tmp_path / host)}


def test_a_warm_query_makes_no_request_and_a_cold_one_few(s3_url, tmp_path):
    with Store.create(s3_url, embed_dim=DIM, hdc_dim=512, shard_max_bytes=64 << 10) as writer:
        for part in range(4):  # several shards
            _fill(writer, range(part * 30, part * 30 + 30))
            writer.flush()
        shards = len(writer.stats().shards)
    assert shards >= 4
    with Store.open(s3_url, read_only=True, storage_options=_elsewhere(tmp_path)) as reader:
        opened = reader.stats().remote
        assert opened.requests == 1 + opened.state_objects  # the manifest, then its state objects
        results = reader.query(_kv(45)[0], 0, top_k=3)
        touched = len({r.shard_idx for r in results})
        cold = reader.stats().remote.requests - opened.requests
        # the shards' heads came with the state objects; a result's keys and
        # values lie side by side: one ranged GET each, or one for results
        # in the same block
        assert touched <= cold <= len(results) == 3
        before = reader.stats().remote.requests
        for _ in range(5):
            again = reader.query(_kv(45)[0], 0, top_k=3)
            assert [r.entry_id for r in again] == [r.entry_id for r in results]
        assert reader.stats().remote.requests == before  # warm: no request at all


def _far_apart_in_one_shard(s3_url: str) -> list[int]:
    """A store of one shard holding ~2 MiB of entries; returns the ids of
    its first and last entry (their blocks lie more than 1 MiB apart)."""
    with Store.create(s3_url, embed_dim=DIM, hdc_dim=512) as writer:
        ids = list(_fill(writer, range(1200), layer=0))  # 1,200 × 2 × 6 × 32 × 4 bytes = 1.8 MB
        writer.flush()
        assert len(writer.stats().shards) == 1
    return [ids[0], ids[-1]]


_MARK = np.random.default_rng(99).standard_normal(DIM).astype(np.float32) * 4


def _fill_marked(store: Store) -> list[int]:
    """Put 1,200 entries, the first and the last with keys that share a
    direction no other entry has (_MARK); returns those two ids."""
    entries = [(*_kv(seed), 0) for seed in range(1200)]
    for at in (0, 1199):
        keys, values, _ = entries[at]
        entries[at] = (keys + _MARK, values, 0)
    ids = store.put_many(entries)
    return [ids[0], ids[-1]]


def test_ranges_of_one_shard_are_fetched_together_only_when_asked(s3_url):
    with Store.create(s3_url, embed_dim=DIM, hdc_dim=512) as writer:
        first, last = _fill_marked(writer)  # 1,200 × 2 × 6 × 32 × 4 bytes = 1.8 MB in one shard
        writer.flush()
        assert len(writer.stats().shards) == 1
    requests, fetched = {}, {}
    for coalesce in (0, 4 << 20):
        with Store.open(s3_url, read_only=True, storage_options={"coalesce_bytes": coalesce}) as reader:
            before = reader.stats().remote.requests
            results = reader.query(np.tile(_MARK, (3, 1)), 0, top_k=2)
            assert sorted(r.entry_id for r in results) == [first, last]
            for r in results:
                seed = 0 if r.entry_id == first else 1199
                assert np.array_equal(r.keys, _kv(seed)[0] + _MARK) and np.array_equal(r.values, _kv(seed)[1])
            requests[coalesce] = reader.stats().remote.requests - before
            fetched[coalesce] = reader.stats().remote.bytes_fetched
    # a ranged GET for each result's keys and values; or one for both, with the bytes between them
    assert requests == {0: 2, 4 << 20: 1}
    assert fetched[0] <= 2 << 20 < fetched[4 << 20]
    with pytest.raises(InvalidArgumentError, match="coalesce_bytes"):
        Store.open(s3_url, read_only=True, storage_options={"coalesce_bytes": -1})


def _rewrite_state(s3_server, s3_url: str, change) -> None:
    """Commit the store's state again as one state object whose four files
    `change` edited in place (a list of bytearrays: entries, pooled,
    sources, shard heads; it may empty the heads)."""
    from hmem.formats import objects as fmt  # crafting a commit needs the format's own encoders

    objects = s3_server.objects(_prefix(s3_url))
    mf = fmt.RemoteManifest.parse(objects["manifest.json"], "manifest.json")
    files = [bytearray(mf.sizes[name]) for name in (*fmt.STATE_FILES, fmt.HEADS_FILE)]
    for item in mf.state:
        fmt.apply_state(objects[item["key"]], files, item["key"])
    change(files)
    body = fmt.encode_state([(number, 0, bytes(content)) for number, content in enumerate(files) if content])
    key = fmt.state_key(mf.generation + 1, "crafted0")
    s3_server.put_object(_prefix(s3_url), key, body)
    mf.retired += [{"key": item["key"], "since": time.time()} for item in mf.state]
    mf.state = [{"key": key, "bytes": len(body)}]
    mf.sizes = {**{name: len(files[n]) for n, name in enumerate(fmt.STATE_FILES)}, fmt.HEADS_FILE: len(files[3])}
    mf.generation += 1
    s3_server.put_object(_prefix(s3_url), "manifest.json", mf.to_bytes())


@pytest.mark.parametrize("damage", ["no heads", "a wrong head"])
@pytest.mark.stress
def test_a_shard_without_a_trusted_head_is_read_through_its_own(s3_server, s3_url, damage):
    # a store written before the state objects carried the shards' heads, or
    # one whose head does not match the shard's index CRC: the reader fetches
    # the shard's first block, as it would without heads, and answers the same
    first, last = _far_apart_in_one_shard(s3_url)

    def change(files):
        if damage == "no heads":
            files[3] = bytearray()
        else:
            files[3][40 + 96] ^= 0x01  # the first entry's token count in the index the head carries

    _rewrite_state(s3_server, s3_url, change)
    with Store.open(s3_url, read_only=True) as reader:
        before = reader.stats().remote.requests
        got = reader.get(last)
        assert np.array_equal(got.keys, _kv(1199)[0]) and np.array_equal(got.values, _kv(1199)[1])
        assert reader.stats().remote.requests - before == 2  # the shard's first block, then the entry's
        assert np.array_equal(reader.get(first).keys, _kv(0)[0])
    if damage == "no heads":
        # a writer of such a store gives heads to the shards it writes
        with Store.open(s3_url) as writer:
            added = _fill(writer, [5000])
        with Store.open(s3_url, read_only=True) as reader:
            before = reader.stats().remote.requests
            (new_id,) = added
            assert np.array_equal(reader.get(new_id).keys, _kv(5000)[0])
            assert reader.stats().remote.requests - before == 1
    report = hmem.verify(s3_url, full=True)
    assert report.ok, report.findings


def test_damaged_heads_are_refused(s3_server, s3_url):
    _far_apart_in_one_shard(s3_url)

    def change(files):
        del files[3][-5:]  # a head cut short: the state no longer describes whole heads

    _rewrite_state(s3_server, s3_url, change)
    with pytest.raises(CorruptStoreError, match="shard head"):
        Store.open(s3_url, read_only=True)


def test_a_closing_writer_leaves_one_state_object_for_readers(s3_url, s3_server, tmp_path):
    writer = Store.create(s3_url, embed_dim=DIM)
    data = {}
    for lo in range(0, 40, 10):  # a state object per flush
        data.update(_fill(writer, range(lo, lo + 10)))
        writer.flush()
    assert len(_manifest(s3_server, s3_url)["state"]) > 1
    writer.close()
    listed = _manifest(s3_server, s3_url)["state"]
    assert len(listed) == 1  # one snapshot, which the session's uploads paid for many times over
    with Store.open(s3_url, read_only=True, storage_options=_elsewhere(tmp_path)) as reader:
        assert reader.stats().remote.requests == 2  # the manifest, the snapshot
        _check_kv(reader, data)
    assert hmem.verify(s3_url, full=True).ok


def test_a_small_session_on_a_large_store_does_not_upload_its_records_whole(s3_url, s3_server, tmp_path):
    with Store.create(s3_url, embed_dim=DIM) as writer:
        data = _fill(writer, range(200))
    for seed in (1000, 1001):  # two sessions of one entry each, a flush and a close
        with Store.open(s3_url) as writer:
            data.update(_fill(writer, [seed]))
    listed = _manifest(s3_server, s3_url)["state"]
    assert len(listed) == 3  # the snapshot of the first session, then one change per session
    assert listed[1]["bytes"] < listed[0]["bytes"] // 20
    with Store.open(s3_url, read_only=True, storage_options=_elsewhere(tmp_path)) as reader:
        assert reader.stats().remote.requests == 4
        _check_kv(reader, data)


def test_state_objects_are_kept_on_the_host_for_the_next_process(s3_server, s3_url, tmp_path):
    # each open is a new process in a shell or cron job: the second on a
    # host fetches only the manifest, until a commit adds a state object
    with Store.create(s3_url, embed_dim=DIM, storage_options=_elsewhere(tmp_path, "writer-host")) as writer:
        data = _fill(writer, range(60))
    here = _elsewhere(tmp_path)
    with Store.open(s3_url, read_only=True, storage_options=here) as reader:
        assert reader.stats().remote.requests == 2  # the manifest, the snapshot
        first = [(r.entry_id, r.score) for r in reader.query(_kv(7)[0], 0, top_k=4)]
    with Store.open(s3_url, read_only=True, storage_options=here) as reader:
        assert reader.stats().remote.requests == 1  # the manifest: the snapshot was kept
        assert [(r.entry_id, r.score) for r in reader.query(_kv(7)[0], 0, top_k=4)] == first
        _check_kv(reader, data)
    with Store.open(s3_url, storage_options=_elsewhere(tmp_path, "writer-host")) as writer:
        data.update(_fill(writer, [500]))  # one change: a second state object (the close keeps the list)
    listed = [item["key"] for item in _manifest(s3_server, s3_url)["state"]]
    assert len(listed) == 2
    with Store.open(s3_url, read_only=True, storage_options=here) as reader:
        assert reader.stats().remote.requests == 2  # the manifest and the new state object only
        _check_kv(reader, data)
    kept = sorted(p.name for p in (tmp_path / "reader-host" / "state").rglob("*.bin"))
    assert kept == sorted(key.rsplit("/", 1)[-1] for key in listed)  # only the commit last opened
    (directory,) = (tmp_path / "reader-host" / "state").iterdir()
    assert directory.stat().st_mode & 0o777 == 0o700  # only this user enters it


def test_a_damaged_copy_on_the_host_is_fetched_again(s3_server, s3_url, tmp_path):
    with Store.create(s3_url, embed_dim=DIM) as writer:  # this host keeps the writer's state objects
        data = _fill(writer, range(20))
    (copy,) = (tmp_path / "hmem-cache" / "state").rglob("*.bin")
    raw = bytearray(copy.read_bytes())
    raw[30] ^= 0xFF
    copy.write_bytes(bytes(raw))
    with Store.open(s3_url, read_only=True) as reader:
        assert reader.stats().remote.requests == 2  # the manifest, the state object fetched again
        _check_kv(reader, data)
    with Store.open(s3_url, read_only=True) as reader:
        assert reader.stats().remote.requests == 1  # the copy was replaced by the object's bytes
    # verify reads the objects, never this host's copies: damage on the object store is reported
    key = _manifest(s3_server, s3_url)["state"][0]["key"]
    remote = bytearray(s3_server.objects(_prefix(s3_url))[key])
    remote[30] ^= 0xFF
    s3_server.put_object(_prefix(s3_url), key, bytes(remote))
    assert "remote.state" in {f.code for f in hmem.verify(s3_url).problems}
    with Store.open(s3_url, read_only=True) as reader:  # while this host still has a good copy
        _check_kv(reader, data)


def test_create_refuses_an_existing_store_and_open_an_empty_prefix(object_url):
    Store.create(object_url, embed_dim=DIM).close()
    with pytest.raises(StoreExistsError):
        Store.create(object_url, embed_dim=DIM)
    with pytest.raises(NotAStoreError):
        Store.open(object_url + "-nothing-here", read_only=True)
    with pytest.raises(NotAStoreError):
        Store.open(object_url + "-nothing-here")


def test_options_are_checked(s3_url, tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown storage option"):
        Store.create(s3_url, embed_dim=DIM, storage_options={"endpoint_url": "http://x"})
    with pytest.raises(InvalidArgumentError, match="object storage"):
        Store.create(tmp_path / "s", embed_dim=DIM, storage_options={"timeout": 1})
    with pytest.raises(InvalidArgumentError):
        Store.create("s3://", embed_dim=DIM)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        Store.create(s3_url, embed_dim=DIM, storage_options={"timeout": -1})
    assert not hmem.is_store_url(str(tmp_path)) and hmem.is_store_url(s3_url)


def test_bad_input_leaves_the_objects_unchanged(s3_server, s3_url):
    with Store.create(s3_url, embed_dim=DIM) as store:
        _fill(store, range(5))
        store.flush()
        before = s3_server.objects(_prefix(s3_url))
        bad = _kv(1)[0].copy()
        bad[0, 0] = np.nan
        with pytest.raises(InvalidArgumentError):
            store.put_many([(*_kv(9), 0), (bad, bad, 0)])
        store.flush()
        assert s3_server.objects(_prefix(s3_url)).keys() == before.keys()
        assert len(store.entry_ids()) == 5


# ---- readers see whole commits and pick up new ones ---------------------------------------


def test_refresh_takes_new_commits_and_old_entries_stay_right(object_url, store_internals):
    writer = Store.create(object_url, embed_dim=DIM)
    first = _fill(writer, range(10))
    writer.flush()
    reader = Store.open(object_url, read_only=True, max_open_shards=7)
    try:
        _check_kv(reader, first)
        second = _fill(writer, range(10, 15))
        assert reader.refresh() is False or True  # the put is not committed yet: nothing new, or the fencing
        writer.flush()
        assert reader.refresh() is True
        _check_kv(reader, {**first, **second})
        requests = reader.stats().remote.requests
        assert reader.refresh() is False  # nothing new: one request
        assert reader.stats().remote.requests == requests + 1
        gone = sorted(first)[:3]
        writer.delete(gone)
        writer.compact()
        assert reader.refresh() is True
        _check_kv(reader, {i: s for i, s in {**first, **second}.items() if i not in gone})
        assert store_internals.shard_map_limit(reader) == 7  # open()'s bound outlives the refreshes
    finally:
        reader.close()
        writer.close()


def test_refresh_seconds_lets_reads_pick_up_commits_by_themselves(object_url):
    writer = Store.create(object_url, embed_dim=DIM)
    _fill(writer, range(3))
    writer.flush()
    reader = Store.open(object_url, read_only=True, refresh_seconds=0)
    try:
        new = _fill(writer, [77])
        writer.flush()
        results = reader.query(_kv(77)[0], 0, top_k=1)
        assert results[0].entry_id == next(iter(new))
    finally:
        reader.close()
        writer.close()


def test_access_counts_reach_readers(object_url):
    with Store.create(object_url, embed_dim=DIM) as writer:
        ids = _fill(writer, range(20))
        writer.flush()
        for _ in range(3):
            writer.query(_kv(4)[0], 0, top_k=1)
        writer.flush()
    target = [i for i, s in ids.items() if s == 4][0]
    with Store.open(object_url, read_only=True) as reader:
        assert reader.get(target).info.access_count == 3


@pytest.mark.stress
def test_many_commits_keep_the_state_list_short(s3_server, s3_url):
    with Store.create(s3_url, embed_dim=DIM) as writer:
        ids = {}
        for round_ in range(20):  # past the 16 state objects at which the list restarts
            ids.update(_fill(writer, [round_]))
            writer.query(_kv(round_ // 2)[0], 0, top_k=1)
            writer.flush()
            assert len(_manifest(s3_server, s3_url)["state"]) <= 16
    with Store.open(s3_url, read_only=True) as reader:
        _check_kv(reader, ids)
        assert reader.stats().total_accesses == 20


def test_a_spans_store_works_on_object_storage(object_url):
    with Store.create(object_url, embed_dim=DIM, signatures_per_entry=4) as writer:
        ids = _fill(writer, range(12))
        writer.flush()
    with Store.open(object_url, read_only=True) as reader:
        _check_kv(reader, ids)
        best = reader.query(_kv(5)[0][1:4], 0, top_k=3)
        assert [i for i, s in ids.items() if s == 5][0] in [r.entry_id for r in best]


# ---- one writer ----------------------------------------------------------------------


def test_one_writer_at_a_time_and_the_lease_is_given_back(object_url):
    writer = Store.create(object_url, embed_dim=DIM)
    with pytest.raises(StoreLockedError, match="locked for writing"):
        Store.open(object_url)
    with Store.open(object_url, read_only=True):  # readers need no lease
        pass
    writer.close()
    with Store.open(object_url) as second:  # released at close, not left to expire
        _fill(second, [1])


@pytest.mark.stress
def test_a_waiting_writer_gets_the_lease_when_it_expires(s3_server, s3_url):
    holder = Store.create(s3_url, embed_dim=DIM)
    # Stop the holder's renewals and let its lease run 1.5 s more from now,
    # in the holder and in the store (private state: the test plays a writer
    # that hangs, whose lease then runs out; a lease that short from the
    # start could run out before the holder's own commits on a busy machine).
    lease = holder._placement.lease
    lease._stop.set()
    lease.expires = time.time() + 1.5
    s3_server.put_object(
        _prefix(s3_url),
        "lease.json",
        json.dumps({"token": lease.token, "owner": lease.owner, "expires": lease.expires}).encode(),
    )
    with Store.open(s3_url, lock_wait=HANG_GUARD) as second:
        assert time.time() >= lease.expires  # it waited for the expiry (how much longer depends on the machine)
        ids = _fill(second, range(3))
    with pytest.raises(StoreLockedError, match="lost its lease"):
        _fill(holder, [99])
        holder.flush()
    with pytest.raises(StoreLockedError):
        holder.close()
    with Store.open(s3_url, read_only=True) as reader:
        _check_kv(reader, ids)


def test_a_writer_whose_lease_was_taken_cannot_commit(s3_server, s3_url):
    old = Store.create(s3_url, embed_dim=DIM, storage_options={"lease_seconds": 30})
    kept = _fill(old, range(4))
    old.flush()
    # The old writer's lease is taken over as if it had expired (private
    # state: its expiry is moved back; the new writer sees an expired lease).
    lease = old._placement.lease
    lease._stop.set()
    s3_server.put_object(
        _prefix(s3_url), "lease.json", json.dumps({"token": lease.token, "owner": lease.owner, "expires": 0}).encode()
    )
    with Store.open(s3_url) as new:
        added = _fill(new, [50, 51])
        new.flush()
        generation = _manifest(s3_server, s3_url)["generation"]
        # The old writer still thinks it holds the lease; its commit is refused.
        lease.expires = time.time() + 30
        lease.lost = False
        _fill(old, [60])
        with pytest.raises(StoreLockedError):
            old.flush()
        assert _manifest(s3_server, s3_url)["generation"] == generation
    with pytest.raises(StoreLockedError):
        old.close()
    with Store.open(s3_url, read_only=True) as reader:
        _check_kv(reader, {**kept, **added})


def test_two_writers_racing_exactly_one_gets_the_store(object_url):
    Store.create(object_url, embed_dim=DIM).close()
    barrier = threading.Barrier(2, timeout=HANG_GUARD)
    outcomes: list[object] = []

    def race() -> None:
        barrier.wait()
        try:
            store = Store.open(object_url)
        except StoreLockedError as exc:
            outcomes.append(exc)
            return
        outcomes.append(store)

    threads = [threading.Thread(target=race) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD)
    winners = [o for o in outcomes if isinstance(o, Store)]
    assert len(winners) == 1 and len(outcomes) == 2
    winners[0].close()


# ---- failures: clean errors, nothing corrupted, the next writer recovers -----------------


def test_an_unanswering_server_times_out_cleanly(s3_env, tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        with pytest.raises(StorageError, match="cannot"):  # it gives up: _in_thread guards against a hang
            _in_thread(
                lambda: Store.open(
                    "s3://hmem-tests/silent",
                    read_only=True,
                    storage_options={"endpoint": endpoint, "timeout": 1, "max_retries": 0},
                )
            )
        assert not list((tmp_path / "hmem-cache").glob("remote-*"))  # the working copy is removed
    finally:
        silent.close()


@pytest.mark.stress
def test_the_server_stopping_mid_write_corrupts_nothing(s3_url, own_s3_server, monkeypatch):
    server = own_s3_server  # stopped and started by this test
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    url = s3_url
    options = FAST  # the default lease: the writer keeps it however long the server is down here
    writer = Store.create(url, embed_dim=DIM, storage_options=options)
    first = _fill(writer, range(5))
    writer.flush()
    second = _fill(writer, range(5, 30))
    server.stop()
    try:
        with pytest.raises(StorageError):
            writer.flush()
    finally:
        server.start()
    with Store.open(url, read_only=True, storage_options=FAST) as reader:
        _check_kv(reader, first)  # the old state, whole
    writer.flush()  # the server is back: the same writer commits what failed
    with Store.open(url, read_only=True, storage_options=FAST) as reader:
        _check_kv(reader, {**first, **second})
    server.stop()
    try:
        with pytest.raises(StorageError):
            writer.close()  # its lease cannot be given back: it expires
    finally:
        server.start()
    _expire_lease(server, url)
    with Store.open(url, lock_wait=HANG_GUARD, storage_options=options) as recovered:
        _check_kv(recovered, {**first, **second})
        third = _fill(recovered, [99])
    with Store.open(url, read_only=True, storage_options=FAST) as reader:
        _check_kv(reader, {**first, **second, **third})


# ---- verify and repair ---------------------------------------------------------------


@pytest.mark.stress
def test_verify_reports_damage_and_repair_keeps_what_checks_out(s3_server, s3_url):
    with Store.create(s3_url, embed_dim=DIM, shard_max_bytes=16 << 10) as writer:
        ids = {}
        for part in range(3):
            ids.update(_fill(writer, range(part * 10, part * 10 + 10)))
            writer.flush()
    assert hmem.verify(s3_url).ok and hmem.verify(s3_url, full=True).ok
    doc = _manifest(s3_server, s3_url)
    lost_key = sorted(s["key"] for s in doc["shards"].values())[0]
    s3_server.delete_object(_prefix(s3_url), lost_key)
    s3_server.put_object(_prefix(s3_url), f"shards/{'5' * 32}.safetensors", b"x")  # a name hmem gives a shard
    report = hmem.verify(s3_url)
    codes = {f.code for f in report.problems}
    assert "remote.missing" in codes and "remote.orphan" in codes
    with pytest.raises(CorruptStoreError):
        with Store.open(s3_url, read_only=True) as reader:
            for entry_id in ids:
                reader.get(entry_id)
    fixed = hmem.repair(s3_url)
    assert 0 < fixed.entries_kept < len(ids)
    after = hmem.verify(s3_url, full=True)
    assert after.ok, after.findings
    with Store.open(s3_url, read_only=True) as reader:
        kept = {i: s for i, s in ids.items() if i in set(reader.entry_ids())}
        assert len(kept) == fixed.entries_kept
        _check_kv(reader, kept)


def test_a_damaged_state_object_or_manifest_is_refused(s3_server, s3_url, tmp_path):
    with Store.create(s3_url, embed_dim=DIM) as writer:
        _fill(writer, range(5))
    doc = _manifest(s3_server, s3_url)
    key = doc["state"][-1]["key"]
    data = bytearray(s3_server.objects(_prefix(s3_url))[key])
    data[20] ^= 0xFF
    s3_server.put_object(_prefix(s3_url), key, bytes(data))
    with pytest.raises(CorruptStoreError, match="checksum"):  # a host without a copy of its own
        Store.open(s3_url, read_only=True, storage_options=_elsewhere(tmp_path))
    assert "remote.state" in {f.code for f in hmem.verify(s3_url).problems}
    doc["generation"] += 1  # a manifest whose checksum no longer matches
    s3_server.put_object(_prefix(s3_url), "manifest.json", json.dumps(doc).encode())
    with pytest.raises(CorruptStoreError, match="checksum"):
        Store.open(s3_url, read_only=True)
    assert "remote.manifest" in {f.code for f in hmem.verify(s3_url).problems}


def test_a_manifest_naming_objects_outside_the_store_is_refused(s3_server, s3_url):
    from hmem.formats import objects as fmt  # a crafted manifest needs the format's own encoder

    with Store.create(s3_url, embed_dim=DIM) as writer:
        _fill(writer, range(2))
    raw = s3_server.objects(_prefix(s3_url))["manifest.json"]
    mf = fmt.RemoteManifest.parse(raw, "manifest.json")
    uid = next(iter(mf.shards))
    mf.shards[uid] = {"key": "../../other-bucket/secret", "bytes": 10}
    s3_server.put_object(_prefix(s3_url), "manifest.json", mf.to_bytes())
    with pytest.raises(CorruptStoreError, match="not the name of shard"):
        Store.open(s3_url, read_only=True)


# ---- the local cache -----------------------------------------------------------------


def test_the_shard_cache_stays_within_its_bound(s3_url):
    with Store.create(s3_url, embed_dim=DIM, shard_max_bytes=256 << 10) as writer:
        ids = {}
        for part in range(6):
            ids.update(_fill(writer, range(part * 100, part * 100 + 100)))
            writer.flush()
    bound = 2 << 20
    with Store.open(s3_url, read_only=True, storage_options={"cache_bytes": bound}) as reader:
        assert len(reader.stats().shards) >= 5
        _check_kv(reader, ids)  # touches every shard
        assert reader.stats().remote.cached_shard_bytes <= bound + (1 << 20)


def test_retired_objects_are_removed_after_their_grace_time(s3_server, s3_url):
    options = {"retire_seconds": 0}
    with Store.create(s3_url, embed_dim=DIM, storage_options=options) as writer:
        ids = _fill(writer, range(10))
        writer.flush()
        reader = Store.open(s3_url, read_only=True)  # opened before the compaction
        writer.delete(sorted(ids)[:5])
        writer.compact()
        _fill(writer, [42])
        writer.flush()  # this commit removes what the compaction retired
    try:
        named = _manifest(s3_server, s3_url)
        keys = set(s3_server.objects(_prefix(s3_url)))
        wanted = {
            "manifest.json",
            "lease.json",
            *(s["key"] for s in named["state"]),
            *(s["key"] for s in named["shards"].values()),
            *(r["key"] for r in named["retired"]),
        }
        assert keys == wanted
        with pytest.raises(StoreChangedError):
            reader.get(sorted(ids)[7])  # its shard object is gone
        assert reader.refresh() is True
        _check_kv(
            reader,
            {i: s for i, s in ids.items() if i not in sorted(ids)[:5]}
            | {i: 42 for i in reader.entry_ids() if i not in ids},
        )
    finally:
        reader.close()


# ---- copies between a directory and object storage ----------------------------------------


def test_copy_a_local_store_to_object_storage_and_back(object_url, tmp_path):
    source = tmp_path / "local"
    with Store.create(source, embed_dim=DIM, hdc_dim=512) as store:
        ids = _fill(store, range(30))
        store.flush()
        store.delete(sorted(ids)[:2])
        store.query(_kv(10)[0], 0, top_k=1)  # an access count, carried over
    kept = {i: s for i, s in ids.items() if i not in sorted(ids)[:2]}
    up = hmem.copy_store(source, object_url)
    assert up.entries == 28 and up.records == 30
    with Store.open(object_url, read_only=True) as reader:
        _check_kv(reader, kept)
        assert reader.stats().total_accesses == 1
    assert hmem.verify(object_url, full=True).ok
    back = tmp_path / "back"
    hmem.copy_store(object_url, back)
    with Store.open(back, read_only=True) as reader:
        _check_kv(reader, kept)
        assert reader.stats().total_accesses == 1
    assert hmem.verify(back, full=True).ok
    with pytest.raises(StoreExistsError):
        hmem.copy_store(source, object_url)
    with pytest.raises(StoreExistsError):
        hmem.copy_store(object_url, back)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.stress
def test_readers_see_exactly_the_writers_commits_through_any_mix_of_changes(object_url, seed):
    """Each commit sends only what it changed (docs/format.md, "State
    objects"); after any mix of puts, counted queries, deletes, evictions
    and compactions, a fresh reader holds exactly the writer's records."""
    rng = np.random.default_rng(seed)
    next_seed = 0
    with Store.create(object_url, embed_dim=DIM, hdc_dim=512, shard_max_bytes=32 << 10) as writer:
        live: dict[int, int] = {}
        for step in range(30):
            action = rng.choice(
                ["put", "put", "query", "delete", "evict", "compact"], p=[0.3, 0.2, 0.25, 0.1, 0.1, 0.05]
            )
            if action == "put" or not live:
                count = int(rng.integers(1, 8))
                live.update(_fill(writer, range(next_seed, next_seed + count), layer=int(rng.integers(0, 2))))
                next_seed += count
            elif action == "query":
                writer.query(_kv(int(rng.choice(list(live.values()))))[0], int(rng.integers(0, 2)), top_k=3)
            elif action == "delete":
                gone = [int(i) for i in rng.choice(list(live), size=min(2, len(live)), replace=False)]
                writer.delete(gone)
                for i in gone:
                    del live[i]
            elif action == "evict":
                writer.evict(max(0, len(live) - 3))
                live = {i: s for i, s in live.items() if i in set(writer.entry_ids())}
            else:
                writer.compact()
            writer.flush()
            with Store.open(object_url, read_only=True) as reader:
                mine = [(e.entry_id, e.access_count, e.layer_idx) for e in writer.entries()]
                theirs = [(e.entry_id, e.access_count, e.layer_idx) for e in reader.entries()]
                assert theirs == mine, f"step {step} ({action})"
        with Store.open(object_url, read_only=True) as reader:
            _check_kv(reader, live)


def test_the_disk_limit_counts_the_objects_not_the_working_copy(object_url):
    """A writer's working copy holds only the shards it made; the limit is
    on what the store takes on object storage."""
    with Store.create(object_url, embed_dim=DIM, hdc_dim=512, shard_max_bytes=64 << 10) as writer:
        _fill(writer, range(200))
    with Store.open(object_url) as writer:
        size = writer.stats().bytes_on_disk
        assert size == writer.size() and size > 200 * 2 * 6 * DIM * 4
        writer.flush()
    limit = size // 2
    with Store.open(object_url, read_only=True) as reader:
        assert reader.stats().bytes_on_disk == size
    # a store created with the same data under a limit keeps under it
    with Store.create(
        object_url + "-limited", embed_dim=DIM, hdc_dim=512, shard_max_bytes=64 << 10, max_disk_bytes=limit
    ) as writer:
        for part in range(4):
            _fill(writer, range(part * 50, part * 50 + 50))
            writer.flush()
    with Store.open(object_url + "-limited") as writer:
        _fill(writer, range(1000, 1050))
        writer.flush()
        st = writer.stats()
        assert st.bytes_on_disk <= limit
        assert st.limits.evicted > 0 or st.entries < 250


def test_the_server_stopping_during_a_large_upload_leaves_old_or_new(s3_url, own_s3_server, monkeypatch):
    """The server goes away while a flush is uploading megabytes: the flush
    fails cleanly or completes; readers see the old state or the new one,
    whole; once the server is back the same writer commits."""
    server = own_s3_server
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    writer = Store.create(s3_url, embed_dim=DIM, storage_options=FAST)  # the default lease outlasts the outage
    first = _fill(writer, range(3))
    writer.flush()
    rng = np.random.default_rng(5)
    big = {}
    for _n in range(8):  # about 8 MiB of new shard bytes
        keys = rng.standard_normal((4096, DIM)).astype(np.float32)
        big[writer.put(keys, keys, 0)] = keys
    stopper = threading.Timer(0.05, server.stop)
    stopper.start()
    try:
        writer.flush()
        failed = False
    except StorageError:
        failed = True
    stopper.join()
    server.start()
    with Store.open(s3_url, read_only=True, storage_options=FAST) as reader:
        ids = set(reader.entry_ids())
        assert ids in (set(first), set(first) | set(big))
        assert failed or ids == set(first) | set(big)
        for entry_id in ids & set(big):
            assert np.array_equal(reader.get(entry_id).keys, big[entry_id])
    writer.flush()
    writer.close()
    with Store.open(s3_url, read_only=True, storage_options=FAST) as reader:
        assert set(reader.entry_ids()) == set(first) | set(big)
        for entry_id, seed in first.items():
            assert np.array_equal(reader.get(entry_id).keys, _kv(seed)[0])
    report = hmem.verify(s3_url, full=True, storage_options=FAST)
    assert not [f for f in report.problems if f.code != "remote.orphan"]


def test_a_refresh_that_fails_keeps_the_reader_on_its_commit(s3_url, s3_server, tmp_path):
    server = s3_server
    writer = Store.create(s3_url, embed_dim=DIM)
    first = _fill(writer, range(4))
    writer.flush()
    # on another host than the writer, which keeps copies of its state objects
    reader = Store.open(s3_url, read_only=True, storage_options={**FAST, **_elsewhere(tmp_path)})
    try:
        second = _fill(writer, range(4, 8))
        writer.flush()
        key = _manifest(server, s3_url)["state"][-1]["key"]
        saved = server.objects(_prefix(s3_url))[key]
        server.delete_object(_prefix(s3_url), key)  # the new commit cannot be read
        with pytest.raises(CorruptStoreError, match="which the manifest names, is missing"):
            reader.refresh()  # damage, not a newer commit: the manifest still names the object
        _check_kv(reader, first)  # still the commit it held, whole
        server.put_object(_prefix(s3_url), key, saved)  # readable again, the same commit
        assert reader.refresh() is True
        _check_kv(reader, {**first, **second})
    finally:
        reader.close()
        writer.close()


@pytest.mark.stress
def test_reader_threads_share_one_store_while_a_writer_commits(s3_url):
    """Threads of one reader query, read and refresh while another process's
    writer (here another Store object) commits; the shard cache is small, so
    shard files are dropped and fetched again under the threads' feet."""
    writer = Store.create(s3_url, embed_dim=DIM, hdc_dim=512, shard_max_bytes=16 << 10)
    seeds = _fill(writer, range(120))
    writer.flush()
    reader = Store.open(s3_url, read_only=True, storage_options={"cache_bytes": 64 << 10})
    errors: list[BaseException] = []
    checked = [0]
    stop = threading.Event()
    known = dict(seeds)

    def read(worker: int) -> None:
        rng = np.random.default_rng(worker)
        try:
            while not stop.is_set():
                seed = int(rng.integers(0, 120))
                # StoreChangedError is documented (a shard removed under an old
                # commit): refresh and go on, as worker 0 does for all of them
                try:
                    for result in reader.query(_kv(seed)[0], 0, top_k=3, count_access=False):
                        keys, values = _kv(known[result.entry_id])
                        assert np.array_equal(result.keys, keys) and np.array_equal(result.values, values)
                        checked[0] += 1
                except StoreChangedError:
                    pass
                if worker == 0:
                    try:
                        reader.refresh()
                    except StoreChangedError:
                        pass
        except BaseException as exc:
            errors.append(exc)

    def read_on(more: int) -> None:
        """Wait until the reader threads have checked `more` results (a commit
        was made before: they read beside it)."""
        target = checked[0] + more
        deadline = time.monotonic() + HANG_GUARD
        while checked[0] < target and not errors:
            assert time.monotonic() < deadline, "the reader threads stopped reading"
            time.sleep(0.01)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for round_ in range(6):
            new = _fill(writer, range(1000 + round_ * 10, 1010 + round_ * 10))
            known.update(new)
            writer.flush()
            if round_ == 3:
                writer.compact()
            read_on(10)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=HANG_GUARD)
        writer.close()
    assert not any(t.is_alive() for t in threads), "a reader thread hung"
    assert not errors, errors[0]
    assert checked[0] > 50
    reader.refresh()
    _check_kv(reader, known)
    reader.close()


@pytest.mark.parametrize("pieces", [3, 300])
def test_state_objects_apply_as_their_pieces_in_order(pieces):
    # the format's own encoder and decoder (hmem/formats/objects.py): a state
    # object's pieces land where they say, few or many, and a damaged one is refused
    from hmem.formats import objects as fmt

    rng = np.random.default_rng(pieces)
    sizes = [4096 * 8, 2048, 512]
    expected = [bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for size in sizes]
    files = [bytearray(f) for f in expected]
    chosen = []
    for number, size in enumerate(sizes):  # non-overlapping pieces of each file
        starts = np.sort(rng.choice(size // 8, size=min(pieces, size // 8), replace=False)) * 8
        for start in starts.tolist():
            length = int(rng.integers(1, 9))
            data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
            chosen.append((number, start, data))
            expected[number][start : start + length] = data
    body = fmt.encode_state(chosen)
    fmt.apply_state(body, files, "state/x")
    assert files == expected
    for damage in (lambda b: b[:-1] + bytes([b[-1] ^ 1]), lambda b: b[:20] + b[21:]):
        with pytest.raises(CorruptStoreError):
            fmt.apply_state(damage(body), [bytearray(len(f)) for f in expected], "state/x")
    outside = fmt.encode_state([(0, sizes[0] - 2, b"abc")])
    with pytest.raises(CorruptStoreError, match="outside"):
        fmt.apply_state(outside, [bytearray(s) for s in sizes], "state/x")
    no_file = fmt.encode_state([(7, 0, b"abc")])
    with pytest.raises(CorruptStoreError):
        fmt.apply_state(no_file, [bytearray(s) for s in sizes], "state/x")


def test_memory_urls_keep_stores_apart_and_take_no_options(monkeypatch, tmp_path):
    monkeypatch.setenv("HMEM_CACHE_DIR", str(tmp_path / "hmem-cache"))
    rng = np.random.default_rng(7)
    base = "memory://apart-test"
    with Store.create(f"{base}/a", embed_dim=DIM) as a:
        k = rng.standard_normal((4, DIM)).astype(np.float32)
        (only,) = a.put_many([(k, k, 0, 1.0)])
    with Store.create(f"{base}/b", embed_dim=DIM) as b:  # beside a, in the same bucket
        assert b.entry_ids() == []
    with Store.open(f"{base}/a", read_only=True) as a:
        assert a.entry_ids() == [only]
        np.testing.assert_array_equal(a.get(only).keys, k)
    with pytest.raises(StoreExistsError, match="inside the hmem store memory://apart-test/a"):
        Store.create(f"{base}/a/inner", embed_dim=DIM)
    with pytest.raises(InvalidArgumentError, match="storage options do not apply"):
        Store.open(f"{base}/a", storage_options={"timeout": 5})
    assert hmem.verify(f"{base}/a").ok
