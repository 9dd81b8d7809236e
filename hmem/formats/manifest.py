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
import time
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io
from hmem._version import __version__
from hmem.config import StoreConfig
from hmem.errors import CorruptStoreError, Hint, NotAStoreError, UnsupportedFormatError
from hmem.formats.layout import INDEX_FILE, record_bytes
from hmem.formats.records import UPDATE_DTYPE
from hmem.kernels import checksum as checksum_kernels

FORMAT_NAME = "hmem-store"
FORMAT_VERSION = 1


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclasses.dataclass
class ShardInfo:
    """One committed shard file."""

    file: str
    bytes: int  # size of the file
    uid: str  # also in the shard's index and __metadata__: a replaced file is noticed
    entries: int  # entries whose tensors the shard holds
    index_crc: int  # CRC-32C of the shard's hmem_index tensor
    dead_entries: int = 0  # of those, evicted
    dead_bytes: int = 0  # tensor bytes of the evicted entries (freed by compact)


@dataclasses.dataclass
class Pending:
    """Idempotent steps that follow the commit that lists them."""

    record_updates: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=UPDATE_DTYPE))
    renames: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    deletes: list[str] = dataclasses.field(default_factory=list)

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
        renames = [(str(a), str(b)) for a, b in data["renames"]]
        return cls(updates, renames, [str(name) for name in data["deletes"]])


@dataclasses.dataclass
class Manifest:
    config: StoreConfig
    projection: dict[str, Any]
    generation: int = 0
    next_entry_id: int = 1
    record_count: int = 0
    shards: list[ShardInfo] = dataclasses.field(default_factory=list)
    pending: Pending = dataclasses.field(default_factory=Pending)
    created: str = dataclasses.field(default_factory=_now)
    committed: str = dataclasses.field(default_factory=_now)
    written_by: str = f"hmem {__version__}"

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "written_by": self.written_by,
            "created": self.created,
            "committed": self.committed,
            "generation": self.generation,
            "config": self.config.to_dict(),
            "projection": self.projection,
            "record_size": record_bytes(self.config.signature_bytes),
            "record_count": self.record_count,
            "next_entry_id": self.next_entry_id,
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "pending": self.pending.to_json(),
        }

    def to_bytes(self) -> bytes:
        body = self._body()
        document = {**body, "checksum": f"crc32c:{_checksum(body):08x}"}
        return (json.dumps(document, indent=1) + "\n").encode()


def _checksum(body: dict[str, Any]) -> int:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return checksum_kernels.crc32c(canonical)


def write(store_dir: Path, manifest: Manifest) -> bytes:
    """Commit `manifest` (atomically and durably); returns the bytes written."""
    manifest.committed = _now()
    manifest.written_by = f"hmem {__version__}"
    data = manifest.to_bytes()
    _io.write_file(store_dir / INDEX_FILE, [data])
    return data


def read_bytes(store_dir: Path) -> bytes:
    if not store_dir.is_dir():
        raise NotAStoreError(f"{store_dir} is not a directory holding an hmem store",
                             hint=Hint.CREATE)
    try:
        return (store_dir / INDEX_FILE).read_bytes()
    except FileNotFoundError:
        raise NotAStoreError(f"{store_dir} holds no hmem store (no {INDEX_FILE})",
                             hint=Hint.CREATE) from None


def parse(store_dir: Path, data: bytes) -> Manifest:
    """Decode index.json, refusing what is not a store, a format this hmem
    does not know, or a document whose checksum does not match."""
    where = store_dir / INDEX_FILE
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise CorruptStoreError(f"{where} is not valid JSON",
                                hint=Hint.REPAIR) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise NotAStoreError(f"{where} is not an hmem store index")
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
            shards=[ShardInfo(**s) for s in doc["shards"]],
            pending=Pending.from_json(doc["pending"]),
            created=str(doc["created"]),
            committed=str(doc["committed"]),
            written_by=str(doc.get("written_by", "")),
        )
    except (UnsupportedFormatError, CorruptStoreError):
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptStoreError(f"{where} is missing or has a malformed field ({exc})",
                                hint=Hint.REPAIR) from None
    if doc.get("record_size") != record_bytes(config.signature_bytes):
        raise CorruptStoreError(f"{where} gives a record size that does not match hdc_dim")
    return manifest


def load(store_dir: Path) -> Manifest:
    return parse(store_dir, read_bytes(store_dir))
