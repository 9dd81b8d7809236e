"""Several writer processes on one tier (hmem/lmcache/tier.py; docs/lmcache.md,
"Guarantees"), without LMCache.

LMCache runs one worker process per tensor-parallel rank, each with its own
ChunkTier on the same store.  Here every writer is a real process
(tests/tier_writer_proc.py) on a store directory or on s3:// (the local
moto server): they store concurrently and every acknowledged chunk is
found; a writer killed with SIGKILL costs only its own uncommitted chunks,
whether the kill lands between commits or during one; the others' commits
go on (a dead writer's lock dies with it; its lease lapses after
`lease_seconds`); readers see each commit whole.

Every chunk's values come from its key (``chunk_words``, the same code as
the helper's), so each chunk found is checked bit for bit.  Processes report
over their stdout; the tests wait for those lines, never for a duration.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Iterator, Set
from pathlib import Path

import numpy as np
import pytest

import hmem
from hmem import Store
from hmem.lmcache import ChunkTier, TierSettings

WRITER = Path(__file__).with_name("tier_writer_proc.py")
SHAPE = (2, 4, 16, 64)  # as tier_writer_proc.SHAPE: [2, layers, tokens, hidden]
HDC = 256
HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)
# A short lease on s3, so that a killed writer's lapses soon: the others'
# commits wait at most this long for it (docs/lmcache.md: 60 s by default).
LEASE_SECONDS = 3.0
LONG = 3600.0  # a commit window no test reaches: staged chunks stay staged until commit()


def chunk_words(key: str) -> np.ndarray:
    """As tier_writer_proc.chunk_words (tests cannot import each other)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    values = np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def lmcache_key(rank: int, name: str) -> str:
    """A key as LMCache spells one (model@world_size@worker_id@chunk_hash@dtype)."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"hmem-test/model@4@{rank}@{digest}@bfloat16"


class Writer:
    """One helper process (tier_writer_proc.py), talked to in JSON lines."""

    def __init__(self, tier: types.SimpleNamespace, name: str, **settings: float) -> None:
        settings.setdefault("hdc_dim", HDC)
        self.name = name
        self.err_path = tier.tmp / f"{name}.stderr"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WRITER), tier.url, json.dumps(settings), json.dumps(tier.options or {})],
                cwd=tier.tmp,
                env={k: v for k, v in os.environ.items() if k not in ("HMEM_CRASH_AT", "HMEM_PAUSE_AT")},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.expect("started")

    def send(self, *command: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(list(command)) + "\n")
        self.proc.stdin.flush()

    def line(self) -> list:
        """The next line.  A process that says nothing for HANG_GUARD seconds
        is killed: the test fails, it does not hang."""
        guard = threading.Timer(HANG_GUARD, self.proc.kill)
        guard.start()
        try:
            assert self.proc.stdout is not None
            text = self.proc.stdout.readline()
        finally:
            guard.cancel()
        if not text:
            raise AssertionError(f"{self.name} ended (exit {self.proc.wait()}) before its next line:\n{self.stderr()}")
        return json.loads(text)

    def expect(self, tag: str) -> list:
        item = self.line()
        assert item[0] == tag, f"{self.name}: expected {tag!r}, got {item!r}\n{self.stderr()}"
        return item

    def expect_after(self, tag: str, skipped: str) -> list:
        """The next line tagged `tag`, past any tagged `skipped`."""
        while (item := self.line())[0] == skipped:
            pass
        assert item[0] == tag, f"{self.name}: expected {tag!r}, got {item!r}\n{self.stderr()}"
        return item

    def do(self, tag: str, *command: object) -> list:
        self.send(*command)
        return self.expect(tag)

    def stage_and_commit(self, keys: list[str]) -> list[str]:
        """Stage `keys`, commit; the keys acknowledged."""
        self.do("staged", "stage", keys)
        return self.do("committed", "commit")[1]

    def wait_stopped(self) -> None:
        """Wait until the process stops itself (SIGSTOP at its HMEM_PAUSE_AT point)."""
        guard = threading.Timer(HANG_GUARD, self.proc.kill)
        guard.start()
        try:
            _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
        finally:
            guard.cancel()
        assert os.WIFSTOPPED(status), f"{self.name} ended (wait status {status}) instead:\n{self.stderr()}"

    def after_loop(self, until: str | None = None) -> tuple[set[str], int | None]:
        """Read a "loop" command's lines up to the one tagged `until` (None:
        to the end of a killed process's output): the keys acknowledged, and
        the last group it asked to commit."""
        acknowledged: set[str] = set()
        last = None
        while True:
            item: list | None
            if until is not None:
                item = self.line()
            else:
                assert self.proc.stdout is not None and self.proc.poll() is not None  # ended: its output is all there
                text = self.proc.stdout.readline()
                item = json.loads(text) if text else None
            if item is None or item[0] == until:
                return acknowledged, last
            if item[0] == "committed":
                acknowledged |= set(item[1])
            elif item[0] == "committing":
                last = item[1]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(HANG_GUARD) == -signal.SIGKILL

    def close(self) -> dict:
        stats = self.do("closed", "close")[1]
        assert self.proc.wait(HANG_GUARD) == 0, self.stderr()
        return stats

    def stderr(self) -> str:
        return self.err_path.read_text()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def on_both(*, quick: tuple[str, ...] = ("dir",)) -> pytest.MarkDecorator:
    """Run the test on a tier directory and on s3; those not `quick` are
    left out of the quick subset (each of these tests takes a second or more)."""
    kinds = [pytest.param(kind, marks=() if kind in quick else pytest.mark.stress) for kind in ("dir", "s3")]
    return pytest.mark.parametrize("tier", kinds, indirect=True)


@pytest.fixture
def tier(request, tmp_path) -> Iterator[types.SimpleNamespace]:
    """A fresh tier location (a directory, or a prefix on the local S3
    server with a short lease) and ``tier.writer(name, **settings)``, which
    starts a helper process; each is killed at teardown if still running."""
    if request.param == "s3":
        url, options = request.getfixturevalue("s3_url"), {"lease_seconds": LEASE_SECONDS}
    else:
        url, options = str(tmp_path / "tier"), None
    started: list[Writer] = []
    ns = types.SimpleNamespace(url=url, options=options, tmp=tmp_path, kind=request.param)

    def writer(name: str, **settings: float) -> Writer:
        started.append(Writer(ns, name, **settings))
        return started[-1]

    ns.writer = writer
    yield ns
    for w in started:
        w.cleanup()


def make_tier(tier: types.SimpleNamespace) -> None:
    """Make the store as the writers' tiers would (so that the tests of
    commits do not depend on who makes it)."""
    ChunkTier(tier.url, embed_dim=SHAPE[-1], settings=TierSettings(hdc_dim=HDC), storage_options=tier.options).close()


def open_together(writers: list[Writer]) -> None:
    """Open every writer's tier at once (each process has started and waits)."""
    for w in writers:
        w.send("open")
    for w in writers:
        item = w.line()
        assert item[0] == "ready", f"{w.name} could not open the tier: {item}\n{w.stderr()}"


