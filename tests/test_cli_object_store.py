"""Stores on object storage (s3://bucket/prefix) end to end, against the
local S3 server of tests/conftest.py (moto: real HTTP, real conditional
writes):

- every command of the command line on an s3:// store, in real processes;
- two writers racing for the lease (threads released together; a process
  holding the store while `hmem put` tries);
- a writer killed between its uploads and its manifest commit, and just
  after the commit (named crash points): readers see the old state or the
  new one whole, the uncommitted uploads are reported as orphans and
  compaction removes them;
- a writer SIGKILLed at random moments while it loops put + flush: every
  state a reader sees is a committed prefix of what was put.

Entries describe themselves (importance = seed, K/V from the seed), so any
entry found in a store can be checked bit for bit.  Everything goes through
the command line and the public API; where a test needs to know which
objects a commit names it reads manifest.json itself (the documented format,
docs/format.md), never the Store's private state.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

# subprocesses import the installed hmem (with its compiled kernels), not the checkout
OUTSIDE_CHECKOUT = tempfile.gettempdir()

D = 32  # embed_dim of the command-line store
HDC = 256
EMBED = 16  # embed_dim of the library stores
CRASH_EXIT = 86  # what a process passing the crash point named by HMEM_CRASH_AT exits with
HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)
# The writers here take a lease far longer than any test runs, so that no
# stall of a busy machine makes one lose it; the test ends a dead writer's
# lease itself (expire_lease) rather than wait it out.
LONG_LEASE = 3600


# ---- entries that describe themselves ------------------------------------------------


def kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    n = 1 + seed % 3
    return (r.standard_normal((n, EMBED)).astype(np.float32), r.standard_normal((n, EMBED)).astype(np.float32))


def put_seed(store, seed: int) -> int:
    keys, values = kv(seed)
    return store.put(keys, values, seed % 3, float(seed))


# the same code in helper processes
_KV_SRC = f"import numpy as np\n\nEMBED = {EMBED}\n\n{inspect.getsource(kv)}\n\n{inspect.getsource(put_seed)}"


def contents(url: str) -> dict[int, tuple[int, bytes, bytes]]:
    """What a fresh reader sees: {entry id: (seed, keys bytes, values bytes)}."""
    with hmem.Store.open(url, read_only=True) as reader:
        return snapshot(reader)


def snapshot(store) -> dict[int, tuple[int, bytes, bytes]]:
    out = {}
    for entry_id in store.entry_ids():
        got = store.get(entry_id)
        out[entry_id] = (int(got.info.importance), got.keys.tobytes(), got.values.tobytes())
    return out


def assert_self_described(state: dict[int, tuple[int, bytes, bytes]]) -> list[int]:
    """Every entry holds exactly the K/V put for its seed; returns the seeds in id order."""
    for entry_id, (seed, keys, values) in state.items():
        want_k, want_v = kv(seed)
        assert keys == want_k.tobytes() and values == want_v.tobytes(), f"entry {entry_id} (seed {seed}) differs"
    return [state[i][0] for i in sorted(state)]


def prefix_of(url: str) -> str:
    return url.split("/", 3)[3]


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment (the AWS variables and HMEM_CACHE_DIR that s3_env
    set included), without anything that changes hmem's output or crashes it."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "HMEM_STORE", "HMEM_DEBUG", "HMEM_CRASH_AT")}
    env.update(NO_COLOR="1", COLUMNS="200", **extra)
    return env


def expire_lease(s3_server, url: str) -> None:
    """The lease a dead writer left runs out now: its expiry is moved into
    the past, as the time passing would (docs/format.md, "The writer's
    lease"), so that the next writer takes the store over at once."""
    lease = json.loads(s3_server.objects(prefix_of(url))["lease.json"])
    s3_server.put_object(prefix_of(url), "lease.json", json.dumps({**lease, "expires": 0}).encode())


def readline(proc: subprocess.Popen) -> str:
    """The process's next line of output ("" at its end).  A process that
    says nothing for HANG_GUARD seconds is killed: a hang guard only."""
    guard = threading.Timer(HANG_GUARD, proc.kill)
    guard.start()
    try:
        return proc.stdout.readline()
    finally:
        guard.cancel()


def python(code: str, *args: str, env: dict | None = None, timeout: float = HANG_GUARD) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env or clean_env(),
        capture_output=True,
        cwd=OUTSIDE_CHECKOUT,
        text=True,
        timeout=timeout,
    )


