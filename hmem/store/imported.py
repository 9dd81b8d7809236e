"""The import registry of an open store: the committed source records
(read from sources.jsonl when first asked for), those added since the
last flush, and a lookup by content (hmem/formats/sources.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hmem import validation
from hmem.errors import InvalidArgumentError
from hmem.formats import sources as source_registry
from hmem.formats.sources import ImportedSource, SourcesInfo

_SHA256 = re.compile(r"[0-9a-f]{64}")


class ImportRegistry:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: list[ImportedSource] = []  # recorded since the last flush; its commit writes them
        self._committed: list[ImportedSource] | None = None  # read when first needed
        self._by_content: dict[tuple[str, int], ImportedSource] | None = None

    def all(self, info: SourcesInfo) -> list[ImportedSource]:
        """Every source recorded, committed ones first, in order."""
        if self._committed is None:
            self._committed = source_registry.read(self.path, info)
        return [*self._committed, *self.pending]

    def find(self, info: SourcesInfo, sha256: str, size: int) -> ImportedSource | None:
        """The latest record of a file with this content, if any."""
        if self._by_content is None:
            self._by_content = {(s.sha256, s.bytes): s for s in self.all(info)}
        return self._by_content.get((sha256, size))

    def add(self, name: Any, sha256: Any, size: Any, entry_ids: Iterable[int], *, next_id: int) -> ImportedSource:
        """Record an import (checked: nothing is recorded when it is refused)."""
        ids = [validation.integer(i, "entry id", low=1) for i in entry_ids]
        if ids and ids != list(range(ids[0], ids[0] + len(ids))):
            raise InvalidArgumentError("entry_ids must be consecutive ids, as one put_many returns them")
        if ids and ids[-1] >= next_id:
            raise InvalidArgumentError(f"entry id {ids[-1]} was never handed out by this store")
        if not (isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
            raise InvalidArgumentError(f"sha256 must be 64 lower-case hexadecimal digits, got {sha256!r}")
        if not isinstance(name, str) or not 0 < len(name) <= source_registry.MAX_NAME_CHARS:
            raise InvalidArgumentError(f"name must be a string of 1 to {source_registry.MAX_NAME_CHARS} characters")
        size = validation.integer(size, "size", low=0, high=2**63 - 1)
        record = ImportedSource(
            sha256, size, name, ids[0] if ids else 0, len(ids), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        )
        self.pending.append(record)
        if self._by_content is not None:
            self._by_content[(sha256, size)] = record
        return record

    def flushed(self) -> None:
        """The pending records are committed now."""
        if self._committed is not None:
            self._committed = [*self._committed, *self.pending]
        self.pending = []
