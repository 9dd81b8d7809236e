"""Stores from untrusted sources (docs/security.md): a store's own files can
never make hmem touch anything outside the store directory.

Every case is built in a sandbox directory: ``store`` (the store under
attack) beside files an attacker would like hmem to read, change or delete
(``victim_shard.safetensors``, a copy of a real shard of the sibling store
``other``; ``victim.txt``) and the inputs of the commands (a query ``.npy``
file and a K/V file for ``put``).  Everything in the sandbox but ``store``
is snapshotted (bytes, mtime, kind, link target) before and compared after
every command.

- the two regression cases of the issue (a shard named
  ``../victim_shard.safetensors`` or ``../victim.txt`` in index.json, its
  checksum recomputed);
- each of the store's files replaced by a symbolic link to (or a hard link
  of) a copy outside, or by a named pipe;
- index.json claiming a billion (or 2**40) records: refused at once, in a
  subprocess under a 1 GiB address-space limit;
- a seeded, structured fuzzer over index.json, entries.bin and
  commit.stamp that recomputes every checksum, so its mutations reach past
  them (pending record updates far past the end, sparse files claiming
  terabytes, stamp ids of any size among them), and runs every command on
  each mutated store, each case within a time and a memory budget.

docs/reliability.md ("Untrusted stores") gives the figures
(``HMEM_RELIABILITY_LOG=file`` appends them as JSON lines;
``HMEM_FUZZ_CASES=N`` runs N fuzz cases instead of 150).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import typer
import typer.main
import typer.testing
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.formats import records, stamp

# A format test: index.json's checksum is recomputed exactly as hmem does
# (the CRC-32C of the canonical JSON of the document without its checksum,
# docs/format.md), so that a crafted document passes it as an attacker's would.
from hmem.formats.manifest import _checksum
from hmem.formats.records import EVICTED, UPDATE_DTYPE
from hmem.formats.store_files import REWRITE_PREFIX

D, HDC = 16, 256
SIG_BYTES = HDC // 8
SHARD_BYTES = 2400  # small shards: the store has several
BASE_ENV = {
    "COLUMNS": "200",
    "NO_COLOR": None,
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "HMEM_STORE": None,
    "HMEM_DEBUG": None,
}
DOCUMENTED_EXIT_CODES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}  # docs/cli.md, "Exit codes"
FUZZ_CASES = int(os.environ.get("HMEM_FUZZ_CASES", "150"))
MEMORY_LIMIT = 1536 << 20  # address space of the fuzzer's subprocess
CASE_SECONDS = 300  # a fuzz case's time budget (a hang guard, _case_budget)
CASE_MEMORY_KIB = 256 << 10  # how far one fuzz case may raise the peak memory

# Subprocesses run outside the checkout so that they import the installed hmem
# (with its compiled kernels), not the source tree.
OUTSIDE_CHECKOUT = tempfile.gettempdir()


def _report(name: str, **figures: Any) -> None:
    """Print a figure line (pytest -s shows it); with HMEM_RELIABILITY_LOG
    set, also append it to that file as JSON (docs/reliability.md)."""
    line = {"kind": "untrusted", "name": name, **figures}
    print("FIGURES", json.dumps(line))
    log = os.environ.get("HMEM_RELIABILITY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")


# ---- the sandbox ---------------------------------------------------------------------------


def _fill(path: Path, seed: int) -> None:
    """A store of 12 entries in 2 layers over several shards, 2 evicted."""
    rng = np.random.default_rng(seed)
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, shard_max_bytes=SHARD_BYTES) as store:
        for i in range(12):
            keys = rng.standard_normal((1 + i % 3, D)).astype(np.float32)
            store.put(keys, keys * 0.5, layer_idx=i % 2, importance=0.1 if i in (4, 9) else 1.0 + i)
        store.flush()
        store.evict(10)


def _build_template(root: Path) -> Path:
    """The sandbox every case copies (built once per module)."""
    root.mkdir()
    _fill(root / "store", 1)
    _fill(root / "other", 2)
    shutil.copy2(root / "other" / "shard_0000.safetensors", root / "victim_shard.safetensors")
    (root / "victim.txt").write_text("an operator's file hmem must never touch\n")
    rng = np.random.default_rng(3)
    np.save(root / "query.npy", rng.standard_normal((2, D)).astype(np.float32))
    kv = rng.standard_normal((2, D)).astype(np.float32)
    save_file({"keys": kv, "values": kv}, str(root / "kv.safetensors"))
    return root


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return _build_template(tmp_path_factory.mktemp("untrusted") / "sandbox")


def _new_sandbox(template: Path, where: Path) -> Path:
    shutil.copytree(template, where, symlinks=True)
    return where


def outside_state(sandbox: Path) -> dict[str, tuple]:
    """Every entry of the sandbox but the store's own: kind, bytes, mtime,
    mode and link target (links are not followed).  Not the link count: a
    store's name of a file going away is the store's own business."""
    state: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(sandbox, followlinks=False):
        rel_dir = Path(dirpath).relative_to(sandbox)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d != "store"]
            filenames = [f for f in filenames if f != "store"]
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(rel_dir / name)
            if stat.S_ISLNK(st.st_mode):
                state[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                state[rel] = ("file", path.read_bytes(), st.st_mtime_ns, st.st_mode)
            else:
                state[rel] = ("other", st.st_mode)
    return state


_CLI = typer.main.get_command(app)


class _Runner(CliRunner):
    """typer's CliRunner with the app's command built once: building it costs
    as much as a refused command does, and the fuzzer runs thousands."""

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(typer.testing, "_get_command", lambda _app: _CLI):
            return super().invoke(*args, **kwargs)


def run(*args: object):
    return _Runner().invoke(app, [str(a) for a in args], env=BASE_ENV)


def commands(sandbox: Path) -> list[tuple[str, list[object]]]:
    """Every command an operator might run on a store from elsewhere."""
    store = sandbox / "store"
    return [
        ("stats", ["stats", store]),
        ("stats --json", ["stats", store, "--json"]),
        ("verify", ["verify", store]),
        ("verify --full", ["verify", store, "--full"]),
        ("query", ["query", store, "--query", sandbox / "query.npy", "--layer", 0, "--top-k", 20]),
        ("evict", ["evict", store, "--target", 1, "--yes"]),
        ("compact", ["compact", store]),
        ("verify --repair", ["verify", store, "--repair", "--yes"]),
        ("put", ["put", store, sandbox / "kv.safetensors"]),
    ]


@dataclasses.dataclass
class Outcome:
    name: str
    code: int
    stdout: str
    stderr: str


def run_checked(name: str, args: list[object]) -> Outcome:
    """Run one command; it must end with a documented exit code and, when it
    fails, one clear error line: never an internal error or a traceback."""
    result = run(*args)
    context = f"{name}: exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    assert result.exception is None or isinstance(result.exception, SystemExit), context
    assert result.exit_code in DOCUMENTED_EXIT_CODES, context
    text = result.stdout + result.stderr
    assert "internal error" not in text and "Traceback" not in text, context
    if result.exit_code in (1, 5, 6, 7, 8, 9, 10):
        assert any(line.startswith("error: ") for line in result.stderr.splitlines()), context
    return Outcome(name, result.exit_code, result.stdout, result.stderr)


def run_all(sandbox: Path) -> dict[str, Outcome]:
    """Every command on the sandbox's store, checking after each that
    nothing outside the store changed."""
    before = outside_state(sandbox)
    out = {}
    for name, args in commands(sandbox):
        out[name] = run_checked(name, args)
        assert outside_state(sandbox) == before, f"{name} changed something outside the store"
    return out


# ---- editing a store's files as an attacker would ---------------------------------------------


def read_doc(store: Path) -> dict:
    doc = json.loads((store / "index.json").read_text())
    doc.pop("checksum")
    return doc


def write_doc(store: Path, doc: dict) -> None:
    """index.json with its checksum recomputed (anyone can: it is a CRC)."""
    body = json.dumps({**doc, "checksum": f"crc32c:{_checksum(doc):08x}"}, indent=1) + "\n"
    (store / "index.json").write_bytes(body.encode())


def read_records(store: Path, doc: dict) -> np.ndarray:
    return records.read(store / "entries.bin", doc["record_count"], SIG_BYTES)


def write_records(store: Path, recs: np.ndarray) -> None:
    """entries.bin with every record's CRC recomputed (records.seal)."""
    recs = recs.copy()
    records.seal(recs)
    (store / "entries.bin").write_bytes(recs.tobytes())


