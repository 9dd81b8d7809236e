"""Interrupts (docs/reliability.md, "Interrupts"; docs/cli.md, "Interrupts").

The library: a KeyboardInterrupt at any point of ``put_many``, ``flush``
or ``compact`` leaves each step done or undone, never half.  A
trace hook raises it at the n-th call or line run inside hmem, for many n
spread over the whole operation: that covers every place a signal's
KeyboardInterrupt can land (and more: a signal lands only at calls and loop
jumps).  Then the store closes without an error, verifies clean (apart
from leftovers the next writer removes) and holds exactly the acknowledged
entries, plus the interrupted batch whole or not at all.

The command line: real ``python -m hmem put/evict/compact --json``
processes get SIGINT or SIGTERM (sometimes twice) at seeded random named
points of their run (each process stops itself there, HMEM_PAUSE_AT, and
the signal is sent to it stopped, so where it lands does not depend on the
machine's load).
Each must exit 0, 130 or 143 without an internal error; what it reports as
committed must be what the store holds, through the public API; and the
store must verify clean apart from leftovers.

Also here: ``put`` never imports the store's own files (a source that is
the store, lies in it, or contains it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem import Store
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

EMBED, HDC = 16, 256
HMEM_DIR = os.path.dirname(hmem.__file__) + os.sep
# verify findings a writer's next open removes (docs/reliability.md)
LEFTOVERS = {"file.temp", "file.orphan", "entries.tail"}


def kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    n = 1 + seed % 3
    return r.standard_normal((n, EMBED)).astype(np.float32), r.standard_normal((n, EMBED)).astype(np.float32)


def entry(seed: int) -> tuple:
    """An entry that names itself: importance = seed, layer = seed % 3."""
    return (*kv(seed), seed % 3, float(seed))


def batch(first: int, count: int) -> list[tuple]:
    return [entry(seed) for seed in range(first, first + count)]


@pytest.fixture
def fast_dir(tmp_path) -> Iterator[Path]:
    """A directory on tmpfs when there is one: these loops open, write and
    verify hundreds of stores, and fsync on a shared runner's disk costs
    more than the rest together.  Nothing here depends on durability."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=base, prefix="hmem-interrupts-") as d:
        yield Path(d)


def _points(total: int, default: int) -> list[int]:
    """Up to HMEM_STRESS_ROUNDS (else `default`) interrupt points spread over 1..total."""
    wanted = int(os.environ.get("HMEM_STRESS_ROUNDS", default))
    return sorted({int(n) for n in np.linspace(1, total, num=min(total, wanted))})


# ---- a KeyboardInterrupt anywhere inside hmem --------------------------------------