def in_process(*args):
    """One command run in this process (typer's CliRunner): for the cheap
    checks, where a process of its own would only cost time."""
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1", "HMEM_STORE": None})


@pytest.fixture
def hmem_cli(tmp_path, s3_env):
    """``hmem_cli(*args, code=0)``: one run of `python -m hmem` in tmp_path
    (the installed package, not the source tree), its exit code checked;
    ``hmem_cli.many((args, code), ...)``: several runs at once (commands
    that only read), their results in order."""

    def start(args) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "hmem", *map(str, args)],
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finish(proc: subprocess.Popen, args, code: int) -> subprocess.CompletedProcess:
        out, err = proc.communicate(timeout=HANG_GUARD)
        assert proc.returncode == code, (args, proc.returncode, out, err)
        assert "Traceback" not in err and "\x1b[" not in out + err
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    def run(*args, code: int = 0) -> subprocess.CompletedProcess:
        return finish(start(args), args, code)

    def many(*runs: tuple[tuple, int]) -> list[subprocess.CompletedProcess]:
        procs = [start(args) for args, _ in runs]
        return [finish(proc, args, code) for proc, (args, code) in zip(procs, runs)]

    run.many = many
    return run


# ---- 1. the command set on s3:// ---------------------------------------------------------


@pytest.mark.stress
def test_every_command_on_an_s3_store(tmp_path, s3_url, s3_server, hmem_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # (commands that only read run several at a time: each process mostly imports)
    J = "--json"

    def doc(proc: subprocess.CompletedProcess) -> dict:
        return json.loads(proc.stdout)

    def jsonl(proc: subprocess.CompletedProcess) -> list[dict]:
        return [json.loads(line) for line in proc.stdout.splitlines()]

    # six dumps, two layers; importance i + 1, so the eviction order is known
    rng = np.random.default_rng(3)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    inputs = {}
    for i in range(6):
        keys, values = rng.standard_normal((2, 8, D)).astype(np.float32)
        inputs[f"c{i}.safetensors"] = keys, values
        save_file(
            {"keys": keys, "values": values},
            dumps / f"c{i}.safetensors",
            metadata={"layer": str(i % 2), "importance": str(i + 1)},
        )
    wanted_keys = inputs["c4.safetensors"][0]
    np.save(tmp_path / "probe.npy", wanted_keys[:5] + 0.1 * rng.standard_normal((5, D)))

    version = in_process("--version")
    assert version.exit_code == 0 and f"object-store format {hmem.OBJECT_FORMAT_VERSION}" in version.stdout
    created = doc(hmem_cli("init", s3_url, "--embed-dim", D, "--hdc-dim", HDC, "--shard-max", "8KiB", J))
    assert created["path"] == s3_url and created["config"]["embed_dim"] == D
    assert {"manifest.json", "lease.json"} <= set(s3_server.objects(prefix_of(s3_url)))

    put = doc(hmem_cli("put", s3_url, "dumps", J))
    assert (put["files_imported"], put["entries_added"], put["files_skipped"]) == (6, 6, 0)
    id_of = {f["file"].split("/")[-1]: f["entry_ids"][0] for f in put["imported"]}
    assert sorted(id_of.values()) == list(range(1, 7))
    again = doc(hmem_cli("put", s3_url, "dumps", J))
    assert (again["entries_added"], again["files_already_imported"], again["bytes_written"]) == (0, 6, 0)
    taken = in_process("init", s3_url, "--embed-dim", D)
    assert taken.exit_code == ExitCode.FAILURE and "already holds an hmem store" in taken.stderr  # one per URL

    wanted = id_of["c4.safetensors"]
    listed, shown, _, found, human, stats, quick, full = hmem_cli.many(
        (("ls", s3_url, "--jsonl"), 0),
        (("show", s3_url, wanted, J), 0),
        (("export", s3_url, *id_of.values(), "-o", "all.safetensors"), 0),
        (("query", s3_url, "--query", "probe.npy", "--layer", 0, "--top-k", 3, J), 0),
        (("stats", s3_url), 0),
        (("stats", s3_url, J), 0),
        (("verify", s3_url), 0),
        (("verify", s3_url, "--full", J), 0),
    )

    listed = jsonl(listed)
    assert [e["entry_id"] for e in listed] == list(range(1, 7))
    assert {e["entry_id"]: e["layer"] for e in listed} == {id_of[f"c{i}.safetensors"]: i % 2 for i in range(6)}
    assert len({e["shard"] for e in listed}) >= 3  # 8 KiB shards: two entries each

    shown = doc(shown)
    assert shown["meta"]["source"] == "c4.safetensors" and shown["importance"] == 5.0
    assert shown["tensors"]["keys"]["shape"] == [8, D]

    def exported_exactly(ids_by_file: dict[str, int], out: str) -> None:
        got = load_file(tmp_path / out)
        assert set(got) == {f"{kind}_{i}" for i in ids_by_file.values() for kind in "kv"}
        for name, entry_id in ids_by_file.items():
            assert got[f"k_{entry_id}"].tobytes() == inputs[name][0].tobytes()
            assert got[f"v_{entry_id}"].tobytes() == inputs[name][1].tobytes()

    exported_exactly(id_of, "all.safetensors")

    # the query finds the entry its (noisy) keys came from
    results = doc(found)["results"]
    assert results[0]["entry_id"] == wanted and len(results) == 3 and {r["layer"] for r in results} == {0}

    assert s3_url in human.stdout and "object store" in human.stdout and "requests" in human.stdout
    assert "health: ok" in human.stdout
    stats = doc(stats)
    assert (stats["entries"], stats["evicted"], stats["path"]) == (6, 0, s3_url)
    remote = stats["remote"]
    assert remote["url"] == s3_url and remote["endpoint"] == s3_server.endpoint
    assert remote["requests"] >= remote["gets"] >= 1 and remote["bytes_fetched"] > 0
    assert stats["bytes_on_disk"] > sum(s["bytes"] for s in stats["shards"])
    objects = s3_server.objects(prefix_of(s3_url))
    mf = json.loads(objects["manifest.json"])
    named = ["manifest.json", *(s["key"] for s in mf["state"]), *(s["key"] for s in mf["shards"].values())]
    assert remote["object_bytes"] == sum(len(objects[key]) for key in named)  # what the server holds

    assert quick.stdout.startswith("ok: quick check of 6 records")
    full = doc(full)["verify"]
    assert (full["ok"], full["findings"], full["records"], full["full"]) == (True, [], 6, True)
    assert full["tensors_checked"] >= 12 and full["path"] == s3_url

    # evict the two least important, delete one more by id, compact
    evicted = doc(hmem_cli("evict", s3_url, "--target", 4, "--yes", J))
    assert evicted["evicted"] == 2
    assert sorted(evicted["entry_ids"]) == sorted([id_of["c0.safetensors"], id_of["c1.safetensors"]])
    removed = doc(hmem_cli("rm", s3_url, id_of["c5.safetensors"], "--yes", J))
    assert (removed["deleted"], removed["store_entries"]) == (1, 3)
    assert in_process("show", s3_url, id_of["c5.safetensors"]).exit_code == ExitCode.FAILURE

    compacted = doc(hmem_cli("compact", s3_url, J))
    assert compacted["performed"] is True and compacted["records_dropped"] == 3 and compacted["bytes_freed"] > 0
    after, again = hmem_cli.many(
        (("stats", s3_url, J), 0),
        (("query", s3_url, "--query", "probe.npy", "--layer", 0, "--top-k", 1, "--export", "hit.safetensors", J), 0),
    )
    after = doc(after)
    assert (after["entries"], after["evicted"], after["reclaimable_bytes"]) == (3, 0, 0)
    assert after["bytes_on_disk"] < stats["bytes_on_disk"]  # the objects the manifest names: 3 entries, not 6
    assert doc(again)["results"][0]["entry_id"] == wanted
    exported_exactly({"c4.safetensors": wanted}, "hit.safetensors")
    kept = {name: id_of[name] for name in ("c2.safetensors", "c3.safetensors", "c4.safetensors")}
    with hmem.Store.open(s3_url, read_only=True) as reader:
        shard_of = {info.entry_id: info.shard_idx for info in reader.entries()}
    assert sorted(shard_of) == sorted(kept.values())  # ids do not change

    # lose the shard object of one entry: verify finds it, repair keeps the rest
    manifest = json.loads(s3_server.objects(prefix_of(s3_url))["manifest.json"])
    shards = json.loads(manifest["index"])["shards"]  # the local format's index.json (docs/format.md)
    victim = shard_of[kept["c2.safetensors"]]
    lost = {i for i, shard in shard_of.items() if shard == victim}
    assert 0 < len(lost) < 3
    s3_server.delete_object(prefix_of(s3_url), f"shards/{shards[victim]['uid']}.safetensors")
    damaged = doc(hmem_cli("verify", s3_url, J, code=ExitCode.PROBLEMS_FOUND))["verify"]
    assert "remote.missing" in {f["code"] for f in damaged["findings"] if f["severity"] == "error"}
    repaired = doc(hmem_cli("verify", s3_url, "--repair", "--yes", J))
    assert repaired["repair"]["entries_kept"] == 3 - len(lost)
    assert {d[0] for d in repaired["repair"]["dropped"] if d[0] is not None} == lost
    assert repaired["after"]["ok"] is True
    clean = hmem.verify(s3_url, full=True)
    assert (clean.ok, clean.findings, clean.records) == (True, (), 3 - len(lost))
    survivors = {name: i for name, i in kept.items() if i not in lost}
    with hmem.Store.open(s3_url, read_only=True) as reader:
        assert reader.entry_ids() == sorted(survivors.values())
        for name, entry_id in survivors.items():
            got = reader.get(entry_id)
            assert got.keys.tobytes() == inputs[name][0].tobytes()
            assert got.values.tobytes() == inputs[name][1].tobytes()
    gone = in_process("export", s3_url, *sorted(lost), "-o", "gone.safetensors")
    assert gone.exit_code == ExitCode.FAILURE and not (tmp_path / "gone.safetensors").exists()


# ---- 2. two writers --------------------------------------------------------------------


def test_two_threads_race_for_the_lease(s3_url):
    hmem.Store.create(s3_url, embed_dim=EMBED, hdc_dim=HDC).close()
    for _ in range(3):
        barrier = threading.Barrier(2, timeout=HANG_GUARD)
        got: list = [None, None]

        def open_writer(n: int) -> None:
            try:
                barrier.wait()
                got[n] = hmem.Store.open(s3_url)
            except Exception as exc:
                got[n] = exc

        threads = [threading.Thread(target=open_writer, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=HANG_GUARD)
        winners = [g for g in got if isinstance(g, hmem.Store)]
        losers = [g for g in got if isinstance(g, hmem.StoreLockedError)]
        assert len(winners) == 1 and len(losers) == 1, got
        assert str(os.getpid()) in losers[0].message
        with winners[0] as writer:  # the winner writes; closing gives the lease back at once
            put_seed(writer, len(writer.entry_ids()) + 1)
    seeds = assert_self_described(contents(s3_url))
    assert seeds == [1, 2, 3]


HOLDER = """
import sys, hmem
store = hmem.Store.open(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
store.close()
"""


@pytest.mark.stress
def test_put_while_another_process_holds_the_store(tmp_path, s3_url, s3_server, hmem_cli):
    with hmem.Store.create(s3_url, embed_dim=D, hdc_dim=HDC) as store:
        store.put(np.ones((2, D), np.float32), np.ones((2, D), np.float32))
    save_file(
        {"keys": np.full((4, D), 2, np.float32), "values": np.full((4, D), 3, np.float32)}, tmp_path / "new.safetensors"
    )
    before = contents(s3_url)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, s3_url],
        stdin=subprocess.PIPE,
        cwd=OUTSIDE_CHECKOUT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert readline(holder).strip() == "ready", holder.stderr.read()
        objects = {k: v for k, v in s3_server.objects(prefix_of(s3_url)).items() if k != "lease.json"}
        refused = hmem_cli("put", s3_url, "new.safetensors", code=ExitCode.LOCKED)
        line = refused.stderr.strip()
        assert line.startswith("error: ") and "locked" in line, line
        assert f"pid {holder.pid} on {socket.gethostname()}" in line, line  # the holder, by host and pid
        # nothing stored: the same entries, the same objects (the holder's lease aside)
        assert contents(s3_url) == before
        assert {k: v for k, v in s3_server.objects(prefix_of(s3_url)).items() if k != "lease.json"} == objects
    finally:
        out, err = holder.communicate("\n", timeout=HANG_GUARD)  # the holder closes and exits normally
    assert holder.returncode == 0, err
    done = json.loads(hmem_cli("put", s3_url, "new.safetensors", "--json").stdout)
    assert done["entries_added"] == 1
    (new_id,) = done["imported"][0]["entry_ids"]
    with hmem.Store.open(s3_url, read_only=True) as reader:
        assert reader.entry_ids() == [*before, new_id]
        assert np.array_equal(reader.get(new_id).values, np.full((4, D), 3, np.float32))


# ---- 3. a writer killed at a crash point of its publish --------------------------------

CRASH_WRITER = (
    _KV_SRC
    + f"""
import os, sys, hmem
store = hmem.Store.open(sys.argv[1], storage_options={{"lease_seconds": {LONG_LEASE}}})
for seed in range(4, 7):
    put_seed(store, seed)
# A put may commit (and publish) an id reservation of its own: arm the crash
# point only now, so that the flush's publish is the one it stops.
os.environ["HMEM_CRASH_AT"] = sys.argv[2]
print("flushing", os.getpid(), flush=True)
store.flush()
print("survived", flush=True)
"""
)


def _three_entries(url: str) -> dict:
    with hmem.Store.create(url, embed_dim=EMBED, hdc_dim=HDC) as store:
        for seed in range(1, 4):
            put_seed(store, seed)
    state = contents(url)
    assert assert_self_described(state) == [1, 2, 3]
    return state


def _named_by_manifest(objects: dict[str, bytes]) -> set[str]:
    """The objects manifest.json names (docs/format.md, "Stores on object storage")."""
    mf = json.loads(objects["manifest.json"])
    return {
        "manifest.json",
        "lease.json",
        *(s["key"] for s in mf["state"]),
        *(s["key"] for s in mf["shards"].values()),
        *(r["key"] for r in mf["retired"]),
    }


@pytest.mark.stress
def test_writer_killed_between_uploads_and_commit(s3_url, s3_server):
    before = _three_entries(s3_url)
    crashed = python(CRASH_WRITER, s3_url, "remote.objects_written")
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    word, pid = crashed.stdout.split()
    assert word == "flushing"

    # the crashed writer's lease stands until it expires
    with pytest.raises(hmem.StoreLockedError, match=f"pid {pid} "):
        hmem.Store.open(s3_url)

    # readers see exactly the state before
    assert contents(s3_url) == before
    # the uploads no commit names are orphans: warnings, no error
    objects = s3_server.objects(prefix_of(s3_url))
    unnamed = set(objects) - _named_by_manifest(objects)
    assert {key.split("/")[0] for key in unnamed} == {"shards", "state"}  # the new shard and state object
    report = hmem.verify(s3_url, full=True)
    assert {(f.code, f.severity) for f in report.findings} == {("remote.orphan", "warning")}
    assert {f.file for f in report.findings} == unnamed

    # once the lease expired, a new writer takes over
    expire_lease(s3_server, s3_url)
    with hmem.Store.open(s3_url, lock_wait=HANG_GUARD) as writer:
        assert snapshot(writer) == before
        put_seed(writer, 7)
        writer.flush()
        assert contents(s3_url).keys() == {*before, max(writer.entry_ids())}
        # orphans are still there; compaction removes them
        assert {f.code for f in hmem.verify(s3_url).findings} == {"remote.orphan"}
        writer.compact()
    assert hmem.verify(s3_url, full=True).findings == ()
    assert not unnamed & set(s3_server.objects(prefix_of(s3_url)))
    after = contents(s3_url)
    assert assert_self_described(after) == [1, 2, 3, 7]
    assert {i: after[i] for i in before} == before


def test_writer_killed_just_after_its_commit(s3_url):
    before = _three_entries(s3_url)
    crashed = python(CRASH_WRITER, s3_url, "remote.committed")
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    assert crashed.stdout.split()[0] == "flushing"
    after = contents(s3_url)
    assert assert_self_described(after) == [1, 2, 3, 4, 5, 6]  # the new state, whole
    assert {i: after[i] for i in before} == before
    assert hmem.verify(s3_url, full=True).findings == ()


def test_hmem_compact_removes_orphans_of_an_otherwise_compact_store(s3_url, s3_server):
    with hmem.Store.create(s3_url, embed_dim=EMBED, hdc_dim=HDC) as store:
        put_seed(store, 1)
    # what a writer killed after uploading a shard, before its commit, leaves behind
    stray = f"shards/{'0' * 32}.safetensors"
    s3_server.put_object(prefix_of(s3_url), stray, b"uploaded, never committed")
    assert [(f.code, f.file) for f in hmem.verify(s3_url).findings] == [("remote.orphan", stray)]
    assert in_process("compact", s3_url).exit_code == 0
    assert hmem.verify(s3_url).findings == ()
    assert stray not in s3_server.objects(prefix_of(s3_url))


# ---- 4. a writer SIGKILLed at random moments --------------------------------------------

LOOP_WRITER = (
    _KV_SRC
    + f"""
import sys, hmem
store = hmem.Store.open(sys.argv[1], lock_wait={HANG_GUARD}, storage_options={{"lease_seconds": {LONG_LEASE}}})
seed = len(store.entry_ids())
print("ready", seed, flush=True)
while True:
    seed += 1
    put_seed(store, seed)
    store.flush()
    print("flushed", seed, flush=True)
"""
)


@pytest.mark.stress
def test_writer_sigkilled_at_random_moments(s3_url, s3_server):
    """Each round's writer is killed at a random moment: after its n-th
    acknowledged flush (n random; one at least in the first round, so that
    something is committed), a random fraction of a second later."""
    rounds = int(os.environ.get("HMEM_STRESS_ROUNDS", 3))
    kill_seed = os.environ.get("HMEM_STRESS_SEED", str(time.time_ns()))  # of the kill moments
    rand = random.Random(kill_seed)
    hmem.Store.create(s3_url, embed_dim=EMBED, hdc_dim=HDC).close()
    committed = 0
    kills: list = [("HMEM_STRESS_SEED", kill_seed)]  # and (flushes, delay, last acknowledged seed) per kill
    with hmem.Store.open(s3_url, read_only=True) as follower:  # one reader kept open across the kills
        for round_no in range(rounds):
            writer = subprocess.Popen(
                [sys.executable, "-c", LOOP_WRITER, s3_url],
                stdout=subprocess.PIPE,
                cwd=OUTSIDE_CHECKOUT,
                stderr=subprocess.PIPE,
                text=True,
                env=clean_env(),
            )
            flushes, delay, seen = rand.randint(0 if round_no else 1, 2), rand.uniform(0.0, 0.5), []
            try:
                ready = readline(writer).split()
                assert ready == ["ready", str(committed)], (ready, writer.stderr.read() if not ready else "")
                while len(seen) < flushes:
                    line = readline(writer)
                    assert line.startswith("flushed"), (line, kills)
                    seen.append(line)
                time.sleep(delay)  # where the kill lands: anywhere in the loop
            finally:
                writer.send_signal(signal.SIGKILL)
                writer.wait(timeout=HANG_GUARD)
                out, err = "".join(seen) + writer.stdout.read(), writer.stderr.read()
                writer.stdout.close()
                writer.stderr.close()
            assert writer.returncode == -signal.SIGKILL, err
            acknowledged = [int(line.split()[1]) for line in out.splitlines() if line.startswith("flushed")]
            assert acknowledged == list(range(committed + 1, committed + 1 + len(acknowledged))), kills
            last_ack = acknowledged[-1] if acknowledged else committed
            kills.append((flushes, round(delay, 3), last_ack))

            state = contents(s3_url)
            seeds = assert_self_described(state)
            # a committed prefix: every acknowledged flush, at most the one put in flight beyond
            assert seeds == list(range(1, len(seeds) + 1)), kills
            assert last_ack <= len(seeds) <= last_ack + 1, kills
            assert sorted(state) == sorted(state, key=lambda i: state[i][0]), kills  # ids in put order
            report = hmem.verify(s3_url)
            assert all(f.code == "remote.orphan" for f in report.findings), (kills, report.findings)
            follower.refresh()
            assert snapshot(follower) == state, kills
            committed = len(seeds)
            expire_lease(s3_server, s3_url)  # the killed writer's: the next one takes over at once
    assert committed > 0, kills  # the loop got going
    with hmem.Store.open(s3_url, lock_wait=HANG_GUARD) as writer:
        writer.compact()
    assert hmem.verify(s3_url, full=True).findings == ()
    assert assert_self_described(contents(s3_url)) == list(range(1, committed + 1))
    # the working copies of the killed writers went with the next store opened (and ours when closed)
    assert not list(Path(os.environ["HMEM_CACHE_DIR"]).glob("remote-*"))
