"""Re-rank without shard traffic: a query with re-rank against the same
query by signature only, on stores of 100k and 1M entries.

    python scripts/bench_rerank.py                      # builds the stores once (~2 min), reuses them
    python scripts/bench_rerank.py --sizes 100000 --root /tmp/x

Each store holds its entries over 32 layers (1 token x 16 float32, hdc_dim
4096), put with put_many in batches of 10,000, each flushed (so a store of
1M entries has 100 shards; the store keeps max_open_shards of them mapped,
hmem's default when it was built: 256, or 4 before that default changed).
Per query, on one layer, top-5 and top-10, count_access=False, each
result's K/V touched:

- signature: rerank=False (the baseline of the goal);
- re-rank: rerank=True, the shortlist's pooled keys from pooled.bin;
- re-rank, shards: rerank=True on a reader opened while pooled.bin was
  away, so every pooled key is read from its shard (how every re-rank read
  them before pooled.bin).

The cases take turns, one call of each per round, over --rounds rounds
(a different query and layer each round); medians; gc off.

Goal (the issue "Performance at scale"): a query with re-rank <= 1.3x the
signature-only query, at 100k and 1M entries.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import benchlib
import numpy as np

import hmem

LAYERS = 32
EMBED_DIM = 16
HDC_DIM = 4096
BUILD_BATCH = 10_000
GOAL = 1.3
CONFIG = hmem.StoreConfig(embed_dim=EMBED_DIM, hdc_dim=HDC_DIM)


def build(path: Path, entries: int, log) -> None:
    rng = np.random.default_rng(8)
    t0 = time.perf_counter()
    with hmem.Store.create(path, CONFIG) as store:
        for lo in range(0, entries, BUILD_BATCH):
            m = min(BUILD_BATCH, entries - lo)
            keys = rng.standard_normal((m, 1, EMBED_DIM), dtype=np.float32)
            layers = np.arange(lo, lo + m) % LAYERS
            store.put_many(hmem.Entry(keys[i], keys[i], int(layers[i])) for i in range(m))
            store.flush()
    log(f"  built in {time.perf_counter() - t0:.0f} s")


def open_pair(root: Path, entries: int, log) -> tuple[hmem.Store, hmem.Store]:
    """A reader that uses pooled.bin and one opened while it was away."""
    path = root / f"rerank-{entries}"

    def build_here() -> None:
        log(f"building {path} ({entries:,} entries over {LAYERS} layers) ...")
        build(path, entries, log)

    benchlib.kept_store(path, CONFIG, build_here, log)
    pooled = path / "pooled.bin"
    if not pooled.exists():
        raise SystemExit(f"{path} has no pooled.bin: remove the store so that it is built again")
    with_file = hmem.Store.open(path, read_only=True)
    with_file.query(np.ones(EMBED_DIM, np.float32), 0, count_access=False)  # maps pooled.bin
    away = path / "pooled.bin.away"
    pooled.rename(away)
    try:
        without = hmem.Store.open(path, read_only=True)
        without.query(np.ones(EMBED_DIM, np.float32), 0, count_access=False)  # finds no pooled.bin
    finally:
        away.rename(pooled)
    return with_file, without


def measure(with_file: hmem.Store, without: hmem.Store, top_k: int, rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(top_k)
    queries = rng.standard_normal((rounds, 4, EMBED_DIM), dtype=np.float32)
    layers = rng.integers(0, LAYERS, rounds)

    def call(store: hmem.Store, rerank: bool) -> Callable[[int], object]:
        def run(i: int) -> object:
            results = store.query(queries[i], int(layers[i]), top_k=top_k, rerank=rerank, count_access=False)
            for r in results:
                float(r.keys[0, 0])
            return results

        return run

    cases = {
        "signature": call(with_file, False),
        "re-rank": call(with_file, True),
        "re-rank, shards": call(without, True),
    }
    for i in range(min(5, rounds)):
        a = [(r.entry_id, r.cosine) for r in cases["re-rank"](i)]
        b = [(r.entry_id, r.cosine) for r in cases["re-rank, shards"](i)]
        if a != b:
            raise SystemExit(f"MISMATCH: query {i} re-ranks differently with pooled.bin ({a}) and without ({b})")
    return benchlib.medians_in_turns(cases, rounds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100000,1000000", help="store sizes (default 100000,1000000)")
    p.add_argument("--rounds", type=int, default=400, help="queries per case (default 400)")
    p.add_argument("--root", default="/tmp/hmem-bench-rerank", help="where the stores are built and kept")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not benchlib.native_kernels():
        return 2
    log = benchlib.log

    facts = benchlib.machine_facts()
    print("hmem re-rank benchmark (scripts/bench_rerank.py)")
    for key, value in facts.items():
        print(f"  {key:10} {value}")
    print()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for entries in sizes:
        with_file, without = open_pair(root, entries, log)
        try:
            for top_k in (5, 10):
                log(f"{entries:,} entries, top-{top_k}: {args.rounds} rounds ...")
                t = measure(with_file, without, top_k, args.rounds)
                results.append(
                    {
                        "entries": entries,
                        "top_k": top_k,
                        **t,
                        "ratio": t["re-rank"] / t["signature"],
                        "ratio_shards": t["re-rank, shards"] / t["signature"],
                    }
                )
        finally:
            with_file.close()
            without.close()
    print(
        "| entries | top-k | signature only | re-rank (pooled.bin) | re-rank / signature "
        "| re-rank from shards | shards / signature |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['entries']:,} | {r['top_k']} | {r['signature'] * 1e6:,.0f} µs | {r['re-rank'] * 1e6:,.0f} µs "
            f"| {r['ratio']:.2f}x | {r['re-rank, shards'] * 1e6:,.0f} µs | {r['ratio_shards']:.2f}x |"
        )
    ok = all(r["ratio"] <= GOAL for r in results)
    ratios = ", ".join(f"{r['ratio']:.2f}x" for r in results)
    print(f"\n{'holds' if ok else 'MISSED'}: a query with re-rank <= {GOAL}x the signature-only query ({ratios})")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": facts, "results": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
