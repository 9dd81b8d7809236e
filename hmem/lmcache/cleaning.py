"""Cleaning an LMCache cache directory: a plan first (what would go and
why), then its execution, file by file re-checked.

What a plan deletes, each file once, for the first reason that applies:

- ``debris``: ``.tmp`` files LMCache's fs writers leave when a write never
  reaches its rename (``<key>.tmp``), older than a stated age (a younger
  one may be a write in flight);
- ``stale after restart``: local_disk files written before LMCache last
  started: its local_disk index lives only in the memory of the process
  that wrote them, so a restarted LMCache never reads them (it writes a
  chunk it stores again anew, with a new time);
- ``unreachable``: chunks stored after a hole in a request's prefix: each
  chunk's hash depends on every chunk before it and a lookup stops at the
  first chunk no tier holds, so nothing reaches them until the hole is
  stored again.  Files alone do not say which chunk follows which; the
  requests do (``unreachable_files``, built on the explanation of
  hmem/lmcache/hit_explanation.py);
- ``selected``: chunks of a chosen model, world size, rank, tag, dtype or
  layer, or named by file name or key;
- ``over byte cap``: the least recently used chunks until the chunks left
  fit in a byte cap.  "Used" is the files' access time (atime) by default,
  or their modification time (mtime, when LMCache wrote them); the plan
  says which, and whether the mount holding the directory updates atime on
  every read (``noatime`` never does, ``relatime`` at most once a day after
  a write), since only then is atime the time of last use.  A layerwise
  chunk's layer files, and a chunk's files of every rank, go together: a
  chunk with a layer or a rank missing is a miss whole.

Nothing else is ever deleted: never a file whose name is no LMCache chunk
or debris (``foreign``), never a directory, symbolic link or special file
(``other``), never a file outside the directory, never through a link.
Executing a plan (``clean``) re-checks each file just before deleting it:
still a regular file (``lstat``), of the planned size and modification
time, else it is skipped as changed since planned (a running LMCache may
have written it again); a file already gone (LMCache evicts too) is
counted as such.

Beside a running LMCache: its fs connector and multiprocess-mode L2 look a
chunk up by its file, so a deleted chunk is a miss.  Its local_disk backend
looks chunks up in an index held in its memory: a local_disk file deleted
while LMCache runs still counts as a hit at its next lookup, whose load then
finds no file (LMCache 0.5.6 logs "File not found on disk" and forgets the
chunk; a lookup of a single chunk then fails its retrieval).  A plan says
so when it deletes such files; files written before a restart are in no
running index and are safe to delete at any time.

Planning works on the listing's columns at once (numpy): no Python step
per file but building the plan's rows.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hmem import _io
from hmem.errors import EntryNotFoundError, InvalidArgumentError, StorageError
from hmem.formats import lmcache as fmt
from hmem.lmcache.cache import CacheDirectory
from hmem.lmcache.listing import DEBRIS, KINDS, LOCAL_DISK, MP

if TYPE_CHECKING:
    from hmem.lmcache.hit_explanation import Deployment, Request

DEBRIS_REASON = "debris"
STALE_REASON = "stale after restart"
UNREACHABLE_REASON = "unreachable"
SELECTED_REASON = "selected"
OVER_CAP_REASON = "over byte cap"
# in the order they are applied: a file planned for one is not planned again
REASONS = (DEBRIS_REASON, STALE_REASON, UNREACHABLE_REASON, SELECTED_REASON, OVER_CAP_REASON)
CLOCKS = ("atime", "mtime")
DELETABLE_KINDS = ("local_disk", "fs", "mp", "debris")

# skip reasons of a clean
ALREADY_GONE = "already gone"
CHANGED = "changed since planned"
NOT_REGULAR = "not a regular file"
NOT_CACHE_FILE = "not a cache file"
NOT_DELETED = "could not delete"
STOPPED = "not attempted: stopped"

_BATCH = 64  # files checked, then deleted, then the directory synced once


@dataclasses.dataclass(frozen=True)
class MountInfo:
    """The mount holding a cache directory, as /proc/self/mounts gives it."""

    mount_point: str
    fs_type: str
    options: tuple[str, ...]

    @property
    def atime_updates(self) -> str:
        """When a read updates a file's atime: ``never`` (noatime), ``every
        read`` (strictatime), or ``relatime`` (only the first read after a
        write, or a read a day after the last update)."""
        if "noatime" in self.options:
            return "never"
        if "strictatime" in self.options:
            return "every read"
        return "relatime"  # the kernel's default when none is given

    def to_dict(self) -> dict:
        return {
            "mount_point": self.mount_point,
            "fs_type": self.fs_type,
            "options": list(self.options),
            "atime_updates": self.atime_updates,
        }


def _unescape_mount_field(text: str) -> str:
    # /proc/self/mounts spells space, tab, newline and backslash as octal escapes
    for code in ("\\040", "\\011", "\\012", "\\134"):
        text = text.replace(code, chr(int(code[1:], 8)))
    return text


def mount_of(path: str | os.PathLike[str], mounts_file: str = "/proc/self/mounts") -> MountInfo | None:
    """The mount holding `path` (the longest mount point that contains its
    real path; the last one mounted there), or None when the mount table
    cannot be read (not Linux)."""
    real = os.path.realpath(path)
    try:
        with open(mounts_file, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: MountInfo | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = _unescape_mount_field(fields[1])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = MountInfo(point, fields[2], tuple(fields[3].split(",")))
    return best


@dataclasses.dataclass(frozen=True)
class PlannedFile:
    """One file a plan deletes, and why."""

    name: str
    kind: str  # "local_disk", "fs", "mp" or "debris"
    reason: str  # one of REASONS
    size: int
    mtime_ns: int
    atime_ns: int

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "reason": self.reason,
            "size": self.size,
            "mtime": self.mtime_ns / 1e9,
            "atime": self.atime_ns / 1e9,
        }


@dataclasses.dataclass(frozen=True)
class CleanPlan:
    """What a clean of one cache directory deletes (``files``, in the order
    of REASONS; over the byte cap least recently used first) and what the
    directory's chunks come to after it."""

    path: str
    files: tuple[PlannedFile, ...]
    chunks_before: int
    chunk_bytes_before: int
    chunks_after: int
    chunk_bytes_after: int
    now: float
    max_bytes: int | None = None
    clock: str | None = None  # "atime" or "mtime": what "least recently used" was read from
    mount: MountInfo | None = None
    missing: tuple[str, ...] = ()  # names or keys given that name no chunk or debris file
    kept_debris: tuple[str, ...] = ()  # .tmp files whose name is no LMCache write's: never deleted
    warnings: tuple[str, ...] = ()
    asked: dict = dataclasses.field(default_factory=dict)  # what the plan was asked for

    @property
    def count(self) -> int:
        return len(self.files)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def by_reason(self) -> dict[str, dict[str, int]]:
        """Files and bytes per reason (the reasons that have any)."""
        out: dict[str, dict[str, int]] = {}
        for f in self.files:
            entry = out.setdefault(f.reason, {"files": 0, "bytes": 0})
            entry["files"] += 1
            entry["bytes"] += f.size
        return {reason: out[reason] for reason in REASONS if reason in out}

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "files": [f.to_dict() for f in self.files],
            "count": self.count,
            "bytes": self.bytes,
            "by_reason": self.by_reason(),
            "chunks_before": self.chunks_before,
            "chunk_bytes_before": self.chunk_bytes_before,
            "chunks_after": self.chunks_after,
            "chunk_bytes_after": self.chunk_bytes_after,
            "now": self.now,
            "max_bytes": self.max_bytes,
            "clock": self.clock,
            "mount": self.mount.to_dict() if self.mount else None,
            "missing": list(self.missing),
            "kept_debris": list(self.kept_debris),
            "warnings": list(self.warnings),
            "asked": dict(self.asked),
        }


