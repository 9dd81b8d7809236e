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
    """The k best of (row, distance) pairs by (distance, row)."""
    order = np.lexsort((rows, dists))[:k]
    return rows[order], dists[order]


class LayerIndex:
    """Signatures of the live entries of one layer."""

    def __init__(self, signature_bytes: int, spans: int = 0, span_bytes: int = 0) -> None:
        self.sigs = np.zeros((_MIN_CAPACITY, signature_bytes), dtype=np.uint8)
        # spans + 1 rows of span_bytes per entry (hmem/store/search.py, above); None without spans
        self.per_entry = spans + 1
        self.span_rows = np.zeros((_MIN_CAPACITY * self.per_entry, span_bytes), dtype=np.uint8) if spans else None
        self.positions = np.zeros(_MIN_CAPACITY, dtype=np.int64)
        self.alive = np.ones(_MIN_CAPACITY, dtype=np.uint8)
        # the first PREFIX_BYTES of each row, contiguous; None until a
        # two-stage search first needs it
        self.prefixes: np.ndarray | None = None
        self._making = threading.RLock()
        # (signatures, positions, spans) whose gather waits for the layer's
        # first use (defer); None once the matrix holds them
        self._deferred: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None
        self.n = 0
        self.dead = 0

    @property
    def live(self) -> int:
        return self.n - self.dead

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        if need <= len(self.positions):
            return
        cap = max(need, 2 * len(self.positions))
        sigs = memory.zeros((cap, self.sigs.shape[1]), np.uint8)  # mapped at once: a bulk put grows it by MBs
        sigs[: self.n] = self.sigs[: self.n]
        positions = np.zeros(cap, dtype=np.int64)
        positions[: self.n] = self.positions[: self.n]
        alive = np.ones(cap, dtype=np.uint8)
        alive[: self.n] = self.alive[: self.n]
        self.sigs, self.positions, self.alive = sigs, positions, alive
        if self.prefixes is not None:
            prefixes = memory.zeros((cap, self.prefixes.shape[1]), np.uint8)
            prefixes[: self.n] = self.prefixes[: self.n]
            self.prefixes = prefixes
        if self.span_rows is not None:
            span_rows = memory.zeros((cap * self.per_entry, self.span_rows.shape[1]), np.uint8)
            span_rows[: self.n * self.per_entry] = self.span_rows[: self.n * self.per_entry]
            self.span_rows = span_rows

    def _set_span_rows(self, first: int, signatures: np.ndarray, spans: np.ndarray) -> None:
        """The span-matrix rows of entries first, first + 1, ...: each one's
        signature prefix, then its span signatures."""
        assert self.span_rows is not None
        width = self.span_rows.shape[1]
        rows = self.span_rows[first * self.per_entry : (first + len(spans)) * self.per_entry]
        rows = rows.reshape(len(spans), self.per_entry, width)
        rows[:, 0] = signatures[:, :width]
        rows[:, 1:] = spans

    def fill(self, signatures: np.ndarray, positions: np.ndarray, spans: np.ndarray | None = None) -> np.ndarray:
        """Make an empty layer hold signatures[positions] (a row per
        record); returns their row numbers.  At open, when a large store's
        layers are built, each signature is copied once, by a kernel, into
        memory mapped at once (hmem/memory.py)."""
        assert self.n == 0
        k = len(positions)
        self.sigs = memory.filled_soon((max(k, _MIN_CAPACITY), self.sigs.shape[1]), np.uint8)
        hamming_kernels.gather_rows(signatures, positions, self.sigs[:k])
        self.positions = np.zeros(len(self.sigs), dtype=np.int64)
        self.positions[:k] = positions
        self.alive = np.ones(len(self.sigs), dtype=np.uint8)
        self.prefixes = None
        if self.span_rows is not None:
            self.span_rows = memory.filled_soon((len(self.sigs) * self.per_entry, self.span_rows.shape[1]), np.uint8)
            assert spans is not None
            self._set_span_rows(0, self.sigs[:k], spans[positions])
        self.n = k
        return np.arange(k, dtype=np.int64)

    def defer(self, signatures: np.ndarray, positions: np.ndarray, spans: np.ndarray | None = None) -> np.ndarray:
        """fill(), the gather left for the layer's first use (ready): an
        open then reads and checks the records and copies no signature; a
        query pays the copy of its own layer's, once.  `signatures` (and
        `spans`) must not change meanwhile: a store's committed signatures
        never do, and a grown records array is a new one."""
        assert self.n == 0
        k = len(positions)
        # `positions` is taken as it is (no copy): rows past it are added
        # into a new array (_reserve), and pack() moves rows only once the
        # deferred gather has read them (ready)
        self.positions = positions
        self.alive = np.ones(k, dtype=np.uint8)
        self.prefixes = None
        self._deferred = (signatures, positions, spans)
        self.n = k
        return np.arange(k, dtype=np.int64)

    def ready(self) -> None:
        """Make the matrix that defer() left for later: once, whichever
        thread first needs it (the others wait for it)."""
        if self._deferred is None:
            return
        with self._making:
            if self._deferred is None:
                return
            signatures, positions, spans = self._deferred
            k = len(positions)
            sigs = memory.filled_soon((max(k, _MIN_CAPACITY), self.sigs.shape[1]), np.uint8)
            hamming_kernels.gather_rows(signatures, positions, sigs[:k])
            if self.span_rows is not None:
                assert spans is not None
                self.span_rows = memory.filled_soon((len(sigs) * self.per_entry, self.span_rows.shape[1]), np.uint8)
                self.sigs = sigs
                self._set_span_rows(0, sigs[:k], spans[positions])
            self.sigs = sigs
            self._deferred = None

    def append(self, sigs: np.ndarray, positions: np.ndarray, spans: np.ndarray | None = None) -> np.ndarray:
        """Add rows (`spans`: their span signatures, in a store that keeps
        them); returns their row numbers."""
        self.ready()
        k = len(positions)
        self._reserve(k)
        rows = np.arange(self.n, self.n + k, dtype=np.int64)
        self.sigs[self.n : self.n + k] = sigs
        self.positions[self.n : self.n + k] = positions
        self.alive[self.n : self.n + k] = 1
        if self.prefixes is not None:
            self.prefixes[self.n : self.n + k] = sigs[:, : self.prefixes.shape[1]]
        if self.span_rows is not None:
            assert spans is not None
            self._set_span_rows(self.n, sigs, spans)
        self.n += k
        return rows

    def kill(self, rows: np.ndarray) -> None:
        rows = rows[self.alive[rows] == 1]
        self.alive[rows] = 0
        self.dead += len(rows)

    def pack(self) -> np.ndarray | None:
        """Drop dead rows when they pass a quarter of the matrix; returns the
        positions of the surviving rows (now rows 0..n-1), or None."""
        if self.dead * 4 <= self.n:
            return None
        self.ready()
        keep = np.flatnonzero(self.alive[: self.n])
        self.sigs[: len(keep)] = self.sigs[keep]
        self.positions[: len(keep)] = self.positions[keep]
        if self.prefixes is not None:
            self.prefixes[: len(keep)] = self.prefixes[keep]
        if self.span_rows is not None:
            per_entry = self.span_rows.reshape(-1, self.per_entry, self.span_rows.shape[1])
            per_entry[: len(keep)] = per_entry[keep]
        self.alive[:] = 1
        self.n, self.dead = len(keep), 0
        return self.positions[: self.n]

    def two_stage(self, search: str, k: int) -> bool:
        """Whether a search of mode `search` for k rows takes two stages."""
        if search == "full" or self.sigs.shape[1] < 4 * PREFIX_BYTES:
            return False  # a prefix of a short signature saves little
        if search == "two-stage":
            return True
        return self.live >= TWO_STAGE_MIN_ROWS and SURVIVORS_PER_PLACE * k * 4 <= self.live

    def _prefix_matrix(self) -> np.ndarray:
        self.ready()
        with self._making:  # the first two-stage queries of several threads make it once
            if self.prefixes is None:
                prefixes = memory.filled_soon((len(self.sigs), PREFIX_BYTES), np.uint8)
                prefixes[: self.n] = self.sigs[: self.n, :PREFIX_BYTES]
                prefixes[self.n :] = 0
                self.prefixes = prefixes
            return self.prefixes[: self.n]

    def _scan(self, query: np.ndarray, sigs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows and distances of the k best rows of `sigs`, every core scanning."""
        alive = self.alive[: self.n] if self.dead else None
        parts = threads.run_ranges(lambda lo, hi: hamming_kernels.topk(query, sigs, alive, k, lo, hi),
                                   threads.split(self.n, _ROWS_PER_THREAD))
        if len(parts) == 1:
            return parts[0]
        return _best(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), k)

    def _second_stage(self, query: np.ndarray, survivors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k best survivors of stage one by their full signatures."""
        survivors = np.sort(survivors)
        full = np.empty((len(survivors), self.sigs.shape[1]), dtype=np.uint8)
        hamming_kernels.gather_rows(self.sigs, survivors, full)
        return _best(survivors, hamming_kernels.distances(query, full), k)

    def topk(self, query: np.ndarray, k: int, search: str = "full") -> tuple[np.ndarray, np.ndarray]:
        """(record positions, Hamming distances) of the k nearest live rows."""
        if self.live == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        self.ready()
        if self.two_stage(search, k):
            survivors, _ = self._scan(query[:PREFIX_BYTES], self._prefix_matrix(), SURVIVORS_PER_PLACE * k)
            rows, dists = self._second_stage(query, survivors, k)
        else:
            rows, dists = self._scan(query, self.sigs[: self.n], k)
        return self.positions[rows], dists

    def topk_spans(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(record positions, Hamming distances over span-signature bits) of
        the k live entries whose best span-matrix row is nearest `query`
        (its first span-signature bytes), ties to the lower entry."""
        if self.live == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        self.ready()
        assert self.span_rows is not None
        per = self.per_entry
        alive = np.repeat(self.alive[: self.n], per) if self.dead else None
        rows = self.span_rows[: self.n * per]
        width = rows.shape[1]
        # Rows come in (distance, row) order, so an entry's first row is its
        # best and the entries met first in the best m rows are the best
        # entries.  2k rows usually hold k entries; k x per always do.
        for m in (min(2 * k + 64, k * per), k * per):
            parts = threads.run_ranges(
                lambda lo, hi: hamming_kernels.topk(query[:width], rows, alive, m, lo * per, hi * per),
                threads.split(self.n, max(1, _ROWS_PER_THREAD // per)))
            found, dists = parts[0] if len(parts) == 1 else _best(np.concatenate([p[0] for p in parts]),
                                                                  np.concatenate([p[1] for p in parts]), m)
            entries = found // per
            _, first = np.unique(entries, return_index=True)
            if len(first) >= k or len(found) < m:  # k entries, or every live row seen
                break
        first = np.sort(first)[:k]
        return self.positions[entries[first]], dists[first]

    def span_distances(self, query: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The distance of each of these entry rows' nearest span-matrix row to `query`."""
        self.ready()
        assert self.span_rows is not None
        per, width = self.per_entry, self.span_rows.shape[1]
        picked = (rows[:, None] * per + np.arange(per)).ravel()
        matrix = np.empty((len(picked), width), dtype=np.uint8)
        hamming_kernels.gather_rows(self.span_rows, picked, matrix)
        return hamming_kernels.distances(query[:width], matrix).reshape(len(rows), per).min(axis=1)

    def topk_many(self, queries: np.ndarray, k: int, search: str = "full") -> list[tuple[np.ndarray, np.ndarray]]:
        """topk of each row of `queries`, the matrix read once for all."""
        if self.live == 0:
            return [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)) for _ in queries]
        self.ready()
        alive = self.alive[: self.n] if self.dead else None
        two_stage = self.two_stage(search, k)
        if two_stage:
            sigs, scanned, keep = self._prefix_matrix(), np.ascontiguousarray(queries[:, :PREFIX_BYTES]), \
                SURVIVORS_PER_PLACE * k
        else:
            sigs, scanned, keep = self.sigs[: self.n], queries, k
        parts = threads.run_ranges(lambda lo, hi: hamming_kernels.topk_many(scanned, sigs, alive, keep, lo, hi),
                                   threads.split(self.n, _ROWS_PER_THREAD))
        rows, dists, counts = _merge(parts, keep)
        found = [(rows[j, : counts[j]], dists[j, : counts[j]]) for j in range(len(queries))]
        if two_stage:
            found = [self._second_stage(query, survivors, k) for query, (survivors, _) in zip(queries, found)]
        return [(self.positions[r], d) for r, d in found]


