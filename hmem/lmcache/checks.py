"""What ``CacheDirectory.verify`` checks in an LMCache cache directory,
and the report it gives: each chunk file against its name, its header and
the K/V shape; names that are no chunk, debris and entries never read;
with ``deep``, each chunk's values (zeros only, inf or NaN)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from hmem.errors import CorruptStoreError, storage_error
from hmem.formats import lmcache as fmt
from hmem.lmcache.chunk_values import non_finite_count
from hmem.lmcache.listing import DEBRIS, FOREIGN, FS, LOCAL_DISK, MP, OTHER

if TYPE_CHECKING:  # the cache calls verify_cache: imported at run time, it would be a cycle
    from hmem.lmcache.cache import CacheDirectory, ChunkInfo


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem `verify` found: the file, what is wrong, and how bad
    (``error``: LMCache would serve or fail on it; ``warning``: not a chunk
    LMCache reads, or a doubt)."""

    name: str
    problem: str
    detail: str
    severity: str = "error"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CacheVerifyReport:
    path: str
    files: int
    chunks_checked: int
    bytes_read: int
    deep: bool
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out


def verify_cache(cache: CacheDirectory, *, deep: bool = False) -> CacheVerifyReport:
    """``cache.verify(deep=deep)`` (its docstring says what is checked):
    the listing's entries that are no chunk, then each chunk file, and
    with `deep` each chunk's values, read one file at a time."""
    ls = cache.listing
    findings: list[Finding] = []
    bytes_read = 0
    for row in np.flatnonzero(ls.kind == FOREIGN).tolist():
        findings.append(Finding(str(ls.name[row]), "not a chunk", _why_not_a_chunk(str(ls.name[row])), "warning"))
    for row in np.flatnonzero(ls.kind == DEBRIS).tolist():
        findings.append(
            Finding(str(ls.name[row]), "debris", "an fs write never renamed into place (or in flight)", "warning")
        )
    for row in np.flatnonzero(ls.kind == OTHER).tolist():
        findings.append(
            Finding(str(ls.name[row]), "not a regular file", "a directory, link or device: not read", "warning")
        )
    rows = np.flatnonzero(ls.kind <= MP)
    if cache.kv_shape is None and ((ls.kind[rows] == LOCAL_DISK) | (ls.kind[rows] == MP)).any():
        findings.append(
            Finding(
                "",
                "shape unknown",
                "local_disk and multiprocess files hold bytes only: sizes were compared with each "
                "other, not with a shape (give --kv-shape LAYERS,HIDDEN or --model-config PATH)",
                "warning",
            )
        )
        findings += _odd_size_findings(cache, rows)
    bad_headers = 0
    for row in rows.tolist():
        name = str(ls.name[row])
        try:
            info, header = cache.chunk_and_header(row)
        except CorruptStoreError as exc:
            findings.append(Finding(name, "bad header", exc.message))
            bad_headers += 1
            continue
        except OSError as exc:
            findings.append(Finding(name, "unreadable", str(storage_error(exc, "read", ls.path(row), writing=False))))
            continue
        findings += _shape_findings(cache, info, header)
        if deep and info.shape is not None:
            try:
                _, data = cache.read(row)
            except (OSError, CorruptStoreError) as exc:
                findings.append(Finding(name, "unreadable", str(exc)))
                continue
            bytes_read += data.nbytes
            findings += _value_findings(info, data)
    fs_files = int((ls.kind == FS).sum())
    if cache.kv_shape is None and fs_files and bad_headers == fs_files:
        findings.append(
            Finding(
                "",
                "no fs header",
                f"none of the {fs_files} fs files starts with a header: an fs connector configured with "
                "save_chunk_meta: false writes none; give --kv-shape LAYERS,HIDDEN or --model-config PATH "
                "to read them as such",
                "warning",
            )
        )
    return CacheVerifyReport(str(cache.path), len(ls), len(rows), bytes_read, deep, tuple(findings))


