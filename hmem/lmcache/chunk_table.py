"""A cache's chunks as rows of a listing (``hmem ls``), built from the
listing's columns rather than a ChunkInfo per file: each chunk's
``ChunkInfo.to_dict()`` (``chunk_dicts``), or the same as compact JSON
objects built column by column (``chunk_json_lines``: 100,000 chunks are
what a large cache's listing holds), and the orders they list in
(``sort_rows``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from itertools import repeat
from typing import Any

import numpy as np

from hmem import validation
from hmem.errors import CorruptStoreError
from hmem.formats import lmcache as fmt
from hmem.lmcache.cache import CacheDirectory, ChunkInfo

CHUNK_SORTS = ("name", "size", "mtime", "atime")  # the orders sort_rows knows


def sort_rows(cache: CacheDirectory, rows: np.ndarray, by: str) -> np.ndarray:
    """`rows` (in name order, as ``select`` gives them) in the order `by`
    names (CHUNK_SORTS): name, size (largest first), mtime or atime (the
    least recent first); ties stay in name order."""
    by = validation.choice(by, "the order", CHUNK_SORTS)
    ls = cache.listing
    if by == "size":  # largest first, then by name (rows are in name order)
        return rows[np.argsort(-ls.size[rows], kind="stable")]
    if by in ("mtime", "atime"):
        column = ls.mtime_ns if by == "mtime" else ls.atime_ns
        return rows[np.argsort(column[rows], kind="stable")]
    return rows


# how a chunk's file name spells its key (ChunkInfo.key): the name less its
# suffix, and an fs file's model with each "/" as "-SEP-"
_SUFFIX = {"local_disk": fmt.LOCAL_DISK_SUFFIX, "fs": fmt.FS_SUFFIX, "mp": fmt.FS_SUFFIX}
_SEPARATOR = fmt.FS_SEPARATOR


def _shape_of(cache: CacheDirectory, row: int) -> ChunkInfo:
    """A chunk's ChunkInfo with its shape: an fs file's header read (when
    it can be: else its shape stays unknown, 'hmem verify' says why)."""
    try:
        return cache.chunk(row)
    except (CorruptStoreError, OSError):
        return next(cache.chunks(np.array([row])))


def _shape_groups(cache: CacheDirectory, rows: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The rows' groups of one shape: same kind, size, dtype, layerwise-ness
    and world size.  (index in `rows` of each group's first, group of each row)"""
    ls = cache.listing
    _, dtype_code = np.unique(ls.kv_dtype[rows].astype(str), return_inverse=True)
    label = np.stack(
        [
            ls.kind[rows].astype(np.int64),
            ls.size[rows],
            dtype_code.reshape(-1).astype(np.int64),
            (ls.layer[rows] >= 0).astype(np.int64),
            ls.world_size[rows],
        ],
        axis=1,
    )
    _, first, inverse = np.unique(label, axis=0, return_index=True, return_inverse=True)
    return first.tolist(), inverse.reshape(-1)


