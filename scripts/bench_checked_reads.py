"""What checking every byte costs a read on this machine: the ceiling under
hmem's retrieve beside LMCache's fs connector (issue 38, goal 6).

The fs connector reads a chunk with one readinto of its file and checks
nothing; hmem's tier reads the same bytes and checks each layer's CRC-32C
(`read_checked`: a megabyte per preadv, each piece checked right after its
read, without the GIL).  Both copy from the page cache (warm) or the disk
(cold) into memory that is already touched (LMCache's pool is pinned when
the engine starts).  This script measures the two reads alone, on the same
file, threads and destination, taking turns, outside LMCache:

    plain         each 32 MiB chunk by one preadv (what the fs connector does)
    read_checked  each chunk's 64 pieces of 512 KiB (a 32-layer chunk's K and V
                  tensors), each checked against its CRC-32C (what hmem does)
    crc only      the CRC-32C of each chunk already in memory (the check alone)

cold: after fdatasync + posix_fadvise(DONTNEED) of the file before each read.

Usage::

    python scripts/bench_checked_reads.py                # 2 GiB, 8 threads, 5 rounds
    python scripts/bench_checked_reads.py --gib 0.5 --rounds 2 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from benchlib import native_kernels, print_machine_facts

from hmem.kernels import checksum as checksum_kernels

CHUNK = 32 << 20  # a chunk of 32 layers x 256 tokens x 1024 hidden, K and V, bf16
PIECE = 512 << 10  # one layer's K (or V) of that chunk


def measure(path: str, threads: int, rounds: int) -> dict[str, list[float]]:
    size = os.path.getsize(path)
    starts = list(range(0, size, CHUNK))
    fd = os.open(path, os.O_RDONLY)
    dest = np.ones(size, dtype=np.uint8)  # touched, as LMCache's pinned pool is
    offsets = np.arange(0, size, PIECE, dtype=np.int64)
    for start in starts:  # the bytes, for their checksums
        os.preadv(fd, [dest[start : start + CHUNK]], start)
    crcs = checksum_kernels.crc32c_pieces(dest, np.append(offsets, size))
    per_chunk = CHUNK // PIECE

    def plain(start: int) -> None:
        os.preadv(fd, [dest[start : start + CHUNK]], start)

    def checked(start: int) -> None:
        first = start // PIECE
        pieces = [dest[o : o + PIECE] for o in range(start, start + CHUNK, PIECE)]
        bad = checksum_kernels.read_checked(
            fd, offsets[first : first + per_chunk], pieces, crcs[first : first + per_chunk]
        )
        if bad != -1:
            raise SystemExit(f"piece {first + bad} failed its checksum: the file changed during the run")

    def crc_only(start: int) -> None:
        checksum_kernels.crc32c(dest[start : start + CHUNK])

    def cold() -> None:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    cases: dict[str, tuple[Callable[[int], None], bool]] = {
        "warm plain": (plain, False),
        "warm read_checked": (checked, False),
        "crc only": (crc_only, False),
        "cold plain": (plain, True),
        "cold read_checked": (checked, True),
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(plain, starts))  # the page cache holds the file
            for _ in range(rounds):
                for name, (read, drop) in cases.items():
                    if drop:
                        cold()
                    elif name.startswith("warm"):
                        list(pool.map(plain, starts))  # warm again after a cold case
                    t0 = time.perf_counter()
                    list(pool.map(read, starts))
                    rates[name].append(size / (time.perf_counter() - t0) / 1e9)
    finally:
        os.close(fd)
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="file size (default %(default)s GiB, 64 chunks)")
    p.add_argument("--threads", type=int, default=8, help="reading threads (the plugin's: %(default)s)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the file goes (default: a temporary directory)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args()
    if not native_kernels():
        return 2
    print_machine_facts()
    size = max(1, int(a.gib * 2**30) // CHUNK) * CHUNK
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hmem-bench-reads-") as tmp:
        path = os.path.join(tmp, "chunks")
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes())
        rates = measure(path, a.threads, a.rounds)
    print(f"{size / 2**30:.2f} GiB, chunks of {CHUNK >> 20} MiB, {a.threads} threads, {a.rounds} rounds (GB/s)")
    print(f"{'':20s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for name, values in rates.items():
        print(f"{name:20s} {statistics.median(values):8.2f} {min(values):8.2f} {max(values):8.2f}")
    for kind in ("warm", "cold"):
        ratio = statistics.median(rates[f"{kind} read_checked"]) / statistics.median(rates[f"{kind} plain"])
        print(f"{kind}: checked read / plain read = {ratio:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"bytes": size, "threads": a.threads, "rounds": a.rounds, "GBps": rates}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
