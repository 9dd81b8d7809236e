"""Write LMCache caches with LMCache 0.5.6 itself, on the CPU: run by the
interpreter of an environment where LMCache is installed (the tests give
its path in HMEM_LMCACHE_PYTHON; hmem is not installed there), never
imported by the tests.

    python lmcache_writer.py OUT_DIR                  # every scenario, full size
    python lmcache_writer.py small OUT_DIR            # the same, tiny (tests/data/lmcache)
    python lmcache_writer.py readback FS_DIR SPEC_JSON OUT_JSON

LMCache's real engine (LMCacheEngine, its storage manager and backends)
stores the K/V of a tiny random Llama (transformers, bf16) for a few
requests with a shared prefix ("a", "b", "c"; "a-tagged": a's tokens with
the tag user=alice; "short": shorter than a chunk).  The only stand-in is
the GPU connector vLLM would give, here a copy between a dense CPU tensor
[2, layers, tokens, hidden] and LMCache's memory objects.  Every wait is
for a condition (files on disk, LMCache's own in-flight lists, an event
fd) with a ceiling.  OUT_DIR/oracle.json holds what LMCache reported, a
key per scenario (the docstring of each says what it records).

Scenarios (one directory of OUT_DIR each):

- local_disk, fs, layerwise: the three caches (scenario_caches);
- local_disk_restarted: a copy of local_disk that a second engine process
  (same config and directory) opened: lookups before and after it stored
  "a" again (scenario_restart);
- fs_deleted: a copy of fs without c's third chunk file, and a fresh
  engine's lookups on it (scenario_deleted_chunk);
- local_disk_evicted: a local_disk capacity of exactly 3 chunks, a, b, c
  stored, what stays and the same process's lookups (scenario_evicted);
- fs_headerless: an fs cache written with save_chunk_meta: false, the
  bytes without a header (scenario_headerless);
- fs_seeded: an fs cache whose chunk hashes start from NONE_HASH =
  hash("0") in a process with PYTHONHASHSEED=0, as vLLM sets it
  (scenario_seeded);
- mp: LMCache's multiprocess-mode L2 fs adapter, objects of a hybrid model
  (full attention, a window of 2 chunks, mamba) on 2 kv ranks, with holes;
  the adapter's presence bitmaps and LMCache's fold/unfold (scenario_mp);
- readback: a fresh engine's lookup and retrieve on fs (readback).

The restart and seeded scenarios run in a second process of this same
interpreter (mode ``_second``), started as soon as local_disk is written,
while the first process writes the rest.
"""

import dataclasses
import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache's usage telemetry: nothing leaves the machine

import torch
from lmcache.v1 import token_database
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.metadata import LMCacheMetadata
from transformers import LlamaConfig, LlamaForCausalLM

MODEL_NAME = "hmem-tests/tiny-llama"  # a "/" as in a Hugging Face id
VOCAB = 1000
WAIT_SECONDS = 300  # a ceiling for the writes landing, not a pace: each loop ends as soon as they have
FS_HEADER_BYTES = 28  # the fs connector's header for one group: 7 int32 words
SEED = "0"  # PYTHONHASHSEED of the seeded scenario
MP_WINDOWS = [-1, 2, 1]  # object groups: full attention, a window of 2 chunks, mamba (its last chunk)
MP_WORLD_SIZE = 2
# (request, chunk index, object group, kv rank index) of the objects the mp scenario deletes
MP_HOLES = [
    ("a-tagged", 1, 0, 1),  # full attention: a missing shard cuts the prefix there
    ("b", 2, 2, 0),  # mamba at b's last chunk: b falls back to the chunk before
    ("c", 2, 2, 1),  # mamba behind c's last chunk: harmless, mamba needs only the last one
]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The model and the requests: full size for CI, small for committed fixtures."""

    name: str
    chunk: int
    layers: int
    kv_heads: int
    head_dim: int
    model_hidden: int  # the Llama's hidden size (4 query heads)
    prefix: int  # tokens a, b and c share
    lengths: tuple[tuple[str, int], ...]  # a, b, c
    short: int

    @property
    def hidden(self) -> int:
        return self.kv_heads * self.head_dim

    def chunk_bytes(self) -> int:  # a whole chunk [2, L, T, H] of bf16
        return 2 * self.layers * self.chunk * self.hidden * 2


FULL = Geometry("full", 256, 4, 2, 16, 64, 512, (("a", 600), ("b", 800), ("c", 1100)), 100)
SMALL = Geometry("small", 16, 2, 1, 8, 32, 32, (("a", 40), ("b", 56), ("c", 72)), 10)
GEOMETRIES = {g.name: g for g in (FULL, SMALL)}


class CPUConnector(GPUConnectorInterface):
    """What vLLM's GPU connector does, on a dense CPU tensor kv=[2, L, T, H]."""

    def __init__(self, layers, hidden):
        self.layers, self.hidden = layers, hidden

    def get_shape(self, num_tokens):
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj, start, end, **kwargs):
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end, :])

    def to_gpu(self, memory_obj, start, end, **kwargs):
        kwargs["kv_out"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)


