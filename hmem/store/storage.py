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
from hmem.kernels import projection as projection_kernels
from hmem.store.quantize import dequantize_rows, quantize_rows


def to_bf16_words(rows: np.ndarray) -> np.ndarray:
    """float32 rows as bfloat16 words (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def from_bf16_words(words: np.ndarray) -> np.ndarray:
    """bfloat16 words (uint16) as float32 rows, exactly."""
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


class Bf16Rows:
    """bfloat16 K/V rows as their 16-bit words, in a token-major uint16 view
    [tokens, ...] of the file they come from (not copied).  hmem's importer
    hands put_many these for BF16 tensors (hmem/transfer/kv_import.py), so
    that a bf16 store keeps the words as they are and other stores widen
    them once, entry by entry: a BF16 file never makes float32 rows of the
    whole import at once, nor a round trip through float32 back to the
    same words."""

    __slots__ = ("view", "shape")

    def __init__(self, view: np.ndarray) -> None:
        if view.dtype != np.uint16 or view.ndim < 2:
            raise InvalidTensorError(
                f"bfloat16 words must be a uint16 array [tokens, ...], got {view.dtype} {list(view.shape)}"
            )
        self.view = view
        width = 1
        for n in view.shape[1:]:
            width *= int(n)
        self.shape = (int(view.shape[0]), width)

    def words(self) -> np.ndarray:
        """The words as a C-contiguous [tokens, width] uint16 matrix."""
        return np.ascontiguousarray(self.view).reshape(self.shape)

    def widened(self) -> np.ndarray:
        """The rows as a new C-contiguous float32 matrix (exact)."""
        return widen(self.words())

    def token_sums(self) -> np.ndarray:
        """The float64 token sums of the rows ([width]): what the projection
        sums of the widened rows (hmem/store/projection.py), read from the
        words where they lie."""
        view = self.view
        if view.ndim == 2:
            view = view[:, None, :]
        elif view.ndim > 3:
            view = view.reshape(view.shape[0], -1, view.shape[-1])
        sums = np.empty(self.shape[1], dtype=np.float64)
        projection_kernels.bf16_token_sums(view, sums)
        return sums


class WideningRows:
    """bfloat16 words that an f32 store keeps: they stand for their float32
    rows (dtype, shape, nbytes) and are widened as they are copied into the
    open shard (hmem/store/shard_builder.py), so that no float32 copy of
    them is made in between."""

    __slots__ = ("view", "shape", "nbytes")
    dtype = np.dtype(np.float32)
    itemsize = 4

    def __init__(self, rows: Bf16Rows) -> None:
        self.view = rows.view
        self.shape = rows.shape
        self.nbytes = rows.shape[0] * rows.shape[1] * 4

    def __len__(self) -> int:
        return self.shape[0]

    def copy_into(self, target: memoryview) -> None:
        """Write the float32 rows into `target` (exactly nbytes bytes)."""
        out = np.frombuffer(target, dtype=np.uint32).reshape(self.view.shape)
        np.left_shift(self.view, 16, out=out, dtype=np.uint32)


def widen(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 words [tokens, ...] (any strides) as float32 rows [tokens,
    width], exactly, into `out` (a float32 array of at least as many
    values) when given."""
    flat = np.empty(words.size, dtype=np.float32) if out is None else out.reshape(-1)[: words.size]
    np.left_shift(words, 16, out=flat.view(np.uint32).reshape(words.shape), dtype=np.uint32)
    return flat.reshape(words.shape[0], -1)


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
        raise InvalidTensorError(
            f"{what} holds values too large for the store's storage_dtype {storage}",
            hint="store them in a store with a wider storage_dtype (f32)",
        )
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
