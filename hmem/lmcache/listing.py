"""One pass over an LMCache cache directory: every file's name, size and
times, and what its name makes it, as columns.

A cache of 100,000 chunks is listed with one ``stat`` per file (the
irreducible part, what a plain directory listing costs) and its names
parsed by one regular expression over all of them at once: no Python
step per file beyond the listing itself (docs/benchmarks.md, "LMCache
caches").

What a file is (``kind``):

- ``local_disk``: a local_disk backend's chunk, ``<key>.pt``;
- ``fs``: an fs connector's chunk, ``<key>.data`` (a header, then bytes);
- ``mp``: a multiprocess-mode L2 object, ``<model>@0x<rank>@<group>@<hash>.data``;
- ``debris``: a ``.tmp`` file, an fs write never renamed (or in flight);
- ``foreign``: a regular file whose name is no chunk of any of these;
- ``other``: a directory, a symbolic link or a special file (never read,
  never followed, never deleted).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import operator
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hmem.formats import lmcache as fmt

KINDS = ("local_disk", "fs", "mp", "debris", "foreign", "other")
LOCAL_DISK, FS, MP, DEBRIS, FOREIGN, OTHER = range(len(KINDS))
CHUNK_KINDS = (LOCAL_DISK, FS, MP)
_by_name = operator.itemgetter(0)
_KNOWN_DTYPES = frozenset(fmt.KV_DTYPE_BYTES)

# One line per file name; each alternative is a whole line.  World size,
# worker and layer have at most 9 digits: a name with more is no chunk
# LMCache wrote (and would not fit the int64 columns).  The first is
# an in-process key (local_disk or fs), the second a multiprocess object.
_LINE = re.compile(
    r"^(?:"
    r"([^@\n]+)@(\d{1,9})@(\d{1,9})@(-?[0-9a-f]+)@([a-z0-9_]+)(?:@(\d{1,9}))?((?:@[^@%\n]+%[^@\n]*)*)\.(pt|data)"
    r"|([^@\n]+)@0x([0-9a-f]{8})@([0-9a-f]{1,8})@((?:[0-9a-f]{2})+)(?:@([^@\n]+))?\.data"
    r"|([^\n]*)"
    r")$",
    re.MULTILINE,
)
(
    _MODEL,
    _WORLD,
    _WORKER,
    _HASH,
    _DTYPE,
    _LAYER,
    _TAGS,
    _SUFFIX,
    _MP_MODEL,
    _MP_RANK,
    _MP_GROUP,
    _MP_HASH,
    _MP_SALT,
    _OTHER,
) = range(14)


@dataclasses.dataclass(frozen=True)
class CacheListing:
    """The files of one cache directory, one row each, sorted by name.

    Chunk columns hold, for rows that are no chunk, empty strings and -1.
    ``model`` is the name as the file gives it: whole for fs and mp files,
    each "/" a "-" for local_disk ones (which cannot be told apart)."""

    root: Path
    name: np.ndarray  # str
    kind: np.ndarray  # int8, an index into KINDS
    size: np.ndarray  # int64 bytes
    mtime_ns: np.ndarray  # int64
    atime_ns: np.ndarray  # int64
    model: np.ndarray  # str
    world_size: np.ndarray  # int64
    rank: np.ndarray  # int64: a key's worker id, an mp object's global rank
    chunk_hash: np.ndarray  # str: the hash as the name spells it (hex)
    kv_dtype: np.ndarray  # str: the key's KV dtype ("" for mp objects)
    layer: np.ndarray  # int64: a layerwise key's layer, else -1
    tags: np.ndarray  # str: "name%value" joined by "@", "" without tags
    group: np.ndarray  # int64: an mp object's group, else -1
    kv_rank: np.ndarray  # int64: an mp object's kv rank, else -1
    salt: np.ndarray  # str: an mp object's cache salt

    def __len__(self) -> int:
        return len(self.name)

    @property
    def chunks(self) -> np.ndarray:
        """Mask of the rows that are chunks (or mp objects)."""
        return self.kind <= MP

    def path(self, row: int) -> Path:
        return self.root / str(self.name[row])


def _stat_rows(root: Path) -> list[tuple[str, int, int, int, int]]:
    with os.scandir(root) as it:
        return [
            (e.name, st.st_mode, st.st_size, st.st_mtime_ns, st.st_atime_ns)
            for e in it
            for st in (e.stat(follow_symlinks=False),)
        ]


def list_cache(root: str | os.PathLike[str]) -> CacheListing:
    """List `root` (a directory; its subdirectories are rows of kind
    ``other``, not entered)."""
    # a listing makes a tuple or two per file: the cyclic garbage collector, which finds no
    # garbage in them, would pass over them again and again (a third of the time at 100k files)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _list_cache(Path(root))
    finally:
        if enabled:
            gc.enable()


def _ints(values: list[str]) -> np.ndarray:
    """Decimal numbers, each distinct text converted once (a column holds few)."""
    number = {v: int(v) for v in set(values)}
    return np.fromiter(map(number.__getitem__, values), dtype=np.int64, count=len(values))


def _texts(values: list[str], change: Callable[[str], str]) -> np.ndarray:
    """`change` of each text, as an object column, each distinct text changed once."""
    changed = {v: change(v) for v in set(values)}
    out = np.empty(len(values), dtype=object)
    out[:] = list(map(changed.__getitem__, values))
    return out


def _list_cache(root: Path) -> CacheListing:
    found = _stat_rows(root)
    found.sort(key=_by_name)  # names are unique: the order of the tuples, 3x faster
    n = len(found)
    if n:
        names_t, modes_t, sizes_t, mtimes_t, atimes_t = zip(*found)
    else:
        names_t = modes_t = sizes_t = mtimes_t = atimes_t = ()
    names = np.array(names_t, dtype=object)
    modes = np.fromiter(modes_t, dtype=np.int64, count=n)
    regular = (modes & 0o170000) == stat.S_IFREG
    # a name holding a newline would split the one-text parse below: parsed as ""
    text = "\n".join(names_t)
    if text.count("\n") > max(n - 1, 0):  # rare: only then a str copy of every name
        odd = np.char.find(names.astype(str), "\n") >= 0
        text = "\n".join(np.where(odd, "", names).tolist())
    else:
        odd = np.zeros(n, bool)
    # 14 texts per name, laid out row by row without np.array's look at each tuple's shape
    parts = np.fromiter(itertools.chain.from_iterable(_LINE.findall(text) if n else ()), dtype=object, count=14 * n)
    parts = parts.reshape(n, 14)

    key_row = parts[:, _SUFFIX] != ""
    mp_row = parts[:, _MP_RANK] != ""
    key_row &= np.fromiter(map(_KNOWN_DTYPES.__contains__, parts[:, _DTYPE].tolist()), dtype=bool, count=n)
    kind = np.full(n, FOREIGN, dtype=np.int8)
    kind[key_row & (parts[:, _SUFFIX] == "pt")] = LOCAL_DISK
    kind[key_row & (parts[:, _SUFFIX] == "data")] = FS
    kind[mp_row] = MP
    # a .tmp name is none of the chunk forms (they end .pt or .data): it is in the last alternative
    unparsed = np.flatnonzero(parts[:, _OTHER] != "")
    if len(unparsed):
        kind[unparsed[np.char.endswith(parts[unparsed, _OTHER].astype(str), fmt.FS_TEMP_SUFFIX)]] = DEBRIS
    kind[~regular | odd] = OTHER

    def ints(column: int, mask: np.ndarray, hexadecimal: bool = False) -> np.ndarray:
        out = np.full(n, -1, dtype=np.int64)
        if mask.any():
            if hexadecimal:  # up to 8 hex digits each: decoded all at once as big-endian words
                values = parts[mask, column].astype(str)
                out[mask] = np.frombuffer(bytes.fromhex("".join(np.char.zfill(values, 8).tolist())), dtype=">u4")
            else:
                out[mask] = _ints(parts[mask, column].tolist())
        return out

    is_key = (kind == LOCAL_DISK) | (kind == FS)
    is_mp = kind == MP
    model = np.where(is_key, parts[:, _MODEL], np.where(is_mp, parts[:, _MP_MODEL], ""))
    fs_like = (kind == FS) | is_mp
    if fs_like.any():  # fs and mp names spell each "/" of the model as "-SEP-"
        model[fs_like] = _texts(model[fs_like].tolist(), _unseparated)
    kv_ranks = ints(_MP_RANK, is_mp, hexadecimal=True)
    world = ints(_WORLD, is_key)
    rank = ints(_WORKER, is_key)
    world[is_mp] = kv_ranks[is_mp] >> 24
    rank[is_mp] = (kv_ranks[is_mp] >> 16) & 0xFF
    layer = ints(_LAYER, is_key & (parts[:, _LAYER] != ""))
    tags = np.where(is_key, parts[:, _TAGS], "")
    tagged = tags != ""
    if tagged.any():  # each tag begins "@": the first one's is dropped
        tags[tagged] = _texts(tags[tagged].tolist(), _after_first)
    return CacheListing(
        root=root,
        name=names,
        kind=kind,
        size=np.fromiter(sizes_t, dtype=np.int64, count=n),
        mtime_ns=np.fromiter(mtimes_t, dtype=np.int64, count=n),
        atime_ns=np.fromiter(atimes_t, dtype=np.int64, count=n),
        model=model,
        world_size=world,
        rank=rank,
        chunk_hash=np.where(is_key, parts[:, _HASH], np.where(is_mp, parts[:, _MP_HASH], "")),
        kv_dtype=np.where(is_key, parts[:, _DTYPE], ""),
        layer=layer,
        tags=tags,
        group=ints(_MP_GROUP, is_mp, hexadecimal=True),
        kv_rank=kv_ranks,
        salt=np.where(is_mp, parts[:, _MP_SALT], ""),
    )


def _unseparated(model: str) -> str:
    return model.replace(fmt.FS_SEPARATOR, "/")


def _after_first(tags: str) -> str:
    return tags[1:]
