"""Entry ids as people read them: runs of consecutive ids as ranges."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def id_ranges(ids: Sequence[int] | np.ndarray, *, limit: int = 20) -> str:
    """``3-7,9,12-40`` for ascending unique ids; past `limit` runs, the rest
    is counted (``..., and 17 more``) so that a line stays a line."""
    array = np.asarray(ids, dtype=np.uint64)
    if not len(array):
        return "none"
    breaks = np.flatnonzero(np.diff(array) != 1) + 1  # where a run of consecutive ids starts
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(array)]])
    shown = [
        str(array[a]) if b == a + 1 else f"{array[a]}-{array[b - 1]}"
        for a, b in zip(starts[:limit].tolist(), stops[:limit].tolist())
    ]
    rest = int(len(array) - stops[min(limit, len(stops)) - 1])
    return ",".join(shown) + (f", and {rest} more" if rest > 0 else "")