class CPULayerwiseConnector(VLLMPagedMemLayerwiseGPUConnector):
    """The same, one layer at a time, as LMCache's layerwise mode asks of
    it: each layer's memory objects are [T, 2, H].  A subclass of vLLM's
    layerwise connector only because LMCache checks for one; none of its
    GPU set-up runs."""

    def __init__(self, layers, hidden):
        self.kvcaches = None
        self.use_mla = False
        self.num_layers = layers
        self.hidden = hidden

    def get_shape(self, num_tokens):
        return torch.Size([num_tokens, 2, self.hidden])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        kv = kwargs["kv"]
        for layer in range(self.num_layers):
            for obj, start, end in zip(memory_objs[layer], starts, ends):
                obj.tensor.copy_(kv[:, layer, start:end, :].permute(1, 0, 2))
            yield
        yield


def requests(geom):
    draw = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, VOCAB, (geom.prefix,), generator=draw).tolist()
    out = [
        {
            "name": name,
            "tokens": prefix + torch.randint(0, VOCAB, (n - geom.prefix,), generator=draw).tolist(),
            "tags": {},
        }
        for name, n in geom.lengths
    ]
    out.append({"name": "a-tagged", "tokens": list(out[0]["tokens"]), "tags": {"lmcache.tag.user": "alice"}})
    out.append({"name": "short", "tokens": torch.randint(0, VOCAB, (geom.short,), generator=draw).tolist(), "tags": {}})
    return out


@torch.inference_mode()
def request_kv(geom, reqs):
    """Per request, [2, layers, tokens, kv_heads * head_dim] of a tiny random
    Llama (seeded: the same in every process), as LMCache's chunks hold it."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=geom.model_hidden,
        intermediate_size=2 * geom.model_hidden,
        num_hidden_layers=geom.layers,
        num_attention_heads=4,
        num_key_value_heads=geom.kv_heads,
        head_dim=geom.head_dim,
        max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    out = {}
    for req in reqs:
        tokens = req["tokens"]
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
        pairs = [(cache.layers[i].keys, cache.layers[i].values) for i in range(geom.layers)]
        rows = [[t[0].transpose(0, 1).reshape(len(tokens), geom.hidden) for t in pair] for pair in pairs]
        out[req["name"]] = torch.stack(
            [torch.stack([k for k, _ in rows]), torch.stack([v for _, v in rows])]
        ).contiguous()
    return out


def sha256_of(tensor):
    """SHA-256 of a bf16 tensor's bytes in C order."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint16).numpy().tobytes()).hexdigest()


def wait_until(condition, what):
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"{what}: not done in {WAIT_SECONDS} s")
        time.sleep(0.005)