def chunk_dicts(cache: CacheDirectory, rows: np.ndarray) -> list[dict[str, Any]]:
    """ChunkInfo.to_dict() of each chunk of `rows`, built from the listing's
    columns (100,000 chunks in a fraction of a second): the shape is that
    of one chunk of the same kind, size, dtype, layerwise-ness and world
    size; for fs files, the header of one file of that size is read (one
    read per distinct size, not per file: listing stays a listing; 'hmem
    show' and 'hmem verify' read each file's own)."""
    ls = cache.listing
    if not len(rows):
        return []
    first_of, inverse = _shape_groups(cache, rows)
    shaped = [_shape_of(cache, int(rows[f])) for f in first_of]
    out = []
    columns = zip(
        inverse.tolist(),
        rows.tolist(),
        ls.name[rows].tolist(),
        ls.model[rows].tolist(),
        ls.world_size[rows].tolist(),
        ls.rank[rows].tolist(),
        ls.chunk_hash[rows].tolist(),
        ls.kv_dtype[rows].tolist(),
        ls.layer[rows].tolist(),
        ls.tags[rows].tolist(),
        ls.group[rows].tolist(),
        ls.size[rows].tolist(),
        (ls.mtime_ns[rows] / 1e9).tolist(),
        (ls.atime_ns[rows] / 1e9).tolist(),
    )
    for group, row, name, model, world, rank, chunk_hash, dtype, layer, tags, obj_group, size, mtime, atime in columns:
        like = shaped[group]
        kind = like.kind
        if kind == "fs" and like.name != name:
            if like.shape is None:  # its header could not be read: this file's own is
                like = _shape_of(cache, row)
                source = like.shape_source
            else:
                source = f"the header of {like.name} (same size)"
        else:
            source = like.shape_source
        key = name[: -len(_SUFFIX[kind])]
        out.append(
            {
                "name": name,
                "kind": kind,
                "key": key.replace(_SEPARATOR, "/") if kind == "fs" else key,
                "model": model,
                "world_size": world,
                "rank": rank,
                "chunk_hash": chunk_hash,
                "kv_dtype": dtype or like.kv_dtype,
                "layer": layer if layer >= 0 else None,
                "tags": tags,
                "group": obj_group if obj_group >= 0 else None,
                "size": size,
                "mtime": mtime,
                "atime": atime,
                "shape": list(like.shape) if like.shape is not None else None,
                "memory_format": like.memory_format,
                "shape_source": source,
                "tokens": like.tokens,
            }
        )
    return out


def _json_strings(values: list[str]) -> list[str]:
    """Each string as a JSON string literal less its quotes (the labels
    around it hold them), all encoded by one call of json's C encoder.
    Split at '", "', which no encoded string holds (a quote inside one is
    escaped)."""
    if not values:
        return []
    parts = json.dumps(values)[2:-2].split('", "')
    if len(parts) != len(values):  # cannot happen; never a wrong document if it does
        return [json.dumps(v)[1:-1] for v in values]
    return parts


def _few_json_strings(values: list[str]) -> list[str]:
    """_json_strings of a column of few distinct strings (a cache holds a
    few models): each distinct one encoded once."""
    text = {v: json.dumps(v)[1:-1] for v in set(values)}
    return list(map(text.__getitem__, values))


def _key_strings(name_strings: list[str], kind: np.ndarray) -> list[str]:
    """Each chunk's key (ChunkInfo.key) from its name's JSON text: the
    suffix cut, and for fs files each "-SEP-" a "/", done on the texts of
    one kind joined by newlines (which no JSON text holds).  JSON escapes
    hold neither "-" nor ".": they never make, nor break, a suffix or a
    separator."""
    out = np.empty(len(name_strings), dtype=object)
    texts = np.array(name_strings, dtype=object)
    for each in np.unique(kind).tolist():
        mask = kind == each
        suffix = _SUFFIX[each]
        joined = "\n".join(texts[mask].tolist()) + "\n"
        joined = joined.replace(suffix + "\n", "\n")
        if each == "fs":
            joined = joined.replace(_SEPARATOR, "/")
        keys = joined[:-1].split("\n")
        if len(keys) != int(mask.sum()):  # cannot happen; never a wrong document if it does
            keys = [
                t[: -len(suffix)].replace(_SEPARATOR, "/") if each == "fs" else t[: -len(suffix)]
                for t in texts[mask].tolist()
            ]
        out[mask] = keys
    return out.tolist()


def _int_strings(values: list[int], none: str = "null") -> list[str]:
    """Each number as JSON text, -1 as `none`; each distinct number converted once."""
    text = {v: str(v) if v >= 0 else none for v in set(values)}
    return list(map(text.__getitem__, values))


