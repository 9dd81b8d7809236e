"""Benchmark of batched queries: Store.query_many against one Store.query
per item and against faiss IndexBinaryFlat, on one layer of 1M entries.

The store holds ONE layer of --entries entries (default 1,000,000), each 1
token x embed_dim 16 of random Gaussian keys, hdc_dim 4096, so every
signature is 512 bytes and the layer's signature matrix is 512 MB.  It is
built with put_many in batches of 10,000 (a flush after each, as a store
that grows over time is written), or reused with --store PATH.

In the same process, on the same open store, with count_access=False so
every call sees the same store, the script times (rounds interleaved, one
call of each case per round, after a warm-up call of each; median and min):

1. 64 single queries: ``for q in qs: store.query(q, 0, top_k=10)``;
2. ``store.query_many(qs, 0, top_k=10)``;

both with rerank=True (a shortlist of 4 x top_k = 40 re-ranked by the
cosine of pooled keys) and rerank=False (signature order only), and

3. faiss ``IndexBinaryFlat(4096)`` holding the same signatures, answering
   the 64 queries' signatures in one ``search(Q, 40)`` call (40 = the
   shortlist hmem scans for top_k=10 with shortlist_factor 4), and with
   one call per query for context.  faiss is given the query signatures
   ready-made; hmem's figures include projecting the queries and building
   the results.

Before timing, each query_many result must equal the single queries'
(entry ids, scores, similarities, cosines, in order) and faiss's distances
must equal hmem's signature distances; otherwise the run stops with exit
status 1.

Then query_many (rerank=False) is timed for batches of 1, 8, 16, 64 and
256 queries (--curve), and query_many's time is split into its parts: the
query signatures, the layer scan alone, and the rest (re-rank and result
assembly).

Usage::

    python scripts/bench_query_many.py                          # builds a 1M-entry store in a temp dir
    python scripts/bench_query_many.py --store /tmp/qm-1m       # builds it there once, reuses it after
    python scripts/bench_query_many.py --entries 200000 --repeat 3
    python scripts/bench_query_many.py --json                   # JSON on stdout instead of the tables
    python scripts/bench_query_many.py --json out.json          # tables on stdout, JSON in out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import benchlib
import numpy as np

import hmem
import hmem.threads
from hmem.kernels import hamming as hamming_kernels

try:
    import faiss
except ImportError:  # the benchmark runs without it
    faiss = None

HDC_DIM = 4096
EMBED_DIM = 16
LAYER = 0
TOP_K = 10
SHORTLIST_FACTOR = 4  # Store.query's default
BUILD_BATCH = 10_000
QUERY_TOKENS = 8
# Every signature compared whole, as faiss's IndexBinaryFlat does: the
# batching is measured here; the two-stage search ("auto" picks it on a
# layer this large) has its own benchmark, scripts/bench_two_stage.py.
SEARCH = "full"

GOAL_SPEEDUP = 4.0  # query_many vs 64 single queries
GOAL_FAISS = 1.5  # faiss batch time / query_many time (rerank=False)


# ---- the store ---------------------------------------------------------------------


def build(path: Path, entries: int, max_open_shards: int, log) -> float:
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    with hmem.Store.create(path, embed_dim=EMBED_DIM, hdc_dim=HDC_DIM, max_open_shards=max_open_shards) as store:
        done = 0
        while done < entries:
            m = min(BUILD_BATCH, entries - done)
            keys = rng.standard_normal((m, 1, EMBED_DIM), dtype=np.float32)
            store.put_many(hmem.Entry(keys[i], keys[i], LAYER) for i in range(m))
            store.flush()
            done += m
            if done % 100_000 == 0 or done == entries:
                log(f"  {done:,} entries, {time.perf_counter() - t0:.0f} s")
    return time.perf_counter() - t0


def open_store(args, root: Path, log) -> tuple[hmem.Store, float | None, int]:
    path = Path(args.store) if args.store else root / "store"
    built = None
    if not (path / "index.json").exists():
        if path.exists() and any(path.iterdir()):
            raise SystemExit(f"{path} exists and is not a store; give an empty or new directory")
        log(f"building a store of {args.entries:,} entries in one layer at {path} ...")
        built = build(path, args.entries, args.max_open_shards, log)
        log(f"  built in {built:.0f} s")
    store = hmem.Store.open(path, read_only=True)
    stats = store.stats()
    config = stats.config
    if (
        stats.layers != {LAYER: args.entries}
        or config.hdc_dim != HDC_DIM
        or config.embed_dim != EMBED_DIM
        or config.max_open_shards != args.max_open_shards
    ):
        store.close()
        raise SystemExit(
            f"{path} holds {stats.layers} (hdc_dim {config.hdc_dim}, embed_dim {config.embed_dim}, "
            f"max_open_shards {config.max_open_shards}), not one layer of {args.entries:,} entries "
            f"with hdc_dim {HDC_DIM}, embed_dim {EMBED_DIM} and max_open_shards "
            f"{args.max_open_shards}: give the options that match, or another --store"
        )
    return store, built, len(stats.shards)


# ---- timing ------------------------------------------------------------------------


def time_rounds(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each case: one warm-up call each, then `rounds`
    rounds of one call of every case in turn (benchlib.samples_in_turns)."""
    for fn in cases.values():
        fn()
    return benchlib.samples_in_turns({name: (lambda i, fn=fn: fn()) for name, fn in cases.items()}, rounds)


