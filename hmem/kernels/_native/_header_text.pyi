"""Types of the compiled hmem.kernels._native._header_text (from _header_text.pyx)."""

import numpy as np
from numpy.typing import NDArray

PATH_NAMES: tuple[str, str, str]

def best_path() -> int: ...
def select_path(limit: int) -> int: ...
def active_path() -> int: ...
def tensor_entries(
    prefix: bytes,
    ids: NDArray[np.int64],
    dtype: bytes,
    shapes: NDArray[np.int64],
    begins: NDArray[np.int64],
    ends: NDArray[np.int64],
) -> bytes: ...
def crc_entries(prefix: bytes, ids: NDArray[np.int64], crcs: NDArray[np.uint32]) -> bytes: ...