def engine(
    instance, geom, kind, directory, *, model_name=MODEL_NAME, kv_dtype=torch.bfloat16, extra_config=None, **settings
):
    """An LMCache engine whose one disk tier is `kind` ("local_disk",
    "layerwise" or "fs") in `directory` (`extra_config`: more of the fs
    connector's settings)."""
    settings = {
        "chunk_size": geom.chunk,
        "local_cpu": False,
        "max_local_cpu_size": 0.25,
        "lmcache_instance_id": instance,
        **settings,
    }
    if kind in ("local_disk", "layerwise"):
        settings.setdefault("max_local_disk_size", 0.5)
        settings.update(local_disk=f"file://{directory}/", use_layerwise=kind == "layerwise")
    else:
        settings.update(
            remote_storage_plugins=["fs"],
            extra_config={"remote_storage_plugin.fs.base_path": directory, **(extra_config or {})},
        )
    metadata = LMCacheMetadata(
        model_name=model_name,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=kv_dtype,
        kv_shape=(geom.layers, 2, geom.chunk, geom.kv_heads, geom.head_dim),
        chunk_size=geom.chunk,
    )
    config = LMCacheEngineConfig.from_defaults(**settings)
    connector = (CPULayerwiseConnector if kind == "layerwise" else CPUConnector)(geom.layers, geom.hidden)
    made = LMCacheEngineBuilder.get_or_create(instance, config, metadata, connector, lambda t, r: None, lambda o, r: o)
    made.post_init()
    return made


def disk_backend(cache):
    return cache.storage_manager.storage_backends["LocalDiskBackend"]


def lookups(cache, reqs):
    """LMCache's lookup (tokens it would retrieve) of every request."""
    return {req["name"]: cache.lookup(req["tokens"], request_configs=req["tags"] or None) for req in reqs}


def write(cache, kind, directory, geom, kvs, reqs, *, header_bytes=FS_HEADER_BYTES):
    """Store every request, wait until LMCache's files are whole on disk;
    per request its chunk hashes, keys and lookup, per file the SHA-256 and
    shape of the K/V it holds (`header_bytes`: an fs file's header)."""
    suffix = ".data" if kind == "fs" else ".pt"
    separator = "-SEP-" if kind == "fs" else "-"
    layerwise = kind == "layerwise"
    out = {"requests": [], "files": {}}
    for req in reqs:
        kv = kvs[req["name"]]
        configs = req["tags"] or None
        hashes = [h for _, _, h in cache.token_database.process_tokens(req["tokens"], make_key=False)]
        chunk_keys = [k for _, _, k in cache.token_database.process_tokens(req["tokens"], request_configs=configs)]
        extra = {"request_configs": configs} if configs else {}
        if layerwise:  # a key, and a file, per layer of each chunk
            keys = [layer_key.to_string() for k in chunk_keys for layer_key in k.split_layers(geom.layers)]
            for _ in cache.store_layer(req["tokens"], kv=kv, req_id=req["name"], sync=True, **extra):
                pass
        else:
            keys = [k.to_string() for k in chunk_keys]
            cache.store(req["tokens"], kv=kv, req_id=req["name"], **extra)
        names = [key.replace("/", separator) + suffix for key in keys]
        sizes = {}
        for number, name in enumerate(names):
            if layerwise:  # [T, 2, H] of one layer
                chunk_number, layer = divmod(number, geom.layers)
                part = kv[:, layer, chunk_number * geom.chunk : (chunk_number + 1) * geom.chunk, :].permute(1, 0, 2)
            else:  # [2, L, T, H]
                part = kv[:, :, number * geom.chunk : (number + 1) * geom.chunk, :]
            out["files"].setdefault(name, {"sha256": sha256_of(part), "shape": list(part.shape)})
            sizes[name] = 2 * part.numel() + (header_bytes if kind == "fs" else 0)

        def landed():
            # local_disk writes the final file in place: whole once it has its size
            return all(
                os.path.exists(os.path.join(directory, n)) and os.path.getsize(os.path.join(directory, n)) == size
                for n, size in sizes.items()
            ) and not any(n.endswith(".tmp") for n in os.listdir(directory))

        wait_until(landed, f"{kind}: LMCache's files")
        if kind != "fs":  # and LMCache's own list of writes in flight is empty
            wait_until(lambda: not disk_backend(cache).disk_worker.put_tasks, f"{kind}: LMCache's puts")
        lookup = cache.lookup(req["tokens"], request_configs=configs)
        out["requests"].append({**req, "chunk_hashes": hashes, "keys": keys, "lookup": lookup})
    return out


