"""Repair never deletes what passes its checksums, never serves another
store's data (docs/reliability.md, "What repair keeps"; issue 40):

- entries.bin deleted, emptied or cut: every entry is rebuilt from its
  shard (ids, K/V, pooled key, meta, tokens; layer and importance as
  asked), nothing is deleted, and the import registry keeps only files
  whose entries are all kept;
- ``verify --repair --dry-run`` and the prompt list what would be kept,
  rebuilt, dropped (entries and bytes) and moved to lost+found/;
- a shard cut inside its pooled keys keeps the entries whose K/V are
  intact (the key from pooled.bin, or computed again from the keys);
- a shard, entries.bin or index.json of another store is never adopted:
  the shard goes to lost+found/, its entries are not served;
- the repair matrix: every file of a small store deleted, emptied, cut,
  byte-flipped or replaced by another store's file of the same name, then
  repaired: 0 intact entries lost, 0 foreign K/V served;
- a directory left by an interrupted ``hmem copy`` (shards, no index.json)
  keeps what was copied.

The stores here are built by importing K/V files (``hmem.import_files``),
so that they have an import registry, one file per entry, layer i % 3.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem import Store
from hmem.cli.app import app

EMBED, HDC = 16, 256
CLI_ENV = {"COLUMNS": "200", "NO_COLOR": "1", "HMEM_DEBUG": None, "HMEM_STORE": None}
ENTRIES = 9


def cli(*args, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=CLI_ENV, input=input)


def build(path: Path, seed: int, *, storage_dtype: str = "f32") -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    """A store of ENTRIES entries of 1-3 tokens in several shards, each
    imported from its own file; returns {entry id: (keys, values, layer)}.
    Two stores built with different seeds have the same file names, sizes
    and ids, and other data."""
    rng = np.random.default_rng(seed)
    files = path.parent / f"{path.name}-files"
    files.mkdir()
    puts = {}
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=2600, storage_dtype=storage_dtype) as store:
        for i in range(ENTRIES):
            n = 1 + i % 3
            keys = rng.standard_normal((n, EMBED)).astype(np.float32)
            values = rng.standard_normal((n, EMBED)).astype(np.float32)
            file = files / f"part_{i:02d}.safetensors"
            save_file({"keys": keys, "values": values}, str(file))
            report = hmem.import_files(store, [file], layer=i % 3)
            (entry_id,) = [e for r in report.files for e in r.entries]
            puts[entry_id] = (keys, values, i % 3)
            if i % 3 == 2:
                store.flush()
    return puts


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two closed stores built once: ``ours`` and ``theirs`` (same shape, other data)."""
    root = tmp_path_factory.mktemp("repair-intact")
    ours, theirs = root / "ours", root / "theirs"
    puts = build(ours, 1)
    other = build(theirs, 2)
    assert sorted(puts) == sorted(other)
    shards = sorted(p.name for p in ours.glob("shard_*.safetensors"))
    assert len(shards) >= 3 and shards == sorted(p.name for p in theirs.glob("shard_*.safetensors"))
    assert hmem.verify(ours, full=True).findings == ()
    return ours, theirs, puts


def clone(stores, tmp_path: Path, name: str = "s") -> Path:
    dst = tmp_path / name
    shutil.copytree(stores[0], dst)
    return dst


def served(root: Path) -> dict[int, tuple[bytes, bytes, int]]:
    """Every entry the store serves: {id: (keys bytes, values bytes, layer)}."""
    out = {}
    with Store.open(root, read_only=True) as store:
        for info in store.entries():
            got = store.get(info.entry_id)
            out[info.entry_id] = (np.asarray(got.keys).tobytes(), np.asarray(got.values).tobytes(), info.layer_idx)
    return out


def assert_exact(root: Path, puts: dict, expected_ids: set[int]) -> dict:
    """The store serves exactly `expected_ids` (at least), each with the K/V
    put under that id; returns what it serves."""
    now = served(root)
    for entry_id, (keys, values, _) in now.items():
        assert entry_id in puts, entry_id
        assert keys == puts[entry_id][0].tobytes() and values == puts[entry_id][1].tobytes(), entry_id
    assert expected_ids <= set(now), (sorted(expected_ids - set(now)), sorted(now))
    return now


