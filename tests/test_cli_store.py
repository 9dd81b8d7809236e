"""The store commands (`hmem init/put/query/stats/evict/compact/demo`):
human output, --json checked against the library, and every exit code."""

from __future__ import annotations

import json
import os
import pty
import re
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import hmem
from hmem.cli import prompts
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

D = 32  # embed_dim of every test store
HDC = 256
ANSI = re.compile(r"\x1b\[")
# Wide enough that no table cell wraps; colour forcing from the caller's
# environment is removed so that "not a terminal" really means no colour.
BASE_ENV = {
    "COLUMNS": "200",
    "NO_COLOR": None,
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "HMEM_STORE": None,
    "HMEM_DEBUG": None,
}


def run(*args, env: dict | None = None, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})}, input=input)


def run_json(*args, code: int = 0, env: dict | None = None):
    result = run(*args, "--json", env=env)
    assert result.exit_code == code, result.output + result.stderr
    assert not ANSI.search(result.stdout)
    return json.loads(result.stdout)


def assert_one_error_line(result, code: int, fragment: str = "") -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    return lines[0]


def rows(rng: np.random.Generator, n: int = 8, dim: int = D) -> np.ndarray:
    return rng.standard_normal((n, dim)).astype(np.float32)


def library_stats(path) -> dict:
    with hmem.Store.open(path, read_only=True) as s:
        return json.loads(json.dumps(s.stats().to_dict()))


def best(path, keys, layer: int):
    """The library's top hit for `keys` (read-only: counts no access)."""
    with hmem.Store.open(path, read_only=True) as s:
        result = s.query(keys, layer, top_k=1)[0]
        return (result.entry_id, np.array(result.keys), np.array(result.values), result.importance, result.layer_idx)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # Relative paths keep the human output short and predictable.
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def store(tmp_path) -> Path:
    result = run("init", "store", "--embed-dim", D, "--hdc-dim", HDC, "-q")
    assert result.exit_code == 0, result.stderr
    return Path("store")


@pytest.fixture
def kv_files(tmp_path, rng):
    """A directory of files in every naming form; returns (dir, expected entries).

    Each expected entry is (keys, values, layer, importance) as float32.
    """
    folder = Path("kv")
    folder.mkdir()
    expected = []
    k, v = rows(rng), rows(rng)
    save_file(
        {"keys": k, "values": v, "extra": rows(rng, 2)},
        folder / "a_single.safetensors",
        metadata={"layer": "2", "importance": "3"},
    )
    expected.append((k, v, 2, 3.0))
    k, v = rows(rng, 5), rows(rng, 5)
    save_file({"k": k, "v": v}, folder / "b_kv.safetensors")
    expected.append((k, v, 0, 1.0))
    k0, v0, k1, v1 = rows(rng), rows(rng), rows(rng, 3), rows(rng, 3)
    save_file(
        {"layer.0.k": k0, "layer.0.v": v0, "layers_1_keys": k1, "layers_1_values": v1}, folder / "c_layers.safetensors"
    )
    expected += [(k0, v0, 0, 1.0), (k1, v1, 1, 1.0)]
    tensors, numbered = {}, []
    for _n, (kname, vname) in enumerate([("k_0", "v_0"), ("k.1", "v.1"), ("keys_2", "values_2")]):
        tensors[kname], tensors[vname] = rows(rng, 4), rows(rng, 4)
        numbered.append((tensors[kname], tensors[vname], 5, 0.5))
    sub = folder / "nested"
    sub.mkdir()
    save_file(tensors, sub / "d_numbered.safetensors", metadata={"layer": "5", "importance": "0.5"})
    expected += numbered
    (folder / "notes.txt").write_text("not a safetensors file: ignored when a directory is searched")
    return folder, expected


@pytest.fixture
def filled(store, kv_files) -> Path:
    result = run("put", store, kv_files[0], "-q")
    assert result.exit_code == 0, result.stderr
    return store


