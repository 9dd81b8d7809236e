"""The in-memory signature index: one contiguous signature matrix per layer.

A query scans only its layer's matrix (1/L of the data with L layers).
Rows are kept in record order, which is ascending entry id, so the kernel's
tie rule (equal Hamming distance: lower row first) means lower entry id
first.  Evicted rows are masked out at once and dropped from the matrix
when they reach a quarter of it.

A scan is split into contiguous row ranges, one thread per core (the
kernels run without the GIL), and the ranges' results are merged in the
same (distance, row) order.  A batch of queries (topk_many) reads the
matrix once for the whole batch.

A two-stage search reads less than every signature: it scans a copy of
the first PREFIX_BYTES of each signature (itself a signature of the same
projection, of fewer bits) for the best SURVIVORS_PER_PLACE x k rows,
ranks those on their full signatures and keeps k.  The prefix matrix is a
contiguous copy (PREFIX_BYTES more memory per row): reading the prefixes
in place, a cache line out of every row, is no faster than the full scan.
It is made on a layer's first two-stage search and kept up to date after.
"auto" uses two stages on layers of at least TWO_STAGE_MIN_ROWS rows,
where recall@10 after re-rank stays within 0.01 of the full scan's
(docs/benchmarks.md, "Two-stage search").

A store with span signatures (signatures_per_entry S > 1) also keeps, per
layer, a span matrix of S rows per entry: the first span-signature bytes of
the entry's signature, then its S - 1 span signatures.  A span search scans
it whole and ranks an entry by its best row, so a query of a few tokens
finds the entry whose span holds them ("auto" on such stores;
docs/benchmarks.md, "Span retrieval").
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from hmem import memory, threads
from hmem.formats.records import EVICTED
from hmem.kernels import hamming as hamming_kernels

_MIN_CAPACITY = 64
# Below this many rows a second thread costs more than it saves.
_ROWS_PER_THREAD = 65536

SEARCHES = ("auto", "full", "two-stage", "spans")
PREFIX_BYTES = 128  # 1024 bits: a quarter of a 4096-bit signature
SURVIVORS_PER_PLACE = 50  # stage one keeps 50 x k rows for stage two
TWO_STAGE_MIN_ROWS = 100_000


def _merge(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k best of each query over parts scanned from ascending row ranges."""
    if len(parts) == 1:
        return parts[0]
    rows = np.concatenate([p[0] for p in parts], axis=1)
    dists = np.concatenate([p[1] for p in parts], axis=1)
    filled = np.concatenate([np.arange(p[0].shape[1]) < p[2][:, None] for p in parts], axis=1)
    # Each part is in (distance, row) order and the parts' rows ascend, so a
    # stable sort by distance alone keeps the lower row first on ties; empty
    # slots sort last.
    key = np.where(filled, dists.astype(np.int64), np.iinfo(np.int64).max)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    counts = np.minimum(filled.sum(axis=1), k)
    return np.take_along_axis(rows, order, axis=1), np.take_along_axis(dists, order, axis=1), counts


