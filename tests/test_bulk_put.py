"""The bulk put path (docs/architecture.md, "Writing"): the batch kernels
against their pure-Python twins on every CPU path (signatures of many
entries, CRC-32C of many pieces, a shard header's text, the scan and join
of a batch's entries), and put_many of
many entries against one put per entry: the same signatures, records and
K/V, shards that any safetensors reader opens, and bad entries named and
refused with the store unchanged."""

from __future__ import annotations

import errno
import gc
import json
import os
import struct
import sys
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hmem
from hmem import _io
from hmem.formats import safetensors
from hmem.kernels._native import _checksum, _header_text, _projection
from hmem.kernels._native import _entries as native_entries
from hmem.kernels.reference import checksum as ref_checksum
from hmem.kernels.reference import entries as ref_entries
from hmem.kernels.reference import header_text as ref_header_text
from hmem.kernels.reference import projection as ref_projection
from hmem.store.projection import Projector, block_size

# ---- signatures of many entries ------------------------------------------------


def _rows(rng: np.random.Generator, n: int, d: int, style: str) -> np.ndarray:
    if style == "integers":  # sums that cancel exactly, zeros in the transform
        x = rng.integers(-2, 3, (n, d)).astype(np.float32)
    elif style == "wide":  # magnitudes far apart: rounding order matters
        x = rng.standard_normal((n, d)) * 10.0 ** rng.integers(-20, 20, (n, d))
    else:
        x = rng.standard_normal((n, d))
    return np.ascontiguousarray(x, dtype=np.float32)


@st.composite
def many_cases(draw):
    d = draw(st.sampled_from([1, 3, 63, 64, 100, 300]))
    m = block_size(d) * draw(st.sampled_from([1, 1, 2]))
    rounds = draw(st.integers(1, 3))
    hdc_dim = draw(st.sampled_from([8, 64, m, m + 64, 3 * m, 2 * m + 8]))
    tokens = draw(st.lists(st.integers(1, 5), min_size=0, max_size=19))  # partial groups of four and eight lanes
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = _rows(rng, sum(tokens), d, draw(st.sampled_from(["normal", "integers", "wide"])))
    starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    return rows, starts, m, rounds, hdc_dim, draw(st.integers(0, 2**64 - 1))


