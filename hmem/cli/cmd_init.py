"""``hmem init``: create a store."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from hmem import Store, StoreConfig
from hmem.cli import signals
from hmem.cli.options import JsonOption, QuietOption
from hmem.cli.output import Output, human_bytes
from hmem.cli.units import parse_size


def init(
    path: Annotated[
        str,
        typer.Argument(
            help="Directory of the new store (missing or empty), or s3://bucket/prefix (empty, outside any store).",
            show_default=False,
        ),
    ],
    embed_dim: Annotated[int, typer.Option("--embed-dim", "-d", help="Width of every K/V row.", show_default=False)],
    hdc_dim: Annotated[int, typer.Option("--hdc-dim", help="Signature bits per entry, a multiple of 64.")] = 4096,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the signature projection.")] = 0,
    max_entries: Annotated[int, typer.Option("--max-entries", help="Live entries kept at most; 0 = unlimited.")] = 0,
    max_disk: Annotated[str, typer.Option("--max-disk", help="Bytes on disk at most (e.g. 50G); 0 = unlimited.")] = "0",
    shard_max: Annotated[str, typer.Option("--shard-max", help="Size at which a shard file is sealed.")] = "256MiB",
    max_open_shards: Annotated[int, typer.Option("--max-open-shards", help="Shard files memory-mapped at once.")] = 256,
    storage_dtype: Annotated[
        str,
        typer.Option(
            "--storage-dtype",
            help="How K/V rows are stored: f32, f16, bf16 (half the disk, exact for rows of that dtype) or int8.",
        ),
    ] = "f32",
    quantize: Annotated[bool, typer.Option("--quantize", help="The same as --storage-dtype int8.")] = False,
    signatures_per_entry: Annotated[
        int,
        typer.Option(
            "--signatures-per-entry",
            help="1: one signature per entry, of its mean key.  S > 1: also S - 1 span "
            "signatures, so that a query of a few tokens finds the entry holding them (docs/cli.md).",
        ),
    ] = 1,
    span_layout: Annotated[
        str,
        typer.Option(
            "--span-layout",
            help="How the spans cut an entry's tokens: overlapping (S - 1 windows, each 2/S of the "
            "tokens, starting 1/S apart) or disjoint (S - 1 equal spans, the earlier layout).",
        ),
    ] = "overlapping",
    chunks: Annotated[
        bool,
        typer.Option(
            "--chunks",
            help="Entries may be put in chunks under a key (an LMCache chunk, one entry per layer), found by key "
            "and evicted or deleted whole; an hmem tier of LMCache makes its store so itself (docs/lmcache.md).",
        ),
    ] = False,
    token_rerank: Annotated[
        int,
        typer.Option(
            "--token-rerank",
            metavar="N",
            help="Queries re-rank their best N candidates by token-level max-sim over the stored keys unless "
            "told otherwise (0: they do not; docs/cli.md).",
        ),
    ] = 0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Create a new store with the given settings (kept in the store forever)."""
    out = Output(json_mode=json_output, quiet=quiet)
    config = StoreConfig(
        embed_dim=embed_dim,
        hdc_dim=hdc_dim,
        seed=seed,
        max_entries=max_entries,
        max_disk_bytes=parse_size(max_disk, "--max-disk"),
        shard_max_bytes=parse_size(shard_max, "--shard-max"),
        max_open_shards=max_open_shards,
        storage_dtype="int8" if quantize else storage_dtype,
        signatures_per_entry=signatures_per_entry,
        span_layout=span_layout,
        chunks=chunks,
        token_rerank=token_rerank,
    )
    with signals.stoppable():  # creating a store is short: a signal lets it finish (hmem/cli/signals.py)
        with Store.create(path, config) as store:
            size = store.size()
        document = {"path": str(path), "format_version": 1, "config": config.to_dict(), "bytes_on_disk": size}
        code = (
            signals.report_stop(document, f"the store at {path} was created", created=True)
            if signals.requested()
            else 0
        )
        if json_output:
            out.emit_json(document)
        else:
            out.print(f"created hmem store at {path}")
            table = out.table("setting", ">value")
            for key, value in dataclasses.asdict(config).items():
                shown = human_bytes(value) if key.endswith("_bytes") and value else value
                table.add_row(key, "unlimited" if key.startswith("max_") and value == 0 else str(shown))
            out.print(table)
    if code:
        raise typer.Exit(code)
