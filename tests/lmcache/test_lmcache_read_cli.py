"""`hmem stats`, `ls`, `show` and `verify` given an LMCache cache directory
instead of a store: on the caches LMCache 0.5.6 itself wrote (the small
ones committed in tests/data/lmcache/, with their oracle.json), copied
first; damaged copies are reported, never changed; a directory that is
neither a store nor a cache is refused with exit code 5."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode
from hmem.lmcache import open_cache, parse_kv_shape

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "lmcache"
ORACLE = json.loads((FIXTURES / "oracle.json").read_text())
CHUNK = ORACLE["chunk_size"]
LAYERS = ORACLE["layers"]
HIDDEN = ORACLE["hidden"]
SHAPE = f"{LAYERS},{HIDDEN}"
KINDS = ("local_disk", "fs", "layerwise")
TAG = "user%alice"
ANSI = re.compile(r"\x1b\[")
BASE_ENV = {  # as tests/test_cli_store.py: wide, no colour forced, no store from the environment
    "COLUMNS": "200",
    "NO_COLOR": None,
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "HMEM_STORE": None,
    "HMEM_DEBUG": None,
}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=BASE_ENV)


def run_json(*args, code: int = 0):
    result = run(*args, "--json")
    assert result.exit_code == code, result.output + result.stderr
    assert not ANSI.search(result.stdout)
    return json.loads(result.stdout)


def copy(tmp_path: Path, kind: str) -> Path:
    return Path(shutil.copytree(FIXTURES / kind, tmp_path / kind))


def files(kind: str) -> dict[str, dict]:
    return ORACLE["caches"][kind]["files"]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        p.name: (os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b"<dir>")
        for p in directory.iterdir()
    }


def shape_options(kind: str) -> list[str]:
    return ["--chunk-size", str(CHUNK)] + (["--kv-shape", SHAPE] if kind == "local_disk" else [])


# ---- stats ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_stats_counts_what_lmcache_wrote(tmp_path, kind):
    directory = copy(tmp_path, kind)
    doc = run_json("stats", directory, *shape_options(kind))
    assert doc["chunks"] == len(files(kind)) == sum(g["chunks"] for g in doc["groups"])
    assert doc["bytes"] == sum(p.stat().st_size for p in directory.iterdir())
    assert doc["kinds"] == (["fs"] if kind == "fs" else ["local_disk"])
    assert (doc["debris"], doc["foreign"], doc["other"]) == ([], [], [])
    assert doc["layerwise"] == (kind == "layerwise") and doc["chunk_size"] == CHUNK
    assert doc["kv_shape_from"] == {"fs": "headers", "local_disk": "given", "layerwise": "inferred"}[kind]
    tagged = sum(g["chunks"] for g in doc["groups"] if g["tags"] == TAG)
    assert tagged == sum(f"@{TAG}." in name for name in files(kind))
    human = run("stats", directory, *shape_options(kind))
    assert human.exit_code == 0, human.output
    assert f"{len(files(kind))}, " in human.stdout and TAG in human.stdout
    if kind == "layerwise":  # one row per group, its layers collapsed
        assert f"0-{LAYERS - 1}" in human.stdout
        assert len([line for line in human.stdout.splitlines() if f"0-{LAYERS - 1}" in line]) == 2
        assert "inferred from the layerwise files" in human.stdout


def test_stats_says_where_the_shape_comes_from(tmp_path):
    directory = copy(tmp_path, "local_disk")
    doc = run_json("stats", directory, "--chunk-size", CHUNK)
    assert doc["kv_shape"] is None and doc["kv_shape_from"] == "unknown"
    human = run("stats", directory)
    assert "unknown" in human.stdout and "--kv-shape" in human.stdout and "--model-config" in human.stdout
    config = tmp_path / "model" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": LAYERS,
                "num_attention_heads": 4 * ORACLE["kv_heads"],
                "num_key_value_heads": ORACLE["kv_heads"],
                "head_dim": ORACLE["head_dim"],
                "hidden_size": 64,
            }
        )
    )
    doc = run_json("stats", directory, "--model-config", config.parent)
    assert doc["kv_shape_from"] == "model config"
    assert (doc["kv_shape"]["layers"], doc["kv_shape"]["hidden"]) == (LAYERS, HIDDEN)
    doc = run_json("stats", directory, "--kv-shape", SHAPE)
    assert doc["kv_shape_from"] == "given" and doc["kv_shape"]["source"] == f"given as {SHAPE}"


def test_stats_names_debris_and_foreign_files(tmp_path):
    directory = copy(tmp_path, "fs")
    first = sorted(files("fs"))[0]
    shutil.copyfile(directory / first, directory / (first + ".tmp"))
    (directory / "notes.txt").write_text("mine")
    (directory / "sub").mkdir()
    doc = run_json("stats", directory)
    assert doc["debris"] == [first + ".tmp"] and doc["debris_bytes"] == (directory / first).stat().st_size
    assert doc["foreign"] == ["notes.txt"] and doc["other"] == ["sub"]
    assert doc["chunks"] == len(files("fs"))
    human = run("stats", directory)
    assert human.exit_code == 0 and "1 file," in human.stdout
    assert "notes.txt" in human.stderr and "sub" in human.stderr


# ---- ls -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_ls_lists_exactly_the_files(tmp_path, kind):
    directory = copy(tmp_path, kind)
    doc = run_json("ls", directory, *shape_options(kind))
    names = [c["name"] for c in doc["chunks"]]
    assert names == sorted(files(kind)) and doc["total"] == doc["count"] == len(names)
    for chunk in doc["chunks"]:
        assert chunk["tokens"] == CHUNK and chunk["shape"] == files(kind)[chunk["name"]]["shape"]
        assert chunk["size"] == (directory / chunk["name"]).stat().st_size
    lines = run("ls", directory, "--jsonl", *shape_options(kind))
    assert lines.exit_code == 0
    assert [json.loads(line)["name"] for line in lines.stdout.splitlines()] == names
    human = run("ls", directory, *shape_options(kind))
    assert human.exit_code == 0, human.output
    for name in files(kind):
        assert name in human.stdout
    assert f"{len(names)} chunk files, by file name" in human.stdout


@pytest.mark.parametrize("kind", [*KINDS, "mp"])
def test_ls_json_is_the_library_s_chunk_info(tmp_path, kind):
    """ls builds its JSON from the listing's columns: the same as each
    chunk's ChunkInfo.to_dict() (an fs file's shape from the header of a
    file of its size, and said so)."""
    directory = copy(tmp_path, kind)
    options = shape_options(kind)
    listed = run_json("ls", directory, *options)["chunks"]
    lines = run("ls", directory, "--jsonl", *options).stdout.splitlines()
    assert [{**json.loads(line), "atime": None} for line in lines] == [{**c, "atime": None} for c in listed]
    cache = open_cache(directory, kv_shape=parse_kv_shape(SHAPE) if "--kv-shape" in options else None, chunk_size=CHUNK)
    assert len(listed) == len(os.listdir(directory))
    for chunk in listed:
        expected = cache.chunk(cache.row_of(chunk["name"])).to_dict()
        expected["atime"] = chunk["atime"]  # a header read may set it
        if kind == "fs" and chunk["shape_source"] != expected["shape_source"]:
            assert chunk["shape_source"].startswith("the header of ")
            expected["shape_source"] = chunk["shape_source"]
        assert chunk == expected


def test_ls_json_of_names_json_must_escape(tmp_path):
    directory = tmp_path / "odd"
    directory.mkdir()
    names = ['we"ird\\model é@1@0@ff@bfloat16.pt', "plain@1@0@-1a@bfloat16.pt", 'a", "b@1@0@2b@bfloat16.pt']
    for name in names:
        (directory / name).write_bytes(bytes(64))
    listed = run_json("ls", directory)["chunks"]
    assert [c["name"] for c in listed] == sorted(names)
    assert {c["model"] for c in listed} == {'we"ird\\model é', "plain", 'a", "b'}
    lines = run("ls", directory, "--jsonl").stdout.splitlines()
    assert [json.loads(line) for line in lines] == listed


def test_ls_selects_by_key_fields(tmp_path):
    directory = copy(tmp_path, "layerwise")
    names = set(files("layerwise"))
    tagged = {n for n in names if f"@{TAG}." in n}

    def listed(*options) -> set[str]:
        return {c["name"] for c in run_json("ls", directory, "--chunk-size", CHUNK, *options)["chunks"]}

    assert listed("--tag", TAG) == tagged
    assert listed("--tag", "none") == names - tagged
    assert listed("--layer", 1) == {n for n in names if f"@{ORACLE['kv_dtype']}@1" in n}
    assert listed("--model", ORACLE["model"], "--world-size", 1, "--rank", 0, "--dtype", ORACLE["kv_dtype"]) == names
    assert listed("--rank", 1) == listed("--dtype", "half") == listed("--model", "other/model") == set()
    empty = run("ls", directory, "--rank", 3)
    assert empty.exit_code == 0 and "no chunks matching rank 3" in empty.stdout


def test_ls_sorts_and_limits(tmp_path):
    directory = copy(tmp_path, "fs")
    names = sorted(files("fs"))
    big = directory / names[-1]
    os.truncate(big, big.stat().st_size + 2)  # a damaged file is still listed
    for i, name in enumerate(names):  # written in reverse name order
        os.utime(directory / name, ns=(10**18 + i, 10**18 - i))
    # the atimes first: reading a header (for its tokens) may set a file's atime
    assert [c["name"] for c in run_json("ls", directory, "--sort", "atime")["chunks"]] == names
    assert [c["name"] for c in run_json("ls", directory, "--sort", "mtime")["chunks"]] == names[::-1]
    doc = run_json("ls", directory, "--sort", "size", "--limit", 1)
    assert [c["name"] for c in doc["chunks"]] == [names[-1]] and doc["total"] == len(names)
    human = run("ls", directory, "--limit", 2)
    assert f"2 of {len(names)} chunk files" in human.stdout


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--sort", "score"], "--sort"),
        (["--tag", "alice"], "NAME%VALUE"),
        (["--json", "--jsonl"], "not both"),
        (["--kv-shape", "4"], "LAYERS,HIDDEN"),
    ],
)
def test_ls_refuses_bad_options(tmp_path, options, fragment):
    directory = copy(tmp_path, "fs")
    result = run("ls", directory, *options)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert fragment in result.stderr


def test_ls_of_a_store_refuses_the_cache_filters(tmp_path):
    store = tmp_path / "store"
    assert run("init", store, "--embed-dim", 8).exit_code == 0
    result = run("ls", store, "--model", "m")
    assert result.exit_code == ExitCode.USAGE and "LMCache cache" in result.stderr


# ---- show -----------------------------------------------------------------------------------


def _values(directory: Path, name: str, kind: str) -> np.ndarray:
    """The file's K/V as float32, read here without hmem."""
    raw = (directory / name).read_bytes()
    words = np.frombuffer(raw[28:] if kind == "fs" else raw, dtype="<u2")
    return (words.astype(np.uint32) << 16).view(np.float32).reshape(files(kind)[name]["shape"])


