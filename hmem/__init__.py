"""hmem: persistent, exact K/V memory on disk for LLM inference.

The public names of the library; everything else is internal.
"""

from hmem._version import __version__
from hmem.bitmap import Bitmap
from hmem.errors import HmemError, InvalidArgumentError, KernelUnavailableError
from hmem.prefix_hit import (
    FULL_ATTENTION_WINDOW,
    GroupHit,
    Layout,
    PrefixHitReport,
    TrimPolicy,
    chunks_present,
    explain_prefix_hit,
    fold,
    fold_unfold,
    fold_unfold_ranked,
    group_rows,
    highest_set_bit,
    merge_bitmaps,
    presence_bits,
    presence_map,
    select_retained,
    unfold,
    unfold_range,
)

__all__ = [
    "FULL_ATTENTION_WINDOW",
    "Bitmap",
    "GroupHit",
    "HmemError",
    "InvalidArgumentError",
    "KernelUnavailableError",
    "Layout",
    "PrefixHitReport",
    "TrimPolicy",
    "__version__",
    "chunks_present",
    "explain_prefix_hit",
    "fold",
    "fold_unfold",
    "fold_unfold_ranked",
    "group_rows",
    "highest_set_bit",
    "merge_bitmaps",
    "presence_bits",
    "presence_map",
    "select_retained",
    "unfold",
    "unfold_range",
]
