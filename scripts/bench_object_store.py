"""Stores on object storage (s3://): put throughput, cold and warm query
latency and the requests they make, beside a local store in the same run;
and the object-store client, obstore against boto3, by measurement.

    python scripts/bench_object_store.py                      # 20,000 entries of 16 x 64 (~35 s)
    python scripts/bench_object_store.py --entries 50000 --batch 5000 --repeat 3
    python scripts/bench_object_store.py --server process     # moto in a child process (no GIL shared)
    python scripts/bench_object_store.py --only clients       # the put section runs too: it makes the objects

Server: moto's ThreadedMotoServer on 127.0.0.1, started by the script in
a thread of its own process by default, where moto's Python competes for
the GIL with hmem's and with the clients measured; --server process runs
it in a child process instead (the two measured the same within the
run-to-run noise: docs/benchmarks.md, "Object storage").  moto is a
Python server holding the objects in memory: its own time per request (a
few ms) is in every figure, so absolute latencies are moto's on this
machine, not S3's; the counts of requests are what carries over.  Stores
on object storage get the endpoint and credentials as storage_options and
their working copies under a temporary cache directory.

1. put: Store.put_many of --entries entries (--tokens x --dim float32 keys
   and values, as tuples of numpy views, layer 0) in batches of --batch,
   a flush after each batch (each flush seals one shard), on a new local
   store and on a new s3:// store, taking turns, --repeat times; the run
   with the median total is shown.  Create and close are not timed.
   Requests are counted from Store.stats().remote around each call: those
   of the flushes (a shard, a state object, the manifest) and those of
   put_many (none unless the store's limits evict and commit).
2. query: the stores of the last put round (one layer).  Queries are 4
   rows of a stored entry's keys plus noise; top_k --top-k, re-rank,
   count_access=False, each result's keys and values touched.
   - cold: a fresh read-only Store.open (for s3 a new working copy, nothing
     cached) then its first query, timed separately; --cold-runs runs,
     each with another query, local and s3 taking turns; medians.  Both
     stores must give the same answers.
   - warm: on one open reader, the query it already answered, repeated
     --rounds times (local and s3 taking turns); median.
   - new queries: on that reader, --new-queries queries it has not seen
     (blocks fetched for earlier queries may serve them); median, and the
     requests they made.
   Requests: stats().remote.requests before and after; "shards touched"
   = distinct shard files of the query's results (QueryResult.shard_idx).
   The GETs of the cold runs are also told apart (by wrapping
   hmem.object_store.ObjectClient.get/get_range in this process): the
   manifest, state objects, a shard's block 0 (its header and entry
   index, which the state objects carry for the shards they know: fetched
   only when a result lies there) and its other blocks (the results'
   tensors).  With --coalesce-bytes (default 32 MiB), the cold runs also
   take turns with a reader given that coalesce_bytes storage option.
3. clients: obstore, boto3 and hmem's ObjectClient (obstore, counted) on
   the same server, for the requests hmem makes: GET of the store's
   manifest.json, ranged GET of 1 MiB of a shard object, a conditional
   (If-Match) PUT of the manifest, a PUT of 8 MiB in one request, and the
   upload of an 8 MiB file (as hmem uploads a shard: obstore called with
   its defaults makes it a multipart upload of 5 MiB parts, 4 requests;
   hmem's client uploads parts of 8 MiB, so one request; boto3's
   upload_file a multipart upload of one 8 MiB part, 3 requests).  The clients take
   turns, one call each per round; medians.  Also: the time to import
   the client and make its S3 client in a fresh interpreter, and the
   installed size of each client's packages.

Goals (the issue "Stores on object storage"): a warm query makes no
request; a cold one at most 2 + the shards it touches.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import benchlib
import numpy as np

import hmem
from hmem import object_store

BUCKET = "hmem-bench"
ACCESS = {"access_key_id": "hmem-bench", "secret_access_key": "hmem-bench-secret", "region": "us-east-1"}
HDC_DIM = 4096
MiB = 1 << 20


# ---- the server ------------------------------------------------------------------------


class HTTPCount(logging.Handler):
    """Counts the requests the server answered (werkzeug logs one record
    each; none is printed)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += 1

    @classmethod
    def install(cls) -> HTTPCount:
        counter = cls()
        log = logging.getLogger("werkzeug")
        log.setLevel(logging.INFO)
        log.propagate = False
        for handler in list(log.handlers):
            log.removeHandler(handler)
        log.addHandler(counter)
        return counter


