"""Reading an entry's tensors: from the open shard (or a full one whose
file is being sealed) while it is in memory, else from its shard file
through the bounded cache of memory maps, each
tensor's CRC-32C checked the first time it is read (docs/format.md); and
the cheap health check of stats(): which shard files are missing or of the
wrong size, and whether index.json is older than the files (docs/reliability.md,
"Degraded reads")."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from hmem import file_reads, validation
from hmem.errors import (
    CorruptStoreError,
    EntryNotFoundError,
    Hint,
    HmemError,
    InvalidArgumentError,
    StoreChangedError,
)
from hmem.formats import shard_file, stamp, store_files
from hmem.formats.records import EVICTED
from hmem.kernels import checksum as checksum_kernels
from hmem.store import storage as storage_codec
from hmem.store.results import EntryInfo, StoredEntry, StoredKV, StoreHealth
from hmem.store.shard_builder import ShardBuilder
from hmem.store.shard_reader import ShardReader
from hmem.store.state import StoreState

_NOT_REGULAR = -1  # what _file_size gives for a link or anything but a regular file


def _byte_size(buffer: Any) -> int:
    size = getattr(buffer, "nbytes", None)  # numpy arrays, memoryviews: no new object
    return int(size) if size is not None else memoryview(buffer).nbytes


def _read_ahead(fd: int, begins: np.ndarray, sizes: np.ndarray) -> None:
    """Ask the kernel to read each run of adjacent pieces (at `begins`,
    ascending, of `sizes` bytes) from the disk now, whole: the reads of a
    run, a checked megabyte at a time, then find it in the page cache or
    arriving, instead of one disk read after another."""
    if not hasattr(os, "posix_fadvise"):
        return
    ends = begins + sizes
    starts = np.flatnonzero(np.concatenate(([True], begins[1:] != ends[:-1])))
    stops = np.concatenate((starts[1:], [len(begins)])) - 1
    for first, last in zip(begins[starts].tolist(), ends[stops].tolist()):
        os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_WILLNEED)


class EntryReader:
    """Tensors of the records of one StoreState."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    def kv(self, pos: int, *, check: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the record at `pos`, as float32 rows (each
        tensor's CRC checked on first read with verify_reads, or when `check`)."""
        state = self.state
        storage = state.config.storage_dtype
        entry_id, shard_idx, n_tokens = state.records[["entry_id", "shard_idx", "n_tokens"]][pos].tolist()
        if storage == "int8" or self._in_memory(shard_idx) is not None:
            stored = self.stored(pos, check=check)
            rows = [storage_codec.decode(stored[kind], stored.get(kind + "s"), storage) for kind in ("k", "v")]
            return rows[0], rows[1]
        # a sealed shard, no scales: both tensors through one look-up of the entry's index row
        reader = self.shard(shard_idx)
        keys, values = reader.pair(
            entry_id, shard_file.DTYPES[shard_file.KV_DTYPES[storage]], (n_tokens, state.config.embed_dim)
        )
        if state.verify_reads if check is None else check:
            verified = reader.verified
            for kind, array in (("k", keys), ("v", values)):
                if (entry_id, kind) not in verified and not reader.check(entry_id, kind, array):
                    raise CorruptStoreError(
                        f"entry {entry_id}: tensor {kind}_{entry_id} in {reader.path.name} fails its checksum",
                        hint=Hint.VERIFY_FULL,
                    )
        return storage_codec.decode(keys, None, storage), storage_codec.decode(values, None, storage)

    def keys(self, pos: int, *, check: bool | None = None) -> np.ndarray:
        """The keys of the record at `pos` alone, as float32 rows (checked as kv() checks)."""
        storage = self.state.config.storage_dtype
        scales = self.tensor(pos, "ks", check=check) if storage == "int8" else None
        return storage_codec.decode(self.tensor(pos, "k", check=check), scales, storage)

    def stored(self, pos: int, *, check: bool | None = None) -> dict[str, np.ndarray]:
        """The K/V tensors of the record at `pos` as the shard holds them, not
        decoded: "k" and "v" in the storage dtype (bf16 as its uint16 words)
        and, in an int8 store, their float32 row scales "ks" and "vs"."""
        kinds = ("k", "v", "ks", "vs") if self.state.config.storage_dtype == "int8" else ("k", "v")
        return {kind: self.tensor(pos, kind, check=check) for kind in kinds}

    def meta(self, pos: int) -> dict[str, Any] | None:
        """The metadata of the record at `pos` (put with the entry), or None."""
        state = self.state
        row = state.records[pos]
        entry_id, shard_idx = int(row["entry_id"]), int(row["shard_idx"])
        builder = self._in_memory(shard_idx)
        if builder is not None:
            text = builder.meta(entry_id)
        else:
            text = self.shard(shard_idx).meta(entry_id)
        if text is None:
            return None
        value = shard_file.parse_meta(text)  # as verify checks it
        if value is None:
            raise CorruptStoreError(f"entry {entry_id}: its metadata in shard {shard_idx} is damaged", hint=Hint.VERIFY)
        return value

    # ---- entries by id (Store.get, Store.stored_kv, the listings) ------------------

    def live_in(self, layer_idx: int | None) -> np.ndarray:
        """Positions of the live records (of layer `layer_idx`, if given)."""
        live = self.state.live_positions()
        if layer_idx is not None:
            live = live[self.state.records["layer_idx"][live] == validation.layer_index(layer_idx)]
        return live

    def position(self, entry_id: int) -> int:
        """Where the live entry `entry_id` is in the records (ids ascend)."""
        state = self.state
        ids = state.records["entry_id"][: state.n]
        pos = int(np.searchsorted(ids, entry_id))
        if pos >= state.n or int(ids[pos]) != entry_id or state.records["shard_idx"][pos] == EVICTED:
            raise EntryNotFoundError(
                f"the store at {state.path} holds no entry {entry_id}", hint="list the live ids with Store.entry_ids()"
            )
        return pos

    def _info(self, pos: int) -> EntryInfo:
        row = self.state.records[pos]
        return EntryInfo.from_record(row, int(self.state.entry_file_bytes(int(row["n_tokens"]))))

    def entry(self, pos: int) -> StoredEntry:
        """The record at `pos`: its metadata and K/V decoded, as read-only arrays."""
        keys, values = self.kv(pos)
        return StoredEntry(self._info(pos), _read_only(keys), _read_only(values), self.meta(pos))

    def stored_kv(self, pos: int) -> StoredKV:
        """The record at `pos`: its K/V as the shard holds them (stored())."""
        tensors = {kind: _read_only(array) for kind, array in self.stored(pos).items()}
        storage = self.state.config.storage_dtype
        return StoredKV(
            self._info(pos),
            storage,
            shard_file.KV_DTYPES[storage],
            tensors["k"],
            tensors["v"],
            tensors.get("ks"),
            tensors.get("vs"),
            self.meta(pos),
        )

    def prefetch(self, positions: np.ndarray, kinds: tuple[str, ...] | None = None) -> None:
        """On object storage, fetch what reading these records' tensors
        (`kinds`; by default their K/V) will need, all at once: first the
        header and index of each shard not yet read whose head the state
        objects did not give, then the tensors' byte ranges, the requests
        of each round made concurrently (hmem/store/object_fetch.py).  The
        reads that follow then wait for no request.  Nothing for a local
        store; damage found here is left for those reads to report."""
        state = self.state
        fetcher = state.cache.fetcher
        if fetcher is None or not len(positions):
            return
        if kinds is None:
            kinds = ("k", "v", "ks", "vs") if state.config.storage_dtype == "int8" else ("k", "v")
        rows = state.records[np.unique(positions)]
        sealed = [i for i in np.unique(rows["shard_idx"]).tolist() if i < len(state.shards)]
        remote = [i for i in sealed if fetcher.remote_bytes(state.shards[i].uid) is not None]
        if not remote:
            return
        try:
            fetcher.fetch_heads([state.shards[i].uid for i in remote])
            spans = []
            for row in rows[np.isin(rows["shard_idx"], remote)]:
                entry_id, shard_idx = int(row["entry_id"]), int(row["shard_idx"])
                reader = self.shard(shard_idx)
                for kind in kinds:
                    dtype, shape = shard_file.tensor_spec(
                        kind,
                        int(row["n_tokens"]),
                        state.config.embed_dim,
                        state.config.storage_dtype,
                        state.config.signatures_per_entry,
                    )
                    spans.append((reader.uid, *reader.span(entry_id, kind, int(np.prod(shape)) * dtype.itemsize)))
            fetcher.fetch_ranges(spans)
        except HmemError:
            return  # the reads report it, each for its own entry

    def tensor(self, pos: int, kind: str, *, check: bool | None = None) -> np.ndarray:
        """Tensor `kind` (k, v, p, ks, vs) of the record at `pos`, its CRC
        checked on first read (with verify_reads, or when `check`)."""
        state = self.state
        row = state.records[pos]
        entry_id, shard_idx = int(row["entry_id"]), int(row["shard_idx"])
        builder = self._in_memory(shard_idx)
        if builder is not None:
            # The open shard's memory is reused after it is sealed: copy.
            return builder.get(entry_id, kind).copy()
        reader = self.shard(shard_idx)
        dtype, shape = shard_file.tensor_spec(
            kind,
            int(row["n_tokens"]),
            state.config.embed_dim,
            state.config.storage_dtype,
            state.config.signatures_per_entry,
        )
        array = reader.tensor(entry_id, kind, dtype, shape)
        wanted = state.verify_reads if check is None else check
        if wanted and (entry_id, kind) not in reader.verified and not reader.check(entry_id, kind, array):
            raise CorruptStoreError(
                f"entry {entry_id}: tensor {kind}_{entry_id} in {reader.path.name} fails its checksum",
                hint=Hint.VERIFY_FULL,
            )
        return array

    def positions(self, entry_ids: np.ndarray) -> np.ndarray:
        """position() of many live entries at once."""
        state = self.state
        ids = state.records["entry_id"][: state.n]
        pos = np.searchsorted(ids, entry_ids)
        found = pos < state.n
        found[found] = ids[pos[found]] == entry_ids[found]
        found[found] = state.records["shard_idx"][pos[found]] != EVICTED
        if not found.all():
            raise EntryNotFoundError(
                f"the store at {state.path} holds no entry {int(entry_ids[~found][0])}",
                hint="list the live ids with Store.entry_ids()",
            )
        return pos

    def read_tensors_into(self, positions: np.ndarray, buffers: dict[str, Sequence[Any]]) -> None:
        """For each tensor kind, its tensor of the entry at each record
        position, as stored, into the writable buffer beside it
        (buffers[kind][i] for positions[i]), checked against its CRC-32C
        (always: the bytes come from the file, not from a map read before).
        Tensors of sealed local shards are read straight into the buffers
        without the GIL (the checksum kernels' read_checked: adjacent ones
        of a file a megabyte per preadv, each checked right after; no page
        of the shard mapped), a shard's at a time; the others are copied
        from where tensor() finds them.  Array operations and one list per
        shard: a chunk of many layers costs few Python objects."""
        state = self.state
        config = state.config
        rows = state.records[positions]
        entry_ids = rows["entry_id"].astype(np.int64)
        kinds = list(buffers)
        wanted: dict[str, np.ndarray] = {}
        for kind in kinds:
            outs = buffers[kind]
            if len(outs) != len(positions):
                raise InvalidArgumentError(f"{len(positions)} tensors, {len(outs)} buffers: give one buffer each")
            sizes = {}
            for n_tokens in np.unique(rows["n_tokens"]).tolist():
                dtype, shape = shard_file.tensor_spec(
                    kind, n_tokens, config.embed_dim, config.storage_dtype, config.signatures_per_entry
                )
                sizes[n_tokens] = int(np.prod(shape)) * dtype.itemsize
            wanted[kind] = np.array([sizes[n] for n in rows["n_tokens"].tolist()], dtype=np.int64)
            given = np.array([_byte_size(out) for out in outs], dtype=np.int64)
            if (wanted[kind] != given).any():
                i = int(np.flatnonzero(wanted[kind] != given)[0])
                raise InvalidArgumentError(
                    f"tensor {kind}_{entry_ids[i]} is {wanted[kind][i]} bytes, its buffer {given[i]}"
                )
        if not len(positions):
            return
        shards = rows["shard_idx"]
        for shard_idx in np.unique(shards).tolist():
            chosen = np.flatnonzero(shards == shard_idx)
            reader = None if self._in_memory(shard_idx) is not None else self.shard(shard_idx)
            if (
                reader is None
                or reader.source is not None
                or not self._read_from_file(reader, chosen, rows, buffers, wanted)
            ):
                # in memory, on object storage, or its file replaced since it was mapped
                for kind in kinds:
                    for i in chosen.tolist():
                        out = np.frombuffer(buffers[kind][i], dtype=np.uint8)
                        out[:] = self.tensor(int(positions[i]), kind, check=True).view(np.uint8).reshape(-1)

    def _read_from_file(
        self,
        reader: ShardReader,
        chosen: np.ndarray,
        rows: np.ndarray,
        buffers: dict[str, Sequence[Any]],
        wanted: dict[str, np.ndarray],
    ) -> bool:
        """read_tensors_into for the `chosen` rows, all of `reader`'s shard,
        by read_checked; False (nothing read) when the shard's path no
        longer names the file the reader maps."""
        kinds = list(buffers)
        entry_ids = rows["entry_id"].astype(np.int64)
        # every tensor wanted: its target (kind, index), file offset and CRC-32C
        parts = []
        for k, kind in enumerate(kinds):
            for size in np.unique(wanted[kind][chosen]).tolist():
                some = chosen[wanted[kind][chosen] == size]
                begins, crcs = reader.spans(entry_ids[some], kind, size)
                parts.append((np.full(len(some), k), some, begins, crcs))
        which, index, begins, crcs = (np.concatenate(column) for column in zip(*parts))
        sort = np.argsort(begins, kind="stable")
        which, index, begins = which[sort], index[sort], begins[sort]
        outs = [buffers[kinds[k]][i] for k, i in zip(which.tolist(), index.tolist())]
        sizes = np.stack([wanted[kind] for kind in kinds])[which, index]
        fd = self._open_mapped(reader)
        if fd is None:
            return False
        bad = self._read_checked(reader, fd, begins, sizes, outs, crcs[sort].astype(np.uint32))
        if bad >= 0:
            kind, entry_id = kinds[int(which[bad])], int(entry_ids[index[bad]])
            raise CorruptStoreError(
                f"entry {entry_id}: tensor {kind}_{entry_id} in {reader.path.name} fails its checksum",
                hint=Hint.VERIFY_FULL,
            )
        return True

    @staticmethod
    def _open_mapped(reader: ShardReader) -> int | None:
        """A descriptor of the very file `reader` maps, or None when its path
        names another file now or none (a compaction wrote the shard again
        under its name, or removed it, after this reader's commit): that
        commit's tensors are then read through the map, which keeps the old
        file alive, never from the new one."""
        try:
            fd = file_reads.open_regular(reader.path)
        except OSError:
            return None
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != reader.identity:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def _read_checked(
        reader: ShardReader, fd: int, begins: np.ndarray, sizes: np.ndarray, buffers: list[Any], crcs: np.ndarray
    ) -> int:
        """Fill the buffers (of `sizes` bytes) from the shard file open at
        `fd` (closed here) at `begins` (ascending), each checked against its
        CRC-32C; the index of the first that fails, or -1."""
        try:
            _read_ahead(fd, begins, sizes)
            return int(checksum_kernels.read_checked(fd, begins, buffers, crcs))
        except EOFError:
            raise CorruptStoreError(
                f"{reader.path.name} ends before the tensors its index names", hint=Hint.VERIFY
            ) from None
        finally:
            os.close(fd)

    def _in_memory(self, shard_idx: int) -> ShardBuilder | None:
        """The builder holding shard `shard_idx` in memory, if one does: the
        open shard, or a full one whose file a put's seal is still making
        durable (StoreState.sealing).  Each is read once: a put or flush
        beside this read may seal the open shard, or finish the sealing
        one, whose file is then in place."""
        state = self.state
        builder = state.builder
        if builder is not None and builder.index == shard_idx:
            return builder
        for sealing in state.sealing:
            if sealing.builder.index == shard_idx:
                return sealing.builder
        return None

    def shard(self, shard_idx: int) -> ShardReader:
        """The reader of a sealed shard, telling a store changed by a writer
        from a damaged file."""
        state = self.state
        info = state.shard_info(shard_idx)
        mapped = state.cache.mapped(shard_idx, info.uid)
        if mapped is not None:  # most reads: no path to make
            return mapped
        path = store_files.resolve(state.path, info.file, state.committed.pending)
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
            if isinstance(exc, StoreChangedError) and state.cache.fetcher is not None:
                raise  # on object storage: a newer commit removed the object (hmem/store/object_link.py)
            changed = state.store_changed()
            if changed and state.read_only:
                raise StoreChangedError(
                    f"{state.path} was changed by a writer since it was opened", hint=Hint.OPEN_AGAIN
                ) from None
            if isinstance(exc, StoreChangedError) and not changed:
                raise CorruptStoreError(
                    f"shard {info.file} is not the file the store names (its uid differs)", hint=Hint.VERIFY
                ) from None
            raise

    def health(self) -> StoreHealth:
        """Every shard file present with its recorded size and entries.bin
        holding the committed records: file sizes only, no tensor read."""
        state = self.state
        problems: list[str] = []
        missing: list[str] = []
        wrong_size: list[str] = []
        bad_shards: list[int] = []
        shard_of = state.records["shard_idx"][: state.n]
        fetcher = state.cache.fetcher  # a store on object storage: shards not fetched are there
        sealing = {seal.builder.index for seal in state.sealing}
        for idx, info in enumerate(state.shards):
            if idx in sealing:
                continue  # its file is being made durable (StoreState.sealing); not yet committed
            kept = fetcher.remote_bytes(info.uid) if fetcher is not None else None
            size = kept if kept is not None else self._file_size(info.file)
            if size == info.bytes:
                continue
            bad_shards.append(idx)
            live = int(np.count_nonzero(shard_of == idx))
            held = f"{live} live {'entry' if live == 1 else 'entries'}"
            if size is None:
                missing.append(info.file)
                problems.append(f"shard {info.file} is missing ({held})")
            elif size == _NOT_REGULAR:  # its size is another file's: never shown (docs/security.md)
                wrong_size.append(info.file)
                problems.append(
                    f"shard {info.file} is not a regular file (a symbolic link or the like): hmem reads "
                    f"nothing through it ({held})"
                )
            else:
                wrong_size.append(info.file)
                problems.append(f"shard {info.file} is {size} bytes, the store expects {info.bytes} ({held})")
        # evicted entries have shard_idx EVICTED; np.isin costs ~20 ms at its first call, so only when needed
        unreachable = int(np.count_nonzero(np.isin(shard_of, bad_shards))) if bad_shards else 0
        need = state.committed_n * state.record_size
        size = self._file_size(store_files.ENTRIES_FILE)
        entries_problem = ""
        if size is None:
            entries_problem = f"{store_files.ENTRIES_FILE} is missing"
        elif size == _NOT_REGULAR:
            entries_problem = f"{store_files.ENTRIES_FILE} is not a regular file (a symbolic link or the like)"
        elif size < need:
            entries_problem = (
                f"{store_files.ENTRIES_FILE} is {size} bytes, shorter than its {state.committed_n} "
                f"committed records ({need} bytes)"
            )
        if entries_problem:
            problems.append(entries_problem)
        stale = self._stale_index() if fetcher is None else None
        if stale:
            problems.append(stale)
        return StoreHealth(
            ok=not problems,
            problems=tuple(problems),
            advice=Hint.ROLL_FORWARD if stale else Hint.VERIFY_THEN_REPAIR if problems else "",
            missing_shards=tuple(missing),
            wrong_size_shards=tuple(wrong_size),
            unreachable_entries=unreachable,
            entries_file_problem=entries_problem,
            stale_index=stale or "",
        )

    def _stale_index(self) -> str | None:
        """Why the store's index.json is older than its files (a later
        commit's stamp, records past it with ids it never reserved:
        hmem/formats/stamp.py), as verify reports it; None when it is not.
        Only a reader meets one (a writer refuses to open such a store),
        and only while index.json is still the one it loaded: after a
        writer's commit the newer files are that commit's, not evidence."""
        state = self.state
        evidence = stamp.stale_evidence(state.path, state.committed)
        if evidence is None or state.store_changed():
            return None
        return evidence

    def _file_size(self, name: str) -> int | None:
        """The size of a file the commit names, where a reader finds it now
        (before or after a pending rename); None when it is not there,
        _NOT_REGULAR for a link or anything but a regular file: never
        followed, so no size of a file outside the store is ever shown."""
        state = self.state
        for path in dict.fromkeys((store_files.resolve(state.path, name, state.committed.pending), state.path / name)):
            try:
                st = os.lstat(path)
            except OSError:  # missing, or the path is no longer usable
                continue
            return st.st_size if stat.S_ISREG(st.st_mode) else _NOT_REGULAR
        return None


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view
