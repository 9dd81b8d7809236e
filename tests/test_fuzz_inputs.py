"""Bad input of every kind (docs/reliability.md): malformed safetensors files for
`hmem put`, garbage query files for `hmem query`, absurd options.

A bad import file is skipped with a one-line reason, the good files of the
same run are stored (exit 3, partial), nothing prints a traceback, and the
store is left exactly as the good files alone would leave it: same records,
same K/V, its older files byte for byte, no other new file.  A bad query file
or option exits 2 with one line and changes nothing.

Known library bugs are kept as strict xfail cases ("BUG: ...") so that
fixing one makes its case pass and fail loudly until the mark is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from typer.testing import CliRunner

from hmem import Store
from hmem.cli.app import app

EMBED, HDC = 16, 256
BASE_ENV = {
    "COLUMNS": "200",
    "NO_COLOR": "1",
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "HMEM_STORE": None,
    "HMEM_DEBUG": None,
}
F32 = np.float32


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=BASE_ENV)


def assert_one_error_line(result, code: int = 2) -> str:
    """Exit `code`, nothing on stdout, exactly one line `error: ...` on stderr."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    assert result.stdout == ""
    return lines[0]


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def content(path: Path) -> dict:
    """Every live entry's metadata (no timestamp) and K/V, the evicted records
    counted, and the shards of a store.  Each row carries the best hit (id,
    similarity) for the entry's own keys in place of its signature, which
    the public API does not show."""
    with Store.open(path, read_only=True) as store:
        rows, kv = [], {}
        for info in store.entries():
            got = store.get(info.entry_id)
            (hit,) = store.query(got.keys, info.layer_idx, 1, rerank=False, count_access=False)
            rows.append(
                (
                    info.entry_id,
                    info.layer_idx,
                    info.n_tokens,
                    info.importance,
                    info.access_count,
                    info.shard_idx,
                    (hit.entry_id, hit.similarity),
                )
            )
            kv[info.entry_id] = (got.keys.tobytes(), got.values.tobytes())
        st = store.stats()
        shards = [(s.file, s.entries, s.dead_entries) for s in st.shards]
    return {"records": rows, "evicted": st.evicted, "kv": kv, "shards": shards}


# ---- the store and the good file every case starts from --------------------------------------


class Fixture:
    def __init__(self, root: Path) -> None:
        rng = np.random.default_rng(5)
        self.root = root
        self.copies = 0
        self.template = root / "template"
        with Store.create(self.template, embed_dim=EMBED, hdc_dim=HDC, shard_max_bytes=6000) as store:
            for i in range(3):
                store.put_many(
                    [
                        (
                            rng.standard_normal((2, EMBED)).astype(F32),
                            rng.standard_normal((2, EMBED)).astype(F32),
                            i % 2,
                            1.0 + i,
                        )
                        for _ in range(2)
                    ]
                )
                store.flush()
            store.evict(5)
        self.template_files = snapshot(self.template)
        self.template_content = content(self.template)
        # the good file: two numbered entries
        self.good_kv = [
            (rng.standard_normal((3, EMBED)).astype(F32), rng.standard_normal((3, EMBED)).astype(F32)) for _ in range(2)
        ]
        self.good = root / "zz_good.safetensors"
        save_file(
            {
                "k_0": self.good_kv[0][0],
                "v_0": self.good_kv[0][1],
                "k_1": self.good_kv[1][0],
                "v_1": self.good_kv[1][1],
            },
            self.good,
            metadata={"layer": "1"},
        )
        # what the good file alone does to the store
        alone = self.copy("good-alone")
        result = cli("put", alone, self.good, "--json")
        assert result.exit_code == 0, result.stderr
        self.after_good = content(alone)
        self.after_good_names = sorted(snapshot(alone))
        assert len(self.after_good["kv"]) == len(self.template_content["kv"]) + 2
        self.query = root / "q.npy"
        np.save(self.query, self.good_kv[0][0])

    def copy(self, name: str | None = None) -> Path:
        self.copies += 1
        path = self.root / (name or f"store-{self.copies}")
        shutil.copytree(self.template, path)
        return path

    def assert_only_the_good_file_went_in(self, path: Path) -> None:
        """The store holds what the good file alone gives, and the files it
        had before keep their bytes (entries.bin and pooled.bin only grew at
        their ends)."""
        assert content(path) == self.after_good
        now = snapshot(path)
        assert sorted(now) == self.after_good_names
        for name, data in self.template_files.items():
            if name in ("entries.bin", "pooled.bin"):
                assert now[name][: len(data)] == data
            elif name not in ("index.json", "lock", "commit.stamp"):  # rewritten by every commit
                assert now[name] == data, name


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Fixture:
    return Fixture(tmp_path_factory.mktemp("fuzz"))


