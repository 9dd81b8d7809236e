"""Incremental compaction and eviction under limits (issue 40, goals 4, 5 and
7's "compaction reports what it removed"): only shards whose evicted bytes
reach the dead share are touched, one commit each, so the extra disk is one
shard; eviction under max_disk_bytes rewrites at most what it frees; the
new entries of a put always stay, and the messages say so; `hmem compact`
reports the leftovers the open of the store removed."""

from __future__ import annotations

import errno
import functools
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem import _io
from hmem.cli.app import app

D, HDC = 16, 256
N_TOKENS = 8
PER_SHARD = 4
HEADER_SLACK = 1024  # a new shard's header (its JSON and index), which the bound allows on top
ENV = {"COLUMNS": "200", "NO_COLOR": None, "FORCE_COLOR": None, "HMEM_STORE": None, "HMEM_DEBUG": None}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.standard_normal((N_TOKENS, D)).astype(np.float32), r.standard_normal((N_TOKENS, D)).astype(np.float32)


@functools.cache
def shard_max() -> int:
    """A shard_max_bytes that holds exactly PER_SHARD entries of N_TOKENS rows."""
    sizes = []
    probe = tempfile.mkdtemp(prefix="hmem-probe-")
    for count in (1, 2):
        with hmem.Store.create(f"{probe}/p{count}", embed_dim=D, hdc_dim=HDC) as s:
            s.put_many([hmem.Entry(*kv(i)) for i in range(count)])
            s.flush()
            sizes.append(s.stats().shards[0].bytes)
    per_entry = sizes[1] - sizes[0]
    # a put counts a little more than the file takes: 0.9 of one more entry
    return sizes[0] + (PER_SHARD - 1) * per_entry + per_entry * 9 // 10


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def make_store(path: str, shards: int, **settings) -> list[int]:
    """A store of `shards` full shards of PER_SHARD entries each (entry i has seed i)."""
    limit = shard_max()
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, shard_max_bytes=limit, **settings) as s:
        ids = s.put_many([hmem.Entry(*kv(i)) for i in range(shards * PER_SHARD)])
        s.flush()
        assert [sh.entries for sh in s.stats().shards] == [PER_SHARD] * shards
    return ids


def uids(path: str) -> list[str]:
    return [s["uid"] for s in json.loads(Path(path, "index.json").read_text())["shards"]]


def check_kv(store: hmem.Store, ids: list[int], seeds: dict[int, int]) -> None:
    for eid in ids:
        got = store.get(eid)
        k, v = kv(seeds[eid])
        assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)


def directory_peak(path: str):
    """Follow the bytes of the store directory at every primitive write
    operation (the crash tests' fault hook): the peak of what compaction
    needs on disk."""
    seen = {"peak": 0}

    def hook(op: str, file: str) -> None:
        seen["peak"] = max(seen["peak"], _io_bytes(path))

    return seen, hook


def _io_bytes(path: str) -> int:
    """The bytes of the store directory's files (the lock's owner record aside)."""
    total = 0
    for entry in os.scandir(path):
        if entry.name == "lock":
            continue
        try:
            total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return total


# ---- only the shards that pay --------------------------------------------------------------


def test_thinly_spread_dead_entries_rewrite_nothing():
    """A few evicted entries spread over many shards (one of four in each):
    no shard reaches the dead share, so compaction rewrites nothing (the
    whole-store rewrite copied every live byte to free a quarter of them)."""
    ids = make_store("s", 6)
    before = uids("s")
    with hmem.Store.open("s") as s:
        s.delete(ids[::PER_SHARD])
        plan = s.plan_compaction()
        assert not plan.needed and plan.rewrite_bytes == 0 and plan.dead_bytes_left > 0
        report = s.compact()
        assert not report.performed and report.reason == "no shard past the dead share"
        assert report.bytes_rewritten == 0
    assert uids("s") == before
    result = run("compact", "s")
    assert result.exit_code == 0, result.stderr
    assert "nothing to do: no shard has 50% of its bytes evicted\n" in result.stdout
    assert uids("s") == before
    # the old behaviour, asked for: every live byte copied
    with hmem.Store.open("s") as s:
        report = s.compact(repack=True)
        assert report.performed and report.bytes_rewritten > 3 * report.bytes_freed


def test_a_mostly_dead_shard_is_rewritten_alone():
    ids = make_store("s", 5)
    seeds = {eid: i for i, eid in enumerate(ids)}
    before = uids("s")
    with hmem.Store.open("s") as s:
        s.delete(ids[2 * PER_SHARD : 2 * PER_SHARD + 3])  # 3 of shard 2's 4 entries
        report = s.compact()
        assert report.performed and report.reason == "compacted"
        assert 0 < report.bytes_rewritten <= report.bytes_freed
        assert report.shards_after == 5
        live = s.entry_ids()
        check_kv(s, live, seeds)
    after = uids("s")
    assert after[:2] == before[:2] and after[3:] == before[3:] and after[2] != before[2]
    assert not hmem.verify("s", full=True).findings


