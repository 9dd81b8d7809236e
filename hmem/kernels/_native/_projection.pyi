"""Types of the compiled hmem.kernels._native._projection (from _projection.pyx)."""

from typing import SupportsIndex, TypeAlias

import numpy as np
from numpy.typing import NDArray

# A `const unsigned char[::1]` parameter takes any 1-d C-contiguous buffer of
# unsigned bytes (buffer format "B"); an `unsigned char[::1]` one must also
# be writable.
_Bytes: TypeAlias = bytes | bytearray | memoryview | NDArray[np.uint8]
_WritableBytes: TypeAlias = bytearray | memoryview | NDArray[np.uint8]

PATH_NAMES: tuple[str, str, str]

def best_path() -> int: ...
def select_path(limit: int) -> int: ...
def active_path() -> int: ...
def variant() -> str: ...

# seed, count, m, rounds, hdc_dim and blocks are read with operator.index:
# numpy integers pass as well as ints.
def splitmix64(seed: SupportsIndex, count: SupportsIndex) -> NDArray[np.uint64]: ...
def signs_table(
    seed: SupportsIndex, m: SupportsIndex, rounds: SupportsIndex, blocks: SupportsIndex
) -> NDArray[np.uint8]: ...
def signature(
    rows: NDArray[np.float32],
    signs: _Bytes,
    m: SupportsIndex,
    rounds: SupportsIndex,
    hdc_dim: SupportsIndex,
    out: _WritableBytes,
    sums: NDArray[np.float64] | None = None,
) -> None: ...
def signature_many(
    rows: NDArray[np.float32],
    starts: NDArray[np.int64],
    signs: _Bytes,
    m: SupportsIndex,
    rounds: SupportsIndex,
    hdc_dim: SupportsIndex,
    out: NDArray[np.uint8],
    sums: NDArray[np.float64] | None = None,
) -> None: ...
def signature_of_sum(
    sums: NDArray[np.float64],
    signs: _Bytes,
    m: SupportsIndex,
    rounds: SupportsIndex,
    hdc_dim: SupportsIndex,
    out: _WritableBytes,
) -> None: ...
def bf16_token_sums(words: NDArray[np.uint16], sums: NDArray[np.float64]) -> None: ...
