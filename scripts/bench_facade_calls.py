"""Per-call cost of the Store facade's calls: put, get, query, entry_ids,
stats, open and close on a small store (5,000 entries of 4 x 64) in
/dev/shm, so that no disk is timed, through the public API only; the best
of five rounds, in microseconds per call.  Baseline, measured in the same
run: the cost of calling a Python function that does nothing (the
interpreter's floor under any call).  Run by two installs of hmem in turn,
it compares their facades (docs/benchmarks.md, "The facade ...").

    python scripts/bench_facade_calls.py [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import numpy as np

import hmem


def best(fn, n, rounds=5):
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn(n)
        out.append((time.perf_counter() - t) / n)
    return min(out) * 1e6


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--dir", default="/dev/shm", help="where the store is made (default /dev/shm: memory)")
args = parser.parse_args()
root = tempfile.mkdtemp(dir=args.dir)
try:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((4, 64), dtype=np.float32)
    store = hmem.Store.create(root + "/s", embed_dim=64, hdc_dim=512)
    ids = store.put_many([(rng.standard_normal((4, 64), dtype=np.float32), keys, 0, 1.0) for _ in range(5000)])
    store.flush()
    res = {"baseline: a call doing nothing, µs": best(lambda n: [(lambda: None)() for _ in range(n)], 100_000)}
    res["put (1 entry of 4x64), µs"] = best(lambda n: [store.put(keys, keys) for _ in range(n)], 2000)
    store.flush()
    res["get, µs"] = best(lambda n: [store.get(ids[i % 5000]) for i in range(n)], 5000)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    res["query top-5 re-rank, µs"] = best(lambda n: [store.query(q, 0, 5) for _ in range(n)], 1000)
    res["query top-5 signature, µs"] = best(lambda n: [store.query(q, 0, 5, rerank=False) for _ in range(n)], 1000)
    res["entry_ids, µs"] = best(lambda n: [store.entry_ids(0) for _ in range(n)], 500)
    res["stats, µs"] = best(lambda n: [store.stats() for _ in range(n)], 200)
    store.close()
    res["open reader + close, µs"] = best(
        lambda n: [hmem.Store.open(root + "/s", read_only=True).close() for _ in range(n)], 100
    )
    res["open writer + close, µs"] = best(lambda n: [hmem.Store.open(root + "/s").close() for _ in range(n)], 50)
    print(json.dumps(res, ensure_ascii=False))
finally:
    shutil.rmtree(root)