def test_a_dead_shard_in_the_middle_takes_the_last_one_without_a_copy():
    ids = make_store("s", 5)
    seeds = {eid: i for i, eid in enumerate(ids)}
    before = uids("s")
    with hmem.Store.open("s") as s:
        s.delete(ids[PER_SHARD : 2 * PER_SHARD])  # all of shard 1
        report = s.compact()
        assert report.performed and report.bytes_rewritten == 0
        assert report.shards_before == 5 and report.shards_after == 4
        check_kv(s, s.entry_ids(), seeds)
    assert uids("s") == [before[0], before[4], before[2], before[3]]
    assert sorted(p.name for p in Path("s").glob("shard_*")) == [f"shard_{i:04d}.safetensors" for i in range(4)]
    assert not hmem.verify("s", full=True).findings
    with hmem.Store.open("s") as s:  # and it goes on working
        new = s.put(*kv(100))
        seeds[new] = 100
        s.flush()
        check_kv(s, s.entry_ids(), seeds)


# ---- the disk it needs ---------------------------------------------------------------------


def _half_dead_store() -> tuple[list[int], int]:
    """Six shards, each with half its entries evicted; returns the ids and
    the largest shard's size."""
    ids = make_store("s", 6)
    with hmem.Store.open("s") as s:
        s.delete([eid for i, eid in enumerate(ids) if i % PER_SHARD < PER_SHARD // 2])
        largest = max(sh.bytes for sh in s.stats().shards)
    return ids, largest


def test_compaction_needs_one_shard_of_extra_disk():
    """The documented bound (docs/reliability.md, "Disk space"): at every
    write, the store directory holds at most its size before plus one
    shard's bytes.  The whole-store rewrite needed a copy of all live data."""
    ids, largest = _half_dead_store()
    seeds = {eid: i for i, eid in enumerate(ids)}
    before = _io_bytes("s")
    seen, hook = directory_peak("s")
    _io.set_fault_hook(hook)
    try:
        with hmem.Store.open("s") as s:
            report = s.compact()
            assert report.performed and report.shards_after == 6
            # half of each shard dead: the live half copied, plus each new shard's header
            assert report.bytes_rewritten <= report.bytes_freed + 6 * HEADER_SLACK
            check_kv(s, s.entry_ids(), seeds)
    finally:
        _io.set_fault_hook(None)
    assert seen["peak"] <= before + largest, (seen["peak"], before, largest)


def test_a_nearly_full_disk_can_be_compacted():
    """A disk with room for one more shard: incremental compaction frees
    the evicted bytes; the whole-store rewrite (repack) fails with ENOSPC
    and leaves the store as it was."""
    _half_dead_store()
    before = _io_bytes("s")
    largest = max(sh.bytes for sh in hmem.Store.open("s", read_only=True).stats().shards)
    room = before + largest

    def full_disk(op: str, file: str) -> None:
        if op in ("write", "fsync") and _io_bytes("s") > room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    _io.set_fault_hook(full_disk)
    try:
        with hmem.Store.open("s") as s:
            with pytest.raises(hmem.HmemError):
                s.compact(repack=True)
            assert _io_bytes("s") <= before
            report = s.compact()
            assert report.performed and report.bytes_after < before
    finally:
        _io.set_fault_hook(None)
    assert not hmem.verify("s", full=True).findings


def test_a_stop_keeps_the_shards_committed_before_it():
    _half_dead_store()
    calls = []

    def stop_at_second(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with hmem.Store.open("s") as s:
        before = s.size()
        with pytest.raises(KeyboardInterrupt):
            s.compact(progress=stop_at_second)
        middle = s.size()
        assert middle < before  # the first shard's step is committed
        assert not [p for p in Path("s").iterdir() if p.name.startswith(".hmem-tmp.")]
        report = s.compact()  # the Store goes on: the rest
        assert report.performed and s.size() < middle
    assert not hmem.verify("s", full=True).findings


# ---- limits --------------------------------------------------------------------------------


def test_eviction_under_max_disk_rewrites_at_most_what_it_frees():
    """Puts past max_disk_bytes, batch after batch: the store stays under
    its limit and its compactions rewrite at most the bytes they free (the
    whole-store rewrite copied every live byte each time)."""
    limit = 12 * shard_max()
    ids = make_store("s", 8, max_disk_bytes=limit)
    seeds = {eid: i for i, eid in enumerate(ids)}
    with hmem.Store.open("s") as s:
        for batch in range(10):
            first = 1000 + 6 * batch
            new = s.put_many([hmem.Entry(*kv(first + i)) for i in range(6)])
            seeds.update((eid, first + i) for i, eid in enumerate(new))
            s.flush()
            assert s.size() <= limit
        limits = s.stats().limits
        assert limits.evicted and limits.compactions
        assert limits.bytes_rewritten <= limits.bytes_freed + limits.compactions * HEADER_SLACK, limits
        check_kv(s, s.entry_ids(), seeds)
    assert not hmem.verify("s", full=True).findings


def test_new_entries_always_stay_and_the_message_says_so(tmp_path):
    """The policy for arrivals: the new entries are kept whatever their
    score; room is made by evicting the lowest-scored of the entries stored
    before, which may score higher than the new ones -- so the line says
    "to make room for the new entries", never "lower-scored"."""
    from safetensors.numpy import save_file

    with hmem.Store.create("s", embed_dim=D, hdc_dim=HDC, max_entries=3) as s:
        old = s.put_many([hmem.Entry(*kv(i), importance=10.0) for i in range(3)])
        low = s.put(*kv(50), importance=0.1)  # scores far below every stored entry
        assert low in s.entry_ids() and old[0] not in s.entry_ids()
    k, v = kv(60)
    save_file({"keys": k, "values": v}, str(tmp_path / "f.safetensors"))
    result = run("put", "s", "f.safetensors", "--importance", "0.01")
    assert result.exit_code == 0, result.stderr
    assert "evicted 1 stored entries (lowest score first) to make room for the new entries under max_entries" in (
        result.stdout
    )
    assert "lower-scored" not in result.stdout
    with hmem.Store.open("s", read_only=True) as s:
        # the new entry stayed; the lowest-scored stored one (the 0.1) made room
        assert len(s.entry_ids()) == 3 and low not in s.entry_ids()
        assert sorted(e.importance for e in s.entries()) == pytest.approx([0.01, 10.0, 10.0])


# ---- what compact reports ------------------------------------------------------------------


def test_compact_reports_the_leftovers_its_open_removed():
    """A writer that died left a temporary file and an uncommitted shard;
    `hmem compact`'s open removes them, and the command says so (it said
    "nothing to do")."""
    make_store("s", 2)
    Path("s/.hmem-tmp.rewrite.shard_0000.safetensors").write_bytes(b"\0" * 300_000)
    Path("s/shard_0007.safetensors").write_bytes(b"\1" * 50_000)
    result = run("compact", "s")
    assert result.exit_code == 0, result.stderr
    assert "removed 2 leftover file(s) of an interrupted writer (341.8 KiB) on opening the store" in result.stdout
    assert "nothing more to do: the store is already compact" in result.stdout
    Path("s/.hmem-tmp.rewrite.entries.bin").write_bytes(b"\0" * 1000)
    doc = json.loads(run("compact", "s", "--json").stdout)
    assert doc["removed_at_open"] == {"files": 1, "bytes": 1000}
    assert doc["performed"] is False
    doc = json.loads(run("compact", "s", "--json").stdout)
    assert doc["removed_at_open"] == {"files": 0, "bytes": 0}


def test_compact_json_reports_rewritten_and_freed_bytes():
    ids = make_store("s", 3)
    with hmem.Store.open("s") as s:
        s.delete(ids[:PER_SHARD] + ids[PER_SHARD : PER_SHARD + 3])
    doc = json.loads(run("compact", "s", "--json").stdout)
    assert doc["performed"] and doc["shards_after"] == 2
    assert 0 < doc["bytes_rewritten"] <= doc["bytes_freed"]
    assert doc["records_dropped"] == 7


@pytest.mark.parametrize("args", [("--min-dead", "150"), ("--min-dead", "-1"), ("--min-dead", "nan")])
def test_bad_min_dead_is_refused_and_changes_nothing(args):
    ids = make_store("s", 2)
    with hmem.Store.open("s") as s:
        s.delete(ids[:3])
    files = {p.name: p.read_bytes() for p in Path("s").iterdir()}
    result = run("compact", "s", *args)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert {p.name: p.read_bytes() for p in Path("s").iterdir()} == files
    with hmem.Store.open("s") as s:
        with pytest.raises(hmem.InvalidArgumentError, match="min_dead_share"):
            s.compact(min_dead_share=1.5)
        with pytest.raises(hmem.InvalidArgumentError, match="min_dead_share"):
            s.plan_compaction(min_dead_share=float("nan"))
    assert {p.name: p.read_bytes() for p in Path("s").iterdir() if p.name != "lock"} == {
        k: v for k, v in files.items() if k != "lock"
    }
