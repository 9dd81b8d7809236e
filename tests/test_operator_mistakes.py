"""An operator's mistakes with a local store (issue 40): each refused with
a clear error and its documented exit code, the store left unchanged, or
read past and reported, never a hang, an overwritten store file, or K/V
imported as something it is not.

- a shard size limit too small to hold a shard (it made every put loop
  without end) and a store whose index.json holds one;
- ``hmem query --export`` (like ``hmem export``) into the store's directory;
- ``hmem put`` of another store's shards, or of a directory of stores;
- one damaged record of entries.bin, read past with ``--skip-damaged``;
- an empty path, and a file where a store goes (exit code 10 everywhere);
- ``hmem stats`` on a stale index.json; ``verify --full --subset``;
- a SIGINT before ``hmem put`` began importing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

D, HDC = 16, 256
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "FORCE_COLOR": None, "HMEM_STORE": None, "HMEM_DEBUG": None}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(40)


def rows(rng, n: int = 3) -> np.ndarray:
    return rng.standard_normal((n, D)).astype(np.float32)


def filled(rng, path: str = "s", count: int = 6, **settings) -> list[int]:
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, **settings) as s:
        return s.put_many([hmem.Entry(rows(rng), rows(rng), i % 2, 1.0 + i) for i in range(count)])


def files_of(path: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file() and p.name != "lock"}


def kv_file(rng, path: str) -> None:
    save_file({"k": rows(rng), "v": rows(rng)}, path)


# ---- shard_max_bytes: bounded at init and at open, the planner always progresses ------------


def test_a_shard_limit_below_the_minimum_is_refused_at_init(rng):
    result = run("init", "tiny", "--embed-dim", D, "--shard-max", "1")
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "shard_max_bytes must be between 512" in result.stderr
    assert not Path("tiny").exists()
    with pytest.raises(hmem.InvalidArgumentError, match="between 512"):
        hmem.Store.create("tiny", embed_dim=D, shard_max_bytes=hmem.config.MIN_SHARD_MAX_BYTES - 1)
    with pytest.raises(hmem.InvalidArgumentError):
        hmem.Store.create("tiny", embed_dim=D, shard_max_bytes=hmem.config.MAX_SHARD_MAX_BYTES + 1)
    assert not Path("tiny").exists()


def test_a_store_whose_index_holds_a_tiny_shard_limit_is_refused_at_open(rng, rewrite_index):
    filled(rng)
    rewrite_index("s", lambda doc: doc["config"].update(shard_max_bytes=1))
    before = files_of("s")
    for read_only in (False, True):
        with pytest.raises(hmem.UnsupportedFormatError, match="shard_max_bytes must be between 512"):
            hmem.Store.open("s", read_only=read_only)
    kv_file(rng, "a.safetensors")
    result = run("put", "s", "a.safetensors")  # once a put that looped until the memory ran out
    assert result.exit_code == ExitCode.UNSUPPORTED_FORMAT, result.output
    assert "cannot be honoured" in result.stderr
    assert files_of("s") == before


def test_entries_larger_than_the_shard_limit_each_get_a_shard(rng):
    limit = hmem.config.MIN_SHARD_MAX_BYTES
    ids = []
    with hmem.Store.create("s", embed_dim=D, hdc_dim=HDC, shard_max_bytes=limit) as s:
        for n in (1, 5, 2, 7):  # puts of one and of several entries, each over the limit
            ids += s.put_many([hmem.Entry(rows(rng, 4), rows(rng, 4), 0) for _ in range(n)])
        ids += s.put_many([hmem.Entry(rows(rng, 1), rows(rng, 1), 0)])
    with hmem.Store.open("s", read_only=True) as s:
        stats = s.stats()
        assert stats.entries == len(ids) == 16
        assert [shard.entries for shard in stats.shards] == [1] * 16
        for entry_id in ids:
            s.get(entry_id)


# ---- query --export and export: never into the store's directory -------------------------------


@pytest.mark.parametrize("name", ["shard_0000.safetensors", "index.json", "entries.bin", "new.safetensors"])
@pytest.mark.parametrize("through_link", [False, True])
def test_query_export_and_export_refuse_a_path_inside_the_store(rng, name, through_link):
    filled(rng)
    np.save("q.npy", rows(rng, 2))
    if through_link:
        os.symlink("s", "link")
    target = f"{'link' if through_link else 's'}/{name}"
    before = files_of("s")
    result = run("query", "s", "--query", "q.npy", "--layer", 0, "--export", target)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "inside the store" in result.stderr
    result = run("export", "s", 1, "-o", target)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "inside the store" in result.stderr
    assert files_of("s") == before
    with hmem.Store.open("s", read_only=True) as s:  # the library refuses it too, for a query's results
        results = s.query(rows(rng, 2), 0, 2)
        with pytest.raises(hmem.InvalidArgumentError, match="inside the store"):
            hmem.export_results(results, target, store=s.path)
    assert files_of("s") == before
    assert hmem.verify("s").ok


# ---- put: another store's shards are not K/V files --------------------------------------------


def test_put_skips_shard_files_and_store_directories_with_their_reason(rng):
    filled(rng, "other")
    filled(rng, "s", count=2)
    os.makedirs("many/sub")
    shutil.copytree("other", "many/other_copy")
    shutil.copy("other/shard_0000.safetensors", "many/sub/shard_0000.backup.safetensors")
    kv_file(rng, "many/sub/real.safetensors")
    result = run("put", "s", "many", "--json")
    assert result.exit_code == ExitCode.PARTIAL, result.output
    doc = json.loads(result.stdout)
    assert doc["entries_added"] == 1 and doc["files_imported"] == 1
    reasons = {Path(s["file"]).name: s["reason"] for s in doc["skipped"]}
    assert set(reasons) == {"other_copy", "shard_0000.backup.safetensors"}
    assert reasons["other_copy"].startswith("an hmem store directory")
    assert reasons["shard_0000.backup.safetensors"].startswith("an hmem shard file")
    assert "skipped many/other_copy: an hmem store directory" in result.stderr
    # a store given as the directory to import, and a shard given by name: nothing imported
    before = files_of("s")
    result = run("put", "s", "other", "other/shard_0000.safetensors")
    assert result.exit_code == ExitCode.FAILURE, result.output
    assert result.stderr.count("skipped") == 2
    assert files_of("s") == before
    with hmem.Store.open("s", read_only=True) as s:
        assert s.stats().entries == 3


# ---- one damaged record: --skip-damaged reads past it -----------------------------------------


def test_skip_damaged_reads_past_a_damaged_record(rng):
    ids = filled(rng)
    np.save("q.npy", rows(rng, 2))
    path = Path("s/entries.bin")
    data = bytearray(path.read_bytes())
    size = len(data) // len(ids)
    data[2 * size + 20] ^= 0xFF  # the timestamp of the third record
    path.write_bytes(bytes(data))
    damaged, sound = ids[2], ids[3]
    query = ("query", "s", "--query", "q.npy", "--layer", damaged % 2, "--top-k", 10)
    for args in (("ls", "s"), ("show", "s", sound), ("export", "s", sound, "-o", "out.safetensors"), query):
        result = run(*args)
        assert result.exit_code == ExitCode.FAILURE and "fail their checksum" in result.stderr, (args, result.output)
        result = run(*args, "--skip-damaged")
        assert result.exit_code == ExitCode.OK, (args, result.output)
        assert f"skipped damaged record 2 of entries.bin (entry {damaged})" in result.stderr, args
    for args in (("show", "s", damaged), ("export", "s", sound, damaged, "-o", "out.safetensors")):
        result = run(*args, "--skip-damaged")  # the damaged entry itself: said so, not "no such entry"
        assert result.exit_code == ExitCode.FAILURE, (args, result.output)
        assert f"the record of entry {damaged} in entries.bin is damaged" in result.stderr, args
    doc = json.loads(run("ls", "s", "--skip-damaged", "--json").stdout)
    assert [e["entry_id"] for e in doc["entries"]] == [i for i in ids if i != damaged]
    doc = json.loads(run(*query, "--skip-damaged", "--json").stdout)
    assert damaged not in [r["entry_id"] for r in doc["results"]]
    assert doc["skipped"][0] == {
        "entry_id": damaged,
        "shard": None,
        "reason": "record 2 of entries.bin fails its checksum",
    }
    with hmem.Store.open("s", read_only=True, on_damage="skip") as s:
        assert s.damaged_records == ((2, damaged),)
        assert s.entry_ids() == [i for i in ids if i != damaged]
    with pytest.raises(hmem.InvalidArgumentError, match="read_only"):
        hmem.Store.open("s", on_damage="skip")


# ---- an empty path; a file where a store goes ----------------------------------------------


def test_an_empty_path_is_refused_not_taken_for_the_current_directory(rng):
    filled(rng)
    np.save("q.npy", rows(rng, 2))
    kv_file(rng, "a.safetensors")
    before = files_of("s")
    cwd_before = sorted(os.listdir("."))
    for args in (
        ("init", "", "--embed-dim", D),
        ("stats", ""),
        ("put", "", "a.safetensors"),
        ("put", "s", ""),
        ("query", "s", "--query", "", "--layer", 0),
        ("query", "s", "--query", "q.npy", "--layer", 0, "--export", ""),
        ("export", "s", 1, "-o", ""),
        ("copy", "s", ""),
        ("verify", ""),
    ):
        result = run(*args)
        assert result.exit_code == ExitCode.USAGE, (args, result.output)
        assert "is empty ('')" in result.stderr, (args, result.stderr)
    assert files_of("s") == before and sorted(os.listdir(".")) == cwd_before
    for call in (
        lambda: hmem.Store.create("", embed_dim=D),
        lambda: hmem.Store.open(""),
        lambda: hmem.Store.open("", read_only=True),
        lambda: hmem.verify(""),
    ):
        with pytest.raises(hmem.InvalidArgumentError, match="is empty"):
            call()


@pytest.mark.parametrize(
    "args",
    [
        ("init", "{f}", "--embed-dim", D),
        ("stats", "{f}"),
        ("ls", "{f}"),
        ("show", "{f}", 1),
        ("export", "{f}", 1, "-o", "out.safetensors"),
        ("query", "{f}", "--query", "q.npy", "--layer", 0),
        ("put", "{f}", "a.safetensors"),
        ("evict", "{f}", "--target", 1),
        ("rm", "{f}", 1),
        ("compact", "{f}"),
        ("verify", "{f}"),
        ("verify", "{f}", "--repair", "--yes"),
        ("copy", "{f}", "copied"),
        ("copy", "s", "{f}"),
    ],
    ids=lambda args: " ".join(str(a) for a in args[:2] if a != "{f}") or args[0],
)
def test_a_file_where_a_store_goes_exits_10_for_every_command(rng, args):
    filled(rng)
    np.save("q.npy", rows(rng, 2))
    kv_file(rng, "a.safetensors")
    Path("afile").write_bytes(b"not a store")
    result = run(*(("afile" if a == "{f}" else a) for a in args))
    assert result.exit_code == ExitCode.BAD_PATH == 10, result.output
    assert "afile is a file, not a store directory" in result.stderr
    assert Path("afile").read_bytes() == b"not a store" and not Path("copied").exists()


# ---- messages that are true ---------------------------------------------------------------------


def test_stats_health_is_not_ok_on_a_stale_index(rng):
    filled(rng, count=2)
    old = Path("s/index.json").read_bytes()
    with hmem.Store.open("s") as s:
        s.put_many([hmem.Entry(rows(rng), rows(rng), 0)])
    Path("s/index.json").write_bytes(old)  # index.json is older than the files now
    assert any(f.severity == "error" for f in hmem.verify("s").findings)
    with hmem.Store.open("s", read_only=True) as s:
        health = s.stats().health
    assert not health.ok and "index.json is older than the store's files" in health.stale_index
    result = run("stats", "s")
    assert result.exit_code == ExitCode.OK, result.output
    assert "health: ok" not in result.stdout
    assert "index.json is older than the store's files" in result.stdout and "hmem verify --repair" in result.stdout
    doc = json.loads(run("stats", "s", "--json").stdout)
    assert doc["health"]["ok"] is False and doc["health"]["stale_index"]


def test_stats_health_stays_ok_for_a_reader_after_a_writer_commits(rng):
    filled(rng, count=2)
    with hmem.Store.open("s", read_only=True) as reader:
        with hmem.Store.open("s") as writer:
            writer.put_many([hmem.Entry(rows(rng), rows(rng), 0)])
        assert reader.stats().health.ok  # the newer files are a newer commit's, not a stale index


def test_verify_full_subset_says_which_subset_it_checked(rng):
    filled(rng, shard_max_bytes=2000)
    result = run("verify", "s", "--full", "--subset", "2/7")
    assert result.exit_code == ExitCode.OK, result.output
    assert "subset 2/7 (the shards numbered 1 mod 7)" in " ".join(result.stdout.split())
    assert "subset" not in run("verify", "s", "--full").stdout
    doc = json.loads(run("verify", "s", "--full", "--subset", "2/7", "--json").stdout)
    assert doc["verify"]["subset"] == "2/7"
    assert json.loads(run("verify", "s", "--full", "--json").stdout)["verify"]["subset"] is None
    assert hmem.verify("s", full=True, subset=(2, 7)).subset == (2, 7)


@pytest.mark.skipif(not hasattr(os, "waitid"), reason="needs os.waitid to see a process stop")
def test_a_sigint_before_put_began_importing_says_nothing_was_committed(rng, tmp_path):
    filled(rng, count=2)
    kv_file(rng, "a.safetensors")
    before = files_of("s")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "HMEM_STORE", "HMEM_DEBUG")}
    env.update(NO_COLOR="1", COLUMNS="200", HMEM_PAUSE_AT="lock.taken")  # in Store.open: before the import
    proc = subprocess.Popen(
        [sys.executable, "-m", "hmem", "put", "s", "a.safetensors", "--json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)  # stopped at the point
    assert info is not None and info.si_code == os.CLD_STOPPED
    proc.send_signal(signal.SIGINT)  # pending until it runs on: it lands at the point
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)  # a hang guard only
    assert proc.returncode == ExitCode.INTERRUPTED, (out, err)
    assert "nothing was committed" in err and "Traceback" not in err
    doc = json.loads(out)
    assert doc["interrupted"]["entries_committed"] == 0 and doc["entries_added"] == 0
    assert doc["interrupted"]["files_not_started"] == 1
    assert files_of("s") == before