# ---- entries.bin lost: rebuilt from the shards ---------------------------------------------


def _delete(path: Path) -> None:
    path.unlink()


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _cut(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3 + 7)


@pytest.mark.parametrize("damage", [_delete, _empty, _cut], ids=["deleted", "emptied", "truncated"])
def test_lost_entries_file_rebuilds_every_entry_from_its_shard(damage, stores, tmp_path):
    puts = stores[2]
    root = clone(stores, tmp_path)
    shard_bytes = sum(p.stat().st_size for p in root.glob("shard_*.safetensors"))
    damage(root / "entries.bin")
    plan = hmem.repair(root, dry_run=True)
    assert plan.dry_run and plan.entries_kept == ENTRIES and not [d for d in plan.dropped if d[0] is not None]
    assert len(plan.rebuilt_entries) >= ENTRIES - ENTRIES // 3  # a cut keeps the records before it
    result = cli("verify", root, "--repair", "--yes", "--rebuild-layer", "2", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["repair"]["entries_kept"] == ENTRIES and doc["after"]["ok"]
    rebuilt = set(doc["repair"]["rebuilt_entries"])
    now = assert_exact(root, puts, set(puts))
    for entry_id, (_, _, layer) in now.items():  # a rebuilt record gets the layer asked for
        assert layer == (2 if entry_id in rebuilt else puts[entry_id][2])
    assert sum(p.stat().st_size for p in root.glob("shard_*.safetensors")) >= shard_bytes * 0.9
    # each rebuilt entry is found by a query of its own keys in its new layer
    with Store.open(root, read_only=True) as store:
        for entry_id in rebuilt:
            assert store.query(puts[entry_id][0], 2, top_k=1)[0].entry_id == entry_id
        assert store.get(min(rebuilt)).meta["source"].startswith("part_")
    # every entry is kept, so every file stays imported: put imports nothing again
    with Store.open(root) as store:
        again = hmem.import_files(store, sorted((stores[0].parent / "ours-files").glob("*.safetensors")))
    assert len(again.files) == ENTRIES and not [e for r in again.files for e in r.entries]


def test_registry_drops_only_files_whose_entries_are_lost(stores, tmp_path):
    puts = stores[2]
    root = clone(stores, tmp_path)
    (root / "entries.bin").unlink()
    victim = root / "shard_0001.safetensors"
    lost = _entries_of(victim)
    victim.unlink()
    fixed = hmem.repair(root)
    assert {i for i, _ in fixed.dropped if i is not None} == set()  # their records were lost too
    assert fixed.sources_dropped == len(lost)
    assert_exact(root, puts, set(puts) - lost)
    with Store.open(root) as store:
        again = hmem.import_files(store, sorted((stores[0].parent / "ours-files").glob("*.safetensors")))
    assert len([e for r in again.files for e in r.entries]) == len(lost)


def _entries_of(shard: Path) -> set[int]:
    raw = shard.read_bytes()
    (length,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8 : 8 + length])
    return {int(name[2:]) for name in header if name.startswith("k_")}


def _tensor_span(shard: Path, name: str) -> tuple[int, int]:
    raw = shard.read_bytes()
    (length,) = struct.unpack_from("<Q", raw, 0)
    start, end = json.loads(raw[8 : 8 + length])[name]["data_offsets"]
    return 8 + length + start, 8 + length + end


RECORD = 40 + HDC // 8