def check_store(
    tier: types.SimpleNamespace, acknowledged: set[str], may_hold: Set[str] = frozenset(), after_kill: bool = False
) -> set[str]:
    """A fresh view of the store holds every acknowledged chunk, bit-exact,
    each once; nothing but those and `may_hold` (chunks of a killed writer,
    each whole); verify finds nothing (after a kill on object storage: only
    the objects the killed writer uploaded and no commit names).  Returns
    the keys held."""
    reader = ChunkTier(tier.url, embed_dim=SHAPE[-1], storage_options=tier.options)
    try:
        held = set(reader.keys())
        lost = acknowledged - held
        assert not lost, f"{len(lost)} acknowledged chunk(s) missing: {sorted(lost)[:5]}"
        assert held <= acknowledged | may_hold, f"chunks never staged: {sorted(held - acknowledged - may_hold)[:5]}"
        for key in sorted(held):
            found = reader.fetch(key)
            assert found is not None, key
            assert tuple(found.shape) == SHAPE and found.layout == "KV_2LTD", (key, found.shape)
            out = np.empty(SHAPE, dtype=np.uint16)
            found.copy_into(out)
            assert np.array_equal(out, chunk_words(key)), f"{key} reads back wrong"
    finally:
        reader.close()
    with Store.open(tier.url, read_only=True, storage_options=tier.options) as store:
        listing = store.chunks.listing()
        assert {info.key for info in listing} == held
        assert all(info.parts == SHAPE[1] and info.layers == tuple(range(SHAPE[1])) for info in listing)
        assert store.stats().entries == SHAPE[1] * len(held)  # a key put by several writers is stored once
    report = hmem.verify(tier.url, full=True, storage_options=tier.options)
    allowed = {"remote.orphan"} if after_kill and tier.kind == "s3" else set()
    assert report.complete and all(f.code in allowed for f in report.problems), report.problems
    return held


# ---- several writers store concurrently ------------------------------------------------