_CHILD = """
import logging, sys
from moto.server import ThreadedMotoServer

class Count(logging.Handler):  # as HTTPCount
    n = 0

    def emit(self, record):
        self.n += 1

counter = Count()
log = logging.getLogger("werkzeug")
log.setLevel(logging.INFO)
log.propagate = False
log.addHandler(counter)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
for line in sys.stdin:  # until the parent closes it
    print(counter.n, flush=True)
server.stop()
"""


class Server:
    """moto on 127.0.0.1: a thread of this process, or a child process."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._child: subprocess.Popen | None = None
        self._server: Any = None
        self._counter: HTTPCount | None = None
        if where == "thread":
            from moto.server import ThreadedMotoServer

            self._counter = HTTPCount.install()
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._server.start()
            host, port = self._server.get_host_and_port()
        else:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert self._child.stdout is not None
            line = self._child.stdout.readline()
            if not line.strip():
                raise SystemExit("the moto server did not start")
            host, port = "127.0.0.1", int(line)
        self.endpoint = f"http://{host}:{port}"

    def http_requests(self) -> int:
        """Requests the server has answered so far."""
        if self._counter is not None:
            return self._counter.n
        assert self._child is not None and self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write("count\n")
        self._child.stdin.flush()
        return int(self._child.stdout.readline())

    def boto(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS["access_key_id"],
            aws_secret_access_key=ACCESS["secret_access_key"],
            region_name=ACCESS["region"],
        )

    def options(self, cache_dir: Path) -> dict[str, Any]:
        return {"endpoint": self.endpoint, **ACCESS, "cache_dir": str(cache_dir)}

    def delete_prefix(self, prefix: str) -> None:
        client = self.boto()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        if self._child is not None:
            assert self._child.stdin is not None
            self._child.stdin.close()
            try:
                self._child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()


# ---- tracing the GETs (classification only; the counts come from stats) ---------------

TRACE: list[tuple[str, int | None]] = []  # (key, start of a ranged GET or None)


def install_trace(latency_ms: float = 0.0) -> None:
    """Record every GET; with `latency_ms`, wait that long before each, as
    a request over a network waits for its first byte (moto on 127.0.0.1
    answers in a few ms)."""
    get, get_range = object_store.ObjectClient.get, object_store.ObjectClient.get_range
    delay = latency_ms / 1000

    def traced_get(self, key, **options):
        TRACE.append((key, None))
        if delay:
            time.sleep(delay)
        return get(self, key, **options)

    def traced_get_range(self, key, start, end):
        TRACE.append((key, start))
        if delay:
            time.sleep(delay)
        return get_range(self, key, start, end)

    object_store.ObjectClient.get = traced_get
    object_store.ObjectClient.get_range = traced_get_range


def classify(trace: list[tuple[str, int | None]]) -> dict[str, int]:
    out = {"manifest": 0, "state": 0, "shard_head": 0, "shard_other": 0}
    for key, start in trace:
        if key == "manifest.json":
            out["manifest"] += 1
        elif key.startswith("state/"):
            out["state"] += 1
        elif start == 0:
            out["shard_head"] += 1
        else:
            out["shard_other"] += 1
    return out


def remote_requests(store: hmem.Store) -> tuple[int, int, int]:
    """(requests, puts, bytes fetched) so far of a store on object storage."""
    r = store.stats().remote
    assert r is not None
    return r.requests, r.puts, r.bytes_fetched


# ---- 1. put --------------------------------------------------------------------------------


def put_round(server: Server, location: str, options: dict | None, entries: list[tuple], batch: int, dim: int) -> dict:
    store = hmem.Store.create(location, embed_dim=dim, hdc_dim=HDC_DIM, storage_options=options)
    remote = options is not None
    http0 = server.http_requests() if remote else 0
    put_s = flush_s = 0.0
    put_requests = flush_requests = 0
    flushes: list[int] = []
    sent0 = store.stats().remote.bytes_sent if remote else 0
    try:
        for lo in range(0, len(entries), batch):
            before = remote_requests(store)[0] if remote else 0
            t0 = time.perf_counter()
            store.put_many(entries[lo : lo + batch])
            t1 = time.perf_counter()
            middle = remote_requests(store)[0] if remote else 0
            t2 = time.perf_counter()
            store.flush()
            t3 = time.perf_counter()
            after = remote_requests(store)[0] if remote else 0
            put_s += t1 - t0
            flush_s += t3 - t2
            put_requests += middle - before
            flush_requests += after - middle
            flushes.append(after - middle)
        http = server.http_requests() - http0 if remote else 0
        stats = store.stats()
        sent = stats.remote.bytes_sent - sent0 if remote else 0
        shards = len(stats.shards)
    finally:
        store.close()
    return {
        "put_s": put_s,
        "flush_s": flush_s,
        "total_s": put_s + flush_s,
        "put_requests": put_requests,
        "flush_requests": flush_requests,
        "per_flush": flushes,
        "http_requests": http,
        "bytes_sent": sent,
        "shards": shards,
    }


def bench_put(server: Server, root: Path, args: argparse.Namespace) -> tuple[dict, str, str]:
    rng = np.random.default_rng(1)
    n, t, d = args.entries, args.tokens, args.dim
    benchlib.log(f"generating {n:,} entries of {t} x {d} float32 ...")
    keys = rng.standard_normal((n, t, d), dtype=np.float32)
    values = rng.standard_normal((n, t, d), dtype=np.float32)
    entries = [(keys[i], values[i], 0, 1.0) for i in range(n)]
    rounds: dict[str, list[dict]] = {"local": [], "s3": []}
    local_path = s3_url = ""
    for r in range(args.repeat):
        for case in ("local", "s3"):
            benchlib.log(f"put round {r + 1}/{args.repeat}: {case} ...")
            if case == "local":
                if local_path:
                    shutil.rmtree(local_path)
                local_path = str(root / f"local-{r}")
                rounds[case].append(put_round(server, local_path, None, entries, args.batch, d))
            else:
                if s3_url:
                    server.delete_prefix(s3_url.split("/", 3)[3])
                s3_url = f"s3://{BUCKET}/bench-{r}-{uuid.uuid4().hex[:8]}"
                rounds[case].append(put_round(server, s3_url, server.options(root / "cache"), entries, args.batch, d))
    kv_bytes = keys.nbytes + values.nbytes
    out: dict[str, Any] = {"entries": n, "kv_bytes": kv_bytes, "batches": -(-n // args.batch)}
    for case, runs in rounds.items():
        mid = sorted(runs, key=lambda run: run["total_s"])[(len(runs) - 1) // 2]  # the median run, whole
        out[case] = {
            **mid,
            "entries_per_s": n / mid["total_s"],
            "mb_per_s": kv_bytes / mid["total_s"] / 1e6,
            "all_total_s": [run["total_s"] for run in runs],
            "all_requests": [run["put_requests"] + run["flush_requests"] for run in runs],
        }
    del keys, values, entries
    return out, local_path, s3_url


# ---- 2. queries ------------------------------------------------------------------------


def make_queries(store: hmem.Store, count: int, dim: int, seed: int) -> list[np.ndarray]:
    """4 rows of a random stored entry's keys, plus noise."""
    rng = np.random.default_rng(seed)
    ids = [info.entry_id for info in store.entries()]
    out = []
    for entry_id in rng.choice(ids, count, replace=False):
        keys = np.asarray(store.get(int(entry_id)).keys[:4], dtype=np.float32)
        out.append(keys + 0.3 * rng.standard_normal(keys.shape, dtype=np.float32))
    return out