class InterruptAt:
    """A trace hook that raises KeyboardInterrupt once, at the n-th call or
    line run in hmem's own code (`n` = 0: never; `seen` counts them)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.fired = n, 0, False

    def __call__(self, frame, event, arg):
        if self.fired or not frame.f_code.co_filename.startswith(HMEM_DIR):
            return None
        if event in ("call", "line"):
            self.seen += 1
            if self.seen == self.n:
                self.fired = True
                sys.settrace(None)
                raise KeyboardInterrupt
        return self


def interrupt(n: int, work: Callable[[], object]) -> InterruptAt:
    """Run `work` with a KeyboardInterrupt at hmem event `n`."""
    hook = InterruptAt(n)
    sys.settrace(hook)
    arrived = False
    try:
        work()
    except KeyboardInterrupt:
        if not hook.fired:
            raise
        arrived = True
    finally:
        sys.settrace(None)
    # a Ctrl-C is never lost: raised anywhere inside hmem (a finalizer or
    # callback included, where Python would print and drop it), it reaches
    # the caller
    assert arrived or not hook.fired, f"the KeyboardInterrupt at hmem event {n} did not reach the caller"
    return hook


def events_of(work: Callable[[], object]) -> int:
    return interrupt(0, work).seen


def check_store(path: Path) -> list[int]:
    """The live ids, every entry's K/V the ones its seed gives (to INT8's
    precision in a quantized store); verify finds nothing but leftovers,
    and nothing at all once a writer opened it."""
    problems = [f.code for f in hmem.verify(path, full=True).problems]
    assert set(problems) <= LEFTOVERS, problems
    with Store.open(path):
        pass
    assert hmem.verify(path, full=True).ok, hmem.verify(path, full=True).findings
    with Store.open(path, read_only=True) as reader:
        for info in reader.entries():
            got = reader.get(info.entry_id)
            for stored, put in zip((got.keys, got.values), kv(int(info.importance))):
                error = np.abs(stored - put).max()
                assert error <= (np.abs(put).max() / 100 if reader.config.quantize_stored else 0), info
        return reader.entry_ids()


def still_open(store: Store) -> bool:
    """Whether a Store object is still open (a closed one refuses every call)."""
    try:
        store.entry_ids()
    except hmem.StoreClosedError:
        return False
    return True


PUT_SETTINGS = {
    "open-shard": dict(shard_max_bytes=1 << 20),  # the batch joins the open shard
    "rollover": dict(shard_max_bytes=3000),  # the batch seals shards on the way
    "quantized": dict(shard_max_bytes=3000, quantize_stored=True),
    "max-entries": dict(shard_max_bytes=3000, max_entries=10),  # the put evicts first
}


@pytest.mark.stress
@pytest.mark.parametrize("name", list(PUT_SETTINGS))
def test_put_many_interrupted_anywhere(fast_dir, name):
    settings = PUT_SETTINGS[name]

    def run(n: int, root: Path) -> tuple[InterruptAt, list[int], list[int], list[int]]:
        store = Store.create(root, embed_dim=EMBED, hdc_dim=HDC, **settings)
        acked = [i for b in range(3) for i in store.put_many(batch(10 * b, 3))]
        store.flush()
        acked += store.put_many(batch(30, 2))  # acknowledged, not yet flushed
        before = store.entry_ids()
        stored: list[int] = []
        hook = interrupt(n, lambda: stored.extend(store.put_many(batch(100, 4))))
        now = store.entry_ids()  # in memory too: the batch is in whole, or not at all
        if "max_entries" not in settings:
            assert now[: len(before)] == before and len(now) - len(before) in (0, 4), n
        store.close()  # never fails, whatever the interrupt left
        return hook, acked, before, stored

    total = run(0, fast_dir / "reference")[0].seen
    for n in _points(total, 80):
        root = fast_dir / f"n{n}"
        hook, acked, before, stored = run(n, root)
        assert hook.fired
        ids = check_store(root)
        new = sorted(set(ids) - set(before))
        assert len(new) in (0, 4), (n, new)  # the batch whole or not at all
        assert not stored or new == stored, (n, new, stored)
        if "max_entries" in settings:
            assert set(ids) <= set(acked) | set(new) and len(ids) <= settings["max_entries"]
        else:
            assert set(acked) <= set(ids), n


@pytest.mark.stress
def test_flush_interrupted_anywhere(fast_dir):
    # A flush cut short leaves the last commit standing, and the next one
    # (here: close) does the whole job.
    def run(n: int, root: Path) -> tuple[InterruptAt, list[int]]:
        store = Store.create(root, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=3000)
        for b in range(3):
            store.put_many(batch(10 * b, 3))
        store.flush()
        store.put_many(batch(40, 5))  # seals shards; the rest waits in the open shard
        store.query(kv(40)[0], 1, 2)  # access counts: records to update in place
        everything = store.entry_ids()
        hook = interrupt(n, store.flush)
        store.close()
        return hook, everything

    total = run(0, fast_dir / "reference")[0].seen
    for n in _points(total, 60):
        hook, everything = run(n, fast_dir / f"n{n}")
        assert hook.fired
        assert check_store(fast_dir / f"n{n}") == everything, n


@pytest.mark.stress
def test_compact_interrupted_anywhere(fast_dir):
    def run(n: int, root: Path) -> tuple[InterruptAt, list[int], bool]:
        store = Store.create(root, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=3000)
        for b in range(4):
            store.put_many(batch(10 * b, 4))
        store.evict(9)
        ids = store.entry_ids()
        hook = interrupt(n, store.compact)
        usable = still_open(store)
        if usable:  # not committed: the Store works on as before
            assert store.entry_ids() == ids
            assert all(np.array_equal(store.get(i).keys, kv(int(store.get(i).info.importance))[0]) for i in ids)
            ids = ids + [store.put(*kv(500), 0, 500.0)]
        store.close()
        return hook, ids, usable

    total = run(0, fast_dir / "reference")[0].seen
    for n in _points(total, 60):
        hook, ids, usable = run(n, fast_dir / f"n{n}")
        assert hook.fired
        assert check_store(fast_dir / f"n{n}") == sorted(ids), n


def test_compact_stopped_from_progress_leaves_the_old_state(tmp_path):
    store = Store.create(tmp_path / "s", embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=3000)
    for b in range(4):
        store.put_many(batch(10 * b, 4))
    store.evict(9)
    ids, before = store.entry_ids(), store.stats()

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.compact(progress=stop)
    assert store.entry_ids() == ids and store.stats().evicted == before.evicted
    assert [s.file for s in store.stats().shards] == [s.file for s in before.shards]
    assert hmem.verify(tmp_path / "s", full=True).findings == ()  # its new files are gone too
    assert store.compact().performed  # still usable
    store.close()
    assert check_store(tmp_path / "s") == ids


# ---- import_files: should_stop, and the store's own files --------------------------------


def _kv_files(folder: Path, count: int, importance: Callable[[int], float] = float) -> list[Path]:
    """Files of one entry each, of seeds 0..count-1 (importance: the seed, by default)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(count):
        keys, values = kv(seed)
        paths.append(folder / f"f{seed:04d}.safetensors")
        save_file({"keys": keys, "values": values}, paths[-1], metadata={"importance": str(importance(seed))})
    return paths


