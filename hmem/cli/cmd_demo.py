"""``hmem demo``: the whole job on a small generated example, in seconds."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from safetensors.numpy import save_file

from hmem import Bitmap, Store, StoreConfig, explain_prefix_hit, presence_map
from hmem.cli.options import JsonOption, QuietOption
from hmem.cli.output import Output, human_bytes
from hmem.errors import InvalidArgumentError
from hmem.transfer.kvfiles import import_files, read_entries

EMBED_DIM = 128
TOKENS = 32


def write_inputs(folder: Path, rng: np.random.Generator) -> list[Path]:
    """K/V files in the three naming forms `hmem put` reads, with keys that
    share a large mean component, as real attention keys do."""
    common = rng.standard_normal(EMBED_DIM) * 2

    def kv(n: int = TOKENS) -> tuple[np.ndarray, np.ndarray]:
        keys = common + rng.standard_normal(EMBED_DIM) + 0.8 * rng.standard_normal((n, EMBED_DIM))
        return keys.astype(np.float32), rng.standard_normal((n, EMBED_DIM)).astype(np.float32)

    paths = []
    for i in range(8):  # one entry per file, its layer and importance in the metadata
        k, v = kv()
        path = folder / f"single_{i:02d}.safetensors"
        save_file({"keys": k, "values": v}, path, metadata={"layer": str(i % 4), "importance": str(1 + i % 3)})
        paths.append(path)
    for i in range(6):  # one entry per layer, stored as float16
        tensors = {}
        for layer in range(4):
            k, v = kv()
            tensors[f"layer.{layer}.k"], tensors[f"layer.{layer}.v"] = k.astype(np.float16), v.astype(np.float16)
        path = folder / f"layers_{i:02d}.safetensors"
        save_file(tensors, path)
        paths.append(path)
    for i in range(4):  # several entries of one layer
        tensors = {}
        for n in range(3):
            tensors[f"k_{n}"], tensors[f"v_{n}"] = kv(16)
        path = folder / f"numbered_{i:02d}.safetensors"
        save_file(tensors, path, metadata={"layer": "2"})
        paths.append(path)
    return paths


def demo(
    path: Annotated[Path | None, typer.Argument(help="Where to create the demo store (kept); default: a "
                                                "temporary directory, removed at the end.", show_default=False)] = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Create a store, import generated K/V files, query, evict, compact, show stats and a prefix hit."""
    out = Output(json_mode=json_output, quiet=quiet)
    if path is not None and path.exists() and any(path.iterdir()):
        raise InvalidArgumentError(f"{path} is not empty", hint="give a new directory for the demo store")
    workdir = Path(tempfile.mkdtemp(prefix="hmem-demo-"))
    store_dir = path if path is not None else workdir / "store"
    rng = np.random.default_rng(7)
    report: dict = {"store": str(store_dir)}
    try:
        inputs = workdir / "inputs"
        inputs.mkdir()
        files = write_inputs(inputs, rng)
        config = StoreConfig(embed_dim=EMBED_DIM, shard_max_bytes=512 * 1024)
        out.print(f"[bold]hmem demo[/]: a store at {store_dir}, K/V rows of {EMBED_DIM} floats, "
                  f"{config.hdc_dim}-bit signatures")
        with Store.create(store_dir, config) as store:
            started = time.perf_counter()
            with out.progress("importing", len(files)) as bar:
                imported = import_files(store, files, progress=lambda _: bar.advance(1))
            store.flush()
            st = store.stats()
            report["import"] = {"files": len(files), "entries": imported.entries_added,
                                "layers": len(st.layers), "bytes_read": imported.bytes_read}
            out.print(f"1. imported {imported.entries_added} entries from {len(files)} safetensors files "
                      f"({human_bytes(imported.bytes_read)}) into {len(st.layers)} layers and {len(st.shards)} "
                      f"shards in {time.perf_counter() - started:.2f} s")

            target = imported.files[5].entries[0]  # single_05.safetensors: layer 1
            entries, _ = read_entries(files[5])
            keys = np.asarray(entries[0].keys)
            probe = keys[:8] + 0.3 * rng.standard_normal((8, EMBED_DIM)).astype(np.float32)
            results = store.query(probe, 1, top_k=3)
            table = out.table(">rank", ">entry", ">cosine", ">signature similarity", ">tokens")
            for rank, r in enumerate(results, 1):
                table.add_row(str(rank), str(r.entry_id), f"{r.score:.4f}", f"{r.similarity:.4f}", str(r.n_tokens))
            found = bool(results) and results[0].entry_id == target
            report["query"] = {"layer": 1, "wanted": target, "results": [r.entry_id for r in results], "found": found}
            out.print(f"2. a query with a noisy copy of 8 tokens of entry {target} (layer 1) finds "
                      + (f"entry {target} first:" if found else "other entries first:"))
            out.print(table)

            keep = st.entries * 3 // 4
            evicted = store.evict(keep)
            compacted = store.compact()
            report["evict"] = {"kept": keep, "evicted": evicted}
            report["compact"] = {"bytes_freed": compacted.bytes_freed, "shards_before": compacted.shards_before,
                                 "shards_after": compacted.shards_after}
            out.print(f"3. evicted the {evicted} lowest-scored entries, then compaction freed "
                      f"{human_bytes(compacted.bytes_freed)} ({compacted.shards_before} shards -> "
                      f"{compacted.shards_after})")
            st = store.stats()
            report["stats"] = {"entries": st.entries, "layers": {str(k): v for k, v in st.layers.items()},
                               "bytes_on_disk": st.bytes_on_disk}
            layers = ", ".join(f"layer {k}: {v}" for k, v in st.layers.items())
            out.print(f"4. the store holds {st.entries} entries ({layers}) in {human_bytes(st.bytes_on_disk)}")

        chunks, windows = 16, [-1, 4, 1]
        rows = [[Bitmap.from_indices([*range(12), 14], chunks)],
                [Bitmap.from_indices([*range(10), *range(12, 16)], chunks)],
                [Bitmap.from_indices(range(6, 10), chunks)]]
        hit = explain_prefix_hit(presence_map(rows, chunks), chunks, 1, windows)
        report["prefix_hit"] = {"chunks": chunks, "windows": windows, "hit": hit.hit,
                                "limiting_groups": list(hit.limiting_groups)}
        out.print(f"5. prefix hit of a hybrid model (full attention, 4-chunk window, mamba; 16 chunks): "
                  f"{hit.hit} chunks, limited by group(s) {', '.join(map(str, hit.limiting_groups)) or 'none'} "
                  f"(try 'hmem prefix-hit --help')")
        if path is None:
            out.print("the demo store is removed; give a path to keep it, then try 'hmem stats PATH'")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if json_output:
        out.emit_json(report)
