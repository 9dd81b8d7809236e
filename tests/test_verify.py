"""``hmem.verify``, ``hmem.repair`` and ``hmem verify`` (docs/cli.md): what a
clean store reports, exit codes, --subset and --max-seconds, that verify
never writes, repair's no-op / tidy / rebuild paths and the --repair flow of
the command line.  The damage matrix itself is in tests/test_corruption.py.

The store under test (tests/conftest.py, ``reliability_template``): entries
1..14 in three layers, five shards, entries 3, 8 and 12 evicted; F32 and
INT8.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem import Store
from hmem.cli.app import app

HDC = 256
RECORD = 40 + HDC // 8
CLI_ENV = {"COLUMNS": "200", "NO_COLOR": "1", "HMEM_DEBUG": None, "HMEM_STORE": None}
MODES = pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])


def cli(*args, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=CLI_ENV, input=input)


def flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw, 0)
    start, end = json.loads(raw[8 : 8 + length])[name]["data_offsets"]
    return 8 + length + start, 8 + length + end


def flip_tensor(root: Path, tpl, entry_id: int, kind: str = "k") -> None:
    path = root / f"shard_{tpl.shard_of[entry_id]:04d}.safetensors"
    start, end = tensor_span(path, f"{kind}_{entry_id}")
    flip(path, (start + end) // 2, 1)


def live_ids(root: Path) -> set[int]:
    with Store.open(root, read_only=True) as store:
        return set(store.entry_ids())


def tensor_count(tpl) -> int:
    return len(tpl.live) * (5 if tpl.quantized else 3)


def tensor_bytes(tpl) -> int:
    n_tokens = sum(tpl.puts[i][0].shape[0] for i in tpl.live)
    if tpl.quantized:
        return 2 * 16 * n_tokens + 4 * 16 * len(tpl.live) + 2 * 4 * n_tokens
    return 2 * 4 * 16 * n_tokens + 4 * 16 * len(tpl.live)


# ---- a clean store ----------------------------------------------------------------------


@MODES
def test_a_clean_store_verifies_with_no_finding(quantized, reliability_template, clone_store, dir_state):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    before = dir_state(root)
    quick = hmem.verify(root)
    full = hmem.verify(root, full=True)
    assert dir_state(root) == before
    for report in (quick, full):
        assert report.findings == () and report.ok and report.complete
        assert report.records == 14 and report.shards == 5
    assert (quick.full, quick.tensors_checked, quick.bytes_checked) == (False, 0, 0)
    assert full.full and full.tensors_checked == tensor_count(tpl)
    assert full.bytes_checked == tensor_bytes(tpl)
    result = cli("verify", root, "--full")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"ok: full check of 14 records, 5 shards, {tensor_count(tpl)} tensors (")
    result = cli("verify", root, "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["verify"]["ok"] is True and doc["verify"]["findings"] == [] and doc["repair"] is None
    assert doc["verify"]["records"] == 14
    assert dir_state(root) == before


def test_verify_runs_beside_a_writer_and_takes_no_lock(reliability_template, clone_store, dir_state):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    with Store.open(root) as writer:  # holds the lock
        keys = np.ones((2, 16), np.float32)
        writer.put(keys, keys)  # not flushed: nothing on disk yet
        before = dir_state(root)
        report = hmem.verify(root, full=True)
        assert dir_state(root) == before
        assert report.ok and report.records == 14
        assert cli("verify", root, "--full").exit_code == 0
        writer.flush()
        report = hmem.verify(root, full=True)
        assert report.ok and report.records == 15 and report.tensors_checked == tensor_count(tpl) + 3


# ---- exit codes and severities ------------------------------------------------------------


# a file is a bad path, exit code 10 (tests/test_operator_mistakes.py)
@pytest.mark.parametrize("content", ["empty", "foreign", "missing"])
def test_a_path_without_a_store_is_not_a_store(tmp_path, content, dir_state):
    path = tmp_path / "dir"
    if content != "missing":
        path.mkdir()
    if content == "foreign":
        (path / "notes.txt").write_text("not a store")
        (path / "index.json.bak").write_text("{}")
    with pytest.raises(hmem.NotAStoreError):
        hmem.verify(path, full=True)
    result = cli("verify", path, "--full")
    assert result.exit_code == 5, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and "holds no hmem store" in result.stderr
    assert "Traceback" not in result.stderr
    if content in ("empty", "foreign"):
        before = dir_state(path)
        assert cli("verify", path, "--repair", "--yes").exit_code == 5
        assert dir_state(path) == before  # no lock file either
    assert not (tmp_path / "dir").is_dir() or not (path / "lock").exists()


def test_a_foreign_file_is_only_information(reliability_template, clone_store, dir_state):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    (root / "README.txt").write_text("operator notes\n")
    before = dir_state(root)
    report = hmem.verify(root, full=True)
    assert [(f.code, f.severity, f.file) for f in report.findings] == [("file.foreign", "info", "README.txt")]
    assert report.ok and report.problems == ()
    result = cli("verify", root, "--full")
    assert result.exit_code == 0, result.stdout
    assert "file.foreign" in result.stdout and "README.txt" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("ok: full check")
    fixed = hmem.repair(root)
    assert fixed.action == "none" and fixed.dropped == ()
    assert dir_state(root)["README.txt"] == before["README.txt"]


def test_findings_carry_the_entry_file_and_expected_value(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(root, tpl, 5, "v")
    (root / f"shard_{tpl.shard_of[9]:04d}.safetensors").unlink()
    report = hmem.verify(root, full=True)
    by_code = {f.code: f for f in report.findings}
    assert set(by_code) == {"tensor.checksum", "shard.missing"}
    bad = by_code["tensor.checksum"]
    shard = root / f"shard_{tpl.shard_of[5]:04d}.safetensors"
    raw = shard.read_bytes()
    (length,) = struct.unpack_from("<Q", raw, 0)
    recorded = json.loads(raw[8 : 8 + length])["__metadata__"]["crc32c:v_5"]
    assert (bad.severity, bad.file, bad.entry_id) == ("error", shard.name, 5)
    assert "v_5" in bad.message and bad.expected == f"CRC-32C {recorded}"
    missing = by_code["shard.missing"]
    assert missing.file == f"shard_{tpl.shard_of[9]:04d}.safetensors" and "entries" in missing.expected
    result = cli("verify", root, "--json")  # quick: the tensor is not read
    assert result.exit_code == 4
    assert [f["code"] for f in json.loads(result.stdout)["verify"]["findings"]] == ["shard.missing"]
    result = cli("verify", root, "--full", "--max-findings", "1")
    assert result.exit_code == 4
    assert "... and 1 more findings" in result.stdout
    assert "2 error(s), 0 warning(s)" in result.stdout


def test_pending_steps_are_information_only(tmp_path, run_python, dir_state):
    """A writer killed right after a commit leaves pending record updates:
    verify applies them, says so (info) and exits 0."""
    path = tmp_path / "s"
    script = f"""
