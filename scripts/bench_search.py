"""Benchmark of the store's kernels: signature search, projection, CRC-32C.

Signature search: random 4096-bit signatures (512 bytes) for each store size,
spread evenly over 32 layers, each layer one contiguous uint8 (n_layer, 512)
matrix as the store keeps them.  For each size it times

- one layer, top-5, warm: the same layer queried again and again (it stays
  in the CPU caches when it fits: 16 MB per layer at 1M entries);
- one layer, top-5 and top-100, cold: each query goes to the next layer, so
  at 1M entries (512 MB in all) the layer is read from memory;
- all 32 layers, top-5 and top-100: a scan of every layer then a merge of
  the per-layer results by (distance, layer, row);

with the native kernel (hmem.kernels._native._hamming.topk) beside, measured in the
same run on the same matrices: numpy (xor + np.bitwise_count + argpartition),
faiss IndexBinaryFlat (one index per layer; skipped when faiss is not
importable), and the memory-read floor (sigs.view(np.uint64).sum() over the
same bytes).  One-layer cold top-5 is also timed on every CPU path.

Projection: one 3584-float vector to 4096 bits, the native signature (3
rounds; 1 and 2 for comparison) against a dense Gaussian matrix-vector
product in numpy (float32, 4096 x 3584) plus the sign packing.  Batch
projection: the signatures of many entries in one call (what a bulk put
makes, one thread), per entry, on every CPU path, for entries of 1-16
tokens of 64-1024 values, checked to give the same bytes on every path.

CRC-32C: 64 MB, native (each CPU path) against zlib.crc32.

Before timing, native search results are checked against numpy (same rows
and distances under the (distance, row) order) and faiss (same distances);
a mismatch stops the run with exit status 1.

Usage::

    python scripts/bench_search.py                      # sizes 10k, 100k, 1M
    python scripts/bench_search.py --sizes 10000,100000 # fewer sizes
    python scripts/bench_search.py --json               # JSON on stdout instead of the tables
    python scripts/bench_search.py --json out.json      # tables on stdout, JSON in out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import zlib
from collections.abc import Callable

import benchlib
import numpy as np

import hmem
from hmem.kernels._native import _checksum, _hamming, _projection

try:
    import faiss
except ImportError:  # the benchmark runs without it
    faiss = None

HDC_DIM = 4096
NBYTES = HDC_DIM // 8
LAYERS = 32
EMBED_DIM = 3584
PROJ_M = 4096  # the transform size for embed_dim 3584: the next power of two
CRC_BYTES = 64 << 20

GOAL_LAYER_MS = 1.0  # one layer of a 1M-entry store, top-5, cold
GOAL_FLOOR_RATIO = 1.5  # full scan (top-5) vs the memory-read floor
GOAL_FAISS_SPEEDUP = 2.0  # native vs faiss IndexBinaryFlat, one query
GOAL_PROJECTION_US = 50.0  # one vector, 3584 -> 4096 bits, 3 rounds


# ---- timing -----------------------------------------------------------------------


def time_calls(call: Callable[[int], object], min_runs: int, seconds: float) -> list[int]:
    """Per-call times (ns) of call(i), i = 0, 1, ...: at least `min_runs` calls
    and `seconds` of timing, after one warm-up call; gc off."""
    clock = time.perf_counter_ns
    call(0)
    times: list[int] = []
    deadline = clock() + int(seconds * 1e9)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        i = 1
        while len(times) < min_runs or (clock() < deadline and len(times) < 100_000):
            t0 = clock()
            call(i)
            times.append(clock() - t0)
            i += 1
    finally:
        if was_enabled:
            gc.enable()
    return times


def median(times: list[int]) -> int:
    return int(statistics.median(times))


# ---- the search implementations ----------------------------------------------------


def layer_sizes(total: int) -> list[int]:
    return [total // LAYERS + (1 if i < total % LAYERS else 0) for i in range(LAYERS)]


def make_layers(total: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.frombuffer(rng.bytes(n * NBYTES), dtype=np.uint8).reshape(n, NBYTES) for n in layer_sizes(total)]


def native_topk(q, sigs, k):
    return _hamming.topk(q, sigs, None, k)


def numpy_topk(q, sigs, k):
    """xor + bitwise_count over u64 words, argpartition for the k-th distance,
    then every row up to it in (distance, row) order (the native tie rule)."""
    d = np.bitwise_count(sigs.view(np.uint64) ^ q.view(np.uint64)).sum(axis=1, dtype=np.int32)
    if k < d.shape[0]:
        kth = d[np.argpartition(d, k - 1)[k - 1]]
        rows = np.flatnonzero(d <= kth)
    else:
        rows = np.arange(d.shape[0])
    order = np.lexsort((rows, d[rows]))[:k]
    return rows[order], d[rows[order]]


def faiss_topk(q, index, k):
    dists, rows = index.search(q[None, :], k)
    return rows[0], dists[0]


def merge(results: list[tuple[np.ndarray, np.ndarray]], k: int):
    """Global top-k of per-layer results by (distance, layer, row)."""
    rows = np.concatenate([r for r, _ in results])
    dists = np.concatenate([d for _, d in results])
    layer = np.concatenate([np.full(r.shape[0], i, dtype=np.int64) for i, (r, _) in enumerate(results)])
    order = np.lexsort((rows, layer, dists))[:k]
    return layer[order], rows[order], dists[order]


def floor_read(sigs) -> int:
    return int(sigs.view(np.uint64).sum())


# ---- the run ------------------------------------------------------------------------


def check_search(q, layers, indexes, log) -> None:
    for k in (5, 100):
        for i in (0, LAYERS - 1):
            rows, dists = native_topk(q, layers[i], k)
            want_rows, want_dists = numpy_topk(q, layers[i], k)
            ok = np.array_equal(rows, want_rows) and np.array_equal(dists, want_dists)
            if indexes is not None:
                _, faiss_dists = faiss_topk(q, indexes[i], k)
                ok = ok and np.array_equal(np.sort(faiss_dists), np.sort(dists))
            if not ok:
                log(f"MISMATCH: native top-{k} of layer {i} differs from numpy or faiss; timings would be meaningless")
                raise SystemExit(1)


def bench_search(total: int, args, log) -> list[dict]:
    rng = np.random.default_rng(total)
    log(f"search: building {total:,} signatures ({total * NBYTES / 2**20:,.0f} MB) over {LAYERS} layers")
    layers = make_layers(total, rng)
    queries = [np.frombuffer(rng.bytes(NBYTES), dtype=np.uint8) for _ in range(16)]
    indexes = None
    if faiss is not None:
        indexes = []
        for sigs in layers:
            index = faiss.IndexBinaryFlat(HDC_DIM)
            index.add(sigs)
            indexes.append(index)
    check_search(queries[0], layers, indexes, log)

    def q(i):
        return queries[i % len(queries)]

    layer_bytes = layers[0].nbytes
    all_bytes = sum(s.nbytes for s in layers)
    cases = [
        ("1 layer, top-5, warm", 5, "warm", layer_bytes),
        ("1 layer, top-5, cold", 5, "cold", layer_bytes),
        ("1 layer, top-100, cold", 100, "cold", layer_bytes),
        ("32 layers, top-5", 5, "all", all_bytes),
        ("32 layers, top-100", 100, "all", all_bytes),
    ]
    rows = []
    for name, k, mode, nbytes in cases:

        def pick(i):  # the layer a one-layer query reads
            return 0 if mode == "warm" else i % LAYERS

        impls: dict[str, Callable[[int], object]] = {}
        if mode == "all":
            impls["native"] = lambda i: merge([native_topk(q(i), s, k) for s in layers], k)
            impls["numpy"] = lambda i: merge([numpy_topk(q(i), s, k) for s in layers], k)
            if indexes is not None:
                impls["faiss"] = lambda i: merge([faiss_topk(q(i), x, k) for x in indexes], k)
            impls["floor"] = lambda i: sum(floor_read(s) for s in layers)
        else:
            impls["native"] = lambda i: native_topk(q(i), layers[pick(i)], k)
            impls["numpy"] = lambda i: numpy_topk(q(i), layers[pick(i)], k)
            if indexes is not None:
                impls["faiss"] = lambda i: faiss_topk(q(i), indexes[pick(i)], k)
            impls["floor"] = lambda i: floor_read(layers[pick(i)])
        row = {"size": total, "case": name, "k": k, "bytes": nbytes}
        for impl, call in impls.items():
            slow = impl == "numpy" and nbytes > (64 << 20)
            times = time_calls(call, 3 if slow else args.min_runs, args.seconds)
            row[impl] = {"median_ns": median(times), "min_ns": min(times), "runs": len(times)}
        rows.append(row)
        log(
            f"  {total:>9,} {name}: native {fmt_ns(row['native']['median_ns'])}, "
            f"floor {fmt_ns(row['floor']['median_ns'])}"
        )

    # One layer, top-5, cold, on every CPU path.
    before = _hamming.active_path()
    try:
        for index, path in enumerate(_hamming.PATH_NAMES[: _hamming.best_path() + 1]):
            _hamming.select_path(index)
            times = time_calls(lambda i: native_topk(q(i), layers[i % LAYERS], 5), args.min_runs, args.seconds)
            rows.append(
                {
                    "size": total,
                    "case": f"1 layer, top-5, cold, path {path}",
                    "k": 5,
                    "bytes": layer_bytes,
                    "native": {"median_ns": median(times), "min_ns": min(times), "runs": len(times)},
                }
            )
    finally:
        _hamming.select_path(before)
    return rows


def bench_projection(args, log) -> list[dict]:
    log("projection: one vector, 3584 -> 4096 bits")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, EMBED_DIM)).astype(np.float32)
    out = np.zeros(NBYTES, dtype=np.uint8)
    rows = []
    before = _projection.active_path()
    try:
        for index, path in enumerate(_projection.PATH_NAMES[: _projection.best_path() + 1]):
            _projection.select_path(index)
            for rounds in (1, 2, 3):
                signs = _projection.signs_table(12345, PROJ_M, rounds, 1)
                times = time_calls(
                    lambda i: _projection.signature(x, signs, PROJ_M, rounds, HDC_DIM, out),
                    args.min_runs * 10,
                    args.seconds,
                )
                rows.append(
                    {
                        "impl": f"native, {rounds} round{'s' if rounds > 1 else ''}, path {path} "
                        f"({_projection.variant()})",
                        "rounds": rounds,
                        "path": path,
                        "median_ns": median(times),
                        "runs": len(times),
                    }
                )
    finally:
        _projection.select_path(before)
    g = np.random.default_rng(2).standard_normal((HDC_DIM, EMBED_DIM), dtype=np.float32)
    vec = x[0]
    times = time_calls(lambda i: np.packbits(g @ vec > 0, bitorder="little"), args.min_runs, args.seconds)
    rows.append(
        {
            "impl": f"dense Gaussian, numpy float32 matvec ({g.nbytes / 2**20:.0f} MB matrix) + packbits",
            "rounds": None,
            "path": None,
            "median_ns": median(times),
            "runs": len(times),
        }
    )
    return rows


BATCH_CASES = ((4, 64), (1, 64), (16, 128), (1, 1024))  # tokens, embed_dim


def bench_projection_batch(args, log) -> list[dict]:
    """signature_many of a batch of entries, one thread, per CPU path."""
    log("projection: batches of entries, " + ", ".join(f"{t} x {d}" for t, d in BATCH_CASES))
    rng = np.random.default_rng(4)
    rows = []
    before = _projection.active_path()
    try:
        for tokens, dim in BATCH_CASES:
            m = max(64, 1 << (dim - 1).bit_length())
            signs = _projection.signs_table(12345, m, 3, -(-HDC_DIM // m))
            count = 20_000 if dim <= 128 else 4_000
            x = rng.standard_normal((count * tokens, dim)).astype(np.float32)
            starts = np.arange(0, count * tokens + 1, tokens, dtype=np.int64)
            out = np.zeros((count, NBYTES), dtype=np.uint8)
            sums = np.zeros((count, dim))
            first = None
            for index, path in enumerate(_projection.PATH_NAMES[: _projection.best_path() + 1]):
                _projection.select_path(index)
                _projection.signature_many(x, starts, signs, m, 3, HDC_DIM, out, sums)
                if first is None:
                    first = out.copy()
                elif not np.array_equal(out, first):
                    raise SystemExit(f"batch signatures differ on path {path}")
                times = time_calls(
                    lambda i: _projection.signature_many(x, starts, signs, m, 3, HDC_DIM, out, sums), 3, args.seconds
                )
                rows.append(
                    {
                        "tokens": tokens,
                        "embed_dim": dim,
                        "path": path,
                        "entries": count,
                        "median_ns": median(times),
                        "per_entry_ns": median(times) / count,
                        "runs": len(times),
                    }
                )
    finally:
        _projection.select_path(before)
    return rows


def bench_crc(args, log) -> list[dict]:
    log(f"crc32c: {CRC_BYTES >> 20} MB")
    data = np.frombuffer(np.random.default_rng(3).bytes(CRC_BYTES), dtype=np.uint8)
    rows = []
    before = _checksum.active_path()
    try:
        for index, path in enumerate(_checksum.PATH_NAMES[: _checksum.best_path() + 1]):
            _checksum.select_path(index)
            times = time_calls(lambda i: _checksum.crc32c(data), args.min_runs, args.seconds)
            rows.append({"impl": f"native crc32c, path {path}", "median_ns": median(times), "runs": len(times)})
    finally:
        _checksum.select_path(before)
    times = time_calls(lambda i: zlib.crc32(data), args.min_runs, args.seconds)
    rows.append(
        {
            "impl": f"zlib.crc32 (zlib {zlib.ZLIB_RUNTIME_VERSION}, a different polynomial)",
            "median_ns": median(times),
            "runs": len(times),
        }
    )
    for row in rows:
        row["GB_per_s"] = CRC_BYTES / row["median_ns"]
    return rows


# ---- goals and output -----------------------------------------------------------------


def goals(search: list[dict], projection: list[dict]) -> list[dict]:
    out = []

    def add(text, ok, detail):
        out.append({"goal": text, "holds": ok, "detail": detail})

    by = {(r["size"], r["case"]): r for r in search}
    cold = by.get((1_000_000, "1 layer, top-5, cold"))
    if cold:
        ms = cold["native"]["median_ns"] / 1e6
        add(f"one layer of a 1M-entry store (top-5, cold) <= {GOAL_LAYER_MS:g} ms", ms <= GOAL_LAYER_MS, f"{ms:.3f} ms")
    else:
        add(f"one layer of a 1M-entry store (top-5, cold) <= {GOAL_LAYER_MS:g} ms", None, "1M not in --sizes")
    largest = max((r["size"] for r in search), default=None)
    full = by.get((largest, "32 layers, top-5"))
    if full:
        ratio = full["native"]["median_ns"] / full["floor"]["median_ns"]
        add(
            f"full scan (32 layers, top-5, {largest:,} entries) within {GOAL_FLOOR_RATIO:g}x of the memory-read floor",
            ratio <= GOAL_FLOOR_RATIO,
            f"{ratio:.2f}x",
        )
    faiss_rows = [r for r in search if "faiss" in r and r["case"] in ("1 layer, top-5, cold", "32 layers, top-5")]
    if faiss_rows:
        speedups = {
            f"{r['size']:,} {r['case']}": r["faiss"]["median_ns"] / r["native"]["median_ns"] for r in faiss_rows
        }
        worst = min(speedups.values())
        add(
            f">= {GOAL_FAISS_SPEEDUP:g}x faster than faiss IndexBinaryFlat on one query",
            worst >= GOAL_FAISS_SPEEDUP,
            ", ".join(f"{k}: {v:.1f}x" for k, v in speedups.items()),
        )
    else:
        add(f">= {GOAL_FAISS_SPEEDUP:g}x faster than faiss IndexBinaryFlat on one query", None, "faiss not importable")
    best = [r for r in projection if r["rounds"] == 3 and r["path"] == _projection.PATH_NAMES[_projection.best_path()]]
    if best:
        us = best[0]["median_ns"] / 1000
        add(
            f"projection of one vector (3584 -> 4096 bits, 3 rounds) <= {GOAL_PROJECTION_US:g} us",
            us <= GOAL_PROJECTION_US,
            f"{us:.1f} us",
        )
    return out


def fmt_ns(ns: int | None) -> str:
    if ns is None:
        return "-"
    if ns < 1_000_000:
        return f"{ns / 1000:.1f} us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def render(header: list[str], body: list[list[str]], left: int = 1) -> str:
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])


def search_table(rows: list[dict]) -> str:
    header = ["entries", "case", "native", "GB/s", "numpy", "faiss", "floor", "native/floor", "faiss/native"]
    body = []
    for r in rows:
        nat = r["native"]["median_ns"]
        get = lambda name: r[name]["median_ns"] if name in r else None  # noqa: E731
        body.append(
            [
                f"{r['size']:,}",
                r["case"],
                fmt_ns(nat),
                f"{r['bytes'] / nat:.1f}",
                fmt_ns(get("numpy")),
                fmt_ns(get("faiss")),
                fmt_ns(get("floor")),
                "-" if "floor" not in r else f"{nat / r['floor']['median_ns']:.2f}x",
                "-" if "faiss" not in r else f"{r['faiss']['median_ns'] / nat:.1f}x",
            ]
        )
    return render(header, body, left=2)


def machine_facts() -> dict[str, str]:
    facts = benchlib.machine_facts()
    facts["faiss"] = (
        "not importable" if faiss is None else f"{faiss.__version__}, {faiss.omp_get_max_threads()} threads"
    )
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        metavar="N,N,...",
        help="store sizes in entries, comma-separated (default 10000,100000,1000000)",
    )
    p.add_argument(
        "--min-runs", type=int, default=20, metavar="N", help="minimum timed calls per measurement (default 20)"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=0.5,
        metavar="S",
        help="minimum timing time per measurement, seconds (default 0.5)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the results as JSON: to stdout instead of the tables, or to PATH",
    )
    args = p.parse_args(argv)
    try:
        sizes = [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error("--sizes takes integers separated by commas")
    if not sizes or min(sizes) < LAYERS or args.min_runs < 1 or args.seconds < 0:
        p.error(f"--sizes must be >= {LAYERS} each, --min-runs >= 1, --seconds >= 0")
    if hmem.kernels.KERNEL_SET != "native":
        sys.stderr.write(
            f"{hmem.kernels.KERNELS_ENV} selects the {hmem.kernels.KERNEL_SET} kernels: "
            "this benchmark measures the native ones; unset it.\n"
        )
        return 2

    json_only = args.json == "-"
    out = sys.stderr if json_only else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    facts = machine_facts()
    print("hmem search / projection / checksum benchmark (scripts/bench_search.py)", file=out)
    for key, value in facts.items():
        print(f"  {key:9} {value}", file=out)
    print(
        f"  timing    median of >= {args.min_runs} calls and >= {args.seconds:g} s per measurement "
        "(>= 3 calls for numpy over more than 64 MB), gc off",
        file=out,
        flush=True,
    )

    search = [row for total in sizes for row in bench_search(total, args, log)]
    projection = bench_projection(args, log)
    batch = bench_projection_batch(args, log)
    crc = bench_crc(args, log)
    result = {
        "machine": facts,
        "settings": {
            "sizes": sizes,
            "min_runs": args.min_runs,
            "seconds": args.seconds,
            "hdc_dim": HDC_DIM,
            "layers": LAYERS,
            "embed_dim": EMBED_DIM,
        },
        "search": search,
        "projection": projection,
        "projection_batch": batch,
        "crc32c": crc,
        "goals": goals(search, projection),
    }

    if not json_only:
        print(file=out)
        print(f"Signature search ({HDC_DIM}-bit signatures, {LAYERS} layers; medians)", file=out)
        print(search_table(search), file=out)
        print(file=out)
        print(f"Projection of one vector ({EMBED_DIM} floats -> {HDC_DIM} bits)", file=out)
        print(render(["implementation", "median"], [[r["impl"], fmt_ns(r["median_ns"])] for r in projection]), file=out)
        print(file=out)
        print(f"Projection of a batch of entries to {HDC_DIM} bits (one call, one thread; per entry)", file=out)
        print(
            render(
                ["tokens x dim", "path", "per entry"],
                [[f"{r['tokens']} x {r['embed_dim']}", r["path"], fmt_ns(r["per_entry_ns"])] for r in batch],
            ),
            file=out,
        )
        print(file=out)
        print(f"CRC-32C over {CRC_BYTES >> 20} MB", file=out)
        print(
            render(
                ["implementation", "median", "GB/s"],
                [[r["impl"], fmt_ns(r["median_ns"]), f"{r['GB_per_s']:.1f}"] for r in crc],
            ),
            file=out,
        )
        print(file=out)
        for g in result["goals"]:
            verdict = "not measured" if g["holds"] is None else "holds" if g["holds"] else "FAILS"
            print(f"goal: {g['goal']}: {verdict} ({g['detail']})", file=out)
    if args.json is not None:
        text = json.dumps(result, indent=2)
        if json_only:
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
