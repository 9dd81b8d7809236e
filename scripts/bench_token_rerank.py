"""Token re-rank: finding a document's next chunk, and the entry that holds
a few tokens, by token-level max-sim over the stored keys, against mean
pooling and span signatures, on one layer of 20,000 entries.

    python scripts/bench_token_rerank.py                              # 20,000 entries, N = 10,20,40 (~4 min)
    python scripts/bench_token_rerank.py --entries 2000 --queries 50  # a quick run (~15 s)
    python scripts/bench_token_rerank.py --token-n 40,80 --dir /tmp/hmem-tokens   # keep the stores there
    python scripts/bench_token_rerank.py --exact-only                 # the data's exact figures, no store

Data: documents of 4-8 consecutive chunks of 64-256 tokens, a chunk an
entry; a document's last chunk is held out, the others stored (the last
document is cut short to store exactly --entries).  Keys have the
structure of real ones (DocGen, seeded), as in bench_span_retrieval.py: a
large shared component (random entries' mean-pooled keys at cosine ~0.8,
the "random-pair cosine" printed), a "sink" first row per chunk, a topic
per document, sentences of ~20 tokens made of three concepts of the topic
(running on across chunks), a word identity vector per token and token
noise.  What this adds is what real text does and mean pooling washes
out: a document repeats its own terms (names, entities), --doc-terms
words, a Zipf-weighted few of them frequent, which a token is with
probability --term-p; other tokens are general words, Zipf-distributed
over the --vocab words, so common ones recur in every entry.  Only one
figure was tuned: exact mean pooling finds a held-out chunk's document in
its top 10 0.56-0.61 of the time (seeds 0-2), as on real keys (~0.59);
max-sim is reported as it comes.  Values stored are the keys again.

Queries (--queries of each kind), re-drawn from latent rows with fresh
noise, never copied from the stored keys: next chunk, a document's
held-out last chunk, whole (sink row first), a hit being any result from
that document; short, 8-32 consecutive tokens of a stored entry (never
its sink row 0), a hit being that entry.

Modes, on one layer of two stores (storage_dtype "bf16", hdc_dim 4096,
under a temporary directory unless --dir is given): mean (today),
signatures_per_entry=1; spans, signatures_per_entry=8 (overlapping
windows); spans + tokens N, for each N of --token-n, the span store queried
with token_rerank=N (its best N candidates re-ranked by max-sim: per query
token the best cosine over the candidate's stored key rows, averaged); and
mean + tokens N, the mean store likewise (for comparison; no goals).  Per
mode: found@1 / found@10 of query(top_k=10), the median seconds of a query
call (count_access=False; after the found@ pass, modes taking turns on
each query, gc off), for each kind, and disk bytes per entry (a token mode
reads its store's keys: its disk is the store's).  The exact figures score
every entry, no signature, no shortlist: mean pooling (float64), and
max-sim, over every query (or the first --exact-queries: max-sim costs
~0.5 s per next-chunk query at 20,000 entries).

Goals, for each spans + tokens N: next-chunk found@10 >= 1.25x mean
pooling's; short-query found@10 no lower than spans'; query time <= 3x
spans' (both kinds); disk <= 1.5x the span store's.  Exit status 0 when
every goal holds for some N.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import benchlib
import numpy as np
from bench_span_retrieval import add_key_options, directory_bytes

import hmem

HDC_DIM = 4096
TOP_K = 10
STORAGE_DTYPE = "bf16"
SPANS = 8
CHUNKS = (4, 8)  # chunks per document, the last held out
CHUNK_TOKENS = (64, 256)
SHORT_TOKENS = (8, 32)
PAIRS = 4000
FOUND = ("next_found1", "next_found10", "short_found1", "short_found10")
GOAL_FOUND = 1.25
GOAL_TIME = 3.0
GOAL_DISK = 1.5


class DocGen:
    """Vectorised generator of documents' keys with the structure of real ones."""

    def __init__(self, args, shared=1.0, concepts=1000, per_sent=3, sentence_tokens=20):
        self.r = r = np.random.default_rng(args.seed)
        self.a, self.d = args, args.dim  # the data options (--tok, --noise, ...) and the row width

        def unit(n):
            x = r.standard_normal((n, self.d))
            return x / np.linalg.norm(x, axis=1, keepdims=True)

        self.mu = unit(1)[0] * shared
        self.topics = unit(args.topics) * args.topic
        self.concepts = unit(concepts)
        self.sink = unit(1)[0] * args.sink
        self.vocab = (unit(args.vocab) * args.tok).astype(np.float32)
        # cumulative weights 1/rank: the word frequencies of text (Zipf's law)
        self.vocab_cdf, self.term_cdf = (np.cumsum(1.0 / np.arange(1, n + 1)) for n in (args.vocab, args.doc_terms))
        self.per_sent, self.p_new = per_sent, 1.0 / sentence_tokens

    def plan(self, entries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Documents until `entries` chunks are stored: each chunk's document,
        whether it is held out (its document's last) and its token count."""
        r = self.r
        counts = r.integers(CHUNKS[0], CHUNKS[1] + 1, entries // (CHUNKS[0] - 1) + 1)
        stored = np.cumsum(counts - 1)
        docs = int(np.searchsorted(stored, entries)) + 1
        counts = counts[:docs]
        counts[-1] -= stored[docs - 1] - entries  # the last document cut short
        doc = np.repeat(np.arange(docs), counts)
        held = np.zeros(len(doc), dtype=bool)
        held[np.cumsum(counts) - 1] = True
        # terms drawn uniformly from the vocabulary are rare words, as names are
        self.doc_topic = r.integers(0, len(self.topics), docs)
        self.terms = r.integers(0, len(self.vocab), (docs, self.a.doc_terms))
        return doc, held, r.integers(CHUNK_TOKENS[0], CHUNK_TOKENS[1] + 1, len(doc))

    def latents(self, doc: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Latent rows (no noise, no sink) of consecutive chunks of whole
        documents: shared + topic + sentence + word identity."""
        r = self.r
        owner = np.repeat(doc, length)
        total = len(owner)
        new = r.random(total) < self.p_new  # a sentence begins here; one runs on into the next chunk
        new[0] = True
        new[1:] |= owner[1:] != owner[:-1]
        sid = np.cumsum(new) - 1
        share = len(self.concepts) // len(self.topics)
        topic = self.doc_topic[owner]
        c = r.integers(0, share * 4, (int(new.sum()), self.per_sent)) + topic[new][:, None] * share
        s = self.concepts[c % len(self.concepts)].sum(1)
        s *= self.a.sent / np.linalg.norm(s, axis=1, keepdims=True)
        word = np.searchsorted(self.vocab_cdf, r.random(total) * self.vocab_cdf[-1], side="right")
        term = r.random(total) < self.a.term_p
        pick = np.searchsorted(self.term_cdf, r.random(int(term.sum())) * self.term_cdf[-1], side="right")
        word[term] = self.terms[owner[term], pick]
        return ((self.mu + self.topics[topic]) + s[sid]).astype(np.float32) + self.vocab[word]

    def draw(self, base: np.ndarray, sink_rows=None) -> np.ndarray:
        """The latent rows plus fresh noise, rows `sink_rows` the attention sink."""
        x = base + self.r.standard_normal(base.shape, dtype=np.float32) * np.float32(self.a.noise / np.sqrt(self.d))
        if sink_rows is not None and len(sink_rows):
            x[sink_rows] = self.sink + self.r.standard_normal((len(sink_rows), self.d)) * 0.5 / np.sqrt(self.d)
        return x


class Data:
    """Generates the entries into `stores`; keeps every stored key (for the
    exact figures), the queries and what each must find."""

    def __init__(self, args, stores: dict, log) -> None:
        gen = DocGen(args)
        doc, held, length = gen.plan(args.entries)
        stored = ~held
        self.doc = doc[stored]  # each stored entry's document
        self.starts = np.concatenate([[0], np.cumsum(length[stored])])
        self.keys = np.empty((int(self.starts[-1]), args.dim), dtype=np.float32)
        self.ids = {name: np.zeros(args.entries, dtype=np.int64) for name in stores}
        pick = np.random.default_rng(args.seed + 1)
        self.next_doc = np.sort(pick.choice(int(doc[-1]) + 1, args.queries, replace=False))
        self.short_entry = np.sort(pick.choice(args.entries, args.queries, replace=False))
        latent: dict[tuple[str, int], np.ndarray] = {}  # the latent rows of each query's source
        wanted = {("next", int(d)) for d in self.next_doc} | {("short", int(e)) for e in self.short_entry}

        entry_of = np.cumsum(stored) - 1
        # batches of whole documents, ~--batch entries each (4.5 stored chunks per document)
        bounds = np.searchsorted(doc, np.arange(0, doc[-1] + 1, max(1, round(args.batch / 4.5))))
        for lo, hi in zip(bounds, [*bounds[1:], len(doc)]):
            starts = np.concatenate([[0], np.cumsum(length[lo:hi])])
            base = gen.latents(doc[lo:hi], length[lo:hi])
            rows = gen.draw(base, starts[:-1])
            entries = []
            for c in range(lo, hi):
                a, b = starts[c - lo], starts[c - lo + 1]
                key = ("short", int(entry_of[c])) if stored[c] else ("next", int(doc[c]))
                if key in wanted:
                    latent[key] = base[a:b].copy()
                if stored[c]:
                    e = key[1]
                    self.keys[self.starts[e] : self.starts[e + 1]] = rows[a:b]
                    entries.append(hmem.Entry(rows[a:b], rows[a:b], 0))
            first = int(entry_of[lo])  # a document's first chunk is always stored
            for name, store in stores.items():
                self.ids[name][first : first + len(entries)] = store.put_many(entries)
                store.flush()
            log(f"  {first + len(entries):,} / {args.entries:,} entries")

        # queries: re-drawn from the latent rows, fresh noise from the generator (cut where rq says)
        rq = np.random.default_rng(args.seed + 2)
        self.next_q = [gen.draw(latent[("next", int(d))], np.array([0])) for d in self.next_doc]
        self.short_q = []
        for e in self.short_entry:
            base = latent[("short", int(e))]
            n = int(rq.integers(SHORT_TOKENS[0], SHORT_TOKENS[1] + 1))
            a = int(rq.integers(1, len(base) - n + 1))  # never row 0, the sink
            self.short_q.append(np.ascontiguousarray(gen.draw(base[a : a + n])))
        self.means = np.add.reduceat(self.keys, self.starts[:-1], axis=0, dtype=np.float64)
        self.means /= np.diff(self.starts)[:, None]
        pairs = pick.integers(0, args.entries, (PAIRS, 2))
        a, b = (unit_rows(self.means[p]) for p in pairs[pairs[:, 0] != pairs[:, 1]].T)
        self.cosine = float(np.mean(np.sum(a * b, axis=1)))

    def hit_rank(self, score: np.ndarray, kind: str, i: int) -> int:
        """Entries scored above the best right answer of query i (found@k: rank < k)."""
        right = self.doc == self.next_doc[i] if kind == "next" else self.short_entry[i]
        return int(np.sum(score > np.max(score[right])))


def ask(store, queries: list[np.ndarray], n: int, i: int):
    """Query i, as every mode asks it (the timing rounds call it with i)."""
    return store.query(queries[i], 0, top_k=TOP_K, count_access=False, token_rerank=n)


def unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)


def found(kind: str, rank: list[int]) -> dict[str, float]:
    """found@1 and found@10 of queries whose first hit ranked `rank` (0: first)."""
    a = np.array(rank)
    return {f"{kind}_found1": float(np.mean(a < 1)), f"{kind}_found10": float(np.mean(a < 10))}


def max_sim(keys: np.ndarray, starts: np.ndarray, queries: list[np.ndarray], block_rows=16384) -> np.ndarray:
    """[queries, entries]: for each query token the best cosine over each
    entry's rows, averaged over the query's tokens (keys: unit rows)."""
    out = np.zeros((len(queries), len(starts) - 1))
    q = [unit_rows(x).astype(np.float32) for x in queries]
    groups: list[list[int]] = [[]]  # queries of <= ~256 rows: one matrix product per group and block
    for i in range(len(q)):
        if groups[-1] and sum(len(q[j]) for j in groups[-1]) + len(q[i]) > 256:
            groups.append([])
        groups[-1].append(i)
    e0 = 0
    while e0 < len(starts) - 1:  # blocks of whole entries; a block's products stay in the caches
        e1 = max(e0 + 1, int(np.searchsorted(starts, starts[e0] + block_rows, side="right")) - 1)
        block, offsets = keys[starts[e0] : starts[e1]], starts[e0:e1] - starts[e0]
        for g in groups:
            best = np.maximum.reduceat(np.concatenate([q[i] for i in g]) @ block.T, offsets, axis=1)
            edges = np.cumsum([0] + [len(q[i]) for i in g])
            out[g, e0:e1] = np.add.reduceat(best, edges[:-1], axis=0) / np.diff(edges)[:, None]
        e0 = e1
    return out


def exact(data: Data, sample: int, log) -> list[dict]:
    """found@1/@10 scoring every entry by mean pooling (float64, every
    query) and by max-sim (float32, the first `sample` of each kind)."""
    means = unit_rows(data.means)
    rows = []
    for name, n in [("mean pooling", len(data.next_q))] + [("max-sim", sample)] * (sample > 0):
        row: dict = {"exact": name, "queries": n}
        for kind, queries in (("next", data.next_q[:n]), ("short", data.short_q[:n])):
            t0 = time.perf_counter()
            if name == "max-sim":
                scores = max_sim(data.keys, data.starts, queries)
                log(f"exact max-sim of {n} {kind} queries: {time.perf_counter() - t0:.0f} s")
            else:
                scores = unit_rows(np.array([q.mean(0, dtype=np.float64) for q in queries])) @ means.T
            row.update(found(kind, [data.hit_rank(s, kind, i) for i, s in enumerate(scores)]))
        rows.append(row)
    return rows


def run_modes(root: Path, args, token_n: list[int], log) -> tuple[Data, list[dict]]:
    paths = {"mean": root / "mean", "spans": root / "spans"}
    same = dict(embed_dim=args.dim, hdc_dim=HDC_DIM, storage_dtype=STORAGE_DTYPE)
    stores = {
        n: hmem.Store.create(p, signatures_per_entry=SPANS if n == "spans" else 1, **same) for n, p in paths.items()
    }
    log(f"generating {args.entries:,} entries into a mean and a span store under {root} ...")
    t0 = time.perf_counter()
    try:
        data = Data(args, stores, log)
    finally:
        for store in stores.values():
            store.close()
    log(f"  built in {time.perf_counter() - t0:.0f} s")

    modes = [("mean (today)", "mean", 0), ("spans", "spans", 0)]
    modes += [(f"{name} + tokens {n}", name, n) for name in ("spans", "mean") for n in token_n]
    opened = {name: hmem.Store.open(path, read_only=True) for name, path in paths.items()}
    rows = []
    try:
        for mode, name, n in modes:
            log(f"{mode}: found@1/@10 ...")
            store, index = opened[name], {int(x): i for i, x in enumerate(data.ids[name])}
            row: dict = {"mode": mode, "store": name, "token_rerank": n}
            for kind, queries in (("next", data.next_q), ("short", data.short_q)):
                rank = []
                for i in range(len(queries)):
                    got = np.array([index[r.entry_id] for r in ask(store, queries, n, i)], dtype=np.int64)
                    hit = data.doc[got] == data.next_doc[i] if kind == "next" else got == data.short_entry[i]
                    rank.append(int(np.argmax(hit)) if hit.any() else TOP_K)
                row.update(found(kind, rank))
            row["disk_bytes_per_entry"] = directory_bytes(paths[name]) / args.entries
            rows.append(row)
        for kind, queries in (("next", data.next_q), ("short", data.short_q)):
            log(f"timing {len(modes)} modes in turns over {len(queries)} {kind} queries ...")
            cases: dict[str, Callable[[int], object]] = {
                r["mode"]: partial(ask, opened[r["store"]], queries, r["token_rerank"]) for r in rows
            }
            for r, seconds in zip(rows, benchlib.medians_in_turns(cases, len(queries)).values()):
                r[f"{kind}_seconds"] = seconds
    finally:
        for store in opened.values():
            store.close()
    return data, rows


def goals(rows: list[dict]) -> list[dict]:
    """The goals of each spans + tokens N, against mean pooling and spans alone."""
    mean, spans = rows[0], rows[1]
    out = []
    for r in (r for r in rows if r["store"] == "spans" and r["token_rerank"]):
        f = r["next_found10"] / mean["next_found10"] if mean["next_found10"] else float("inf")
        t = {k: r[f"{k}_seconds"] / spans[f"{k}_seconds"] for k in ("next", "short")}
        times = (f"{k} {r[f'{k}_seconds'] * 1e3:.2f} vs {spans[f'{k}_seconds'] * 1e3:.2f} ms = {t[k]:.2f}x" for k in t)
        d, disk = r["disk_bytes_per_entry"] / spans["disk_bytes_per_entry"], r["disk_bytes_per_entry"]
        nf, sf = (f"{r[k]:.3f} vs {b[k]:.3f}" for k, b in (("next_found10", mean), ("short_found10", spans)))
        for goal, holds, detail in (
            (f"next-chunk found@10 >= {GOAL_FOUND}x mean pooling's", f >= GOAL_FOUND, f"{nf} = {f:.2f}x"),
            ("short-query found@10 no lower than spans'", r["short_found10"] >= spans["short_found10"], sf),
            (f"query time <= {GOAL_TIME}x spans'", max(t.values()) <= GOAL_TIME, ", ".join(times)),
            (f"disk <= {GOAL_DISK}x the span store's", d <= GOAL_DISK, f"{disk:,.0f} B per entry = {d:.2f}x"),
        ):
            out.append({"goal": f"{r['mode']}: {goal}", "holds": bool(holds), "detail": detail})
    return out


def table(title: str, columns: list[str], lines: list[list[str]]) -> None:
    print(f"\n{title}\n\n| " + " | ".join(columns) + " |\n|---|" + "---:|" * (len(columns) - 1))
    for line in lines:
        print("| " + " | ".join(line) + " |")


def report(facts: dict, exact_rows: list[dict], rows: list[dict]) -> list[str]:
    """Prints the facts, tables and goals; returns the modes that meet every goal."""
    print("hmem token re-rank benchmark (scripts/bench_token_rerank.py)")
    for key, value in facts.items():
        print(f"  {key:19} {value}")
    heads = ["next found@1", "next found@10", "short found@1", "short found@10"]
    table(
        "Exact (every entry scored, float64 means / float32 max-sim; no signatures, no shortlist):",
        ["exact", "queries", *heads],
        [[v["exact"], str(v["queries"])] + [f"{v[k]:.3f}" for k in FOUND] for v in exact_rows],
    )
    if not rows:
        return []
    mean, spans = rows[0], rows[1]
    heads += ["query (next)", "query (short)", "disk / entry", "next found@10 vs mean", "query vs spans (next, short)"]
    lines = []
    for r in rows:
        q = [r[f"{k}_seconds"] for k in ("next", "short")]
        lines.append(
            [r["mode"], *(f"{r[k]:.3f}" for k in FOUND), f"{q[0] * 1e3:.2f} ms", f"{q[1] * 1e3:.2f} ms"]
            + [f"{r['disk_bytes_per_entry']:,.0f} B", f"{r['next_found10'] / mean['next_found10']:.2f}x"]
            + [f"{q[0] / spans['next_seconds']:.2f}x, {q[1] / spans['short_seconds']:.2f}x"]
        )
    table("Stores (query(top_k=10); median time of one query call):", ["mode", *heads], lines)
    print()
    checks = goals(rows)
    benchlib.print_goals(checks)
    modes = [r["mode"] for r in rows if r["store"] == "spans" and r["token_rerank"]]
    met = [m for m in modes if all(g["holds"] for g in checks if g["goal"].startswith(m + ":"))]
    print(f"\nevery goal holds for: {', '.join(met) or 'no N'}")
    return met


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=20_000, metavar="N", help="stored entries (default 20,000)")
    p.add_argument("--queries", type=int, default=300, metavar="N", help="queries of each kind (default 300)")
    p.add_argument("--token-n", default="10,20,40", metavar="N[,N...]", help="token_rerank values (default 10,20,40)")
    p.add_argument("--exact-queries", type=int, metavar="N", help="queries of each kind max-sim scores (default all)")
    p.add_argument("--exact-only", action="store_true", help="build no store: the exact figures only")
    p.add_argument("--batch", type=int, default=2000, metavar="N", help="entries per put_many (default ~2000)")
    p.add_argument("--dir", metavar="PATH", help="build the stores here (empty or missing) and keep them")
    add_key_options(p)  # the span benchmark's key structure; documents add:
    p.add_argument("--doc-terms", type=int, default=32, help="a document's own terms (default 32)")
    p.add_argument("--term-p", type=float, default=0.32, help="chance a token is a document term (default 0.32)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    try:
        token_n = sorted({int(s) for s in args.token_n.split(",") if s.strip()})
    except ValueError:
        p.error("--token-n takes integers, e.g. 10,20,40")
    if args.entries < 1000 or not 1 <= args.queries <= args.entries // 4 or any(n < 1 for n in token_n + [args.batch]):
        p.error("--entries must be >= 1000, --queries from 1 to --entries / 4, --token-n and --batch >= 1")
    if args.dir and Path(args.dir).exists() and any(Path(args.dir).iterdir()):
        p.error(f"{args.dir} is not empty")
    sample = min(args.queries if args.exact_queries is None else args.exact_queries, args.queries)
    if not benchlib.native_kernels():
        return 2
    t_start = time.perf_counter()

    facts = benchlib.machine_facts()
    facts["hmem scan threads"] = str(hmem.threads.cores())
    facts["entries"] = f"{args.entries:,} (one layer, {args.dim} floats a token, 64-256 a chunk, 4-8 a document)"
    facts["store"] = f"hdc_dim {HDC_DIM}, storage_dtype {STORAGE_DTYPE}, values = keys"
    facts["data"] = ", ".join(
        f"{k.replace('_', '-')} {getattr(args, k)}"
        for k in ("vocab", "doc_terms", "term_p", "tok", "noise", "sent", "topics", "topic", "sink", "seed")
    )
    facts["queries"] = f"{args.queries} next-chunk + {args.queries} short (8-32 tokens), top_k {TOP_K}"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hmem-bench-tokens-") as tmp:
        if args.exact_only:
            data = Data(args, {}, benchlib.log)
        else:
            root = Path(args.dir or tmp)
            root.mkdir(parents=True, exist_ok=True)
            data, rows = run_modes(root, args, token_n, benchlib.log)
    data.keys = unit_rows(data.keys)  # only max-sim reads them from here on
    facts["documents"] = f"{int(data.doc[-1]) + 1:,}"
    facts["random-pair cosine"] = f"{data.cosine:.3f} (mean-pooled keys, {PAIRS} random pairs)"
    exact_rows = exact(data, sample, benchlib.log)
    facts["seconds"] = f"{time.perf_counter() - t_start:.0f} (the whole run)"
    met = report(facts, exact_rows, rows)
    if args.json:
        out = {"machine": facts, "exact": exact_rows, "results": rows, "goals": goals(rows) if rows else []}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if args.exact_only or met else 1


if __name__ == "__main__":
    sys.exit(main())
