"""Bytes rewritten per byte freed by compaction: the whole-store rewrite
(the behaviour before incremental compaction, still there as
``compact(repack=True)``) beside the incremental one, in the same run.

Cases (entries of 16 tokens x embed_dim 64, f32: 8 KiB of K/V each):

- thin: 24 shards of 8 entries, one entry in eight deleted, spread over
  every shard (a few dead entries spread thinly);
- one shard: the same store, 7 of one shard's 8 entries deleted;
- max_disk: a store with max_disk_bytes = 1 MiB, filled to its limit,
  then 1.3 MiB more imported the way ``hmem put`` does it (a put_many and
  a flush per file of 8 entries), so that eviction triggers again and
  again.  "before" runs the same puts into a store without the limit and
  does what a put under the limit did before: evict the lowest-scored
  entries down to 90% of the limit, then rewrite the whole store;
  "after" is the store's own limit (stats().limits).

Each case also records the peak of the store directory's bytes during
the compaction, over its size before (observed at every write call
through hmem._io's fault hook, which injects nothing here).

Usage::

    python scripts/bench_compaction.py            # the table
    python scripts/bench_compaction.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

import hmem
from hmem import _io

EMBED, TOKENS, PER_SHARD, SHARDS = 64, 16, 8, 24
LIMIT = 1 << 20  # the max_disk case: 1 MiB
IMPORT = int(1.3 * (1 << 20))  # ... and 1.3 MiB imported into it
FILE_ENTRIES = 8  # entries per imported file (one put_many + flush each)


def entry(seed: int) -> hmem.Entry:
    r = np.random.default_rng(seed)
    k = r.standard_normal((TOKENS, EMBED)).astype(np.float32)
    return hmem.Entry(k, r.standard_normal((TOKENS, EMBED)).astype(np.float32), importance=float(r.random()))


def directory_bytes(path: Path) -> int:
    total = 0
    for item in os.scandir(path):
        if item.name != "lock":
            try:
                total += item.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total


class Peak:
    """The largest size of the store directory seen at a write call."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak = path, directory_bytes(path)

    def __call__(self, op: str, file: str) -> None:
        self.peak = max(self.peak, directory_bytes(self.path))


def shard_limit(root: Path) -> int:
    """A shard_max_bytes that holds PER_SHARD entries."""
    sizes = []
    for count in (1, 2):
        with hmem.Store.create(root / f"probe{count}", embed_dim=EMBED) as s:
            s.put_many([entry(i) for i in range(count)])
            s.flush()
            sizes.append(s.stats().shards[0].bytes)
    per = sizes[1] - sizes[0]
    return sizes[0] + (PER_SHARD - 1) * per + per * 9 // 10


def compact_case(root: Path, name: str, victims: list[int], limit: int) -> list[dict]:
    """A store of SHARDS full shards with `victims` (entry positions) deleted,
    compacted both ways."""
    base = root / f"{name}-base"
    with hmem.Store.create(base, embed_dim=EMBED, shard_max_bytes=limit) as s:
        ids = s.put_many([entry(i) for i in range(SHARDS * PER_SHARD)])
        s.flush()
        s.delete([ids[i] for i in victims])
    rows = []
    for mode, options in (("before (whole rewrite)", {"repack": True}), ("after (incremental)", {})):
        path = root / f"{name}-{'repack' if options else 'incremental'}"
        shutil.copytree(base, path)
        peak = Peak(path)
        _io.set_fault_hook(peak)
        try:
            with hmem.Store.open(path) as s:
                report = s.compact(**options)
        finally:
            _io.set_fault_hook(None)
        rows.append(
            dict(
                case=name,
                mode=mode,
                rewritten=report.bytes_rewritten,
                freed=report.bytes_freed,
                compactions=int(report.performed),
                store_before=report.bytes_before,
                peak_extra=peak.peak - report.bytes_before,
            )
        )
    return rows


def max_disk_case(root: Path) -> list[dict]:
    per_file = FILE_ENTRIES * (2 * TOKENS * EMBED * 4)
    files = IMPORT // per_file + 1
    fill = LIMIT // per_file  # files that (about) fill the store first
    rows = []
    # after: the store's own limit
    path = root / "disk-after"
    with hmem.Store.create(path, embed_dim=EMBED, max_disk_bytes=LIMIT) as s:
        for f in range(fill + files):
            s.put_many([entry(1000 + f * FILE_ENTRIES + i) for i in range(FILE_ENTRIES)])
            s.flush()
            if f == fill - 1:
                start = s.stats().limits
        end = s.stats().limits
        assert s.size() <= LIMIT
    rows.append(
        dict(
            case="max_disk 1.3 MiB into 1 MiB",
            mode="after (incremental)",
            rewritten=end.bytes_rewritten - start.bytes_rewritten,
            freed=end.bytes_freed - start.bytes_freed,
            compactions=end.compactions - start.compactions,
            store_before=LIMIT,
            peak_extra=None,
        )
    )
    # before: what a put under the limit did, through the public API
    path = root / "disk-before"
    rewritten = freed = compactions = 0
    with hmem.Store.create(path, embed_dim=EMBED) as s:
        for f in range(fill + files):
            batch = [entry(1000 + f * FILE_ENTRIES + i) for i in range(FILE_ENTRIES)]
            size = s.size()
            if size + per_file + 16 * 1024 > LIMIT:
                live = s.stats().entries
                per_entry = size / max(live, 1)
                keep = max(0, int((0.9 * LIMIT - per_file - 16 * 1024) / per_entry))
                s.evict(keep)
                report = s.compact(repack=True)
                if f >= fill:
                    rewritten += report.bytes_rewritten
                    freed += report.bytes_freed
                    compactions += 1
            s.put_many(batch)
            s.flush()
    rows.insert(
        0,
        dict(
            case="max_disk 1.3 MiB into 1 MiB",
            mode="before (whole rewrite)",
            rewritten=rewritten,
            freed=freed,
            compactions=compactions,
            store_before=LIMIT,
            peak_extra=None,
        ),
    )
    return rows


def human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hmem-bench-compaction-"))
    try:
        limit = shard_limit(root)
        rows = compact_case(root, "thin", list(range(0, SHARDS * PER_SHARD, PER_SHARD)), limit)
        rows += compact_case(root, "one shard", list(range(5 * PER_SHARD, 5 * PER_SHARD + 7)), limit)
        rows += max_disk_case(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    header = ("case", "mode", "rewritten", "freed", "rewritten/freed", "compactions", "peak extra disk")
    print(" | ".join(header))
    for r in rows:
        ratio = f"{r['rewritten'] / r['freed']:.2f}" if r["freed"] else "-"
        print(
            " | ".join(
                (
                    r["case"],
                    r["mode"],
                    human(r["rewritten"]),
                    human(r["freed"]),
                    ratio,
                    str(r["compactions"]),
                    human(r["peak_extra"]),
                )
            )
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
