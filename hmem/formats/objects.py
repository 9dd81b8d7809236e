"""A store on object storage: the names of its objects, its manifest, the
state objects that carry its records, and the writer's lease
(docs/format.md, "Stores on object storage").

    manifest.json                 the commit point, replaced by conditional writes
    lease.json                    the single writer's lease
    shards/<uid>.safetensors      a shard file, byte for byte (never changed)
    state/<generation>-<n>.bin    changes to the store's small files (never changed)

A local store's small files (entries.bin, pooled.bin, sources.jsonl)
change in place; on object storage nothing changes in place.  Each commit
instead writes one state object holding the byte ranges of those files
that changed since the previous commit (a record's access count, appended
records); the manifest lists the state objects from the last snapshot (a
state object holding the files whole) on.  Applying them in order gives
the files.  A writer writes a new snapshot when the list grows long, and
at every compaction, so the list stays short.  The state objects also
carry each shard's head (its header length and entry index), so that a
reader need not fetch a shard's first bytes before reading an entry.

The manifest also carries the local format's index.json text unchanged
(docs/format.md, "index.json"): what the store holds is described once.
"""

from __future__ import annotations

import json
import re
import struct
import time
from typing import Any

import numpy as np

from hmem.errors import CorruptStoreError, Hint, NotAStoreError, UnsupportedFormatError
from hmem.formats import shard_file
from hmem.formats.manifest import MAX_SHARDS
from hmem.formats.pooled import POOLED_FILE
from hmem.formats.records import ENTRIES_FILE
from hmem.formats.sources import SOURCES_FILE
from hmem.kernels import checksum as checksum_kernels

FORMAT_NAME = "hmem-object-store"
FORMAT_VERSION = 1
MANIFEST_KEY = "manifest.json"
LEASE_KEY = "lease.json"
SHARD_PREFIX = "shards/"
STATE_PREFIX = "state/"
# the small files a state object carries, by number
STATE_FILES = (ENTRIES_FILE, POOLED_FILE, SOURCES_FILE)
# piece file 3: the shard heads, kept by the working copy in memory (not a file of the store)
HEADS_FILE = "shard-heads"
HEADS = len(STATE_FILES)
MAX_MANIFEST_BYTES = 1 << 30
MAX_STATE_OBJECTS = 10_000
MAX_FILE_BYTES = MAX_MANIFEST_BYTES * 1024  # a small file's committed size (entries.bin, ...), 1 TiB
MAX_OBJECT_BYTES = 1 << 50  # a shard or state object's size (index.json's MAX_FILE_BYTES)
MAX_RETIRED = 1 << 22  # retired objects a manifest lists (as many as index.json's shards)
MAX_SECONDS = float(1 << 36)  # `committed` and `since`, Unix seconds (past the year 4000)
_MAX_PIECE = 1 << 62  # a state piece's offset and length

_STATE_MAGIC = b"HMEMSTAT"
_STATE_HEAD = struct.Struct("<8sII")  # magic, version, number of pieces
_PIECE = np.dtype([("file", "<u4"), ("zero", "<u4"), ("offset", "<u8"), ("length", "<u8")])
_HEAD = struct.Struct("<16sQQ")  # shard uid, JSON header length, entries

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HEADS",
    "HEADS_FILE",
    "LEASE_KEY",
    "MANIFEST_KEY",
    "STATE_FILES",
    "Lease",
    "RemoteManifest",
    "StatePieces",
    "apply_state",
    "encode_head",
    "encode_state",
    "is_init_leftover",
    "is_own_key",
    "parse_heads",
    "read_state",
    "shard_key",
    "state_key",
]


def shard_key(uid: str) -> str:
    return f"{SHARD_PREFIX}{uid}.safetensors"


def state_key(generation: int, token: str) -> str:
    return f"{STATE_PREFIX}{generation:012d}-{token}.bin"


