"""The shard file format: standard safetensors holding the K/V tensors of entries.

This module is the only one that knows a shard's bytes: the index tensor
(ShardIndex: made, parsed with its one check, searched), the metadata keys,
the order of the data, what an entry costs in a file, and the length word.
The builder, the readers, verify, repair and the object-storage code call
it and name no offset or key of their own.

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

After the index come every F32 tensor, then every narrower one, so F32
data is 4-byte aligned and reads as zero-copy numpy views of the memory
map; an entry's keys and values lie side by side (k_0, v_0, k_1, v_1, ...),
so a result's K/V is one byte range.  ``__metadata__`` holds ``format`` =
"hmem-shard", ``format_version`` = "1", ``shard_uid``, ``store_config``,
per tensor ``crc32c:<name>`` and per entry with metadata ``meta:<id>``.
docs/format.md lists every name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io, file_reads
from hmem.errors import CorruptStoreError, Hint
from hmem.formats import safetensors
from hmem.formats.safetensors import bytes_view
from hmem.formats.store_files import SHARD_NAME as SHARD_NAME  # named in store_files
from hmem.formats.store_files import shard_file as shard_file
from hmem.kernels import checksum as checksum_kernels
from hmem.kernels import header_text

SHARD_FORMAT = "hmem-shard"
SHARD_FORMAT_VERSION = "1"
META_MAX_BYTES = 4096  # an entry's metadata as JSON, at most

# ---- metadata keys (docs/format.md, "Shards") -------------------------------------------

FORMAT_KEY = "format"
VERSION_KEY = "format_version"
UID_KEY = "shard_uid"
STORE_CONFIG_KEY = "store_config"  # the store's config as JSON: a lost index.json can be rebuilt
CRC_PREFIX = "crc32c:"  # + tensor name: that tensor's CRC-32C, 8 hex digits
META_PREFIX = "meta:"  # + entry id: that entry's metadata, a JSON object


def crc_key(tensor: str) -> str:
    return CRC_PREFIX + tensor


def meta_key(entry_id: int) -> str:
    return META_PREFIX + str(entry_id)


def uid_of(metadata: dict[str, Any]) -> str | None:
    """The shard uid its metadata records (any value: metadata carries no checksum)."""
    return metadata.get(UID_KEY)


def meta_of(metadata: dict[str, Any], entry_id: int) -> Any:
    """The metadata text an entry's key holds, unchecked (parse_meta checks it)."""
    return metadata.get(meta_key(entry_id))


# ---- tensors ----------------------------------------------------------------------------

INDEX_TENSOR = "hmem_index"
INDEX_MAGIC = int.from_bytes(b"HMEMIDX1", "little")
INDEX_VERSION = 1
INDEX_COLUMNS = 12
KINDS = ("k", "v", "p", "ks", "vs")  # index columns 2-6 (offsets) and 7-11 (CRCs)
PER_ENTRY_KINDS = ("p",)  # one tensor row per entry; the other kinds hold one row per token
PAIR = "kv"  # the block of an entry's keys and values, adjacent: k_0, v_0, k_1, v_1, ...
BLOCK_ORDER = (PAIR, "p", "ks", "vs")  # the blocks of each region (F32, then narrower), in file order

DTYPES: dict[str, np.dtype] = {name: safetensors.NUMPY_DTYPES[name] for name in ("F32", "F16", "I8", "I64")}
# numpy has no bfloat16: a BF16 tensor is held as its raw 16-bit words (a
# bfloat16 is the top half of a float32).  No shard holds U16 tensors, so the
# raw words' dtype names BF16 here without ambiguity.
DTYPES["BF16"] = np.dtype("<u2")
# The dtype of an entry's keys and values for each storage_dtype (StoreConfig).
KV_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "int8": "I8"}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEM_SIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}

# ---- what a file costs ------------------------------------------------------------------

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


def entry_file_bytes(n_tokens: Any, embed_dim: int, storage: str, pooled_keys: int = 1) -> Any:
    """Bytes an entry takes in a shard file at most: its tensors, their
    header entries and its index row (an int, or an array for an array of
    n_tokens); its metadata, if any, adds meta_bytes."""
    return (
        entry_bytes(n_tokens, embed_dim, storage, pooled_keys)
        + len(kinds(storage)) * HEADER_BYTES_PER_TENSOR
        + INDEX_ROW_BYTES
    )


