"""Plain-numpy twin of hmem.kernels._native._hamming: Hamming distances and top-k.

Layout: a signature is hdc_dim bits packed LSB-first in nbytes = hdc_dim / 8
bytes, a positive multiple of 8; `sigs` is a C-contiguous uint8 matrix
(n, nbytes); `alive` is None or one uint8/bool per row (0 = skip).

topk orders by (distance ascending, row ascending), computed here with a
full stable sort: clear, and slow for large n.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, SupportsIndex

import numpy as np

# the CPU-path switch every kernel module offers hmem.kernels, re-exported
from hmem.kernels.reference._paths import PATH_NAMES as PATH_NAMES
from hmem.kernels.reference._paths import active_path as active_path
from hmem.kernels.reference._paths import best_path as best_path
from hmem.kernels.reference._paths import select_path as select_path

if TYPE_CHECKING:
    from typing import TypeAlias

    from numpy.typing import NDArray

    # As the native kernels take them (hmem/kernels/_native/_hamming.pyi).
    _Bytes: TypeAlias = bytes | bytearray | memoryview | NDArray[np.uint8]
    _Alive: TypeAlias = NDArray[np.uint8] | NDArray[np.bool_] | None

# Set bits of each byte value 0..255, by counting them in its binary digits.
_BYTE_POPCOUNT = np.array([bin(value).count("1") for value in range(256)], dtype=np.uint8)


def _table_popcount(data: np.ndarray) -> np.ndarray:
    """Set bits of each byte of a uint8 array, looked up in _BYTE_POPCOUNT."""
    return _BYTE_POPCOUNT[data]


# np.bitwise_count came with NumPy 2.0; hmem also runs on NumPy 1.x, where
# the table gives the same counts.  Chosen once, here.
_byte_popcount = getattr(np, "bitwise_count", _table_popcount)


def _check_shapes(query, sigs) -> tuple[np.ndarray, np.ndarray]:
    q = np.asarray(query)
    s = np.asarray(sigs)
    if q.dtype != np.uint8 or s.dtype != np.uint8:
        raise ValueError("query and signatures must be uint8 arrays")
    if q.ndim != 1 or s.ndim != 2:
        raise ValueError(f"need a 1-d query and a 2-d signature matrix, got {q.ndim}-d and {s.ndim}-d")
    nbytes = s.shape[1]
    if q.shape[0] != nbytes:
        raise ValueError(f"the query has {q.shape[0]} bytes but the signatures have {nbytes}")
    if nbytes <= 0 or nbytes % 8 or nbytes > (1 << 28):
        raise ValueError(f"a signature must be a positive multiple of 8 bytes (at most 2**28), got {nbytes}")
    return q, s


def _check_k(k) -> int:
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"k must be an integer >= 1, got {k!r}") from None
    if k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k}")
    return k


def distances(query: _Bytes, sigs: NDArray[np.uint8]) -> NDArray[np.int32]:
    """Hamming distance of each row of `sigs` to `query`: int32 array [n]."""
    q, s = _check_shapes(query, sigs)
    return _byte_popcount(s ^ q).sum(axis=1, dtype=np.int64).astype(np.int32)


def _check_range(lo: int, hi, n: int) -> int:
    end = n if hi is None else hi
    if not 0 <= lo <= end <= n:
        raise ValueError(f"rows [{lo}, {end}) are outside a matrix of {n} rows")
    return end


def topk(
    query: _Bytes, sigs: NDArray[np.uint8], alive: _Alive, k: SupportsIndex, lo: int = 0, hi: int | None = None
) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """The min(k, live rows in [lo, hi)) rows nearest to `query`, by
    (distance, row): (rows int64 [m], dists int32 [m])."""
    q, s = _check_shapes(query, sigs)
    k = _check_k(k)
    n = s.shape[0]
    end = _check_range(lo, hi, n)
    rows = np.arange(lo, end, dtype=np.int64)
    if alive is not None:
        live = np.asarray(alive)
        if live.ndim != 1 or live.shape[0] != n:
            raise ValueError(f"alive has {live.size} entries for {n} signatures")
        rows = rows[live[lo:end].astype(bool)]
    dists = distances(q, s[lo:end])[rows - lo]
    order = np.lexsort((rows, dists))[:k]  # last key sorts first: distance, then row
    return rows[order], dists[order]


def topk_many(
    queries: NDArray[np.uint8],
    sigs: NDArray[np.uint8],
    alive: _Alive,
    k: SupportsIndex,
    lo: int = 0,
    hi: int | None = None,
) -> tuple[NDArray[np.int64], NDArray[np.int32], NDArray[np.int64]]:
    """topk of every query (row of `queries`) over rows [lo, hi): (rows int64
    [nq, cap], dists int32 [nq, cap], counts int64 [nq]), cap = min(k, hi - lo),
    query j's results the first counts[j] of its row."""
    qs = np.asarray(queries)
    s = np.asarray(sigs)
    if qs.ndim != 2 or qs.dtype != np.uint8:
        raise ValueError("the queries must be a 2-d uint8 matrix")
    if qs.shape[1] != s.shape[1]:
        raise ValueError(f"the queries have {qs.shape[1]} bytes but the signatures have {s.shape[1]}")
    n = s.shape[0]
    end = _check_range(lo, hi, n)
    live = None if alive is None else np.asarray(alive)
    if live is not None and (live.ndim != 1 or live.shape[0] != n):
        raise ValueError(f"alive has {live.size} entries for {n} signatures")
    cap = min(_check_k(k), end - lo)
    rows = np.zeros((len(qs), cap), dtype=np.int64)
    dists = np.zeros((len(qs), cap), dtype=np.int32)
    counts = np.zeros(len(qs), dtype=np.int64)
    for j, q in enumerate(qs):
        if end == lo:
            continue
        r, d = topk(q, s, alive, max(cap, 1), lo, end)
        counts[j] = len(r)
        rows[j, : len(r)] = r
        dists[j, : len(r)] = d
    return rows, dists, counts


def gather_rows(src: NDArray[np.uint8], rows: NDArray[np.int64], out: NDArray[np.uint8]) -> None:
    """out[i] = src[rows[i]]."""
    idx = np.asarray(rows)
    if out.shape != (len(idx), src.shape[1]):
        raise ValueError(f"out has shape {out.shape}, need {(len(idx), src.shape[1])}")
    if len(idx) and (idx.min() < 0 or idx.max() >= src.shape[0]):
        raise ValueError(f"a row is outside a matrix of {src.shape[0]} rows")
    out[:] = src[idx]