@pytest.mark.parametrize("kind", KINDS)
def test_show_a_chunk(tmp_path, kind):
    directory = copy(tmp_path, kind)
    name = sorted(files(kind))[-1]
    doc = run_json("show", directory, name, *shape_options(kind))
    chunk = doc["chunk"]
    assert chunk["name"] == name and chunk["shape"] == files(kind)[name]["shape"] and chunk["tokens"] == CHUNK
    assert chunk["kind"] == ("fs" if kind == "fs" else "local_disk")
    assert doc["header_bytes"] == (28 if kind == "fs" else None)
    values = _values(directory, name, kind)
    sample = doc["sample"]
    assert sample["decoded"]
    if kind == "layerwise":  # [tokens, 2, hidden] of the file's layer
        [layer] = sample["layers"]
        assert layer["layer"] == chunk["layer"]
        assert layer["k"] == values[0, 0, :4].tolist() and layer["v"] == values[0, 1, :4].tolist()
        assert layer["max_abs_k"] == float(np.abs(values[:, 0]).max())
    else:  # [2, layers, tokens, hidden]
        assert [entry["layer"] for entry in sample["layers"]] == list(range(LAYERS))
        for entry in sample["layers"]:
            assert entry["k"] == values[0, entry["layer"], 0, :4].tolist()
            assert entry["v"] == values[1, entry["layer"], 0, :4].tolist()
            assert entry["non_finite_k"] == entry["non_finite_v"] == 0
    human = run("show", directory, name, *shape_options(kind))
    assert human.exit_code == 0, human.output
    assert name in human.stdout and " x ".join(map(str, chunk["shape"])) in human.stdout
    assert f"{values.reshape(-1)[0]:.4g}" in human.stdout


