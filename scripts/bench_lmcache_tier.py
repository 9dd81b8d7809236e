"""hmem as LMCache 0.5.6's durable tier (issue 38, goal 6): store, retrieve
and lookup through hmem's plugin (hmem/lmcache/connector.py) beside
LMCache's own fs connector and local_disk backend, in one run, the same
engine and the same requests.

Run it with the interpreter LMCache is installed in (hmem importable there)::

    # the comparison: 3 rounds of 64 chunks (about 10 minutes on 2 busy cores)
    nice -n 10 /work/lmvenv/bin/python scripts/bench_lmcache_tier.py --out results.json
    # a quick check of the script (2 layers, 8 chunks, 1 round: about a minute)
    /work/lmvenv/bin/python scripts/bench_lmcache_tier.py --layers 2 --chunks 8 --rounds 1 --out quick.json
    # where hmem's threads spend their time: a sampler of every thread in hmem's
    # store and retrieve phases (<phase>.profile.txt); it takes the GIL 200 times a
    # second, so its figures are slower than a plain run's
    nice -n 10 /work/lmvenv/bin/python scripts/bench_lmcache_tier.py --backends fs,hmem --profile --out p.json

Shape: a real model's chunk, 32 layers x 256 tokens x 1024 hidden (8 KV
heads x 128) in bfloat16, LMCache's KV_2LTD [2, L, T, H]: 32 MiB a chunk.
One request of --chunks chunks (default 64 = 2 GiB) is stored by one
LMCache `store()` and read back by one `retrieve()`.  LMCache's CPU pool
holds the whole request (local_cpu off, so every chunk goes to the tier).
The "GPU" is a CPU stand-in: storing copies a source chunk (normal values in
bfloat16, finite: hmem refuses NaN and inf) into LMCache's buffer and stamps
the chunk's index into its first word; retrieving copies the buffer into a
scratch chunk (timed: the upload's stand-in, the same for every backend),
then checks every word (timed apart and left out of the retrieve time).

Each round measures every backend in turn (fs, local_disk, hmem, then the
next round), each phase in a process of its own, from an empty directory,
whose data is deleted once the backend is measured.  The figures (GB = 10^9
bytes; a table of medians over the rounds, min-max beside; JSON with every
round in --out):

store, "durable in the tier's own terms", timed from `store()`:
  fs          every chunk's file is renamed into place (page cache; fs never
              fsyncs, so a crash can lose them);
  local_disk  LMCache's disk writes are done (page cache; its index is in
              memory only: nothing survives a restart);
  hmem        the connector's `commit()` returned: every chunk is in a commit
              of the store (written, fsynced, renamed: crash-safe, checksummed).
  "+ fdatasync": fs and local_disk with an fdatasync of every file afterwards
  (what durability would cost them); hmem's figure is the same as above, its
  commits fsync.  "store() call": the call alone (the copy into LMCache's
  buffers); "staged" (hmem): every put returned, i.e. hmem copied the chunk.
retrieve, timed around `retrieve()` (lookup done before it, apart):
  warm        a NEW process, the tier's files still in the page cache from
              the store (local_disk cannot be read after a restart: its
              retrieve is in the storing process);
  cold        a new process after fdatasync + posix_fadvise(DONTNEED) on the
              tier's files (fs: its chunk files; hmem: every file of the
              store, its shards); only those pages are dropped.
lookup of a 128-chunk request (--lookup-chunks), every chunk present, in
  the storing process (hmem: after its commit, so from the store's index):
  median of --lookups calls of `engine.lookup(tokens)` (LMCache's token
  hashing included; also reported alone) and of
  `storage_manager.batched_contains(keys)` alone.  Lookup cost does not
  depend on chunk bytes: these chunks are 1 layer x 8 hidden.

Goals (issue 38): hmem store >= 0.8x fs store, hmem retrieve >= 1.0x fs
retrieve (warm and cold), lookup of a 128-chunk request <= 1 ms; the ratios
are of medians of the same run.  The machine (load average before and after
included) is recorded: on a shared machine the rounds vary, so compare
within a run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # after the environment above: LMCache reads it when imported
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

CHUNK = 256  # tokens a chunk: LMCache's default chunk_size
KV_HEADS, HEAD_DIM = 8, 128  # hidden 1024
MODEL = "bench/model"
BACKENDS = ("fs", "local_disk", "hmem")
GOALS = {"store": 0.8, "retrieve_warm": 1.0, "retrieve_cold": 1.0, "lookup_ms": 1.0}
GiB = 1 << 30


def chunk_bytes(layers: int, hidden: int = KV_HEADS * HEAD_DIM) -> int:
    return 2 * layers * CHUNK * hidden * 2


# ---- the phases: each runs in a process of its own -----------------------------------------


class Stamped(GPUConnectorInterface):
    """LMCache's GPU connector, on the CPU: the source of every chunk's
    values on store, a scratch chunk on retrieve."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.torch = torch
        self.layers, self.hidden = layers, hidden
        generator = torch.Generator().manual_seed(1)
        self.src = torch.randn((2, layers, CHUNK, hidden), generator=generator).to(torch.bfloat16)
        self.src_words = self.src.view(torch.int16)
        self.scratch = torch.empty_like(self.src)
        self.bad = 0
        self.checked = 0
        self.check_s = 0.0

    def get_shape(self, n: int) -> Any:
        return self.torch.Size([2, self.layers, n, self.hidden])

    def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for o, s, e in zip(objs, starts, ends):
            t = o.tensor
            t.copy_(self.src[:, :, : e - s])
            t.view(self.torch.int16)[0, 0, 0, 0] = s // CHUNK

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any) -> None:
        for o, s, e in zip(memory_objs, starts, ends):
            n = e - s
            self.scratch[:, :, :n].copy_(o.tensor)
            t0 = time.perf_counter()  # the check is ours, not the tier's: timed apart
            words = self.scratch.view(self.torch.int16)[:, :, :n]
            ok = int(words[0, 0, 0, 0]) == s // CHUNK
            words[0, 0, 0, 0] = self.src_words[0, 0, 0, 0]
            ok = ok and self.torch.equal(words, self.src_words[:, :, :n])
            self.bad += not ok
            self.checked += 1
            self.check_s += time.perf_counter() - t0

    def from_gpu(self, o: Any, s: int, e: int, **kw: Any) -> None:
        self.batched_from_gpu([o], [s], [e])

    def to_gpu(self, o: Any, s: int, e: int, **kw: Any) -> None:
        self.batched_to_gpu([o], [s], [e])


