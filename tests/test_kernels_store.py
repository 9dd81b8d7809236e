"""The store's native kernels (hmem.kernels._native._checksum, _hamming, _projection)
against their numpy/Python twins in hmem.kernels.reference, on every CPU path this
machine can run; known values of CRC-32C and SplitMix64; the tie rule of
top-k; and the angle test that chose the signature projection."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hmem import kernels
from hmem.kernels._native import _checksum, _hamming, _projection
from hmem.kernels.reference import checksum as ref_checksum
from hmem.kernels.reference import hamming as ref_hamming
from hmem.kernels.reference import projection as ref_projection

NATIVE = (_checksum, _hamming, _projection)
REFERENCE = (ref_checksum, ref_hamming, ref_projection)
OUTSIDE_CHECKOUT = tempfile.gettempdir()  # subprocesses import the installed hmem


# ---- CPU paths --------------------------------------------------------------------


def _paths() -> tuple[str, ...]:
    if kernels.KERNEL_SET == "native":
        return kernels.available_cpu_paths()
    return _hamming.PATH_NAMES[: _hamming.best_path() + 1]


@contextmanager
def on_path(name: str):
    """Run every native kernel module on CPU path `name`, then restore the path before."""
    before = _hamming.PATH_NAMES[_hamming.active_path()]

    def select(path: str) -> None:
        if kernels.KERNEL_SET == "native":
            kernels.select_cpu_path(path)
        else:  # hmem.kernels drives the reference twins; drive the native modules directly
            for module in NATIVE:
                module.select_path(module.PATH_NAMES.index(path))

    select(name)
    try:
        assert [m.PATH_NAMES[m.active_path()] for m in NATIVE] == [name] * len(NATIVE)
        yield
    finally:
        select(before)


def every_path(fn):
    """fn() on every CPU path: {path: result}."""
    out = {}
    for name in _paths():
        with on_path(name):
            out[name] = fn()
    return out


def test_native_modules_share_the_path_names_and_dispatch():
    for module in NATIVE:
        assert module.PATH_NAMES == ("portable", "popcnt", "avx512-vpopcntdq")
        assert module.best_path() == _hamming.best_path()
    for module in REFERENCE:
        assert module.PATH_NAMES == ("reference",)
        assert (module.best_path(), module.select_path(5), module.active_path()) == (0, 0, 0)


@pytest.mark.skipif(kernels.KERNEL_SET != "native", reason="hmem.kernels drives the reference kernels")
def test_select_cpu_path_reaches_every_kernel_module():
    before = kernels.cpu_path()
    try:
        for name in kernels.available_cpu_paths():
            assert kernels.select_cpu_path(name) == name
            for module in (kernels.bitops, kernels.checksum, kernels.hamming, kernels.projection):
                assert module.PATH_NAMES[module.active_path()] == name
        assert kernels.select_cpu_path(None) == kernels.available_cpu_paths()[-1]
        assert kernels.hamming.topk is _hamming.topk
        assert kernels.projection.signature is _projection.signature
        assert kernels.checksum.crc32c is _checksum.crc32c
    finally:
        kernels.select_cpu_path(before)


def test_hmem_cpu_caps_every_kernel_module():
    env = {k: v for k, v in os.environ.items() if k not in (kernels.KERNELS_ENV, kernels.CPU_ENV)}
    env[kernels.CPU_ENV] = "portable"
    code = (
        "import hmem.kernels as k;"
        "print(*[m.PATH_NAMES[m.active_path()] for m in (k.checksum, k.hamming, k.projection, k.bitops)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=OUTSIDE_CHECKOUT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["portable"] * 4


# ---- CRC-32C ------------------------------------------------------------------------

# RFC 3720 (iSCSI), appendix B.4, and the customary check value.
CRC_VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("data, expected", CRC_VECTORS)
def test_crc32c_known_vectors(data, expected):
    assert ref_checksum.crc32c(data) == expected
    assert set(every_path(lambda: _checksum.crc32c(data)).values()) == {expected}


@st.composite
def crc_inputs(draw):
    # Short inputs, and lengths around the 3 x 256-byte stride of the hardware loop.
    n = draw(st.one_of(st.integers(0, 64), st.integers(700, 800), st.integers(0, 3000)))
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@given(crc_inputs(), st.integers(0, 2**32 - 1), st.data())
def test_crc32c_matches_reference_and_is_incremental(data, crc, draw):
    expected = ref_checksum.crc32c(data, crc)
    cut = draw.draw(st.integers(0, len(data)))
    for path, (whole, split) in every_path(
        lambda: (_checksum.crc32c(data, crc), _checksum.crc32c(data[cut:], _checksum.crc32c(data[:cut], crc)))
    ).items():
        assert whole == expected, path
        assert split == expected, path
    assert ref_checksum.crc32c(data[cut:], ref_checksum.crc32c(data[:cut], crc)) == expected


def test_crc32c_folded_lengths_agree_on_every_path():
    # Around the AVX-512 path's carry-less fold (from 1 KB, 256 bytes a step,
    # then the crc32 instruction for the rest), from several running checksums.
    data = np.random.default_rng(5).integers(0, 256, 4096 + 300, dtype=np.uint8)
    for n in (1023, 1024, 1025, 1279, 1280, 1281, 1535, 1536, 2047, 2048, 2049, 4096 + 255, 4096 + 256, 4096 + 300):
        for crc in (0, 0xFFFFFFFF, 0x12345678):
            expected = ref_checksum.crc32c(data[:n], crc)
            assert set(every_path(lambda: _checksum.crc32c(data[:n], crc)).values()) == {expected}, (n, crc)


@pytest.fixture
def piece_file(tmp_path):
    """A file of 3 MB of random bytes, open for reading, and its bytes."""
    data = np.random.default_rng(11).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "pieces.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, data
    finally:
        os.close(fd)


def pieces_of(data: bytes, spans: list[tuple[int, int]]):
    offsets = np.array([start for start, _ in spans], dtype=np.int64)
    crcs = np.array([ref_checksum.crc32c(data[start : start + size]) for start, size in spans], dtype=np.uint32)
    return offsets, crcs


# adjacent runs (one preadv each, split at a megabyte), a gap, a piece read twice, empty ones
SPANS = [(0, 100), (100, 700 << 10), ((700 << 10) + 100, 600 << 10), (5, 0), (2 << 20, 4096), (7, 33), (7, 33)]


@pytest.mark.parametrize("module", [_checksum, ref_checksum], ids=["native", "reference"])
def test_read_checked_fills_each_buffer_and_checks_it(module, piece_file):
    fd, data = piece_file
    offsets, crcs = pieces_of(data, SPANS)
    buffers = [bytearray(size) for _, size in SPANS]
    assert module.read_checked(fd, offsets, buffers, crcs) == -1
    assert [bytes(b) for b in buffers] == [data[start : start + size] for start, size in SPANS]
    # numpy arrays and views of one buffer, as a chunk's layers are
    whole = np.zeros((2, 1000), dtype=np.uint16)
    spans = [(64, 2000), (64 + 2000, 2000)]
    offsets, crcs = pieces_of(data, spans)
    assert module.read_checked(fd, offsets, [whole[0], whole[1]], crcs) == -1
    assert whole.tobytes() == data[64 : 64 + 4000]


@pytest.mark.parametrize("module", [_checksum, ref_checksum], ids=["native", "reference"])
def test_read_checked_names_the_first_piece_that_fails(module, piece_file):
    fd, data = piece_file
    offsets, crcs = pieces_of(data, SPANS)
    for bad in (0, 1, 2, 4, 6):
        wrong = crcs.copy()
        wrong[bad] ^= 1
        if bad < 6:
            wrong[6] ^= 1  # a later one too: reading stops at the first
        buffers = [bytearray(size) for _, size in SPANS]
        assert module.read_checked(fd, offsets, buffers, wrong) == bad


@pytest.mark.parametrize("module", [_checksum, ref_checksum], ids=["native", "reference"])
def test_read_checked_refuses_what_it_cannot_read(module, piece_file):
    fd, data = piece_file
    offsets, crcs = pieces_of(data, [(0, 10)])
    with pytest.raises(EOFError):  # past the end of the file
        module.read_checked(fd, np.array([len(data) - 5], dtype=np.int64), [bytearray(10)], crcs)
    with pytest.raises(ValueError, match="one of each"):
        module.read_checked(fd, offsets, [bytearray(10), bytearray(10)], crcs)
    with pytest.raises(ValueError, match="negative"):
        module.read_checked(fd, np.array([-1], dtype=np.int64), [bytearray(10)], crcs)
    with pytest.raises((BufferError, TypeError)):  # a read-only buffer
        module.read_checked(fd, offsets, [bytes(10)], crcs)
    closed = os.dup(fd)
    os.close(closed)
    with pytest.raises(OSError):
        module.read_checked(closed, offsets, [bytearray(10)], crcs)


def test_crc32c_large_input_agrees_on_every_path():
    # Two 3 x 64 KB strides of the hardware loop, then 3 x 256-byte ones, words and a byte tail.
    data = np.random.default_rng(3).integers(0, 256, 2 * 3 * 65536 + 3 * 256 * 2 + 77, dtype=np.uint8)
    expected = ref_checksum.crc32c(data)
    assert set(every_path(lambda: _checksum.crc32c(data)).values()) == {expected}
    assert set(every_path(lambda: _checksum.crc32c(data[1:])).values()) == {ref_checksum.crc32c(data[1:])}


@given(st.sampled_from([0, 1, 5]), st.sampled_from([1, 40, 552]), st.data())
def test_crc32c_rows_matches_reference_on_every_path(n, width, draw):
    rows = np.random.default_rng(draw.draw(st.integers(0, 2**32 - 1))).integers(0, 256, (n, width), dtype=np.uint8)
    start = draw.draw(st.integers(0, width))
    end = draw.draw(st.integers(start, width))
    want = ref_checksum.crc32c_rows(rows, start, end)
    assert want.dtype == np.uint32 and want.shape == (n,)
    assert want.tolist() == [ref_checksum.crc32c(bytes(r[:start]) + bytes(r[end:])) for r in rows]
    for path, got in every_path(lambda: _checksum.crc32c_rows(rows, start, end)).items():
        assert got.dtype == np.uint32, path
        np.testing.assert_array_equal(got, want, err_msg=path)


@pytest.mark.parametrize("module", [_checksum, ref_checksum], ids=["native", "reference"])
def test_crc32c_rows_refuses_bad_ranges(module):
    rows = np.zeros((2, 48), dtype=np.uint8)
    for start, end in ((-1, 4), (5, 4), (0, 49)):
        with pytest.raises(ValueError, match="skip range"):
            module.crc32c_rows(rows, start, end)


@pytest.mark.parametrize("crc32c", [_checksum.crc32c, ref_checksum.crc32c], ids=["native", "reference"])
def test_crc32c_accepts_any_contiguous_buffer(crc32c):
    floats = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = floats.tobytes()
    expected = crc32c(raw)
    assert crc32c(bytearray(raw)) == expected
    assert crc32c(memoryview(raw)) == expected
    assert crc32c(np.frombuffer(raw, dtype=np.uint8)) == expected
    assert crc32c(floats) == expected
    assert crc32c(memoryview(floats).cast("B")) == expected
    records = np.zeros(3, dtype=[("a", "<u4"), ("b", "<f8")])
    assert crc32c(records) == crc32c(records.tobytes())
    with pytest.raises(ValueError, match="C-contiguous"):
        crc32c(floats[:, ::2])
    with pytest.raises(TypeError):
        crc32c("text")
    with pytest.raises(ValueError):
        crc32c(raw, -1)
    with pytest.raises(ValueError):
        crc32c(raw, 2**32)


# ---- Hamming distances and top-k ------------------------------------------------


@st.composite
def search_cases(draw):
    n = draw(st.sampled_from([0, 1, 2, 7, 64, 300]))
    nbytes = draw(st.sampled_from([8, 64, 72, 512]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    style = draw(st.sampled_from(["random", "pool", "sparse"]))
    if style == "random":
        sigs = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    elif style == "pool":  # few distinct rows: many equal distances
        pool = rng.integers(0, 256, (3, nbytes), dtype=np.uint8)
        sigs = pool[rng.integers(0, 3, n)]
    else:  # a few bits set: small, often equal distances
        bits = np.zeros((n, nbytes * 8), dtype=np.uint8)
        bits[rng.random(bits.shape) < 4 / (nbytes * 8)] = 1
        sigs = np.packbits(bits, axis=1, bitorder="little")
    sigs = np.ascontiguousarray(sigs, dtype=np.uint8).reshape(n, nbytes)
    query = (
        sigs[rng.integers(0, n)].copy() if n and draw(st.booleans()) else rng.integers(0, 256, nbytes, dtype=np.uint8)
    )
    live = draw(st.sampled_from(["none-given", "all", "none", "random"]))
    alive = {
        "none-given": None,
        "all": np.ones(n, dtype=np.uint8),
        "none": np.zeros(n, dtype=np.uint8),
        "random": (rng.random(n) < 0.5).astype(np.uint8),
    }[live]
    k = draw(st.integers(1, n + 3))
    return query, sigs, alive, k


@given(search_cases())
def test_hamming_matches_reference_on_every_path(case):
    query, sigs, alive, k = case
    want_d = ref_hamming.distances(query, sigs)
    want_rows, want_dists = ref_hamming.topk(query, sigs, alive, k)
    assert want_d.dtype == np.int32 and want_rows.dtype == np.int64 and want_dists.dtype == np.int32
    for path, (d, (rows, dists)) in every_path(
        lambda: (_hamming.distances(query, sigs), _hamming.topk(query, sigs, alive, k))
    ).items():
        assert d.dtype == np.int32 and rows.dtype == np.int64 and dists.dtype == np.int32, path
        np.testing.assert_array_equal(d, want_d, err_msg=path)
        np.testing.assert_array_equal(rows, want_rows, err_msg=path)
        np.testing.assert_array_equal(dists, want_dists, err_msg=path)


def test_topk_tie_rule_and_sizes():
    sigs = np.zeros((10, 64), dtype=np.uint8)
    sigs[[2, 5, 7], 0] = 1  # rows 2, 5, 7 at distance 1 from the zero query, the rest at 0
    query = np.zeros(64, dtype=np.uint8)
    for topk in (_hamming.topk, ref_hamming.topk):
        rows, dists = topk(query, sigs, None, 9)
        assert rows.tolist() == [0, 1, 3, 4, 6, 8, 9, 2, 5]
        assert dists.tolist() == [0] * 7 + [1, 1]
        rows, _ = topk(query, sigs, np.array([1, 0] * 5, dtype=np.uint8), 10**12)
        assert rows.tolist() == [0, 4, 6, 8, 2]
        rows, _ = topk(query, sigs, np.array([True] * 3 + [False] * 7), 2)  # bool masks are accepted
        assert rows.tolist() == [0, 1]
        rows, dists = topk(query, sigs[:0], None, 3)
        assert rows.shape == dists.shape == (0,)


def test_topk_replaces_the_worst_on_every_row():
    # Distances strictly decrease with the row index: every row enters the heap.
    n, nbytes = 3000, 512
    bits = np.arange(nbytes * 8)[None, :] < (nbytes * 8 - np.arange(n))[:, None]
    sigs = np.packbits(bits, axis=1, bitorder="little")
    query = np.zeros(nbytes, dtype=np.uint8)
    alive = (np.arange(n) % 3 != 1).astype(np.uint8)
    for k in (1, 100, 2500):
        want = ref_hamming.topk(query, sigs, alive, k)
        for path, got in every_path(lambda: _hamming.topk(query, sigs, alive, k)).items():
            np.testing.assert_array_equal(got[0], want[0], err_msg=path)
            np.testing.assert_array_equal(got[1], want[1], err_msg=path)


@st.composite
def large_k_cases(draw):
    # k of 128 and more: the native kernel selects by counting distances
    # instead of keeping a heap (hamming.h, HM_SELECT_MIN_CAP).  Narrow
    # distance ranges make the k-th distance shared by many rows, so the tie
    # rule (lower row first) decides which of them are kept.
    n = draw(st.integers(0, 2500))
    nbytes = draw(st.sampled_from([8, 16, 128, 136]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([1, 3, nbytes * 8]))  # bits that differ between rows
    bits = np.zeros((n, nbytes * 8), dtype=np.uint8)
    bits[:, :spread] = rng.random((n, spread)) < 0.5
    sigs = np.ascontiguousarray(np.packbits(bits, axis=1, bitorder="little")).reshape(n, nbytes)
    query = np.zeros(nbytes, dtype=np.uint8)
    alive = draw(st.sampled_from([None, "random", "few"]))
    if alive is not None:
        alive = (rng.random(n) < (0.5 if alive == "random" else 0.02)).astype(np.uint8)
    k = draw(st.one_of(st.integers(128, 140), st.integers(128, max(128, n + 5))))
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n))
    return query, sigs, alive, k, lo, hi


@given(large_k_cases())
@example((np.zeros(8, np.uint8), np.zeros((300, 8), np.uint8), None, 128, 0, 300))  # every row tied
def test_topk_of_large_k_matches_the_reference_on_every_path(case):
    query, sigs, alive, k, lo, hi = case
    want_rows, want_dists = ref_hamming.topk(query, sigs, alive, k, lo, hi)
    for path, (rows, dists) in every_path(lambda: _hamming.topk(query, sigs, alive, k, lo, hi)).items():
        assert rows.tolist() == want_rows.tolist(), path
        assert dists.tolist() == want_dists.tolist(), path


@pytest.mark.parametrize("module", [_hamming, ref_hamming], ids=["native", "reference"])
def test_hamming_refuses_bad_arguments(module):
    sigs = np.zeros((4, 64), dtype=np.uint8)
    query = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="bytes"):
        module.distances(np.zeros(32, dtype=np.uint8), sigs)
    with pytest.raises(ValueError, match="multiple of 8"):
        module.distances(np.zeros(12, dtype=np.uint8), np.zeros((4, 12), dtype=np.uint8))
    for k in (0, -1, 1.5, "3"):
        with pytest.raises(ValueError, match="k must be"):
            module.topk(query, sigs, None, k)
    with pytest.raises(ValueError, match="alive"):
        module.topk(query, sigs, np.ones(3, dtype=np.uint8), 1)
    assert module.topk(query, sigs, None, np.int64(2))[0].tolist() == [0, 1]


# ---- SplitMix64 and the sign table ---------------------------------------------------


def _splitmix64_ints(seed: int, count: int) -> list[int]:
    """SplitMix64 with Python integers, written from the definition."""
    mask = (1 << 64) - 1
    out = []
    for k in range(count):
        z = (seed + (k + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
def test_splitmix64_known_values(module):
    assert int(module.splitmix64(0, 1)[0]) == 0xE220A8397B1DCDAF
    assert [int(x) for x in module.splitmix64(0, 3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    for seed in (1, 12345, 2**63, 2**64 - 1):
        out = module.splitmix64(seed, 70)
        assert out.dtype == np.uint64
        assert [int(x) for x in out] == _splitmix64_ints(seed, 70)
    assert module.splitmix64(7, 0).shape == (0,)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            module.splitmix64(bad, 1)


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
def test_signs_table_is_the_bit_stream_of_splitmix64(module):
    seed, m, rounds, blocks = 99, 128, 3, 2
    table = module.signs_table(seed, m, rounds, blocks)
    assert table.dtype == np.uint8 and table.shape == (blocks * rounds * m // 8,)
    words = _splitmix64_ints(seed, blocks * rounds * m // 64)
    for p in range(blocks * rounds * m):
        assert (table[p // 8] >> (p % 8)) & 1 == (words[p // 64] >> (p % 64)) & 1
    np.testing.assert_array_equal(table, ref_projection.signs_table(seed, m, rounds, blocks))
    for bad in [dict(m=96), dict(m=32), dict(rounds=0), dict(blocks=0)]:
        args = dict(seed=1, m=64, rounds=1, blocks=1) | bad
        with pytest.raises(ValueError):
            module.signs_table(**args)


# ---- the signature projection ---------------------------------------------------------


def block_size(d: int) -> int:
    """The transform size the tests use: the smallest power of two >= max(d, 64)."""
    return max(64, 1 << (d - 1).bit_length())


def native_signature(rows, m, rounds, hdc_dim, seed=5) -> np.ndarray:
    signs = _projection.signs_table(seed, m, rounds, -(-hdc_dim // m))
    out = np.full(hdc_dim // 8, 0xAA, dtype=np.uint8)  # the kernel overwrites every byte
    _projection.signature(rows, signs, m, rounds, hdc_dim, out)
    return out


def reference_signature(rows, m, rounds, hdc_dim, seed=5) -> np.ndarray:
    signs = ref_projection.signs_table(seed, m, rounds, -(-hdc_dim // m))
    out = bytearray(hdc_dim // 8)
    ref_projection.signature(rows, signs, m, rounds, hdc_dim, out)
    return np.frombuffer(bytes(out), dtype=np.uint8)


def make_rows(rng, n, d, style) -> np.ndarray:
    if style == "normal":
        x = rng.standard_normal((n, d))
    elif style == "integers":  # small integers: many transform outputs are exactly 0
        x = rng.integers(-2, 3, (n, d))
    elif style == "sparse":
        x = rng.standard_normal((n, d)) * (rng.random((n, d)) < 0.05)
    elif style == "wide":  # magnitudes from 1e-30 to 1e30
        x = rng.standard_normal((n, d)) * 10.0 ** rng.integers(-30, 31, (n, d))
    else:  # "cancel": small integers, and in one or two columns +-2**60 in about
        # half the tokens.  The big values cancel in some token sums and in some
        # transform outputs, leaving a small value whose rounding depends on the
        # order of the additions: any reordering changes bits.
        x = rng.integers(-3, 4, (n, d)).astype(np.float64)
        cols = rng.integers(0, d, rng.integers(1, 3))
        big = rng.random((n, cols.size)) < 0.5
        x[:, cols] = np.where(big, 2.0**60 * rng.choice([-1.0, 1.0], big.shape), x[:, cols])
    return np.ascontiguousarray(x, dtype=np.float32)


@st.composite
def projection_cases(draw):
    d = draw(st.sampled_from([1, 3, 63, 64, 100, 300, 512]))
    m = block_size(d) * draw(st.sampled_from([1, 1, 2, 4]))
    rounds = draw(st.integers(1, 3))
    # hdc_dim below m, equal to m, and spanning several blocks (not always whole ones)
    hdc_dim = draw(st.sampled_from([8, 64, m // 2, m, m + 64, 3 * m, 2 * m + 8]))
    n = draw(st.sampled_from([1, 1, 2, 5, 9]))
    style = draw(st.sampled_from(["normal", "integers", "sparse", "wide", "cancel"]))
    rows = make_rows(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), n, d, style)
    return rows, m, rounds, hdc_dim, draw(st.integers(0, 2**64 - 1))


@given(projection_cases())
@example((np.zeros((1, 64), np.float32), 64, 3, 64, 0))
def test_signature_is_bit_identical_to_reference_on_every_path(case):
    rows, m, rounds, hdc_dim, seed = case
    want = reference_signature(rows, m, rounds, hdc_dim, seed)
    for path, got in every_path(lambda: native_signature(rows, m, rounds, hdc_dim, seed)).items():
        np.testing.assert_array_equal(got, want, err_msg=f"path {path} ({_projection.variant()})")


def test_signature_at_the_store_size_on_every_path():
    rng = np.random.default_rng(11)
    for n, d, hdc_dim in ((1, 3584, 4096), (3, 3584, 4096), (1, 3584, 1024), (2, 4096, 8192)):
        for style in ("normal", "wide", "integers", "cancel"):
            rows = make_rows(rng, n, d, style)
            want = reference_signature(rows, block_size(d), 3, hdc_dim)
            got = every_path(lambda: native_signature(rows, block_size(d), 3, hdc_dim))
            for path, sig in got.items():
                np.testing.assert_array_equal(sig, want, err_msg=f"{path}, {n}x{d}, {style}")


def test_signature_of_zero_and_negated_input():
    rng = np.random.default_rng(12)
    for d, hdc_dim in ((64, 4096), (300, 1024), (3584, 4096)):
        m = block_size(d)
        zero = np.zeros((2, d), dtype=np.float32)
        for sig in every_path(lambda: native_signature(zero, m, 3, hdc_dim)).values():
            assert not sig.any()
        # Negation commutes exactly with IEEE addition, so -x flips every bit
        # whose value is not exactly 0; exact zeros give 0 both ways.
        x = make_rows(rng, 2, d, "normal")
        np.testing.assert_array_equal(native_signature(-x, m, 3, hdc_dim), ~native_signature(x, m, 3, hdc_dim))
        x = make_rows(rng, 1, d, "integers")
        x[0, 0] += x.sum() % 2  # an even sum makes every output of round 1 even, and often 0
        pos, neg = native_signature(x, m, 1, hdc_dim), native_signature(-x, m, 1, hdc_dim)
        assert not (pos & neg).any()
        either = np.unpackbits(pos | neg)
        assert either.any() and not either.all()  # some values are exactly 0


def test_signature_sums_tokens_in_token_order():
    # ((2**60 - 2**60) + 1) = 1, while any other order loses the 1 against 2**60.
    rows = np.zeros((3, 64), dtype=np.float32)
    rows[:, 0] = [2.0**60, -(2.0**60), 1.0]
    one = np.zeros((1, 64), dtype=np.float32)
    one[0, 0] = 1.0
    want = reference_signature(one, 64, 2, 128)
    assert want.any()
    np.testing.assert_array_equal(reference_signature(rows, 64, 2, 128), want)
    for path, got in every_path(lambda: native_signature(rows, 64, 2, 128)).items():
        np.testing.assert_array_equal(got, want, err_msg=path)


def bit_counts(a: np.ndarray) -> np.ndarray:
    """Set bits of each element of an integer array (np.bitwise_count, which
    NumPy 1.x lacks: the oldest NumPy hmem accepts runs these tests too)."""
    a = np.ascontiguousarray(a)
    return np.unpackbits(a.view(np.uint8).reshape(*a.shape, a.itemsize), axis=-1).sum(axis=-1)


def test_signature_is_sign_of_the_sylvester_hadamard_transform():
    # On small integers the arithmetic is exact, so the kernel must equal the
    # dense product H_m D_r ... H_m D_1 x with H[i, j] = (-1)^popcount(i & j).
    m, rounds, d = 64, 2, 50
    idx = np.arange(m)
    hadamard = (-1.0) ** bit_counts(idx[:, None] & idx[None, :])
    x = np.random.default_rng(13).integers(-3, 4, (2, d)).astype(np.float32)
    negate = np.unpackbits(ref_projection.signs_table(5, m, rounds, 1), bitorder="little").astype(bool)
    v = np.zeros(m)
    v[:d] = x.astype(np.float64).sum(axis=0)
    for r in range(rounds):
        v = hadamard @ np.where(negate[r * m : (r + 1) * m], -v, v)
    want = np.packbits(v > 0, bitorder="little")
    np.testing.assert_array_equal(native_signature(x, m, rounds, m), want)
    np.testing.assert_array_equal(reference_signature(x, m, rounds, m), want)


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
def test_signature_refuses_bad_arguments(module):
    rows = np.ones((2, 100), dtype=np.float32)
    signs = ref_projection.signs_table(1, 128, 2, 1)
    out = np.zeros(16, dtype=np.uint8)
    module.signature(rows, signs, 128, 2, 128, out)
    bad = [
        (rows, signs, 64, 2, 128, out),  # d > m (and the sign table does not fit)
        (rows, signs, 96, 2, 128, out),  # m not a power of two
        (rows, signs, 128, 0, 128, out),  # no rounds
        (rows, signs, 128, 2, 124, out),  # hdc_dim not a multiple of 8
        (rows, signs, 128, 2, 256, out),  # out too small for hdc_dim
        (rows, signs[:-1], 128, 2, 128, out),  # sign table too short
        (rows, signs, 128, 3, 128, out),  # sign table built for other rounds
        (rows[:0], signs, 128, 2, 128, out),  # no tokens
        (rows.astype(np.float64), signs, 128, 2, 128, out),  # not float32
    ]
    for args in bad:
        with pytest.raises(ValueError):
            module.signature(*args)


# ---- the angle test: structured projection vs a dense Gaussian ---------------------------


def angle_pairs(rng, d: int, count: int):
    """Pairs (x, y) at known angles spread over (0, pi), from three families:
    isotropic Gaussian; sparse (8 non-zero coordinates); and LLM-key-like,
    a few channels 30x larger than the rest."""
    xs, ys = [], []
    for i in range(count):
        family = i % 3
        x, u = rng.standard_normal(d), rng.standard_normal(d)
        if family == 1:
            x *= rng.permutation(d) < 8
            u *= rng.permutation(d) < 8
        elif family == 2:
            channels = rng.choice(d, min(4, d), replace=False)
            x[channels] *= 30
            u[channels[:2]] *= 30
        x /= np.linalg.norm(x)
        u -= (u @ x) * x
        u /= np.linalg.norm(u)
        theta = rng.uniform(0.0, np.pi)
        xs.append(x)
        ys.append(np.cos(theta) * x + np.sin(theta) * u)
    x, y = np.array(xs, dtype=np.float32), np.array(ys, dtype=np.float32)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    cos = (x64 * y64).sum(1) / np.linalg.norm(x64, axis=1) / np.linalg.norm(y64, axis=1)
    return x, y, np.arccos(np.clip(cos, -1.0, 1.0))


def mean_angle_error(sig_x, sig_y, hdc_dim, theta) -> float:
    estimate = np.pi * bit_counts(sig_x ^ sig_y).sum(axis=1) / hdc_dim
    return float(np.abs(estimate - theta).mean())


def structured_error(x, y, theta, d, hdc_dim, rounds) -> float:
    m = block_size(d)
    sx = np.array([native_signature(v[None, :], m, rounds, hdc_dim) for v in x])
    sy = np.array([native_signature(v[None, :], m, rounds, hdc_dim) for v in y])
    return mean_angle_error(sx, sy, hdc_dim, theta)


def dense_error(x, y, theta, d, hdc_dim, seed) -> float:
    g = np.random.default_rng(seed).standard_normal((hdc_dim, d))
    sx = np.packbits(x.astype(np.float64) @ g.T > 0, axis=1, bitorder="little")
    sy = np.packbits(y.astype(np.float64) @ g.T > 0, axis=1, bitorder="little")
    return mean_angle_error(sx, sy, hdc_dim, theta)


@pytest.mark.parametrize("d, hdc_dim", [(64, 4096), (300, 4096), (1024, 4096), (3584, 4096), (3584, 1024)])
@pytest.mark.stress
def test_structured_projection_estimates_angles_as_well_as_a_dense_gaussian(d, hdc_dim):
    x, y, theta = angle_pairs(np.random.default_rng(d + hdc_dim), d, 600)
    dense = dense_error(x, y, theta, d, hdc_dim, seed=d)
    structured = structured_error(x, y, theta, d, hdc_dim, rounds=3)
    assert structured <= 1.10 * dense + 0.002, (structured, dense)


@given(n=st.integers(1, 6), d=st.integers(1, 130), seed=st.integers(0, 2**64 - 1))
def test_signature_token_sums_match_reference_and_numpy(n, d, seed):
    rows = np.random.default_rng(seed % 2**32).standard_normal((n, d)).astype(np.float32)
    m = max(64, 1 << (d - 1).bit_length())
    signs = ref_projection.signs_table(seed, m, 3, 1)
    native_sums, ref_sums = np.zeros(d), np.zeros(d)
    native_out, ref_out = np.zeros(m // 8, np.uint8), np.zeros(m // 8, np.uint8)
    _projection.signature(rows, signs, m, 3, m, native_out, native_sums)
    ref_projection.signature(rows, signs, m, 3, m, ref_out, ref_sums)
    assert native_out.tobytes() == ref_out.tobytes()
    assert native_sums.tobytes() == ref_sums.tobytes()  # the same float64 additions in token order
    expected = np.zeros(d)
    for t in range(n):
        expected += rows[t].astype(np.float64)
    assert native_sums.tobytes() == expected.tobytes()


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
def test_signature_sums_length_is_checked(module):
    rows = np.ones((2, 10), np.float32)
    signs = ref_projection.signs_table(0, 64, 3, 1)
    with pytest.raises(ValueError, match="sums"):
        module.signature(rows, signs, 64, 3, 64, np.zeros(8, np.uint8), np.zeros(9))


# ---- signatures from token sums, and the token sums of bfloat16 words -------------


@given(projection_cases())
def test_signature_of_sum_gives_the_signature_of_the_rows_on_every_path(case):
    rows, m, rounds, hdc_dim, seed = case
    want = reference_signature(rows, m, rounds, hdc_dim, seed)
    sums = np.zeros(rows.shape[1])
    ref_projection.signature(
        rows,
        ref_projection.signs_table(seed, m, rounds, -(-hdc_dim // m)),
        m,
        rounds,
        hdc_dim,
        bytearray(hdc_dim // 8),
        sums,
    )
    signs = _projection.signs_table(seed, m, rounds, -(-hdc_dim // m))

    def from_sum(module):
        out = np.full(hdc_dim // 8, 0xAA, dtype=np.uint8)  # every byte must be written
        module.signature_of_sum(sums, signs, m, rounds, hdc_dim, out)
        return out

    np.testing.assert_array_equal(from_sum(ref_projection), want)
    for path, got in every_path(lambda: from_sum(_projection)).items():
        np.testing.assert_array_equal(got, want, err_msg=f"path {path} ({_projection.variant()})")


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
def test_signature_of_sum_refuses_bad_arguments(module):
    signs = ref_projection.signs_table(1, 128, 2, 1)
    out = np.zeros(16, dtype=np.uint8)
    module.signature_of_sum(np.ones(100), signs, 128, 2, 128, out)
    for sums, m, hdc_dim, target in (
        (np.ones(129), 128, 128, out),  # more values than m
        (np.ones(0), 128, 128, out),  # none
        (np.ones(100), 96, 128, out),  # m not a power of two
        (np.ones(100), 128, 124, out),  # hdc_dim not a multiple of 8
        (np.ones(100), 128, 256, out),
    ):  # out too small
        with pytest.raises(ValueError):
            module.signature_of_sum(sums, signs, m, 2, hdc_dim, target)


@st.composite
def bf16_word_cases(draw):
    n, a, b = draw(st.integers(1, 9)), draw(st.integers(1, 4)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    style = draw(st.sampled_from(["normal", "wide", "cancel", "any"]))
    if style == "any":  # every bit pattern, NaN and infinities included
        words = rng.integers(0, 1 << 16, (n, a, b), dtype=np.uint16)
    else:
        rows = make_rows(rng, n, a * b, style)
        words = (rows.view(np.uint32) >> 16).astype(np.uint16).reshape(n, a, b)
    order = draw(st.sampled_from(["tah", "ath", "hta"]))  # where the words lie: the view's strides
    lying = {
        "tah": words,
        "ath": np.ascontiguousarray(words.transpose(1, 0, 2)).transpose(1, 0, 2),
        "hta": np.ascontiguousarray(words.transpose(2, 0, 1)).transpose(1, 2, 0),
    }[order]
    return words, lying


@given(bf16_word_cases())
def test_bf16_token_sums_are_the_sums_of_the_widened_rows(case):
    words, lying = case
    n, a, b = words.shape
    widened = np.ascontiguousarray((words.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(n, a * b))
    want = np.zeros(a * b)
    with np.errstate(invalid="ignore"):
        for t in range(n):  # what signature() sums: float64, token order, from +0.0
            want += widened[t].astype(np.float64)
    finite = np.isfinite(want)
    for module in (_projection, ref_projection):
        got = np.full(a * b, 7.0)
        module.bf16_token_sums(lying, got)
        assert got[finite].tobytes() == want[finite].tobytes(), module.__name__
        # NaN where a NaN was summed (or infinities of both signs), the infinity otherwise
        np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=module.__name__)


@pytest.mark.parametrize("module", [_projection, ref_projection], ids=["native", "reference"])
def test_bf16_token_sums_refuses_bad_arguments(module):
    words = np.zeros((2, 3, 4), np.uint16)
    with pytest.raises(ValueError, match="sums"):
        module.bf16_token_sums(words, np.zeros(11))
    with pytest.raises((ValueError, TypeError)):
        module.bf16_token_sums(words.astype(np.float32), np.zeros(12))
