"""verify: check a store's files against each other and against their checksums.

Works on the files directly (no lock, nothing written), so it also examines
a store that will not open.  Every problem becomes a Finding with a stable
code (docs/reliability.md lists them), a severity, the file concerned and
what was expected.

- quick (default): index.json, every record of entries.bin (checksums,
  order, shard references), every shard's size, header and hmem_index, and
  the files of the directory;
- full: also every tensor of every live entry against its CRC-32C, and its
  shape against the record; ``subset=(k, n)`` limits that to the shards
  whose index is k - 1 modulo n (a cron job checks 1/7 a night), and
  ``max_seconds`` stops it early (reported).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import time
from pathlib import Path

import numpy as np

from hmem import _io, validation
from hmem.config import StoreConfig
from hmem.errors import CorruptStoreError, HmemError, InvalidArgumentError, NotAStoreError, UnsupportedFormatError
from hmem.formats import manifest, pooled, records, shard_file, stamp, store_files
from hmem.formats import sources as source_registry
from hmem.formats.records import EVICTED
from hmem.formats.store_files import ENTRIES_FILE
from hmem.kernels import checksum as checksum_kernels
from hmem.store import lock
from hmem.store.projection import Projector

ERROR, WARNING, INFO = "error", "warning", "info"
# A record describes its tensors when its signature is within 1/this of the
# bits of the signature of the entry's pooled key: both come from the rows
# the put was given (their float64 sum, their float32 mean) and differ in a
# few bits at most; unrelated data (another store's entries.bin) differs in
# half of them.
SIGNATURE_TOLERANCE = 8


def signatures_agree(a: np.ndarray, b: np.ndarray, hdc_dim: int) -> bool:
    """Whether two packed signatures are of the same rows (SIGNATURE_TOLERANCE)."""
    differ = int(np.unpackbits(np.bitwise_xor(a, b)).sum())
    return differ * SIGNATURE_TOLERANCE <= hdc_dim


@dataclasses.dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    file: str
    message: str
    expected: str | None = None
    entry_id: int | None = None


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    path: str
    full: bool
    findings: tuple[Finding, ...]
    records: int
    shards: int
    tensors_checked: int
    bytes_checked: int
    complete: bool  # False when max_seconds stopped the full check
    seconds: float
    subset: tuple[int, int] | None = None  # (k, n): the full check covered only the shards numbered k - 1 mod n

    @property
    def problems(self) -> tuple[Finding, ...]:
        """Findings that need attention (errors and warnings)."""
        return tuple(f for f in self.findings if f.severity != INFO)

    @property
    def ok(self) -> bool:
        """No problem found, and everything asked for was checked."""
        return not self.problems and self.complete

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["subset"] = f"{self.subset[0]}/{self.subset[1]}" if self.subset else None  # as --subset takes it
        out["ok"] = self.ok
        return out


class _Collector:
    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def add(
        self,
        code: str,
        severity: str,
        file: str,
        message: str,
        expected: str | None = None,
        entry_id: int | None = None,
    ) -> None:
        self.findings.append(Finding(code, severity, file, message, expected, entry_id))


def _kinds(config: StoreConfig) -> tuple[str, ...]:
    return shard_file.kinds(config.storage_dtype)


def verify(
    path: str | Path,
    *,
    full: bool = False,
    subset: tuple[int, int] | None = None,
    max_seconds: float | None = None,
    fetched_heads: bool = False,
) -> VerifyReport:
    """Check the store directory at `path`; see the module docstring.
    `fetched_heads`: the working copy of a store on object storage whose
    shards hold only their fetched heads (holes elsewhere, by design: not
    reported as sparse shards)
    (hmem/recovery/checks.py adds stores on object storage)."""
    started = time.perf_counter()
    root = Path(validation.store_directory(path))  # "" and a file refused, as for every command
    if (
        not root.is_dir()
        or not any((root / name).exists() for name in (store_files.INDEX_FILE, ENTRIES_FILE))
        and not store_files.shard_names(root)
    ):
        raise NotAStoreError(f"{root} holds no hmem store", hint="check the path")
    if not full and (subset is not None or max_seconds is not None):
        raise InvalidArgumentError("subset and max_seconds bound the full check: give them with full=True")
    if max_seconds is not None:
        max_seconds = validation.number(max_seconds, "max_seconds", low=0.0)
    if subset is not None:
        k, n = subset
        n = validation.integer(n, "subset n", low=1)
        k = validation.integer(k, "subset k", low=1, high=n)
        subset = (k, n)
    for _ in range(_CHANGE_RETRIES):
        # a commit made while the files were read makes them disagree for
        # no fault of theirs: such a check is made again
        before = _index_bytes(root)
        checked = _check_all(root, full, subset, max_seconds, started, fetched_heads)
        if _index_bytes(root) == before:
            break
    else:
        # A store that commits all the time (several writers, an LMCache
        # tier): what a commit made while the files were read is no problem.
        out = checked[0]
        out.findings = [
            dataclasses.replace(f, severity=INFO, message=f"{f.message}; made by a commit while verify ran")
            if f.code in _COMMIT_TRACES and f.severity == WARNING
            else f
            for f in out.findings
        ]
        out.add(
            "store.changing",
            INFO,
            store_files.INDEX_FILE,
            f"the store committed during each of {_CHANGE_RETRIES} checks: files newer than the commit checked "
            "are reported as info",
        )
    out, loaded, scans, tensors, nbytes, complete = checked
    return VerifyReport(
        str(root),
        full,
        tuple(out.findings),
        len(loaded),
        len(scans),
        tensors,
        nbytes,
        complete,
        time.perf_counter() - started,
        subset if full else None,
    )


_CHANGE_RETRIES = 3  # checks made before a store that keeps committing is reported as such
# what a commit made while a check read the files leaves, seen from the commit before it
_COMMIT_TRACES = frozenset({"file.orphan", "file.temp", "entries.tail"})


def _index_bytes(root: Path) -> bytes | None:
    try:
        return manifest.read_bytes(root)
    except HmemError:
        return None


def _check_all(
    root: Path,
    full: bool,
    subset: tuple[int, int] | None,
    max_seconds: float | None,
    started: float,
    fetched_heads: bool,
) -> tuple[_Collector, np.ndarray, dict[int, shard_file.ShardScan], int, int, bool]:
    """Every check of one pass over the store's files."""
    out = _Collector()
    mf = _check_index(root, out)
    files = store_files.classify(root, mf.shards if mf else (), mf.pending if mf else None)
    for name in files.unsafe:  # never read: docs/security.md
        out.add(
            "file.unsafe",
            ERROR,
            name,
            "a symbolic link or not a regular file in place of a store file: hmem reads and writes nothing through it",
            "a regular file",
        )
    at_work = lock.writer_at_work(root)
    loaded = np.zeros(0)
    scans: dict[int, shard_file.ShardScan] = {}
    tensors = nbytes = 0
    complete = True
    if mf is not None:
        evidence = stamp.stale_evidence(root, mf)
        if evidence is not None:
            out.add("index.stale", ERROR, store_files.INDEX_FILE, evidence, "an index.json as new as the store's files")
        loaded = _check_records(root, mf, out, stale=evidence is not None, at_work=at_work)
        _check_sources(root, mf, out)
        _check_pooled(root, mf, loaded, out)
        scans = _check_shards(root, mf, loaded, out, fetched_heads=fetched_heads)
        _check_directory(root, mf, out, stale=evidence is not None, at_work=at_work)
        if full:
            tensors, nbytes, complete = _check_tensors(root, mf, loaded, scans, out, subset, max_seconds, started)
            if not complete:
                out.add("verify.incomplete", INFO, "", f"the full check stopped after {max_seconds} s")
    return out, loaded, scans, tensors, nbytes, complete


