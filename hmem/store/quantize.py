"""INT8 storage of K/V rows (docs/format.md, "INT8 storage"): symmetric,
one float32 scale per row."""

from __future__ import annotations

import numpy as np

from hmem.kernels import quantize as quantize_kernels


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 per row: scale = max|row| / 127 (0 for a zero row),
    q = round(x / scale) in [-127, 127]."""
    q = np.empty(rows.shape, dtype=np.int8)
    scales = np.empty(rows.shape[0], dtype=np.float32)
    quantize_kernels.quantize_rows(rows, q, scales)
    return q, scales


def dequantize_rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    out = np.empty(q.shape, dtype=np.float32)
    quantize_kernels.dequantize_rows(q, scales, out)
    return out
