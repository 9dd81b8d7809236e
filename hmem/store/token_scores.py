"""Token-level scores of a query's candidates (docs/format.md, "Token
re-rank"): for each of the query's key rows its best cosine over a
candidate's stored key rows, averaged over the query's rows ("max-sim").

Mean pooling keeps what a whole entry is about and loses the tokens that
make one text follow another (the names and terms a document repeats);
max-sim keeps them, at the price of every candidate's rows, which is why
it re-ranks a shortlist and never scans a layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Candidates' rows scored per matrix product: bounds the product's memory
# (query rows x this many float32) whatever the shortlist.
_BLOCK_ROWS = 1 << 16


def _unit_rows(rows: np.ndarray) -> np.ndarray:
    """Float32 rows scaled to unit length (a zero row stays zero: its
    cosine with anything is 0)."""
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
    norms[norms == 0] = np.inf
    return rows / norms[:, None]


def max_sim(query_rows: np.ndarray, candidates: Sequence[np.ndarray]) -> np.ndarray:
    """The max-sim score of each candidate (a [t_i, d] matrix of its key
    rows, t_i >= 1) against the query's rows ([q, d]), float64 [len(candidates)]:
    mean over the query's rows of the largest cosine with the candidate's
    rows.  Cosines are float32 dot products of unit rows; each score is
    rounded to float32, so that candidates with the same rows tie."""
    if not len(candidates):
        return np.zeros(0)
    query = _unit_rows(query_rows)
    lengths = np.array([len(c) for c in candidates], dtype=np.int64)
    if (lengths < 1).any():
        raise ValueError("every candidate needs at least one row")
    scores = np.zeros(len(candidates))
    first = 0
    while first < len(candidates):
        # as many whole candidates as fit in a block (at least one)
        ends = np.cumsum(lengths[first:])
        last = first + max(1, int(np.searchsorted(ends, _BLOCK_ROWS, side="right")))
        rows = _unit_rows(np.concatenate(candidates[first:last]))
        cosines = query @ rows.T  # [q, rows of the block]
        starts = np.concatenate(([0], np.cumsum(lengths[first:last])[:-1]))
        best = np.maximum.reduceat(cosines, starts, axis=1)  # [q, candidates of the block]
        scores[first:last] = best.mean(axis=0, dtype=np.float64)
        first = last
    return scores.astype(np.float32).astype(np.float64)
