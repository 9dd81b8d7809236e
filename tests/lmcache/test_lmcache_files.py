"""hmem reads LMCache 0.5.6's cache files as LMCache wrote them, without
LMCache: LMCache itself, run on the CPU in its own environment
(HMEM_LMCACHE_PYTHON, tests/lmcache/lmcache_writer.py), writes a
local_disk and an fs connector cache, and its own chunk hashes, keys and
the K/V each chunk holds are the oracle."""

from __future__ import annotations

import hashlib
import math
import os
import struct
from pathlib import Path

import pytest

from hmem.errors import CorruptStoreError
from hmem.formats import lmcache


@pytest.fixture(params=["local_disk", "fs", "layerwise"])
def cache(request, written) -> tuple[str, Path, dict, dict]:
    out, oracle = written
    return request.param, out / request.param, oracle["caches"][request.param], oracle


def test_every_file_names_a_key_lmcache_made(cache):
    kind, directory, made, oracle = cache
    keys = {key for req in made["requests"] for key in req["keys"]}
    assert sorted(os.listdir(directory)) == sorted(made["files"])  # nothing more, nothing less
    found = {name: lmcache.key_of_file(name) for name in os.listdir(directory)}
    assert None not in found.values()
    if kind == "fs":  # the name gives the key whole
        assert {key.text for key in found.values() if key is not None} == keys
    else:  # each "/" of the model name is a "-" for good
        assert {key.text for key in found.values() if key is not None} == {k.replace("/", "-") for k in keys}
    layers = set(range(oracle["layers"])) if kind == "layerwise" else {None}
    for key in found.values():
        assert key is not None
        assert (key.world_size, key.worker_id, key.kv_dtype) == (1, 0, "bfloat16")
        assert key.layer in layers
    assert {key.layer for key in found.values() if key is not None} == layers
    assert any(key is not None and key.chunk_hash < 0 for key in found.values())  # a negative hash, as printed
    tagged = {key.tags for key in found.values() if key is not None and key.tags}
    assert tagged == {(("user", "alice"),)}


def test_chunk_hashes_are_lmcaches(written):
    _, oracle = written
    for req in oracle["caches"]["fs"]["requests"]:
        assert lmcache.chunk_hashes(req["tokens"], oracle["chunk_size"]) == req["chunk_hashes"], req["name"]
        # a request's keys are its chunk hashes, in order, and LMCache's lookup finds every full chunk
        assert [lmcache.ChunkKey.parse(k).chunk_hash for k in req["keys"]] == req["chunk_hashes"]
        assert req["lookup"] == len(req["chunk_hashes"]) * oracle["chunk_size"]


def test_a_layerwise_chunk_is_a_key_per_layer(written):
    _, oracle = written
    for req in oracle["caches"]["layerwise"]["requests"]:
        keys = [lmcache.ChunkKey.parse(k) for k in req["keys"]]
        expected = [(h, layer) for h in req["chunk_hashes"] for layer in range(oracle["layers"])]
        assert [(k.chunk_hash, k.layer) for k in keys if k is not None] == expected, req["name"]


def test_a_prompt_shorter_than_a_chunk_stores_nothing(written):
    _, oracle = written
    [short] = [r for r in oracle["caches"]["fs"]["requests"] if r["name"] == "short"]
    assert len(short["tokens"]) < oracle["chunk_size"]
    assert lmcache.chunk_hashes(short["tokens"], oracle["chunk_size"]) == [] == short["keys"]


def test_each_chunk_holds_its_kv(cache):
    kind, directory, made, oracle = cache
    if kind == "layerwise":  # one layer: [tokens, 2, hidden]
        shape: tuple[int, ...] = (oracle["chunk_size"], 2, oracle["hidden"])
    else:  # the whole chunk: [2, layers, tokens, hidden]
        shape = (2, oracle["layers"], oracle["chunk_size"], oracle["hidden"])
    data_bytes = 2 * math.prod(shape)  # bf16
    for name, expected in made["files"].items():
        raw = (directory / name).read_bytes()
        if kind == "fs":
            header = lmcache.read_fs_header(raw[:64], len(raw), name)
            assert header == lmcache.FsHeader(data_bytes, "KV_2LTD", (("bfloat16", shape),))
            raw = raw[header.header_bytes :]
        assert len(raw) == data_bytes and tuple(expected["shape"]) == shape
        assert hashlib.sha256(raw).hexdigest() == expected["sha256"], name


def test_keys_print_as_lmcache_prints_them(written):
    _, oracle = written
    for req in oracle["caches"]["fs"]["requests"]:
        for text in req["keys"]:
            key = lmcache.ChunkKey.parse(text)
            assert key is not None and key.text == text
            assert key.fs_name() in oracle["caches"]["fs"]["files"]
            assert key.local_disk_name() in oracle["caches"]["local_disk"]["files"]
    for req in oracle["caches"]["layerwise"]["requests"]:
        for text in req["keys"]:
            key = lmcache.ChunkKey.parse(text)
            assert key is not None and key.text == text and key.layer is not None
            assert key.local_disk_name() in oracle["caches"]["layerwise"]["files"]


@pytest.mark.parametrize(
    "name",
    [
        "notes.txt",
        "model@1@0@ff@bfloat16.tmp",  # an fs write never renamed: debris, not a chunk
        "model@1@0@ff.data",  # no dtype
        "model@x@0@ff@bfloat16.data",
        "model@1@0@FF@bfloat16.data",  # LMCache prints lower case
        "model@1@0@0xff@bfloat16.data",
        "model@1@0@f_f@bfloat16.data",
        "model@1@0@ff@float7.data",
        "model@1@0@ff@bfloat16@user.data",  # a tag without its value
        "@1@0@ff@bfloat16.pt",
    ],
)
def test_names_that_are_no_chunk(name):
    assert lmcache.key_of_file(name) is None


def test_a_layer_key_and_tags():
    key = lmcache.ChunkKey.parse("org/m@2@1@-1f@half@17@user%bob@ttl%3")
    assert key == lmcache.ChunkKey("org/m", 2, 1, -0x1F, "half", 17, (("user", "bob"), ("ttl", "3")))
    assert key.fs_name() == "org-SEP-m@2@1@-1f@half@17@user%bob@ttl%3.data"


def test_damaged_fs_files_are_refused(written):
    out, oracle = written
    name = sorted(oracle["caches"]["fs"]["files"])[0]
    raw = (out / "fs" / name).read_bytes()
    length, fmt, code, *shape = struct.unpack_from("=7i", raw)

    def refused(data: bytes, why: str) -> None:
        with pytest.raises(CorruptStoreError, match=why):
            lmcache.read_fs_header(data[:64], len(data), name)

    refused(raw[: len(raw) - 1], "header says")  # cut short: the length no longer matches
    refused(raw[:6], "shorter than a header")
    refused(struct.pack("=7i", length, 99, code, *shape) + raw[28:], "memory format 99")
    refused(struct.pack("=7i", length, fmt, 42, *shape) + raw[28:], "dtype code 42")
    refused(struct.pack("=7i", length, fmt, 4, *shape) + raw[28:], "its shapes hold")  # float: twice the bytes
    refused(struct.pack("=7i", length, fmt, code, 0, 0, 0, 0) + raw[28:], "holds nothing")