def _check_index(root: Path, out: _Collector) -> manifest.Manifest | None:
    name = store_files.INDEX_FILE
    try:
        mf = manifest.load(root)
    except NotAStoreError as exc:
        out.add("index.missing", ERROR, name, exc.message, "an hmem index.json")
        return None
    except CorruptStoreError as exc:
        code = "index.checksum" if "checksum" in exc.message else "index.unreadable"
        out.add(code, ERROR, name, exc.message)
        return None
    except UnsupportedFormatError:
        raise  # a newer hmem's store: nothing here can judge it (docs/reliability.md)
    except HmemError as exc:
        out.add("index.format", ERROR, name, exc.message, f"format version {manifest.FORMAT_VERSION}")
        return None
    if mf.pending:
        out.add("index.pending", INFO, name, "the last commit has unfinished steps; the next writer finishes them")
    return mf


def _check_sources(root: Path, mf: manifest.Manifest, out: _Collector) -> None:
    """The import registry: the committed part as index.json counts it."""
    name = source_registry.SOURCES_FILE
    if not mf.sources.bytes or _unsafe(root / name):
        return
    if any(dst == name for _, dst in mf.pending.renames):
        return  # a repair committed a new registry: the next writer renames it into place
    try:
        source_registry.read(root, mf.sources)
    except CorruptStoreError as exc:
        out.add("sources.damaged", ERROR, name, exc.message, f"{mf.sources.bytes} committed bytes of source records")


