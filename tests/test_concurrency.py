"""Several processes at one store (docs/cli.md "One writer at a time",
hmem/lock.py): one writer wins and the others are refused with the
holder's pid and nothing left behind; a killed holder frees the store at
once; --lock-wait / lock_wait waits for the holder; readers querying while
a writer puts, evicts and compacts never get wrong K/V.

Every process here is a real one (subprocess, cwd outside the checkout, so
it imports the installed hmem).  Entries describe themselves: importance =
seed, layer = seed % 3, and the K/V come from the seed, so any result a
reader gets can be checked against the truth by itself.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import hmem
from hmem import Store, _io

EMBED, HDC = 16, 256
HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)


def kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    n = 1 + seed % 3
    return (r.standard_normal((n, EMBED)).astype(np.float32), r.standard_normal((n, EMBED)).astype(np.float32))


def entry(seed: int) -> tuple:
    k, v = kv(seed)
    return (k, v, seed % 3, float(seed))


_KV_SRC = inspect.getsource(kv) + "\n\n" + inspect.getsource(entry)  # the same code in helper processes

_PRELUDE = f"""
import json, os, sys, time, traceback
import numpy as np
import hmem
EMBED = {EMBED}
{_KV_SRC}
"""


def _stress_seconds(default: float) -> float:
    """`default` seconds, scaled by HMEM_STRESS_ROUNDS / 60 in a long run (60 rounds: the default)."""
    rounds = os.environ.get("HMEM_STRESS_ROUNDS")
    return default if rounds is None else default * max(1, int(rounds)) / 60


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (_io.CRASH_ENV, "HMEM_STORE", "HMEM_DEBUG", "FORCE_COLOR")}
    env.update(NO_COLOR="1", COLUMNS="200")
    return env


class Procs:
    """Helper processes of one test, all killed at teardown if still running."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.running: list[subprocess.Popen] = []

    def python(self, code: str, *args, name: str = "helper") -> subprocess.Popen:
        script = self.tmp_path / f"{name}-{len(self.running)}.py"
        script.write_text(_PRELUDE + code)
        return self.spawn([sys.executable, str(script), *map(str, args)])

    def hmem(self, *args) -> subprocess.Popen:
        return self.spawn([sys.executable, "-m", "hmem", *map(str, args)])

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            cwd=self.tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.running.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.cleanup()


def finish(proc: subprocess.Popen, timeout: float = HANG_GUARD) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def next_line(proc: subprocess.Popen, timeout: float = HANG_GUARD) -> list:
    """The process's next JSON line.  A process that says nothing for
    `timeout` seconds is killed (a hang guard: the test fails, it does not hang)."""
    guard = threading.Timer(timeout, proc.kill)
    guard.start()
    try:
        line = proc.stdout.readline()
    finally:
        guard.cancel()
    if not line:
        raise AssertionError(f"the helper ended (exit {proc.wait()}) before its next line: {proc.stderr.read()}")
    return json.loads(line)


def expect_line(proc: subprocess.Popen, wanted: str) -> list:
    """Read JSON lines from the process until one whose first item is `wanted`."""
    while True:
        item = next_line(proc)
        if item[0] == wanted:
            return item


def wait_for_lock_open(pid: int, path: Path) -> None:
    """Wait until process `pid` has the lock file of the store at `path` open
    (Linux /proc): a writer opens it just before trying for the lock, and
    only a writer opens it.  A poll for an event, not for a duration."""
    lock = os.path.realpath(path / "lock")
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            raise AssertionError(f"process {pid} ended before it opened {lock}") from None
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == lock:
                    return
            except OSError:  # closed meanwhile
                pass
        time.sleep(0.005)
    raise AssertionError(f"process {pid} never opened {lock}")