# The names of the objects a store writes that it may also delete (an
# orphan, an expired retired object): exactly what shard_key and state_key
# make (the token is the first 8 hex digits of the writer's lease token),
# directly under shards/ and state/.  Anything else under a store's prefix
# (another store's objects, in a sub-prefix or beside it at a bucket's
# root; a file someone put there) is never deleted.
_OWN_KEY = re.compile(r"shards/[0-9a-f]{32}\.safetensors|state/[0-9]{12,20}-[0-9a-f]{8}\.bin")
# the state keys a manifest may name (read, never deleted unless also
# own): one name directly under state/ of characters every object store
# takes as they are (an empty segment, "." or a control character would
# be a request the client refuses, not a missing object)
_STATE_NAME = re.compile(r"state/[0-9A-Za-z_-][0-9A-Za-z._-]{0,254}")
# what an interrupted `hmem init` of a URL leaves there (the lease, the
# first state object), which a new init there may take over
_INIT_LEFTOVER = re.compile(r"lease\.json|state/[0-9]{12,20}-[0-9a-f]{8}\.bin")


def is_own_key(key: str) -> bool:
    """Whether `key` (relative to a store's prefix) is a name the store
    gives a shard or state object: the only objects it ever deletes."""
    return _OWN_KEY.fullmatch(key) is not None


def is_init_leftover(key: str) -> bool:
    """Whether `key` is what an interrupted ``hmem init`` of the prefix
    leaves (lease.json, a state object); no shard: init uploads none."""
    return _INIT_LEFTOVER.fullmatch(key) is not None


def _crc(data: bytes | memoryview) -> int:
    return int(checksum_kernels.crc32c(data))


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# ---- state objects ---------------------------------------------------------------------


def encode_state(pieces: list[tuple[int, int, bytes | memoryview]]) -> bytes:
    """A state object: (file number, offset, bytes) pieces, then a CRC-32C
    of everything before it.

    Layout (little-endian): 8 bytes "HMEMSTAT", u32 version (1), u32 count;
    count rows of (u32 file, u32 zero, u64 offset, u64 length); the pieces'
    bytes in row order; u32 CRC-32C of all the preceding bytes."""
    table = np.zeros(len(pieces), dtype=_PIECE)
    table["file"] = [file for file, _, _ in pieces]
    table["offset"] = [offset for _, offset, _ in pieces]
    table["length"] = [len(data) for _, _, data in pieces]
    parts = [_STATE_HEAD.pack(_STATE_MAGIC, 1, len(pieces)), table.tobytes(), *(bytes(d) for _, _, d in pieces)]
    body = b"".join(parts)
    return body + struct.pack("<I", _crc(body))


class StatePieces:
    """A state object checked whole (read_state): its pieces' file numbers,
    offsets and lengths, and where each piece's bytes start in it."""

    def __init__(self, key: str, data: bytes, table: np.ndarray, start: int) -> None:
        self.key = key
        self.data = data
        self.files = table["file"].astype(np.int64)
        self.offsets = table["offset"].astype(np.int64)
        self.lengths = table["length"].astype(np.int64)
        self.start = start

    def file_bytes(self, count: int) -> np.ndarray:
        """The bytes its pieces hold for each of `count` files: what a
        manifest may claim of them is bounded by this (ObjectLink.materialize)."""
        held = np.zeros(count, dtype=np.int64)
        np.add.at(held, self.files, self.lengths)
        return held

    def check_within(self, sizes: list[int]) -> None:
        """Refuse a piece that names a file not among `sizes` (bytes of each
        file) or lies outside its file."""

        def bad(why: str) -> CorruptStoreError:
            return CorruptStoreError(f"state object {self.key} is damaged: {why}", hint=Hint.VERIFY)

        if not len(self.files):
            return
        if int(self.files.max()) >= len(sizes):
            raise bad("its pieces name a file that does not exist")
        ends = np.array(sizes, dtype=np.int64)[self.files]
        if np.any(self.offsets + self.lengths > ends):  # each below 2^62: no overflow
            raise bad("a piece lies outside its file")

    def apply(self, files: list[bytearray]) -> None:
        """Write the pieces into `files`; refuses (before writing a byte) a
        piece that names a file not given or lies outside its file."""
        self.check_within([len(f) for f in files])
        if not len(self.files):
            return
        offsets, lengths = self.offsets, self.lengths
        body = np.frombuffer(self.data, dtype=np.uint8, count=len(self.data) - 4 - self.start, offset=self.start)
        sources = np.cumsum(lengths) - lengths
        for number, target in enumerate(files):
            mine = np.flatnonzero(self.files == number)
            if not len(mine):
                continue
            out = np.frombuffer(target, dtype=np.uint8)
            if len(mine) <= 64:  # a snapshot, or a few runs: copied piece by piece
                for i in mine.tolist():
                    out[offsets[i] : offsets[i] + lengths[i]] = body[sources[i] : sources[i] + lengths[i]]
                continue
            # many small pieces (records updated here and there): one gather and one scatter
            within = np.arange(int(lengths[mine].sum()), dtype=np.int64) - np.repeat(
                np.cumsum(lengths[mine]) - lengths[mine], lengths[mine]
            )
            out[np.repeat(offsets[mine], lengths[mine]) + within] = body[
                np.repeat(sources[mine], lengths[mine]) + within
            ]


