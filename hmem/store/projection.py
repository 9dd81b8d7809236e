"""Signatures: a structured random projection of pooled keys to hdc_dim bits.

The projection is fixed by the store's seed forever (docs/format.md gives
every step): keys are summed over tokens in float64 (the sign of a
projection does not depend on the scale, so this is the mean's signature),
zero-padded to m = the power of two >= max(embed_dim, 64), and each of
ceil(hdc_dim / m) blocks applies ROUNDS rounds of random signs followed by
an unnormalised fast Walsh-Hadamard transform.  Output bit i of block b is 1
iff coordinate i ends up > 0.  The signs come from SplitMix64 seeded with
the store's seed, a generator whose outputs the format fixes.

Why this family: it estimates angles as well as a dense Gaussian matrix
(P[bit differs] = angle / pi), measured in tests/test_kernels_store.py, at
O(m log m) time and m bits of memory instead of embed_dim x hdc_dim floats.
"""

from __future__ import annotations

import numpy as np

from hmem import memory, threads
from hmem.kernels import projection as projection_kernels

MANY_PER_THREAD = 512  # entries a thread takes at least in signatures_and_means
FEW = 4  # signatures_and_means of this many entries or fewer: one kernel call each

FAMILY = "srht"
GENERATOR = "splitmix64"
ROUNDS = 3


def block_size(embed_dim: int) -> int:
    return max(64, 1 << (embed_dim - 1).bit_length())


