"""LMCache 0.5.6's cache files, read without LMCache: chunk keys, the file
names its disk tiers give them, the header of its `fs` connector's files,
and its chunk hashes.

What LMCache writes (docs/lmcache.md has the whole picture):

- a chunk key: ``model@world_size@worker_id@<chunk hash>@<kv dtype>``, the
  hash in lower-case hex, signed (``-1f3a``), then ``@<layer>`` for one
  layer of a layerwise cache, then ``@<tag>%<value>`` for each tag of the
  request;
- ``local_disk``: one file per key, ``<key with "/" -> "-">.pt``, holding
  the chunk's K/V bytes and nothing else (its shape and dtype live only in
  the memory of the process that wrote it);
- the ``fs`` connector: ``<key with "/" -> "-SEP-">.data``, a header of
  native int32 words (the data's length, its memory format, then per
  group a dtype code and a shape padded to four dimensions) and the bytes;
  written as ``.tmp`` and renamed, so a ``.tmp`` file is a write that never
  finished;
- chunk hashes (the in-process engine, Python's built-in hash, outside
  vLLM): ``h_i = hash((h_{i-1}, tuple(chunk_i), ()))`` from ``h_-1 = 0``,
  full chunks only;
- multiprocess mode (``lmcache server``): objects named
  ``<model with "/" -> "-SEP-">@0x<kv rank, 8 hex digits>@<object group,
  hex>@<chunk hash, hex>[@<salt>].data``, raw bytes without a header,
  chunk hashes by blake3: ``h_i = blake3(h_{i-1} || tokens as big-endian
  uint32)`` from ``h_-1 = blake3(8 zero bytes || 4 zero bytes)``.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import sys
from collections.abc import Sequence

from hmem.errors import CorruptStoreError, Hint

LMCACHE_VERSION = "0.5.6"  # the release whose files this module reads and writes
LOCAL_DISK_SUFFIX = ".pt"
FS_SUFFIX = ".data"
FS_TEMP_SUFFIX = ".tmp"  # an fs write not yet renamed: debris once its writer is gone
FS_SEPARATOR = "-SEP-"  # what the fs connector writes for each "/" of a key

# Bytes per element of each KV dtype name a key may carry.
KV_DTYPE_BYTES = {
    "half": 2,
    "bfloat16": 2,
    "float": 4,
    "double": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "fp8_e4m3fn": 1,
    "fp8_e4m3fnuz": 1,
    "fp8_e5m2": 1,
    "fp8_e5m2fnuz": 1,
}

# The fs header's dtype codes, as LMCache writes them, and its memory formats.
FS_DTYPE_CODES = {2: "half", 3: "bfloat16", 4: "float", 5: "double", 6: "uint8", 7: "fp8_e4m3fn", 8: "fp8_e5m2"}
MEMORY_FORMATS = {
    1: "KV_2LTD",  # [2, layers, tokens, hidden]: a whole chunk
    2: "KV_T2D",  # [tokens, 2, hidden]: one layer of a layerwise cache
    3: "KV_2TD",  # [2, tokens, hidden]: one layer, blending
    4: "BINARY",
    5: "BINARY_BUFFER",
    6: "KV_MLA_FMT",  # [1, layers, tokens, head]: MLA
    7: "EC_TD",
    8: "HS_TD",
}

_HASH = re.compile(r"-?[0-9a-f]+")
_HEX = re.compile(r"[0-9a-f]+")
_COUNT = re.compile(r"[0-9]{1,9}")  # a world size, worker id or layer: ASCII digits, a sane number of them
_BYTES_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_KV_RANK = re.compile(r"0x[0-9a-f]{8}")  # f"{hash:x}": lower-case hex, a minus sign for a negative hash
# native int32 words, as LMCache packs them (no byte order given)
_GROUP = struct.Struct("=5i")  # dtype code, then a shape padded to 4 dimensions
_LENGTH_AND_FORMAT = struct.Struct("=2i")


@dataclasses.dataclass(frozen=True)
class ChunkKey:
    """One LMCache key: a chunk (or one layer of it) of one request prefix,
    for one worker of one model."""

    model: str
    world_size: int
    worker_id: int
    chunk_hash: int
    kv_dtype: str
    layer: int | None = None  # a layerwise cache's layer
    tags: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        """The key as LMCache prints it."""
        parts = [self.model, str(self.world_size), str(self.worker_id), f"{self.chunk_hash:x}", self.kv_dtype]
        if self.layer is not None:
            parts.append(str(self.layer))
        parts += [f"{name}%{value}" for name, value in self.tags]
        return "@".join(parts)

    @classmethod
    def parse(cls, text: str) -> ChunkKey | None:
        """The key `text` names, or None when it cannot be an LMCache key."""
        parts = text.split("@")
        if len(parts) < 5 or not parts[0]:
            return None
        model, world, worker, chunk_hash, kv_dtype, *rest = parts
        if not (_COUNT.fullmatch(world) and _COUNT.fullmatch(worker)) or kv_dtype not in KV_DTYPE_BYTES:
            return None
        if _HASH.fullmatch(chunk_hash) is None:  # int(x, 16) would also take "0x", "_" and upper case
            return None
        value = int(chunk_hash, 16)
        layer = None
        if rest and _COUNT.fullmatch(rest[0]):
            layer = int(rest.pop(0))
        tags = []
        for part in rest:
            name, sep, tag_value = part.partition("%")
            if not sep or not name:
                return None
            tags.append((name, tag_value))
        return cls(model, int(world), int(worker), value, kv_dtype, layer, tuple(tags))

    def local_disk_name(self) -> str:
        return self.text.replace("/", "-") + LOCAL_DISK_SUFFIX

    def fs_name(self) -> str:
        return self.text.replace("/", FS_SEPARATOR) + FS_SUFFIX


def key_of_file(name: str) -> ChunkKey | None:
    """The key a cache file's name gives: an fs connector's ``.data`` file
    (its model name whole) or a local_disk ``.pt`` file (each "/" of the
    model name read back as "-", which the name cannot tell apart); None
    for a name of neither kind."""
    if name.endswith(FS_SUFFIX):
        return ChunkKey.parse(name[: -len(FS_SUFFIX)].replace(FS_SEPARATOR, "/"))
    if name.endswith(LOCAL_DISK_SUFFIX):
        return ChunkKey.parse(name[: -len(LOCAL_DISK_SUFFIX)])
    return None


@dataclasses.dataclass(frozen=True)
class FsHeader:
    """The header of an fs connector file."""

    length: int  # bytes of data after the header
    memory_format: str
    groups: tuple[tuple[str, tuple[int, ...]], ...]  # (kv dtype name, shape) per group

    @property
    def header_bytes(self) -> int:
        return _LENGTH_AND_FORMAT.size + _GROUP.size * len(self.groups)


def read_fs_header(head: bytes, file_size: int, name: str) -> FsHeader:
    """The header at the start of an fs connector file of `file_size`
    bytes (`head`: at least its first header's bytes; 8 + 20 per group),
    checked against the file: its data length is what follows the header,
    each group's dtype and shape known, and the shapes' bytes the data's
    length.  CorruptStoreError names what does not hold."""

    def bad(why: str) -> CorruptStoreError:
        return CorruptStoreError(f"{name}: not an LMCache fs chunk: {why}", hint=Hint.VERIFY)

    if len(head) < _LENGTH_AND_FORMAT.size or file_size < _LENGTH_AND_FORMAT.size:
        raise bad(f"{file_size} bytes, shorter than a header")
    length, fmt = _LENGTH_AND_FORMAT.unpack_from(head, 0)
    rest = file_size - length - _LENGTH_AND_FORMAT.size
    if length < 0 or rest < _GROUP.size or rest % _GROUP.size:
        raise bad(f"its header says {length} bytes of data, the file holds {file_size} bytes in all")
    if fmt not in MEMORY_FORMATS:
        raise bad(f"memory format {fmt} is not one LMCache writes")
    count = rest // _GROUP.size
    if len(head) < _LENGTH_AND_FORMAT.size + count * _GROUP.size:
        raise bad("the header was not read whole")
    groups = []
    total = 0
    for index in range(count):
        code, *shape = _GROUP.unpack_from(head, _LENGTH_AND_FORMAT.size + index * _GROUP.size)
        kv_dtype = FS_DTYPE_CODES.get(code)
        if kv_dtype is None:
            raise bad(f"group {index}: dtype code {code} is not one LMCache writes")
        while shape and shape[-1] == 0:  # padded to four dimensions with zeros
            shape.pop()
        if not shape or min(shape) <= 0:
            raise bad(f"group {index}: shape {shape} holds nothing")
        elements = 1
        for size in shape:
            elements *= size
        total += elements * KV_DTYPE_BYTES[kv_dtype]
        groups.append((kv_dtype, tuple(shape)))
    if total != length:
        raise bad(f"its shapes hold {total} bytes, its header says {length}")
    return FsHeader(length, MEMORY_FORMATS[fmt], tuple(groups))


def fs_header_bytes(memory_format: str, groups: Sequence[tuple[str, Sequence[int]]]) -> bytes:
    """The header LMCache's fs connector writes before a chunk's bytes:
    native int32 words, the data's length, the memory format's code, then
    per group (kv dtype name, shape of at most four dimensions) its dtype
    code and its shape padded to four dimensions with zeros (read back by
    ``read_fs_header``).  ValueError for a format, dtype or shape the
    header cannot carry."""
    formats = {name: code for code, name in MEMORY_FORMATS.items()}
    codes = {name: code for code, name in FS_DTYPE_CODES.items()}
    if memory_format not in formats:
        raise ValueError(f"memory format {memory_format!r} is none LMCache writes")
    words: list[bytes] = []
    length = 0
    for kv_dtype, shape in groups:
        if kv_dtype not in codes:
            raise ValueError(f"dtype {kv_dtype!r} has no fs header code")
        dims = [int(n) for n in shape]
        if not 0 < len(dims) <= 4 or min(dims) <= 0:
            raise ValueError(f"shape {dims} is not 1 to 4 positive dimensions")
        elements = 1
        for n in dims:
            elements *= n
        length += elements * KV_DTYPE_BYTES[kv_dtype]
        words.append(_GROUP.pack(codes[kv_dtype], *dims, *[0] * (4 - len(dims))))
    if not words:
        raise ValueError("a header holds at least one group")
    return _LENGTH_AND_FORMAT.pack(length, formats[memory_format]) + b"".join(words)


@dataclasses.dataclass(frozen=True)
class ObjectName:
    """One object of a multiprocess-mode (``lmcache server``) L2 fs cache:
    a chunk of one object group (the layers of one attention kind of a
    hybrid model) for one kv rank."""

    model: str
    kv_rank: int  # (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank
    group: int
    chunk_hash: str  # lower-case hex of the hash's bytes
    salt: str = ""

    @property
    def world_size(self) -> int:
        return self.kv_rank >> 24

    @property
    def rank(self) -> int:
        return (self.kv_rank >> 16) & 0xFF

    @property
    def text(self) -> str:
        parts = [self.model.replace("/", FS_SEPARATOR), f"{self.kv_rank:#010x}", f"{self.group:x}", self.chunk_hash]
        if self.salt:
            parts.append(self.salt)
        return "@".join(parts)

    def file_name(self) -> str:
        return self.text + FS_SUFFIX

    @classmethod
    def parse(cls, name: str) -> ObjectName | None:
        """The object a file name gives, or None when it names none."""
        if not name.endswith(FS_SUFFIX):
            return None
        parts = name[: -len(FS_SUFFIX)].split("@")
        if len(parts) not in (4, 5) or not parts[0]:
            return None
        model, rank, group, chunk_hash, *salt = parts
        if (
            _KV_RANK.fullmatch(rank) is None
            or _HEX.fullmatch(group) is None
            or _BYTES_HEX.fullmatch(chunk_hash) is None
        ):
            return None
        if salt and not salt[0]:
            return None
        return cls(model.replace(FS_SEPARATOR, "/"), int(rank, 16), int(group, 16), chunk_hash, salt[0] if salt else "")


def kv_rank(world_size: int, rank: int) -> int:
    """The kv rank multiprocess mode names a rank's objects by (its server
    takes the local world and rank to be the global ones)."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


