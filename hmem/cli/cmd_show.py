"""``hmem show``: one entry's metadata and a summary of its tensors."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from hmem import EntryNotFoundError, Store, StoredKV
from hmem.cli.entry_args import EntryOrChunkArgument, refuse_keys, store_and_targets
from hmem.cli.entry_view import age, entry_json, not_found, utc_time
from hmem.cli.health_view import SkipDamagedRecordsOption, refuse_damaged, report_damaged_records
from hmem.cli.options import ChunkSizeOption, JsonOption, KVShapeOption, ModelConfigOption, QuietOption
from hmem.cli.output import Output, human_bytes, literal


def show(
    args: EntryOrChunkArgument,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    skip_damaged: SkipDamagedRecordsOption = False,
    kv_shape: KVShapeOption = None,
    model_config: ModelConfigOption = None,
    chunk_size: ChunkSizeOption = 256,
) -> None:
    """Show one entry: its metadata and a summary of its keys and values.

    The metadata: layer, tokens, importance, accesses, eviction score, time
    put, shard, bytes, and the meta 'hmem put' recorded, such as the source
    file and token range. The keys and values: shape, stored dtype, mean
    and largest row L2 norm, largest absolute value.

    Only reads: takes no lock and counts no access. An id the store does
    not hold exits with code 1.

    Of a store of chunks (an hmem tier of LMCache), a chunk's key in place
    of the id shows the chunk: its parts (one entry per layer), tokens,
    bytes, when it was put, and its first part's meta.

    Of an LMCache cache directory (hmem show CACHE CHUNK, the chunk given
    by its file name, key, or hash when one file has it; a negative hash
    after "--", as in hmem show CACHE -- -1f2e): the key's fields,
    the header, the shape and where it comes from, and the first values of
    each layer's K and V.
    """
    if len(args) == 2:
        from hmem.cli.lmcache_target import cache_at

        cache = cache_at(args[0], kv_shape_text=kv_shape, model_config=model_config, chunk_size=chunk_size)
        if cache is not None:
            from hmem.cli import lmcache_show_view

            lmcache_show_view.show(cache, args[1], json_output=json_output, quiet=quiet)
            return
    out = Output(json_mode=json_output, quiet=quiet)
    store, ids, keys = store_and_targets(args, one=True)
    with Store.open(store, read_only=True, on_damage="skip" if skip_damaged else "raise") as s:
        report_damaged_records(out, s)
        if keys:
            refuse_keys(keys, s)
            from hmem.cli import chunk_view

            chunk_view.show(out, s, store, keys[0])
            return
        (entry_id,) = ids
        try:
            stored = s.stored_kv(entry_id)
            decoded = s.get(entry_id)
        except EntryNotFoundError as exc:
            refuse_damaged(s, [entry_id])
            raise not_found(exc, store) from None
        tensors = {"keys": _summary(stored, "keys", decoded.keys), "values": _summary(stored, "values", decoded.values)}
    info = stored.info
    if json_output:
        out.emit_json(
            {
                "store": str(store),
                **entry_json(info),
                "meta": stored.meta,
                "storage_dtype": stored.storage_dtype,
                "tensors": tensors,
            }
        )
        return
    if quiet:
        return
    now = time.time_ns()
    facts = out.table("", "value", show_header=False, title=f"entry {info.entry_id}")
    facts.add_row("layer", str(info.layer_idx))
    facts.add_row("tokens", str(info.n_tokens))
    facts.add_row("importance", f"{info.importance:g}")
    facts.add_row("accesses", str(info.access_count))
    facts.add_row("score", f"{info.score:.4g} (eviction score)")
    facts.add_row("put", f"{utc_time(info.created)} ({age(info.created, now)} ago)")
    facts.add_row("shard", str(info.shard_idx))
    facts.add_row("bytes", f"{human_bytes(info.bytes)} in its shard")
    for key, value in (stored.meta or {}).items():
        shown = value if isinstance(value, str) else json.dumps(value)
        facts.add_row(literal(f"meta {key}"), literal(shown))  # as text: a file name's [brackets] are no markup
    out.print(facts)
    table = out.table("tensor", "shape", "stored as", ">mean row L2", ">max row L2", ">max |x|")
    for name, t in tensors.items():
        stored_as = t["dtype"] + (" + F32 row scales" if "scales" in t else "")
        table.add_row(
            name,
            " x ".join(map(str, t["shape"])),
            stored_as,
            f"{t['mean_row_l2']:.4g}",
            f"{t['max_row_l2']:.4g}",
            f"{t['max_abs']:.4g}",
        )
    out.print(table)
    if stored.dtype == "I8":
        out.print("norms are of the rows read back (int8 x scale)")


def _summary(stored: StoredKV, side: str, rows: np.ndarray) -> dict[str, Any]:
    """Shape and dtype as stored; norms of the float32 rows read back."""
    norms = np.linalg.norm(np.asarray(rows, dtype=np.float64), axis=1)
    summary: dict[str, Any] = {
        "shape": list(getattr(stored, side).shape),
        "dtype": stored.dtype,
        "mean_row_l2": float(norms.mean()) if norms.size else 0.0,
        "max_row_l2": float(norms.max()) if norms.size else 0.0,
        "max_abs": float(np.abs(rows).max()) if rows.size else 0.0,
    }
    scales = stored.key_scales if side == "keys" else stored.value_scales
    if scales is not None:
        summary["scales"] = {
            "shape": list(scales.shape),
            "dtype": "F32",
            "min": float(scales.min()),
            "max": float(scales.max()),
        }
    return summary