def _fs_chunk(path: Path, memory_format: int, dtype_code: int, shape: tuple[int, ...], data: bytes) -> None:
    """An fs connector file as LMCache lays one out: length, memory format,
    dtype code, the shape padded to four dimensions, then the bytes."""
    padded = list(shape) + [0] * (4 - len(shape))
    path.write_bytes(struct.pack("=7i", len(data), memory_format, dtype_code, *padded) + data)


@pytest.mark.parametrize(
    ("dtype", "code", "stored", "shown"),
    [  # known codes of each format and their values; one NaN each
        ("fp8_e4m3fn", 7, [0x38, 0xC0, 0x7E, 0x01, 0x7F], [1.0, -2.0, 448.0, 2.0**-9]),
        ("fp8_e5m2", 8, [0x3C, 0xC0, 0x7B, 0x01, 0x7F], [1.0, -2.0, 57344.0, 2.0**-16]),
        ("half", 2, [0x3C00, 0xC000, 0x7BFF, 0x0001, 0x7E00], [1.0, -2.0, 65504.0, 2.0**-24]),
    ],
)
def test_show_decodes_each_dtype(tmp_path, dtype, code, stored, shown):
    directory = tmp_path / "cache"
    directory.mkdir()
    shape = (2, LAYERS, CHUNK, HIDDEN)
    values = np.zeros(shape, dtype="u1" if dtype.startswith("fp8") else "<u2")
    values[0, 0, 0, :5] = stored  # token 0 of layer 0's K: four values shown, the fifth a NaN
    name = f"m@1@0@1f@{dtype}.data"
    _fs_chunk(directory / name, 1, code, shape, values.tobytes())
    doc = run_json("show", directory, name, "--chunk-size", CHUNK)
    first = doc["sample"]["layers"][0]
    assert doc["sample"]["decoded"] and first["k"] == shown and first["v"] == [0.0] * 4
    assert first["non_finite_k"] == 1 and first["max_abs_k"] == max(abs(x) for x in shown)
    human = run("show", directory, name, "--chunk-size", CHUNK)
    assert human.exit_code == 0 and "(1 inf/NaN)" in human.stdout