def encode_updates(updates: np.ndarray) -> str:
    return base64.b64encode(updates.tobytes()).decode("ascii")


# ---- the regression cases of the issue -----------------------------------------------------------


@pytest.mark.parametrize("victim", ["victim_shard.safetensors", "victim.txt"])
def test_a_shard_named_outside_the_store_is_refused(template, tmp_path, victim):
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    store = sandbox / "store"
    doc = read_doc(store)
    doc["shards"][0]["file"] = f"../{victim}"
    write_doc(store, doc)
    victim_path = sandbox / victim
    victim_before = (victim_path.read_bytes(), victim_path.stat().st_mtime_ns)
    out = run_all(sandbox)  # also: nothing outside the store changed after each command
    assert (victim_path.read_bytes(), victim_path.stat().st_mtime_ns) == victim_before
    # Each refusal names the bad name and points at verify.
    for name in ("stats", "query", "evict", "compact"):
        assert out[name].code == 1, out[name]
        assert f"'../{victim}' is not a plain file name of the store directory" in out[name].stderr
        assert "hmem verify" in out[name].stderr
    for name in ("verify", "verify --full"):
        assert out[name].code == 4 and "index.unreadable" in out[name].stdout, out[name]
    # repair rebuilds index.json from the store's own shards: every live entry is kept.
    assert out["verify --repair"].code == 0, out["verify --repair"]
    assert "kept 10 entries" in out["verify --repair"].stdout
    assert out["put"].code == 0, out["put"]  # the repaired store takes new entries
    assert out["stats --json"].code == 1
    assert json.loads(out["stats --json"].stdout)["error"]["code"] == "corrupt_store"