@dataclasses.dataclass(frozen=True)
class SkippedFile:
    """A planned file a clean did not delete, and why."""

    name: str
    reason: str  # CHANGED, NOT_REGULAR, NOT_CACHE_FILE, NOT_DELETED or STOPPED
    detail: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CleanReport:
    """What a clean did: the files it deleted, those already gone, those it
    skipped (and why), and whether a stop request cut it short."""

    path: str
    deleted: tuple[str, ...]
    deleted_bytes: int
    already_gone: tuple[str, ...]
    skipped: tuple[SkippedFile, ...]
    stopped: bool = False

    @property
    def problems(self) -> tuple[SkippedFile, ...]:
        """The skipped files but those a stop left unattempted."""
        return tuple(s for s in self.skipped if s.reason != STOPPED)

    @property
    def complete(self) -> bool:
        """Every planned file is gone (deleted now or before)."""
        return not self.skipped

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "deleted": list(self.deleted),
            "deleted_count": len(self.deleted),
            "deleted_bytes": self.deleted_bytes,
            "already_gone": list(self.already_gone),
            "skipped": [s.to_dict() for s in self.skipped],
            "stopped": self.stopped,
            "complete": self.complete,
        }


# ---- planning ---------------------------------------------------------------------------


def _check_seconds(value: float | None, what: str) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(f"{what} must be a number of seconds >= 0, got {value!r}")