def summary(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "runs": len(samples), "samples_s": samples}


def fmt(seconds: float) -> str:
    return benchlib.fmt_seconds(seconds)


# ---- checks ------------------------------------------------------------------------


def described(results) -> list[tuple]:
    return [(r.entry_id, r.score, r.similarity, r.cosine) for r in results]


def check_same(store, qs, rerank: bool, log) -> None:
    singles = [
        described(store.query(q, LAYER, top_k=TOP_K, rerank=rerank, count_access=False, search=SEARCH)) for q in qs
    ]
    many = [
        described(r) for r in store.query_many(qs, LAYER, top_k=TOP_K, rerank=rerank, count_access=False, search=SEARCH)
    ]
    if len(many) != len(singles):
        log(f"MISMATCH: query_many returned {len(many)} results for {len(singles)} queries")
        raise SystemExit(1)
    for i, (a, b) in enumerate(zip(singles, many)):
        if a != b:
            log(f"MISMATCH (rerank={rerank}): query {i}: query gives {a[:3]}..., query_many gives {b[:3]}...")
            log(
                "reproduce: the same store, store.query(qs[i], 0, top_k=10, rerank=...) against "
                "store.query_many(qs, 0, top_k=10, rerank=...)[i]"
            )
            raise SystemExit(1)
    if any(len(a) != TOP_K for a in singles):
        log(f"MISMATCH: a query returned fewer than {TOP_K} results")
        raise SystemExit(1)


def check_faiss(store, qs, index, qsigs, log) -> None:
    dists, _ = index.search(qsigs, TOP_K)
    many = store.query_many(qs, LAYER, top_k=TOP_K, rerank=False, count_access=False, search=SEARCH)
    for i, res in enumerate(many):
        hmem_dists = [round((1.0 - r.similarity) * HDC_DIM) for r in res]
        if hmem_dists != dists[i].tolist():
            log(
                f"MISMATCH: query {i}: hmem's signature distances {hmem_dists} differ from faiss's "
                f"{dists[i].tolist()}; timings would be meaningless"
            )
            raise SystemExit(1)


# ---- the run -----------------------------------------------------------------------


