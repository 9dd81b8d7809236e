"""A stale index.json (older than the store's files, as when one file is
restored from a backup) is told from the leftovers of one interrupted flush:
verify reports it, a writer refuses to open the store, and repair rolls
forward keeping every intact entry with its id; no id is given twice
afterwards (docs/reliability.md, "Stale index.json").  A store of a newer
format is never rewritten."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app

DIM = 16


def tree_hash(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def kv(rng: np.random.Generator, tokens: int = 3) -> tuple[np.ndarray, np.ndarray]:
    return (
        rng.standard_normal((tokens, DIM)).astype(np.float32),
        rng.standard_normal((tokens, DIM)).astype(np.float32),
    )


def build(
    root: Path, *, sessions: int, evict_and_compact_at: int | None = None, shard_max_bytes: int = 4096
) -> tuple[list[bytes], dict[int, tuple[np.ndarray, np.ndarray]]]:
    """A store written by `sessions` writer sessions of two flushes each;
    returns index.json as it was after every flush (oldest first) and the
    entries live at the end {id: (keys, values)}."""
    rng = np.random.default_rng(7)
    puts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    generations = []
    hmem.Store.create(root, embed_dim=DIM, hdc_dim=256, shard_max_bytes=shard_max_bytes).close()
    for session in range(sessions):
        with hmem.Store.open(root) as store:
            for _ in range(2):
                for i in range(6):
                    k, v = kv(rng)
                    puts[store.put(k, v, layer_idx=i % 2)] = (k, v)
                store.flush()  # mid-session: the id reservation is still open
                generations.append((root / "index.json").read_bytes())
            if session == evict_and_compact_at:
                store.evict(len(store.entry_ids()) - 5)
                store.compact()
                generations.append((root / "index.json").read_bytes())
        generations.append((root / "index.json").read_bytes())  # closed: exact ids
    with hmem.Store.open(root, read_only=True) as reader:
        live = {i: puts[i] for i in reader.entry_ids()}
    return generations, live


def assert_holds_exactly(root: Path, live: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    with hmem.Store.open(root, read_only=True) as reader:
        assert reader.entry_ids() == sorted(live)
        for entry_id, (k, v) in live.items():
            got = reader.get(entry_id)
            assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)


@pytest.mark.parametrize("compaction", [False, True], ids=["appends", "with-compaction"])
def test_every_older_index_is_reported_refused_and_rolled_forward(tmp_path, compaction):
    template = tmp_path / "template"
    generations, live = build(template, sessions=3, evict_and_compact_at=1 if compaction else None)
    # every index.json that names other data than the newest (the last
    # commits of a session only narrow the id reservation: no data differs)
    older = [g for g in dict.fromkeys(generations) if _data_of(g) != _data_of(generations[-1])]
    assert len(older) >= 5
    ever_seen = max(live)
    for n, stale in enumerate(older):
        root = tmp_path / f"s{n}"
        _copy(template, root)
        (root / "index.json").write_bytes(stale)  # one file restored from a backup
        before = tree_hash(root)

        report = hmem.verify(root)
        assert "index.stale" in {f.code for f in report.findings if f.severity == "error"}, n
        with pytest.raises(hmem.CorruptStoreError, match="older than the store's files"):
            hmem.Store.open(root)  # a writer would remove newer data as leftovers: refused
        assert tree_hash(root) == before  # verify and the refused open wrote nothing

        fixed = hmem.repair(root)
        assert fixed.rolled_forward and fixed.action == "rewritten"
        assert fixed.entries_kept == len(live) and not [d for d in fixed.dropped if d[0] is not None]
        assert hmem.verify(root, full=True).ok
        assert_holds_exactly(root, live)
        with hmem.Store.open(root) as store:  # no id is given twice
            fresh = store.put(*kv(np.random.default_rng(n)))
            assert fresh > ever_seen
            assert fresh not in live


def test_the_newest_index_is_not_stale(tmp_path):
    generations, live = build(tmp_path / "s", sessions=2)
    report = hmem.verify(tmp_path / "s", full=True)
    assert report.ok and "index.stale" not in {f.code for f in report.findings}
    assert_holds_exactly(tmp_path / "s", live)


def test_a_store_without_a_stamp_is_judged_by_its_entry_ids(tmp_path):
    # Stores written before the commit stamp: a closed session's index.json
    # reserves no id past its entries, so later entries prove it stale.
    root = tmp_path / "s"
    generations, live = build(root, sessions=3)
    (root / "commit.stamp").unlink()
    (root / "index.json").write_bytes(generations[2])  # the first session, closed
    assert "index.stale" in {f.code for f in hmem.verify(root).findings}
    fixed = hmem.repair(root)
    assert fixed.rolled_forward
    assert_holds_exactly(root, live)


def test_leftovers_of_one_interrupted_flush_are_still_rolled_back(tmp_path, run_python):
    root = tmp_path / "s"
    generations, live = build(root, sessions=1)
    script = f"""
