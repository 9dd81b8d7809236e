"""``hmem compact``'s run of the compaction: a progress bar, and a stop at
the first shard written after a signal (hmem/cli/signals.py)."""

from __future__ import annotations

from hmem import CompactionReport, Store
from hmem.cli import signals
from hmem.cli.output import Output, human_bytes


class _Stop(Exception):
    """Raised from the progress callback to stop the rewrite before its
    commit: Store.compact then leaves the store as it was, and usable."""


def stoppable_compaction(
    store: Store, min_reclaim_share: float, out: Output, *, min_dead_share: float, repack: bool
) -> CompactionReport | None:
    """Compact `store`; None when a signal stopped it (before the commit of
    the shard at hand: the shards committed before stay compacted)."""
    if signals.requested():
        return None
    seen = [0]
    with out.progress("compacting", None, bytes_mode=True) as bar:

        def step(done: int, total: int) -> None:
            bar.advance(done - seen[0], total=total)
            seen[0] = done
            if signals.requested():
                raise _Stop

        try:
            return store.compact(min_reclaim_share, progress=step, min_dead_share=min_dead_share, repack=repack)
        except _Stop:
            return None


def compact_advice(store: Store, freed: int) -> str:
    """What to run to free `freed` bytes of entries just evicted or deleted:
    plain 'hmem compact' frees only shards half evicted (its --min-dead),
    so the advice names --min-dead 0 when that frees less (a true line)."""
    if store.plan_compaction().reclaimable_bytes >= freed:
        return f"run 'hmem compact' to free about {human_bytes(freed)}"
    return f"run 'hmem compact --min-dead 0' to free about {human_bytes(freed)}"
