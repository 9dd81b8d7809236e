"""The entry commands (`hmem ls`, `hmem show`, `hmem export`) and the
library calls under them (Store.entries, Store.stored_kv, export_entries):
orders checked against an independent computation, JSON against the
library, exports bit for bit, and bad input refused with nothing written."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.cli.cmd_ls import SHOWN
from hmem.cli.exit_codes import ExitCode
from hmem.cli.query_export import export_note

D = 16
HDC = 128
BASE_ENV = {
    "COLUMNS": "200",
    "NO_COLOR": "1",
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "HMEM_STORE": None,
    "HMEM_DEBUG": None,
}
ANSI = re.compile(r"\x1b\[")


def run(*args, env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})})


def run_json(*args, code: int = 0):
    result = run(*args, "--json")
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert not ANSI.search(result.stdout)
    return json.loads(result.stdout)


def error_line(result, code: int, fragment: str = "") -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file of a directory and its bytes (a read-only command must not change one)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def rng():
    return np.random.default_rng(20240612)


def make_store(rng, path: str = "s", storage_dtype: str = "f32") -> Path:
    """A store whose entries differ in every column ls sorts by: layers,
    token counts, importances, access counts, and ties among them."""
    importances = [1.0, 2.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0, 3.0, 2.0]
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, storage_dtype=storage_dtype) as s:
        keys = {}
        batch = []
        for n, (imp, t) in enumerate(zip(importances, tokens)):
            keys[n + 1] = rng.standard_normal((t, D)).astype(np.float32)
            batch.append((keys[n + 1], rng.standard_normal((t, D)).astype(np.float32), n % 3, imp))
            if n not in (5, 8):  # entries 6 and 7, and 9 and 10, go in one put: one timestamp, ties by id
                s.put_many(batch)
                batch = []
        s.flush()
        # accesses: query with the keys of some entries so that their counts differ
        for entry_id, times in ((2, 3), (5, 1), (8, 2), (1, 1)):
            for _ in range(times):
                s.query(keys[entry_id], (entry_id - 1) % 3, top_k=1)
        s.flush()
    return Path(path)


def independent_order(infos: list[dict], sort: str) -> list[int]:
    key = {
        "id": lambda e: e["entry_id"],
        "score": lambda e: (e["importance"] * (1 + math.log1p(e["access_count"])), e["timestamp_ns"], e["entry_id"]),
        "accesses": lambda e: (-e["access_count"], e["entry_id"]),
        "age": lambda e: (e["timestamp_ns"], e["entry_id"]),
        "size": lambda e: (-e["bytes"], e["entry_id"]),
    }[sort]
    return [e["entry_id"] for e in sorted(infos, key=key)]


def library_rows(path: Path) -> list[dict]:
    """Each live entry's metadata through Store.get, as the JSON names it."""
    with hmem.Store.open(path, read_only=True) as s:
        rows = []
        for i in s.entry_ids():
            info = s.get(i).info
            rows.append(
                {
                    "entry_id": info.entry_id,
                    "layer": info.layer_idx,
                    "n_tokens": info.n_tokens,
                    "importance": info.importance,
                    "access_count": info.access_count,
                    "score": info.importance * (1 + math.log1p(info.access_count)),
                    "timestamp_ns": info.created,
                    "shard": info.shard_idx,
                    "bytes": info.bytes,
                }
            )
        return rows


