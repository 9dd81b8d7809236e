"""Types of the compiled hmem.kernels._native._hamming (from _hamming.pyx)."""

from typing import SupportsIndex, TypeAlias

import numpy as np
from numpy.typing import NDArray

# A `const unsigned char[::1]` parameter takes any 1-d C-contiguous buffer of
# unsigned bytes (buffer format "B").
_Bytes: TypeAlias = bytes | bytearray | memoryview | NDArray[np.uint8]
# One entry per row, 0 = skip the row; bool arrays are read as their bytes.
_Alive: TypeAlias = _Bytes | NDArray[np.bool_] | None

PATH_NAMES: tuple[str, str, str]

def best_path() -> int: ...
def select_path(limit: int) -> int: ...
def active_path() -> int: ...
def distances(query: _Bytes, sigs: NDArray[np.uint8]) -> NDArray[np.int32]: ...
def topk(
    query: _Bytes, sigs: NDArray[np.uint8], alive: _Alive, k: SupportsIndex, lo: int = 0, hi: int | None = None
) -> tuple[NDArray[np.int64], NDArray[np.int32]]: ...
def topk_many(
    queries: NDArray[np.uint8],
    sigs: NDArray[np.uint8],
    alive: _Alive,
    k: SupportsIndex,
    lo: int = 0,
    hi: int | None = None,
) -> tuple[NDArray[np.int64], NDArray[np.int32], NDArray[np.int64]]: ...
def gather_rows(src: NDArray[np.uint8], rows: NDArray[np.int64], out: NDArray[np.uint8]) -> None: ...