def file_bytes_of(tensor_bytes: int, tensors: int, meta: str | None) -> int:
    """Bytes an entry takes in a shard file at most, given its tensors'
    bytes and count and its metadata (entry_file_bytes, for an entry
    whose tensors are already in a file)."""
    return tensor_bytes + tensors * HEADER_BYTES_PER_TENSOR + INDEX_ROW_BYTES + (meta_bytes(meta) if meta else 0)


def meta_bytes(meta: str) -> int:
    """An entry's metadata's share of the JSON header at most: the key, and
    the value with every character escaped."""
    return 2 * len(meta) + 40


def file_bytes_bound(entries: int, tensors: int, data_bytes: int) -> int:
    """An upper bound of the size of a shard file of `entries` entries and
    `tensors` tensors holding `data_bytes` (metadata's share included)."""
    return data_bytes + HEADER_FIXED_BYTES + HEADER_BYTES_PER_TENSOR * tensors + INDEX_ROW_BYTES * entries


def tensor_spec(
    kind: str, n_tokens: int, embed_dim: int, storage: str, pooled_keys: int = 1
) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape of one tensor of an entry in a store of this
    storage_dtype and signatures_per_entry (`pooled_keys`)."""
    if kind in ("k", "v"):
        return DTYPES[KV_DTYPES[storage]], (n_tokens, embed_dim)
    if kind == "p":
        return DTYPES["F32"], ((embed_dim,) if pooled_keys == 1 else (pooled_keys, embed_dim))
    return DTYPES["F32"], (n_tokens,)


# ---- the length word and the head -------------------------------------------------------

LENGTH_BYTES = safetensors.LENGTH_BYTES  # the length word, first in the file


def data_start(first_bytes: Any) -> int:
    """Where a shard's data (its hmem_index first) starts, from the file's
    first LENGTH_BYTES bytes."""
    return LENGTH_BYTES + safetensors.header_length(first_bytes)


def header_length(start: int) -> int:
    """The length word of a shard whose data starts at `start`."""
    return start - LENGTH_BYTES


def data_start_after(length: int) -> int:
    """Where the data starts after a JSON header of `length` bytes."""
    return LENGTH_BYTES + length


def index_bytes(entries: int) -> int:
    """The bytes of the hmem_index of a shard of `entries` entries."""
    return (entries + 1) * INDEX_ROW_BYTES


def head_bytes(start: int, entries: int) -> int:
    """The bytes a reader needs before any tensor: the length word, the JSON
    header and the hmem_index of a shard whose data starts at `start`."""
    return start + index_bytes(entries)


# ---- hmem_index -------------------------------------------------------------------------

_MAGIC_BYTES = INDEX_MAGIC.to_bytes(8, "little")


def uid_halves(uid: str) -> tuple[int, int]:
    """A 32-hex-digit uid as hmem_index's header row holds it: two signed
    64-bit halves, the high one first."""
    value = int(uid, 16)
    high, low = value >> 64, value & ((1 << 64) - 1)
    return high - (1 << 64) if high >= 1 << 63 else high, low - (1 << 64) if low >= 1 << 63 else low


class ShardIndex:
    """A shard's hmem_index tensor: int64 [entries + 1, 12], a header row
    then one row per entry (the module docstring).  A view of the file's
    bytes when read; an array of its own when a shard is encoded."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    @classmethod
    def new(cls, uid: str, ids: np.ndarray, n_tokens: np.ndarray) -> ShardIndex:
        """The index of a shard being encoded: its header row, each entry's
        id and n_tokens, and no tensor yet (-1)."""
        rows = np.full((len(ids) + 1, INDEX_COLUMNS), -1, dtype="<i8")
        rows[0, :5] = [INDEX_MAGIC, INDEX_VERSION, len(ids), *uid_halves(uid)]
        rows[1:, 0] = ids
        rows[1:, 1] = n_tokens
        return cls(rows)

    @classmethod
    def view(cls, buf: Any, offset: int, entries: int) -> ShardIndex:
        """The index of `entries` entries at `offset` of `buf`, not copied
        and not checked (problem() checks it); the caller made sure the
        bytes lie inside `buf`."""
        count = (entries + 1) * INDEX_COLUMNS
        return cls(np.frombuffer(buf, dtype="<i8", count=count, offset=offset).reshape(entries + 1, INDEX_COLUMNS))

    @classmethod
    def find(cls, buf: Any, start: int | None) -> tuple[ShardIndex | None, int]:
        """The index of a shard that may be damaged, and where it starts: at
        the data start its header gives (`start`), or, when that is damaged,
        at the first 8-aligned place holding its magic whose header row fits
        in the file (verify and repair, which trust neither)."""
        size = len(buf)
        candidates = [start] if start is not None else []
        at = 8
        while (at := buf.find(_MAGIC_BYTES, at)) != -1 and len(candidates) < 4:
            if at % 8 == 0:
                candidates.append(at)
            at += 1
        for begin in candidates:
            if begin is None or begin + 2 * INDEX_ROW_BYTES > size:
                continue
            head = np.frombuffer(buf, dtype="<i8", count=INDEX_COLUMNS, offset=begin)
            entries = int(head[2])
            if (
                head[0] == INDEX_MAGIC
                and head[1] == INDEX_VERSION
                and 0 <= entries <= (size - begin) // INDEX_ROW_BYTES - 1
            ):
                return cls.view(buf, begin, entries), begin
        return None, -1

    @property
    def entries(self) -> int:
        return len(self.rows) - 1

    @property
    def ids(self) -> np.ndarray:
        """The entries' ids, in row order (a view)."""
        return self.rows[1:, 0]

    def data(self) -> memoryview:
        """The index tensor's bytes."""
        return bytes_view(self.rows)

    def crc(self) -> int:
        return checksum_kernels.crc32c(self.data())

    def names_uid(self, uid: str) -> bool:
        """Whether the header row names the shard `uid` (a file replaced since
        a reader took its uid names another)."""
        return (int(self.rows[0, 3]), int(self.rows[0, 4])) == uid_halves(uid)

    def problem(self, entries: int, uid: str, crc: int | None = None) -> str | None:
        """What a reader refuses in this index, the one check of it (reads,
        verify, the heads object storage keeps), so that `verify` finds
        whatever a read refuses: a checksum other than `crc` (when given),
        a header row other than the one index.json describes (magic,
        version, entry count, the shard's uid), or entry ids not strictly
        increasing (a reader finds rows by binary search).  A crafted
        shard can carry any index whose CRC index.json records."""
        if crc is not None and self.crc() != crc:
            return "its entry index fails its checksum"
        head = self.rows[0]
        if int(head[0]) != INDEX_MAGIC or int(head[1]) != INDEX_VERSION or int(head[2]) != entries:
            return "its entry index has a wrong header row"
        if not self.names_uid(uid):
            return "its entry index names another uid than the one index.json records"
        ids = self.ids
        if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            return "its entry index lists entry ids out of order"
        return None

    def locate(self, row: int, kind: str) -> tuple[int, int]:
        """The data offset (-1: no such tensor) and recorded CRC-32C of a
        tensor of the entry at `row` (1 for the first entry)."""
        column = KINDS.index(kind)
        return int(self.rows[row, 2 + column]), int(self.rows[row, 7 + column])

    def pair_offsets(self, row: int) -> tuple[int, int]:
        """The data offsets of the keys and values of the entry at `row`."""
        k, v = self.rows[row, 2:4].tolist()  # KINDS[0] and [1]
        return k, v

    def place(self, rows: slice, kind: str, offsets: np.ndarray, crcs: np.ndarray) -> None:
        """Record where the tensors of one kind of the entries at `rows` lie
        and their CRC-32C (encoding)."""
        column = KINDS.index(kind)
        self.rows[rows, 2 + column] = offsets
        self.rows[rows, 7 + column] = crcs

    def tensors(
        self, start: int, embed_dim: int, storage: str, pooled_keys: int = 1
    ) -> dict[tuple[int, str], tuple[np.dtype, tuple[int, ...], int, int, int]]:
        """(entry_id, kind) -> dtype, shape, absolute start and end, recorded
        CRC of every tensor the index lists, for an index at `start` of the file."""
        found = {}
        for row in self.rows[1:].tolist():
            entry_id, n_tokens = row[0], row[1]
            for column, kind in enumerate(KINDS):
                offset = row[2 + column]
                if offset < 0:
                    continue
                dtype, shape = tensor_spec(kind, n_tokens, embed_dim, storage, pooled_keys)
                begin, crc = start + offset, row[7 + column]
                found[(entry_id, kind)] = (dtype, shape, begin, begin + math.prod(shape) * dtype.itemsize, crc)
        return found


