"""Types of the compiled hmem.kernels._native._entries (from _entries.pyx)."""

from typing import Any

import numpy as np
from numpy.typing import NDArray

PATH_NAMES: tuple[str, str, str]

def best_path() -> int: ...
def select_path(limit: int) -> int: ...
def active_path() -> int: ...

# `items` may hold anything: scan_entries stops at the first item not of
# the common form and returns its index.
def scan_entries(
    items: list[Any],
    dim: int,
    max_tokens: int,
    max_layer: int,
    max_importance: float,
    tokens: NDArray[np.int64],
    layers: NDArray[np.int64],
    weights: NDArray[np.float64],
    entry_type: type | None = None,
) -> int: ...
def join_rows(
    items: list[Any],
    starts: NDArray[np.int64],
    k_out: NDArray[np.float32],
    v_out: NDArray[np.float32],
    entry_type: type | None = None,
) -> None: ...