def run_query(store: hmem.Store, q: np.ndarray, top_k: int) -> list:
    results = store.query(q, 0, top_k=top_k, count_access=False)
    for r in results:
        float(r.keys[-1, -1])
        float(r.values[-1, -1])
    return results


def bench_queries(server: Server, root: Path, local_path: str, s3_url: str, args: argparse.Namespace) -> dict:
    options = server.options(root / "cache")
    with hmem.Store.open(local_path, read_only=True) as probe:
        total = args.cold_runs + 1 + args.new_queries
        queries = make_queries(probe, total, args.dim, seed=7)
    cold_q, warm_q, new_q = queries[: args.cold_runs], queries[args.cold_runs], queries[args.cold_runs + 1 :]

    def open_store(case: str, host: Path | None = None) -> hmem.Store:
        """`host`: the cache directory of a process on a host of its own
        (fresh: nothing kept from earlier processes)."""
        if case == "local":
            return hmem.Store.open(local_path, read_only=True)
        own = options if host is None else {**options, "cache_dir": str(host)}
        if case == "s3-coalesced":
            return hmem.Store.open(
                s3_url, read_only=True, storage_options={**own, "coalesce_bytes": args.coalesce_bytes}
            )
        return hmem.Store.open(s3_url, read_only=True, storage_options=own)

    # cold: a fresh reader, its first query
    cases = ("local", "s3", "s3-coalesced") if args.coalesce_bytes else ("local", "s3")
    cold: dict[str, list[dict]] = {case: [] for case in cases}
    benchlib.log(f"cold: {args.cold_runs} fresh opens + first query, {', '.join(cases)} taking turns ...")
    for i, q in enumerate(cold_q):
        answers = {}
        for case in cases:
            host = root / f"host-{case}-{i}"
            TRACE.clear()
            http0 = server.http_requests()
            t0 = time.perf_counter()
            store = open_store(case, host)
            t1 = time.perf_counter()
            opened = remote_requests(store) if case != "local" else (0, 0, 0)
            open_trace = list(TRACE)
            t2 = time.perf_counter()
            results = run_query(store, q, args.top_k)
            t3 = time.perf_counter()
            queried = remote_requests(store) if case != "local" else (0, 0, 0)
            state_objects = store.stats().remote.state_objects if case != "local" else 0
            http = server.http_requests() - http0
            store.close()
            reopen_s = reopen_requests = 0.0
            if case != "local":  # the next process on the same host: the state objects were kept
                t4 = time.perf_counter()
                store = open_store(case, host)
                reopen_s, reopen_requests = time.perf_counter() - t4, remote_requests(store)[0]
                store.close()
            answers[case] = [(r.entry_id, round(r.score, 6)) for r in results]
            cold[case].append(
                {
                    "reopen_s": reopen_s,
                    "reopen_requests": reopen_requests,
                    "open_s": t1 - t0,
                    "query_s": t3 - t2,
                    "open_requests": opened[0],
                    "query_requests": queried[0] - opened[0],
                    "open_bytes": opened[2],
                    "query_bytes": queried[2] - opened[2],
                    "shards_touched": len({r.shard_idx for r in results}),
                    "results": len(results),
                    "state_objects": state_objects,
                    "http_requests": http,
                    "open_gets": classify(open_trace),
                    "query_gets": classify(TRACE[len(open_trace) :]),
                }
            )
        for case in cases[1:]:
            if answers["local"] != answers[case]:
                raise SystemExit(
                    f"MISMATCH: cold query {i} answers {answers['local']} locally, {answers[case]} on {case}"
                )

    # warm and new queries: one open reader each
    readers = {case: open_store(case) for case in ("local", "s3")}
    try:
        for store in readers.values():
            run_query(store, warm_q, args.top_k)
        before = remote_requests(readers["s3"])[0]
        http0 = server.http_requests()
        benchlib.log(f"warm: the same query, {args.rounds} rounds ...")
        warm = benchlib.medians_in_turns(
            {case: (lambda i, s=store: run_query(s, warm_q, args.top_k)) for case, store in readers.items()},
            args.rounds,
        )
        warm_requests = remote_requests(readers["s3"])[0] - before
        warm_http = server.http_requests() - http0
        benchlib.log(f"new queries: {len(new_q)} on the open readers ...")
        touched: list[int] = []

        def new_query(store: hmem.Store, i: int) -> None:
            shards = len({r.shard_idx for r in run_query(store, new_q[i], args.top_k)})
            if store is readers["s3"]:
                touched.append(shards)

        before = remote_requests(readers["s3"])[0]
        new = benchlib.medians_in_turns(
            {case: (lambda i, s=store: new_query(s, i)) for case, store in readers.items()}, len(new_q)
        )
        new_requests = remote_requests(readers["s3"])[0] - before
        cached = readers["s3"].stats().remote.cached_shard_bytes
        shards = len(readers["s3"].stats().shards)
    finally:
        for store in readers.values():
            store.close()
    summary: dict[str, Any] = {
        "cold": cold,
        "shards": shards,
        "warm": warm,
        "warm_requests": warm_requests,
        "warm_http": warm_http,
        "warm_rounds": args.rounds,
        "new": new,
        "new_requests": new_requests,
        "new_count": len(new_q),
        "cached_shard_bytes": cached,
        "new_shards_touched": statistics.mean(touched) if touched else 0.0,
    }
    for case in cases:
        summary[f"cold_{case}"] = {
            k: statistics.median(run[k] for run in cold[case])
            for k in (
                "open_s",
                "query_s",
                "open_requests",
                "query_requests",
                "shards_touched",
                "open_bytes",
                "query_bytes",
                "reopen_s",
                "reopen_requests",
            )
        }
    return summary


