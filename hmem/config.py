"""StoreConfig: the settings a store is created with and keeps forever.

The config is saved in index.json; a reopened store uses it as saved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hmem import validation
from hmem.errors import InvalidArgumentError, UnsupportedFormatError

MiB = 1 << 20
U64_MAX = validation.U64_MAX


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Settings of one store (the `config` of index.json, docs/format.md).

    embed_dim        width of every K/V row (required)
    hdc_dim          signature bits per entry, a multiple of 64
    seed             seed of the signature projection
    max_entries      live entries kept at most, 0 = unlimited (older, less
                     useful entries are evicted to make room)
    max_disk_bytes   bytes on disk at most, 0 = unlimited
    shard_max_bytes  size at which a shard file is sealed and a new one begun
    max_open_shards  shard files kept memory-mapped at once
    quantize_stored  store K/V as INT8 with one F32 scale per token row
    """

    embed_dim: int
    hdc_dim: int = 4096
    seed: int = 0
    max_entries: int = 0
    max_disk_bytes: int = 0
    shard_max_bytes: int = 256 * MiB
    max_open_shards: int = 4
    quantize_stored: bool = False

    def __post_init__(self) -> None:
        def integer(name: str, low: int, high: int) -> None:
            object.__setattr__(self, name, validation.integer(getattr(self, name), name, low=low, high=high))

        integer("embed_dim", 1, 1 << 20)
        integer("hdc_dim", 64, 1 << 20)
        if self.hdc_dim % 64:
            raise InvalidArgumentError(f"hdc_dim must be a multiple of 64, got {self.hdc_dim}")
        integer("seed", 0, U64_MAX)
        integer("max_entries", 0, U64_MAX)
        integer("max_disk_bytes", 0, U64_MAX)
        integer("shard_max_bytes", 1, U64_MAX)
        integer("max_open_shards", 1, 1 << 16)
        validation.flag(self.quantize_stored, "quantize_stored")

    @property
    def signature_bytes(self) -> int:
        return self.hdc_dim // 8

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StoreConfig:
        """The config saved in index.json; unknown settings are refused, not ignored."""
        if not isinstance(data, dict):
            raise UnsupportedFormatError("index.json holds no config object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UnsupportedFormatError(
                f"the store's config has settings this hmem does not know: {', '.join(unknown)}",
                hint="open it with the hmem version that created it",
            )
        if "embed_dim" not in data:
            raise UnsupportedFormatError("the store's config has no embed_dim")
        try:
            return cls(**data)
        except InvalidArgumentError as exc:
            raise UnsupportedFormatError(f"the store's config cannot be honoured: {exc.message}") from None