def put_bad_and_good(fx: Fixture, bad: Path) -> tuple[str, Path]:
    """`hmem put STORE BAD GOOD --json` on a fresh copy: exit 3, only BAD
    skipped, the store as the good file alone leaves it.  Returns the reason."""
    path = fx.copy()
    result = cli("put", path, bad, fx.good, "--json")
    assert result.exit_code == 3, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.output + result.stderr
    assert result.stderr.startswith(f"error: skipped {bad}: ") and result.stderr.count("\n") == 1
    report = json.loads(result.stdout)
    assert report["files"] == 2 and report["files_skipped"] == 1 and report["entries_added"] == 2, report
    (skip,) = report["skipped"]
    assert skip["file"] == str(bad)
    reason = skip["reason"]
    assert reason and "\n" not in reason and "Traceback" not in reason
    fx.assert_only_the_good_file_went_in(path)
    shutil.rmtree(path)
    return reason


def put_bad_alone(fx: Fixture, bad: Path) -> str:
    """`hmem put STORE BAD` (people's output): exit 1 (every file skipped),
    the file and its reason on stderr, the store's files byte for byte as
    before."""
    path = fx.copy()
    result = cli("put", path, bad)
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.output + result.stderr
    assert "added 0 entries from 0 of 1 files" in result.stdout
    assert result.stderr.startswith(f"error: skipped {bad}: ") and result.stderr.count("\n") == 1
    assert snapshot(path) == fx.template_files
    shutil.rmtree(path)
    return result.stderr


# ---- malformed safetensors files -------------------------------------------------------------


