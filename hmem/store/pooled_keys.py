"""Pooled keys for a re-rank, gathered from pooled.bin (hmem/formats/pooled.py).

The file is memory-mapped once and mapped again when a position past the
map is asked for (each flush appends rows).  A shortlist's rows are copied
out at once and each is checked (its entry id and CRC-32C) before use; a
row that is missing or fails is left to the caller, which reads the key
from the entry's shard.  The file is replaced, never changed in place,
by compaction and repair, so a map stays valid while it is held; those
drop it (``drop``) once they have replaced the file.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from hmem import _io
from hmem.errors import UnsafeFileError
from hmem.formats import pooled


class PooledKeys:
    """Rows of one store's pooled.bin."""

    def __init__(self, root: Path, embed_dim: int) -> None:
        self.path = root / pooled.POOLED_FILE
        self.embed_dim = embed_dim
        self._rows: np.ndarray | None = None

    def drop(self) -> None:
        """Forget the map (arrays already handed out are copies)."""
        self._rows = None

    def _mapped(self, need: int) -> np.ndarray | None:
        """The file's whole rows, mapped again if fewer than `need` were."""
        if self._rows is not None and len(self._rows) >= need:
            return self._rows
        try:
            fd = _io.open_regular(self.path)  # never through a link: docs/security.md
        except (OSError, UnsafeFileError):
            # absent (a store from before pooled.bin), unreadable, or a link
            # (never followed; verify reports it): the shards serve
            return self._rows
        try:
            count = os.fstat(fd).st_size // pooled.row_bytes(self.embed_dim)
            if count == 0:
                return self._rows
            mapped = mmap.mmap(fd, count * pooled.row_bytes(self.embed_dim), access=mmap.ACCESS_READ)
        except OSError:
            return self._rows
        finally:
            os.close(fd)
        self._rows = np.frombuffer(mapped, dtype=pooled.row_dtype(self.embed_dim), count=count)
        return self._rows

    def get(self, positions: np.ndarray, entry_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keys float32 [m, embed_dim], found bool [m]): the key of each
        committed record position (entry_ids: theirs) whose row is usable."""
        rows = self._mapped(int(positions.max()) + 1) if len(positions) else None
        if rows is not None and int(positions.max()) < len(rows):
            # the usual case, every row there: taken without index arrays or
            # a second copy (a shortlist's keys are a few MB of fresh memory)
            picked = rows[positions]  # a copy
            good = pooled.usable(picked, entry_ids)
            if good.all():
                return picked["key"], good
            keys = np.zeros((len(positions), self.embed_dim), dtype=np.float32)
            keys[good] = picked["key"][good]
            return keys, good
        keys = np.zeros((len(positions), self.embed_dim), dtype=np.float32)
        found = np.zeros(len(positions), dtype=bool)
        if rows is None:
            return keys, found
        inside = np.flatnonzero(positions < len(rows))
        picked = rows[positions[inside]]  # a copy
        good = pooled.usable(picked, entry_ids[inside])
        keys[inside[good]] = picked["key"][good]
        found[inside[good]] = True
        return keys, found