def read_safetensors(path: Path) -> tuple[dict, dict[str, tuple[str, list[int], bytes]]]:
    """metadata and {name: (dtype, shape, raw bytes)}, read by hand (numpy has no bfloat16)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n :]
    return meta, {
        name: (h["dtype"], h["shape"], body[h["data_offsets"][0] : h["data_offsets"][1]]) for name, h in header.items()
    }


# ---- hmem ls -------------------------------------------------------------------------


@pytest.mark.parametrize("sort", ["id", "score", "accesses", "age", "size"])
def test_ls_sorts_as_an_independent_computation(rng, sort):
    store = make_store(rng)
    expected = library_rows(store)
    assert len({e["access_count"] for e in expected}) > 2  # the store really has different access counts
    document = run_json("ls", store, "--sort", sort)
    assert document["store"] == "s" and document["sort"] == sort
    assert document["total"] == document["count"] == len(expected) == 10
    got = [e["entry_id"] for e in document["entries"]]
    assert got == independent_order(expected, sort)
    by_id = {e["entry_id"]: e for e in expected}
    for entry in document["entries"]:
        want = by_id[entry["entry_id"]]
        assert entry.keys() == want.keys()
        assert entry == pytest.approx(want, rel=1e-12)


def test_ls_score_order_is_the_eviction_order(rng):
    store = make_store(rng)
    with hmem.Store.open(store, read_only=True) as s:
        plan = s.plan_eviction(0)
    document = run_json("ls", store, "--sort", "score")
    assert [e["entry_id"] for e in document["entries"]] == list(plan.entry_ids)
    # ties of score, and of score and time, exist: the tie-breaks were exercised
    scores = [e["score"] for e in document["entries"]]
    assert len(set(scores)) < len(scores)
    times = [(e["score"], e["timestamp_ns"]) for e in document["entries"]]
    assert len(set(times)) < len(times)


def test_ls_layer_filter_and_limit(rng):
    store = make_store(rng)
    expected = library_rows(store)
    layer1 = [e for e in expected if e["layer"] == 1]
    document = run_json("ls", store, "--layer", 1, "--sort", "size")
    assert [e["entry_id"] for e in document["entries"]] == independent_order(layer1, "size")
    assert document["layer"] == 1 and document["total"] == len(layer1)
    document = run_json("ls", store, "--sort", "accesses", "--limit", 3)
    assert [e["entry_id"] for e in document["entries"]] == independent_order(expected, "accesses")[:3]
    assert document["count"] == 3 and document["total"] == 10 and document["limit"] == 3
    document = run_json("ls", store, "--layer", 7)
    assert document["entries"] == [] and document["total"] == 0


def test_ls_jsonl_is_one_object_per_line(rng):
    store = make_store(rng)
    whole = run_json("ls", store, "--sort", "age")
    result = run("ls", store, "--sort", "age", "--jsonl")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 10
    assert [json.loads(line) for line in lines] == whole["entries"]
    limited = run("ls", store, "--jsonl", "--limit", 4, "--layer", 0)
    assert [json.loads(line)["entry_id"] for line in limited.stdout.splitlines()] == sorted(
        e["entry_id"] for e in whole["entries"] if e["layer"] == 0
    )[:4]


def test_ls_json_is_what_json_dumps_prints(rng):
    store = make_store(rng)
    result = run("ls", store, "--json", "--sort", "score")
    assert result.stdout == json.dumps(json.loads(result.stdout), indent=2) + "\n"


def test_ls_table(rng):
    store = make_store(rng)
    result = run("ls", store, "--sort", "score", "--limit", 4)
    assert result.exit_code == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if "importance" in line)
    assert re.findall(r"\w+", header) == [
        "id",
        "layer",
        "tokens",
        "importance",
        "accesses",
        "score",
        "age",
        "shard",
        "bytes",
    ]
    ids = [int(line.split()[1]) for line in result.stdout.splitlines() if re.match(r"│\s+\d", line)]
    assert ids == [e["entry_id"] for e in run_json("ls", store, "--sort", "score")["entries"]][:4]
    assert "4 of 10 entries, by eviction score, next to be evicted first" in result.stdout
    assert run("ls", store, "-q").stdout == ""


def test_ls_table_shows_the_first_rows_unless_limit_says(rng):
    with hmem.Store.create("many", embed_dim=D, hdc_dim=HDC) as s:
        rows = rng.standard_normal((SHOWN + 5, 1, D)).astype(np.float32)
        s.put_many([(r, r) for r in rows])
    result = run("ls", "many")
    assert f"{SHOWN} of {SHOWN + 5} entries, by id (--limit N shows more)" in result.stdout
    result = run("ls", "many", "--limit", SHOWN + 5)
    assert f"{SHOWN + 5} entries, by id\n" in result.stdout
    assert len(run("ls", "many", "--jsonl").stdout.splitlines()) == SHOWN + 5


def test_ls_empty_store():
    hmem.Store.create("empty", embed_dim=D, hdc_dim=HDC).close()
    result = run("ls", "empty")
    assert result.exit_code == 0 and result.stdout == "no entries in empty\n"
    assert run("ls", "empty", "--layer", 2).stdout == "no entries in layer 2 in empty\n"
    document = run_json("ls", "empty")
    assert document["entries"] == [] and document["count"] == document["total"] == 0
    result = run("ls", "empty", "--jsonl")
    assert result.exit_code == 0 and result.stdout == ""


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--limit", "0"], "--limit"),
        (["--limit", "-3"], "--limit"),
        (["--sort", "newest"], "--sort must be one of id, score, accesses, age, size"),
        (["--json", "--jsonl"], "give --json or --jsonl, not both"),
        (["--layer", "-1"], ""),
    ],
)
def test_ls_bad_arguments_are_usage_errors(rng, args, fragment):
    store = make_store(rng)
    before = snapshot(store)
    result = run("ls", store, *args)
    error_line(result, ExitCode.USAGE, fragment)
    assert snapshot(store) == before


def test_ls_of_no_store(tmp_path):
    Path("plain").mkdir()
    error_line(run("ls", "plain"), ExitCode.NOT_A_STORE)


def test_ls_takes_the_store_from_hmem_store(rng):
    make_store(rng)
    result = run("ls", "--jsonl", env={"HMEM_STORE": "s"})
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 10


# ---- Store.entries in the library ---------------------------------------------------


def test_store_entries_library(rng):
    store = make_store(rng)
    expected = library_rows(store)
    with hmem.Store.open(store, read_only=True) as s:
        every = list(s.entries())
        assert [e.entry_id for e in every] == s.entry_ids()
        assert every == [s.get(i).info for i in s.entry_ids()]
        listing = s.entries(sort="score", limit=3)
        assert isinstance(listing, hmem.EntryListing)
        assert len(listing) == 3 and listing.total == 10
        assert [e.entry_id for e in listing] == independent_order(expected, "score")[:3]
        assert [e.entry_id for e in s.entries(2, sort="size")] == independent_order(
            [e for e in expected if e["layer"] == 2], "size"
        )
        empty = s.entries(limit=0)
        assert len(empty) == 0 and list(empty) == [] and empty.total == 10
        for bad in ({"sort": "newest"}, {"limit": -1}, {"limit": 1.5}):
            with pytest.raises(hmem.InvalidArgumentError):
                s.entries(**bad)
        batches = list(s.entries().batches(4))
        assert [len(b) for b in batches] == [4, 4, 2]
        assert sum(batches, []) == every
        for info in every:
            assert info.score == pytest.approx(info.importance * (1 + math.log1p(info.access_count)), rel=1e-12)
    assert hmem.ENTRY_SORTS == ("id", "score", "accesses", "age", "size")


# ---- hmem show ------------------------------------------------------------------------


def test_show_meta_and_tensors_of_a_put(rng):
    hmem.Store.create("s", embed_dim=D, hdc_dim=HDC).close()
    keys, values = rng.standard_normal((10, D)).astype(np.float32), rng.standard_normal((10, D)).astype(np.float32)
    save_file({"k": keys, "v": values}, "run[bold]1.safetensors")
    result = run("put", "s", "run[bold]1.safetensors", "--chunk-tokens", 4, "--layer", 3, "--importance", 2, "-q")
    assert result.exit_code == 0, result.stderr
    document = run_json("show", "s", 2)
    assert document["entry_id"] == 2 and document["layer"] == 3 and document["n_tokens"] == 4
    assert document["importance"] == 2.0 and document["access_count"] == 0 and document["score"] == 2.0
    assert document["meta"] == {"source": "run[bold]1.safetensors", "chunk": 1, "tokens": [4, 8]}
    assert document["storage_dtype"] == "f32"
    assert document == {
        **run_json("ls", "s")["entries"][1],
        "store": "s",
        "meta": document["meta"],
        "storage_dtype": "f32",
        "tensors": document["tensors"],
    }
    for side, rows in (("keys", keys[4:8]), ("values", values[4:8])):
        summary = document["tensors"][side]
        assert summary["shape"] == [4, D] and summary["dtype"] == "F32"
        norms = np.linalg.norm(rows.astype(np.float64), axis=1)
        assert summary["mean_row_l2"] == pytest.approx(norms.mean(), rel=1e-12)
        assert summary["max_row_l2"] == pytest.approx(norms.max(), rel=1e-12)
        assert summary["max_abs"] == pytest.approx(float(np.abs(rows).max()), rel=1e-12)
        assert "scales" not in summary
    result = run("show", "s", 2)
    assert result.exit_code == 0, result.stderr
    assert "run[bold]1.safetensors" in result.stdout  # user text is not read as markup
    assert re.search(r"meta tokens\s+│ \[4, 8\]", result.stdout)
    assert re.search(r"keys\s+│ 4 x 16\s+│ F32", result.stdout)


def test_show_int8_and_half_stores(rng):
    for dtype, name in (("f16", "F16"), ("bf16", "BF16"), ("int8", "I8")):
        store = make_store(rng, dtype, storage_dtype=dtype)
        document = run_json("show", store, 3)
        assert document["storage_dtype"] == dtype
        with hmem.Store.open(store, read_only=True) as s:
            entry = s.get(3)
        for side in ("keys", "values"):
            summary = document["tensors"][side]
            assert summary["dtype"] == name and summary["shape"] == [4, D]
            rows = getattr(entry, side)
            assert summary["max_abs"] == float(np.abs(rows).max())  # of the rows read back
            assert ("scales" in summary) == (dtype == "int8")
        if dtype == "int8":
            assert document["tensors"]["keys"]["scales"]["shape"] == [4]
            assert "F32 row scales" in run("show", store, 3).stdout


def test_show_unknown_id_fails_with_code_1(rng):
    store = make_store(rng)
    before = snapshot(store)
    line = error_line(run("show", store, 99), ExitCode.FAILURE, "holds no entry 99")
    assert "'hmem ls s' lists the live entries" in line
    error_line(run("show", store, "x"), ExitCode.USAGE, "'x' is not an entry id")
    error_line(run("show", store, 1, 2), ExitCode.USAGE, "give one entry id")
    error_line(run("show", store), ExitCode.USAGE, "give the store and the entry id")
    assert snapshot(store) == before


def test_show_takes_the_store_from_hmem_store(rng):
    make_store(rng)
    result = run("show", 4, "--json", env={"HMEM_STORE": "s"})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["entry_id"] == 4


# ---- hmem export ----------------------------------------------------------------------


def half_store(rng, dtype: str) -> tuple[Path, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """A store of `dtype` holding rows that dtype represents exactly: what
    was put is what must come out, bit for bit."""
    path = Path(dtype)
    put = {}
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, storage_dtype=dtype) as s:
        for n in range(4):
            rows = rng.standard_normal((2, 3 + n, D)).astype(np.float32)
            if dtype == "f16":
                rows = rows.astype(np.float16).astype(np.float32)
            elif dtype == "bf16":
                rows = (rows.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
            entry_id = s.put(rows[0], rows[1], layer_idx=1, importance=0.75)
            put[entry_id] = (rows[0], rows[1])
    return path, put


@pytest.mark.parametrize("dtype, name", [("f32", "F32"), ("f16", "F16"), ("bf16", "BF16")])
def test_export_is_bit_exact_and_puts_back(rng, dtype, name):
    store, put = half_store(rng, dtype)
    document = run_json("export", store, 3, 1, 3, "-o", "out.safetensors")
    assert document["entry_ids"] == [3, 1] and document["dtype"] == name and document["scales"] is False
    assert document["importable"] is True and document["bytes"] == Path("out.safetensors").stat().st_size
    meta, tensors = read_safetensors(Path("out.safetensors"))
    assert set(tensors) == {"k_1", "v_1", "k_3", "v_3"}
    assert json.loads(meta["entry_ids"]) == [3, 1] and meta["storage_dtype"] == dtype
    assert meta["layer"] == "1" and float(meta["importance"]) == np.float32(0.75)
    with hmem.Store.open(store, read_only=True) as s:
        for entry_id in (1, 3):
            stored = s.stored_kv(entry_id)
            decoded = s.get(entry_id)
            for side, kind, original in (("keys", "k", put[entry_id][0]), ("values", "v", put[entry_id][1])):
                file_dtype, shape, raw = tensors[f"{kind}_{entry_id}"]
                assert file_dtype == name and shape == list(original.shape)
                assert raw == getattr(stored, side).tobytes()
                if name == "BF16":
                    back = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
                else:
                    back = np.frombuffer(raw, {"F32": "<f4", "F16": "<f2"}[name]).astype(np.float32)
                back = back.reshape(shape)
                assert back.tobytes() == original.tobytes() == getattr(decoded, side).tobytes()
    # back in with hmem put: the same entries, layer and importance, bit for bit
    hmem.Store.create("again", embed_dim=D, hdc_dim=HDC, storage_dtype=dtype).close()
    result = run("put", "again", "out.safetensors", "-q")
    assert result.exit_code == 0, result.stderr
    with hmem.Store.open(store, read_only=True) as a, hmem.Store.open("again", read_only=True) as b:
        for old, new in ((1, 1), (3, 2)):  # numbered k_{n}/v_{n} go in ascending n
            x, y = a.stored_kv(old), b.stored_kv(new)
            assert x.keys.tobytes() == y.keys.tobytes() and x.values.tobytes() == y.values.tobytes()
            assert (y.info.layer_idx, y.info.importance) == (1, 0.75)


def test_export_int8_writes_int8_and_scales(rng):
    store = make_store(rng, "q", storage_dtype="int8")
    result = run("export", store, 2, 5, "-o", "q.safetensors")
    assert result.exit_code == 0, result.stderr
    assert "as stored: I8" in result.stdout and "'hmem put' cannot import this file" in result.stdout
    meta, tensors = read_safetensors(Path("q.safetensors"))
    assert set(tensors) == {f"{k}_{i}" for i in (2, 5) for k in ("k", "v", "k_scale", "v_scale")}
    assert meta["storage_dtype"] == "int8" and "k_scale_{id}" in meta["scales"]
    with hmem.Store.open(store, read_only=True) as s:
        for entry_id in (2, 5):
            stored, decoded = s.stored_kv(entry_id), s.get(entry_id)
            assert stored.dtype == "I8" and stored.keys.dtype == np.int8
            for side, kind in (("keys", "k"), ("values", "v")):
                dtype, shape, raw = tensors[f"{kind}_{entry_id}"]
                assert dtype == "I8" and shape == [decoded.info.n_tokens, D]
                q = np.frombuffer(raw, np.int8).reshape(shape)
                sdtype, sshape, sraw = tensors[f"{kind}_scale_{entry_id}"]
                assert sdtype == "F32" and sshape == [decoded.info.n_tokens]
                scales = np.frombuffer(sraw, "<f4")
                assert q.tobytes() == getattr(stored, side).tobytes()
                np.testing.assert_array_equal(q.astype(np.float32) * scales[:, None], getattr(decoded, side))
    document = run_json("export", store, 2, "-o", "q2.safetensors")
    assert document["dtype"] == "I8" and document["scales"] is True and document["importable"] is False
    # hmem put refuses it, and says why
    hmem.Store.create("f", embed_dim=D, hdc_dim=HDC).close()
    result = run("put", "f", "q.safetensors")
    assert result.exit_code != 0 and "I8" in result.stderr + result.stdout


def test_export_refuses_unknown_ids_and_bad_paths_writing_nothing(rng):
    store = make_store(rng)
    before = snapshot(store)
    Path("old.safetensors").write_bytes(b"keep me")
    line = error_line(
        run("export", store, 1, 77, 99, "-o", "old.safetensors"), ExitCode.FAILURE, "holds no entries 77, 99"
    )
    assert "'hmem ls s' lists the live entries" in line
    assert Path("old.safetensors").read_bytes() == b"keep me"
    error_line(run("export", store, 1, "-o", "missing/x.safetensors"), ExitCode.BAD_PATH, "missing/x.safetensors")
    Path("adir").mkdir()
    error_line(run("export", store, 1, "-o", "adir"), ExitCode.BAD_PATH)
    error_line(run("export", store, "-o", "x.safetensors"), ExitCode.USAGE, "give the store and at least one")
    error_line(run("export", store, 1, "one", "-o", "x.safetensors"), ExitCode.USAGE, "'one' is not an entry id")
    result = run("export", store, 1)
    assert result.exit_code == ExitCode.USAGE and "--output" in result.stderr
    error_line(run("export", store, 1, "-o", store / "index.json"), ExitCode.USAGE, "inside the store")
    assert not Path("x.safetensors").exists() and not Path("missing").exists()
    assert sorted(p.name for p in Path(".").iterdir()) == ["adir", "old.safetensors", "s"]
    assert snapshot(store) == before


def test_export_takes_the_store_from_hmem_store(rng):
    make_store(rng)
    result = run("export", 2, 4, "-o", "e.safetensors", env={"HMEM_STORE": "s"})
    assert result.exit_code == 0, result.stderr
    assert set(read_safetensors(Path("e.safetensors"))[1]) == {"k_2", "v_2", "k_4", "v_4"}


def test_export_entries_and_stored_kv_in_the_library(rng):
    store, put = half_store(rng, "bf16")
    with hmem.Store.open(store, read_only=True) as s:
        stored = s.stored_kv(2)
        assert isinstance(stored, hmem.StoredKV) and stored.dtype == "BF16" and stored.keys.dtype == np.uint16
        assert not stored.keys.flags.writeable and stored.key_scales is None
        with pytest.raises(hmem.EntryNotFoundError):
            s.stored_kv(40)
        size = hmem.export_entries(s, [2], "lib.safetensors", {"note": "mine"})
        assert size == Path("lib.safetensors").stat().st_size
        assert read_safetensors(Path("lib.safetensors"))[0]["note"] == "mine"
        with pytest.raises(hmem.InvalidArgumentError):
            hmem.export_entries(s, [], "none.safetensors")
        with pytest.raises(hmem.InvalidArgumentError):
            hmem.export_entries(s, [-1], "none.safetensors")
        with pytest.raises(hmem.EntryNotFoundError, match="no entries 8, 9"):
            hmem.export_entries(s, [9, 2, 8], "none.safetensors")
        with pytest.raises(hmem.PathError):
            hmem.export_entries(s, [2], "nowhere/none.safetensors")
    assert not Path("none.safetensors").exists()


def test_query_export_names_the_storage_dtype(rng):
    store = make_store(rng, "q8", storage_dtype="int8")
    with hmem.Store.open(store, read_only=True) as s:
        results = s.query(s.get(3).keys, 2, top_k=2)
        hmem.export_results(results, Path("hits.safetensors"), storage_dtype=s.config.storage_dtype)
        meta, tensors = read_safetensors(Path("hits.safetensors"))
        assert meta["storage_dtype"] == "int8" and meta["dequantized"] == "true"
        assert all(dtype == "F32" for dtype, _, _ in tensors.values())
        raw = tensors[f"k_{results[0].entry_id}"][2]
        assert raw == s.get(results[0].entry_id).keys.tobytes()  # the rows read back, dequantized
        with pytest.raises(hmem.InvalidArgumentError):
            hmem.export_results(results, Path("bad.safetensors"), storage_dtype="f8")


def test_query_export_note_is_for_int8_only():
    assert "dequantized to F32" in export_note("int8") and "'hmem export'" in export_note("int8")
    assert all(export_note(dtype) is None for dtype in ("f32", "f16", "bf16"))


@pytest.mark.parametrize("storage", ["int8", "f32"])
def test_query_export_says_when_the_rows_are_dequantized(rng, storage):
    store = make_store(rng, "q" + storage, storage_dtype=storage)
    with hmem.Store.open(store, read_only=True) as s:
        np.save("probe.npy", np.asarray(s.get(3).keys))
    result = run("query", store, "--query", "probe.npy", "-l", 2, "-k", 1, "--export", "hits.safetensors")
    assert result.exit_code == 0, result.stderr
    assert ("dequantized to F32" in result.stdout) == (storage == "int8")
