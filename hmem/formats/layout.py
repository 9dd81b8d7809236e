"""A store directory: the names of its files, and what each file in it is.

    index.json               the commit point (hmem/formats/manifest.py)
    entries.bin              one record per entry (hmem/formats/records.py)
    shard_NNNN.safetensors   K/V tensors (hmem/formats/shard_file.py)
    lock                     the single-writer lock and its owner record
    .hmem-tmp.*              temporary files of a writer

Anything else in the directory is foreign: hmem did not make it and leaves
it alone.  docs/format.md, "Files", describes each; "The write protocol"
says which leftovers a writer removes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from hmem._io import TEMP_PREFIX
from hmem.formats.records import ENTRIES_FILE, HEADER_BYTES

if TYPE_CHECKING:
    from hmem.formats.manifest import Pending, ShardInfo

INDEX_FILE = "index.json"
LOCK_FILE = "lock"
# ENTRIES_FILE ("entries.bin") is defined beside the record format, which
# this module builds on (record_bytes); it is imported from here like the rest.
FIXED_FILES = (INDEX_FILE, ENTRIES_FILE, LOCK_FILE)
SHARD_NAME = re.compile(r"^shard_(\d{4,9})\.safetensors$")
# Compaction and repair write a store's new files under these names first
# (docs/format.md, "Compaction").
REWRITE_PREFIX = TEMP_PREFIX + "rewrite."

__all__ = ["ENTRIES_FILE", "FIXED_FILES", "INDEX_FILE", "LOCK_FILE", "REWRITE_PREFIX", "SHARD_NAME", "TEMP_PREFIX",
           "DirectoryFiles", "classify", "directory_bytes", "record_bytes", "resolve", "shard_file", "shard_index",
           "shard_names"]


def shard_file(index: int) -> str:
    """The file name of shard `index`."""
    return f"shard_{index:04d}.safetensors"


def shard_index(name: str) -> int | None:
    """The index a shard file name carries, or None for any other name."""
    match = SHARD_NAME.match(name)
    return int(match.group(1)) if match else None


def record_bytes(signature_bytes: int) -> int:
    """The size of one record of entries.bin."""
    return HEADER_BYTES + signature_bytes


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
    def foreign(self) -> list[str]:
        """Everything else the commit does not name: hmem leaves it alone."""
        return sorted(self.others + [n for n in self.temporary + self.unnamed_shards if n in self.irregular])


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
    return DirectoryFiles(sorted(committed), sorted(temporary), sorted(unnamed), sorted(others),
                          frozenset(irregular))


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
    (present only while a writer holds it) does not count."""
    return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(root)
               if e.is_file(follow_symlinks=False) and e.name != LOCK_FILE)