def _chunk_labels(cache: CacheDirectory, rows: np.ndarray, *, by_rank: bool, by_layer: bool) -> np.ndarray:
    """A text per row naming its chunk: rows of one label are the files of
    one chunk (its layers unless `by_layer`, its ranks unless `by_rank`)."""
    ls = cache.listing
    columns: list[np.ndarray] = [
        ls.kind,
        ls.model,
        ls.world_size,
        ls.chunk_hash,
        ls.kv_dtype,
        ls.tags,
        ls.group,
        ls.salt,
    ]
    if by_rank:
        columns.append(ls.rank)
    if by_layer:
        columns.append(ls.layer)
    label = np.full(len(rows), "", dtype=object).astype(str)
    for column in columns:
        label = np.char.add(np.char.add(label, column[rows].astype(str)), "\0")
    return label


def _lmcache_debris(names: np.ndarray) -> np.ndarray:
    """Mask of the ``.tmp`` names that are an LMCache write's: ``<key or
    object name>.tmp``."""
    return np.array([_kind_of_name(n) == "debris" for n in names.tolist()], dtype=bool)


def _kind_of_name(name: str) -> str | None:
    """What LMCache file a name is, from the name alone: a chunk's kind,
    ``debris`` for the temporary file of an fs write of a chunk, or None."""
    if name.endswith(fmt.FS_TEMP_SUFFIX):
        final = name[: -len(fmt.FS_TEMP_SUFFIX)] + fmt.FS_SUFFIX
        return "debris" if _kind_of_name(final) in ("fs", "mp") else None
    if fmt.ObjectName.parse(name) is not None:
        return "mp"
    if fmt.key_of_file(name) is not None:
        return "fs" if name.endswith(fmt.FS_SUFFIX) else "local_disk"
    return None


def _rows_named(cache: CacheDirectory, names: Iterable[str]) -> tuple[list[int], list[str]]:
    """The rows of the chunk or debris files given by file name or key, and
    the names that give none."""
    ls = cache.listing
    sorted_names = ls.name.astype(str)
    rows, missing = [], []
    for name in names:
        at = int(np.searchsorted(sorted_names, name))
        if at < len(ls) and sorted_names[at] == name and ls.kind[at] <= DEBRIS:
            if ls.kind[at] != DEBRIS or _kind_of_name(name) == "debris":  # never a .tmp not LMCache's
                rows.append(at)
            else:
                missing.append(name)
            continue
        key = fmt.ChunkKey.parse(name)
        if key is not None:  # a key: its file in every form the directory holds (local_disk, fs)
            found = [
                int(at)
                for candidate in (key.local_disk_name(), key.fs_name())
                for at in (np.searchsorted(sorted_names, candidate),)
                if at < len(ls) and sorted_names[at] == candidate and ls.kind[at] <= MP
            ]
            if found:
                rows += found
                continue
        try:
            rows.append(cache.row_of(name))
        except (EntryNotFoundError, InvalidArgumentError):
            missing.append(name)
    return rows, missing