def make_engine(backend: str, directory: str, layers: int, hidden: int, pool_gib: float, opts: dict[str, str]) -> Any:
    cfg: dict[str, Any] = {
        "chunk_size": CHUNK,
        "local_cpu": False,
        "max_local_cpu_size": pool_gib,
        "lmcache_instance_id": "bench",
    }
    if backend == "local_disk":
        cfg.update(local_disk=f"file://{directory}/", max_local_disk_size=256.0)
    elif backend == "fs":
        cfg.update(remote_storage_plugins=["fs"], extra_config={"remote_storage_plugin.fs.base_path": directory})
    else:
        extra = {
            "remote_storage_plugin.hmem.module_path": "hmem.lmcache.connector",
            "remote_storage_plugin.hmem.class_name": "HmemConnector",
            "remote_storage_plugin.hmem.path": directory,
        }
        extra.update({f"remote_storage_plugin.hmem.{k}": v for k, v in opts.items()})
        cfg.update(remote_storage_plugins=["hmem"], extra_config=extra)
    heads = hidden // HEAD_DIM if hidden % HEAD_DIM == 0 else 1
    metadata = LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(layers, 2, CHUNK, heads, hidden // heads),
        chunk_size=CHUNK,
    )
    connector = Stamped(layers, hidden)
    engine = LMCacheEngineBuilder.get_or_create(
        "bench", LMCacheEngineConfig.from_defaults(**cfg), metadata, connector, lambda t, r: None, lambda o, r: o
    )
    engine.post_init()
    return engine, connector


def destroy_engine() -> None:
    LMCacheEngineBuilder.destroy("bench")


def tokens(n_chunks: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 50000 for i in range(n_chunks * CHUNK)]


def backend_of(engine: Any, backend: str) -> Any:
    name = "LocalDiskBackend" if backend == "local_disk" else f"RemoteBackend-{backend}"
    return engine.storage_manager.storage_backends[name]


