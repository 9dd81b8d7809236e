"""A store directory: the names of its files, what each file in it is, and
how hmem opens one to read it.

    index.json               the commit point (hmem/formats/manifest.py)
    entries.bin              one record per entry (hmem/formats/records.py)
    pooled.bin               each record's pooled key (hmem/formats/pooled.py)
    shard_NNNN.safetensors   K/V tensors (hmem/formats/shard_file.py)
    lock                     the single-writer lock and its owner record
    .hmem-tmp.*              temporary files of a writer

Anything else in the directory is foreign: hmem did not make it and leaves
it alone.  docs/format.md, "Files", describes each; "The write protocol"
says which leftovers a writer removes.

A store's files may come from an untrusted source (docs/security.md): a
file name read from any store file is used only when it is one of these
names (``name_problem``); store files are opened without following
symbolic links and only when they are regular files (hmem/_io.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from hmem._io import TEMP_PREFIX
from hmem.formats.pooled import POOLED_FILE
from hmem.formats.records import ENTRIES_FILE, record_dtype
from hmem.formats.sources import SOURCES_FILE

if TYPE_CHECKING:
    from hmem.config import StoreConfig
    from hmem.formats.manifest import Pending, ShardInfo

INDEX_FILE = "index.json"
LOCK_FILE = "lock"
# ENTRIES_FILE ("entries.bin") is defined beside the record format, which
# this module builds on (record_bytes); it is imported from here like the rest.
STAMP_FILE = "commit.stamp"  # hmem/formats/stamp.py
# SOURCES_FILE ("sources.jsonl", the import registry) and POOLED_FILE
# ("pooled.bin") likewise live beside their formats.
FIXED_FILES = (INDEX_FILE, ENTRIES_FILE, LOCK_FILE, STAMP_FILE, SOURCES_FILE, POOLED_FILE)
SHARD_NAME = re.compile(r"^shard_(\d{4,9})\.safetensors$")
# Compaction and repair write a store's new files under these names first
# (docs/format.md, "Compaction").
REWRITE_PREFIX = TEMP_PREFIX + "rewrite."
TEMP_NAME = re.compile(r"^" + re.escape(TEMP_PREFIX) + r"[A-Za-z0-9_.-]{1,200}$")

__all__ = [
    "ENTRIES_FILE",
    "FIXED_FILES",
    "INDEX_FILE",
    "LOCK_FILE",
    "POOLED_FILE",
    "SOURCES_FILE",
    "STAMP_FILE",
    "REWRITE_PREFIX",
    "SHARD_NAME",
    "TEMP_PREFIX",
    "DirectoryFiles",
    "classify",
    "directory_bytes",
    "files_without_index",
    "record_bytes",
    "resolve",
    "shard_file",
    "shard_index",
    "shard_names",
]


def shard_file(index: int) -> str:
    """The file name of shard `index`."""
    return f"shard_{index:04d}.safetensors"


def shard_index(name: str) -> int | None:
    """The index a shard file name carries, or None for any other name."""
    match = SHARD_NAME.match(name)
    return int(match.group(1)) if match else None


def name_problem(
    name: object, *, shard_at: int | None = None, rename: bool = False, delete: bool = False
) -> str | None:
    """Why `name`, read from a store file, is not a name that file may give,
    or None.  `shard_at`: the name of shard number `shard_at`; `rename`: the
    source of a pending rename (a rewrite's temporary name of a store file);
    `delete`: a file a pending step deletes (a shard or temporary file)."""
    if not isinstance(name, str):
        return f"a file name must be a string, got {type(name).__name__}"
    if not 0 < len(name) <= 255 or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        return f"{name!r} is not a plain file name of the store directory"
    if shard_at is not None:
        return (
            None if name == shard_file(shard_at) else f"shard {shard_at} must be {shard_file(shard_at)}, not {name!r}"
        )
    if rename:
        final = name[len(REWRITE_PREFIX) :] if name.startswith(REWRITE_PREFIX) else ""
        return (
            None
            if final in (ENTRIES_FILE, POOLED_FILE) or SHARD_NAME.match(final)
            else f"{name!r} is no rewrite's file"
        )
    if delete:
        return None if SHARD_NAME.match(name) or TEMP_NAME.match(name) else f"{name!r} is not a file hmem deletes"
    return None if name in FIXED_FILES or SHARD_NAME.match(name) else f"{name!r} is not a store file"


def is_store(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding an hmem store (it has an
    index.json; whether that is sound is verify's question)."""
    root = Path(path)
    return root.is_dir() and (root / INDEX_FILE).is_file()


def files_without_index(root: Path) -> list[str]:
    """The store files (entries.bin, shards) in `root`, a directory without
    an index.json: a store whose index is lost when there are any (repair
    rebuilds it), no store at all when there are none."""
    try:
        files = classify(root)
    except OSError:
        return []
    return [name for name in files.committed if name == ENTRIES_FILE] + files.unnamed_shards


def record_bytes(config: StoreConfig | int) -> int:
    """The size of one record of entries.bin (an int: the signature bytes
    of a store without span signatures)."""
    return record_dtype(config).itemsize


@dataclasses.dataclass(frozen=True)
class DirectoryFiles:
    """The entries of a store directory by what they are, each list sorted.

    ``temporary``, ``unnamed_shards`` and ``others`` go by name alone and
    together hold every entry the commit does not name; ``irregular`` lists
    the entries (of any kind) that are not regular files: directories, links
    and the like, which hmem never makes."""

    committed: list[str]  # index.json, entries.bin, lock, the shards and pending rename sources that exist
    temporary: list[str]  # named like a writer's temporary file
    unnamed_shards: list[str]  # named like a shard file, but no shard of the commit
    others: list[str]  # any other name
    irregular: frozenset[str]

    @property
    def orphans(self) -> list[str]:
        """Leftovers hmem made that no commit names: temporary and shard
        files (regular files only); compaction removes them."""
        return sorted(n for n in self.temporary + self.unnamed_shards if n not in self.irregular)

    @property
    def unsafe(self) -> list[str]:
        """Committed names that are not regular files (a symbolic link, a
        named pipe, a directory): hmem reads and writes none of them, and a
        writer refuses the store (docs/security.md)."""
        return sorted(n for n in self.committed if n in self.irregular)

    @property
    def foreign(self) -> list[str]:
        """Everything else, which hmem did not make and leaves alone: what
        the commit does not name, and the unsafe files."""
        return sorted(
            self.others + self.unsafe + [n for n in self.temporary + self.unnamed_shards if n in self.irregular]
        )


def classify(root: Path, shards: Iterable[ShardInfo] = (), pending: Pending | None = None) -> DirectoryFiles:
    """Sort the entries of the store directory `root` against a commit: its
    `shards` and the sources of its `pending` renames are committed files.
    Without a commit, every shard file is an unnamed one."""
    named = {*FIXED_FILES, *(info.file for info in shards)}
    if pending is not None:
        named.update(src for src, _ in pending.renames)
    committed: list[str] = []
    temporary: list[str] = []
    unnamed: list[str] = []
    others: list[str] = []
    irregular = set()
    for entry in os.scandir(root):
        name = entry.name
        if not entry.is_file(follow_symlinks=False):
            irregular.add(name)
        if name in named:
            committed.append(name)
        elif name.startswith(TEMP_PREFIX):
            temporary.append(name)
        elif SHARD_NAME.match(name):
            unnamed.append(name)
        else:
            others.append(name)
    return DirectoryFiles(sorted(committed), sorted(temporary), sorted(unnamed), sorted(others), frozenset(irregular))


def shard_names(root: Path) -> list[str]:
    """The entries of `root` named like shard files, sorted."""
    return classify(root).unnamed_shards


def resolve(root: Path, name: str, pending: Pending) -> Path:
    """Where a file the commit names is now: the source of a pending rename
    to it while that rename has not happened yet (as readers see it)."""
    for src, dst in pending.renames:
        if dst == name and (root / src).exists():
            return root / src
    return root / name


def directory_bytes(root: Path) -> int:
    """Bytes of the files of a store directory; the lock file's owner record
    (present only while a writer holds it) does not count.  A file that goes
    while it is counted (a writer's temporary file, renamed or removed by a
    flush under way) counts nothing."""
    total = 0
    for entry in os.scandir(root):
        if entry.name == LOCK_FILE:
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total
