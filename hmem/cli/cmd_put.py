"""``hmem put``: import K/V safetensors files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from hmem import LAYOUTS, InvalidArgumentError, Store, find_kv_files, import_files, is_store, is_store_url
from hmem.cli import lmcache_transfer_view, signals
from hmem.cli.options import (
    STORE_ENV,
    ChunkSizeOption,
    DryRunOption,
    JsonOption,
    KVShapeOption,
    LockWaitOption,
    ModelConfigOption,
    QuietOption,
)
from hmem.cli.output import Output
from hmem.cli.put_report import report as _report
from hmem.cli.put_report import report_not_started


def _is_store(text: str) -> bool:
    return is_store_url(text) or is_store(text)


def _store_and_inputs(args: list[str]) -> tuple[str, list[str]]:
    """STORE FILES...: the store may be left out when HMEM_STORE names it.
    A first path that is neither a store nor an existing file or directory
    is a store name (mistyped, or not made yet), never a file to import."""
    env = os.environ.get(STORE_ENV)
    stores = [_is_store(arg) for arg in args[:1]]
    paths = [Path(arg) for arg in args]
    if env and args and not stores[0] and not paths[0].exists() and len(paths) > 1:
        raise InvalidArgumentError(
            f"{paths[0]} is not a store, nor a file or directory to import",
            hint=f"give an existing store, or only the files to import into {env} ({STORE_ENV})",
        )
    # the inputs as typed: find_kv_files refuses "" (as a Path it would be ".")
    if env and (not paths or not stores[0]):
        return env, list(args)
    if len(paths) < 2:
        raise InvalidArgumentError(
            "give the store and at least one file or directory to import",
            hint=f"or set {STORE_ENV} and give only the files",
        )
    return args[0], list(args[1:])


def put(
    paths: Annotated[
        list[str],
        typer.Argument(
            metavar="[STORE] FILES...",
            help="The store (may be left out when HMEM_STORE is set), then safetensors files or directories "
            "searched for *.safetensors, or LMCache cache directories.",
            show_default=False,
        ),
    ],
    layer: Annotated[
        int | None, typer.Option("--layer", "-l", min=0, help="Layer of entries whose tensor names carry none.")
    ] = None,
    importance: Annotated[
        float | None, typer.Option("--importance", "-i", min=0.0, help="Importance of every entry imported.")
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout",
            metavar="LAYOUT",
            help="How per-head tensors are laid out: "
            + ", ".join(LAYOUTS)
            + " (t tokens, h kv heads, d head_dim, b batch, l layers, 2 K/V); by default from the names or the "
            "store's embed_dim.",
            show_default=False,
        ),
    ] = None,
    chunk_tokens: Annotated[
        int | None,
        typer.Option(
            "--chunk-tokens",
            min=1,
            metavar="N",
            help="Store each sequence as entries of N consecutive tokens (the last may be shorter).",
            show_default=False,
        ),
    ] = None,
    again: Annotated[
        bool,
        typer.Option(
            "--again",
            help="Import files the store already imported (same content), storing their entries a second time.",
        ),
    ] = False,
    dry_run: DryRunOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    kv_shape: KVShapeOption = None,
    model_config: ModelConfigOption = None,
    chunk_size: ChunkSizeOption = 256,
    tokens: Annotated[
        str | None,
        typer.Option(
            "--tokens",
            metavar="FILE",
            help="With an LMCache cache: JSON token ids of the requests (as hmem prefix-hit --tokens), to "
            "record each chunk's token range within its request.",
            show_default=False,
        ),
    ] = None,
    hash_seed: Annotated[
        str | None,
        typer.Option(
            "--hash-seed",
            help="With --tokens: the PYTHONHASHSEED the deployment ran with (vLLM derives NONE_HASH from it).",
            show_default=False,
        ),
    ] = None,
    none_hash: Annotated[
        int | None,
        typer.Option("--none-hash", help="With --tokens: NONE_HASH itself (0 outside vLLM).", show_default=False),
    ] = None,
) -> None:
    """Import K/V safetensors files or LMCache caches; bad files are reported and skipped.

    Tensor names (case-insensitive): 'keys'/'values' or 'k'/'v' (one pair),
    'layer.{i}.k', 'past_key_values.{i}.key' or '.{i}.0',
    'model.layers.{i}.self_attn.key_cache' (layer i), 'k_{n}'/'v_{n}', or one
    'kv' (layers, 2, tokens, kv_heads, head_dim). Per-head tensors (thd, htd,
    bhtd, bthd) become rows of kv_heads*head_dim, the store's embed_dim; each
    batch row is its own entry. The layer comes from the names, else --layer,
    else __metadata__ 'layer', else 0; importance from --importance, else
    __metadata__ 'importance', else 1. A file whose content the store already
    imported is not imported again (unless --again), so re-running an import
    stores exactly what is missing. An LMCache cache directory (docs/lmcache.md)
    is imported as one entry per layer per chunk, the LMCache key in each
    entry's meta (local_disk files need --kv-shape or --model-config).
    Skipped files are named on stderr
    with the reason; the exit code is then 3 (partial), or 1 when every
    file was skipped. See docs/cli.md, "Naming conventions and layouts".
    """
    out = Output(json_mode=json_output, quiet=quiet)
    if layout is not None and layout not in LAYOUTS:
        raise InvalidArgumentError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    store, inputs = _store_and_inputs(paths)
    if lmcache_transfer_view.any_cache(inputs):
        if layer is not None or layout is not None or chunk_tokens is not None:
            raise InvalidArgumentError("--layer, --layout and --chunk-tokens apply to safetensors files, not caches")
        code = lmcache_transfer_view.put_caches(
            out,
            store,
            inputs,
            kv_shape_text=kv_shape,
            model_config=model_config,
            chunk_size=chunk_size,
            tokens=tokens,
            hash_seed=hash_seed,
            none_hash=none_hash,
            importance=importance,
            again=again,
            dry_run=dry_run,
            lock_wait=lock_wait,
        )
        if code:
            raise typer.Exit(code)
        return
    if tokens is not None or hash_seed is not None or none_hash is not None:
        raise InvalidArgumentError("--tokens, --hash-seed and --none-hash apply to LMCache caches")
    files: list[Path] = []
    try:
        files = find_kv_files(inputs, store=None if is_store_url(store) else store)
        if not files:
            raise InvalidArgumentError("no .safetensors files found in " + ", ".join(inputs))
        total = sum(p.stat().st_size for p in files if p.is_file())
        started = time.perf_counter()
        opened = Store.open(store, read_only=dry_run, lock_wait=lock_wait)  # a signal stops the lock wait at once
    except KeyboardInterrupt:
        # Stopped before the import began (searching the inputs, opening the
        # store, waiting for its lock): say that nothing went in, as a stop
        # between files says what did (docs/cli.md, "Interrupts").
        raise typer.Exit(report_not_started(out, store, dry_run, files)) from None
    with signals.stoppable():  # from here a signal stops between files (hmem/cli/signals.py)
        with opened as s:
            before = s.stats()
            with out.progress("importing", total, bytes_mode=True) as bar:
                report = import_files(
                    s,
                    files,
                    layer=layer,
                    importance=importance,
                    layout=layout,
                    chunk_tokens=chunk_tokens,
                    dry_run=dry_run,
                    progress=lambda result: bar.advance(result.bytes),
                    should_stop=signals.requested,
                    again=again,
                )
            if not dry_run:
                s.flush()
            after = s.stats()
        code = _report(out, store, dry_run, report, before, after, time.perf_counter() - started)
    if code:
        raise typer.Exit(code)
