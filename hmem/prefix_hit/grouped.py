"""The grouped form of the prefix-hit operators: one Bitmap per row.

A connector that looks each (group, rank) up on its own gets back one
C-bit Bitmap per lookup: bit j set when that row holds chunk j.  The
grouped operators take those rows as they are, each paired 1:1 with the
window of its group, instead of a flat G*C*R presence map:

- ``fold_grouped(rows, windows)``: the C-bit servable map, bit j set when a
  prefix of length j + 1 is servable by every row (under full attention,
  w <= 0, a row must hold chunks [0, L); under a window w, chunks
  [max(0, L - w), L)).
- ``unfold_grouped(hit, num_chunks, windows)``: the retain result, one
  C-bit Bitmap per row, parallel to the windows.
- ``fold_unfold_grouped(rows, windows)``: (hit, retain rows).

The ranks of a group are simply rows with the same window, so these give
the same hit as the flat operators on the same cells
(hmem/prefix_hit/operators.py), without copying the rows into a flat map.
The kernels read and write each row's packed bytes in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from hmem import validation
from hmem.errors import InvalidArgumentError
from hmem.kernels import bitops
from hmem.prefix_hit.bitmap import Bitmap
from hmem.prefix_hit.operators import _kernel_windows, _windows

# Per-row work is done by C-level map() calls: a request has tens to hundreds
# of rows, and a Python step per row would cost more than the kernels.  The
# slots are read directly (not through Bitmap.buffer / len()) for the same
# reason: a property or __len__ is a Python call per row.
_BUFFER = attrgetter("_buf")
_NBITS = attrgetter("_nbits")


def _checked_rows(rows: Sequence[Bitmap]) -> tuple[list[Bitmap], int]:
    """The rows as a list, and their common length C."""
    if isinstance(rows, Bitmap):
        raise InvalidArgumentError(
            "rows must be a sequence of Bitmaps, one per (group, rank) row; got one Bitmap "
            "(a flat presence map goes to fold / fold_unfold_ranked)"
        )
    try:
        rs = list(rows)
    except TypeError:
        raise InvalidArgumentError(f"rows must be a sequence of Bitmaps, got {type(rows).__name__}") from None
    if not rs:
        raise InvalidArgumentError("no rows given: give one Bitmap per (group, rank) row")
    if set(map(type, rs)) != {Bitmap}:
        for i, r in enumerate(rs):
            if not isinstance(r, Bitmap):
                raise InvalidArgumentError(f"row {i} is a {type(r).__name__}, not a Bitmap")
    lengths = set(map(_NBITS, rs))
    C = len(rs[0])
    if len(lengths) > 1:
        i = next(i for i, r in enumerate(rs) if len(r) != C)
        raise InvalidArgumentError(
            f"rows of different lengths: row 0 has {C} bits, row {i} has {len(rs[i])}; "
            "every row holds one bit per chunk of the same request"
        )
    return rs, C


def _paired_windows(windows: Sequence[int], n_rows: int) -> tuple[int, ...]:
    ws = _windows(windows)
    if len(ws) != n_rows:
        raise InvalidArgumentError(
            f"{n_rows} rows and {len(ws)} windows: give one window per row (the window of the "
            "row's group, repeated for each of its ranks)"
        )
    return ws


def fold_grouped(rows: Sequence[Bitmap], windows: Sequence[int]) -> Bitmap:
    """C-bit map whose bit j is set iff a prefix of length j + 1 is servable by every row."""
    rs, C = _checked_rows(rows)
    ws = _paired_windows(windows, len(rs))
    out = Bitmap(C)
    bitops.fold_rows_into(list(map(_BUFFER, rs)), C, _kernel_windows(ws, C), out.buffer)
    return out


def unfold_grouped(hit: int, num_chunks: int, windows: Sequence[int]) -> list[Bitmap]:
    """One C-bit Bitmap per window: chunks [lo, hit) that row must keep.

    `hit` larger than C is clamped to C.
    """
    C = validation.count(num_chunks, "num_chunks")
    ws = _windows(windows)
    hit = validation.count(hit, "hit")
    return _unfold(min(hit, C), C, _kernel_windows(ws, C))


def _unfold(hit: int, C: int, kernel_windows: tuple[int, ...]) -> list[Bitmap]:
    out = Bitmap._zeros_many(C, len(kernel_windows))
    bitops.unfold_rows_into(hit, C, kernel_windows, list(map(_BUFFER, out)))
    return out


def fold_unfold_grouped(rows: Sequence[Bitmap], windows: Sequence[int]) -> tuple[int, list[Bitmap]]:
    """(hit, retain rows): fold_grouped, then highest_set_bit + 1, then unfold_grouped."""
    rs, C = _checked_rows(rows)
    ws = _paired_windows(windows, len(rs))
    kernel_ws = _kernel_windows(ws, C)
    servable = Bitmap(C)
    bitops.fold_rows_into(list(map(_BUFFER, rs)), C, kernel_ws, servable.buffer)
    hit = servable.highest_set_bit() + 1
    return hit, _unfold(hit, C, kernel_ws)
