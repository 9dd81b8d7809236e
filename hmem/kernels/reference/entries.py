"""Plain-Python twin of hmem.kernels._native._entries: the scan of a bulk
put's entries for the common form, and the join of their rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

# the CPU-path switch every kernel module offers hmem.kernels, re-exported
from hmem.kernels.reference._paths import PATH_NAMES as PATH_NAMES
from hmem.kernels.reference._paths import active_path as active_path
from hmem.kernels.reference._paths import best_path as best_path
from hmem.kernels.reference._paths import select_path as select_path

if TYPE_CHECKING:
    from numpy.typing import NDArray


def _rows(array: object, dim: int, max_tokens: int) -> bool:
    """An ndarray of native float32 rows [n, dim], C-contiguous, 0 < n <= max_tokens."""
    return (
        type(array) is np.ndarray
        and array.dtype == np.float32
        and array.dtype.isnative
        and array.ndim == 2
        and array.shape[1] == dim
        and 0 < array.shape[0] <= max_tokens
        and array.flags.c_contiguous
    )


def _common(item: object, entry_type: type | None) -> bool:
    """A plain 4-tuple, or an entry_type 5-tuple without meta."""
    if type(item) is tuple:
        return len(item) == 4
    return (
        entry_type is not None
        and type(item) is entry_type
        and isinstance(item, tuple)
        and len(item) == 5
        and item[4] is None
    )


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
) -> int:
    """The index of the first entry not of the common form, or len(items);
    tokens, layers and weights of the entries before it filled."""
    if type(items) is not list:
        raise TypeError("items must be a list")
    n = len(items)
    if len(tokens) < n or len(layers) < n or len(weights) < n:
        raise ValueError(f"tokens, layers and weights must hold {n} values each")
    for i, item in enumerate(items):
        if not _common(item, entry_type):
            return i
        keys, values, layer, importance = item[:4]
        if type(layer) is not int or not 0 <= layer <= max_layer:
            return i
        if type(importance) is not float or not 0.0 <= importance <= max_importance:
            return i
        if not (_rows(keys, dim, max_tokens) and _rows(values, dim, max_tokens)):
            return i
        tokens[i] = keys.shape[0]
        if values.shape[0] != keys.shape[0]:
            return i
        layers[i] = layer
        weights[i] = importance
    return n


def join_rows(
    items: list[Any],
    starts: NDArray[np.int64],
    k_out: NDArray[np.float32],
    v_out: NDArray[np.float32],
    entry_type: type | None = None,
) -> None:
    """Entry e's keys into rows starts[e] .. starts[e + 1] - 1 of k_out, its values into v_out's."""
    if type(items) is not list:
        raise TypeError("items must be a list")
    n, dim = len(items), k_out.shape[1]
    if len(starts) != n + 1 or v_out.shape != k_out.shape:
        raise ValueError("starts must hold len(items) + 1 offsets and k_out, v_out the same shape")
    if n and (starts[0] != 0 or starts[n] != k_out.shape[0]):
        raise ValueError("starts must run from 0 to the output's row count")
    for i, item in enumerate(items):
        count = int(starts[i + 1] - starts[i])
        if (
            not _common(item, entry_type)
            or not _rows(item[0], dim, count)
            or not _rows(item[1], dim, count)
            or item[0].shape[0] != count
            or item[1].shape[0] != count
        ):
            raise ValueError(f"entry {i} is not as scan_entries found it")
    for i, item in enumerate(items):
        k_out[starts[i] : starts[i + 1]] = item[0]
        v_out[starts[i] : starts[i + 1]] = item[1]
