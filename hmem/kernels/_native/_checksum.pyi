"""Types of the compiled hmem.kernels._native._checksum (from _checksum.pyx)."""

from typing import Any, TypeAlias

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Buffer

# crc32c and crc32c_pieces read the raw bytes of any C-contiguous buffer:
# bytes, bytearray, memoryview, mmap, or a numpy array of any plain dtype.
# numpy declares its arrays buffers to type checkers of Python 3.12+ only,
# hence NDArray besides Buffer.
_AnyBuffer: TypeAlias = Buffer | NDArray[Any]

PATH_NAMES: tuple[str, str, str]

def best_path() -> int: ...
def select_path(limit: int) -> int: ...
def active_path() -> int: ...
def crc32c(data: _AnyBuffer, crc: int = 0) -> int: ...
def crc32c_rows(rows: NDArray[np.uint8], skip_start: int, skip_end: int) -> NDArray[np.uint32]: ...
def crc32c_pieces(data: _AnyBuffer, bounds: NDArray[np.int64]) -> NDArray[np.uint32]: ...