def _check_pooled(root: Path, mf: manifest.Manifest, loaded: np.ndarray, out: _Collector) -> None:
    """pooled.bin repeats what the shards hold (hmem/formats/pooled.py): a
    live record without a usable row there costs speed, not data."""
    if not len(loaded):
        return
    # records that fail their own checksum are reported as such, their ids untrusted
    live = np.flatnonzero((loaded["shard_idx"] != EVICTED) & (records.checksums(loaded) == loaded["checksum"]))
    if not len(live) or _unsafe(root / pooled.POOLED_FILE):
        return
    dtype = pooled.row_dtype(mf.config.pooled_width)
    try:
        with open(_io.open_regular(root / pooled.POOLED_FILE), "rb") as f:
            rows = np.fromfile(f, dtype=dtype, count=len(loaded))
    except FileNotFoundError:
        rows = np.zeros(0, dtype=dtype)
    except OSError as exc:
        out.add(
            "pooled.partial",
            INFO,
            pooled.POOLED_FILE,
            f"unreadable ({exc.strerror or exc}): re-rank reads every pooled key from the shards",
        )
        return
    inside = live[live < len(rows)]
    usable = int(pooled.usable(rows[inside], loaded["entry_id"][inside]).sum())
    if usable < len(live):
        out.add(
            "pooled.partial",
            INFO,
            pooled.POOLED_FILE,
            f"{len(live) - usable} of {len(live)} live entries have no usable row: re-rank reads their pooled "
            "keys from the shards (slower); compaction or repair writes the file anew",
            "a row per live entry",
        )


