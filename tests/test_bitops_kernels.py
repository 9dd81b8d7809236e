"""The native kernels (hmem.kernels._native._bitops) against their pure-Python twins
(hmem.kernels.reference.bitops), on every CPU path this machine can run, plus the
kernel-selection switch in hmem.kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hmem import kernels
from hmem.kernels._native import _bitops
from hmem.kernels.reference import bitops as ref

# ---- helpers and strategies ------------------------------------------------------


# Subprocesses start outside the checkout so that they import the installed
# hmem (with its compiled kernels), not the source tree on sys.path[0].
OUTSIDE_CHECKOUT = tempfile.gettempdir()


def nbytes(nbits: int) -> int:
    return (nbits + 7) // 8


def clear_pad(buf: bytearray, nbits: int) -> bytearray:
    """Zero the bits of the last used byte past `nbits` (popcount's precondition)."""
    if nbits % 8:
        buf[nbits // 8] &= (1 << (nbits % 8)) - 1
    return buf


def model_bits(buf, nbits: int) -> list[int]:
    return [(buf[i >> 3] >> (i & 7)) & 1 for i in range(nbits)]


@st.composite
def buffers(draw, max_bytes: int = 300):
    """Random bytes, or runs of 0x00 / 0xFF bytes with a few stray bits (these
    exercise the 512-bit skips and the 64-byte AVX-512 blocks)."""
    mode = draw(st.sampled_from(["random", "runs", "runs"]))
    if mode == "random":
        return bytearray(draw(st.binary(max_size=max_bytes)))
    n = draw(st.integers(0, max_bytes))
    out = bytearray()
    value = draw(st.sampled_from([0x00, 0xFF]))
    while len(out) < n:
        run = draw(st.integers(1, max(1, n)))
        out.extend([value] * min(run, n - len(out)))
        value ^= 0xFF
    for _ in range(draw(st.integers(0, 3))):
        if out:
            i = draw(st.integers(0, len(out) - 1))
            out[i] ^= 1 << draw(st.integers(0, 7))
    return out


@st.composite
def buffer_and_nbits(draw, max_bytes: int = 300):
    """A buffer and a bit length that fits in it (often not a multiple of 8)."""
    buf = draw(buffers(max_bytes))
    nbits = draw(st.integers(0, len(buf) * 8))
    return buf, nbits


# ---- the CPU-path switch -----------------------------------------------------------


def test_cpu_paths_are_listed_slowest_first(cpu_paths):
    assert cpu_paths[0] == "portable"
    assert cpu_paths == _bitops.PATH_NAMES[: len(cpu_paths)]
    assert _bitops.PATH_NAMES[_bitops.best_path()] == cpu_paths[-1]
    assert ref.PATH_NAMES == ("reference",)


def test_select_cpu_path(cpu_paths):
    if kernels.KERNEL_SET != "native":
        pytest.skip("hmem.kernels drives the native CPU path only with HMEM_KERNELS=native")
    before = kernels.cpu_path()
    try:
        for name in cpu_paths:
            assert kernels.select_cpu_path(name) == name
            assert kernels.cpu_path() == name
            assert name in kernels.describe()
        # asking for a path above what the CPU supports caps it at the best one
        assert kernels.select_cpu_path(_bitops.PATH_NAMES[-1]) == cpu_paths[-1]
        assert kernels.select_cpu_path(None) == cpu_paths[-1]
        assert kernels.available_cpu_paths() == cpu_paths
    finally:
        kernels.select_cpu_path(before)
    assert kernels.cpu_path() == before


def test_native_kernels_are_the_default():
    if os.environ.get(kernels.KERNELS_ENV, "native").strip().lower() not in ("", "native"):
        pytest.skip("HMEM_KERNELS is set to something else for this run")
    assert kernels.KERNEL_SET == "native"
    for name in (
        "popcount",
        "highest_set_bit",
        "next_bit",
        "set_range",
        "clear_range",
        "fold_into",
        "unfold_into",
        "fold_rows_into",
        "unfold_rows_into",
    ):
        assert getattr(kernels.bitops, name) is getattr(_bitops, name)
    assert "kernels: native" in kernels.describe()


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in (kernels.KERNELS_ENV, kernels.CPU_ENV)}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=OUTSIDE_CHECKOUT, env=full, capture_output=True, text=True, timeout=60
    )