import numpy as np, hmem
store = hmem.Store.open({str(root)!r})
rng = np.random.default_rng(1)
for i in range(9):
    store.put(rng.standard_normal((3, {DIM})).astype(np.float32), rng.standard_normal((3, {DIM})).astype(np.float32))
store.flush()
"""
    crashed = run_python(script, env={"HMEM_CRASH_AT": "flush.records_written"})
    assert crashed.returncode == 86, crashed.stderr
    report = hmem.verify(root)
    codes = {f.code for f in report.findings}
    assert "index.stale" not in codes and "entries.tail" in codes
    assert not [f for f in report.findings if f.severity == "error"]
    with hmem.Store.open(root) as store:  # the writer rolls the unacknowledged flush back
        assert store.entry_ids() == sorted(live)
    assert hmem.verify(root, full=True).ok


def test_the_cli_case_from_a_backup(tmp_path):
    # hmem init; put; copy index.json; put; put; restore the copy; verify; repair
    runner = CliRunner()
    source = tmp_path / "d1"
    source.mkdir()
    rng = np.random.default_rng(3)
    for n in range(4):
        tensors = {f"layer.{i}.k": rng.standard_normal((8, DIM)).astype(np.float32) for i in range(4)}
        tensors.update({f"layer.{i}.v": rng.standard_normal((8, DIM)).astype(np.float32) for i in range(4)})
        hmem.write_kv_file(source / f"f{n}.safetensors", tensors)
    store = tmp_path / "S"
    assert runner.invoke(app, ["init", str(store), "-d", str(DIM)]).exit_code == 0
    assert runner.invoke(app, ["put", str(store), str(source)]).exit_code == 0
    old = (store / "index.json").read_bytes()
    for _ in range(2):
        assert (
            runner.invoke(
                app,
                ["put", str(store), str(source), "--again"]
                if _supports_again(runner)
                else ["put", str(store), str(source)],
            ).exit_code
            == 0
        )
    (store / "index.json").write_bytes(old)
    checked = runner.invoke(app, ["verify", str(store)])
    assert checked.exit_code == 4 and "index.stale" in checked.stdout and "roll forward" in checked.stdout
    repaired = runner.invoke(app, ["verify", str(store), "--repair", "--yes", "--json"])
    assert repaired.exit_code == 0, repaired.output
    document = json.loads(repaired.stdout)
    assert document["repair"]["rolled_forward"] and document["repair"]["entries_kept"] == 48
    assert document["repair"]["dropped"] == []
    stats = json.loads(runner.invoke(app, ["stats", str(store), "--json"]).stdout)
    assert stats["entries"] == 48 and stats["next_entry_id"] > 48


def _data_of(index_json: bytes) -> tuple:
    doc = json.loads(index_json)
    return doc["record_count"], [(s["file"], s["uid"]) for s in doc["shards"]]


def _supports_again(runner: CliRunner) -> bool:
    return "--again" in runner.invoke(app, ["put", "--help"]).stdout


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())


def test_a_newer_format_is_never_rewritten(tmp_path):
    root = tmp_path / "s"
    build(root, sessions=1)
    (root / "lock").unlink(missing_ok=True)
    # a format test: rewrite index.json as a newer hmem would, its checksum fixed
    from hmem.formats import manifest

    doc = json.loads((root / "index.json").read_bytes())
    doc["format_version"] = manifest.FORMAT_VERSION + 1
    doc.pop("checksum", None)
    doc["checksum"] = f"crc32c:{manifest._checksum(doc):08x}"
    (root / "index.json").write_text(json.dumps(doc))
    before = tree_hash(root)
    with pytest.raises(hmem.UnsupportedFormatError):
        hmem.verify(root)
    with pytest.raises(hmem.UnsupportedFormatError):
        hmem.repair(root)
    runner = CliRunner()
    assert runner.invoke(app, ["verify", str(root)]).exit_code == 7
    assert runner.invoke(app, ["verify", str(root), "--repair", "--yes"]).exit_code == 7
    assert runner.invoke(app, ["stats", str(root)]).exit_code == 7
    assert tree_hash(root) == before and not (root / "lock").exists()
