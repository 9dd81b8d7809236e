"""Similarity queries: rank a layer's entries by signature, re-rank a
shortlist by the exact cosine of pooled keys, and count accesses
(docs/format.md, "Signatures")."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hmem import validation
from hmem.store.projection import similarity
from hmem.store.reading import EntryReader
from hmem.store.results import QueryResult, as_framework
from hmem.store.state import StoreState
from hmem.store.tensors import as_rows

FRAMEWORKS = ("numpy", "torch")


class Queries:
    """Queries over one StoreState."""

    def __init__(self, state: StoreState, reader: EntryReader) -> None:
        self.state = state
        self.reader = reader

    def query(self, query: Any, layer_idx: int, top_k: int, *, rerank: bool, shortlist_factor: int,
              framework: str, count_access: bool) -> list[QueryResult]:
        """See Store.query."""
        state = self.state
        q = as_rows(query, "query", state.config.embed_dim, allow_vector=True)
        layer = validation.layer_index(layer_idx)
        k = validation.top_k(top_k)
        validation.choice(framework, "framework", FRAMEWORKS)
        factor = validation.integer(shortlist_factor, "shortlist_factor", low=1) if rerank else 1
        signature, q_mean = state.projector.signature_and_mean(q)
        positions, dists = state.index.search(layer, signature, k * factor)
        sims = np.asarray(similarity(dists, state.config.hdc_dim))
        cosines: np.ndarray | None = None
        if rerank and len(positions):
            cosines = self._cosines(positions, q_mean)
            order = np.lexsort((state.records["entry_id"][positions], -cosines))[:k]
            positions, sims, cosines = positions[order], sims[order], cosines[order]
        results = [self._result(int(pos), float(sims[i]), None if cosines is None else float(cosines[i]),
                                framework) for i, pos in enumerate(positions)]
        if count_access and not state.read_only and len(positions):
            self.count_access(positions)
            results = [dataclasses.replace(r, access_count=int(state.records["access_count"][pos]))
                       for r, pos in zip(results, positions)]
        return results

    def _cosines(self, positions: np.ndarray, target: np.ndarray) -> np.ndarray:
        # Row by row with numpy's own reduction (not a BLAS product, whose
        # rounding depends on a row's place in the block): an entry's cosine
        # is the same whatever the other candidates, and equal keys tie.
        pooled = np.stack([self.reader.tensor(int(pos), "p") for pos in positions]).astype(np.float64)
        norms = np.sqrt((pooled * pooled).sum(axis=1)) * np.sqrt((target * target).sum())
        dots = (pooled * target).sum(axis=1)
        return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)

    def count_access(self, positions: np.ndarray) -> None:
        """One more access of each record (persisted by the next flush)."""
        state = self.state
        counts = state.records["access_count"]
        counts[positions] = np.minimum(counts[positions].astype(np.int64) + 1, validation.U32_MAX)
        state.dirty.update(int(p) for p in positions if p < state.committed_n)

    def _result(self, pos: int, sim: float, cosine: float | None, framework: str) -> QueryResult:
        row = self.state.records[pos]
        keys, values = self.reader.kv(pos)
        return QueryResult(
            entry_id=int(row["entry_id"]),
            layer_idx=int(row["layer_idx"]),
            score=sim if cosine is None else cosine,
            similarity=sim,
            cosine=cosine,
            keys=as_framework(keys, framework),
            values=as_framework(values, framework),
            n_tokens=int(row["n_tokens"]),
            importance=float(row["importance"]),
            timestamp=int(row["timestamp"]),
            access_count=int(row["access_count"]),
            shard_idx=int(row["shard_idx"]),
        )