def test_import_files_stops_between_files_when_asked(tmp_path):
    files = _kv_files(tmp_path / "in", 6)
    asked = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) > 4

    with Store.create(tmp_path / "s", embed_dim=EMBED, hdc_dim=HDC) as store:
        report = hmem.import_files(store, [tmp_path / "in"], should_stop=should_stop)
    assert [Path(f.path).name for f in report.files] == [p.name for p in files[:4]]
    assert report.not_started == tuple(str(p) for p in files[4:])
    with Store.open(tmp_path / "s", read_only=True) as reader:
        assert sorted(int(e.importance) for e in reader.entries()) == [0, 1, 2, 3]


def _store_with_files(tmp_path: Path) -> tuple[Path, Store]:
    """A store inside `tmp_path/data`, beside a folder of files to import."""
    _kv_files(tmp_path / "data" / "dumps", 3)
    store = Store.create(tmp_path / "data" / "store", embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=3000)
    store.put_many(batch(50, 4))
    store.flush()
    assert any((tmp_path / "data" / "store").glob("shard_*.safetensors"))
    return tmp_path / "data" / "store", store


def test_import_refuses_the_store_and_files_inside_it(tmp_path):
    root, store = _store_with_files(tmp_path)
    (tmp_path / "link").symlink_to(root)
    inside = next(root.glob("shard_*.safetensors"))
    for source, fragment in [
        (root, "is the store itself"),
        (tmp_path / "link", "is the store itself"),
        (inside, "lies inside the store"),
        (tmp_path / "link" / inside.name, "lies inside"),
    ]:
        with pytest.raises(hmem.InvalidArgumentError, match=fragment) as caught:
            hmem.import_files(store, [tmp_path / "data" / "dumps", source])
        assert str(source) in caught.value.message
        assert store.stats().entries == 4 and store.stats().unflushed == 0  # nothing was put
    store.close()


def test_import_of_a_directory_holding_the_store_skips_the_store(tmp_path):
    root, store = _store_with_files(tmp_path)
    (tmp_path / "data" / "dumps" / "to_a_shard.safetensors").symlink_to(next(root.glob("shard_*.safetensors")))
    with store:
        report = hmem.import_files(store, [tmp_path / "data"])
        assert sorted(Path(f.path).name for f in report.files) == [
            "f0000.safetensors",
            "f0001.safetensors",
            "f0002.safetensors",
        ]
        assert report.entries_added == 3 and not report.skipped


def test_cli_put_refuses_the_store_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root, store = _store_with_files(tmp_path)
    store.close()
    result = CliRunner().invoke(app, ["put", str(root), str(root)])
    assert result.exit_code == ExitCode.USAGE
    assert "is the store itself" in result.stderr and "Traceback" not in result.stderr
    result = CliRunner().invoke(app, ["put", str(root), str(tmp_path / "data"), "--json"])
    assert result.exit_code == ExitCode.OK, result.stderr
    assert json.loads(result.stdout)["entries_added"] == 3
    with Store.open(root, read_only=True) as reader:
        assert reader.stats().entries == 7


