"""The shard file format: standard safetensors holding the K/V tensors of entries.

A shard is written once, whole, and never modified.  Layout of the file
(the safetensors format):

    u64 little-endian   N, the length of the JSON header
    N bytes             JSON header, padded with spaces to a multiple of 8
    data                the tensors' bytes, back to back

The data region starts with ``hmem_index``, an I64 tensor of
[entries + 1, 12]: a header row (magic "HMEMIDX1", version, entry count,
the shard uid as two 64-bit halves) and one row per entry (entry_id,
n_tokens, the data offsets of its k, v, p, ks, vs tensors, -1 where absent,
and the CRC-32C of each).  hmem reads shards through this index, a
zero-copy view that needs no JSON parsing, so opening a shard costs
microseconds whatever its number of tensors.  The JSON header still lists
every tensor, so any safetensors reader opens the file; ``verify`` checks
that both agree.

After the index come every F32 tensor, then every I8 tensor, so F32 data is
4-byte aligned and reads as zero-copy numpy views of the memory map.
``__metadata__`` holds ``format`` = "hmem-shard", ``format_version`` = "1",
``shard_uid`` and, per tensor, ``crc32c:<name>``.  docs/format.md lists
every name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import re
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io, file_reads
from hmem.errors import CorruptStoreError, Hint
from hmem.formats import safetensors
from hmem.formats.layout import SHARD_NAME as SHARD_NAME  # named in layout
from hmem.formats.layout import shard_file as shard_file
from hmem.formats.safetensors import bytes_view
from hmem.kernels import checksum as checksum_kernels

SHARD_FORMAT = "hmem-shard"
SHARD_FORMAT_VERSION = "1"
CRC_PREFIX = "crc32c:"
META_PREFIX = "meta:"  # + entry id: that entry's metadata, a JSON object (docs/format.md, "Shards")
META_MAX_BYTES = 4096  # an entry's metadata as JSON, at most

INDEX_TENSOR = "hmem_index"
INDEX_MAGIC = int.from_bytes(b"HMEMIDX1", "little")
INDEX_VERSION = 1
INDEX_COLUMNS = 12
KINDS = ("k", "v", "p", "ks", "vs")  # index columns 2-6 (offsets) and 7-11 (CRCs)

DTYPES: dict[str, np.dtype] = {name: safetensors.NUMPY_DTYPES[name] for name in ("F32", "F16", "I8", "I64")}
# numpy has no bfloat16: a BF16 tensor is held as its raw 16-bit words (a
# bfloat16 is the top half of a float32).  No shard holds U16 tensors, so the
# raw words' dtype names BF16 here without ambiguity.
DTYPES["BF16"] = np.dtype("<u2")
# The dtype of an entry's keys and values for each storage_dtype (StoreConfig).
KV_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "int8": "I8"}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEM_SIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
# Upper bound of one tensor's share of the JSON header: its entry with
# 20-digit offsets and shape numbers, plus its checksum in the metadata.
HEADER_BYTES_PER_TENSOR = 200
HEADER_FIXED_BYTES = 256 + INDEX_COLUMNS * 8  # the metadata, the length word, the index's header row
INDEX_ROW_BYTES = INDEX_COLUMNS * 8


def kinds(storage: str) -> tuple[str, ...]:
    """The tensor kinds an entry has in a store of this storage_dtype."""
    return KINDS if storage == "int8" else KINDS[:3]


def entry_bytes(n_tokens: Any, embed_dim: int, storage: str, pooled_keys: int = 1) -> Any:
    """Tensor bytes one entry adds to a shard (keys, values, pooled keys,
    scales), not counting its index row and header entries (an int, or an
    array for an array of n_tokens).  `pooled_keys`: the store's
    signatures_per_entry."""
    kv = 2 * DTYPES[KV_DTYPES[storage]].itemsize * n_tokens * embed_dim + 4 * embed_dim * pooled_keys
    return kv + 2 * 4 * n_tokens if storage == "int8" else kv


# How a shard's damaged header is worded (verify reports these).
_SHARD_WORDING = {
    "entry": "tensor {} has a malformed entry",
    "outside": "tensor {} lies outside the data",
    "size": "tensor {}'s size does not match its shape",
}


def _check_shard_metadata(metadata: Any) -> None:
    metadata = metadata or {}
    if not isinstance(metadata, dict) or metadata.get("format") != SHARD_FORMAT:
        raise safetensors.SafetensorsError("it is not an hmem shard", reason="metadata")


def parse_header(buf: mmap.mmap | bytes, name: str) -> tuple[dict[str, str], dict[str, tuple], int]:
    """A shard's __metadata__, its tensors (name -> numpy dtype, shape,
    absolute start and end) and where its data starts."""
    try:
        header = safetensors.parse(
            buf,
            dtypes=_ITEM_SIZES,
            dtype_in_entry=True,  # a dtype no shard holds
            check_metadata=_check_shard_metadata,
        )
    except safetensors.SafetensorsError as exc:
        wording = _SHARD_WORDING.get(exc.reason)
        why = wording.format(exc.tensor) if wording else exc.message
        raise CorruptStoreError(f"shard {name} has a damaged header: {why}", hint=Hint.VERIFY) from None
    start = header.data_start
    entries = {
        tensor: (DTYPES[spec.dtype], spec.shape, start + spec.begin, start + spec.end)
        for tensor, spec in header.tensors.items()
    }
    return header.metadata or {}, entries, start


_NAME = re.compile(r"^(k|v|p|ks|vs)_(\d{1,20})$")


@dataclasses.dataclass
class ShardScan:
    """What a shard file holds, read through its hmem_index and its JSON
    header independently, for verify and repair (which must cope with
    damage to either)."""

    size: int  # bytes read: the file's size (a shard with too many holes: up to its first hole)
    metadata: dict[str, str]
    # (entry_id, kind) -> (dtype, shape, absolute start, absolute end, recorded CRC or None);
    # from hmem_index when it is sound, else from the JSON header
    tensors: dict[tuple[int, str], tuple[np.dtype, tuple[int, ...], int, int, int | None]]
    index_entries: np.ndarray | None  # [entries + 1, 12] view of a sound hmem_index
    problems: list[tuple[str, str]]  # (finding code, message)


def tensor_layout(
    kind: str, n_tokens: int, embed_dim: int, storage: str, pooled_keys: int = 1
) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape of one tensor of an entry in a store of this
    storage_dtype and signatures_per_entry (`pooled_keys`)."""
    if kind in ("k", "v"):
        return DTYPES[KV_DTYPES[storage]], (n_tokens, embed_dim)
    if kind == "p":
        return DTYPES["F32"], ((embed_dim,) if pooled_keys == 1 else (pooled_keys, embed_dim))
    return DTYPES["F32"], (n_tokens,)