def _shape_findings(cache: CacheDirectory, info: ChunkInfo, header: fmt.FsHeader | None) -> list[Finding]:
    """A chunk's header against its key, and its tokens and shape against
    the cache's chunk size and K/V shape."""
    out = []
    if header is not None:
        dtypes = sorted({d for d, _ in header.groups})
        if info.kv_dtype not in dtypes:
            out.append(Finding(info.name, "dtype differs", f"its key says {info.kv_dtype}, its header {dtypes}"))
        want = "KV_T2D" if info.layer is not None else "KV_2LTD"
        if header.memory_format not in (want, "KV_MLA_FMT", "KV_2TD"):
            what = "layer" if info.layer is not None else "chunk"
            out.append(Finding(info.name, "format differs", f"{header.memory_format} for a {what} key"))
    if info.shape is None:
        if info.kind != "fs" and cache.kv_shape is not None:
            out.append(Finding(info.name, "size fits no shape", info.shape_source))
        return out
    tokens = info.tokens or 0
    if tokens > cache.chunk_size:
        out.append(Finding(info.name, "too many tokens", f"{tokens} tokens, a chunk holds at most {cache.chunk_size}"))
    elif tokens < cache.chunk_size:
        out.append(
            Finding(
                info.name,
                "partial chunk",
                f"{tokens} of {cache.chunk_size} tokens: a partial last chunk (save_unfull_chunk) or a file cut short",
                "warning",
            )
        )
    if info.kind == "fs" and cache.kv_shape is not None and info.memory_format == "KV_2LTD":
        expect = (cache.kv_shape.planes, cache.kv_shape.layers, tokens, cache.kv_shape.hidden_for(info.world_size))
        if info.shape != expect:
            out.append(Finding(info.name, "shape differs", f"header {list(info.shape)}, model {list(expect)}"))
    return out


def _odd_size_findings(cache: CacheDirectory, rows: np.ndarray) -> list[Finding]:
    """Without a shape: local_disk and mp files whose size is not the
    most common one of their (model, world, rank, dtype, layer or group)."""
    ls = cache.listing
    rows = rows[(ls.kind[rows] == LOCAL_DISK) | (ls.kind[rows] == MP)]
    if not len(rows):
        return []
    label = np.char.add(ls.model[rows].astype(str), "\0")
    for column in (ls.world_size, ls.rank, ls.kv_dtype, ls.layer >= 0, ls.group):
        label = np.char.add(np.char.add(label, column[rows].astype(str)), "\0")
    out = []
    _, inverse = np.unique(label, return_inverse=True)
    for g in np.unique(inverse).tolist():
        members = rows[inverse == g]
        values, counts = np.unique(ls.size[members], return_counts=True)
        common = int(values[np.argmax(counts)])
        for row in members[ls.size[members] != common].tolist():
            out.append(
                Finding(
                    str(ls.name[row]),
                    "size differs",
                    f"{int(ls.size[row])} bytes where its kind's chunks hold {common}: a partial last "
                    "chunk or a file cut short",
                    "warning" if int(ls.size[row]) < common else "error",
                )
            )
    return out


def _why_not_a_chunk(name: str) -> str:
    if name.endswith((fmt.FS_SUFFIX, fmt.LOCAL_DISK_SUFFIX)):
        parts = name.rsplit(".", 1)[0].split("@")
        if len(parts) >= 5 and parts[4] not in fmt.KV_DTYPE_BYTES:
            return f"dtype {parts[4]!r} is none LMCache writes"
        return "its name parses as no LMCache key (model@world@worker@hash@dtype[@layer][@tag%value])"
    return "neither a .pt, .data nor .tmp file"


def _value_findings(info: ChunkInfo, data: np.ndarray) -> list[Finding]:
    """A chunk's K/V (as ``CacheDirectory.read`` gives them) all zeros, or
    holding inf or NaN (fp8 codes included)."""
    flat = data.reshape(-1)
    if not flat.any():
        return [Finding(info.name, "all zeros", "every byte is 0: space allocated, K/V never written")]
    bad = non_finite_count(info.kv_dtype, flat)
    if bad:
        return [Finding(info.name, "non-finite values", f"{bad} of {flat.size} values are inf or NaN")]
    return []


__all__ = ["CacheVerifyReport", "Finding", "verify_cache"]