def write_bf16(path: Path, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write a BF16 safetensors file by hand (header JSON + uint16 data);
    returns the float32 values the file holds (bf16 -> f32 is exact)."""
    header, blobs, offset, exact = {}, [], 0, {}
    for name, array in tensors.items():
        top = (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + top.nbytes]}
        blobs.append(top.tobytes())
        offset += top.nbytes
        exact[name] = (top.astype(np.uint32) << 16).view(np.float32)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return exact


# ---- init --------------------------------------------------------------------------


def test_init_human_output_and_saved_config():
    result = run(
        "init",
        "s",
        "-d",
        48,
        "--hdc-dim",
        512,
        "--seed",
        3,
        "--max-entries",
        100,
        "--max-disk",
        "10MiB",
        "--shard-max",
        "1M",
        "--max-open-shards",
        2,
        "--quantize",
    )
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "created hmem store at s" in out
    for fact in ("embed_dim", "48", "hdc_dim", "512", "10.0 MiB", "max_entries", "100", "quantize_stored", "True"):
        assert fact in out, fact
    cfg = library_stats("s")["config"]
    assert cfg == {
        "embed_dim": 48,
        "hdc_dim": 512,
        "seed": 3,
        "max_entries": 100,
        "max_disk_bytes": 10 * 2**20,
        "shard_max_bytes": 10**6,
        "max_open_shards": 2,
        "quantize_stored": True,
    }


def test_init_json_matches_library():
    doc = run_json("init", "s", "--embed-dim", D, "--hdc-dim", HDC)
    st = library_stats("s")
    assert doc["format_version"] == st["format_version"] == 1
    assert doc["config"] == st["config"]
    assert doc["config"]["max_disk_bytes"] == 0 and doc["config"]["shard_max_bytes"] == 256 * 2**20
    assert doc["bytes_on_disk"] >= st["bytes_on_disk"] > 0
    assert st["entries"] == 0


def test_init_json_size_equals_stats_size():
    doc = run_json("init", "s", "--embed-dim", D, "--hdc-dim", HDC)
    assert doc["bytes_on_disk"] == library_stats("s")["bytes_on_disk"]


def test_init_refuses_existing_store(store):
    before = (store / "index.json").read_bytes()
    line = assert_one_error_line(run("init", store, "-d", D), ExitCode.FAILURE, "already holds an hmem store")
    assert line.endswith(")")  # what to do, in parentheses
    assert (store / "index.json").read_bytes() == before


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--embed-dim", "-3"], "embed_dim"),
        (["--embed-dim", "0"], "embed_dim"),
        (["-d", str(D), "--hdc-dim", "100"], "multiple of 64"),
        (["-d", str(D), "--max-disk", "12XB"], "--max-disk '12XB'"),
        (["-d", str(D), "--max-disk", "-5G"], "--max-disk"),
        (["-d", str(D), "--shard-max", "big"], "--shard-max"),
        (["-d", "many"], "--embed-dim"),
        ([], "--embed-dim"),
    ],
)
def test_init_bad_values_are_usage_errors_and_create_nothing(args, fragment):
    assert_one_error_line(run("init", "s", *args), ExitCode.USAGE, fragment)
    assert not Path("s").exists()


# ---- put ---------------------------------------------------------------------------


def test_put_reads_every_naming_form(store, kv_files):
    folder, expected = kv_files
    result = run("put", store, folder)
    assert result.exit_code == 0, result.stderr
    assert f"added {len(expected)} entries from 4 of 4 files" in result.stdout
    assert f"the store holds {len(expected)} entries" in result.stdout
    st = library_stats(store)
    assert st["entries"] == len(expected)
    assert st["layers"] == {"0": 2, "1": 1, "2": 1, "5": 3}
    for keys, values, layer, importance in expected:
        _, got_k, got_v, got_importance, got_layer = best(store, keys, layer)
        np.testing.assert_array_equal(got_k, keys)  # exact: F32 in, F32 out
        np.testing.assert_array_equal(got_v, values)
        assert (got_layer, got_importance) == (layer, importance)


def test_put_json_report_matches_library(store, kv_files):
    folder, expected = kv_files
    before = library_stats(store)
    doc = run_json("put", store, folder)
    after = library_stats(store)
    assert doc["dry_run"] is False
    assert (doc["files"], doc["files_imported"], doc["files_skipped"]) == (4, 4, 0)
    assert doc["entries_added"] == doc["entries_found"] == len(expected) == after["entries"]
    assert doc["bytes_read"] == sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    # measured before close() commits the exact next id (index.json shrinks by a few bytes)
    assert doc["bytes_written"] == pytest.approx(after["bytes_on_disk"] - before["bytes_on_disk"], abs=64)
    assert doc["bytes_written"] > 0
    assert doc["shards_created"] == len(after["shards"]) - len(before["shards"]) == 1
    assert doc["skipped"] == []
    assert after["next_entry_id"] - before["next_entry_id"] >= len(expected)


def test_put_layer_and_importance_precedence(tmp_path, rng):
    single_k, single_v, named_k, named_v, bare_k, bare_v = (rows(rng) for _ in range(6))
    folder = Path("in")
    folder.mkdir()
    save_file(
        {"keys": single_k, "values": single_v}, folder / "meta.safetensors", metadata={"layer": "4", "importance": "2"}
    )
    save_file(
        {"layer.3.k": named_k, "layer.3.v": named_v},
        folder / "named.safetensors",
        metadata={"layer": "4", "importance": "5"},
    )
    save_file({"k": bare_k, "v": bare_v}, folder / "bare.safetensors")
    # options beat metadata; layer names beat everything
    for name in ("opts", "meta"):
        assert run("init", name, "-d", D, "--hdc-dim", HDC, "-q").exit_code == 0
    assert run("put", "opts", folder, "--layer", 1, "--importance", 7, "-q").exit_code == 0
    assert best("opts", single_k, 1)[3:] == (7.0, 1)
    assert best("opts", named_k, 3)[3:] == (7.0, 3)
    assert best("opts", bare_k, 1)[3:] == (7.0, 1)
    assert library_stats("opts")["layers"] == {"1": 2, "3": 1}
    # without options: metadata, else layer 0 and importance 1
    assert run("put", "meta", folder, "-q").exit_code == 0
    assert best("meta", single_k, 4)[3:] == (2.0, 4)
    assert best("meta", named_k, 3)[3:] == (5.0, 3)
    assert best("meta", bare_k, 0)[3:] == (1.0, 0)


def test_put_reads_f16_bf16_f64_exactly(store, rng):
    folder = Path("dtypes")
    folder.mkdir()
    k16, v16 = rows(rng).astype(np.float16), rows(rng).astype(np.float16)
    save_file({"keys": k16, "values": v16}, folder / "f16.safetensors")
    k64, v64 = rows(rng).astype(np.float64), rows(rng).astype(np.float64)
    save_file({"keys": k64, "values": v64}, folder / "f64.safetensors", metadata={"layer": "1"})
    bf = write_bf16(folder / "bf16.safetensors", {"keys": rows(rng) * 3, "values": rows(rng)})
    assert bf["keys"].dtype == np.float32 and not np.array_equal(bf["keys"], np.zeros_like(bf["keys"]))
    try:  # the hand-written file is valid safetensors: the reference reader agrees
        from safetensors.torch import load_file as torch_load
    except ImportError:
        pass
    else:
        ref = torch_load(folder / "bf16.safetensors")
        np.testing.assert_array_equal(ref["keys"].float().numpy(), bf["keys"])
    result = run("put", store, folder, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["entries_added"] == 3
    np.testing.assert_array_equal(best(store, k16, 0)[1], k16.astype(np.float32))
    np.testing.assert_array_equal(best(store, k16, 0)[2], v16.astype(np.float32))
    np.testing.assert_array_equal(best(store, k64, 1)[1], k64.astype(np.float32))
    got = best(store, bf["keys"], 0)
    np.testing.assert_array_equal(got[1], bf["keys"])  # bf16 -> f32 is exact
    np.testing.assert_array_equal(got[2], bf["values"])


def _bad_files(folder: Path, rng) -> dict[str, str]:
    """Write one file per kind of bad input; returns {file name: reason fragment}."""
    save_file({"foo": rows(rng), "bar": rows(rng)}, folder / "names.safetensors")
    save_file({"k": rows(rng)}, folder / "unpaired.safetensors")
    save_file({"keys": np.ones((4, D), np.int32), "values": np.ones((4, D), np.int32)}, folder / "ints.safetensors")
    nan = rows(rng)
    nan[1, 2] = np.nan
    save_file({"keys": nan, "values": rows(rng)}, folder / "nan.safetensors")
    save_file({"keys": rows(rng), "values": rows(rng)}, folder / "whole.safetensors")
    data = (folder / "whole.safetensors").read_bytes()
    (folder / "whole.safetensors").unlink()
    (folder / "truncated.safetensors").write_bytes(data[:-100])
    (folder / "cut_header.safetensors").write_bytes(data[:40])
    text = b"this is not json"
    (folder / "notjson.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bytes(64))
    save_file({"keys": rows(rng, dim=D + 8), "values": rows(rng, dim=D + 8)}, folder / "dim.safetensors")
    save_file({"keys": rows(rng, 4), "values": rows(rng, 5)}, folder / "shapes.safetensors")
    return {
        "names.safetensors": "no K/V pair found (tensors: bar, foo)",
        "unpaired.safetensors": "tensor 'k' has no values partner",
        "ints.safetensors": "is I32; K/V must be F32, F16, BF16 or F64",
        "nan.safetensors": "NaN or infinite",
        "truncated.safetensors": "lies outside the file's data",
        "cut_header.safetensors": "runs past the end of the file",
        "notjson.safetensors": "the header is not valid JSON",
        "dim.safetensors": f"embed_dim is {D}",
        "shapes.safetensors": "differ in shape",
    }


def test_put_skips_bad_files_stores_good_ones_and_exits_partial(store, kv_files, rng):
    folder, expected = kv_files
    bad = Path("bad")
    bad.mkdir()
    reasons = _bad_files(bad, rng)
    result = run("put", store, folder, bad)
    assert result.exit_code == ExitCode.PARTIAL, result.stderr
    out = result.stdout
    total = 4 + len(reasons)
    assert f"added {len(expected)} entries from 4 of {total} files into {store}" in out
    for name, reason in reasons.items():  # each skip on stderr, with its reason
        assert name not in out
        line = next((x for x in result.stderr.splitlines() if name in x), None)
        assert line is not None and line.startswith("error: skipped ") and reason in line, (name, reason)
    assert library_stats(store)["entries"] == len(expected)  # the good files are stored
    quiet = run("put", store, bad, folder / "a_single.safetensors", "-q")  # -q keeps the reasons
    assert quiet.exit_code == ExitCode.PARTIAL and quiet.stdout == ""
    assert sum(line.startswith("error: skipped ") for line in quiet.stderr.splitlines()) == len(reasons)


def test_put_partial_json_lists_every_skip(store, kv_files, rng):
    folder, expected = kv_files
    bad = Path("bad")
    bad.mkdir()
    reasons = _bad_files(bad, rng)
    doc = run_json("put", store, bad, folder, "nowhere.safetensors", code=ExitCode.PARTIAL)
    skipped = {Path(s["file"]).name: s["reason"] for s in doc["skipped"]}
    assert set(skipped) == {*reasons, "nowhere.safetensors"}
    for name, reason in reasons.items():
        assert reason in skipped[name]
    assert skipped["nowhere.safetensors"] == "no such file"
    assert doc["files_skipped"] == len(reasons) + 1
    assert doc["entries_added"] == len(expected) == library_stats(store)["entries"]


def test_put_of_only_bad_files_fails_and_changes_no_entry(store, rng):
    bad = Path("bad")
    bad.mkdir()
    reasons = _bad_files(bad, rng)
    result = run("put", store, bad, "-q")
    assert result.exit_code == ExitCode.FAILURE  # nothing went in: not "partial"
    assert sum(line.startswith("error: skipped ") for line in result.stderr.splitlines()) == len(reasons)
    assert library_stats(store)["entries"] == 0


def test_put_dry_run_stores_nothing(store, kv_files, rng, snapshot_dir):
    folder, expected = kv_files
    before = snapshot_dir(store)
    result = run("put", store, folder, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert f"would add {len(expected)} entries from 4 of 4 files" in result.stdout
    assert "wrote" not in result.stdout
    doc = run_json("put", store, folder, "--dry-run")
    assert doc["dry_run"] is True
    assert (doc["entries_found"], doc["entries_added"], doc["bytes_written"], doc["shards_created"]) == (
        len(expected),
        0,
        0,
        0,
    )
    # a dry run checks as a real put would: bad files are reported, exit 1 when all are bad
    bad = Path("bad")
    bad.mkdir()
    save_file({"keys": rows(rng, dim=D + 1), "values": rows(rng, dim=D + 1)}, bad / "dim.safetensors")
    doc = run_json("put", store, bad, "--dry-run", code=ExitCode.FAILURE)
    assert "embed_dim" in doc["skipped"][0]["reason"]
    assert snapshot_dir(store) == before
    assert library_stats(store)["entries"] == 0


def test_put_with_no_safetensors_files_is_a_usage_error(store):
    Path("empty").mkdir()
    assert_one_error_line(run("put", store, "empty"), ExitCode.USAGE, "no .safetensors files found")


@pytest.mark.parametrize("args", [["--layer", "-1"], ["--importance", "-2"]])
def test_put_bad_options_are_usage_errors(store, kv_files, args):
    assert_one_error_line(run("put", store, kv_files[0], *args), ExitCode.USAGE)
    assert library_stats(store)["entries"] == 0


# ---- query -------------------------------------------------------------------------


def test_query_human_table(filled, kv_files):
    keys, _, layer, importance = kv_files[1][0]
    np.save("q.npy", keys[:4])
    wanted = best(filled, keys, layer)[0]
    result = run("query", filled, "--query", "q.npy", "--layer", layer, "--top-k", 3)
    assert result.exit_code == 0, result.stderr
    table_rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    first = table_rows[0].replace("│", " ").split()
    assert first[:2] == ["1", str(wanted)]  # rank 1 is the wanted entry
    assert f"{importance:g}" in first
    assert "result(s) from layer 2, ranked by cosine of pooled keys" in result.stdout
    no_rerank = run("query", filled, "--query", "q.npy", "--layer", layer, "--no-rerank")
    assert "ranked by signature similarity" in no_rerank.stdout


def test_query_json_matches_library(filled, kv_files):
    keys = kv_files[1][2][0]  # layer 0 of c_layers
    np.save("q.npy", keys)
    doc = run_json("query", filled, "--query", "q.npy", "-l", 0, "-k", 5)
    with hmem.Store.open(filled, read_only=True) as s:
        lib = s.query(keys, 0, top_k=5)
    assert [r["entry_id"] for r in doc["results"]] == [r.entry_id for r in lib]
    assert [r["rank"] for r in doc["results"]] == list(range(1, len(lib) + 1))
    assert doc["results"][0]["entry_id"] == best(filled, keys, 0)[0]
    assert doc["results"][0]["score"] == pytest.approx(1.0)
    for row, r in zip(doc["results"], lib):
        assert (row["score"], row["similarity"], row["n_tokens"], row["layer"], row["importance"]) == (
            r.score,
            r.similarity,
            r.n_tokens,
            r.layer_idx,
            r.importance,
        )
    assert (doc["layer"], doc["top_k"], doc["rerank"], doc["search"], doc["export"]) == (0, 5, True, "auto", None)
    assert doc["searched"] == "full"  # what "auto" chose on a small layer
    for mode in ("full", "two-stage"):
        doc = run_json("query", filled, "--query", "q.npy", "-l", 0, "-k", 5, "--search", mode)
        with hmem.Store.open(filled, read_only=True) as s:
            lib = s.query(keys, 0, top_k=5, search=mode)
        assert [r["entry_id"] for r in doc["results"]] == [r.entry_id for r in lib], mode
        assert doc["search"] == mode and doc["searched"] == lib.search  # short signatures take one stage


def test_query_token_rerank_matches_library(filled, kv_files):
    keys = kv_files[1][2][0]  # layer 0 of c_layers
    np.save("q.npy", keys[2:5])
    doc = run_json("query", filled, "--query", "q.npy", "-l", 0, "-k", 3, "--token-rerank", 6)
    with hmem.Store.open(filled, read_only=True) as s:
        lib = s.query(keys[2:5], 0, top_k=3, token_rerank=6)
    assert [(r["entry_id"], r["token_score"], r["score"]) for r in doc["results"]] == [
        (r.entry_id, r.token_score, r.token_score) for r in lib
    ]
    assert doc["token_rerank"] == 6 and doc["results"][0]["token_score"] == pytest.approx(1.0)
    human = run("query", filled, "--query", "q.npy", "-l", 0, "-k", 3, "--token-rerank", 6)
    assert human.exit_code == 0 and "ranked by token max-sim" in human.stdout
    plain = run_json("query", filled, "--query", "q.npy", "-l", 0, "-k", 3)
    assert plain["token_rerank"] is None and all(r["token_score"] is None for r in plain["results"])


@pytest.mark.parametrize(
    "args, fragment",
    [(("--token-rerank", -1), "token_rerank"), (("--token-rerank", 3, "--no-rerank"), "needs rerank=True")],
)
def test_query_bad_token_rerank_is_a_usage_error(filled, kv_files, args, fragment):
    np.save("q.npy", kv_files[1][2][0])
    before = library_stats(filled)
    assert_one_error_line(run("query", filled, "--query", "q.npy", "-l", 0, *args), ExitCode.USAGE, fragment)
    assert library_stats(filled) == before


def test_init_token_rerank_is_the_stores_default(tmp_path, rng):
    doc = run_json("init", tmp_path / "t", "--embed-dim", D, "--hdc-dim", HDC, "--token-rerank", 12)
    assert doc["config"]["token_rerank"] == 12
    keys = rows(rng, 6)
    with hmem.Store.open(tmp_path / "t") as s:
        s.put(keys, keys, 0)
        s.put(rows(rng, 6), keys, 0)
    np.save("q.npy", keys[:2])
    found = run_json("query", tmp_path / "t", "--query", "q.npy", "-l", 0, "-k", 2)
    assert found["results"][0]["token_score"] == pytest.approx(1.0)
    stats = run("stats", tmp_path / "t")
    assert "queries re-rank 12 by tokens" in stats.stdout


def test_query_input_file_forms(filled, kv_files):
    keys = kv_files[1][0][0]  # layer 2
    wanted = best(filled, keys, 2)[0]
    np.save("tokens.npy", keys)
    np.save("vector.npy", keys.mean(axis=0))
    save_file({"query": keys}, "named_query.safetensors")
    save_file({"q": keys, "other": keys}, "named_q.safetensors")
    save_file({"keys": keys, "values": keys}, "named_keys.safetensors")
    save_file({"k": keys, "v": keys}, "named_k.safetensors")
    save_file({"whatever": keys.astype(np.float16)}, "only.safetensors")
    for name in (
        "tokens.npy",
        "vector.npy",
        "named_query.safetensors",
        "named_q.safetensors",
        "named_keys.safetensors",
        "named_k.safetensors",
        "only.safetensors",
    ):
        doc = run_json("query", filled, "--query", name, "-l", 2, "-k", 1)
        assert [r["entry_id"] for r in doc["results"]] == [wanted], name


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        (
            "garbage.safetensors",
            b"\x00\x01garbage bytes that are not a safetensors file",
            "--query garbage.safetensors",
        ),
        ("garbage.npy", b"not numpy at all", "not a readable .npy file"),
        ("short.safetensors", b"abc", "too short"),
        ("missing.npy", None, "no such file"),
        ("missing.safetensors", None, "no such file"),
    ],
)
def test_query_rejects_unreadable_query_file(filled, name, content, fragment):
    if content is not None:
        Path(name).write_bytes(content)
    assert_one_error_line(run("query", filled, "--query", name, "-l", 0), ExitCode.USAGE, fragment)


def test_query_rejects_ambiguous_or_wrong_shape_query(filled, rng):
    save_file({"a": rows(rng), "b": rows(rng)}, "two.safetensors")
    assert_one_error_line(
        run("query", filled, "--query", "two.safetensors", "-l", 0),
        ExitCode.USAGE,
        "no tensor named query or q or keys or k",
    )
    np.save("wide.npy", rows(rng, dim=D + 1))
    assert_one_error_line(run("query", filled, "--query", "wide.npy", "-l", 0), ExitCode.USAGE)
    np.save("ints.npy", np.ones((2, D), np.int64))
    assert_one_error_line(run("query", filled, "--query", "ints.npy", "-l", 0), ExitCode.USAGE, "must hold floats")


@pytest.mark.parametrize(
    "args", [["--top-k", "0"], ["--top-k", "-1"], ["--layer", "-1"], ["--layer", "x"], ["--search", "fast"]]
)
def test_query_bad_options_are_usage_errors(filled, kv_files, args):
    np.save("q.npy", kv_files[1][0][0])
    base = ["query", filled, "--query", "q.npy"] + ([] if "--layer" in args else ["--layer", "0"])
    assert_one_error_line(run(*base, *args), ExitCode.USAGE)


def test_query_empty_layer(filled, kv_files):
    np.save("q.npy", kv_files[1][0][0])
    result = run("query", filled, "--query", "q.npy", "-l", 9)
    assert result.exit_code == 0
    assert result.stdout.strip() == "no entries in layer 9"
    assert run_json("query", filled, "--query", "q.npy", "-l", 9)["results"] == []


def test_query_export_writes_store_kv_in_rank_order(filled, kv_files):
    keys = kv_files[1][4][0]  # numbered entries, layer 5
    np.save("q.npy", keys)
    doc = run_json("query", filled, "--query", "q.npy", "-l", 5, "-k", 3, "--export", "hits.safetensors")
    ids = [r["entry_id"] for r in doc["results"]]
    assert len(ids) == 3 and doc["export"] == "hits.safetensors"
    tensors = load_file("hits.safetensors")
    assert set(tensors) == {f"{kind}_{i}" for i in ids for kind in "kv"}
    with safe_open("hits.safetensors", "np") as f:
        meta = f.metadata()
    assert json.loads(meta["entry_ids"]) == ids
    assert json.loads(meta["scores"]) == [r["score"] for r in doc["results"]]
    assert meta["format"] == "hmem-export" and meta["layer"] == "5"
    with hmem.Store.open(filled, read_only=True) as s:
        for r in s.query(keys, 5, top_k=3):
            assert tensors[f"k_{r.entry_id}"].dtype == np.float32
            np.testing.assert_array_equal(tensors[f"k_{r.entry_id}"], r.keys)
            np.testing.assert_array_equal(tensors[f"v_{r.entry_id}"], r.values)
    human = run("query", filled, "--query", "q.npy", "-l", 5, "-k", 2, "--export", "two.safetensors")
    assert "exported K/V of 2 entries to two.safetensors" in human.stdout
    assert len(load_file("two.safetensors")) == 4


def test_query_counts_accesses_only_when_asked(filled, kv_files, snapshot_dir):
    np.save("q.npy", kv_files[1][0][0])
    before = snapshot_dir(filled)
    doc = run_json("query", filled, "--query", "q.npy", "-l", 0, "-k", 2)
    assert all(r["access_count"] == 0 for r in doc["results"])
    assert snapshot_dir(filled) == before  # a shell query only reads
    assert library_stats(filled)["total_accesses"] == 0
    doc = run_json("query", filled, "--query", "q.npy", "-l", 0, "-k", 2, "--count-access")
    assert [r["access_count"] for r in doc["results"]] == [1, 1]
    assert library_stats(filled)["total_accesses"] == 2


# ---- stats -------------------------------------------------------------------------


def test_stats_json_is_the_library_stats(filled):
    doc = run_json("stats", filled)
    assert doc == library_stats(filled)
    for field in (
        "path",
        "format_version",
        "generation",
        "config",
        "entries",
        "evicted",
        "unflushed",
        "layers",
        "shards",
        "bytes_on_disk",
        "live_bytes",
        "reclaimable_bytes",
        "orphan_files",
        "foreign_files",
        "total_accesses",
        "next_entry_id",
        "kernels",
    ):
        assert field in doc, field
    assert (doc["entries"], doc["evicted"], doc["unflushed"], doc["reclaimable_bytes"]) == (7, 0, 0, 0)
    assert doc["bytes_on_disk"] == sum(p.stat().st_size for p in filled.iterdir())


def test_stats_human(filled):
    result = run("stats", filled)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert re.search(r"entries\s+│\s+7 live, 0 evicted", out)
    assert re.search(r"layers\s+│\s+4 ", out)
    assert f"embed_dim {D}, hdc_dim {HDC}, seed 0, stored as f32" in out
    assert "entries per layer" in out and "shard_0000.safetensors" in out
    assert re.search(r"reclaimable\s+│\s+0 B", out)


def test_stats_lists_first_20_shards_unless_all(tmp_path, rng):
    assert run("init", "s", "-d", D, "--hdc-dim", HDC, "--shard-max", "1KiB", "-q").exit_code == 0
    folder = Path("many")
    folder.mkdir()
    for i in range(23):
        save_file({"k": rows(rng, 4), "v": rows(rng, 4)}, folder / f"{i:02d}.safetensors")
    assert run("put", "s", folder, "-q").exit_code == 0
    assert len(library_stats("s")["shards"]) == 23  # an entry over the limit gets its own shard
    short = run("stats", "s").stdout
    assert "... and 3 more shards (--all-shards lists them)" in short
    assert "shard_0019" in short and "shard_0020" not in short
    full = run("stats", "s", "--all-shards").stdout
    assert "shard_0022" in full and "more shards" not in full


def test_stats_warns_about_foreign_files(filled):
    (filled / "README.txt").write_text("hello")
    result = run("stats", filled)
    assert result.exit_code == 0
    assert "foreign file README.txt" in result.stderr


# ---- evict -------------------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["--target", "3", "--keep", "0.5"], ["--keep", "1.5"], ["--target", "-1"]])
def test_evict_needs_exactly_one_valid_goal(filled, args, snapshot_dir):
    before = snapshot_dir(filled)
    assert_one_error_line(run("evict", filled, "--yes", *args), ExitCode.USAGE)
    assert snapshot_dir(filled) == before


def test_evict_without_yes_off_a_terminal_is_a_usage_error(filled, snapshot_dir):
    before = snapshot_dir(filled)
    assert_one_error_line(run("evict", filled, "--target", 2), ExitCode.USAGE, "pass --yes")
    assert snapshot_dir(filled) == before
    assert library_stats(filled)["entries"] == 7


def test_evict_dry_run_changes_nothing(filled, snapshot_dir):
    before = snapshot_dir(filled)
    result = run("evict", filled, "--target", 4, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "would evict 3 of 7 entries" in result.stdout
    doc = run_json("evict", filled, "--target", 4, "--dry-run")
    with hmem.Store.open(filled, read_only=True) as s:
        plan = s.plan_eviction(4)
    assert doc["entry_ids"] == list(plan.entry_ids)
    assert (doc["evict"], doc["evicted"], doc["dry_run"], doc["entries_before"]) == (3, 0, True, 7)
    assert doc["bytes_reclaimable"] == plan.bytes_reclaimable > 0
    assert f"entry ids, first to go first: {', '.join(map(str, plan.entry_ids))}" in result.stdout
    assert snapshot_dir(filled) == before


def test_evict_yes_removes_the_lowest_scored(filled):
    with hmem.Store.open(filled, read_only=True) as s:
        plan = s.plan_eviction(4)
    doc = run_json("evict", filled, "--target", 4, "--yes")
    assert doc["evicted"] == 3 and doc["entry_ids"] == list(plan.entry_ids)
    st = library_stats(filled)
    assert (st["entries"], st["evicted"]) == (4, 3)
    assert st["reclaimable_bytes"] > 0
    # importance 0.5 (the numbered file) goes first
    assert st["layers"].get("5", 0) == 0
    result = run("evict", filled, "--keep", "0.5", "-y")
    assert result.exit_code == 0
    assert "evicted 2 entries; 2 remain; run 'hmem compact'" in result.stdout
    nothing = run("evict", filled, "--target", 10, "-y")
    assert nothing.stdout.strip() == "nothing to evict: 2 entries, target 10"


@pytest.mark.parametrize("answer, entries", [("y\n", 5), ("n\n", 7)])
def test_evict_asks_on_a_terminal(filled, monkeypatch, answer, entries):
    monkeypatch.setattr(prompts, "sys", types.SimpleNamespace(stdin=types.SimpleNamespace(isatty=lambda: True)))
    result = run("evict", filled, "--target", 5, input=answer)
    assert result.exit_code == 0, result.stderr
    assert "evict 2 of 7 entries from store?" in result.stderr  # the question goes to stderr
    assert library_stats(filled)["entries"] == entries
    if entries == 7:
        assert "nothing evicted" in result.stdout


# ---- compact -----------------------------------------------------------------------


def test_compact_threshold_out_of_range_is_a_usage_error(filled):
    assert_one_error_line(run("compact", filled, "--threshold", 150), ExitCode.USAGE, "--threshold")
    assert_one_error_line(run("compact", filled, "--threshold", -1), ExitCode.USAGE, "--threshold")


def test_compact_below_threshold_does_nothing(filled, snapshot_dir):
    assert run("evict", filled, "--target", 6, "-y").exit_code == 0
    st = library_stats(filled)
    share = 100 * st["reclaimable_bytes"] / st["bytes_on_disk"]
    assert 0 < share < 50
    before = snapshot_dir(filled)
    # --min-dead 0: every evicted byte counts (stats' reclaimable_bytes)
    result = run("compact", filled, "--threshold", 50, "--min-dead", 0)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nothing to do: compaction would free ")
    assert lines[0].endswith("below the threshold of 50%")
    assert result.stderr == ""
    doc = run_json("compact", filled, "--threshold", 50, "--min-dead", 0)
    assert doc["performed"] is False and doc["needed"] is True
    assert doc["reclaimable_pct"] == pytest.approx(share, rel=0.05)
    assert snapshot_dir(filled) == before


def test_compact_dry_run_changes_nothing(filled, snapshot_dir):
    assert run("evict", filled, "--target", 3, "-y").exit_code == 0
    before = snapshot_dir(filled)
    result = run("compact", filled, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("would free about ")
    assert "4 evicted records" in result.stdout
    doc = run_json("compact", filled, "--dry-run")
    assert (doc["dry_run"], doc["performed"], doc["needed"]) == (True, False, True)
    assert snapshot_dir(filled) == before


def test_compact_after_evict_frees_bytes_and_keeps_results(filled, kv_files):
    assert run("evict", filled, "--target", 4, "-y").exit_code == 0
    keys = kv_files[1][2][0]  # layer 0
    with hmem.Store.open(filled, read_only=True) as s:
        wanted = [(r.entry_id, r.score) for r in s.query(keys, 0, top_k=5)]
    before = library_stats(filled)
    doc = run_json("compact", filled, "--min-dead", 0)  # every evicted byte
    after = library_stats(filled)
    assert doc["performed"] is True
    assert doc["bytes_freed"] > 0
    assert doc["bytes_freed"] == before["bytes_on_disk"] - after["bytes_on_disk"]
    assert doc["records_dropped"] == 3
    assert (after["entries"], after["evicted"], after["reclaimable_bytes"]) == (4, 0, 0)
    with hmem.Store.open(filled, read_only=True) as s:
        assert [(r.entry_id, r.score) for r in s.query(keys, 0, top_k=5)] == wanted
    again = run("compact", filled)
    assert again.stdout.strip() == "nothing to do: the store is already compact"


def test_compact_human_output(filled):
    assert run("evict", filled, "--target", 4, "-y").exit_code == 0
    result = run("compact", filled, "--min-dead", "0")
    assert result.exit_code == 0, result.stderr
    assert re.match(
        r"freed [\d.]+ KiB rewriting [\d.]+ KiB: [\d.]+ KiB -> [\d.]+ KiB, 1 shards -> 1\n"
        r"3 evicted records dropped, in ",
        result.stdout,
    )


# ---- shared behaviour: not a store, locks, format version, HMEM_STORE ---------------


def _all_commands(store: Path) -> list[list]:
    np.save("q.npy", np.ones((2, D), np.float32))
    save_file({"k": np.ones((2, D), np.float32), "v": np.ones((2, D), np.float32)}, "one.safetensors")
    return [
        ["stats", store],
        ["put", store, "one.safetensors"],
        ["query", store, "--query", "q.npy", "-l", "0"],
        ["evict", store, "--target", "0", "--yes"],
        ["compact", store],
    ]


# a file where a store goes is a bad path, exit 10 (tests/test_operator_mistakes.py)
@pytest.mark.parametrize("case", ["missing", "empty dir", "other dir"])
def test_not_a_store_exits_5(case):
    path = Path("target")
    if case == "empty dir":
        path.mkdir()
    elif case == "other dir":
        path.mkdir()
        (path / "data.txt").write_text("x")
    for args in _all_commands(path):
        assert_one_error_line(run(*args), ExitCode.NOT_A_STORE, "hmem init")
    if case in ("empty dir", "other dir"):
        assert {p.name for p in path.iterdir()} <= {"data.txt"}  # no lock file left behind


def test_locked_store_exits_6_for_writing_commands(filled, kv_files):
    commands = [
        ["put", filled, kv_files[0]],
        ["evict", filled, "--target", "1", "--yes"],
        ["compact", filled],
        ["query", filled, "--query", "q.npy", "-l", "0", "--count-access"],
    ]
    np.save("q.npy", kv_files[1][0][0])
    writer = hmem.Store.open(filled)
    try:
        for args in commands:
            assert_one_error_line(run(*args), ExitCode.LOCKED, f"pid {os.getpid()}")
        started = time.perf_counter()
        line = assert_one_error_line(run("compact", filled, "--lock-wait", 0.2), ExitCode.LOCKED, "locked")
        assert time.perf_counter() - started >= 0.2
        assert "--lock-wait" in line  # what to do
        # readers need no lock
        assert run("stats", filled).exit_code == 0
        assert run("query", filled, "--query", "q.npy", "-l", "0").exit_code == 0
    finally:
        writer.close()
    assert library_stats(filled)["entries"] == 7


def test_lock_wait_succeeds_when_the_writer_leaves(filled, kv_files):
    """The writer leaves only once the put is trying for the lock (it has
    opened the lock file: hmem/_io.py's fault hook sees it), so the put
    waits for it, then takes the lock."""
    from hmem import _io

    putting, trying = threading.get_ident(), threading.Event()
    lock_ops: list[tuple[str, str]] = []

    def watch(op: str, path: str) -> None:
        if os.path.basename(path) == "lock":
            mine = threading.get_ident() == putting
            lock_ops.append(("put" if mine else "writer", op))
            if mine and op == "open":
                trying.set()

    writer = hmem.Store.open(filled)

    def leave() -> None:
        trying.wait(120)  # a hang guard: a put that never tries is seen below
        writer.close()

    leaving = threading.Thread(target=leave)
    _io.set_fault_hook(watch)
    try:
        leaving.start()
        result = run("put", filled, kv_files[0], "--lock-wait", "inf", "--again", "-q")  # the same files once more
    finally:
        _io.set_fault_hook(None)
        leaving.join()
    assert result.exit_code == 0, result.stderr
    # the put opened the lock file while the writer held the lock, and wrote
    # its owner record (it had the lock) only after the writer had cleared its own
    assert lock_ops[:3] == [("put", "open"), ("writer", "truncate"), ("put", "truncate")], lock_ops
    assert library_stats(filled)["entries"] == 14


def test_unknown_format_version_exits_7(filled, rewrite_index, snapshot_dir):
    rewrite_index(filled, lambda doc: doc.update(format_version=2))
    before = snapshot_dir(filled)
    for args in _all_commands(filled):
        assert_one_error_line(run(*args), ExitCode.UNSUPPORTED_FORMAT, "format")
    assert snapshot_dir(filled) == before


def test_hmem_store_env_stands_in_for_the_argument(filled, kv_files):
    env = {"HMEM_STORE": str(filled)}
    assert run_json("stats", env=env)["entries"] == 7
    np.save("q.npy", kv_files[1][0][0])
    assert len(run_json("query", "--query", "q.npy", "-l", 2, env=env)["results"]) == 1
    assert run_json("evict", "--target", 6, "--yes", env=env)["evicted"] == 1
    assert run_json("compact", "--min-dead", 0, env=env)["performed"] is True
    # the argument beats the variable
    assert run("stats", "elsewhere", env=env).exit_code == ExitCode.NOT_A_STORE


def test_hmem_store_env_for_put(filled, kv_files):
    result = run("put", kv_files[0], env={"HMEM_STORE": str(filled)})
    assert result.exit_code == 0, result.stderr


# ---- demo --------------------------------------------------------------------------


def test_demo_json():
    doc = run_json("demo")
    assert doc["query"]["found"] is True
    assert doc["query"]["results"][0] == doc["query"]["wanted"]
    assert doc["import"]["entries"] > 0 and doc["import"]["files"] == 18
    assert doc["evict"]["evicted"] > 0 and doc["compact"]["bytes_freed"] > 0
    assert doc["stats"]["entries"] == doc["import"]["entries"] - doc["evict"]["evicted"] > 0
    assert doc["prefix_hit"]["hit"] == 10
    assert not Path(doc["store"]).exists()  # the temporary store is removed


def test_demo_human_and_kept_store():
    result = run("demo", "kept")
    assert result.exit_code == 0, result.stderr
    for step in (
        "1. imported 44 entries from 18 safetensors files",
        "2. a query with a noisy copy",
        "3. evicted the",
        "4. the store holds",
        "5. prefix hit of a hybrid model",
    ):
        assert step in result.stdout, step
    assert "finds entry" in result.stdout and "first:" in result.stdout
    assert library_stats("kept")["entries"] == 33
    assert_one_error_line(run("demo", "kept"), ExitCode.USAGE, "is not empty")


# ---- output conventions ----------------------------------------------------------


def test_quiet_prints_nothing_on_success(store, kv_files):
    np.save("q.npy", kv_files[1][0][0])
    for args in (
        ["init", "other", "-d", D],
        ["put", store, kv_files[0]],
        ["stats", store],
        ["query", store, "--query", "q.npy", "-l", 0, "--export", "x.safetensors"],
        ["evict", store, "--target", 3, "--yes"],
        ["evict", store, "--target", 1, "--dry-run"],
        ["compact", store, "--dry-run"],
        ["compact", store],
        ["demo"],
    ):
        result = run(*args, "--quiet")
        assert result.exit_code == 0, (args, result.stderr)
        assert result.stdout == "", args
        assert result.stderr == "", args
    assert library_stats(store)["entries"] == 3
    # --quiet with --json still prints the document
    assert run_json("stats", store, "--quiet")["entries"] == 3


def test_no_ansi_when_not_a_terminal(store, kv_files, monkeypatch):
    np.save("q.npy", kv_files[1][0][0])
    for no_color in (None, "1"):
        env = {"NO_COLOR": no_color, "TERM": "xterm-256color"}
        for args in (
            ["put", store, kv_files[0], "--dry-run"],
            ["stats", store],
            ["query", store, "--query", "q.npy", "-l", 0],
            ["evict", store, "--target", 3, "--dry-run"],
            ["compact", store, "--dry-run"],
            ["demo"],
            ["stats", "nowhere"],
        ):
            result = run(*args, env=env)
            assert not ANSI.search(result.stdout + result.stderr), (args, no_color)


def _run_on_terminal(args: list[str], env: dict) -> bytes:
    """Run `python -m hmem ARGS` with a pseudo-terminal as stdin/stdout/stderr."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hmem", *args], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=Path.cwd()
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks)