def plan_clean(
    cache: CacheDirectory,
    *,
    debris_older_than: float | None = None,
    restarted_at: float | None = None,
    unreachable: Iterable[str] = (),
    names: Iterable[str] = (),
    model: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    tag: str | None = None,
    kv_dtype: str | None = None,
    layer: int | None = None,
    max_bytes: int | None = None,
    by: str = "atime",
    now: float | None = None,
) -> CleanPlan:
    """Plan a clean of `cache` (module docstring); nothing is deleted.

    - `debris_older_than`: delete LMCache's ``.tmp`` files whose mtime is
      more than this many seconds before `now`;
    - `restarted_at`: the unix time LMCache last started: delete local_disk
      files written before it;
    - `unreachable`: file names (or keys) of chunks stored after a hole
      (``unreachable_files`` finds them for given requests);
    - `names`, and `model`, `world_size`, `rank`, `tag` (``name%value``, or
      ``none``: untagged), `kv_dtype`, `layer`: delete the named files, and
      the chunks matching every given field (none given: none selected);
    - `max_bytes`: then delete the least recently used chunks (`by`
      ``atime`` or ``mtime``) until the chunks left take at most this many
      bytes.
    """
    now = time.time() if now is None else float(now)
    _check_seconds(debris_older_than, "debris_older_than")
    _check_seconds(restarted_at, "restarted_at")
    if restarted_at is not None and restarted_at > now:
        raise InvalidArgumentError(f"restarted_at {restarted_at} is after now ({now}): give when LMCache last started")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise InvalidArgumentError(f"max_bytes must be a whole number of bytes >= 0, got {max_bytes!r}")
    if by not in CLOCKS:
        raise InvalidArgumentError(f"by {by!r}: least recent use is read from {' or '.join(CLOCKS)}")
    for what, number in (("world_size", world_size), ("rank", rank), ("layer", layer)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 0):
            raise InvalidArgumentError(f"{what} must be a whole number >= 0, got {number!r}")
    if world_size == 0:
        raise InvalidArgumentError("world_size must be at least 1")
    if tag is not None and tag != "none" and ("%" not in tag or tag.startswith("%") or "@" in tag):
        raise InvalidArgumentError(f"tag {tag!r}: give name%value (as in the file names), or none for untagged chunks")
    if kv_dtype is not None and kv_dtype not in fmt.KV_DTYPE_BYTES:
        raise InvalidArgumentError(f"kv_dtype {kv_dtype!r} is none of {', '.join(fmt.KV_DTYPE_BYTES)}")

    ls = cache.listing
    n = len(ls)
    reason = np.full(n, -1, dtype=np.int8)  # an index into REASONS
    chunk = ls.kind <= MP
    warnings: list[str] = []
    now_ns = int(now * 1e9)

    def assign(mask: np.ndarray, which: str) -> None:
        reason[mask & (reason < 0)] = REASONS.index(which)

    debris = ls.kind == DEBRIS
    theirs = np.zeros(n, dtype=bool)
    if debris.any():
        theirs[debris] = _lmcache_debris(ls.name[debris])
    kept_debris = tuple(ls.name[debris & ~theirs].tolist())
    if debris_older_than is not None:
        assign(theirs & (now_ns - ls.mtime_ns > int(debris_older_than * 1e9)), DEBRIS_REASON)
        young = theirs & (now_ns - ls.mtime_ns <= int(debris_older_than * 1e9))
        if young.any():
            warnings.append(
                f"{int(young.sum())} .tmp file(s) younger than {debris_older_than:g} s kept: a write may be in flight"
            )
    if kept_debris:
        warnings.append(f"{len(kept_debris)} .tmp file(s) not named as an LMCache write's kept (never deleted)")

    if restarted_at is not None:
        assign((ls.kind == LOCAL_DISK) & (ls.mtime_ns < int(restarted_at * 1e9)), STALE_REASON)

    missing: list[str] = []
    unreachable = list(unreachable)
    if unreachable:
        rows, lost = _rows_named(cache, unreachable)
        missing += lost
        mask = np.zeros(n, dtype=bool)
        mask[rows] = True
        assign(mask & chunk, UNREACHABLE_REASON)

    names = list(names)
    selected = np.zeros(n, dtype=bool)
    if names:
        rows, lost = _rows_named(cache, names)
        missing += lost
        selected[rows] = True
    criteria = {
        "model": model,
        "world_size": world_size,
        "rank": rank,
        "kv_dtype": kv_dtype,
        "tag": tag,
        "layer": layer,
    }
    if any(v is not None for v in criteria.values()):
        rows_of = cache.select(model=model, world_size=world_size, rank=rank, kv_dtype=kv_dtype, tag=tag, layer=layer)
        selected[rows_of] = True
    assign(selected, SELECTED_REASON)

    cap_order = np.zeros(0, dtype=np.int64)
    clock = None
    mount = None
    if max_bytes is not None:
        clock = by
        mount = mount_of(cache.path)
        warnings += _clock_warnings(by, mount)
        left_rows = np.flatnonzero(chunk & (reason < 0))
        left = int(ls.size[left_rows].sum())
        if left > max_bytes:
            cap_order = _over_cap(cache, left_rows, left - max_bytes, ls.atime_ns if by == "atime" else ls.mtime_ns)
            reason[cap_order] = REASONS.index(OVER_CAP_REASON)

    indexed = (ls.kind == LOCAL_DISK) & (reason >= 0) & (reason != REASONS.index(STALE_REASON))
    if indexed.any():
        warnings.append(
            f"{int(indexed.sum())} local_disk file(s) to delete may be in a running LMCache's in-memory index: "
            "it counts each as a hit until its load finds no file (then it forgets the chunk); "
            "delete them while LMCache is stopped"
        )

    planned = np.flatnonzero(reason >= 0)
    planned = planned[np.lexsort((planned, reason[planned]))]  # by reason, then name
    if len(cap_order):  # the cap's rows least recently used first
        planned = np.concatenate([planned[reason[planned] != REASONS.index(OVER_CAP_REASON)], cap_order])
    files = tuple(
        PlannedFile(name, KINDS[k], REASONS[r], size, mtime, atime)
        for name, k, r, size, mtime, atime in zip(
            ls.name[planned].tolist(),
            ls.kind[planned].tolist(),
            reason[planned].tolist(),
            ls.size[planned].tolist(),
            ls.mtime_ns[planned].tolist(),
            ls.atime_ns[planned].tolist(),
        )
    )
    gone_chunks = chunk & (reason >= 0)
    asked: dict[str, Any] = {
        "debris_older_than": debris_older_than,
        "restarted_at": restarted_at,
        "unreachable": len(unreachable),
        "names": names,
        **{k: v for k, v in criteria.items() if v is not None},
        "max_bytes": max_bytes,
        "by": by if max_bytes is not None else None,
    }
    return CleanPlan(
        path=str(cache.path),
        files=files,
        chunks_before=int(chunk.sum()),
        chunk_bytes_before=int(ls.size[chunk].sum()),
        chunks_after=int((chunk & ~gone_chunks).sum()),
        chunk_bytes_after=int(ls.size[chunk & ~gone_chunks].sum()),
        now=now,
        max_bytes=max_bytes,
        clock=clock,
        mount=mount,
        missing=tuple(missing),
        kept_debris=kept_debris,
        warnings=tuple(warnings),
        asked=asked,
    )