def test_the_issue_replayed_step_by_step(template, tmp_path):
    """The issue's exact sequence: `evict --keep 0.5 --yes`, then `compact`,
    on a store whose shard 0 is named ../victim_shard.safetensors."""
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    store = sandbox / "store"
    doc = read_doc(store)
    doc["shards"][0]["file"] = "../victim_shard.safetensors"
    write_doc(store, doc)
    before = outside_state(sandbox)
    for args in (["evict", store, "--keep", "0.5", "--yes"], ["compact", store]):
        out = run_checked(args[0], args)
        assert out.code == 1 and "not a plain file name" in out.stderr
    assert outside_state(sandbox) == before
    assert (sandbox / "victim_shard.safetensors").read_bytes() == (
        sandbox / "other" / "shard_0000.safetensors"
    ).read_bytes()


# ---- symbolic links, hard links and named pipes in place of the store's files ---------------------

STORE_FILES = ["shard_0000.safetensors", "entries.bin", "index.json", "commit.stamp", "lock"]


def _replace(store: Path, name: str, how: str) -> Path:
    """Replace the store's `name` by a symbolic link to a copy outside, or a
    hard link of it; returns the outside copy."""
    outside = store.parent / f"outside_{name}"
    if (store / name).exists():
        shutil.copy2(store / name, outside)
    else:
        outside.write_bytes(b"")
    (store / name).unlink(missing_ok=True)
    if how == "symlink":
        os.symlink(outside, store / name)
    else:
        os.link(outside, store / name)
    return outside


# What each command must do when a store file is a symbolic link (docs/security.md):
# "refused" -- exit 1 with an error line naming the link; "foreign" -- it succeeds
# and warns of the link as a file hmem did not make; "ok" -- it needs nothing from
# that file and succeeds. A writer refuses any store whose own files are links;
# verify (and --full) report each as file.unsafe (exit 4), and --repair refuses.
LINK_EXPECTED: dict[str, dict[str, str]] = {
    "shard_0000.safetensors": {
        "stats": "foreign",
        "query": "refused",
        "evict": "refused",
        "compact": "refused",
        "put": "refused",
    },
    "entries.bin": {"stats": "refused", "query": "refused", "evict": "refused", "compact": "refused", "put": "refused"},
    "index.json": {"stats": "refused", "query": "refused", "evict": "refused", "compact": "refused", "put": "refused"},
    "commit.stamp": {"stats": "foreign", "query": "ok", "evict": "refused", "compact": "refused", "put": "refused"},
    "lock": {"stats": "foreign", "query": "ok", "evict": "refused", "compact": "refused", "put": "refused"},
}


@pytest.mark.parametrize("name", STORE_FILES)
def test_no_command_goes_through_a_symbolic_link(template, tmp_path, name):
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    store = sandbox / "store"
    outside = _replace(store, name, "symlink")
    before = (outside.read_bytes(), outside.stat().st_mtime_ns)
    out = run_all(sandbox)
    assert (outside.read_bytes(), outside.stat().st_mtime_ns) == before
    assert os.path.islink(store / name), "the link is the user's to remove, never hmem's"
    for command, expected in LINK_EXPECTED[name].items():
        got = out[command]
        if expected == "refused":
            assert got.code == 1, got
            assert name in got.stderr and ("symbolic link" in got.stderr or "not a regular file" in got.stderr), got
        elif expected == "foreign":
            assert got.code == 0 and f"foreign file {name}" in got.stderr, got
        else:
            assert got.code == 0, got
    for command in ("verify", "verify --full"):
        assert out[command].code == 4 and "file.unsafe" in out[command].stdout, out[command]
        assert name in out[command].stdout
    assert out["verify --repair"].code == 1 and name in out["verify --repair"].stderr, out["verify --repair"]
    stats = json.loads(out["stats --json"].stdout) if out["stats --json"].code == 0 else None
    if stats is not None:
        assert name in stats["foreign_files"]


def test_a_query_never_serves_a_linked_shard(template, tmp_path):
    """The library refuses to read a shard through a link: CorruptStoreError
    (UnsafeFileError) naming the file, for every entry the shard holds."""
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    store = sandbox / "store"
    with hmem.Store.open(store, read_only=True) as s:
        in_shard_0 = [e.entry_id for e in s.entries() if e.shard_idx == 0]
    _replace(store, "shard_0000.safetensors", "symlink")
    assert in_shard_0
    with hmem.Store.open(store, read_only=True) as s:
        for entry_id in in_shard_0:
            with pytest.raises(hmem.CorruptStoreError, match="symbolic link") as info:
                s.get(entry_id)
            assert isinstance(info.value, hmem.UnsafeFileError) and info.value.hint
        assert s.stats().foreign_files == ["shard_0000.safetensors"]