def run(store, args, log) -> dict:
    rng = np.random.default_rng(3)
    n_max = max([args.queries, *args.curve])
    pool = [rng.standard_normal((QUERY_TOKENS, EMBED_DIM), dtype=np.float32) for _ in range(n_max)]
    qs = pool[: args.queries]
    shortlist = TOP_K * SHORTLIST_FACTOR

    # Store.query_many and Store.query give results, not signatures, and
    # faiss needs the layer's signature matrix and the queries' signatures:
    # they are read from the store's private state (read only) so that faiss
    # searches exactly the bytes hmem searches.
    state = store._state
    layer = state.search_index.layers[LAYER]
    view = layer.ready()  # a layer's matrix is made at its first query (LayerIndex.defer)
    sigs = view.sigs[: view.n]
    prepared = [state.projector.signature_and_mean(np.ascontiguousarray(q)) for q in pool]
    qsigs_all = np.stack([sig for sig, _ in prepared])
    qsigs = qsigs_all[: args.queries]

    log("checking that query_many gives the single queries' results ...")
    for rerank in (True, False):
        check_same(store, qs, rerank, log)

    index = None
    if faiss is not None:
        log(f"loading {len(sigs):,} signatures into faiss IndexBinaryFlat({HDC_DIM}) ...")
        index = faiss.IndexBinaryFlat(HDC_DIM)
        index.add(sigs)
        check_faiss(store, qs, index, qsigs, log)

    def singles(rerank: bool) -> Callable[[], object]:
        return lambda: [
            store.query(q, LAYER, top_k=TOP_K, rerank=rerank, count_access=False, search=SEARCH) for q in qs
        ]

    def many(rerank: bool, batch=qs) -> Callable[[], object]:
        return lambda: store.query_many(batch, LAYER, top_k=TOP_K, rerank=rerank, count_access=False, search=SEARCH)

    cases: dict[str, Callable[[], object]] = {
        "singles, rerank": singles(True),
        "query_many, rerank": many(True),
        "singles, signature": singles(False),
        "query_many, signature": many(False),
    }
    if index is not None:
        cases["faiss batch"] = lambda: index.search(qsigs, shortlist)
        cases["faiss singles"] = lambda: [index.search(qsigs[i : i + 1], shortlist) for i in range(len(qsigs))]
    log(f"timing {', '.join(cases)}: {args.repeat} rounds ...")
    main_times = {name: summary(t) for name, t in time_rounds(cases, args.repeat).items()}

    # Where query_many's time goes: the steps it takes, one by one, through
    # the same private calls it makes (the public API answers only whole
    # queries).  "answers" builds each query's results from its ready
    # shortlist: the batch's pooled keys and K/V read shard by shard, then
    # per query the re-rank and the result objects.
    def signatures() -> object:
        return [state.projector.signature_and_mean(q) for q in qs]

    ready = {
        True: state.search_index.search_many(LAYER, qsigs, shortlist),
        False: state.search_index.search_many(LAYER, qsigs, TOP_K),
    }

    def answers(rerank: bool) -> Callable[[], object]:
        factor = SHORTLIST_FACTOR if rerank else 1

        def run() -> object:
            queries = store._session.components.queries
            no_spans = [None] * len(prepared)  # mean keys only: a store without span signatures
            pooled, kvs = queries._read_ahead(
                ready[rerank], [mean for _, mean in prepared], TOP_K, rerank, None, no_spans
            )
            return [
                queries._answer(
                    LAYER,
                    sig,
                    mean,
                    sl,
                    TOP_K,
                    factor,
                    rerank=rerank,
                    skip=False,
                    search=SEARCH,
                    pooled=pooled,
                    kvs=kvs,
                    q_tokens=None,
                )[0]
                for (sig, mean), sl in zip(prepared, ready[rerank])
            ]

        return run

    parts_cases: dict[str, Callable[[], object]] = {
        "query signatures": signatures,
        "scan, k=40": lambda: state.search_index.search_many(LAYER, qsigs, shortlist),
        "scan, k=10": lambda: state.search_index.search_many(LAYER, qsigs, TOP_K),
        "scan, k=40, 1 thread": lambda: _one_thread(layer, qsigs, shortlist),
        "answers, rerank": answers(True),
        "answers, signature": answers(False),
    }
    log("timing query_many's parts ...")
    parts = {name: summary(t) for name, t in time_rounds(parts_cases, args.repeat).items()}

    log(f"timing query_many (signature order) for batches of {', '.join(map(str, args.curve))} ...")
    curve_cases = {n: many(False, pool[:n]) for n in args.curve}
    curve_times = time_rounds({str(n): fn for n, fn in curve_cases.items()}, args.repeat)
    curve = [{"queries": n, **summary(curve_times[str(n)])} for n in args.curve]
    return {
        "times": main_times,
        "parts": parts,
        "curve": curve,
        "layer_rows": int(layer.n),
        "signature_bytes": int(sigs.shape[1]),
    }


def _one_thread(layer, qsigs: np.ndarray, k: int) -> object:
    """The batch kernel over the whole layer on one thread: what the
    second core adds."""
    view = layer.view
    return hamming_kernels.topk_many(qsigs, view.sigs[: view.n], None, k)


# ---- goals and output ----------------------------------------------------------------


