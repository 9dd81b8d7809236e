"""index.json: the store's config, its committed state, and the commit point.

A store's state is what index.json says: how many records of entries.bin
count, which shard files exist, the next entry id.  Replacing index.json
(atomically, through hmem._io) is the single step that commits a change;
files written before it that it does not name are leftovers, ignored by
readers and removed by the next writer.

Work that must follow a commit (record fields written in place, renames and
deletions of files) is listed under "pending" in the committing index.json
itself, so a writer that dies half way is finished by the next one: every
pending step can be done again without harm.  docs/format.md describes
every field.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import operator
import time
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io, validation
from hmem._version import __version__
from hmem.config import StoreConfig
from hmem.errors import CorruptStoreError, Hint, NotAStoreError, UnsupportedFormatError, storage_error
from hmem.formats.records import UPDATE_DTYPE
from hmem.formats.shard_file import INDEX_ROW_BYTES
from hmem.formats.sources import SourcesInfo
from hmem.formats.store_files import INDEX_FILE, REWRITE_PREFIX, files_without_index, name_problem, record_bytes
from hmem.kernels import checksum as checksum_kernels

FORMAT_NAME = "hmem-store"
FORMAT_VERSION = 1
# Bounds of what index.json may claim (docs/security.md): far past any real
# store, small enough that nothing sized by them exhausts a machine.
MAX_INDEX_BYTES = 1 << 30
MAX_COUNT = (1 << 63) - 1
MAX_RECORDS = 1 << 40
MAX_SHARDS = 1 << 22
MAX_FILE_BYTES = 1 << 50
MAX_DEPTH = 16  # lists and objects within each other; hmem's own go 3 deep


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One committed shard file.  Frozen: a change is a new ShardInfo
    (dataclasses.replace), which is what lets a commit reuse the texts of
    the shards the last commit listed (_ListedShards)."""

    file: str
    bytes: int  # size of the file
    uid: str  # also in the shard's index and __metadata__: a replaced file is noticed
    entries: int  # entries whose tensors the shard holds
    index_crc: int  # CRC-32C of the shard's hmem_index tensor
    dead_entries: int = 0  # of those, evicted
    dead_bytes: int = 0  # tensor bytes of the evicted entries (freed by compact)

    def to_json(self) -> dict[str, Any]:
        """The fields in their order (what dataclasses.asdict gives, at a
        fraction of its cost: every commit lists every shard)."""
        return {
            "file": self.file,
            "bytes": self.bytes,
            "uid": self.uid,
            "entries": self.entries,
            "index_crc": self.index_crc,
            "dead_entries": self.dead_entries,
            "dead_bytes": self.dead_bytes,
        }

    def texts(self) -> tuple[str, str]:
        """This shard's item of index.json's shard list, as written (indent
        1, inside the list) and as checksummed (sorted keys, no spaces),
        made once (the fields never change)."""
        kept = self.__dict__.get("_texts")
        if kept is None:
            quoted = encode_basestring_ascii  # what json.dumps writes for a str (ensure_ascii)
            written = (
                f'  {{\n   "file": {quoted(self.file)},\n   "bytes": {int(self.bytes)},\n   "uid": '
                f'{quoted(self.uid)},\n   "entries": {int(self.entries)},\n   "index_crc": '
                f'{int(self.index_crc)},\n   "dead_entries": {int(self.dead_entries)},\n   "dead_bytes": '
                f"{int(self.dead_bytes)}\n  }}"
            )
            canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            kept = self.__dict__["_texts"] = (written, canonical)
        return kept