# ---- encoding ---------------------------------------------------------------------------


@dataclasses.dataclass
class TensorBlock:
    """The tensors of one kind of a run of m entries, in entry order; for
    the PAIR block, each entry's keys then its values (2m tensors)."""

    dtype: np.dtype
    # the shapes of each entry's tensors: int64 [m, rank], or made when
    # needed from the row shape (one row per entry, or n_tokens rows)
    shapes: np.ndarray | tuple[tuple[int, ...], bool]
    bounds: np.ndarray  # int64 [tensors + 1]: tensor i is bytes bounds[i] .. bounds[i + 1] of the block
    data: list[Any]  # one buffer holding every tensor, or one _io.FileRange per tensor (copied by the kernel)
    crcs: np.ndarray | None  # uint32 [tensors]; None: computed from the one buffer when encoded

    @property
    def region(self) -> int:
        """F32 data first, then the narrower dtypes."""
        return 0 if self.dtype == DTYPES["F32"] else 1

    def shape_rows(self, n_tokens: np.ndarray) -> np.ndarray:
        """The tensors' shapes, int64 [m, rank], for entries of `n_tokens`."""
        if isinstance(self.shapes, np.ndarray):
            return self.shapes
        row_shape, per_entry = self.shapes
        shapes = np.empty((len(n_tokens), len(row_shape) + (0 if per_entry else 1)), dtype=np.int64)
        shapes[:, shapes.shape[1] - len(row_shape) :] = row_shape
        if not per_entry:
            shapes[:, 0] = n_tokens
        return shapes

    def shape_of(self, n_tokens: np.ndarray, row: int) -> tuple[int, ...]:
        """The shape of tensor `row`."""
        if isinstance(self.shapes, np.ndarray):
            return tuple(int(x) for x in self.shapes[row])
        row_shape, per_entry = self.shapes
        return row_shape if per_entry else (int(n_tokens[row]), *row_shape)


