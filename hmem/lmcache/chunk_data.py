"""One chunk file of an LMCache cache read whole, as importing
(hmem/lmcache/importing.py) and exporting (hmem/lmcache/exporting.py) both
read it: its bytes, its K/V viewed as its shape (checked against what its
header said a moment before), and those K/V cut into layers."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

import numpy as np

from hmem import file_reads
from hmem.errors import BadFileError, HmemError, InvalidArgumentError, storage_error
from hmem.formats import lmcache as fmt
from hmem.lmcache.cache import NUMPY_DTYPES, CacheDirectory, ChunkInfo
from hmem.lmcache.listing import MP

# the K/V dtypes an entry can hold, and their safetensors names
FLOAT_DTYPES = {"half": "F16", "bfloat16": "BF16", "float": "F32", "double": "F64"}


@dataclasses.dataclass(frozen=True)
class ChunkFile:
    """A chunk file as it was read: its info, its bytes, its K/V."""

    info: ChunkInfo
    data: bytes  # the whole file
    array: np.ndarray  # its K/V, of info.shape (bfloat16 as words)

    @property
    def payload(self) -> memoryview:
        """The K/V bytes (after an fs header)."""
        return memoryview(self.data)[len(self.data) - self.array.nbytes :]


def read_chunk_file(cache: CacheDirectory, row: int) -> ChunkFile:
    """A chunk file read whole, its K/V viewed as its shape.  BadFileError
    says why it cannot be (a multiprocess object, no shape known, a header
    that lies, a file that changed while read)."""
    if cache.listing.kind[row] == MP:
        raise BadFileError("a multiprocess-mode object: its layout is its object group's, which the file does not give")
    try:
        info = cache.chunk(row)
        if info.shape is None:
            raise BadFileError(f"its shape is {info.shape_source}")
        path = cache.listing.path(row)
        with os.fdopen(file_reads.open_regular(path), "rb") as f:
            data = f.read()
    except BadFileError:
        raise
    except HmemError as exc:
        raise BadFileError(exc.message, hint=exc.hint) from None
    except OSError as exc:
        raise BadFileError(str(storage_error(exc, "read", cache.listing.path(row), writing=False))) from None
    if len(data) != info.size:
        raise BadFileError("it changed while it was read (LMCache may be writing it)")
    dtype = np.dtype(NUMPY_DTYPES[info.kv_dtype])
    count = int(np.prod(info.shape))
    header = data[: len(data) - count * dtype.itemsize]  # empty for an fs file without one (save_chunk_meta: false)
    if info.kind == "fs" and header and header != fs_header(info):
        raise BadFileError("its header changed while it was read")
    array = np.frombuffer(data, dtype=dtype, count=count, offset=len(data) - count * dtype.itemsize)
    return ChunkFile(info, data, array.reshape(info.shape))


def chunk_rows(cache: CacheDirectory, rows: Iterable[int] | np.ndarray | None) -> np.ndarray:
    """The listing rows given (every chunk's by default), each checked to
    be a chunk's (not debris, a foreign file or a directory)."""
    chunks = np.flatnonzero(cache.listing.kind <= MP)
    if rows is None:
        return chunks
    chosen = np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows, dtype=np.int64).reshape(-1)
    bad = chosen[~np.isin(chosen, chunks)]
    if len(bad):
        raise InvalidArgumentError(f"row {int(bad[0])} of {cache.path} is not a chunk file (CacheDirectory.select)")
    return chosen


def fs_header(info: ChunkInfo) -> bytes:
    """The fs connector header of a chunk of `info`'s shape, as LMCache
    writes it (what an fs file must begin with, and what an export writes)."""
    assert info.shape is not None and info.memory_format is not None
    return fmt.fs_header_bytes(info.memory_format, [(info.kv_dtype, info.shape)])


def kv_layers(info: ChunkInfo, array: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(layer, keys [tokens, hidden], values [tokens, hidden]) of a chunk:
    views of `array`; an MLA latent is both keys and values."""
    shape, form = array.shape, info.memory_format
    if form == "KV_2LTD" and len(shape) == 4 and shape[0] == 2:
        return [(layer, array[0, layer], array[1, layer]) for layer in range(shape[1])]
    if form == "KV_MLA_FMT" and len(shape) == 4 and shape[0] == 1:
        return [(layer, array[0, layer], array[0, layer]) for layer in range(shape[1])]
    layer = info.layer if info.layer is not None else 0
    if form == "KV_T2D" and len(shape) == 3 and shape[1] == 2:
        return [(layer, array[:, 0], array[:, 1])]
    if form == "KV_2TD" and len(shape) == 3 and shape[0] == 2:
        return [(layer, array[0], array[1])]
    if form == "KV_MLA_FMT" and len(shape) == 2:
        return [(layer, array, array)]
    raise BadFileError(f"memory format {form} of shape {list(shape)} holds no K/V hmem imports")


def key_text(name: str) -> str:
    """The key a chunk file's name spells (the name less its suffix when
    it spells none)."""
    key = fmt.key_of_file(name)
    return key.text if key is not None else name.rsplit(".", 1)[0]