import numpy as np, hmem
store = hmem.Store.create({str(path)!r}, embed_dim=16, hdc_dim=256)
keys = np.arange(32, dtype=np.float32).reshape(2, 16)
store.put(keys, keys)
store.put(-keys, keys)
store.flush()
store.query(keys, 0, 1)
store.flush()  # killed after its commit, before the access count is written in place
"""
    crashed = run_python(script, env={"HMEM_CRASH_AT": "flush.committed:2"})
    assert crashed.returncode == 86, crashed.stderr
    before = dir_state(path)
    report = hmem.verify(path, full=True)
    assert [(f.code, f.severity) for f in report.findings] == [("index.pending", "info")]
    result = cli("verify", path, "--full")
    assert result.exit_code == 0 and "index.pending" in result.stdout
    assert dir_state(path) == before
    with Store.open(path, read_only=True) as reader:
        assert [(e.entry_id, e.access_count) for e in reader.entries()] == [(1, 1), (2, 0)]
        assert reader.stats().evicted == 0
    Store.open(path).close()  # the writer finishes the step
    assert hmem.verify(path, full=True).ok


def test_a_cleanly_closed_store_has_no_pending_step(tmp_path):
    """close() leaves an index.json whose listed steps are all done: none is listed."""
    path = tmp_path / "s"
    keys = np.arange(32, dtype=np.float32).reshape(2, 16)
    with Store.create(path, embed_dim=16, hdc_dim=256) as store:
        store.put(keys, keys)
        store.flush()
        store.query(keys, 0, 1)  # an access count: close's flush carries it as a pending update
    index = json.loads((path / "index.json").read_text())
    assert index["pending"] == {"record_updates": "", "renames": [], "deletes": []}
    assert hmem.verify(path, full=True).findings == ()
    with Store.open(path, read_only=True) as reader:
        assert [(e.entry_id, e.access_count) for e in reader.entries()] == [(1, 1)]
        assert reader.stats().evicted == 0


def test_a_compaction_killed_after_its_commit_verifies(tmp_path, run_python):
    path = tmp_path / "s"
    script = f"""
