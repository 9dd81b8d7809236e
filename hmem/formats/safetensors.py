"""The safetensors container, read and written in one place.

A safetensors file is

    u64 little-endian   N, the length of the JSON header
    N bytes             JSON header, padded with spaces to a multiple of 8
    data                the tensors' bytes

The header maps each tensor name to its ``dtype``, ``shape`` and
``data_offsets`` (begin, end; relative to the start of the data), and may
hold ``__metadata__``, a map of strings.  hmem's shards are safetensors
files (docs/format.md, "Shards"), and so are the K/V files it imports and
exports (docs/cli.md).

``parse`` checks a header strictly (sizes are integers from 0 to 2**62,
never floats or booleans; byte sizes are computed with Python integers, so
no shape can overflow them) and raises SafetensorsError, which each reader
turns into its own error.  ``encode`` writes a header for tensors laid back
to back; ``encode_text`` one whose tensor entries are already JSON text
(shards of many tensors, hmem/store/shard_builder.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

LENGTH_BYTES = 8  # the u64 header length
HEADER_ALIGN = 8  # the JSON header is padded to a multiple of this
METADATA = "__metadata__"
_SIZE_LIMIT = 1 << 62

# Bytes per element of every dtype safetensors names.
ITEM_SIZES: dict[str, int] = {
    "F32": 4,
    "F16": 2,
    "F64": 8,
    "BF16": 2,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# The numpy dtype of each that numpy has (bfloat16 and float8 it has not).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
}
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}


class SafetensorsError(Exception):
    """A header that is not sound safetensors.  `reason` says which check
    failed ("short", "length", "json", "object", "metadata", "entry",
    "outside", "dtype", "size", "overlap", "gap", "tail") and `tensor`
    names the tensor concerned, so that a reader can word it its own way."""

    def __init__(self, message: str, *, reason: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.tensor = tensor


class TensorSpec(NamedTuple):
    dtype: str  # the safetensors dtype name
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorSpec]  # in the header's order
    metadata: Any  # the raw __metadata__ value, None when absent
    data_start: int  # file offset of the data: 8 + the header length


def _size(value: Any) -> int:
    """A non-negative integer of a header, refusing floats, bools and absurd sizes."""
    if type(value) is not int or not 0 <= value < _SIZE_LIMIT:
        raise ValueError(f"{value!r} is not a size")
    return value


def header_length(buf: Any) -> int:
    """The length word: the JSON header's length in bytes, from the first
    LENGTH_BYTES of `buf` (the data starts LENGTH_BYTES past it)."""
    (length,) = struct.unpack_from("<Q", buf, 0)
    return int(length)


def parse(
    buf: Any,
    *,
    dtypes: Mapping[str, int] = ITEM_SIZES,
    dtype_in_entry: bool = False,
    contiguous: bool = False,
    check_metadata: Callable[[Any], None] | None = None,
) -> Header:
    """The header of the safetensors bytes in `buf` (bytes or a memory map).

    `dtypes` are the dtype names accepted, with their item sizes; a dtype
    outside them is refused once the tensor's offsets are checked, or, with
    `dtype_in_entry`, as a malformed entry before them.  With `contiguous`,
    the tensors must also lie back to back and cover the data exactly, as
    the format requires.  `check_metadata` is given the raw ``__metadata__``
    before any tensor is checked and may raise SafetensorsError."""
    size = len(buf)
    if size < LENGTH_BYTES:
        raise SafetensorsError(f"too short to be safetensors ({size} bytes)", reason="short")
    length = header_length(buf)
    if length > size - LENGTH_BYTES:
        raise SafetensorsError(f"header length {length} runs past the end of the file", reason="length")
    try:
        header = json.loads(bytes(buf[LENGTH_BYTES : LENGTH_BYTES + length]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise SafetensorsError("the header is not valid JSON", reason="json") from None
    if not isinstance(header, dict):
        raise SafetensorsError("the header is not a JSON object", reason="object")
    metadata = header.pop(METADATA, None)
    if check_metadata is not None:
        check_metadata(metadata)
    data_start = LENGTH_BYTES + length
    data_len = size - data_start
    tensors: dict[str, TensorSpec] = {}
    for name, spec in header.items():
        try:
            dtype = str(spec["dtype"])
            shape = tuple(_size(x) for x in spec["shape"])
            begin, end = (_size(x) for x in spec["data_offsets"])
            if dtype_in_entry and dtype not in dtypes:
                raise ValueError(f"{dtype} is not one of {sorted(dtypes)}")
        except (KeyError, TypeError, ValueError, OverflowError):
            raise SafetensorsError(
                f"tensor {name!r} has a malformed header entry", reason="entry", tensor=name
            ) from None
        if not 0 <= begin <= end <= data_len:
            raise SafetensorsError(f"tensor {name!r} lies outside the file's data", reason="outside", tensor=name)
        item = dtypes.get(dtype)
        if item is None:
            raise SafetensorsError(f"tensor {name!r} has unknown dtype {dtype}", reason="dtype", tensor=name)
        if end - begin != math.prod(shape) * item:  # Python ints: no overflow
            raise SafetensorsError(
                f"tensor {name!r}: its byte size does not match shape {list(shape)}", reason="size", tensor=name
            )
        tensors[name] = TensorSpec(dtype, shape, begin, end)
    if contiguous:
        _check_contiguous(tensors, data_len)
    return Header(tensors, metadata, data_start)


def _check_contiguous(tensors: dict[str, TensorSpec], data_len: int) -> None:
    """Tensors back to back, covering the data: no gap, no overlap, no tail."""
    at = 0
    for name, spec in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if spec.begin != at:
            if spec.begin < at:
                raise SafetensorsError(f"tensor {name!r} overlaps another", reason="overlap", tensor=name)
            raise SafetensorsError(f"tensor {name!r} leaves a gap before it", reason="gap", tensor=name)
        at = spec.end
    if at != data_len:
        raise SafetensorsError(f"{data_len - at} bytes after the last tensor belong to none", reason="tail")


def encode(tensors: Iterable[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length word and JSON header of a file whose data holds the
    tensors (name, dtype name, shape, byte size) back to back in the order
    given; ``__metadata__`` comes first when there is any."""
    header: dict[str, Any] = {} if metadata is None else {METADATA: dict(metadata)}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def entry_text(name: str, dtype: str, shape: Sequence[int], begin: int, end: int) -> bytes:
    """One tensor's header entry followed by a comma, for encode_text."""
    entry = {"dtype": dtype, "shape": [int(x) for x in shape], "data_offsets": [int(begin), int(end)]}
    return json.dumps({name: entry}, separators=(",", ":"))[1:-1].encode() + b","