def goals(times: dict, n: int, entries: int) -> list[dict]:
    out = []
    where = f"a layer of {entries:,} entries" + ("" if entries == 1_000_000 else " (the goals are set for 1,000,000)")
    for label, key in (("re-rank", "rerank"), ("signature order", "signature")):
        single, many = times[f"singles, {key}"]["median_s"], times[f"query_many, {key}"]["median_s"]
        speedup = single / many
        out.append(
            {
                "goal": f"query_many >= {GOAL_SPEEDUP:g}x the throughput of {n} single queries ({label}), {where}",
                "holds": speedup >= GOAL_SPEEDUP,
                "detail": f"{fmt(single)} / {fmt(many)} = {speedup:.2f}x",
            }
        )
    if "faiss batch" in times:
        fb = times["faiss batch"]["median_s"]
        sig, rr = times["query_many, signature"]["median_s"], times["query_many, rerank"]["median_s"]
        out.append(
            {
                "goal": f"query_many (signature order) >= {GOAL_FAISS:g}x faster than faiss IndexBinaryFlat "
                f"answering the {n} signatures in one call, {where}",
                "holds": fb / sig >= GOAL_FAISS,
                "detail": f"faiss {fmt(fb)} / query_many {fmt(sig)} = {fb / sig:.2f}x "
                f"(with re-rank, not the verdict: {fmt(rr)}, {fb / rr:.2f}x)",
            }
        )
    else:
        out.append(
            {
                "goal": f"query_many >= {GOAL_FAISS:g}x faster than faiss IndexBinaryFlat",
                "holds": None,
                "detail": "faiss not importable",
            }
        )
    return out


def render(header: list[str], body: list[list[str]], left: int = 1) -> str:
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])


def tables(result: dict, out) -> None:
    times, n = result["times"], result["settings"]["queries"]
    print(file=out)
    print(
        f"{n} queries of {QUERY_TOKENS} tokens x {EMBED_DIM}, top-{TOP_K}, one layer of "
        f"{result['layer_rows']:,} entries ({result['layer_rows'] * result['signature_bytes'] / 1e6:,.0f} MB of "
        f"signatures) in {result['settings']['shards']} shards, max_open_shards "
        f"{result['settings']['max_open_shards']}; medians (min) of {result['settings']['repeat']} rounds",
        file=out,
    )
    body = []
    for label, key in (("re-rank (shortlist 40)", "rerank"), ("signature order", "signature")):
        s, m = times[f"singles, {key}"], times[f"query_many, {key}"]
        row = [
            label,
            f"{fmt(s['median_s'])} ({fmt(s['min_s'])})",
            fmt(s["median_s"] / n),
            f"{fmt(m['median_s'])} ({fmt(m['min_s'])})",
            fmt(m["median_s"] / n),
            f"{s['median_s'] / m['median_s']:.2f}x",
        ]
        if "faiss batch" in times:
            fb = times["faiss batch"]["median_s"]
            row += [fmt(fb), f"{fb / m['median_s']:.2f}x"]
        else:
            row += ["-", "-"]
        body.append(row)
    print(
        render(
            [
                "mode",
                f"{n} singles",
                "per query",
                "query_many",
                "per query",
                "speed-up",
                "faiss batch",
                "faiss / query_many",
            ],
            body,
        ),
        file=out,
    )
    if "faiss batch" in times:
        fb, fs = times["faiss batch"], times["faiss singles"]
        print(
            f"faiss IndexBinaryFlat, k={TOP_K * SHORTLIST_FACTOR}, {result['machine']['faiss']}: "
            f"batch of {n} in one search {fmt(fb['median_s'])} (min {fmt(fb['min_s'])}); "
            f"{n} one-query searches {fmt(fs['median_s'])} (min {fmt(fs['min_s'])}, "
            f"{fmt(fs['median_s'] / n)} each)",
            file=out,
        )
    print(file=out)
    parts = result["parts"]
    rr, sig = times["query_many, rerank"]["median_s"], times["query_many, signature"]["median_s"]

    def part(name: str, of: float | None, of_sig: float | None) -> list[str]:
        t = parts[name]["median_s"]
        return [fmt(t), "-" if of is None else f"{t / of:.0%}", "-" if of_sig is None else f"{t / of_sig:.0%}"]

    threads = hmem.threads.cores()
    shortlist = TOP_K * SHORTLIST_FACTOR
    print(f"query_many's {n} queries, by part (medians; each part timed on its own)", file=out)
    print(
        render(
            ["part", "time", "share of query_many, re-rank", "share, signature order"],
            [
                ["query signatures (projection + pooled mean)", *part("query signatures", rr, sig)],
                [f"layer scan, k={shortlist} ({threads} threads)", *part("scan, k=40", rr, None)],
                [f"layer scan, k={TOP_K} ({threads} threads)", *part("scan, k=10", None, sig)],
                [f"layer scan, k={shortlist}, 1 thread", *part("scan, k=40, 1 thread", None, None)],
                [
                    f"answers, re-rank: {shortlist} pooled keys + {TOP_K} K/V read per query",
                    *part("answers, rerank", rr, None),
                ],
                [f"answers, signature order: {TOP_K} K/V read per query", *part("answers, signature", None, sig)],
            ],
        ),
        file=out,
    )
    print(file=out)
    per_single = times["singles, signature"]["median_s"] / n
    print("query_many by batch size (signature order; medians)", file=out)
    print(
        render(
            ["queries", "query_many", "per query", "queries/s", "vs one single query each"],
            [
                [
                    str(c["queries"]),
                    fmt(c["median_s"]),
                    fmt(c["median_s"] / c["queries"]),
                    f"{c['queries'] / c['median_s']:,.0f}",
                    f"{per_single * c['queries'] / c['median_s']:.2f}x",
                ]
                for c in result["curve"]
            ],
        ),
        file=out,
    )
    print(file=out)
    for g in result["goals"]:
        verdict = "not measured" if g["holds"] is None else "holds" if g["holds"] else "FAILS"
        print(f"goal: {g['goal']}: {verdict} ({g['detail']})", file=out)