import numpy as np, hmem
rng = np.random.default_rng(0)
store = hmem.Store.create({str(path)!r}, embed_dim=16, hdc_dim=256, shard_max_bytes=1600)
for i in range(8):
    keys = rng.standard_normal((2, 16)).astype(np.float32)
    store.put(keys, keys, i % 2, importance=i + 1)
store.flush()
store.evict(5)
store.compact()
"""
    crashed = run_python(script, env={"HMEM_CRASH_AT": "compact.committed"})
    assert crashed.returncode == 86, crashed.stderr
    with Store.open(path, read_only=True) as reader:  # the committed (compacted) state
        assert reader.stats().entries == 5
    report = hmem.verify(path, full=True)
    assert not [f for f in report.findings if f.severity == "error"], report.findings


# ---- --subset and --max-seconds ----------------------------------------------------------------


@MODES
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_subsets_cover_every_shard_exactly_once(quantized, n, reliability_template, clone_store):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    full = hmem.verify(root, full=True)
    parts = [hmem.verify(root, full=True, subset=(k, n)) for k in range(1, n + 1)]
    assert sum(p.tensors_checked for p in parts) == full.tensors_checked == tensor_count(tpl)
    assert sum(p.bytes_checked for p in parts) == full.bytes_checked
    # damage one tensor in every shard: each run finds exactly the shards of its share
    first_of = {}
    for entry_id in sorted(tpl.live):
        first_of.setdefault(tpl.shard_of[entry_id], entry_id)
    for entry_id in first_of.values():
        flip_tensor(root, tpl, entry_id, "p")
    seen = []
    for k in range(1, n + 1):
        report = hmem.verify(root, full=True, subset=(k, n))
        files = [f.file for f in report.findings if f.code == "tensor.checksum"]
        assert files == [f"shard_{s:04d}.safetensors" for s in sorted(first_of) if s % n == k - 1]
        assert all(f.code == "tensor.checksum" for f in report.findings)
        seen += files
    assert sorted(seen) == sorted(f"shard_{s:04d}.safetensors" for s in first_of)
    result = cli("verify", root, "--full", "--subset", f"1/{n}", "--json")
    assert result.exit_code == 4
    assert json.loads(result.stdout)["verify"]["tensors_checked"] == parts[0].tensors_checked  # damaged count too


def test_cli_subset_runs_add_up_to_a_full_run(reliability_template, clone_store):
    tpl = reliability_template(True)
    root = clone_store(tpl)
    runs = [
        json.loads(cli("verify", root, "--full", "--subset", f"{k}/3", "--json").stdout)["verify"] for k in (1, 2, 3)
    ]
    full = json.loads(cli("verify", root, "--full", "--json").stdout)["verify"]
    assert sum(r["tensors_checked"] for r in runs) == full["tensors_checked"] == tensor_count(tpl)
    assert all(r["ok"] and r["complete"] for r in runs)


@pytest.mark.parametrize("bad", ["0/3", "4/3", "3", "a/b", "1/0"])
def test_a_bad_subset_is_a_usage_error(bad, reliability_template, clone_store):
    root = clone_store(reliability_template(False))
    result = cli("verify", root, "--full", "--subset", bad)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert "--subset" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(hmem.InvalidArgumentError):
        hmem.verify(root, full=True, subset=(0, 3))


def test_max_seconds_zero_reports_an_incomplete_check(reliability_template, clone_store, dir_state):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(root, tpl, 5)
    before = dir_state(root)
    report = hmem.verify(root, full=True, max_seconds=0)
    assert not report.complete and report.tensors_checked < tensor_count(tpl)
    assert [(f.code, f.severity) for f in report.findings] == [("verify.incomplete", "info")]
    result = cli("verify", root, "--full", "--max-seconds", "0")
    assert "verify.incomplete" in result.stdout and "incomplete:" in result.stdout and "ok:" not in result.stdout
    assert not report.ok  # a check that stopped early is never reported as ok
    assert result.exit_code == 3  # partial: the tensors it did not reach are not known to be good or bad
    assert dir_state(root) == before
    plenty = hmem.verify(root, full=True, max_seconds=600)
    assert plenty.complete and "verify.incomplete" not in {f.code for f in plenty.findings}
    assert {f.code for f in plenty.findings} == {"tensor.checksum"}


def test_verify_writes_nothing_even_on_a_store_that_will_not_open(reliability_template, clone_store, dir_state):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    with open(root / "entries.bin", "ab") as f:
        f.write(b"\x00" * 100)
    (root / ".hmem-tmp.index.json.1.0").write_bytes(b"{")
    (root / "index.json").write_bytes((root / "index.json").read_bytes()[:-40])
    before = dir_state(root)
    for full in (False, True):
        report = hmem.verify(root, full=full)
        assert {f.code for f in report.findings} == {"index.unreadable"}  # nothing else can be judged
    for args in (["--full"], [], ["--json"], ["--subset", "1/2", "--full"]):
        assert cli("verify", root, *args).exit_code == 4
    assert dir_state(root) == before
    assert not (root / "lock").read_bytes()


# ---- repair: no-op, tidy, rebuild ----------------------------------------------------------------


@MODES
def test_repair_of_a_clean_store_changes_nothing(quantized, reliability_template, clone_store, dir_state):
    root = clone_store(reliability_template(quantized))
    before = dir_state(root)
    fixed = hmem.repair(root)
    assert fixed.action == "none" and fixed.findings == () and fixed.dropped == ()
    assert not fixed.rebuilt_index and fixed.entries_kept == 14 and fixed.shards_after == 5
    assert fixed.bytes_before == fixed.bytes_after
    after = dir_state(root)
    assert after.keys() == before.keys()
    for name in before:  # the lock file is written while repair holds the lock, and emptied again
        assert after[name][0] == before[name][0], name
        if name != "lock":
            assert after[name][1] == before[name][1], name
    result = cli("verify", root, "--repair", "--yes")
    assert result.exit_code == 0 and "repaired" not in result.stdout + result.stderr
    assert {n: s[0] for n, s in dir_state(root).items()} == {n: s[0] for n, s in before.items()}


@MODES
def test_repair_with_only_leftovers_tidies(quantized, reliability_template, clone_store, dir_state, probe_store):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    before = dir_state(root)
    with open(root / "entries.bin", "ab") as f:
        f.write(os.urandom(RECORD + 5))
    (root / ".hmem-tmp.x").write_bytes(b"junk")
    shutil.copyfile(root / "shard_0001.safetensors", root / "shard_0099.safetensors")
    report = hmem.verify(root, full=True)
    assert {(f.code, f.severity) for f in report.findings} == {
        ("entries.tail", "warning"),
        ("file.temp", "warning"),
        ("file.orphan", "warning"),
    }
    fixed = hmem.repair(root)
    assert fixed.action == "tidied" and fixed.dropped == () and not fixed.rebuilt_index
    assert {f.code for f in fixed.findings} == {"entries.tail", "file.temp", "file.orphan"}
    assert fixed.bytes_after < fixed.bytes_before
    after = dir_state(root)
    assert after.keys() == before.keys()
    for name in before:  # nothing else was rewritten, not even index.json
        assert after[name][0] == before[name][0], name
        if name not in ("lock", "entries.bin"):
            assert after[name][1] == before[name][1], name
    assert hmem.verify(root, full=True).findings == ()
    served = probe_store(root, tpl, read_only=True)
    assert served.served == len(tpl.queries)


@MODES
def test_repair_rebuilds_a_lost_index(quantized, reliability_template, clone_store, probe_store):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    old = json.loads((root / "index.json").read_text())
    (root / "index.json").unlink()
    fixed = hmem.repair(root)
    assert fixed.action == "rewritten" and fixed.rebuilt_index and fixed.dropped == ()
    assert fixed.entries_kept == len(tpl.live)
    assert [f.code for f in fixed.findings] == ["index.missing"]
    doc = json.loads((root / "index.json").read_text())
    assert doc["config"] == old["config"] and doc["projection"] == old["projection"]
    assert doc["next_entry_id"] > max(tpl.live) and doc["next_entry_id"] >= old["next_entry_id"]
    assert live_ids(root) == tpl.live
    assert hmem.verify(root, full=True).findings == ()
    served = probe_store(root, tpl, read_only=True, exact_scores=False)
    assert served.served == len(tpl.queries)
    with Store.open(root) as store:
        keys = np.ones((1, 16), np.float32)
        assert store.put(keys, keys) >= doc["next_entry_id"]


def test_repair_without_index_or_shards_refuses(tmp_path, dir_state):
    path = tmp_path / "s"
    with Store.create(path, embed_dim=16, hdc_dim=256):
        pass
    (path / "index.json").unlink()
    before = dir_state(path)
    report = hmem.verify(path)
    assert [(f.code, f.severity) for f in report.findings] == [("index.missing", "error")]
    with pytest.raises(hmem.CorruptStoreError) as info:
        hmem.repair(path)
    assert "index.json" in info.value.message and info.value.hint
    assert {n: s[0] for n, s in dir_state(path).items()} == {n: s[0] for n, s in before.items()}
    result = cli("verify", path, "--repair", "--yes")
    assert result.exit_code == 1 and "no shard carries the store's config" in result.stderr


# ---- hmem verify --repair ----------------------------------------------------------------------


@MODES
def test_cli_repair_lists_lost_entries_and_exits_0(quantized, reliability_template, clone_store):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    flip_tensor(root, tpl, 5, "k")
    flip_tensor(root, tpl, 10, "v")
    result = cli("verify", root, "--repair", "--yes")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "tensor.checksum" in result.stdout
    assert f"repaired: kept {len(tpl.live) - 2} entries in " in result.stdout
    assert "2 entries could not be saved" in result.stdout
    lost = sorted(line for line in result.stderr.splitlines() if line.startswith("warning: lost entry"))
    assert lost == [
        "warning: lost entry 10: tensor v_10 fails its checksum",
        "warning: lost entry 5: tensor k_5 fails its checksum",
    ]
    assert live_ids(root) == tpl.live - {5, 10}
    assert cli("verify", root, "--full").exit_code == 0


def test_cli_repair_json_reports_before_repair_and_after(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    (root / "index.json").write_text("{ not json")
    result = cli("verify", root, "--repair", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [f["code"] for f in doc["verify"]["findings"]] == ["index.unreadable"]
    assert doc["repair"]["action"] == "rewritten" and doc["repair"]["rebuilt_index"] is True
    assert doc["repair"]["entries_kept"] == len(tpl.live) and doc["repair"]["dropped"] == []
    assert doc["after"]["ok"] is True and doc["after"]["findings"] == []


def test_cli_repair_of_leftovers_says_it_tidied(reliability_template, clone_store):
    root = clone_store(reliability_template(False))
    (root / ".hmem-tmp.shard_0005.safetensors.99.0").write_bytes(b"x" * 10)
    result = cli("verify", root, "--repair", "--yes")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "repaired: finished what an interrupted writer left and removed its leftovers" in result.stdout
    assert not (root / ".hmem-tmp.shard_0005.safetensors.99.0").exists()


def test_cli_repair_without_yes_off_a_terminal_changes_nothing(reliability_template, clone_store, dir_state):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(root, tpl, 5)
    (root / ".hmem-tmp.x").write_bytes(b"x")
    before = dir_state(root)
    result = cli("verify", root, "--repair", input="y\n")
    assert result.exit_code == 2, result.stdout + result.stderr
    assert "--yes" in result.stderr and "Traceback" not in result.stderr
    assert dir_state(root) == before


def test_cli_repair_refuses_while_a_writer_holds_the_lock(reliability_template, clone_store, dir_state):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(root, tpl, 5)
    with Store.open(root) as writer:
        before = dir_state(root)
        result = cli("verify", root, "--repair", "--yes")
        assert result.exit_code == 6, result.stdout + result.stderr
        assert "locked" in result.stderr
        assert dir_state(root) == before
        with pytest.raises(hmem.StoreLockedError):
            hmem.repair(root)
        assert writer.stats().entries == len(tpl.live)
    assert {f.code for f in hmem.verify(root, full=True).findings} == {"tensor.checksum"}
