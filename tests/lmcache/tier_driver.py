"""Drive LMCache 0.5.6's real engine on the CPU with an hmem store as its
remote tier (hmem.lmcache.connector): run by the interpreter of an
environment where LMCache and hmem are installed (the tests give its path
in HMEM_LMCACHE_PYTHON), never imported by the tests.

    python tier_driver.py        # orders on stdin, one JSON line each

The model, the requests ("a", "b", "c" sharing a prefix, "a-tagged",
"short") and the stand-in for vLLM's GPU connector are lmcache_writer.py's.
The process prints "loaded" once LMCache is imported, then carries out
each order, each engine made for it and destroyed after it.  Every wait
is for a condition (LMCache's puts in flight, the tier's commit, a line on
stdin, a file) and each order ends with a line the test waits for
("failed ERROR" when it raised).  Orders ({"mode": ..., ...}):

- write, out: OUT/fs (LMCache's own fs connector: the reference),
  OUT/hmem (the hmem tier) and OUT/capped (an hmem tier with a byte cap
  that its stores exceed), each request stored then committed;
  OUT/written.json holds per request its chunk keys, the SHA-256 of each
  chunk's K/V as stored, and the writing engines' lookups.  "written".
- read, kind ("hmem" or "fs"), store, out: an engine on that store: per
  request its lookup, retrieve (tokens and the SHA-256 of each retrieved
  chunk) and a second lookup after the retrieve, into the JSON file out.
  "done".  (A new engine process is one whose process never wrote.)
- loop, store, stop, counts: stores the requests, prints "ready", then
  stores, looks up and retrieves new requests (sharing a's prefix) and
  the stored ones, a line "iteration N" each, until the file stop exists;
  counts (JSON) holds the counts.  "stopped".
- kill, store, out: stores the requests, waits for the tier's commit,
  writes their keys and chunks' SHA-256 to out (JSON), prints "committed
  COMMITS" (the tier's commits so far), then stores new requests ("stored
  N commits COMMITS" each) until it is killed.
- hold, store, out: puts one chunk straight through the connector, in a
  memory object of LMCache's pool, and writes to out (JSON) its reference
  count: before, once staged, after a second put of it, once committed,
  after a put of it committed; and the chunk's SHA-256 as put and as the
  store holds it.  "done".
"""

import asyncio
import functools
import hashlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lmcache_writer as W
import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

GEOM = W.FULL
BACKEND = "RemoteBackend-hmem"
FAST = {"commit_seconds": 0.05, "refresh_seconds": 0.05}  # commits and others' changes seen at once
CAPPED_CHUNKS = 4  # the capped tier's byte cap holds about this many of the 7 chunks


@functools.cache
def model_kv():
    """The requests and their K/V (the tiny Llama runs once per process, when first needed)."""
    reqs = W.requests(GEOM)
    return reqs, W.request_kv(GEOM, reqs)


def hmem_engine(instance, store, **options):
    """An LMCache engine whose one remote tier is the hmem store `store`
    (`options`: the plugin's remote_storage_plugin.hmem.* settings)."""
    extra = {
        "remote_storage_plugin.hmem.module_path": "hmem.lmcache.connector",
        "remote_storage_plugin.hmem.class_name": "HmemConnector",
        "remote_storage_plugin.hmem.path": store,
        **{f"remote_storage_plugin.hmem.{k}": v for k, v in options.items()},
    }
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=GEOM.chunk,
        local_cpu=False,
        max_local_cpu_size=0.25,
        lmcache_instance_id=instance,
        remote_storage_plugins=["hmem"],
        extra_config=extra,
    )
    metadata = LMCacheMetadata(
        model_name=W.MODEL_NAME,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(GEOM.layers, 2, GEOM.chunk, GEOM.kv_heads, GEOM.head_dim),
        chunk_size=GEOM.chunk,
    )
    connector = W.CPUConnector(GEOM.layers, GEOM.hidden)
    made = LMCacheEngineBuilder.get_or_create(instance, config, metadata, connector, lambda t, r: None, lambda o, r: o)
    made.post_init()
    return made


def backend(cache):
    return cache.storage_manager.storage_backends[BACKEND]


def tier_connector(cache):
    """hmem's connector inside LMCache's wrappers (its commit() and tier)."""
    return backend(cache).connection.getWrappedConnector()