@pytest.mark.stress
def test_environment_switches():
    out = _run(
        "import hmem, hmem.kernels as k; from hmem.kernels.reference import bitops as r;"
        "print(k.KERNEL_SET, k.bitops.fold_into is r.fold_into, k.cpu_path(),"
        " hmem.fold_unfold(hmem.Bitmap.from_indices([0, 1, 3], 4), 4, [-1])[0])",
        HMEM_KERNELS="reference",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["reference", "True", "reference", "2"]

    out = _run("import hmem.kernels as k; print(k.cpu_path())", HMEM_CPU="portable")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "portable"

    use = "import hmem; hmem.fold(hmem.Bitmap(1), 1, 1, [-1])"
    out = _run(use, HMEM_KERNELS="bogus")
    assert out.returncode != 0 and "KernelUnavailableError" in out.stderr

    out = _run(use, HMEM_CPU="bogus")
    assert out.returncode != 0 and "KernelUnavailableError" in out.stderr


# ---- popcount --------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 15, 16, 63, 64, 65, 127, 128, 129, 191, 192, 200, 1000, 1001, 4099])
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0xA5, 0x80])
def test_popcount_of_filled_buffers_on_every_path(size, fill, on_every_cpu_path):
    buf = bytes([fill]) * size
    want = bin(fill).count("1") * size
    results = on_every_cpu_path(lambda: _bitops.popcount(buf, size * 8))
    assert set(results.values()) == {want}, results
    assert ref.popcount(buf, size * 8) == want


@pytest.mark.parametrize("nbits", [0, 1, 5, 8, 13, 63, 64, 65, 100, 511, 512, 513, 1000, 4103])
def test_popcount_with_lengths_not_multiple_of_8_or_64(nbits, on_every_cpu_path):
    buf = clear_pad(bytearray(b"\xff" * nbytes(nbits)), nbits)
    results = on_every_cpu_path(lambda: _bitops.popcount(buf, nbits))
    assert set(results.values()) == {nbits}, results
    # bytes past the bitmap are never read
    longer = buf + b"\xff" * 70
    assert set(on_every_cpu_path(lambda: _bitops.popcount(longer, nbits)).values()) == {nbits}


@given(case=buffer_and_nbits(max_bytes=600), extra=st.binary(max_size=80))
@example(case=(bytearray(b"\xff" * 65), 513), extra=b"\xff")
@example(case=(bytearray(b"\x01" * 130), 1033), extra=b"")
def test_popcount_matches_reference_on_every_path(case, extra, on_every_cpu_path):
    buf, nbits = case
    buf = clear_pad(bytearray(buf[: nbytes(nbits)]), nbits) + extra
    want = ref.popcount(buf, nbits)
    assert want == sum(model_bits(buf, nbits))
    results = on_every_cpu_path(lambda: _bitops.popcount(buf, nbits))
    assert set(results.values()) == {want}, results
    # bytes objects (read-only buffers) are accepted too
    assert _bitops.popcount(bytes(buf), nbits) == want


# ---- highest_set_bit, next_bit ---------------------------------------------------------


@given(case=buffer_and_nbits())
@example(case=(bytearray(b"\xff\x80"), 15))
@example(case=(bytearray(b"\x00" * 20 + b"\x01"), 161))
@example(case=(bytearray(b"\x00" * 20 + b"\x02"), 161))
def test_highest_set_bit_matches_reference(case, on_every_cpu_path):
    buf, nbits = case  # bits past nbits are garbage: both must ignore them
    want = ref.highest_set_bit(buf, nbits)
    bits = model_bits(buf, nbits)
    assert want == max((i for i, b in enumerate(bits) if b), default=-1)
    results = on_every_cpu_path(lambda: _bitops.highest_set_bit(buf, nbits))
    assert set(results.values()) == {want}, results


