"""Concurrent reads: query throughput of one Store shared by threads.

    python scripts/bench_threads.py                 # builds the store once (~20 s), reuses it
    python scripts/bench_threads.py --search full

One layer of 200,000 entries (1 token x 16 float32, hdc_dim 4096), built
with put_many in batches of 10,000, each flushed. 200 queries of 4 tokens,
top-10 with re-rank, count_access=True (the store opened for writing, as a
serving process holds it). Cases, each answering the same 200 queries:

- 1 thread;
- 2 threads sharing one Store (100 queries each);
- 2 threads, each with its own Store opened read-only on the same path
  (the baseline: nothing shared);
- 2 processes, each with its own Store opened read-only, each answering
  half of the queries from the same moment (nothing shared, not even the
  GIL: what this machine allows two readers at all);
- 2 threads sharing one Store while a writer thread on it puts 100 entries
  (in another layer) and flushes, again and again, with --writer-pause
  seconds between rounds.

Each case is run --repeat times, taking turns; medians.  A single query's
scan already runs on both cores (hmem/threads.py), so "1 thread" uses them
too: the script prints how busy it kept them (the process's CPU time over
the wall time), and from that the most any number of threads could gain
over it at the same CPU per query (cores / busy cores).

Goals (the issue "Concurrent reads"): 2 threads sharing one Store >= 1.6x
the throughput of 1 thread; with the writer, >= 70% of the figure without.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib
import numpy as np

import hmem
from hmem import threads as hmem_threads

ENTRIES = 200_000
EMBED_DIM = 16
QUERIES = 200
TOP_K = 10


def open_store(root: Path, log) -> Path:
    path = root / f"threads-{ENTRIES}"
    config = hmem.StoreConfig(embed_dim=EMBED_DIM, hdc_dim=4096)

    def build() -> None:
        log(f"building {path} ...")
        rng = np.random.default_rng(4)
        with hmem.Store.create(path, config) as store:
            for _lo in range(0, ENTRIES, 10_000):
                keys = rng.standard_normal((10_000, 1, EMBED_DIM), dtype=np.float32)
                store.put_many(hmem.Entry(k, k, 0) for k in keys)
                store.flush()

    benchlib.kept_store(path, config, build, log)
    return path


def process_child(argv: list[str]) -> None:
    """In a child process: open the store read-only, warm up, wait for the
    start time, answer queries [lo, hi) and print the seconds it took."""
    path, search, lo, hi, start_at = argv[0], argv[1], int(argv[2]), int(argv[3]), float(argv[4])
    queries = np.random.default_rng(5).standard_normal((QUERIES, 4, EMBED_DIM), dtype=np.float32)
    with hmem.Store.open(path, read_only=True) as store:
        run_threads([store], queries[:10], search)
        while time.time() < start_at:
            time.sleep(0.0005)
        print(run_threads([store], queries[lo:hi], search), flush=True)


def run_processes(path: Path, search: str) -> float:
    """Seconds for 2 processes, started together, to answer half the
    queries each (the slower one's time; start-up and warm-up not timed)."""
    start_at = time.time() + 2.0  # time enough to start, open and warm up
    half = QUERIES // 2
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(path), search, str(lo), str(hi), repr(start_at)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for lo, hi in ((0, half), (half, QUERIES))
    ]
    outs = [child.communicate()[0] for child in children]
    if any(child.returncode for child in children):
        raise RuntimeError("a query process failed")
    return max(float(out) for out in outs)