def _best(rows: np.ndarray, dists: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of (row, distance) pairs by (distance, row).  Rows and
    distances are below 2**32 (a layer's rows, Hamming distances): one sort
    of `distance << 32 | row` orders them as a lexsort would, 7x faster at a
    two-stage query's 4,000 survivors, time that holds the GIL."""
    if not len(rows) or int(rows.max()) >= 1 << 32 or int(dists.min()) < 0:
        order = np.lexsort((rows, dists))[:k]
        return rows[order], dists[order]
    keys = (dists.astype(np.int64) << 32) | rows.astype(np.int64)
    if k < len(keys):
        keys = np.partition(keys, k - 1)[:k]
    keys.sort()
    return keys & 0xFFFFFFFF, (keys >> 32).astype(dists.dtype)


class LayerView(NamedTuple):
    """One moment of a layer: rows 0..n-1 of its arrays.  A put appends past
    n in place (or into new arrays) and then publishes a new view, so a
    query holding a view reads the same rows whatever puts run meanwhile;
    rows below n change in place only under the store's exclusive lock
    (eviction marks them dead, packing moves them)."""

    n: int
    dead: int
    sigs: np.ndarray
    positions: np.ndarray
    alive: np.ndarray
    # the first PREFIX_BYTES of each row, contiguous; None until a two-stage search first needs it
    prefixes: np.ndarray | None
    # spans + 1 rows of span_bytes per entry (the module docstring); None without spans
    span_rows: np.ndarray | None

    @property
    def live(self) -> int:
        return self.n - self.dead


class LayerIndex:
    """Signatures of the live entries of one layer.

    Queries read ``view`` once and use only it; every change publishes a
    new view in one assignment (LayerView).  Changes, and the matrices a
    query makes on first use (``ready``, the prefix matrix), are made under
    ``_making``, so two of them never interleave."""

    def __init__(self, signature_bytes: int, spans: int = 0, span_bytes: int = 0) -> None:
        self.per_entry = spans + 1
        self.view = LayerView(
            n=0,
            dead=0,
            sigs=np.zeros((_MIN_CAPACITY, signature_bytes), dtype=np.uint8),
            positions=np.zeros(_MIN_CAPACITY, dtype=np.int64),
            alive=np.ones(_MIN_CAPACITY, dtype=np.uint8),
            prefixes=None,
            span_rows=np.zeros((_MIN_CAPACITY * self.per_entry, span_bytes), dtype=np.uint8) if spans else None,
        )
        self._making = threading.RLock()
        # (signatures, positions, spans) whose gather waits for the layer's
        # first use (defer); None once the matrix holds them
        self._deferred: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None

    @property
    def n(self) -> int:
        return self.view.n

    @property
    def live(self) -> int:
        return self.view.live

    def _reserved(self, view: LayerView, extra: int) -> LayerView:
        """`view`, its arrays with room for `extra` more rows (new arrays
        holding rows 0..n-1 when they must grow; the view itself unpublished)."""
        n = view.n
        need = n + extra
        if need <= len(view.positions):
            return view
        cap = max(need, 2 * len(view.positions))
        sigs = memory.zeros((cap, view.sigs.shape[1]), np.uint8)  # mapped at once: a bulk put grows it by MBs
        sigs[:n] = view.sigs[:n]
        positions = np.zeros(cap, dtype=np.int64)
        positions[:n] = view.positions[:n]
        alive = np.ones(cap, dtype=np.uint8)
        alive[:n] = view.alive[:n]
        prefixes = old_prefixes = view.prefixes
        if old_prefixes is not None:
            prefixes = memory.zeros((cap, old_prefixes.shape[1]), np.uint8)
            prefixes[:n] = old_prefixes[:n]
        span_rows = old_span_rows = view.span_rows
        if old_span_rows is not None:
            span_rows = memory.zeros((cap * self.per_entry, old_span_rows.shape[1]), np.uint8)
            span_rows[: n * self.per_entry] = old_span_rows[: n * self.per_entry]
        return view._replace(sigs=sigs, positions=positions, alive=alive, prefixes=prefixes, span_rows=span_rows)

    def _set_span_rows(self, span_rows: np.ndarray, first: int, signatures: np.ndarray, spans: np.ndarray) -> None:
        """The span-matrix rows of entries first, first + 1, ...: each one's
        signature prefix, then its span signatures."""
        width = span_rows.shape[1]
        rows = span_rows[first * self.per_entry : (first + len(spans)) * self.per_entry]
        rows = rows.reshape(len(spans), self.per_entry, width)
        rows[:, 0] = signatures[:, :width]
        rows[:, 1:] = spans

    def fill(self, signatures: np.ndarray, positions: np.ndarray, spans: np.ndarray | None = None) -> None:
        """Make an empty layer hold signatures[positions] (a row per
        record, rows 0..k-1).  At open, when a large store's layers are
        built, each signature is copied once, by a kernel, into memory
        mapped at once (hmem/memory.py)."""
        with self._making:
            view = self.view
            assert view.n == 0
            k = len(positions)
            sigs = memory.filled_soon((max(k, _MIN_CAPACITY), view.sigs.shape[1]), np.uint8)
            hamming_kernels.gather_rows(signatures, positions, sigs[:k])
            kept = np.zeros(len(sigs), dtype=np.int64)
            kept[:k] = positions
            span_rows = None
            if view.span_rows is not None:
                span_rows = memory.filled_soon((len(sigs) * self.per_entry, view.span_rows.shape[1]), np.uint8)
                assert spans is not None
                self._set_span_rows(span_rows, 0, sigs[:k], spans[positions])
            self.view = LayerView(k, 0, sigs, kept, np.ones(len(sigs), dtype=np.uint8), None, span_rows)

    def defer(self, signatures: np.ndarray, positions: np.ndarray, spans: np.ndarray | None = None) -> None:
        """fill(), the gather left for the layer's first use (ready): an
        open then reads and checks the records and copies no signature; a
        query pays the copy of its own layer's, once.  `signatures` (and
        `spans`) must not change meanwhile: a store's committed signatures
        never do, and a grown records array is a new one."""
        with self._making:
            view = self.view
            assert view.n == 0
            k = len(positions)
            # `positions` is taken as it is (no copy): rows past it are added
            # into new arrays (_reserved), and pack() moves rows only once the
            # deferred gather has read them (ready)
            self._deferred = (signatures, positions, spans)
            self.view = view._replace(n=k, dead=0, positions=positions, alive=np.ones(k, dtype=np.uint8), prefixes=None)

    def ready(self) -> LayerView:
        """The view, its matrix made first when defer() left it for later:
        once, whichever thread first needs it (the others wait for it)."""
        if self._deferred is None:
            return self.view
        with self._making:
            if self._deferred is None:
                return self.view
            signatures, positions, spans = self._deferred
            view = self.view
            k = len(positions)
            sigs = memory.filled_soon((max(k, _MIN_CAPACITY), view.sigs.shape[1]), np.uint8)
            hamming_kernels.gather_rows(signatures, positions, sigs[:k])
            span_rows = view.span_rows
            if span_rows is not None:
                assert spans is not None
                span_rows = memory.filled_soon((len(sigs) * self.per_entry, span_rows.shape[1]), np.uint8)
                self._set_span_rows(span_rows, 0, sigs[:k], spans[positions])
            self.view = view._replace(sigs=sigs, span_rows=span_rows)
            self._deferred = None
            return self.view

    def append(self, sigs: np.ndarray, positions: np.ndarray, spans: np.ndarray | None = None) -> None:
        """Add rows (`spans`: their span signatures, in a store that keeps
        them) as rows n..n+k-1, published at the end."""
        with self._making:
            self.ready()
            k = len(positions)
            view = self._reserved(self.view, k)
            n = view.n
            view.sigs[n : n + k] = sigs
            view.positions[n : n + k] = positions
            view.alive[n : n + k] = 1
            if view.prefixes is not None:
                view.prefixes[n : n + k] = sigs[:, : view.prefixes.shape[1]]
            if view.span_rows is not None:
                assert spans is not None
                self._set_span_rows(view.span_rows, n, sigs, spans)
            self.view = view._replace(n=n + k)

    def truncate(self, n: int) -> None:
        """Forget the rows from n on (a failed put's; appends only add rows past n)."""
        with self._making:
            self.view = self.view._replace(n=n)

    def kill(self, rows: np.ndarray) -> None:
        """Mark rows dead (the store's lock held exclusively: in place)."""
        with self._making:
            view = self.view
            rows = rows[view.alive[rows] == 1]
            view.alive[rows] = 0
            self.view = view._replace(dead=view.dead + len(rows))

    def pack(self) -> np.ndarray | None:
        """Drop dead rows when they pass a quarter of the matrix; returns the
        positions of the surviving rows (now rows 0..n-1), or None.  In
        place: the store's lock is held exclusively."""
        with self._making:
            view = self.view
            if view.dead * 4 <= view.n:
                return None
            view = self.ready()
            keep = np.flatnonzero(view.alive[: view.n])
            view.sigs[: len(keep)] = view.sigs[keep]
            view.positions[: len(keep)] = view.positions[keep]
            if view.prefixes is not None:
                view.prefixes[: len(keep)] = view.prefixes[keep]
            if view.span_rows is not None:
                per_entry = view.span_rows.reshape(-1, self.per_entry, view.span_rows.shape[1])
                per_entry[: len(keep)] = per_entry[keep]
            view.alive[:] = 1
            self.view = view._replace(n=len(keep), dead=0)
            return view.positions[: len(keep)]

    def two_stage(self, search: str, k: int, view: LayerView | None = None) -> bool:
        """Whether a search of mode `search` for k rows takes two stages."""
        view = self.view if view is None else view
        if search == "full" or view.sigs.shape[1] < 4 * PREFIX_BYTES:
            return False  # a prefix of a short signature saves little
        if search == "two-stage":
            return True
        return view.live >= TWO_STAGE_MIN_ROWS and SURVIVORS_PER_PLACE * k * 4 <= view.live

    def _prefix_matrix(self, view: LayerView) -> np.ndarray:
        """Rows 0..n-1 of the view's prefix matrix, made at its first use."""
        if view.prefixes is not None:
            return view.prefixes[: view.n]
        with self._making:  # the first two-stage queries of several threads make it once
            current = self.ready()
            if current.prefixes is None:
                prefixes = memory.filled_soon((len(current.sigs), PREFIX_BYTES), np.uint8)
                prefixes[: current.n] = current.sigs[: current.n, :PREFIX_BYTES]
                prefixes[current.n :] = 0
                current = current._replace(prefixes=prefixes)
                self.view = current
            # the same rows as `view`'s: rows below n are the same in every later view
            # (changed in place only under the store's exclusive lock, when no query runs)
            assert current.prefixes is not None
            return current.prefixes[: view.n]

    def _scan(self, view: LayerView, query: np.ndarray, sigs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows and distances of the k best rows of `sigs`, every core scanning."""
        alive = view.alive[: view.n] if view.dead else None
        parts = threads.run_ranges(
            lambda lo, hi: hamming_kernels.topk(query, sigs, alive, k, lo, hi), threads.split(view.n, _ROWS_PER_THREAD)
        )
        if len(parts) == 1:
            return parts[0]
        return _best(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), k)

    @staticmethod
    def _second_stage(
        view: LayerView, query: np.ndarray, survivors: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k best survivors of stage one by their full signatures."""
        survivors = np.sort(survivors)
        full = np.empty((len(survivors), view.sigs.shape[1]), dtype=np.uint8)
        hamming_kernels.gather_rows(view.sigs, survivors, full)
        return _best(survivors, hamming_kernels.distances(query, full), k)

    def topk(self, query: np.ndarray, k: int, search: str = "full") -> tuple[np.ndarray, np.ndarray]:
        """(record positions, Hamming distances) of the k nearest live rows."""
        if self.view.live == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        view = self.ready()
        if self.two_stage(search, k, view):
            survivors, _ = self._scan(view, query[:PREFIX_BYTES], self._prefix_matrix(view), SURVIVORS_PER_PLACE * k)
            rows, dists = self._second_stage(view, query, survivors, k)
        else:
            rows, dists = self._scan(view, query, view.sigs[: view.n], k)
        return view.positions[rows], dists

    def topk_spans(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(record positions, Hamming distances over span-signature bits) of
        the k live entries whose best span-matrix row is nearest `query`
        (its first span-signature bytes), ties to the lower entry."""
        if self.view.live == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        view = self.ready()
        assert view.span_rows is not None
        per = self.per_entry
        alive = np.repeat(view.alive[: view.n], per) if view.dead else None
        rows = view.span_rows[: view.n * per]
        width = rows.shape[1]
        # Rows come in (distance, row) order, so an entry's first row is its
        # best and the entries met first in the best m rows are the best
        # entries.  2k rows usually hold k entries; k x per always do.
        for m in (min(2 * k + 64, k * per), k * per):
            parts = threads.run_ranges(
                lambda lo, hi: hamming_kernels.topk(query[:width], rows, alive, m, lo * per, hi * per),
                threads.split(view.n, max(1, _ROWS_PER_THREAD // per)),
            )
            found, dists = (
                parts[0]
                if len(parts) == 1
                else _best(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), m)
            )
            entries = found // per
            _, first = np.unique(entries, return_index=True)
            if len(first) >= k or len(found) < m:  # k entries, or every live row seen
                break
        first = np.sort(first)[:k]
        return view.positions[entries[first]], dists[first]

    def span_distances(self, query: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The distance of each of these entry rows' nearest span-matrix row to `query`."""
        view = self.ready()
        assert view.span_rows is not None
        per, width = self.per_entry, view.span_rows.shape[1]
        picked = (rows[:, None] * per + np.arange(per)).ravel()
        matrix = np.empty((len(picked), width), dtype=np.uint8)
        hamming_kernels.gather_rows(view.span_rows, picked, matrix)
        return hamming_kernels.distances(query[:width], matrix).reshape(len(rows), per).min(axis=1)

    def topk_many(self, queries: np.ndarray, k: int, search: str = "full") -> list[tuple[np.ndarray, np.ndarray]]:
        """topk of each row of `queries`, the matrix read once for all."""
        if self.view.live == 0:
            return [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)) for _ in queries]
        view = self.ready()
        alive = view.alive[: view.n] if view.dead else None
        two_stage = self.two_stage(search, k, view)
        if two_stage:
            sigs, scanned, keep = (
                self._prefix_matrix(view),
                np.ascontiguousarray(queries[:, :PREFIX_BYTES]),
                SURVIVORS_PER_PLACE * k,
            )
        else:
            sigs, scanned, keep = view.sigs[: view.n], queries, k
        parts = threads.run_ranges(
            lambda lo, hi: hamming_kernels.topk_many(scanned, sigs, alive, keep, lo, hi),
            threads.split(view.n, _ROWS_PER_THREAD),
        )
        rows, dists, counts = _merge(parts, keep)
        found = [(rows[j, : counts[j]], dists[j, : counts[j]]) for j in range(len(queries))]
        if two_stage:
            found = [self._second_stage(view, query, survivors, k) for query, (survivors, _) in zip(queries, found)]
        return [(view.positions[r], d) for r, d in found]


class SearchIndex:
    """Per-layer LayerIndex plus the row of every record position.

    Puts add rows while queries run (hmem/store/rwlock.py): a new layer
    goes into a new dict (queries look layers up without a lock), and a
    record's row is tracked before its layer publishes it."""

    def __init__(self, signature_bytes: int, spans: int = 0, span_bytes: int = 0) -> None:
        self.signature_bytes = signature_bytes
        self.spans, self.span_bytes = spans, span_bytes
        self.layers: dict[int, LayerIndex] = {}
        self._row_of = np.full(_MIN_CAPACITY, -1, dtype=np.int64)

    def _track(self, positions: np.ndarray, rows: np.ndarray) -> None:
        top = int(positions.max()) + 1 if len(positions) else 0
        if top > len(self._row_of):
            grown = np.full(max(top, 2 * len(self._row_of)), -1, dtype=np.int64)
            grown[: len(self._row_of)] = self._row_of
            self._row_of = grown
        self._row_of[positions] = rows

    def _layer(self, layer_idx: int) -> LayerIndex:
        layer = self.layers.get(layer_idx)
        if layer is None:
            layer = LayerIndex(self.signature_bytes, self.spans, self.span_bytes)
            self.layers = {**self.layers, layer_idx: layer}
        return layer

    def load(self, records: np.ndarray) -> None:
        """Index every live record, into an index that holds none yet (at
        open, and after a compaction rewrote the store): each layer's
        positions now, its signatures at its first query (LayerIndex.defer).
        Records are grouped by layer with one sort of their 16-bit layer
        numbers (a radix sort), without a copy of the records."""
        assert not self.layers
        n = len(records)
        if not n:
            return
        layer_of = records["layer_idx"]
        if int(layer_of.max()) >= 1 << 16:  # not from hmem (layers are < 2**16): the general path
            self.add_records(records, np.arange(n, dtype=np.int64))
            return
        keys = layer_of.astype(np.uint16)
        evicted = records["shard_idx"] == EVICTED
        self._row_of = memory.filled_soon((max(n, _MIN_CAPACITY),), np.int64)
        self._row_of[n:] = -1
        if evicted.any():
            self._row_of[:] = -1
            live = np.flatnonzero(~evicted)
            order = live[np.argsort(keys[live], kind="stable")]
        else:
            order = np.argsort(keys, kind="stable")  # keeps position order within a layer
        if not len(order):
            return
        sorted_keys = keys[order]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(sorted_keys)) + 1))
        sizes = np.diff(np.concatenate((starts, [len(order)])))
        # each record's row in its layer: its place in the sorted order less its layer's start
        self._row_of[order] = np.arange(len(order), dtype=np.int64) - np.repeat(starts, sizes)
        signatures = records["signature"]
        spans = records["spans"] if self.spans else None
        for start, size in zip(starts.tolist(), sizes.tolist()):
            layer = self._layer(int(sorted_keys[start]))
            layer.defer(signatures, order[start : start + size], spans)

    def add_records(self, records: np.ndarray, positions: np.ndarray) -> None:
        """Index the live records among records[positions] (vectorised per layer)."""
        live = positions[records["shard_idx"][positions] != 0xFFFFFFFF]
        layers = records["layer_idx"][live]
        if len(layers) and int(layers.max()) < 1 << 16:
            layers = layers.astype(np.uint16)  # a stable sort of 16-bit keys is a radix sort
        order = np.argsort(layers, kind="stable")  # keeps position order within a layer
        live, layers = live[order], layers[order]
        bounds = np.flatnonzero(np.diff(layers)) + 1
        groups = [g for g in np.split(live, bounds) if len(g)]
        targets = [self._layer(int(records["layer_idx"][g[0]])) for g in groups]
        signatures = records["signature"]
        spans = records["spans"] if self.spans else None
        # Each group's rows: past its layer's (only this writer adds rows),
        # tracked before the layer publishes them.
        for group, layer in zip(groups, targets):
            self._track(group, np.arange(layer.n, layer.n + len(group), dtype=np.int64))
        # Empty layers (all of them, at open) are filled on every core: the
        # mapping of their memory (mmap) and the gather both run without the GIL.
        empty = [i for i, layer in enumerate(targets) if layer.n == 0]

        def fill(lo: int, hi: int) -> None:
            for i in empty[lo:hi]:
                targets[i].fill(signatures, groups[i], spans)

        if empty:
            threads.run_ranges(fill, threads.split(len(empty), 1))
        filled = set(empty)
        for i, (group, layer) in enumerate(zip(groups, targets)):
            if i not in filled:
                layer.append(signatures[group], group, None if spans is None else spans[group])

    def remove(self, records: np.ndarray, positions: np.ndarray) -> None:
        """Take records out of the search (eviction)."""
        layers = records["layer_idx"][positions]
        for layer_idx in np.unique(layers):
            layer = self.layers[int(layer_idx)]
            mine = positions[layers == layer_idx]
            layer.kill(self._row_of[mine])
            survivors = layer.pack()
            if survivors is not None:
                self._track(survivors, np.arange(len(survivors), dtype=np.int64))

    def search(self, layer_idx: int, query: np.ndarray, k: int, search: str = "full") -> tuple[np.ndarray, np.ndarray]:
        """(record positions, Hamming distances) of the k nearest entries of
        a layer; `search` is one of SEARCHES."""
        layer = self.layers.get(layer_idx)
        if layer is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        return layer.topk(query, k, search)

    def search_spans(self, layer_idx: int, query: np.ndarray, k: int, whole: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(record positions, Hamming distances over span-signature bits) of
        the k entries of a layer with the nearest span-matrix row, and with
        `whole` > 0 also of the `whole` nearest by their whole signature
        (search "auto"), in (distance, entry) order."""
        layer = self.layers.get(layer_idx)
        if layer is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        positions, dists = layer.topk_spans(query, k)
        if whole:
            extra = np.setdiff1d(layer.topk(query, whole, "auto")[0], positions)
            if len(extra):
                positions = np.concatenate([positions, extra])
                dists = np.concatenate([dists, layer.span_distances(query, self._row_of[extra]).astype(dists.dtype)])
                order = np.lexsort((positions, dists))
                positions, dists = positions[order], dists[order]
        return positions, dists

    def search_many(
        self, layer_idx: int, queries: np.ndarray, k: int, search: str = "full"
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """search() of each row of `queries`, in one pass over the layer."""
        layer = self.layers.get(layer_idx)
        if layer is None:
            return [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)) for _ in queries]
        return layer.topk_many(queries, k, search)

    def layer_counts(self) -> dict[int, int]:
        return {idx: layer.live for idx, layer in sorted(self.layers.items()) if layer.live}