def chunk_json_lines(cache: CacheDirectory, rows: np.ndarray) -> list[str]:
    """chunk_dicts(cache, rows) as compact JSON objects, the same key
    order, built column by column (no Python step per chunk beyond the
    joins in C): a listing of 100,000 chunks is what 'hmem ls --json' of
    a large cache prints."""
    ls = cache.listing
    n = len(rows)
    if not n:
        return []
    first_of, inverse = _shape_groups(cache, rows)
    shaped = [_shape_of(cache, int(rows[f])) for f in first_of]
    tail_own = []  # per group: the text after "atime", for the file whose header was read ...
    tail_same = []  # ... and for other files of its size (their own header unread)
    for like in shaped:
        common = (
            f',"shape":{json.dumps(list(like.shape) if like.shape is not None else None)}'
            f',"memory_format":{json.dumps(like.memory_format)}'
        )
        tokens = f',"tokens":{json.dumps(like.tokens)}}}'
        tail_own.append(f'{common},"shape_source":{json.dumps(like.shape_source)}{tokens}')
        tail_same.append(f'{common},"shape_source":{json.dumps(f"the header of {like.name} (same size)")}{tokens}')
    group_kind = np.array([like.kind for like in shaped])[inverse]
    fs = group_kind == "fs"
    first = np.zeros(n, dtype=bool)
    first[first_of] = True
    tail_of = (inverse + len(shaped) * (fs & ~first)).tolist()
    tails = list(map((tail_own + tail_same).__getitem__, tail_of))
    names = _json_strings(ls.name[rows].tolist())
    keys = _key_strings(names, group_kind)
    # kind, world size, dtype and size are one per group: each with the labels around it, per group
    group_rows = rows[first_of]
    group_dtypes = [
        d or like.kv_dtype  # an mp object's name has no dtype: its header's, when it has one
        for d, like in zip(ls.kv_dtype[group_rows].tolist(), shaped)
    ]
    per_group = [
        [f'","kind":"{like.kind}","key":"' for like in shaped],
        [f'","world_size":{w},"rank":' for w in ls.world_size[group_rows].tolist()],
        [f'","kv_dtype":{json.dumps(d)},"layer":' for d in group_dtypes],
        [f',"size":{size},"mtime":' for size in ls.size[group_rows].tolist()],
    ]
    group_of = inverse.tolist()
    kind_key, world_rank, dtype_layer, size_mtime = (list(map(texts.__getitem__, group_of)) for texts in per_group)
    pieces = (  # each label holds the quotes of the strings around it
        ('{"name":"', names),
        ("", kind_key),
        ("", keys),
        ('","model":"', _few_json_strings(ls.model[rows].tolist())),
        ("", world_rank),
        ("", _int_strings(ls.rank[rows].tolist(), "-1")),
        (',"chunk_hash":"', _json_strings(ls.chunk_hash[rows].tolist())),
        ("", dtype_layer),
        ("", _int_strings(ls.layer[rows].tolist())),
        (',"tags":"', _json_strings(ls.tags[rows].tolist())),
        ('","group":', _int_strings(ls.group[rows].tolist())),
        ("", size_mtime),
        ("", list(map(repr, (ls.mtime_ns[rows] / 1e9).tolist()))),
        (',"atime":', list(map(repr, (ls.atime_ns[rows] / 1e9).tolist()))),
        ("", tails),
    )
    columns: list[Iterable[str]] = []
    for label, values in pieces:
        if label:
            columns.append(repeat(label, n))
        columns.append(values)
    out = list(map("".join, zip(*columns)))
    # fs files of a size whose first file's header could not be read: each its own
    for index in np.flatnonzero(fs & ~first).tolist():
        if shaped[int(inverse[index])].shape is None:
            out[index] = json.dumps(chunk_dicts(cache, rows[index : index + 1])[0], separators=(",", ":"))
    return out


__all__ = ["CHUNK_SORTS", "chunk_dicts", "chunk_json_lines", "sort_rows"]
