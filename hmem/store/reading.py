"""Reading an entry's tensors: from the open shard while it is in memory,
else from its shard file through the bounded cache of memory maps, each
tensor's CRC-32C checked the first time it is read (docs/format.md)."""

from __future__ import annotations

import numpy as np

from hmem.errors import CorruptStoreError, Hint, StoreChangedError
from hmem.formats import layout, shard_file
from hmem.store.quantize import dequantize_rows
from hmem.store.shard_reader import ShardReader
from hmem.store.state import StoreState


class EntryReader:
    """Tensors of the records of one StoreState."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    def kv(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the record at `pos`, as float32 rows."""
        keys, values = self.tensor(pos, "k"), self.tensor(pos, "v")
        if self.state.config.quantize_stored:
            keys = dequantize_rows(keys, self.tensor(pos, "ks"))
            values = dequantize_rows(values, self.tensor(pos, "vs"))
        return keys, values

    def tensor(self, pos: int, kind: str, *, check: bool | None = None) -> np.ndarray:
        """Tensor `kind` (k, v, p, ks, vs) of the record at `pos`, its CRC
        checked on first read (with verify_reads, or when `check`)."""
        state = self.state
        row = state.records[pos]
        entry_id, shard_idx = int(row["entry_id"]), int(row["shard_idx"])
        if state.builder is not None and shard_idx == state.builder.index:
            # The open shard's memory is reused after it is sealed: copy.
            return state.builder.get(entry_id, kind).copy()
        reader = self.shard(shard_idx)
        dtype, shape = shard_file.tensor_layout(kind, int(row["n_tokens"]), state.config.embed_dim,
                                                state.config.quantize_stored)
        array = reader.tensor(entry_id, kind, dtype, shape)
        wanted = state.verify_reads if check is None else check
        if wanted and (entry_id, kind) not in reader.verified and not reader.check(entry_id, kind, array):
            raise CorruptStoreError(f"entry {entry_id}: tensor {kind}_{entry_id} in {reader.path.name} "
                                    "fails its checksum", hint=Hint.VERIFY_FULL)
        return array

    def shard(self, shard_idx: int) -> ShardReader:
        """The reader of a sealed shard, telling a store changed by a writer
        from a damaged file."""
        state = self.state
        info = state.shard_info(shard_idx)
        path = layout.resolve(state.path, info.file, state.committed.pending)
        try:
            try:
                return state.cache.get(shard_idx, path, info)
            except CorruptStoreError:
                if path == state.path / info.file:
                    raise
                # the pending rename happened in between: the file has its final name now
                return state.cache.get(shard_idx, state.path / info.file, info)
        except (CorruptStoreError, StoreChangedError) as exc:
            # Say what really happened: a reader whose files a writer has
            # since replaced (compaction) sees them as missing or foreign;
            # when nothing was committed since, the file itself is damaged.
            changed = state.store_changed()
            if changed and state.read_only:
                raise StoreChangedError(f"{state.path} was changed by a writer since it was opened",
                                        hint=Hint.OPEN_AGAIN) from None
            if isinstance(exc, StoreChangedError) and not changed:
                raise CorruptStoreError(f"shard {info.file} is not the file the store names (its uid differs)",
                                        hint=Hint.VERIFY) from None
            raise
