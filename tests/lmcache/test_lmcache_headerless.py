"""An fs connector configured with ``save_chunk_meta: false`` writes each
chunk's bytes without a header: hmem reads such a cache given its K/V
shape, and without one says what it sees instead of a bad header alone.

LMCache 0.5.6 writes the full-size cache (HMEM_LMCACHE_PYTHON); the small
one is the committed fs cache with its 28-byte headers cut off, which the
first test shows is exactly what LMCache writes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from hmem.lmcache import Deployment, KVShape, explain, export_fs_cache, open_cache, parse_requests

SMALL = Path(__file__).parents[1] / "data" / "lmcache"
HEADER_BYTES = 28


@pytest.fixture(params=["small", "written"])
def headerless(request, tmp_path) -> tuple[Path, dict, dict]:
    """(the cache directory, the oracle, the oracle of its requests and files)."""
    if request.param == "small":
        oracle = json.loads((SMALL / "oracle.json").read_text())
        directory = tmp_path / "fs_headerless"
        shutil.copytree(SMALL / "fs", directory)
        for path in directory.iterdir():
            path.write_bytes(path.read_bytes()[HEADER_BYTES:])
        return directory, oracle, oracle["caches"]["fs"]
    root, oracle = request.getfixturevalue("written")
    directory = tmp_path / "fs_headerless"  # a copy: the session's caches are read-only to the tests
    shutil.copytree(root / "fs_headerless", directory)
    shutil.copytree(root / "fs", tmp_path / "fs")
    return directory, oracle, oracle["caches"]["fs_headerless"]


def test_lmcache_writes_the_fs_bytes_without_their_header(written):
    root, _ = written
    plain, headed = root / "fs_headerless", root / "fs"
    assert sorted(os.listdir(plain)) == sorted(os.listdir(headed))
    for name in os.listdir(plain):
        assert (plain / name).read_bytes() == (headed / name).read_bytes()[HEADER_BYTES:]


def test_without_a_shape_verify_says_the_files_have_no_header(headerless):
    directory, oracle, _ = headerless
    report = open_cache(directory, chunk_size=oracle["chunk_size"]).verify()
    assert not report.ok
    problems = [f.problem for f in report.findings]
    assert problems.count("bad header") == len(os.listdir(directory))
    [hint] = [f for f in report.findings if f.problem == "no fs header"]
    assert "save_chunk_meta" in hint.detail and "--kv-shape" in hint.detail


def test_with_its_shape_the_cache_reads_whole(headerless):
    directory, oracle, made = headerless
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    cache = open_cache(directory, chunk_size=oracle["chunk_size"], kv_shape=KVShape(oracle["layers"], oracle["hidden"]))
    report = cache.verify(deep=True)
    assert report.ok and not report.findings, report.findings
    for row in cache.select():
        info, data = cache.read(int(row))
        assert "save_chunk_meta: false" in info.shape_source
        assert list(info.shape) == made["files"][info.name]["shape"]
        assert hashlib.sha256(data.tobytes()).hexdigest() == made["files"][info.name]["sha256"]
    requests = parse_requests([{"name": r["name"], "tokens": r["tokens"], "tags": r["tags"]} for r in made["requests"]])
    deployment = Deployment(model=oracle["model"], chunk_size=oracle["chunk_size"])
    assert [r.hit_tokens for r in explain(cache, requests, deployment)] == [r["lookup"] for r in made["requests"]]
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # nothing written


def test_a_size_the_shape_does_not_fit_is_still_a_bad_header(headerless):
    directory, oracle, _ = headerless
    victim = sorted(directory.iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:-3])  # no whole token: neither headerless nor headed
    cache = open_cache(directory, chunk_size=oracle["chunk_size"], kv_shape=KVShape(oracle["layers"], oracle["hidden"]))
    bad = [f for f in cache.verify().findings if f.severity == "error"]
    assert [(f.name, f.problem) for f in bad] == [(victim.name, "bad header")]


def test_exported_with_headers_it_is_the_cache_lmcache_writes_by_default(headerless, tmp_path):
    directory, oracle, _ = headerless
    cache = open_cache(directory, chunk_size=oracle["chunk_size"], kv_shape=KVShape(oracle["layers"], oracle["hidden"]))
    report = export_fs_cache(cache, tmp_path / "headed")
    assert not report.problems
    headed = directory.parent / "fs" if (directory.parent / "fs").is_dir() else SMALL / "fs"  # what LMCache wrote
    assert sorted(os.listdir(tmp_path / "headed")) == sorted(os.listdir(headed))
    for name in os.listdir(headed):
        assert (tmp_path / "headed" / name).read_bytes() == (headed / name).read_bytes()
