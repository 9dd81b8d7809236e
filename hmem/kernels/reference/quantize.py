"""Plain-numpy twin of hmem.kernels._native._quantize (INT8 rows, docs/format.md "INT8 storage").

Per row: scale = max|x| / 127 in float32 (0 for a zero row; one step
smaller when 127 * scale would overflow, at the top of float32's range); q =
round-half-even(x / scale), the division in float32, clamped to [-127, 127].
Dequantization is float32(q) * scale in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

# the CPU-path switch every kernel module offers hmem.kernels, re-exported
from hmem.kernels.reference._paths import PATH_NAMES as PATH_NAMES
from hmem.kernels.reference._paths import active_path as active_path
from hmem.kernels.reference._paths import best_path as best_path
from hmem.kernels.reference._paths import select_path as select_path

if TYPE_CHECKING:
    from numpy.typing import NDArray


def quantize_rows(rows: NDArray[np.float32], q: NDArray[np.int8], scales: NDArray[np.float32]) -> None:
    rows = np.asarray(rows, dtype=np.float32)
    if q.shape != rows.shape or scales.shape != (rows.shape[0],):
        raise ValueError("q must be [n, d] and scales [n] for rows of shape [n, d]")
    peak = np.abs(rows).max(axis=1) if rows.shape[1] else np.zeros(rows.shape[0], np.float32)
    scale = (peak / np.float32(127)).astype(np.float32)
    with np.errstate(over="ignore"):
        top = np.isinf(scale * np.float32(127))  # rounded up at the top of the range
    scale[top] = np.nextafter(scale[top], np.float32(0))
    scales[:] = scale
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    values = np.clip(np.rint(rows / safe[:, None]), -127, 127)
    values[scale == 0] = 0
    q[:] = values.astype(np.int8)


def dequantize_rows(q: NDArray[np.int8], scales: NDArray[np.float32], out: NDArray[np.float32]) -> None:
    if scales.shape != (q.shape[0],) or out.shape != q.shape:
        raise ValueError("scales must be [n] and out [n, d] for q of shape [n, d]")
    out[:] = q.astype(np.float32) * scales.astype(np.float32)[:, None]
