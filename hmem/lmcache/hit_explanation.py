"""Why a request hits what it hits in an LMCache cache, from the files
alone: the explanation `hmem prefix-hit CACHE --tokens FILE` prints.

For each request hmem computes the chunk hashes LMCache computes for its
tokens under the deployment's settings (`Deployment`), the file each
(chunk, rank) would be, and which of them the directory holds.  The rows
of that grid (one per rank, or per object group and rank in multiprocess
mode) go through hmem's grouped prefix-hit operators, as LMCache's own
lookup does (hmem/prefix_hit/grouped.py): the hit is the longest prefix
every row can serve, and each row's retained chunks follow from its
window.

What the explanation adds to the count: the first chunk that stops the
hit and why (no file; a file a restarted LMCache never reads; a write
never renamed; a layer file missing), the chunks stored after that hole
(unreachable: every chunk's hash depends on all before it, so nothing can
reach them), near misses (the same chunk hashes stored under another
model name, world size, dtype or tag, or under another hash seed: the
usual cause of a zero hit rate), and prompts shorter than one chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hmem.errors import InvalidArgumentError
from hmem.formats import lmcache as fmt
from hmem.lmcache.cache import CacheDirectory
from hmem.lmcache.listing import DEBRIS, LOCAL_DISK, MP
from hmem.prefix_hit.bitmap import Bitmap
from hmem.prefix_hit.explain import explain_prefix_hit

HASH_ALGORITHMS = ("builtin", "blake3")

# What each cell of the grid is (one letter per cell in ``RequestHit.grid``)
HIT = "H"  # held, and part of the hit (retained)
HELD = "h"  # held and inside the hit, but its row need not keep it (outside the row's window)
MISSING = "."  # no file
HOLE = "X"  # the first chunk some row misses: the hit stops here
UNREACHABLE = "u"  # held, but after the hole: no lookup reaches it
STALE = "s"  # a local_disk file older than the restart: the running LMCache never reads it
DEBRIS_CELL = "t"  # only a .tmp file: an fs write that never finished
CELL_MEANINGS = {
    HIT: "held and hit",
    HELD: "held, inside the hit, outside the row's window",
    MISSING: "missing",
    HOLE: "missing: stops the hit",
    UNREACHABLE: "held after the hole: unreachable",
    STALE: "held, written before the restart: never read",
    DEBRIS_CELL: "only a .tmp: a write that never finished",
}


@dataclasses.dataclass(frozen=True)
class Deployment:
    """The settings of the LMCache deployment whose requests are explained.

    `none_hash` is the hash chained before the first chunk: 0 outside vLLM;
    under vLLM with Python's built-in hash it comes from PYTHONHASHSEED
    (give the seed as `hash_seed`; when the seed was unset, every process
    draws its own and no restart ever hits).  `layers`: for a layerwise
    cache, how many layer files make a chunk (default: the cache's K/V
    shape, or its highest layer + 1).  `windows`: multiprocess mode, one
    per object group in chunks (-1 full attention).  `restarted_at`: the
    unix time the running LMCache started; local_disk files written before
    it are never read by that process."""

    model: str
    world_size: int = 1
    chunk_size: int = 256
    kv_dtype: str | None = None
    hash_algorithm: str | None = None  # "builtin" (in-process engine), "blake3" (multiprocess mode)
    none_hash: int | None = None
    hash_seed: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    layers: int | None = None
    windows: tuple[int, ...] = (-1,)
    salt: str = ""
    save_unfull_chunk: bool = False
    restarted_at: float | None = None

    def __post_init__(self) -> None:
        if not self.model or "@" in self.model:
            raise InvalidArgumentError(f"model {self.model!r}: give the model name vLLM was started with (no '@')")
        if self.world_size < 1 or self.chunk_size < 1:
            raise InvalidArgumentError("world_size and chunk_size must be at least 1")
        if self.kv_dtype is not None and self.kv_dtype not in fmt.KV_DTYPE_BYTES:
            raise InvalidArgumentError(f"kv_dtype {self.kv_dtype!r} is none of {', '.join(fmt.KV_DTYPE_BYTES)}")
        if self.hash_algorithm is not None and self.hash_algorithm not in HASH_ALGORITHMS:
            raise InvalidArgumentError(
                f"hash algorithm {self.hash_algorithm!r}: hmem computes {' and '.join(HASH_ALGORITHMS)} "
                "(LMCache's defaults in-process and in multiprocess mode)"
            )
        if self.none_hash is not None and self.hash_seed is not None:
            raise InvalidArgumentError("give none_hash or hash_seed, not both")
        if not self.windows:
            raise InvalidArgumentError("windows: give one window per object group")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Deployment:
        """From a settings document (a JSON object with these fields' names;
        ``tags`` as an object of name: value)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgumentError(
                f"unknown deployment setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        values = dict(data)
        if isinstance(values.get("tags"), Mapping):
            values["tags"] = tuple((str(k).removeprefix("lmcache.tag."), str(v)) for k, v in values["tags"].items())
        elif "tags" in values:
            values["tags"] = tuple(tuple(pair) for pair in values["tags"])
        if "windows" in values:
            values["windows"] = tuple(int(w) for w in values["windows"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise InvalidArgumentError(f"deployment settings: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> Deployment:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot read deployment settings from {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"{path}: deployment settings must be a JSON object")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tags"] = dict(self.tags)
        out["windows"] = list(self.windows)
        return out


def none_hash_of_seed(seed: str) -> int:
    """NONE_HASH as vLLM derives it from PYTHONHASHSEED with Python's
    built-in hash: hash(seed) in a process run with PYTHONHASHSEED=seed
    (str hashes depend on the seed and on the Python version: run hmem on
    the deployment's Python version)."""
    if not seed.isdigit() or int(seed) > 4294967295:
        raise InvalidArgumentError(f"hash seed {seed!r}: PYTHONHASHSEED is an integer 0..4294967295")
    env = {**os.environ, "PYTHONHASHSEED": seed}
    run = subprocess.run(
        [sys.executable, "-c", "import sys; print(hash(sys.argv[1]))", seed],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(run.stdout)


@dataclasses.dataclass(frozen=True)
class Request:
    """The token ids of one request to explain, with its tags."""

    name: str
    tokens: tuple[int, ...]
    tags: tuple[tuple[str, str], ...] | None = None  # None: the deployment's
    salt: str | None = None  # multiprocess mode's cache salt; None: the deployment's


def read_requests(path: str | os.PathLike[str]) -> list[Request]:
    """Requests from a JSON file: a list of token ids (one request), a list
    of such lists, or a list (or ``{"requests": [...]}``) of objects with
    ``tokens`` and optional ``name``, ``tags`` (in-process keys) and
    ``salt`` (multiprocess mode's cache salt)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read token ids from {path}: {exc}") from exc
    return parse_requests(data, str(path))


def parse_requests(data: Any, where: str = "requests") -> list[Request]:
    if isinstance(data, dict) and "requests" in data:
        data = data["requests"]
    if isinstance(data, list) and data and all(isinstance(t, int) for t in data):
        data = [data]
    if not isinstance(data, list) or not data:
        raise InvalidArgumentError(f"{where}: give token ids: a list of ints, a list of such lists, or objects")
    out = []
    for n, item in enumerate(data):
        if isinstance(item, list):
            item = {"tokens": item}
        if not isinstance(item, dict) or not isinstance(item.get("tokens"), list):
            raise InvalidArgumentError(f"{where}: request {n} has no list of token ids")
        tokens = item["tokens"]
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
            raise InvalidArgumentError(f"{where}: request {n}: token ids must be integers 0..2**32-1")
        tags = item.get("tags")
        if tags is not None:
            if not isinstance(tags, dict):
                raise InvalidArgumentError(f"{where}: request {n}: tags must be an object of name: value")
            tags = tuple((str(k).removeprefix("lmcache.tag."), str(v)) for k, v in tags.items())
        salt = item.get("salt", item.get("cache_salt"))
        if salt is not None and not isinstance(salt, str):
            raise InvalidArgumentError(f"{where}: request {n}: salt must be a string")
        out.append(Request(str(item.get("name", n)), tuple(tokens), tags, salt))
    return out


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """Chunks of the request stored under other settings."""

    setting: str  # model, world_size, kv_dtype, tags, rank, none_hash
    stored: str
    wanted: str
    chunks: int  # how many of the request's chunks are stored so
    example: str  # one such file

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RequestHit:
    """The explanation of one request."""

    name: str
    tokens: int
    chunk_size: int
    chunks: int  # chunks LMCache keys (full ones, and a partial last one under save_unfull_chunk)
    hit_chunks: int
    hit_tokens: int  # what LMCache's lookup returns
    rows: tuple[str, ...]  # the grid's rows: "rank 0", "group 1 rank 0"
    windows: tuple[int, ...]  # per row
    grid: tuple[str, ...]  # per row one letter per chunk (CELL_MEANINGS)
    chunk_hashes: tuple[str, ...]
    keys: tuple[str, ...]  # rank 0's key (object name in multiprocess mode) per chunk
    files: tuple[tuple[str | None, ...], ...]  # per row, per chunk: the file present, or None
    first_missing: int | None
    reason: str | None  # why the hit stops there (or why it is 0)
    unreachable: tuple[int, ...]  # chunks held after the hole
    unreachable_files: tuple[str, ...]
    near_misses: tuple[NearMiss, ...]
    limiting_rows: tuple[int, ...]
    notes: tuple[str, ...]

    @property
    def short(self) -> bool:
        return self.chunks == 0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["near_misses"] = [m.to_dict() for m in self.near_misses]
        out["short"] = self.short
        return out


def explain(cache: CacheDirectory, requests: Sequence[Request], deployment: Deployment) -> list[RequestHit]:
    """Explain each request's hit against `cache` (module docstring)."""
    return _Explainer(cache, deployment).explain_all(requests)


class _Explainer:
    def __init__(self, cache: CacheDirectory, deployment: Deployment) -> None:
        self.cache = cache
        self.d = deployment
        ls = cache.listing
        self.names = ls.name  # sorted str objects: searched as they are (a str copy of 100k names costs ~60 ms)
        self.mp = deployment.hash_algorithm == "blake3" or (
            deployment.hash_algorithm is None and set(cache.kinds) == {"mp"}
        )
        kinds = set(cache.kinds)
        self.forms = ["mp"] if self.mp else [k for k in ("fs", "local_disk") if k in kinds] or ["fs"]
        self.none_hash = self._none_hash()
        self.kv_dtype = deployment.kv_dtype or self._dtype_of_model()
        self.layers = self._layers()
        self._hash_text: np.ndarray | None = None

    @property
    def hash_text(self) -> np.ndarray:
        """Every row's chunk hash as str (made when near misses are searched only)."""
        if self._hash_text is None:
            self._hash_text = self.cache.listing.chunk_hash.astype(str)
        return self._hash_text

    def _with_hash(self, hashes: Sequence[str]) -> np.ndarray:
        """Mask of the rows whose chunk hash is one of `hashes` (each row's
        hash searched among the few wanted: 3x faster than np.isin here)."""
        text = self.hash_text
        wanted = np.unique(np.array(hashes, dtype=str))
        if not len(wanted) or not len(text):
            return np.zeros(len(text), bool)
        at = np.minimum(np.searchsorted(wanted, text), len(wanted) - 1)
        return wanted[at] == text

    def _none_hash(self) -> int:
        if self.d.hash_seed is not None:
            return none_hash_of_seed(self.d.hash_seed)
        return self.d.none_hash or 0

    def _dtype_of_model(self) -> str:
        rows = self.cache.select(model=self.d.model)
        counts = collections.Counter(self.cache.listing.kv_dtype[rows].tolist())  # a few distinct values
        if counts:
            return str(max(sorted(counts), key=counts.__getitem__))  # the most common; a tie: the first by name
        return "bfloat16"  # nothing of this model is stored: any dtype misses alike

    def _layers(self) -> int | None:
        if self.d.layers is not None:
            return self.d.layers
        ls = self.cache.listing
        if not (ls.layer >= 0).any():  # no layerwise file at all
            return None
        rows = self.cache.select(model=self.d.model)
        if not len(rows) or not (ls.layer[rows] >= 0).any():
            return None
        if self.cache.kv_shape is not None:
            return self.cache.kv_shape.layers
        return int(ls.layer[rows].max()) + 1

    def explain_all(self, requests: Sequence[Request]) -> list[RequestHit]:
        return [self._explain(r) for r in requests]

    # ---- one request --------------------------------------------------------------------

    def _hashes(self, tokens: Sequence[int], none_hash: int) -> tuple[list[str], int]:
        """(hash text per chunk as file names spell it, tokens the last chunk ends at)."""
        size = self.d.chunk_size
        if self.mp:
            return [h.hex() for h in fmt.blake3_chunk_hashes(tokens, size)], len(tokens) - len(tokens) % size
        hashes = fmt.chunk_hashes(tokens, size, none_hash=none_hash)
        end = len(hashes) * size
        if self.d.save_unfull_chunk and len(tokens) % size:
            tail = hash(((hashes[-1] if hashes else none_hash), tuple(int(t) for t in tokens[end:]), ()))
            hashes.append(tail)
            end = len(tokens)
        return [f"{h:x}" for h in hashes], end

    def _row_names(
        self, hashes: list[str], tags: tuple[tuple[str, str], ...], salt: str
    ) -> tuple[list[str], list[int], list[list[list[str]]]]:
        """(row labels, row windows, per row per chunk the file names any of
        which holds it; a layerwise chunk needs every layer: names joined)."""
        d = self.d
        labels, windows, names = [], [], []
        if self.mp:
            for group, window in enumerate(d.windows):
                for rank in range(d.world_size):
                    labels.append(f"group {group} rank {rank}")
                    windows.append(window)
                    kv = fmt.kv_rank(d.world_size, rank)
                    names.append([[fmt.ObjectName(d.model, kv, group, h, salt).file_name()] for h in hashes])
            return labels, windows, names
        layers = [None] if self.layers is None else list(range(self.layers))
        for rank in range(d.world_size):
            labels.append(f"rank {rank}")
            windows.append(-1)
            row = []
            for h in hashes:
                cell = []
                for layer in layers:
                    key = fmt.ChunkKey(d.model, d.world_size, rank, int(h, 16), self.kv_dtype, layer, tags)
                    cell += [key.fs_name() if form == "fs" else key.local_disk_name() for form in self.forms]
                row.append(cell)
            names.append(row)
        return labels, windows, names

    def _held(self, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(held, stale) per name: the file exists as a chunk; it is a
        local_disk file older than the restart."""
        ls = self.cache.listing
        if not len(self.names):
            return np.zeros(len(names), bool), np.zeros(len(names), bool)
        wanted = np.array(names, dtype=object)
        at = np.searchsorted(self.names, wanted)
        at_clipped = np.minimum(at, len(self.names) - 1)
        held = (self.names[at_clipped] == wanted) & (ls.kind[at_clipped] <= MP)
        stale = np.zeros(len(names), bool)
        if self.d.restarted_at is not None:
            old = ls.mtime_ns[at_clipped] < int(self.d.restarted_at * 1e9)
            stale = held & old & (ls.kind[at_clipped] == LOCAL_DISK)
        return held, stale

    def _explain(self, request: Request) -> RequestHit:
        d = self.d
        tags = d.tags if request.tags is None else request.tags
        hashes, end = self._hashes(request.tokens, self.none_hash)
        C = len(hashes)
        salt = d.salt if request.salt is None else request.salt
        labels, windows, names = self._row_names(hashes, tags, salt)
        flat = [n for row in names for cell in row for n in cell]
        held_flat, stale_flat = self._held(flat)
        # cells[row, chunk, layer, form]: a cell is held when, for every
        # layer, one of its forms (fs, local_disk) holds it
        forms = 1 if self.mp else len(self.forms)
        per_cell = len(names[0][0]) if C else forms
        shape = (len(labels), C, per_cell // forms, forms)
        held: np.ndarray = held_flat.reshape(shape)
        stale: np.ndarray = stale_flat.reshape(shape)
        cell_held = np.all(np.any(held & ~stale, axis=3), axis=2)
        cell_stale = np.all(np.any(held, axis=3), axis=2) & ~cell_held
        rows = [Bitmap.from_numpy(r) for r in cell_held] if C else []
        notes: list[str] = []
        if C:
            report = explain_prefix_hit(rows, windows=windows)
            hit = report.hit
            retained = [r.to_numpy().astype(bool) for r in report.retain_rows]
            limiting = tuple(report.limiting_groups) if hit < C else ()
        else:
            hit, retained, limiting = 0, [], ()
        grid, files = [], []
        cells = held.reshape(len(labels), C, -1) if C else held
        for r in range(len(labels)):
            lo = self._needed_from(windows[r], hit)
            letters = []
            for c in range(C):
                present = bool(cell_held[r, c])
                if c < hit:
                    letters.append(HIT if retained[r][c] else (HELD if present else MISSING))
                elif present:
                    letters.append(UNREACHABLE)
                elif cell_stale[r, c]:
                    letters.append(STALE)
                elif r in limiting and lo <= c <= hit:
                    letters.append(DEBRIS_CELL if self._debris(names[r][c]) else HOLE)
                else:
                    letters.append(MISSING)
            for c in range(lo, min(hit, C)):  # a windowed row may stop the hit on a chunk before it
                if r in limiting and not cell_held[r, c]:
                    letters[c] = HOLE
            grid.append("".join(letters))
            files.append(
                tuple(names[r][c][int(np.argmax(cells[r, c]))] if cells[r, c].any() else None for c in range(C))
            )
        unreachable = tuple(c for c in range(hit + 1, C) if cell_held[:, c].any())
        unreachable_files = tuple(f for c in unreachable for r in range(len(labels)) if (f := files[r][c]) is not None)
        first_missing = hit if hit < C else None
        reason = self._reason(request, C, hit, labels, names, cell_held, cell_stale, limiting)
        near = self._near_misses(request, hashes[hit:], tags, hit) if hit < C else ()
        if C and hit == 0 and not near and not cell_held.any():
            stored = len(self.cache.select(model=d.model))
            if stored:  # the model's chunks are there, none of this request's: other tokens, or another seed
                notes.append(
                    f"none of this request's chunks is stored under any name, though {stored} file(s) of "
                    f"{d.model} are: either these tokens were never stored, or the deployment's NONE_HASH "
                    "differs (under vLLM it comes from PYTHONHASHSEED, random per process when unset: "
                    "try --hash-seed)"
                )
        if C and end < len(request.tokens):
            notes.append(
                f"the last {len(request.tokens) - end} tokens are a partial chunk: never stored, never hit "
                "(save_unfull_chunk)"
            )
        hit_tokens = 0 if hit == 0 else min(hit * d.chunk_size, end)
        keys = tuple(self._key_text(h, tags, salt) for h in hashes)
        return RequestHit(
            name=request.name,
            tokens=len(request.tokens),
            chunk_size=d.chunk_size,
            chunks=C,
            hit_chunks=hit,
            hit_tokens=hit_tokens,
            rows=tuple(labels),
            windows=tuple(windows),
            grid=tuple(grid),
            chunk_hashes=tuple(hashes),
            keys=keys,
            files=tuple(files),
            first_missing=first_missing,
            reason=reason,
            unreachable=unreachable,
            unreachable_files=unreachable_files,
            near_misses=tuple(near),
            limiting_rows=limiting,
            notes=tuple(notes),
        )

    def _key_text(self, chunk_hash: str, tags: tuple[tuple[str, str], ...], salt: str) -> str:
        """Rank 0's key of a chunk (multiprocess mode: group 0's object name)."""
        d = self.d
        if self.mp:
            return fmt.ObjectName(d.model, fmt.kv_rank(d.world_size, 0), 0, chunk_hash, salt).text
        return fmt.ChunkKey(d.model, d.world_size, 0, int(chunk_hash, 16), self.kv_dtype, None, tags).text

    @staticmethod
    def _needed_from(window: int, hit: int) -> int:
        """The first chunk a row of `window` must hold to serve hit + 1 chunks."""
        return 0 if window <= 0 else max(0, hit + 1 - window)

    def _debris(self, cell: list[str]) -> bool:
        """Whether a .tmp of one of the cell's fs names is in the directory."""
        ls = self.cache.listing
        temps = [n.removesuffix(fmt.FS_SUFFIX) + fmt.FS_TEMP_SUFFIX for n in cell if n.endswith(fmt.FS_SUFFIX)]
        if not temps:
            return False
        at = np.searchsorted(self.names, temps)
        return any(a < len(self.names) and self.names[a] == t and ls.kind[a] == DEBRIS for a, t in zip(at, temps))

    def _reason(self, request, C, hit, labels, names, cell_held, cell_stale, limiting) -> str | None:
        d = self.d
        if C == 0:
            return (
                f"{len(request.tokens)} tokens: shorter than one chunk of {d.chunk_size}; LMCache stores and looks "
                "up full chunks only (save_unfull_chunk is off by default), so this prompt never hits"
            )
        if hit == C:
            return None
        parts = []
        for r in range(len(labels)):
            if r not in limiting:
                continue
            lo = self._needed_from(d.windows[r // d.world_size] if self.mp else -1, hit)
            missing = [c for c in range(lo, hit + 1) if not cell_held[r, c]]
            for c in missing:
                cell = names[r][c]
                if cell_stale[r, c]:
                    why = "its local_disk file was written before the restart: the running LMCache never reads it"
                elif self._debris(cell):
                    why = "only a .tmp file: an fs write that never finished"
                elif self.layers is not None and not self.mp:
                    have, _ = self._held(cell)
                    per = len(self.forms)
                    lost = [layer for layer in range(self.layers) if not have[layer * per : (layer + 1) * per].any()]
                    why = f"no file of layer(s) {_ranges(lost)}" if lost else "no file"
                else:
                    why = "no file"
                parts.append(f"chunk {c} on {labels[r]}: {why} ({cell[0]})")
        return "; ".join(parts) if parts else None

    def _near_misses(
        self, request: Request, hashes: list[str], tags: tuple[tuple[str, str], ...], hit: int
    ) -> list[NearMiss]:
        """The request's chunks from the hole on (`hashes`) stored under
        other settings."""
        ls = self.cache.listing
        d = self.d
        out: list[NearMiss] = []
        if hashes:
            rows = np.flatnonzero(self._with_hash(hashes) & (ls.kind <= MP))
            model_names = {d.model, d.model.replace("/", "-")}
            wanted_tags = "@".join(f"{k}%{v}" for k, v in tags)
            checks = [
                ("model", ls.model, lambda v: v in model_names, d.model),
                ("world_size", ls.world_size, lambda v: v == d.world_size, str(d.world_size)),
                ("kv_dtype", ls.kv_dtype, lambda v: self.mp or v == self.kv_dtype, self.kv_dtype),
                ("tags", ls.tags, lambda v: self.mp or v == wanted_tags, wanted_tags or "(none)"),
            ]
            # each stored file by the settings it differs in: one near miss per such set
            found: dict[tuple[tuple[str, str], ...], list[int]] = {}
            for row in rows.tolist():
                differs = tuple(
                    (setting, str(column[row]) or "(none)")
                    for setting, column, fits, _ in checks
                    if not fits(column[row])
                )
                if differs:
                    found.setdefault(differs, []).append(row)
            wanted_of = {setting: wanted for setting, _, _, wanted in checks}
            for differs, members in sorted(found.items(), key=lambda item: (len(item[0]), item[0])):
                out.append(
                    NearMiss(
                        ", ".join(setting for setting, _ in differs),
                        ", ".join(value for _, value in differs),
                        ", ".join(wanted_of[setting] for setting, _ in differs),
                        len(set(self.hash_text[members].tolist())),
                        str(ls.name[members[0]]),
                    )
                )
        if not self.mp and hit == 0 and not any(m.setting == "model" for m in out):
            out += self._seed_misses(request, hashes)
        return out

    def _seed_misses(self, request: Request, hashes: list[str]) -> list[NearMiss]:
        """When not even the first chunk's hash is stored under any name,
        try NONE_HASH 0 (LMCache outside vLLM): a deployment whose seed
        differs from what was stored misses every chunk."""
        ls = self.cache.listing
        if hashes and self._with_hash(hashes[:1]).any():
            return []
        candidates = {0: "0 (LMCache outside vLLM)"} if self.none_hash != 0 else {}
        out = []
        for value, label in candidates.items():
            others, _ = self._hashes(request.tokens, value)
            rows = np.flatnonzero(self._with_hash(others) & (ls.kind <= MP))
            if len(rows):
                chunks = len(set(self.hash_text[rows].tolist()))
                out.append(NearMiss("none_hash", label, str(self.none_hash), chunks, str(ls.name[rows[0]])))
        return out


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)
