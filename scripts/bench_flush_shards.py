"""What a flush costs as a store's shards pile up, beside the same commit
written the plain way, measured in the same run.

A writer that flushes often (a serving process making each batch durable)
seals a shard per flush, and every commit rewrites index.json, which lists
every shard.  This builds a store by rounds of put_many (100 entries of 1 x
16) + flush, and at each checkpoint (shard counts) measures:

- flush: the median of 30 more rounds of put + flush, the flush alone,
  taking turns with rounds whose commit writes index.json the plain way
  (below; the same bytes);
- index.json: `Manifest.to_bytes` of the store's committed manifest, against
  the plain way to the same bytes (dataclasses.asdict of every shard, then
  json.dumps with indent=1), checked equal;
- raw: os.write + fsync of a file of index.json's size (the floor of a
  commit's own write).

Usage::

    python scripts/bench_flush_shards.py                       # 100, 1000, 3000 shards
    python scripts/bench_flush_shards.py --checkpoints 100 10000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import print_machine_facts, time_calls

import hmem
from hmem.formats import manifest


def plain_bytes(mf: manifest.Manifest) -> bytes:
    """index.json's bytes the plain way (what hmem did before writing the shard list itself)."""
    body = mf._body([dataclasses.asdict(s) for s in mf.shards])
    document = {**body, "checksum": f"crc32c:{manifest._checksum(body):08x}"}
    return (json.dumps(document, indent=1) + "\n").encode()


def raw_write(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[100, 1000, 3000])
    parser.add_argument("--rounds", type=int, default=30, help="put + flush rounds timed at each checkpoint")
    args = parser.parse_args()
    print_machine_facts()
    root = Path(tempfile.mkdtemp(prefix="hmem-bench-flush-"))
    rng = np.random.default_rng(0)

    def round_(store: hmem.Store) -> float:
        keys = rng.standard_normal((100, 1, 16), dtype=np.float32)
        store.put_many([(k, k, 0, 1.0) for k in keys])
        t0 = time.perf_counter()
        store.flush()
        return time.perf_counter() - t0

    ours_to_bytes = manifest.Manifest.to_bytes

    def flush_rounds(store: hmem.Store) -> tuple[float, float]:
        """Median flush, hmem's commit and the plain way's, taking turns."""
        times: dict[bool, list[float]] = {False: [], True: []}
        try:
            for i in range(2 * args.rounds):
                plain = bool(i % 2)
                manifest.Manifest.to_bytes = plain_bytes if plain else ours_to_bytes  # type: ignore[method-assign]
                times[plain].append(round_(store))
        finally:
            manifest.Manifest.to_bytes = ours_to_bytes  # type: ignore[method-assign]
        return statistics.median(times[False]), statistics.median(times[True])

    print(
        f"{'shards':>7} {'flush':>10} {'plain way':>10} {'index.json':>11} {'to_bytes':>10} {'plain way':>10}"
        f" {'raw write':>10}"
    )
    try:
        with hmem.Store.create(root / "s", embed_dim=16) as store:
            done = 0  # rounds so far: each flush seals the round's shard
            for checkpoint in sorted(args.checkpoints):
                while done < checkpoint:
                    round_(store)
                    done += 1
                flush, flush_plain = flush_rounds(store)
                done += 2 * args.rounds
                mf = manifest.parse(root / "s", (root / "s" / "index.json").read_bytes())
                ours, plain = mf.to_bytes(), plain_bytes(mf)
                assert ours == plain, "the two ways wrote different bytes"
                t_ours = statistics.median(time_calls(mf.to_bytes, min_runs=5, min_seconds=0.2))
                t_plain = statistics.median(time_calls(lambda: plain_bytes(mf), min_runs=5, min_seconds=0.2))
                t_raw = statistics.median(raw_write(root / "raw.json", ours) for _ in range(9))
                print(
                    f"{len(mf.shards):>7} {flush * 1e3:>7.2f} ms {flush_plain * 1e3:>7.2f} ms"
                    f" {len(ours) / 1e3:>8.0f} kB {t_ours * 1e3:>7.2f} ms {t_plain * 1e3:>7.2f} ms"
                    f" {t_raw * 1e3:>7.2f} ms"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