@pytest.mark.parametrize(
    ("offset", "bit", "keeps_layer"), [(36, 3, True), (28, 0, True), (40 + 5, 2, True), (8, 2, False)]
)
def test_a_damaged_record_is_rebuilt_keeping_what_it_still_says(offset, bit, keeps_layer, stores, tmp_path):
    """One bit flipped in a record (its checksum, access count, signature;
    its layer, to one the store does not use): the entry is rebuilt from its
    shard, keeping the record's layer when the fields a shard can check
    agree with it, else in the layer repair is given."""
    puts = stores[2]
    root = clone(stores, tmp_path)
    target = sorted(puts)[4]  # layer 1
    with open(root / "entries.bin", "r+b") as f:
        f.seek((target - 1) * RECORD + offset)
        byte = f.read(1)[0]
        f.seek((target - 1) * RECORD + offset)
        f.write(bytes([byte ^ (1 << bit)]))
    fixed = hmem.repair(root, rebuild_layer=2)
    assert fixed.rebuilt_entries == (target,) and not [d for d in fixed.dropped if d[0] is not None]
    now = assert_exact(root, puts, set(puts))
    assert now[target][2] == (puts[target][2] if keeps_layer else 2)
    assert any("unverified" in note for note in fixed.notes) == keeps_layer


# ---- the plan: --dry-run and the prompt -------------------------------------------------------


def test_dry_run_lists_what_would_be_kept_rebuilt_and_dropped_and_writes_nothing(stores, tmp_path):
    root = clone(stores, tmp_path)
    (root / "entries.bin").unlink()
    victim = root / "shard_0002.safetensors"
    start, end = _tensor_span(victim, f"k_{max(_entries_of(victim))}")
    with open(victim, "r+b") as f:
        f.seek((start + end) // 2)
        f.write(b"\xff\xff")
    before = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and p.name != "lock"}
    result = cli("verify", root, "--repair", "--dry-run")
    assert result.exit_code == 4, result.stdout + result.stderr
    text = result.stdout + result.stderr
    assert f"would keep {ENTRIES - 1} entries" in text
    assert f"{ENTRIES - 1} of them rebuilt from their shards" in text
    assert "layer 0, importance 1" in text
    assert "nothing written (--dry-run)" in text
    assert {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and p.name != "lock"} == before
    # the prompt shows the same plan before it asks; "n" changes nothing
    result = cli("verify", root, "--repair", input="n\n")
    assert "would keep" in result.stdout + result.stderr
    assert {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and p.name != "lock"} == before


def test_dry_run_counts_dropped_entries_and_bytes(stores, tmp_path):
    puts = stores[2]
    root = clone(stores, tmp_path)
    victim = root / "shard_0001.safetensors"
    lost = _entries_of(victim)
    victim.unlink()
    plan = hmem.repair(root, dry_run=True)
    assert {i for i, _ in plan.dropped if i is not None} == lost
    expected = sum(2 * 4 * EMBED * puts[i][0].shape[0] + 4 * EMBED for i in lost)
    assert plan.dropped_bytes == expected
    result = cli("verify", root, "--repair", "--dry-run")
    assert f"would drop {len(lost)} entries" in result.stdout, result.stdout


def test_dry_run_needs_repair(stores, tmp_path):
    root = clone(stores, tmp_path)
    result = cli("verify", root, "--dry-run")
    assert result.exit_code == 2 and "--repair" in result.stderr


# ---- a lost pooled key ---------------------------------------------------------------------------


@pytest.mark.parametrize("pooled_file", ["kept", "deleted"])
@pytest.mark.parametrize("storage_dtype", ["f32", "bf16"])
def test_a_lost_pooled_key_keeps_the_entries_whose_kv_are_intact(pooled_file, storage_dtype, tmp_path):
    """An F32 store's shard cut inside its pooled keys (they come after every
    k and v), a BF16 store's with a byte of each pooled key flipped (they
    come first there): the key is taken from pooled.bin, or computed again
    from the keys when pooled.bin is gone."""
    puts = build(tmp_path / "s", 3, storage_dtype=storage_dtype)
    root = tmp_path / "s"
    shard = root / "shard_0000.safetensors"
    ids = sorted(_entries_of(shard))
    spans = {i: _tensor_span(shard, f"p_{i}") for i in ids}
    if storage_dtype == "f32":
        kv_end = max(max(_tensor_span(shard, f"{kind}_{i}")[1] for kind in "kv") for i in ids)
        assert kv_end <= min(start for start, _ in spans.values())
        with open(shard, "r+b") as f:
            f.truncate(min(start for start, _ in spans.values()) + 8)
    else:
        with open(shard, "r+b") as f:
            for start, _ in spans.values():
                f.seek(start + 2)
                f.write(b"\x5a")
    if pooled_file == "deleted":
        (root / "pooled.bin").unlink()
    fixed = hmem.repair(root)
    assert fixed.action == "rewritten" and not [d for d in fixed.dropped if d[0] in ids], fixed.dropped
    assert hmem.verify(root, full=True).ok
    with Store.open(root, read_only=True) as store:
        for entry_id in ids:
            got = store.get(entry_id)
            keys, values, layer = puts[entry_id]
            if storage_dtype == "f32":
                assert np.asarray(got.keys).tobytes() == keys.tobytes()
                assert np.asarray(got.values).tobytes() == values.tobytes()
            # the entry is found by its own keys, ranked first after the re-rank
            assert store.query(keys, layer, top_k=1)[0].entry_id == entry_id