@pytest.mark.parametrize("name", ["entries.bin", "commit.stamp", "lock", "shard_0000.safetensors"])
def test_no_write_reaches_a_hard_linked_file(template, tmp_path, name):
    """The files hmem writes in place (entries.bin's records, the commit
    stamp, the lock's owner record) are refused by a writer when they have
    other names: a hard link would carry the write to a file outside the
    store.  A shard is never written in place: a hard-linked one (a backup
    made with hard links) is read, compacted away and left whole."""
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    store = sandbox / "store"
    outside = _replace(store, name, "hardlink")
    before = (outside.read_bytes(), outside.stat().st_mtime_ns)
    out = run_all(sandbox)
    assert (outside.read_bytes(), outside.stat().st_mtime_ns) == before
    for command in ("evict", "compact", "put"):
        if name.startswith("shard_"):
            assert out[command].code == 0, out[command]
        else:
            assert out[command].code == 1 and name in out[command].stderr, out[command]
            assert "hard link" in out[command].stderr and "copy the store directory" in out[command].stderr
    # readers, and verify (the store is sound; --repair finds nothing to do), are unaffected
    for command in ("stats", "query", "verify", "verify --full", "verify --repair"):
        assert out[command].code == 0, out[command]
    if name.startswith("shard_"):
        assert outside.stat().st_nlink == 1  # compaction replaced the store's name of it


def test_the_store_directory_may_be_a_link_the_user_chose(template, tmp_path):
    """Only the store's own files are never followed: the path the user
    gives may be a symbolic link to the store directory."""
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    real = sandbox / "store"
    os.symlink(real, tmp_path / "chosen")
    before = outside_state(sandbox)
    for name, args in commands(sandbox):
        args = [tmp_path / "chosen" if a == real else a for a in args]
        out = run_checked(name, args)
        assert out.code == 0, out
    assert outside_state(sandbox) == before
    assert hmem.verify(real, full=True).ok


class _Blocked(BaseException):
    """A command hung (raised by an alarm, past the command line's handler)."""


@pytest.mark.parametrize("name", STORE_FILES)
def test_a_named_pipe_never_blocks_a_command(template, tmp_path, name):
    """A named pipe in place of a store file: every command ends at once
    (an open for writing would otherwise wait for a reader forever)."""
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    store = sandbox / "store"
    (store / name).unlink(missing_ok=True)
    os.mkfifo(store / name)

    def blocked(signum, frame):  # not an Exception: the command line must not catch it
        raise _Blocked(f"a command waited 300 s on the named pipe {name}")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(300)  # a hang guard: an open that waits on a pipe waits for ever
    try:
        out = run_all(sandbox)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    for command in ("evict", "compact", "put"):
        assert out[command].code == 1 and name in out[command].stderr, out[command]
    assert out["verify"].code == 4 and "file.unsafe" in out["verify"].stdout, out["verify"]


# ---- counts that would size an allocation ------------------------------------------------------

_BOUNDED = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from typer.testing import CliRunner
from hmem.cli.app import app
out = []
for args in json.loads(sys.argv[1]):
    started = time.perf_counter()
    result = CliRunner().invoke(app, args, env={{"COLUMNS": "200", "HMEM_DEBUG": None}})
    out.append({{"args": args, "code": result.exit_code, "seconds": time.perf_counter() - started,
                "exception": repr(result.exception), "stderr": result.stderr[-400:],
                "stdout": result.stdout[-400:]}})