def scenario_caches(out_dir, geom, kvs, reqs, kind):
    """local_disk, fs or layerwise: every request stored by one engine."""
    directory = os.path.join(out_dir, kind)
    os.makedirs(directory)
    cache = engine(kind, geom, kind, directory)
    out = write(cache, kind, directory, geom, kvs, reqs)
    if kind == "local_disk":  # the bytes LMCache's capacity accounting charges a chunk
        out["chunk_physical_bytes"] = max(m.size for m in disk_backend(cache).dict.values())
    LMCacheEngineBuilder.destroy(kind)
    return out


def scenario_headerless(out_dir, geom, kvs, reqs):
    """An fs cache whose connector is configured with save_chunk_meta:
    false: the chunks' bytes without a header."""
    directory = os.path.join(out_dir, "fs_headerless")
    os.makedirs(directory)
    cache = engine("fs_headerless", geom, "fs", directory, extra_config={"save_chunk_meta": False})
    out = write(cache, "fs", directory, geom, kvs, reqs, header_bytes=0)
    LMCacheEngineBuilder.destroy("fs_headerless")
    return out


def mtime_granularity_ns(directory):
    """The smallest step between distinct mtimes of a file rewritten in a
    loop (the loop ends once three steps are seen)."""
    probe = os.path.join(directory, ".mtime-probe")
    seen = []
    deadline = time.monotonic() + 5
    while len(seen) < 4 and time.monotonic() < deadline:
        with open(probe, "wb") as f:
            f.write(b"x")
        mtime = os.stat(probe).st_mtime_ns
        if not seen or mtime != seen[-1]:
            seen.append(mtime)
    os.remove(probe)
    steps = [b - a for a, b in zip(seen, seen[1:])]
    return min(steps) if steps else None


def scenario_restart(out_dir, geom, kvs, reqs):
    """A second engine process opens local_disk_restarted (a copy of
    local_disk, mtimes kept): LMCache's index starts empty, so every lookup
    misses; it stores "a" again (its files rewritten) and looks up every
    request again.  Files whose mtime is before `restarted_at` are ones the
    new process cannot read."""
    directory = os.path.join(out_dir, "local_disk_restarted")
    before_files = {n: os.stat(os.path.join(directory, n)).st_mtime_ns for n in sorted(os.listdir(directory))}
    granularity = mtime_granularity_ns(out_dir)
    restarted_at_ns = time.time_ns()
    cache = engine("local_disk_restarted", geom, "local_disk", directory)
    first = lookups(cache, reqs)
    [a] = [r for r in reqs if r["name"] == "a"]
    keys = [k.to_string() for _, _, k in cache.token_database.process_tokens(a["tokens"])]
    names = [k.replace("/", "-") + ".pt" for k in keys]
    cache.store(a["tokens"], kv=kvs["a"], req_id="a")

    def rewritten():
        backend = disk_backend(cache)
        return not backend.disk_worker.put_tasks and all(
            os.stat(os.path.join(directory, n)).st_mtime_ns >= restarted_at_ns for n in names
        )

    wait_until(rewritten, "restart: a's files rewritten")
    second = lookups(cache, reqs)
    LMCacheEngineBuilder.destroy("local_disk_restarted")
    files = {}
    for name in sorted(os.listdir(directory)):
        stat = os.stat(os.path.join(directory, name))
        files[name] = {"mtime_ns": stat.st_mtime_ns, "size": stat.st_size, "rewritten": name in names}
    newest_before = max(before_files.values())
    if newest_before >= restarted_at_ns:
        sys.exit("restart: a file of the first process is newer than the restart")
    return {
        "restarted_at": restarted_at_ns / 1e9,
        "restarted_at_ns": restarted_at_ns,
        "mtime_granularity_ns": granularity,
        "clock_resolution_s": time.get_clock_info("time").resolution,
        "newest_mtime_ns_before_restart": newest_before,
        "mtime_ns_before_restart": before_files,
        "stored_again": "a",
        "rewritten_files": names,
        "lookups_before_store": first,
        "lookups_after_store": second,
        "files": files,
    }


