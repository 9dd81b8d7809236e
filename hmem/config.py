"""StoreConfig: the settings a store is created with and keeps forever.

The config is saved in index.json; a reopened store uses it as saved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hmem import validation
from hmem.errors import InvalidArgumentError, UnsupportedFormatError

MiB = 1 << 20
STORAGE_DTYPES = ("f32", "f16", "bf16", "int8")
U64_MAX = validation.U64_MAX
MAX_SIGNATURES_PER_ENTRY = 64
MAX_OPEN_SHARDS = 1 << 16
# Bounds of shard_max_bytes.  Below MIN_SHARD_MAX_BYTES a shard could not
# hold its fixed header (the metadata, the length word and the index's
# header row: 352 bytes, hmem/formats/shard_file.py) and one entry's index
# row; an entry larger than the limit still gets a shard of its own.  Above
# MAX_SHARD_MAX_BYTES the open shard, which a put holds in memory (twice
# while the full one is made durable), would outgrow any machine's memory.
MIN_SHARD_MAX_BYTES = 512
MAX_SHARD_MAX_BYTES = 1 << 36
# A span signature is the first SPAN_SIGNATURE_BITS bits of the signature
# of its span's mean (all of it when hdc_dim is smaller): spans only pick
# candidates, which their exact pooled keys then rank (docs/format.md).
SPAN_SIGNATURE_BITS = 512
# How an entry's tokens are cut into its spans (docs/format.md, "Span
# signatures"): "overlapping" windows, each two of S equal parts wide,
# starting one part apart (new stores), or "disjoint" equal spans (stores
# made before span_layout existed, whose config does not name one).
SPAN_LAYOUTS = ("overlapping", "disjoint")
# The most candidates a query re-ranks by token-level max-sim: each costs
# reading its stored keys (docs/format.md, "Token re-rank").
MAX_TOKEN_RERANK = 4096


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
                     (a bulk put holds up to two in memory: the open shard
                     and a full one whose file is being made durable);
                     512 bytes (MIN_SHARD_MAX_BYTES) to 64 GiB
    max_open_shards  shard files kept memory-mapped at once (a map costs
                     address space, not memory; mapping a shard again for
                     a read costs about 0.1 ms)
    storage_dtype    how K/V rows are stored: "f32", "f16", "bf16" (exact
                     for rows that came in that dtype, half the disk) or
                     "int8" (one F32 scale per row); similarity math is F32
    quantize_stored  the older name of storage_dtype="int8" (kept in step)
    signatures_per_entry
                     1 (default): one signature per entry, of its mean key;
                     S > 1: also S - 1 span signatures, of the means of the
                     entry's tokens cut into S - 1 equal spans, so that a
                     query of a few tokens finds the entry that holds them
                     (docs/format.md, "Span signatures")
    span_layout      how the spans cut an entry's tokens: "overlapping"
                     (default: S - 1 windows, each 2/S of the tokens wide,
                     starting 1/S apart, so a few consecutive tokens lie
                     mostly inside one window) or "disjoint" (S - 1 equal
                     spans, the layout of span stores made before
                     span_layout existed);
                     meaningless without spans, where it is "overlapping"
    chunks           entries may be put in chunks under an external key
                     (Store.put_chunks): found by key without a scan, and
                     evicted and deleted a chunk at a time (docs/format.md,
                     "Chunks")
    token_rerank     queries re-rank their best token_rerank candidates (by
                     pooled keys) by token-level max-sim over the stored keys
                     unless told otherwise; 0 (default): they do not
                     (docs/format.md, "Token re-rank")
    """

    embed_dim: int
    hdc_dim: int = 4096
    seed: int = 0
    max_entries: int = 0
    max_disk_bytes: int = 0
    shard_max_bytes: int = 256 * MiB
    max_open_shards: int = 256
    quantize_stored: bool = False
    storage_dtype: str = "f32"
    signatures_per_entry: int = 1
    span_layout: str = "overlapping"
    chunks: bool = False
    token_rerank: int = 0

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
        integer("shard_max_bytes", MIN_SHARD_MAX_BYTES, MAX_SHARD_MAX_BYTES)
        integer("max_open_shards", 1, MAX_OPEN_SHARDS)
        integer("signatures_per_entry", 1, MAX_SIGNATURES_PER_ENTRY)
        integer("token_rerank", 0, MAX_TOKEN_RERANK)
        validation.flag(self.quantize_stored, "quantize_stored")
        validation.flag(self.chunks, "chunks")
        validation.choice(self.storage_dtype, "storage_dtype", STORAGE_DTYPES)
        validation.choice(self.span_layout, "span_layout", SPAN_LAYOUTS)
        if self.signatures_per_entry == 1:  # no spans: nothing to lay out, saved as before layouts existed
            object.__setattr__(self, "span_layout", "overlapping")
        if self.quantize_stored and self.storage_dtype not in ("f32", "int8"):
            raise InvalidArgumentError(f"quantize_stored means storage_dtype='int8', not {self.storage_dtype!r}")
        if self.quantize_stored or self.storage_dtype == "int8":
            object.__setattr__(self, "storage_dtype", "int8")
            object.__setattr__(self, "quantize_stored", True)

    @property
    def signature_bytes(self) -> int:
        return self.hdc_dim // 8

    @property
    def spans(self) -> int:
        """Span signatures (and span means) per entry: signatures_per_entry - 1."""
        return self.signatures_per_entry - 1

    @property
    def span_signature_bytes(self) -> int:
        """Bytes of one span signature."""
        return min(self.hdc_dim, SPAN_SIGNATURE_BITS) // 8

    @property
    def pooled_width(self) -> int:
        """Floats of an entry's pooled keys: its mean key, then each span's mean."""
        return self.signatures_per_entry * self.embed_dim

    def to_dict(self) -> dict[str, Any]:
        # f32 and int8 stores are saved as before storage_dtype existed, so
        # older hmem releases keep opening them; f16 and bf16 stores name it,
        # and an older release refuses them (an unknown setting).
        out = dataclasses.asdict(self)
        if self.storage_dtype in ("f32", "int8"):
            del out["storage_dtype"]
        if self.signatures_per_entry == 1:  # likewise: a store without spans is saved as before they existed
            del out["signatures_per_entry"]
            del out["span_layout"]
        elif self.span_layout == "disjoint":  # saved as before layouts existed
            del out["span_layout"]
        if not self.chunks:  # likewise; a store of chunks names it, and an older release refuses it
            del out["chunks"]
        if not self.token_rerank:  # likewise
            del out["token_rerank"]
        return out

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
        if "span_layout" not in data:  # saved before layouts existed: its spans are disjoint
            data = {**data, "span_layout": "disjoint"}
        try:
            return cls(**data)
        except InvalidArgumentError as exc:
            raise UnsupportedFormatError(f"the store's config cannot be honoured: {exc.message}") from None
