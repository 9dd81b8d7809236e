"""Integrity (docs/reliability.md): damage a small store in every way the issue lists and
check that ``verify`` names the damage, that opening and querying either
refuse with a clear hmem error or return exactly the right data, and that
``repair`` leaves a clean store holding every entry whose data survived.

Also torn tails: a writer killed after writing a flush's shard and records
but before its commit, with entries.bin and the newest shard then cut at
every byte of what that flush wrote; a writer recovers exactly the committed
state and a reader sees it without writing.

The store under test (tests/conftest.py, ``reliability_template``): entries
1..14 in layers 0, 1, 2 (entry i in layer (i - 1) % 3), five shards of two
or three entries, entries 3, 8 and 12 evicted; built F32 and INT8.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem import Store
from hmem.cli.app import app

HDC = 256
RECORD = 40 + HDC // 8
CLI_ENV = {"COLUMNS": "200", "NO_COLOR": "1", "HMEM_DEBUG": None}

# Field offsets of a record (docs/format.md).
F_ENTRY_ID, F_LAYER, F_N_TOKENS, F_IMPORTANCE, F_TIMESTAMP, F_ACCESS, F_SHARD, F_CHECKSUM, F_SIGNATURE = (
    0,
    8,
    12,
    16,
    20,
    28,
    32,
    36,
    40,
)

TARGET = 5  # the entry whose tensors and record are damaged: shard 1 (entries 4, 5, 6), layer 1


# ---- reading a shard the way any safetensors reader would ------------------------------


def shard_header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw, 0)
    return length, json.loads(raw[8 : 8 + length])


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute [start, end) of a tensor's bytes in a shard file."""
    length, header = shard_header(path)
    start, end = header[name]["data_offsets"]
    return 8 + length + start, 8 + length + end


def entries_past(path: Path, cut: int) -> set[int]:
    """Entries with a byte of their keys, values or scales at or past file
    offset `cut` (a lost pooled key is found again: repair takes it from
    pooled.bin)."""
    length, header = shard_header(path)
    return {
        int(name.split("_")[1])
        for name, spec in header.items()
        if name not in ("__metadata__", "hmem_index")
        and not name.startswith("p_")
        and 8 + length + spec["data_offsets"][1] > cut
    }


def flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def shard_path(root: Path, tpl, entry_id: int) -> Path:
    return root / f"shard_{tpl.shard_of[entry_id]:04d}.safetensors"


def record_position(tpl, entry_id: int) -> int:
    return int(np.flatnonzero(tpl.records["entry_id"] == entry_id)[0])


def live_in_shard(tpl, entry_id: int) -> set[int]:
    return {i for i, s in tpl.shard_of.items() if s == tpl.shard_of[entry_id]}


# ---- the damage ----------------------------------------------------------------------------


def delete_shard(root, tpl):
    shard_path(root, tpl, 7).unlink()


