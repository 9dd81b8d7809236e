"""Bulk import of small entries: Store.put_many + flush of many entries of
1-16 tokens, beside a raw durable write of the same K/V bytes (os.write of
the keys and values + fsync) measured in the same run.

Each case takes turns (raw write, hmem) for --repeat rounds; the figures are
medians.  hmem's time runs from the first put_many (batches of --batch
entries, each a (keys, values, layer, importance) tuple of numpy views, as
a caller holding the arrays passes them) to the end of flush, on a new
store (create and close are not counted).  "prepare" is Store.check_entries
of the same entries: the checks, the joining of the rows and the
signatures, without storing anything.

Usage::

    python scripts/bench_bulk_put.py                        # 100k entries of 1x64, 4x64, 16x128; 1M of 4x64
    python scripts/bench_bulk_put.py --cases 4x64 --entries 100000 --repeat 5
    python scripts/bench_bulk_put.py --no-million
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import median, print_machine_facts

import hmem

GOAL_ENTRIES_PER_S = 150_000
GOAL_RAW_SHARE = 0.50


def _raw_write(path: Path, keys: np.ndarray, values: np.ndarray) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for array in (keys, values):
            view = memoryview(array.reshape(-1).view(np.uint8))
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def _hmem_put(path: Path, dim: int, entries: list[tuple], batch: int) -> tuple[float, float, dict]:
    store = hmem.Store.create(path, embed_dim=dim)
    gc.collect()
    t0 = time.perf_counter()
    for lo in range(0, len(entries), batch):
        store.put_many(entries[lo : lo + batch])
    t1 = time.perf_counter()
    store.flush()
    t2 = time.perf_counter()
    store.close()
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    shutil.rmtree(path)
    return t2 - t0, t2 - t1, files


def _prepare(path: Path, dim: int, entries: list[tuple], batch: int) -> float:
    store = hmem.Store.create(path, embed_dim=dim)
    t0 = time.perf_counter()
    for lo in range(0, len(entries), batch):
        store.check_entries(entries[lo : lo + batch])
    seconds = time.perf_counter() - t0
    store.close()
    shutil.rmtree(path)
    return seconds


def run_case(root: Path, n: int, tokens: int, dim: int, repeat: int, batch: int) -> dict:
    rng = np.random.default_rng(tokens * 1000 + dim)
    keys = rng.standard_normal((n, tokens, dim), dtype=np.float32)
    values = rng.standard_normal((n, tokens, dim), dtype=np.float32)
    entries = [(keys[i], values[i], i % 32, 1.0) for i in range(n)]
    kv_bytes = keys.nbytes + values.nbytes
    raw, put, flush, prep, files = [], [], [], [], {}
    for _ in range(repeat):
        raw.append(_raw_write(root / "raw.bin", keys, values))
        total, flushed, files = _hmem_put(root / "store", dim, entries, batch)
        put.append(total)
        flush.append(flushed)
        prep.append(_prepare(root / "prep", dim, entries, batch))
    return {
        "n": n,
        "tokens": tokens,
        "dim": dim,
        "kv_bytes": kv_bytes,
        "raw": median(raw),
        "hmem": median(put),
        "flush": median(flush),
        "prepare": median(prep),
        "files": files,
        "raw_all": raw,
        "hmem_all": put,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x64,4x64,16x128", help="tokens x embed_dim, comma separated")
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument(
        "--million", dest="million", action="store_true", default=True, help="also 1,000,000 entries of 4x64 (default)"
    )
    parser.add_argument("--no-million", dest="million", action="store_false")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=10_000, help="entries per put_many call")
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    args = parser.parse_args()
    print_machine_facts()
    cases = [(args.entries, *map(int, case.split("x"))) for case in args.cases.split(",")]
    if args.million:
        cases.append((1_000_000, 4, 64))
    root = Path(tempfile.mkdtemp(prefix="hmem-bench-bulk-", dir=args.dir))
    try:
        print(
            "| entries | tokens x dim | K/V bytes | raw write + fsync | hmem put_many + flush | of which flush "
            "| entries/s | share of raw | prepare only | on disk / K/V |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, tokens, dim in cases:
            r = run_case(root, n, tokens, dim, args.repeat, args.batch)
            rate = n / r["hmem"]
            share = r["raw"] / r["hmem"]
            disk = sum(r["files"].values()) / r["kv_bytes"]
            print(
                f"| {n:,} | {tokens} x {dim} | {r['kv_bytes'] / 1e6:,.0f} MB | {r['raw'] * 1e3:,.0f} ms "
                f"| {r['hmem'] * 1e3:,.0f} ms | {r['flush'] * 1e3:,.0f} ms | {rate:,.0f} | {share:.0%} "
                f"| {r['prepare'] * 1e3:,.0f} ms ({n / r['prepare']:,.0f}/s) | {disk:.2f}x |",
                flush=True,
            )
            print(
                f"    runs: raw {[round(x, 3) for x in r['raw_all']]} s, "
                f"hmem {[round(x, 3) for x in r['hmem_all']]} s; "
                f"files {', '.join(f'{k} {v / 1e6:.1f} MB' for k, v in sorted(r['files'].items()))}",
                flush=True,
            )
        print(f"\ngoals: >= {GOAL_ENTRIES_PER_S:,} entries/s and >= {GOAL_RAW_SHARE:.0%} of the raw write")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
