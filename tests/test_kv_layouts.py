"""K/V files as Hugging Face and serving engines write them: the naming
conventions and per-head layouts `hmem put` imports, chunks, dtypes kept,
and the export in the model's layout (docs/cli.md, "Naming conventions and
layouts").

Every row of the docs' tables is one case below: its file is built, imported
into a store of embed_dim = kv_heads x head_dim, and every entry's rows,
layer and meta are checked exactly against a numpy reference of the
flattening written here, independently of hmem/store/kv_layouts.py.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parent.parent
H, HD, T = 4, 8, 6  # kv heads, head_dim, tokens (T != H: every shape below reads one way only)
E = H * HD  # the stores' embed_dim
HDC = 256
ENV = {"COLUMNS": "200", "NO_COLOR": None, "FORCE_COLOR": None, "HMEM_STORE": None, "HMEM_DEBUG": None}
F32 = np.float32


def run(*args: Any):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def run_json(*args: Any, code: int = 0) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == code, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


def new_store(path: str = "store", **settings: Any) -> hmem.Store:
    return hmem.Store.create(path, embed_dim=settings.pop("embed_dim", E), hdc_dim=HDC, **settings)


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(F32)


# ---- the reference flattening: heads into the row, one matrix per batch row ----------------


def flatten(x: np.ndarray, layout: str) -> list[np.ndarray]:
    """[tokens, kv_heads * head_dim] per batch row, head-major within a row:
    row t = concat over heads h of x[.., h, t, :]."""
    if layout == "td":
        return [x]
    if layout in ("thd", "htd"):
        return flatten(x[None], "b" + layout)
    out = []
    for row in x:  # one batch row
        tokens = row.shape[0] if layout == "bthd" else row.shape[1]
        heads = row.shape[1] if layout == "bthd" else row.shape[0]
        m = np.empty((tokens, heads * row.shape[2]), row.dtype)
        for t in range(tokens):
            for h in range(heads):
                m[t, h * row.shape[2] : (h + 1) * row.shape[2]] = row[t, h] if layout == "bthd" else row[h, t]
        out.append(m)
    return out


Expected = list[tuple[int, np.ndarray, np.ndarray, dict]]  # (layer, keys rows, values rows, meta) per entry


def entries_of(keys: np.ndarray, values: np.ndarray, layout: str, layer: int, source: str) -> Expected:
    ks, vs = flatten(keys, layout), flatten(values, layout)
    many = len(ks) > 1
    return [
        (layer, k, v, {"source": source, "tokens": [0, len(k)], **({"batch": b} if many else {})})
        for b, (k, v) in enumerate(zip(ks, vs))
    ]


def stored(store: hmem.Store, ids: list[int] | None = None) -> Expected:
    out = []
    for entry_id in store.entry_ids() if ids is None else ids:
        e = store.get(entry_id)
        out.append((e.info.layer_idx, np.array(e.keys), np.array(e.values), e.meta))
    return out


def assert_entries(got: Expected, want: Expected) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, ((gl, gk, gv, gm), (wl, wk, wv, wm)) in enumerate(zip(got, want)):
        assert (gl, gm) == (wl, wm), i
        np.testing.assert_array_equal(gk, wk.astype(F32), err_msg=f"entry {i} keys")
        np.testing.assert_array_equal(gv, wv.astype(F32), err_msg=f"entry {i} values")


# ---- one case per row of the docs' tables --------------------------------------------------


def _kv(rng):  # `kv`: keys / values (upper case and singular too), one pair
    k, v = randn(rng, T, E), randn(rng, T, E)
    return {"K": k, "Value": v, "other": randn(rng, 2)}, entries_of(k, v, "td", 0, "f.safetensors")


def _layer(rng):
    k0, v0, k2, v2 = randn(rng, T, E), randn(rng, T, E), randn(rng, 3, H, HD), randn(rng, 3, H, HD)
    files = {"layer.0.k": k0, "layer.0.v": v0, "layers_2_key": k2, "layers_2_value": v2}
    return files, entries_of(k0, v0, "td", 0, "f.safetensors") + entries_of(k2, v2, "thd", 2, "f.safetensors")


def _numbered(rng):
    k0, v0, k1, v1 = randn(rng, T, E), randn(rng, T, E), randn(rng, 2, E), randn(rng, 2, E)
    return (
        {"k_0": k0, "v_0": v0, "keys.1": k1, "values.1": v1},
        entries_of(k0, v0, "td", 0, "f.safetensors") + entries_of(k1, v1, "td", 0, "f.safetensors"),
    )


def _per_layer(name: Callable[[int, str], str]):
    def build(rng):
        files, want = {}, []
        for layer in (0, 1, 3):
            k, v = randn(rng, 1, H, T, HD), randn(rng, 1, H, T, HD)
            files[name(layer, "k")], files[name(layer, "v")] = k, v
            want += entries_of(k, v, "bhtd", layer, "f.safetensors")
        return files, want

    return build


def _all_layers(rng):
    kv = randn(rng, 3, 2, T, H, HD)
    want = []
    for layer in range(3):
        want += entries_of(kv[layer, 0], kv[layer, 1], "thd", layer, "f.safetensors")
    return {"kv": kv}, want


def _layout(layout: str, shape: tuple[int, ...], names: tuple[str, str] = ("keys", "values")):
    def build(rng):
        k, v = randn(rng, *shape), randn(rng, *shape)
        return {names[0]: k, names[1]: v}, entries_of(k, v, layout, 0, "f.safetensors")

    return build


ROWS: dict[str, Callable] = {
    # naming conventions
    "kv": _kv,
    "layer": _layer,
    "numbered": _numbered,
    "hf": _per_layer(lambda i, r: f"past_key_values.{i}.{'key' if r == 'k' else 'value'}"),
    "hf-tuple": _per_layer(lambda i, r: f"past_key_values.{i}.{0 if r == 'k' else 1}"),
    "model-layers": _per_layer(lambda i, r: f"model.layers.{i}.self_attn.{'key' if r == 'k' else 'value'}_cache"),
    "all-layers": _all_layers,
    # layouts
    "td": _layout("td", (T, E)),
    "thd": _layout("thd", (T, H, HD)),
    "htd": _layout("htd", (H, T, HD)),
    "bhtd": _layout("bhtd", (1, H, T, HD)),
    "bthd": _layout("bthd", (1, T, H, HD)),
    "l2thd": _all_layers,
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_every_table_row_imports_exactly(row, rng):
    tensors, want = ROWS[row](rng)
    save_file(tensors, "f.safetensors")
    with new_store() as s:
        report = hmem.import_files(s, ["f.safetensors"])
        assert report.skipped == (), report.skipped[0].skipped
        assert list(report.files[0].entries) == s.entry_ids()  # ids in the file's order
        assert_entries(stored(s), want)


def _doc_section() -> str:
    text = (ROOT / "docs" / "cli.md").read_text()
    start = text.index("### Naming conventions and layouts")
    return text[start : text.index("\n#", start + 10)]


def test_the_docs_tables_list_exactly_the_rows_tested():
    section = _doc_section()
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", section, flags=re.M)
    assert sorted(documented) == sorted(ROWS)
    for layout in hmem.LAYOUTS:
        assert f"| `{layout}` |" in section


def test_put_help_mentions_the_conventions():
    out = run("put", "--help").stdout
    for fragment in ("past_key_values.{i}.key", "model.layers.{i}", "case-insensitive", "--layout", "--chunk-tokens"):
        assert fragment in out, fragment


# ---- ambiguity: heads as many as tokens ----------------------------------------------------


def _square(rng) -> tuple[np.ndarray, np.ndarray]:
    k, v = randn(rng, H, H, HD), randn(rng, H, H, HD)  # [4, 4, 8]: thd and htd both make rows of 32
    save_file({"k": k, "v": v}, "square.safetensors")
    return k, v


def test_an_ambiguous_shape_is_refused_naming_the_layouts(rng):
    _square(rng)
    with new_store() as s:
        with pytest.raises(hmem.AmbiguousLayoutError) as err:
            hmem.read_kv_file(Path("square.safetensors"), embed_dim=E)
        assert err.value.layouts == ("thd", "htd")
        assert "layout='thd'" in err.value.hint and "layout='htd'" in err.value.hint
        report = hmem.import_files(s, ["square.safetensors"])
        (skip,) = report.skipped
        assert skip.layouts == ("thd", "htd") and "[4, 4, 8]" in skip.skipped and "4 heads, 4 tokens" in skip.skipped
        assert s.entry_ids() == []


def test_an_ambiguous_shape_on_the_command_line_says_which_layout_to_give(rng):
    _square(rng)
    new_store().close()
    result = run("put", "store", "square.safetensors")
    assert result.exit_code == ExitCode.FAILURE  # the only file was skipped
    assert "give --layout thd or --layout htd" in result.stderr
    assert "thd [tokens, kv_heads, head_dim]" in result.stderr  # a reason's brackets are no markup
    doc = run_json("put", "store", "square.safetensors", code=ExitCode.FAILURE)
    assert doc["skipped"][0]["reason"].endswith("(give --layout thd or --layout htd)")
    assert doc["entries_added"] == 0


@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_layout_resolves_the_ambiguity(layout, rng):
    k, v = _square(rng)
    new_store().close()
    doc = run_json("put", "store", "square.safetensors", "--layout", layout)
    assert doc["entries_added"] == 1
    with hmem.Store.open("store", read_only=True) as s:
        assert_entries(stored(s), entries_of(k, v, layout, 0, "square.safetensors"))


def test_a_hugging_face_name_says_the_layout(rng):
    k, v = randn(rng, 1, H, H, HD), randn(rng, 1, H, H, HD)  # bhtd and bthd both fit; the names say bhtd
    save_file({"past_key_values.0.key": k, "past_key_values.0.value": v}, "hf.safetensors")
    save_file({"keys": k, "values": v}, "plain.safetensors")
    with new_store() as s:
        report = hmem.import_files(s, ["hf.safetensors", "plain.safetensors"])
        assert [f.layouts for f in report.files] == [(), ("bhtd", "bthd")]
        assert_entries(stored(s), entries_of(k, v, "bhtd", 0, "hf.safetensors"))
        report = hmem.import_files(s, ["plain.safetensors"], layout="bthd")
        assert_entries(stored(s, list(report.files[0].entries)), entries_of(k, v, "bthd", 0, "plain.safetensors"))


@pytest.mark.parametrize(
    "layout, fragment",
    [
        ("tdh", "layout must be one of td, thd, htd, bhtd, bthd, l2thd"),
        ("l2thd", "layout l2thd is for one tensor holding every layer"),
        ("bhtd", "which is not layout bhtd (4 dimensions)"),
    ],
)
def test_a_wrong_layout_is_refused_and_stores_nothing(layout, fragment, rng):
    save_file({"keys": randn(rng, T, H, HD), "values": randn(rng, T, H, HD)}, "f.safetensors")
    new_store().close()
    result = run("put", "store", "f.safetensors", "--layout", layout)
    assert fragment in result.stdout + result.stderr
    assert result.exit_code == (ExitCode.USAGE if layout == "tdh" else ExitCode.FAILURE)
    with hmem.Store.open("store", read_only=True) as s:
        assert s.entry_ids() == []


# ---- refusals ------------------------------------------------------------------------------


def test_a_refused_file_lists_its_tensor_names_and_the_conventions(rng):
    save_file({f"blk{i}.attn_out": randn(rng, 2, E) for i in range(9)}, "odd.safetensors")
    with pytest.raises(hmem.BadFileError) as err:
        hmem.read_kv_file(Path("odd.safetensors"), embed_dim=E)
    message = err.value.message
    assert (
        "no K/V pair found (tensors: blk0.attn_out, blk1.attn_out, blk2.attn_out, blk3.attn_out, "
        "blk4.attn_out, blk5.attn_out and 3 more)" in message
    )
    for short in ("kv", "layer", "numbered", "hf", "hf-tuple", "model-layers", "all-layers"):
        assert f"{short} (" in message
    assert "past_key_values.{i}.key" in message


@pytest.mark.parametrize(
    "name, shape, fragment",
    [
        (
            "keys",
            (T, 5, HD),
            "has shape [6, 5, 8], which makes no rows of the store's embed_dim 32: as thd "
            "[tokens, kv_heads, head_dim] its rows hold 40 values, as htd [kv_heads, tokens, head_dim] 48",
        ),
        ("keys", (1, 3, T, HD), "makes no rows of the store's embed_dim 32"),
        ("keys", (T, E + 8), "tensor 'keys' has rows of 40 values; the store's embed_dim is 32"),
        ("keys", (48,), "must have shape [tokens, embed_dim]"),
        ("keys", (2, 2, T, H, HD), "must have shape"),
        ("kv", (2, 2, T, H, HD + 1), "as l2thd [layers, 2, tokens, kv_heads, head_dim] its rows hold 36 values"),
        ("kv", (2, 3, T, H, HD), "which is not layout l2thd"),
        (
            "past_key_values.0.key",
            (1, T, H, HD),
            "as bhtd [batch, kv_heads, tokens, head_dim] (as its naming "
            "convention hf says) its rows hold 48 values; the store's embed_dim is 32",
        ),
    ],
)
def test_a_shape_no_layout_fits_is_refused_with_what_it_would_make(name, shape, fragment, rng):
    tensors = {name: randn(rng, *shape)}
    if name != "kv":  # the all-layers tensor has no partner
        tensors[name.removesuffix("key") + "value" if name.endswith(".key") else "values"] = randn(rng, *shape)
    save_file(tensors, "f.safetensors")
    with new_store() as s:
        (skip,) = hmem.import_files(s, ["f.safetensors"]).skipped
        assert fragment in skip.skipped
        assert s.entry_ids() == []


def test_names_are_case_insensitive_but_two_names_for_one_tensor_are_refused(rng):
    k, v = randn(rng, 1, H, T, HD), randn(rng, 1, H, T, HD)
    save_file({"PAST_KEY_VALUES.2.KEY": k, "Past_Key_Values.2.Value": v}, "upper.safetensors")
    save_file({"KEYS": k[0, 0], "values": v[0, 0], "VALUES": v[0, 0]}, "twice.safetensors")
    with new_store(embed_dim=E) as s:
        report = hmem.import_files(s, ["upper.safetensors", "twice.safetensors"])
        assert report.files[0].skipped is None
        assert "tensors 'VALUES' and 'values' both name the values" in report.files[1].skipped
        assert_entries(stored(s), entries_of(k, v, "bhtd", 2, "upper.safetensors"))


def test_a_files_entries_go_in_together_or_not_at_all(rng):
    kv = randn(rng, 3, 2, T, H, HD)
    kv[2, 1, 4, 1, 3] = np.nan  # the last layer's values
    save_file({"kv_cache": kv}, "nan.safetensors")
    with new_store() as s:
        (skip,) = hmem.import_files(s, ["nan.safetensors"], chunk_tokens=2).skipped
        assert "NaN" in skip.skipped
        assert s.entry_ids() == []


# ---- batch rows, all layers, chunks --------------------------------------------------------


def test_each_batch_row_is_its_own_entry(rng):
    k, v = randn(rng, 3, H, T, HD), randn(rng, 3, H, T, HD)
    save_file({"model.layers.5.self_attn.k": k, "model.layers.5.self_attn.v": v}, "batch.safetensors")
    with new_store() as s:
        ids = list(hmem.import_files(s, ["batch.safetensors"]).files[0].entries)
        got = stored(s, ids)
        assert [m for *_, m in got] == [{"source": "batch.safetensors", "tokens": [0, T], "batch": b} for b in range(3)]
        assert_entries(
            got,
            [
                (5, k[b].transpose(1, 0, 2).reshape(T, E), v[b].transpose(1, 0, 2).reshape(T, E), got[b][3])
                for b in range(3)
            ],
        )


def test_an_unnamed_all_layers_tensor_with_layout_l2thd(rng):
    chunk = randn(rng, 2, 2, T, H, HD)
    save_file({"lmcache_chunk_0": chunk}, "chunk.safetensors")
    with new_store() as s:
        (skip,) = hmem.import_files(s, ["chunk.safetensors"]).skipped
        assert "no K/V pair found (tensors: lmcache_chunk_0)" in skip.skipped
        report = hmem.import_files(s, ["chunk.safetensors"], layout="l2thd")
        want = [
            e
            for layer in range(2)
            for e in entries_of(chunk[layer, 0], chunk[layer, 1], "thd", layer, "chunk.safetensors")
        ]
        assert_entries(stored(s, list(report.files[0].entries)), want)


def test_chunks_are_consecutive_token_ranges_in_order(rng):
    tokens, size = 11, 4
    k, v = randn(rng, 2, H, tokens, HD), randn(rng, 2, H, tokens, HD)
    save_file({"past_key_values.1.key": k, "past_key_values.1.value": v}, "long.safetensors")
    with new_store() as s:
        ids = list(hmem.import_files(s, ["long.safetensors"], chunk_tokens=size).files[0].entries)
        assert ids == list(range(ids[0], ids[0] + 6))  # 2 batch rows x 3 chunks, in order
        want = []
        for b, (kr, vr) in enumerate(zip(flatten(k, "bhtd"), flatten(v, "bhtd"))):
            for c, start in enumerate(range(0, tokens, size)):
                stop = min(start + size, tokens)
                want.append(
                    (
                        1,
                        kr[start:stop],
                        vr[start:stop],
                        {"source": "long.safetensors", "chunk": c, "tokens": [start, stop], "batch": b},
                    )
                )
        assert [len(w[1]) for w in want] == [4, 4, 3, 4, 4, 3]  # the last chunk is short
        assert_entries(stored(s, ids), want)


def test_put_chunk_tokens_on_the_command_line(rng):
    k, v = randn(rng, 1, H, 10, HD), randn(rng, 1, H, 10, HD)
    save_file({"past_key_values.0.key": k, "past_key_values.0.value": v}, "hf.safetensors")
    new_store().close()
    dry = run_json("put", "store", "hf.safetensors", "--chunk-tokens", 4, "--dry-run")
    assert (dry["entries_found"], dry["entries_added"]) == (3, 0)
    doc = run_json("put", "store", "hf.safetensors", "--chunk-tokens", 4)
    assert doc["entries_added"] == 3
    with hmem.Store.open("store", read_only=True) as s:
        got = stored(s)
    assert [m["tokens"] for *_, m in got] == [[0, 4], [4, 8], [8, 10]]
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), flatten(k, "bhtd")[0])
    bad = run("put", "store", "hf.safetensors", "--chunk-tokens", 0)
    assert bad.exit_code == ExitCode.USAGE


# ---- dtypes kept ---------------------------------------------------------------------------


def write_bf16(path: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A BF16 safetensors file written by hand; returns the bfloat16 words."""
    header, blobs, offset, words = {}, [], 0, {}
    for name, array in tensors.items():
        top = (np.ascontiguousarray(array, dtype=F32).view(np.uint32) >> 16).astype("<u2")
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + top.nbytes]}
        blobs.append(top.tobytes())
        offset += top.nbytes
        words[name] = top
    text = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return words