def scenario_seeded(out_dir, geom, kvs, reqs):
    """An fs cache whose hash chain starts from NONE_HASH = hash(seed) in a
    process run with PYTHONHASHSEED=seed (what vLLM's init_none_hash does
    with the builtin hash).  LMCache's TokenDatabase sets its module global
    NONE_HASH (read at each hash) to 0 when it is built without vLLM, so it
    is set after the engine is built."""
    if os.environ.get("PYTHONHASHSEED") != SEED:
        sys.exit(f"seeded: run with PYTHONHASHSEED={SEED}")
    directory = os.path.join(out_dir, "fs_seeded")
    os.makedirs(directory)
    cache = engine("fs_seeded", geom, "fs", directory)
    token_database.NONE_HASH = hash(SEED)
    if cache.token_database._get_init_hash() != hash(SEED):
        sys.exit("seeded: LMCache's TokenDatabase does not read NONE_HASH")
    out = write(cache, "fs", directory, geom, kvs, reqs)
    out.update(none_hash=hash(SEED), pythonhashseed=SEED, none_hash_from=f'hash("{SEED}")')
    LMCacheEngineBuilder.destroy("fs_seeded")
    token_database.NONE_HASH = 0
    return out


def scenario_deleted_chunk(out_dir, geom, reqs, fs):
    """fs_deleted: a copy of fs without c's third chunk file (index 2); a
    fresh engine's lookups stop before it although c's fourth stays."""
    directory = os.path.join(out_dir, "fs_deleted")
    shutil.copytree(os.path.join(out_dir, "fs"), directory)
    [c] = [r for r in fs["requests"] if r["name"] == "c"]
    deleted = c["keys"][2].replace("/", "-SEP-") + ".data"
    os.remove(os.path.join(directory, deleted))
    cache = engine("fs_deleted", geom, "fs", directory)
    found = lookups(cache, reqs)
    LMCacheEngineBuilder.destroy("fs_deleted")
    unreachable = [k.replace("/", "-SEP-") + ".data" for k in c["keys"][3:]]
    return {"deleted": deleted, "unreachable": unreachable, "files": sorted(os.listdir(directory)), "lookups": found}


def scenario_evicted(out_dir, geom, kvs, reqs, chunk_physical_bytes):
    """local_disk_evicted: capacity for exactly 3 chunks (in GiB, as LMCache
    takes it); a, b, c stored in turn; LMCache evicts per chunk (LRU), not
    per prefix.  The same process's lookups see its in-memory index, which
    is the files left."""
    directory = os.path.join(out_dir, "local_disk_evicted")
    capacity_gib = 3 * chunk_physical_bytes / 1024**3
    cache = engine("local_disk_evicted", geom, "local_disk", directory, max_local_disk_size=capacity_gib)
    backend = disk_backend(cache)
    stored = [r for r in reqs if r["name"] in ("a", "b", "c")]
    for req in stored:
        cache.store(req["tokens"], kv=kvs[req["name"]], req_id=req["name"])
        wait_until(lambda: not backend.disk_worker.put_tasks, "evicted: LMCache's puts")
    index = sorted(k.to_string().replace("/", "-") + ".pt" for k in backend.dict)
    found = lookups(cache, reqs)
    files = sorted(os.listdir(directory))
    LMCacheEngineBuilder.destroy("local_disk_evicted")
    if files != index:
        sys.exit(f"evicted: LMCache's index {index} is not the files {files}")
    return {
        "capacity_gib": capacity_gib,
        "capacity_bytes": int(capacity_gib * 1024**3),
        "chunk_physical_bytes": chunk_physical_bytes,
        "stored": [r["name"] for r in stored],
        "files": files,
        "lookups": found,
    }


def wait_event(fd, result, what):
    """Wait on an L2 adapter's event fd until `result()` is not None."""
    from lmcache.v1.platform.event_notifier import consume_fd

    deadline = time.monotonic() + WAIT_SECONDS
    while (got := result()) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            sys.exit(f"{what}: no answer in {WAIT_SECONDS} s")
        if select.select([fd], [], [], left)[0]:
            consume_fd(fd)
    return got