# ---- 3. clients ------------------------------------------------------------------------


def package_bytes(names: list[str]) -> int:
    total = 0
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or []:
            try:
                total += Path(dist.locate_file(f)).stat().st_size
            except OSError:
                pass
    return total


def startup_seconds(code: str, runs: int) -> float:
    """Median seconds of `code` (an import and a client made) in a fresh interpreter."""
    samples = []
    for _ in range(runs):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import time\nt0 = time.perf_counter()\n" + code + "\nprint(time.perf_counter() - t0)",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        samples.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


def bench_clients(server: Server, root: Path, s3_url: str, args: argparse.Namespace) -> dict:
    import boto3  # noqa: F401  (imported before timing)
    import obstore
    from obstore.store import S3Store

    prefix = s3_url.split("/", 3)[3]
    boto = server.boto()
    ob = S3Store(BUCKET, endpoint=server.endpoint, client_options={"allow_http": True}, **ACCESS)
    hm = object_store.ObjectClient(f"s3://{BUCKET}", {"endpoint": server.endpoint, **ACCESS})
    manifest_key = f"{prefix}/manifest.json"
    manifest = boto.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read()
    shard_keys = [item["Key"] for item in boto.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/shards/")["Contents"]]
    shard_key = shard_keys[0]
    shard_size = boto.head_object(Bucket=BUCKET, Key=shard_key)["ContentLength"]
    blocks = max(1, shard_size // MiB)
    put_bytes = np.random.default_rng(3).bytes(8 * MiB)
    put_file = root / "put-8mib.bin"
    put_file.write_bytes(put_bytes)

    def block(i: int) -> tuple[int, int]:
        b = (i * 7) % blocks
        return b * MiB, (b + 1) * MiB

    etags: dict[str, str] = {}
    for name in ("obstore", "boto3", "hmem"):
        etags[name] = boto.put_object(Bucket=BUCKET, Key=f"clients/cond-{name}", Body=manifest)["ETag"]

    def ob_cond(i: int) -> None:
        etags["obstore"] = obstore.put(ob, "clients/cond-obstore", manifest, mode={"e_tag": etags["obstore"]})["e_tag"]

    def boto_cond(i: int) -> None:
        etags["boto3"] = boto.put_object(
            Bucket=BUCKET, Key="clients/cond-boto3", Body=manifest, IfMatch=etags["boto3"]
        )["ETag"]

    def hm_cond(i: int) -> None:
        etags["hmem"] = hm.put("clients/cond-hmem", manifest, if_match=etags["hmem"])

    ops: list[tuple[str, int, dict[str, Any]]] = [
        (
            f"GET manifest.json ({len(manifest):,} B)",
            args.client_rounds,
            {
                "obstore": lambda i: bytes(obstore.get(ob, manifest_key).bytes()),
                "boto3": lambda i: boto.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read(),
                "hmem": lambda i: hm.get(manifest_key),
            },
        ),
        (
            "ranged GET of 1 MiB of a shard",
            max(20, args.client_rounds // 3),
            {
                "obstore": lambda i: bytes(obstore.get_range(ob, shard_key, start=block(i)[0], end=block(i)[1])),
                "boto3": lambda i: boto.get_object(
                    Bucket=BUCKET, Key=shard_key, Range=f"bytes={block(i)[0]}-{block(i)[1] - 1}"
                )["Body"].read(),
                "hmem": lambda i: hm.get_range(shard_key, *block(i)),
            },
        ),
        (
            "conditional PUT of manifest.json (If-Match)",
            max(20, args.client_rounds // 3),
            {
                "obstore": ob_cond,
                "boto3": boto_cond,
                "hmem": hm_cond,
            },
        ),
        (
            "PUT of 8 MiB, one request",
            args.put_rounds,
            {
                "obstore": lambda i: obstore.put(ob, "clients/put-obstore", put_bytes, use_multipart=False),
                "boto3": lambda i: boto.put_object(Bucket=BUCKET, Key="clients/put-boto3", Body=put_bytes),
            },
        ),
        (
            "PUT of an 8 MiB file (as a shard is uploaded)",
            args.put_rounds,
            {
                "obstore": lambda i: obstore.put(ob, "clients/file-obstore", put_file),
                "boto3": lambda i: boto.upload_file(str(put_file), BUCKET, "clients/file-boto3"),
                "hmem": lambda i: hm.put("clients/file-hmem", put_file),
            },
        ),
    ]
    results = []
    for label, rounds, cases in ops:
        benchlib.log(f"clients: {label}, {rounds} rounds ...")
        for fn in cases.values():  # warm-up: connections open
            fn(0)
        results.append({"op": label, "rounds": rounds, **benchlib.medians_in_turns(cases, rounds)})
    benchlib.log("clients: start-up in fresh interpreters ...")
    endpoint = server.endpoint
    startup = {
        "obstore": startup_seconds(
            "from obstore.store import S3Store\n"
            f"S3Store('{BUCKET}', endpoint='{endpoint}', region='us-east-1', client_options={{'allow_http': True}})",
            args.startup_runs,
        ),
        "boto3": startup_seconds(
            f"import boto3\nboto3.client('s3', endpoint_url='{endpoint}', region_name='us-east-1')", args.startup_runs
        ),
    }
    sizes = {
        "obstore": package_bytes(["obstore"]),
        "boto3": package_bytes(["boto3", "botocore", "s3transfer", "jmespath"]),
    }
    put_file.unlink()
    server.delete_prefix("clients")
    return {
        "ops": results,
        "startup": startup,
        "package_bytes": sizes,
        "versions": {name: importlib.metadata.version(name) for name in ("obstore", "boto3", "botocore", "moto")},
    }


# ---- report --------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:,.0f} ms"


def report(args: argparse.Namespace, put: dict | None, queries: dict | None, clients: dict | None) -> list[dict]:
    goals: list[dict] = []
    if put is not None:
        print(
            f"put_many + flush of {put['entries']:,} entries of {args.tokens} x {args.dim} float32 "
            f"({put['kv_bytes'] / 1e6:,.0f} MB of K/V), batches of {args.batch:,}, a flush after each; "
            f"the median of {args.repeat} runs (by total):\n"
        )
        print(
            "| store | put_many | flushes | total | entries/s | MB/s of K/V | shards "
            "| requests of put_many | requests of the flushes | HTTP requests the server answered | bytes sent |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for case in ("local", "s3"):
            r = put[case]
            req = (
                f"{r['put_requests']} | {r['flush_requests']} ({', '.join(map(str, r['per_flush']))}) "
                f"| {r['http_requests']}"
                if case == "s3"
                else "— | — | —"
            )
            sent = f"{r['bytes_sent'] / 1e6:,.0f} MB" if case == "s3" else "—"
            print(
                f"| {case} | {ms(r['put_s'])} | {ms(r['flush_s'])} | {ms(r['total_s'])} | {r['entries_per_s']:,.0f} "
                f"| {r['mb_per_s']:,.0f} | {r['shards']} | {req} | {sent} |"
            )
        print(f"\ns3 / local, total time: {put['s3']['total_s'] / put['local']['total_s']:.2f}x\n")
    if queries is not None:
        q = queries
        cl, cs = q["cold_local"], q["cold_s3"]
        print(
            f"Queries on one layer of {args.entries:,} entries in {q['shards']} shards, top-{args.top_k}, re-rank, "
            f"4-row queries; cold: medians of {args.cold_runs} fresh opens:\n"
        )
        print("| store | open (cold) | first query (cold) | warm query | new query on an open reader |")
        print("|---|---:|---:|---:|---:|")
        for case, c in (("local", cl), ("s3", cs)):
            print(
                f"| {case} | {ms(c['open_s'])} | {ms(c['query_s'])} | {q['warm'][case] * 1e3:,.2f} ms "
                f"| {q['new'][case] * 1e3:,.2f} ms |"
            )
        coalesced = q.get("cold_s3-coalesced")
        if coalesced is not None:
            print(
                f"| s3, coalesce_bytes={args.coalesce_bytes:,} | {ms(coalesced['open_s'])} "
                f"| {ms(coalesced['query_s'])} | — | — |"
            )
        print(
            f"\nThe next process on the same host (its state objects kept there): open {ms(cs['reopen_s'])}, "
            f"{cs['reopen_requests']:.0f} request(s), against {ms(cs['open_s'])} and "
            f"{cs['open_requests']:.0f} on a host new to the store (medians)"
        )
        cold_ok = {}
        for case in [c for c in ("s3", "s3-coalesced") if c in q["cold"]]:
            print(
                f"\nRequests of the {case} reader, each cold run (open: manifest + state objects; first query: "
                "ranged GETs of shard blocks; block 0 holds a shard's header and entry index, which the state "
                "objects carry for every shard they know):\n"
            )
            print(
                "| run | open | of which state objects | bytes fetched by open | first query | of which block 0 "
                "| other blocks | bytes fetched by the query | shards touched | open + first query "
                "| 2 + shards touched |"
            )
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            cold_ok[case] = True
            for i, run in enumerate(q["cold"][case]):
                limit = 2 + run["shards_touched"]
                both = run["open_requests"] + run["query_requests"]
                cold_ok[case] &= both <= limit
                print(
                    f"| {i + 1} | {run['open_requests']} | {run['open_gets']['state']} "
                    f"| {run['open_bytes'] / 1e6:,.1f} MB | {run['query_requests']} "
                    f"| {run['query_gets']['shard_head']} | {run['query_gets']['shard_other']} "
                    f"| {run['query_bytes'] / MiB:,.0f} MiB | {run['shards_touched']} | {both} | {limit} |"
                )
        runs = q["cold"]["s3"]
        http = sum(r["http_requests"] for r in runs)
        counted = sum(r["open_requests"] + r["query_requests"] for r in runs)
        print(f"\nHTTP requests the server answered for these opens and first queries: {http} (hmem counted {counted})")
        print(
            f"warm: {q['warm_requests']} requests in {q['warm_rounds']} queries (the server answered "
            f"{q['warm_http']}); new queries: "
            f"{q['new_requests']} requests in {q['new_count']} ({q['new_requests'] / max(1, q['new_count']):.1f} per "
            f"query, {q['new_shards_touched']:.1f} shards touched per query); shard bytes cached at the end: "
            f"{q['cached_shard_bytes'] / MiB:,.0f} MiB\n"
        )
        goals.append(
            {
                "goal": "a warm query makes no request",
                "holds": q["warm_requests"] == q["warm_http"] == 0,
                "detail": f"{q['warm_requests']} requests in {q['warm_rounds']} warm queries",
            }
        )
        for case, ok in cold_ok.items():
            setting = "" if case == "s3" else f" (coalesce_bytes={args.coalesce_bytes:,})"
            goals.append(
                {
                    "goal": f"a cold query (open + first query) makes at most 2 + the shards it touches{setting}",
                    "holds": ok,
                    "detail": "; ".join(
                        f"{r['open_requests']} + {r['query_requests']} vs 2 + {r['shards_touched']}"
                        for r in q["cold"][case]
                    ),
                }
            )
    if clients is not None:
        print(
            "Clients on the same server, median per call, taking turns (obstore and boto3 called directly; "
            "hmem = hmem.object_store.ObjectClient, obstore with hmem's counting and checks):\n"
        )
        print("| operation | obstore | boto3 | boto3 / obstore | hmem ObjectClient |")
        print("|---|---:|---:|---:|---:|")
        for r in clients["ops"]:
            hm = f"{r['hmem'] * 1e3:,.2f} ms" if "hmem" in r else "—"
            print(
                f"| {r['op']} | {r['obstore'] * 1e3:,.2f} ms | {r['boto3'] * 1e3:,.2f} ms "
                f"| {r['boto3'] / r['obstore']:.2f}x | {hm} |"
            )
        s, b = clients["startup"], clients["package_bytes"]
        print(
            f"\nimport + client made, fresh interpreter: obstore {s['obstore'] * 1e3:,.0f} ms, "
            f"boto3 {s['boto3'] * 1e3:,.0f} ms; installed: obstore {b['obstore'] / 1e6:,.1f} MB, "
            f"boto3 + botocore + s3transfer + jmespath {b['boto3'] / 1e6:,.1f} MB "
            f"({', '.join(f'{k} {v}' for k, v in clients['versions'].items())})\n"
        )
    return goals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=20_000, help="entries put and queried (default 20,000)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per entry (default 16)")
    p.add_argument("--dim", type=int, default=64, help="embed_dim (default 64)")
    p.add_argument(
        "--batch", type=int, default=2_000, help="entries per put_many, each followed by a flush (default 2,000)"
    )
    p.add_argument("--repeat", type=int, default=5, help="put rounds per store (default 5)")
    p.add_argument("--top-k", type=int, default=5, help="results per query (default 5)")
    p.add_argument("--cold-runs", type=int, default=7, help="fresh opens + first query per store (default 7)")
    p.add_argument("--rounds", type=int, default=200, help="warm queries per store (default 200)")
    p.add_argument("--new-queries", type=int, default=50, help="queries new to an open reader (default 50)")
    p.add_argument(
        "--client-rounds",
        type=int,
        default=150,
        help="calls per client for the small requests "
        "(default 150; a third of that for 1 MiB GETs and conditional PUTs)",
    )
    p.add_argument("--put-rounds", type=int, default=12, help="calls per client of the 8 MiB PUTs (default 12)")
    p.add_argument("--startup-runs", type=int, default=3, help="fresh interpreters per client (default 3)")
    p.add_argument(
        "--server",
        choices=("thread", "process"),
        default="thread",
        help="moto in a thread of this process (default) or in a child process",
    )
    p.add_argument(
        "--only",
        choices=("put", "query", "clients"),
        action="append",
        help="run only these sections (repeatable; query and clients need the put section's stores, "
        "so put runs with them)",
    )
    p.add_argument("--root", help="where the local stores and the cache go (a temporary directory otherwise)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="wait this long before each GET, as over a network (default 0: moto's own time only)",
    )
    p.add_argument(
        "--coalesce-bytes",
        type=int,
        default=32 * MiB,
        help="cold runs also on a reader with this coalesce_bytes storage option (ranges of one shard "
        "this close fetched by one GET); 0: only the default reader (default 32 MiB)",
    )
    p.add_argument(
        "--sequential-reads",
        action="store_true",
        help="baseline: read a query's shard bytes one request after another, as without "
        "EntryReader.prefetch (its concurrent fetch turned off)",
    )
    args = p.parse_args(argv)
    if not benchlib.native_kernels():
        return 2
    sections = set(args.only or ("put", "query", "clients"))

    facts = benchlib.machine_facts()
    print("hmem object-storage benchmark (scripts/bench_object_store.py)")
    for key, value in facts.items():
        print(f"  {key:10} {value}")
    print(
        f"  {'server':10} moto {importlib.metadata.version('moto')} ThreadedMotoServer on 127.0.0.1, "
        f"{'a child process' if args.server == 'process' else 'a thread of this process'}"
    )
    print(
        f"  {'latency':10} {args.latency_ms:g} ms added before each GET"
        + (
            "; a query's shard bytes read one request after another (--sequential-reads)"
            if args.sequential_reads
            else ""
        )
    )
    print()
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="hmem-bench-s3-"))
    root.mkdir(parents=True, exist_ok=True)
    install_trace(args.latency_ms)
    if args.sequential_reads:
        from hmem.store import reading  # the baseline: no concurrent fetch before a query's reads

        reading.EntryReader.prefetch = lambda self, positions, kinds=None: None
    server = Server(args.server)
    put = queries = clients = None
    try:
        server.boto().create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        put, local_path, s3_url = bench_put(server, root, args)
        if "query" in sections:
            queries = bench_queries(server, root, local_path, s3_url, args)
        if "clients" in sections:
            clients = bench_clients(server, root, s3_url, args)
        benchlib.log(f"done in {time.perf_counter() - t0:.0f} s")
    finally:
        server.stop()
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    goals = report(args, put if "put" in sections else None, queries, clients)
    if goals:
        benchlib.print_goals(goals)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": facts,
                    "server": args.server,
                    "args": vars(args),
                    "put": put,
                    "queries": queries,
                    "clients": clients,
                    "goals": goals,
                },
                indent=2,
                default=str,
            )
        )
    return 0 if all(g["holds"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
