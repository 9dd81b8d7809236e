"""A store of chunks on the command line: `hmem init --chunks`, `hmem ls
--chunks`, `hmem show STORE KEY`, `hmem rm STORE KEY...`, each checked
against the library (Store.chunks), with their errors and exit codes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

D = 16
ENV = {"COLUMNS": "200", "NO_COLOR": None, "FORCE_COLOR": None, "HMEM_STORE": None, "HMEM_DEBUG": None}
KEYS = ["m@1@0@1a@bfloat16", "m@1@0@-2b@bfloat16", "m@1@0@3c@bfloat16"]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def parts(rng: np.random.Generator, layers: int, tokens: int) -> list[hmem.Entry]:
    def rows() -> np.ndarray:
        return rng.standard_normal((tokens, D), dtype=np.float32)

    return [hmem.Entry(rows(), rows(), layer) for layer in range(layers)]


@pytest.fixture
def tier(tmp_path):
    """A store of chunks made by `hmem init --chunks`, three chunks of 4 layers put."""
    path = tmp_path / "tier"
    made = run("init", path, "--embed-dim", D, "--hdc-dim", 64, "--chunks", "--json")
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["config"]["chunks"] is True
    rng = np.random.default_rng(0)
    with hmem.Store.open(path) as store:
        ids = store.chunks.put({key: parts(rng, 4, 8 + i) for i, key in enumerate(KEYS)})
    return path, ids


def files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "lock"}


def test_ls_chunks_lists_each_chunk_as_the_library_does(tier):
    path, ids = tier
    result = run("ls", path, "--chunks", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["total"] == doc["count"] == 3
    with hmem.Store.open(path, read_only=True) as store:
        listing = store.chunks.listing()
    assert [c["key"] for c in doc["chunks"]] == sorted(KEYS) == [c.key for c in listing]
    for row, info in zip(doc["chunks"], listing):
        assert row["entry_ids"] == list(info.entry_ids) == ids[info.key]
        assert row["layers"] == [0, 1, 2, 3]
        assert row["tokens"] == info.n_tokens and row["bytes"] == info.bytes
    table = run("ls", path, "--chunks", "--limit", 2)
    assert table.exit_code == 0
    assert sorted(KEYS)[0] in table.stdout and sorted(KEYS)[2] not in table.stdout
    assert "2 of 3 chunks, by key" in table.stdout


def test_show_by_key(tier):
    path, ids = tier
    result = run("show", path, KEYS[1], "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["key"] == KEYS[1] and doc["entry_ids"] == ids[KEYS[1]] and doc["tokens"] == 9
    assert doc["meta"] == {"chunk_key": KEYS[1], "part": 0, "parts": 4}
    human = run("show", path, KEYS[1])
    assert f"chunk {KEYS[1]}" in human.stdout and "4 entries" in human.stdout
    # an id still shows the entry
    entry = run("show", path, ids[KEYS[1]][2], "--json")
    assert json.loads(entry.stdout)["meta"] == {"chunk_key": KEYS[1], "part": 2, "parts": 4}


def test_show_of_a_key_the_store_does_not_hold(tier):
    path, _ = tier
    result = run("show", path, "m@1@0@ffff@bfloat16")
    assert result.exit_code == ExitCode.FAILURE
    assert "holds no chunk 'm@1@0@ffff@bfloat16'" in result.stderr


def test_rm_by_key_deletes_whole_chunks(tier):
    path, ids = tier
    dry = run("rm", path, KEYS[0], "--dry-run", "--json")
    assert dry.exit_code == 0 and json.loads(dry.stdout)["entry_ids"] == ids[KEYS[0]]
    result = run("rm", path, KEYS[0], "m@1@0@gone@bfloat16", "--yes", "--json")
    assert result.exit_code == ExitCode.PARTIAL, result.output
    doc = json.loads(result.stdout)
    assert doc["deleted"] == 4 and doc["missing_keys"] == ["m@1@0@gone@bfloat16"]
    # one entry of a chunk, by id, takes the whole chunk
    assert run("rm", path, ids[KEYS[1]][3], "--yes").exit_code == 0
    with hmem.Store.open(path, read_only=True) as store:
        assert store.chunks.keys() == [KEYS[2]]
        assert store.entry_ids() == ids[KEYS[2]]


def test_keys_on_a_store_without_chunks_are_refused(tmp_path):
    path = tmp_path / "plain"
    with hmem.Store.create(path, embed_dim=D, hdc_dim=64) as store:
        store.put(np.ones((2, D), np.float32), np.ones((2, D), np.float32))
    before = files(path)
    for args in (("show", path, "somekey"), ("rm", path, "somekey", "--yes"), ("ls", path, "--chunks")):
        result = run(*args)
        assert result.exit_code == ExitCode.USAGE, (args, result.output)
        assert "keeps no chunks" in result.stderr
    assert files(path) == before