_MAGIC_BYTES = INDEX_MAGIC.to_bytes(8, "little")


def uid_halves(uid: str) -> tuple[int, int]:
    """A 32-hex-digit uid as hmem_index's header row holds it: two signed
    64-bit halves, the high one first."""
    value = int(uid, 16)
    high, low = value >> 64, value & ((1 << 64) - 1)
    return high - (1 << 64) if high >= 1 << 63 else high, low - (1 << 64) if low >= 1 << 63 else low


def index_problem(index: np.ndarray, entries: int, uid: str) -> str | None:
    """What a reader refuses in an hmem_index that passes its checksum (one
    check for hmem/store/shard_reader.py and verify, so that `verify` finds
    whatever a read refuses): a header row other than the one index.json
    describes (magic, version, entry count, the shard's uid), or entry ids
    not strictly increasing (a reader finds rows by binary search).  A
    crafted shard can carry any index whose CRC index.json records."""
    head = index[0]
    if int(head[0]) != INDEX_MAGIC or int(head[1]) != INDEX_VERSION or int(head[2]) != entries:
        return "its entry index has a wrong header row"
    if (int(head[3]), int(head[4])) != uid_halves(uid):
        return "its entry index names another uid than the one index.json records"
    ids = index[1:, 0]
    if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        return "its entry index lists entry ids out of order"
    return None


def parse_meta(text: Any) -> dict[str, Any] | None:
    """An entry's metadata as the header's ``meta:<id>`` holds it, or None
    when it is not a JSON object (damaged or crafted: metadata carries no
    checksum).  Reads refuse such an entry; verify reports it."""
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or crafted to nest without end: docs/security.md
        return None
    return value if isinstance(value, dict) else None


def shard_metadata(path: Path) -> dict[str, str]:
    """The __metadata__ of a shard file (raises CorruptStoreError)."""
    with open(_io.open_regular(path), "rb") as f:  # no link, a regular file: docs/security.md
        size = f.seek(0, 2)
        if size < 8:
            raise CorruptStoreError(f"shard {path.name} is too short to be safetensors")
        buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    return parse_header(buf, path.name)[0]


