"""StoreStats of an open store (Store.stats, `hmem stats`): what its parts
say, put together in one place.

The caller holds the store's lock in intent mode: the figures come from
many parts of the state, which no write may change between them
(hmem/store/rwlock.py).
"""

from __future__ import annotations

import numpy as np

from hmem import kernels
from hmem.formats import manifest, shard_file, store_files
from hmem.store.results import ShardStats, StoreStats
from hmem.store.session import Session


def store_stats(session: Session) -> StoreStats:
    parts, placement = session.components, session.placement
    state, config = parts.state, parts.state.config
    live = state.live_positions()
    rows = state.records[: state.n]
    n_tokens = rows["n_tokens"][live].astype(np.int64)
    files = store_files.classify(state.path, state.shards, state.committed.pending)
    return StoreStats(
        path=placement.location,
        format_version=manifest.FORMAT_VERSION,
        generation=state.committed.generation,
        config=config,
        entries=len(live),
        evicted=state.n - len(live),
        unflushed=state.n - state.committed_n,
        layers=state.search_index.layer_counts(),
        shards=[
            ShardStats(i, s.file, s.bytes, s.entries, s.dead_entries, s.dead_bytes, i < state.shards_committed)
            for i, s in enumerate(state.shards)
        ],
        bytes_on_disk=state.stored_bytes(),
        live_bytes=int(
            np.sum(
                shard_file.entry_bytes(n_tokens, config.embed_dim, config.storage_dtype, config.signatures_per_entry)
            )
        ),
        # every evicted byte, as `compact(min_dead_share=0)` frees it (a shard left
        # without live entries frees its whole file, header too)
        reclaimable_bytes=parts.compaction.plan(0.0).reclaimable_bytes,
        orphan_files=files.orphans,
        foreign_files=files.foreign,
        total_accesses=int(rows["access_count"].astype(np.int64).sum()),
        next_entry_id=state.next_id,
        kernels=kernels.describe(),
        # on object storage, also whether the objects are there (a listing; verify's remote errors)
        health=placement.checked_health(parts.reader.health(), state.shards, rows["shard_idx"]),
        limits=state.limits,
        remote=placement.report(),
    )