def scenario_mp(out_dir, geom, kvs, reqs):
    """mp: LMCache's multiprocess-mode L2 fs adapter, written and read
    through its own API: one object per (chunk, object group, kv rank) of a
    hybrid model on 2 ranks, keys from its TokenHasher (blake3) and
    ipc_key_to_object_keys; "a-tagged" carries the cache salt "alice".
    After the holes (MP_HOLES) are deleted through the adapter, per request
    the adapter's lookup bitmap of each (group, rank) row and LMCache's
    fold_unfold_grouped on them."""
    from lmcache.v1.distributed.api import (
        AttnWindowDesc,
        MemoryLayoutDesc,
        ObjectKey,
        ipc_key_to_grouped_object_keys,
        ipc_key_to_object_keys,
    )
    from lmcache.v1.distributed.bitmap_ops.fold import fold_unfold_grouped
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    directory = os.path.join(out_dir, "mp")
    adapter = create_l2_adapter(get_l2_adapter_config_class("fs").from_dict({"base_path": directory}))
    hasher = TokenHasher(chunk_size=geom.chunk, hash_algorithm="blake3")
    groups = list(range(len(MP_WINDOWS)))
    shard = geom.hidden // MP_WORLD_SIZE
    shape = torch.Size([2, 1, geom.chunk, shard])  # a group's K/V on one rank: [2, layers, tokens, hidden / ranks]
    layouts = {g: MemoryLayoutDesc(shapes=[shape], dtypes=[torch.bfloat16]) for g in groups}
    windows = AttnWindowDesc(num_chunks_in_sw=list(MP_WINDOWS), world_size=MP_WORLD_SIZE)
    kv_ranks = [ObjectKey.ComputeKVRank(MP_WORLD_SIZE, r, MP_WORLD_SIZE, r) for r in range(MP_WORLD_SIZE)]
    per_object = 2 * shape.numel()
    allocator = TensorMemoryAllocator(torch.empty(64 * 4096 + 64 * per_object, dtype=torch.uint8))

    def ipc_key(req, worker):
        salt = req["tags"].get("lmcache.tag.user", "")
        tokens = tuple(req["tokens"])
        return IPCCacheServerKey(MODEL_NAME, MP_WORLD_SIZE, worker, tokens, 0, len(tokens), req["name"], salt)

    objects, out_reqs, keys_of = {}, [], {}
    for req in reqs:
        hashes = hasher.compute_chunk_hashes(req["tokens"])
        kv = kvs[req["name"]]
        keys, memory = [], []
        for rank in range(MP_WORLD_SIZE):
            for group, group_keys in zip(groups, ipc_key_to_object_keys(ipc_key(req, rank), hashes, groups)):
                for chunk_index, key in enumerate(group_keys):
                    layer = group % geom.layers
                    part = kv[:, layer : layer + 1, chunk_index * geom.chunk : (chunk_index + 1) * geom.chunk]
                    part = part[..., rank * shard : (rank + 1) * shard]
                    obj = allocator.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
                    obj.tensor.copy_(part)
                    keys.append(key)
                    memory.append(obj)
                    keys_of[(req["name"], chunk_index, group, rank)] = key
                    objects.setdefault(
                        _object_key_to_filename(key),
                        {
                            "request": req["name"],
                            "chunk": chunk_index,
                            "object_group": group,
                            "kv_rank": key.kv_rank,
                            "chunk_hash": key.chunk_hash.hex(),
                            "cache_salt": key.cache_salt,
                            "sha256": sha256_of(part),
                            "shape": list(shape),
                        },
                    )
        if keys:
            task = adapter.submit_store_task(keys, memory)
            done = {}
            result = wait_event(
                adapter.get_store_event_fd(),
                lambda: done.update(adapter.pop_completed_store_tasks()) or done.get(task),
                "mp: store",
            )
            if not result.is_successful():
                sys.exit(f"mp: LMCache's adapter failed to store {req['name']}")
        for obj in memory:
            obj.ref_count_down()
        salt = ipc_key(req, None).cache_salt
        out_reqs.append({**req, "cache_salt": salt, "chunk_hashes": [h.hex() for h in hashes]})

    holes = [keys_of[hole] for hole in MP_HOLES]
    adapter.delete(holes)
    for req in out_reqs:
        rows = ipc_key_to_grouped_object_keys(
            ipc_key(req, None), [bytes.fromhex(h) for h in req["chunk_hashes"]], groups, layouts, windows
        )
        found = []
        for row in rows:
            task = adapter.submit_lookup_and_lock_task(row.keys, layouts)
            found.append(
                wait_event(
                    adapter.get_lookup_and_lock_event_fd(),
                    lambda: adapter.query_lookup_and_lock_result(task),
                    "mp: lookup",
                )
            )
            adapter.submit_unlock(row.keys)
        if req["chunk_hashes"]:
            hit, retain = fold_unfold_grouped(found, [row.sliding_window_size for row in rows])
        else:  # nothing to look up
            hit, retain = 0, [None] * len(rows)
        req["rows"] = [
            {
                "object_group": row.object_group_id,
                "kv_rank": kv_ranks[number % MP_WORLD_SIZE],  # rows are group-major, rank-minor
                "window": row.sliding_window_size,
                "present": [int(bits.test(i)) for i in range(bits.size())],
                "retained": retain_bits.get_indices_list() if retain_bits is not None else [],
                "files": [_object_key_to_filename(key) for key in row.keys],
            }
            for number, (row, bits, retain_bits) in enumerate(zip(rows, found, retain))
        ]
        if any(row.keys and row.keys[0].kv_rank != r["kv_rank"] for row, r in zip(rows, req["rows"])):
            sys.exit("mp: LMCache's rows are not group-major, rank-minor")
        req["hit_chunks"] = hit
        req["hit_tokens"] = hit * geom.chunk
    adapter.close()
    files = sorted(os.listdir(directory))
    return {
        "model": MODEL_NAME,
        "chunk_size": geom.chunk,
        "hash": "blake3",
        "none_hash": hasher.none_hash.hex(),
        "world_size": MP_WORLD_SIZE,
        "kv_ranks": kv_ranks,
        "windows": list(MP_WINDOWS),
        "object_shape": list(shape),
        "kv_dtype": "bfloat16",
        "holes": [
            {
                "request": r,
                "chunk": c,
                "object_group": g,
                "kv_rank": kv_ranks[k],
                "file": _object_key_to_filename(keys_of[(r, c, g, k)]),
            }
            for r, c, g, k in MP_HOLES
        ],
        "objects": objects,
        "files": files,
        "requests": out_reqs,
    }


