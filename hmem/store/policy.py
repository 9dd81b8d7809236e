"""Which entries go first when a store must shrink.

Score = importance x (1 + ln(1 + access_count)): important entries and
often-retrieved entries stay.  The lowest score goes first; among equal
scores the older timestamp, then the lower entry id.
"""

from __future__ import annotations

import numpy as np


def scores(importance: np.ndarray, access_count: np.ndarray) -> np.ndarray:
    return importance.astype(np.float64) * (1.0 + np.log1p(access_count.astype(np.float64)))


def order(importance: np.ndarray, access_count: np.ndarray, timestamp: np.ndarray, entry_id: np.ndarray) -> np.ndarray:
    """The permutation that puts entries (given as columns) in eviction
    order, first to evict first."""
    return np.lexsort((entry_id, timestamp, scores(importance, access_count)))


def eviction_order(records: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`positions` (of live records) sorted from first to evict to last."""
    rows = records[positions]
    return positions[order(rows["importance"], rows["access_count"], rows["timestamp"], rows["entry_id"])]