@dataclasses.dataclass
class EntryRun:
    """Entries of a shard with increasing ids, their tensors in blocks (one
    per kind, BLOCK_ORDER's names) and their metadata."""

    ids: np.ndarray  # int64 [m], increasing
    n_tokens: np.ndarray  # int64 [m]
    blocks: dict[str, TensorBlock]
    meta: dict[int, str]  # entry_id -> its metadata as JSON


def encode(uid: str, store_config: str, runs: Sequence[EntryRun]) -> tuple[list[Any], int]:
    """A shard file's bytes as buffers and file ranges (header, index, F32
    data, then the narrower data), and the CRC-32C of the index tensor.
    Everything per tensor (index rows, header text, checksums) is computed
    block by block with array operations and the kernels: a shard of
    100,000 small entries holds 300,000 tensors."""
    starts = np.cumsum([0] + [len(run.ids) for run in runs])
    index = ShardIndex.new(
        uid,
        np.concatenate([run.ids for run in runs]) if runs else np.zeros(0, np.int64),
        np.concatenate([run.n_tokens for run in runs]) if runs else np.zeros(0, np.int64),
    )
    data: list[Any] = []
    tensor_text: list[bytes] = []
    crc_text: list[bytes] = []
    at = index.rows.nbytes  # data offsets count from the start of the data, where hmem_index is
    for region in (0, 1):
        # each kind's tensors together: one header-text call for all of them
        members: dict[tuple[str, np.dtype], list[tuple]] = {}
        for unit in BLOCK_ORDER:
            for run, first in zip(runs, starts):
                block = run.blocks.get(unit)
                if block is None or block.region != region:
                    continue
                if block.crcs is None:
                    block.crcs = checksum_kernels.crc32c_pieces(block.data[0], block.bounds)
                rows = slice(1 + first, 1 + first + len(run.ids))
                begins, ends = at + block.bounds[:-1], at + block.bounds[1:]
                shapes = block.shape_rows(run.n_tokens)
                # a pair block's tensors alternate: k_0, v_0, k_1, v_1, ...
                for kind, pick in (
                    (("k", slice(0, None, 2)), ("v", slice(1, None, 2))) if unit == PAIR else ((unit, slice(None)),)
                ):
                    index.place(rows, kind, begins[pick], block.crcs[pick])
                    members.setdefault((kind, block.dtype), []).append(
                        (run.ids, shapes, begins[pick], ends[pick], block.crcs[pick])
                    )
                data.extend(block.data)
                at += int(block.bounds[-1])
        for (kind, dtype), pieces in members.items():
            name = f"{kind}_".encode()
            ids, shapes, begins, ends, crcs = (np.concatenate(column) for column in zip(*pieces))
            tensor_text.append(header_text.tensor_entries(name, ids, DTYPE_NAMES[dtype].encode(), shapes, begins, ends))
            crc_text.append(header_text.crc_entries(CRC_PREFIX.encode() + name, ids, crcs))
    index_crc = index.crc()
    metadata = {FORMAT_KEY: SHARD_FORMAT, VERSION_KEY: SHARD_FORMAT_VERSION, UID_KEY: uid}
    if store_config:
        metadata[STORE_CONFIG_KEY] = store_config
    for run in runs:
        metadata.update((meta_key(entry_id), text) for entry_id, text in run.meta.items())
    metadata[crc_key(INDEX_TENSOR)] = f"{index_crc:08x}"
    index_entry = safetensors.entry_text(INDEX_TENSOR, "I64", index.rows.shape, 0, index.rows.nbytes)
    header = safetensors.encode_text(metadata, crc_text, [index_entry, *tensor_text])
    return [header, index.data(), *data], index_crc