def _one_by_one(module, rows, starts, signs, m, rounds, hdc_dim):
    count = len(starts) - 1
    out = np.zeros((count, hdc_dim // 8), np.uint8)
    sums = np.zeros((count, rows.shape[1]))
    for e in range(count):
        module.signature(rows[starts[e] : starts[e + 1]], signs, m, rounds, hdc_dim, out[e], sums[e])
    return out, sums


def _many(module, rows, starts, signs, m, rounds, hdc_dim):
    count = len(starts) - 1
    out = np.full((count, hdc_dim // 8), 0xAA, np.uint8)  # every byte must be written
    sums = np.full((count, rows.shape[1]), np.nan)
    module.signature_many(rows, starts, signs, m, rounds, hdc_dim, out, sums)
    return out, sums


@settings(max_examples=60)
@given(case=many_cases())
def test_signature_many_is_bit_identical_to_one_signature_per_entry_on_every_path(case, on_every_cpu_path):
    rows, starts, m, rounds, hdc_dim, seed = case
    signs = ref_projection.signs_table(seed, m, rounds, -(-hdc_dim // m))
    want_out, want_sums = _one_by_one(ref_projection, rows, starts, signs, m, rounds, hdc_dim)
    got_ref = _many(ref_projection, rows, starts, signs, m, rounds, hdc_dim)
    assert got_ref[0].tobytes() == want_out.tobytes() and got_ref[1].tobytes() == want_sums.tobytes()
    for path, (out, sums) in on_every_cpu_path(
        lambda: _many(_projection, rows, starts, signs, m, rounds, hdc_dim)
    ).items():
        assert out.tobytes() == want_out.tobytes(), f"signatures differ on {path} ({_projection.variant()})"
        assert sums.tobytes() == want_sums.tobytes(), f"token sums differ on {path}"


def test_signature_many_at_the_store_sizes_on_every_path(on_every_cpu_path):
    rng = np.random.default_rng(5)
    for d, hdc_dim, tokens in ((64, 4096, [4] * 17), (128, 4096, [1, 16, 3, 2, 7]), (3584, 1024, [2, 1, 3])):
        m = block_size(d)
        signs = ref_projection.signs_table(d, m, 3, -(-hdc_dim // m))
        rows = _rows(rng, sum(tokens), d, "normal")
        starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        want, _ = _one_by_one(_projection, rows, starts, signs, m, 3, hdc_dim)  # the single kernel, twin-tested
        for path, (out, _) in on_every_cpu_path(lambda: _many(_projection, rows, starts, signs, m, 3, hdc_dim)).items():
            np.testing.assert_array_equal(out, want, err_msg=f"{path}, d={d}")


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
@pytest.mark.parametrize(
    "starts, message",
    [
        ([0, 2, 2, 4], "entry 1 has no rows"),
        ([0, 3, 2, 4], "no rows"),
        ([1, 2, 4], "from 0 to the row count"),
        ([0, 2, 3], "from 0 to the row count"),
    ],
)
def test_signature_many_refuses_bad_starts(module, starts, message):
    rows = np.ones((4, 8), np.float32)
    signs = ref_projection.signs_table(0, 64, 3, 1)
    count = len(starts) - 1
    out = np.zeros((count, 8), np.uint8)
    with pytest.raises(ValueError, match=message):
        module.signature_many(rows, np.array(starts, np.int64), signs, 64, 3, 64, out)
    assert not out.any()


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
def test_signature_many_checks_its_output_shapes(module):
    rows = np.ones((4, 8), np.float32)
    starts = np.array([0, 2, 4], np.int64)
    signs = ref_projection.signs_table(0, 64, 3, 1)
    with pytest.raises(ValueError, match="out must be"):
        module.signature_many(rows, starts, signs, 64, 3, 64, np.zeros((3, 8), np.uint8))
    with pytest.raises(ValueError, match="sums must be"):
        module.signature_many(rows, starts, signs, 64, 3, 64, np.zeros((2, 8), np.uint8), np.zeros((2, 7)))


def test_projector_signatures_of_a_batch_match_one_entry_at_a_time_across_threads():
    projector = Projector(48, 512, seed=7)
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 6, 1500)  # more than one thread's share
    rows = rng.standard_normal((int(tokens.sum()), 48)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    signatures, means = projector.signatures_and_means(rows, starts)
    for e in (0, 1, 749, 750, 751, 1499):
        signature, mean = projector.signature_and_mean(rows[starts[e] : starts[e + 1]])
        assert signatures[e].tobytes() == signature.tobytes()
        assert means[e].tobytes() == mean.tobytes()


# ---- checksums of many pieces --------------------------------------------------


@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_crc32c_pieces_match_one_checksum_per_piece(data, cuts):
    bounds = np.array(sorted({0, len(data), *(min(c, len(data)) for c in cuts)}), np.int64)
    want = [ref_checksum.crc32c(data[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert _checksum.crc32c_pieces(data, bounds).tolist() == want
    assert ref_checksum.crc32c_pieces(data, bounds).tolist() == want


@pytest.mark.parametrize("module", [_checksum, ref_checksum], ids=["native", "reference"])
def test_crc32c_pieces_refuses_pieces_outside_the_data(module):
    for bounds in ([0, 11], [3, 2], [-1, 4]):
        with pytest.raises(ValueError, match="not inside"):
            module.crc32c_pieces(b"0123456789", np.array(bounds, np.int64))
    with pytest.raises(ValueError, match="at least one"):
        module.crc32c_pieces(b"", np.zeros(0, np.int64))


# ---- a shard header's text -----------------------------------------------------

ints = st.integers(-(2**63), 2**63 - 1)


@given(
    rows=st.lists(st.tuples(ints, ints, ints, ints, ints), max_size=6),
    rank=st.integers(0, 2),
    crcs=st.lists(st.integers(0, 2**32 - 1), min_size=6, max_size=6),
)
def test_header_text_matches_its_twin_and_is_json(rows, rank, crcs):
    ids = np.array([r[0] for r in rows], np.int64)
    shapes = np.array([r[1 : 1 + rank] for r in rows], np.int64).reshape(len(rows), rank)
    begins = np.array([r[3] for r in rows], np.int64)
    ends = np.array([r[4] for r in rows], np.int64)
    text = _header_text.tensor_entries(b"k_", ids, b"F32", shapes, begins, ends)
    assert text == ref_header_text.tensor_entries(b"k_", ids, b"F32", shapes, begins, ends)
    parsed = json.loads(b"{" + text[:-1] + b"}") if rows else {}
    assert [(name, e["shape"], e["data_offsets"]) for name, e in parsed.items()] == [
        (f"k_{r[0]}", list(r[1 : 1 + rank]), [r[3], r[4]]) for r in {f"k_{r[0]}": r for r in rows}.values()
    ]
    crc = np.array(crcs[: len(rows)], np.uint32)
    crc_text = _header_text.crc_entries(b"crc32c:k_", ids, crc)
    assert crc_text == ref_header_text.crc_entries(b"crc32c:k_", ids, crc)
    assert json.loads(b"{" + crc_text[:-1] + b"}") == {f"crc32c:k_{i}": f"{c:08x}" for i, c in zip(ids, crc)}


def test_header_text_of_the_widest_numbers_and_many_dimensions():
    # every number at its longest (a sign and 19 digits), 40 dimensions: the
    # native formatter must size its buffer for all of it
    low = np.full(3, -(2**63), np.int64)
    shapes = np.full((3, 40), -(2**63), np.int64)
    args = (b"k" * 50 + b"_", low, b"BF16", shapes, low, low)
    assert _header_text.tensor_entries(*args) == ref_header_text.tensor_entries(*args)


@pytest.mark.parametrize("module", [_header_text, ref_header_text], ids=["native", "reference"])
def test_header_text_refuses_names_that_would_break_the_json(module):
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="quotes"):
        module.tensor_entries(b'k"_', one, b"F32", np.zeros((1, 1), np.int64), one, one)
    with pytest.raises(ValueError, match="quotes"):
        module.crc_entries(b"k\\", one, np.zeros(1, np.uint32))
    with pytest.raises(ValueError, match="one row per tensor"):
        module.tensor_entries(b"k_", one, b"F32", np.zeros((2, 1), np.int64), one, one)


# ---- the scan and join of a batch's entries ------------------------------------

U32_MAX, F32_MAX = hmem.validation.U32_MAX, hmem.validation.F32_MAX

# What an entry can be instead of the common form (each makes the scan stop there).
_DEFECTS = {
    "entry with meta": lambda k, v, layer, w: hmem.Entry(k, v, layer, w, {"chunk": 1}),
    "another named tuple": lambda k, v, layer, w: _Other(k, v, layer, w),
    "list": lambda k, v, layer, w: [k, v, layer, w],
    "short tuple": lambda k, v, layer, w: (k, v, layer),
    "float64 keys": lambda k, v, layer, w: (k.astype(np.float64), v, layer, w),
    "big-endian values": lambda k, v, layer, w: (k, v.astype(">f4"), layer, w),
    "not C order": lambda k, v, layer, w: (
        (np.asfortranarray(np.concatenate([k, k])), np.concatenate([v, v]), layer, w)
        if k.shape[0] == 1
        else (k[::-1], v, layer, w)
    ),
    "a row view of a wider array": lambda k, v, layer, w: (
        np.concatenate([k, k], axis=1)[:, : k.shape[1]],
        v,
        layer,
        w,
    ),
    "1-D keys": lambda k, v, layer, w: (k.ravel(), v.ravel(), layer, w),
    "shapes differ": lambda k, v, layer, w: (k, np.concatenate([v, v]), layer, w),
    "no rows": lambda k, v, layer, w: (k[:0], v[:0], layer, w),
    "a subclass": lambda k, v, layer, w: (k.view(_Sub), v, layer, w),
    "numpy layer": lambda k, v, layer, w: (k, v, np.int64(layer), w),
    "bool layer": lambda k, v, layer, w: (k, v, True, w),
    "negative layer": lambda k, v, layer, w: (k, v, -1, w),
    "layer too large": lambda k, v, layer, w: (k, v, U32_MAX + 1, w),
    "int importance": lambda k, v, layer, w: (k, v, layer, 1),
    "nan importance": lambda k, v, layer, w: (k, v, layer, float("nan")),
    "negative importance": lambda k, v, layer, w: (k, v, layer, -0.5),
    "importance too large": lambda k, v, layer, w: (k, v, layer, 1e39),
    "not an array": lambda k, v, layer, w: (k.tolist(), v, layer, w),
}


class _Sub(np.ndarray):
    pass


class _Other(NamedTuple):
    keys: Any
    values: Any
    layer: int
    importance: float


@st.composite
def entry_lists(draw):
    dim = draw(st.sampled_from([1, 3, 16]))
    count = draw(st.integers(0, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    items = []
    for _i in range(count):
        n = int(rng.integers(1, 4))
        k, v = (rng.standard_normal((n, dim)).astype(np.float32) for _ in range(2))
        if draw(st.booleans()):
            k.flags.writeable = False  # read-only rows (a file's memory map) are of the common form too
        item = (k, v, int(rng.integers(0, 5)), float(rng.random() * 4))
        if draw(st.integers(0, 5)) == 0:
            item = _DEFECTS[draw(st.sampled_from(sorted(_DEFECTS)))](*item)
        elif draw(st.booleans()):
            item = hmem.Entry(*item)  # without meta: the common form too
        items.append(item)
    return items, dim


def _scan(module, items, dim):
    tokens, layers, weights = np.full(len(items), -7), np.full(len(items), -7), np.full(len(items), -7.0)
    first = module.scan_entries(items, dim, U32_MAX, U32_MAX, F32_MAX, tokens, layers, weights, hmem.Entry)
    return first, tokens[:first].tolist(), layers[:first].tolist(), weights[:first].tolist()


@settings(max_examples=150)
@given(case=entry_lists())
def test_scan_and_join_of_entries_match_the_reference(case):
    items, dim = case
    native, reference = _scan(native_entries, items, dim), _scan(ref_entries, items, dim)
    assert native == reference
    first, tokens, layers, weights = native
    # the scan stops exactly at the first entry not in the common form
    if first < len(items):
        assert _scan(ref_entries, [items[first]], dim)[0] == 0
    for i in range(first):
        k, v, layer, weight = items[i][:4]
        assert (tokens[i], layers[i], weights[i]) == (k.shape[0], layer, weight)
    starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    joined = {}
    for module in (native_entries, ref_entries):
        k_out = np.full((int(starts[-1]), dim), np.nan, np.float32)
        v_out = np.full_like(k_out, np.nan)
        module.join_rows(items[:first], starts, k_out, v_out, hmem.Entry)
        joined[module] = (k_out.tobytes(), v_out.tobytes())
    want_k = np.concatenate([items[i][0] for i in range(first)] or [np.zeros((0, dim), np.float32)])
    want_v = np.concatenate([items[i][1] for i in range(first)] or [np.zeros((0, dim), np.float32)])
    assert joined[native_entries] == joined[ref_entries] == (want_k.tobytes(), want_v.tobytes())


@pytest.mark.parametrize("defect", sorted(_DEFECTS))
def test_the_scan_stops_at_each_entry_not_in_the_common_form(defect):
    rng = np.random.default_rng(2)
    items = [
        (rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32), 1, 0.5)
        for _ in range(4)
    ]
    items[2] = _DEFECTS[defect](*items[2])
    for module in (native_entries, ref_entries):
        assert _scan(module, items, 8)[0] == 2, module


def test_the_common_form_takes_read_only_rows_entries_and_ranges_edges():
    rows = np.ones((3, 8), np.float32)
    frozen = rows.copy()
    frozen.flags.writeable = False
    items = [(frozen, frozen, 0, 0.0), hmem.Entry(rows, rows, U32_MAX, F32_MAX), (rows[1:], rows[1:], 7, 2.5)]
    for module in (native_entries, ref_entries):
        assert _scan(module, items, 8) == (3, [3, 3, 2], [0, U32_MAX, 7], [0.0, F32_MAX, 2.5])


@pytest.mark.parametrize("module", [native_entries, ref_entries], ids=["native", "reference"])
def test_join_rows_refuses_entries_changed_since_the_scan_and_bad_offsets(module):
    rows = np.ones((2, 4), np.float32)
    items = [(rows, rows, 0, 1.0), (rows, rows, 0, 1.0)]
    starts = np.array([0, 2, 4], np.int64)
    k_out, v_out = np.zeros((4, 4), np.float32), np.zeros((4, 4), np.float32)
    changed = [items[0], (rows[:1], rows[:1], 0, 1.0)]
    with pytest.raises(ValueError, match="entry 1 is not as scan_entries found it"):
        module.join_rows(changed, starts, k_out, v_out)
    assert not k_out.any() and not v_out.any()  # nothing copied
    with pytest.raises(ValueError, match="from 0 to the output's row count"):
        module.join_rows(items, np.array([0, 2, 3], np.int64), k_out, v_out)
    with pytest.raises(ValueError, match="len\\(items\\) \\+ 1 offsets"):
        module.join_rows(items, np.array([0, 4], np.int64), k_out, v_out)
    with pytest.raises(ValueError, match="must hold 2 values each"):
        module.scan_entries(
            items, 4, U32_MAX, U32_MAX, F32_MAX, np.zeros(1, np.int64), np.zeros(2, np.int64), np.zeros(2)
        )


def test_every_form_of_an_entry_stores_the_same(store_factory):
    # put_many scans a batch of tuples and Entry without meta natively (hmem/store/prepare.py,
    # _common_form) and takes any other batch entry by entry: the same store.
    rng = np.random.default_rng(12)
    entries = _entries(rng, 40, 16)
    forms = {
        "tuples": entries,
        "Entry": [hmem.Entry(*e) for e in entries],
        "a generator": (e for e in entries),
        "one list among tuples": entries[:20] + [list(entries[20])] + entries[21:],
        "one Entry with meta": entries[:20] + [hmem.Entry(*entries[20], meta={"chunk": 3})] + entries[21:],
    }
    stored = {}
    for name, batch in forms.items():
        store = store_factory(name, embed_dim=16)
        ids = store.put_many(batch)
        store.flush()
        stored[name] = [
            (
                store.get(i).keys.tobytes(),
                store.get(i).values.tobytes(),
                store.get(i).info.layer_idx,
                store.get(i).info.importance,
                store.get(i).info.n_tokens,
            )
            for i in ids
        ]
        stored[name].append([r.entry_id for r in store.query(entries[3][0], 1, top_k=5)])
    assert all(value == stored["tuples"] for value in stored.values())


# ---- put_many as a whole -------------------------------------------------------


def _entries(rng, count, dim, max_tokens=5, min_tokens=1):
    return [
        (
            rng.standard_normal((int(t), dim)).astype(np.float32),
            rng.standard_normal((int(t), dim)).astype(np.float32),
            i % 3,
            float(i % 7) + 0.5,
        )
        for i, t in enumerate(rng.integers(min_tokens, max_tokens + 1, count))
    ]


# Small entries are joined and converted batch-wide; large ones (64 KiB of
# keys and more on average) one by one (hmem/store/prepare.py): both ways.
SIZES = {"small": dict(max_tokens=5), "large": dict(min_tokens=1100, max_tokens=1300)}


@pytest.mark.parametrize("size, joined", [("small", True), ("large", False)])
def test_the_sizes_take_both_ways(store_factory, store_internals, size, joined):
    store = store_factory(embed_dim=16)
    assert store_internals.prepared_joined(store, _entries(np.random.default_rng(1), 5, 16, **SIZES[size])) is joined


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("storage", ["f32", "f16", "bf16", "int8"])
def test_put_many_stores_what_one_put_per_entry_stores(store_factory, storage, size):
    entries = _entries(np.random.default_rng(3), 300 if size == "small" else 30, 24, **SIZES[size])
    bulk = store_factory("bulk", embed_dim=24, storage_dtype=storage)
    single = store_factory("single", embed_dim=24, storage_dtype=storage)
    ids = bulk.put_many(entries)
    assert ids == [single.put(*entry) for entry in entries]
    for store in (bulk, single):
        store.flush()
    for entry_id in ids[::7] + ids[-3:]:
        a, b = bulk.get(entry_id), single.get(entry_id)
        assert a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes()
        assert (a.info.layer_idx, a.info.n_tokens, a.info.importance) == (
            b.info.layer_idx,
            b.info.n_tokens,
            b.info.importance,
        )
    query = entries[10][0]
    assert [r.entry_id for r in bulk.query(query, 1, top_k=5)] == [r.entry_id for r in single.query(query, 1, top_k=5)]
    bulk.close()
    report = hmem.verify(bulk.path, full=True)
    assert report.ok and report.tensors_checked >= 3 * len(entries)


def test_put_many_over_several_shards_reads_back_and_opens_in_a_safetensors_reader(tmp_path):
    rng = np.random.default_rng(4)
    entries = _entries(rng, 400, 16, max_tokens=8)
    with hmem.Store.create(tmp_path / "s", embed_dim=16, hdc_dim=256, shard_max_bytes=64 << 10) as store:
        first = store.put_many(entries[:150])
        second = store.put_many(entries[150:])  # rolls over the open shard, several times
        ids = first + second
        for entry_id, (keys, values, _layer, _importance) in zip(ids, entries):
            got = store.get(entry_id)  # from the open shard or a sealed one
            assert got.keys.tobytes() == keys.tobytes() and got.values.tobytes() == values.tobytes()
    shards = sorted((tmp_path / "s").glob("shard_*.safetensors"))
    assert len(shards) > 3
    seen = set()
    for shard in shards:
        # The format test reads the files themselves: the header must be
        # strict safetensors with tensors back to back, and each tensor's
        # recorded CRC must be its bytes'.
        buf = shard.read_bytes()
        header = safetensors.parse(buf, contiguous=True)
        for name, spec in header.tensors.items():
            data = buf[header.data_start + spec.begin : header.data_start + spec.end]
            assert int(header.metadata["crc32c:" + name], 16) == _checksum.crc32c(data)
            if name.startswith("k_"):
                entry = entries[ids.index(int(name[2:]))]
                assert data == entry[0].tobytes()
                seen.add(int(name[2:]))
        (length,) = struct.unpack_from("<Q", buf, 0)
        assert (8 + length) % 8 == 0
    assert seen == set(ids)
    assert hmem.verify(tmp_path / "s", full=True).ok
    with hmem.Store.open(tmp_path / "s") as store:
        assert store.stats().entries == 400


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda e: (np.full_like(e[0], np.nan), e[1], 0, 1.0), "entry 5: keys holds NaN or infinite values"),
        (
            lambda e: (
                e[0],
                np.where(np.arange(e[1].size).reshape(e[1].shape) == 3, np.inf, e[1]).astype(np.float32),
                0,
                1.0,
            ),
            "entry 5: values holds NaN or infinite values",
        ),
        (lambda e: (e[0], e[1][:, :8], 0, 1.0), "entry 5: .*differ in shape|entry 5: values has rows of 8"),
        (lambda e: (e[0], e[1], -1, 1.0), "entry 5: layer_idx"),
        (lambda e: (e[0], e[1], 0, float("nan")), "entry 5: importance"),
        (lambda e: (e[0].astype(np.int32), e[1], 0, 1.0), "entry 5: keys must hold floats"),
        (lambda e: ("keys", e[1], 0, 1.0), "entry 5: keys must be a numpy array"),
    ],
)
@pytest.mark.parametrize("size", SIZES)
def test_a_bad_entry_is_named_and_the_batch_stores_nothing(store_factory, snapshot_dir, bad, message, size):
    store = store_factory(embed_dim=16)
    store.put_many(_entries(np.random.default_rng(6), 4, 16))
    store.flush()
    before = snapshot_dir(store.path)
    entries = _entries(np.random.default_rng(7), 9, 16, **SIZES[size])
    entries[5] = bad(entries[5])
    with pytest.raises(hmem.InvalidArgumentError, match=message):
        store.put_many(entries)
    store.flush()
    assert store.stats().entries == 4
    assert snapshot_dir(store.path) == before


@pytest.mark.parametrize("size", SIZES)
def test_an_entry_too_large_for_f16_is_named(store_factory, size):
    store = store_factory(embed_dim=16, storage_dtype="f16")
    entries = _entries(np.random.default_rng(8), 6, 16, **SIZES[size])
    entries[4] = (entries[4][0] * 1e6, entries[4][1], 0, 1.0)
    with pytest.raises(hmem.InvalidTensorError, match="entry 4: keys holds values too large"):
        store.put_many(entries)
    assert store.stats().entries == 0


def test_put_many_takes_other_float_dtypes_and_layouts(store_factory):
    rng = np.random.default_rng(9)
    store = store_factory(embed_dim=16)
    keys = rng.standard_normal((3, 16))  # float64, rounded to float32
    values = np.asfortranarray(rng.standard_normal((3, 16)).astype(np.float32))  # not C order
    half = rng.standard_normal((2, 16)).astype(np.float16)
    ids = store.put_many([(keys, values, 0, 1.0), (half, half, 1, 2.0), (keys[::-1], values[::-1], 2, 1.0)])
    assert store.get(ids[0]).keys.tobytes() == keys.astype(np.float32).tobytes()
    assert store.get(ids[0]).values.tobytes() == np.ascontiguousarray(values).tobytes()
    assert store.get(ids[1]).keys.tobytes() == half.astype(np.float32).tobytes()
    assert store.get(ids[2]).keys.tobytes() == keys[::-1].astype(np.float32).tobytes()


# ---- shards sealed in the background ----------------------------------------------------------


HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)


def _wait_until_waiting(thread_id: int) -> None:
    """Wait until the thread `thread_id` waits on a threading primitive (an
    Event, a Condition, a join: its innermost Python frame is in the
    threading module), as a writer waiting for a held seal does.  A poll for
    an event, not for a duration: HANG_GUARD is a hang guard only."""
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread_id)
        if frame is None:
            raise AssertionError("the thread ended instead of waiting")
        if frame.f_code.co_filename == threading.__file__:
            return
        time.sleep(0.001)
    raise AssertionError("the thread never waited")


def _release_once_waiting(hook: _SealThreadHook, thread_id: int) -> threading.Thread:
    """Let the held seal go once the thread `thread_id` waits (for it); a
    thread that never waits leaves it held, so that the test sees it went on."""

    def release() -> None:
        try:
            assert hook.held.wait(HANG_GUARD)
            _wait_until_waiting(thread_id)
        finally:
            hook.release.set()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    return releaser


class _SealThreadHook:
    """A fault hook (hmem/_io.py) acting only in the thread that writes and
    finishes a put's seal ("hmem-seal"): it holds the fsync there until released, or
    fails `fail_op` on the temporary file with `fail_errno` (`fail` times)."""

    def __init__(
        self, *, hold: bool = False, fail: int = 0, fail_op: str = "fsync", fail_errno: int = errno.EIO
    ) -> None:
        self.release = threading.Event()
        self.held = threading.Event()
        self.failed = threading.Event()
        self.hold, self.fail, self.fail_op, self.fail_errno = hold, fail, fail_op, fail_errno
        self.seal_ops: list[tuple[str, str]] = []

    def __call__(self, op: str, path: str) -> None:
        if threading.current_thread().name != "hmem-seal":
            return
        self.seal_ops.append((op, os.path.basename(path)))
        if not os.path.basename(path).startswith(_io.TEMP_PREFIX):
            return
        if self.hold and op == "fsync":
            self.held.set()
            assert self.release.wait(HANG_GUARD)
        if self.fail and op == self.fail_op:
            self.fail -= 1
            self.failed.set()
            raise OSError(self.fail_errno, os.strerror(self.fail_errno), path)


def _holds_exactly(path, ids: list[int], entries: list[tuple]) -> None:
    """The store at `path` verifies clean and holds exactly these entries,
    each with its K/V bit for bit and its layer."""
    assert hmem.verify(path, full=True).ok
    with hmem.Store.open(path, read_only=True) as store:
        assert store.stats().entries == len(entries)
        for entry_id, (keys, values, layer, _) in zip(ids, entries, strict=True):
            got = store.get(entry_id)
            assert got.keys.tobytes() == keys.tobytes() and got.values.tobytes() == values.tobytes()
            assert got.info.layer_idx == layer


@pytest.fixture
def seal_hook():
    hooks: list[_SealThreadHook] = []

    def install(**kwargs: Any) -> _SealThreadHook:
        hook = _SealThreadHook(**kwargs)
        hooks.append(hook)
        _io.set_fault_hook(hook)
        return hook

    yield install
    for hook in hooks:
        hook.release.set()
    _io.set_fault_hook(None)


def test_a_shard_sealed_in_the_background_is_read_from_memory_until_its_file_is_durable(tmp_path, seal_hook):
    rng = np.random.default_rng(11)
    entries = _entries(rng, 30, 16, max_tokens=8)
    hook = seal_hook(hold=True)
    path = tmp_path / "s"
    with hmem.Store.create(path, embed_dim=16, hdc_dim=256, shard_max_bytes=32 << 10) as store:
        ids = store.put_many(entries)  # fills shard 0 (sealed in the background) and begins shard 1
        assert hook.held.wait(HANG_GUARD)  # the seal's fsync is held: the put returned before it
        assert not (path / "shard_0000.safetensors").exists()
        for entry_id, (keys, values, _, _) in zip(ids, entries):
            got = store.get(entry_id)  # shard 0's from the sealing builder's memory
            assert got.keys.tobytes() == keys.tobytes() and got.values.tobytes() == values.tobytes()
        found = store.query(entries[0][0], layer_idx=entries[0][2], top_k=1)
        assert found[0].entry_id == ids[0] and found[0].keys.tobytes() == entries[0][0].tobytes()
        stats = store.stats()
        assert stats.health.ok, stats.health.problems  # a shard being sealed is not a missing one
        assert stats.unflushed == 30 and [sh.entries for sh in stats.shards][0] < 30
        hook.release.set()
        store.flush()  # waits for the seal, then commits
        # all on the seal's thread: the file written, synced, renamed, then its directory synced
        assert [op for op, _ in hook.seal_ops] == ["open", "write", "fsync", "rename", "open", "fsync"]
        assert (path / "shard_0000.safetensors").exists()
        assert not [p for p in path.iterdir() if p.name.startswith(_io.TEMP_PREFIX)]
    assert hmem.verify(path, full=True).ok
    with hmem.Store.open(path, read_only=True) as store:
        assert store.stats().entries == 30
        got = store.get(ids[0])
        assert got.keys.tobytes() == entries[0][0].tobytes()


@pytest.mark.parametrize("failures", [1, 2], ids=["once", "twice"])
@pytest.mark.parametrize(
    "fail_op, fail_errno", [("fsync", errno.EIO), ("write", errno.ENOSPC)], ids=["fsync-EIO", "write-ENOSPC"]
)
def test_a_background_seal_that_fails_is_written_again_from_memory(tmp_path, seal_hook, failures, fail_op, fail_errno):
    """A failed write or fsync may leave the bytes off the disk: the flush
    writes the whole file again from the builder's memory.  When that fails
    too, the flush raises, nothing is committed, and the next flush succeeds."""
    rng = np.random.default_rng(12)
    entries = _entries(rng, 30, 16, max_tokens=8)
    path = tmp_path / "s"
    hmem.Store.create(path, embed_dim=16, hdc_dim=256, shard_max_bytes=32 << 10).close()
    store = hmem.Store.open(path)
    try:
        hook = seal_hook(fail=1, fail_op=fail_op, fail_errno=fail_errno)
        ids = store.put_many(entries)  # the put itself succeeds: shard 0's seal fails on its thread
        assert hook.failed.wait(HANG_GUARD)
        if failures == 2:
            real = hook

            def fail_the_rewrite(op: str, file: str) -> None:
                real(op, file)
                if op == fail_op and os.path.basename(file).startswith(_io.TEMP_PREFIX + "shard_0000"):
                    raise OSError(fail_errno, os.strerror(fail_errno), file)

            _io.set_fault_hook(fail_the_rewrite)
            with pytest.raises(hmem.StorageError) as caught:
                store.flush()
            assert caught.value.errno == fail_errno and "shard_0000.safetensors" in str(caught.value)
            with hmem.Store.open(path, read_only=True) as reader:
                assert reader.stats().entries == 0  # nothing committed
            assert store.get(ids[0]).keys.tobytes() == entries[0][0].tobytes()  # still there, in memory
            _io.set_fault_hook(None)
        store.flush()
        # the seal's thread failed at fail_op, and its temporary file went
        ops = ["open", "write", "fsync"]
        assert hook.fail == 0 and [op for op, _ in hook.seal_ops] == ops[: ops.index(fail_op) + 1]
        assert not [p.name for p in path.iterdir() if p.name.startswith(_io.TEMP_PREFIX)]
        assert store.stats().health.ok
    finally:
        _io.set_fault_hook(None)
        store.close()
    _holds_exactly(path, ids, entries)


def _a_put_whose_seal_is_held(tmp_path, seal_hook, seed: int) -> tuple[hmem.Store, Any, _SealThreadHook]:
    """A new store (left open) after a put of 30 entries whose full shard's
    seal is held at its fsync."""
    entries = _entries(np.random.default_rng(seed), 30, 16, max_tokens=8)
    hook = seal_hook(hold=True)
    path = tmp_path / "s"
    store = hmem.Store.create(path, embed_dim=16, hdc_dim=256, shard_max_bytes=32 << 10)
    store.put_many(entries)
    assert hook.held.wait(HANG_GUARD)
    return store, path, hook


def test_closing_waits_for_a_background_seal(tmp_path, seal_hook):
    store, path, hook = _a_put_whose_seal_is_held(tmp_path, seal_hook, seed=13)
    closer = threading.Thread(target=store.close)
    closer.start()
    _wait_until_waiting(closer.ident)
    assert closer.is_alive() and not (path / "shard_0000.safetensors").exists()  # close waits for the seal
    hook.release.set()
    closer.join(HANG_GUARD)
    assert not closer.is_alive()
    assert hmem.verify(path, full=True).ok
    with hmem.Store.open(path, read_only=True) as reader:
        assert reader.stats().entries == 30


def test_a_put_that_fails_after_a_background_seal_takes_its_shard_back(tmp_path, seal_hook, store_internals):
    rng = np.random.default_rng(14)
    entries = _entries(rng, 30, 16, max_tokens=8)
    hook = seal_hook(hold=True)
    path = tmp_path / "s"
    with hmem.Store.create(path, embed_dim=16, hdc_dim=256, shard_max_bytes=32 << 10) as store:
        releaser = _release_once_waiting(hook, threading.get_ident())
        with store_internals.failing_records_growth(store), pytest.raises(MemoryError):
            store.put_many(entries)
        assert hook.held.is_set() and hook.release.is_set()  # the undo waited for the held seal
        releaser.join(HANG_GUARD)
        assert store.stats().entries == 0 and store.stats().unflushed == 0 and not store.stats().shards
        assert not [p.name for p in path.iterdir() if p.name.startswith(("shard_", _io.TEMP_PREFIX))]
        _io.set_fault_hook(None)
        ids = store.put_many(entries)  # the store goes on as if the failed put never came
    assert hmem.verify(path, full=True).ok
    with hmem.Store.open(path, read_only=True) as store:
        assert store.stats().entries == 30
        assert store.get(ids[-1]).values.tobytes() == entries[-1][1].tobytes()


def test_a_writer_dropped_unclosed_lets_its_lock_go_only_after_a_background_seal(tmp_path, seal_hook):
    store, path, hook = _a_put_whose_seal_is_held(tmp_path, seal_hook, seed=15)
    releaser = _release_once_waiting(hook, threading.get_ident())
    del store  # never closed: its lock goes back when it is collected
    gc.collect()
    assert hook.release.is_set()  # the lock went back only once the seal had finished
    releaser.join(HANG_GUARD)
    _io.set_fault_hook(None)
    with hmem.Store.open(path) as again:  # nothing was committed; the next writer removes the leftovers
        assert again.stats().entries == 0
    assert not [p.name for p in path.iterdir() if p.name.startswith(("shard_", _io.TEMP_PREFIX))]


def test_a_flush_writes_its_new_records_a_batch_at_a_time(tmp_path, monkeypatch):
    """A flush seals and writes its new records and pooled.bin rows
    ROWS_PER_WRITE at a time in one buffer; a write failing part way
    commits nothing, and the next flush writes them all."""
    from hmem.store import writer

    # Private knob (65,536 rows at a time): lowered so that a small store's
    # flush takes many batches, some of them crossing the puts' boundaries.
    monkeypatch.setattr(writer, "ROWS_PER_WRITE", 40)
    rng = np.random.default_rng(16)
    entries = _entries(rng, 250, 16, max_tokens=4)
    path = tmp_path / "s"
    writes: dict[str, int] = {}
    failing = {"at": 4}

    def count_writes(op: str, file: str) -> None:
        name = os.path.basename(file)
        if op == "write" and name in ("entries.bin", "pooled.bin"):
            writes[name] = writes.get(name, 0) + 1
            if name == "entries.bin" and writes[name] == failing["at"]:
                raise OSError(errno.EIO, os.strerror(errno.EIO), file)

    hmem.Store.create(path, embed_dim=16, hdc_dim=256).close()
    store = hmem.Store.open(path)
    try:
        ids = [i for lo in range(0, 250, 90) for i in store.put_many(entries[lo : lo + 90])]  # puts of 90, 90, 70
        _io.set_fault_hook(count_writes)
        with pytest.raises(hmem.StorageError) as caught:
            store.flush()
        assert caught.value.errno == errno.EIO and "entries.bin" in str(caught.value)
        with hmem.Store.open(path, read_only=True) as reader:
            assert reader.stats().entries == 0  # nothing committed
        failing["at"] = 0
        writes.clear()
        store.flush()
        # 250 records in batches of 40; pooled rows put by put: 40 + 40 + 10, twice, then 40 + 30
        assert writes == {"entries.bin": 7, "pooled.bin": 8}
    finally:
        _io.set_fault_hook(None)
        store.close()
    _holds_exactly(path, ids, entries)
    with hmem.Store.open(path, read_only=True) as store:
        # the re-rank reads each entry's pooled key from pooled.bin: a row
        # out of place would rank another entry first
        for entry_id, (keys, _, layer, _) in list(zip(ids, entries))[::25]:
            assert store.query(keys, layer_idx=layer, top_k=1, shortlist_factor=50)[0].entry_id == entry_id