@pytest.mark.parametrize(
    ("name", "memory_format", "shape", "planes"),
    [
        ("m@1@0@2e@bfloat16.data", 6, (1, LAYERS, CHUNK, HIDDEN), ["latent"]),  # MLA: one latent plane
        ("m@1@0@3d@bfloat16@0.data", 3, (2, CHUNK, HIDDEN), ["k", "v"]),  # one layer as [2, tokens, hidden]
    ],
)
def test_show_lays_out_other_memory_formats(tmp_path, name, memory_format, shape, planes):
    directory = tmp_path / "cache"
    directory.mkdir()
    words = np.arange(np.prod(shape), dtype="<u2").reshape(shape) | 0x3F00  # bf16 around 0.5..1
    _fs_chunk(directory / name, memory_format, 3, shape, words.tobytes())
    sample = run_json("show", directory, name, "--chunk-size", CHUNK)["sample"]
    floats = (words.astype(np.uint32) << 16).view(np.float32)
    rows = {"latent": lambda layer: floats[0, layer], "k": lambda layer: floats[0], "v": lambda layer: floats[1]}
    assert [sorted(p for p in entry if p in ("k", "v", "latent")) for entry in sample["layers"]] == [
        sorted(planes)
    ] * len(sample["layers"])
    for entry in sample["layers"]:
        for plane in planes:
            assert entry[plane] == rows[plane](entry["layer"])[0, :4].tolist()
    assert run_json("verify", directory, "--deep", "--chunk-size", CHUNK)["ok"]