# ---- decoding ---------------------------------------------------------------------------

# How a shard's damaged header is worded (verify reports these).
_SHARD_WORDING = {
    "entry": "tensor {} has a malformed entry",
    "outside": "tensor {} lies outside the data",
    "size": "tensor {}'s size does not match its shape",
}


def _check_shard_metadata(metadata: Any) -> None:
    metadata = metadata or {}
    if not isinstance(metadata, dict) or metadata.get(FORMAT_KEY) != SHARD_FORMAT:
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


def store_config_text(path: Path) -> Any:
    """The store config (JSON text, unchecked) a shard file's metadata
    carries, for rebuilding a lost index.json (raises KeyError without one)."""
    return shard_metadata(path)[STORE_CONFIG_KEY]


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
    index: ShardIndex | None  # a sound hmem_index
    problems: list[tuple[str, str]]  # (finding code, message)

    @property
    def uid(self) -> str | None:
        """The uid the metadata records (unchecked)."""
        return uid_of(self.metadata)

    def meta(self, entry_id: int) -> Any:
        """An entry's metadata text as the header holds it (unchecked)."""
        return meta_of(self.metadata, entry_id)


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
    start = None
    try:
        metadata, entries, start = parse_header(buf, path.name)
        for name, (dtype, shape, begin, end) in entries.items():
            match = _NAME.match(name)
            if match:
                crc_text = metadata.get(crc_key(name))
                try:
                    crc = int(crc_text, 16) if crc_text is not None else None
                except ValueError:
                    crc = None
                from_header[(int(match.group(2)), match.group(1))] = (dtype, shape, begin, end, crc)
            elif name != INDEX_TENSOR:
                problems.append(("shard.header", f"unexpected tensor {name}"))
    except CorruptStoreError as exc:
        problems.append(("shard.header", exc.message))
    index, index_start = ShardIndex.find(buf, start)
    if index is None:
        problems.append(("shard.index", "no readable hmem_index"))
    else:
        expected = index_crc
        if expected is None:
            try:
                expected = int(metadata[crc_key(INDEX_TENSOR)], 16)
            except (KeyError, ValueError):
                expected = None
        if expected is not None and index.crc() != expected:
            problems.append(("shard.index", "hmem_index fails its checksum"))
            index = None
    if index is None:
        return ShardScan(size, metadata, from_header, None, problems)
    from_index: dict[tuple[int, str], tuple[np.dtype, tuple[int, ...], int, int, int | None]] = dict(
        index.tensors(index_start, embed_dim, storage, pooled_keys)
    )
    if from_header:
        for key in from_header.keys() | from_index.keys():
            a, b = from_header.get(key), from_index.get(key)
            if a is None or b is None or a[2:] != b[2:] or tuple(a[1]) != tuple(b[1]):
                problems.append(("shard.mismatch", f"{key[1]}_{key[0]}: the JSON header and hmem_index disagree"))
    return ShardScan(size, metadata, from_index, index, problems)
