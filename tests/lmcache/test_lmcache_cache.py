"""hmem.lmcache's view of a cache directory (stats, select, row_of, chunk,
read, verify) against the caches LMCache 0.5.6 itself wrote: the small
ones committed in tests/data/lmcache/, whose oracle.json lists every file
with its shape and the sha256 of its K/V bytes.  Damaged copies give a
finding each and lose nothing."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest

from hmem.errors import CorruptStoreError, EntryNotFoundError, InvalidArgumentError, NotAStoreError
from hmem.lmcache import CHUNK_SORTS, CacheDirectory, KVShape, open_cache, parse_kv_shape, sort_rows

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "lmcache"
ORACLE = json.loads((FIXTURES / "oracle.json").read_text())
CHUNK = ORACLE["chunk_size"]
SHAPE = KVShape(ORACLE["layers"], ORACLE["hidden"], source="the oracle")
KINDS = ("local_disk", "fs", "layerwise")
TAG = "user%alice"


def copy(tmp_path: Path, kind: str) -> Path:
    """A copy of a committed cache to change (the fixtures stay as LMCache wrote them)."""
    return Path(shutil.copytree(FIXTURES / kind, tmp_path / kind))


def opened(tmp_path: Path, kind: str, *, shape: bool = True) -> CacheDirectory:
    given = SHAPE if shape and kind == "local_disk" else None
    return open_cache(copy(tmp_path, kind), kv_shape=given, chunk_size=CHUNK)


def files(kind: str) -> dict[str, dict]:
    return ORACLE["caches"][kind]["files"]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every entry's name and bytes (a link: its target's name): what must not change."""
    return {
        p.name: (os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b"<dir>")
        for p in directory.iterdir()
    }