@given(case=buffer_and_nbits(), data=st.data(), want=st.sampled_from([0, 1]))
@example(case=(bytearray(b"\xff" * 200), 1600), data=None, want=0)
def test_next_bit_matches_reference(case, data, want, on_every_cpu_path):
    buf, nbits = case
    if data is None:
        start, end = 3, 1600
    else:
        start = data.draw(st.integers(0, nbits))
        end = data.draw(st.integers(start, nbits))
    expected = ref.next_bit(buf, start, end, want)
    bits = model_bits(buf, nbits)
    assert expected == next((i for i in range(start, end) if bits[i] == want), end)
    results = on_every_cpu_path(lambda: _bitops.next_bit(buf, start, end, want))
    assert set(results.values()) == {expected}, results


# ---- range writes --------------------------------------------------------------------------


@given(case=buffer_and_nbits(), data=st.data(), op=st.sampled_from(["set_range", "clear_range"]))
def test_range_writes_match_reference(case, data, op, on_every_cpu_path):
    buf, nbits = case
    start = data.draw(st.integers(0, nbits))
    end = data.draw(st.integers(start, nbits))
    expected = bytearray(buf)
    getattr(ref, op)(expected, start, end)
    # the model: only bits in [start, end) change
    value = 1 if op == "set_range" else 0
    old, new = model_bits(buf, len(buf) * 8), model_bits(expected, len(buf) * 8)
    assert new == [value if start <= i < end else b for i, b in enumerate(old)]

    def run():
        out = bytearray(buf)
        getattr(_bitops, op)(out, start, end)
        return bytes(out)

    results = on_every_cpu_path(run)
    assert set(results.values()) == {bytes(expected)}


# ---- fold / unfold ---------------------------------------------------------------------------

WINDOWS = st.one_of(
    st.integers(-8, 0),  # full attention
    st.integers(1, 6),  # mamba and short windows
    st.integers(7, 3000),  # often larger than C
    st.just(2**62),
)


@st.composite
def fold_cases(draw, max_chunks: int = 40):
    G = draw(st.integers(1, 5))
    R = draw(st.integers(1, 4))
    C = draw(st.one_of(st.integers(0, max_chunks), st.integers(0, 3 * max_chunks)))
    windows = draw(st.lists(WINDOWS, min_size=G, max_size=G))
    chunk_major = draw(st.booleans())
    N = G * C * R
    mode = draw(st.sampled_from(["random", "holes", "runs"]))
    if mode == "random" and N <= 1000:
        bits = draw(st.lists(st.booleans(), min_size=N, max_size=N))
    elif mode == "random":  # too long for a list strategy: seeded noise of some density
        seed = draw(st.integers(0, 2**32 - 1))
        density = draw(st.sampled_from([0.5, 0.9, 0.99, 0.999]))
        bits = (np.random.default_rng(seed).random(N) < density).tolist()
    elif mode == "holes":
        holes = set(draw(st.lists(st.integers(0, max(0, N - 1)), max_size=6))) if N else set()
        bits = [i not in holes for i in range(N)]
    else:
        bits, value = [], draw(st.booleans())
        while len(bits) < N:
            run = draw(st.integers(1, max(1, N)))
            bits.extend([value] * min(run, N - len(bits)))
            value = not value
    found = bytearray(nbytes(N))
    for i, b in enumerate(bits):
        if b:
            found[i >> 3] |= 1 << (i & 7)
    return C, R, windows, chunk_major, found


def _fold_native(found, C, R, windows, chunk_major, spare=3):
    out = bytearray(nbytes(C) + spare)
    _bitops.fold_into(found, C, R, windows, chunk_major, out)
    return bytes(out)


