"""Untrusted local stores (docs/security.md, "Bounded memory and time"):
what a command costs is bounded by the bytes really on disk, never by a
number or a size a store's files claim for free.

- a pending record update naming a record entries.bin does not hold never
  grows entries.bin (a writer's open wrote it before the count was checked);
- a sparse entries.bin (committed records in holes, or a huge sparse tail)
  is read only as far as its data goes;
- without index.json, repair takes the shard files found, not a list sized
  by the highest number a shard-like name carries;
- a shard that is mostly holes is refused by reads, reported by verify and
  never copied, while a copy made with ``cp --sparse=always`` (holes for
  runs of zeros) still reads and verifies;
- the size of a file a shard links to appears in no output.

Each crafted case runs its commands in a subprocess under an address-space
limit (an allocation sized by a claim fails there) with a hang guard; the
figures (seconds, max RSS) are printed as FIGURES lines (pytest -s).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app

# A format test: index.json's checksum is recomputed exactly as hmem does
# (as tests/test_untrusted.py does), so that a crafted document passes it.
from hmem.formats.manifest import _checksum
from hmem.formats.records import UPDATE_DTYPE

D, HDC = 16, 256
SIG_BYTES = HDC // 8
SHARD_BYTES = 2400  # small shards: the store has several
LIMIT = 2_000_000_000  # address space of the subprocess (prlimit --as=2000000000)
HANG_GUARD = 600  # seconds: work sized by a claim would run far longer (never a timing assertion)
OUTSIDE_CHECKOUT = tempfile.gettempdir()  # subprocesses import the installed hmem


def _report(name: str, got: dict) -> None:
    runs = got["runs"]
    line = {
        "kind": "untrusted-bounds",
        "name": name,
        "commands": len(runs),
        "slowest_s": round(max(r["seconds"] for r in runs), 3),
        "maxrss_mib": got["maxrss_kib"] // 1024,
    }
    print("FIGURES", json.dumps(line))
    log = os.environ.get("HMEM_RELIABILITY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")


def _fill(path: Path, seed: int) -> None:
    """A store of 12 entries in 2 layers over several shards, 2 evicted."""
    rng = np.random.default_rng(seed)
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, shard_max_bytes=SHARD_BYTES) as store:
        for i in range(12):
            keys = rng.standard_normal((1 + i % 3, D)).astype(np.float32)
            store.put(keys, keys * 0.5, layer_idx=i % 2, importance=0.1 if i in (4, 9) else 1.0 + i)
        store.flush()
        store.evict(10)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bounds") / "sandbox"
    root.mkdir()
    _fill(root / "store", 1)
    rng = np.random.default_rng(3)
    np.save(root / "query.npy", rng.standard_normal((2, D)).astype(np.float32))
    kv = rng.standard_normal((2, D)).astype(np.float32)
    save_file({"keys": kv, "values": kv}, str(root / "kv.safetensors"))
    return root


@pytest.fixture
def sandbox(template, tmp_path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "sandbox", symlinks=True))


def read_doc(store: Path) -> dict:
    doc = json.loads((store / "index.json").read_text())
    doc.pop("checksum")
    return doc


def write_doc(store: Path, doc: dict) -> None:
    """index.json with its checksum recomputed (anyone can: it is a CRC)."""
    body = json.dumps({**doc, "checksum": f"crc32c:{_checksum(doc):08x}"}, indent=1) + "\n"
    (store / "index.json").write_bytes(body.encode())


def encode_updates(updates: np.ndarray) -> str:
    return base64.b64encode(updates.tobytes()).decode("ascii")


def store_state(store: Path) -> dict[str, tuple]:
    """Each file of the store: kind, apparent size, allocated blocks, mtime
    and (for a file of up to 1 MiB) its bytes; never reads a large file."""
    state: dict[str, tuple] = {}
    for path in sorted(store.rglob("*")):
        st = path.lstat()
        if stat.S_ISREG(st.st_mode):
            data = path.read_bytes() if st.st_size <= 1 << 20 else None
            state[str(path.relative_to(store))] = (st.st_size, st.st_blocks, st.st_mtime_ns, data)
        else:
            state[str(path.relative_to(store))] = (
                stat.S_IFMT(st.st_mode),
                os.readlink(path) if path.is_symlink() else "",
            )
    return state


_BOUNDED = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from typer.testing import CliRunner
from hmem.cli.app import app
out = []
for args in json.loads(sys.argv[1]):
    started = time.perf_counter()
    result = CliRunner().invoke(app, args, env={{"COLUMNS": "200", "HMEM_DEBUG": None, "NO_COLOR": "1"}})
    out.append({{"args": args, "code": result.exit_code, "seconds": time.perf_counter() - started,
                "exception": repr(result.exception), "stderr": result.stderr[-2000:],
                "stdout": result.stdout[-20000:]}})
print(json.dumps({{"runs": out, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""


def run_bounded(argv: list[list[Any]]) -> dict:
    """The commands in one subprocess under the address-space limit."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HMEM_CRASH_AT", None)
    proc = subprocess.run(
        [sys.executable, "-c", _BOUNDED.format(limit=LIMIT), json.dumps([[str(a) for a in args] for args in argv])],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        env=env,
        cwd=OUTSIDE_CHECKOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_clean(run_: dict, codes: tuple[int, ...] = (1, 4)) -> None:
    """Refused or reported: a documented code, no internal error or traceback."""
    text = run_["stdout"] + run_["stderr"]
    assert run_["code"] in codes, run_
    assert "internal error" not in text and "Traceback" not in text and "MemoryError" not in text, run_
    if run_["code"] == 1:
        assert any(line.startswith("error: ") for line in run_["stderr"].splitlines()), run_


def writers(sandbox: Path) -> list[list[Any]]:
    store = sandbox / "store"
    return [
        ["put", store, sandbox / "kv.safetensors"],
        ["evict", store, "--target", 1, "--yes"],
        ["compact", store],
    ]


def readers(sandbox: Path) -> list[list[Any]]:
    store = sandbox / "store"
    return [
        ["stats", store],
        ["stats", store, "--json"],
        ["verify", store],
        ["verify", store, "--full"],
        ["query", store, "--query", sandbox / "query.npy", "--layer", 0],
    ]


# ---- 1. a pending record update past the records entries.bin holds ---------------------------


@pytest.mark.parametrize("claim", [2**20, 2**36])
def test_a_pending_update_past_the_records_never_grows_entries_bin(sandbox, claim):
    """record_count claims `claim` records (parse bounds it, not the file),
    and one pending update names the last: a writer's open wrote it in place
    before the count was checked, growing entries.bin to a sparse file (4.5
    TiB at 2^36) that verify --repair then read whole."""
    store = sandbox / "store"
    doc = read_doc(store)
    doc["record_count"] = claim
    doc["next_entry_id"] = max(doc["next_entry_id"], claim + 1)
    update = np.zeros(1, dtype=UPDATE_DTYPE)
    update["position"] = claim - 1
    doc["pending"]["record_updates"] = encode_updates(update)
    write_doc(store, doc)
    assert len((store / "index.json").read_bytes()) < 4096
    before = store_state(store)
    got = run_bounded([*writers(sandbox), *readers(sandbox), ["verify", store, "--repair", "--yes", "--dry-run"]])
    for run_ in got["runs"]:
        assert_clean(run_)
    for run_ in got["runs"][:3]:  # the writers: refused, naming what is wrong
        assert "records" in run_["stderr"], run_
    after = store_state(store)
    after.pop("lock", None), before.pop("lock", None)  # a writer's lock file is the lock's own business
    assert after == before
    assert (store / "entries.bin").stat().st_size < 4096
    _report(f"pending-update-{claim}", got)


# ---- 2. a sparse entries.bin ----------------------------------------------------------------------


def test_committed_records_in_holes_are_refused_without_reading_them(sandbox):
    """A 56 KiB store whose index.json claims 2^26 records and whose
    entries.bin is extended sparse to hold them: the size check passed, and
    stats read 4.8 GB of holes."""
    store = sandbox / "store"
    doc = read_doc(store)
    claim = 2**26
    doc["record_count"] = claim
    doc["next_entry_id"] = claim + 1
    write_doc(store, doc)
    os.truncate(store / "entries.bin", claim * doc["record_size"])
    before = store_state(store)
    got = run_bounded([*readers(sandbox), ["verify", store, "--repair", "--yes", "--dry-run"], *writers(sandbox)])
    for run_ in got["runs"]:
        assert_clean(run_)
    verify = got["runs"][2]
    assert verify["code"] == 4 and "entries.sparse" in verify["stdout"], verify
    assert "holes" in got["runs"][0]["stderr"], got["runs"][0]
    after = store_state(store)
    after.pop("lock", None), before.pop("lock", None)
    assert after == before
    _report("entries-sparse-committed", got)


def test_a_sparse_tail_past_the_commit_is_never_read(sandbox):
    """4 GiB of holes past the committed records: verify read them all (170
    s, 8.9 GB). Readers report the tail and leave it; its holes are never read."""
    store = sandbox / "store"
    size = (store / "entries.bin").stat().st_size
    os.truncate(store / "entries.bin", size + (4 << 30))
    before = store_state(store)
    argv = [
        ["stats", store],
        ["stats", store, "--json"],
        ["verify", store],
        ["query", store, "--query", sandbox / "query.npy", "--layer", 0],
    ]
    got = run_bounded(argv)
    for run_ in got["runs"]:
        assert_clean(run_, (0, 4))
    assert got["runs"][2]["code"] == 4 and "entries.tail" in got["runs"][2]["stdout"], got["runs"][2]
    assert store_state(store) == before
    _report("entries-sparse-tail", got)


# ---- 3. repair without index.json and a shard-like name of a huge number -----------------------


def test_repair_sizes_its_shard_list_by_the_files_found(sandbox):
    """No index.json and one empty shard_999999999.safetensors: repair made
    a list of a billion shards (73 s, then MemoryError)."""
    store = sandbox / "store"
    (store / "index.json").unlink()
    (store / "shard_999999999.safetensors").write_bytes(b"")
    live = 10  # 12 put, 2 evicted (their records lost with index.json: repair may bring them back)
    got = run_bounded([["verify", store, "--repair", "--yes"], ["stats", store, "--json"]])
    repair, stats = got["runs"]
    assert_clean(repair, (0,))
    assert_clean(stats, (0,))
    assert json.loads(stats["stdout"])["entries"] >= live, stats
    _report("repair-shard-name", got)


# ---- 4. sparse shards -------------------------------------------------------------------------------


def _grow_shard_sparse(store: Path, size: int) -> str:
    """The first shard extended with holes to `size` bytes, index.json
    recording that size (so the size check passes)."""
    doc = read_doc(store)
    info = doc["shards"][0]
    os.truncate(store / info["file"], size)
    info["bytes"] = size
    write_doc(store, doc)
    return info["file"]


def test_a_shard_that_is_mostly_holes_is_reported_refused_and_never_copied(sandbox):
    """A shard extended to 1 TiB of holes: quick verify scanned it all (over
    13 minutes, 17 GB); hmem copy wrote its apparent size for real."""
    store = sandbox / "store"
    name = _grow_shard_sparse(store, 1 << 40)
    before = store_state(store)
    copy_to = sandbox / "copy"
    argv = [
        ["verify", store],
        ["verify", store, "--full"],
        ["show", store, 1],
        ["copy", store, copy_to],
        ["stats", store],
        ["verify", store, "--repair", "--yes", "--dry-run"],
    ]
    got = run_bounded(argv)
    verify, full, get, copy, stats, repair = got["runs"]
    for run_ in (verify, full):
        assert_clean(run_, (4,))
        assert "shard.sparse" in run_["stdout"] and name in run_["stdout"], run_
    for run_ in (get, copy):
        assert_clean(run_, (1,))
        assert "holes" in run_["stderr"] and name in run_["stderr"], run_
    assert_clean(stats, (0, 1, 4))
    assert_clean(repair, (0, 1, 4))
    assert "drop nothing" in repair["stdout"], repair  # its entries lie in its data: none is dropped
    assert not copy_to.exists() or not any(copy_to.iterdir())
    after = store_state(store)
    after.pop("lock", None), before.pop("lock", None)
    assert after == before
    _report("shard-sparse", got)


def test_a_copy_whose_holes_stand_for_zeros_reads_as_the_store(tmp_path):
    """A store copied with holes for its runs of zero bytes (what ``cp
    --sparse=always`` makes) reads, verifies and copies as the original."""
    original = tmp_path / "original"
    zeros = np.zeros((2048, D), dtype=np.float32)  # 128 KiB of zero values: several whole blocks
    keys = np.random.default_rng(5).standard_normal((2048, D)).astype(np.float32)
    with hmem.Store.create(original, embed_dim=D, hdc_dim=HDC) as store:
        entry = store.put(keys, zeros)
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    holes = 0
    for path in original.iterdir():
        if not path.is_file() or path.name == "lock":
            continue
        data = path.read_bytes()
        with open(sparse / path.name, "wb") as f:
            block = 4096
            for at in range(0, len(data), block):
                piece = data[at : at + block]
                if len(piece) == block and not any(piece):
                    f.seek(at + block)  # a hole for a whole block of zeros, as cp --sparse=always leaves
                    holes += 1
                else:
                    f.seek(at)
                    f.write(piece)
            f.truncate(len(data))
    assert holes >= 16
    shard = next(sparse.glob("shard_*.safetensors"))
    assert shard.stat().st_blocks * 512 < shard.stat().st_size  # the file system made holes
    runner = CliRunner()
    full = runner.invoke(app, ["verify", str(sparse), "--full"])
    assert full.exit_code == 0, full.stdout + full.stderr
    with hmem.Store.open(sparse, read_only=True) as store:
        got = store.get(entry)
        np.testing.assert_array_equal(np.asarray(got.values, dtype=np.float32), zeros)
    copied = runner.invoke(app, ["copy", str(sparse), str(tmp_path / "copied")])
    assert copied.exit_code == 0, copied.stdout + copied.stderr
    assert runner.invoke(app, ["verify", str(tmp_path / "copied"), "--full"]).exit_code == 0


# ---- 5. a shard that is a link: no size of a file outside the store in any output --------------


def test_a_linked_shard_leaks_no_size(sandbox):
    store = sandbox / "store"
    outside = sandbox / "outside_secret.bin"
    secret_size = 631_277  # a size that appears nowhere else
    outside.write_bytes(b"s" * secret_size)
    doc = read_doc(store)
    name = doc["shards"][0]["file"]
    (store / name).unlink()
    (store / name).symlink_to(outside)
    runner = CliRunner()
    for args in (["stats", str(store)], ["stats", str(store), "--json"], ["verify", str(store)]):
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        text = result.stdout + result.stderr
        assert "Traceback" not in text and "internal error" not in text, text
        assert str(secret_size) not in text and f"{secret_size:,}" not in text, (args, text)
        assert name in text, (args, text)
    stats = runner.invoke(app, ["stats", str(store), "--json"], env={"COLUMNS": "200"})
    problems = json.loads(stats.stdout)["health"]["problems"]
    assert any(name in p and "not a regular file" in p for p in problems), problems


def test_a_store_on_object_storage_is_not_judged_by_its_fetched_heads(s3_server, s3_url):
    """The quick check of a store on object storage fetches each shard's
    head only, into a sparse local copy: its holes are by design, and a
    shard of several MiB (past the hole slack) is not reported sparse."""
    rng = np.random.default_rng(7)
    with hmem.Store.create(s3_url, embed_dim=D, hdc_dim=HDC, shard_max_bytes=32 << 20) as store:
        for _ in range(4):
            keys = rng.standard_normal((16384, D)).astype(np.float32)  # 1 MiB of keys and as much of values
            store.put(keys, keys)
    with hmem.Store.open(s3_url, read_only=True) as reader:
        assert max(shard.bytes for shard in reader.stats().shards) > 6 << 20  # past 2x a fetched head + slack
    quick = hmem.verify(s3_url)
    assert quick.ok, quick.findings
    assert hmem.verify(s3_url, full=True).ok