@pytest.mark.parametrize("storage", ["bf16", "f16"])
def test_half_inputs_are_bit_exact_in_a_store_of_their_dtype(storage, rng):
    k, v = randn(rng, 1, H, T, HD) * 3, randn(rng, 1, H, T, HD)
    assert run("init", "store", "-d", E, "--hdc-dim", HDC, "--storage-dtype", storage, "-q").exit_code == 0
    if storage == "bf16":
        words = write_bf16("half.safetensors", {"past_key_values.0.key": k, "past_key_values.0.value": v})
        want = {n: (w.astype(np.uint32) << 16).view(F32) for n, w in words.items()}
    else:
        want = {"past_key_values.0.key": k.astype(np.float16), "past_key_values.0.value": v.astype(np.float16)}
        save_file(want, "half.safetensors")
    assert run_json("put", "store", "half.safetensors")["entries_added"] == 1
    with hmem.Store.open("store", read_only=True) as s:
        (got,) = stored(s)
    for rows, name in ((got[1], "past_key_values.0.key"), (got[2], "past_key_values.0.value")):
        expected = flatten(want[name], "bhtd")[0].astype(F32)
        assert rows.dtype == F32
        np.testing.assert_array_equal(rows.view(np.uint32), expected.view(np.uint32))  # every bit
        if storage == "bf16":
            assert not (rows.view(np.uint32) & 0xFFFF).any()


