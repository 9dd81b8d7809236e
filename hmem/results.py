"""What a query returns and what stats() reports."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hmem.config import StoreConfig


@dataclasses.dataclass(frozen=True)
class QueryResult:
    """One retrieved entry.

    ``score`` ranks the results: the cosine of the pooled keys when the query
    re-ranked its shortlist, else the signature similarity.  ``keys`` and
    ``values`` are [n_tokens, embed_dim] float32 (read-only views of the
    shard's memory map when stored as F32; torch tensors when the query
    asked for framework="torch").
    """

    entry_id: int
    layer_idx: int
    score: float
    similarity: float  # 1 - hamming / hdc_dim
    cosine: float | None  # pooled-key cosine, when re-ranked
    keys: Any
    values: Any
    n_tokens: int
    importance: float
    timestamp: int  # nanoseconds since the Unix epoch
    access_count: int  # including this query's access
    shard_idx: int


@dataclasses.dataclass(frozen=True)
class ShardStats:
    index: int
    file: str
    bytes: int
    entries: int
    dead_entries: int
    dead_bytes: int
    committed: bool


@dataclasses.dataclass(frozen=True)
class StoreStats:
    path: str
    format_version: int
    generation: int
    config: StoreConfig
    entries: int  # live entries
    evicted: int  # records of evicted entries still in entries.bin
    unflushed: int  # entries put since the last flush
    layers: dict[int, int]  # live entries per layer
    shards: list[ShardStats]
    bytes_on_disk: int
    next_entry_id: int
    kernels: str

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = self.config.to_dict()
        out["layers"] = {str(k): v for k, v in self.layers.items()}
        return out


def as_framework(array: np.ndarray, framework: str) -> Any:
    if framework == "numpy":
        return array
    import torch  # framework="torch" was asked for explicitly

    return torch.from_numpy(np.array(array, copy=True))