@pytest.mark.parametrize("kind", KINDS)
def test_stats_count_every_file_lmcache_wrote(tmp_path, kind):
    cache = opened(tmp_path, kind)
    st = cache.stats()
    names = files(kind)
    sizes = {p.name: p.stat().st_size for p in cache.path.iterdir()}
    assert st.chunks == len(names) == sum(g.chunks for g in st.groups)
    assert st.bytes == sum(sizes.values()) == sum(g.bytes for g in st.groups)
    assert st.kinds == ("fs",) if kind == "fs" else ("local_disk",)
    assert (st.debris, st.foreign, st.other, st.debris_bytes) == ((), (), (), 0)
    tagged = sum(g.chunks for g in st.groups if g.tags == TAG)
    assert tagged == sum(name.endswith((f"@{TAG}.pt", f"@{TAG}.data")) for name in names)
    assert {(g.world_size, g.rank, g.kv_dtype) for g in st.groups} == {(1, 0, ORACLE["kv_dtype"])}
    if kind == "layerwise":
        assert cache.layerwise
        assert {g.layer for g in st.groups} == set(range(ORACLE["layers"]))
        per_layer = {layer: sum(g.chunks for g in st.groups if g.layer == layer) for layer in range(ORACLE["layers"])}
        assert set(per_layer.values()) == {len(names) // ORACLE["layers"]}
    else:
        assert not cache.layerwise and {g.layer for g in st.groups} == {None}
    assert json.loads(json.dumps(st.to_dict()))["chunks"] == len(names)


def test_the_shape_of_a_layerwise_cache_is_inferred_from_its_files(tmp_path):
    cache = opened(tmp_path, "layerwise")
    assert cache.kv_shape is not None
    assert (cache.kv_shape.layers, cache.kv_shape.hidden) == (ORACLE["layers"], ORACLE["hidden"])
    assert cache.kv_shape.source.startswith("inferred")


def test_a_local_disk_cache_has_no_shape_unless_given(tmp_path):
    directory = copy(tmp_path, "local_disk")
    assert open_cache(directory, chunk_size=CHUNK).kv_shape is None
    given = open_cache(directory, kv_shape=parse_kv_shape(f"{ORACLE['layers']},{ORACLE['hidden']}"), chunk_size=CHUNK)
    assert given.kv_shape is not None and given.kv_shape.source.startswith("given")


@pytest.mark.parametrize("kind", KINDS)
def test_read_gives_the_bytes_lmcache_wrote(tmp_path, kind):
    cache = opened(tmp_path, kind)
    seen = set()
    for info in cache.chunks():
        row = cache.row_of(info.name)
        chunk, data = cache.read(row)
        expected = files(kind)[info.name]
        assert list(chunk.shape or ()) == expected["shape"] == list(data.shape), info.name
        assert hashlib.sha256(data.tobytes()).hexdigest() == expected["sha256"], info.name
        assert chunk.tokens == CHUNK
        seen.add(info.name)
    assert seen == set(files(kind))


def test_an_fs_chunk_has_its_shape_from_its_header(tmp_path):
    cache = opened(tmp_path, "fs")
    for info in cache.chunks():
        assert info.shape is None  # listing reads no file
        read = cache.chunk(cache.row_of(info.name))
        assert list(read.shape or ()) == files("fs")[info.name]["shape"]
        assert read.memory_format == "KV_2LTD" and read.shape_source == "the file's header"


@pytest.mark.parametrize("kind", KINDS)
def test_select_by_tag_model_and_layer(tmp_path, kind):
    cache = opened(tmp_path, kind)
    names = files(kind)
    tagged = {n for n in names if f"@{TAG}." in n}
    listed = cache.listing.name
    assert set(listed[cache.select(tag=TAG)].tolist()) == tagged
    assert set(listed[cache.select(tag="none")].tolist()) == set(names) - tagged
    assert set(listed[cache.select(model=ORACLE["model"])].tolist()) == set(names)  # "/" as local_disk spells it
    assert len(cache.select(model="another/model")) == 0
    assert len(cache.select(world_size=1, rank=0, kv_dtype=ORACLE["kv_dtype"])) == len(names)
    assert len(cache.select(rank=1)) == len(cache.select(kv_dtype="half")) == 0
    if kind == "layerwise":
        assert len(cache.select(layer=0)) == len(names) // ORACLE["layers"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_chunk_is_found_by_its_file_name_or_its_key(tmp_path, kind):
    cache = opened(tmp_path, kind)
    for request in ORACLE["caches"][kind]["requests"]:
        for key in request["keys"]:
            name = str(cache.listing.name[cache.row_of(key)])
            assert name in files(kind)
            assert cache.row_of(name) == cache.row_of(key)
    with pytest.raises(EntryNotFoundError):
        cache.row_of("no-such-chunk.data")


@pytest.mark.parametrize("kind", KINDS)
def test_intact_caches_verify_clean(tmp_path, kind):
    cache = opened(tmp_path, kind)
    for deep in (False, True):
        report = cache.verify(deep=deep)
        assert report.ok and report.findings == (), report.findings
        assert report.chunks_checked == report.files == len(files(kind))
    # bf16: every chunk read whole
    assert cache.verify(deep=True).bytes_read == sum(2 * math.prod(meta["shape"]) for meta in files(kind).values())


def test_without_a_shape_a_local_disk_cache_says_so(tmp_path):
    cache = opened(tmp_path, "local_disk", shape=False)
    report = cache.verify(deep=True)
    assert report.ok
    assert [(f.problem, f.severity) for f in report.findings] == [("shape unknown", "warning")]
    assert "--kv-shape" in report.findings[0].detail and "--model-config" in report.findings[0].detail
    assert all(info.shape is None and info.tokens is None for info in cache.chunks())


# ---- bad input: a finding each, nothing deleted or changed ----------------------------------


def _fs_file(directory: Path) -> Path:
    return directory / sorted(files("fs"))[0]


def _damaged(tmp_path: Path, kind: str, damage, *, shape: bool = True):
    directory = copy(tmp_path, kind)
    name = damage(directory)
    before = snapshot(directory)
    cache = open_cache(directory, kv_shape=SHAPE if shape and kind == "local_disk" else None, chunk_size=CHUNK)
    reports = [cache.verify(), cache.verify(deep=True)]
    assert snapshot(directory) == before  # nothing deleted, nothing written
    for report in reports:
        found = [f for f in report.findings if f.name == name]
        assert len(found) == 1, report.findings
    return reports[1], found[0], cache


def test_a_truncated_fs_file(tmp_path):
    def damage(d: Path) -> str:
        path = _fs_file(d)
        os.truncate(path, path.stat().st_size - 100)
        return path.name

    report, finding, cache = _damaged(tmp_path, "fs", damage)
    assert (finding.problem, finding.severity) == ("bad header", "error") and not report.ok
    assert "says" in finding.detail
    with pytest.raises(CorruptStoreError):
        cache.read(cache.row_of(finding.name))


def test_an_fs_header_that_lies_about_its_length(tmp_path):
    def damage(d: Path) -> str:
        path = _fs_file(d)
        raw = bytearray(path.read_bytes())
        (length,) = struct.unpack_from("=i", raw)
        struct.pack_into("=i", raw, 0, length - 2)
        path.write_bytes(bytes(raw))
        return path.name

    report, finding, _ = _damaged(tmp_path, "fs", damage)
    assert (finding.problem, finding.severity) == ("bad header", "error") and not report.ok


def test_an_unknown_dtype_code_in_an_fs_header(tmp_path):
    def damage(d: Path) -> str:
        path = _fs_file(d)
        raw = bytearray(path.read_bytes())
        struct.pack_into("=i", raw, 8, 99)  # the first group's dtype code
        path.write_bytes(bytes(raw))
        return path.name

    report, finding, _ = _damaged(tmp_path, "fs", damage)
    assert finding.problem == "bad header" and "dtype code 99" in finding.detail and not report.ok


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("notes.txt", "neither"),
        ("hmem-tests-SEP-tiny-llama@1@0@ff@float99.data", "float99"),
        ("hmem-tests-SEP-tiny-llama@1@0@FF@bfloat16.data", "parses as no LMCache key"),
        ("hmem-tests-SEP-tiny-llama@99999999999999999999@0@ff@bfloat16.data", "parses as no LMCache key"),
        ("hmem-tests-SEP-tiny-llama@1@0@ff@bfloat16@99999999999999999999.data", "parses as no LMCache key"),
    ],
)
def test_a_name_that_is_no_key(tmp_path, name, why):
    def damage(d: Path) -> str:
        shutil.copyfile(_fs_file(d), d / name)
        return name

    report, finding, cache = _damaged(tmp_path, "fs", damage)
    assert (finding.problem, finding.severity) == ("not a chunk", "warning") and why in finding.detail
    assert report.ok and name in cache.stats().foreign