@on_both()
@pytest.mark.parametrize("count", [2, pytest.param(4, marks=pytest.mark.stress)])
def test_writers_store_concurrently(tier, count):
    """Each writer stages chunks of its own (rank) and chunks every writer
    stages (the same key, the same values), commits three times; every
    acknowledged chunk is found, bit-exact, and each key is stored once."""
    make_tier(tier)
    writers = [tier.writer(f"w{rank}", commit_seconds=LONG) for rank in range(count)]
    open_together(writers)
    acknowledged: set[str] = set()
    for round_ in range(3):
        for rank, w in enumerate(writers):
            own = [lmcache_key(rank, f"{round_}-{n}") for n in range(4)]
            shared = [lmcache_key(0, f"shared-{round_}-{n}") for n in range(3)]
            w.send("stage", own + shared)
        for w in writers:  # every writer has staged before any commits: their commits queue on the lock
            w.expect("staged")
        for w in writers:
            w.send("commit")
        for w in writers:
            acknowledged |= set(w.expect("committed")[1])
    stats = [w.close() for w in writers]
    assert len(acknowledged) == 3 * (4 * count + 3)
    assert sum(s["committed_chunks"] for s in stats) == len(acknowledged)  # each chunk went in once
    assert check_store(tier, acknowledged) == acknowledged


@on_both()
def test_writers_make_the_store_together(tier):
    """Four tiers opened at once on a location that holds no store yet (as
    LMCache's workers start together): one makes it, all of them come up,
    and the store verifies clean."""
    writers = [tier.writer(f"w{rank}", commit_seconds=LONG) for rank in range(4)]
    open_together(writers)
    acknowledged = set()
    for rank, w in enumerate(writers):
        acknowledged |= set(w.stage_and_commit([lmcache_key(rank, "first")]))
    for w in writers:
        w.close()
    assert check_store(tier, acknowledged) == acknowledged


# ---- a killed writer costs only its own uncommitted chunks -----------------------------


@on_both()
@pytest.mark.parametrize("window", ["commit", "timer"])
def test_killed_writer_loses_only_its_uncommitted_chunks(tier, window):
    """The victim commits a first set (by commit(), or by its committer's
    timer alone: no commit() call, as LMCache's puts never call one), stages
    a second set and is killed (SIGKILL, as kill -9 of the engine).  The
    survivor committed before and commits after: its lock or lease is not
    held by the dead writer.  Every acknowledged chunk is there; of the
    second set, with a commit window no test reaches, nothing."""
    make_tier(tier)
    victim = tier.writer("victim", commit_seconds=LONG if window == "commit" else 0.05)
    survivor = tier.writer("survivor", commit_seconds=LONG)
    open_together([victim, survivor])
    first = [lmcache_key(1, f"first-{n}") for n in range(5)]
    second = [lmcache_key(1, f"second-{n}") for n in range(5)]
    if window == "commit":
        acknowledged = set(victim.stage_and_commit(first))
    else:
        victim.do("staged", "stage", first)
        acknowledged = set(victim.do("own_commit", "wait_own_commit")[1])
    acknowledged |= set(survivor.stage_and_commit([lmcache_key(0, "before")]))
    victim.do("staged", "stage", second)
    victim.kill()
    acknowledged |= set(survivor.stage_and_commit([lmcache_key(0, "after")]))
    survivor.close()
    held = check_store(tier, acknowledged, may_hold=set(second), after_kill=True)
    if window == "commit":
        assert not held & set(second), "chunks staged and never committed were stored"


# The points of hmem's write path (hmem/_io.py crash_point) a tier's commit
# passes, in order, and from which one on the commit is durable.  A writer
# stopped at one (HMEM_PAUSE_AT) is then killed: the kill lands at that
# exact step (so the thread that passes the point must stop there, not run
# on while another of the process's threads takes the SIGSTOP).  On s3 the
# flush is the working copy's: a commit is durable once the manifest names
# it (remote.committed).
COMMIT_POINTS = {
    "dir": ["lock.taken", "flush.shards_written", "flush.records_written", "flush.committed", "flush.updates_written"],
    "s3": ["lock.taken", "flush.shards_written", "flush.committed", "remote.objects_written", "remote.committed"],
}
DURABLE_FROM = {"dir": "flush.committed", "s3": "remote.committed"}


QUICK_POINTS = {("dir", "flush.committed")}