# ---- the command line under SIGINT and SIGTERM ---------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "HMEM_STORE", "HMEM_DEBUG")}
    env.update(NO_COLOR="1", COLUMNS="120")
    return env


# Where each command's signals are aimed: a named point of its run (hmem's
# crash points, hmem/_io.py), and which pass through it.  HMEM_PAUSE_AT stops
# the process there (SIGSTOP) and the test sends its signal to the stopped
# process, so the signal lands at that point on every run, however busy the
# machine.  "lock.taken" is before the command's stoppable section (a signal
# stops it at once); the others are inside it (it stops at its next safe point).
_AIMS = {
    "put": [
        ("lock.taken", 1),
        ("import.file", 1),
        ("import.file", 90),
        ("import.file", 250),
        ("import.file", 400),
        ("flush.shards_written", 1),
        ("flush.committed", 1),
        ("flush.updates_written", 1),
    ],
    "compact": [
        ("lock.taken", 1),
        ("compact.shard_written", 1),
        ("compact.shard_written", 2),
        ("compact.shards_written", 1),
        ("compact.committed", 1),
    ],
    "evict": [("lock.taken", 1), ("evict.marked", 1), ("flush.committed", 1)],
}
# A second signal goes to a point the command passes after its first
# signal (in its flush, its commit): it stops the command at once there.
_AIMED_PAIRS = {
    "put": [(("import.file", 1), ("flush.shards_written", 1)), (("import.file", 250), ("flush.committed", 1))],
    "compact": [(("compact.shards_written", 1), ("compact.committed", 1))],
    "evict": [(("evict.marked", 1), ("flush.committed", 1))],
}


def _stopped_at_the_point(proc: subprocess.Popen) -> bool:
    """Wait until the process stops at its pause point (True) or ends
    without reaching it (False); its exit status is left for communicate()."""
    info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    return info is not None and info.si_code == os.CLD_STOPPED


class Tally:
    def __init__(self) -> None:
        self.runs = self.aimed = self.signals = self.stopped = self.reported_stops = 0
        self.codes: dict[int, int] = {}
        self.internal_errors = self.mismatches = 0

    def line(self) -> str:
        return (
            f"{self.runs} runs, {self.aimed} reached their point, {self.signals} signals sent, "
            f"{self.stopped} runs stopped by a signal "
            f"({self.reported_stops} with an 'interrupted' report), exit codes {sorted(self.codes.items())}, "
            f"{self.internal_errors} internal errors, {self.mismatches} mismatches"
        )


