"""``hmem compact``'s run of the compaction: a progress bar, and a stop at
the first shard written after a signal (hmem/cli/signals.py)."""

from __future__ import annotations

from hmem import CompactionReport, Store
from hmem.cli import signals
from hmem.cli.output import Output


class _Stop(Exception):
    """Raised from the progress callback to stop the rewrite before its
    commit: Store.compact then leaves the store as it was, and usable."""


def stoppable_compaction(store: Store, min_reclaim_share: float, out: Output) -> CompactionReport | None:
    """Compact `store`; None when a signal stopped it before the commit."""
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
            return store.compact(min_reclaim_share, progress=step)
        except _Stop:
            return None