# ---- another store's files are never adopted -----------------------------------------------------


def test_a_foreign_shard_goes_to_lost_and_found_and_is_not_served(stores, tmp_path):
    ours, theirs, puts = stores
    root = clone(stores, tmp_path)
    shutil.copyfile(theirs / "shard_0001.safetensors", root / "shard_0001.safetensors")
    foreign = _entries_of(root / "shard_0001.safetensors")
    codes = {f.code for f in hmem.verify(root, full=True).findings}
    assert "shard.uid" in codes
    result = cli("verify", root, "--repair", "--yes")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "lost+found/shard_0001.safetensors" in result.stdout + result.stderr
    now = assert_exact(root, puts, set(puts) - foreign)
    assert not foreign & set(now)
    kept = list((root / "lost+found").iterdir())
    assert len(kept) == 1 and kept[0].read_bytes() == (theirs / "shard_0001.safetensors").read_bytes()
    assert hmem.verify(root, full=True).ok


def test_another_stores_entries_file_is_not_adopted(stores, tmp_path):
    ours, theirs, puts = stores
    root = clone(stores, tmp_path)
    shutil.copyfile(theirs / "entries.bin", root / "entries.bin")
    shutil.copyfile(theirs / "pooled.bin", root / "pooled.bin")
    (root / "index.json").unlink()  # so that nothing but the records names the shards
    fixed = hmem.repair(root)
    assert any("disagree" in note for note in fixed.notes), fixed.notes
    assert_exact(root, puts, set(puts))


@pytest.mark.parametrize("name", ["entries.bin", "pooled.bin"])
def test_another_stores_records_or_pooled_keys_are_found_and_not_adopted(name, stores, tmp_path):
    """Same ids, sizes and counts: only the data tells them apart.  verify
    --full reports it; repair rebuilds the records from the shards (and
    pooled.bin from the shards' keys), so every query ranks by our data."""
    ours, theirs, puts = stores
    root = clone(stores, tmp_path)
    shutil.copyfile(theirs / name, root / name)
    code = "record.mismatch" if name == "entries.bin" else "pooled.mismatch"
    findings = hmem.verify(root, full=True).findings
    assert {f.code for f in findings} == {code} and len(findings) == ENTRIES
    fixed = hmem.repair(root)
    assert hmem.verify(root, full=True).ok
    now = assert_exact(root, puts, set(puts))
    if name == "entries.bin":
        assert set(fixed.rebuilt_entries) == set(puts)
    with Store.open(root, read_only=True) as store:
        for entry_id, (keys, _, _) in puts.items():
            assert store.query(keys, now[entry_id][2], top_k=1)[0].entry_id == entry_id


def test_another_stores_index_is_not_adopted(stores, tmp_path):
    ours, theirs, puts = stores
    root = clone(stores, tmp_path)
    shutil.copyfile(theirs / "index.json", root / "index.json")
    fixed = hmem.repair(root)
    assert fixed.rebuilt_index and any("another store" in note for note in fixed.notes)
    assert_exact(root, puts, set(puts))
    assert not (root / "lost+found").exists()


# ---- a repair killed at any of its points -------------------------------------------------------