class InThread:
    """fn() on a thread of its own; result() returns or raises what it did."""

    def __init__(self, fn) -> None:
        self._outcome: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._outcome["value"] = fn()
        except BaseException as exc:
            self._outcome["error"] = exc

    def result(self):
        self._thread.join(HANG_GUARD)  # a hang guard only
        assert not self._thread.is_alive(), f"still running after {HANG_GUARD} s"
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file of the store directory, the lock file and its owner record included."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def make_store(path: Path, seeds=range(1, 31), **config) -> None:
    config.setdefault("shard_max_bytes", 4000)
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC, **config) as store:
        seeds = list(seeds)
        for i in range(0, len(seeds), 5):
            store.put_many([entry(s) for s in seeds[i : i + 5]])
            store.flush()


def live_seeds(path: Path) -> dict[int, int]:
    """entry id -> seed of every live entry, each checked against its seed."""
    out = {}
    with Store.open(path, read_only=True) as store:
        for info in store.entries():
            seed = int(info.importance)
            got = store.get(info.entry_id)
            want = kv(seed)
            assert got.keys.tobytes() == want[0].tobytes() and got.values.tobytes() == want[1].tobytes()
            out[info.entry_id] = seed
    return out


_HOLDER = """
path = sys.argv[1]
release = sys.argv[2]  # the holder closes the store once this file exists ("": it holds it until killed)
store = hmem.Store.open(path)
ids = store.put_many([entry(s) for s in (901, 902)])
store.flush()
print(json.dumps(["acked", ids]), flush=True)
store.put_many([entry(s) for s in (903, 904)])  # never flushed
print(json.dumps(["ready", os.getpid()]), flush=True)
if not release:
    time.sleep(3600)  # killed before that
while not os.path.exists(release):
    time.sleep(0.01)
store.close()
print(json.dumps(["closed"]), flush=True)
"""


def _report(kind: str, name: str, **figures) -> None:
    line = {"kind": kind, "name": name, **figures}
    print("FIGURES", json.dumps(line))
    log = os.environ.get("HMEM_RELIABILITY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")


# ---- one writer wins -------------------------------------------------------------------------

_CONTENDER = """
path, go, release = sys.argv[1:4]
print(json.dumps(["started"]), flush=True)
while not os.path.exists(go):
    time.sleep(0.0005)
try:
    store = hmem.Store.open(path)
except hmem.StoreLockedError as exc:
    print(json.dumps(["locked", str(exc)]), flush=True)
    sys.exit(0)
print(json.dumps(["won", os.getpid()]), flush=True)
store.put_many([entry(os.getpid())])
store.flush()
while not os.path.exists(release):
    time.sleep(0.005)
store.close()
print(json.dumps(["closed"]), flush=True)
"""


@pytest.mark.stress
def test_exactly_one_of_many_simultaneous_writers_wins(tmp_path, procs):
    path = tmp_path / "s"
    make_store(path)
    trials, contenders = 3, 6
    figures = {"trials": trials, "contenders": contenders, "refused": 0, "refusals_naming_the_pid": 0}
    expected_live = live_seeds(path)
    for trial in range(trials):
        go, release = tmp_path / f"go-{trial}", tmp_path / f"release-{trial}"
        started = [procs.python(_CONTENDER, path, go, release, name="contender") for _ in range(contenders)]
        for proc in started:
            expect_line(proc, "started")
        go.touch()
        winners, refusals = [], []
        for proc in started:
            item = next_line(proc)
            (winners if item[0] == "won" else refusals).append((proc, item))
        assert len(winners) == 1, [item for _, item in winners]
        assert len(refusals) == contenders - 1
        ((winner, (_, winner_pid)),) = winners
        for proc, (what, message) in refusals:
            assert what == "locked"
            assert finish(proc)[0] == 0
            assert f"{path} is locked for writing by" in message
            # the owner record is written just after the flock is taken, so a
            # contender that lost in that instant can only say "another process"
            assert f"pid {winner_pid} " in message or "another process" in message, message
            figures["refusals_naming_the_pid"] += f"pid {winner_pid} " in message
        figures["refused"] += len(refusals)
        release.touch()
        assert expect_line(winner, "closed")
        assert finish(winner)[0] == 0
        # exactly the winner's entry went in
        now = live_seeds(path)
        new = {eid: seed for eid, seed in now.items() if eid not in expected_live}
        assert list(new.values()) == [winner_pid] and set(expected_live) <= set(now)
        expected_live = now
    assert hmem.verify(path, full=True).ok
    _report("concurrency", "simultaneous writers", **figures)


