"""The operator's commands that change entries: `Store.delete` and
`hmem rm`, and what `hmem put` reports (ids per file, evictions by the
store's limits, skipped files on stderr, the store it wrote to)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

D, HDC = 16, 256
ENV = {"COLUMNS": "200", "NO_COLOR": None, "FORCE_COLOR": None, "HMEM_STORE": None, "HMEM_DEBUG": None}


def run(*args, env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={**ENV, **(env or {})})


def run_json(*args, code: int = 0, env: dict | None = None) -> dict:
    result = run(*args, "--json", env=env)
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def rows(rng, n: int = 3) -> np.ndarray:
    return rng.standard_normal((n, D)).astype(np.float32)


def filled(rng, count: int = 6, path: str = "s", **settings) -> list[int]:
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, **settings) as s:
        return s.put_many([hmem.Entry(rows(rng), rows(rng), i % 2) for i in range(count)])


def files_of(path: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.name != "LOCK"}


# ---- Store.delete ----------------------------------------------------------------------------


def test_delete_removes_exactly_the_given_entries_durably(rng):
    ids = filled(rng)
    with hmem.Store.open("s") as s:
        before = {i: s.get(i) for i in ids}
        plan = s.delete([ids[4], ids[1]])
        assert plan.entry_ids == (ids[1], ids[4]) and plan.missing == ()
        assert plan.bytes_reclaimable > 0
        assert s.entry_ids() == [i for i in ids if i not in (ids[1], ids[4])]
        with pytest.raises(hmem.EntryNotFoundError):
            s.get(ids[1])
        for hit in s.query(before[ids[1]].keys, 1, top_k=10):  # no query finds a deleted entry
            assert hit.entry_id != ids[1]
    with hmem.Store.open("s", read_only=True) as s:  # committed when delete returned
        assert s.entry_ids() == [i for i in ids if i not in (ids[1], ids[4])]
        kept = s.get(ids[0])
        assert np.array_equal(kept.keys, before[ids[0]].keys)
    with hmem.Store.open("s") as s:
        report = s.compact(min_dead_share=0.0)  # every evicted byte, records too
        assert report.records_dropped == 2
        assert s.entry_ids() == [i for i in ids if i not in (ids[1], ids[4])]


def test_delete_with_an_unknown_id_deletes_nothing_unless_missing_is_ok(rng):
    ids = filled(rng)
    before = files_of("s")
    with hmem.Store.open("s") as s:
        with pytest.raises(hmem.EntryNotFoundError, match="no entry 999"):
            s.delete([ids[0], 999])
        assert s.entry_ids() == ids
    assert files_of("s") == before
    with hmem.Store.open("s") as s:
        plan = s.delete([ids[0], 999, ids[0]], missing_ok=True)  # repeats count once
        assert (plan.entry_ids, plan.missing) == ((ids[0],), (999,))
        assert s.entry_ids() == ids[1:]
        assert s.delete([ids[0]], missing_ok=True).missing == (ids[0],)  # already gone


@pytest.mark.parametrize("bad", [[-1], ["3"], [1.5], [True], "12", 5])
def test_delete_refuses_what_is_not_an_id_and_changes_nothing(rng, bad):
    ids = filled(rng)
    before = files_of("s")
    with hmem.Store.open("s") as s:
        with pytest.raises(hmem.InvalidArgumentError):
            s.delete(bad)
        assert s.entry_ids() == ids
    assert files_of("s") == before


def test_delete_takes_a_numpy_array_and_a_read_only_store_refuses(rng):
    ids = filled(rng)
    with hmem.Store.open("s", read_only=True) as s:
        assert s.plan_delete(np.array(ids[:2])).entry_ids == tuple(ids[:2])
        with pytest.raises(hmem.ReadOnlyStoreError):
            s.delete(ids[:2])
    with hmem.Store.open("s") as s:
        assert s.delete(np.array(ids[:2], dtype=np.int64)).count == 2
        assert s.stats().entries == len(ids) - 2


# ---- hmem rm ---------------------------------------------------------------------------------


def test_rm_deletes_and_says_what_compaction_frees(rng):
    ids = filled(rng)
    result = run("rm", "s", ids[0], ids[1], ids[2], ids[5], "--yes")
    assert result.exit_code == 0, result.stderr
    assert f"deleted 4 entries ({ids[0]}-{ids[2]},{ids[5]}) from s" in result.stdout
    assert "hmem compact" in result.stdout
    with hmem.Store.open("s", read_only=True) as s:
        assert s.entry_ids() == [ids[3], ids[4]]


def test_rm_dry_run_and_json_change_nothing(rng):
    ids = filled(rng)
    before = files_of("s")
    doc = run_json("rm", "s", ids[1], "--dry-run")
    assert doc["dry_run"] is True and doc["entry_ids"] == [ids[1]] and doc["deleted"] == 0
    assert doc["bytes_reclaimable"] > 0 and doc["store_entries"] == len(ids)
    assert files_of("s") == before
    doc = run_json("rm", "s", ids[1], "--yes")
    assert (doc["deleted"], doc["store_entries"], doc["missing"]) == (1, len(ids) - 1, [])


def test_rm_reports_unknown_ids_deletes_the_others_and_exits_partial(rng):
    ids = filled(rng)
    result = run("rm", "s", ids[0], 998, 999, "--yes", "-q")
    assert result.exit_code == ExitCode.PARTIAL
    assert result.stdout == ""
    assert "error: no entry 998-999 in s" in result.stderr  # under -q too
    with hmem.Store.open("s", read_only=True) as s:
        assert s.entry_ids() == ids[1:]
    before = files_of("s")
    doc = run_json("rm", "s", 998, "--yes", code=ExitCode.FAILURE)  # none of them exists
    assert doc["missing"] == [998] and doc["deleted"] == 0
    assert files_of("s") == before


def test_rm_needs_yes_when_nobody_can_confirm(rng):
    ids = filled(rng)
    before = files_of("s")
    result = run("rm", "s", ids[0])
    assert result.exit_code == ExitCode.USAGE
    assert "--yes" in result.stderr
    assert files_of("s") == before


@pytest.mark.parametrize("args", [["-3"], ["x"], []])
def test_rm_refuses_bad_ids_as_usage_errors(rng, args):
    filled(rng)
    before = files_of("s")
    assert run("rm", "s", *args, "--yes").exit_code == ExitCode.USAGE
    assert files_of("s") == before


# ---- what hmem put reports ---------------------------------------------------------------------


def kv_file(path: str, rng, n: int = 3) -> None:
    save_file({"keys": rows(rng, n), "values": rows(rng, n)}, path)


def test_put_reports_the_ids_of_each_file(rng):
    filled(rng, 0)
    for name in ("a", "b", "c"):
        kv_file(f"{name}.safetensors", rng)
    save_file({"keys": rows(rng)}, "bad.safetensors")
    doc = run_json(
        "put",
        "s",
        "a.safetensors",
        "b.safetensors",
        "bad.safetensors",
        "c.safetensors",
        "--chunk-tokens",
        "1",
        code=ExitCode.PARTIAL,
    )
    assert [(f["file"], f["entry_ids"]) for f in doc["imported"]] == [
        ("a.safetensors", [1, 2, 3]),
        ("b.safetensors", [4, 5, 6]),
        ("c.safetensors", [7, 8, 9]),
    ]
    kv_file("d.safetensors", rng)
    result = run("put", "s", "d.safetensors", "--chunk-tokens", "1")
    assert result.exit_code == 0, result.stderr
    assert "added 3 entries from 1 of 1 files into s" in result.stdout
    assert "d.safetensors: ids 10-12" in result.stdout
    with hmem.Store.open("s", read_only=True) as s:
        assert s.get(11).meta["source"] == "d.safetensors"


def test_put_reports_entries_its_limits_evicted(rng):
    filled(rng, 6, max_entries=8)
    kv_file("f.safetensors", rng, n=4)
    result = run("put", "s", "f.safetensors", "--chunk-tokens", "1")
    assert result.exit_code == 0, result.stderr
    assert "evicted 2 stored entries (lowest score first) to make room for the new entries under max_entries" in (
        result.stdout
    )
    kv_file("g.safetensors", rng, n=4)
    doc = run_json("put", "s", "g.safetensors", "--chunk-tokens", "1")
    assert (doc["entries_added"], doc["entries_evicted"], doc["compactions"]) == (4, 4, 0)
    with hmem.Store.open("s", read_only=True) as s:
        assert s.stats().entries == 8


def test_put_past_max_disk_bytes_reports_evictions_and_the_rewrite(rng):
    with hmem.Store.create("s", embed_dim=D, hdc_dim=HDC, max_disk_bytes=60_000, shard_max_bytes=8_000) as s:
        for _ in range(6):  # 30 entries, about 48 kB: the next 8 need room
            s.put_many([hmem.Entry(rows(rng, 8), rows(rng, 8)) for _ in range(5)])
        before = s.stats().entries
    kv_file("f.safetensors", rng, n=64)
    doc = run_json("put", "s", "f.safetensors", "--chunk-tokens", "8")
    assert doc["entries_added"] == 8
    assert doc["entries_evicted"] > 0 and doc["compactions"] >= 1 and doc["bytes_rewritten"] > 0
    with hmem.Store.open("s", read_only=True) as s:
        assert s.stats().entries == before + 8 - doc["entries_evicted"]


def test_a_mistyped_store_with_hmem_store_set_is_not_taken_for_a_file(rng):
    filled(rng, 2, path="s1")
    kv_file("f.safetensors", rng)
    before = files_of("s1")
    result = run("put", "s1typo", "f.safetensors", env={"HMEM_STORE": "s1"})
    assert result.exit_code == ExitCode.USAGE
    assert "s1typo is not a store, nor a file or directory to import" in result.stderr
    assert files_of("s1") == before
    result = run("put", "f.safetensors", env={"HMEM_STORE": "s1"})  # the store left out: HMEM_STORE's
    assert result.exit_code == 0, result.stderr
    assert "into s1" in result.stdout


# ---- re-imports skip what is stored (the import registry) --------------------------------------


def test_a_second_put_of_the_same_files_imports_nothing(rng):
    filled(rng, 0)
    for name in ("a", "b"):
        kv_file(f"{name}.safetensors", rng)
    first = run_json("put", "s", "a.safetensors", "b.safetensors")
    assert first["entries_added"] == 2
    second = run_json("put", "s", "a.safetensors", "b.safetensors")
    assert (second["entries_added"], second["files_already_imported"]) == (0, 2)
    assert [(f["file"], f["imported_as"], f["entry_ids"]) for f in second["already_imported"]] == [
        ("a.safetensors", "a.safetensors", [1]),
        ("b.safetensors", "b.safetensors", [2]),
    ]
    human = run("put", "s", "a.safetensors")
    assert human.exit_code == 0 and "already imported, not imported again: a.safetensors" in human.stdout
    again = run_json("put", "s", "a.safetensors", "--again")  # the operator insists
    assert again["entries_added"] == 1 and again["imported"][0]["entry_ids"] == [3]
    with hmem.Store.open("s", read_only=True) as s:
        assert s.stats().entries == 3
        assert [(x.name, list(x.entry_ids)) for x in s.imported_sources()] == [
            ("a.safetensors", [1]),
            ("b.safetensors", [2]),
            ("a.safetensors", [3]),
        ]


def test_the_same_content_under_another_name_is_already_imported_and_a_changed_file_is_not(rng):
    filled(rng, 0)
    kv_file("a.safetensors", rng)
    assert run_json("put", "s", "a.safetensors")["entries_added"] == 1
    Path("copy.safetensors").write_bytes(Path("a.safetensors").read_bytes())
    doc = run_json("put", "s", "copy.safetensors")
    assert doc["entries_added"] == 0 and doc["already_imported"][0]["imported_as"] == "a.safetensors"
    kv_file("a.safetensors", rng)  # new content, same name and size
    assert run_json("put", "s", "a.safetensors")["entries_added"] == 1


def test_rerunning_a_stopped_import_stores_exactly_what_is_missing(rng):
    filled(rng, 0)
    os.mkdir("in")
    for n in range(5):
        kv_file(f"in/f{n}.safetensors", rng)
    calls = []
    with hmem.Store.open("s") as s:  # stopped after two files, as by Ctrl-C
        report = hmem.import_files(s, ["in"], should_stop=lambda: calls.append(1) or len(calls) > 2)
        assert len(report.files) == 2 and len(report.not_started) == 3
    with hmem.Store.open("s") as s:
        report = hmem.import_files(s, ["in"])
        assert [len(f.entries) for f in report.files] == [0, 0, 1, 1, 1]
        assert [f.imported_before is not None for f in report.files] == [True, True, False, False, False]
    with hmem.Store.open("s", read_only=True) as s:
        assert s.stats().entries == 5
        assert sorted(x.name for x in s.imported_sources()) == [f"f{n}.safetensors" for n in range(5)]


def test_an_unflushed_import_is_not_recorded_and_a_dry_run_records_nothing(rng):
    filled(rng, 0)
    kv_file("a.safetensors", rng)
    assert run_json("put", "s", "a.safetensors", "--dry-run")["entries_found"] == 1
    with hmem.Store.open("s", read_only=True) as s:
        assert s.imported_sources() == []
    s = hmem.Store.open("s")
    hmem.import_files(s, ["a.safetensors"])
    assert len(s.imported_sources()) == 1  # pending: seen by this writer
    with hmem.Store.open("s", read_only=True) as reader:  # not committed yet
        assert reader.imported_sources() == [] and reader.stats().entries == 0
    s.close()
    with hmem.Store.open("s", read_only=True) as reader:
        assert len(reader.imported_sources()) == 1 and reader.stats().entries == 1


def test_a_store_that_never_imported_a_file_has_no_registry(rng):
    filled(rng, 3)
    doc = json.loads(Path("s/index.json").read_text())  # the format: no "sources" key while empty
    assert "sources" not in doc and not Path("s/sources.jsonl").exists()


def test_a_damaged_registry_is_found_by_verify_and_repaired(rng):
    filled(rng, 0)
    for n in range(3):
        kv_file(f"f{n}.safetensors", rng)
    assert run_json("put", "s", "f0.safetensors", "f1.safetensors", "f2.safetensors")["entries_added"] == 3
    path = Path("s/sources.jsonl")
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], lines[1].replace(b'"sha256"', b'"shaXXX"'), *lines[2:]]))
    report = hmem.verify("s")
    assert [f.code for f in report.problems] == ["sources.damaged"]
    with pytest.raises(hmem.CorruptStoreError):
        hmem.Store.open("s", read_only=True).imported_sources()
    hmem.repair("s")
    assert hmem.verify("s", full=True).ok
    with hmem.Store.open("s") as s:
        assert [x.name for x in s.imported_sources()] == ["f0.safetensors"]  # the whole records before the damage
        assert s.stats().entries == 3  # no entry is lost for it
    doc = run_json("put", "s", "f0.safetensors", "f1.safetensors", "f2.safetensors")
    assert (doc["entries_added"], doc["files_already_imported"]) == (2, 1)


def test_a_lost_index_keeps_the_registry_through_repair(rng):
    filled(rng, 0)
    for n in range(2):
        kv_file(f"f{n}.safetensors", rng)
    run_json("put", "s", "f0.safetensors", "f1.safetensors")
    os.unlink("s/index.json")
    hmem.repair("s")
    with hmem.Store.open("s") as s:
        assert [x.name for x in s.imported_sources()] == ["f0.safetensors", "f1.safetensors"]
    assert run_json("put", "s", "f0.safetensors", "f1.safetensors")["entries_added"] == 0


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (dict(sha256="xyz"), "sha256"),
        (dict(entry_ids=[3, 5]), "consecutive"),
        (dict(name=""), "name"),
        (dict(entry_ids=[99]), "never handed out"),
        (dict(size=-1), "size"),
    ],
)
def test_record_source_refuses_bad_records(rng, bad, fragment):
    ids = filled(rng, 3)
    args = dict(name="f.safetensors", sha256="0" * 64, size=10, entry_ids=ids[:2])
    args.update(bad)
    with hmem.Store.open("s") as s:
        with pytest.raises(hmem.InvalidArgumentError, match=fragment):
            s.record_source(**args)
        assert s.imported_sources() == []


def test_rm_takes_the_store_from_hmem_store(rng):
    ids = filled(rng)
    result = run("rm", ids[2], "--yes", env={"HMEM_STORE": "s"})
    assert result.exit_code == 0, result.stderr
    with hmem.Store.open("s", read_only=True) as s:
        assert ids[2] not in s.entry_ids() and len(s.entry_ids()) == len(ids) - 1


def test_a_refused_file_among_small_ones_put_together_is_skipped_alone(rng):
    """Small files go in with one put; a file the put refuses (NaN) sends
    them in one by one: the others are stored, in order, each whole."""
    filled(rng, 0)
    kv_file("a.safetensors", rng)
    k = rows(rng)
    k[1, 2] = np.nan
    save_file({"keys": k, "values": rows(rng)}, "b_nan.safetensors")
    kv_file("c.safetensors", rng)
    with hmem.Store.open("s") as s:
        report = hmem.import_files(s, ["a.safetensors", "b_nan.safetensors", "c.safetensors"], chunk_tokens=1)
        assert [Path(f.path).name for f in report.files] == ["a.safetensors", "b_nan.safetensors", "c.safetensors"]
        assert [f.entries for f in report.files] == [(1, 2, 3), (), (4, 5, 6)]
        assert "NaN" in report.files[1].skipped
        assert [x.name for x in s.imported_sources()] == ["a.safetensors", "c.safetensors"]


def test_files_opened_ahead_keep_their_order_and_their_reasons(rng):
    """Files are opened and hashed ahead of the one being put: an
    unreadable file, a large file put alone, a copy of an earlier file and
    small ones still come out in the order given, each with its own
    result."""
    filled(rng, 0)
    kv_file("a.safetensors", rng)
    Path("b_garbage.safetensors").write_bytes(b"\x05" * 64)
    tokens = (4 << 20) // (2 * D * 4) + 1  # past 4 MiB: put alone
    save_file({"keys": rows(rng, tokens), "values": rows(rng, tokens)}, "c_big.safetensors")
    Path("d_copy.safetensors").write_bytes(Path("a.safetensors").read_bytes())
    kv_file("e.safetensors", rng)
    names = ["a.safetensors", "b_garbage.safetensors", "c_big.safetensors", "d_copy.safetensors", "e.safetensors"]
    with hmem.Store.open("s") as s:
        report = hmem.import_files(s, names)
        assert [Path(f.path).name for f in report.files] == names
        assert [len(f.entries) for f in report.files] == [1, 0, 1, 0, 1]
        assert report.files[1].skipped and "header" in report.files[1].skipped
        assert report.files[3].imported_before.name == "a.safetensors"
        assert [x.name for x in s.imported_sources()] == ["a.safetensors", "c_big.safetensors", "e.safetensors"]
        assert s.entry_ids() == [f.entries[0] for f in report.files if f.entries]


def test_a_copy_within_one_import_is_imported_once(rng):
    filled(rng, 0)
    kv_file("a.safetensors", rng)
    Path("b.safetensors").write_bytes(Path("a.safetensors").read_bytes())
    with hmem.Store.open("s") as s:
        report = hmem.import_files(s, ["a.safetensors", "b.safetensors"])
        assert [len(f.entries) for f in report.files] == [1, 0]
        assert report.files[1].imported_before.name == "a.safetensors"
        report = hmem.import_files(s, ["a.safetensors", "b.safetensors"], again=True)
        assert [len(f.entries) for f in report.files] == [1, 1]


def test_a_large_file_is_hashed_beside_its_put_and_found_again(rng):
    filled(rng, 0)
    tokens = (4 << 20) // (2 * D * 4) + 1  # past 4 MiB: put alone, hashed on the second thread
    save_file({"keys": rows(rng, tokens), "values": rows(rng, tokens)}, "big.safetensors")
    doc = run_json("put", "s", "big.safetensors", "--chunk-tokens", "4096")
    assert doc["entries_added"] == -(-tokens // 4096)
    again = run_json("put", "s", "big.safetensors", "--chunk-tokens", "4096")
    assert again["entries_added"] == 0
    assert again["already_imported"][0]["sha256"] == hashlib.sha256(Path("big.safetensors").read_bytes()).hexdigest()


def test_a_copy_of_a_refused_file_in_the_same_batch_is_refused_too(rng):
    filled(rng, 0)
    k = rows(rng)
    k[0, 0] = np.inf
    save_file({"keys": k, "values": rows(rng)}, "a_bad.safetensors")
    Path("b_bad.safetensors").write_bytes(Path("a_bad.safetensors").read_bytes())
    kv_file("c.safetensors", rng)
    with hmem.Store.open("s") as s:
        report = hmem.import_files(s, ["a_bad.safetensors", "b_bad.safetensors", "c.safetensors"])
        assert [f.skipped is not None for f in report.files] == [True, True, False]
        assert [Path(f.path).name for f in report.files] == ["a_bad.safetensors", "b_bad.safetensors", "c.safetensors"]
        assert report.entries_added == 1 and [x.name for x in s.imported_sources()] == ["c.safetensors"]
