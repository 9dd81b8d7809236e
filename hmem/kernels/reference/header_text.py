"""Plain-Python twin of hmem.kernels._native._header_text: the safetensors
header entries of many tensors, each followed by a comma."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

# the CPU-path switch every kernel module offers hmem.kernels, re-exported
from hmem.kernels.reference._paths import PATH_NAMES as PATH_NAMES
from hmem.kernels.reference._paths import active_path as active_path
from hmem.kernels.reference._paths import best_path as best_path
from hmem.kernels.reference._paths import select_path as select_path

if TYPE_CHECKING:
    from numpy.typing import NDArray


def _checked_text(value, what: str) -> bytes:
    if not isinstance(value, bytes) or b'"' in value or b"\\" in value:
        raise ValueError(f"{what} must be bytes without quotes or backslashes, got {value!r}")
    return value


def tensor_entries(
    prefix: bytes,
    ids: NDArray[np.int64],
    dtype: bytes,
    shapes: NDArray[np.int64],
    begins: NDArray[np.int64],
    ends: NDArray[np.int64],
) -> bytes:
    """``"<prefix><id>":{"dtype":"<dtype>","shape":[..],"data_offsets":[b,e]},``
    for each tensor, as one bytes object."""
    _checked_text(prefix, "prefix")
    _checked_text(dtype, "dtype")
    shapes = np.asarray(shapes, dtype=np.int64)
    if not len(shapes) == len(ids) == len(begins) == len(ends):
        raise ValueError("ids, shapes, begins and ends must have one row per tensor")
    name, kind = prefix.decode(), dtype.decode()
    return "".join(
        f'"{name}{int(i)}":{{"dtype":"{kind}","shape":[{",".join(str(int(x)) for x in shape)}],'
        f'"data_offsets":[{int(b)},{int(e)}]}},'
        for i, shape, b, e in zip(ids, shapes, begins, ends)
    ).encode()


def crc_entries(prefix: bytes, ids: NDArray[np.int64], crcs: NDArray[np.uint32]) -> bytes:
    """``"<prefix><id>":"<crc as 8 lower-case hex digits>",`` for each tensor."""
    _checked_text(prefix, "prefix")
    if len(ids) != len(crcs):
        raise ValueError("ids and crcs must have one value per tensor")
    name = prefix.decode()
    return "".join(f'"{name}{int(i)}":"{int(c):08x}",' for i, c in zip(ids, crcs)).encode()