@pytest.mark.stress
def test_simultaneous_cli_puts_store_exactly_what_they_report(tmp_path, procs):
    """Four `hmem put` at once, without and with --lock-wait: each either
    stores its file whole (exit 0) or is refused (exit 6) and stores nothing."""
    path = tmp_path / "s"
    make_store(path, seeds=range(1, 6))
    outcomes = {}
    for round_no, wait in enumerate(("0", "inf")):  # inf: as long as it takes (finish() guards against a hang)
        files = []
        for i in range(4):
            seed = 3000 + 100 * round_no + i
            k, v = kv(seed)
            file = tmp_path / f"put-{wait}-{i}.safetensors"
            save_file({"keys": k, "values": v}, file, metadata={"layer": str(seed % 3), "importance": str(seed)})
            files.append((seed, file))
        before = live_seeds(path)
        runs = [(seed, procs.hmem("put", path, file, "--lock-wait", wait, "--json")) for seed, file in files]
        stored = set()
        for seed, proc in runs:
            code, out, err = finish(proc)
            assert "Traceback" not in err
            if code == 0:
                assert json.loads(out)["entries_added"] == 1
                stored.add(seed)
            else:
                assert code == 6, err
                assert len(err.strip().splitlines()) == 1 and "is locked for writing by" in err
                assert json.loads(out)["error"]["code"] == "locked"  # --json: the error as a document
            outcomes.setdefault(wait, []).append(code)
        after = live_seeds(path)
        assert set(after.values()) == set(before.values()) | stored
        assert len(after) == len(before) + len(stored)
        if wait == "inf":
            assert stored == {seed for seed, _ in files}  # everyone got its turn
    assert hmem.verify(path, full=True).ok
    _report("concurrency", "simultaneous CLI puts", exit_codes=outcomes)


_PAUSED_HOLDER = """
from hmem import _io
path, release = sys.argv[1], sys.argv[2]
paused = []

def hook(op, file):  # stop inside WriterLock: the flock is taken, the owner record not yet written
    if op == "truncate" and os.path.basename(file) == "lock" and not paused:
        paused.append(True)
        print(json.dumps(["in the window", os.getpid()]), flush=True)
        while not os.path.exists(release):  # in the window until the test has been refused
            time.sleep(0.01)

_io.set_fault_hook(hook)
store = hmem.Store.open(path)
print(json.dumps(["ready", os.getpid()]), flush=True)
time.sleep(3600)
"""


def test_a_writer_refused_while_the_holder_takes_the_lock_names_the_holder(tmp_path, procs):
    path = tmp_path / "s"
    make_store(path, seeds=range(1, 4))
    release = tmp_path / "release"
    holder = procs.python(_PAUSED_HOLDER, path, release, name="paused-holder")
    _, pid = expect_line(holder, "in the window")
    with pytest.raises(hmem.StoreLockedError) as refused:
        Store.open(path)
    # no owner record yet: the pid comes from the kernel's lock table
    assert f"pid {pid} (just taking the lock)" in str(refused.value), str(refused.value)
    release.touch()
    expect_line(holder, "ready")


# ---- refused writers leave nothing behind ----------------------------------------------------


