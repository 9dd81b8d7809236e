"""``hmem demo``: the whole job on a small generated example, in seconds."""

from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from hmem import InvalidArgumentError, PathError, Store, StoreConfig, explain_prefix_hit, import_files, read_kv_file
from hmem.cli.demo_data import EMBED_DIM, PREFIX_CHUNKS, PREFIX_WINDOWS, prefix_presence, write_inputs
from hmem.cli.options import JsonOption, QuietOption
from hmem.cli.output import Output, human_bytes, styled


def demo(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Where to create the demo store (kept); default: a temporary directory, removed at the end.",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Create a store, import generated K/V files, query, evict, compact, show stats and a prefix hit."""
    out = Output(json_mode=json_output, quiet=quiet)
    if path is not None and path.exists() and not path.is_dir():
        raise PathError(
            f"{path} exists and is not a directory",
            path=str(path),
            errno=errno.ENOTDIR,
            strerror=os.strerror(errno.ENOTDIR),
            hint="give a new directory for the demo store",
        )
    if path is not None and path.exists() and any(path.iterdir()):
        raise InvalidArgumentError(f"{path} is not empty", hint="give a new directory for the demo store")
    rng = np.random.default_rng(7)
    # the temporary directory holds the generated inputs, and the store unless
    # a path is given; it is removed when the demo ends, however it ends
    with tempfile.TemporaryDirectory(prefix="hmem-demo-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        store_dir = path if path is not None else workdir / "store"
        report: dict = {"store": str(store_dir)}
        files = write_inputs(workdir, rng)
        config = StoreConfig(embed_dim=EMBED_DIM, shard_max_bytes=512 * 1024)
        out.print(
            Text.assemble(
                styled("hmem demo", "bold"),
                f": a store at {store_dir}, K/V rows of {EMBED_DIM} floats, {config.hdc_dim}-bit signatures",
            )
        )
        with Store.create(store_dir, config) as store:
            started = time.perf_counter()
            with out.progress("importing", len(files)) as bar:
                imported = import_files(store, files, progress=lambda _: bar.advance(1))
            store.flush()
            st = store.stats()
            report["import"] = {
                "files": len(files),
                "entries": imported.entries_added,
                "layers": len(st.layers),
                "bytes_read": imported.bytes_read,
            }
            out.print(
                f"1. imported {imported.entries_added} entries from {len(files)} safetensors files "
                f"({human_bytes(imported.bytes_read)}) into {len(st.layers)} layers and {len(st.shards)} "
                f"shards in {time.perf_counter() - started:.2f} s"
            )

            target = imported.files[5].entries[0]  # single_05.safetensors: layer 1
            entries, _ = read_kv_file(files[5])
            keys = np.asarray(entries[0].keys)
            probe = keys[:8] + 0.3 * rng.standard_normal((8, EMBED_DIM)).astype(np.float32)
            results = store.query(probe, 1, top_k=3)
            table = out.table(">rank", ">entry", ">cosine", ">signature similarity", ">tokens")
            for rank, r in enumerate(results, 1):
                table.add_row(str(rank), str(r.entry_id), f"{r.score:.4f}", f"{r.similarity:.4f}", str(r.n_tokens))
            found = bool(results) and results[0].entry_id == target
            report["query"] = {"layer": 1, "wanted": target, "results": [r.entry_id for r in results], "found": found}
            out.print(
                f"2. a query with a noisy copy of 8 tokens of entry {target} (layer 1) finds "
                + (f"entry {target} first:" if found else "other entries first:")
            )
            out.print(table)

            keep = st.entries * 3 // 4
            evicted = store.evict(keep)
            compacted = store.compact()
            report["evict"] = {"kept": keep, "evicted": evicted}
            report["compact"] = {
                "bytes_freed": compacted.bytes_freed,
                "shards_before": compacted.shards_before,
                "shards_after": compacted.shards_after,
            }
            out.print(
                f"3. evicted the {evicted} lowest-scored entries, then compaction freed "
                f"{human_bytes(compacted.bytes_freed)} ({compacted.shards_before} shards -> "
                f"{compacted.shards_after})"
            )
            st = store.stats()
            report["stats"] = {
                "entries": st.entries,
                "layers": {str(k): v for k, v in st.layers.items()},
                "bytes_on_disk": st.bytes_on_disk,
            }
            layers = ", ".join(f"layer {k}: {v}" for k, v in st.layers.items())
            out.print(f"4. the store holds {st.entries} entries ({layers}) in {human_bytes(st.bytes_on_disk)}")

        chunks, windows = PREFIX_CHUNKS, PREFIX_WINDOWS
        hit = explain_prefix_hit(prefix_presence(), chunks, 1, windows)
        report["prefix_hit"] = {
            "chunks": chunks,
            "windows": windows,
            "hit": hit.hit,
            "limiting_groups": list(hit.limiting_groups),
        }
        out.print(
            f"5. prefix hit of a hybrid model (full attention, 4-chunk window, mamba; 16 chunks): "
            f"{hit.hit} chunks, limited by group(s) {', '.join(map(str, hit.limiting_groups)) or 'none'} "
            f"(try 'hmem prefix-hit --help')"
        )
        if path is None:
            out.print("the demo store is removed; give a path to keep it, then try 'hmem stats PATH'")
    if json_output:
        out.emit_json(report)