def readback(fs_dir, spec, reqs, instance="readback"):
    """A fresh engine with an fs connector on `fs_dir` and the model of
    `spec` (model, layers, hidden, chunk_size, kv_dtype, and none_hash when
    the hashes start from one, as fs_seeded's do): per request its
    lookup, and the tokens retrieve gives with the SHA-256 of their K/V."""
    hidden, layers, chunk = int(spec["hidden"]), int(spec["layers"]), int(spec["chunk_size"])
    geom = Geometry("readback", chunk, layers, 1, hidden, hidden, 0, (), 0)
    kv_dtype = getattr(torch, spec.get("kv_dtype", "bfloat16"))
    cache = engine(instance, geom, "fs", fs_dir, model_name=spec["model"], kv_dtype=kv_dtype)
    token_database.NONE_HASH = int(spec.get("none_hash", 0))  # as scenario_seeded sets it
    out = {}
    for req in reqs:
        configs = req.get("tags") or None
        lookup = cache.lookup(req["tokens"], request_configs=configs)
        entry = {"lookup": lookup, "retrieved": 0, "sha256": None}
        if lookup:
            kv_out = torch.zeros(2, layers, len(req["tokens"]), hidden, dtype=kv_dtype)
            extra = {"request_configs": configs} if configs else {}
            mask = cache.retrieve(req["tokens"], kv_out=kv_out, **extra)
            hit = int(mask.sum())
            entry.update(retrieved=hit, sha256=sha256_of(kv_out[:, :, :hit]))
        out[req["name"]] = entry
    LMCacheEngineBuilder.destroy(instance)
    token_database.NONE_HASH = 0
    return out