def _find_index(buf: Any, data_start: int | None) -> tuple[np.ndarray | None, int]:
    """hmem_index and where it starts: at the data start the header gives,
    or, when that is damaged, at the first 8-aligned place holding its magic."""
    size = len(buf)
    candidates = [data_start] if data_start is not None else []
    at = 8
    while (at := buf.find(_MAGIC_BYTES, at)) != -1 and len(candidates) < 4:
        if at % 8 == 0:
            candidates.append(at)
        at += 1
    for start in candidates:
        if start is None or start + 2 * INDEX_ROW_BYTES > size:
            continue
        head = np.frombuffer(buf, dtype="<i8", count=INDEX_COLUMNS, offset=start)
        entries = int(head[2])
        if (
            head[0] != INDEX_MAGIC
            or head[1] != INDEX_VERSION
            or not 0 <= entries <= (size - start) // INDEX_ROW_BYTES - 1
        ):
            continue
        rows = entries + 1
        return np.frombuffer(buf, dtype="<i8", count=rows * INDEX_COLUMNS, offset=start).reshape(
            rows, INDEX_COLUMNS
        ), start
    return None, -1


def scan_shard(
    path: Path,
    *,
    embed_dim: int,
    storage: str,
    index_crc: int | None = None,
    pooled_keys: int = 1,
    holes_allowed: bool = False,
) -> ShardScan:
    """Read a shard without trusting its header or its index.  `index_crc`
    is what index.json records for the index (None when it is lost);
    `holes_allowed`: a copy of a shard on object storage holding only what
    was fetched (never judged by its holes)."""
    problems: list[tuple[str, str]] = []
    with open(_io.open_regular(path), "rb") as f:  # no link, a regular file: docs/security.md
        size = f.seek(0, 2)
        sparse = None if holes_allowed else file_reads.too_sparse(f.fileno())
        if sparse is not None:
            # read as far as its first hole only (a shard extended with holes keeps what it held
            # there): the holes would cost what the data does not (docs/security.md)
            problems.append(("shard.sparse", f"the shard {sparse}"))
            size = file_reads.leading_data(f.fileno())
        buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b""
    metadata: dict[str, str] = {}
    from_header: dict = {}
    data_start = None
    try:
        metadata, entries, data_start = parse_header(buf, path.name)
        for name, (dtype, shape, start, end) in entries.items():
            match = _NAME.match(name)
            if match:
                crc_text = metadata.get(CRC_PREFIX + name)
                try:
                    crc = int(crc_text, 16) if crc_text is not None else None
                except ValueError:
                    crc = None
                from_header[(int(match.group(2)), match.group(1))] = (dtype, shape, start, end, crc)
            elif name != INDEX_TENSOR:
                problems.append(("shard.header", f"unexpected tensor {name}"))
    except CorruptStoreError as exc:
        problems.append(("shard.header", exc.message))
    index, index_start = _find_index(buf, data_start)
    if index is None:
        problems.append(("shard.index", "no readable hmem_index"))
    else:
        expected = index_crc
        if expected is None:
            try:
                expected = int(metadata[CRC_PREFIX + INDEX_TENSOR], 16)
            except (KeyError, ValueError):
                expected = None
        if expected is not None and checksum_kernels.crc32c(bytes_view(index)) != expected:
            problems.append(("shard.index", "hmem_index fails its checksum"))
            index = None
    if index is None:
        return ShardScan(size, metadata, from_header, None, problems)
    from_index: dict[tuple[int, str], tuple[np.dtype, tuple[int, ...], int, int, int | None]] = {}
    for row in index[1:]:
        entry_id, n_tokens = int(row[0]), int(row[1])
        for column, kind in enumerate(KINDS):
            offset = int(row[2 + column])
            if offset < 0:
                continue
            dtype, shape = tensor_layout(kind, n_tokens, embed_dim, storage, pooled_keys)
            start = index_start + offset
            end = start + math.prod(shape) * dtype.itemsize
            from_index[(entry_id, kind)] = (dtype, shape, start, end, int(row[7 + column]))
    if from_header:
        for key in from_header.keys() | from_index.keys():
            a, b = from_header.get(key), from_index.get(key)
            if a is None or b is None or a[2:] != b[2:] or tuple(a[1]) != tuple(b[1]):
                problems.append(("shard.mismatch", f"{key[1]}_{key[0]}: the JSON header and hmem_index disagree"))
    return ShardScan(size, metadata, from_index, index, problems)