class SearchIndex:
    """Per-layer LayerIndex plus the row of every record position."""

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
            layer = self.layers[layer_idx] = LayerIndex(self.signature_bytes, self.spans, self.span_bytes)
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
            layer.defer(signatures, order[start:start + size], spans)

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
        # Empty layers (all of them, at open) are filled on every core: the
        # mapping of their memory (mmap) and the gather both run without the GIL.
        empty = [i for i, layer in enumerate(targets) if layer.n == 0]

        def fill(lo: int, hi: int) -> list[np.ndarray]:
            return [targets[i].fill(signatures, groups[i], spans) for i in empty[lo:hi]]

        filled = [rows for part in threads.run_ranges(fill, threads.split(len(empty), 1)) for rows in part] \
            if empty else []
        rows_of = dict(zip(empty, filled))
        for i, (group, layer) in enumerate(zip(groups, targets)):
            rows = rows_of[i] if i in rows_of else \
                layer.append(signatures[group], group, None if spans is None else spans[group])
            self._track(group, rows)

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

    def search(self, layer_idx: int, query: np.ndarray, k: int, search: str = "full"
               ) -> tuple[np.ndarray, np.ndarray]:
        """(record positions, Hamming distances) of the k nearest entries of
        a layer; `search` is one of SEARCHES."""
        layer = self.layers.get(layer_idx)
        if layer is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        return layer.topk(query, k, search)

    def search_spans(self, layer_idx: int, query: np.ndarray, k: int, whole: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
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

    def search_many(self, layer_idx: int, queries: np.ndarray, k: int, search: str = "full"
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """search() of each row of `queries`, in one pass over the layer."""
        layer = self.layers.get(layer_idx)
        if layer is None:
            return [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)) for _ in queries]
        return layer.topk_many(queries, k, search)

    def layer_counts(self) -> dict[int, int]:
        return {idx: layer.live for idx, layer in sorted(self.layers.items()) if layer.live}
