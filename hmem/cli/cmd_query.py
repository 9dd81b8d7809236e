"""``hmem query``: retrieve the entries most similar to a query."""

from __future__ import annotations

import time
import zipfile
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from hmem import (
    BadFileError,
    InvalidArgumentError,
    Store,
    check_export_path,
    export_results,
    is_store_url,
    read_tensor_file,
)
from hmem.cli.health_view import report_damaged_records, report_skipped, skipped_json
from hmem.cli.options import JsonOption, LockWaitOption, QuietOption, StoreArgument
from hmem.cli.output import Output, human_bytes, human_duration
from hmem.cli.query_export import ExportLayoutOption, KvHeadsOption, check_heads, check_options, export_note

QUERY_TENSOR_NAMES = ("query", "q", "keys", "k")


NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"  # an .npz archive
NUMPY_SUFFIXES = (".npy", ".npz")


def _magic(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(len(NPY_MAGIC))
    except FileNotFoundError:
        raise InvalidArgumentError(f"--query {path}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"--query {path}: a directory, not a query file") from None
    except OSError as exc:
        raise InvalidArgumentError(f"--query {path}: cannot read it ({exc.strerror or exc})") from None


def _load_npy(path: Path) -> np.ndarray:
    try:
        # mapped, not loaded: a header claiming a huge shape fails
        # against the file's real size instead of allocating it
        tokens = np.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError, EOFError, TypeError, MemoryError, zipfile.BadZipFile) as exc:
        raise InvalidArgumentError(f"--query {path}: not a readable .npy file ({exc or type(exc).__name__})") from None
    if not isinstance(tokens, np.ndarray):
        raise InvalidArgumentError(f"--query {path}: an .npz archive, not one .npy array")
    return tokens


def load_query(path: Path) -> np.ndarray:
    """Query tokens from a .npy file or a safetensors file (tensor 'query',
    'q', 'keys' or 'k', or its only tensor).  What the file holds decides,
    then its suffix in any case (q.NPY is a .npy file)."""
    magic = _magic(path)
    suffix = path.suffix.lower()
    if magic == NPY_MAGIC or magic.startswith(ZIP_MAGIC) or suffix in NUMPY_SUFFIXES:
        return _load_npy(path)
    try:
        return read_tensor_file(path, QUERY_TENSOR_NAMES)
    except BadFileError as exc:
        if suffix == ".safetensors":
            raise InvalidArgumentError(f"--query {path}: {exc.message}") from None
        raise InvalidArgumentError(
            f"--query {path}: neither a .npy file nor a safetensors file (read as safetensors: {exc.message})"
        ) from None


def query(
    store: StoreArgument,
    query_file: Annotated[
        str,  # not a Path, which turns "" into "." (a directory): "" is refused as it is
        typer.Option(
            "--query",
            metavar="<path>",
            help="Query tokens: a .npy or .safetensors file "
            "holding n_tokens x embed_dim values (or one row of embed_dim).",
            show_default=False,
        ),
    ],
    layer: Annotated[int, typer.Option("--layer", "-l", min=0, help="Layer to search.", show_default=False)],
    top_k: Annotated[int, typer.Option("--top-k", "-k", min=1, help="Number of results.")] = 5,
    rerank: Annotated[
        bool, typer.Option("--rerank/--no-rerank", help="Re-rank a 4x shortlist by the exact cosine of pooled keys.")
    ] = True,
    search: Annotated[
        str,
        typer.Option(
            "--search",
            metavar="MODE",
            help="How signatures are scanned: full (every signature whole), two-stage (the first 1024 bits of each, "
            "then the best 50x shortlist whole), spans (a store's span signatures: an entry ranks by its best "
            "span) or auto (spans on a store that has them, else two-stage on layers of 100,000 entries and "
            "more).",
        ),
    ] = "auto",
    token_rerank: Annotated[
        int | None,
        typer.Option(
            "--token-rerank",
            metavar="N",
            help="Re-rank the best N candidates by token-level max-sim over their stored keys (0: off; default: "
            "the store's setting). A query as long as an entry finds the document it continues more often.",
            show_default=False,
        ),
    ] = None,
    export: Annotated[
        str | None,  # not a Path, which turns "" into ".": check_export_path refuses ""
        typer.Option("--export", metavar="<path>", help="Write the retrieved K/V to this safetensors file."),
    ] = None,
    export_layout: ExportLayoutOption = "entries",
    kv_heads: KvHeadsOption = None,
    count_access: Annotated[
        bool,
        typer.Option(
            "--count-access",
            help="Count the results as accesses (takes the write lock); by default a query from the shell only reads.",
        ),
    ] = False,
    skip_damaged: Annotated[
        bool,
        typer.Option(
            "--skip-damaged",
            help="Leave out entries whose record, shard or tensors are damaged (listed on stderr) and show the next "
            "best.",
        ),
    ] = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Show the entries of a layer most similar to a query, best first."""
    out = Output(json_mode=json_output, quiet=quiet)
    if not query_file:  # "" is no file (as a Path it would be ".", the current directory)
        raise InvalidArgumentError("--query is empty (''): an empty path names no file", hint="give the query file")
    tokens = load_query(Path(query_file))
    check_options(export, export_layout, kv_heads)
    if export is not None:
        # a bad --export path, or one inside the store, fails before the store is touched
        check_export_path(export, None if is_store_url(store) else store)
    started = time.perf_counter()
    # --skip-damaged also reads past damaged records of entries.bin (a reader only: never with --count-access)
    past_records = "skip" if skip_damaged and not count_access else "raise"
    with Store.open(store, read_only=not count_access, lock_wait=lock_wait, on_damage=past_records) as s:
        damaged_records = report_damaged_records(out, s)
        check_heads(s.config.embed_dim, kv_heads)
        results = s.query(
            tokens,
            layer,
            top_k,
            rerank=rerank,
            on_damage="skip" if skip_damaged else "raise",
            search=search,
            token_rerank=token_rerank,
        )
        skipped_note = report_skipped(out, results, layer)
        seconds = time.perf_counter() - started
        exported, note = None, None
        if export is not None:
            exported = export_results(
                results,
                export,
                {"layer": str(layer), "store": str(store)},
                layout=export_layout,
                kv_heads=kv_heads,
                storage_dtype=s.config.storage_dtype,
                store=s.path,
            )
            note = export_note(s.config.storage_dtype)
    now = time.time_ns()
    rows: list[dict[str, Any]] = [
        {
            "rank": rank,
            "entry_id": r.entry_id,
            "layer": r.layer_idx,
            "score": r.score,
            "similarity": r.similarity,
            "cosine": r.cosine,
            "token_score": r.token_score,
            "n_tokens": r.n_tokens,
            "importance": r.importance,
            "access_count": r.access_count,
            "timestamp_ns": r.timestamp,
            "shard": r.shard_idx,
        }
        for rank, r in enumerate(results, start=1)
    ]
    if json_output:
        out.emit_json(
            {
                "store": str(store),
                "layer": layer,
                "top_k": top_k,
                "rerank": rerank,
                "token_rerank": token_rerank,
                "search": search,
                "searched": results.search,
                "results": rows,
                "skipped": damaged_records + skipped_json(results),
                "export": str(export) if export else None,
                "seconds": seconds,
            }
        )
        return
    if not results:
        out.print(f"no entries in layer {layer}")
        return
    table = out.table(">rank", ">entry", ">score", ">similarity", ">tokens", ">importance", ">accesses", ">age")
    for row in rows:
        table.add_row(
            str(row["rank"]),
            str(row["entry_id"]),
            f"{row['score']:.4f}",
            f"{row['similarity']:.4f}",
            str(row["n_tokens"]),
            f"{row['importance']:g}",
            str(row["access_count"]),
            human_duration(max(0, now - row["timestamp_ns"]) / 1e9),
        )
    out.print(table)
    by_tokens = bool(results) and results[0].token_score is not None
    ranked = "token max-sim" if by_tokens else "cosine of pooled keys" if rerank else "signature similarity"
    out.print(
        f"{len(results)} result(s) from layer {layer}, ranked by {ranked}, in {human_duration(seconds)}" + skipped_note,
        soft_wrap=True,
    )
    if exported is not None:
        out.print(f"exported K/V of {len(results)} entries to {export} ({human_bytes(exported)})")
        if note is not None:
            out.print(note)
