"""Large in-memory arrays whose pages the kernel maps when they are made.

Writing into freshly allocated memory faults its pages in one at a time;
on virtual machines each fault is costly (filling 512 MB that way measured
7x slower than having the kernel map it at once, MAP_POPULATE).  Arrays
of at least POPULATE_MIN_BYTES that hmem fills whole right away (the
signature matrices built at open, the rows and records of a bulk put)
come from here.
"""

from __future__ import annotations

import mmap
import math

import numpy as np

POPULATE_MIN_BYTES = 1 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", None)  # Linux only


def zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.zeros, its pages mapped at once when it is large (anonymous
    memory comes zeroed): for arrays about to be written all over."""
    dt = np.dtype(dtype)
    if _POPULATE is None or math.prod(shape) * dt.itemsize < POPULATE_MIN_BYTES:
        return np.zeros(shape, dtype=dt)
    return filled_soon(shape, dt)


def filled_soon(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array the caller is about to fill whole
    (np.empty where populating is not available or not worth it)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if _POPULATE is None or nbytes == 0 or nbytes < POPULATE_MIN_BYTES:
        return np.empty(shape, dtype=dt)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    except OSError:  # no room to map it whole at once: fault it in as usual
        return np.empty(shape, dtype=dt)
    return np.frombuffer(buf, dtype=dt).reshape(shape)