def encode_text(
    metadata: Mapping[str, str], metadata_entries: Sequence[bytes], tensor_entries: Sequence[bytes]
) -> bytes:
    """The length word and JSON header of a file whose tensor entries (with
    their offsets) are already written as JSON text, each followed by a
    comma (entry_text, or hmem.kernels.header_text for many at once), in
    pieces; ``__metadata__`` holds `metadata` and then `metadata_entries`,
    pieces of the same form.  The header is joined once: it is tens of MB
    for a shard of many small entries."""
    meta_pieces = [json.dumps(dict(metadata), separators=(",", ":"))[1:-1].encode() + b","] if metadata else []
    meta_pieces += [piece for piece in metadata_entries if piece]
    tensor_pieces = [piece for piece in tensor_entries if piece]
    parts: list[Any] = [b"", b'{"' + METADATA.encode() + b'":{', *_without_last_comma(meta_pieces), b"}"]
    if tensor_pieces:
        parts += [b",", *_without_last_comma(tensor_pieces)]
    parts.append(b"}")
    length = sum(len(part) for part in parts)
    pad = -length % HEADER_ALIGN
    parts[0] = struct.pack("<Q", length + pad)
    parts.append(b" " * pad)
    return b"".join(parts)


def _without_last_comma(pieces: list[bytes]) -> list[Any]:
    if not pieces:
        return []
    assert pieces[-1].endswith(b",")
    return [*pieces[:-1], memoryview(pieces[-1])[:-1]]


def bytes_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy."""
    return array.data.cast("B") if array.size else memoryview(b"")