def raw(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    header = header + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def st_file(header: dict, data: bytes) -> bytes:
    return raw(json.dumps(header).encode(), data)


K = np.arange(3 * EMBED, dtype=F32).reshape(3, EMBED) / 7
KB = K.tobytes()  # 192 bytes


def kv_header(kd="F32", ks=(3, EMBED), ko=(0, 192), vd="F32", vs=(3, EMBED), vo=(192, 384), **extra) -> dict:
    return {
        "keys": {"dtype": kd, "shape": list(ks), "data_offsets": list(ko)},
        "values": {"dtype": vd, "shape": list(vs), "data_offsets": list(vo)},
        **extra,
    }


def _bad(value, dtype="<f4"):
    arr = np.array(K, dtype=dtype)
    arr[1, 3] = value
    return arr.tobytes()


MALFORMED = {
    "empty file": (b"", "too short"),
    "seven bytes": (b"\x07" * 7, "too short"),
    "header length zero": (raw(b"", KB, length=0), "not valid JSON"),
    "header length past the end": (raw(b"{}", length=10**6), "runs past the end"),
    "header length 2**64-1": (struct.pack("<Q", 2**64 - 1) + b"{}", "runs past the end"),
    "header not JSON": (raw(b"{keys: F32}", KB), "not valid JSON"),
    "header not UTF-8": (raw(b'{"\xff\xfe": 1}', KB), "not valid JSON"),
    "header a JSON list": (raw(b"[1, 2, 3]"), "not a JSON object"),
    "header a JSON number": (raw(b"42"), "not a JSON object"),
    "header a JSON string": (raw(b'"keys"'), "not a JSON object"),
    "header JSON null": (raw(b"null"), "not a JSON object"),
    "header empty object": (raw(b"{}"), "no K/V pair"),
    "tensor entry not an object": (st_file({"keys": 5, "values": kv_header()["values"]}, KB * 2), "malformed"),
    "tensor without dtype": (
        st_file({"keys": {"shape": [3, EMBED], "data_offsets": [0, 192]}, "values": kv_header()["values"]}, KB * 2),
        "malformed",
    ),
    "tensor without offsets": (
        st_file({"keys": {"dtype": "F32", "shape": [3, EMBED]}, "values": kv_header()["values"]}, KB * 2),
        "malformed",
    ),
    "shape not a list": (
        st_file({**kv_header(), "keys": {"dtype": "F32", "shape": 48, "data_offsets": [0, 192]}}, KB * 2),
        "malformed",
    ),
    "three offsets": (
        st_file({**kv_header(), "keys": {"dtype": "F32", "shape": [3, EMBED], "data_offsets": [0, 96, 192]}}, KB * 2),
        "malformed",
    ),
    "offsets not numbers": (st_file(kv_header(ko=("a", "b")), KB * 2), "malformed"),
    "offsets past the data": (st_file(kv_header(vo=(192, 10_000)), KB * 2), "outside the file's data"),
    "negative offsets": (st_file(kv_header(ko=(-192, 0)), KB * 2), "malformed header entry"),
    "reversed offsets": (st_file(kv_header(ko=(192, 0)), KB * 2), "outside the file's data"),
    "negative shape": (st_file(kv_header(ks=(-3, EMBED)), KB * 2), "malformed header entry"),
    "truncated data": (st_file(kv_header(), KB * 2)[:-100], "outside the file's data"),
    "unknown dtype F33": (st_file(kv_header(kd="F33"), KB * 2), "unknown dtype F33"),
    "dtype float32 (numpy's name)": (st_file(kv_header(kd="float32"), KB * 2), "unknown dtype"),
    "empty dtype": (st_file(kv_header(kd=""), KB * 2), "unknown dtype"),
    "int dtype I32": (st_file(kv_header(kd="I32", vd="I32"), KB * 2), "is I32; K/V must be F32, F16, BF16 or F64"),
    "int dtype I8": (st_file(kv_header(kd="I8", ko=(0, 48), vo=(48, 240)), KB[:48] + KB), "is I8"),
    "bool dtype": (st_file(kv_header(kd="BOOL", ko=(0, 48), vo=(48, 240)), KB[:48] + KB), "is BOOL"),
    "size does not match the shape": (st_file(kv_header(ks=(4, EMBED)), KB * 2), "does not match shape [4, 16]"),
    "NaN in keys": (st_file(kv_header(), _bad(np.nan) + KB), "NaN or infinite"),
    "Inf in values": (st_file(kv_header(), KB + _bad(np.inf)), "NaN or infinite"),
    "-Inf in F16 keys": (
        st_file(kv_header(kd="F16", ko=(0, 96), vo=(96, 288)), _bad(-np.inf, "<f2") + KB),
        "NaN or infinite",
    ),
    "F64 too large for F32": (
        st_file(kv_header(kd="F64", ko=(0, 384), vo=(384, 576)), _bad(1e300, "<f8") + KB),
        "NaN or infinite",
    ),
    "rows of the wrong width": (st_file(kv_header(ks=(4, 12), vs=(4, 12)), KB * 2), "embed_dim is 16"),
    "K and V of different shapes": (
        st_file(kv_header(vs=(2, EMBED), vo=(192, 320)), (KB * 2)[:320]),
        "differ in shape",
    ),
    "no tokens": (st_file(kv_header(ks=(0, EMBED), ko=(0, 0), vs=(0, EMBED), vo=(0, 0)), b""), "no tokens"),
    "one-dimensional keys": (st_file(kv_header(ks=(48,), vs=(48,)), KB * 2), "must have shape"),
    "no K/V pair": (st_file({"foo": kv_header()["keys"], "bar": kv_header()["values"]}, KB * 2), "no K/V pair"),
    "keys without values": (st_file({"keys": kv_header()["keys"]}, KB), "has no values partner"),
    "numbered keys without values": (
        st_file({"k_3": kv_header()["keys"], "v_4": kv_header()["values"]}, KB * 2),
        "partner",
    ),
    "importance not a number": (st_file(kv_header(__metadata__={"importance": "high"}), KB * 2), "not a number"),
    "negative importance": (st_file(kv_header(__metadata__={"importance": "-1"}), KB * 2), "importance"),
    "layer not a number": (st_file(kv_header(__metadata__={"layer": "1e400"}), KB * 2), "not a number"),
    "layer past u32": (st_file(kv_header(__metadata__={"layer": "4294967296"}), KB * 2), "layer"),
    "layer in the name past u32": (
        st_file({"layer.4294967296.k": kv_header()["keys"], "layer.4294967296.v": kv_header()["values"]}, KB * 2),
        "layer",
    ),
}

# Inputs that make hmem fail instead of skipping the file (see each reason).
MALFORMED_BUGS = {
    "overlapping offsets": (
        st_file(kv_header(vo=(0, 192)), KB),
        "BUG: hmem/kvfiles.py _File accepts tensors whose data_offsets overlap (here keys and values share "
        "the same 192 bytes, so V is stored as a copy of K); the safetensors format forbids overlaps and "
        "safetensors.safe_open refuses the file ('invalid offset'); expected the file skipped, got 1 entry "
        "imported (exit 0)",
    ),
    "shape whose size wraps int64": (
        st_file(kv_header(ks=(2**62, 4), ko=(0, 0), vs=(2**62, 4), vo=(0, 0)), b""),
        "BUG: hmem/kvfiles.py checks the byte size with np.prod(shape, dtype=int64), which wraps to 0 for "
        "shape [2**62, 4] and offsets [0, 0]; the reshape then raises ValueError and `hmem put` ends with "
        "'internal error: ValueError: cannot reshape array of size 0' (exit 1) instead of skipping the file",
    ),
    "shape past int64": (
        st_file(kv_header(ks=(10**30, EMBED)), KB * 2),
        "BUG: hmem/kvfiles.py np.prod(shape, dtype=int64) raises OverflowError for a dimension of 10**30; "
        "`hmem put` ends with 'internal error: OverflowError' (exit 1) instead of skipping the file",
    ),
    "Infinity in the shape": (
        raw(
            b'{"keys":{"dtype":"F32","shape":[Infinity,16],"data_offsets":[0,192]},'
            b'"values":{"dtype":"F32","shape":[3,16],"data_offsets":[192,384]}}',
            KB * 2,
        ),
        "BUG: json.loads accepts Infinity, and int(float('inf')) in hmem/kvfiles.py raises OverflowError, "
        "which is not caught: 'internal error: OverflowError' (exit 1) instead of a skip "
        "(NaN gives the right 'malformed header entry' skip)",
    ),
    "deeply nested header": (
        raw(b"[" * 100_000 + b"]" * 100_000),
        "BUG: json.loads raises RecursionError on a header nested 100000 deep; hmem/kvfiles.py catches only "
        "ValueError/UnicodeDecodeError, so `hmem put` ends with 'internal error: RecursionError' (exit 1)",
    ),
    "5000-digit entry number": (
        st_file({"k_" + "9" * 5000: kv_header()["keys"], "v_" + "9" * 5000: kv_header()["values"]}, KB * 2),
        "BUG: int() of a tensor name's 5000-digit number passes Python's int_max_str_digits limit and raises "
        "ValueError in hmem/kvfiles.py read_entries: 'internal error: ValueError: Exceeds the limit (4300 "
        "digits)' (exit 1) instead of a skip",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_is_skipped_with_its_reason_and_changes_nothing(fx, case, tmp_path):
    data, fragment = MALFORMED[case]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    reason = put_bad_and_good(fx, bad)
    assert fragment in reason, reason
    put_bad_alone(fx, bad)


@pytest.mark.parametrize("case", list(MALFORMED_BUGS))
def test_a_malformed_file_hmem_fails_on_is_skipped(fx, case, tmp_path):
    data, _ = MALFORMED_BUGS[case]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    put_bad_and_good(fx, bad)


def test_unreadable_paths_are_skipped(fx, tmp_path):
    missing = tmp_path / "missing.safetensors"
    assert "no such file" in put_bad_and_good(fx, missing)
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    assert "cannot read it" in put_bad_and_good(fx, loop)
    put_bad_alone(fx, loop)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_without_read_permission_is_skipped(fx, tmp_path):
    locked = tmp_path / "locked.safetensors"
    shutil.copy(fx.good, locked)
    locked.chmod(0)
    assert "permission denied" in put_bad_and_good(fx, locked)
    put_bad_alone(fx, locked)


def test_a_directory_named_like_a_file_is_searched_not_imported(fx, tmp_path):
    """docs/cli.md: directories are searched for *.safetensors; a directory
    named x.safetensors holds none, so it adds nothing (and is not reported)."""
    folder = tmp_path / "x.safetensors"
    (folder / "inner").mkdir(parents=True)
    path = fx.copy()
    result = cli("put", path, folder, fx.good, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["files"] == 1
    fx.assert_only_the_good_file_went_in(path)
    # inside a searched directory it is not taken for a file either
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "y.safetensors").mkdir()
    shutil.copy(fx.good, tmp_path / "in" / "good.safetensors")
    path = fx.copy()
    result = cli("put", path, tmp_path / "in", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["files"] == 1, result.stdout
    # alone: nothing to import is a usage error that changes nothing
    path = fx.copy()
    assert "no .safetensors files found" in assert_one_error_line(cli("put", path, folder))
    assert snapshot(path) == fx.template_files


def test_a_named_pipe_is_skipped_not_waited_for(fx, tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    path = fx.copy()
    env = {k: v for k, v in os.environ.items() if k not in ("HMEM_STORE", "HMEM_DEBUG", "HMEM_CRASH_AT")}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "hmem", "put", str(path), str(fifo), str(fx.good), "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,  # a hang guard: a put that waited on the pipe would wait for ever
        )
    except subprocess.TimeoutExpired:
        pytest.fail("hmem put waited for a writer on a named pipe")
    assert done.returncode == 3, done.stderr
    fx.assert_only_the_good_file_went_in(path)


def test_a_bad_file_in_a_real_process_prints_no_traceback(fx, tmp_path):
    """The same checks through `python -m hmem` in a process of its own."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(MALFORMED["header not JSON"][0])
    path = fx.copy()
    env = {k: v for k, v in os.environ.items() if k not in ("HMEM_STORE", "HMEM_DEBUG", "HMEM_CRASH_AT")}
    done = subprocess.run(
        [sys.executable, "-m", "hmem", "put", str(path), str(bad), str(fx.good)],
        cwd=tmp_path,
        env={**env, "NO_COLOR": "1", "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr == f"error: skipped {bad}: the header is not valid JSON\n"
    fx.assert_only_the_good_file_went_in(path)


# ---- Hypothesis: random bytes, random mutations of a valid file ------------------------------

# HMEM_FUZZ_EXAMPLES sets the examples per Hypothesis test; the long run (HMEM_STRESS_ROUNDS set) tries 600
_EXAMPLES = int(os.environ.get("HMEM_FUZZ_EXAMPLES", 600 if "HMEM_STRESS_ROUNDS" in os.environ else 60))
FUZZ = settings(
    max_examples=_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=600),
        st.binary(max_size=400).map(lambda body: struct.pack("<Q", len(body)) + body),  # a consistent length word
        st.binary(max_size=400).map(lambda body: struct.pack("<Q", len(body)) + b"{" + body),
    )
)
@pytest.mark.stress
def test_random_bytes_are_skipped(fx, tmp_path, data):
    bad = tmp_path / "random.safetensors"
    bad.write_bytes(data)
    put_bad_and_good(fx, bad)


def _valid_file() -> bytes:
    """A file of one entry (keys/values) with layer and importance metadata."""
    rng = np.random.default_rng(11)
    header = {
        "__metadata__": {"layer": "2", "importance": "3"},
        "keys": {"dtype": "F32", "shape": [2, EMBED], "data_offsets": [0, 128]},
        "values": {"dtype": "F32", "shape": [2, EMBED], "data_offsets": [128, 256]},
    }
    return st_file(header, rng.standard_normal((4, EMBED)).astype(F32).tobytes())


VALID = _valid_file()
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8")}


def _mutations():
    n = len(VALID)
    flip = st.tuples(st.just("set"), st.integers(0, n - 1), st.integers(0, 255))
    insert = st.tuples(st.just("insert"), st.integers(0, n), st.binary(min_size=1, max_size=8))
    delete = st.tuples(st.just("delete"), st.integers(0, n - 1), st.integers(1, 16))
    header_text = st.tuples(
        st.just("set"),
        st.integers(8, 8 + int.from_bytes(VALID[:8], "little") - 1),
        st.sampled_from(b'0123456789-.,:[]{}"eE FIkv_'),
    )
    return st.lists(st.one_of(flip, insert, delete, header_text, header_text), min_size=1, max_size=5)


def _apply(data: bytes, steps) -> bytes:
    out = bytearray(data)
    for kind, pos, arg in steps:
        pos = min(pos, len(out))
        if kind == "set" and pos < len(out):
            out[pos] = arg
        elif kind == "insert":
            out[pos:pos] = arg
        elif kind == "delete":
            del out[pos : pos + arg]
    return bytes(out)


def _as_hmem_reads(data: bytes):
    """What an import of this file must store, read independently: the
    (keys, values, layer, importance) of its one-entry form, as float32;
    None when the mutation made another naming form."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    meta = header.pop("__metadata__", None)
    meta = meta if isinstance(meta, dict) else {}
    if not ({"keys", "values"} <= set(header) or {"k", "v"} <= set(header)):
        return None
    body = data[8 + length :]

    def tensor(name):
        spec = header[name]
        begin, end = spec["data_offsets"]
        dtype = spec["dtype"]
        if dtype == "BF16":
            raw16 = np.frombuffer(body[begin:end], dtype="<u2")
            return (raw16.astype(np.uint32) << 16).view(F32).reshape(spec["shape"])
        return np.frombuffer(body[begin:end], dtype=_DTYPES[dtype]).reshape(spec["shape"]).astype(F32)

    names = ("keys", "values") if "keys" in header else ("k", "v")
    return tensor(names[0]), tensor(names[1]), int(meta.get("layer", 0)), float(meta.get("importance", 1))


@FUZZ
@given(steps=_mutations())
@pytest.mark.stress
def test_random_mutations_of_a_valid_file_are_skipped_or_stored_exactly(fx, tmp_path, steps):
    data = _apply(VALID, steps)
    bad = tmp_path / "mutated.safetensors"
    bad.write_bytes(data)
    path = fx.copy()
    result = cli("put", path, bad, fx.good, "--json")
    assert "Traceback" not in result.output + result.stderr
    assert result.exit_code in (0, 3), (result.exit_code, result.stdout, result.stderr)
    # a skip is one line on stderr, nothing else is
    assert result.stderr == ("" if result.exit_code == 0 else result.stderr.splitlines()[0] + "\n"), result.stderr
    report = json.loads(result.stdout)
    if result.exit_code == 3:
        (skip,) = report["skipped"]
        assert skip["file"] == str(bad) and skip["reason"] and "\n" not in skip["reason"]
        fx.assert_only_the_good_file_went_in(path)
    else:
        # the mutation left a valid file: what was stored is what the file says
        assert report["skipped"] == [] and report["entries_added"] >= 3, report
        expected = _as_hmem_reads(data)
        if expected is None or report["entries_added"] != 3:
            return
        keys, values, layer, importance = expected
        stored = content(path)
        first_new = max(stored["kv"]) - 2
        (row,) = [r for r in stored["records"] if r[0] == first_new]
        assert stored["kv"][first_new] == (keys.tobytes(), values.tobytes())
        assert row[1:4] == (layer, len(keys), float(F32(importance)))
    shutil.rmtree(path)


# ---- garbage query files ------------------------------------------------------------------------


def _npy(array) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def _npy_header(text: str, body: bytes = b"\0" * 64) -> bytes:
    text = text + " " * (-(len(text) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode() + body


GARBAGE_QUERIES = {
    "random bytes": ("q.npy", np.random.default_rng(3).bytes(300), "not a readable .npy file"),
    "truncated": ("q.npy", _npy(np.ones((4, EMBED), F32))[:100], "not a readable .npy file"),
    "header that is not a dict": ("q.npy", _npy_header("[1, 2, 3]"), "not a readable .npy file"),
    "shape computed in the header": (
        "q.npy",
        _npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (10**5, 16), }"),
        "not a readable .npy file",
    ),
    "object array": ("q.npy", _npy(np.array([1, None], dtype=object)), "not a readable .npy file"),
    "three dimensions": ("q.npy", _npy(np.ones((2, 2, EMBED), F32)), "must have shape"),
    "a scalar": ("q.npy", _npy(np.float32(3)), "must have shape"),
    "rows of the wrong width": ("q.npy", _npy(np.ones((2, EMBED + 1), F32)), "embed_dim is 16"),
    "no tokens": ("q.npy", _npy(np.zeros((0, EMBED), F32)), "no tokens"),
    "int dtype": ("q.npy", _npy(np.ones((2, EMBED), np.int32)), "must hold floats"),
    "bool dtype": ("q.npy", _npy(np.ones((2, EMBED), bool)), "must hold floats"),
    "complex dtype": ("q.npy", _npy(np.ones((2, EMBED), np.complex64)), "must hold floats"),
    "NaN": ("q.npy", _npy(np.full((2, EMBED), np.nan, F32)), "NaN or infinite"),
    "Inf in float64": ("q.npy", _npy(np.full((1, EMBED), 1e300)), "NaN or infinite"),
    "safetensors garbage": ("q.safetensors", b"\x08" + b"\0" * 7 + b"not json", "not valid JSON"),
    "empty safetensors": ("q.safetensors", b"", "too short"),
    "safetensors without a query tensor": (
        "q.safetensors",
        st_file({"a": kv_header()["keys"], "b": kv_header()["values"]}, KB * 2),
        "more than one tensor",
    ),
    "safetensors int query": (
        "q.safetensors",
        st_file({"query": {"dtype": "I32", "shape": [3, EMBED], "data_offsets": [0, 192]}}, KB),
        "is I32",
    ),
}


@pytest.mark.parametrize("case", list(GARBAGE_QUERIES))
def test_a_garbage_query_file_is_a_usage_error(fx, case, tmp_path):
    name, data, fragment = GARBAGE_QUERIES[case]
    query = tmp_path / name
    query.write_bytes(data)
    for extra in ([], ["--count-access"], ["--export", str(tmp_path / "out.safetensors")]):
        path = fx.copy()
        line = assert_one_error_line(cli("query", path, "--query", query, "--layer", "1", *extra))
        assert fragment in line, line
        assert snapshot(path) == fx.template_files
        assert not (tmp_path / "out.safetensors").exists()
        shutil.rmtree(path)


def test_query_paths_that_are_not_files_are_usage_errors(fx, tmp_path):
    (tmp_path / "dir.npy").mkdir()
    for query in (tmp_path / "missing.npy", tmp_path / "dir.npy", tmp_path / "missing.safetensors"):
        line = assert_one_error_line(cli("query", fx.template, "--query", query, "--layer", "0"))
        assert str(query.name) in line
    assert snapshot(fx.template) == fx.template_files


def test_an_empty_query_file_is_a_usage_error(fx, tmp_path):
    query = tmp_path / "empty.npy"
    query.write_bytes(b"")
    line = assert_one_error_line(cli("query", fx.template, "--query", query, "--layer", "0"))
    assert "empty.npy" in line


def test_a_query_file_that_looks_like_a_zip_is_a_usage_error(fx, tmp_path):
    query = tmp_path / "z.npy"
    query.write_bytes(b"PK\x03\x04" + b"garbage" * 10)
    assert_one_error_line(cli("query", fx.template, "--query", query, "--layer", "0"))


def test_a_query_file_claiming_a_huge_shape_is_a_usage_error(fx, tmp_path):
    query = tmp_path / "huge.npy"
    query.write_bytes(_npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 16), }"))
    assert_one_error_line(cli("query", fx.template, "--query", query, "--layer", "0"))


@FUZZ
@given(
    data=st.one_of(
        st.binary(min_size=1, max_size=300),  # an empty file: the xfail case above
        st.binary(max_size=200).map(lambda b: b"\x93NUMPY\x01\x00" + b),
    )
)
@pytest.mark.stress
def test_random_query_bytes_are_usage_errors(fx, tmp_path, data):
    query = tmp_path / "random.npy"
    query.write_bytes(data)
    assert_one_error_line(cli("query", fx.template, "--query", query, "--layer", "0"))


# ---- absurd options -------------------------------------------------------------------------------

HUGE = "9" * 400
ABSURD = {
    "init --embed-dim 0": ["init", "{new}", "--embed-dim", "0"],
    "init --embed-dim -3": ["init", "{new}", "--embed-dim", "-3"],
    "init --embed-dim 10**23": ["init", "{new}", "--embed-dim", "99999999999999999999999"],
    "init --embed-dim 1.5": ["init", "{new}", "--embed-dim", "1.5"],
    "init --hdc-dim 100": ["init", "{new}", "-d", "16", "--hdc-dim", "100"],
    "init --hdc-dim 0": ["init", "{new}", "-d", "16", "--hdc-dim", "0"],
    "init --seed -1": ["init", "{new}", "-d", "16", "--seed", "-1"],
    "init --max-entries -1": ["init", "{new}", "-d", "16", "--max-entries", "-1"],
    "init --max-disk 1e999X": ["init", "{new}", "-d", "16", "--max-disk", "1e999X"],
    "init --max-disk 1e999": ["init", "{new}", "-d", "16", "--max-disk", "1e999"],
    "init --max-disk -5G": ["init", "{new}", "-d", "16", "--max-disk", "-5G"],
    "init --max-disk inf": ["init", "{new}", "-d", "16", "--max-disk", "inf"],
    "init --max-disk 2**64": ["init", "{new}", "-d", "16", "--max-disk", "18446744073709551616"],
    "init --max-disk 10**20 TB": ["init", "{new}", "-d", "16", "--max-disk", "99999999999999999999T"],
    "init --shard-max 0": ["init", "{new}", "-d", "16", "--shard-max", "0"],
    "init --shard-max nan": ["init", "{new}", "-d", "16", "--shard-max", "nan"],
    "init --max-open-shards 0": ["init", "{new}", "-d", "16", "--max-open-shards", "0"],
    "query --top-k 0": ["query", "{store}", "--query", "{query}", "--layer", "0", "--top-k", "0"],
    "query --top-k -1": ["query", "{store}", "--query", "{query}", "--layer", "0", "--top-k", "-1"],
    "query --layer -1": ["query", "{store}", "--query", "{query}", "--layer", "-1"],
    "query --layer 2**32": ["query", "{store}", "--query", "{query}", "--layer", "4294967296"],
    "query --layer 10**20": ["query", "{store}", "--query", "{query}", "--layer", "99999999999999999999"],
    "query --lock-wait -1": [
        "query",
        "{store}",
        "--query",
        "{query}",
        "--layer",
        "0",
        "--count-access",
        "--lock-wait",
        "-1",
    ],
    "query --lock-wait nan": ["query", "{store}", "--query", "{query}", "--layer", "0", "--lock-wait", "nan"],
    "put --layer -1": ["put", "{store}", "{good}", "--layer", "-1"],
    "put --layer 2**32": ["put", "{store}", "{good}", "--layer", "4294967296"],
    "put --importance -1": ["put", "{store}", "{good}", "--importance", "-1"],
    "put --importance nan": ["put", "{store}", "{good}", "--importance", "nan"],
    "put --importance inf": ["put", "{store}", "{good}", "--importance", "inf"],
    "put --lock-wait -1": ["put", "{store}", "{good}", "--lock-wait", "-1"],
    "put --lock-wait nan": ["put", "{store}", "{good}", "--lock-wait", "nan"],
    "put with no files": ["put", "{store}"],
    "evict --target -5": ["evict", "{store}", "--target", "-5", "--yes"],
    "evict --keep 1.5": ["evict", "{store}", "--keep", "1.5", "--yes"],
    "evict --keep -0.1": ["evict", "{store}", "--keep", "-0.1", "--yes"],
    "evict --keep nan": ["evict", "{store}", "--keep", "nan", "--yes"],
    "evict with both goals": ["evict", "{store}", "--target", "1", "--keep", "0.5", "--yes"],
    "evict with no goal": ["evict", "{store}", "--yes"],
    "compact --threshold 1e9": ["compact", "{store}", "--threshold", "1e9"],
    "compact --threshold -1": ["compact", "{store}", "--threshold", "-1"],
    "compact --threshold nan": ["compact", "{store}", "--threshold", "nan"],
    "compact --lock-wait -1": ["compact", "{store}", "--lock-wait", "-1"],
    "compact --lock-wait nan": ["compact", "{store}", "--lock-wait", "nan"],
    "compact --dry-run --threshold nan": ["compact", "{store}", "--dry-run", "--threshold", "nan"],
    "verify --max-seconds nan": ["verify", "{store}", "--full", "--max-seconds", "nan"],
    "verify --subset 0/0": ["verify", "{store}", "--full", "--subset", "0/0"],
    "verify --subset 1/0": ["verify", "{store}", "--full", "--subset", "1/0"],
    "verify --subset 3/2": ["verify", "{store}", "--full", "--subset", "3/2"],
    "verify --subset -1/2": ["verify", "{store}", "--full", "--subset", "-1/2"],
    "verify --subset a/b": ["verify", "{store}", "--full", "--subset", "a/b"],
    "verify --subset 1/2/3": ["verify", "{store}", "--full", "--subset", "1/2/3"],
    "verify --max-seconds -1": ["verify", "{store}", "--full", "--max-seconds", "-1"],
    "verify --max-findings 0": ["verify", "{store}", "--max-findings", "0"],
    "stats with an unknown option": ["stats", "{store}", "--bogus"],
}

ABSURD_BUGS = {
    "init --max-disk with 400 digits": (
        ["init", "{new}", "-d", "16", "--max-disk", HUGE],
        "BUG: hmem/cli/units.py parse_size does int(float(text) * unit); float('9' * 400) is inf and int(inf) "
        "raises OverflowError: `hmem init s -d 16 --max-disk 999...9` (400 digits) ends with 'internal error: "
        "OverflowError: cannot convert float infinity to integer' (exit 1) instead of exit 2 "
        "(max_disk_bytes must be between 0 and 2**64-1)",
    ),
    "put --importance 1e39": (
        ["put", "{store}", "{good}", "--importance", "1e39"],
        "BUG: `hmem put --importance 1e39` is accepted as an option (finite, >= 0) but every entry is then "
        "refused as above the float32 range, so each file is 'skipped' with the misleading reason 'importance "
        "must be finite and >= 0, got 1e+39' and the run exits 3 (partial) instead of 2 (usage: a bad option)",
    ),
}


def _absurd(fx: Fixture, argv: list[str], tmp_path: Path):
    path = fx.copy()
    new = tmp_path / "new-store"
    args = [a.format(store=path, new=new, query=fx.query, good=fx.good) for a in argv]
    result = cli(*args)
    return result, path, new


@pytest.mark.parametrize("case", list(ABSURD))
def test_absurd_options_are_usage_errors_that_change_nothing(fx, case, tmp_path):
    result, path, new = _absurd(fx, ABSURD[case], tmp_path)
    assert_one_error_line(result, 2)
    assert snapshot(path) == fx.template_files
    assert not new.exists()  # init made nothing, not even the directory


@pytest.mark.parametrize("case", list(ABSURD_BUGS))
def test_absurd_options_hmem_mishandles_are_usage_errors(fx, case, tmp_path):
    result, path, new = _absurd(fx, ABSURD_BUGS[case][0], tmp_path)
    assert_one_error_line(result, 2)
    assert snapshot(path) == fx.template_files
    assert not new.exists()


def test_a_huge_top_k_returns_every_entry_of_the_layer_and_changes_nothing(fx):
    """--top-k has no upper bound (docs/cli.md: N >= 1): 10**20 means "all"."""
    with Store.open(fx.template, read_only=True) as store:
        layer_entries = store.stats().layers.get(1, 0)
    assert layer_entries >= 1
    for k in ("99999999999999999999", str(2**63 - 1), "1000000000"):
        result = cli("query", fx.template, "--query", fx.query, "--layer", "1", "--top-k", k, "--json")
        assert result.exit_code == 0, result.stderr
        assert len(json.loads(result.stdout)["results"]) == layer_entries
    assert snapshot(fx.template) == fx.template_files