def read_state(data: bytes, key: str) -> StatePieces:
    """A state object checked whole, before anything is sized by it: its
    checksum, and a table whose pieces name files 0..3, have offsets and
    lengths below 2^62 and fill the object exactly (so a piece's bytes are
    bytes the object really holds)."""

    def bad(why: str) -> CorruptStoreError:
        return CorruptStoreError(f"state object {key} is damaged: {why}", hint=Hint.VERIFY)

    if len(data) < _STATE_HEAD.size + 4:
        raise bad("too short")
    if _crc(memoryview(data)[:-4]) != struct.unpack_from("<I", data, len(data) - 4)[0]:
        raise bad("it fails its checksum")
    magic, version, count = _STATE_HEAD.unpack_from(data, 0)
    if magic != _STATE_MAGIC or version != 1:
        raise bad("wrong magic or version")
    start = _STATE_HEAD.size + count * _PIECE.itemsize
    if start > len(data) - 4:
        raise bad("its table runs past its end")
    table = np.frombuffer(data, dtype=_PIECE, count=count, offset=_STATE_HEAD.size)
    body_bytes = len(data) - 4 - start
    if len(table) and (
        int(table["file"].max()) > HEADS
        or np.any(table["zero"] != 0)
        or np.any(table["offset"] >= np.uint64(_MAX_PIECE))
        or np.any(table["length"] > np.uint64(body_bytes))
    ):
        raise bad("a piece names a file that does not exist, or its offset or length is out of range")
    # each length at most the body: a running sum passes the body before it could wrap
    ends = np.cumsum(table["length"].astype(np.int64))
    if (int(ends[-1]) if len(ends) else 0) != body_bytes or (len(ends) and int(ends.max()) > body_bytes):
        raise bad("its pieces do not fill it")
    return StatePieces(key, data, table, start)


def apply_state(data: bytes, files: list[bytearray], key: str) -> None:
    """Write a state object's pieces into `files` (one bytearray per
    STATE_FILES entry, then one for the shard heads, sized as the manifest
    says); refuses a damaged object or a piece outside its file."""
    read_state(data, key).apply(files)


# ---- shard heads -----------------------------------------------------------------------


def encode_head(uid: str, data_start: int, index: bytes | memoryview) -> bytes:
    """A shard's head, as the heads pieces of state objects carry it: its
    uid (16 bytes, the hex digits' value big-endian), the length of its JSON
    header (u64; its data starts at 8 + that), its entries (u64), then its
    hmem_index tensor byte for byte ((entries + 1) × 96 bytes)."""
    entries = len(index) // shard_file.INDEX_ROW_BYTES - 1
    return _HEAD.pack(bytes.fromhex(uid), shard_file.header_length(data_start), entries) + bytes(index)


