"""Bitmap: a fixed-length sequence of bits packed LSB-first.

Bit i lives in byte i // 8 under mask 1 << (i % 8), the layout of
``numpy.packbits(..., bitorder="little")``.  A Bitmap of n bits holds exactly
ceil(n / 8) bytes and keeps every bit past n zero, so no operation can report
a bit beyond the length.

Policies:

- Binary operators (``&``, ``|``, ``^``) need equal lengths and raise
  InvalidArgumentError otherwise: silently padding or cutting one side hides
  layout bugs.  Use ``resized`` (zero-extend or cut) to combine maps of
  different lengths on purpose; ``merge_bitmaps`` does so for presence maps.
- Equality compares length and bits.  A Bitmap is mutable (``set``,
  ``clear``, ``set_range``), so it is unhashable, like ``bytearray``; use
  ``(len(bm), bm.to_bytes())`` as a key.
- Pickling stores the length and the packed bytes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from hmem import validation
from hmem.errors import InvalidArgumentError
from hmem.kernels import bitops

_REPR_MAX_RUNS = 8


def _nbytes(nbits: int) -> int:
    return (nbits + 7) >> 3


def _length(value: Any, what: str = "length") -> int:
    return validation.count(value, what)


class Bitmap:
    """A fixed-length, LSB-first packed bitmap."""

    __slots__ = ("_buf", "_nbits")

    def __init__(self, nbits: int = 0) -> None:
        self._nbits = _length(nbits)
        self._buf = bytearray(_nbytes(self._nbits))

    # ---- construction ---------------------------------------------------

    @classmethod
    def _wrap(cls, buf: bytearray, nbits: int) -> Bitmap:
        bm = cls.__new__(cls)
        bm._buf = buf
        bm._nbits = nbits
        bm._clear_tail()
        return bm

    @classmethod
    def _zeros_many(cls, nbits: int, count: int) -> list[Bitmap]:
        """`count` zeroed Bitmaps of `nbits` (checked by the caller) bits,
        made without per-object argument checks: the grouped operators make
        one per row of every request."""
        nbytes = _nbytes(nbits)
        out = []
        for _ in range(count):
            bm = cls.__new__(cls)
            bm._buf = bytearray(nbytes)
            bm._nbits = nbits
            out.append(bm)
        return out

    @classmethod
    def zeros(cls, nbits: int) -> Bitmap:
        return cls(nbits)

    @classmethod
    def ones(cls, nbits: int) -> Bitmap:
        return cls.prefix(nbits, nbits)

    @classmethod
    def prefix(cls, nbits: int, count: int) -> Bitmap:
        """`nbits` bits of which the first `count` are set."""
        bm = cls(nbits)
        count = validation.integer(count, "count", low=0, high=bm._nbits)
        bitops.set_range(bm._buf, 0, count)
        return bm

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, nbits: int | None = None) -> Bitmap:
        """Packed LSB-first bytes; `nbits` defaults to 8 * len(data).

        The data must be exactly ceil(nbits / 8) bytes long; bits of the last
        byte past `nbits` are ignored.
        """
        buf = bytearray(data)
        n = len(buf) * 8 if nbits is None else _length(nbits, "nbits")
        if len(buf) != _nbytes(n):
            raise InvalidArgumentError(f"{len(buf)} bytes cannot hold exactly {n} bits (need {_nbytes(n)} bytes)")
        return cls._wrap(buf, n)

    @classmethod
    def from_numpy(cls, bits: np.ndarray) -> Bitmap:
        """One array element per bit: a 1-D bool array, or integers that are 0 or 1."""
        arr = np.asarray(bits)
        if arr.ndim != 1:
            raise InvalidArgumentError(f"expected a 1-D array of bits, got shape {arr.shape}")
        if arr.dtype != np.bool_:
            if not np.issubdtype(arr.dtype, np.integer):
                raise InvalidArgumentError(f"expected a bool or integer array, got {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() > 1):
                raise InvalidArgumentError("integer bit arrays may only hold 0 and 1")
        packed = np.packbits(arr.astype(np.bool_, copy=False), bitorder="little")
        return cls._wrap(bytearray(packed.tobytes()), int(arr.shape[0]))

    @classmethod
    def from_indices(cls, indices: Iterable[int], nbits: int) -> Bitmap:
        """The bits at `indices` set; every index must be in [0, nbits)."""
        n = _length(nbits, "nbits")
        idx = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices))
        if idx.size == 0:
            idx = idx.astype(np.int64)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise InvalidArgumentError(f"indices must be a flat sequence of integers, got {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
            raise InvalidArgumentError(f"index {bad} is outside a bitmap of {n} bits")
        bits = np.zeros(n, dtype=np.bool_)
        bits[idx] = True
        return cls.from_numpy(bits)

    # ---- conversion -----------------------------------------------------

    def to_bytes(self) -> bytes:
        return bytes(self._buf)

    def to_numpy(self) -> np.ndarray:
        """A bool array with one element per bit."""
        packed = np.frombuffer(self._buf, dtype=np.uint8)
        return np.unpackbits(packed, count=self._nbits, bitorder="little").astype(np.bool_)

    def indices(self) -> np.ndarray:
        """Indices of the set bits, ascending (int64)."""
        return np.flatnonzero(self.to_numpy()).astype(np.int64)

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs of set bits as half-open (start, end) pairs, ascending."""
        out = []
        p = bitops.next_bit(self._buf, 0, self._nbits, 1)
        while p < self._nbits:
            end = bitops.next_bit(self._buf, p, self._nbits, 0)
            out.append((p, end))
            p = bitops.next_bit(self._buf, end, self._nbits, 1)
        return out

    @property
    def buffer(self) -> bytearray:
        """The packed bytes, shared with the kernels that write into it.

        Writers must keep the bits past the length zero.
        """
        return self._buf

    # ---- single bits and ranges ------------------------------------------

    def __len__(self) -> int:
        return self._nbits

    def _index(self, i: int) -> int:
        i = operator.index(i)
        if not 0 <= i < self._nbits:
            raise IndexError(f"bit {i} is outside a bitmap of {self._nbits} bits")
        return i

    def test(self, i: int) -> bool:
        i = self._index(i)
        return bool((self._buf[i >> 3] >> (i & 7)) & 1)

    __getitem__ = test

    def set(self, i: int) -> None:
        i = self._index(i)
        self._buf[i >> 3] |= 1 << (i & 7)

    def clear(self, i: int) -> None:
        i = self._index(i)
        self._buf[i >> 3] &= ~(1 << (i & 7)) & 0xFF

    def _range(self, start: int, end: int) -> tuple[int, int]:
        start, end = operator.index(start), operator.index(end)
        if not 0 <= start <= end <= self._nbits:
            raise IndexError(f"range [{start}, {end}) is outside a bitmap of {self._nbits} bits")
        return start, end

    def set_range(self, start: int, end: int) -> None:
        """Set bits [start, end)."""
        bitops.set_range(self._buf, *self._range(start, end))

    def clear_range(self, start: int, end: int) -> None:
        """Clear bits [start, end)."""
        bitops.clear_range(self._buf, *self._range(start, end))

    # ---- queries ----------------------------------------------------------

    def popcount(self) -> int:
        return bitops.popcount(self._buf, self._nbits)

    def highest_set_bit(self) -> int:
        """Index of the highest set bit, -1 if none."""
        return bitops.highest_set_bit(self._buf, self._nbits)

    def leading_ones(self) -> int:
        """Number of consecutive set bits from index 0."""
        return bitops.next_bit(self._buf, 0, self._nbits, 0)

    def leading_zeros(self) -> int:
        """Number of consecutive clear bits from index 0."""
        return bitops.next_bit(self._buf, 0, self._nbits, 1)

    def any(self) -> bool:
        return self.leading_zeros() < self._nbits

    # ---- whole-map operations ----------------------------------------------

    def copy(self) -> Bitmap:
        return Bitmap._wrap(bytearray(self._buf), self._nbits)

    def resized(self, nbits: int) -> Bitmap:
        """A copy cut or zero-extended to `nbits` bits."""
        n = _length(nbits, "nbits")
        buf = bytearray(self._buf[: _nbytes(n)])
        buf.extend(bytes(_nbytes(n) - len(buf)))
        return Bitmap._wrap(buf, n)

    def _clear_tail(self) -> None:
        spare = len(self._buf) * 8 - self._nbits
        if spare:
            self._buf[-1] &= 0xFF >> spare

    def _words(self) -> np.ndarray:
        return np.frombuffer(self._buf, dtype=np.uint8)

    def _binary(self, other: object, op) -> Bitmap:
        if not isinstance(other, Bitmap):
            return NotImplemented
        if other._nbits != self._nbits:
            raise InvalidArgumentError(
                f"bitmaps of different lengths ({self._nbits} and {other._nbits} bits); "
                "resize one with .resized(n) first"
            )
        result = op(self._words(), other._words())
        return Bitmap._wrap(bytearray(result.tobytes()), self._nbits)

    def __and__(self, other: Bitmap) -> Bitmap:
        return self._binary(other, np.bitwise_and)

    def __or__(self, other: Bitmap) -> Bitmap:
        return self._binary(other, np.bitwise_or)

    def __xor__(self, other: Bitmap) -> Bitmap:
        return self._binary(other, np.bitwise_xor)

    def __invert__(self) -> Bitmap:
        return Bitmap._wrap(bytearray(np.invert(self._words()).tobytes()), self._nbits)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bitmap):
            return NotImplemented
        return self._nbits == other._nbits and self._buf == other._buf

    __hash__ = None  # type: ignore[assignment]  # mutable: see the module docstring
    __array_ufunc__ = None  # numpy must not treat a Bitmap as a sequence of bits

    def __reduce__(self):
        return (Bitmap.from_bytes, (bytes(self._buf), self._nbits))

    def __repr__(self) -> str:
        runs = self.runs()
        shown = ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs[:_REPR_MAX_RUNS])
        if len(runs) > _REPR_MAX_RUNS:
            shown += f", ... ({self.popcount()} set in {len(runs)} runs)"
        return f"Bitmap({self._nbits}, {{{shown}}})"