def cut_shard(amount: str):
    def damage(root, tpl):
        path = shard_path(root, tpl, 7)
        size = path.stat().st_size
        truncate(path, {"1": size - 1, "8": size - 8, "half": size // 2}[amount])

    return damage


def cut_shard_lost(amount: str):
    def lost(tpl):
        path = shard_path(tpl.path, tpl, 7)
        size = path.stat().st_size
        return entries_past(path, {"1": size - 1, "8": size - 8, "half": size // 2}[amount]) & tpl.live

    return lost


def flip_header_brace(root, tpl):
    flip(shard_path(root, tpl, TARGET), 8, 0)  # the JSON's opening "{" becomes "z"


def flip_header_length(root, tpl):
    flip(shard_path(root, tpl, TARGET), 0, 3)  # the header length word, off by 8


def flip_header_crc(root, tpl):
    """A digit of the recorded CRC-32C of k_5 in __metadata__ (the JSON stays valid)."""
    path = shard_path(root, tpl, TARGET)
    raw = path.read_bytes()
    key = f'"crc32c:k_{TARGET}":"'.encode()
    at = raw.index(key) + len(key)
    at += next(i for i, c in enumerate(raw[at : at + 8]) if c in b"0123456789bcde")
    flip(path, at, 0)


def flip_index_row(root, tpl):
    """n_tokens of entry 5's row of hmem_index."""
    path = shard_path(root, tpl, TARGET)
    start, _ = tensor_span(path, "hmem_index")
    row = sorted(live_in_shard(tpl, TARGET)).index(TARGET) + 1
    flip(path, start + (row * 12 + 1) * 8, 0)


def flip_index_uid(root, tpl):
    """The shard uid in the header row of hmem_index."""
    path = shard_path(root, tpl, TARGET)
    start, _ = tensor_span(path, "hmem_index")
    flip(path, start + 3 * 8 + 2, 5)


def flip_tensor(kind: str):
    def damage(root, tpl):
        path = shard_path(root, tpl, TARGET)
        start, end = tensor_span(path, f"{kind}_{TARGET}")
        flip(path, (start + end) // 2, 6)

    return damage


def flip_record(entry_id: int, offset: int, bit: int):
    def damage(root, tpl):
        flip(root / "entries.bin", record_position(tpl, entry_id) * RECORD + offset, bit)

    return damage


def append_junk(root, tpl):
    with open(root / "entries.bin", "ab") as f:
        f.write(b"\xa5" * 13)


def cut_entries(root, tpl):
    path = root / "entries.bin"
    truncate(path, path.stat().st_size - 1)


def delete_entries(root, tpl):
    (root / "entries.bin").unlink()


def delete_index(root, tpl):
    (root / "index.json").unlink()


def garble_index(root, tpl):
    path = root / "index.json"
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2])


def renumber_index(root, tpl):
    """record_count 14 -> 13, valid JSON, old checksum."""
    path = root / "index.json"
    doc = json.loads(path.read_text())
    assert doc["record_count"] == 14
    doc["record_count"] = 13
    path.write_text(json.dumps(doc, indent=1) + "\n")


def orphan_shard(root, tpl):
    shutil.copyfile(root / "shard_0000.safetensors", root / "shard_0099.safetensors")


def temp_file(root, tpl):
    (root / ".hmem-tmp.x").write_bytes(b"half a shard")


def foreign_file(root, tpl):
    (root / "NOTES.txt").write_text("kept by the operator\n")


# ---- the matrix ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    damage: Callable
    findings: dict  # code -> severity: exactly what verify(full=True) reports
    opens: bool  # whether Store.open (reader and writer) accepts the damaged store
    lost: Callable = lambda tpl: set()  # live entries whose data is gone for good
    action: str = "rewritten"  # what repair does
    rebuilt: bool = False  # whether repair rebuilds index.json
    modes: tuple = (False, True)  # quantize_stored settings the case applies to
    record_damage: bool = False  # repair drops a record it cannot trust: listed by position, not id
    unreadable: Callable = lambda tpl: set()  # live entries an open store refuses to read (CorruptStoreError...)
    over_drops: str | None = None  # BUG: repair drops entries whose data survived (why)
    # live entries whose records are lost: repair rebuilds them from their shards (layer 0, importance 1.0)
    rebuilt_entries: Callable = lambda tpl: set()
    # evicted entries whose records are lost in a shard where the store cannot tell them from live
    # ones: repair rebuilds them too, and says so (docs/reliability.md, "What repair keeps")
    back: Callable = lambda tpl: set()

    @property
    def exit_code(self) -> int:
        return 4 if any(s != "info" for s in self.findings.values()) else 0


E, W, I = "error", "warning", "info"  # noqa: E741  (the verify report's three levels)
OVER_DROP_HEADER = (
    "BUG: repair locates and checks tensors only through the shard's JSON header, never "
    "through hmem_index: scan_shard gives up on the whole header at its first bad field (a cut "
    "tail, a flipped byte) and a wrong CRC digit there wins over the index, so repair drops "
    "entries whose data and hmem_index are intact (and which open+query still serve)"
)
OVER_DROP_ORDER = (
    "BUG: repair drops the record after one whose entry_id fails its checksum (the order check "
    "runs on the untrusted id) without listing it in RepairReport.dropped"
)

CASES = [
    Case(
        "shard-deleted",
        delete_shard,
        {"shard.missing": E},
        True,
        lambda tpl: live_in_shard(tpl, 7),
        unreadable=lambda tpl: live_in_shard(tpl, 7),
    ),
    # the cut takes the end of the last tensor; hmem_index still finds the others
    Case(
        "shard-cut-1-byte",
        cut_shard("1"),
        {"shard.size": E, "shard.header": E, "tensor.checksum": E},
        True,
        cut_shard_lost("1"),
        unreadable=lambda tpl: live_in_shard(tpl, 7),
    ),
    Case(
        "shard-cut-8-bytes",
        cut_shard("8"),
        {"shard.size": E, "shard.header": E, "tensor.checksum": E},
        True,
        cut_shard_lost("8"),
        unreadable=lambda tpl: live_in_shard(tpl, 7),
    ),
    # half the file is within the JSON header and hmem_index here: every entry of the shard is lost
    Case(
        "shard-cut-half",
        cut_shard("half"),
        {"shard.size": E, "shard.header": E, "shard.index": E},
        True,
        cut_shard_lost("half"),
        unreadable=lambda tpl: live_in_shard(tpl, 7),
    ),
    # hmem reads shards through hmem_index, so damage to the JSON header alone costs no data
    Case("shard-header-json", flip_header_brace, {"shard.header": E}, True),
    Case(
        "shard-header-length",
        flip_header_length,
        {"shard.header": E},
        True,
        unreadable=lambda tpl: live_in_shard(tpl, TARGET),
    ),
    # a wrong CRC digit in the JSON header: hmem_index's CRC holds, the data is intact
    Case("shard-header-crc", flip_header_crc, {"shard.mismatch": E}, True),
    Case(
        "shard-index-row", flip_index_row, {"shard.index": E}, True, unreadable=lambda tpl: live_in_shard(tpl, TARGET)
    ),
    Case(
        "shard-index-uid", flip_index_uid, {"shard.index": E}, True, unreadable=lambda tpl: live_in_shard(tpl, TARGET)
    ),
    Case(
        "tensor-k",
        flip_tensor("k"),
        {"tensor.checksum": E},
        True,
        lambda tpl: {TARGET},
        unreadable=lambda tpl: {TARGET},
    ),
    Case(
        "tensor-v",
        flip_tensor("v"),
        {"tensor.checksum": E},
        True,
        lambda tpl: {TARGET},
        unreadable=lambda tpl: {TARGET},
    ),
    # queries re-rank with the copy of the key in pooled.bin: none reads the damaged one
    # the pooled key is taken from pooled.bin: the entry is kept
    Case("tensor-p", flip_tensor("p"), {"tensor.checksum": E}, True),
    Case(
        "tensor-ks",
        flip_tensor("ks"),
        {"tensor.checksum": E},
        True,
        lambda tpl: {TARGET},
        modes=(True,),
        unreadable=lambda tpl: {TARGET},
    ),
    Case(
        "tensor-vs",
        flip_tensor("vs"),
        {"tensor.checksum": E},
        True,
        lambda tpl: {TARGET},
        modes=(True,),
        unreadable=lambda tpl: {TARGET},
    ),
    # the fields of a record that fails its checksum are not consulted
    Case(
        "record-entry-id",
        flip_record(TARGET, F_ENTRY_ID + 5, 0),
        {"record.checksum": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {TARGET},
    ),
    Case(
        "record-layer",
        flip_record(TARGET, F_LAYER, 1),
        {"record.checksum": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {TARGET},
    ),
    Case(
        "record-n-tokens",
        flip_record(TARGET, F_N_TOKENS, 0),
        {"record.checksum": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {TARGET},
    ),
    Case(
        "record-shard-idx",
        flip_record(TARGET, F_SHARD + 2, 4),
        {"record.checksum": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {TARGET},
    ),
    Case(
        "record-access-count",
        flip_record(TARGET, F_ACCESS, 3),
        {"record.checksum": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {TARGET},
    ),
    Case(
        "record-checksum",
        flip_record(TARGET, F_CHECKSUM, 7),
        {"record.checksum": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {TARGET},
    ),
    Case("record-of-evicted", flip_record(8, F_IMPORTANCE + 3, 2), {"record.checksum": E}, False, record_damage=True),
    Case(
        "signature",
        flip_record(TARGET, F_SIGNATURE + 11, 5),
        {"record.checksum": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {TARGET},
    ),
    Case("entries-junk-tail", append_junk, {"entries.tail": W}, True, action="tidied"),
    Case(
        "entries-cut",
        cut_entries,
        {"entries.truncated": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: {14},
    ),
    Case(
        "entries-deleted",
        delete_entries,
        {"entries.missing": E},
        False,
        record_damage=True,
        rebuilt_entries=lambda tpl: set(tpl.live),
        back=lambda tpl: set(tpl.evicted),
    ),
    Case("index-deleted", delete_index, {"index.missing": E}, False, rebuilt=True),
    Case("index-invalid-json", garble_index, {"index.unreadable": E}, False, rebuilt=True),
    Case("index-old-checksum", renumber_index, {"index.checksum": E}, False, rebuilt=True),
    Case("orphan-shard", orphan_shard, {"file.orphan": W}, True, action="tidied"),
    Case("temp-file", temp_file, {"file.temp": W}, True, action="tidied"),
    Case("foreign-file", foreign_file, {"file.foreign": I}, True, action="none"),
]

MATRIX = [
    pytest.param(case, quantized, id=f"{case.name}-{'int8' if quantized else 'f32'}")
    for case in CASES
    for quantized in case.modes
]

# Filled as the matrix runs; HMEM_RELIABILITY_SUMMARY=<file> writes it out (docs/reliability.md figures).
OUTCOMES: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    target = os.environ.get("HMEM_RELIABILITY_SUMMARY")
    if target and OUTCOMES:
        Path(target).write_text(json.dumps(OUTCOMES, indent=1, sort_keys=True) + "\n")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=CLI_ENV)


def findings_of(report) -> dict:
    out: dict = {}
    for f in report.findings:
        assert out.get(f.code, f.severity) == f.severity, f  # one severity per code
        out[f.code] = f.severity
    return out


@pytest.mark.parametrize(("case", "quantized"), MATRIX)
def test_damage_is_found_refused_or_served_and_repaired(
    case, quantized, reliability_template, clone_store, dir_state, probe_store
):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    case.damage(root, tpl)
    lost = case.lost(tpl)
    outcome = OUTCOMES.setdefault(f"{case.name}-{'int8' if quantized else 'f32'}", {})

    # verify names the damage, with its severity, and writes nothing
    before = dir_state(root)
    report = hmem.verify(root, full=True)
    quick = hmem.verify(root)
    assert dir_state(root) == before
    assert findings_of(report) == case.findings, report.findings
    assert set(findings_of(quick)) <= set(case.findings)
    assert report.ok == (case.exit_code == 0)
    for f in report.findings:
        assert f.message and f.file is not None
    result = cli("verify", root, "--full")
    assert result.exit_code == case.exit_code, result.stdout + result.stderr
    for code in case.findings:
        assert code in result.stdout
    assert dir_state(root) == before
    outcome["detected"] = bool(report.findings)

    # a reader writes nothing; reader and writer refuse or serve exactly the clean data
    reader = probe_store(root, tpl, read_only=True)
    assert dir_state(root) == before
    writer = probe_store(_damaged_copy(root, "writer"), tpl, read_only=False)
    for probe in (reader, writer):
        assert probe.opened == case.opens, probe
        if probe.opened:
            # every query of a layer holding an entry it cannot read refuses (top_k covers the
            # whole layer, so every entry is read); every other query is served
            layers = {tpl.puts[i][2] for i in case.unreadable(tpl)}
            assert probe.refused == sum(layer in layers for _, layer in tpl.queries), probe
            assert probe.served == len(tpl.queries) - probe.refused
    outcome["opened"] = reader.opened
    outcome["open_error"] = reader.open_error.__name__ if reader.open_error else None
    outcome["queries_served"] = reader.served + writer.served
    outcome["queries_refused"] = reader.refused + writer.refused
    outcome["query_errors"] = sorted({e.__name__ for e in reader.errors + writer.errors})

    # repair: clean, opens, keeps every entry it can vouch for, bit for bit, under its id
    fixed = hmem.repair(root)
    assert fixed.action == case.action
    assert fixed.rebuilt_index == case.rebuilt
    assert {f.code for f in fixed.findings} == set(case.findings)
    after = hmem.verify(root, full=True)
    assert after.ok, after.findings
    assert {f.code for f in after.findings} <= {"file.foreign"}
    with Store.open(root, read_only=True) as store:
        kept = set(store.entry_ids())
        assert store.stats().entries == len(kept)
    if case.action == "rewritten":
        assert fixed.entries_kept == len(kept)
    assert set(fixed.rebuilt_entries) == case.rebuilt_entries(tpl) | case.back(tpl)
    assert kept <= (tpl.live - lost) | case.back(tpl), (kept, lost)
    dropped_ids = {i for i, _ in fixed.dropped if i is not None}
    assert not dropped_ids & kept
    missing = tpl.live - kept
    if case.record_damage:
        # the entries of damaged records, which repair cannot name (see the xfail tests below)
        assert missing - dropped_ids <= (lost if case.over_drops != OVER_DROP_ORDER else tpl.live)
        assert any(i is None and why for i, why in fixed.dropped)
    else:
        assert missing == dropped_ids, (missing, fixed.dropped)
    if case.action != "rewritten":
        assert not fixed.dropped and kept == tpl.live
    rebuilt = set(fixed.rebuilt_entries)
    if rebuilt:
        # their K/V exact under their ids (their layer is the one repair was given), then deleted
        # so that the probe compares the rest with the clean store
        with Store.open(root) as store:
            for entry_id in rebuilt:
                got = store.get(entry_id)
                keys, values, _ = tpl.puts[entry_id]
                if entry_id in tpl.kv:
                    keys, values = tpl.kv[entry_id]
                if entry_id in tpl.kv or not tpl.quantized:
                    assert np.asarray(got.keys).tobytes() == keys.tobytes(), entry_id
                    assert np.asarray(got.values).tobytes() == values.tobytes(), entry_id
            store.delete(sorted(rebuilt))
        kept -= rebuilt
    served = probe_store(root, tpl, read_only=True, keep=kept, exact_scores=False)
    assert served.opened and served.served == len(tpl.queries) and not served.refused
    _assert_records_kept(root, tpl, kept)
    outcome["repaired"] = True
    outcome["kept"] = len(kept)
    outcome["lost"] = len(lost)
    outcome["over_dropped"] = len(tpl.live - lost - kept)

    # and a writer can go on from there: new ids above every id the store ever had
    with Store.open(root) as store:
        keys = np.ones((2, 16), np.float32)
        new_id = store.put(keys, keys, layer_idx=0)
        assert new_id > max(tpl.puts)
    assert hmem.verify(root, full=True).ok


def _damaged_copy(root: Path, suffix: str) -> Path:
    dst = root.with_name(root.name + "-" + suffix)
    shutil.copytree(root, dst)
    return dst


def _assert_records_kept(root: Path, tpl, kept: set[int]) -> None:
    """Every kept entry's record is the clean one but for shard_idx (and checksum)."""
    doc = json.loads((root / "index.json").read_text())
    recs = hmem.formats.records.read(root / "entries.bin", doc["record_count"], HDC // 8)
    by_id = {int(r["entry_id"]): r for r in recs}
    for entry_id in kept:
        now, then = by_id[entry_id], tpl.records[record_position(tpl, entry_id)]
        for field in ("layer_idx", "n_tokens", "importance", "timestamp", "access_count"):
            assert now[field] == then[field], (entry_id, field)
        assert now["signature"].tobytes() == then["signature"].tobytes()
    assert doc["next_entry_id"] > max(by_id, default=0)


@pytest.mark.parametrize(
    ("case", "quantized"),
    [
        pytest.param(
            case,
            quantized,
            id=f"{case.name}-{'int8' if quantized else 'f32'}",
            marks=[pytest.mark.xfail(strict=True, reason=case.over_drops)] if case.over_drops else [],
        )
        for case in CASES
        for quantized in case.modes
        if case.action == "rewritten"
    ],
)
def test_repair_keeps_every_entry_whose_data_survived(case, quantized, reliability_template, clone_store):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    case.damage(root, tpl)
    fixed = hmem.repair(root)
    with Store.open(root, read_only=True) as store:
        kept = set(store.entry_ids())
    assert kept == (tpl.live - case.lost(tpl)) | case.back(tpl), fixed.dropped
    assert len(fixed.dropped) == len(case.lost(tpl)) or case.record_damage


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
def test_repair_lists_every_entry_it_drops(quantized, reliability_template, clone_store):
    """A flipped bit in entry 5's entry_id (record 4): repair must drop that
    record (listed by position) and keep or name every other entry.  It
    drops record 5 too (entry 6, intact) without a word."""
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    flip_record(TARGET, F_ENTRY_ID + 5, 0)(root, tpl)
    fixed = hmem.repair(root)
    assert (None, "record 4 of entries.bin fails its checksum") in fixed.dropped
    with Store.open(root, read_only=True) as store:
        kept = set(store.entry_ids())
    named = {i for i, _ in fixed.dropped if i is not None} | {TARGET}
    assert tpl.live - kept <= named, (tpl.live - kept, fixed.dropped)


# ---- torn tails: a flush killed before its commit, then cut anywhere -----------------------

_CRASH_SCRIPT = """
import numpy as np, hmem
d = np.load({data!r})
store = hmem.Store.create({path!r}, embed_dim=16, hdc_dim=256, shard_max_bytes={limit}, quantize_stored={quant})
for i in range(6):
    store.put(d["a%d" % i], -2 * d["a%d" % i], layer_idx=i % 2)
store.flush()
print("committed", flush=True)
for i in range(4):
    store.put(d["b%d" % i], 3 * d["b%d" % i], layer_idx=i % 2)
store.flush()  # killed (HMEM_CRASH_AT) after its shards and records, before its commit
print("flushed", flush=True)
"""


def _state(root: Path) -> dict:
    """What a reader sees: every live entry's metadata and K/V bytes, and the
    evicted records it counts."""
    with Store.open(root, read_only=True) as store:
        st = store.stats()
        out = {"entries": st.entries, "evicted": st.evicted}
        for info in store.entries():
            got = store.get(info.entry_id)
            out[info.entry_id] = (
                info.layer_idx,
                info.n_tokens,
                info.shard_idx,
                got.keys.tobytes(),
                got.values.tobytes(),
            )
        return out


@pytest.fixture(scope="module")
def crashed_flush(tmp_path_factory):
    """``crashed_flush(quantized)`` -> namespace(path, committed (a reader's
    state), committed_bytes (of entries.bin), committed_shards (file names),
    new_shards (uncommitted file names, oldest first)), built once."""
    import subprocess
    import types

    built = {}

    def get(quantized: bool):
        if quantized in built:
            return built[quantized]
        base = tmp_path_factory.mktemp("crashed")
        rng = np.random.default_rng(11)
        arrays = {f"a{i}": rng.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(6)}
        arrays.update({f"b{i}": rng.standard_normal((1 + i % 2, 16)).astype(np.float32) for i in range(4)})
        np.savez(base / "data.npz", **arrays)
        path = base / "store"
        env = {k: v for k, v in os.environ.items() if k != "HMEM_CRASH_AT"}
        env["HMEM_CRASH_AT"] = "flush.records_written:2"  # the second flush
        code = _CRASH_SCRIPT.format(
            data=str(base / "data.npz"), path=str(path), quant=quantized, limit=2600 if quantized else 1600
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=base, env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == hmem._io.CRASH_EXIT_CODE == 86, proc.stderr
        assert proc.stdout.split() == ["committed"]
        doc = json.loads((path / "index.json").read_text())
        committed_shards = [s["file"] for s in doc["shards"]]
        new_shards = sorted(p.name for p in path.glob("shard_*.safetensors") if p.name not in committed_shards)
        assert len(committed_shards) >= 2 and new_shards
        committed_bytes = doc["record_count"] * RECORD
        assert doc["record_count"] == 6
        assert (path / "entries.bin").stat().st_size == committed_bytes + 4 * RECORD
        committed = _state(path)
        assert committed["entries"] == 6 and committed["evicted"] == 0
        assert sorted(k for k in committed if isinstance(k, int)) == [1, 2, 3, 4, 5, 6]
        for i in range(6):
            layer, n_tokens, _, keys, values = committed[i + 1]
            a = arrays[f"a{i}"]
            assert (layer, n_tokens) == (i % 2, len(a))
            if not quantized:
                assert keys == a.tobytes() and values == (-2 * a).tobytes()
            else:
                got = np.frombuffer(keys, np.float32).reshape(a.shape)
                assert np.all(np.abs(got - a) <= np.abs(a).max(axis=1, keepdims=True) / 254 + 1e-6)
        built[quantized] = types.SimpleNamespace(
            path=path,
            committed=committed,
            committed_bytes=committed_bytes,
            committed_shards=committed_shards,
            new_shards=new_shards,
        )
        return built[quantized]

    return get


def _recovers(crash, root: Path, dir_state) -> None:
    """verify sees only leftovers and writes nothing; a reader sees the
    committed state and writes nothing; a writer recovers exactly it and
    leaves a store that verifies with no finding at all."""
    before = dir_state(root)
    report = hmem.verify(root, full=True)
    assert dir_state(root) == before
    assert {(f.code, f.severity) for f in report.findings} <= {("entries.tail", W), ("file.orphan", W)}, report.findings
    tail = (root / "entries.bin").stat().st_size > crash.committed_bytes
    assert any(f.code == "entries.tail" for f in report.findings) == tail
    assert _state(root) == crash.committed
    assert dir_state(root) == before
    with Store.open(root) as writer:
        st = writer.stats()
        assert st.entries == 6 and st.evicted == 0  # the 6 committed records, not one of the torn tail
    assert (root / "entries.bin").stat().st_size == crash.committed_bytes
    assert sorted(p.name for p in root.glob("shard_*")) == sorted(crash.committed_shards)
    assert not hmem.verify(root, full=True).findings
    assert _state(root) == crash.committed


def _offsets(length: int, every: bool) -> list[int]:
    sample = {0, 1, 8, length // 2, length - 1}
    return sorted(range(length) if every else {o for o in sample if 0 <= o < length})


def _cut_copy(crash, tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(crash.path, root)
    return root


@pytest.mark.parametrize(
    "every", [pytest.param(False, id="sampled"), pytest.param(True, id="every-byte", marks=pytest.mark.stress)]
)
@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
def test_entries_torn_in_the_last_uncommitted_record(quantized, every, crashed_flush, tmp_path, dir_state):
    crash = crashed_flush(quantized)
    last = crash.committed_bytes + 3 * RECORD  # where the last uncommitted record starts
    sizes = [crash.committed_bytes] + [last + o for o in _offsets(RECORD, every)]
    for i, size in enumerate(sizes):
        root = _cut_copy(crash, tmp_path, f"cut{i}")
        truncate(root / "entries.bin", size)
        _recovers(crash, root, dir_state)
        shutil.rmtree(root)


@pytest.mark.parametrize(
    "every", [pytest.param(False, id="sampled"), pytest.param(True, id="every-byte", marks=pytest.mark.stress)]
)
@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
def test_newest_uncommitted_shard_torn_in_its_last_tensor(quantized, every, crashed_flush, tmp_path, dir_state):
    crash = crashed_flush(quantized)
    newest = crash.new_shards[-1]
    length, header = shard_header(crash.path / newest)
    last_start = 8 + length + max(spec["data_offsets"][0] for name, spec in header.items() if name != "__metadata__")
    size = (crash.path / newest).stat().st_size
    cuts = sorted({0, 1, 8, size // 2} | {last_start + o for o in _offsets(size - last_start, every)})
    for i, cut in enumerate(cuts):
        root = _cut_copy(crash, tmp_path, f"cut{i}")
        truncate(root / newest, cut)
        if i % 3 == 0:  # and now and then the records' tail too
            truncate(root / "entries.bin", crash.committed_bytes + 2 * RECORD + 1 + i % RECORD)
        _recovers(crash, root, dir_state)
        shutil.rmtree(root)


# ---- scores after a repair ---------------------------------------------------------------------


def test_a_results_score_does_not_depend_on_the_other_candidates(tmp_path):
    rng = np.random.default_rng(0)
    with Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256) as store:
        for i in range(40):
            keys = rng.standard_normal((1 + i % 3, 16)).astype(np.float32)
            store.put(keys, keys, 0)
        scores: dict[tuple[int, int], set[float]] = {}
        for q in range(20):
            query = rng.standard_normal((2, 16)).astype(np.float32)
            for top_k in range(1, 12):
                for r in store.query(query, 0, top_k, shortlist_factor=1, count_access=False):
                    scores.setdefault((q, r.entry_id), set()).add(r.cosine)
    assert all(len(s) == 1 for s in scores.values()), [k for k, s in scores.items() if len(s) > 1]


@pytest.mark.stress
def test_identical_entries_tie_and_rank_by_id(tmp_path):
    wrong = []
    for seed in range(16):
        rng = np.random.default_rng(seed)
        with Store.create(tmp_path / f"s{seed}", embed_dim=16, hdc_dim=256) as store:
            dup = rng.standard_normal((2, 16)).astype(np.float32)
            for _ in range(12):
                keys = rng.standard_normal((2, 16)).astype(np.float32)
                store.put(keys, keys, 0)
            a, b = store.put(dup, dup, 0), store.put(dup, dup, 0)
            for _ in range(10):
                query = rng.standard_normal((2, 16)).astype(np.float32)
                for top_k in range(1, 15):
                    found = store.query(query, 0, top_k, shortlist_factor=1, count_access=False)
                    cos = {r.entry_id: r.cosine for r in found}
                    order = [r.entry_id for r in found]
                    if a in cos and b in cos and (cos[a] != cos[b] or order.index(b) < order.index(a)):
                        wrong.append((seed, top_k, cos[a], cos[b], order.index(a) < order.index(b)))
    assert not wrong, wrong[:5]
