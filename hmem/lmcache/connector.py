"""LMCache 0.5.6's remote storage plugin for an hmem store (docs/lmcache.md,
"hmem as LMCache's durable tier").  Imported by LMCache, in LMCache's
environment; nothing else in hmem imports this module.

    remote_storage_plugins: ["hmem"]
    extra_config:
      remote_storage_plugin.hmem.module_path: hmem.lmcache.connector
      remote_storage_plugin.hmem.class_name: HmemConnector
      remote_storage_plugin.hmem.path: /var/lib/hmem/tier      # or s3://bucket/prefix

Optional keys (same prefix): commit_seconds, commit_bytes, max_staged_bytes,
max_bytes (a new store's byte cap), lock_wait, refresh_seconds (TierSettings).

The connector only translates: LMCache's keys to their strings, its memory
objects to and from the bytes of a `ChunkTier` (hmem/lmcache/tier.py),
which does the work.  Every coroutine runs on LMCache's storage-manager
event loop, shared by all requests, so none blocks it: staging a chunk
(which may wait for room) and reading one (checksums, a copy) run on the
connector's own threads, and a lookup (`batched_contains`, `exists`) is in
memory.  A put's buffer is kept, by a reference, until its chunk is
committed, and written to the store from there (no copy of its own).
Memory for a chunk read is allocated without waiting (a full LMCache pool
makes the read a miss, never a stalled loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import Any

import numpy as np
import torch
from lmcache.v1.memory_management import MemoryFormat, TensorMemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from hmem.errors import InvalidArgumentError
from hmem.lmcache.tier import DTYPES, KV_2LTD, KV_T2D, ChunkRead, ChunkTier, TierSettings

log = logging.getLogger("hmem.lmcache.connector")

_OPTION_PREFIX = "remote_storage_plugin.{}."
_SETTINGS = {
    "commit_seconds": float,
    "commit_bytes": int,
    "max_staged_bytes": int,
    "max_bytes": int,
    "lock_wait": float,
    "refresh_seconds": float,
}
_THREADS = 8  # stage and read chunks beside the loop; reads and checksums release the GIL (cold reads gain from eight)


class HmemConnector(RemoteConnector):  # LMCache ships no type information: an Any base
    """An hmem store as LMCache's remote tier; one per LMCache worker process."""

    def __init__(self, *, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        metadata = local_cpu_backend.metadata
        if metadata.use_mla:
            raise InvalidArgumentError("an hmem tier keeps K and V chunks; MLA's latent chunks are not supported yet")
        self.name, options = _own_options(config, type(self).__name__)
        location = options.get("path")
        if not location:
            raise InvalidArgumentError(f"give the hmem store in extra_config: remote_storage_plugin.{self.name}.path")
        settings = TierSettings(**{k: kind(options[k]) for k, kind in _SETTINGS.items() if k in options})
        dtype = str(self.meta_dtypes[0]).removeprefix("torch.")
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"an hmem tier keeps {', '.join(DTYPES)} chunks, not {dtype}")
        self.torch_dtype = self.meta_dtypes[0]
        self.tier = ChunkTier(
            str(location),
            embed_dim=int(self.meta_shapes[0][-1]),
            dtype=dtype,
            settings=settings,
            storage_options=json.loads(options["storage_options"]) if "storage_options" in options else None,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="hmem-tier")

    # ---- lookups: in memory, from any thread ---------------------------------------------

    async def exists(self, key: Any) -> bool:
        return self.tier.contains([key.to_string()])[0]

    def exists_sync(self, key: Any) -> bool:
        return self.tier.contains([key.to_string()])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many of `keys`, from the first, the tier holds (LMCache's prefix hit)."""
        found = self.tier.contains([key.to_string() for key in keys])
        return found.index(False) if False in found else len(found)

    # ---- store and retrieve ---------------------------------------------------------------

    async def put(self, key: Any, memory_obj: Any) -> None:
        layout = memory_obj.get_memory_format().name
        shape = tuple(memory_obj.get_shapes()[0])
        layer = int(getattr(key, "layer_id", 0) or 0)
        release = None
        if isinstance(memory_obj, TensorMemoryObj):
            # LMCache's buffer is kept, not copied, until the chunk is
            # committed: a reference of the tier's own keeps LMCache from
            # freeing or evicting it meanwhile (at most max_staged_bytes).
            memory_obj.ref_count_up()
            release = memory_obj.ref_count_down
        # (Other memory objects are copied: LMCache keeps them until this returns.)
        try:
            staging = self._pool.submit(
                self.tier.stage, key.to_string(), memory_obj.byte_array, layout, shape, layer, release
            )
        except BaseException:  # not taken (the connector closed): the reference goes back
            if release is not None:
                release()
            raise
        if release is not None:  # a put cancelled before it ran gives its reference back too
            staging.add_done_callback(lambda done: release() if done.cancelled() else None)
        await asyncio.wrap_future(staging, loop=self.loop)

    async def get(self, key: Any) -> Any:
        """The chunk, or None: LMCache then keeps the hit before it."""
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        """The chunks of `keys`, in order, up to the first one the tier
        cannot give, None from there (LMCache keeps the hit before the
        first None): found in one job, then read on the connector's threads
        at once, each straight into the buffer LMCache allocates for it."""
        names = [key.to_string() for key in keys]
        # a layerwise key names one layer's [T, 2, H]
        layouts = [KV_T2D if hasattr(key, "layer_id") else KV_2LTD for key in keys]
        got: list[Any] = []
        try:
            found = await self.loop.run_in_executor(self._pool, self._find, names, layouts)
            for read in found:
                memory_obj = self.local_cpu_backend.allocate(
                    [torch.Size(read.shape)], [self.torch_dtype], MemoryFormat[read.layout], busy_loop=False
                )
                if memory_obj is None:
                    break  # LMCache's pool is full: a miss rather than a wait on its loop
                got.append((read, memory_obj))
            for read in found[len(got) :]:
                read.close()
            results = await asyncio.gather(
                *(
                    self.loop.run_in_executor(self._pool, read.copy_into, self._words(memory_obj, read.shape))
                    for read, memory_obj in got
                ),
                return_exceptions=True,
            )
        except Exception as exc:  # never an exception into LMCache's retrieve: a miss
            log.warning("hmem tier: chunks could not be read: %s", exc)
            for read, memory_obj in got:
                read.close()
                memory_obj.ref_count_down()
            return [None] * len(keys)
        out: list[Any] = []
        for name, (_, memory_obj), result in zip(names, got, results):
            if isinstance(result, BaseException):  # evicted meanwhile, or damaged: a miss from here on
                log.warning("hmem tier: chunk %s could not be read: %s", name, result)
            if isinstance(result, BaseException) or None in out:
                memory_obj.ref_count_down()
                out.append(None)
            else:
                out.append(memory_obj)
        return out + [None] * (len(keys) - len(out))

    def _find(self, names: list[str], layouts: list[str]) -> list[ChunkRead]:
        """The tier's reads of the chunks named, up to the first it does not hold."""
        found = []
        for name, layout in zip(names, layouts):
            read = self.tier.fetch(name, layout)
            if read is None:
                break
            found.append(read)
        return found

    def _words(self, memory_obj: Any, shape: tuple[int, ...]) -> np.ndarray:
        return np.frombuffer(memory_obj.byte_array, dtype=self.tier.word_type).reshape(shape)

    async def list(self) -> list[str]:
        return await self.loop.run_in_executor(self._pool, self.tier.keys)

    def remove_sync(self, key: Any) -> bool:
        return self.tier.remove(key.to_string())

    async def close(self) -> None:
        await self.loop.run_in_executor(self._pool, self.tier.close)
        self._pool.shutdown(wait=False)

    def commit(self, timeout: float | None = None) -> None:
        """Wait until every chunk put so far is committed (tests, benchmarks, shutdown)."""
        self.tier.commit(timeout)


def _own_options(config: Any, class_name: str) -> tuple[str, dict[str, Any]]:
    """The plugin's name in LMCache's configuration and its extra_config
    options: LMCache does not tell a plugin its name, so it is the plugin
    whose class_name is this class."""
    extra = dict(config.extra_config or {})
    names = [
        name
        for name in (config.remote_storage_plugins or [])
        if extra.get(_OPTION_PREFIX.format(name) + "class_name") == class_name
    ]
    if len(names) != 1:
        raise InvalidArgumentError(
            f"LMCache's configuration names {len(names)} remote storage plugins of class {class_name}; "
            "an engine takes one hmem tier"
        )
    prefix = _OPTION_PREFIX.format(names[0])
    return names[0], {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix)}


__all__ = ["HmemConnector", "KV_2LTD", "KV_T2D"]
