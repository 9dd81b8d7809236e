"""Crash safety and disk faults of every mutating path (docs/reliability.md, docs/format.md
"The write protocol"): named crash points, a crash before every primitive I/O
operation, a SIGKILL loop, and injected ENOSPC/EIO faults.

How the crash tests know the right answer.  Each scenario is a piece of code
(put with shard rollover, evict and compact, puts past max_disk_bytes, repair
of a damaged shard, repair of a lost index.json) run by a helper process.  A
*reference* run does the work without crashing and records, in order: a copy
of the store directory after every commit of index.json, every pass through
a crash point and every primitive I/O operation (with how many commits came
before it), and every acknowledgement (a flush that returned).  A crashed run
is the same code in a forked child that ends with os._exit at one crash point
(HMEM_CRASH_AT=name:n) or just before the N-th I/O operation.  Its store must
then hold exactly the state of the reference copy for the commits made before
that moment, read-only before any writer touches it, and again after a
writer opened it; hmem.verify(full=True) must be clean after that open, and
the store must keep working (a new entry gets an id above every id handed
out before the crash).

Timestamps (time.time_ns() of each put) and shard uids differ between runs
and are left out of the comparison; everything else is compared, through
the public API: every live entry's metadata and K/V bytes (and its signature,
as a query with its own keys sees it), the count of evicted records, the
shard files and their entries.
"""

from __future__ import annotations

import ast
import errno
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hmem
from hmem import Store, _io
from hmem.formats import records as record_format

EMBED, HDC = 16, 256
HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)
SHARD_MAX = 3000  # two or three entries a shard: batches roll over mid-way


# Entries describe themselves: importance = seed, layer = seed % 3, and the
# K/V come from the seed, so any entry found in a store can be checked.
def kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    n = 1 + seed % 3
    return (r.standard_normal((n, EMBED)).astype(np.float32), r.standard_normal((n, EMBED)).astype(np.float32))


def entry(seed: int) -> tuple:
    k, v = kv(seed)
    return (k, v, seed % 3, float(seed))


_KV_SRC = inspect.getsource(kv) + "\n\n" + inspect.getsource(entry)  # the same code in helper processes


def _stress_rounds(default: int) -> int:
    return int(os.environ.get("HMEM_STRESS_ROUNDS", default))


def _long_run() -> bool:
    return "HMEM_STRESS_ROUNDS" in os.environ


# ---- what a store holds ------------------------------------------------------------------


def describe(store) -> dict:
    """Every live entry's metadata (no timestamp) and its signature as the
    best hit (id, similarity) for its own keys -- (its id, 1.0) while the
    stored signature is the one its keys give; the records' signature bytes
    are not public -- every live entry's K/V bytes (or the error reading
    them), the shards and the stats (evicted records counted)."""
    st = store.stats()
    rows, kvs = [], {}
    for info in store.entries():
        eid = info.entry_id
        try:
            got = store.get(eid)
            kvs[eid] = (got.keys.tobytes(), got.values.tobytes())
            (hit,) = store.query(got.keys, info.layer_idx, 1, rerank=False, count_access=False)
            own = (hit.entry_id, hit.similarity)
        except hmem.CorruptStoreError as exc:
            kvs[eid] = own = f"corrupt: {exc.message}"
        rows.append((eid, info.layer_idx, info.n_tokens, info.importance, info.access_count, info.shard_idx, own))
    sources = [(s.sha256, s.bytes, s.name, s.first_id, s.entries) for s in store.imported_sources()]
    return {
        "entries": st.entries,
        "evicted": st.evicted,
        "layers": st.layers,
        "shards": [(s.file, s.entries, s.dead_entries) for s in st.shards],
        "records": rows,
        "kv": kvs,
        "sources": sources,
    }


def still_open(store) -> bool:
    """Whether a Store object is still open (a closed one refuses every call)."""
    try:
        store.entry_ids()
    except hmem.StoreClosedError:
        return False
    return True


def state_of(path) -> dict:
    """What a reader sees; a store that does not open is described by the error."""
    try:
        with Store.open(path, read_only=True) as reader:
            return describe(reader)
    except hmem.HmemError as exc:
        return {"error": type(exc).__name__}


def files_of(path) -> dict[str, bytes]:
    """The bytes of a store's files, apart from temporary files and the lock."""
    return {
        p.name: p.read_bytes()
        for p in sorted(Path(path).iterdir())
        if p.is_file() and not p.name.startswith(_io.TEMP_PREFIX) and p.name != "lock"
    }


def assert_committed_files_untouched(path, before: dict[str, bytes], what: str = "") -> None:
    """Every file of the old state still holds its bytes (entries.bin may
    have an uncommitted tail, which readers ignore)."""
    now = files_of(path)
    for name, data in before.items():
        assert name in now, f"{what}: {name} is gone"
        got = now[name][: len(data)] if name in ("entries.bin", "sources.jsonl") else now[name]
        assert got == data, f"{what}: {name} changed"


def assert_entries_are_right(state: dict) -> None:
    """Every live entry's K/V is what its seed (its importance) says, and its
    signature is the one its keys give."""
    for row in state["records"]:
        eid, layer, n_tokens, importance, _, _, own = row
        seed = int(importance)
        k, v = kv(seed)
        assert (layer, n_tokens) == (seed % 3, len(k)), row
        got = state["kv"][eid]
        assert not isinstance(got, str), (eid, got)
        assert got == (k.tobytes(), v.tobytes()), f"entry {eid}: wrong K/V"
        assert own == (eid, 1.0), f"entry {eid}: its signature is not its keys' ({own})"