def parse_heads(data: bytes | bytearray, key: str) -> dict[str, tuple[int, memoryview]]:
    """The heads in the heads pieces of a store's state: shard uid -> (data
    start, index bytes); the index bytes are a view into `data`, checked by
    whoever uses them (against the shard's index CRC in index.json), as a
    shard's own are."""
    heads: dict[str, tuple[int, memoryview]] = {}
    at, view = 0, memoryview(data)
    while at < len(view):
        if at + _HEAD.size > len(view):
            raise CorruptStoreError(f"{key}: the shard heads end in the middle of one", hint=Hint.VERIFY)
        uid, header_length, entries = _HEAD.unpack_from(view, at)
        length = shard_file.index_bytes(entries)
        if entries > MAX_MANIFEST_BYTES or at + _HEAD.size + length > len(view) or header_length > 1 << 40:
            raise CorruptStoreError(f"{key}: a shard head runs past the end of the heads", hint=Hint.VERIFY)
        start = at + _HEAD.size
        heads[uid.hex()] = (shard_file.data_start_after(header_length), view[start : start + length])
        at = start + length
    return heads


# ---- the manifest ----------------------------------------------------------------------


class RemoteManifest:
    """manifest.json: one committed state of a store on object storage."""

    def __init__(
        self,
        *,
        generation: int,
        index: bytes,
        sizes: dict[str, int],
        state: list[dict[str, Any]],
        shards: dict[str, dict[str, Any]],
        retired: list[dict[str, Any]],
        writer: str,
        committed: float | None = None,
    ) -> None:
        self.generation = generation
        self.index = index  # the index.json text of the local format (hmem/formats/manifest.py)
        self.sizes = sizes  # STATE_FILES name (and HEADS_FILE) -> bytes
        self.state = state  # [{"key", "bytes"}], oldest first; the first a snapshot
        self.shards = shards  # uid -> {"key", "bytes"}
        self.retired = retired  # [{"key", "since"}]: objects no commit names, deleted after a grace time
        self.writer = writer  # the lease token of the writer that committed
        self.committed = time.time() if committed is None else committed

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "committed": self.committed,
            "writer": self.writer,
            "index": self.index.decode(),
            "files": self.sizes,
            "state": self.state,
            "shards": self.shards,
            "retired": self.retired,
        }
        body["checksum"] = f"crc32c:{_crc(_canonical(body)):08x}"
        return json.dumps(body, indent=1).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes, where: str) -> RemoteManifest:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise CorruptStoreError(f"{where} is not valid JSON", hint=Hint.VERIFY) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise NotAStoreError(f"{where} is not the manifest of an hmem store on object storage")
        if doc.get("format_version") != FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{where} uses object-store format version {doc.get('format_version')!r}; "
                f"this hmem reads version {FORMAT_VERSION}",
                hint="use the hmem release that wrote it",
            )
        stored = doc.pop("checksum", None)
        if stored != f"crc32c:{_crc(_canonical(doc)):08x}":
            raise CorruptStoreError(f"{where} fails its checksum", hint=Hint.VERIFY)
        try:
            mf = cls(
                generation=_whole(doc["generation"], "generation", (1 << 63) - 1),
                index=_text(doc["index"], "index").encode(),
                sizes={
                    **{name: _whole(doc["files"][name], f"files.{name}", MAX_FILE_BYTES) for name in STATE_FILES},
                    HEADS_FILE: _whole(doc["files"].get(HEADS_FILE, 0), f"files.{HEADS_FILE}", MAX_FILE_BYTES),
                },
                state=[
                    {"key": _text(s["key"], "state.key"), "bytes": _whole(s["bytes"], "state.bytes", MAX_OBJECT_BYTES)}
                    for s in _items(doc["state"], "state", MAX_STATE_OBJECTS)
                ],
                shards={
                    _text(uid, "shards"): {
                        "key": _text(s["key"], "shards.key"),
                        "bytes": _whole(s["bytes"], "shards.bytes", MAX_OBJECT_BYTES),
                    }
                    for uid, s in _shard_items(doc["shards"])
                },
                retired=[
                    {"key": _text(r["key"], "retired.key"), "since": _seconds(r["since"], "retired.since")}
                    for r in _items(doc["retired"], "retired", MAX_RETIRED)
                ],
                writer=_text(doc["writer"], "writer"),
                committed=_seconds(doc["committed"], "committed"),
            )
        except _Malformed as exc:
            raise CorruptStoreError(f"{where}: {exc}", hint=Hint.VERIFY) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptStoreError(f"{where} is missing or has a malformed field ({exc})", hint=Hint.VERIFY) from None
        problem = mf._problem()
        if problem:
            raise CorruptStoreError(f"{where}: {problem}", hint=Hint.VERIFY)
        return mf

    def _problem(self) -> str | None:
        """What an untrusted manifest may not say (docs/security.md): keys
        outside the store's own names, retired keys that are not names the
        store deletes or that a commit still names, files its state objects
        cannot hold.  (Types and bounds of each number: parse.)"""
        if not self.state:
            return "it lists no state objects"
        named: set[str] = set()
        for item in self.state:
            if _STATE_NAME.fullmatch(item["key"]) is None or ".." in item["key"]:
                return f"state key {item['key']!r} is not a state object's name"
            if item["key"] in named:
                return f"state key {item['key']!r} is listed twice"
            named.add(item["key"])
        for uid, item in self.shards.items():
            if item["key"] != shard_key(uid) or len(uid) != 32 or any(c not in "0123456789abcdef" for c in uid):
                return f"shards key {item['key']!r} is not the name of shard {uid!r}"
            named.add(item["key"])
        for item in self.retired:
            # a retired object is deleted once its grace time is over: only a
            # name the store gives its own objects, and none a commit names
            if not is_own_key(item["key"]):
                return f"retired key {item['key']!r} is not the name of one of the store's shard or state objects"
            if item["key"] in named:
                return f"retired key {item['key']!r} is an object the manifest still names"
        # every byte of the small files comes from a piece of a state object:
        # files the listed objects cannot hold are a claim, refused before
        # anything is sized by it
        claimed, held = sum(self.sizes.values()), sum(item["bytes"] for item in self.state)
        if claimed > held:
            return f"files claims {claimed} bytes, more than its state objects hold ({held} bytes)"
        return None


