"""Two-stage search: one query on one layer of 1M entries, against faiss.

    python scripts/bench_two_stage.py --root /tmp/hmem-two-stage   # builds two stores once (~3 min each), reuses them
    python scripts/bench_two_stage.py --entries 200000 --queries 50

Two stores of one layer each, built with put_many (entries of 1 token x
--dim, float32, hdc_dim 4096: 512 bytes of signature per entry):

- isotropic: pooled keys drawn from N(0, I);
- anisotropic: pooled keys with a large shared component, 2 c + N(0, I)
  with c ~ N(0, I) drawn once (unrelated keys have cosine ~0.8, as keys of
  real transformers do).

Each query is 4 tokens: an entry's key plus Gaussian noise (sigma 0.5).
The exact answer is the top 10 entries by the cosine of the query's mean
with every pooled key (numpy, float64).  For each store the script
measures, per query, Store.query(q, 0, top_k=10) with re-rank (a shortlist
of 40 re-ranked by cosine) and count_access=False:

- search="full": every signature compared whole;
- search="two-stage": hmem's default on a layer this large;
- faiss IndexBinaryFlat(4096) holding the same signatures, search(q, 40)
  of one query signature: the baseline, measured in the same run.

It reports recall@10 against the exact answer for full and two-stage, and
the speed/recall curve of the two-stage search over its two settings
(PREFIX_BYTES, SURVIVORS_PER_PLACE in hmem/store/search.py; the curve sets
them in the module, which a user cannot).  Timings: one call of each case
per round, cases taking turns, median of the rounds; gc off.

Goals (the issue "Performance at scale"): two-stage query <= 0.5x faiss's
time on one query, and recall@10 within 0.01 of the full search's, on both
stores.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import benchlib
import numpy as np

import hmem
from hmem.store import search as search_module

try:
    import faiss
except ImportError:  # the benchmark runs without it, without the baseline
    faiss = None

HDC_DIM = 4096
TOP_K = 10
SHORTLIST = 40  # TOP_K x Store.query's shortlist_factor
QUERY_TOKENS = 4
QUERY_NOISE = 0.5
BUILD_BATCH = 10_000
DATASETS = ("isotropic", "anisotropic")
CURVE_PREFIX = (32, 64, 128)
CURVE_SURVIVORS = (5, 10, 25, 50, 100)
GOAL_FAISS = 0.5
GOAL_RECALL_GAP = 0.01


def pooled_keys(dataset: str, entries: int, dim: int) -> np.ndarray:
    """The pooled key of every entry, in entry order (the same on every call)."""
    rng = np.random.default_rng(11 if dataset == "isotropic" else 12)
    keys = rng.standard_normal((entries, dim), dtype=np.float32)
    if dataset == "anisotropic":
        keys += 2.0 * rng.standard_normal(dim).astype(np.float32)
    return keys


def open_store(root: Path, dataset: str, keys: np.ndarray, log) -> hmem.Store:
    path = root / f"{dataset}-{len(keys)}x{keys.shape[1]}"
    config = hmem.StoreConfig(embed_dim=keys.shape[1], hdc_dim=HDC_DIM)

    def build() -> None:
        log(f"building {path} ({len(keys):,} entries) ...")
        with hmem.Store.create(path, config) as store:
            for lo in range(0, len(keys), BUILD_BATCH):
                rows = keys[lo : lo + BUILD_BATCH, None, :]
                store.put_many(hmem.Entry(r, r, 0) for r in rows)
                store.flush()

    built = benchlib.kept_store(path, config, build, log)
    if built is not None:
        log(f"  built in {built:.0f} s")
    if not (path / "pooled.bin").exists():
        raise SystemExit(f"{path} was built without pooled.bin (re-rank would read the shards): remove it")
    store = hmem.Store.open(path, read_only=True)
    if store.stats().layers != {0: len(keys)}:
        store.close()
        raise SystemExit(f"{path} does not hold one layer of {len(keys):,} entries: remove it or give another --root")
    return store


def time_rounds(cases: dict[str, Callable[[int], object]], queries: int) -> dict[str, float]:
    """Median seconds per call of each case over the queries, the cases
    taking turns on each query; one warm-up call each first."""
    for fn in cases.values():
        fn(0)
    return benchlib.medians_in_turns(cases, queries)


def recall(store, queries, exact, search: str) -> float:
    hits = 0
    for q, want in zip(queries, exact):
        got = {r.entry_id for r in store.query(q, 0, top_k=TOP_K, search=search, count_access=False)}
        hits += len(got & want)
    return hits / (TOP_K * len(queries))


def set_two_stage(store, prefix: int, survivors: int) -> None:
    # The curve's settings are module constants of hmem/store/search.py; the
    # layer's prefix matrix is dropped so that the next search makes it anew
    # at the new width (private state, read and reset by this script only).
    search_module.PREFIX_BYTES = prefix
    search_module.SURVIVORS_PER_PLACE = survivors
    layer = store._state.search_index.layers[0]
    layer.view = layer.view._replace(prefixes=None)


def run_dataset(root: Path, dataset: str, args, log) -> dict:
    keys = pooled_keys(dataset, args.entries, args.dim)
    store = open_store(root, dataset, keys, log)
    try:
        ids = np.array(store.entry_ids(0), dtype=np.int64)
        unit = keys / np.linalg.norm(keys, axis=1, keepdims=True)
        pairs = np.random.default_rng(5).integers(0, len(keys), (4000, 2))
        unrelated = float(np.mean(np.sum(unit[pairs[:, 0]] * unit[pairs[:, 1]], axis=1)))
        rng = np.random.default_rng(13)
        targets = rng.integers(0, len(keys), args.queries)
        queries = [
            (keys[t] + QUERY_NOISE * rng.standard_normal((QUERY_TOKENS, args.dim))).astype(np.float32) for t in targets
        ]
        exact = []
        for q in queries:
            mean = q.mean(axis=0, dtype=np.float64)
            cos = unit @ (mean / np.linalg.norm(mean))
            exact.append(set(ids[np.argsort(-cos, kind="stable")[:TOP_K]].tolist()))
        default = (search_module.PREFIX_BYTES, search_module.SURVIVORS_PER_PLACE)
        log(f"{dataset}: recall of the full search and of the two-stage search ...")
        result = {
            "entries": len(keys),
            "dim": args.dim,
            "unrelated_cosine": unrelated,
            "recall_full": recall(store, queries, exact, "full"),
            "recall_two_stage": recall(store, queries, exact, "two-stage"),
            "recall_auto": recall(store, queries, exact, "auto"),
        }

        cases: dict[str, Callable[[int], object]] = {
            "two-stage": lambda i: store.query(queries[i], 0, top_k=TOP_K, search="two-stage", count_access=False),
            "full": lambda i: store.query(queries[i], 0, top_k=TOP_K, search="full", count_access=False),
        }
        if faiss is not None:
            layer = store._state.search_index.layers[0]  # the signatures hmem scans, for faiss (read only)
            view = layer.ready()  # made at the layer's first query (LayerIndex.defer)
            index = faiss.IndexBinaryFlat(HDC_DIM)
            index.add(view.sigs[: view.n])
            projector = store._state.projector
            qsigs = np.stack([projector.signature(np.ascontiguousarray(q)) for q in queries])
            cases["faiss"] = lambda i: index.search(qsigs[i : i + 1], SHORTLIST)
        log(f"{dataset}: timing {', '.join(cases)} over {args.queries} queries ...")
        result["seconds"] = time_rounds(cases, args.queries)

        curve = []
        for prefix in CURVE_PREFIX:
            for survivors in CURVE_SURVIVORS:
                set_two_stage(store, prefix, survivors)
                r = recall(store, queries, exact, "two-stage")
                t = time_rounds(
                    {"q": lambda i: store.query(queries[i], 0, top_k=TOP_K, search="two-stage", count_access=False)},
                    min(args.queries, 60),
                )["q"]
                curve.append({"prefix_bytes": prefix, "survivors_per_place": survivors, "recall": r, "seconds": t})
                log(f"  prefix {prefix} B, {survivors} x shortlist: recall {r:.3f}, {t * 1e3:.2f} ms")
        set_two_stage(store, *default)
        result["curve"] = curve
        return result
    finally:
        store.close()


def goals(results: dict) -> list[dict]:
    out = []
    for dataset, r in results.items():
        gap = r["recall_full"] - r["recall_two_stage"]
        out.append(
            {
                "goal": f"{dataset}: two-stage recall@10 within {GOAL_RECALL_GAP} of the full search's",
                "holds": gap <= GOAL_RECALL_GAP + 1e-12,
                "detail": f"{r['recall_two_stage']:.3f} vs {r['recall_full']:.3f}",
            }
        )
        if "faiss" in r["seconds"]:
            ratio = r["seconds"]["two-stage"] / r["seconds"]["faiss"]
            out.append(
                {
                    "goal": f"{dataset}: a two-stage query <= {GOAL_FAISS}x faiss IndexBinaryFlat on one query",
                    "holds": ratio <= GOAL_FAISS,
                    "detail": f"{r['seconds']['two-stage'] * 1e3:.2f} ms vs {r['seconds']['faiss'] * 1e3:.2f} ms "
                    f"= {ratio:.2f}x",
                }
            )
    return out


def report(results: dict, facts: dict, out) -> None:
    print("hmem two-stage search benchmark (scripts/bench_two_stage.py)", file=out)
    for key, value in facts.items():
        print(f"  {key:17} {value}", file=out)
    print(file=out)
    print(
        "| data | entries | unrelated cosine | recall@10 full | recall@10 two-stage | recall@10 auto "
        "| query, full | query, two-stage | faiss, one query | two-stage / faiss |",
        file=out,
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", file=out)
    for dataset, r in results.items():
        s = r["seconds"]
        faiss_s = s.get("faiss")
        print(
            f"| {dataset} | {r['entries']:,} | {r['unrelated_cosine']:.2f} | {r['recall_full']:.3f} "
            f"| {r['recall_two_stage']:.3f} | {r['recall_auto']:.3f} | {s['full'] * 1e3:.2f} ms "
            f"| {s['two-stage'] * 1e3:.2f} ms | "
            + ("n/a | n/a |" if faiss_s is None else f"{faiss_s * 1e3:.2f} ms | {s['two-stage'] / faiss_s:.2f}x |"),
            file=out,
        )
    print(file=out)
    for dataset, r in results.items():
        print(
            f"speed/recall of the two-stage search, {dataset} (prefix bytes x survivors per shortlist place):", file=out
        )
        print("| prefix | survivors | recall@10 | query |", file=out)
        print("|---:|---:|---:|---:|", file=out)
        for c in r["curve"]:
            print(
                f"| {c['prefix_bytes']} B | {c['survivors_per_place']} x 40 | {c['recall']:.3f} "
                f"| {c['seconds'] * 1e3:.2f} ms |",
                file=out,
            )
        print(file=out)
    benchlib.print_goals(goals(results), out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=1_000_000, metavar="N", help="entries per store (default 1,000,000)")
    p.add_argument("--dim", type=int, default=64, metavar="D", help="embed_dim (default 64)")
    p.add_argument("--queries", type=int, default=200, metavar="N", help="queries (default 200)")
    p.add_argument(
        "--root",
        default="/tmp/hmem-bench-two-stage",
        metavar="PATH",
        help="where the stores are built once and reused (default /tmp/hmem-bench-two-stage)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if args.entries < 1000 or args.dim < 1 or args.queries < 1:
        p.error("--entries must be >= 1000, --dim and --queries >= 1")
    if not benchlib.native_kernels():
        return 2
    log = benchlib.log

    facts = benchlib.machine_facts()
    facts["faiss"] = (
        "not importable" if faiss is None else f"{faiss.__version__}, {faiss.omp_get_max_threads()} threads"
    )
    facts["hmem scan threads"] = str(hmem.threads.cores())
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results = {dataset: run_dataset(root, dataset, args, log) for dataset in DATASETS}
    report(results, facts, sys.stdout)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": facts, "results": results, "goals": goals(results)}, indent=2)
        )
    return 0 if all(g["holds"] for g in goals(results)) else 1


if __name__ == "__main__":
    sys.exit(main())