def assert_verifies(path, *, full: bool = True) -> None:
    report = hmem.verify(path, full=full)
    assert report.ok, [(f.code, f.file, f.message) for f in report.problems]


# ---- the stores the scenarios start from ----------------------------------------------


def _base_store(path: Path, **config) -> None:
    """12 entries over several shards, three flushes, some access counts."""
    config.setdefault("shard_max_bytes", SHARD_MAX)
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC, **config) as store:
        for seeds in (range(1, 6), range(6, 10), range(10, 13)):
            store.put_many([entry(s) for s in seeds])
            store.flush()
        for s in (2, 7, 7, 11):
            store.query(kv(s)[0], s % 3, 2)


def _evicted_store(path: Path) -> None:
    _base_store(path)
    with Store.open(path) as store:
        store.evict(8)


def _flip_tensor_byte(path: Path, entry_id: int, kind: str = "k") -> str:
    """Flip one byte in the middle of tensor `kind` of a live entry; returns the shard file."""
    with Store.open(path, read_only=True) as store:
        (info,) = [e for e in store.entries() if e.entry_id == entry_id]
        shard = store.stats().shards[info.shard_idx].file
    file = path / shard
    data = bytearray(file.read_bytes())
    length = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + length])[f"{kind}_{entry_id}"]["data_offsets"]
    data[8 + length + (begin + end) // 2] ^= 0x10
    file.write_bytes(bytes(data))
    return shard


def _damaged_tensor_store(path: Path) -> None:
    _evicted_store(path)
    with Store.open(path) as store:
        ids = store.put_many([entry(s) for s in (40, 41, 42, 43)])  # several shards again
    _flip_tensor_byte(path, ids[1])


def _lost_index_store(path: Path) -> None:
    _evicted_store(path)
    with Store.open(path) as store:
        store.put_many([entry(s) for s in (40, 41, 42, 43)])
    (path / "index.json").unlink()


def _spans_store(path: Path) -> None:
    """_base_store with span signatures: 3 spans of entries of 1 to 3 tokens."""
    _base_store(path, signatures_per_entry=4)


def _limited_store(path: Path) -> None:
    """A store with max_disk_bytes a little above what it holds (about 14.6 kB,
    and a batch of six entries takes about 6.5 kB): the scenario's second
    and third batches evict and compact on their own."""
    _base_store(path, max_disk_bytes=24_000)


# ---- the scenarios: code run by the helper process ------------------------------------------

SCENARIOS = {
    # put_many batches that seal shards part way, each followed by a flush;
    # access counts change in between (pending record updates)
    "put_rollover": dict(
        setup=_base_store,
        code="""
def scenario(path, ack, handed):
    s = hmem.Store.open(path)
    ids = s.put_many([entry(seed) for seed in range(101, 108)]); handed(ids)
    s.flush(); ack("A", ids)
    s.query(kv(103)[0], 103 % 3, 2)
    ids = s.put_many([entry(seed) for seed in range(201, 206)]); handed(ids)
    s.query(kv(5)[0], 5 % 3, 3)
    s.flush(); ack("B", ids)
    ids = s.put_many([entry(seed) for seed in range(301, 305)]); handed(ids)
    s.query(kv(7)[0], 7 % 3, 1)
    s.close(); ack("C", ids)
""",
        points={
            "lock.taken",
            "flush.shards_written",
            "flush.records_written",
            "flush.committed",
            "flush.updates_written",
        },
    ),
    # evict and compact twice, with puts in between: every evict/compact
    # crash point is passed more than once (NAME:n)
    "evict_compact": dict(
        setup=_base_store,
        code="""
def scenario(path, ack, handed):
    s = hmem.Store.open(path)
    s.query(kv(3)[0], 0, 2)
    s.evict(8); ack("evict1")
    s.compact(); ack("compact1")
    ids = s.put_many([entry(seed) for seed in range(401, 405)]); handed(ids)
    s.flush(); ack("put", ids)
    s.evict(6); ack("evict2")
    s.compact(); ack("compact2")
    s.close(); ack("close")
""",
        points={
            "lock.taken",
            "compact.shard_written",
            "evict.marked",
            "flush.shards_written",
            "flush.records_written",
            "flush.committed",
            "flush.updates_written",
            "compact.shards_written",
            "compact.records_written",
            "compact.committed",
            "compact.finished",
        },
    ),
    # a store with span signatures (longer records, [S, embed_dim] pooled
    # keys): puts that roll shards over, eviction and compaction
    "spans": dict(
        setup=_spans_store,
        code="""
def scenario(path, ack, handed):
    s = hmem.Store.open(path)
    ids = s.put_many([entry(seed) for seed in range(801, 808)]); handed(ids)
    s.flush(); ack("put", ids)
    s.query(kv(803)[0], 803 % 3, 2)
    s.evict(10); ack("evict")
    s.compact(min_dead_share=0.0); ack("compact")  # every evicted byte: the span records rewritten too
    s.close(); ack("close")
""",
        points={
            "lock.taken",
            "compact.shard_written",
            "flush.shards_written",
            "flush.records_written",
            "flush.committed",
            "flush.updates_written",
            "evict.marked",
            "compact.shards_written",
            "compact.records_written",
            "compact.committed",
            "compact.finished",
        },
    ),
    # deletes by id, one with an id that names nothing, then a put
    "delete": dict(
        setup=_base_store,
        code="""
def scenario(path, ack, handed):
    s = hmem.Store.open(path)
    plan = s.delete([2, 5, 7]); ack("delete1", plan.entry_ids)
    plan = s.delete([1, 999], missing_ok=True); ack("delete2", plan.entry_ids)
    ids = s.put_many([entry(seed) for seed in range(601, 603)]); handed(ids)
    s.close(); ack("close", ids)
""",
        points={
            "lock.taken",
            "delete.marked",
            "flush.shards_written",
            "flush.records_written",
            "flush.committed",
            "flush.updates_written",
        },
    ),
    # imports of K/V files: each file's entries and its record in the import
    # registry (sources.jsonl) are committed together; the second import
    # finds two of its files already imported
    "import": dict(
        setup=_base_store,
        code="""
def scenario(path, ack, handed):
    from safetensors.numpy import save_file
    src = path + "-files"
    os.makedirs(src, exist_ok=True)
    for seed in (701, 702, 703):
        k, v = kv(seed)
        save_file({"keys": k, "values": v}, f"{src}/f{seed}.safetensors")
    s = hmem.Store.open(path)
    def put(seeds):
        ids = []
        for seed in seeds:  # one file at a time: importance and layer from the seed, as entry(seed) has them
            report = hmem.import_files(s, [f"{src}/f{seed}.safetensors"], importance=seed, layer=seed % 3)
            ids += [i for f in report.files for i in f.entries]
        handed(ids)
        return ids
    ids = put([701, 702]); s.flush(); ack("import1", ids)
    ids = put([701, 702, 703]); s.close(); ack("import2", ids)
""",
        points={
            "lock.taken",
            "import.file",
            "flush.shards_written",
            "flush.records_written",
            "flush.committed",
            "flush.updates_written",
        },
    ),
    # puts past max_disk_bytes: each batch evicts the lowest-scored entries
    # and compacts before it is stored
    "put_limits": dict(
        setup=_limited_store,
        code="""
def scenario(path, ack, handed):
    s = hmem.Store.open(path)
    for batch in range(3):
        ids = s.put_many([entry(500 + 10 * batch + i) for i in range(6)]); handed(ids)
        s.flush(); ack(f"batch{batch}", ids)
    s.close(); ack("close")
""",
        points={
            "lock.taken",
            "flush.shards_written",
            "flush.records_written",
            "flush.committed",
            "flush.updates_written",
            "compact.shards_written",
            "compact.records_written",
            "compact.committed",
            "compact.finished",
        },
    ),
    # repair of a store with a flipped byte in one tensor
    "repair_tensor": dict(
        setup=_damaged_tensor_store,
        code="""
def scenario(path, ack, handed):
    report = hmem.repair(path)
    ack(report.action, [])
""",
        points={
            "lock.taken",
            "repair.shard_written",
            "repair.planned",
            "repair.shards_written",
            "repair.records_written",
            "repair.committed",
            "repair.finished",
        },
    ),
    # repair of a store whose index.json is lost (rebuilt from the shards)
    "repair_index": dict(
        setup=_lost_index_store,
        code="""
def scenario(path, ack, handed):
    report = hmem.repair(path)
    ack(report.action, [])
""",
        points={
            "lock.taken",
            "repair.shard_written",
            "repair.planned",
            "repair.shards_written",
            "repair.records_written",
            "repair.committed",
            "repair.finished",
        },
    ),
}

_RUNNER = r"""
import json, os, shutil, sys, traceback
import numpy as np
import hmem
from hmem import _io
from hmem.formats import manifest

EMBED = %(embed)d
%(kv_src)s
%(scenario)s

STATE = {"commits": 0, "ops": 0, "crash_op": 0, "out": sys.stdout, "log_ops": False}

def emit(*item):
    STATE["out"].write(json.dumps(item) + "\n")
    STATE["out"].flush()

def ack(label, ids=()):
    emit("ack", label, [int(i) for i in ids], STATE["commits"])

def handed(ids):
    emit("handed", [int(i) for i in ids])

def hook(op, file):
    STATE["ops"] += 1
    if STATE["ops"] == STATE["crash_op"]:
        os._exit(86)
    if STATE["log_ops"]:
        emit("op", STATE["ops"], op, os.path.basename(file), STATE["commits"])

_io.set_fault_hook(hook)
mode = sys.argv[1]
if mode == "reference":
    path, snapshots = sys.argv[2], sys.argv[3]
    real_write, real_point, passes = manifest.write, _io.crash_point, {}
    def write(root, mf):
        written = real_write(root, mf)
        STATE["commits"] += 1
        shutil.copytree(root, os.path.join(snapshots, str(STATE["commits"])))
        return written
    def point(name):
        passes[name] = passes.get(name, 0) + 1
        emit("pass", name, passes[name], STATE["commits"])
        real_point(name)
    manifest.write, _io.crash_point = write, point
    STATE["log_ops"] = True
    scenario(path, ack, handed)
    emit("done")
else:  # run every job of a list in a forked child that crashes where the job says
    jobs = json.load(open(sys.argv[2]))
    for job in jobs:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                if job["crash_at"]:
                    os.environ["HMEM_CRASH_AT"] = job["crash_at"]
                STATE["crash_op"] = job["crash_op"]
                STATE["out"] = open(job["dir"] + ".out", "w")
                scenario(job["dir"], ack, handed)
                emit("done")
            except BaseException:
                STATE["out"].write("ERROR " + json.dumps(traceback.format_exc()) + "\n")
                STATE["out"].flush()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        with open(job["dir"] + ".rc", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
"""

_CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _runner_file(tmp_path: Path, name: str) -> Path:
    code = _RUNNER % {"embed": EMBED, "kv_src": _KV_SRC, "scenario": textwrap.dedent(SCENARIOS[name]["code"])}
    file = tmp_path / f"run_{name}.py"
    file.write_text(code)
    return file


def _python(args: list, cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != _io.CRASH_ENV}
    full_env.update(_CHILD_ENV)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


class Reference:
    """The uncrashed run of a scenario: states after each commit, and the
    ordered events (crash point passes, I/O operations, acknowledgements)."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.name = name
        self.root = tmp_path / name
        self.root.mkdir()
        self.initial = self.root / "initial"
        SCENARIOS[name]["setup"](self.initial)
        self.initial_files = files_of(self.initial)
        self.runner = _runner_file(tmp_path, name)
        work, snapshots = self.root / "reference", self.root / "commits"
        shutil.copytree(self.initial, work)
        snapshots.mkdir()
        done = _python([self.runner, "reference", work, snapshots], cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        self.events = [json.loads(line) for line in done.stdout.splitlines()]
        assert self.events[-1] == ["done"]
        commits = len(list(snapshots.iterdir()))
        self.states = [state_of(self.initial)] + [state_of(snapshots / str(c)) for c in range(1, commits + 1)]
        self.final = state_of(work)
        assert self.final == self.states[-1]

    def passes(self) -> list[tuple[str, int, int, int]]:
        """(name, n, commits before, position in the event list) of every crash point pass."""
        return [(e[1], e[2], e[3], i) for i, e in enumerate(self.events) if e[0] == "pass"]

    def ops(self) -> list[tuple[int, str, str, int, int]]:
        return [(e[1], e[2], e[3], e[4], i) for i, e in enumerate(self.events) if e[0] == "op"]

    def acks_before(self, position: int) -> list:
        return [e for e in self.events[:position] if e[0] == "ack"]

    def expected_after_op(self, number: int) -> tuple[int, int]:
        """(commits on disk, event position) for a crash just before I/O operation `number`."""
        ops = self.ops()
        _, _, _, commits, position = ops[number - 1]
        # once index.json was renamed into place, its commit is on disk even
        # though the reference had not counted it yet (the directory fsync follows)
        renamed = any(
            c == commits and op == "rename" and name.startswith(_io.TEMP_PREFIX + "index.json")
            for n, op, name, c, _ in ops[: number - 1]
        )
        return commits + (1 if renamed else 0), position

    def run_jobs(self, jobs: list[dict], tmp_path: Path) -> None:
        for job in jobs:
            shutil.copytree(self.initial, job["dir"])
        listing = self.root / f"jobs-{len(list(self.root.glob('jobs-*')))}.json"
        listing.write_text(json.dumps(jobs))
        done = _python([self.runner, "jobs", listing], cwd=tmp_path, timeout=600)
        assert done.returncode == 0, done.stderr


def _check_crashed(ref: Reference, job: dict, commits: int, position: int, what: str) -> None:
    """The checks every crashed run must pass (see the module docstring)."""
    path = Path(job["dir"])
    rc = int(Path(job["dir"] + ".rc").read_text())
    out = Path(job["dir"] + ".out").read_text().splitlines()
    assert rc == _io.CRASH_EXIT_CODE, f"{what}: exit {rc}\n" + "\n".join(out)
    events = [json.loads(line) for line in out]
    # acknowledged work is exactly what the reference acknowledged before this point
    assert [e[:3] for e in events if e[0] == "ack"] == [e[:3] for e in ref.acks_before(position)], what
    assert ["done"] not in events
    expected = ref.states[commits]
    # a reader first: it must cope with whatever the crash left
    assert state_of(path) == expected, f"{what}: expected the state after {commits} commit(s)"
    if commits == 0:
        assert_committed_files_untouched(path, ref.initial_files, what)
    handed = [i for e in events if e[0] == "handed" for i in e[1]]
    if ref.name.startswith("repair"):
        hmem.repair(path)  # the next repair finishes the job
        expected = ref.final
        assert state_of(path) == expected, what
        # every id the store ever had: its records, evicted ones too (on disk, in the format)
        doc = json.loads((path / "index.json").read_text())
        handed = record_format.read(path / "entries.bin", doc["record_count"], HDC // 8)["entry_id"].tolist()
        assert set(handed) >= {row[0] for row in expected["records"]}
    else:
        with Store.open(path) as store:  # a writer finishes what the commit lists and tidies
            assert describe(store) == expected, what
    assert_verifies(path)
    assert state_of(path) == expected, what
    assert_entries_are_right(expected)
    with Store.open(path) as store:  # and the store keeps working
        k, v = kv(999)
        eid = store.put(k, v, layer_idx=999 % 3, importance=999.0)
        assert eid > max(handed, default=0), f"{what}: id {eid} handed out again"
        store.flush()
        (hit,) = [h for h in store.query(k, 999 % 3, 50, rerank=False, count_access=False) if h.entry_id == eid]
        assert hit.keys.tobytes() == k.tobytes() and hit.values.tobytes() == v.tobytes()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The reference run of every scenario, made once."""
    made: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in made:
            made[name] = Reference(tmp_path_factory.mktemp(f"ref-{name}"), name)
        return made[name]

    return get


# ---- 1. named crash points, every pass ----------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.stress
def test_a_crash_at_every_pass_of_every_crash_point_leaves_the_old_or_the_new_state(name, references, tmp_path):
    ref = references(name)
    passes = ref.passes()
    # the scenario passes the crash points it claims (the coverage test relies on it)
    assert {p for p, _, _, _ in passes} == SCENARIOS[name]["points"]
    if name == "put_rollover":
        new_shards = len(ref.states[-1]["shards"]) - len(ref.states[0]["shards"])
        assert new_shards >= 4  # batches of several entries sealed shards part way
    if name == "repair_tensor":
        assert any(isinstance(v, str) for v in ref.states[0]["kv"].values())  # damaged before
        assert not any(isinstance(v, str) for v in ref.final["kv"].values())
        assert ref.final["entries"] == ref.states[0]["entries"] - 1
    if name == "repair_index":
        assert ref.states[0] == {"error": "NotAStoreError"} and ref.final["entries"] > 0
    jobs = [
        {"dir": str(tmp_path / f"{point}-{n}"), "crash_at": f"{point}:{n}", "crash_op": 0} for point, n, _, _ in passes
    ]
    ref.run_jobs(jobs, tmp_path)
    outcomes = {"before_commit": 0, "after_commit": 0}
    for job, (point, n, commits, position) in zip(jobs, passes):
        # the state of the commits made before the crash: a point before a
        # step's commit leaves the state before it, a point after it the new one
        _check_crashed(ref, job, commits, position, f"{name} at {point}:{n}")
        after = point.rsplit(".", 1)[1] in ("committed", "finished", "updates_written")
        outcomes["after_commit" if after else "before_commit"] += 1
    assert all(outcomes.values())
    _report("crash points", name, passes=len(passes), names=sorted(SCENARIOS[name]["points"]), **outcomes)


def _crash_point_names_in_source() -> set[str]:
    """Every crash point name the library can pass, from its syntax tree:
    crash_point("name") calls, and crash_point(f"{crash_prefix}.step") calls
    times every crash_prefix="..." passed to a function."""
    literal, suffixes, prefixes = set(), set(), set()
    for file in Path(hmem.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call):
                continue
            prefixes.update(
                k.value.value for k in node.keywords if k.arg == "crash_prefix" and isinstance(k.value, ast.Constant)
            )
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "crash_point":
                continue
            (arg,) = node.args
            if isinstance(arg, ast.Constant):
                literal.add(arg.value)
            elif (
                isinstance(arg, ast.JoinedStr)
                and len(arg.values) == 2
                and isinstance(arg.values[0], ast.FormattedValue)
                and getattr(arg.values[0].value, "id", None) == "crash_prefix"
                and isinstance(arg.values[1], ast.Constant)
                and arg.values[1].value.startswith(".")
            ):
                suffixes.add(arg.values[1].value)
            else:
                raise AssertionError(
                    f"{file.name}:{node.lineno}: a crash_point name this test cannot work out; teach it the new form"
                )
    return literal | {p + s for p in prefixes for s in suffixes}


@pytest.mark.stress
def test_every_crash_point_in_the_source_is_exercised():
    names = _crash_point_names_in_source()
    assert len(names) >= 14 and {"flush.committed", "evict.marked", "compact.finished", "repair.planned"} <= names
    covered = {name: [] for name in names}
    for scenario, spec in SCENARIOS.items():  # each checked by the scenario test above
        for point in spec["points"]:
            covered.setdefault(point, []).append(f"test_crash_faults.py:{scenario}")
    here = Path(__file__).parent
    for other in ("test_store_format.py", "test_management.py", "test_cli_object_store.py"):
        text = (here / other).read_text()
        for name in names:
            if f'"{name}"' in text:
                covered[name].append(other)
    missed = sorted(name for name, where in covered.items() if not where)
    assert not missed, f"crash points no test crashes at: {missed}"
    unknown = sorted(set(covered) - names)
    assert not unknown, f"scenarios claim crash points the source does not have: {unknown}"


# ---- 2. a crash before every primitive I/O operation ------------------------------------------


@pytest.mark.stress
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_crash_before_any_io_operation_leaves_the_old_or_the_new_state(name, references, tmp_path):
    """os._exit before the N-th open/write/fsync/rename/unlink/truncate: this
    also reaches places no crash point names (a shard sealed in the middle
    of put_many, the lock's owner record, the directory fsync after a rename,
    the pending steps a writer's open finishes)."""
    ref = references(name)
    ops = ref.ops()
    total = len(ops)
    assert total > 20
    numbers = list(range(1, total + 1))
    if not _long_run():  # the default run: an even sample that keeps the first and last
        step = max(1, total // 25)  # about 25 crashes a scenario (the suite's 10-minute budget)
        numbers = sorted(set(numbers[::step]) | {1, total})
    jobs = [{"dir": str(tmp_path / f"op-{n}"), "crash_at": None, "crash_op": n} for n in numbers]
    ref.run_jobs(jobs, tmp_path)
    by_commit: dict[int, int] = {}
    for job, n in zip(jobs, numbers):
        commits, position = ref.expected_after_op(n)
        _, op, file, _, _ = ops[n - 1]
        _check_crashed(ref, job, commits, position, f"{name}: crash before I/O #{n} ({op} {file})")
        by_commit[commits] = by_commit.get(commits, 0) + 1
    assert len(by_commit) >= 2  # crashes landed on both sides of a commit
    _report("crash before I/O", name, crashes=len(numbers), operations=total)


# ---- 2. SIGKILL at random moments -------------------------------------------------------------

_KILL_WRITER = r"""
import json, sys
import numpy as np
import hmem
EMBED = %(embed)d
%(kv_src)s
path, side, round_no = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(round_no)
out = open(side, "a")

def rec(*item):  # written after the step it reports returned (or, for "doing", before it starts)
    out.write(json.dumps(item) + "\n")
    out.flush()
    print(item[0], flush=True)  # the test counts these lines to time its kill

next_seed = (round_no + 1) * 20000  # seeds stay below 2**24: importance holds them exactly
store = hmem.Store.open(path, lock_wait=10)
rec("open", round_no)
pending = []

def flush():
    global pending
    rec("doing", "flush")
    store.flush()
    rec("ack", pending)
    pending = []

while True:
    r = rng.random()
    if r < 0.55:
        seeds = list(range(next_seed, next_seed + int(rng.integers(1, 5))))
        next_seed += len(seeds)
        rec("doing", "put")
        ids = store.put_many([entry(x) for x in seeds])
        pending += [[i, x] for i, x in zip(ids, seeds)]
        if rng.random() < 0.6:
            flush()
    elif r < 0.7:
        x = int(rng.integers(1, next_seed))
        store.query(kv(x)[0], x %% 3, 3)  # access counts: record updates at the next flush
    elif r < 0.82:
        flush()
        live = store.stats().entries
        if live > 30:
            target = live - int(rng.integers(1, 10 if live < 60 else 40))
            victims = list(store.plan_eviction(target).entry_ids)
            rec("doing", "evict", victims)  # before: a kill may land after the eviction committed
            store.evict(target)
            rec("evicted", victims)
    elif r < 0.9:
        flush()
        rec("doing", "compact")
        store.compact()
        rec("compacted")
    elif r < 0.98:
        flush()
    else:
        rec("doing", "close")
        store.close()
        rec("ack", pending)
        pending = []
        store = hmem.Store.open(path, lock_wait=10)
        rec("open", round_no)
"""


def _read_side_file(side: Path) -> list:
    """The complete lines of the writer's record (a kill may cut the last one)."""
    text = side.read_text() if side.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


@pytest.mark.stress
def test_a_writer_killed_at_random_moments_loses_nothing_acknowledged(tmp_path):
    """Each round's writer is SIGKILLed at a random moment of its work: just
    after its n-th record (n random), a random fraction of a step later.
    The moment is counted in the writer's own steps, not in seconds, so a
    slow machine kills it as far into its work as a fast one; rounds go on
    (up to a guard) until the kills have cut through acknowledged puts,
    evictions and compactions."""
    # 16 rounds at least: thousands of acknowledged entries and tens of
    # evictions and compactions among the kills; HMEM_STRESS_ROUNDS=800 for a long run
    rounds = min(_stress_rounds(16), 800)
    rng = np.random.default_rng(20240611)
    path, side = tmp_path / "s", tmp_path / "side.jsonl"
    writer = tmp_path / "writer.py"
    writer.write_text(_KILL_WRITER % {"embed": EMBED, "kv_src": _KV_SRC})
    Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=4000).close()
    env = {k: v for k, v in os.environ.items() if k != _io.CRASH_ENV}
    acked: dict[int, int] = {}  # entry id -> seed, for every flush that returned
    may_be_evicted: set[int] = set()  # an eviction had begun
    evicted: set[int] = set()  # an eviction returned
    figures = {
        "rounds": 0,
        "acknowledged": 0,
        "acknowledged_checks": 0,
        "entries_checked": 0,
        "full_verifies": 0,
        "evictions": 0,
        "compactions": 0,
        "killed_during": {},
    }

    def covered() -> bool:
        return len(acked) > 100 and figures["evictions"] > 0 and figures["compactions"] > 0

    started = time.monotonic()
    round_no = 0
    while round_no < rounds or not covered():
        assert round_no < 4 * rounds, f"the kills never cut through every kind of step: {figures}"
        before = len(_read_side_file(side))
        records = int(rng.integers(1, 61))  # the kill comes after this many of the writer's records
        with open(tmp_path / "writer.err", "w") as err:
            proc = subprocess.Popen(
                [sys.executable, str(writer), str(path), str(side), str(round_no)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        hung: list[bool] = []
        guard = threading.Timer(HANG_GUARD, lambda: (hung.append(True), proc.kill()))  # a hang guard only
        guard.start()
        try:
            seen = 0
            while seen < records and proc.stdout.readline():
                seen += 1
            time.sleep(float(rng.uniform(0.0, 0.05)))  # where in the next step the kill lands: anywhere
            proc.send_signal(signal.SIGKILL)
        finally:
            guard.cancel()
            proc.wait(timeout=HANG_GUARD)
            proc.stdout.close()
        assert not hung, f"round {round_no}: the writer wrote no record for {HANG_GUARD} s"
        assert proc.returncode == -signal.SIGKILL, (tmp_path / "writer.err").read_text()
        lines = _read_side_file(side)
        for item in lines[before:]:
            if item[0] == "ack":
                acked.update((int(i), int(x)) for i, x in item[1])
            elif item[0] == "doing" and item[1] == "evict":
                may_be_evicted.update(item[2])
            elif item[0] == "evicted":
                evicted.update(item[1])
                figures["evictions"] += 1
            elif item[0] == "compacted":
                figures["compactions"] += 1
        last = lines[-1] if len(lines) > before else ["not started"]
        where = last[1] if last[0] == "doing" else last[0]
        figures["killed_during"][where] = figures["killed_during"].get(where, 0) + 1

        # the kernel released the flock: a writer opens at once, finishing what the kill left
        with Store.open(path) as store:
            live = {}
            for info in store.entries():
                eid, seed = info.entry_id, int(info.importance)
                got = store.get(eid)
                want_k, want_v = kv(seed)
                assert got.keys.tobytes() == want_k.tobytes() and got.values.tobytes() == want_v.tobytes(), (
                    f"entry {eid}"
                )
                assert info.layer_idx == seed % 3
                live[eid] = seed
            # no id twice, evicted records included: entries.bin (the writer's
            # open finished every pending step) read with the format module
            doc = json.loads((path / "index.json").read_text())
            on_disk = record_format.read(path / "entries.bin", doc["record_count"], HDC // 8)
            ids = on_disk["entry_id"].tolist()
            assert ids == sorted(set(ids))
            assert on_disk["entry_id"][on_disk["shard_idx"] != record_format.EVICTED].tolist() == sorted(live)
        lost = sorted(i for i in acked if i not in live and i not in may_be_evicted)
        assert not lost, f"round {round_no}: acknowledged entries lost: {lost[:20]}"
        assert all(live[i] == acked[i] for i in acked if i in live)
        back = sorted(evicted & set(live))
        assert not back, f"round {round_no}: evicted entries came back: {back[:20]}"
        full = round_no % 5 == 4
        assert_verifies(path, full=full)
        figures["rounds"] += 1
        figures["full_verifies"] += full
        figures["acknowledged_checks"] += sum(1 for i in acked if i in live)
        figures["entries_checked"] += len(live)
        round_no += 1
    figures["acknowledged"] = len(acked)
    figures["seconds"] = round(time.monotonic() - started, 1)
    _report("kill loop", "put/flush/query/evict/compact/close", **figures)


# ---- 3. injected disk faults ---------------------------------------------------------------


class Faults:
    """A fault hook: the `nth` call of primitive operation `op` fails with
    `err` (and, when persistent, every call of it after that)."""

    def __init__(self, op: str, nth: int, err: int, persistent: bool) -> None:
        self.op, self.nth, self.err, self.persistent = op, nth, err, persistent
        self.calls = self.injected = 0
        self.index_renamed = False

    def __call__(self, op: str, path: str) -> None:
        if op == self.op:
            self.calls += 1
            if self.calls == self.nth or (self.persistent and self.calls > self.nth):
                self.injected += 1
                raise OSError(self.err, os.strerror(self.err), path)
        if op == "rename" and os.path.basename(path).startswith(_io.TEMP_PREFIX + "index.json"):
            self.index_renamed = True  # the hook runs just before the rename, which then happens


class _Operation:
    """One mutating operation: `start` opens what it needs (no faults yet),
    `act` runs it (faults on), `recover` runs it again once the disk is
    healthy (as a caller would), `finish` closes."""

    setup = staticmethod(_base_store)
    holds_lock = True
    content_changes = True

    def start(self, path: Path) -> dict:
        return {"store": Store.open(path)}

    def recover(self, ctx: dict, path: Path) -> None:
        self.act(ctx)

    def finish(self, ctx: dict) -> None:
        if ctx.get("store") is not None:
            ctx["store"].close()


class _Put(_Operation):
    batch = [entry(seed) for seed in range(601, 608)]  # seals shards part way (put with rollover)

    def act(self, ctx: dict) -> None:
        ctx["ids"] = ctx["store"].put_many(self.batch)
        ctx["store"].flush()

    def recover(self, ctx: dict, path: Path) -> None:
        if "ids" not in ctx:  # the put failed: nothing of it was stored, put again
            ctx["ids"] = ctx["store"].put_many(self.batch)
        ctx["store"].flush()


class _Flush(_Operation):
    def start(self, path: Path) -> dict:
        store = Store.open(path)
        store.put_many([entry(seed) for seed in range(701, 704)])
        store.query(kv(7)[0], 7 % 3, 3)  # access counts: record updates in place
        store.query(kv(701)[0], 701 % 3, 1)
        return {"store": store}

    def act(self, ctx: dict) -> None:
        ctx["store"].flush()


class _Evict(_Operation):
    def act(self, ctx: dict) -> None:
        ctx["store"].evict(6)


class _Compact(_Operation):
    setup = staticmethod(_evicted_store)

    def act(self, ctx: dict) -> None:
        assert ctx["store"].compact().performed or "retried" in ctx

    def recover(self, ctx: dict, path: Path) -> None:
        ctx["retried"] = True
        try:
            self.act(ctx)
        except hmem.StoreClosedError:  # it committed, then failed: it closed itself
            ctx["store"] = Store.open(path)  # the open finishes the pending renames and deletes
            ctx["store"].compact()


class _Repair(_Operation):
    setup = staticmethod(_damaged_tensor_store)
    holds_lock = False  # repair releases the lock when it fails

    def start(self, path: Path) -> dict:
        return {"path": path}

    def act(self, ctx: dict) -> None:
        hmem.repair(ctx["path"])


def _crashed_store(path: Path, point: str, code: str) -> None:
    """An evicted store on which `code` (with `s` a writer) crashed at `point`."""
    _evicted_store(path)
    script = f"import hmem, numpy as np\nEMBED = {EMBED}\n{_KV_SRC}\ns = hmem.Store.open({str(path)!r})\n{code}\n"
    crashed = _python(["-c", script], cwd=path.parent, timeout=60, env={_io.CRASH_ENV: point})
    assert crashed.returncode == _io.CRASH_EXIT_CODE, crashed.stderr


class _Reopen(_Operation):
    """A writer's open after a crash: it redoes the pending steps of the last
    commit and removes the leftovers (so unlink, rename and truncate fail too)."""

    holds_lock = False
    content_changes = False

    def __init__(self, point: str, code: str) -> None:
        self.setup = lambda path: _crashed_store(path, point, code)

    def start(self, path: Path) -> dict:
        return {"path": path}

    def act(self, ctx: dict) -> None:
        Store.open(ctx["path"]).close()


OPERATIONS = {
    "put": _Put(),
    "flush": _Flush(),
    "evict": _Evict(),
    "compact": _Compact(),
    "repair": _Repair(),
    "reopen_after_flush_crash": _Reopen(
        "flush.records_written", "s.put_many([entry(x) for x in range(801, 806)]); s.flush()"
    ),
    "reopen_after_compact_crash": _Reopen("compact.committed", "s.compact()"),
}
FAULT_OPS = ("open", "write", "fsync", "rename", "unlink", "truncate")
FAULT_MODES = [("once", errno.ENOSPC), ("persistent", errno.EIO)]
if _long_run():
    FAULT_MODES += [("once", errno.EIO), ("persistent", errno.ENOSPC)]


class _CommitWatch:
    """A fault hook that injects nothing: it notes the state a reader sees
    each time index.json has changed since the last I/O call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = (path / "index.json").read_bytes()
        self.states: list[dict] = []
        self.busy = False

    def __call__(self, op: str, file: str) -> None:
        if self.busy:
            return
        try:
            index = (self.path / "index.json").read_bytes()
        except FileNotFoundError:
            return
        if index != self.index:
            self.index, self.busy = index, True
            try:
                self.states.append(state_of(self.path))
            finally:
                self.busy = False


@pytest.mark.stress
@pytest.mark.parametrize("mode,err", FAULT_MODES, ids=[f"{m}-{errno.errorcode[e]}" for m, e in FAULT_MODES])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_a_failing_disk_at_every_call_keeps_the_committed_state(name, mode, err, tmp_path):
    operation = OPERATIONS[name]
    template = tmp_path / "template"
    operation.setup(template)
    old = state_of(template)
    # the state after the operation, on a healthy disk
    shutil.copytree(template, tmp_path / "healthy")
    ctx = operation.start(tmp_path / "healthy")
    # the states of the commits on the way (an incremental compaction commits
    # shard by shard: a failure may leave any of them, each whole)
    steps = _CommitWatch(tmp_path / "healthy")
    _io.set_fault_hook(steps)
    try:
        operation.act(ctx)
    finally:
        _io.set_fault_hook(None)
    operation.finish(ctx)
    new = state_of(tmp_path / "healthy")
    names = sorted(p.name for p in (tmp_path / "healthy").iterdir())
    assert (new != old) == operation.content_changes
    assert names != sorted(p.name for p in template.iterdir()) or operation.content_changes
    assert_entries_are_right(new)
    injected: dict[str, int] = {}
    outcomes = {"before_commit": 0, "after_commit": 0, "absorbed": 0}
    for op in FAULT_OPS:
        for nth in range(1, 500):
            path = tmp_path / f"{op}-{nth}"
            shutil.copytree(template, path)
            ctx = operation.start(path)
            faults = Faults(op, nth, err, persistent=mode == "persistent")
            _io.set_fault_hook(faults)
            try:
                operation.act(ctx)
            except (OSError, hmem.HmemError) as exc:
                failed = exc
            else:
                failed = None
            finally:
                _io.set_fault_hook(None)
            try:
                what = f"{name}: {mode} {errno.errorcode[err]} at {op} #{nth}"
                if not faults.injected:  # the operation calls `op` fewer than nth times: done
                    assert failed is None, what
                    break
                injected[op] = injected.get(op, 0) + faults.injected
                if failed is None:  # a best-effort step (a clean-up, the lock's owner record) failed
                    outcomes["absorbed"] += 1
                else:
                    assert isinstance(failed, OSError) and failed.errno == err, (what, repr(failed))
                    assert os.strerror(err) in str(failed), (what, str(failed))
                    # the committed state is intact; a reader sees it while the writer still holds the lock
                    seen = state_of(path)
                    if seen == old:
                        outcomes["before_commit"] += 1
                    else:
                        assert faults.index_renamed and (seen == new or seen in steps.states), (
                            f"{what}: a state neither old, new nor one committed on the way"
                        )
                        outcomes["after_commit"] += 1
                    if operation.holds_lock and still_open(ctx["store"]):
                        with pytest.raises(hmem.StoreLockedError):
                            Store.open(path)
                    # the disk is healthy again: doing it again finishes the job
                    operation.recover(ctx, path)
                operation.finish(ctx)
                assert state_of(path) == new, what
                Store.open(path).close()
                assert_verifies(path)
                assert state_of(path) == new, what
                assert sorted(p.name for p in path.iterdir()) == names, what
            finally:
                operation.finish(ctx)
            shutil.rmtree(path)
        else:
            raise AssertionError(f"{name} still calls {op} after 500 calls")
    # every kind of operation the work needs was made to fail at least once
    needs = {
        "put": {"open", "write", "fsync", "rename"},
        "flush": {"open", "write", "fsync", "rename"},
        "reopen_after_flush_crash": {"open", "fsync", "unlink", "truncate"},
        "reopen_after_compact_crash": {"open", "fsync", "rename", "unlink", "truncate"},
        "evict": {"open", "write", "fsync", "rename"},
        "compact": {"open", "write", "fsync", "rename", "unlink"},
        "repair": {"open", "write", "fsync", "rename", "unlink", "truncate"},
    }[name]
    assert needs <= set(injected), injected
    assert outcomes["before_commit"] and (outcomes["after_commit"] or not operation.content_changes), outcomes
    _report(
        "faults", f"{name} {mode} {errno.errorcode[err]}", injected=injected, total=sum(injected.values()), **outcomes
    )


# ---- figures for docs/reliability.md ------------------------------------------------------------


def _report(kind: str, name: str, **figures) -> None:
    """Print a figure line (pytest -s shows it); with HMEM_RELIABILITY_LOG set,
    also append it to that file as JSON."""
    line = {"kind": kind, "name": name, **figures}
    print("FIGURES", json.dumps(line))
    log = os.environ.get("HMEM_RELIABILITY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")
