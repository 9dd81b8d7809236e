"""K/V rows in their storage dtype (StoreConfig.storage_dtype; docs/format.md,
"Storage dtypes"): the tensors an entry's rows become in its shard, and the
float32 rows read back.

- f32: as given;
- f16: IEEE half, rounded to nearest; exact for rows that were half;
- bf16: the top 16 bits of the float32, rounded to nearest even; exact for
  rows that were bfloat16 (a bfloat16 widened to float32 has zero low bits);
- int8: symmetric per row with a float32 scale (hmem/store/quantize.py).

Rows are finite float32 when they get here; a row whose values overflow the
narrower dtype is refused, never stored as infinity.
"""

from __future__ import annotations

import numpy as np

from hmem.errors import InvalidTensorError
from hmem.store.quantize import dequantize_rows, quantize_rows


def to_bf16_words(rows: np.ndarray) -> np.ndarray:
    """float32 rows as bfloat16 words (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def from_bf16_words(words: np.ndarray) -> np.ndarray:
    """bfloat16 words (uint16) as float32 rows, exactly."""
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(rows: np.ndarray, storage: str, what: str) -> dict[str, np.ndarray]:
    """The stored tensor of float32 `rows` ("" key) and, for int8, its scales ("s")."""
    if storage == "f32":
        return {"": rows}
    if storage == "int8":
        q, scales = quantize_rows(rows)
        return {"": q, "s": scales}
    if storage == "f16":
        with np.errstate(over="ignore"):
            stored = rows.astype("<f2")
        finite = np.isfinite(stored)
    else:
        stored = to_bf16_words(rows)
        finite = (stored & np.uint16(0x7F80)) != np.uint16(0x7F80)
    if not finite.all():
        raise InvalidTensorError(f"{what} holds values too large for the store's storage_dtype {storage}",
                                 hint="store them in a store with a wider storage_dtype (f32)")
    return {"": stored}


def decode(stored: np.ndarray, scales: np.ndarray | None, storage: str) -> np.ndarray:
    """float32 rows of a stored tensor (a view when stored as f32)."""
    if storage == "f32":
        return stored
    if storage == "int8":
        assert scales is not None
        return dequantize_rows(stored, scales)
    if storage == "f16":
        return stored.astype(np.float32)
    return from_bf16_words(stored)
