"""Span signatures: finding an entry from a few of its tokens, against
today's mean pooling, on one layer of 100,000 entries.

    python scripts/bench_span_retrieval.py                     # 100,000 entries, S = 8, both layouts (~7 min)
    python scripts/bench_span_retrieval.py --entries 20000 --spans 4,8,16 --layouts overlapping
    python scripts/bench_span_retrieval.py --dir /tmp/hmem-spans   # keep the stores there (removed otherwise)
    python scripts/bench_span_retrieval.py --exact-only             # the data's exact bound, no store
    python scripts/bench_span_retrieval.py --topic 0.4 --sent 0.4   # the earlier default data (see below)

Data: keys with the structure of real transformer keys, generated in the
script (KeyGen below, seeded): a large shared component (unrelated entries'
mean-pooled keys have cosine ~0.8, printed as "random-pair cosine"), a
first row per entry that is an outlier "attention sink" (--sink times the
norm of the shared component), a topic per entry (--topics) shared by its
sentences, sentences of ~20 tokens each made of three concepts of the topic,
a vocabulary identity vector per token (--vocab, weight --tok) and small
per-token noise (--noise).  Entries have 64-256 tokens of --dim floats.
The default weights (--topic 0.5, --sent 0.2) make data like the keys
measured on a real transformer (the issue "Retrieval beyond the mean"):
random entries' mean keys at cosine ~0.80, and exact mean pooling finding
a one-sentence query's entry in the top 10 about a third of the time (the
real keys: 11-35% by layer).  The earlier default (--topic 0.4 --sent 0.4)
gives entry-level structure that mean pooling keeps better (cosine ~0.84,
found@10 ~0.57).
The values stored are the keys again (they are not measured; generating
others would only cost time).  Every store gets exactly the same entries:
each batch of --batch entries is generated once and put into every store.
Stores are created with storage_dtype "bf16" (half the disk of f32; the
same for every store) and hdc_dim 4096, under a temporary directory unless
--dir is given.

Stores ("modes"), one layer each:

- mean (today): signatures_per_entry=1, default search ("auto": the
  two-stage scan on a layer of >= 100,000 entries, the full scan below),
  re-rank by the cosine of mean-pooled keys;
- spans S=8, overlapping / disjoint: signatures_per_entry=8 (the mean plus
  7 spans) with each span_layout (--layouts), default search ("auto" =
  "spans": an entry ranked by its best span signature, re-ranked by the max
  cosine over its mean and span keys); --spans picks the S values;
- S=8, search=two-stage (full below 100,000 entries): the same store
  queried by mean pooling with the scan "auto" takes without spans (a sanity row:
  it should match mean (today)).

Queries (--queries, 300 by default; their source entries spread over the
store), each re-drawn from the entry's latent rows with fresh noise, never
copied from the stored keys:

- span queries: 8-32 consecutive tokens of the entry (never its sink row 0);
- full-entry queries: the whole entry (sink row included).

Per mode: found@1 / found@10 (the fraction of queries whose source entry
is first / among the top 10 results of query(top_k=10)), disk bytes per
entry (every file in the store directory / entries), and the latency of
one query call (top_k=10, count_access=False) on a span query: after a
warm-up pass (the found@ pass), modes taking turns on each query, median
over the span queries; gc off.

Goals: span-query found@10 >= 2x mean pooling's, query time <= 3x
today's, disk <= 1.5x today's, and full-entry queries lose nothing
(found@1 and found@10 no lower than mean pooling's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import numpy as np

import hmem
from hmem.store.projection import span_bounds

HDC_DIM = 4096
TOP_K = 10
STORAGE_DTYPE = "bf16"
SPAN_QUERY_TOKENS = (8, 32)
PAIRS = 4000
GOAL_FOUND = 2.0
GOAL_TIME = 3.0
GOAL_DISK = 1.5


class KeyGen:
    """Vectorised generator of keys with the structure of real ones."""

    def __init__(
        self,
        d=64,
        topics=10,
        concepts=1000,
        seed=0,
        shared=1.0,
        topic=0.5,
        sent=0.2,
        noise=0.7,
        sink=6.0,
        per_sent=3,
        vocab=50000,
        tok=0.7,
        sentence_tokens=20,
        min_tokens=64,
        max_tokens=256,
    ):
        r = np.random.default_rng(seed)
        self.r, self.d = r, d

        def unit(n):
            x = r.standard_normal((n, d))
            return x / np.linalg.norm(x, axis=-1, keepdims=True)

        self.mu = unit(1)[0] * shared
        self.topics = unit(topics) * topic
        self.concepts = unit(concepts)
        self.sink = unit(1)[0] * sink
        self.sent, self.noise, self.per_sent = sent, noise, per_sent
        self.p_new = 1.0 / sentence_tokens
        self.vocab = (unit(vocab) * tok).astype(np.float32) if vocab else None
        self.min_tokens, self.max_tokens = min_tokens, max_tokens

    def latents(self, count):
        """(token counts, entry starts (count + 1), latent rows): every row's
        shared + topic + sentence (+ token identity) part, without noise."""
        r = self.r
        n = r.integers(self.min_tokens, self.max_tokens + 1, count)
        topic = r.integers(0, len(self.topics), count)
        starts = np.concatenate([[0], np.cumsum(n)])
        total = int(starts[-1])
        new = r.random(total) < self.p_new  # a sentence begins here
        new[starts[:-1]] = True
        sid = np.cumsum(new) - 1
        owner = np.repeat(np.arange(count), n)
        n_sent = int(sid[-1]) + 1
        share = len(self.concepts) // len(self.topics)
        sent_topic = topic[owner[new]]
        c = (r.integers(0, share * 4, (n_sent, self.per_sent)) + sent_topic[:, None] * share) % len(self.concepts)
        s = self.concepts[c].sum(1)
        s *= self.sent / np.linalg.norm(s, axis=1, keepdims=True)
        base = ((self.mu + self.topics[topic])[owner] + s[sid]).astype(np.float32)
        if self.vocab is not None:
            base += self.vocab[r.integers(0, len(self.vocab), total)]
        return n, starts, base

    def draw(self, base, sink_rows=None):
        """Rows: the latent rows plus fresh token noise; rows `sink_rows` (the
        first of each entry) are replaced by the attention sink."""
        x = base + self.r.standard_normal(base.shape, dtype=np.float32) * np.float32(self.noise / np.sqrt(self.d))
        if sink_rows is not None and len(sink_rows):
            x[sink_rows] = self.sink + self.r.standard_normal((len(sink_rows), self.d)) * 0.5 / np.sqrt(self.d)
        return x


def directory_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


VARIANT_SPANS = 7  # the spans of signatures_per_entry = 8
SINK_FACTOR = 3.0  # a query's first row counts as a sink when its norm passes 3 x the median row norm
VARIANTS = (  # name, pooled keys, layer mean removed, span layout (None: the mean alone)
    ("mean", "all", False, None),
    ("mean, layer mean removed", "all", True, None),
    ("mean, sink row left out", "no sink", False, None),
    ("disjoint spans", "all", False, "disjoint"),
    ("disjoint spans, layer mean removed", "all", True, "disjoint"),
    ("disjoint spans, sink row left out (before)", "no sink", False, "disjoint"),
    ("overlapping spans", "all", False, "overlapping"),
    ("overlapping spans, sink row left out (the store)", "no sink", False, "overlapping"),
)
LAYOUTS = ("disjoint", "overlapping")


class Pooled:
    """Every entry's pooled keys (its mean and span means in each layout,
    with and without its first, "sink", row) for the exact variants of
    --variants: what scoring every entry in float64 finds, with no
    signatures and no shortlist."""

    def __init__(self, count: int, dim: int, spans: int) -> None:
        self.spans = spans
        self.lengths = {kind: np.zeros(count, dtype=np.int64) for kind in ("all", "no sink")}
        self.keys = {
            (kind, layout): np.zeros((count, spans + 1, dim), dtype=np.float32)
            for kind in ("all", "no sink")
            for layout in LAYOUTS
        }

    def add(self, first: int, rows: np.ndarray, starts: np.ndarray) -> None:
        total = np.zeros((len(rows) + 1, rows.shape[1]))
        np.cumsum(rows, axis=0, dtype=np.float64, out=total[1:])  # the sum of rows a..b-1 is total[b] - total[a]
        for kind, skip in (("all", 0), ("no sink", 1)):
            lo, end = starts[:-1] + skip, starts[1:]
            count = len(lo)
            self.lengths[kind][first : first + count] = end - lo
            local = np.concatenate([[0], np.cumsum(end - lo)])
            for layout in LAYOUTS:
                a, b = span_bounds(local, self.spans, layout=layout)
                a, b = a - local[:-1, None] + lo[:, None], b - local[:-1, None] + lo[:, None]
                block = self.keys[(kind, layout)][first : first + count]
                block[:, 0] = (total[end] - total[lo]) / (end - lo)[:, None]
                block[:, 1:] = (total[b] - total[a]) / (b - a)[:, :, None]

    def variants(
        self,
        span_q: list[np.ndarray],
        full_q: list[np.ndarray],
        targets: np.ndarray,
        names: tuple[str, ...] | None = None,
    ) -> list[dict]:
        """found@1 and @10 of each exact variant (those named, or all), for
        the span and the full-entry queries."""
        out = []
        for name, kind, centred, spans in VARIANTS:
            if names is not None and name not in names:
                continue
            keys = self.keys[(kind, spans or "disjoint")].astype(np.float64)
            centre = keys[:, 0].mean(axis=0) if centred else np.zeros(keys.shape[2])
            keys -= centre
            keys /= np.maximum(np.linalg.norm(keys, axis=2, keepdims=True), 1e-30)
            local = np.concatenate([[0], np.cumsum(self.lengths[kind])])
            a, b = span_bounds(local, self.spans, layout=spans or "disjoint")
            width = b - a  # tokens of each span [entries, spans]
            flat = keys.reshape(-1, keys.shape[2])
            row: dict = {"variant": name}
            for label, queries in (("span", span_q), ("full", full_q)):
                vectors, lengths = [], []
                for q in queries:
                    q = q.astype(np.float64)
                    norms = np.linalg.norm(q, axis=1)
                    if kind == "no sink" and len(q) > 1 and norms[0] > SINK_FACTOR * np.median(norms):
                        q = q[1:]
                    v = q.mean(axis=0) - centre
                    vectors.append(v / np.linalg.norm(v))
                    lengths.append(len(q))
                ranks = []
                for lo in range(0, len(vectors), 32):  # 32 queries at a time: one matrix product each
                    v = np.array(vectors[lo : lo + 32])
                    if spans:  # as the store: the mean and the spans of at least half the query's tokens
                        scores = (flat @ v.T).T.reshape(len(v), *keys.shape[:2])
                        held = width[None] >= 0.5 * np.array(lengths[lo : lo + 32])[:, None, None]
                        scores[:, :, 1:] = np.where(held, scores[:, :, 1:], -np.inf)
                        score = scores.max(axis=2)
                    else:
                        score = (keys[:, 0] @ v.T).T
                    mine = score[np.arange(len(v)), targets[lo : lo + 32]]
                    ranks.append(np.sum(score > mine[:, None], axis=1))
                rank = np.concatenate(ranks)
                row[f"{label}_found1"] = float(np.mean(rank < 1))
                row[f"{label}_found10"] = float(np.mean(rank < 10))
            out.append(row)
        return out


def build(root: Path, args, span_values: list[int], log):
    """Create one store per S, put the same entries into all; returns
    (paths, ids of the query entries per S, span queries, full queries,
    random-pair cosine, seconds of put_many+flush per S)."""
    gen = KeyGen(
        d=args.dim,
        vocab=args.vocab,
        tok=args.tok,
        noise=args.noise,
        sent=args.sent,
        topics=args.topics,
        topic=args.topic,
        sink=args.sink,
        seed=args.seed,
    )
    pick = np.random.default_rng(args.seed + 1)
    targets = np.sort(pick.choice(args.entries, args.queries, replace=False))
    wanted = {int(t): i for i, t in enumerate(targets)}
    latent: list[np.ndarray | None] = [None] * args.queries
    pair_entries = pick.integers(0, args.entries, (PAIRS, 2))
    pair_entries = pair_entries[pair_entries[:, 0] != pair_entries[:, 1]]
    pair_set = np.unique(pair_entries)
    pair_means: dict[int, np.ndarray] = {}

    pooled = Pooled(args.entries, args.dim, VARIANT_SPANS) if args.variants else None
    paths = {s: root / f"spans-{s[0]}-{s[1]}" for s in span_values}
    stores = {
        s: hmem.Store.create(
            paths[s],
            embed_dim=args.dim,
            hdc_dim=HDC_DIM,
            signatures_per_entry=s[0],
            span_layout=s[1],
            storage_dtype=STORAGE_DTYPE,
        )
        for s in span_values
    }
    ids = {s: np.zeros(args.entries, dtype=np.int64) for s in span_values}
    put_seconds = dict.fromkeys(span_values, 0.0)
    t_start = time.perf_counter()
    try:
        for lo in range(0, args.entries, args.batch):
            count = min(args.batch, args.entries - lo)
            n, starts, base = gen.latents(count)
            rows = gen.draw(base, starts[:-1])
            means = np.add.reduceat(rows, starts[:-1], axis=0, dtype=np.float64) / n[:, None]
            for e in pair_set[(pair_set >= lo) & (pair_set < lo + count)]:
                pair_means[int(e)] = means[e - lo]
            for t in targets[(targets >= lo) & (targets < lo + count)]:
                i = int(t) - lo
                latent[wanted[int(t)]] = base[starts[i] : starts[i + 1]].copy()
            if pooled is not None:
                pooled.add(lo, rows, starts)
            entries = (
                [hmem.Entry(rows[starts[i] : starts[i + 1]], rows[starts[i] : starts[i + 1]], 0) for i in range(count)]
                if stores
                else []
            )
            for s, store in stores.items():
                t0 = time.perf_counter()
                ids[s][lo : lo + count] = store.put_many(entries)
                store.flush()
                put_seconds[s] += time.perf_counter() - t0
            done = lo + count
            log(f"  {done:,} / {args.entries:,} entries put ({time.perf_counter() - t_start:.0f} s)")
    finally:
        for store in stores.values():
            store.close()

    a = np.stack([pair_means[int(e)] for e in pair_entries[:, 0]])
    b = np.stack([pair_means[int(e)] for e in pair_entries[:, 1]])
    cosine = float(np.mean(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))

    # queries: re-drawn from the latent rows with fresh noise (same RNG stream, after the build)
    rq = np.random.default_rng(args.seed + 2)
    span_queries, full_queries = [], []
    for base in latent:
        assert base is not None
        length = int(rq.integers(SPAN_QUERY_TOKENS[0], SPAN_QUERY_TOKENS[1] + 1))
        start = int(rq.integers(1, len(base) - length + 1))  # never row 0, the sink
        span_queries.append(np.ascontiguousarray(gen.draw(base[start : start + length])))
        full_queries.append(np.ascontiguousarray(gen.draw(base, np.array([0]))))
    target_ids = {s: ids[s][targets] for s in span_values}
    return paths, target_ids, span_queries, full_queries, cosine, put_seconds, (pooled, targets)


EXACT_ONLY = ("mean", "disjoint spans, sink row left out (before)", "overlapping spans, sink row left out (the store)")


def run_exact(root: Path, args, log) -> dict:
    """--exact-only: the data and queries of a run, scored exactly for mean
    pooling and for the spans the store cuts (S = 8), no store built."""
    args.variants = True
    log(f"generating {args.entries:,} entries and scoring them exactly (no store) ...")
    _, _, span_q, full_q, cosine, _, (pooled, targets) = build(root, args, [], log)
    return {"random_pair_cosine": cosine, "variants": pooled.variants(span_q, full_q, targets, EXACT_ONLY)}


def found(store, queries, target_ids, search: str) -> tuple[float, float]:
    at1 = at10 = 0
    for q, want in zip(queries, target_ids):
        got = [r.entry_id for r in store.query(q, 0, top_k=TOP_K, count_access=False, search=search)]
        if got and got[0] == want:
            at1 += 1
        if want in got:
            at10 += 1
    return at1 / len(queries), at10 / len(queries)


def time_rounds(cases: dict, queries: list[np.ndarray]) -> dict[str, float]:
    """Median seconds of one query call per case, the cases taking turns
    on each query (the found@ pass before this was the warm-up)."""

    def call(store, search: str):
        return lambda i: store.query(queries[i], 0, top_k=TOP_K, count_access=False, search=search)

    return benchlib.medians_in_turns(
        {name: call(store, search) for name, (store, search) in cases.items()}, len(queries)
    )


def run(root: Path, args, span_values: list[int], layouts: list[str], log) -> tuple[list[dict], dict]:
    stores_s = [(1, "overlapping")] + [(s, layout) for s in span_values for layout in layouts]
    log(
        f"building {len(stores_s)} stores of {args.entries:,} entries "
        f"({', '.join(f'S = {s}' + (f' {layout}' if s > 1 else '') for s, layout in stores_s)}) under {root} ..."
    )
    t0 = time.perf_counter()
    paths, target_ids, span_q, full_q, cosine, put_seconds, (pooled, targets) = build(root, args, stores_s, log)
    log(f"  built in {time.perf_counter() - t0:.0f} s")

    modes = [("mean (today)", (1, "overlapping"), "auto")]
    for key in stores_s[1:]:
        modes.append((f"spans S={key[0]}, {key[1]}", key, "auto"))
    for key in stores_s[1:]:
        if key[1] == layouts[0]:
            # the scan "auto" takes on a store without spans: two stages from 100,000 entries
            mean_search = "two-stage" if args.entries >= 100_000 else "full"
            modes.append((f"S={key[0]}, search={mean_search}", key, mean_search))
    opened = {key: hmem.Store.open(paths[key], read_only=True) for key in stores_s}
    try:
        rows = []
        for name, key, search in modes:
            log(f"{name}: found@1/@10 of {len(span_q)} span and {len(full_q)} full-entry queries ...")
            store = opened[key]
            span1, span10 = found(store, span_q, target_ids[key], search)
            full1, full10 = found(store, full_q, target_ids[key], search)
            rows.append(
                {
                    "mode": name,
                    "signatures_per_entry": key[0],
                    "span_layout": key[1],
                    "search": search,
                    "span_found1": span1,
                    "span_found10": span10,
                    "full_found1": full1,
                    "full_found10": full10,
                    "disk_bytes_per_entry": directory_bytes(paths[key]) / args.entries,
                    "put_seconds": put_seconds[key],
                }
            )
        log(f"timing {len(modes)} modes over {len(span_q)} span queries ...")
        seconds = time_rounds(
            {r["mode"]: (opened[(r["signatures_per_entry"], r["span_layout"])], r["search"]) for r in rows}, span_q
        )
        for r in rows:
            r["query_seconds"] = seconds[r["mode"]]
    finally:
        for store in opened.values():
            store.close()
    extra: dict = {"random_pair_cosine": cosine}
    if pooled is not None:
        log("exact variants (numpy, every entry scored) ...")
        extra["variants"] = pooled.variants(span_q, full_q, targets)
    return rows, extra


def goals(rows: list[dict]) -> list[dict]:
    base = rows[0]
    out = []
    for r in rows[1:]:
        if r["search"] != "auto":
            continue
        m = r["mode"]
        f = r["span_found10"] / base["span_found10"] if base["span_found10"] else float("inf")
        out.append(
            {
                "goal": f"{m}: span-query found@10 >= {GOAL_FOUND}x mean pooling's",
                "holds": f >= GOAL_FOUND,
                "detail": f"{r['span_found10']:.3f} vs {base['span_found10']:.3f} = {f:.2f}x",
            }
        )
        t = r["query_seconds"] / base["query_seconds"]
        out.append(
            {
                "goal": f"{m}: query time <= {GOAL_TIME}x today's",
                "holds": t <= GOAL_TIME,
                "detail": f"{r['query_seconds'] * 1e3:.2f} ms vs {base['query_seconds'] * 1e3:.2f} ms = {t:.2f}x",
            }
        )
        d = r["disk_bytes_per_entry"] / base["disk_bytes_per_entry"]
        out.append(
            {
                "goal": f"{m}: disk <= {GOAL_DISK}x today's",
                "holds": d <= GOAL_DISK,
                "detail": f"{r['disk_bytes_per_entry']:,.0f} B vs {base['disk_bytes_per_entry']:,.0f} B "
                f"per entry = {d:.2f}x",
            }
        )
        keep = r["full_found1"] >= base["full_found1"] and r["full_found10"] >= base["full_found10"]
        out.append(
            {
                "goal": f"{m}: full-entry queries lose nothing (found@1 and @10 >= mean pooling's)",
                "holds": keep,
                "detail": f"@1 {r['full_found1']:.3f} vs {base['full_found1']:.3f}, "
                f"@10 {r['full_found10']:.3f} vs {base['full_found10']:.3f}",
            }
        )
    return out


def report(rows: list[dict], facts: dict, out) -> None:
    print("hmem span-retrieval benchmark (scripts/bench_span_retrieval.py)", file=out)
    for key, value in facts.items():
        print(f"  {key:19} {value}", file=out)
    print(file=out)
    base = rows[0]
    print(
        "| mode | span found@1 | span found@10 | full found@1 | full found@10 | disk / entry | query (span) "
        "| found@10 vs mean | query vs mean | disk vs mean |",
        file=out,
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", file=out)
    for r in rows:
        f = r["span_found10"] / base["span_found10"] if base["span_found10"] else float("inf")
        print(
            f"| {r['mode']} | {r['span_found1']:.3f} | {r['span_found10']:.3f} | {r['full_found1']:.3f} "
            f"| {r['full_found10']:.3f} | {r['disk_bytes_per_entry']:,.0f} B "
            f"| {r['query_seconds'] * 1e3:.2f} ms | {f:.2f}x | {r['query_seconds'] / base['query_seconds']:.2f}x "
            f"| {r['disk_bytes_per_entry'] / base['disk_bytes_per_entry']:.2f}x |",
            file=out,
        )
    print(file=out)
    benchlib.print_goals(goals(rows), out)


def print_variants(variants: list[dict]) -> None:
    print("\nExact variants (every entry scored in float64 by its pooled keys; no signatures, no shortlist):\n")
    print("| variant | span found@1 | span found@10 | full found@1 | full found@10 |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        print(
            f"| {v['variant']} | {v['span_found1']:.3f} | {v['span_found10']:.3f} | {v['full_found1']:.3f} "
            f"| {v['full_found10']:.3f} |"
        )


def add_key_options(p: argparse.ArgumentParser) -> None:
    """The options of the generated keys' structure (KeyGen's weights),
    shared with the benchmarks that generate keys the same way."""
    p.add_argument("--dim", type=int, default=64, metavar="D", help="embed_dim (default 64)")
    p.add_argument("--vocab", type=int, default=50000, help="token identity vectors (default 50000)")
    p.add_argument("--tok", type=float, default=0.7, help="norm of a token's identity vector (default 0.7)")
    p.add_argument("--noise", type=float, default=0.7, help="norm of a token's noise (default 0.7)")
    p.add_argument("--sent", type=float, default=0.2, help="norm of a sentence's vector (default 0.2)")
    p.add_argument("--topics", type=int, default=10, help="topics (default 10)")
    p.add_argument("--topic", type=float, default=0.5, help="norm of a topic's vector (default 0.5)")
    p.add_argument(
        "--sink", type=float, default=6.0, help="norm of the sink row, the shared component's being 1 (default 6)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data (default 0)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=100_000, metavar="N", help="entries per store (default 100,000)")
    p.add_argument(
        "--spans",
        default="8",
        metavar="S[,S...]",
        help="signatures_per_entry of the span stores, comma-separated (default 8)",
    )
    p.add_argument(
        "--layouts",
        default="overlapping,disjoint",
        metavar="L[,L...]",
        help="span_layout of the span stores: a store per S and layout (default overlapping,disjoint)",
    )
    p.add_argument("--queries", type=int, default=300, metavar="N", help="queries of each kind (default 300)")
    p.add_argument("--batch", type=int, default=5000, metavar="N", help="entries per put_many (default 5000)")
    p.add_argument(
        "--dir",
        metavar="PATH",
        help="build the stores here (an empty or missing directory) and keep them; "
        "default: a temporary directory, removed at the end",
    )
    add_key_options(p)
    p.add_argument(
        "--variants",
        action="store_true",
        help="also score every entry exactly (numpy) for mean pooling and spans (S = 8, both layouts), "
        "each as is, with the layer's mean key removed and with the sink row left out "
        "(~1 min, ~2 GB more)",
    )
    p.add_argument(
        "--exact-only",
        action="store_true",
        help="build no store: score the data exactly (numpy, every entry, no signatures) by mean pooling "
        "and by the spans of S = 8 in both layouts, the sink row left out, as the store cuts them: what "
        "any mode "
        "can reach on this data (~1.5 min at 100,000 entries)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    try:
        span_values = sorted({int(s) for s in args.spans.split(",") if s.strip()})
    except ValueError:
        p.error("--spans takes integers, e.g. 4,8,16")
    if not span_values or any(s < 2 or s > 64 for s in span_values):
        p.error("--spans takes values from 2 to 64")
    if args.entries < 1000 or args.queries < 1 or args.queries > args.entries or args.batch < 1:
        p.error("--entries must be >= 1000, --queries from 1 to --entries, --batch >= 1")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or any(x not in ("overlapping", "disjoint") for x in layouts):
        p.error("--layouts takes overlapping and/or disjoint")
    if not benchlib.native_kernels():
        return 2
    log = benchlib.log

    facts = benchlib.machine_facts()
    facts["hmem scan threads"] = str(hmem.threads.cores())
    facts["entries"] = f"{args.entries:,} (one layer, {args.dim} floats per token, 64-256 tokens per entry)"
    facts["store"] = f"hdc_dim {HDC_DIM}, storage_dtype {STORAGE_DTYPE}, values = keys"
    facts["data"] = (
        f"vocab {args.vocab}, tok {args.tok}, noise {args.noise}, sent {args.sent}, "
        f"topics {args.topics}, topic {args.topic}, sink {args.sink}, seed {args.seed}"
    )
    facts["queries"] = (
        f"{args.queries} span ({SPAN_QUERY_TOKENS[0]}-{SPAN_QUERY_TOKENS[1]} tokens) + "
        f"{args.queries} full-entry, top_k {TOP_K}"
    )
    if args.exact_only:
        extra = run_exact(Path(tempfile.gettempdir()), args, log)
        print("hmem span-retrieval benchmark (scripts/bench_span_retrieval.py), exact scores only", file=sys.stdout)
        facts["random-pair cosine"] = f"{extra['random_pair_cosine']:.3f} (mean-pooled keys, {PAIRS} random pairs)"
        for key, value in facts.items():
            print(f"  {key:19} {value}")
        print_variants(extra["variants"])
        mean, *spans = extra["variants"]
        ratio = {}
        for v in spans:
            ratio[v["variant"]] = v["span_found10"] / mean["span_found10"] if mean["span_found10"] else float("inf")
            print(
                f"\nspan found@10, {v['variant']} / mean pooling: {ratio[v['variant']]:.2f}x (the goal: {GOAL_FOUND}x)"
            )
        if args.json:
            Path(args.json).write_text(
                json.dumps({"machine": facts, "variants": extra["variants"], "ratio": ratio}, indent=2)
            )
        return 0
    if args.dir:
        root = Path(args.dir)
        if root.exists() and any(root.iterdir()):
            p.error(f"{root} is not empty")
        root.mkdir(parents=True, exist_ok=True)
        rows, extra = run(root, args, span_values, layouts, log)
    else:
        with tempfile.TemporaryDirectory(prefix="hmem-bench-spans-") as tmp:
            rows, extra = run(Path(tmp), args, span_values, layouts, log)
    facts["random-pair cosine"] = f"{extra['random_pair_cosine']:.3f} (mean-pooled keys, {PAIRS} random pairs)"
    report(rows, facts, sys.stdout)
    if "variants" in extra:
        print_variants(extra["variants"])
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": facts, "results": rows, "goals": goals(rows), "variants": extra.get("variants", [])},
                indent=2,
            )
        )
    return 0 if all(g["holds"] for g in goals(rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