REPAIR_POINTS = [
    "repair.planned",
    "repair.shard_written",
    "repair.shards_written",
    "repair.records_written",
    "repair.committed",
    "repair.finished",
]


@pytest.mark.parametrize("point", REPAIR_POINTS)
def test_a_repair_killed_at_any_point_keeps_everything_intact(point, stores, tmp_path, run_python):
    """entries.bin lost and shard 1 replaced by another store's: a repair
    killed at each of its points, then run again, ends as an uninterrupted
    one (every entry of our shards served with its K/V, the foreign shard in
    lost+found/, never served), whatever the first run had done."""
    ours, theirs, puts = stores
    root = clone(stores, tmp_path)
    (root / "entries.bin").unlink()
    shutil.copyfile(theirs / "shard_0001.safetensors", root / "shard_0001.safetensors")
    foreign = _entries_of(root / "shard_0001.safetensors")
    crashed = run_python(f"import hmem; hmem.repair({str(root)!r})", env={"HMEM_CRASH_AT": point})
    assert crashed.returncode != 0, crashed.stdout + crashed.stderr
    hmem.repair(root)
    assert hmem.verify(root, full=True).ok
    now = assert_exact(root, puts, set(puts) - foreign)
    assert not foreign & set(now)
    moved = list((root / "lost+found").iterdir())
    assert [p.read_bytes() for p in moved] == [(theirs / "shard_0001.safetensors").read_bytes()]


# ---- an interrupted hmem copy --------------------------------------------------------------------


def test_repair_after_an_interrupted_copy_keeps_what_was_copied(stores, tmp_path):
    """hmem copy writes the shards first and index.json last: cut short, the
    copy holds shards and no index; stats' advice (verify --repair) keeps them."""
    ours, _, puts = stores
    copy = tmp_path / "copy"
    copy.mkdir()
    for shard in sorted(ours.glob("shard_*.safetensors")):
        shutil.copyfile(shard, copy / shard.name)
    result = cli("verify", copy, "--repair", "--yes")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert_exact(copy, puts, set(puts))


# ---- the repair matrix ---------------------------------------------------------------------------

FILES = ["index.json", "entries.bin", "pooled.bin", "commit.stamp", "sources.jsonl", "lock"]


def _damages(size: int) -> list[tuple[str, object]]:
    """(name, how) for a file of `size` bytes."""
    out: list[tuple[str, object]] = [("deleted", "delete"), ("emptied", "empty"), ("foreign", "foreign")]
    for share in (0.1, 0.5, 0.9):
        if size:
            out.append((f"cut-{share}", ("cut", max(0, int(size * share)))))
    if size:
        out.append(("cut-last-byte", ("cut", size - 1)))
        for share in (0.0, 0.05, 0.3, 0.6, 0.95):
            out.append((f"flip-{share}", ("flip", min(size - 1, int(size * share)))))
    return out


def _cases(stores_dir: Path) -> list[tuple[str, str, object]]:
    names = FILES + sorted(p.name for p in stores_dir.glob("shard_*.safetensors"))
    return [(name, label, how) for name in names for label, how in _damages(_size(stores_dir / name))]


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _apply(root: Path, theirs: Path, name: str, how) -> None:
    path = root / name
    if how == "delete":
        path.unlink(missing_ok=True)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "foreign":
        shutil.copyfile(theirs / name, path)
    elif how[0] == "cut":
        with open(path, "r+b") as f:
            f.truncate(how[1])
    else:
        with open(path, "r+b") as f:
            f.seek(how[1])
            byte = f.read(1)[0]
            f.seek(how[1])
            f.write(bytes([byte ^ 0x10]))