def test_a_local_disk_file_cut_short(tmp_path):
    def damage(d: Path) -> str:
        path = d / sorted(files("local_disk"))[0]
        os.truncate(path, path.stat().st_size - 3)  # no whole token: no shape fits
        return path.name

    report, finding, _ = _damaged(tmp_path, "local_disk", damage)
    assert (finding.problem, finding.severity) == ("size fits no shape", "error") and not report.ok


def test_a_local_disk_file_missing_tokens(tmp_path):
    def damage(d: Path) -> str:
        path = d / sorted(files("local_disk"))[0]
        os.truncate(path, path.stat().st_size // 2)  # half the tokens of each layer's planes
        return path.name

    _, finding, _ = _damaged(tmp_path, "local_disk", damage)
    assert (finding.problem, finding.severity) == ("partial chunk", "warning")
    _, unshaped, _ = _damaged(tmp_path / "unshaped", "local_disk", damage, shape=False)
    assert unshaped.problem == "size differs"  # without a shape: against its neighbours' size


def test_tmp_debris(tmp_path):
    def damage(d: Path) -> str:
        name = _fs_file(d).name + ".tmp"
        shutil.copyfile(_fs_file(d), d / name)
        return name

    report, finding, cache = _damaged(tmp_path, "fs", damage)
    assert (finding.problem, finding.severity) == ("debris", "warning") and report.ok
    st = cache.stats()
    assert st.debris == (finding.name,) and st.debris_bytes == (cache.path / finding.name).stat().st_size


def test_a_symbolic_link_is_never_followed(tmp_path):
    outside = tmp_path / "outside.data"
    outside.write_bytes(b"\0" * 64)

    def damage(d: Path) -> str:
        name = "hmem-tests-SEP-tiny-llama@1@0@abc@bfloat16.data"
        (d / name).symlink_to(outside)
        return name

    report, finding, cache = _damaged(tmp_path, "fs", damage)
    assert (finding.problem, finding.severity) == ("not a regular file", "warning") and report.ok
    assert finding.name in cache.stats().other and report.chunks_checked == len(files("fs"))
    assert outside.read_bytes() == b"\0" * 64


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_file(tmp_path):
    def damage(d: Path) -> str:
        path = _fs_file(d)
        path.chmod(0)
        return path.name

    directory = copy(tmp_path, "fs")
    name = damage(directory)
    try:
        report = open_cache(directory, chunk_size=CHUNK).verify(deep=True)
        [finding] = [f for f in report.findings if f.name == name]
        assert (finding.problem, finding.severity) == ("unreadable", "error") and not report.ok
    finally:
        (directory / name).chmod(0o644)
    assert sorted(os.listdir(directory)) == sorted(files("fs"))


# ---- what is no cache -----------------------------------------------------------------------


def test_a_directory_that_is_neither_a_store_nor_a_cache(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotAStoreError, match="LMCache cache"):
        open_cache(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotAStoreError, match="empty"):
        open_cache(empty)
    with pytest.raises(NotAStoreError, match="not a directory"):
        open_cache(tmp_path / "notes.txt")
    assert sorted(os.listdir(tmp_path)) == ["empty", "notes.txt"] and not os.listdir(empty)


@pytest.mark.parametrize(
    ("kv_dtype", "codes", "non_finite"),
    [  # each format's inf and NaN codes among finite ones
        ("fp8_e4m3fn", [0x7F, 0xFF, 0x38, 0x7E], 2),  # NaN at S.1111.111, no inf: 0x7E is 448
        ("fp8_e5m2", [0x7C, 0xFE, 0x3C, 0x7B], 2),  # +inf and a NaN; 0x7B is 57344
        ("fp8_e5m2fnuz", [0x80, 0x7C, 0x3C, 0xFF], 1),  # fnuz: NaN only at 0x80, no inf
        ("fp8_e4m3fn", [0x38, 0x7E, 0xC0, 0x01], 0),
    ],
)
def test_deep_verify_finds_non_finite_fp8_values(tmp_path, kv_dtype, codes, non_finite):
    """fp8 chunks are bytes: deep verify decodes them by their format's
    table, as show does, so an inf or NaN among them is a finding too."""
    directory = tmp_path / "cache"
    directory.mkdir()
    shape = (2, SHAPE.layers, CHUNK, SHAPE.hidden)
    data = bytearray(math.prod(shape))
    data[: len(codes)] = bytes(codes)
    name = f"m@1@0@1f@{kv_dtype}"
    if kv_dtype.endswith("fnuz"):  # no fs dtype code: a local_disk file, its shape given
        (directory / f"{name}.pt").write_bytes(bytes(data))
    else:
        code = {"fp8_e4m3fn": 7, "fp8_e5m2": 8}[kv_dtype]
        header = struct.pack("=7i", len(data), 1, code, *shape)  # length, KV_2LTD, dtype, shape
        (directory / f"{name}.data").write_bytes(header + bytes(data))
    cache = open_cache(directory, kv_shape=SHAPE, chunk_size=CHUNK)
    assert cache.verify().findings == ()  # the values are read only when deep
    report = cache.verify(deep=True)
    found = [f for f in report.findings if f.problem == "non-finite values"]
    if non_finite:
        assert [(f.severity, f.detail) for f in found] == [
            ("error", f"{non_finite} of {len(data)} values are inf or NaN")
        ]
        assert not report.ok
    else:
        assert found == [] and report.ok and report.findings == ()


def test_sort_rows_orders_a_selection_and_refuses_an_unknown_order(tmp_path):
    cache = opened(tmp_path, "local_disk")
    rows = cache.select()
    assert sort_rows(cache, rows, "name").tolist() == rows.tolist()
    by_size = sort_rows(cache, rows, "size")
    sizes = cache.listing.size[by_size].tolist()
    assert sorted(by_size.tolist()) == rows.tolist() and sizes == sorted(sizes, reverse=True)
    assert set(CHUNK_SORTS) == {"name", "size", "mtime", "atime"}
    with pytest.raises(InvalidArgumentError):
        sort_rows(cache, rows, "age")  # the CLI's alias, not the library's word