@dataclasses.dataclass(frozen=True)
class Pending:
    """Idempotent steps that follow the commit that lists them.  Frozen,
    its lists tuples and its update rows read-only: a commit's steps are
    part of an immutable snapshot (a change is a new Pending)."""

    record_updates: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=UPDATE_DTYPE))
    renames: tuple[tuple[str, str], ...] = ()
    deletes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # lists given (tests, older callers) are kept as tuples; nothing
        # writes to the update rows once they are part of a Pending
        object.__setattr__(self, "renames", tuple((str(a), str(b)) for a, b in self.renames))
        object.__setattr__(self, "deletes", tuple(self.deletes))
        self.record_updates.flags.writeable = False

    def __bool__(self) -> bool:
        return bool(len(self.record_updates) or self.renames or self.deletes)

    def to_json(self) -> dict[str, Any]:
        return {
            "record_updates": base64.b64encode(self.record_updates.tobytes()).decode("ascii"),
            "renames": [list(pair) for pair in self.renames],
            "deletes": list(self.deletes),
        }

    @classmethod
    def from_json(cls, data: Any) -> Pending:
        raw = base64.b64decode(data["record_updates"], validate=True)
        if len(raw) % UPDATE_DTYPE.itemsize:
            raise ValueError("record_updates is not a whole number of rows")
        updates = np.frombuffer(raw, dtype=UPDATE_DTYPE).copy()
        renames = tuple((str(a), str(b)) for a, b in data["renames"])
        return cls(updates, renames, tuple(str(name) for name in data["deletes"]))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one index.json says.  Frozen, its shard list a tuple: the
    committed manifest a store holds (StoreState.committed) is an immutable
    snapshot, replaced whole by each commit (dataclasses.replace)."""

    config: StoreConfig
    projection: dict[str, Any]
    generation: int = 0
    next_entry_id: int = 1
    record_count: int = 0
    shards: tuple[ShardInfo, ...] = ()
    pending: Pending = dataclasses.field(default_factory=Pending)
    created: str = dataclasses.field(default_factory=_now)
    committed: str = dataclasses.field(default_factory=_now)
    written_by: str = f"hmem {__version__}"
    sources: SourcesInfo = SourcesInfo()  # the committed part of sources.jsonl (hmem/formats/sources.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))  # a list given is kept as a tuple

    def _body(self, shards: Any) -> dict[str, Any]:
        """The document without its checksum, "shards" holding `shards`."""
        body = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "written_by": self.written_by,
            "created": self.created,
            "committed": self.committed,
            "generation": self.generation,
            "config": self.config.to_dict(),
            "projection": self.projection,
            "record_size": record_bytes(self.config),
            "record_count": self.record_count,
            "next_entry_id": self.next_entry_id,
            "shards": shards,
            "pending": self.pending.to_json(),
        }
        if self.sources.bytes:  # absent while empty: a store that never imported a file reads as before
            body["sources"] = self.sources.to_json()
        return body

    def to_bytes(self) -> bytes:
        """index.json: json.dumps(document, indent=1), its checksum over the
        canonical JSON of the rest (sorted keys, no spaces).  The shard list
        is spliced into both texts from each shard's kept item texts
        (ShardInfo.texts, _ListedShards): json's indenting encoder is pure
        Python, and a store that flushes often has thousands of shards,
        each listed in every commit."""
        written, sorted_items = _LISTED.texts(self.shards)
        body = self._body(_SHARDS_MARK)
        canonical = _spliced(
            json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True),
            '"shards":',
            "[" + ",".join(sorted_items) + "]",
        )
        document = {**body, "checksum": f"crc32c:{checksum_kernels.crc32c(canonical.encode()):08x}"}
        items = "[\n" + ",\n".join(written) + "\n ]" if written else "[]"
        return (_spliced(json.dumps(document, indent=1), '"shards": ', items) + "\n").encode()


class _ListedShards:
    """The shard list of the last commit and its items' texts.  A flush
    lists the same ShardInfo objects as the commit before it plus the shards
    it sealed, so only those are looked at: asking each of thousands of
    shards for its kept texts costs more than the rest of a small flush.
    One per process; stores committing by turns, or at once from threads,
    only make it start over (an update replaces one tuple, never changes it)."""

    def __init__(self) -> None:
        self._last: tuple[tuple[ShardInfo, ...], list[str], list[str]] = ((), [], [])

    def texts(self, shards: tuple[ShardInfo, ...]) -> tuple[list[str], list[str]]:
        """The written and the canonical item text of every shard, in order."""
        infos, written, canonical = self._last
        kept = len(infos)
        if len(shards) < kept or not all(map(operator.is_, shards[:kept], infos)):
            kept, written, canonical = 0, [], []
        written, canonical = written[:], canonical[:]
        for shard in shards[kept:]:
            text, sorted_text = shard.texts()
            written.append(text)
            canonical.append(sorted_text)
        self._last = (shards, written, canonical)  # a tuple: kept as it is
        return written, canonical


_LISTED = _ListedShards()


# What "shards" holds while the rest of index.json is encoded: an int, which
# both encodings write as its digits, replaced by the list's text after.
_SHARDS_MARK = 7305_1794_6130_2655


def _spliced(text: str, key: str, value: str) -> str:
    """`text` with the value of `key` (the mark) replaced by `value`."""
    mark = f"{key}{_SHARDS_MARK}"
    at = text.find(mark)
    if at < 0 or text.find(mark, at + 1) >= 0:
        raise AssertionError("index.json's shard list has no single place in its text")
    return text[:at] + key + value + text[at + len(mark) :]


def _checksum(body: dict[str, Any]) -> int:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return checksum_kernels.crc32c(canonical)


def write(store_dir: Path, manifest: Manifest) -> tuple[Manifest, bytes]:
    """Commit `manifest` (atomically and durably), stamped with the time of
    the commit and this hmem's version; returns the manifest committed (a
    new snapshot: `manifest`, frozen, keeps what it was given) and its bytes."""
    spent = counters_problem(manifest)
    if spent is not None:  # never commit an index.json that parse() refuses: docs/security.md
        raise CorruptStoreError(
            f"{store_dir}: {spent}; the change is not committed",
            hint="copy the store's entries into a new store",
        )
    committed = dataclasses.replace(manifest, committed=_now(), written_by=f"hmem {__version__}")
    data = committed.to_bytes()
    _io.write_file(store_dir / INDEX_FILE, [data])
    return committed, data


def counters_problem(mf: Manifest) -> str | None:
    """Which counter of `mf` lies past the bound parse() holds it to, or
    None.  Only a crafted store gets there (a counter set near its bound):
    writers check before they write anything, write() before it commits."""
    for name, value, high in (
        ("generation", mf.generation, MAX_COUNT),
        ("next_entry_id", mf.next_entry_id, MAX_COUNT),
        ("record_count", mf.record_count, MAX_RECORDS),
    ):
        if value > high:
            return f"its {name} would pass {high}, the most a store may hold"
    # (a shard's counts are held to their bounds where they change, never
    # looked at here: a commit must not cost a look at each of its shards)
    return None


def read_bytes(store_dir: Path) -> bytes:
    validation.store_directory(store_dir)  # a file: a bad path (exit code 10), as for every command
    if not store_dir.is_dir():
        raise NotAStoreError(f"{store_dir} is not a directory holding an hmem store", hint=Hint.CREATE)
    try:
        return _io.read_regular(store_dir / INDEX_FILE, MAX_INDEX_BYTES)
    except FileNotFoundError:
        left = files_without_index(store_dir)
        if left:  # a store that lost its index: creating one there would be the wrong advice
            shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
            raise NotAStoreError(
                f"{store_dir} has no {INDEX_FILE} but holds store files ({shown}): the store's index is missing",
                hint=Hint.REPAIR,
            ) from None
        raise NotAStoreError(f"{store_dir} holds no hmem store (no {INDEX_FILE})", hint=Hint.CREATE) from None
    except OSError as exc:  # permissions, a disk error: docs/reliability.md, "OS errors"
        raise storage_error(exc, "read", store_dir / INDEX_FILE, writing=False) from exc


def parse(store_dir: Path, data: bytes) -> Manifest:
    """Decode index.json, refusing what is not a store, a format this hmem
    does not know, or a document whose checksum does not match."""
    where = store_dir / INDEX_FILE
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: "[[[[...": docs/security.md
        raise CorruptStoreError(f"{where} is not valid JSON", hint=Hint.REPAIR) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise NotAStoreError(f"{where} is not an hmem store index")
    if _nested_past(doc, MAX_DEPTH):  # what reads it (the checksum's json.dumps) recurses
        raise CorruptStoreError(f"{where} nests values deeper than an index.json does", hint=Hint.VERIFY)
    version = doc.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{store_dir} uses store format version {version!r}; this hmem reads version {FORMAT_VERSION}",
            hint="use the hmem release that wrote it",
        )
    stored = doc.pop("checksum", None)
    if stored != f"crc32c:{_checksum(doc):08x}":
        raise CorruptStoreError(f"{where} fails its checksum", hint=Hint.REPAIR)
    try:
        config = StoreConfig.from_dict(doc["config"])
        manifest = Manifest(
            config=config,
            projection=dict(doc["projection"]),
            generation=int(doc["generation"]),
            next_entry_id=int(doc["next_entry_id"]),
            record_count=int(doc["record_count"]),
            shards=tuple(ShardInfo(**s) for s in doc["shards"]),
            pending=Pending.from_json(doc["pending"]),
            created=str(doc["created"]),
            committed=str(doc["committed"]),
            written_by=str(doc.get("written_by", "")),
            sources=SourcesInfo.from_json(doc.get("sources")),
        )
    except (UnsupportedFormatError, CorruptStoreError):
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e400)
        raise CorruptStoreError(f"{where} is missing or has a malformed field ({exc})", hint=Hint.REPAIR) from None
    if doc.get("record_size") != record_bytes(config):
        raise CorruptStoreError(f"{where} gives a record size that does not match hdc_dim")
    problem = _problem(doc, manifest)
    if problem is not None:  # a crafted or damaged index.json: docs/security.md
        raise CorruptStoreError(f"{where}: {problem}", hint=Hint.VERIFY)
    return manifest


def _problem(doc: dict[str, Any], mf: Manifest) -> str | None:
    """What in a decoded index.json lies outside what hmem ever writes:
    names that are not the store's own, numbers past any sane bound."""
    for key, high in (("generation", MAX_COUNT), ("next_entry_id", MAX_COUNT), ("record_count", MAX_RECORDS)):
        if not _whole(doc[key], high):
            return f"{key} {doc[key]!r} is not a whole number up to {high}"
    if not isinstance(doc["shards"], list) or len(doc["shards"]) > MAX_SHARDS:
        return f"it lists more than {MAX_SHARDS} shards"
    for i, (raw, info) in enumerate(zip(doc["shards"], mf.shards)):
        why = name_problem(raw.get("file"), shard_at=i)
        if why is not None:
            return why
        if not all(_whole(raw.get(k), MAX_FILE_BYTES) for k in ("bytes", "entries", "dead_entries", "dead_bytes")):
            return f"shard {info.file} has a size or count that is not a whole number in range"
        if not _whole(raw.get("index_crc"), 0xFFFFFFFF) or not _is_uid(raw.get("uid")):
            return f"shard {info.file} has a malformed uid or index checksum"
        # (dead_bytes is an estimate that may pass the file's size: not bounded by it)
        if info.entries > info.bytes // INDEX_ROW_BYTES or info.dead_entries > info.entries:
            return f"shard {info.file} claims more entries than its size allows"
    for src, dst in mf.pending.renames:
        why = name_problem(src, rename=True)
        if why is not None or dst != src[len(REWRITE_PREFIX) :]:
            return why or f"a pending rename of {src!r} to {dst!r} is not one hmem makes"
    for name in mf.pending.deletes:
        why = name_problem(name, delete=True)
        if why is not None:
            return why
    updates = mf.pending.record_updates
    if len(updates) and int(updates["position"].max()) >= mf.record_count:
        return "a pending record update names a record past record_count"
    return None


def _nested_past(value: Any, limit: int) -> bool:
    """Whether lists and objects in `value` nest deeper than `limit` (looked
    at level by level, without recursion)."""
    level = [value]
    for _ in range(limit):
        level = [
            item for v in level if isinstance(v, (dict, list)) for item in (v.values() if isinstance(v, dict) else v)
        ]
        if not level:
            return False
    return any(isinstance(v, (dict, list)) for v in level)


def _whole(value: Any, high: int) -> bool:
    return type(value) is int and 0 <= value <= high


def _is_uid(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def load(store_dir: Path) -> Manifest:
    return parse(store_dir, read_bytes(store_dir))
