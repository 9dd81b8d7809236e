"""repair: salvage what can be saved of a damaged store.

Takes the write lock, runs a full verify, and when it finds errors rewrites
the store (hmem/store/rewrite.py) from what checks out:

- the config from index.json, or, when index.json is lost or garbled, from
  the ``store_config`` every shard carries in its metadata;
- the records of entries.bin whose checksum matches (when index.json is lost
  or stale, every whole record; a torn tail is cut off).  A stale index.json
  (older than the files, hmem/formats/stamp.py) is rolled forward: the
  store is rebuilt from what its files hold, every intact entry kept with
  its id;
- of those, the live entries whose every tensor is found (through hmem_index
  or the JSON header of its shard) with a matching CRC-32C;
- the import registry (sources.jsonl) as committed, or its longest prefix
  of whole records when it is damaged or index.json no longer counts it.

Everything else is dropped and listed in the report.  The next entry id is
set past every id any record holds or any commit reserved.  A store that
verifies clean is left untouched; a store of a newer format is refused
before anything is touched.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from hmem import _io, file_reads
from hmem.config import StoreConfig
from hmem.errors import CorruptStoreError, HmemError, UnsafeFileError, UnsupportedFormatError
from hmem.formats import layout, manifest, records, shard_file, stamp
from hmem.formats import sources as source_registry
from hmem.formats.layout import ENTRIES_FILE
from hmem.formats.manifest import Manifest, Pending
from hmem.formats.records import EVICTED
from hmem.kernels import checksum as checksum_kernels
from hmem.recovery.verify import ERROR, Finding, config_from_shards, verify
from hmem.store import lock, rewrite
from hmem.store.projection import Projector

ID_MARGIN = 4096  # ids skipped after a rebuilt index, in case lost records held higher ones


@dataclasses.dataclass(frozen=True)
class RepairReport:
    path: str
    action: str  # "none", "tidied" (leftovers of an interrupted writer removed) or "rewritten"
    findings: tuple[Finding, ...]  # what verify found before
    rebuilt_index: bool
    entries_kept: int
    dropped: tuple[tuple[int | None, str], ...]  # (entry id if known, why)
    shards_after: int
    bytes_before: int
    bytes_after: int
    seconds: float
    rolled_forward: bool = False  # index.json was stale: the store now holds what its files hold

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def repair(path: str | Path, *, lock_wait: float = 0.0) -> RepairReport:
    """Repair the store directory at `path` (see the module docstring;
    hmem/recovery/checks.py adds stores on object storage)."""
    started = time.perf_counter()
    root = Path(path)
    if not root.is_dir():
        raise CorruptStoreError(f"{root} is not a directory", hint="give the store's directory")
    try:
        manifest.load(root)  # a newer hmem's store is never rewritten: refuse before touching anything
    except UnsupportedFormatError:
        raise
    except HmemError:
        pass  # damage: verify reports it below
    writer = lock.WriterLock(root, wait_seconds=lock_wait)
    try:
        rewrite.refuse_unsafe(root, layout.classify(root))  # the fixed files; verify finds linked shards
        before = layout.directory_bytes(root)
        report = verify(root, full=True)
        errors = tuple(f for f in report.findings if f.severity == ERROR)
        if not errors:
            # Only leftovers of an interrupted writer, if anything: finish
            # and tidy as a writer opening the store would.
            if report.problems:
                mf = manifest.load(root)
                rewrite.finish_pending(root, mf)
                rewrite.remove_leftovers(root, mf)
            return RepairReport(
                str(root),
                "tidied" if report.problems else "none",
                report.findings,
                False,
                report.records,
                (),
                report.shards,
                before,
                layout.directory_bytes(root),
                time.perf_counter() - started,
            )
        unsafe = sorted({f.file for f in errors if f.code == "file.unsafe"})
        if unsafe:  # nothing read or written through them: docs/security.md
            raise UnsafeFileError(
                f"{', '.join(unsafe)} in {root}: not a regular file (a symbolic link or the "
                "like); repair works on the store's own files only",
                hint="replace each with a copy of the file it stands for, or remove it",
            )
        stale = any(f.code == "index.stale" for f in errors)
        base, rebuilt = _base_manifest(root, stale)
        base.sources = _registry(root, base, rebuilt)
        kept, dropped, sources, sizes, highest = _salvage(root, base, rebuilt)
        _io.crash_point("repair.planned")
        # past every id ever seen or reserved: an id is never given twice
        found = stamp.read(root)
        base.next_entry_id = max(base.next_entry_id, highest + 1, found.next_entry_id if found else 0)
        if rebuilt:
            base.next_entry_id += ID_MARGIN
        deletes = layout.classify(root).orphans  # every shard and temporary file: the rewrite replaces them
        config_json = json.dumps(base.config.to_dict(), sort_keys=True)
        mf, _ = rewrite.rewrite(
            root, base, kept, sources, sizes, deletes, config_json=config_json, crash_prefix="repair"
        )
        return RepairReport(
            str(root),
            "rewritten",
            report.findings,
            rebuilt and not stale,
            len(kept),
            tuple(dropped),
            len(mf.shards),
            before,
            layout.directory_bytes(root),
            time.perf_counter() - started,
            rolled_forward=stale,
        )
    finally:
        writer.release()


def _base_manifest(root: Path, stale: bool) -> tuple[Manifest, bool]:
    """The manifest to rewrite over, and whether it is rebuilt from the
    files (index.json lost, or stale: older than the files, so neither its
    shard list nor its pending steps may be trusted)."""
    config = None
    try:
        mf = manifest.load(root)
        if not stale:
            rewrite.finish_pending(root, mf)  # what an interrupted writer left
            return dataclasses.replace(mf, pending=Pending()), False
        config = mf.config
        floor = mf.next_entry_id
    except (CorruptStoreError, HmemError):
        floor = 0
    config = config or config_from_shards(root)
    if config is None:
        raise CorruptStoreError(
            f"index.json of {root} is lost and no shard carries the store's config",
            hint="nothing can be rebuilt; restore index.json from a backup",
        )
    projection = Projector(config.embed_dim, config.hdc_dim, config.seed).describe()
    count = max(((layout.shard_index(name) or 0) + 1 for name in layout.shard_names(root)), default=0)
    infos = [
        manifest.ShardInfo(file=layout.shard_file(i), bytes=0, uid="", entries=0, index_crc=0) for i in range(count)
    ]
    return Manifest(config=config, projection=projection, shards=infos, next_entry_id=max(floor, 1)), True


def _registry(root: Path, base: Manifest, rebuilt: bool) -> source_registry.SourcesInfo:
    """The import registry to keep: as committed when intact; else (damaged,
    or index.json rebuilt and so counting none of it) its longest prefix of
    whole source records.  A source whose entries this repair drops stays
    listed: `hmem put --again` imports it anew."""
    if not rebuilt:
        try:
            source_registry.read(root, base.sources)
            return base.sources
        except CorruptStoreError:
            pass
    try:
        data = file_reads.read_regular(root / source_registry.SOURCES_FILE, source_registry.MAX_SOURCES_BYTES)
    except (FileNotFoundError, HmemError):
        return source_registry.SourcesInfo()
    _, kept = source_registry.whole_lines(data if rebuilt else data[: base.sources.bytes])
    # the next import appends past the kept lines, over whatever follows them
    return source_registry.appended(source_registry.SourcesInfo(), data[:kept])


def _salvage(root: Path, base: Manifest, rebuilt: bool):
    """The records to keep, why others go, and where the kept tensors lie."""
    config: StoreConfig = base.config
    size = layout.record_bytes(config)
    path = root / ENTRIES_FILE
    available = path.stat().st_size // size if path.exists() else 0
    count = available if rebuilt else min(available, base.record_count)
    loaded = _read_records(path, config, count) if count else records.empty(0, config)
    dropped: list[tuple[int | None, str]] = []
    if not rebuilt and available < base.record_count:
        dropped.append((None, f"{base.record_count - available} committed records are missing from entries.bin"))
    good = np.ones(len(loaded), dtype=bool)
    for pos in records.damaged(loaded):
        good[pos] = False
        dropped.append((None, f"record {int(pos)} of entries.bin fails its checksum"))
    # ids must increase: among the sound records, drop any id not above the
    # highest before it (a damaged record's id is not consulted)
    ids = loaded["entry_id"].astype(np.int64)
    highest = np.maximum.accumulate(np.where(good, ids, -1))
    for pos in np.flatnonzero(good[1:] & (ids[1:] <= highest[:-1])) + 1:
        good[pos] = False
        dropped.append((int(ids[pos]), f"record {int(pos)} repeats or reverses an earlier entry id"))
    live = good & (loaded["shard_idx"] != EVICTED)
    scans: dict[int, shard_file.ShardScan | None] = {}
    kinds = shard_file.kinds(config.storage_dtype)
    keep, sources, sizes = [], [], []
    for pos in np.flatnonzero(live).tolist():
        entry_id, shard_idx = int(loaded["entry_id"][pos]), int(loaded["shard_idx"][pos])
        if shard_idx not in scans:
            file = root / layout.shard_file(shard_idx)
            try:
                known = base.shards[shard_idx].index_crc if not rebuilt and shard_idx < len(base.shards) else None
                scans[shard_idx] = (
                    shard_file.scan_shard(
                        file,
                        embed_dim=config.embed_dim,
                        storage=config.storage_dtype,
                        index_crc=known,
                        pooled_keys=config.signatures_per_entry,
                    )
                    if file.exists()
                    else None
                )
            except (OSError, HmemError):  # unreadable, or not a regular file (docs/security.md)
                scans[shard_idx] = None
        found = _tensors_of(root, scans[shard_idx], shard_idx, entry_id, int(loaded["n_tokens"][pos]), config, kinds)
        if isinstance(found, str):
            dropped.append((entry_id, found))
            continue
        keep.append(pos)
        meta = _sound_meta(scans[shard_idx], entry_id)
        sources.append(lambda found=found, meta=meta: (found, meta))
        sizes.append(
            sum(part.length for _, _, part, _ in found.values())
            + (2 * len(meta) + 40 if meta else 0)
            + len(kinds) * shard_file.HEADER_BYTES_PER_TENSOR
            + shard_file.INDEX_ROW_BYTES
        )
    kept = loaded[np.array(keep, dtype=np.int64)]
    sound = np.setdiff1d(np.arange(len(ids)), records.damaged(loaded))
    top_id = int(ids[sound].max()) if len(sound) else 0  # the highest id any whole record holds
    return kept, dropped, sources, np.array(sizes, dtype=np.int64), top_id


def _sound_meta(scan: shard_file.ShardScan | None, entry_id: int) -> str | None:
    """An entry's metadata as its shard holds it, when it is a JSON object
    of a sane size (metadata carries no checksum: anything else is left out)."""
    text = scan.metadata.get(shard_file.META_PREFIX + str(entry_id)) if scan is not None else None
    if not isinstance(text, str) or len(text) > shard_file.META_MAX_BYTES:
        return None
    try:
        return text if isinstance(json.loads(text), dict) else None
    except (ValueError, RecursionError):  # "[[[[...": docs/security.md
        return None


def _read_records(path: Path, config: StoreConfig, count: int) -> np.ndarray:
    with open(_io.open_regular(path), "rb") as f:
        return np.fromfile(f, dtype=records.record_dtype(config), count=count)


def _tensors_of(
    root: Path,
    scan: shard_file.ShardScan | None,
    shard_idx: int,
    entry_id: int,
    n_tokens: int,
    config: StoreConfig,
    kinds: tuple[str, ...],
):
    """The entry's tensor sources, or why it cannot be kept."""
    if scan is None:
        return f"its shard {layout.shard_file(shard_idx)} is missing or unreadable"
    file = root / layout.shard_file(shard_idx)
    found = {}
    with open(_io.open_regular(file), "rb") as f:
        for kind in kinds:
            spec = scan.tensors.get((entry_id, kind))
            if spec is None:
                return f"tensor {kind}_{entry_id} is not in {file.name}"
            dtype, shape, start, end, crc = spec
            want = shard_file.tensor_layout(
                kind, n_tokens, config.embed_dim, config.storage_dtype, config.signatures_per_entry
            )
            if (dtype, tuple(shape)) != want or end > scan.size:
                return f"tensor {kind}_{entry_id} has the wrong dtype or shape"
            f.seek(start)
            if crc is None or checksum_kernels.crc32c(f.read(end - start)) != crc:
                return f"tensor {kind}_{entry_id} fails its checksum"
            found[kind] = (dtype, tuple(shape), _io.FileRange(file, start, end - start), crc)
    return found
