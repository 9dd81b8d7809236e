"""``hmem stats``: what a store holds."""

from __future__ import annotations

from typing import Annotated

import typer

from hmem import Store
from hmem.cli.health_view import health_line
from hmem.cli.options import ChunkSizeOption, JsonOption, KVShapeOption, ModelConfigOption, QuietOption, StoreArgument
from hmem.cli.output import Output, human_bytes

SHARD_ROWS = 20


def stats(
    store: StoreArgument,
    all_shards: Annotated[
        bool, typer.Option("--all-shards", help=f"List every shard (default: the first {SHARD_ROWS}).")
    ] = False,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    kv_shape: KVShapeOption = None,
    model_config: ModelConfigOption = None,
    chunk_size: ChunkSizeOption = 256,
) -> None:
    """Show what a store holds: entries, layers, shards, bytes, health.

    Also what compaction would free, and whether every shard file is there
    with its recorded size (the health line).

    Of an LMCache cache directory: its chunk files per model, world size,
    rank, dtype, tags and layer, the .tmp debris, files that are no chunk,
    and the K/V shape and where it comes from."""
    from hmem.cli.lmcache_target import cache_at

    cache = cache_at(store, kv_shape_text=kv_shape, model_config=model_config, chunk_size=chunk_size)
    if cache is not None:
        from hmem.cli import lmcache_stats_view

        lmcache_stats_view.stats(cache, json_output=json_output, quiet=quiet)
        return
    out = Output(json_mode=json_output, quiet=quiet)
    with Store.open(store, read_only=True) as s:
        st = s.stats()
    if json_output:
        out.emit_json(st.to_dict())  # exactly the library's stats, health included (docs/cli.md)
        return
    cfg = st.config
    summary = out.table("", ">value", show_header=False)
    summary.add_row("store", st.path)
    summary.add_row("format", f"version {st.format_version}, generation {st.generation}")
    summary.add_row(
        "entries", f"{st.entries} live, {st.evicted} evicted" + (f", {st.unflushed} unflushed" if st.unflushed else "")
    )
    summary.add_row("layers", str(len(st.layers)))
    summary.add_row("shards", str(len(st.shards)))
    summary.add_row("on disk" if st.remote is None else "objects", human_bytes(st.bytes_on_disk))
    if st.remote is not None:
        r = st.remote
        summary.add_row(
            "object store", f"{r.endpoint}, manifest generation {r.generation}, {r.state_objects} state object(s)"
        )
        summary.add_row(
            "requests",
            f"{r.requests} ({r.gets} get, {r.puts} put, {r.deletes} delete, {r.lists} list); "
            f"{human_bytes(r.bytes_fetched)} fetched, {human_bytes(r.bytes_sent)} sent",
        )
    summary.add_row("live K/V", human_bytes(st.live_bytes))
    summary.add_row(
        "reclaimable",
        f"{human_bytes(st.reclaimable_bytes)} ('hmem compact --min-dead 0' frees it all)"
        if st.reclaimable_bytes
        else "0 B",
    )
    summary.add_row("accesses", str(st.total_accesses))
    summary.add_row(
        "config",
        f"embed_dim {cfg.embed_dim}, hdc_dim {cfg.hdc_dim}, seed {cfg.seed}, "
        f"stored as {cfg.storage_dtype}, shards up to {human_bytes(cfg.shard_max_bytes)}"
        + (f", {cfg.signatures_per_entry} signatures per entry ({cfg.span_layout} spans)" if cfg.spans else "")
        + (f", queries re-rank {cfg.token_rerank} by tokens" if cfg.token_rerank else ""),
    )
    limits = [
        f"max {cfg.max_entries} entries" if cfg.max_entries else "",
        f"max {human_bytes(cfg.max_disk_bytes)} on disk" if cfg.max_disk_bytes else "",
    ]
    summary.add_row("limits", ", ".join(x for x in limits if x) or "none")
    summary.add_row("kernels", st.kernels)
    out.print(summary)
    out.print(health_line(st.health, st.entries), soft_wrap=True)
    if st.layers:
        layers = out.table(">layer", ">entries", title="entries per layer")
        for layer, count in st.layers.items():
            layers.add_row(str(layer), str(count))
        out.print(layers)
    if st.shards:
        shards = out.table(">shard", "file", ">size", ">entries", ">evicted", ">dead bytes", title="shards")
        shown = st.shards if all_shards else st.shards[:SHARD_ROWS]
        damage = {
            **dict.fromkeys(st.health.missing_shards, " (missing)"),
            **dict.fromkeys(st.health.wrong_size_shards, " (wrong size)"),
        }
        for sh in shown:
            shards.add_row(
                str(sh.index),
                sh.file + damage.get(sh.file, ""),
                human_bytes(sh.bytes),
                str(sh.entries),
                str(sh.dead_entries),
                human_bytes(sh.dead_bytes),
            )
        out.print(shards)
        if len(shown) < len(st.shards):
            out.print(f"... and {len(st.shards) - len(shown)} more shards (--all-shards lists them)")
    for name in st.orphan_files:
        out.warn(f"orphan file {name}: no commit names it; 'hmem compact' removes it")
    for name in st.foreign_files:
        out.warn(f"foreign file {name} in the store directory (hmem leaves it alone)")