def test_show_finds_a_chunk_by_key_or_hash(tmp_path):
    directory = copy(tmp_path, "fs")
    request = ORACLE["caches"]["fs"]["requests"][0]
    key = request["keys"][0]
    by_key = run_json("show", directory, key)
    assert by_key["chunk"]["key"] == key
    hashes = [c["chunk_hash"] for c in run_json("ls", directory)["chunks"]]
    for unique in [h for h in hashes if hashes.count(h) == 1]:
        result = run("show", "--json", directory, "--", unique)  # a negative hash: after "--"
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["chunk"]["chunk_hash"] == unique
    shared = next(h for h in hashes if hashes.count(h) > 1)  # the tagged request's chunks share a hash
    ambiguous = run("show", directory, "--", shared)
    assert ambiguous.exit_code == ExitCode.USAGE and "give a file name or key" in ambiguous.stderr
    missing = run("show", directory, "no-such-chunk")
    assert missing.exit_code == ExitCode.FAILURE and "no chunk" in missing.stderr
    link = "hmem-tests-SEP-tiny-llama@1@0@ab@bfloat16.data"  # named as a chunk: never followed
    (directory / link).symlink_to(directory / sorted(files("fs"))[0])
    linked = run("show", directory, link)
    assert linked.exit_code == ExitCode.FAILURE and "no chunk" in linked.stderr


def test_show_without_a_shape_shows_no_values(tmp_path):
    directory = copy(tmp_path, "local_disk")
    name = sorted(files("local_disk"))[0]
    doc = run_json("show", directory, name)
    assert doc["chunk"]["shape"] is None and doc["sample"] is None and doc["kv_shape_from"] == "unknown"
    human = run("show", directory, name)
    assert human.exit_code == 0 and "--kv-shape" in human.stdout


def test_show_of_a_damaged_chunk_fails_clearly(tmp_path):
    directory = copy(tmp_path, "fs")
    name = sorted(files("fs"))[0]
    os.truncate(directory / name, 100)
    result = run("show", directory, name)
    assert result.exit_code == ExitCode.FAILURE and "not an LMCache fs chunk" in result.stderr
    assert (directory / name).stat().st_size == 100


# ---- verify ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_verify_an_intact_cache(tmp_path, kind):
    directory = copy(tmp_path, kind)
    for depth in ([], ["--deep"]):
        doc = run_json("verify", directory, *depth, *shape_options(kind))
        assert doc["ok"] and doc["findings"] == [] and doc["chunks_checked"] == len(files(kind))
        assert doc["deep"] == bool(depth)
    human = run("verify", directory, "--deep", *shape_options(kind))
    assert human.exit_code == 0 and human.stdout.startswith("ok: deep check"), human.output


def test_verify_without_a_shape_warns(tmp_path):
    directory = copy(tmp_path, "local_disk")
    doc = run_json("verify", directory, "--chunk-size", CHUNK)
    assert doc["ok"] and [f["problem"] for f in doc["findings"]] == ["shape unknown"]
    human = run("verify", directory)
    assert human.exit_code == 0 and "1 warning(s), no error" in human.stdout


