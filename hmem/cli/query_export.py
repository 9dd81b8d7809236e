"""The export options of ``hmem query`` (docs/cli.md, "hmem query"):
``--export-layout`` and ``--kv-heads``, checked before the store is read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hmem import EXPORT_LAYOUTS, InvalidArgumentError

ExportLayoutOption = Annotated[
    str,
    typer.Option(
        "--export-layout",
        metavar="LAYOUT",
        help="Layout of the --export file: entries (k_{id}/v_{id}, tokens x embed_dim per result) or hf "
        "(past_key_values.{layer}.key/.value, 1 x kv_heads x tokens x head_dim, a layer's results concatenated "
        "along tokens in rank order; needs --kv-heads).",
    ),
]
KvHeadsOption = Annotated[
    int | None,
    typer.Option(
        "--kv-heads",
        min=1,
        metavar="N",
        help="K/V heads of the model, for --export-layout hf (embed_dim = N x head_dim).",
        show_default=False,
    ),
]


def check_options(export: str | Path | None, layout: str, kv_heads: int | None) -> None:
    """The export options agree with each other (before the store is touched)."""
    if layout not in EXPORT_LAYOUTS:
        raise InvalidArgumentError(f"--export-layout must be one of {', '.join(EXPORT_LAYOUTS)}, got {layout!r}")
    if export is None and (layout != "entries" or kv_heads is not None):
        raise InvalidArgumentError("--export-layout and --kv-heads apply to an --export file; give --export FILE")
    if layout == "hf" and kv_heads is None:
        raise InvalidArgumentError("--export-layout hf needs --kv-heads N, the model's number of K/V heads")
    if layout != "hf" and kv_heads is not None:
        raise InvalidArgumentError("--kv-heads applies to --export-layout hf only")


def check_heads(embed_dim: int, kv_heads: int | None) -> None:
    """--kv-heads splits the store's rows into heads of equal size."""
    if kv_heads is not None and embed_dim % kv_heads:
        raise InvalidArgumentError(
            f"--kv-heads {kv_heads} does not divide the store's embed_dim {embed_dim} into heads of equal size"
        )


def export_note(storage_dtype: str) -> str | None:
    """What to say after an --export from a store of this storage_dtype:
    the file holds F32 rows as the store reads them back, which for an INT8
    store are not what it holds (docs/cli.md, "hmem query")."""
    if storage_dtype != "int8":
        return None
    return (
        "note: the store is INT8: the export holds its rows dequantized to F32 (int8 x row scale); "
        "'hmem export' writes them as stored"
    )