def second_process(out_dir, geom_name, result_path):
    """Mode ``_second``: the restart and seeded scenarios, in a new process."""
    geom = GEOMETRIES[geom_name]
    reqs = requests(geom)
    kvs = request_kv(geom, reqs)
    result = {
        "restart": scenario_restart(out_dir, geom, kvs, reqs),
        "seeded": scenario_seeded(out_dir, geom, kvs, reqs),
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


def main(out_dir, geom):
    reqs = requests(geom)
    kvs = request_kv(geom, reqs)
    caches = {"local_disk": scenario_caches(out_dir, geom, kvs, reqs, "local_disk")}
    shutil.copytree(os.path.join(out_dir, "local_disk"), os.path.join(out_dir, "local_disk_restarted"))  # mtimes kept
    scratch = tempfile.mkdtemp(prefix="lmcache-writer-")
    result_path = os.path.join(scratch, "second.json")
    errors = open(os.path.join(scratch, "second.stderr"), "w+")  # a file: a pipe left unread could fill
    second = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "_second", out_dir, geom.name, result_path],
        env={**os.environ, "PYTHONHASHSEED": SEED},
        stderr=errors,
    )
    try:
        for kind in ("fs", "layerwise"):
            caches[kind] = scenario_caches(out_dir, geom, kvs, reqs, kind)
        caches["fs_headerless"] = scenario_headerless(out_dir, geom, kvs, reqs)
        oracle = {
            "model": MODEL_NAME,
            "layers": geom.layers,
            "kv_heads": geom.kv_heads,
            "head_dim": geom.head_dim,
            "hidden": geom.hidden,
            "chunk_size": geom.chunk,
            "kv_dtype": "bfloat16",
            "geometry": geom.name,
            "caches": caches,
            "deleted_chunk": scenario_deleted_chunk(out_dir, geom, reqs, caches["fs"]),
            "evicted": scenario_evicted(out_dir, geom, kvs, reqs, caches["local_disk"]["chunk_physical_bytes"]),
            "mp": scenario_mp(out_dir, geom, kvs, reqs),
            "readback": readback(
                os.path.join(out_dir, "fs"),
                {"model": MODEL_NAME, "layers": geom.layers, "hidden": geom.hidden, "chunk_size": geom.chunk},
                reqs,
            ),
        }
        second.wait(timeout=900)
        if second.returncode != 0:
            errors.seek(0)
            sys.exit(f"the second process failed:\n{errors.read()[-4000:]}")
        with open(result_path) as f:
            result = json.load(f)
    finally:
        if second.poll() is None:
            second.kill()
        errors.close()
        shutil.rmtree(scratch, ignore_errors=True)
    oracle["restart"] = result["restart"]
    caches["fs_seeded"] = result["seeded"]
    with open(os.path.join(out_dir, "oracle.json"), "w") as f:
        json.dump(oracle, f, indent=None, separators=(",", ":"))


SCENARIO_DIRS = (
    "local_disk",
    "fs",
    "layerwise",
    "local_disk_restarted",
    "fs_deleted",
    "local_disk_evicted",
    "fs_seeded",
    "fs_headerless",
    "mp",
)


def small(out_dir):
    """Mode ``small``: every scenario in the small geometry into `out_dir`
    (tests/data/lmcache), replacing what an earlier run left there."""
    os.makedirs(out_dir, exist_ok=True)
    for name in SCENARIO_DIRS:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    if os.path.exists(os.path.join(out_dir, "oracle.json")):
        os.remove(os.path.join(out_dir, "oracle.json"))
    leftover = sorted(set(os.listdir(out_dir)) - {"README.md"})
    if leftover:
        sys.exit(f"{out_dir} holds {leftover}: not a fixture directory this writer made")
    main(os.path.abspath(out_dir), SMALL)


def readback_mode(fs_dir, spec_path, out_path):
    """Mode ``readback``: SPEC_JSON is an oracle.json (its fs requests) or
    {"model", "layers", "hidden", "chunk_size", ["kv_dtype"], ["none_hash"],
    "requests": [{"name", "tokens", ["tags"]}]}."""
    with open(spec_path) as f:
        spec = json.load(f)
    reqs = spec["requests"] if "requests" in spec else spec["caches"]["fs"]["requests"]
    out = {"fs_dir": fs_dir, "requests": readback(os.path.abspath(fs_dir), spec, reqs)}
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "small":
        small(args[1])
    elif args[0] == "readback":
        readback_mode(*args[1:4])
    elif args[0] == "_second":
        second_process(*args[1:4])
    else:
        os.makedirs(args[0], exist_ok=True)
        main(os.path.abspath(args[0]), FULL)
