"""Which entries go first when a store must shrink.

Score = importance x (1 + ln(1 + access_count)): important entries and
often-retrieved entries stay.  The lowest score goes first; among equal
scores the older timestamp, then the lower entry id.
"""

from __future__ import annotations

import numpy as np


def scores(importance: np.ndarray, access_count: np.ndarray) -> np.ndarray:
    return importance.astype(np.float64) * (1.0 + np.log1p(access_count.astype(np.float64)))


def eviction_order(records: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`positions` (of live records) sorted from first to evict to last."""
    rows = records[positions]
    order = np.lexsort((rows["entry_id"], rows["timestamp"], scores(rows["importance"], rows["access_count"])))
    return positions[order]