class Projector:
    """Maps [n_tokens, embed_dim] float32 rows to packed hdc_dim-bit signatures."""

    def __init__(self, embed_dim: int, hdc_dim: int, seed: int) -> None:
        self.embed_dim = embed_dim
        self.hdc_dim = hdc_dim
        self.seed = seed
        self.m = block_size(embed_dim)
        self.blocks = -(-hdc_dim // self.m)
        self.signs = projection_kernels.signs_table(seed, self.m, ROUNDS, self.blocks)

    def describe(self) -> dict:
        """What index.json records of the projection."""
        return {"family": FAMILY, "generator": GENERATOR, "rounds": ROUNDS, "block": self.m, "blocks": self.blocks}

    def signature(self, rows: np.ndarray) -> np.ndarray:
        """Packed signature (hdc_dim / 8 bytes) of C-contiguous float32 rows."""
        out = np.zeros(self.hdc_dim // 8, dtype=np.uint8)
        projection_kernels.signature(rows, self.signs, self.m, ROUNDS, self.hdc_dim, out)
        return out

    def signature_of_sum(self, sums: np.ndarray) -> np.ndarray:
        """The signature of rows whose float64 token sum is `sums`: the
        bytes signature() gives for those rows."""
        out = np.zeros(self.hdc_dim // 8, dtype=np.uint8)
        projection_kernels.signature_of_sum(sums, self.signs, self.m, ROUNDS, self.hdc_dim, out)
        return out

    def signature_and_mean(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The signature and the float64 mean of the rows, from one pass."""
        out = np.zeros(self.hdc_dim // 8, dtype=np.uint8)
        sums = np.zeros(rows.shape[1], dtype=np.float64)
        projection_kernels.signature(rows, self.signs, self.m, ROUNDS, self.hdc_dim, out, sums)
        return out, sums / rows.shape[0]

    def signatures_and_means(
        self, rows: np.ndarray, starts: np.ndarray, buffers: list[np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """signature_and_mean of many entries at once: entry e is rows
        starts[e] .. starts[e + 1] - 1 of the float32 matrix `rows`.  Returns
        the signatures [n, hdc_dim / 8] and the float64 means [n, embed_dim];
        the same bytes as one call per entry, on every core.  With
        `buffers`, both live in memory.POOL buffers appended to it, for the
        caller to give back once it has copied them: a bulk put's batches
        then reuse memory instead of faulting fresh pages in every time."""
        count = len(starts) - 1
        if count <= FEW:  # the batch kernel's set-up costs more than it saves here
            pairs = [self.signature_and_mean(rows[starts[e] : starts[e + 1]]) for e in range(count)]
            if not pairs:
                return np.zeros((0, self.hdc_dim // 8), dtype=np.uint8), np.zeros((0, rows.shape[1]))
            return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
        out = _array((count, self.hdc_dim // 8), np.uint8, buffers)
        sums = _array((count, rows.shape[1]), np.float64, buffers)

        def run(lo: int, hi: int) -> None:
            first, last = int(starts[lo]), int(starts[hi])
            projection_kernels.signature_many(
                rows[first:last],
                starts[lo : hi + 1] - first,
                self.signs,
                self.m,
                ROUNDS,
                self.hdc_dim,
                out[lo:hi],
                sums[lo:hi],
            )

        if count < 2 * MANY_PER_THREAD:
            run(0, count)  # one thread's share: no pool
        else:
            threads.run_ranges(run, threads.split(count, MANY_PER_THREAD))
        np.divide(sums, (starts[1:] - starts[:-1])[:, None], out=sums)  # the means, where the sums were
        return out, sums


def _array(shape: tuple[int, int], dtype: type, buffers: list[np.ndarray] | None) -> np.ndarray:
    """An uninitialised array to be filled whole: from memory.POOL (the
    buffer appended to `buffers`) or fresh."""
    if buffers is None:
        return memory.filled_soon(shape, dtype)
    nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
    buffer = memory.POOL.take(nbytes)
    buffers.append(buffer)
    return buffer[:nbytes].view(dtype).reshape(shape)


# An entry's first row is a "sink" when its norm passes SINK_FACTOR x the
# mean norm of the entry's other rows (docs/format.md, "Span signatures").
SINK_FACTOR = 3.0


def span_bounds(
    starts: np.ndarray, spans: int, skip: np.ndarray | None = None, layout: str = "overlapping"
) -> tuple[np.ndarray, np.ndarray]:
    """(first, end) rows of each span of each entry, int64 [n, spans] each:
    entry e (rows starts[e] .. starts[e + 1] - 1, n_e of them; without its
    first row where skip[e]) cut by `layout` (docs/format.md, "Span
    signatures"):

    - "overlapping": span j covers its rows j * n_e // (spans + 1) up to
      (j + 2) * n_e // (spans + 1), two of spans + 1 equal parts, so that
      consecutive spans share a part;
    - "disjoint": span j covers its rows j * n_e // spans up to
      (j + 1) * n_e // spans.

    An entry too short for every span to get rows of its own gives some
    spans a single row (shared with a neighbour) instead of none."""
    lo = starts[:-1] + (0 if skip is None else skip.astype(np.int64))
    n = (starts[1:] - lo)[:, None]
    j = np.arange(spans, dtype=np.int64)[None, :]
    parts, width = (spans + 1, 2) if layout == "overlapping" else (spans, 1)
    first = np.minimum(j * n // parts, n - 1)
    end = np.maximum((j + width) * n // parts, first + 1)
    return lo[:, None] + first, lo[:, None] + end


def sink_rows(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Whether each entry's first row is a sink (bool [n]): its L2 norm
    (float64) is more than SINK_FACTOR x the mean L2 norm of the entry's
    other rows.  An entry of one row has none."""
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))
    total = np.concatenate([[0.0], np.cumsum(norms)])
    first, end = starts[:-1], starts[1:]
    n = end - first
    others = total[end] - total[np.minimum(first + 1, end)]
    return (n > 1) & (norms[np.minimum(first, len(norms) - 1)] * (n - 1) > SINK_FACTOR * others)


class SpanProjector:
    """Span signatures: the first min(hdc_dim, 512) bits of the signature
    of each span's mean, which is the whole signature of the same
    projection made with fewer bits (its first blocks)."""

    def __init__(self, embed_dim: int, span_bits: int, seed: int, spans: int, layout: str) -> None:
        self.spans, self.layout = spans, layout
        self.projector = Projector(embed_dim, span_bits, seed)

    def signatures_and_means(self, rows: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The span signatures (uint8 [n, spans, span bytes]) and span means
        (float64 [n, spans, embed_dim]) of the entries of `rows` (as in
        Projector.signatures_and_means), in one kernel call for the batch."""
        count = len(starts) - 1
        starts = np.asarray(starts, dtype=np.int64)
        sinks = sink_rows(rows, starts) if count else np.zeros(0, dtype=bool)
        first, end = span_bounds(starts, self.spans, sinks, self.layout)
        if count == 0 or bool(np.all(end[:, :-1] == first[:, 1:])):
            # every entry has a row per span: its spans, after its sink row if
            # it has one, are consecutive row ranges; a sink row is taken as a
            # range of its own whose signature is dropped
            ranges = np.concatenate([starts[:-1, None], first], axis=1)
            taken = np.ones(ranges.shape, dtype=bool)
            taken[:, 0] = sinks
            is_span = np.ones(ranges.shape, dtype=bool)
            is_span[:, 0] = False
            span_starts = np.append(ranges[taken], starts[-1])
            keep = is_span[taken]
            sigs, means = self.projector.signatures_and_means(rows, span_starts)
            sigs, means = sigs[keep], means[keep]
        else:  # spans overlap or share a row: each span's rows copied out, back to back
            lengths = (end - first).ravel()
            span_starts = np.concatenate([[0], np.cumsum(lengths)])
            source = np.ascontiguousarray(
                rows[np.repeat(first.ravel() - span_starts[:-1], lengths) + np.arange(span_starts[-1])]
            )
            sigs, means = self.projector.signatures_and_means(source, span_starts)
        return sigs.reshape(count, self.spans, -1), means.reshape(count, self.spans, -1)


def similarity(hamming: np.ndarray | int, hdc_dim: int) -> np.ndarray | float:
    """1 - hamming / hdc_dim, in [0, 1]."""
    return 1.0 - np.asarray(hamming, dtype=np.float64) / hdc_dim