@pytest.mark.stress
def test_writers_are_refused_while_the_lock_is_held_and_change_nothing(tmp_path, procs):
    path = tmp_path / "s"
    make_store(path)
    k, v = kv(77)
    save_file({"keys": k, "values": v}, tmp_path / "in.safetensors")
    np.save(tmp_path / "q.npy", kv(5)[0])
    holder = procs.python(_HOLDER, path, "", name="holder")
    expect_line(holder, "acked")
    _, pid = expect_line(holder, "ready")

    # readers and dry runs take no lock: they run beside the writer
    readers = [
        procs.hmem(*args)
        for args in (
            ["stats", path, "--json"],
            ["query", path, "--query", "q.npy", "--layer", "2", "--json"],
            ["verify", path, "--full", "--json"],
            ["put", path, "in.safetensors", "--dry-run", "--json"],
            ["evict", path, "--target", "3", "--dry-run", "--json"],
            ["compact", path, "--dry-run", "--json"],
        )
    ]
    for proc in readers:
        code, out, err = finish(proc)
        assert code == 0, (proc.args, err)
        json.loads(out)

    # a damaged record makes verify --repair want to write (a stray temporary
    # file would not: beside a live writer it is that writer's work in progress)
    records = bytearray((path / "entries.bin").read_bytes())
    records[20] ^= 0xFF
    (path / "entries.bin").write_bytes(bytes(records))
    before = snapshot(path)
    assert f'"pid": {pid}' in before["lock"].decode()  # the holder's owner record
    refused_cli = [
        procs.hmem(*args)
        for args in (
            ["put", path, "in.safetensors"],
            ["put", path, "in.safetensors", "--lock-wait", "0.2"],
            ["evict", path, "--target", "3", "--yes"],
            ["compact", path],
            ["compact", path, "--threshold", "0"],
            ["query", path, "--query", "q.npy", "--layer", "2", "--count-access"],
            ["verify", path, "--repair", "--yes"],
        )
    ]
    for proc in refused_cli:
        code, out, err = finish(proc)
        lines = err.strip().splitlines()
        assert code == 6, (proc.args, code, err)
        assert len(lines) == 1 and lines[-1].startswith("error: "), (proc.args, err)
        assert f"is locked for writing by pid {pid} on " in lines[-1] and "--lock-wait" in lines[-1], lines
        assert "Traceback" not in err
    for attempt in (lambda: Store.open(path), lambda: Store.open(path, lock_wait=0.2), lambda: hmem.repair(path)):
        with pytest.raises(hmem.StoreLockedError, match=f"pid {pid} on "):
            attempt()
    assert snapshot(path) == before  # no file made, changed or removed, the lock's record included
    holder.kill()
    _report(
        "concurrency",
        "refused while locked",
        cli_refusals=len(refused_cli),
        library_refusals=3,
        readers_beside_the_writer=len(readers),
    )


# ---- a killed holder ---------------------------------------------------------------------------


@pytest.mark.stress
def test_a_killed_lock_holder_frees_the_store_at_once(tmp_path, procs):
    path = tmp_path / "s"
    make_store(path)
    before = live_seeds(path)
    for how in ("library", "cli"):
        holder = procs.python(_HOLDER, path, "", name="holder")
        _, acked = expect_line(holder, "acked")
        _, pid = expect_line(holder, "ready")
        with pytest.raises(hmem.StoreLockedError):
            Store.open(path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=HANG_GUARD)
        assert f'"pid": {pid}' in (path / "lock").read_text()  # a stale owner record: the flock is what counts
        # "at once": these opens wait for no lock at all, so they succeed only
        # if the kernel released the killed holder's flock
        if how == "library":
            with Store.open(path):
                assert f'"pid": {os.getpid()}' in (path / "lock").read_text()
        else:
            done = procs.hmem("compact", path, "--json")
            code, out, err = finish(done)
            assert code == 0, err
            assert json.loads(out)["needed"] is False or json.loads(out)["performed"]
        now = live_seeds(path)
        # the flushed entries are there, the unflushed ones are not
        assert set(now) == set(before) | set(acked), (acked, sorted(now))
        before = now
        assert hmem.verify(path, full=True).ok
    _report("concurrency", "killed holder", kills=2)


# ---- waiting for the lock -----------------------------------------------------------------------