def _over_cap(cache: CacheDirectory, rows: np.ndarray, excess: int, clock: np.ndarray) -> np.ndarray:
    """The rows of the least recently used chunks whose bytes come to at
    least `excess`, least recently used first.  A chunk's files (its layers
    and ranks) go together; its time of last use is its newest file's."""
    ls = cache.listing
    if (ls.layer[rows] < 0).all() and (ls.world_size[rows] <= 1).all() and not (ls.kind[rows] == MP).any():
        inverse = np.arange(len(rows))  # one file a chunk: no grouping to do
    else:
        labels = _chunk_labels(cache, rows, by_rank=False, by_layer=False)
        _, inverse = np.unique(labels, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    sorted_groups = inverse[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    sizes = cache.listing.size[rows][order]
    group_bytes = np.add.reduceat(sizes, starts)
    group_time = np.maximum.reduceat(clock[rows][order], starts)
    first_name = cache.listing.name[rows][order][starts].astype(str)  # rows are by name: ties go by name
    by_use = np.lexsort((first_name, group_time))
    total = np.cumsum(group_bytes[by_use])
    take = int(np.searchsorted(total, excess, side="left")) + 1
    chosen = by_use[:take]
    rank_of_group = np.full(len(group_bytes), len(group_bytes), dtype=np.int64)
    rank_of_group[chosen] = np.arange(len(chosen))
    member = rank_of_group[inverse] < len(group_bytes)
    picked = rows[member]
    return picked[np.lexsort((picked, rank_of_group[inverse][member]))]


def _clock_warnings(by: str, mount: MountInfo | None) -> list[str]:
    if by == "mtime":
        return [
            "least recently used by mtime: the time LMCache wrote each file (a hit does not change it), "
            "so the oldest writes go first, however often they are read"
        ]
    reads = "hmem's own reads of chunk files (show, export, verify --deep) update atime too"
    if mount is None:
        return [f"the mount holding the cache is unknown: atime may not be updated on every read; {reads}"]
    where = f"{mount.mount_point} ({mount.fs_type}) is mounted"
    if mount.atime_updates == "never":
        return [
            f"{where} noatime: reads never update atime, so atime is the time each file was written "
            f"and 'least recently used' is 'least recently written' (--by mtime says so plainly)"
        ]
    if mount.atime_updates == "relatime":
        return [
            f"{where} relatime: a read updates atime only when it is older than the last write or a day "
            f"old, so atime tells the last use to within a day; chunks used within the same day look alike; {reads}"
        ]
    return [f"{where} strictatime: every read updates atime; {reads}"]


def unreachable_files(cache: CacheDirectory, requests: Sequence[Request], deployment: Deployment) -> tuple[str, ...]:
    """The files of the chunks the requests' explanations find stored
    after a hole (every layer file of each such chunk, per rank, or per
    object group and rank in multiprocess mode), by name."""
    from hmem.lmcache.hit_explanation import explain

    named = sorted({f for hit in explain(cache, requests, deployment) for f in hit.unreachable_files})
    if not named:
        return ()
    rows, _ = _rows_named(cache, named)
    ls = cache.listing
    chunk_rows = np.flatnonzero(ls.kind <= MP)
    labels = _chunk_labels(cache, chunk_rows, by_rank=True, by_layer=False)
    wanted = _chunk_labels(cache, np.array(rows, dtype=np.int64), by_rank=True, by_layer=False)
    return tuple(ls.name[chunk_rows[np.isin(labels, wanted)]].tolist())


# ---- execution --------------------------------------------------------------------------


def clean(cache: CacheDirectory, plan: CleanPlan, *, should_stop: Callable[[], bool] | None = None) -> CleanReport:
    """Delete the plan's files from `cache`'s directory (module docstring),
    a batch at a time: each file checked just before (a regular file of the
    planned size and mtime, never through a link), the batch deleted, the
    directory synced.  `should_stop` is asked between batches; when it says
    so, the files left are reported as not attempted.  The cache is listed
    again afterwards."""
    root = cache.path
    if os.path.realpath(plan.path) != os.path.realpath(root):
        raise InvalidArgumentError(f"the plan is for {plan.path}, not {root}")
    deleted: list[str] = []
    deleted_bytes = 0
    gone: list[str] = []
    skipped: list[SkippedFile] = []
    stopped = False
    files = list(plan.files)
    for start in range(0, len(files), _BATCH):
        if should_stop is not None and should_stop():
            stopped = True
            skipped += [SkippedFile(f.name, STOPPED) for f in files[start:]]
            break
        batch: list[PlannedFile] = []
        for planned in files[start : start + _BATCH]:
            why = _check(root, planned)
            if why is None:
                batch.append(planned)
            elif why.reason == ALREADY_GONE:
                gone.append(planned.name)
            else:
                skipped.append(why)
        done, failed = _delete(root, batch)
        deleted += [f.name for f in done]
        deleted_bytes += sum(f.size for f in done)
        skipped += failed
    if deleted:
        cache.reload()
    return CleanReport(
        path=str(root),
        deleted=tuple(deleted),
        deleted_bytes=deleted_bytes,
        already_gone=tuple(gone),
        skipped=tuple(skipped),
        stopped=stopped,
    )


def _check(root: Path, planned: PlannedFile) -> SkippedFile | None:
    """None when the file may be deleted now, else why not."""
    name = planned.name
    if not name or name in (".", "..") or "/" in name or "\0" in name or (os.altsep and os.altsep in name):
        return SkippedFile(name, NOT_CACHE_FILE, "not a file name in the cache directory")
    if planned.kind not in DELETABLE_KINDS or _kind_of_name(name) != planned.kind:
        return SkippedFile(name, NOT_CACHE_FILE, f"its name is no LMCache {planned.kind} file: never deleted")
    try:
        st = os.lstat(root / name)
    except FileNotFoundError:
        return SkippedFile(name, ALREADY_GONE)
    except OSError as exc:
        return SkippedFile(name, NOT_DELETED, exc.strerror or str(exc))
    if not stat.S_ISREG(st.st_mode):
        return SkippedFile(name, NOT_REGULAR, "a link, directory or special file now: never deleted nor followed")
    if st.st_size != planned.size or st.st_mtime_ns != planned.mtime_ns:
        return SkippedFile(name, CHANGED, f"now {st.st_size} bytes, mtime {st.st_mtime_ns / 1e9:.3f}")
    return None


def _delete(root: Path, batch: list[PlannedFile]) -> tuple[list[PlannedFile], list[SkippedFile]]:
    """Delete the batch's files (one directory sync); when that fails, each
    on its own, so that each failure names its file."""
    if not batch:
        return [], []
    try:
        _io.unlink_many([root / f.name for f in batch])
        return batch, []
    except StorageError:
        pass
    done, failed = [], []
    for planned in batch:
        try:
            _io.unlink(root / planned.name)
        except StorageError as exc:
            failed.append(SkippedFile(planned.name, NOT_DELETED, str(exc)))
        else:
            done.append(planned)
    return done, failed
