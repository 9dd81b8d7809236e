"""INT8 storage (docs/format.md, "INT8 storage"): the native quantize/dequantize kernels against
their pure-numpy reference twins (bit-identical on every CPU path), the
rounding rule on exact ties, shape checks, and what a quantized store gives
back: the error bound, exact zero rows, F32 signatures, a quarter of the
disk, and compaction that copies the INT8 data bit for bit.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from hmem import Store, kernels
from hmem.formats import records
from hmem.kernels._native import _quantize as native
from hmem.kernels.reference import quantize as ref
from hmem.store import quantize

F = np.float32
F32_MAX = float(np.finfo(F).max)
NORMAL_SCALE_PEAK = float(np.finfo(F).tiny) * 128  # rows peaking above this have a normal float32 scale


def run(module, rows):
    rows = np.ascontiguousarray(rows, dtype=F)
    q = np.full(rows.shape, 99, dtype=np.int8)
    scales = np.full(rows.shape[0], np.nan, dtype=F)
    out = np.full(rows.shape, np.nan, dtype=F)
    with np.errstate(over="ignore"):  # near the float32 maximum, 127 * scale can round to inf
        module.quantize_rows(rows, q, scales)
        module.dequantize_rows(q, scales, out)
    return q, scales, out


def assert_same(a, b):
    (qa, sa, oa), (qb, sb, ob) = a, b
    assert qa.dtype == qb.dtype == np.int8 and np.array_equal(qa, qb)
    assert sa.dtype == sb.dtype == F and sa.view(np.uint32).tolist() == sb.view(np.uint32).tolist()
    assert oa.dtype == ob.dtype == F and np.array_equal(oa.view(np.uint32), ob.view(np.uint32))


# ---- matrices -------------------------------------------------------------------------------

any_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
BIG, SMALL = float(F(1e30)), float(F(1e-36))
huge = st.floats(BIG, F32_MAX, width=32) | st.floats(-F32_MAX, -BIG, width=32)
tiny = st.floats(-SMALL, SMALL, width=32)  # subnormals included
unit = st.floats(-4, 4, width=32)


@st.composite
def tie_rows(draw, d):
    """Rows whose scale is exactly 2**e (a peak of 127 * 2**e) and whose
    other values are multiples of half a scale: x / scale lands on .5 ties."""
    e = draw(st.integers(-60, 60))
    halves = draw(st.lists(st.integers(-254, 254), min_size=d, max_size=d))
    row = np.array(halves, dtype=np.float64) / 2
    row[draw(st.integers(0, d - 1))] = draw(st.sampled_from([127.0, -127.0]))
    return (row * 2.0**e).astype(F)


@st.composite
def matrices(draw, max_rows=10, max_cols=70):
    n = draw(st.integers(1, max_rows))
    d = draw(st.integers(1, max_cols))
    elements = [any_f32, huge, tiny, unit, st.one_of(huge, tiny, unit)][draw(st.integers(0, 4))]
    rows = draw(hnp.arrays(F, (n, d), elements=elements))
    for i in draw(st.lists(st.integers(0, n - 1), max_size=n)):
        kind = draw(st.sampled_from(["zero", "negzero", "ties", "ramp"]))
        if kind == "zero":
            rows[i] = 0.0
        elif kind == "negzero":
            rows[i] = -0.0
        elif kind == "ties":
            rows[i] = draw(tie_rows(d))
        else:  # np.arange(d) / 2 * scale
            rows[i] = (np.arange(d) / 2 * draw(st.sampled_from([1.0, 2.0**-20, 2.0**40, 3.0, 0.1]))).astype(F)
    return rows


# ---- native against reference -------------------------------------------------------------------


@settings(max_examples=200)
@given(rows=matrices())
def test_native_matches_reference_on_every_cpu_path(rows, on_every_cpu_path):
    want = run(ref, rows)
    results = on_every_cpu_path(lambda: run(native, rows))
    assert results
    for got in results.values():
        assert_same(got, want)
    assert_same(run(kernels.quantize, rows), want)
    q, scales = quantize.quantize_rows(np.ascontiguousarray(rows))  # what the store calls
    assert np.array_equal(q, want[0]) and np.array_equal(scales.view(np.uint32), want[1].view(np.uint32))
    assert np.array_equal(quantize.dequantize_rows(q, scales).view(np.uint32), want[2].view(np.uint32))


def test_every_cpu_path_is_selected_for_the_quantize_kernels(cpu_paths, on_cpu_path):
    if kernels.KERNEL_SET != "native":
        pytest.skip("HMEM_KERNELS=reference: hmem.kernels does not drive the native module")
    before = kernels.cpu_path()
    for name in cpu_paths:
        with on_cpu_path(name):
            assert native.PATH_NAMES[native.active_path()] == name
    assert kernels.cpu_path() == before
    assert native.PATH_NAMES[native.active_path()] == before


@settings(max_examples=150)
@given(rows=matrices())
@pytest.mark.stress
def test_the_rule_as_documented(rows):
    """scale = max|row| / 127 in float32 (the next smaller float32 when
    127 * scale would overflow); q = round-half-even of x / scale in float32,
    within [-127, 127]; a zero row gives scale 0 and q 0; reads are
    float32(q) * scale, finite."""
    q, scales, out = run(native, rows)
    peak = np.abs(rows).max(axis=1)
    expect_scale = (peak / F(127)).astype(F)
    with np.errstate(over="ignore"):
        top = np.isinf(expect_scale * F(127))
    expect_scale[top] = np.nextafter(expect_scale[top], F(0))
    assert np.isfinite(out).all()
    assert np.array_equal(scales.view(np.uint32), expect_scale.view(np.uint32))
    for i in range(rows.shape[0]):
        if expect_scale[i] == 0:
            assert not q[i].any() and not out[i].any()
            continue
        quotient = (rows[i] / expect_scale[i]).astype(F).astype(np.float64)
        expect_q = [max(-127, min(127, round(float(x)))) for x in quotient]  # round() ties to even
        assert q[i].tolist() == expect_q
        with np.errstate(over="ignore"):  # 127 * scale may round past the float32 maximum
            assert np.array_equal(out[i], (q[i].astype(F) * scales[i]).astype(F))
        if peak[i] >= NORMAL_SCALE_PEAK:  # a normal scale: the documented error bound holds
            with np.errstate(over="ignore"):
                tol = np.float64(scales[i]) / 2 + 4 * np.spacing(peak[i]).astype(np.float64)
            assert np.all(np.abs(out[i].astype(np.float64) - rows[i]) <= tol)


@pytest.mark.parametrize("e", [-40, -3, 0, 7, 50])
def test_exact_half_ties_round_to_even(e):
    halves = np.arange(-254, 255)
    row = (np.concatenate([[127.0], halves / 2]) * 2.0**e).astype(F)
    want_q = np.array([127] + [round(h / 2) for h in halves], dtype=np.int8)  # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    assert want_q[1 + 254 + 1] == 0 and want_q[1 + 254 + 3] == 2 and want_q[1 + 254 + 5] == 2
    assert want_q[1 + 254 - 1] == 0 and want_q[1 + 254 - 3] == -2
    for module in (native, ref):
        q, scales, out = run(module, row[None, :])
        assert scales[0] == F(2.0**e)
        assert np.array_equal(q[0], want_q)
        assert np.array_equal(out[0], (want_q.astype(np.float64) * 2.0**e).astype(F))


@pytest.mark.parametrize(
    "rows",
    [
        np.zeros((3, 8), F),
        np.full((2, 5), -0.0, F),
        np.array([[F32_MAX, -F32_MAX, 1.0, 0.0]], F),
        np.array([[1e-45, -1e-45, 0.0]], F),  # the smallest subnormals: scale rounds to 0
        np.array([[3.0e-39, 1e-40, -2e-39]], F),  # a subnormal peak
        np.array([[5.0], [-7.5], [0.0], [1e-30]], F),  # one column
        np.linspace(-3, 3, 129, dtype=F)[None, :],  # one row
        np.zeros((0, 4), F),
        np.zeros((3, 0), F),
    ],
    ids=[
        "zeros",
        "negative-zeros",
        "f32-max",
        "min-subnormal",
        "subnormal-peak",
        "one-column",
        "one-row",
        "no-rows",
        "no-columns",
    ],
)
def test_edge_matrices(rows, on_every_cpu_path):
    want = run(ref, rows)
    for got in on_every_cpu_path(lambda: run(native, rows)).values():
        assert_same(got, want)
    q, scales, out = want
    assert np.isfinite(out).all()
    zero = ~rows.any(axis=1) if rows.shape[1] else np.ones(rows.shape[0], bool)
    assert not scales[zero].any() and not q[zero].any() and not out[zero].any()
    if rows.shape == (4, 1):
        assert q[:, 0].tolist() == [127, -127, 0, 127]


@pytest.mark.parametrize("module", [native, ref], ids=["native", "reference"])
def test_shape_mismatches_raise_value_error(module):
    rows = np.ones((3, 4), F)
    q8, scales, out = np.zeros((3, 4), np.int8), np.zeros(3, F), np.zeros((3, 4), F)
    for bad_q, bad_s in (
        (np.zeros((3, 5), np.int8), scales),
        (np.zeros((2, 4), np.int8), scales),
        (np.zeros((4, 4), np.int8), scales),
        (q8, np.zeros(2, F)),
        (q8, np.zeros(4, F)),
        (q8, np.zeros((3, 1), F)),
    ):
        with pytest.raises(ValueError):
            module.quantize_rows(rows, bad_q, bad_s)
    for bad_s, bad_out in (
        (np.zeros(2, F), out),
        (np.zeros(4, F), out),
        (scales, np.zeros((3, 5), F)),
        (scales, np.zeros((2, 4), F)),
        (scales, np.zeros(12, F)),
    ):
        with pytest.raises(ValueError):
            module.dequantize_rows(q8, bad_s, bad_out)
    module.quantize_rows(rows, q8, scales)  # the right shapes work
    assert q8.tolist() == [[127] * 4] * 3 and scales.tolist() == [F(1 / 127)] * 3


# ---- a quantized store ------------------------------------------------------------------------------


@st.composite
def entries(draw):
    """Entries of [n, 32] rows with magnitudes from 1e-30 to 1e30 and zero rows."""
    n = draw(st.integers(1, 6))
    rows = draw(hnp.arrays(F, (n, 32), elements=st.floats(-1, 1, width=32)))
    scale = draw(st.sampled_from([1.0, 1e-30, 1e-3, 1e4, 1e30]))
    rows = (rows.astype(np.float64) * scale).astype(F)
    # a row whose scale would be subnormal loses the bound to the scale's
    # own rounding (see test_the_rule_as_documented): keep scales normal
    rows[np.abs(rows).max(axis=1) < NORMAL_SCALE_PEAK] = 0.0
    for i in draw(st.lists(st.integers(0, n - 1), max_size=n)):
        rows[i] = 0.0
    return rows


def _bound_holds(got, want):
    assert got.dtype == F and got.shape == want.shape
    scale = (np.abs(want).max(axis=1) / F(127)).astype(F).astype(np.float64)
    tol = scale / 2 + 4 * np.spacing(np.abs(want).max(axis=1)).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol[:, None])
    zero = ~want.any(axis=1)
    assert np.array_equal(got[zero], np.zeros_like(got[zero]))  # exactly zero, not just close


@settings(max_examples=30)
@given(batch=st.lists(entries(), min_size=1, max_size=5), seed=st.integers(0, 2**32 - 1))
@pytest.mark.stress
def test_a_quantized_store_reads_within_half_a_scale_with_f32_signatures(batch, seed):
    with tempfile.TemporaryDirectory() as tmp:
        q = Store.create(Path(tmp) / "q", embed_dim=32, hdc_dim=512, seed=seed, quantize_stored=True)
        f = Store.create(Path(tmp) / "f", embed_dim=32, hdc_dim=512, seed=seed)
        try:
            values = [np.ascontiguousarray(k[::-1] * F(-0.5)) for k in batch]
            ids = [q.put(k, v, layer_idx=0) for k, v in zip(batch, values)]
            assert [f.put(k, v, layer_idx=0) for k, v in zip(batch, values)] == ids
            q.flush()
            f.flush()
            # signatures are stored bytes of entries.bin: read them through its format module
            stored = [records.read(Path(tmp) / name / "entries.bin", len(ids), 512 // 8)["signature"] for name in "qf"]
            assert np.array_equal(stored[0], stored[1])
            q.close()
            f.close()
            for read_only in (False, True):
                with Store.open(Path(tmp) / "q", read_only=read_only) as again:
                    hits = {h.entry_id: h for h in again.query(batch[0], 0, len(ids), rerank=False)}
                    assert set(hits) == set(ids)
                    for eid, k, v in zip(ids, batch, values):
                        _bound_holds(hits[eid].keys, k)
                        _bound_holds(hits[eid].values, v)
        finally:
            q.close()
            f.close()


@pytest.mark.parametrize("embed_dim", [256, 512])
def test_a_quantized_store_uses_about_a_quarter_of_the_disk(tmp_path, embed_dim):
    rng = np.random.default_rng(embed_dim)
    data = [
        (rng.standard_normal((n, embed_dim)).astype(F), rng.standard_normal((n, embed_dim)).astype(F))
        for n in (16, 24, 32, 48, 64)
    ]
    sizes = {}
    for quantized in (False, True):
        path = tmp_path / f"{embed_dim}-{quantized}"
        with Store.create(path, embed_dim=embed_dim, hdc_dim=256, quantize_stored=quantized) as store:
            store.put_many(data)
        sizes[quantized] = sum(p.stat().st_size for p in path.glob("shard_*.safetensors"))
    assert 0.2 < sizes[True] / sizes[False] < 0.3


def test_a_quantized_store_gives_finite_values_for_finite_input(tmp_path):
    # fl(max / 127) rounds up: 127 * scale once overflowed to inf
    k = np.ones((2, 16), F)
    k[0, 0], k[1, 3] = F32_MAX, -F32_MAX
    with Store.create(tmp_path / "q", embed_dim=16, hdc_dim=256, quantize_stored=True) as store:
        store.put(k, k)
        (h,) = store.query(np.ones(16, F), 0, 1)
        with np.errstate(over="ignore", invalid="ignore"):
            assert np.isfinite(h.keys).all() and np.isfinite(h.values).all(), h.keys[:, :4]
            _bound_holds(h.keys, k)


def _raw_tensors(path: Path) -> dict[str, bytes]:
    """Every tensor of every shard, read with the safetensors library."""
    out = {}
    for shard in sorted(path.glob("shard_*.safetensors")):
        with safe_open(str(shard), "np") as fh:
            for name in fh.keys():
                if name != "hmem_index":
                    t = fh.get_tensor(name)
                    out[name] = (str(t.dtype), t.shape, t.tobytes())
    return out


def test_compaction_copies_int8_data_bit_for_bit(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "q"
    store = Store.create(path, embed_dim=64, hdc_dim=256, quantize_stored=True, shard_max_bytes=4000)
    try:
        data = {}
        for i in range(16):
            k = (rng.standard_normal((int(rng.integers(1, 6)), 64)) * 10.0 ** rng.integers(-5, 5)).astype(F)
            if i % 5 == 0:
                k[0] = 0.0
            data[store.put(k, -k, layer_idx=i % 2, importance=float(i % 4))] = (k, i % 2)
            if i % 3 == 2:
                store.flush()
        store.flush()
        gone = set(store.plan_eviction(9).entry_ids)
        store.evict(9)
        before = _raw_tensors(path)
        assert {name.split("_", 1)[0] for name in before} == {"k", "v", "p", "ks", "vs"}
        assert all(before[f"k_{i}"][0] == "int8" and before[f"ks_{i}"][0] == "float32" for i in data)
        queries = [(k, layer) for k, layer in data.values()]

        def answers(s):
            return [
                (h.entry_id, h.score, h.keys.tobytes(), h.values.tobytes())
                for q, layer in queries
                for h in s.query(q, layer, 5, count_access=False)
            ]

        expected = answers(store)
        report = store.compact(repack=True)  # the whole rewrite: every INT8 tensor copied
        assert report.performed and report.records_dropped == 7
        after = _raw_tensors(path)
        live = set(data) - gone
        assert {int(name.split("_", 1)[1]) for name in after} == live
        assert after == {name: t for name, t in before.items() if int(name.split("_", 1)[1]) in live}
        assert answers(store) == expected
        for eid in live:
            k, layer = data[eid]
            (h,) = [h for h in store.query(k, layer, 10, rerank=False) if h.entry_id == eid]
            _bound_holds(h.keys, k)
            _bound_holds(h.values, -k)
    finally:
        store.close()
