"""Explaining a prefix hit (what `hmem prefix-hit` shows): the hit, and per
group where its chunks stop and whether it limits the hit.  The operators
are hmem/prefix_hit/operators.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hmem.prefix_hit.bitmap import Bitmap
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
    num_chunks: int
    num_ranks: int
    windows: tuple[int, ...]
    layout: Layout
    hit: int
    servable: Bitmap  # fold's output: bit j = length j + 1 servable by all
    retain: Bitmap  # unfold's output in `layout`
    groups: tuple[GroupHit, ...]

    @property
    def limiting_groups(self) -> tuple[int, ...]:
        """Groups that cannot serve one chunk more than the hit."""
        return tuple(g.index for g in self.groups if g.blocks_longer)


def explain_prefix_hit(
    found: Bitmap,
    num_chunks: int,
    num_ranks: int,
    windows: Sequence[int],
    layout: Layout | str = Layout.GROUP_MAJOR,
) -> PrefixHitReport:
    """The hit plus, per group, where its chunks stop and whether it limits the hit."""
    C, R, ws = checked_shape(num_chunks, num_ranks, windows)
    lay = checked_layout(layout)
    servable = fold(found, C, R, ws, lay)
    hit = servable.highest_set_bit() + 1
    retain = unfold(hit, C, R, ws, lay)
    groups = []
    for g, (w, present) in enumerate(zip(ws, chunks_present(found, C, R, ws, lay))):
        alone = fold(present, C, 1, (w,))
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
    return PrefixHitReport(C, R, ws, lay, hit, servable, retain, tuple(groups))