print(json.dumps({{"runs": out, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""


def run_bounded(argv: list[list[str]], limit: int, timeout: float = 300) -> dict:
    """Commands run in a subprocess under an address-space limit of `limit`
    bytes; `timeout` is a hang guard (work that grew with a claimed count of
    10**9 or 2**40 would run far longer)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HMEM_CRASH_AT", None)
    proc = subprocess.run(
        [sys.executable, "-c", _BOUNDED.format(limit=limit), json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=OUTSIDE_CHECKOUT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("claim", [10**9, 2**40])
@pytest.mark.stress
def test_a_tiny_index_claiming_huge_counts_is_refused_at_once(template, tmp_path, claim):
    sandbox = _new_sandbox(template, tmp_path / "sandbox")
    store = sandbox / "store"
    doc = read_doc(store)
    doc["record_count"] = claim
    write_doc(store, doc)
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    small = {"format": "hmem-store", "format_version": 1, "record_count": claim}
    write_doc(tiny, small)
    assert len((tiny / "index.json").read_bytes()) <= 120  # about 100 bytes
    argv = []
    for root in (store, tiny):
        argv += [
            ["stats", str(root)],
            ["verify", str(root)],
            ["verify", str(root), "--full"],
            ["query", str(root), "--query", str(sandbox / "query.npy"), "--layer", "0"],
            ["evict", str(root), "--target", "1", "--yes"],
            ["compact", str(root)],
        ]
    before = outside_state(sandbox)
    got = run_bounded(argv, 1 << 30)
    assert outside_state(sandbox) == before
    for run_ in got["runs"]:  # refused: no allocation (the address-space limit) nor work sized by the claim
        assert run_["code"] in (1, 4), run_
        assert "internal error" not in run_["stderr"] and "Traceback" not in run_["stderr"], run_
        if run_["code"] == 1:
            assert "records" in run_["stderr"] or "malformed field" in run_["stderr"], run_
    _report(
        "huge-count",
        claim=claim,
        commands=len(got["runs"]),
        maxrss_mib=got["maxrss_kib"] // 1024,
        slowest_s=round(max(r["seconds"] for r in got["runs"]), 3),
    )


# ---- the fuzzer -------------------------------------------------------------------------------------

# Mutations of index.json (the decoded document, without its checksum) and
# of entries.bin (the committed records, resealed). Each takes the case's
# random generator and what it edits, and returns what it did.

BAD_INTS: list[Any] = [
    -1,
    -(2**63),
    2**31,
    2**32,
    2**40 + 1,
    2**50 + 1,
    2**63,
    2**64,
    10**30,
    True,
    False,
    1.5,
    float("inf"),
    "7",
    None,
    [],
    {},
]


def bad_names(sandbox: Path) -> list[Any]:
    # Absolute names point into the sandbox, never at the machine's own
    # files: a regression must not be able to harm the host running the tests.
    return [
        "../victim_shard.safetensors",
        "../victim.txt",
        "../other/shard_0000.safetensors",
        "../../victim.txt",
        str(sandbox / "victim.txt"),
        str(sandbox / "victim_shard.safetensors"),
        str(sandbox / "other"),
        "a/b",
        "shard_0000.safetensors\0",
        "shard_0000.safetensors/",
        "",
        ".",
        "..",
        "x" * 300,
        "x" * 5000,
        "index.json",
        "lock",
        "entries.bin",
        "commit.stamp",
        "shard_0001.safetensors",
        "shard_0000.safetensors",
        "shard_00000.safetensors",
        "shard_9999999999.safetensors",
        REWRITE_PREFIX + "shard_0000.safetensors",
        "..\\victim.txt",
        "\u2215victim.txt",
        None,
        7,
        ["a"],
    ]


@dataclasses.dataclass
class Target:
    doc: dict
    recs: np.ndarray
    sandbox: Path
    original: dict  # the document before any mutation (mutations compose)
    records_changed: bool = False
    raw_index: bytes | None = None  # index.json's bytes, when a mutation writes them itself


def _pick(rng: np.random.Generator, seq: list) -> Any:
    return seq[int(rng.integers(len(seq)))]


def shards(t: Target) -> list[dict]:
    """The document's shard list, put back first if a mutation replaced it."""
    if (
        not isinstance(t.doc["shards"], list)
        or len(t.doc["shards"]) < 2
        or not all(isinstance(s, dict) for s in t.doc["shards"])
    ):
        t.doc["shards"] = copy.deepcopy(t.original["shards"])
    return t.doc["shards"]


def m_shard_name(rng, t: Target) -> str:
    i = int(rng.integers(len(shards(t))))
    t.doc["shards"][i]["file"] = _pick(rng, bad_names(t.sandbox))
    return f"shards[{i}].file = {t.doc['shards'][i]['file']!r:.60}"


def m_shard_number(rng, t: Target) -> str:
    i = int(rng.integers(len(shards(t))))
    key = _pick(rng, ["bytes", "entries", "dead_entries", "dead_bytes", "index_crc"])
    t.doc["shards"][i][key] = _pick(rng, BAD_INTS + [0, 1, 2**50, 2**32 - 1])
    return f"shards[{i}].{key} = {t.doc['shards'][i][key]!r}"


def m_shard_uid(rng, t: Target) -> str:
    i = int(rng.integers(len(shards(t))))
    t.doc["shards"][i]["uid"] = _pick(
        rng, ["", "0" * 32, "g" * 32, "A" * 32, "0" * 31, "../x", 5, None, t.doc["shards"][-1 - i]["uid"]]
    )
    return f"shards[{i}].uid = {t.doc['shards'][i]['uid']!r}"


def m_shard_list(rng, t: Target) -> str:
    listed = shards(t)
    how = _pick(rng, ["drop", "duplicate", "swap", "empty", "not-a-list", "extra-key", "missing-key", "many"])
    if how == "drop":
        listed.pop(int(rng.integers(len(listed))))
    elif how == "duplicate":
        listed.append(copy.deepcopy(listed[0]))
        listed[-1]["file"] = f"shard_{len(listed) - 1:04d}.safetensors"
    elif how == "swap":
        listed[0], listed[1] = listed[1], listed[0]
    elif how == "empty":
        t.doc["shards"] = []
    elif how == "not-a-list":
        t.doc["shards"] = {"0": listed[0]}
    elif how == "extra-key":
        listed[0]["path"] = "../victim.txt"
    elif how == "missing-key":
        listed[0].pop(_pick(rng, ["file", "uid", "bytes", "index_crc"]), None)
    else:  # many valid-looking shards the directory does not hold
        model = listed[0]
        t.doc["shards"] = [{**model, "file": f"shard_{i:04d}.safetensors"} for i in range(2000)]
    return f"shards: {how}"


def m_counter(rng, t: Target) -> str:
    key = _pick(rng, ["record_count", "next_entry_id", "generation"])
    real = t.original[key]
    t.doc[key] = _pick(rng, BAD_INTS + [0, 1, real - 1, real + 1, 10**9, 2**40, 2**63 - 1])
    return f"{key} = {t.doc[key]!r}"


def m_pending_rename(rng, t: Target) -> str:
    names = bad_names(t.sandbox)
    src = _pick(
        rng,
        [
            REWRITE_PREFIX + "shard_0000.safetensors",
            REWRITE_PREFIX + "entries.bin",
            REWRITE_PREFIX + "index.json",
            REWRITE_PREFIX + "lock",
            "../victim.txt",
            str(t.sandbox / "victim.txt"),
            "shard_0000.safetensors",
        ]
        + names,
    )
    dst = _pick(rng, ["shard_0000.safetensors", "entries.bin", "index.json", "lock", "commit.stamp"] + names)
    if rng.random() < 0.3:  # a source that exists: a copy of a real shard, or a link out
        src = REWRITE_PREFIX + "shard_0000.safetensors"
        path = t.sandbox / "store" / src
        if rng.random() < 0.5:
            shutil.copy2(t.sandbox / "victim_shard.safetensors", path)
        else:
            os.symlink(t.sandbox / "victim_shard.safetensors", path)
    t.doc["pending"]["renames"] = _pick(rng, [[[src, dst]], [[src, dst, "x"]], [[src]], [src], "x", None])
    return f"pending.renames = {t.doc['pending']['renames']!r:.80}"


def m_pending_delete(rng, t: Target) -> str:
    names = bad_names(t.sandbox)
    t.doc["pending"]["deletes"] = _pick(
        rng,
        [
            [_pick(rng, names)],
            [_pick(rng, names), _pick(rng, names)],
            ["../victim.txt", "index.json", "lock", "entries.bin"],
            ".hmem-tmp.x",
            None,
            [".hmem-tmp." + "../victim.txt"],
        ],
    )
    return f"pending.deletes = {t.doc['pending']['deletes']!r:.80}"


def m_pending_updates(rng, t: Target) -> str:
    n = t.original["record_count"]
    how = _pick(
        rng, ["past-end", "far-past-end", "huge", "many", "odd-bytes", "not-base64", "bad-shard", "not-a-string"]
    )
    updates = np.zeros(3, dtype=UPDATE_DTYPE)
    if how == "past-end":
        updates["position"] = [0, n, n + 5]
    elif how == "far-past-end":
        # one sound update (its checksum matches the record it makes) far
        # past the records: a writer that applied it before checking would
        # grow entries.bin to a sparse file of terabytes
        row = t.recs[:1].copy()
        records.seal(row)
        updates = records.updates_for(row, np.array([0]))
        updates["position"] = _pick(rng, [2**20, 2**26, 2**36])
    elif how == "huge":
        updates["position"] = [2**63, 2**64 - 1, 2**40]
    elif how == "many":
        updates = np.zeros(20000, dtype=UPDATE_DTYPE)
        updates["position"] = np.arange(20000) % max(n, 1)
    elif how == "bad-shard":
        # a sound update (its checksum matches the record it makes) naming a shard past the list
        pos = int(rng.integers(n))
        row = t.recs[pos : pos + 1].copy()
        row["shard_idx"] = len(t.original["shards"]) + int(rng.integers(1, 1000))
        records.seal(row)
        updates = records.updates_for(row, np.array([0]))
        updates["position"] = pos
    if how == "odd-bytes":
        t.doc["pending"]["record_updates"] = base64.b64encode(b"\0" * 13).decode()
    elif how == "not-base64":
        t.doc["pending"]["record_updates"] = "!!not base64!!"
    elif how == "not-a-string":
        t.doc["pending"]["record_updates"] = 12
    else:
        t.doc["pending"]["record_updates"] = encode_updates(updates)
    return f"pending.record_updates: {how}"


def m_config(rng, t: Target) -> str:
    key = _pick(rng, ["embed_dim", "hdc_dim", "shard_max_bytes", "max_open_shards", "max_entries", "seed"])
    t.doc["config"][key] = _pick(rng, BAD_INTS + [0, 8, 2**20])
    return f"config.{key} = {t.doc['config'][key]!r}"


def m_index_text(rng, t: Target) -> str:
    """index.json as text no hmem writes: values nested past any depth
    hmem uses (checksum recomputed where the JSON still parses), not UTF-8,
    not an object, cut short."""
    how = _pick(rng, ["nested-20", "nested-500", "nested-5000", "not-utf8", "a-list", "null", "cut"])
    if how.startswith("nested"):
        depth = int(how.split("-")[1])
        if depth < 900:
            t.doc["projection"] = json.loads("[" * depth + "]" * depth)
        else:  # past what json.loads follows: the checksum cannot matter
            text = json.dumps({**t.doc, "projection": "NEST"}).replace('"NEST"', "[" * depth + "]" * depth)
            t.raw_index = text.encode()
    elif how == "not-utf8":
        t.raw_index = b'{"format": "hmem-store", "\xff": "' + bytes(range(128, 256)) + b'"}'
    elif how == "a-list":
        t.raw_index = json.dumps([t.doc]).encode()
    elif how == "null":
        t.raw_index = b"null"
    else:
        text = json.dumps({**t.doc, "checksum": f"crc32c:{_checksum(t.doc):08x}"}, indent=1)
        t.raw_index = text[: int(rng.integers(1, len(text)))].encode()
    return f"index.json: {how}"


def m_record_field(rng, t: Target) -> str:
    n = len(t.recs)
    pos = int(rng.integers(n))
    field, values = _pick(
        rng,
        [
            ("shard_idx", [len(t.original["shards"]), len(t.original["shards"]) + 7, EVICTED - 1, 2**31]),
            ("n_tokens", [2**32 - 1, 2**31, 0, 1000]),
            ("layer_idx", [2**32 - 1, 2**31, 1000]),
            ("importance", [np.nan, np.inf, -np.inf, -1.0, 3e38, 0.0]),
            ("timestamp", [2**64 - 1, 0]),
            ("access_count", [2**32 - 1]),
            ("entry_id", [0, 2**64 - 1, 2**63, t.original["next_entry_id"], t.original["next_entry_id"] + 10]),
        ],
    )
    value = _pick(rng, values)
    with np.errstate(invalid="ignore", over="ignore"):
        t.recs[field][pos] = value
    t.records_changed = True
    return f"record {pos}.{field} = {value!r}"


def m_record_order(rng, t: Target) -> str:
    how = _pick(rng, ["swap", "duplicate", "reverse", "all-same"])
    ids = t.recs["entry_id"]
    if how == "swap":
        ids[[0, 1]] = ids[[1, 0]]
    elif how == "duplicate":
        ids[2] = ids[3]
    elif how == "reverse":
        ids[:] = ids[::-1].copy()
    else:
        ids[:] = ids[0]
    t.records_changed = True
    return f"entry ids: {how}"


def m_record_file(rng, t: Target) -> str:
    """entries.bin shorter or longer than the commit (sound records past it)."""
    store = t.sandbox / "store"
    how = _pick(rng, ["cut", "extra-sound", "extra-junk", "empty"])
    data = (store / "entries.bin").read_bytes()
    if how == "cut":
        data = data[: -int(rng.integers(1, 100))]
    elif how == "extra-sound":
        extra = t.recs[-3:].copy()
        extra["entry_id"] = t.original["next_entry_id"] + np.arange(3) + int(rng.integers(0, 2**40))
        records.seal(extra)
        data += extra.tobytes()
    elif how == "extra-junk":
        data += rng.integers(0, 256, size=1000, dtype=np.uint8).tobytes()
    else:
        data = b""
    (store / "entries.bin").write_bytes(data)
    return f"entries.bin: {how}"


def m_sparse_file(rng, t: Target) -> str:
    """A file whose size claims data that is not there: holes (a sparse
    file) a few kilobytes of store turn into terabytes of apparent size."""
    store = t.sandbox / "store"
    how = _pick(rng, ["entries-tail", "entries-claim", "shard"])
    if how == "entries-tail":  # 4 GiB of holes past the committed records
        entries = store / "entries.bin"
        os.truncate(entries, entries.stat().st_size + (4 << 30))
    elif how == "entries-claim":  # a record count entries.bin covers only with holes
        t.doc["record_count"] = 2**26
        os.truncate(store / "entries.bin", 2**26 * t.recs.itemsize)
    else:  # a shard of 1 TiB, index.json agreeing on its size
        i = int(rng.integers(len(shards(t))))
        os.truncate(store / t.doc["shards"][i]["file"], 1 << 40)
        t.doc["shards"][i]["bytes"] = 1 << 40
    return f"sparse: {how}"


def m_stamp(rng, t: Target) -> str:
    """commit.stamp with its checksum recomputed and ids of any size."""
    real = stamp.read(t.sandbox / "store")
    assert real is not None
    key = _pick(rng, ["generation", "next_entry_id", "record_count"])
    value = _pick(rng, [0, getattr(real, key) + 1, 2**40, 2**63 - 1, 2**63, 2**64 - 1])
    crafted = dataclasses.replace(real, **{key: value})
    (t.sandbox / "store" / "commit.stamp").write_bytes(stamp.encode(crafted))
    return f"commit.stamp {key} = {value}"


INDEX_MUTATIONS: list[Callable[[np.random.Generator, Target], str]] = [
    m_shard_name,
    m_shard_number,
    m_shard_uid,
    m_shard_list,
    m_counter,
    m_pending_rename,
    m_pending_delete,
    m_pending_updates,
    m_config,
    m_index_text,
]
RECORD_MUTATIONS: list[Callable[[np.random.Generator, Target], str]] = [m_record_field, m_record_order]
# Mutations of the files themselves, applied after the records are written back.
FILE_MUTATIONS: list[Callable[[np.random.Generator, Target], str]] = [m_record_file, m_sparse_file, m_stamp]
MUTATIONS = INDEX_MUTATIONS + RECORD_MUTATIONS + FILE_MUTATIONS
# The mutations whose numbers could size an allocation or a loop.
COUNT_MUTATIONS = [
    m_counter,
    m_shard_number,
    m_shard_list,
    m_pending_updates,
    m_record_field,
    m_record_file,
    m_sparse_file,
    m_stamp,
]


def make_case(
    template: Path, where: Path, seed: int, kinds: list[Callable[[np.random.Generator, Target], str]] | None = None
) -> tuple[Path, list[str]]:
    """A sandbox whose store had 1 to 3 mutations (case `seed`) of `kinds`
    (default: all); case i < len(kinds) applies kind i alone, so every kind
    is covered."""
    sandbox = _new_sandbox(template, where)
    store = sandbox / "store"
    rng = np.random.default_rng(seed)
    doc = read_doc(store)
    t = Target(doc, read_records(store, doc).copy(), sandbox, copy.deepcopy(doc))
    pool = kinds or MUTATIONS
    if seed < len(pool):
        chosen = [pool[seed]]
    else:
        chosen = [_pick(rng, pool) for _ in range(int(rng.integers(1, 4)))]
    done = [mutate(rng, t) for mutate in chosen if mutate not in FILE_MUTATIONS]
    if t.records_changed:
        write_records(store, t.recs)
    done += [mutate(rng, t) for mutate in dict.fromkeys(chosen) if mutate in FILE_MUTATIONS]
    write_doc(store, t.doc)
    if t.raw_index is not None:
        (store / "index.json").write_bytes(t.raw_index)
    return sandbox, done


class _OverBudget(BaseException):
    """Not an Exception: the command line must not catch it."""


@contextlib.contextmanager
def _case_budget(what: str):
    """The time budget of one fuzz case, a hang guard: its nine commands on
    a store of a few kilobytes take about a second, even on a busy machine
    well under a minute; work that followed a crafted size (a terabyte of
    holes scanned, 2**36 records) would take hours."""

    def over(signum, frame):
        raise _OverBudget(f"{what} ran past its budget of {CASE_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, over)
    signal.alarm(CASE_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def fuzz(
    template: Path, work: Path, seeds: range, kinds: list[Callable[[np.random.Generator, Target], str]] | None = None
) -> dict[str, Any]:
    """Run every command on each case; returns the figures."""
    figures = {
        "cases": 0,
        "commands": 0,
        "outside_changed": 0,
        "internal_errors": 0,
        "codes": {},
        "mutations": 0,
        "slowest_case_s": 0.0,
        "largest_case_growth_kib": 0,
    }
    for seed in seeds:
        sandbox, done = make_case(template, work / f"case{seed}", seed, kinds)
        what = f"fuzz case {seed} ({'; '.join(done)})"
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        try:
            with _case_budget(what):
                out = run_all(sandbox)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        # the memory budget: a case's work sized by a claim (terabytes of
        # holes, 2**36 records) would raise the peak far past it
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
        assert growth < CASE_MEMORY_KIB, f"{what} raised peak memory by {growth} KiB"
        figures["slowest_case_s"] = max(figures["slowest_case_s"], round(time.perf_counter() - started, 2))
        figures["largest_case_growth_kib"] = max(figures["largest_case_growth_kib"], growth)
        figures["cases"] += 1
        figures["mutations"] += len(done)
        figures["commands"] += len(out)
        for o in out.values():
            key = f"{o.name}={o.code}"
            figures["codes"][key] = figures["codes"].get(key, 0) + 1
        shutil.rmtree(sandbox)
    return figures


@pytest.mark.stress
def test_fuzzed_stores_never_reach_outside(template, tmp_path):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    figures = fuzz(template, tmp_path, range(FUZZ_CASES))
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert growth < 512 * 1024, f"peak memory grew by {growth} KiB"
    _report("fuzz", **figures, seconds=round(time.perf_counter() - started, 1), maxrss_growth_kib=growth)


_FUZZ_IN_SUBPROCESS = r"""
import importlib.util, json, resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
spec = importlib.util.spec_from_file_location("untrusted_fuzz", {test_file!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module  # its dataclasses look their module up
spec.loader.exec_module(module)
work = Path(sys.argv[1])
template = module._build_template(work / "template")
kinds = [getattr(module, name) for name in sys.argv[3].split(",")]
figures = module.fuzz(template, work, range(int(sys.argv[2])), kinds)
figures["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(figures))
"""


@pytest.mark.stress
def test_fuzzed_stores_stay_within_a_memory_limit(tmp_path):
    """The mutations that claim huge counts, run in a subprocess under an
    address-space limit: an allocation sized by a claimed count would fail."""
    code = _FUZZ_IN_SUBPROCESS.format(limit=MEMORY_LIMIT, test_file=str(Path(__file__).resolve()))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cases = max(20, FUZZ_CASES // 6)
    kinds = ",".join(m.__name__ for m in COUNT_MUTATIONS)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(cases), kinds],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only
        env=env,
        cwd=OUTSIDE_CHECKOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["cases"] == cases
    _report(
        "fuzz-memory-limit",
        cases=figures["cases"],
        commands=figures["commands"],
        limit_mib=MEMORY_LIMIT >> 20,
        maxrss_mib=figures["maxrss_kib"] // 1024,
    )
