"""The state objects of a store on object storage, kept on this host from
one process to the next (docs/format.md, "The working copy").

State objects never change once written, and an open reads every one its
manifest lists: the snapshot of a large store is most of what an open
fetches (records, pooled keys, shard heads).  Each open keeps the ones it
fetched here, under the cache directory, and takes what it finds here
instead of fetching it again, so that a command run again on an unchanged
store fetches only the manifest.  A copy is used only once it passes the
state object's own checksum (apply_state); a damaged one is fetched again.
Only the objects of the commit last opened are kept, per store URL.

These files are copies: losing them loses nothing, so they are written
without fsync (hmem/_io.py, "the local cache").
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from hmem import _io
from hmem.errors import HmemError

STATE_DIR = "state"
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old was left by a process that stopped


class StateCache:
    """The cached state objects of one store URL."""

    def __init__(self, root: Path, url: str) -> None:
        self.directory = root / STATE_DIR / hashlib.sha256(url.encode()).hexdigest()[:32]

    def _path(self, key: str) -> Path:
        # keys are the manifest's own "state/<generation>-<token>.bin" (checked
        # when it was parsed): the last part names the file
        return self.directory / key.rsplit("/", 1)[-1]

    def get(self, key: str) -> bytes | None:
        """The cached copy of the state object `key`, or None."""
        try:
            return _io.read_regular(self._path(key), 1 << 40)
        except (OSError, HmemError):  # not here, or not a regular file: fetched instead
            return None

    def put(self, key: str, data: bytes) -> None:
        """Keep a copy of the state object `key` (which passed its checksum);
        a cache that cannot be written is no error."""
        try:
            _io.make_dir(self.directory, 0o700)
            _io.write_cache_file(self._path(key), data)
        except (OSError, HmemError):
            pass

    def keep(self, keys: list[str]) -> None:
        """Remove the copies of objects that are not among `keys` (the state
        list of the commit just opened or made), and temporary files that
        stopped processes left."""
        wanted = {self._path(key).name for key in keys}
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return
        now = time.time()
        gone = []
        for entry in entries:
            try:
                if entry.name.startswith(_io.TEMP_PREFIX):
                    if now - entry.stat(follow_symlinks=False).st_mtime < STALE_TEMP_SECONDS:
                        continue  # another process may be writing it
                elif entry.name in wanted:
                    continue
            except OSError:
                continue  # gone already
            gone.append(Path(entry.path))
        try:
            _io.unlink_many(gone)
        except HmemError:
            pass  # the next open tries again
