"""Explaining a prefix hit (what `hmem prefix-hit` shows): the hit, and per
group where its chunks stop and whether it limits the hit.  The operators
are hmem/prefix_hit/operators.py (a flat presence map) and
hmem/prefix_hit/grouped.py (one row per (group, rank)); a report can be made
from either."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hmem.errors import InvalidArgumentError
from hmem.prefix_hit.bitmap import Bitmap
from hmem.prefix_hit.grouped import _checked_rows, _paired_windows, fold_grouped, unfold_grouped
from hmem.prefix_hit.operators import (
    Layout,
    checked_layout,
    checked_shape,
    chunks_present,
    fold,
    unfold,
    unfold_range,
)


@dataclass(frozen=True)
class GroupHit:
    """What one group contributes to a prefix hit."""

    index: int
    window: int  # <= 0: full attention
    present: Bitmap  # C bits: chunks present on every rank
    first_missing: int | None  # first chunk not present, None if all are
    own_hit: int  # longest prefix this group alone could serve
    needed: tuple[int, int]  # chunks [lo, hi) it must keep for the hit
    blocks_longer: bool  # it cannot serve length hit + 1 (hit < C only)

    @property
    def kind(self) -> str:
        if self.window <= 0:
            return "full attention"
        return "mamba" if self.window == 1 else f"window {self.window}"


@dataclass(frozen=True)
class PrefixHitReport:
    """What explain_prefix_hit found.

    Made from rows, each row counts as a group of one rank: `groups` holds
    one GroupHit per row (its index is the row's), `num_ranks` is 1,
    `retain` is the rows' retain result laid out as a flat map of those
    one-rank groups in `layout`, and `retain_rows` is that result as one
    Bitmap per row, parallel to the input.  Made from a flat presence map,
    `retain_rows` is empty.
    """

    num_chunks: int
    num_ranks: int
    windows: tuple[int, ...]
    layout: Layout
    hit: int
    servable: Bitmap  # fold's output: bit j = length j + 1 servable by all
    retain: Bitmap  # unfold's output in `layout`
    groups: tuple[GroupHit, ...]
    retain_rows: tuple[Bitmap, ...] = ()

    @property
    def from_rows(self) -> bool:
        """True when the presence was given as rows (fold_grouped's form)."""
        return bool(self.retain_rows)

    @property
    def limiting_groups(self) -> tuple[int, ...]:
        """Groups (rows, when made from rows) that cannot serve one chunk more than the hit."""
        return tuple(g.index for g in self.groups if g.blocks_longer)


def _group_hits(presents: Sequence[Bitmap], ws: tuple[int, ...], hit: int, C: int) -> tuple[GroupHit, ...]:
    groups = []
    for g, (w, present) in enumerate(zip(ws, presents)):
        alone = fold_grouped([present], (w,))
        first_missing = present.leading_ones()
        groups.append(
            GroupHit(
                index=g,
                window=w,
                present=present,
                first_missing=first_missing if first_missing < C else None,
                own_hit=alone.highest_set_bit() + 1,
                needed=unfold_range(hit, w),
                blocks_longer=hit < C and not alone.test(hit),
            )
        )
    return tuple(groups)


def explain_prefix_hit(
    found: Bitmap | Sequence[Bitmap],
    num_chunks: int | None = None,
    num_ranks: int | None = None,
    windows: Sequence[int] | None = None,
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> PrefixHitReport:
    """The hit plus, per group, where its chunks stop and whether it limits the hit.

    `found` is a flat presence map (then num_chunks, num_ranks and windows
    describe it), or a sequence of rows, one C-bit Bitmap per (group, rank)
    paired 1:1 with `windows`, as fold_grouped takes them
    (``explain_prefix_hit(rows, windows=ws)``); num_chunks, if given, must
    then be the rows' length and num_ranks 1.
    """
    if windows is None:
        raise InvalidArgumentError("windows is required: give one window per group (per row for rows)")
    if isinstance(found, Bitmap):
        if num_chunks is None or num_ranks is None:
            raise InvalidArgumentError("a flat presence map needs num_chunks and num_ranks")
        return _explain_flat(found, num_chunks, num_ranks, windows, layout)
    return _explain_rows(found, num_chunks, num_ranks, windows, layout)


def _explain_flat(
    found: Bitmap, num_chunks: int, num_ranks: int, windows: Sequence[int], layout: Layout | str
) -> PrefixHitReport:
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    lay = checked_layout(layout)
    servable = fold(found, C, R, ws, lay)
    hit = servable.highest_set_bit() + 1
    retain = unfold(hit, C, R, ws, lay)
    groups = _group_hits(chunks_present(found, C, R, ws, lay), ws, hit, C)
    return PrefixHitReport(C, R, ws, lay, hit, servable, retain, groups)


def _explain_rows(
    rows: Sequence[Bitmap], num_chunks: int | None, num_ranks: int | None, windows: Sequence[int], layout: Layout | str
) -> PrefixHitReport:
    rs, C = _checked_rows(rows)
    ws = _paired_windows(windows, len(rs))
    lay = checked_layout(layout)
    if num_chunks is not None and checked_shape(num_chunks, 1, ws)[0] != C:
        raise InvalidArgumentError(f"num_chunks is {num_chunks} but the rows hold {C} bits each")
    if num_ranks is not None and checked_shape(C, num_ranks, ws)[1] != 1:
        raise InvalidArgumentError(
            f"num_ranks is {num_ranks}, but rows are one per (group, rank): give each rank its own "
            "row and its group's window (num_ranks 1, or leave it out)"
        )
    servable = fold_grouped(rs, ws)
    hit = servable.highest_set_bit() + 1
    retain_rows = tuple(unfold_grouped(hit, C, ws))
    retain = unfold(hit, C, 1, ws, lay)
    groups = _group_hits([r.copy() for r in rs], ws, hit, C)
    return PrefixHitReport(C, 1, ws, lay, hit, servable, retain, groups, retain_rows)