def _fs_damage(how: str):
    def damage(d: Path) -> str:
        path = d / sorted(files("fs"))[0]
        raw = bytearray(path.read_bytes())
        if how == "truncated":
            del raw[-100:]
        elif how == "length":
            struct.pack_into("=i", raw, 0, struct.unpack_from("=i", raw)[0] + 20)
        else:  # dtype code
            struct.pack_into("=i", raw, 8, 99)
        path.write_bytes(bytes(raw))
        return path.name

    return damage


def _new_file(name: str, *, link: bool = False, directory: bool = False):
    def damage(d: Path) -> str:
        if link:
            (d / name).symlink_to(d.parent / "outside.data")
        elif directory:
            (d / name).mkdir()
        else:
            shutil.copyfile(d / sorted(os.listdir(d))[0], d / name)
        return name

    return damage


def _cut_local_disk(d: Path) -> str:
    path = d / sorted(files("local_disk"))[0]
    os.truncate(path, path.stat().st_size - 1)
    return path.name


@pytest.mark.parametrize(
    ("kind", "damage", "problem", "code"),
    [
        ("fs", _fs_damage("truncated"), "bad header", ExitCode.PROBLEMS_FOUND),
        ("fs", _fs_damage("length"), "bad header", ExitCode.PROBLEMS_FOUND),
        ("fs", _fs_damage("dtype"), "bad header", ExitCode.PROBLEMS_FOUND),
        ("fs", _new_file("hmem-tests-SEP-tiny-llama@1@0@xyz@bfloat16.data"), "not a chunk", ExitCode.OK),
        ("fs", _new_file("notes.txt"), "not a chunk", ExitCode.OK),
        ("fs", _new_file("a.data.tmp"), "debris", ExitCode.OK),
        ("fs", _new_file("hmem-tests-SEP-tiny-llama@1@0@ab@bfloat16.data", link=True), "not a regular file", 0),
        ("fs", _new_file("hmem-tests-SEP-tiny-llama@1@0@cd@bfloat16.data", directory=True), "not a regular file", 0),
        ("local_disk", _cut_local_disk, "size fits no shape", ExitCode.PROBLEMS_FOUND),
    ],
    ids=["truncated", "lying-length", "dtype-code", "no-key", "foreign", "tmp", "symlink", "directory", "cut-short"],
)
def test_verify_reports_bad_input_and_changes_nothing(tmp_path, kind, damage, problem, code):
    directory = copy(tmp_path, kind)
    (tmp_path / "outside.data").write_bytes(b"\1" * 40)
    name = damage(directory)
    before = snapshot(directory)
    for depth in ([], ["--deep"]):
        doc = run_json("verify", directory, *depth, *shape_options(kind), code=code)
        found = [f for f in doc["findings"] if f["name"] == name]
        assert [f["problem"] for f in found] == [problem], doc["findings"]
        assert doc["ok"] == (code == ExitCode.OK)
    human = run("verify", directory, *shape_options(kind))
    assert human.exit_code == code
    assert problem in human.stdout and name in human.stdout
    assert ("error(s)" in human.stdout) == (code != ExitCode.OK)
    assert snapshot(directory) == before  # nothing deleted, nothing written
    assert (tmp_path / "outside.data").read_bytes() == b"\1" * 40


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads a file of mode 000")
def test_verify_reports_an_unreadable_file(tmp_path):
    directory = copy(tmp_path, "fs")
    path = directory / sorted(files("fs"))[0]
    path.chmod(0)
    try:
        doc = run_json("verify", directory, code=ExitCode.PROBLEMS_FOUND)
        assert [f["problem"] for f in doc["findings"] if f["name"] == path.name] == ["unreadable"]
    finally:
        path.chmod(0o644)


def test_verify_of_a_cache_refuses_the_repair_options(tmp_path):
    directory = copy(tmp_path, "fs")
    for options in (["--repair"], ["--full", "--subset", "1/2"]):
        result = run("verify", directory, *options)
        assert result.exit_code == ExitCode.USAGE and "LMCache cache" in result.stderr
    assert sorted(os.listdir(directory)) == sorted(files("fs"))
    assert run_json("verify", directory, "--full")["deep"]  # --full: the store's word for it