@pytest.mark.stress
def test_lock_wait_waits_for_the_holder_and_gives_up_in_time(tmp_path, procs):
    path = tmp_path / "s"
    make_store(path)
    k, v = kv(1234)
    save_file({"keys": k, "values": v}, tmp_path / "in.safetensors", metadata={"importance": "1234"})

    # the holder lets go only once the put is trying for the lock: the put
    # waits for it (a put that did not wait would be refused with exit 6)
    release = tmp_path / "release-cli"
    holder = procs.python(_HOLDER, path, release, name="holder")
    expect_line(holder, "acked")
    expect_line(holder, "ready")
    put = procs.hmem("put", path, "in.safetensors", "--lock-wait", "inf", "--json")
    wait_for_lock_open(put.pid, path)
    assert put.poll() is None
    release.touch()
    code, out, err = finish(put)
    assert code == 0, err
    assert json.loads(out)["entries_added"] == 1
    assert expect_line(holder, "closed") and finish(holder)[0] == 0
    assert 1234 in live_seeds(path).values()

    # the library's lock_wait does the same
    release = tmp_path / "release-library"
    holder = procs.python(_HOLDER, path, release, name="holder")
    expect_line(holder, "ready")
    opening = InThread(lambda: Store.open(path, lock_wait=float("inf")))
    wait_for_lock_open(os.getpid(), path)
    release.touch()
    with opening.result():
        pass
    assert expect_line(holder, "closed") and finish(holder)[0] == 0

    # a holder that stays: the wait ends after the time given, with exit 6
    holder = procs.python(_HOLDER, path, "", name="holder")
    expect_line(holder, "ready")
    before = snapshot(path)
    started = time.monotonic()
    code, out, err = finish(procs.hmem("compact", path, "--lock-wait", "0.8"))  # finish(): a hang guard
    gave_up = time.monotonic() - started
    assert code == 6 and "is locked for writing by pid" in err and len(err.strip().splitlines()) == 1, err
    assert gave_up >= 0.8, gave_up  # it waited the time given (how much longer depends on the machine)
    started = time.monotonic()
    with pytest.raises(hmem.StoreLockedError):
        InThread(lambda: Store.open(path, lock_wait=0.5)).result()
    assert time.monotonic() - started >= 0.5
    assert snapshot(path) == before
    holder.kill()
    _report("concurrency", "lock wait", gave_up_after=round(gave_up, 2))


# ---- readers beside a busy writer ---------------------------------------------------------------

_BUSY_WRITER = """
path, seconds, progress, readers = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
rng = np.random.default_rng(7)
store = hmem.Store.open(path, lock_wait=10)
done = {"puts": 0, "evictions": 0, "compactions": 0, "queries": 0}
next_seed = 10_000

def enough():  # `seconds` of work at least, every kind of it, and every reader busy beside it
    return (time.monotonic() >= soak_until and done["puts"] >= 10 and done["evictions"] >= 3
            and done["compactions"] >= 3 and len(os.listdir(progress)) >= 2 * readers)

soak_until = time.monotonic() + seconds
give_up = soak_until + 300  # a hang guard: the test then fails on the figures
while not enough() and time.monotonic() < give_up:
    r = rng.random()
    if r < 0.45:
        n = int(rng.integers(1, 4))
        store.put_many([entry(s) for s in range(next_seed, next_seed + n)])
        next_seed += n
        store.flush()
        done["puts"] += 1
    elif r < 0.6:
        x = int(rng.integers(1, 60))
        store.query(kv(x)[0], x % 3, 2)
        done["queries"] += 1
    elif r < 0.8:
        live = store.stats().entries
        store.evict(max(20, live - int(rng.integers(1, 6))))
        done["evictions"] += 1
    else:
        store.compact()
        done["compactions"] += 1
store.close()
print(json.dumps(["done", done, next_seed]), flush=True)
"""