WIDE_H, WIDE_HD = 4, 64  # rows of 256 values: an entry of 64 tokens or more is put on its own (not joined)


def _bf16_import_against_put_many(
    folder: Path, storage: str, files: dict[str, tuple[str, int]], chunk: int | None, spans: bool, seed: int
) -> None:
    """Import BF16 files (name -> (layout, tokens)) in one import_files, and
    put the float32 rows hmem.read_kv_file makes of them with put_many into
    a second store: both hold the same K/V, bit for bit, and answer a query
    alike."""
    rng = np.random.default_rng(seed)
    dim = WIDE_H * WIDE_HD
    paths = []
    for name, (layout, tokens) in files.items():
        shape = (1, WIDE_H, tokens, WIDE_HD) if layout == "bhtd" else (tokens, WIDE_H, WIDE_HD)
        paths.append(folder / name)
        write_bf16(str(paths[-1]), {"keys": randn(rng, *shape) * 3, "values": randn(rng, *shape)})
    settings = {"embed_dim": dim, "hdc_dim": HDC, "storage_dtype": storage}
    if spans:
        settings["signatures_per_entry"] = 3
    with hmem.Store.create(folder / "imported", **settings) as s:
        report = hmem.import_files(s, paths, chunk_tokens=chunk)
        assert not report.skipped, report.skipped
        got = stored(s)
    with hmem.Store.create(folder / "reference", **settings) as ref:
        for path, (layout, _) in zip(paths, files.values()):
            entries, _ = hmem.read_kv_file(path, layout=layout, chunk_tokens=chunk, embed_dim=dim)
            assert all(e.keys.dtype == F32 for e in entries)  # the library's float32 rows
            ref.put_many(entries)
        want = stored(ref)
        query = randn(rng, 5, dim)
        want_hits = [(r.entry_id, r.score) for r in ref.query(query, 0, top_k=5)]
        # by signature alone, every entry: the signatures are the same bits
        want_similarities = [(r.entry_id, r.similarity) for r in ref.query(query, 0, top_k=1000, rerank=False)]
    assert_entries(got, want)
    with hmem.Store.open(folder / "imported", read_only=True) as s:
        assert [(r.entry_id, r.score) for r in s.query(query, 0, top_k=5)] == want_hits
        assert [(r.entry_id, r.similarity) for r in s.query(query, 0, top_k=1000, rerank=False)] == want_similarities