@pytest.mark.parametrize(
    ("tier", "point"),
    [
        pytest.param(kind, point, marks=() if (kind, point) in QUICK_POINTS else pytest.mark.stress)
        for kind, points in COMMIT_POINTS.items()
        for point in points
    ],
    indirect=["tier"],
)
def test_kill_during_a_commit(tier, point):
    """A writer stages and commits group after group; in its second commit
    it is stopped at `point` and killed (SIGKILL).  Another writer commits
    on through it all (past the dead writer's lock; on s3, its lease,
    which lapses).  Every group acknowledged is there; the group in flight
    is there whole once the commit reached its durable step, absent before;
    the store verifies clean (on s3: but for the objects the dead writer
    uploaded and no commit names)."""
    make_tier(tier)
    victim = tier.writer("victim", commit_seconds=LONG)
    survivor = tier.writer("survivor", commit_seconds=LONG)
    open_together([victim, survivor])
    size, survivor_groups = 3, 4
    survivor.send("loop", lmcache_key(0, "survivor"), survivor_groups, size)
    victim.send("loop", lmcache_key(1, "victim"), 1000, size, point)
    victim.wait_stopped()
    victim.kill()
    acknowledged, in_flight = victim.after_loop()
    assert len(acknowledged) == size and in_flight == 1, (acknowledged, in_flight)
    in_flight_keys = {f"{lmcache_key(1, 'victim')}-{in_flight}-{j}" for j in range(size)}
    survivor_keys, _ = survivor.after_loop(until="looped")
    assert len(survivor_keys) == survivor_groups * size
    # a commit surely after the kill: the writer's open clears what the dead one left
    survivor_keys |= set(survivor.stage_and_commit([lmcache_key(0, "after")]))
    survivor.close()
    held = check_store(tier, acknowledged | survivor_keys, may_hold=in_flight_keys, after_kill=True)
    points = COMMIT_POINTS[tier.kind]
    if points.index(point) >= points.index(DURABLE_FROM[tier.kind]):
        assert in_flight_keys <= held, "a commit past its durable step was lost"
    else:
        assert not held & in_flight_keys, "a commit killed before its durable step was stored"


@on_both(quick=())
def test_kill_after_asking_for_a_commit(tier):
    """As above, killed as soon as it has asked for the commit of its
    fourth group: mostly in its wait for the lock or lease, between the
    other writer's commits.  Each group is stored whole or not at all."""
    make_tier(tier)
    victim = tier.writer("victim", commit_seconds=LONG)
    survivor = tier.writer("survivor", commit_seconds=LONG)
    open_together([victim, survivor])
    size, kill_at, survivor_groups = 3, 3, 5
    survivor.send("loop", lmcache_key(0, "survivor"), survivor_groups, size)
    victim.send("loop", lmcache_key(1, "victim"), 1000, size)
    acknowledged: set[str] = set()
    while (item := victim.line()) != ["committing", kill_at]:
        if item[0] == "committed":
            acknowledged |= set(item[1])
    victim.kill()
    assert len(acknowledged) == kill_at * size
    in_flight = {f"{lmcache_key(1, 'victim')}-{kill_at}-{j}" for j in range(size)}
    survivor_keys, _ = survivor.after_loop(until="looped")
    assert len(survivor_keys) == survivor_groups * size
    # a commit surely after the kill: the writer's open clears what the dead one left
    survivor_keys |= set(survivor.stage_and_commit([lmcache_key(0, "after")]))
    survivor.close()
    held = check_store(tier, acknowledged | survivor_keys, may_hold=in_flight, after_kill=True)
    assert not held & in_flight or in_flight <= held, f"a commit stored in part: {sorted(held & in_flight)}"


# ---- readers see each commit whole --------------------------------------------------------


@on_both()
def test_readers_see_each_commit_whole(tier):
    """A reader process polls keys() and contains() while two writers commit
    groups of chunks (a group: staged, then one commit()).  It never sees
    part of a group, and every chunk it sees reads back bit-exact.  One
    writer commits freely; the other waits, after each commit, until the
    reader has seen it: the reader surely sees the store between commits."""
    make_tier(tier)
    reader = tier.writer("reader", commit_seconds=LONG, refresh_seconds=0.02)
    free, stepped = tier.writer("free", commit_seconds=LONG), tier.writer("stepped", commit_seconds=LONG)
    open_together([reader, free, stepped])
    size, free_groups, stepped_groups = 4, 8, 4
    free_prefix = lmcache_key(0, "free")
    groups = [[f"{free_prefix}-{i}-{j}" for j in range(size)] for i in range(free_groups)]
    groups += [[lmcache_key(1, f"stepped-{i}-{j}") for j in range(size)] for i in range(stepped_groups)]
    reader.send("watch", groups)
    free.send("loop", free_prefix, free_groups, size)
    seen: set[int] = set()
    for i in range(stepped_groups):
        stepped.stage_and_commit(groups[free_groups + i])
        while free_groups + i not in seen:
            seen.update(reader.expect("seen")[1])
    free_keys, _ = free.after_loop(until="looped")
    assert len(free_keys) == free_groups * size
    free.close()
    stepped.close()
    _, polls, reader_keys, problems = reader.expect_after("watched", "seen")
    assert not problems, problems
    everything = {key for group in groups for key in group}
    assert set(reader_keys) == everything
    assert polls >= stepped_groups
    reader.close()
    check_store(tier, everything)
