"""``hmem export``: chosen entries' K/V, exactly as stored, to a safetensors file."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hmem import EntryNotFoundError, Store, check_export_path, export_entries, is_store_url
from hmem.cli.entry_args import EntryIdsArgument, store_and_ids
from hmem.cli.entry_view import not_found
from hmem.cli.health_view import SkipDamagedRecordsOption, refuse_damaged, report_damaged_records
from hmem.cli.options import JsonOption, QuietOption
from hmem.cli.output import Output, human_bytes, literal

DTYPE_NAMES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "int8": "I8"}


def export(
    args: EntryIdsArgument,
    output: Annotated[
        str,  # not a Path, which turns "" into "." (a directory): check_export_path refuses ""
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            show_default=False,
            help="The safetensors file to write (replaced atomically).",
        ),
    ],
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    skip_damaged: SkipDamagedRecordsOption = False,
) -> None:
    """Write the keys and values of entries, exactly as stored, to a safetensors file.

    The tensors are k_{id} and v_{id} in the store's dtype (F32, F16 or
    BF16, bit-exact; 'hmem put' reads them back), or, from an INT8 store,
    I8 with F32 row scales k_scale_{id} and v_scale_{id} (not importable).

    An id the store does not hold exits with code 1 and writes nothing.
    """
    out = Output(json_mode=json_output, quiet=quiet)
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