# ---- neither a store nor a cache ------------------------------------------------------------


@pytest.mark.parametrize("command", ["stats", "ls", "verify", "show"])
def test_a_directory_that_is_neither(tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for directory in (empty, other):
        args = [command, directory] + (["chunk.data"] if command == "show" else [])
        result = run(*args)
        assert result.exit_code == ExitCode.NOT_A_STORE, result.output
        assert "hmem store" in result.stderr and "LMCache cache" in result.stderr  # says it is neither
        doc = run_json(*args, code=ExitCode.NOT_A_STORE)
        assert doc["error"]["code"] == "not_a_store"
    assert os.listdir(empty) == [] and os.listdir(other) == ["notes.txt"]


def test_a_file_is_no_cache(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    result = run("stats", path)
    assert result.exit_code == ExitCode.BAD_PATH and "is a file" in result.stderr
    assert path.read_text() == "mine"


# ---- a multiprocess-mode cache; a layerwise cache missing a layer ---------------------------


def test_a_multiprocess_cache(tmp_path):
    directory = copy(tmp_path, "mp")
    mp = ORACLE["mp"]
    doc = run_json("stats", directory, "--chunk-size", CHUNK)
    assert doc["kinds"] == ["mp"] and doc["chunks"] == len(mp["files"]) and doc["kv_shape_from"] == "unknown"
    expected: dict[tuple[int, int, int], int] = {}
    for name in mp["files"]:
        obj = mp["objects"][name]
        label = (obj["object_group"], obj["kv_rank"] >> 24, (obj["kv_rank"] >> 16) & 0xFF)
        expected[label] = expected.get(label, 0) + 1
    assert {(g["group"], g["world_size"], g["rank"]): g["chunks"] for g in doc["groups"]} == expected
    assert sorted(c["name"] for c in run_json("ls", directory)["chunks"]) == sorted(mp["files"])
    shown = run_json("show", directory, mp["files"][0])["chunk"]
    assert (shown["kind"], shown["group"], shown["shape"]) == (
        "mp",
        mp["objects"][mp["files"][0]]["object_group"],
        None,
    )
    report = run_json("verify", directory, "--deep", "--chunk-size", CHUNK)
    assert report["ok"] and [f["problem"] for f in report["findings"]] == ["shape unknown"]
    human = run("stats", directory)
    assert human.exit_code == 0 and "group" in human.stdout


def test_stats_says_when_layers_hold_different_chunks(tmp_path):
    directory = copy(tmp_path, "layerwise")
    gone = sorted(n for n in files("layerwise") if n.endswith("@1.pt"))[0]  # one chunk's layer 1
    (directory / gone).unlink()
    result = run("stats", directory, "--chunk-size", CHUNK)
    assert result.exit_code == 0, result.output
    assert "layers hold different numbers of chunks" in result.stderr
    untagged = len([n for n in files("layerwise") if f"@{TAG}." not in n]) // LAYERS
    assert f"{untagged - 1}-{untagged}" in result.stdout


def test_verify_lists_errors_first_and_at_most_max_findings(tmp_path):
    directory = copy(tmp_path, "fs")
    (directory / "notes.txt").write_text("mine")  # a warning, named first in the library's order
    bad = _fs_damage("truncated")(directory)
    result = run("verify", directory, "--max-findings", 1, "--chunk-size", CHUNK)
    assert result.exit_code == ExitCode.PROBLEMS_FOUND
    assert bad in result.stdout and "notes.txt" not in result.stdout
    assert "and 1 more findings" in result.stdout and "1 error(s), 1 warning(s)" in result.stdout


def test_verify_hints_at_the_chunk_size(tmp_path):
    directory = copy(tmp_path, "fs")
    result = run("verify", directory)  # the default chunk size, 256: every chunk looks partial
    assert result.exit_code == 0
    assert f"--chunk-size {CHUNK}" in result.stdout
    assert f"--chunk-size {CHUNK}" not in run("verify", directory, "--chunk-size", CHUNK).stdout