@pytest.mark.parametrize("storage", ["f32", "bf16", "f16", "int8"])
@pytest.mark.parametrize("layout", ["bhtd", "thd"])
def test_a_bf16_file_of_large_entries_stores_what_put_many_stores(tmp_path, storage, layout):
    """A BF16 file's tensors go into the put as their words, widened entry
    by entry (a bf16 store keeps the words, an f32 store widens them as
    they are copied into the shard): large entries (put one by one) hold
    exactly what put_many stores of the same rows as float32."""
    _bf16_import_against_put_many(tmp_path, storage, {"big.safetensors": (layout, 300)}, 100, False, 7)


@settings(max_examples=16, deadline=None)
@given(
    storage=st.sampled_from(["f32", "bf16", "f16", "int8"]),
    big=st.integers(64, 200),
    small=st.integers(1, 8).filter(lambda n: n != WIDE_H),  # as many tokens as heads: ambiguous, refused
    chunk=st.one_of(st.none(), st.integers(32, 128)),
    spans=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@pytest.mark.stress
def test_bf16_files_large_and_small_store_what_put_many_stores(
    tmp_path_factory, storage, big, small, chunk, spans, seed
):
    """Small and large BF16 entries in one import (joined or put one by
    one, as the batch's sizes decide), with span signatures or without."""
    folder = tmp_path_factory.mktemp("bf16")
    files = {"a.safetensors": ("bhtd", big), "b.safetensors": ("thd", small), "c.safetensors": ("thd", big)}
    _bf16_import_against_put_many(folder, storage, files, chunk, spans, seed)


@pytest.mark.parametrize("storage", ["f32", "bf16"])
@pytest.mark.parametrize("bad, kv", [(0x7FC0, "values"), (0xFF80, "keys")])  # NaN, -inf
def test_a_nonfinite_bf16_word_in_a_large_entry_skips_its_file(tmp_path, storage, bad, kv):
    rng = np.random.default_rng(3)
    with hmem.Store.create(tmp_path / "s", embed_dim=WIDE_H * WIDE_HD, hdc_dim=HDC, storage_dtype=storage) as s:
        s.put(randn(rng, 2, WIDE_H * WIDE_HD), randn(rng, 2, WIDE_H * WIDE_HD))
        tensors = {name: randn(rng, 1, WIDE_H, 256, WIDE_HD) for name in ("keys", "values")}
        words = write_bf16(str(tmp_path / "bad.safetensors"), tensors)
        raw = bytearray((tmp_path / "bad.safetensors").read_bytes())
        # the last entry's first word of `kv` (chunks of 64 tokens: entry 3 starts at token 192)
        index = list(words).index(kv) * words["keys"].size + 192 * WIDE_HD
        data_start = len(raw) - 2 * words["keys"].nbytes
        raw[data_start + 2 * index : data_start + 2 * index + 2] = struct.pack("<H", bad)
        (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
        (skip,) = hmem.import_files(s, [tmp_path / "bad.safetensors"], chunk_tokens=64).skipped
        assert f"entry 3: {kv} holds NaN or infinite values" in skip.skipped
        assert len(s.entry_ids()) == 1


SOURCE_DTYPES = ("F32", "F16", "F64", "BF16")
SHAPES_OF = {
    "td": lambda b, t: (t, E),
    "thd": lambda b, t: (t, H, HD),
    "htd": lambda b, t: (H, t, HD),
    "bhtd": lambda b, t: (b, H, t, HD),
    "bthd": lambda b, t: (b, t, H, HD),
}


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(sorted(SHAPES_OF)),
    dtype=st.sampled_from(SOURCE_DTYPES),
    batches=st.integers(1, 3),
    tokens=st.integers(1, 9),
    chunk=st.one_of(st.none(), st.integers(1, 10)),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_layout_and_dtype_imports_exactly_in_chunks(
    tmp_path_factory, layout, dtype, batches, tokens, chunk, seed
):
    """Each chunk's rows are made straight from the file (transposed and
    widened in one pass): they equal the reference flattening of the whole
    tensor, cut afterwards, for every source dtype."""
    rng = np.random.default_rng(seed)
    shape = SHAPES_OF[layout](batches, tokens)
    k, v = randn(rng, *shape) * 4, randn(rng, *shape)
    folder = tmp_path_factory.mktemp("chunks")
    path = str(folder / "f.safetensors")
    if dtype == "BF16":
        words = write_bf16(path, {"keys": k, "values": v})
        k, v = ((words[n].astype(np.uint32) << 16).view(F32) for n in ("keys", "values"))
    else:
        np_dtype = {"F32": F32, "F16": np.float16, "F64": np.float64}[dtype]
        k, v = k.astype(np_dtype), v.astype(np_dtype)
        save_file({"keys": k, "values": v}, path)
    ks, vs = flatten(k, layout), flatten(v, layout)
    want: Expected = []
    for b, (kr, vr) in enumerate(zip(ks, vs)):
        step = chunk or len(kr)
        for n, start in enumerate(range(0, len(kr), step)):
            meta: dict = {"source": "f.safetensors", "tokens": [start, min(start + step, len(kr))]}
            if chunk is not None:
                meta["chunk"] = n
            if len(ks) > 1:
                meta["batch"] = b
            want.append((0, kr[start : start + step], vr[start : start + step], meta))
    with new_store(str(folder / "store")) as s:
        report = hmem.import_files(s, [path], layout=layout, chunk_tokens=chunk)
        assert not report.skipped, report.skipped
        assert_entries(stored(s), want)


def test_a_bad_tensor_after_good_ones_stores_nothing_of_its_file(rng):
    """Entries are made as the put takes them; a tensor found bad after
    others were already converted still leaves the store as it was."""
    with new_store() as s:
        s.put(randn(rng, 2, E), randn(rng, 2, E))  # an open shard with an entry in it
        tensors = {f"past_key_values.{i}.{kv}": randn(rng, 1, H, T, HD) for i in range(3) for kv in ("key", "value")}
        tensors["past_key_values.2.value"] = tensors["past_key_values.2.value"].astype(np.int32)
        save_file(tensors, "late.safetensors")
        (skip,) = hmem.import_files(s, ["late.safetensors"], chunk_tokens=2).skipped
        assert "I32" in skip.skipped
        assert len(s.entry_ids()) == 1
        s.flush()
    with hmem.Store.open("store", read_only=True) as s:
        assert len(s.entry_ids()) == 1


# ---- export in the model's layout ----------------------------------------------------------


def _filled(rng) -> tuple[list[np.ndarray], list[np.ndarray]]:
    keys = [randn(rng, n, E) for n in (3, 5, 2, 4)]
    values = [randn(rng, n, E) for n in (3, 5, 2, 4)]
    with new_store() as s:
        s.put_many([hmem.Entry(k, v, 2) for k, v in zip(keys, values)])
    return keys, values


def test_export_hf_round_trips_through_put(rng):
    keys, values = _filled(rng)
    np.save("q.npy", keys[1])
    doc = run_json(
        "query",
        "store",
        "--query",
        "q.npy",
        "--layer",
        2,
        "--top-k",
        3,
        "--export",
        "hits.safetensors",
        "--export-layout",
        "hf",
        "--kv-heads",
        H,
    )
    ids = [r["entry_id"] for r in doc["results"]]
    assert len(ids) == 3 and ids[0] == 2  # the best hit is the query's own entry
    with hmem.Store.open("store", read_only=True) as s:
        ranked = [s.get(i) for i in ids]
    want_k = np.concatenate([np.array(e.keys) for e in ranked])  # along tokens, in rank order
    want_v = np.concatenate([np.array(e.values) for e in ranked])
    tensors = load_file("hits.safetensors")
    assert sorted(tensors) == ["past_key_values.2.key", "past_key_values.2.value"]
    got = tensors["past_key_values.2.key"]
    assert got.shape == (1, H, len(want_k), HD) and got.dtype == F32
    np.testing.assert_array_equal(got[0, 1], want_k[:, HD : 2 * HD])  # head 1 of every token
    # back in through `hmem put`: one entry of layer 2 with the same rows
    new_store("again").close()
    assert run_json("put", "again", "hits.safetensors")["entries_added"] == 1
    with hmem.Store.open("again", read_only=True) as s:
        assert_entries(stored(s), [(2, want_k, want_v, {"source": "hits.safetensors", "tokens": [0, len(want_k)]})])
    with safe_open("hits.safetensors", "np") as f:
        meta = f.metadata()
    assert (meta["layout"], meta["kv_heads"], json.loads(meta["entry_ids"])) == ("hf", str(H), ids)
    assert json.loads(meta["entry_tokens"]) == [len(np.array(e.keys)) for e in ranked]


def test_the_default_export_is_unchanged(rng):
    keys, _ = _filled(rng)
    np.save("q.npy", keys[0])
    run_json("query", "store", "--query", "q.npy", "--layer", 2, "--top-k", 2, "--export", "hits.safetensors")
    names = sorted(load_file("hits.safetensors"))
    assert len(names) == 4 and all(re.fullmatch(r"[kv]_\d+", n) for n in names)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--export-layout", "hf"], "--export-layout hf needs --kv-heads N"),
        (["--kv-heads", 4], "--kv-heads applies to --export-layout hf only"),
        (["--export-layout", "bhtd", "--kv-heads", 4], "--export-layout must be one of entries, hf"),
        (["--export-layout", "hf", "--kv-heads", 5], "--kv-heads 5 does not divide the store's embed_dim 32"),
    ],
)
def test_bad_export_options_are_usage_errors_and_write_nothing(args, fragment, rng):
    keys, _ = _filled(rng)
    np.save("q.npy", keys[0])
    result = run("query", "store", "--query", "q.npy", "--layer", 2, "--export", "hits.safetensors", *args)
    assert result.exit_code == ExitCode.USAGE, result.stdout + result.stderr
    assert fragment in result.stderr and result.stdout == ""
    assert not Path("hits.safetensors").exists()
    no_file = run("query", "store", "--query", "q.npy", "--layer", 2, "--export-layout", "hf", "--kv-heads", 4)
    assert no_file.exit_code == ExitCode.USAGE and "give --export FILE" in no_file.stderr


def test_export_results_in_the_library(rng):
    keys, values = _filled(rng)
    with hmem.Store.open("store", read_only=True) as s:
        results = s.query(keys[3], 2, top_k=2)
    with pytest.raises(hmem.InvalidArgumentError, match="kv_heads"):
        hmem.export_results(results, Path("x.safetensors"), layout="hf")
    with pytest.raises(hmem.InvalidArgumentError, match="heads of equal size"):
        hmem.export_results(results, Path("x.safetensors"), layout="hf", kv_heads=3)
    assert not Path("x.safetensors").exists()
    hmem.export_results(results, Path("x.safetensors"), layout="hf", kv_heads=2)
    back = hmem.cache_tensors([[(r.keys, r.values) for r in results]], 2, framework="numpy")
    np.testing.assert_array_equal(load_file("x.safetensors")["past_key_values.2.key"], back[0][0])