def _intact(original: Path, damaged: Path, name: str, puts: dict) -> set[int]:
    """The entries whose K/V bytes are intact and can be found: every entry,
    less those of a damaged shard whose k or v bytes changed, or whose shard
    can no longer say where they are (its hmem_index and its JSON header
    both damaged)."""
    if not name.startswith("shard_"):
        return set(puts)
    held = _entries_of(original / name)
    rest = set(puts) - held
    if not damaged.exists():
        return rest
    old, new = (original / name).read_bytes(), damaged.read_bytes()
    index = _tensor_span(original / name, "hmem_index")
    (length,) = struct.unpack_from("<Q", old, 0)
    header_ok = new[: 8 + length] == old[: 8 + length] and len(new) == len(old)
    if new[index[0] : index[1]] != old[index[0] : index[1]] and not header_ok:
        return rest
    out = set(rest)
    kinds = ("k", "v", "ks", "vs") if f"ks_{min(held)}" in old[8 : 8 + length].decode() else ("k", "v")
    for entry_id in held:  # the keys and values, and an INT8 store's scales
        spans = [_tensor_span(original / name, f"{kind}_{entry_id}") for kind in kinds]
        if all(new[a:b] == old[a:b] for a, b in spans):
            out.add(entry_id)
    return out


def _run_case(stores, tmp_path: Path, name: str, how, clean: dict | None = None) -> None:
    """One damage, then repair.  `clean`: what the undamaged store serves,
    compared with instead of the inputs (an INT8 store serves them rounded)."""
    ours, theirs, puts = stores
    root = tmp_path / "s"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(ours, root)
    _apply(root, theirs, name, how)
    intact = _intact(ours, root / name, name, puts)
    if how == "foreign" and name.startswith("shard_"):
        intact -= _entries_of(ours / name)
    hmem.repair(root)
    assert hmem.verify(root, full=True).ok, hmem.verify(root, full=True).findings
    if clean is None:
        assert_exact(root, puts, intact)
        return
    now = served(root)
    assert intact <= set(now), sorted(intact - set(now))
    for entry_id, (keys, values, _) in now.items():
        assert (keys, values) == clean[entry_id][:2], entry_id


QUICK = [
    ("entries.bin", "deleted", "delete"),
    ("entries.bin", "cut", ("cut", 100)),
    ("index.json", "foreign", "foreign"),
    ("entries.bin", "foreign", "foreign"),
    ("shard_0001.safetensors", "foreign", "foreign"),
    ("shard_0000.safetensors", "cut-last-byte", ("cut", -1)),
    ("shard_0002.safetensors", "flip-header", ("flip", 40)),
    ("pooled.bin", "emptied", "empty"),
    ("pooled.bin", "foreign", "foreign"),
    ("sources.jsonl", "foreign", "foreign"),
]


@pytest.mark.parametrize(("name", "label", "how"), QUICK, ids=[f"{n}-{label}" for n, label, _ in QUICK])
def test_repair_matrix_representative_cases(name, label, how, stores, tmp_path):
    if how[0] == "cut" and how[1] < 0:
        how = ("cut", _size(stores[0] / name) - 1)
    _run_case(stores, tmp_path, name, how)


@pytest.fixture(scope="module")
def int8_stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("repair-intact-int8")
    puts = build(root / "ours", 1, storage_dtype="int8")
    build(root / "theirs", 2, storage_dtype="int8")
    return root / "ours", root / "theirs", puts


@pytest.mark.stress
@pytest.mark.parametrize("storage_dtype", ["f32", "int8"])
def test_repair_matrix_every_file_every_damage(storage_dtype, request, tmp_path):
    stores = request.getfixturevalue("stores" if storage_dtype == "f32" else "int8_stores")
    clean = served(stores[0]) if storage_dtype == "int8" else None
    failures = []
    cases = _cases(stores[0])
    for name, label, how in cases:
        try:
            _run_case(stores, tmp_path, name, how, clean)
        except (AssertionError, hmem.HmemError) as exc:  # collected: the report lists every failing case
            failures.append(f"{name} {label}: {type(exc).__name__}: {str(exc)[:300]}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
    assert len(cases) >= 100


def test_matrix_covers_every_file_of_the_store(stores):
    present = {p.name for p in stores[0].iterdir() if p.is_file()}
    assert present <= set(FILES) | {p.name for p in stores[0].glob("shard_*.safetensors")}
    assert os.path.exists(stores[0] / "sources.jsonl")
