"""verify and repair of a store on object storage (docs/format.md, "Stores
on object storage").

Both work on a working copy of the committed state (hmem/store/object_link.py):

- verify checks the manifest and its state objects (checksums), that
  every object the manifest names exists with its size, and lists the
  objects no commit names; then it runs the local verify on the working
  copy, each shard's header and index fetched (the quick check) or the
  whole shard (the full check);
- repair takes the writer's lease, fetches every shard whole, runs the
  local repair on the working copy and commits the result as a new
  snapshot; the objects it no longer names are retired, those no commit
  ever named removed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from hmem import _io
from hmem.errors import HmemError, NotAStoreError
from hmem.formats import manifest, shard_file
from hmem.formats import objects as fmt
from hmem.recovery.repair import RepairReport, repair
from hmem.recovery.verify import ERROR, INFO, WARNING, Finding, VerifyReport, verify
from hmem.store.object_fetch import RemoteShardFile
from hmem.store.object_link import ObjectLink


def verify_remote(
    url: str,
    *,
    full: bool,
    subset: tuple[int, int] | None,
    max_seconds: float | None,
    storage_options: dict[str, Any] | None,
) -> VerifyReport:
    started = time.perf_counter()
    link = ObjectLink(url, storage_options)
    found: list[Finding] = []

    def report(local: VerifyReport | None) -> VerifyReport:
        findings = tuple(found) + (local.findings if local else ())
        return VerifyReport(
            link.url,
            full,
            findings,
            local.records if local else 0,
            local.shards if local else 0,
            local.tensors_checked if local else 0,
            local.bytes_checked if local else 0,
            local.complete if local else True,
            time.perf_counter() - started,
            local.subset if local else None,
        )

    try:
        try:
            mf = link.read_manifest()
        except NotAStoreError:
            raise
        except HmemError as exc:
            found.append(
                Finding("remote.manifest", ERROR, fmt.MANIFEST_KEY, exc.message, "a manifest that passes its checksum")
            )
            return report(None)
        listed = link.listing()  # the store's shards/ and state/: nothing of another store
        for item in [*mf.state, *mf.shards.values()]:
            size = listed.get(item["key"])
            if size is None:
                found.append(
                    Finding(
                        "remote.missing",
                        ERROR,
                        item["key"],
                        "an object the manifest names is missing",
                        f"{item['bytes']} bytes",
                    )
                )
            elif size != item["bytes"]:
                found.append(
                    Finding("remote.size", ERROR, item["key"], f"the object is {size} bytes", f"{item['bytes']} bytes")
                )
        for key in link.orphan_sizes(listed):
            found.append(
                Finding(
                    "remote.orphan",
                    WARNING,
                    key,
                    "an object no commit names (left by a writer that stopped before its commit; compact removes it)",
                    "no such object",
                )
            )
        manifest_keys = {item["key"] for item in [*mf.state, *mf.shards.values(), *mf.retired]}
        for key in sorted(listed):
            if key not in manifest_keys and not fmt.is_own_key(key):
                found.append(
                    Finding(
                        "remote.foreign",
                        INFO,
                        key,
                        "an object of a name hmem does not give its objects (left alone: never deleted)",
                        "no such object",
                    )
                )
        if any(f.code == "remote.missing" and f.file.startswith(fmt.STATE_PREFIX) for f in found):
            return report(None)
        try:
            directory = link.materialize()
        except HmemError as exc:
            found.append(
                Finding("remote.state", ERROR, fmt.STATE_PREFIX, exc.message, "state objects that pass their checksums")
            )
            return report(None)
        local_mf = manifest.parse(directory, mf.index)
        for info in local_mf.shards:
            named = mf.shards.get(info.uid)
            if named is None or named["key"] not in listed:
                continue  # the local verify reports the shard missing
            if full:
                data, _ = link.client.get(named["key"])
                _io.write_file(directory / info.file, [data])
            else:
                # at the object's real size: one shorter than the manifest says
                # (remote.size above) is then what the local check finds, not a failed read
                _fetch_head(link, named["key"], directory / info.file, listed[named["key"]], info.entries)
        link.fetcher.remote = {}
        # a quick check fetched only the shards' heads: their holes are by design
        local = verify(directory, full=full, subset=subset, max_seconds=max_seconds, fetched_heads=not full)
        # the working copy's names are the store's own; say where they live
        return dataclasses.replace(report(local), path=link.url)
    finally:
        link.close()


def _fetch_head(link: ObjectLink, key: str, path: Path, size: int, entries: int) -> None:
    """A sparse copy of a shard holding its header and entry index, all the
    quick check reads of it."""
    mirror = RemoteShardFile(link.fetcher, key, path, size)
    try:
        if size < shard_file.LENGTH_BYTES:
            return  # no header length to read: the local check finds it too short
        mirror.ensure(0, shard_file.LENGTH_BYTES)
        start = shard_file.data_start(_io.read_ranges([_io.FileRange(path, 0, shard_file.LENGTH_BYTES)]))
        mirror.ensure(0, shard_file.head_bytes(start, entries))
    finally:
        mirror.close()


def repair_remote(url: str, *, lock_wait: float, storage_options: dict[str, Any] | None) -> RepairReport:
    link = ObjectLink(url, storage_options)
    try:
        link.read_manifest()
        link.take_lease(lock_wait)
        link.fence()
        directory = link.materialize()
        local_mf = manifest.parse(directory, link.manifest.index if link.manifest else b"")
        link.download_shards(directory, local_mf.shards)
        fixed = repair(directory)
        link.published_generation = -1
        link.publish(directory, manifest.load(directory), snapshot=True)
        link.remove_orphans()
        return dataclasses.replace(fixed, path=link.url)
    finally:
        link.close()


__all__ = ["repair_remote", "verify_remote"]