def in_flight(engine: Any, backend: str) -> int:
    b = backend_of(engine, backend)
    return len(b.disk_worker.put_tasks) if backend == "local_disk" else len(b.put_tasks)


def hmem_connector(engine: Any) -> Any:
    return backend_of(engine, "hmem").connection.getWrappedConnector()


def tier_files(backend: str, directory: str) -> list[str]:
    """The files a backend keeps its chunks in (hmem: every file of the store)."""
    if backend == "hmem":
        return sorted(os.path.join(d, f) for d, _, names in os.walk(directory) for f in names)
    return sorted(f for f in glob.glob(os.path.join(directory, "*")) if not f.endswith(".tmp"))


def fdatasync_all(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def drop_pages(paths: list[str]) -> None:
    """Evict these files (only) from the page cache: written back first,
    as DONTNEED leaves dirty pages."""
    fdatasync_all(paths)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def poll(cond: Any, ceiling: float = 1800.0) -> None:
    end = time.monotonic() + ceiling
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("the backend did not finish within the ceiling")
        time.sleep(0.001)


def do_retrieve(engine: Any, connector: Stamped, toks: list[int], nbytes_chunk: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    hit = engine.lookup(toks)
    t_lookup = time.perf_counter() - t0
    connector.bad = connector.checked = 0
    connector.check_s = 0.0
    t0 = time.perf_counter()
    mask = engine.retrieve(toks)
    t_ret = time.perf_counter() - t0 - connector.check_s
    got = int(mask.sum())
    nbytes = got // CHUNK * nbytes_chunk
    return {
        "lookup_tokens": hit,
        "lookup_s": t_lookup,
        "retrieved_tokens": got,
        "retrieve_s": t_ret,
        "check_s": connector.check_s,
        "GBps": nbytes / t_ret / 1e9 if t_ret > 0 else 0.0,
        "chunks_checked": connector.checked,
        "bad_chunks": connector.bad,
    }


def phase_store(a: argparse.Namespace) -> dict[str, Any]:
    n, backend, directory = a.chunks, a.backend, a.data
    os.makedirs(directory, exist_ok=True)
    size = chunk_bytes(a.layers)
    engine, connector = make_engine(backend, directory, a.layers, KV_HEADS * HEAD_DIM, n * size / GiB + 0.5, a.opts)
    toks = tokens(n)
    t0 = time.perf_counter()
    engine.store(toks, req_id="bench")
    t_call = time.perf_counter() - t0
    poll(lambda: in_flight(engine, backend) == 0)
    t_staged = time.perf_counter() - t0
    res: dict[str, Any] = {"backend": backend, "chunks": n, "bytes": n * size, "store_call_s": t_call}
    if backend == "hmem":
        conn = hmem_connector(engine)
        conn.commit()
        t_done = time.perf_counter() - t0
        res["staged_s"] = t_staged
        res["tier_stats"] = dataclasses.asdict(conn.tier.stats())
        t_fsync = 0.0  # a commit fsyncs
    else:
        poll(lambda: len(tier_files(backend, directory)) >= n)
        t_done = time.perf_counter() - t0
        t1 = time.perf_counter()
        fdatasync_all(tier_files(backend, directory))
        t_fsync = time.perf_counter() - t1
    paths = tier_files(backend, directory)
    res.update(
        store_done_s=t_done,
        fdatasync_s=t_fsync,
        store_GBps=n * size / t_done / 1e9,
        store_fsync_GBps=n * size / (t_done + t_fsync) / 1e9,
        files=len(paths),
        file_bytes=sum(os.path.getsize(p) for p in paths),
    )
    if backend == "local_disk":  # its index dies with the process: retrieved here
        res["retrieve_warm"] = do_retrieve(engine, connector, toks, size)
        drop_pages(paths)
        res["retrieve_cold"] = do_retrieve(engine, connector, toks, size)
    destroy_engine()
    return res


def phase_retrieve(a: argparse.Namespace) -> dict[str, Any]:
    size = chunk_bytes(a.layers)
    if a.cold:
        drop_pages(tier_files(a.backend, a.data))
    t0 = time.perf_counter()
    engine, connector = make_engine(
        a.backend, a.data, a.layers, KV_HEADS * HEAD_DIM, a.chunks * size / GiB + 0.5, a.opts
    )
    t_engine = time.perf_counter() - t0
    res = {
        "backend": a.backend,
        "cold": a.cold,
        "engine_s": t_engine,
        **do_retrieve(engine, connector, tokens(a.chunks), size),
    }
    if a.backend == "hmem":
        res["tier_stats"] = dataclasses.asdict(hmem_connector(engine).tier.stats())
    destroy_engine()
    return res


def phase_lookup(a: argparse.Namespace) -> dict[str, Any]:
    layers, hidden, n = 1, 8, a.lookup_chunks
    os.makedirs(a.data, exist_ok=True)
    engine, _ = make_engine(a.backend, a.data, layers, hidden, 0.5, a.opts)
    toks = tokens(n, salt=3)
    engine.store(toks, req_id="lookup")
    poll(lambda: in_flight(engine, a.backend) == 0)
    if a.backend == "hmem":
        hmem_connector(engine).commit()
    else:
        poll(lambda: len(tier_files(a.backend, a.data)) >= n)
    keys = [k for _, _, k in engine.token_database.process_tokens(toks)]
    sm = engine.storage_manager
    full, contains, hashing = [], [], []
    hit = found = 0
    for _ in range(a.lookups):
        t0 = time.perf_counter()
        hit = engine.lookup(toks)
        full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        found, _ = sm.batched_contains(keys)
        contains.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        list(engine.token_database.process_tokens(toks))
        hashing.append(time.perf_counter() - t0)
    destroy_engine()
    return {
        "backend": a.backend,
        "chunks": n,
        "calls": a.lookups,
        "lookup_hit_tokens": hit,
        "contains_hit_chunks": found,
        "engine_lookup_ms": statistics.median(full) * 1e3,
        "engine_lookup_ms_min": min(full) * 1e3,
        "batched_contains_ms": statistics.median(contains) * 1e3,
        "hashing_ms": statistics.median(hashing) * 1e3,
    }


class Sampler(threading.Thread):
    """A sampling profiler of every thread of this process (py-spy is not
    always at hand, and cProfile sees one thread): each sample counts the
    innermost Python frame (self) and every function on the stack (total),
    per thread name.  A thread in C code (I/O, a copy, a checksum with the
    GIL released) shows the Python line that called it."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.interval = interval
        self.stop = threading.Event()
        self.samples = 0
        self.own: collections.Counter[tuple[str, str]] = collections.Counter()
        self.total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.per_thread: collections.Counter[str] = collections.Counter()

    def run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.interval):
            names = {t.ident: t.name.rstrip("0123456789_-") or t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                thread = names.get(ident, "?")
                f: Any = frame
                leaf = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"
                self.own[(thread, leaf)] += 1
                self.per_thread[thread] += 1
                seen = set()
                while f is not None:
                    func = f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_firstlineno} {f.f_code.co_name}"
                    if func not in seen:
                        seen.add(func)
                        self.total[(thread, func)] += 1
                    f = f.f_back

    def report(self, top: int = 25) -> str:
        lines = [f"{self.samples} samples every {self.interval * 1e3:.0f} ms; per thread: samples (self / total)"]
        for thread, count in self.per_thread.most_common():
            lines.append(f"\n== thread {thread}: {count} samples")
            own = [(c, k[1]) for k, c in self.own.items() if k[0] == thread]
            lines.append("  self:")
            lines += [f"    {c:6d} {100 * c / count:5.1f}%  {name}" for c, name in sorted(own, reverse=True)[:top]]
            total = [(c, k[1]) for k, c in self.total.items() if k[0] == thread]
            lines.append("  total:")
            lines += [f"    {c:6d} {100 * c / count:5.1f}%  {name}" for c, name in sorted(total, reverse=True)[:top]]
        return "\n".join(lines)


def run_phase(a: argparse.Namespace) -> None:
    sampler = None
    if a.profile and a.backend == "hmem" and a.phase != "lookup":
        sampler = Sampler()
        sampler.start()
    res = {"store": phase_store, "retrieve": phase_retrieve, "lookup": phase_lookup}[a.phase](a)
    if sampler is not None:
        sampler.stop.set()
        sampler.join()
        profile = a.result[: -len(".json")] + ".profile.txt"
        with open(profile, "w") as f:
            f.write(sampler.report())
        res["profile"] = profile
    with open(a.result, "w") as f:
        json.dump(res, f, indent=1)


# ---- the run ---------------------------------------------------------------------------------


def machine(directory: str) -> dict[str, Any]:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    import hmem

    return {
        "date": sh("date -u"),
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "nproc": os.cpu_count(),
        "mem_available_gib": round(_mem_available() / GiB, 1),
        "disk_free_gib": round(shutil.disk_usage(directory).free / GiB, 1),
        "filesystem": sh(f"df -T {directory} | tail -1"),
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo").split(":")[-1].strip(),
        "python": sys.version.split()[0],
        "hmem": hmem.__version__,
        # the tier's code changes between runs while it is developed: which one was measured
        "hmem_sources": _sources(os.path.dirname(hmem.__file__)),
        "lmcache": sh(f"{sys.executable} -m pip show lmcache 2>/dev/null | grep ^Version").split(":")[-1].strip(),
        "nice": os.nice(0),
    }


def _sources(package: str) -> dict[str, str]:
    """sha256[:12] of the tier's files and of all hmem's Python sources."""
    everything = hashlib.sha256()
    for d, _, names in sorted(os.walk(package)):
        for name in sorted(n for n in names if n.endswith(".py")):
            with open(os.path.join(d, name), "rb") as f:
                everything.update(f.read())
    out = {"hmem/**/*.py": everything.hexdigest()[:12]}
    for name in ("lmcache/connector.py", "lmcache/tier.py", "_io.py"):
        with open(os.path.join(package, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()[:12]
    return out


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


FIGURES = [
    # (label, key in a backend's round record, unit, higher is better)
    ("store, durable in the tier's terms", "store_GBps", "GB/s", True),
    ("store + fdatasync (hmem: as above)", "store_fsync_GBps", "GB/s", True),
    ("store() call", "store_call_s", "s", False),
    ("retrieve warm (local_disk: same process)", "retrieve_warm_GBps", "GB/s", True),
    ("retrieve cold (local_disk: same process)", "retrieve_cold_GBps", "GB/s", True),
    ("lookup 128 chunks: engine.lookup", "lookup_ms", "ms", False),
    ("lookup 128: batched_contains", "contains_ms", "ms", False),
    ("lookup 128: token hashing", "hashing_ms", "ms", False),
]


def flatten(rec: dict[str, Any]) -> dict[str, float]:
    """A backend's figures of one round, as the table names them."""
    out = {}
    s = rec.get("store", {})
    for key in ("store_GBps", "store_fsync_GBps", "store_call_s"):
        if key in s:
            out[key] = s[key]
    for kind in ("warm", "cold"):
        r = rec.get(f"retrieve_{kind}") or s.get(f"retrieve_{kind}")
        if r:
            out[f"retrieve_{kind}_GBps"] = r["GBps"]
    lk = rec.get("lookup")
    if lk:
        out.update(lookup_ms=lk["engine_lookup_ms"], contains_ms=lk["batched_contains_ms"], hashing_ms=lk["hashing_ms"])
    return out


def summarise(rounds: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    per: dict[str, dict[str, list[float]]] = {b: collections.defaultdict(list) for b in backends}
    for rnd in rounds:
        for b in backends:
            if b in rnd:
                for k, v in flatten(rnd[b]).items():
                    per[b][k].append(v)
    summary: dict[str, Any] = {
        b: {k: dict(zip(("median", "min", "max"), median_range(v))) for k, v in per[b].items()} for b in backends
    }
    ratios: dict[str, Any] = {}
    if "fs" in backends:
        for b in backends:
            if b == "fs":
                continue
            ratios[b] = {}
            for _, key, _, _ in FIGURES:
                if key in per[b] and key in per["fs"] and statistics.median(per["fs"][key]) > 0:
                    ratios[b][key] = statistics.median(per[b][key]) / statistics.median(per["fs"][key])
            # the ratio of each round (the same round's fs), to show the spread
            ratios[b]["per_round"] = [
                {
                    key: flatten(r[b])[key] / flatten(r["fs"])[key]
                    for _, key, _, _ in FIGURES
                    if key in flatten(r[b]) and key in flatten(r["fs"]) and flatten(r["fs"])[key] > 0
                }
                for r in rounds
                if b in r and "fs" in r
            ]
    goals: dict[str, Any] = {}
    if "hmem" in ratios:
        rh = ratios["hmem"]
        goals = {
            "store >= 0.8x fs": _goal(rh.get("store_GBps"), GOALS["store"]),
            "retrieve warm >= 1.0x fs": _goal(rh.get("retrieve_warm_GBps"), GOALS["retrieve_warm"]),
            "retrieve cold >= 1.0x fs": _goal(rh.get("retrieve_cold_GBps"), GOALS["retrieve_cold"]),
        }
    if "hmem" in summary and "lookup_ms" in summary["hmem"]:
        lk = summary["hmem"]["lookup_ms"]["median"]
        goals["lookup 128 chunks <= 1 ms (engine.lookup)"] = {"value": lk, "met": lk <= GOALS["lookup_ms"]}
        c = summary["hmem"]["contains_ms"]["median"]
        goals["lookup 128 chunks <= 1 ms (batched_contains)"] = {"value": c, "met": c <= GOALS["lookup_ms"]}
    return {"per_backend": summary, "ratio_to_fs": ratios, "goals": goals}


def _goal(value: float | None, bound: float) -> dict[str, Any]:
    return {"value": value, "met": value is not None and value >= bound}


def table(summary: dict[str, Any], backends: list[str]) -> str:
    per, ratios = summary["per_backend"], summary["ratio_to_fs"]
    others = [b for b in backends if b != "fs" and b in ratios]
    head = f"{'figure (median, min-max over rounds)':48s}" + "".join(f"{b:>24s}" for b in backends)
    head += "".join(f"{b + '/fs':>15s}" for b in others)
    lines = [head, "-" * len(head)]
    for label, key, unit, _ in FIGURES:
        if not any(key in per[b] for b in backends):
            continue
        row = f"{label + ' (' + unit + ')':48s}"
        for b in backends:
            if key in per[b]:
                m = per[b][key]
                row += f"{m['median']:.3f} ({m['min']:.3f}-{m['max']:.3f})".rjust(24)
            else:
                row += f"{'-':>24s}"
        for b in others:
            r = ratios[b].get(key)
            row += f"{r:14.2f}x" if r is not None else f"{'-':>15s}"
        lines.append(row)
    lines.append("")
    for name, g in summary["goals"].items():
        v = g["value"]
        lines.append(f"goal {name}: {'MET' if g['met'] else 'MISSED'} ({'n/a' if v is None else f'{v:.3f}'})")
    return "\n".join(lines)


def run_all(a: argparse.Namespace) -> int:
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}: choose among {', '.join(BACKENDS)}")
    base = a.dir or tempfile.mkdtemp(prefix="hmem-bench-tier-")
    os.makedirs(base, exist_ok=True)
    out = os.path.abspath(a.out)
    phase_dir = out[: -len(".json")] + ".phases" if out.endswith(".json") else out + ".phases"
    os.makedirs(phase_dir, exist_ok=True)
    size = chunk_bytes(a.layers)
    need = a.chunks * size * 1.3 + 1 * GiB  # one backend's data at a time (+ hmem's index and slack)
    free = shutil.disk_usage(base).free
    if free < need:
        raise SystemExit(f"{base} has {free / GiB:.1f} GiB free; this run needs {need / GiB:.1f} GiB")
    if _mem_available() < 3 * a.chunks * size:
        print(
            f"warning: {_mem_available() / GiB:.1f} GiB of memory available for "
            f"{a.chunks * size / GiB:.1f} GiB of chunks (LMCache's pool holds them all, hmem stages them): "
            "the page cache may not stay warm",
            file=sys.stderr,
        )
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--layers", str(a.layers), "--chunks", str(a.chunks), "--lookups", str(a.lookups)]
    common += ["--lookup-chunks", str(a.lookup_chunks)] + [x for kv in a.hmem_opt for x in ("--hmem-opt", kv)]
    if a.profile:
        common.append("--profile")

    def phase(rnd: int, name: str, backend: str, data: str, *extra: str) -> dict[str, Any]:
        result = os.path.join(phase_dir, f"r{rnd}_{backend}_{name}{'_' + extra[0].strip('-') if extra else ''}.json")
        cmd = [*me, "--phase", name, "--backend", backend, "--data", data, "--result", result, *common, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(result):
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"phase {name} of {backend} (round {rnd}) failed: {' '.join(cmd)}")
        with open(result) as f:
            return dict(json.load(f))

    results: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "settings": {
            "chunks": a.chunks,
            "layers": a.layers,
            "tokens_per_chunk": CHUNK,
            "hidden": KV_HEADS * HEAD_DIM,
            "chunk_bytes": size,
            "request_bytes": a.chunks * size,
            "rounds": a.rounds,
            "backends": backends,
            "lookup_chunks": a.lookup_chunks,
            "lookups": a.lookups,
            "hmem_options": a.opts,
        },
        "machine_before": machine(base),
        "rounds": [],
    }
    print(
        f"{a.rounds} round(s) of {', '.join(backends)}: {a.chunks} chunks of {size / 2**20:.0f} MiB "
        f"({a.chunks * size / GiB:.2f} GiB) a request; data under {base}",
        flush=True,
    )
    try:
        for rnd in range(a.rounds):
            record: dict[str, Any] = {}
            for b in backends:
                data = os.path.join(base, f"{b}_data")
                lookup_data = os.path.join(base, f"{b}_lookup")
                shutil.rmtree(data, ignore_errors=True)
                rec: dict[str, Any] = {"loadavg": open("/proc/loadavg").read().split()[:3]}
                try:
                    rec["store"] = phase(rnd, "store", b, data)
                    if b != "local_disk":
                        rec["retrieve_warm"] = phase(rnd, "retrieve", b, data)
                        rec["retrieve_cold"] = phase(rnd, "retrieve", b, data, "--cold")
                finally:
                    shutil.rmtree(data, ignore_errors=True)  # this backend's data goes before the next one's
                try:
                    rec["lookup"] = phase(rnd, "lookup", b, lookup_data)
                finally:
                    shutil.rmtree(lookup_data, ignore_errors=True)
                record[b] = rec
                figures = flatten(rec)
                print(f"round {rnd + 1} {b:10s} " + "  ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
            results["rounds"].append(record)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    results["machine_after"] = machine(os.path.dirname(out) or ".")
    results["summary"] = summarise(results["rounds"], backends)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(table(results["summary"], backends))
    print(f"\nload average before {results['machine_before']['loadavg']}, after {results['machine_after']['loadavg']}")
    print(f"results: {out}  (each phase: {phase_dir})")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench_lmcache_tier.json", help="the JSON results (default %(default)s)")
    p.add_argument("--chunks", type=int, default=64, help="chunks in the stored request (default %(default)s: 2 GiB)")
    p.add_argument("--layers", type=int, default=32, help="layers of a chunk (default %(default)s: 32 MiB chunks)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every backend, interleaved (default %(default)s)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="in each round's order (default %(default)s)")
    p.add_argument("--lookup-chunks", type=int, default=128, help="chunks of the lookup request (default %(default)s)")
    p.add_argument("--lookups", type=int, default=100, help="lookup calls timed (default %(default)s)")
    p.add_argument("--dir", help="where the backends' data go (default: a new temporary directory, removed after)")
    p.add_argument(
        "--hmem-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of hmem's plugin (remote_storage_plugin.hmem.KEY), e.g. commit_seconds=1.0",
    )
    p.add_argument("--profile", action="store_true", help="sample every thread of hmem's store and retrieve phases")
    # one phase, in its own process (run by the above)
    p.add_argument("--phase", choices=("store", "retrieve", "lookup"), help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.opts = dict(kv.split("=", 1) for kv in a.hmem_opt)
    if a.rounds < 1 or a.chunks < 1 or a.layers < 1 or a.lookups < 1 or a.lookup_chunks < 1:
        p.error("--rounds, --chunks, --layers, --lookups and --lookup-chunks must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.phase is None:
        return run_all(a)
    try:
        run_phase(a)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # LMCache's loop thread is not a daemon: it would keep a failed phase alive
    sys.stdout.flush()
    os._exit(0)  # ... and a finished one


if __name__ == "__main__":
    sys.exit(main())
