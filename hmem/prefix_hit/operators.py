"""Prefix-cache hit across the object groups of a hybrid model.

A request is split into C chunks; each chunk of each object group is stored
as R kv-rank shards.  Group g has a window W[g]: W[g] <= 0 is full attention
(it needs every chunk before the prefix end), W[g] = w >= 1 a sliding window
of w chunks (mamba is w = 1).  A chunk counts as present for a group only when
all R of its rank bits are present.

A prefix of length L (1 <= L <= C) is servable when, for every group, every
chunk in [lo, L) is present, with lo = 0 for full attention and
lo = max(0, L - w) for a window w.  The hit is the largest servable L (0 if
none).  Sliding windows make the servable lengths gappy, so the hit is the
highest servable length, not a count of leading ones.

Presence maps have N = G*C*R bits in one of two layouts:

- ``Layout.GROUP_MAJOR`` (default): bit g*C*R + j*R + r
- ``Layout.CHUNK_MAJOR``: bit j*G*R + g*R + r

The pipeline is fold (presence -> C-bit servable map) -> highest_set_bit + 1
-> unfold (hit -> N-bit retain mask).  fold and unfold run in native code over
the packed bytes (see hmem.kernels).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import numpy as np

from hmem import validation
from hmem.errors import InvalidArgumentError
from hmem.kernels import bitops
from hmem.prefix_hit.bitmap import Bitmap

FULL_ATTENTION_WINDOW = -1


class Layout(str, enum.Enum):
    GROUP_MAJOR = "group-major"
    CHUNK_MAJOR = "chunk-major"


class TrimPolicy(str, enum.Enum):
    PREFIX = "prefix"  # keep the longest run of set bits from index 0
    KEEP_ALL = "keep-all"  # keep every set bit


# ---- argument checks -----------------------------------------------------


def _int(value: object, name: str) -> int:
    return validation.integer(value, name)


def _windows(windows: Sequence[int] | Iterable[int]) -> tuple[int, ...]:
    try:
        ws = tuple(windows)
    except TypeError:
        raise InvalidArgumentError(f"windows must be a sequence of integers, got {windows!r}") from None
    if not ws:
        raise InvalidArgumentError("windows is empty: give one window per object group")
    if not set(map(type, ws)) <= {int}:  # exact ints pass without a Python step per window
        ws = tuple(_int(w, "every window") for w in ws)
    return ws


def checked_layout(layout: Layout | str) -> Layout:
    if isinstance(layout, Layout):
        return layout
    return Layout(validation.choice(layout, "layout", [x.value for x in Layout]))


def checked_shape(num_chunks: int, num_ranks: int, windows) -> tuple[int, int, tuple[int, ...]]:
    C = validation.count(num_chunks, "num_chunks")
    R = validation.integer(num_ranks, "num_ranks", low=1)
    return C, R, _windows(windows)


def _kernel_windows(ws: tuple[int, ...], C: int) -> tuple[int, ...]:
    """Windows as the kernels take them (C longs): a window of C or more
    chunks needs every chunk, exactly like full attention."""
    if max(ws) <= C and min(ws) >= FULL_ATTENTION_WINDOW:
        return ws
    return tuple(FULL_ATTENTION_WINDOW if w <= 0 or w >= C else w for w in ws)


def presence_bits(num_chunks: int, num_ranks: int, windows: Sequence[int]) -> int:
    """N = G * C * R, the length of a presence map and of a retain mask."""
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    return len(ws) * C * R


def _check_found(found: Bitmap, C: int, R: int, G: int) -> None:
    if not isinstance(found, Bitmap):
        raise InvalidArgumentError(f"the presence map must be a Bitmap, got {type(found).__name__}")
    if len(found) != G * C * R:
        raise InvalidArgumentError(
            f"the presence map has {len(found)} bits but {G} groups x {C} chunks x {R} ranks need {G * C * R}"
        )


# ---- the operators --------------------------------------------------------


def fold(
    found: Bitmap,
    num_chunks: int,
    num_ranks: int,
    windows: Sequence[int],
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> Bitmap:
    """C-bit map whose bit j is set iff a prefix of length j + 1 is servable by every group."""
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    _check_found(found, C, R, len(ws))
    out = Bitmap(C)
    bitops.fold_into(
        found.buffer, C, R, _kernel_windows(ws, C), checked_layout(layout) is Layout.CHUNK_MAJOR, out.buffer
    )
    return out


def highest_set_bit(bm: Bitmap) -> int:
    """Index of the highest set bit, -1 if none (on fold's output: hit - 1)."""
    if not isinstance(bm, Bitmap):
        raise InvalidArgumentError(f"expected a Bitmap, got {type(bm).__name__}")
    return bm.highest_set_bit()


def unfold(
    hit: int,
    num_chunks: int,
    num_ranks: int,
    windows: Sequence[int],
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> Bitmap:
    """N-bit retain mask: for each group, all R rank bits of chunks [lo, hit).

    `hit` larger than C is clamped to C.
    """
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    hit = min(validation.count(hit, "hit"), C)
    out = Bitmap(len(ws) * C * R)
    bitops.unfold_into(hit, C, R, _kernel_windows(ws, C), checked_layout(layout) is Layout.CHUNK_MAJOR, out.buffer)
    return out


def fold_unfold_ranked(
    found: Bitmap,
    num_chunks: int,
    num_ranks: int,
    windows: Sequence[int],
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> tuple[int, Bitmap]:
    """(hit, retain mask): fold, then highest_set_bit + 1, then unfold."""
    # The same steps as fold() and unfold(), validated once: on small
    # requests the argument checks cost more than the kernels.
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    _check_found(found, C, R, len(ws))
    chunk_major = checked_layout(layout) is Layout.CHUNK_MAJOR
    servable = Bitmap(C)
    bitops.fold_into(found.buffer, C, R, _kernel_windows(ws, C), chunk_major, servable.buffer)
    hit = servable.highest_set_bit() + 1
    mask = Bitmap(len(found))
    bitops.unfold_into(hit, C, R, _kernel_windows(ws, C), chunk_major, mask.buffer)
    return hit, mask


def fold_unfold(
    found: Bitmap,
    num_chunks: int,
    windows: Sequence[int],
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> tuple[int, Bitmap]:
    """fold_unfold_ranked with one rank per chunk (a G x C presence map)."""
    return fold_unfold_ranked(found, num_chunks, 1, windows, layout)


def unfold_range(length: int, window: int) -> tuple[int, int]:
    """Chunks [lo, hi) one group with `window` needs to serve a prefix of `length`."""
    L = _int(length, "length")
    w = _int(window, "window")
    if L <= 0:
        return (0, 0)
    return (0, L) if w <= 0 else (max(0, L - w), L)


def merge_bitmaps(bitmaps: Iterable[Bitmap], nbits: int) -> Bitmap:
    """Bitwise OR of presence maps (e.g. what L1 holds | what L2 holds).

    Each input is taken as `nbits` long: a shorter one counts as absent past
    its end, and bits of a longer one past `nbits` are dropped.  No input
    gives `nbits` zeros.
    """
    n = validation.count(nbits, "nbits")
    acc = np.zeros((n + 7) >> 3, dtype=np.uint8)
    for bm in bitmaps:
        if not isinstance(bm, Bitmap):
            raise InvalidArgumentError(f"merge_bitmaps takes Bitmaps, got {type(bm).__name__}")
        part = np.frombuffer(bm.buffer, dtype=np.uint8)[: acc.size]
        acc[: part.size] |= part
    return Bitmap.from_bytes(acc.tobytes(), n)


def select_retained(found: Bitmap, nbits: int, policy: TrimPolicy | str = TrimPolicy.PREFIX) -> Bitmap:
    """Bits to keep without windows: PREFIX keeps the leading run of set
    bits, KEEP_ALL keeps every set bit."""
    n = validation.count(nbits, "nbits")
    if not isinstance(found, Bitmap) or len(found) != n:
        got = len(found) if isinstance(found, Bitmap) else type(found).__name__
        raise InvalidArgumentError(f"select_retained needs a Bitmap of {n} bits, got {got}")
    policy = TrimPolicy(validation.choice(policy, "policy", [x.value for x in TrimPolicy]))
    if policy is TrimPolicy.PREFIX:
        return Bitmap.prefix(n, found.leading_ones())
    return found.copy()


# ---- grouped form -----------------------------------------------------------


def _cells(bits: np.ndarray, C: int, R: int, G: int, layout: Layout) -> np.ndarray:
    """View a flat presence array as [group, chunk, rank]."""
    if layout is Layout.GROUP_MAJOR:
        return bits.reshape(G, C, R)
    return bits.reshape(C, G, R).transpose(1, 0, 2)


def presence_map(
    rows: Sequence[Sequence[Bitmap]],
    num_chunks: int,
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> Bitmap:
    """Build a flat presence map from one row per group and rank.

    ``rows[g][r]`` is a C-bit Bitmap of the chunks whose rank-r shard group g
    holds; every group must list the same number of ranks.
    """
    lay = checked_layout(layout)
    C = validation.count(num_chunks, "num_chunks")
    G = len(rows)
    if G == 0:
        raise InvalidArgumentError("no groups given")
    R = len(rows[0])
    if R < 1 or any(len(r) != R for r in rows):
        raise InvalidArgumentError("every group must give the same number (>= 1) of rank rows")
    cube = np.zeros((G, C, R), dtype=np.bool_)
    for g, ranks in enumerate(rows):
        for r, row in enumerate(ranks):
            if not isinstance(row, Bitmap) or len(row) != C:
                raise InvalidArgumentError(f"group {g} rank {r}: expected a Bitmap of {C} chunks")
            cube[g, :, r] = row.to_numpy()
    flat = cube if lay is Layout.GROUP_MAJOR else cube.transpose(1, 0, 2)
    return Bitmap.from_numpy(flat.reshape(-1))


def group_rows(
    found: Bitmap,
    num_chunks: int,
    num_ranks: int,
    windows: Sequence[int],
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> list[list[Bitmap]]:
    """The inverse of presence_map: ``rows[g][r]`` = chunks group g holds on rank r."""
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    _check_found(found, C, R, len(ws))
    cube = _cells(found.to_numpy(), C, R, len(ws), checked_layout(layout))
    return [[Bitmap.from_numpy(cube[g, :, r]) for r in range(R)] for g in range(len(ws))]


def chunks_present(
    found: Bitmap,
    num_chunks: int,
    num_ranks: int,
    windows: Sequence[int],
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> list[Bitmap]:
    """Per group, the C-bit map of chunks present on all R ranks."""
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    _check_found(found, C, R, len(ws))
    cube = _cells(found.to_numpy(), C, R, len(ws), checked_layout(layout))
    return [Bitmap.from_numpy(cube[g].all(axis=1)) for g in range(len(ws))]
