"""``hmem export``: chosen entries' K/V, exactly as stored, to a safetensors file."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hmem import EntryNotFoundError, InvalidArgumentError, Store, check_export_path, export_entries, is_store_url
from hmem.cli import lmcache_transfer_view
from hmem.cli.entry_args import EntryIdsArgument, store_and_ids
from hmem.cli.entry_view import not_found
from hmem.cli.health_view import SkipDamagedRecordsOption, refuse_damaged, report_damaged_records
from hmem.cli.lmcache_target import cache_at
from hmem.cli.options import (
    ChunkSizeOption,
    DryRunOption,
    JsonOption,
    KVShapeOption,
    ModelConfigOption,
    QuietOption,
)
from hmem.cli.output import Output, human_bytes, literal

DTYPE_NAMES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "int8": "I8"}


def export(
    args: EntryIdsArgument,
    output: Annotated[
        str | None,  # not a Path, which turns "" into "." (a directory): check_export_path refuses ""
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            show_default=False,
            help="The safetensors file to write (replaced atomically).",
        ),
    ] = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    skip_damaged: SkipDamagedRecordsOption = False,
    to_fs: Annotated[
        str | None,
        typer.Option(
            "--to-fs",
            metavar="DIR",
            show_default=False,
            help="Write LMCache chunks (of a cache, or imported into the store) as an LMCache fs connector "
            "cache in DIR, which LMCache reads (docs/lmcache.md).",
        ),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout",
            metavar="LAYOUT",
            show_default=False,
            help="An LMCache cache's --output layout: split (one entry per layer per chunk, as 'hmem put' "
            "imports it; the default) or model (each chunk as LMCache keeps it).",
        ),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option(
            "--model-name",
            metavar="NAME",
            show_default=False,
            help="The model name LMCache serves, for keys of local_disk files (their names turn each '/' into '-').",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="--to-fs: replace files of other bytes under a chunk's name.")
    ] = False,
    dry_run: DryRunOption = False,
    kv_shape: KVShapeOption = None,
    model_config: ModelConfigOption = None,
    chunk_size: ChunkSizeOption = 256,
) -> None:
    """Write the keys and values of entries, exactly as stored, to a safetensors file.

    The tensors are k_{id} and v_{id} in the store's dtype (F32, F16 or
    BF16, bit-exact; 'hmem put' reads them back), or, from an INT8 store,
    I8 with F32 row scales k_scale_{id} and v_scale_{id} (not importable).

    An id the store does not hold exits with code 1 and writes nothing.

    From an LMCache cache directory (then CHUNK... in place of ids: file
    names or keys, all by default): --output FILE writes its chunks as
    safetensors (--layout), --to-fs DIR as an fs connector cache. From a
    store, --to-fs DIR writes back the chunks its entries were imported
    from (those of the ids given, or all).
    """
    out = Output(json_mode=json_output, quiet=quiet)
    cache = None
    if args:
        cache = cache_at(args[0], kv_shape_text=kv_shape, model_config=model_config, chunk_size=chunk_size)
    if cache is not None:
        code = lmcache_transfer_view.export_cache(
            out,
            cache,
            args[1:],
            output=output,
            to_fs=to_fs,
            layout=layout,
            model_name=model_name,
            force=force,
            dry_run=dry_run,
        )
        if code:
            raise typer.Exit(code)
        return
    if layout is not None:
        raise InvalidArgumentError("--layout applies to the export of an LMCache cache")
    if to_fs is not None:
        if output is not None:
            raise InvalidArgumentError("give --output FILE or --to-fs DIR, not both")
        # the ids are optional here: STORE alone exports every chunk it imported
        one_store = len(args) == 1 and not args[0].isdigit()
        store, entry_ids = (args[0], []) if one_store else store_and_ids(args, one=False)
        code = lmcache_transfer_view.export_store_to_fs(
            out, store, entry_ids, to_fs=to_fs, model_name=model_name, force=force, dry_run=dry_run
        )
        if code:
            raise typer.Exit(code)
        return
    if model_name is not None or force or dry_run:
        raise InvalidArgumentError("--model-name, --force and --dry-run apply to --to-fs")
    if output is None:
        raise InvalidArgumentError("give --output FILE, the safetensors file to write")
    store, entry_ids = store_and_ids(args, one=False)
    check_export_path(output, None if is_store_url(store) else store)  # a bad path fails before the store is touched
    with Store.open(store, read_only=True, on_damage="skip" if skip_damaged else "raise") as s:
        report_damaged_records(out, s)
        storage = s.config.storage_dtype
        try:
            size = export_entries(s, entry_ids, output, {"store": str(store)})
        except EntryNotFoundError as exc:
            refuse_damaged(s, list(entry_ids))
            raise not_found(exc, store) from None
    ids = list(dict.fromkeys(entry_ids))
    dtype = DTYPE_NAMES[storage]
    document: dict[str, Any] = {
        "store": str(store),
        "output": str(output),
        "entry_ids": ids,
        "entries": len(ids),
        "storage_dtype": storage,
        "dtype": dtype,
        "scales": storage == "int8",
        "importable": storage != "int8",
        "bytes": size,
    }
    if json_output:
        out.emit_json(document)
        return
    out.print(
        literal(
            f"exported the K/V of {len(ids)} {'entry' if len(ids) == 1 else 'entries'} to {output} "
            f"({human_bytes(size)}), as stored: {dtype}"
        ),
        soft_wrap=True,
    )
    if storage == "int8":
        out.print(
            "note: the store is INT8: k_{id} and v_{id} are I8 and k_scale_{id}, v_scale_{id} their F32 "
            "row scales (row t = k_{id}[t] x k_scale_{id}[t]); 'hmem put' cannot import this file",
            markup=False,
            soft_wrap=True,
        )