_READER = """
path, stop, seed, progress = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(seed)
out = {"opens": 0, "queries": 0, "results": 0, "wrong": 0, "refused": {}, "messages": [], "final": 0}

def check(results):
    for r in results:
        s = int(r.importance)
        k, v = kv(s)
        if (r.layer_idx != s % 3 or r.n_tokens != len(k) or r.keys.tobytes() != k.tobytes()
                or r.values.tobytes() != v.tobytes()):
            out["wrong"] += 1
            print(json.dumps(["wrong", r.entry_id, s]), flush=True)
    out["results"] += len(results)

def one_query(store):
    x = int(rng.integers(1, 12_000)) if rng.random() < 0.5 else int(rng.integers(1, 60))
    return store.query(kv(x)[0], x % 3, int(rng.integers(1, 6)), rerank=bool(rng.random() < 0.5))

while not os.path.exists(stop):
    try:
        store = hmem.Store.open(path, read_only=True)
        out["opens"] += 1
        with store:
            for _ in range(int(rng.integers(5, 40))):
                check(one_query(store))
                out["queries"] += 1
                if out["queries"] in (1, 20):  # querying; then busy enough for the test's count
                    open(os.path.join(progress, f"reader-{seed}-{out['queries']}"), "w").close()
    except (hmem.StoreChangedError, hmem.CorruptStoreError) as exc:
        name = type(exc).__name__
        out["refused"][name] = out["refused"].get(name, 0) + 1
        if len(out["messages"]) < 5 and str(exc) not in out["messages"]:
            out["messages"].append(str(exc))
# the writer is gone: a fresh open answers every query
with hmem.Store.open(path, read_only=True) as store:
    for _ in range(30):
        check(one_query(store))
        out["final"] += 1
print(json.dumps(["summary", out]), flush=True)
"""


@pytest.mark.stress
def test_readers_never_get_wrong_kv_while_a_writer_puts_evicts_and_compacts(tmp_path, procs):
    path = tmp_path / "s"
    make_store(path, seeds=range(1, 61), max_open_shards=2)  # few maps: readers reopen shards often
    seconds = _stress_seconds(8.0)
    stop, progress = tmp_path / "stop", tmp_path / "progress"
    progress.mkdir()
    readers = [procs.python(_READER, path, stop, seed, progress, name="reader") for seed in range(3)]
    # the readers are querying before the writer starts
    deadline = time.monotonic() + HANG_GUARD
    while len(list(progress.glob("reader-*-1"))) < len(readers):
        assert time.monotonic() < deadline and all(r.poll() is None for r in readers), "a reader never queried"
        time.sleep(0.01)
    # the writer works until each reader has made its 20 queries beside it (files in `progress`)
    writer = procs.python(_BUSY_WRITER, path, seconds, progress, len(readers), name="writer")
    code, out, err = finish(writer, timeout=seconds + 300 + HANG_GUARD)
    assert code == 0, err
    _, done, _ = json.loads(out.splitlines()[-1])
    stop.touch()
    totals = {"queries": 0, "results": 0, "refused": {}, "final": 0, "opens": 0}
    messages = []
    for reader in readers:
        code, out, err = finish(reader)
        assert code == 0, err
        assert '["wrong"' not in out, out
        ((_, summary),) = [json.loads(line) for line in out.splitlines()]
        assert summary["wrong"] == 0
        assert summary["queries"] >= 20, summary
        assert summary["final"] == 30
        for key in ("queries", "results", "final", "opens"):
            totals[key] += summary[key]
        for name, count in summary["refused"].items():
            totals["refused"][name] = totals["refused"].get(name, 0) + count
        messages += summary["messages"]
    for message in messages:  # a refusal says what happened and what to do
        assert "(" in message and ("open" in message or "verify" in message), message
    assert done["compactions"] >= 3 and done["evictions"] >= 3 and done["puts"] >= 10, done
    Store.open(path).close()
    assert hmem.verify(path, full=True).ok
    _report(
        "concurrency",
        "readers beside a writer",
        writer=done,
        readers=len(readers),
        **totals,
        sample_messages=messages[:3],
    )