def configs(req):
    return req["tags"] or None


def tags_of(req):
    return {"request_configs": req["tags"]} if req["tags"] else {}


def chunk_keys(cache, req):
    return [
        k.to_string() for _, _, k in cache.token_database.process_tokens(req["tokens"], request_configs=configs(req))
    ]


def chunk_sha256(kv, tokens):
    """SHA-256 of each whole chunk of kv[:, :, :tokens]."""
    return [W.sha256_of(kv[:, :, i * GEOM.chunk : (i + 1) * GEOM.chunk]) for i in range(tokens // GEOM.chunk)]


def store(cache, req, kv):
    cache.store(req["tokens"], kv=kv, req_id=req["name"], **tags_of(req))


def committed(cache):
    """Wait until LMCache handed every put to the tier and the tier committed them."""
    W.wait_until(lambda: not backend(cache).put_tasks, "LMCache's puts")
    tier_connector(cache).commit(W.WAIT_SECONDS)


def store_keys(path):
    """The chunk keys an hmem store holds, through hmem's public API."""
    import hmem

    with hmem.Store.open(path, read_only=True) as s:
        return s.chunks.keys()


def retrieve(cache, req, layers=GEOM.layers):
    """Tokens retrieved and the retrieved K/V."""
    kv_out = torch.zeros(2, layers, len(req["tokens"]), GEOM.hidden, dtype=torch.bfloat16)
    mask = cache.retrieve(req["tokens"], kv_out=kv_out, **tags_of(req))
    got = int(mask.sum())
    return got, kv_out


def write(out_dir):
    reqs, kvs = model_kv()
    out = {"chunk_size": GEOM.chunk, "requests": []}
    fs_dir = os.path.join(out_dir, "fs")
    os.makedirs(fs_dir)
    fs = W.engine("fs", GEOM, "fs", fs_dir)
    reference = W.write(fs, "fs", fs_dir, GEOM, kvs, reqs)  # waits until LMCache's files are whole
    LMCacheEngineBuilder.destroy("fs")

    path = os.path.join(out_dir, "hmem")
    cache = hmem_engine("hmem", path, commit_seconds=0.05)
    for req in reqs:
        store(cache, req, kvs[req["name"]])
        committed(cache)
    for req, ref in zip(reqs, reference["requests"]):
        kv = kvs[req["name"]]
        keys = chunk_keys(cache, req)
        out["requests"].append(
            {
                "name": req["name"],
                "keys": keys,
                "fs_keys": ref["keys"],
                "chunk_sha256": chunk_sha256(kv, len(keys) * GEOM.chunk),
                "fs_lookup": ref["lookup"],
                "hmem_lookup": cache.lookup(req["tokens"], request_configs=configs(req)),
            }
        )
    out["hmem_stats"] = str(tier_connector(cache).tier.stats())
    LMCacheEngineBuilder.destroy("hmem")

    # the capped tier: chunk bytes as the uncapped store holds them, times CAPPED_CHUNKS
    import hmem

    with hmem.Store.open(path, read_only=True) as s:
        per_chunk = max(info.bytes for info in s.chunks.listing())
    cap = CAPPED_CHUNKS * per_chunk
    capped_path = os.path.join(out_dir, "capped")
    cache = hmem_engine("capped", capped_path, commit_seconds=0.05, max_bytes=cap)
    keys_after = {}
    for req in reqs:
        store(cache, req, kvs[req["name"]])
        committed(cache)
        keys_after[req["name"]] = store_keys(capped_path)
    out["capped"] = {
        "max_bytes": cap,
        "chunk_bytes": per_chunk,
        "keys_after_each_store": keys_after,
        "lookups": {req["name"]: cache.lookup(req["tokens"], request_configs=configs(req)) for req in reqs},
        "stats": str(tier_connector(cache).tier.stats()),
    }
    LMCacheEngineBuilder.destroy("capped")
    with open(os.path.join(out_dir, "written.json"), "w") as f:
        json.dump(out, f)


def read(cache, reqs):
    out = {}
    for req in reqs:
        lookup = cache.lookup(req["tokens"], request_configs=configs(req))
        got, kv_out = retrieve(cache, req)
        out[req["name"]] = {
            "keys": chunk_keys(cache, req),
            "lookup": lookup,
            "retrieved": got,
            "chunk_sha256": chunk_sha256(kv_out, got),
            "lookup_after_retrieve": cache.lookup(req["tokens"], request_configs=configs(req)),
        }
    return out


def read_store(number, kind, path, out):
    """A fresh engine on the store at `path`; what it reads, into `out`."""
    instance = f"read-{number}"
    if kind == "fs":
        cache = W.engine(instance, GEOM, "fs", path)
    else:
        cache = hmem_engine(instance, path)
    try:
        result = {"requests": read(cache, W.requests(GEOM))}
    finally:
        LMCacheEngineBuilder.destroy(instance)
    with open(out, "w") as f:
        json.dump(result, f)
    print("done", flush=True)


def said(tier, keys):
    """The tier's answer for `keys` (hmem's ChunkTier.contains, which the
    connector's lookups call), or what it raised."""
    try:
        return tier.contains(keys)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def new_request(number, reqs, kvs, chunks=2):
    """A request of a's first two chunks and `chunks` new ones (tokens and
    K/V drawn from `number`), with its K/V."""
    [a] = [r for r in reqs if r["name"] == "a"]
    draw = torch.Generator().manual_seed(1000 + number)
    tail = chunks * GEOM.chunk
    tokens = a["tokens"][: GEOM.prefix] + torch.randint(0, W.VOCAB, (tail,), generator=draw).tolist()
    fresh = torch.randn(2, GEOM.layers, tail, GEOM.hidden, generator=draw).to(torch.bfloat16)
    kv = torch.cat([kvs["a"][:, :, : GEOM.prefix], fresh], dim=2).contiguous()
    return {"name": f"new-{number}", "tokens": tokens, "tags": {}}, kv


def loop(order, path, stop_file, counts_path):
    """Store, look up and retrieve until `stop_file` exists; every retrieve
    must be bit-exact on the tokens it gives (fewer tokens than the lookup
    said, down to none, is a clean miss: an hmem command evicted them)."""
    reqs, kvs = model_kv()
    instance = f"loop-{order}"
    cache = hmem_engine(instance, path, **FAST)
    counts = dict.fromkeys(
        [
            "iterations",
            "stores",
            "lookups",
            "retrieves",
            "whole",
            "partial",
            "missed",
            "mismatched",
            "errors",
            "tier_errors",
        ],
        0,
    )
    failures = []
    for req in reqs:
        store(cache, req, kvs[req["name"]])
    committed(cache)
    print("ready", flush=True)
    tier = tier_connector(cache).tier
    number = 0
    while not os.path.exists(stop_file):
        req, kv = new_request(number, reqs, kvs)
        old = reqs[number % len(reqs)]
        for one, one_kv, new in ((req, kv, True), (old, kvs[old["name"]], False)):
            try:
                if new:  # stored, and handed to the tier: its lookup counts the new chunks
                    store(cache, one, one_kv)
                    W.wait_until(lambda: not backend(cache).put_tasks, "LMCache's puts")
                    counts["stores"] += 1
                keys = chunk_keys(cache, one)
                seen = [said(tier, keys)]  # what the tier said around the lookup, for a failure's message
                lookup = cache.lookup(one["tokens"], request_configs=configs(one))
                seen.append(said(tier, keys))
                counts["lookups"] += 1
                got, kv_out = retrieve(cache, one)
                seen.append(said(tier, keys))
                counts["retrieves"] += 1
                full = len(one["tokens"]) // GEOM.chunk * GEOM.chunk
                if not torch.equal(kv_out[:, :, :got], one_kv[:, :, :got]) or got % GEOM.chunk:
                    counts["mismatched"] += 1
                    failures.append(f"{one['name']}: {got} tokens retrieved, not bit-exact")
                elif got == full:
                    counts["whole"] += 1
                elif got:
                    counts["partial"] += 1
                else:
                    counts["missed"] += 1
                if got > lookup:
                    failures.append(
                        f"{one['name']}: {got} tokens retrieved after a lookup of {lookup}; "
                        f"the tier's contains before, after the lookup, after the retrieve: {seen}"
                    )
                raised = [answer for answer in seen if isinstance(answer, str)]
                if raised:
                    counts["tier_errors"] += 1
                    failures.append(f"{one['name']}: the tier's contains raised {raised[0]}")
            except Exception:
                counts["errors"] += 1
                failures.append(traceback.format_exc(limit=-3))
        number += 1
        counts["iterations"] = number
        print(f"iteration {number}", flush=True)
    committed(cache)
    remote = backend(cache)
    stats = tier_connector(cache).tier.stats()
    result = {
        **counts,
        "failures": failures[:20],
        "put_failed": remote._put_failed_count,
        "get_failed": remote._get_blocking_failed_count,
        "failed_commits": stats.failed_commits,
        "bad_chunks": stats.bad_chunks,
    }
    LMCacheEngineBuilder.destroy(instance)
    with open(counts_path, "w") as f:
        json.dump(result, f)
    print("stopped", flush=True)


def kill(path, out):
    """Store the requests, wait for their commit, say so (`out`: their
    keys and chunks' SHA-256), then store new requests until killed."""
    reqs, kvs = model_kv()
    cache = hmem_engine("kill", path, **FAST)
    for req in reqs:
        store(cache, req, kvs[req["name"]])
    committed(cache)
    stored = []
    for req in reqs:
        keys = chunk_keys(cache, req)
        stored.append(
            {"name": req["name"], "keys": keys, "chunk_sha256": chunk_sha256(kvs[req["name"]], len(keys) * GEOM.chunk)}
        )
    with open(out, "w") as f:
        json.dump({"chunk_size": GEOM.chunk, "requests": stored}, f)
    commits = tier_connector(cache).tier.stats().commits
    print(f"committed {commits}", flush=True)
    number = 0
    while True:
        req, kv = new_request(number, reqs, kvs, chunks=4)
        store(cache, req, kv)
        number += 1
        print(f"stored {number} commits {tier_connector(cache).tier.stats().commits}", flush=True)


def hold(path, out):
    """The tier keeps a put's buffer by a reference of its own until the
    chunk is committed (no copy), and gives back every reference it does
    not keep."""
    import numpy as np

    import hmem

    reqs, kvs = model_kv()
    cache = hmem_engine("hold", path, commit_seconds=3600, commit_bytes=1 << 40)
    conn, remote = tier_connector(cache), backend(cache)
    req = reqs[0]
    [(_, _, key), *_] = cache.token_database.process_tokens(req["tokens"], request_configs=configs(req))
    obj = remote.local_cpu_backend.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
    obj.tensor.copy_(kvs[req["name"]][:, :, : GEOM.chunk])

    def put():
        asyncio.run_coroutine_threadsafe(conn.put(key, obj), remote.loop).result(W.WAIT_SECONDS)
        return obj.get_ref_count()

    counts = {"before": obj.get_ref_count(), "staged": put(), "put_again": put()}
    conn.commit(W.WAIT_SECONDS)
    counts["committed"] = obj.get_ref_count()
    counts["put_committed"] = put()
    stored = np.zeros((2, GEOM.layers, GEOM.chunk, GEOM.hidden), dtype=np.uint16)
    with hmem.Store.open(path, read_only=True) as s:
        s.chunks.read_into(key.to_string(), list(stored[0]), list(stored[1]))
    counts["sha256_put"] = hashlib.sha256(obj.tensor.view(torch.uint16).numpy().tobytes()).hexdigest()
    counts["sha256_stored"] = hashlib.sha256(stored.tobytes()).hexdigest()
    obj.ref_count_down()
    LMCacheEngineBuilder.destroy("hold")
    with open(out, "w") as f:
        json.dump(counts, f)
    print("done", flush=True)


def main():
    print("loaded", flush=True)
    for number, line in enumerate(sys.stdin):
        order = json.loads(line)
        mode = order.pop("mode")
        try:
            if mode == "write":
                os.makedirs(order["out"], exist_ok=True)
                write(os.path.abspath(order["out"]))
                print("written", flush=True)
            elif mode == "read":
                read_store(number, order["kind"], order["store"], order["out"])
            elif mode == "loop":
                loop(number, order["store"], order["stop"], order["counts"])
            elif mode == "hold":
                hold(order["store"], order["out"])
            elif mode == "kill":
                kill(order["store"], order["out"])
            else:
                raise ValueError(f"no mode {mode!r}")
        except Exception:
            print("failed " + json.dumps(traceback.format_exc()), flush=True)


if __name__ == "__main__":
    main()
