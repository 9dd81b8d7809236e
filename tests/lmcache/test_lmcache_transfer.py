"""LMCache caches into hmem and back (docs/lmcache.md, "Import and
export"): `hmem put STORE CACHE` stores one entry per layer per chunk,
bit-exact and once; `hmem export` writes chunks (of a cache, or imported
into a store) as an fs connector cache whose files are the ones LMCache
itself writes, and which LMCache 0.5.6 reads back bit-exactly
(HMEM_LMCACHE_PYTHON, tests/lmcache/lmcache_writer.py readback); and as
safetensors that `hmem put` imports.

The caches are LMCache's own: tests/data/lmcache (small, committed, with
its oracle.json), copied to a temporary directory before any use."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.formats import lmcache as fmt
from hmem.formats import safetensors
from hmem.lmcache import (
    KVShape,
    export_fs_cache,
    export_safetensors,
    import_cache,
    open_cache,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "lmcache"
WRITER = Path(__file__).with_name("lmcache_writer.py")
KINDS = ("local_disk", "fs", "layerwise")
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "FORCE_COLOR": None, "TTY_COMPATIBLE": None, "HMEM_STORE": None}


@pytest.fixture(scope="module")
def oracle() -> dict:
    if not (DATA / "oracle.json").is_file():
        pytest.skip("tests/data/lmcache holds no fixtures (tests/lmcache/regenerate_fixtures.sh)")
    return json.loads((DATA / "oracle.json").read_text())


@pytest.fixture
def caches(tmp_path, oracle) -> Path:
    """A copy of the local_disk, fs and layerwise caches LMCache wrote."""
    for kind in KINDS:
        shutil.copytree(DATA / kind, tmp_path / kind)
    return tmp_path


def opened(root: Path, kind: str, oracle: dict):
    shape = KVShape(oracle["layers"], oracle["hidden"]) if kind == "local_disk" else None
    return open_cache(root / kind, kv_shape=shape, chunk_size=oracle["chunk_size"])


def new_store(path: Path, oracle: dict, dtype: str = "bf16") -> hmem.Store:
    return hmem.Store.create(path, embed_dim=oracle["hidden"], storage_dtype=dtype)


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def safetensors_header(path: Path):
    return safetensors.parse(path.read_bytes(), contiguous=True)


def words(stored) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(stored.keys), np.asarray(stored.values)


# ---- import -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_import_stores_an_entry_per_layer_per_chunk_bit_exact(caches, oracle, kind):
    cache = opened(caches, kind, oracle)
    rows = cache.select()
    with new_store(caches / "store", oracle) as store:
        report = import_cache(store, cache)
        store.flush()
        assert not report.skipped
        per_file = 1 if kind == "layerwise" else oracle["layers"]
        assert report.entries_added == len(rows) * per_file == len(store.entry_ids())
        for chunk in report.chunks:
            info, array = cache.read(cache.row_of(chunk.name))
            assert len(chunk.entries) == per_file
            for entry_id in chunk.entries:
                stored = store.stored_kv(entry_id)
                meta = stored.meta
                layer = meta["lmcache_layer"]
                assert stored.info.layer_idx == layer
                assert stored.dtype == "BF16"
                keys, values = words(stored)
                if kind == "layerwise":
                    assert layer == info.layer
                    assert np.array_equal(keys, array[:, 0]) and np.array_equal(values, array[:, 1])
                else:
                    assert np.array_equal(keys, array[0, layer]) and np.array_equal(values, array[1, layer])
                assert meta["lmcache_key"] == info.key
                assert meta["source"] == info.name
                assert meta["tokens"] == [0, oracle["chunk_size"]]
                assert meta["lmcache_chunk_hash"] == info.chunk_hash
                assert meta["lmcache_kind"] == info.kind
                assert meta["lmcache_shape"] == list(info.shape)
                assert "lmcache_request_tokens" not in meta  # a file alone does not say where in a request


def test_a_float32_store_keeps_bfloat16_chunks_exactly(caches, oracle):
    cache = opened(caches, "fs", oracle)
    with new_store(caches / "store", oracle, "f32") as store:
        report = import_cache(store, cache)
        chunk = report.chunks[0]
        _, array = cache.read(cache.row_of(chunk.name))
        got = store.get(chunk.entries[1])
        widened = (array.astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(got.keys, widened[0, 1]) and np.array_equal(got.values, widened[1, 1])


def test_importing_a_cache_again_adds_nothing(caches, oracle):
    cache = opened(caches, "fs", oracle)
    with new_store(caches / "store", oracle) as store:
        first = import_cache(store, cache)
        store.flush()
        # a tagged request's chunks hold the same bytes as untagged ones: other keys, imported each
        tagged = [c for c in first.chunks if "%" in c.key]
        assert tagged and all(c.entries for c in tagged)
        assert len(first.imported) == len(first.chunks)
    with hmem.Store.open(caches / "store") as store:
        second = import_cache(store, cache)
        assert second.entries_added == 0
        assert len(second.already_imported) == len(first.chunks)
        assert [c.imported_before.entry_ids for c in second.already_imported] == [
            range(c.entries[0], c.entries[-1] + 1) for c in first.chunks
        ]
        again = import_cache(store, cache, again=True, dry_run=True)
        assert again.entries_found == first.entries_added and again.entries_added == 0


def test_the_requests_give_each_chunk_its_token_range(caches, oracle):
    cache = opened(caches, "fs", oracle)
    requests = oracle["caches"]["fs"]["requests"]
    size = oracle["chunk_size"]
    with new_store(caches / "store", oracle) as store:
        report = import_cache(store, cache, requests=[r["tokens"] for r in requests])
        where = {}
        for r in requests:
            for index, value in enumerate(r["chunk_hashes"]):
                where.setdefault(f"{value:x}", [index * size, (index + 1) * size])
        for chunk in report.chunks:
            meta = store.stored_kv(chunk.entries[0]).meta
            assert meta["lmcache_request_tokens"] == where[meta["lmcache_chunk_hash"]]


def test_chunks_without_a_shape_are_skipped_with_the_reason(caches, oracle):
    cache = open_cache(caches / "local_disk", chunk_size=oracle["chunk_size"])  # no K/V shape given
    with new_store(caches / "store", oracle) as store:
        report = import_cache(store, cache)
        assert report.entries_added == 0 and len(report.skipped) == len(report.chunks) > 0
        assert all("shape" in c.skipped for c in report.skipped)
        assert store.imported_sources() == []


def test_chunks_the_store_cannot_take_are_skipped(caches, oracle):
    cache = opened(caches, "fs", oracle)
    with hmem.Store.create(caches / "store", embed_dim=oracle["hidden"] * 2) as store:
        report = import_cache(store, cache)
        assert report.entries_added == 0 and len(report.skipped) == len(report.chunks)
        assert len(store.entry_ids()) == 0


# ---- export as an fs connector cache ------------------------------------------------------


def lmcache_fs_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (DATA / "fs").iterdir()}


def test_local_disk_exported_to_fs_is_the_fs_cache_lmcache_writes(caches, oracle):
    cache = opened(caches, "local_disk", oracle)
    report = export_fs_cache(cache, caches / "out", model=oracle["model"])
    assert report.count("written") == len(report.files) == len(os.listdir(caches / "local_disk"))
    assert not report.notes and not report.problems
    written = {p.name: p.read_bytes() for p in (caches / "out").iterdir()}
    assert written == lmcache_fs_files()  # same names, same bytes: header and K/V
    back = open_cache(caches / "out")
    for row in range(len(back.listing)):
        info, array = back.read(row)
        _, source = cache.read(cache.row_of(fmt.ChunkKey.parse(info.key).local_disk_name()))
        assert np.array_equal(array, source)
    again = export_fs_cache(cache, caches / "out", model=oracle["model"])  # the same bytes: left as they are
    assert again.count("unchanged") == len(again.files)


def test_without_the_model_name_local_disk_keys_keep_their_dashes_and_say_so(caches, oracle):
    cache = opened(caches, "local_disk", oracle)
    report = export_fs_cache(cache, caches / "out")
    assert report.dashed_models == (oracle["model"].replace("/", "-"),) and report.notes
    assert all(name.startswith(oracle["model"].replace("/", "-") + "@") for name in os.listdir(caches / "out"))


@pytest.mark.parametrize("kind", ["fs", "local_disk"])
def test_a_store_exports_the_chunks_it_imported_as_lmcache_wrote_them(caches, oracle, kind):
    cache = opened(caches, kind, oracle)
    with new_store(caches / "store", oracle) as store:
        import_cache(store, cache)
        store.flush()
        report = export_fs_cache(store, caches / "out", model=oracle["model"])
    assert report.count("written") == len(report.files) and all(f.exact for f in report.files)
    assert {p.name: p.read_bytes() for p in (caches / "out").iterdir()} == lmcache_fs_files()


def test_a_layerwise_import_exports_one_file_per_layer(caches, oracle):
    cache = opened(caches, "layerwise", oracle)
    with new_store(caches / "store", oracle) as store:
        import_cache(store, cache)
        report = export_fs_cache(store, caches / "out", model=oracle["model"])
    assert report.count("written") == len(os.listdir(caches / "layerwise"))
    out = open_cache(caches / "out")
    for row in range(len(out.listing)):
        info, array = out.read(row)
        assert info.memory_format == "KV_T2D" and info.layer is not None
        source = caches / "layerwise" / fmt.ChunkKey.parse(info.key).local_disk_name()
        assert array.tobytes() == source.read_bytes()
        header = (caches / "out" / info.name).read_bytes()[:28]
        assert struct.unpack("=7i", header) == (array.nbytes, 2, 3, *array.shape, 0)


def test_a_chunk_with_a_layer_gone_is_skipped_and_the_rest_written(caches, oracle):
    cache = opened(caches, "fs", oracle)
    with new_store(caches / "store", oracle) as store:
        report = import_cache(store, cache)
        store.delete([report.chunks[0].entries[1]])
        out = export_fs_cache(store, caches / "out")
    (skipped,) = out.problems
    assert skipped.status == "skipped" and "layers [1]" in (skipped.reason or "")
    assert out.count("written") == len(report.chunks) - 1
    assert skipped.name not in os.listdir(caches / "out")


def test_a_different_file_is_refused_unless_forced(caches, oracle):
    cache = opened(caches, "fs", oracle)
    name = sorted(os.listdir(caches / "fs"))[0]
    (caches / "out").mkdir()
    (caches / "out" / name).write_bytes(b"not this chunk")
    report = export_fs_cache(cache, caches / "out")
    (refused,) = report.problems
    assert refused.status == "refused" and refused.name == name
    assert (caches / "out" / name).read_bytes() == b"not this chunk"
    forced = export_fs_cache(cache, caches / "out", force=True)
    assert forced.count("replaced") == 1 and forced.count("unchanged") == len(forced.files) - 1
    assert (caches / "out" / name).read_bytes() == (caches / "fs" / name).read_bytes()


def test_an_fs_export_writes_neither_into_the_cache_nor_into_a_store(caches, oracle):
    cache = opened(caches, "fs", oracle)
    with pytest.raises(hmem.InvalidArgumentError, match="the cache exported"):
        export_fs_cache(cache, caches / "fs")
    new_store(caches / "store", oracle).close()
    for dest in (caches / "store", caches / "store" / "sub"):
        with pytest.raises(hmem.InvalidArgumentError, match="store"):
            export_fs_cache(cache, dest)
    assert not (caches / "store" / "sub").exists()
    dry = export_fs_cache(cache, caches / "dry", dry_run=True)
    assert dry.count("written") == len(dry.files) and not (caches / "dry").exists()


# ---- export as safetensors ----------------------------------------------------------------


def test_split_safetensors_import_back_as_the_same_entries(caches, oracle):
    cache = opened(caches, "fs", oracle)
    result = export_safetensors(cache, caches / "x.safetensors")
    assert result.entries == len(result.chunks) * oracle["layers"]
    with new_store(caches / "store", oracle) as store:
        imported = hmem.import_files(store, [caches / "x.safetensors"])
        assert imported.entries_added == result.entries
        chunks = json.loads(safetensors_header(caches / "x.safetensors").metadata["chunks"])
        for entry_id in imported.files[0].entries:
            stored = store.stored_kv(entry_id)
            layer, batch = stored.info.layer_idx, stored.meta.get("batch", 0)
            _, array = cache.read(cache.row_of(chunks[str(layer)][batch]))
            keys, values = words(stored)
            assert stored.dtype == "BF16"
            assert np.array_equal(keys, array[0, layer]) and np.array_equal(values, array[1, layer])


def test_model_safetensors_hold_each_chunk_as_lmcache_keeps_it(caches, oracle):
    cache = opened(caches, "local_disk", oracle)
    export_safetensors(cache, caches / "m.safetensors", layout="model", model=oracle["model"])
    data = (caches / "m.safetensors").read_bytes()
    header = safetensors_header(caches / "m.safetensors")
    assert len(header.tensors) == len(os.listdir(caches / "local_disk"))
    for key, (dtype, shape, begin, end) in header.tensors.items():
        assert key.startswith(oracle["model"] + "@")  # the model name LMCache serves, restored
        info, array = cache.read(cache.row_of(key))
        assert dtype == "BF16" and tuple(shape) == array.shape
        assert data[header.data_start + begin : header.data_start + end] == array.tobytes()
        assert json.loads(header.metadata["memory_formats"])[key] == info.memory_format


# ---- the command line ---------------------------------------------------------------------


def test_hmem_put_imports_a_cache_once(caches, oracle):
    store = caches / "store"
    new_store(store, oracle).close()
    dry = run("put", store, caches / "fs", "--dry-run")
    assert dry.exit_code == 0 and "would add" in dry.stdout
    first = run("put", store, caches / "fs", "--chunk-size", oracle["chunk_size"], "--json")
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    chunks = len(os.listdir(caches / "fs"))
    assert (doc["chunks_imported"], doc["entries_added"]) == (chunks, chunks * oracle["layers"])
    second = run("put", store, caches / "fs", "--json")
    assert second.exit_code == 0
    doc = json.loads(second.stdout)
    assert (doc["entries_added"], doc["chunks_already_imported"]) == (0, chunks)
    human = run("put", store, caches / "fs")
    assert "already imported" in human.stdout


def test_hmem_put_of_local_disk_needs_its_shape(caches, oracle):
    store = caches / "store"
    new_store(store, oracle).close()
    bare = run("put", store, caches / "local_disk")
    assert bare.exit_code == 1 and "--kv-shape" in bare.stderr
    shaped = run("put", store, caches / "local_disk", "--kv-shape", f"{oracle['layers']},{oracle['hidden']}")
    assert shaped.exit_code == 0, shaped.output
    assert "added" in shaped.stdout
    mixed = run("put", store, caches / "fs", caches / "x.safetensors")
    assert mixed.exit_code == 2
    layered = run("put", store, caches / "fs", "--layer", 1)
    assert layered.exit_code == 2


def test_hmem_export_to_fs_from_a_cache_and_from_a_store(caches, oracle):
    store = caches / "store"
    new_store(store, oracle).close()
    shape = f"{oracle['layers']},{oracle['hidden']}"
    assert run("put", store, caches / "local_disk", "--kv-shape", shape).exit_code == 0
    from_cache = run(
        "export", caches / "local_disk", "--to-fs", caches / "a", "--kv-shape", shape, "--model-name", oracle["model"]
    )
    assert from_cache.exit_code == 0, from_cache.output
    assert "wrote 7 chunk files" in from_cache.stdout
    from_store = run("export", store, "--to-fs", caches / "b", "--model-name", oracle["model"], "--json")
    assert from_store.exit_code == 0, from_store.output
    assert json.loads(from_store.stdout)["written"] == len(os.listdir(caches / "local_disk"))
    for out in ("a", "b"):
        assert {p.name: p.read_bytes() for p in (caches / out).iterdir()} == lmcache_fs_files()
    dashed = run("export", store, "--to-fs", caches / "c")
    assert dashed.exit_code == 0 and "--model-name" in dashed.stderr
    one = run("export", store, "1", "--to-fs", caches / "d", "--json")
    assert one.exit_code == 0 and json.loads(one.stdout)["written"] == 1
    (caches / "e").mkdir()
    name = sorted(os.listdir(caches / "a"))[0]
    (caches / "e" / name).write_bytes(b"other")
    refused = run("export", caches / "fs", "--to-fs", caches / "e")
    assert refused.exit_code == 3 and "--force" in refused.stdout + refused.stderr
    assert run("export", caches / "fs", "--to-fs", caches / "e", "--force").exit_code == 0
    nothing = new_store(caches / "empty", oracle)
    nothing.close()
    assert run("export", caches / "empty", "--to-fs", caches / "f").exit_code == 2


def test_hmem_export_of_a_cache_to_safetensors(caches, oracle):
    result = run("export", caches / "fs", "-o", caches / "x.safetensors", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["layout"] == "split" and doc["entries"] == 7 * oracle["layers"]
    key = fmt.key_of_file(sorted(os.listdir(caches / "fs"))[0]).text
    one = run("export", caches / "fs", key, "-o", caches / "one.safetensors", "--layout", "model", "--json")
    assert one.exit_code == 0 and json.loads(one.stdout)["chunks"] == [key]
    store = caches / "store"
    new_store(store, oracle).close()
    back = run("put", store, caches / "x.safetensors", "--json")
    assert back.exit_code == 0 and json.loads(back.stdout)["entries_added"] == 7 * oracle["layers"]
    assert run("export", caches / "fs", "-o", caches / "y.safetensors", "--layout", "nope").exit_code == 2
    assert run("export", caches / "fs").exit_code == 2  # neither -o nor --to-fs


# ---- LMCache reads hmem's export ----------------------------------------------------------


def lmcache_reads(fs_dir: Path, tmp_path: Path) -> dict:
    python = os.environ.get("HMEM_LMCACHE_PYTHON")
    if not python:
        pytest.skip("HMEM_LMCACHE_PYTHON names no interpreter with LMCache 0.5.6 (.ci/run makes one)")
    out = tmp_path / "readback.json"
    run_ = subprocess.run(
        [python, str(WRITER), "readback", str(fs_dir), str(DATA / "oracle.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run_.returncode == 0, run_.stderr[-4000:]
    return json.loads(out.read_text())["requests"]


def test_lmcache_reads_a_store_exported_to_fs_bit_exactly(caches, oracle, tmp_path):
    """local_disk files (which a restarted LMCache never reads) imported
    into a store, exported as an fs cache: a fresh LMCache engine finds
    every chunk and retrieves K/V of the same SHA-256 as from the fs cache
    it wrote itself."""
    if "readback" not in oracle:
        pytest.skip("the fixtures' oracle holds no readback of LMCache's own fs cache")
    with new_store(caches / "store", oracle) as store:
        import_cache(store, opened(caches, "local_disk", oracle))
        store.flush()
        export_fs_cache(store, caches / "out", model=oracle["model"])
    assert lmcache_reads(caches / "out", tmp_path) == oracle["readback"]


# ---- chunks the fixtures do not hold --------------------------------------------------------


def test_an_mla_latent_is_stored_as_keys_and_values_and_written_back_once(tmp_path):
    layers, tokens, latent = 2, 16, 8
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((1, layers, tokens, latent)).astype(np.float16)
    (tmp_path / "cache").mkdir()
    name = fmt.ChunkKey("org/mla", 1, 0, 0x1A, "half").local_disk_name()
    (tmp_path / "cache" / name).write_bytes(latents.tobytes())
    cache = open_cache(tmp_path / "cache", kv_shape=KVShape(layers, latent, mla=True), chunk_size=tokens)
    with hmem.Store.create(tmp_path / "store", embed_dim=latent, storage_dtype="f16") as store:
        report = import_cache(store, cache)
        assert report.entries_added == layers
        for layer, entry_id in enumerate(report.chunks[0].entries):
            stored = store.stored_kv(entry_id)
            assert stored.meta["lmcache_mla"] is True and stored.info.layer_idx == layer
            assert np.array_equal(stored.keys, latents[0, layer]) and np.array_equal(stored.values, latents[0, layer])
        export = export_fs_cache(store, tmp_path / "out", model="org/mla")
    (chunk,) = export.files
    assert chunk.status == "written" and chunk.name == fmt.ChunkKey("org/mla", 1, 0, 0x1A, "half").fs_name()
    data = (tmp_path / "out" / chunk.name).read_bytes()
    assert struct.unpack("=7i", data[:28]) == (latents.nbytes, 6, 2, 1, layers, tokens, latent)  # KV_MLA_FMT, half
    assert data[28:] == latents.tobytes()


def test_fp8_chunks_are_skipped_with_the_reason(tmp_path):
    (tmp_path / "cache").mkdir()
    name = fmt.ChunkKey("m", 1, 0, 0x2B, "fp8_e4m3fn").local_disk_name()
    (tmp_path / "cache" / name).write_bytes(bytes(2 * 2 * 16 * 8))
    cache = open_cache(tmp_path / "cache", kv_shape=KVShape(2, 8), chunk_size=16)
    with hmem.Store.create(tmp_path / "store", embed_dim=8) as store:
        (chunk,) = import_cache(store, cache).chunks
        assert chunk.skipped is not None and "fp8_e4m3fn" in chunk.skipped and not chunk.entries


def test_hmem_put_with_the_requests_records_each_chunks_token_range(caches, oracle):
    """--tokens (as prefix-hit reads them) and the seed of a vLLM deployment's NONE_HASH."""
    shutil.copytree(DATA / "fs_seeded", caches / "fs_seeded")
    made = oracle["caches"]["fs_seeded"]
    (caches / "tokens.json").write_text(json.dumps([r["tokens"] for r in made["requests"]]))
    store = caches / "store"
    new_store(store, oracle).close()
    args = ("put", store, caches / "fs_seeded", "--tokens", caches / "tokens.json", "--json")
    unseeded = run(*args, "--chunk-size", oracle["chunk_size"], "--dry-run")  # NONE_HASH 0: no chunk found
    assert unseeded.exit_code == 0 and "--hash-seed" in unseeded.stderr
    assert json.loads(unseeded.stdout)["chunks_located"] == 0
    result = run(*args, "--chunk-size", oracle["chunk_size"], "--hash-seed", made["pythonhashseed"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["chunks_located"] == len(os.listdir(caches / "fs_seeded"))
    size = oracle["chunk_size"]
    where = {}
    for r in made["requests"]:
        for index, value in enumerate(r["chunk_hashes"]):
            where.setdefault(f"{value:x}", [index * size, (index + 1) * size])
    with hmem.Store.open(store, read_only=True) as s:
        metas = [s.stored_kv(i).meta for i in s.entry_ids()]
    assert metas and all(m["lmcache_request_tokens"] == where[m["lmcache_chunk_hash"]] for m in metas)
    assert run(*args, "--hash-seed", "0", "--none-hash", "0").exit_code == 2
    assert run("put", store, caches / "fs", "--none-hash", "0").exit_code == 2  # without --tokens
