"""Plain-Python twins of hmem.kernels._native._bitops, written for clarity.

They are the executable specification the tests compare the native kernels
against, and the implementation used when ``HMEM_KERNELS=reference``.  They
loop bit by bit on purpose; never use them on a hot path.

Layout: bit i is in byte i // 8 under mask 1 << (i % 8).  A presence map of
G groups, C chunks and R ranks has bit g*C*R + j*R + r (group-major) or
j*G*R + g*R + r (chunk-major).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

# the CPU-path switch every kernel module offers hmem.kernels, re-exported
from hmem.kernels.reference._paths import PATH_NAMES as PATH_NAMES
from hmem.kernels.reference._paths import active_path as active_path
from hmem.kernels.reference._paths import best_path as best_path
from hmem.kernels.reference._paths import select_path as select_path

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from numpy.typing import NDArray

    # What the native kernels take (hmem/kernels/_native/_bitops.pyi):
    # 1-d C-contiguous unsigned bytes, writable where a kernel writes.
    _Bytes: TypeAlias = bytes | bytearray | memoryview | NDArray[np.uint8]
    _WritableBytes: TypeAlias = bytearray | memoryview | NDArray[np.uint8]


def _get(buf: _Bytes, i: int) -> int:
    return (buf[i >> 3] >> (i & 7)) & 1


def _put(buf: _WritableBytes, i: int, value: int) -> None:
    if value:
        buf[i >> 3] |= 1 << (i & 7)
    else:
        buf[i >> 3] &= ~(1 << (i & 7)) & 0xFF


def popcount(buf: _Bytes, nbits: int) -> int:
    return sum(_get(buf, i) for i in range(nbits))


def highest_set_bit(buf: _Bytes, nbits: int) -> int:
    for i in range(nbits - 1, -1, -1):
        if _get(buf, i):
            return i
    return -1


def next_bit(buf: _Bytes, start: int, end: int, want: int) -> int:
    for i in range(start, end):
        if _get(buf, i) == want:
            return i
    return end


def set_range(buf: _WritableBytes, start: int, end: int) -> None:
    for i in range(start, end):
        _put(buf, i, 1)


def clear_range(buf: _WritableBytes, start: int, end: int) -> None:
    for i in range(start, end):
        _put(buf, i, 0)


def _cell_index(g: int, j: int, r: int, C: int, R: int, G: int, chunk_major: bool) -> int:
    return j * G * R + g * R + r if chunk_major else g * C * R + j * R + r


def fold_into(found: _Bytes, C: int, R: int, windows: Sequence[int], chunk_major: bool, out: _WritableBytes) -> None:
    """Bit j of `out` = every group can serve a prefix of length j + 1.

    A group with window w serves length L when its last min(w, L) chunks
    before L are present (all L chunks for full attention, w <= 0), i.e. when
    the run of present chunks ending at chunk L - 1 is that long.
    """
    G = len(windows)
    servable = [True] * C
    for g, w in enumerate(windows):
        run = 0
        for j in range(C):
            present = all(_get(found, _cell_index(g, j, r, C, R, G, chunk_major)) for r in range(R))
            run = run + 1 if present else 0
            need = j + 1 if w <= 0 else min(w, j + 1)
            if run < need:
                servable[j] = False
    for j in range(C):
        if servable[j]:
            _put(out, j, 1)


def unfold_into(hit: int, C: int, R: int, windows: Sequence[int], chunk_major: bool, out: _WritableBytes) -> None:
    """Set every rank bit of chunks [lo_g, hit) of each group g."""
    G = len(windows)
    for g, w in enumerate(windows):
        lo = 0 if w <= 0 else max(0, hit - w)
        for j in range(lo, hit):
            for r in range(R):
                _put(out, _cell_index(g, j, r, C, R, G, chunk_major), 1)


def fold_rows_into(rows: Sequence[_Bytes], C: int, windows: Sequence[int], out: _WritableBytes) -> None:
    """The grouped fold: row i holds C bits (chunk j present or not) under
    windows[i].  Bit j of `out` = every row can serve a prefix of length
    j + 1: the last min(w, j + 1) chunks before it are present (all j + 1
    under full attention, w <= 0)."""
    for j in range(C):
        length = j + 1
        servable = True
        for row, w in zip(rows, windows):
            lo = 0 if w <= 0 else max(0, length - w)
            if not all(_get(row, k) for k in range(lo, length)):
                servable = False
        if servable:
            _put(out, j, 1)


def unfold_rows_into(hit: int, C: int, windows: Sequence[int], outs: Sequence[_WritableBytes]) -> None:
    """Set chunks [lo, hit) of every row outs[i] under windows[i]."""
    for out, w in zip(outs, windows):
        lo = 0 if w <= 0 else max(0, hit - w)
        for j in range(lo, hit):
            _put(out, j, 1)