def machine_facts() -> dict[str, str]:
    facts = benchlib.machine_facts()
    facts["faiss"] = (
        "not importable" if faiss is None else f"{faiss.__version__}, {faiss.omp_get_max_threads()} threads"
    )
    facts["hmem scan threads"] = str(hmem.threads.cores())
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--entries", type=int, default=1_000_000, metavar="N", help="entries in the layer (default 1,000,000)"
    )
    p.add_argument("--store", metavar="PATH", help="build the store here once and reuse it (default: a temp dir)")
    p.add_argument(
        "--max-open-shards",
        type=int,
        default=hmem.StoreConfig(embed_dim=1).max_open_shards,
        metavar="N",
        help="the store's max_open_shards when it is built (default hmem's, 256); the store has one "
        "shard per 10,000 entries, and re-rank reads pooled keys from many of them",
    )
    p.add_argument("--queries", type=int, default=64, metavar="N", help="queries per batch (default 64)")
    p.add_argument("--repeat", type=int, default=5, metavar="N", help="timed rounds per case (default 5)")
    p.add_argument(
        "--curve",
        default="1,8,16,64,256",
        metavar="N,N,...",
        help="batch sizes for the throughput curve (default 1,8,16,64,256)",
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
        args.curve = [int(s) for s in args.curve.split(",") if s.strip()]
    except ValueError:
        p.error("--curve takes integers separated by commas")
    if (
        args.entries < 1
        or args.max_open_shards < 1
        or args.queries < 1
        or args.repeat < 1
        or not args.curve
        or min(args.curve) < 1
    ):
        p.error("--entries, --queries, --repeat and every --curve size must be >= 1")
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
    print("hmem batched query benchmark (scripts/bench_query_many.py)", file=out)
    for key, value in facts.items():
        print(f"  {key:17} {value}", file=out)
    print(flush=True, file=out)

    root = Path(tempfile.mkdtemp(prefix="hmem-bench-qm-"))
    try:
        store, built, shards = open_store(args, root, log)
        try:
            result = run(store, args, log)
        finally:
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "machine": facts,
        "settings": {
            "entries": args.entries,
            "queries": args.queries,
            "query_tokens": QUERY_TOKENS,
            "embed_dim": EMBED_DIM,
            "hdc_dim": HDC_DIM,
            "top_k": TOP_K,
            "shortlist": TOP_K * SHORTLIST_FACTOR,
            "repeat": args.repeat,
            "curve": args.curve,
            "max_open_shards": args.max_open_shards,
            "shards": shards,
            "build_seconds": built,
        },
        **result,
    }
    result["goals"] = goals(result["times"], args.queries, args.entries)

    if not json_only:
        tables(result, out)
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