def _check_records(
    root: Path, mf: manifest.Manifest, out: _Collector, *, stale: bool, at_work: int | None
) -> np.ndarray:
    path = store_files.resolve(root, ENTRIES_FILE, mf.pending)
    size = store_files.record_bytes(mf.config)
    committed = mf.record_count * size
    if _unsafe(path):
        return records.empty(0, mf.config)  # file.unsafe
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        out.add("entries.missing", ERROR, ENTRIES_FILE, "entries.bin is missing", f"{mf.record_count} records")
        return records.empty(0, mf.config)
    if actual < committed:
        out.add(
            "entries.truncated",
            ERROR,
            ENTRIES_FILE,
            f"holds {actual // size} whole records of {mf.record_count} committed",
            f"{committed} bytes",
        )
    elif actual > committed:
        why = (
            "newer records the stale index.json does not name; repair keeps them"
            if stale
            else "an interrupted flush; a writer removes them"
        )
        severity = WARNING
        if at_work is not None and not stale:
            why, severity = f"a flush of the writer at work, pid {at_work}", INFO
        past = f"{actual - committed} bytes past the committed records ({why})"
        out.add("entries.tail", severity, ENTRIES_FILE, past)
    count = min(actual // size, mf.record_count)
    # only records in data really present are read: a sparse file's holes cost nothing to claim
    present = records.present_count(path, count, mf.config)
    if present < count:
        out.add(
            "entries.sparse",
            ERROR,
            ENTRIES_FILE,
            f"has holes where committed records must be: {present} of {count} records' bytes are data",
            f"{count * size} bytes of data",
        )
        count = present
    with open(_io.open_regular(path), "rb") as f:
        loaded = np.fromfile(f, dtype=records.record_dtype(mf.config), count=count)
    records.apply_updates(loaded, mf.pending.record_updates)
    for pos in records.damaged(loaded):
        out.add(
            "record.checksum",
            ERROR,
            ENTRIES_FILE,
            f"record {int(pos)} fails its checksum",
            entry_id=int(loaded["entry_id"][pos]),
        )
    ids = loaded["entry_id"][np.setdiff1d(np.arange(len(loaded)), records.damaged(loaded))]
    if len(ids) > 1 and not np.all(np.diff(ids.astype(np.int64)) > 0):
        out.add("record.order", ERROR, ENTRIES_FILE, "entry ids are not strictly increasing")
    if len(ids) and int(ids.max()) >= mf.next_entry_id:
        out.add(
            "record.id", ERROR, ENTRIES_FILE, f"entry id {int(ids.max())} is not below next_entry_id {mf.next_entry_id}"
        )
    bad_shard = (loaded["shard_idx"] != EVICTED) & (loaded["shard_idx"] >= len(mf.shards))
    bad_shard[records.damaged(loaded)] = False
    for pos in np.flatnonzero(bad_shard):
        out.add(
            "record.shard",
            ERROR,
            ENTRIES_FILE,
            f"record {int(pos)} names shard {int(loaded['shard_idx'][pos])}, which the store does not have",
            entry_id=int(loaded["entry_id"][pos]),
        )
    return loaded


def _check_shards(
    root: Path, mf: manifest.Manifest, loaded: np.ndarray, out: _Collector, *, fetched_heads: bool = False
) -> dict[int, shard_file.ShardScan]:
    scans = {}
    live = loaded["shard_idx"] != EVICTED
    live[records.damaged(loaded)] = False  # a damaged record's fields mean nothing
    for idx, info in enumerate(mf.shards):
        path = store_files.resolve(root, info.file, mf.pending)
        if _unsafe(path):
            continue  # file.unsafe
        if not path.exists():
            out.add(
                "shard.missing",
                ERROR,
                info.file,
                "the shard file is missing",
                f"{info.bytes} bytes holding {info.entries} entries",
            )
            continue
        size = path.stat().st_size
        if size != info.bytes:
            out.add("shard.size", ERROR, info.file, f"{size} bytes", f"{info.bytes} bytes")
        scan = shard_file.scan_shard(
            path,
            embed_dim=mf.config.embed_dim,
            storage=mf.config.storage_dtype,
            index_crc=info.index_crc,
            pooled_keys=mf.config.signatures_per_entry,
            holes_allowed=fetched_heads,
        )
        scans[idx] = scan
        for code, message in scan.problems:
            out.add(code, ERROR, info.file, message)
        if scan.metadata and scan.uid != info.uid:
            out.add("shard.uid", ERROR, info.file, "the shard's uid differs from the one index.json records", info.uid)
        if scan.index is not None:
            if scan.index.entries != info.entries:
                out.add("shard.count", ERROR, info.file, f"holds {scan.index.entries} entries", f"{info.entries}")
            if scan.index.crc() != info.index_crc:
                out.add("shard.index", ERROR, info.file, "hmem_index differs from the one index.json records")
            elif scan.index.entries == info.entries:
                # what a read refuses in an index that passes its checksum (the same check)
                problem = scan.index.problem(info.entries, info.uid)
                if problem is not None:
                    code = "shard.uid" if "uid" in problem else "shard.index"
                    out.add(code, ERROR, info.file, problem)
        mine = loaded[live & (loaded["shard_idx"] == idx)]
        for entry_id in mine["entry_id"].tolist():
            meta = scan.meta(entry_id)
            if meta is not None and shard_file.parse_meta(meta) is None:  # a read refuses it (the same check)
                out.add(
                    "shard.header",
                    ERROR,
                    info.file,
                    f"entry {entry_id}: its metadata is not a JSON object",
                    entry_id=entry_id,
                )
            missing = [k for k in _kinds(mf.config) if (entry_id, k) not in scan.tensors]
            if missing and scan.tensors:
                out.add(
                    "shard.entry",
                    ERROR,
                    info.file,
                    f"entry {entry_id} lacks tensors {', '.join(missing)}",
                    entry_id=entry_id,
                )
    return scans


# What verify says of each file the commit does not name (docs/reliability.md).
_TEMP_NOTE = ("file.temp", WARNING, "a temporary file of an interrupted writer (the next writer removes it)")
_ORPHAN_NOTE = ("file.orphan", WARNING, "a shard file no commit names ('hmem compact' removes it)")
_FOREIGN_NOTE = ("file.foreign", INFO, "a file hmem did not make (left alone)")
_NEWER_NOTE = ("file.orphan", WARNING, "a shard file the stale index.json does not name (repair keeps its entries)")


def _unsafe(path: Path) -> bool:
    """A link, or an entry that is not a regular file (reported as file.unsafe)."""
    return path.is_symlink() or (path.exists() and not path.is_file())


def _check_directory(root: Path, mf: manifest.Manifest, out: _Collector, *, stale: bool, at_work: int | None) -> None:
    files = store_files.classify(root, mf.shards, mf.pending)
    orphan = _NEWER_NOTE if stale else _ORPHAN_NOTE
    temporary = _TEMP_NOTE
    if at_work is not None and not stale:  # what the writer at work is making: no problem
        at_work_note = ("file.at_work", INFO, f"a file the writer at work (pid {at_work}) is making")
        orphan = temporary = at_work_note
    notes = {
        **dict.fromkeys(files.temporary, temporary),
        **dict.fromkeys(files.unnamed_shards, orphan),
        **dict.fromkeys(files.others, _FOREIGN_NOTE),
    }
    for name in sorted(notes):
        code, severity, message = notes[name]
        out.add(code, severity, name, message)


def _check_tensors(
    root: Path,
    mf: manifest.Manifest,
    loaded: np.ndarray,
    scans: dict[int, shard_file.ShardScan],
    out: _Collector,
    subset: tuple[int, int] | None,
    max_seconds: float | None,
    started: float,
) -> tuple[int, int, bool]:
    checked = nbytes = 0
    good = np.ones(len(loaded), dtype=bool)
    good[records.damaged(loaded)] = False
    projector = Projector(mf.config.embed_dim, mf.config.hdc_dim, mf.config.seed)
    pooled_rows = _pooled_rows(root, mf, len(loaded))
    for idx, scan in scans.items():
        if subset is not None and idx % subset[1] != subset[0] - 1:
            continue
        info = mf.shards[idx]
        rows = np.flatnonzero(good & (loaded["shard_idx"] == idx))
        with open(_io.open_regular(store_files.resolve(root, info.file, mf.pending)), "rb") as f:
            # scan.size: what the quick check read (a sparse shard: up to its first hole)
            data = mmap.mmap(f.fileno(), scan.size, access=mmap.ACCESS_READ) if scan.size else b""
        for pos in rows.tolist():
            if max_seconds is not None and time.perf_counter() - started > max_seconds:
                return checked, nbytes, False
            entry_id, n_tokens = int(loaded["entry_id"][pos]), int(loaded["n_tokens"][pos])
            for kind in _kinds(mf.config):
                spec = scan.tensors.get((entry_id, kind))
                if spec is None:
                    continue  # reported by the quick check
                dtype, shape, start, end, crc = spec
                want_dtype, want_shape = shard_file.tensor_spec(
                    kind, n_tokens, mf.config.embed_dim, mf.config.storage_dtype, mf.config.signatures_per_entry
                )
                name = f"{kind}_{entry_id}"
                if dtype != want_dtype or tuple(shape) != want_shape:
                    out.add(
                        "tensor.shape",
                        ERROR,
                        info.file,
                        f"{name} is {dtype} {list(shape)}",
                        f"{want_dtype} {list(want_shape)}",
                        entry_id,
                    )
                    continue
                checked += 1
                nbytes += end - start
                if crc is None or checksum_kernels.crc32c(memoryview(data)[start:end]) != crc:
                    out.add(
                        "tensor.checksum",
                        ERROR,
                        info.file,
                        f"{name} fails its checksum",
                        "CRC-32C " + (f"{crc:08x}" if crc is not None else "recorded"),
                        entry_id,
                    )
                elif kind == "p":
                    _check_pooled_key(mf, loaded, pos, bytes(memoryview(data)[start:end]), projector, pooled_rows, out)
    return checked, nbytes, True


def _pooled_rows(root: Path, mf: manifest.Manifest, count: int) -> np.ndarray:
    """The first `count` rows of pooled.bin (fewer when it is shorter or unreadable)."""
    dtype = pooled.row_dtype(mf.config.pooled_width)
    if _unsafe(root / pooled.POOLED_FILE):
        return np.zeros(0, dtype=dtype)
    try:
        with open(_io.open_regular(root / pooled.POOLED_FILE), "rb") as f:
            return np.fromfile(f, dtype=dtype, count=count)
    except OSError:
        return np.zeros(0, dtype=dtype)


def _check_pooled_key(
    mf: manifest.Manifest,
    loaded: np.ndarray,
    pos: int,
    key: bytes,
    projector: Projector,
    pooled_rows: np.ndarray,
    out: _Collector,
) -> None:
    """An entry's pooled key (which passed its CRC) against its record and
    its row of pooled.bin: each must describe the same data, else one of
    them is another store's (or was rewritten under a new checksum)."""
    entry_id = int(loaded["entry_id"][pos])
    mean = np.frombuffer(key, dtype="<f4", count=mf.config.embed_dim).astype(np.float64)
    if not signatures_agree(projector.signature_of_sum(mean), loaded["signature"][pos], mf.config.hdc_dim):
        out.add(
            "record.mismatch",
            ERROR,
            ENTRIES_FILE,
            f"the record of entry {entry_id} does not describe its tensors (another store's entries.bin?)",
            "the signature of the entry's pooled key",
            entry_id,
        )
    if pos < len(pooled_rows) and bool(pooled.usable(pooled_rows[pos : pos + 1], loaded["entry_id"][pos : pos + 1])[0]):
        if pooled_rows["key"][pos].tobytes() != key:
            out.add(
                "pooled.mismatch",
                ERROR,
                pooled.POOLED_FILE,
                f"the row of entry {entry_id} holds another pooled key than its shard (another store's pooled.bin?)",
                "a copy of p_" + str(entry_id),
                entry_id,
            )


def config_from_shards(root: Path) -> StoreConfig | None:
    """The store config a shard's metadata carries (for rebuilding a lost
    index.json), or None."""
    for path in (root / name for name in store_files.shard_names(root)):
        try:
            return StoreConfig.from_dict(json.loads(shard_file.store_config_text(path)))
        except (KeyError, TypeError, ValueError, RecursionError, HmemError, OSError):  # any text: docs/security.md
            continue
    return None
