"""What the views of an LMCache cache (hmem/cli/lmcache_*_view.py) share:
their tables fitted to a narrow terminal."""

from __future__ import annotations

from typing import Any

WRAPPED = ("model", "tags", "file", "detail", "value")


def fitted(table: Any) -> Any:
    """A filled table for a narrow terminal: names (model, tags, file)
    and details wrap, whole (no ellipsis: they are what a user copies);
    every other column keeps its width."""
    for column in table.columns:
        if column.header in WRAPPED:
            column.overflow = "fold"
        else:
            column.min_width = max([len(column.header), *(len(str(cell)) for cell in column.cells)])
    return table