def run_threads(stores: list[hmem.Store], queries: np.ndarray, search: str) -> float:
    """Seconds for len(stores) threads to answer the queries, split evenly."""
    parts = np.array_split(np.arange(len(queries)), len(stores))
    errors: list[BaseException] = []

    def work(store: hmem.Store, idx: np.ndarray) -> None:
        try:
            for i in idx:
                store.query(queries[i], 0, top_k=TOP_K, search=search, count_access=not store.read_only)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s, p)) for s, p in zip(stores, parts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


class Writer:
    """A thread that puts 100 entries into layer 1 and flushes, again and again."""

    def __init__(self, store: hmem.Store, pause: float) -> None:
        self.store, self.pause = store, pause
        self.stop = threading.Event()
        self.rounds = 0
        self.cpu = self.wall = 0.0
        self.thread = threading.Thread(target=self._run)
        self.rng = np.random.default_rng(9)

    def _run(self) -> None:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            self._rounds()
        finally:  # the CPU the writer took from the readers' two cores
            self.cpu, self.wall = time.thread_time() - cpu0, time.perf_counter() - wall0

    def _rounds(self) -> None:
        while not self.stop.is_set():
            keys = self.rng.standard_normal((100, 1, EMBED_DIM), dtype=np.float32)
            self.store.put_many(hmem.Entry(k, k, 1) for k in keys)
            self.store.flush()
            self.rounds += 1
            if self.pause:
                self.stop.wait(self.pause)

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        process_child(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/tmp/hmem-bench-threads", help="where the store is built and kept")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--search", default="auto", choices=("auto", "full", "two-stage"))
    p.add_argument(
        "--writer-pause",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="the writer's pause between rounds of put + flush (default 0: back to back)",
    )
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    facts = benchlib.machine_facts()
    print("hmem concurrent reads benchmark (scripts/bench_threads.py)")
    for key, value in facts.items():
        print(f"  {key:10} {value}")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    built = open_store(root, log)
    # the writer adds entries and a shard per round: it writes into a copy,
    # so that every run starts from the same 200,000 entries in one layer
    work = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    path = work / built.name
    shutil.copytree(built, path)
    queries = np.random.default_rng(5).standard_normal((QUERIES, 4, EMBED_DIM), dtype=np.float32)
    shared = hmem.Store.open(path)
    own = [hmem.Store.open(path, read_only=True) for _ in range(2)]
    writes, writer_cpu, writer_wall = 0, 0.0, 0.0
    try:
        for s in (shared, *own):
            run_threads([s], queries[:10], args.search)  # warm: maps, prefix matrices
        times: dict[str, list[float]] = {
            "1 thread": [],
            "2 threads, one Store": [],
            "2 threads, own Stores": [],
            "2 processes, own Stores": [],
            "2 threads, one Store, writer": [],
        }
        one_thread_cpu: list[float] = []  # process CPU seconds of the "1 thread" case, every thread counted
        for _ in range(args.repeat):
            cpu0 = time.process_time()
            times["1 thread"].append(run_threads([shared], queries, args.search))
            one_thread_cpu.append(time.process_time() - cpu0)
            times["2 threads, one Store"].append(run_threads([shared, shared], queries, args.search))
            times["2 threads, own Stores"].append(run_threads(own, queries, args.search))
            times["2 processes, own Stores"].append(run_processes(path, args.search))
            with Writer(shared, args.writer_pause) as writer:
                times["2 threads, one Store, writer"].append(run_threads([shared, shared], queries, args.search))
            writes += writer.rounds
            writer_cpu, writer_wall = writer_cpu + writer.cpu, writer_wall + writer.wall
    finally:
        shared.close()
        for s in own:
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["1 thread"]
    print(
        f"\n{QUERIES} queries, top-{TOP_K}, re-rank, search={args.search}, one layer of {ENTRIES:,} entries; "
        f"medians of {args.repeat}"
    )
    print("| case | time | queries/s | vs 1 thread |")
    print("|---|---:|---:|---:|")
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:,.0f} ms | {QUERIES / t:,.0f} | {base / t:.2f}x |")
    print(
        f"\nthe writer put and flushed {writes} rounds of 100 entries during the last case "
        f"(pause {args.writer_pause} s), {writes / writer_wall:,.0f} a second, its thread busy on a core "
        f"{writer_cpu / writer_wall:.0%} of the time"
    )
    # The most any sharing of the work can gain: one thread's queries take
    # C seconds of CPU (its scans on every core) in T seconds; with every
    # core busy and the same CPU a query, N cores answer them in C / N.
    cores = hmem_threads.cores()  # the cores this process may run on
    busy = statistics.median(one_thread_cpu) / base
    ceiling = cores / busy
    print(
        f"1 thread kept {busy:.2f} of the {cores} cores busy (CPU time / wall time): at the same CPU per "
        f"query, no number of threads can pass {ceiling:.2f}x it on this machine"
    )
    shared_gain = base / med["2 threads, one Store"]
    with_writer = med["2 threads, one Store"] / med["2 threads, one Store, writer"]
    goals = [
        ("2 threads sharing one Store >= 1.6x 1 thread", shared_gain >= 1.6, f"{shared_gain:.2f}x"),
        (
            "with a writer putting and flushing, reader throughput >= 70% of without",
            with_writer >= 0.7,
            f"{with_writer:.0%}",
        ),
    ]
    for text, ok, detail in goals:
        print(f"{'holds' if ok else 'MISSED'}: {text} ({detail})")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": facts,
                    "seconds": med,
                    "writer_rounds": writes,
                    "one_thread_busy_cores": busy,
                    "ceiling": ceiling,
                    "writer_cpu_share": writer_cpu / writer_wall,
                    "search": args.search,
                },
                indent=2,
            )
        )
    return 0 if all(ok for _, ok, _ in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
