"""Stores from untrusted sources, round two (docs/security.md): crafted
numbers never end in an internal error, repair never writes a store it
would refuse, a store hmem has just committed always parses, `verify
--full` finds what a read refuses, text from a store is escaped before it
reaches a terminal, and a hard-linked file changed in place is refused.

Each case copies a small store (tests/test_untrusted.py's patterns: the
checksums of what is crafted are recomputed, so the crafted values reach
past them) and drives the ``hmem`` command line.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.formats import records, stamp

# A format test: index.json's checksum is recomputed exactly as hmem does
# (docs/format.md), so that a crafted document passes it as an attacker's would.
from hmem.formats.manifest import MAX_COUNT, MAX_FILE_BYTES, _checksum
from hmem.kernels import checksum as checksum_kernels

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
U64_MAX = (1 << 64) - 1


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
    root = tmp_path_factory.mktemp("untrusted_reports") / "sandbox"
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


def run(*args: object, env: dict[str, Any] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})})


def run_checked(*args: object, env: dict[str, Any] | None = None):
    """Run one command: a documented exit code and, when it fails, one
    clear error line; never an internal error or a traceback."""
    result = run(*args, env=env)
    context = f"{args}: exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    assert result.exception is None or isinstance(result.exception, SystemExit), context
    assert result.exit_code in DOCUMENTED_EXIT_CODES, context
    text = result.stdout + result.stderr
    assert "internal error" not in text and "Traceback" not in text, context
    if result.exit_code in (1, 5, 6, 7, 8, 9, 10):
        assert any(line.startswith("error: ") for line in result.stderr.splitlines()), context
    return result


def every_command(sandbox: Path) -> list[list[object]]:
    store = sandbox / "store"
    return [
        ["stats", store],
        ["stats", store, "--json"],
        ["ls", store],
        ["verify", store],
        ["verify", store, "--full"],
        ["query", store, "--query", sandbox / "query.npy", "--layer", 0, "--top-k", 20],
        ["evict", store, "--target", 1, "--yes"],
        ["compact", store],
        ["put", store, sandbox / "kv.safetensors"],
        ["verify", store, "--repair", "--yes"],
    ]


def snapshot(store: Path) -> dict[str, bytes]:
    """Every file of the store and its bytes (the lock file's owner record
    aside: any command may take the lock)."""
    return {
        str(p.relative_to(store)): p.read_bytes()
        for p in sorted(store.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != "lock"
    }


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


def write_stamp(store: Path, generation: int, next_entry_id: int, record_count: int) -> None:
    """commit.stamp with any u64 values, its CRC recomputed (docs/format.md)."""
    head = struct.pack("<8sQQQ", stamp.MAGIC, generation, next_entry_id, record_count)
    (store / "commit.stamp").write_bytes(head + struct.pack("<II", checksum_kernels.crc32c(head), 0))


def assert_sound(sandbox: Path, *, ids_left: bool = True) -> None:
    """The store parses and verifies clean, and a writer can use it (or,
    when its ids are spent, refuses a put cleanly)."""
    store = sandbox / "store"
    assert read_doc(store)["next_entry_id"] <= MAX_COUNT
    for args in (["verify", store, "--full"], ["stats", store]):
        result = run_checked(*args)
        assert result.exit_code == 0, result.output
    result = run_checked("put", store, sandbox / "kv.safetensors")
    if ids_left:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 1 and "next_entry_id would pass" in result.stderr, result.output
    assert run_checked("verify", store).exit_code == 0


# ---- 1. repair and commit.stamp's ids ---------------------------------------------------


@pytest.mark.parametrize(
    "crafted",
    [
        pytest.param(lambda doc: (doc["generation"] + 5, U64_MAX, doc["record_count"]), id="next-id-u64-max"),
        pytest.param(lambda doc: (doc["generation"] + 5, 1 << 63, doc["record_count"]), id="next-id-2^63"),
        pytest.param(lambda doc: (doc["generation"] + 5, MAX_COUNT - 1, doc["record_count"]), id="next-id-near-max"),
        pytest.param(lambda doc: (U64_MAX, doc["next_entry_id"], doc["record_count"]), id="generation-u64-max"),
        pytest.param(lambda doc: (doc["generation"] + 5, doc["next_entry_id"], U64_MAX), id="record-count-u64-max"),
    ],
)
def test_repair_never_trusts_a_stamp_past_its_bounds(sandbox, crafted):
    store = sandbox / "store"
    write_stamp(store, *crafted(read_doc(store)))
    for args in every_command(sandbox)[:6]:
        run_checked(*args)
    result = run_checked("verify", store, "--repair", "--yes")
    assert result.exit_code == 0, result.output
    # a stamp within bounds is trusted: every id it reserved stays spent
    assert_sound(sandbox, ids_left=read_doc(store)["next_entry_id"] < MAX_COUNT)
    again = run_checked("verify", store, "--repair", "--yes")
    assert again.exit_code == 0, again.output


def test_a_store_an_earlier_repair_wrote_past_the_bounds_is_repaired(sandbox):
    """What a repair that trusted a crafted stamp left: index.json's
    next_entry_id past 2**63 (refused by every command) and the stamp."""
    store = sandbox / "store"
    doc = read_doc(store)
    write_stamp(store, doc["generation"] + 2, U64_MAX, doc["record_count"])
    doc["next_entry_id"] = U64_MAX + 4097
    write_doc(store, doc)
    assert run_checked("stats", store).exit_code == 1
    result = run_checked("verify", store, "--repair", "--yes")
    assert result.exit_code == 0, result.output
    assert_sound(sandbox)


# ---- 2. numbers >= 2**63 in entries.bin ----------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("entry_id", U64_MAX),
        ("entry_id", 1 << 63),
        ("n_tokens", 0xFFFFFFFF),
        ("layer_idx", 0xFFFFFFFF),
        ("timestamp", U64_MAX),
        ("access_count", 0xFFFFFFFF),
        ("shard_idx", 0xFFFFFFFE),
    ],
)
def test_records_with_huge_fields_are_never_an_internal_error(sandbox, field, value):
    store = sandbox / "store"
    doc = read_doc(store)
    recs = read_records(store, doc)
    live = np.flatnonzero(recs["shard_idx"] != records.EVICTED)
    recs[field][live[-1]] = value
    write_records(store, recs)
    for args in every_command(sandbox):
        run_checked(*args)
    # whatever was refused, a repair leaves a store hmem reads
    run_checked("verify", store, "--repair", "--yes")
    assert_sound(sandbox)


# ---- 3. a store hmem has just committed always parses --------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [("next_entry_id", MAX_COUNT), ("generation", MAX_COUNT - 1), ("generation", MAX_COUNT)],
)
def test_a_put_past_a_counters_bound_is_refused_and_changes_nothing(sandbox, field, value):
    store = sandbox / "store"
    doc = read_doc(store)
    doc[field] = value
    write_doc(store, doc)
    assert run_checked("stats", store).exit_code == 0
    before = snapshot(store)
    result = run_checked("put", store, sandbox / "kv.safetensors")
    assert result.exit_code == 1, result.output
    assert "would pass" in result.stderr
    assert snapshot(store) == before
    assert run_checked("stats", store).exit_code == 0


def test_an_evict_at_the_generation_bound_is_refused_and_changes_nothing(sandbox):
    store = sandbox / "store"
    doc = read_doc(store)
    doc["generation"] = MAX_COUNT
    write_doc(store, doc)
    before = snapshot(store)
    result = run_checked("evict", store, "--target", 1, "--yes")
    assert result.exit_code == 1, result.output
    assert "generation would pass" in result.stderr
    assert snapshot(store) == before
    assert run_checked("stats", store).exit_code == 0


@pytest.mark.parametrize("counter", ["dead_entries", "dead_bytes"])
def test_an_evict_keeps_dead_counters_within_their_bounds(sandbox, counter):
    store = sandbox / "store"
    doc = read_doc(store)
    for shard in doc["shards"]:  # at the bound, its live entries still live
        shard[counter] = shard["entries"] if counter == "dead_entries" else MAX_FILE_BYTES
    write_doc(store, doc)
    assert run_checked("stats", store).exit_code == 0
    result = run_checked("evict", store, "--target", 1, "--yes")
    assert result.exit_code == 0, result.output
    for args in (["stats", store], ["verify", store]):
        assert run_checked(*args).exit_code in (0, 3), args  # parses: at most warnings
    assert all(s[counter] <= MAX_FILE_BYTES and s["dead_entries"] <= s["entries"] for s in read_doc(store)["shards"])


# ---- 6. a hard-linked sources.jsonl --------------------------------------------------------


def test_a_hard_linked_import_registry_is_refused_at_open(sandbox):
    store = sandbox / "store"
    assert run_checked("put", store, sandbox / "kv.safetensors").exit_code == 0  # writes sources.jsonl
    os.link(store / "sources.jsonl", sandbox / "registry-elsewhere.jsonl")
    other = sandbox / "kv2.safetensors"
    kv = np.random.default_rng(4).standard_normal((3, D)).astype(np.float32)
    save_file({"keys": kv, "values": kv}, str(other))
    before = snapshot(store)
    outside = (sandbox / "registry-elsewhere.jsonl").read_bytes()
    result = run_checked("put", store, other)
    assert result.exit_code == 1, result.output
    assert "sources.jsonl" in result.stderr and "copy the store directory" in result.stderr
    assert snapshot(store) == before  # no orphan shard, nothing appended
    assert (sandbox / "registry-elsewhere.jsonl").read_bytes() == outside


# ---- 5. control characters from a store are shown, never sent to the terminal -------------

EVIL = "evil\x1b]0;owned\x07\x1b[2J\x9b31m\r"  # a title, a clear screen, a C1 CSI, a carriage return


def assert_escaped(result) -> None:
    text = result.stdout + result.stderr
    assert not any(c in text for c in "\x1b\x07\x9b\r"), repr(text)
    assert "\\x1b" in text, text


def test_control_characters_in_entry_metadata_are_escaped(sandbox):
    store = sandbox / "store"
    evil_file = sandbox / f"{EVIL}.safetensors"
    shutil.copy(sandbox / "kv.safetensors", evil_file)
    assert_escaped(run_checked("put", store, evil_file))
    listed = json.loads(run_checked("ls", store, "--json").stdout)
    entry_id = max(e["entry_id"] for e in listed["entries"])
    show = run_checked("show", store, entry_id)
    assert show.exit_code == 0, show.output
    assert_escaped(show)
    # JSON output is escaped by json: the name comes back whole
    shown = run_checked("show", store, entry_id, "--json").stdout
    assert "\x1b" not in shown and json.loads(shown)["meta"]["source"] == f"{EVIL}.safetensors"
    # the import registry's name, quoted when the same file comes again
    assert_escaped(run_checked("put", store, evil_file))
    # a query's rows, and the error path: a file named so that does not exist
    query = run_checked("query", store, "--query", sandbox / "query.npy", "--layer", 0, "--top-k", 20)
    assert "\x1b" not in query.stdout + query.stderr
    assert_escaped(run_checked("put", store, sandbox / f"{EVIL}-missing.safetensors"))


def test_control_characters_in_the_lock_owner_are_escaped(sandbox):
    import fcntl

    store = sandbox / "store"
    fd = os.open(store / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another holder (its own open file: flocks conflict)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": 1, "host": EVIL, "command": EVIL, "since": EVIL}).encode())
        before = snapshot(store)
        result = run_checked("put", store, sandbox / "kv.safetensors")
        assert result.exit_code != 0 and "locked" in result.stderr, result.output
        assert_escaped(result)
        assert snapshot(store) == before
    finally:
        os.close(fd)


# ---- 4. verify --full finds what a read refuses --------------------------------------------


def craft_index(store: Path, shard: int, change) -> None:
    """Change a shard's hmem_index with `change(rows)` (in place, on an
    int64 [entries + 1, 12] array) and record its new CRC-32C where hmem
    looks for it (index.json and the header's crc32c:hmem_index, the same
    length), as an attacker can."""
    path = store / f"shard_{shard:04d}.safetensors"
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack_from("<Q", data, 0)
    doc = read_doc(store)
    info = doc["shards"][shard]
    start = 8 + length
    rows = np.frombuffer(bytes(data[start : start + (info["entries"] + 1) * 96]), dtype="<i8").reshape(-1, 12).copy()
    old_crc = checksum_kernels.crc32c(rows.tobytes())
    change(rows)
    new_crc = checksum_kernels.crc32c(rows.tobytes())
    data[start : start + rows.nbytes] = rows.tobytes()
    data = data.replace(f"crc32c:{old_crc:08x}".encode(), f"crc32c:{new_crc:08x}".encode())
    path.write_bytes(bytes(data))
    info["index_crc"] = new_crc
    write_doc(store, doc)


def shard_with_live_entries(store: Path, at_least: int) -> int:
    doc = read_doc(store)
    recs = read_records(store, doc)
    live = recs["shard_idx"][recs["shard_idx"] != records.EVICTED]
    counts = np.bincount(live, minlength=len(doc["shards"]))
    return int(np.flatnonzero(counts >= at_least)[0])


def read_every_entry(sandbox: Path):
    store = sandbox / "store"
    listed = json.loads(run_checked("ls", store, "--json").stdout)["entries"]
    return [run_checked("show", store, e["entry_id"]) for e in listed]


def swap_first_rows(rows: np.ndarray) -> None:
    rows[[1, 2]] = rows[[2, 1]]


def other_uid(rows: np.ndarray) -> None:
    rows[0, 3] ^= 1


@pytest.mark.parametrize(
    "change,code",
    [
        pytest.param(swap_first_rows, "shard.index", id="ids-out-of-order"),
        pytest.param(other_uid, "shard.uid", id="uid"),
    ],
)
def test_verify_full_reports_an_index_a_read_refuses(sandbox, change, code):
    store = sandbox / "store"
    craft_index(store, shard_with_live_entries(store, 2), change)
    refused = [r for r in read_every_entry(sandbox) if r.exit_code != 0]
    assert refused, "a read refuses some entry of the crafted shard"
    result = run_checked("verify", store, "--full", "--json")
    assert result.exit_code == 4, result.output
    assert code in {f["code"] for f in json.loads(result.stdout)["verify"]["findings"]}, result.stdout
    assert run_checked("verify", store, "--repair", "--yes").exit_code == 0
    assert all(r.exit_code == 0 for r in read_every_entry(sandbox))
    assert run_checked("verify", store, "--full").exit_code == 0


def test_verify_full_reports_metadata_a_read_refuses(sandbox):
    store = sandbox / "store"
    assert run_checked("put", store, sandbox / "kv.safetensors").exit_code == 0  # an entry with metadata
    listed = json.loads(run_checked("ls", store, "--json").stdout)["entries"]
    newest = max(listed, key=lambda e: e["entry_id"])
    entry_id = newest["entry_id"]
    path = store / f"shard_{newest['shard']:04d}.safetensors"
    data = path.read_bytes()
    key = f'"meta:{entry_id}":"{{'.encode()
    if key not in data:
        key = f'"meta:{entry_id}": "{{'.encode()
    assert key in data
    path.write_bytes(data.replace(key, key[:-1] + b"["))  # the same length: a JSON list, not an object
    shown = run_checked("show", store, entry_id)
    assert shown.exit_code == 1 and "metadata" in shown.stderr, shown.output
    result = run_checked("verify", store, "--full", "--json")
    assert result.exit_code == 4, result.output
    assert any(
        f["code"] == "shard.header" and f.get("entry_id") == entry_id
        for f in json.loads(result.stdout)["verify"]["findings"]
    ), result.stdout
