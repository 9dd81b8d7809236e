"""repair: salvage what can be saved of a damaged store.

Takes the write lock, runs a full verify, and when it finds errors rewrites
the store (hmem/store/rewrite.py) from what checks out
(docs/reliability.md, "What repair keeps"):

- the config from index.json, or, when index.json is lost, garbled or
  another store's (it names none of the shard files present), from the
  ``store_config`` every shard carries in its metadata;
- the records of entries.bin whose checksum matches (when index.json is lost
  or stale, every whole record; a torn tail is cut off), each held to its
  shard's tensors: a record whose signature is not that of its entry's
  pooled key belongs to other data (another store's entries.bin) and is not
  trusted.  A stale index.json (older than the files, hmem/formats/stamp.py)
  is rolled forward: the store is rebuilt from what its files hold, every
  intact entry kept with its id;
- every entry of the store's own shards whose keys and values pass their
  CRC-32C: with its record when one is trusted, else with a record rebuilt
  from the shard (id, tokens, signature and pooled key; layer and importance
  as the caller says, by default 0 and 1.0; the time of the shard file),
  unless a trusted record says it was evicted.  A lost or damaged pooled key
  ``p_i`` is taken from pooled.bin, or computed again from the keys;
- a shard that is not the store's own (its uid is not the one index.json
  records, or, without index.json, the store's records disagree with every
  entry of it) is moved whole to ``lost+found/`` and none of its entries is
  served;
- the import registry (sources.jsonl) as committed, or its longest prefix
  of whole records when it is damaged or index.json no longer counts it,
  less the files whose entries this repair could not keep (so that the next
  import of such a file stores it again).

Everything else is dropped and listed in the report.  ``dry_run`` plans
the same and writes nothing.  The next entry id is set past every id any
record holds or any commit reserved.  A store that verifies clean is left
untouched; a store of a newer format is refused before anything is touched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path

import numpy as np

from hmem import _io, file_reads, validation
from hmem.config import StoreConfig
from hmem.errors import CorruptStoreError, HmemError, UnsafeFileError, UnsupportedFormatError
from hmem.formats import manifest, pooled, records, shard_file, stamp, store_files
from hmem.formats import sources as source_registry
from hmem.formats.manifest import Manifest, Pending
from hmem.formats.records import EVICTED
from hmem.formats.store_files import ENTRIES_FILE
from hmem.kernels import checksum as checksum_kernels
from hmem.recovery.verify import ERROR, Finding, config_from_shards, signatures_agree, verify
from hmem.store import lock, rewrite, storage
from hmem.store.projection import Projector, SpanProjector

ID_MARGIN = 4096  # ids skipped after a rebuilt index, in case lost records held higher ones
LOST_FOUND = "lost+found"  # inside the store: shards repair will not serve and must not delete
# The pooled keys repair computes again from the keys, written beside the
# store's files for the rewrite to copy (a temporary file: removed after the
# commit, or by the next writer).
SCRATCH_FILE = store_files.REWRITE_PREFIX + "repair.pooled"
SOURCES_TEMP = store_files.REWRITE_PREFIX + source_registry.SOURCES_FILE


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
    dry_run: bool = False  # nothing was written: what a repair would do
    rebuilt_entries: tuple[int, ...] = ()  # kept with a record rebuilt from their shard (theirs was lost)
    # of those, entries whose damaged record still gave their layer, importance, time and access count
    salvaged_fields: tuple[int, ...] = ()
    rebuilt_layer: int = 0  # the layer and importance the other rebuilt records got
    rebuilt_importance: float = 1.0
    dropped_bytes: int = 0  # tensor bytes of the dropped entries whose size is known
    quarantined: tuple[tuple[str, str, int, int], ...] = ()  # (file under lost+found/, why, entries, bytes)
    sources_dropped: int = 0  # import registry lines dropped: their files' entries were not all kept
    notes: tuple[str, ...] = ()  # what else the operator should know

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def repair(
    path: str | Path,
    *,
    lock_wait: float = 0.0,
    dry_run: bool = False,
    rebuild_layer: int = 0,
    rebuild_importance: float = 1.0,
) -> RepairReport:
    """Repair the store directory at `path` (see the module docstring;
    hmem/recovery/checks.py adds stores on object storage).  Entries whose
    records are lost get `rebuild_layer` and `rebuild_importance`; with
    `dry_run`, nothing is written and the report says what would be done."""
    started = time.perf_counter()
    rebuild_layer = validation.layer_index(rebuild_layer, "rebuild_layer")
    rebuild_importance = validation.importance(rebuild_importance, "rebuild_importance")
    root = Path(validation.store_directory(path))  # "" and a file refused, as for every command
    if not root.is_dir():
        raise CorruptStoreError(f"{root} is not a directory", hint="give the store's directory")
    try:
        manifest.load(root)  # a newer hmem's store is never rewritten: refuse before touching anything
    except UnsupportedFormatError:
        raise
    except HmemError:
        pass  # damage: verify reports it below
    writer = None if dry_run else lock.WriterLock(root, wait_seconds=lock_wait)
    try:
        rewrite.refuse_unsafe(root, store_files.classify(root))  # the fixed files; verify finds linked shards
        before = store_files.directory_bytes(root)
        report = verify(root, full=True)
        errors = tuple(f for f in report.findings if f.severity == ERROR)
        if not errors:
            # Only leftovers of an interrupted writer, if anything: finish
            # and tidy as a writer opening the store would.
            if report.problems and not dry_run:
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
                before if dry_run else store_files.directory_bytes(root),
                time.perf_counter() - started,
                dry_run=dry_run,
            )
        unsafe = sorted({f.file for f in errors if f.code == "file.unsafe"})
        if unsafe:  # nothing read or written through them: docs/security.md
            raise UnsafeFileError(
                f"{', '.join(unsafe)} in {root}: not a regular file (a symbolic link or the "
                "like); repair works on the store's own files only",
                hint="replace each with a copy of the file it stands for, or remove it",
            )
        stale = any(f.code == "index.stale" for f in errors)
        base, rebuilt, notes = _base_manifest(root, stale, dry_run)
        sources, registry_data = _registry(root, base, rebuilt)
        base = dataclasses.replace(base, sources=sources)
        plan = _salvage(root, base, rebuilt, rebuild_layer, rebuild_importance)
        notes += plan.notes
        registry_kept, registry_dropped = _registry_kept(registry_data, plan)
        _io.crash_point("repair.planned")
        # past every id ever seen or reserved: an id is never given twice
        found = stamp.read(root)  # None when its numbers are past their bounds (crafted)
        next_id = max(base.next_entry_id, plan.highest + 1, found.next_entry_id if found else 0)
        if rebuilt:
            next_id += ID_MARGIN
        # held to the bound parse() holds index.json to: the kept ids lie below it (_salvage)
        base = dataclasses.replace(base, next_entry_id=min(next_id, manifest.MAX_COUNT))
        common = dict(
            dry_run=dry_run,
            rebuilt_entries=tuple(plan.rebuilt_ids),
            salvaged_fields=tuple(sorted(plan.salvaged)),
            rebuilt_layer=rebuild_layer,
            rebuilt_importance=rebuild_importance,
            dropped_bytes=plan.dropped_bytes,
            quarantined=tuple((f"{LOST_FOUND}/{q.target}", q.why, q.entries, q.size) for q in plan.quarantine),
            sources_dropped=registry_dropped,
            notes=tuple(notes),
            rolled_forward=stale,
        )
        if dry_run:  # what the rewrite below would make: shards and bytes of the kept entries
            shards_after = len(rewrite.pack(plan.sizes, base.config.shard_max_bytes))
            bytes_after = int(plan.sizes.sum()) + len(plan.kept) * (
                store_files.record_bytes(base.config) + pooled.row_bytes(base.config.pooled_width)
            )
        else:
            _quarantine(root, plan.quarantine)
            renames: list[tuple[str, str]] = []
            if registry_dropped:
                # the registry without the lines of files whose entries are gone
                _io.write_file(root / SOURCES_TEMP, [registry_kept])
                renames.append((SOURCES_TEMP, source_registry.SOURCES_FILE))
                base = dataclasses.replace(
                    base, sources=source_registry.appended(source_registry.SourcesInfo(), registry_kept)
                )
            if plan.scratch:
                _io.write_file(root / SCRATCH_FILE, [b"".join(plan.scratch)])
            # every shard and temporary file: the rewrite replaces them
            deletes = [name for name in store_files.classify(root).orphans if name not in {n for _, n in renames}]
            config_json = json.dumps(base.config.to_dict(), sort_keys=True)
            mf, _ = rewrite.rewrite(
                root,
                base,
                plan.kept,
                plan.sources,
                plan.sizes,
                deletes,
                config_json=config_json,
                crash_prefix="repair",
                more_renames=renames,
            )
            shards_after, bytes_after = len(mf.shards), store_files.directory_bytes(root)
        return RepairReport(
            str(root),
            "rewritten",
            report.findings,
            rebuilt and not stale,
            len(plan.kept),
            tuple(plan.dropped),
            shards_after,
            before,
            bytes_after,
            time.perf_counter() - started,
            **common,  # type: ignore[arg-type]
        )
    finally:
        if writer is not None:
            writer.release()


def _base_manifest(root: Path, stale: bool, dry_run: bool) -> tuple[Manifest, bool, list[str]]:
    """The manifest to rewrite over, whether it is rebuilt from the files
    (index.json lost, stale, so that neither its shard list nor its pending
    steps may be trusted, or another store's), and notes for the report."""
    config = None
    notes: list[str] = []
    try:
        mf = manifest.load(root)
        if not stale and _names_its_shards(root, mf):
            if not dry_run:
                rewrite.finish_pending(root, mf)  # what an interrupted writer left
            return dataclasses.replace(mf, pending=Pending()), False, notes
        if stale:
            config = mf.config
            floor = mf.next_entry_id
        else:
            floor = 0
            notes.append(
                "index.json names none of the shard files present (another store's index.json?): "
                "ignored, and the store rebuilt from its own files"
            )
    except (CorruptStoreError, HmemError):
        floor = 0
    config = config or config_from_shards(root)
    if config is None:
        raise CorruptStoreError(
            f"index.json of {root} is lost and no shard carries the store's config",
            hint="nothing can be rebuilt; restore index.json from a backup",
        )
    projection = Projector(config.embed_dim, config.hdc_dim, config.seed).describe()
    # no shard list: _salvage takes the shard files found (never a list sized by a name's number)
    return Manifest(config=config, projection=projection, next_entry_id=max(floor, 1)), True, notes


def _names_its_shards(root: Path, mf: Manifest) -> bool:
    """Whether index.json is this directory's: it names no shard, or at
    least one shard file present carries the uid it records (a store's
    shards are never all replaced at once; another store's index.json
    matches none of them)."""
    seen = False
    for info in mf.shards:
        path = store_files.resolve(root, info.file, mf.pending)
        try:
            uid = shard_file.uid_of(shard_file.shard_metadata(path))
        except (OSError, HmemError, ValueError):
            continue
        seen = True
        if uid == info.uid:
            return True
    return not seen


def _registry(root: Path, base: Manifest, rebuilt: bool) -> tuple[source_registry.SourcesInfo, bytes]:
    """The import registry to keep, and its bytes: as committed when intact;
    else (damaged, or index.json rebuilt and so counting none of it) its
    longest prefix of whole source records."""
    data = b""
    if not rebuilt:
        try:
            source_registry.read(root, base.sources)
            if base.sources.bytes:
                data = file_reads.read_regular(
                    root / source_registry.SOURCES_FILE, source_registry.MAX_SOURCES_BYTES * 2
                )
            return base.sources, data[: base.sources.bytes]
        except (HmemError, OSError):
            pass
    try:
        data = file_reads.read_regular(root / source_registry.SOURCES_FILE, source_registry.MAX_SOURCES_BYTES)
    except (FileNotFoundError, HmemError):
        return source_registry.SourcesInfo(), b""
    _, kept = source_registry.whole_lines(data if rebuilt else data[: base.sources.bytes])
    # the next import appends past the kept lines, over whatever follows them
    return source_registry.appended(source_registry.SourcesInfo(), data[:kept]), data[:kept]


def _registry_kept(data: bytes, plan: _Plan) -> tuple[bytes, int]:
    """The registry's lines whose every entry is kept or was evicted before
    (an import whose entries this repair lost must not be skipped by the
    next `hmem put`), and how many lines go."""
    lines, _ = source_registry.whole_lines(data)
    if not lines:
        return data, 0
    accounted = np.union1d(plan.kept["entry_id"].astype(np.int64), np.array(sorted(plan.evicted), dtype=np.int64))
    keep = []
    for line in lines:
        ids = np.arange(line.first_id, line.first_id + line.entries, dtype=np.int64)
        keep.append(bool(np.isin(ids, accounted).all()))
    if all(keep):
        return data, 0
    return source_registry.encode([line for line, k in zip(lines, keep) if k]), keep.count(False)


@dataclasses.dataclass
class _Quarantined:
    name: str  # the shard file in the store
    target: str  # its name under lost+found/
    why: str
    entries: int
    size: int


@dataclasses.dataclass
class _Plan:
    kept: np.ndarray  # the records to keep, in entry order
    sources: list  # per kept record: () -> (tensor sources, meta)
    sizes: np.ndarray  # per kept record: its bytes in a shard
    dropped: list[tuple[int | None, str]]
    dropped_bytes: int
    rebuilt_ids: list[int]
    salvaged: list[int]
    quarantine: list[_Quarantined]
    notes: list[str]
    highest: int  # the highest id any whole record or kept entry holds
    evicted: set[int]  # ids trusted records say were evicted
    scratch: list[bytes]  # pooled keys computed again (SCRATCH_FILE)


class _Salvage:
    """Reads the records, pooled.bin and every shard, and decides what of
    each shard is kept (hmem/recovery/repair.py's docstring)."""

    def __init__(self, root: Path, base: Manifest, rebuilt: bool) -> None:
        self.root, self.base, self.rebuilt = root, base, rebuilt
        self.config: StoreConfig = base.config
        self.kinds = shard_file.kinds(self.config.storage_dtype)
        self.projector = Projector(self.config.embed_dim, self.config.hdc_dim, self.config.seed)
        self.scratch: list[bytes] = []
        self.scratch_keys: dict[int, bytes] = {}  # offset in SCRATCH_FILE -> the key written there
        self.scratch_at = 0
        self.keys_from_pooled: list[int] = []  # entries whose lost pooled key came from pooled.bin
        self.keys_computed: list[int] = []  # ... or was computed again from their keys
        self.pooled_rows = self._pooled_rows()

    def _pooled_rows(self) -> dict[int, int]:
        """entry id -> its row of pooled.bin, for rows that pass their checksum."""
        dtype = pooled.row_dtype(self.config.pooled_width)
        try:
            with open(_io.open_regular(self.root / pooled.POOLED_FILE), "rb") as f:
                # as many rows as its data holds: a sparse pooled.bin claims any size for free
                rows = np.fromfile(f, dtype=dtype, count=file_reads.data_bytes(f.fileno()) // dtype.itemsize)
        except (OSError, ValueError):
            return {}
        good = np.flatnonzero(pooled.usable(rows, rows["entry_id"]))
        return {int(rows["entry_id"][i]): int(i) for i in good[::-1]}

    def scan(self, idx: int) -> shard_file.ShardScan | None:
        info = self.base.shards[idx] if idx < len(self.base.shards) else None
        file = self.path(idx)
        if not file.exists():
            return None
        try:
            return shard_file.scan_shard(
                file,
                embed_dim=self.config.embed_dim,
                storage=self.config.storage_dtype,
                index_crc=info.index_crc if info is not None and not self.rebuilt else None,
                pooled_keys=self.config.signatures_per_entry,
            )
        except (OSError, HmemError):  # unreadable, or not a regular file (docs/security.md)
            return None

    def path(self, idx: int) -> Path:
        return self.root / store_files.shard_file(idx)

    def tensors(self, scan: shard_file.ShardScan, idx: int, entry_id: int, n_tokens: int | None):
        """The entry's tensor sources (each checked against its CRC-32C; a
        lost pooled key found again), or why it cannot be kept."""
        file = self.path(idx)
        config = self.config
        if n_tokens is None:  # no record: the keys' shape says
            spec = scan.tensors.get((entry_id, "k"))
            if spec is None or len(spec[1]) != 2 or spec[1][0] < 1:
                return f"tensor k_{entry_id} is not in {file.name}"
            n_tokens = int(spec[1][0])
        found = {}
        why_p = None
        with open(_io.open_regular(file), "rb") as f:
            for kind in self.kinds:
                spec = scan.tensors.get((entry_id, kind))
                problem = None
                if spec is None:
                    problem = f"tensor {kind}_{entry_id} is not in {file.name}"
                else:
                    dtype, shape, start, end, crc = spec
                    want = shard_file.tensor_spec(
                        kind, n_tokens, config.embed_dim, config.storage_dtype, config.signatures_per_entry
                    )
                    if (dtype, tuple(shape)) != want:
                        problem = f"tensor {kind}_{entry_id} has the wrong dtype or shape"
                    elif end > scan.size:
                        problem = f"tensor {kind}_{entry_id} lies past the end of {file.name} (cut short)"
                    else:
                        f.seek(start)
                        if crc is None or checksum_kernels.crc32c(f.read(end - start)) != crc:
                            problem = f"tensor {kind}_{entry_id} fails its checksum"
                        else:
                            found[kind] = (dtype, tuple(shape), _io.FileRange(file, start, end - start), crc)
                if problem is None:
                    continue
                if kind != "p":
                    return problem
                why_p = problem
        if why_p is not None:
            found["p"] = self._pooled_key(entry_id, n_tokens, found)
        return found

    def _pooled_key(self, entry_id: int, n_tokens: int, found: dict) -> tuple:
        """A pooled key in place of a lost p tensor: its copy in pooled.bin
        (bit-exact, checked), else the mean of the keys computed again as a
        put computes it (bit-exact in an f32 store; from the stored rows in
        a narrower one)."""
        width = self.config.pooled_width
        dtype, shape = shard_file.tensor_spec(
            "p", n_tokens, self.config.embed_dim, self.config.storage_dtype, self.config.signatures_per_entry
        )
        rows = self.rows(found, n_tokens)
        signature, mean = self.projector.signature_and_mean(rows)
        row = self.pooled_rows.get(entry_id)
        if row is not None:
            where = _io.FileRange(
                self.root / pooled.POOLED_FILE, row * pooled.row_bytes(width) + pooled.HEADER_BYTES, 4 * width
            )
            data = _io.read_ranges([where])
            copy = (dtype, shape, where, checksum_kernels.crc32c(data))
            if self._close(signature, self.projector.signature_of_sum(self._first_key(data))):
                self.keys_from_pooled.append(entry_id)
                return copy  # the row is this entry's key (not another store's pooled.bin)
        self.keys_computed.append(entry_id)
        keys = [mean[None, :]]
        if self.config.spans:
            span_projector = SpanProjector(
                self.config.embed_dim,
                self.config.span_signature_bytes * 8,
                self.config.seed,
                self.config.spans,
                self.config.span_layout,
            )
            keys.append(span_projector.signatures_and_means(rows, np.array([0, n_tokens]))[1][0])
        data = np.concatenate(keys).astype("<f4").tobytes()
        where = _io.FileRange(self.root / SCRATCH_FILE, self.scratch_at, len(data))
        self.scratch.append(data)
        self.scratch_keys[self.scratch_at] = data
        self.scratch_at += len(data)
        return dtype, shape, where, checksum_kernels.crc32c(data)

    def _first_key(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype="<f4", count=self.config.embed_dim).astype(np.float64)

    def _close(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Whether two signatures are of the same rows (verify.SIGNATURE_TOLERANCE)."""
        return signatures_agree(a, b, self.config.hdc_dim)

    def rows(self, found: dict, n_tokens: int) -> np.ndarray:
        """The entry's keys as float32 rows, decoded from the shard."""
        dtype, shape, where, _ = found["k"]
        stored = np.frombuffer(_io.read_ranges([where]), dtype=dtype).reshape(shape)
        scales = None
        if "ks" in found:
            scales = np.frombuffer(_io.read_ranges([found["ks"][2]]), dtype="<f4")
        return np.ascontiguousarray(storage.decode(stored, scales, self.config.storage_dtype), dtype=np.float32)

    def pooled_key(self, found: dict) -> np.ndarray:
        """The entry's pooled key (the mean of its keys) in float64."""
        where = found["p"][2]
        if where.path.name == SCRATCH_FILE:  # computed by this repair, not written yet
            return self._first_key(self.scratch_keys[where.offset])
        return self._first_key(_io.read_ranges([where]))

    def agrees(self, record: np.void, found: dict) -> bool:
        """Whether the record's signature is that of the entry's pooled key
        (verify.SIGNATURE_TOLERANCE): the record describes these tensors."""
        return self._close(self.projector.signature_of_sum(self.pooled_key(found)), record["signature"])

    def new_record(self, entry_id: int, found: dict, idx: int, layer: int, importance: float) -> np.ndarray:
        """A record for an entry whose own is lost, from its shard."""
        record = records.empty(1, self.config)
        n_tokens = found["k"][1][0]
        record["entry_id"] = entry_id
        record["layer_idx"] = layer
        record["n_tokens"] = n_tokens
        record["importance"] = importance
        record["timestamp"] = os.stat(self.path(idx)).st_mtime_ns  # the put was no later than its shard
        record["shard_idx"] = idx
        if self.config.storage_dtype == "f32" or self.config.spans:
            rows = self.rows(found, n_tokens)
        if self.config.storage_dtype == "f32":
            record["signature"][0] = self.projector.signature(rows)  # as the put made it, bit for bit
        else:  # the stored rows are rounded: the pooled key is the mean of the rows the put was given
            record["signature"][0] = self.projector.signature_of_sum(self.pooled_key(found))
        if self.config.spans:
            span_projector = SpanProjector(
                self.config.embed_dim,
                self.config.span_signature_bytes * 8,
                self.config.seed,
                self.config.spans,
                self.config.span_layout,
            )
            record["spans"][0] = span_projector.signatures_and_means(rows, np.array([0, n_tokens]))[0][0]
        return record


def _salvage(root: Path, base: Manifest, rebuilt: bool, layer: int, importance: float) -> _Plan:
    """The records to keep, why others go, and where the kept tensors lie."""
    config: StoreConfig = base.config
    size = store_files.record_bytes(config)
    path = root / ENTRIES_FILE
    available = path.stat().st_size // size if path.exists() else 0
    # records in holes are not there: a sparse entries.bin claims any count for free (docs/security.md)
    available = records.present_count(path, available, config) if available else 0
    count = available if rebuilt else min(available, base.record_count)
    loaded = _read_records(path, config, count) if count else records.empty(0, config)
    dropped: list[tuple[int | None, str]] = []
    notes: list[str] = []
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
    evicted = set(ids[good & (loaded["shard_idx"] == EVICTED)].tolist())
    # records that fail their checksum, by the id they claim (checked below against the shard)
    damaged_at = {int(ids[pos]): int(pos) for pos in records.damaged(loaded)}
    layers_in_use = set(loaded["layer_idx"][good].tolist())
    recorded = {int(ids[pos]): int(pos) for pos in np.flatnonzero(good & (loaded["shard_idx"] != EVICTED))}
    salvage = _Salvage(root, base, rebuilt)
    kinds = salvage.kinds
    # every shard of the commit (without a trusted index.json: every shard file)
    # without a trusted index.json: the shard files found, by the numbers their names carry; sized by
    # the files really there, never by the highest number a name claims (docs/security.md)
    shard_ids = (
        sorted({i for name in store_files.shard_names(root) if (i := store_files.shard_index(name)) is not None})
        if rebuilt
        else range(len(base.shards))
    )
    scans = {idx: salvage.scan(idx) for idx in shard_ids}
    by_shard: dict[int, list[int]] = {}
    for entry_id, pos in recorded.items():
        by_shard.setdefault(int(loaded["shard_idx"][pos]), []).append(entry_id)
    keep: dict[int, tuple[np.ndarray, dict, str | None]] = {}  # entry id -> (record, tensors, meta)
    rebuilt_ids: list[int] = []
    salvaged: list[int] = []  # of those, the ones whose layer etc. come from their damaged record
    quarantine: list[_Quarantined] = []
    dropped_bytes = 0

    def entry_bytes(n_tokens: int) -> int:
        return int(
            shard_file.entry_bytes(n_tokens, config.embed_dim, config.storage_dtype, config.signatures_per_entry)
        )

    # each shard's entries checked against their records first: whether the
    # records describe any shard at all tells another store's entries.bin
    # from another store's shard
    checks: dict[int, tuple[dict, set[int], set[int]]] = {}
    for idx in shard_ids:
        scan = scans[idx]
        if scan is None:
            continue
        checked = {
            entry_id: salvage.tensors(scan, idx, entry_id, int(loaded["n_tokens"][recorded[entry_id]]))
            for entry_id in sorted(by_shard.get(idx, []))
        }
        agree = {
            e
            for e, found in checked.items()
            if not isinstance(found, str) and salvage.agrees(loaded[recorded[e]], found)
        }
        checks[idx] = (checked, agree, {e for e, found in checked.items() if not isinstance(found, str)} - agree)
    records_describe_a_shard = any(agree for _, agree, _ in checks.values())
    for idx in shard_ids:
        scan = scans[idx]
        mine = sorted(by_shard.get(idx, []))
        name = store_files.shard_file(idx)
        if scan is None:
            for entry_id in mine:
                dropped.append((entry_id, f"its shard {name} is missing or unreadable"))
                dropped_bytes += entry_bytes(int(loaded["n_tokens"][recorded[entry_id]]))
            continue
        in_shard = sorted({entry_id for entry_id, _ in scan.tensors})
        checked, agree, disagree = checks[idx]
        info = base.shards[idx] if not rebuilt else None
        if info is None:  # no uid to go by: the records that describe other shards disagree with all of this one
            ours = not (disagree and not agree and records_describe_a_shard)
            why_foreign = f"the store's records disagree with every entry of {name}"
        else:
            ours = scan.index is not None or scan.uid == info.uid
            why_foreign = f"{name} is not the shard index.json names (uid {scan.uid!s})"
        if not ours:
            if in_shard or scan.metadata:
                uid = str(scan.uid or uuid.uuid4().hex)
                quarantine.append(
                    _Quarantined(
                        name, f"{name}.{uid[:32]}", why_foreign + ": another store's shard?", len(in_shard), scan.size
                    )
                )
            for entry_id in mine:
                dropped.append((entry_id, f"its shard {name} belongs to other data ({LOST_FOUND}/)"))
                dropped_bytes += entry_bytes(int(loaded["n_tokens"][recorded[entry_id]]))
            continue
        for entry_id, found in checked.items():
            if isinstance(found, str):
                dropped.append((entry_id, found))
                dropped_bytes += entry_bytes(int(loaded["n_tokens"][recorded[entry_id]]))
            elif entry_id in agree:
                keep[entry_id] = (loaded[recorded[entry_id]].copy(), found, _sound_meta(scan, entry_id))
        # entries of this shard without a trusted record: rebuilt from the shard
        # (a record that disagrees with its tensors is another store's, or damaged)
        orphans = [e for e in in_shard if e not in keep and e not in evicted and (e not in recorded or e in disagree)]
        if disagree:
            notes.append(
                f"{len(disagree)} records of entries.bin disagree with their tensors in {name} "
                "(another store's entries.bin?): those entries are rebuilt from the shard"
            )
        candidates = {}
        for entry_id in orphans:
            found = salvage.tensors(scan, idx, entry_id, None)
            if not isinstance(found, str):  # else not an entry of which anything can be kept
                candidates[entry_id] = found
        # evicted entries whose records are lost: the commit counts the shard's
        # dead entries, the sound records name some of them; the rest are
        # among the candidates
        unaccounted = 0 if info is None else max(0, info.dead_entries - sum(e in evicted for e in in_shard))
        if candidates and unaccounted >= len(candidates):
            notes.append(
                f"{name}: {len(candidates)} entries whose records are lost are left out: the store counts "
                f"{unaccounted} evicted or deleted entries there that no record names"
            )
            candidates = {}
        for entry_id, found in candidates.items():
            record = salvage.new_record(entry_id, found, idx, layer, importance)
            pos = damaged_at.get(entry_id)
            if pos is not None and _describes(loaded[pos], record[0], layers_in_use, config.hdc_dim):
                # the damaged record's checkable fields agree with the shard: keep its others
                for field in ("layer_idx", "importance", "timestamp", "access_count"):
                    record[field] = loaded[field][pos]
                salvaged.append(entry_id)
            keep[entry_id] = (record[0], found, _sound_meta(scan, entry_id))
            rebuilt_ids.append(entry_id)
        if candidates and unaccounted:
            notes.append(
                f"{name}: up to {unaccounted} of its {len(candidates)} rebuilt entries had been evicted or "
                "deleted (their records are lost): check with 'hmem ls' and remove them again"
            )
    if salvaged:
        shown = ", ".join(map(str, salvaged[:10])) + (", ..." if len(salvaged) > 10 else "")
        notes.append(
            f"{len(salvaged)} rebuilt entries ({shown}) keep the layer, importance, time and access count of "
            "their record, which fails its checksum but whose id, tokens, shard and signature agree with the "
            "shard (unverified)"
        )
    for ids_, where in (
        (salvage.keys_from_pooled, "taken from pooled.bin"),
        (salvage.keys_computed, "computed again from their keys"),
    ):
        if ids_:
            shown = ", ".join(map(str, sorted(set(ids_))[:10])) + (", ..." if len(set(ids_)) > 10 else "")
            notes.append(f"the pooled keys of {len(set(ids_))} entries ({shown}) were lost: {where}")
    if rebuilt and rebuilt_ids:
        notes.append(
            f"{len(rebuilt_ids)} entries rebuilt without index.json: any of them evicted or deleted before "
            "(their records are lost) is back; check with 'hmem ls' and remove them again"
        )
    for entry_id, pos in recorded.items():
        if int(loaded["shard_idx"][pos]) not in scans:
            dropped.append((entry_id, f"its shard {store_files.shard_file(int(loaded['shard_idx'][pos]))} is missing"))
            dropped_bytes += entry_bytes(int(loaded["n_tokens"][pos]))
    for entry_id in [e for e in keep if not 0 <= e < manifest.MAX_COUNT]:
        # an id no next_entry_id can lie above (crafted): the store would be refused
        del keep[entry_id]
        dropped.append((entry_id, f"its entry id is not below {manifest.MAX_COUNT}"))
    order = sorted(keep)
    kept = records.empty(len(order), config)
    sources, sizes = [], []
    for i, entry_id in enumerate(order):
        record, found, meta = keep[entry_id]
        kept[i] = record
        sources.append(lambda found=found, meta=meta: (found, meta))
        sizes.append(shard_file.file_bytes_of(sum(part.length for _, _, part, _ in found.values()), len(kinds), meta))
    sound = np.setdiff1d(np.arange(len(ids)), records.damaged(loaded))
    top_id = max(int(ids[sound].max()) if len(sound) else 0, order[-1] if order else 0)
    return _Plan(
        kept,
        sources,
        np.array(sizes, dtype=np.int64),
        dropped,
        dropped_bytes,
        sorted(rebuilt_ids),
        salvaged,
        quarantine,
        notes,
        top_id,
        evicted,
        salvage.scratch,
    )


def _describes(damaged: np.void, rebuilt: np.void, layers_in_use: set[int], hdc_dim: int) -> bool:
    """Whether a record that fails its checksum still describes the entry
    rebuilt from its shard: its id, tokens and shard are the shard's, its
    signature is near the one computed again, its layer is one the sound
    records use and its importance is a valid one.  Its fields no shard
    holds are then kept (the damage lies elsewhere, or in them: unverified)."""
    importance = float(damaged["importance"])
    return (
        int(damaged["n_tokens"]) == int(rebuilt["n_tokens"])
        and int(damaged["shard_idx"]) == int(rebuilt["shard_idx"])
        and signatures_agree(damaged["signature"], rebuilt["signature"], hdc_dim)
        and int(damaged["layer_idx"]) in layers_in_use
        and np.isfinite(importance)
        and importance >= 0
    )


def _quarantine(root: Path, moves: list[_Quarantined]) -> None:
    """Move shards that are not the store's own under lost+found/, whole:
    before the commit, whose new shards may take their names."""
    if not moves:
        return
    target = root / LOST_FOUND
    _io.make_dir(target)
    for q in moves:
        _io.rename(root / q.name, target / q.target)
    _io.fsync_dir(root)


def _sound_meta(scan: shard_file.ShardScan | None, entry_id: int) -> str | None:
    """An entry's metadata as its shard holds it, when it is a JSON object
    of a sane size (metadata carries no checksum: anything else is left out)."""
    text = scan.meta(entry_id) if scan is not None else None
    if not isinstance(text, str) or len(text) > shard_file.META_MAX_BYTES:
        return None
    try:
        return text if isinstance(json.loads(text), dict) else None
    except (ValueError, RecursionError):  # "[[[[...": docs/security.md
        return None


def _read_records(path: Path, config: StoreConfig, count: int) -> np.ndarray:
    with open(_io.open_regular(path), "rb") as f:
        return np.fromfile(f, dtype=records.record_dtype(config), count=count)
