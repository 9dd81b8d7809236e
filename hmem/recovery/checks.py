"""The public verify and repair: a store directory (hmem/recovery/verify.py,
hmem/recovery/repair.py) or a store on object storage
(hmem/recovery/objects.py), told apart by its name.  The object-store
side is imported when a URL is given: `hmem verify DIR` starts without it
(docs/benchmarks.md, "Command start-up")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hmem.errors import InvalidArgumentError
from hmem.object_store import is_url
from hmem.recovery import repair as local_repair
from hmem.recovery import verify as local_verify
from hmem.recovery.repair import RepairReport
from hmem.recovery.verify import VerifyReport


def verify(
    path: str | Path,
    *,
    full: bool = False,
    subset: tuple[int, int] | None = None,
    max_seconds: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> VerifyReport:
    """Check the store at `path`, a directory or a URL s3://bucket/prefix
    (with `storage_options` as for Store.open): every file against the
    others and against its checksums; `full` also reads every tensor.
    Nothing is written.  docs/reliability.md lists the finding codes."""
    if is_url(path):
        from hmem.recovery import objects

        return objects.verify_remote(
            str(path), full=full, subset=subset, max_seconds=max_seconds, storage_options=storage_options
        )
    _local_only(storage_options)
    return local_verify.verify(path, full=full, subset=subset, max_seconds=max_seconds)


def repair(
    path: str | Path,
    *,
    lock_wait: float = 0.0,
    storage_options: dict[str, Any] | None = None,
    dry_run: bool = False,
    rebuild_layer: int = 0,
    rebuild_importance: float = 1.0,
) -> RepairReport:
    """Salvage what passes its checksums in the store at `path`, a directory
    or a URL s3://bucket/prefix, as the writer (waiting up to `lock_wait`
    seconds for the lock or lease).  Entries whose records are lost are
    rebuilt from their shards with `rebuild_layer` and `rebuild_importance`;
    `dry_run` (directories only) writes nothing and reports what repair
    would keep, rebuild, drop and move to lost+found/."""
    if is_url(path):
        if dry_run or rebuild_layer != 0 or rebuild_importance != 1.0:
            raise InvalidArgumentError(
                "dry_run, rebuild_layer and rebuild_importance apply to store directories only",
                hint="copy the store to a directory with 'hmem copy' to plan its repair",
            )
        from hmem.recovery import objects

        return objects.repair_remote(str(path), lock_wait=lock_wait, storage_options=storage_options)
    _local_only(storage_options)
    return local_repair.repair(
        path,
        lock_wait=lock_wait,
        dry_run=dry_run,
        rebuild_layer=rebuild_layer,
        rebuild_importance=rebuild_importance,
    )


def _local_only(storage_options: Any) -> None:
    if storage_options is not None:
        raise InvalidArgumentError("storage_options apply to stores on object storage (s3://...) only")