def blake3_chunk_hashes(tokens: Sequence[int], chunk_size: int = 256) -> list[bytes]:
    """The hash of each full chunk of `tokens` as multiprocess mode computes
    it (blake3, its default): each over the previous hash's 32 bytes and
    the chunk's tokens as big-endian uint32.  Needs the blake3 package
    (``pip install 'hmem[lmcache]'``)."""
    try:
        import blake3
    except ImportError as exc:
        raise RuntimeError(
            "multiprocess-mode chunk hashes need the blake3 package: pip install 'hmem[lmcache]'"
        ) from exc
    previous = blake3.blake3(bytes(12)).digest()  # the hash of (0 as 8 bytes, one token 0)
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - len(tokens) % chunk_size, chunk_size):
        chunk = tokens[start : start + chunk_size]
        previous = blake3.blake3(previous + struct.pack(f">{len(chunk)}I", *chunk)).digest()
        hashes.append(previous)
    return hashes


def chunk_hashes(tokens: Sequence[int], chunk_size: int = 256, *, none_hash: int = 0) -> list[int]:
    """The hash of each full chunk of `tokens`, as LMCache's in-process
    engine computes it with Python's built-in hash (its default outside
    vLLM; under vLLM, `none_hash` comes from PYTHONHASHSEED): each depends
    on every chunk before it; a partial last chunk has none."""
    if sys.hash_info.width != 64:
        raise RuntimeError("LMCache's chunk hashes are those of a 64-bit Python")
    hashes: list[int] = []
    previous = none_hash
    for start in range(0, len(tokens) - len(tokens) % chunk_size, chunk_size):
        previous = hash((previous, tuple(int(t) for t in tokens[start : start + chunk_size]), ()))
        hashes.append(previous)
    return hashes