def _fold_reference(found, C, R, windows, chunk_major):
    out = bytearray(nbytes(C))
    ref.fold_into(found, C, R, windows, chunk_major, out)
    return bytes(out)


@given(case=fold_cases(), pad_garbage=st.integers(0, 255))
@example(case=(5, 1, [2], False, bytearray([0b11011])), pad_garbage=0)
@example(case=(5, 2, [-1, 2], True, bytearray(b"\xff\xff\x0f")), pad_garbage=0xFC)
def test_fold_into_matches_reference(case, pad_garbage, on_every_cpu_path):
    C, R, windows, chunk_major, found = case
    N = len(windows) * C * R
    expected = _fold_reference(found, C, R, windows, chunk_major)
    # bits of the presence map past N are never looked at
    dirty = bytearray(found) + b"\xff"
    if N % 8:
        dirty[N // 8] |= pad_garbage & ~((1 << (N % 8)) - 1) & 0xFF
    results = on_every_cpu_path(lambda: _fold_native(dirty, C, R, windows, chunk_major))
    for got in results.values():
        assert got[: nbytes(C)] == expected
        assert got[nbytes(C) :] == b"\x00" * 3  # nothing written past the output
        assert int.from_bytes(got, "little") >> C == 0  # no bit past C
    # bytes objects (read-only buffers) are accepted
    assert _fold_native(bytes(found), C, R, windows, chunk_major) == expected + b"\x00" * 3


@given(case=fold_cases(), data=st.data())
def test_unfold_into_matches_reference(case, data, on_every_cpu_path):
    C, R, windows, chunk_major, _ = case
    N = len(windows) * C * R
    hit = data.draw(st.integers(0, C))
    expected = bytearray(nbytes(N))
    ref.unfold_into(hit, C, R, windows, chunk_major, expected)

    def run():
        out = bytearray(nbytes(N) + 3)
        _bitops.unfold_into(hit, C, R, windows, chunk_major, out)
        return bytes(out)

    for got in on_every_cpu_path(run).values():
        assert got[: nbytes(N)] == bytes(expected)
        assert got[nbytes(N) :] == b"\x00" * 3
        assert int.from_bytes(got, "little") >> N == 0


# Shapes for the chunk-major unfold tiling: rows of G*R bits that are (8x8,
# 2x4) and are not (3x1, 5x3) whole bytes, with segments long enough to tile.
@pytest.mark.parametrize("G, R", [(3, 1), (5, 3), (8, 8), (2, 4), (1, 1), (7, 2)])
@pytest.mark.parametrize("windows_kind", ["full", "mixed", "all-windows"])
@pytest.mark.parametrize("chunk_major", [False, True])
def test_unfold_into_tiling_shapes(G, R, windows_kind, chunk_major):
    C = 150
    if windows_kind == "full":
        windows = [-1] * G
    elif windows_kind == "mixed":
        windows = [[-1, 1, 40, 7, 0, 200, 64, 3][g % 8] for g in range(G)]
    else:
        windows = [[1, 17, 90, 33, 2, 160, 8, 64][g % 8] for g in range(G)]
    N = G * C * R
    for hit in (0, 1, 7, 8, 9, 16, 63, 64, 100, 149, 150):
        expected = bytearray(nbytes(N))
        ref.unfold_into(hit, C, R, windows, chunk_major, expected)
        got = bytearray(nbytes(N) + 1)
        _bitops.unfold_into(hit, C, R, windows, chunk_major, got)
        assert bytes(got) == bytes(expected) + b"\x00", (hit, windows)


@pytest.mark.parametrize("chunk_major", [False, True])
def test_fold_into_large_shapes_with_long_runs(chunk_major):
    # C*R well above 512 bits per group: the scans skip whole 512-bit blocks.
    C, R = 700, 3
    windows = [-1, 5, 1, 300]
    G = len(windows)
    N = G * C * R
    cases = []
    full = bytearray(b"\xff" * nbytes(N))
    clear_pad(full, N)
    cases.append(full)

    def cell(g, j, r):
        return j * G * R + g * R + r if chunk_major else g * C * R + j * R + r

    for holes in (
        [(0, 650, 1)],
        [(1, 10, 0), (1, 11, 2), (3, 500, 0)],
        [(2, 699, 2), (3, 0, 0)],
        [(1, j, 0) for j in range(100, 400)],
        [(3, j, 1) for j in range(1, 690, 2)],
    ):
        buf = bytearray(full)
        for g, j, r in holes:
            i = cell(g, j, r)
            buf[i >> 3] &= ~(1 << (i & 7)) & 0xFF
        cases.append(buf)
    cases.append(bytearray(nbytes(N)))
    for buf in cases:
        assert _fold_native(buf, C, R, windows, chunk_major, spare=0) == _fold_reference(
            buf, C, R, windows, chunk_major
        )


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(case=fold_cases(max_chunks=400))
def test_fold_into_matches_reference_on_large_shapes(case):
    C, R, windows, chunk_major, found = case
    assert _fold_native(found, C, R, windows, chunk_major, spare=0) == _fold_reference(
        found, C, R, windows, chunk_major
    )


# ---- grouped fold / unfold: one buffer per row --------------------------------------------


def _row_buffer(bits, pad_garbage: int = 0, extra: bytes = b"") -> bytearray:
    """Packed bits, garbage in the unused bits of the last byte, then `extra` bytes."""
    n = len(bits)
    buf = bytearray(nbytes(n))
    for i, b in enumerate(bits):
        if b:
            buf[i >> 3] |= 1 << (i & 7)
    if n % 8:
        buf[-1] |= pad_garbage & ~((1 << (n % 8)) - 1) & 0xFF
    return buf + extra


def _fold_via(call, C: int) -> bytes:
    """call(out) with a zeroed output of C bits and 3 spare bytes; the output's bytes."""
    out = bytearray(nbytes(C) + 3)
    call(out)
    return bytes(out)


@st.composite
def row_cases(draw, max_chunks: int = 200):
    """(C, windows, rows): 1-6 row buffers of C bits (random, holes, long runs or
    all present), each with garbage past its C bits that the kernels must not read."""
    C = draw(st.one_of(st.integers(0, 70), st.integers(0, max_chunks)))
    n = draw(st.integers(1, 6))
    windows = draw(st.lists(WINDOWS, min_size=n, max_size=n))
    rows = []
    for _ in range(n):
        mode = draw(st.sampled_from(["random", "holes", "runs", "ones"]))
        if mode == "random":
            bits = draw(st.lists(st.booleans(), min_size=C, max_size=C))
        elif mode == "holes":
            holes = set(draw(st.lists(st.integers(0, max(0, C - 1)), max_size=4))) if C else set()
            bits = [j not in holes for j in range(C)]
        elif mode == "runs":
            bits, value = [], draw(st.booleans())
            while len(bits) < C:
                run = draw(st.integers(1, max(1, C)))
                bits.extend([value] * min(run, C - len(bits)))
                value = not value
        else:
            bits = [True] * C
        rows.append(_row_buffer(bits, draw(st.integers(0, 255)), draw(st.binary(max_size=9))))
    return C, windows, rows


@given(case=row_cases(), data=st.data())
@example(case=(5, [2], [bytearray([0b11011])]), data=None)
@example(case=(9, [-1, 1], [bytearray(b"\xff\x01"), bytearray(b"\x00\xff\xff")]), data=None)
def test_row_kernels_match_reference_on_every_path(case, data, on_every_cpu_path):
    C, windows, rows = case
    before = [bytes(r) for r in rows]
    expected = bytearray(nbytes(C))
    ref.fold_rows_into(rows, C, windows, expected)

    def run_fold():
        out = bytearray(nbytes(C) + 3)
        _bitops.fold_rows_into(rows, C, windows, out)
        return bytes(out)

    for got in on_every_cpu_path(run_fold).values():
        assert got == bytes(expected) + b"\x00" * 3  # nothing written past the C bits
    assert [bytes(r) for r in rows] == before  # the rows are only read
    # read-only buffers are accepted as rows
    read_only = [bytes(r) for r in rows]
    assert _fold_via(lambda out: _bitops.fold_rows_into(read_only, C, windows, out), C) == bytes(expected) + b"\x00" * 3

    hit = C if data is None else data.draw(st.integers(0, C))
    expected_rows = [bytearray(nbytes(C)) for _ in windows]
    ref.unfold_rows_into(hit, C, windows, expected_rows)
    for out, w in zip(expected_rows, windows):  # the definition: chunks [lo, hit)
        lo = 0 if w <= 0 else max(0, hit - w)
        assert model_bits(out, C) == [int(lo <= j < hit) for j in range(C)]

    def run_unfold():
        outs = [bytearray(nbytes(C) + 2) for _ in windows]
        _bitops.unfold_rows_into(hit, C, windows, outs)
        return tuple(bytes(o) for o in outs)

    for got in on_every_cpu_path(run_unfold).values():
        assert list(got) == [bytes(e) + b"\x00\x00" for e in expected_rows]


@pytest.mark.parametrize("C", [1, 7, 8, 9, 64, 600])
@pytest.mark.parametrize("short_row", [0, 1])
def test_row_kernels_refuse_a_row_shorter_than_its_bits(C, short_row):
    need = nbytes(C)
    rows = [clear_pad(bytearray(b"\xff" * need), C) for _ in range(2)]
    rows[short_row] = bytearray(b"\xff" * (need - 1))
    out = bytearray(need)
    message = f"row {short_row} holds {need - 1} bytes, fewer than the {need} its bits need"
    with pytest.raises(ValueError, match=message):
        _bitops.fold_rows_into(rows, C, [-1, 1], out)
    assert out == bytearray(need)  # nothing written
    outs = [bytearray(need), bytearray(need), bytearray(need)]
    outs[short_row] = bytearray(need - 1)
    with pytest.raises(ValueError, match=message):
        _bitops.unfold_rows_into(C, C, [-1, 1, -1], outs)
    assert not any(any(o) for o in outs)  # nothing written, not even to the rows before
    # every buffer taken before the refusal was released: a bytearray still
    # exported to the kernel could not be resized
    for buf in (*rows, *outs):
        buf.append(0)


@pytest.mark.parametrize("C", [1, 7, 8, 13, 64, 511, 515, 1100])
def test_row_kernels_read_only_the_first_bytes_of_a_longer_buffer(C, on_every_cpu_path):
    rng = np.random.default_rng(C)
    patterns = [
        [True] * C,
        [j >= C // 2 for j in range(C)],
        (rng.random(C) < 0.97).tolist(),
        [j != C - 1 for j in range(C)],
        [False] * C,
    ]
    for windows in ([-1, 1, 3, 40, -1], [2, 2, 1, 7, 600]):
        clean = [_row_buffer(p) for p in patterns]
        dirty = [_row_buffer(p, 0xFF, b"\xff" * 70) for p in patterns]
        want = _fold_via(lambda out: ref.fold_rows_into(clean, C, windows, out), C)
        for rows in (clean, dirty):
            results = on_every_cpu_path(lambda: _fold_via(lambda out: _bitops.fold_rows_into(rows, C, windows, out), C))
            assert set(results.values()) == {want}, results
        # unfold leaves the unused bits of each row's last byte, and the bytes past it, as they were
        for hit in (0, C // 2, C):
            outs = [_row_buffer([False] * C, 0xFF, b"\xa5" * 5) for _ in windows]
            expected_rows = [bytearray(o) for o in outs]
            ref.unfold_rows_into(hit, C, windows, expected_rows)
            _bitops.unfold_rows_into(hit, C, windows, outs)
            assert outs == expected_rows
            assert all(o[nbytes(C) :] == b"\xa5" * 5 for o in outs)
