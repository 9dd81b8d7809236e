"""The import registry: sources.jsonl (docs/format.md, "The import registry").

One line per source file an import stored entries from: its content hash,
size and name, and the ids its entries got.  ``hmem put`` skips a file
whose content hash and size the registry holds (unless told to import it
again), so re-running an import after an interrupt or a cron retry stores
exactly what is missing.

The file only grows.  index.json says how many of its bytes are committed
and their CRC-32C (``SourcesInfo``), so lines are appended and fsynced
before the commit that counts them: a crash leaves lines past the
committed length, which readers ignore and the next flush overwrites.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from hmem import file_reads
from hmem.errors import CorruptStoreError, Hint
from hmem.kernels import checksum as checksum_kernels

SOURCES_FILE = "sources.jsonl"
MAX_SOURCES_BYTES = 1 << 30  # the committed length index.json may give
MAX_NAME_CHARS = 1024  # a source's file name, as stored
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_FIELDS = ("sha256", "bytes", "name", "first_id", "entries", "imported")


@dataclasses.dataclass(frozen=True)
class ImportedSource:
    """One imported file: what identifies it and what it became."""

    sha256: str  # of the file's bytes, lower-case hex
    bytes: int  # the file's size
    name: str  # its name as given to the import (the last component, as in entries' meta "source")
    first_id: int  # its entries got ids first_id .. first_id + entries - 1
    entries: int
    imported: str  # when, ISO 8601 UTC

    @property
    def entry_ids(self) -> range:
        return range(self.first_id, self.first_id + self.entries)


@dataclasses.dataclass(frozen=True)
class SourcesInfo:
    """What index.json says of sources.jsonl: its committed length and the
    CRC-32C of those bytes (absent from index.json while empty)."""

    bytes: int = 0
    crc32c: int = 0

    def to_json(self) -> dict[str, Any] | None:
        return {"bytes": self.bytes, "crc32c": f"{self.crc32c:08x}"} if self.bytes else None

    @classmethod
    def from_json(cls, raw: Any) -> SourcesInfo:
        """The committed length and CRC of index.json's "sources" (None: empty)."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict) or set(raw) != {"bytes", "crc32c"}:
            raise ValueError("sources must be an object of bytes and crc32c")
        size, crc = raw["bytes"], raw["crc32c"]
        if type(size) is not int or not 0 < size <= MAX_SOURCES_BYTES:
            raise ValueError(f"sources bytes {size!r} is not a whole number up to {MAX_SOURCES_BYTES}")
        if not isinstance(crc, str) or not re.fullmatch(r"[0-9a-f]{8}", crc):
            raise ValueError(f"sources crc32c {crc!r} is not 8 hexadecimal digits")
        return cls(size, int(crc, 16))


def encode(sources: list[ImportedSource]) -> bytes:
    """Lines to append, one JSON object each."""
    return "".join(
        json.dumps(
            {
                "sha256": s.sha256,
                "bytes": s.bytes,
                "name": s.name,
                "first_id": s.first_id,
                "entries": s.entries,
                "imported": s.imported,
            },
            separators=(",", ":"),
            ensure_ascii=True,
        )
        + "\n"
        for s in sources
    ).encode()


def appended(info: SourcesInfo, data: bytes) -> SourcesInfo:
    """The committed length and CRC once `data` is appended."""
    return SourcesInfo(info.bytes + len(data), checksum_kernels.crc32c(data, info.crc32c))


def read(store_dir: Path, info: SourcesInfo) -> list[ImportedSource]:
    """The committed sources; CorruptStoreError when the file is shorter
    than index.json says, fails its CRC, or holds a line hmem never writes."""
    if not info.bytes:
        return []
    where = store_dir / SOURCES_FILE
    try:
        data = file_reads.read_regular(where, MAX_SOURCES_BYTES * 2)[: info.bytes]
    except FileNotFoundError:
        raise CorruptStoreError(
            f"{where} is missing; index.json counts {info.bytes} bytes of it", hint=Hint.REPAIR
        ) from None
    if len(data) < info.bytes:
        raise CorruptStoreError(f"{where} holds {len(data)} bytes; index.json counts {info.bytes}", hint=Hint.REPAIR)
    if checksum_kernels.crc32c(data) != info.crc32c:
        raise CorruptStoreError(f"{where} fails its checksum", hint=Hint.REPAIR)
    return parse(data, where)


def parse(data: bytes, where: Path) -> list[ImportedSource]:
    """Every line of `data` as an ImportedSource (each must be one hmem writes)."""
    if data and not data.endswith(b"\n"):
        raise CorruptStoreError(f"{where} ends inside a line", hint=Hint.REPAIR)
    out = []
    for number, line in enumerate(data.split(b"\n")[:-1], 1):
        source = _line(line)
        if source is None:
            raise CorruptStoreError(f"{where} line {number} is not a source record", hint=Hint.REPAIR)
        out.append(source)
    return out


def whole_lines(data: bytes) -> tuple[list[ImportedSource], int]:
    """The sources of the longest prefix of `data` made of valid lines, and
    its length (what a repair keeps of a damaged or uncounted file)."""
    out: list[ImportedSource] = []
    kept = 0
    for line in data.split(b"\n")[:-1]:
        source = _line(line)
        if source is None:
            break
        out.append(source)
        kept += len(line) + 1
    return out, kept


def _line(line: bytes) -> ImportedSource | None:
    try:
        raw = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(raw, dict) or tuple(raw) != _FIELDS:
        return None
    sha, size, name, first, entries, when = (raw[k] for k in _FIELDS)
    if not (
        isinstance(sha, str)
        and _SHA256.match(sha)
        and isinstance(name, str)
        and len(name) <= MAX_NAME_CHARS
        and isinstance(when, str)
        and len(when) <= 64
        and all(type(v) is int and 0 <= v < 2**63 for v in (size, first, entries))
    ):
        return None
    return ImportedSource(sha, size, name, first, entries, when)