@pytest.mark.stress
@pytest.mark.skipif(not hasattr(os, "waitid"), reason="needs os.waitid to see a process stop")
def test_cli_stops_cleanly_on_sigint_and_sigterm(fast_dir):
    rng = random.Random(int(os.environ.get("HMEM_INTERRUPT_SEED", "20")))
    runs = int(os.environ.get("HMEM_INTERRUPT_RUNS", "32"))
    _kv_files(fast_dir / "in", 400, lambda seed: rng.uniform(0.5, 2.0))  # evictions spread over the shards
    store = fast_dir / "store"
    with Store.create(store, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=64 << 10):
        pass
    tally = Tally()
    for i in range(runs):
        command = (
            ["put", str(store), str(fast_dir / "in")]
            if i % 6 < 4
            else (["compact", str(store)] if i % 6 == 4 else ["evict", str(store), "--keep", "0.8", "--yes"])
        )
        sent = [signal.SIGTERM if rng.random() < 0.3 else signal.SIGINT]
        if rng.random() < 0.25:  # a second signal: it stops the command at once
            aims = list(rng.choice(_AIMED_PAIRS[command[0]]))
            sent.append(signal.SIGINT)
        else:
            aims = [rng.choice(_AIMS[command[0]])]
        pause_at = ",".join(f"{point}:{nth}" for point, nth in aims)
        with Store.open(store, read_only=True) as reader:
            before_ids, before = reader.entry_ids(), reader.stats()
        # output to files: a process stopped at its point must never also be
        # one blocked on a full pipe that nobody reads yet
        with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hmem", *command, "--json"],
                cwd=fast_dir,
                env={**_env(), "HMEM_PAUSE_AT": pause_at},
                stdout=out_file,
                stderr=err_file,
                text=True,
            )
            # each signal goes to the process stopped at the next point it
            # reaches (the first signal is handled long before the second
            # point: Python runs a signal's handler at its next instruction)
            landed = 0
            while landed < len(sent) and _stopped_at_the_point(proc):
                proc.send_signal(sent[landed])  # pending until the process runs on: it lands at the point
                proc.send_signal(signal.SIGCONT)
                landed += 1
            sent = sent[:landed]
            tally.aimed += bool(sent)
            tally.signals += len(sent)
            proc.wait(timeout=120)  # a hang guard only
            out_file.seek(0)
            err_file.seek(0)
            out, err = out_file.read(), err_file.read()
        tally.runs += 1
        tally.codes[proc.returncode] = tally.codes.get(proc.returncode, 0) + 1
        what = f"run {i} {command[0]} at {pause_at} signals {[s.name for s in sent]}: exit {proc.returncode}\n{err}"
        assert proc.returncode in (ExitCode.OK, ExitCode.INTERRUPTED, ExitCode.TERMINATED), what
        if proc.returncode:
            tally.stopped += 1
            assert proc.returncode == (ExitCode.TERMINATED if sent[0] == signal.SIGTERM else ExitCode.INTERRUPTED), what
        tally.internal_errors += "internal error" in err
        assert "internal error" not in err and "Traceback" not in err, what
        problems = [f.code for f in hmem.verify(store).problems]
        assert set(problems) <= LEFTOVERS, (what, problems)
        with Store.open(store, read_only=True) as reader:
            ids, after = reader.entry_ids(), reader.stats()
        document = _document(out, cut_short_ok=len(sent) > 1)
        if document is None or "error" in document:  # stopped at once (outside a stoppable section, or a second signal)
            assert proc.returncode, what
            assert document is None or document["error"]["exit"] == proc.returncode, what
            assert {
                "put": set(before_ids) <= set(ids),
                "evict": set(ids) <= set(before_ids),
                "compact": ids == before_ids,
            }[command[0]], what
            continue
        stop = document.get("interrupted")
        if stop is not None:
            tally.reported_stops += 1
            assert stop["signal"] == sent[0].name and stop["exit_code"] == proc.returncode, what
        matches = _report_matches(command[0], document, before_ids, ids, before, after)
        tally.mismatches += not matches
        assert matches, (what, document, len(before_ids), len(ids))
    print(f"\ninterrupt loop: {tally.line()}")
    # every signal lands inside the run it was aimed at, so it stops that run
    assert tally.stopped == tally.aimed >= 20 and tally.reported_stops >= 8, tally.line()
    assert tally.signals - tally.aimed >= 2, tally.line()  # second signals landed, in a flush or a commit
    with Store.open(store):  # a writer's open removes the leftovers
        pass
    assert hmem.verify(store, full=True).ok


def _document(out: str, *, cut_short_ok: bool) -> dict | None:
    """The run's JSON document; None when there is none, or when a second
    signal cut its writing short (it stops at once, output included)."""
    try:
        return json.loads(out) if out.strip() else None
    except json.JSONDecodeError:
        if cut_short_ok:
            return None
        raise


def _report_matches(command: str, document: dict, before_ids: list[int], ids: list[int], before, after) -> bool:
    """Whether the store holds what the run's report says it committed."""
    if command == "put":
        stop = document.get("interrupted")
        if stop is not None and not (
            stop["entries_committed"] == document["entries_added"]
            # a stop before the import began (the store not yet open) names no store count
            and stop.get("store_entries", after.entries) == after.entries
            and stop["files_finished"] + stop["files_not_started"] == document["files"]
        ):
            return False
        # new ids are above every older one, so the count says it all
        return ids[: len(before_ids)] == before_ids and len(ids) == len(before_ids) + document["entries_added"]
    if command == "evict":
        gone = set(document["entry_ids"]) if document["evicted"] else set()
        return document["evicted"] in (0, document["evict"]) and ids == [i for i in before_ids if i not in gone]
    if document["performed"]:  # the records of evicted entries go only once they are the share compaction asks
        return ids == before_ids and after.evicted == before.evicted - document["records_dropped"]
    # nothing to do, or stopped: the steps committed before the stop stay (one may have dropped records)
    return ids == before_ids and after.evicted <= before.evicted