def _terminal_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, "TERM": "xterm-256color", "COLUMNS": "120", **extra}


def test_a_terminal_gets_styles(filled):
    # the pseudo-terminal works: without NO_COLOR, Rich styles the tables
    assert b"\x1b[" in _run_on_terminal(["stats", str(filled)], _terminal_env())


def test_no_escape_codes_on_a_terminal_with_no_color(filled):
    out = _run_on_terminal(["stats", str(filled)], _terminal_env(NO_COLOR="1"))
    assert b"\x1b[" not in out


@pytest.mark.parametrize(
    "args, code",
    [
        # with --json, stdout holds the error's JSON document: tests/test_cli_messages.py
        (["stats", "nowhere"], ExitCode.NOT_A_STORE),
        (["init", "s", "--embed-dim", "-1"], ExitCode.USAGE),
        (["query", "nowhere", "--query", "q.npy", "-l", "0"], ExitCode.USAGE),
        (["compact", "nowhere", "--threshold", "101"], ExitCode.USAGE),
        (["put", "nowhere", "x.safetensors"], ExitCode.NOT_A_STORE),
        (["evict", "nowhere", "--target", "1", "--yes"], ExitCode.NOT_A_STORE),
        (["stats"], ExitCode.USAGE),
        (["query", "nowhere"], ExitCode.USAGE),
    ],
)
def test_errors_are_one_line_without_traceback(args, code):
    assert_one_error_line(run(*args), code)


def test_debug_adds_the_traceback():
    result = run("--debug", "stats", "nowhere")
    assert result.exit_code == ExitCode.NOT_A_STORE
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_query_help_shows_the_query_shapes():
    result = run("query", "--help")
    assert "n_tokens x embed_dim values (or one row of embed_dim)" in " ".join(result.stdout.split())