class _Malformed(ValueError):
    """A manifest field of the wrong type or out of its bound."""


def _whole(value: Any, field: str, bound: int) -> int:
    """A whole number in 0..bound (not a boolean, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
        raise _Malformed(f"{field} is not a whole number from 0 to {bound}: {str(value)[:40]}")
    return value


def _seconds(value: Any, field: str) -> float:
    """A time in Unix seconds: a finite number from 0 to MAX_SECONDS."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS:
        raise _Malformed(f"{field} is not a time in seconds from 0 to {MAX_SECONDS:.0f}: {str(value)[:40]}")
    return float(value)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"{field} is not a string")
    return value


def _shard_items(value: Any) -> Any:
    if not isinstance(value, dict) or len(value) > MAX_SHARDS:
        raise _Malformed(f"shards is not a mapping of at most {MAX_SHARDS} shards")
    return value.items()


def _items(value: Any, field: str, bound: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > bound:
        raise _Malformed(f"{field} is not a list of at most {bound} items")
    return value


# ---- the lease -------------------------------------------------------------------------


class Lease:
    """lease.json: who may write, until when.  A writer creates it with a
    create-only write, renews it with a write conditional on the ETag it
    last wrote, and may take it over only once it has expired."""

    def __init__(self, token: str, owner: dict[str, Any], expires: float) -> None:
        self.token = token
        self.owner = owner
        self.expires = expires

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"format": FORMAT_NAME + "-lease", "token": self.token, "owner": self.owner, "expires": self.expires}
        ).encode()

    @classmethod
    def parse(cls, data: bytes) -> Lease | None:
        """The lease, or None for a document that is not one (a damaged
        lease counts as expired)."""
        try:
            doc = json.loads(data)
            return cls(str(doc["token"]), dict(doc["owner"]), float(doc["expires"]))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError):
            return None
