"""The safetensors container (hmem/formats/safetensors.py) and the store
directory's layout (hmem/formats/store_files.py), through their own functions:
headers round-trip and every malformation is refused with its reason; a
store directory's files are sorted into committed, orphan and foreign."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import hmem
from hmem import _io
from hmem.formats import safetensors, shard_file, store_files
from hmem.formats.manifest import Pending, ShardInfo
from hmem.transfer.kv_export import write_kv_file

# ---- safetensors ----------------------------------------------------------------------


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "keys": rng.standard_normal((3, 5)).astype(np.float32),
        "half": rng.standard_normal((2, 3)).astype(np.float16),
        "double": rng.standard_normal(4),
        "bytes": np.arange(-3, 4, dtype=np.int8),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "scalar": np.array(2.5, dtype=np.float32),
    }


def _file(arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    specs = [(name, safetensors.DTYPE_NAMES[a.dtype], a.shape, a.nbytes) for name, a in arrays.items()]
    return safetensors.encode(specs, metadata) + b"".join(a.tobytes() for a in arrays.values())


def test_encode_then_parse_gives_the_same_tensors_and_metadata():
    arrays = _arrays()
    data = _file(arrays, {"layer": "2", "note": "é"})
    (length,) = struct.unpack_from("<Q", data)
    assert length % safetensors.HEADER_ALIGN == 0
    header = safetensors.parse(data, contiguous=True)
    assert header.metadata == {"layer": "2", "note": "é"}
    assert header.data_start == 8 + length
    assert list(header.tensors) == list(arrays)
    for name, array in arrays.items():
        spec = header.tensors[name]
        assert spec.dtype == safetensors.DTYPE_NAMES[array.dtype] and spec.shape == array.shape
        raw = data[header.data_start + spec.begin : header.data_start + spec.end]
        np.testing.assert_array_equal(np.frombuffer(raw, dtype=array.dtype).reshape(array.shape), array)


def test_the_header_is_compact_json_with_the_metadata_first():
    text = safetensors.encode([("a", "F32", (2,), 8), ("b", "I8", (3,), 3)], {"format": "x"})[8:]
    assert text.rstrip(b" ") == (
        b'{"__metadata__":{"format":"x"},"a":{"dtype":"F32","shape":[2],'
        b'"data_offsets":[0,8]},"b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}}'
    )
    assert b"__metadata__" not in safetensors.encode([("a", "F32", (2,), 8)])


def test_a_written_file_is_read_by_the_safetensors_package(tmp_path):
    arrays = _arrays()
    path = tmp_path / "t.safetensors"
    size = write_kv_file(path, arrays, {"layer": "1"})
    assert size == path.stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(_io.TEMP_PREFIX)]
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"layer": "1"}
        assert set(f.keys()) == set(arrays)
        for name, array in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(name), array)
    entries, _ = hmem.read_kv_file(_kv_file(tmp_path))
    assert len(entries) == 1


def _kv_file(tmp_path: Path) -> Path:
    path = tmp_path / "kv.safetensors"
    write_kv_file(path, {"keys": np.ones((2, 4), np.float32), "values": np.zeros((2, 4), np.float32)})
    return path


def test_write_kv_file_refuses_what_safetensors_cannot_hold(tmp_path):
    with pytest.raises(hmem.InvalidArgumentError):
        write_kv_file(tmp_path / "a.safetensors", {"x": np.array(["text"])})
    with pytest.raises(hmem.InvalidArgumentError):
        write_kv_file(tmp_path / "b.safetensors", {"__metadata__": np.ones(2, np.float32)})
    with pytest.raises(hmem.InvalidArgumentError):
        write_kv_file(tmp_path / "c.safetensors", {"x": np.ones(2, np.float32)}, {"layer": 1})
    assert not list(tmp_path.iterdir())


def _raw(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _one(spec: dict, data: bytes = bytes(8)) -> bytes:
    return _raw({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **spec}}, data)


MALFORMED = {
    "too short": (b"\x01\x00", "short"),
    "header length past the end": (_raw({}, length=10**6), "length"),
    "header not JSON": (struct.pack("<Q", 3) + b"{x}", "json"),
    "header not an object": (_raw([1, 2]), "object"),
    "bool size": (_one({"shape": [True, 2]}), "entry"),
    "float offset": (_one({"data_offsets": [0.0, 8]}), "entry"),
    "negative size": (_one({"shape": [-2]}), "entry"),
    "size past 2**62": (_one({"shape": [2**62]}), "entry"),
    "three offsets": (_one({"data_offsets": [0, 4, 8]}), "entry"),
    "no dtype": (_raw({"t": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "entry"),
    "offset past the end": (_one({"data_offsets": [0, 16]}), "outside"),
    "size mismatch": (_one({"shape": [3]}), "size"),
    "unknown dtype": (_one({"dtype": "F33"}), "dtype"),
}
NOT_CONTIGUOUS = {
    "gap": (
        _raw(
            {
                "a": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]},
                "b": {"dtype": "I8", "shape": [2], "data_offsets": [4, 6]},
            },
            bytes(6),
        ),
        "gap",
    ),
    "overlap": (
        _raw(
            {
                "a": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "I8", "shape": [2], "data_offsets": [2, 4]},
            },
            bytes(4),
        ),
        "overlap",
    ),
    "bytes after the last tensor": (_one({}, bytes(12)), "tail"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_header_is_refused_with_its_reason(case):
    data, reason = MALFORMED[case]
    with pytest.raises(safetensors.SafetensorsError) as info:
        safetensors.parse(data)
    assert info.value.reason == reason and info.value.message


@pytest.mark.parametrize("case", list(NOT_CONTIGUOUS))
def test_tensors_must_lie_back_to_back_when_asked(case):
    data, reason = NOT_CONTIGUOUS[case]
    safetensors.parse(data)  # each tensor on its own is sound
    with pytest.raises(safetensors.SafetensorsError) as info:
        safetensors.parse(data, contiguous=True)
    assert info.value.reason == reason


def test_a_reader_may_restrict_dtypes_and_check_the_metadata():
    data = _file({"x": np.ones(2, np.float16)}, {"format": "other"})
    with pytest.raises(safetensors.SafetensorsError) as info:
        safetensors.parse(data, dtypes={"F32": 4})
    assert info.value.reason == "dtype" and info.value.tensor == "x"

    def check(metadata: object) -> None:
        raise safetensors.SafetensorsError(f"metadata {metadata}", reason="metadata")

    with pytest.raises(safetensors.SafetensorsError) as info:
        safetensors.parse(data, check_metadata=check)
    assert info.value.message == "metadata {'format': 'other'}"


def test_a_shard_reader_words_a_damaged_header_its_own_way():
    def shard(spec: dict, data: bytes = bytes(8), fmt: str = "hmem-shard") -> bytes:
        return _raw(
            {"__metadata__": {"format": fmt}, "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **spec}}, data
        )

    cases = {
        b"abc": "too short to be safetensors (3 bytes)",
        shard({}, fmt="other"): "it is not an hmem shard",
        shard({"dtype": "U16", "data_offsets": [0, 99]}): "tensor t has a malformed entry",  # no shard holds U16
        shard({"data_offsets": [0, 99]}): "tensor t lies outside the data",
        shard({"shape": [3]}): "tensor t's size does not match its shape",
    }
    for data, why in cases.items():
        with pytest.raises(hmem.CorruptStoreError) as info:
            shard_file.parse_header(data, "shard_0000.safetensors")
        assert info.value.message == f"shard shard_0000.safetensors has a damaged header: {why}"
        assert info.value.hint == hmem.Hint.VERIFY
    metadata, tensors, start = shard_file.parse_header(shard({}), "shard_0000.safetensors")
    assert metadata == {"format": "hmem-shard"} and tensors == {"t": (np.dtype("<f4"), (2,), start, start + 8)}


# ---- the store directory ---------------------------------------------------------------


def test_names_and_record_size():
    assert store_files.shard_file(3) == "shard_0003.safetensors"
    assert store_files.shard_index("shard_0003.safetensors") == 3
    assert store_files.shard_index("shard_3.safetensors") is None
    assert store_files.record_bytes(16) == 56
    fixed = ("index.json", "entries.bin", "lock", "commit.stamp", "sources.jsonl", "pooled.bin")
    assert store_files.FIXED_FILES == fixed


def _directory(root: Path) -> None:
    root.mkdir()
    for name in (
        "index.json",
        "entries.bin",
        "lock",
        "shard_0000.safetensors",
        "shard_0001.safetensors",
        "shard_0007.safetensors",
        _io.TEMP_PREFIX + "index.json.1.0",
        store_files.REWRITE_PREFIX + "shard_0000.safetensors",
        "notes.txt",
    ):
        (root / name).write_bytes(b"12345")
    (root / "lock").write_bytes(b'{"pid": 1}')
    (root / (_io.TEMP_PREFIX + "dir")).mkdir()
    os.symlink(root / "notes.txt", root / "shard_0009.safetensors")


def test_classify_sorts_a_store_directory(tmp_path):
    root = tmp_path / "s"
    _directory(root)
    shards = [ShardInfo(file=store_files.shard_file(i), bytes=5, uid="", entries=0, index_crc=0) for i in range(2)]
    pending = Pending(renames=[(store_files.REWRITE_PREFIX + "shard_0000.safetensors", "shard_0000.safetensors")])
    files = store_files.classify(root, shards, pending)
    assert files.committed == sorted(
        [
            "index.json",
            "entries.bin",
            "lock",
            "shard_0000.safetensors",
            "shard_0001.safetensors",
            store_files.REWRITE_PREFIX + "shard_0000.safetensors",
        ]
    )
    assert files.temporary == [_io.TEMP_PREFIX + "dir", _io.TEMP_PREFIX + "index.json.1.0"]
    assert files.unnamed_shards == ["shard_0007.safetensors", "shard_0009.safetensors"]
    assert files.others == ["notes.txt"]
    # orphans are regular files hmem made; a directory or a link is never one
    assert files.orphans == [_io.TEMP_PREFIX + "index.json.1.0", "shard_0007.safetensors"]
    assert files.foreign == [_io.TEMP_PREFIX + "dir", "notes.txt", "shard_0009.safetensors"]
    # without a commit, every shard and temporary file is an orphan
    bare = store_files.classify(root)
    assert bare.orphans == sorted(
        [
            _io.TEMP_PREFIX + "index.json.1.0",
            store_files.REWRITE_PREFIX + "shard_0000.safetensors",
            "shard_0000.safetensors",
            "shard_0001.safetensors",
            "shard_0007.safetensors",
        ]
    )
    assert store_files.shard_names(root) == [
        "shard_0000.safetensors",
        "shard_0001.safetensors",
        "shard_0007.safetensors",
        "shard_0009.safetensors",
    ]


def test_resolve_follows_a_pending_rename_until_it_is_done(tmp_path):
    root = tmp_path / "s"
    _directory(root)
    temp = store_files.REWRITE_PREFIX + "shard_0000.safetensors"
    pending = Pending(renames=[(temp, "shard_0000.safetensors")])
    assert store_files.resolve(root, "shard_0000.safetensors", pending) == root / temp
    assert store_files.resolve(root, "shard_0001.safetensors", pending) == root / "shard_0001.safetensors"
    (root / temp).unlink()
    assert store_files.resolve(root, "shard_0000.safetensors", pending) == root / "shard_0000.safetensors"


def test_directory_bytes_leaves_out_the_lock_owner_record_and_links(tmp_path):
    root = tmp_path / "s"
    _directory(root)
    regular = [p for p in root.iterdir() if p.is_file() and not p.is_symlink() and p.name != "lock"]
    assert store_files.directory_bytes(root) == 5 * len(regular) == 5 * 8


# ---- index.json ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    shards=st.lists(
        st.tuples(
            st.text(max_size=12),
            st.integers(0, 2**62),
            st.text(max_size=6),
            st.integers(0, 2**40),
            st.integers(0, 2**32 - 1),
            st.integers(0, 9),
            st.integers(0, 2**40),
        ),
        max_size=6,
    ),
    sources=st.booleans(),
)
def test_index_json_is_the_indented_json_of_its_document(shards, sources):
    # manifest.to_bytes writes the shard list itself (json's indenting
    # encoder is slow for thousands of shards): the text must be exactly
    # json.dumps(document, indent=1), whatever the names hold
    from hmem.config import StoreConfig
    from hmem.formats import manifest
    from hmem.formats.sources import SourcesInfo

    mf = manifest.Manifest(
        config=StoreConfig(embed_dim=8),
        projection={"family": "srht", "blocks": [1, 2]},
        shards=[ShardInfo(*fields) for fields in shards],
        pending=Pending(renames=[('a\n"b', "c")], deletes=["x"]),
        sources=SourcesInfo(bytes=10, crc32c=3) if sources else SourcesInfo(),
    )
    data = mf.to_bytes()
    document = json.loads(data)
    assert data == (json.dumps(document, indent=1) + "\n").encode()
    assert tuple(ShardInfo(**s) for s in document["shards"]) == mf.shards
    body = {key: value for key, value in document.items() if key != "checksum"}
    assert document["checksum"] == f"crc32c:{manifest._checksum(body):08x}"
    # the texts of the last commit's shards are kept for the next: a shard
    # replaced since (an eviction counts dead entries), one added and one
    # left out must each show in the next commit's text
    if mf.shards:
        with pytest.raises(dataclasses.FrozenInstanceError):
            mf.shards[-1].dead_entries += 1  # type: ignore[misc]
        last = mf.shards[-1]
        mf = dataclasses.replace(
            mf, shards=(*mf.shards[:-1], dataclasses.replace(last, dead_entries=last.dead_entries + 1))
        )
        again = json.loads(mf.to_bytes())
        assert again["shards"][-1]["dead_entries"] == document["shards"][-1]["dead_entries"] + 1
        assert again["shards"][:-1] == document["shards"][:-1]
        assert (
            again["checksum"] == f"crc32c:{manifest._checksum({k: v for k, v in again.items() if k != 'checksum'}):08x}"
        )
        mf = dataclasses.replace(mf, shards=(*mf.shards, ShardInfo("added", 1, "u", 2, 3)))
        assert tuple(ShardInfo(**s) for s in json.loads(mf.to_bytes())["shards"]) == mf.shards
        mf = dataclasses.replace(mf, shards=mf.shards[1:])
        data = mf.to_bytes()
        assert tuple(ShardInfo(**s) for s in json.loads(data)["shards"]) == mf.shards
        assert data == (json.dumps(json.loads(data), indent=1) + "\n").encode()
