"""LMCache caches (issue 36, goal "Fast"): `stats` and `ls` of a cache of
100,000 chunk files, and the explanation of a 32k-token request, beside
the floors they stand on, measured in the same run.

The cache is built once (``--dir``, default a folder under the system's
temporary directory, kept and reused while it holds the same files): file
names exactly as LMCache 0.5.6 names them (chunk hashes chained by
Python's built-in hash over random token ids, as its in-process engine
computes them), two models, world size 2 (ranks 0 and 1), fs connector
files (a valid 28-byte header, then 512 bytes: one [2, 1, 16, 8] bfloat16
group) beside local_disk files (512 bytes), some tagged, a few ``.tmp``
writes never renamed and a few foreign files.  The goals are about the
number of files, not their bytes, so each file is small.

Cases:

- floors: a plain directory listing, ``os.scandir`` + ``stat`` of every
  file; the same as ``ls -l`` prints it, in Python (names sorted, one
  ``lstat`` and one formatted line per file); ``ls -l`` itself;
- ``stats``: ``open_cache(dir).stats()`` (the open lists the directory);
- ``ls``: ``open_cache(dir)``, then every chunk's JSON object as ``hmem ls
  --json`` builds them (column by column, in this process); and, for
  programs using the library, every chunk's ``ChunkInfo.to_dict()`` and
  ``json.dumps`` of them all (no goal: the API, not the command);
- the commands as a user runs them, each a fresh process (start-up
  included): ``hmem stats DIR --json``, ``hmem ls DIR --json`` and
  ``hmem ls DIR --jsonl``;
- the explanation of a 32,768-token request (128 chunks) whose chunks are
  all in the cache, on an open cache, per call; the same with one chunk
  missing on rank 1 (a hole, unreachable chunks after it, near misses
  searched); and a request stored only under another model name (hit 0,
  near misses found); the floor: LMCache's hash chain over the same
  tokens in plain Python, ``hash((prev, tuple(chunk), ()))`` per chunk.

The page cache: nothing here can drop it (that needs root).  The first
call of the first case (the plain listing) meets the directory as the
machine left it ("first"; cold only when the cache was built long before
or the machine is fresh); every later case finds its inodes cached.
Medians are of calls taking turns.

Usage::

    nice -n 10 python scripts/bench_lmcache.py               # about 2.5 minutes once the cache exists
    nice -n 10 python scripts/bench_lmcache.py --files 20000 --rounds 3
    nice -n 10 python scripts/bench_lmcache.py --profile      # cProfile of every case that misses its goal
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from benchlib import compile_like_an_install, fmt_seconds, log, print_machine_facts

from hmem.formats import lmcache as fmt
from hmem.lmcache import open_cache
from hmem.lmcache.hit_explanation import Deployment, Request, explain

MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct")
OTHER_MODEL = "meta-llama/Llama-3.1-8B"  # the near-miss request's chunks are stored under this name
WORLD = 2
CHUNK = 256
REQUEST_TOKENS = 32_768
BULK_CHUNKS = 16  # chunks per bulk request (4096 tokens)
DATA = 512  # bytes of K/V per file: [2, 1, 16, 8] bfloat16
FS_HEADER = fmt.fs_header_bytes("KV_2LTD", [("bfloat16", (2, 1, 16, 8))])
MARKER = "bench-marker.json"  # the benchmark's own file in the cache (one of its foreign files)
VERSION = 1  # of the cache this script builds: a kept cache of another version is built again
DEBRIS_FILES = 20
FOREIGN = ("README", "lmcache.log", "core.1234", "notes.txt")
STATS_GOAL = 2.0
EXPLAIN_GOAL = 0.050


def default_dir() -> Path:
    return Path(tempfile.gettempdir()) / "hmem-bench-lmcache" / "cache"


# ---- the cache ---------------------------------------------------------------------------------


def special_requests() -> dict[str, list[int]]:
    """The three 32k-token requests the explanation is timed on (the same
    tokens every run)."""
    rng = np.random.default_rng(36)
    return {name: rng.integers(0, 128_000, REQUEST_TOKENS).tolist() for name in ("full", "hole", "other_model")}


def planned_names(files: int) -> list[tuple[str, bytes]]:
    """(file name, content) of every file of the cache, `files` in all."""
    fs_content = FS_HEADER + bytes(DATA)
    ld_content = bytes(DATA)
    out: list[tuple[str, bytes]] = []

    def add(key: fmt.ChunkKey, form: str) -> None:
        if form == "fs":
            out.append((key.fs_name(), fs_content))
        else:
            out.append((key.local_disk_name(), ld_content))

    requests = special_requests()
    for name, tokens in requests.items():
        model = OTHER_MODEL if name == "other_model" else MODELS[0]
        for c, h in enumerate(fmt.chunk_hashes(tokens, CHUNK)):
            for rank in range(WORLD):
                if name == "hole" and c == 64 and rank == 1:
                    continue
                add(fmt.ChunkKey(model, WORLD, rank, h, "bfloat16"), "fs")
    out.append((MARKER, b""))  # content written last
    out += [(name, b"not a chunk\n") for name in FOREIGN]
    rng = np.random.default_rng(1)
    debris = 0
    n = 0
    while len(out) < files:
        n += 1
        model = MODELS[n % 2]
        form = "fs" if n % 5 < 3 else "local_disk"
        kv_dtype = "half" if model == MODELS[1] and n % 3 == 0 else "bfloat16"
        tags: tuple[tuple[str, str], ...] = ()
        if n % 4 == 0:
            tags = (("user", ("alice", "bob", "carol")[n % 3]),)
        tokens = rng.integers(0, 128_000, BULK_CHUNKS * CHUNK).tolist()
        for h in fmt.chunk_hashes(tokens, CHUNK):
            for rank in range(WORLD):
                key = fmt.ChunkKey(model, WORLD, rank, h, kv_dtype, None, tags)
                if form == "fs" and debris < DEBRIS_FILES and n % 97 == 0 and rank == 1:
                    out.append((key.fs_name().removesuffix(fmt.FS_SUFFIX) + fmt.FS_TEMP_SUFFIX, fs_content))
                    debris += 1
                else:
                    add(key, form)
    del out[files:]
    return out


def marker_text(files: int) -> str:
    return json.dumps({"version": VERSION, "files": files})


def kept(root: Path, files: int) -> bool:
    try:
        if (root / MARKER).read_text() != marker_text(files):
            return False
        with os.scandir(root) as it:
            return sum(1 for _ in it) == files
    except OSError:
        return False


def build(root: Path, files: int) -> float:
    """The cache at `root`, built again; seconds taken."""
    if root.exists():
        if not (root / MARKER).exists():
            raise SystemExit(f"{root} exists and is no cache of this benchmark ({MARKER} missing): not touched")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    start = time.perf_counter()
    plan = planned_names(files)
    log(f"building {root}: {len(plan):,} files ({time.perf_counter() - start:.1f} s to name them)")
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        for name, content in plan:
            if name == MARKER:
                continue
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
            try:
                os.write(fd, content)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    (root / MARKER).write_text(marker_text(files))
    return time.perf_counter() - start


# ---- the cases ---------------------------------------------------------------------------------


def scandir_stat(root: Path) -> int:
    with os.scandir(root) as it:
        return len([(e.name, e.stat(follow_symlinks=False)) for e in it])


def ls_l_python(root: Path) -> int:
    lines = []
    for name in sorted(os.listdir(root)):
        st = os.lstat(os.path.join(root, name))
        when = time.strftime("%b %d %H:%M", time.localtime(st.st_mtime))
        lines.append(f"{stat.filemode(st.st_mode)} {st.st_nlink} {st.st_uid} {st.st_gid} {st.st_size:>8} {when} {name}")
    return len("\n".join(lines))


def ls_l(root: Path) -> None:
    subprocess.run(["ls", "-l", str(root)], stdout=subprocess.DEVNULL, check=True)


def lib_stats(root: Path) -> object:
    return open_cache(root).stats()


def lib_ls(root: Path) -> int:
    cache = open_cache(root)
    return len(json.dumps([info.to_dict() for info in cache.chunks()]))


def ls_lines(root: Path) -> int:
    """What `hmem ls DIR --json` does after its start-up: open, then every
    chunk's JSON object built column by column."""
    from hmem.lmcache import chunk_json_lines

    cache = open_cache(root)
    return len(chunk_json_lines(cache, cache.select()))


def hmem_executable() -> str:
    return shutil.which("hmem", path=str(Path(sys.executable).parent)) or "hmem"


def cli(argv: list[str]) -> Callable[[], None]:
    def run() -> None:
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr.decode(errors='replace').strip()[-300:]}")

    return run


def hash_loop(tokens: list[int]) -> int:
    """LMCache's chunk-hash chain in plain Python: the floor of any explanation."""
    previous = 0
    for start in range(0, len(tokens) - len(tokens) % CHUNK, CHUNK):
        previous = hash((previous, tuple(tokens[start : start + CHUNK]), ()))
    return previous


def in_turns(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def profile(fn: Callable[[], object], title: str, lines: int = 22) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(lines)
    print(f"\n--- cProfile: {title} (cumulative) ---")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])


# ---- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=default_dir(), help="the cache (built when absent; kept)")
    parser.add_argument("--files", type=int, default=100_000, help="files in the cache (default 100,000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the listing cases (default 5)")
    parser.add_argument("--explain-rounds", type=int, default=30, help="calls of each explanation (default 30)")
    parser.add_argument("--no-cli", action="store_true", help="skip the hmem commands in fresh processes")
    parser.add_argument("--profile", action="store_true", help="cProfile every case that misses its goal")
    args = parser.parse_args()
    if args.files < 1000:
        raise SystemExit("--files: at least 1000 (the three requests alone take 767)")

    print_machine_facts()
    root: Path = args.dir
    if kept(root, args.files):
        built = None
        log(f"reusing {root} ({args.files:,} files)")
    else:
        built = build(root, args.files)
        log(f"built in {built:.1f} s")
    cli_note = compile_like_an_install() if not args.no_cli else ""

    results: list[tuple[str, float, float | None, str]] = []  # what, seconds, goal, note

    # the plain listing first: it meets the directory as the machine left it
    t0 = time.perf_counter()
    count = scandir_stat(root)
    first_listing = time.perf_counter() - t0
    t0 = time.perf_counter()
    lib_stats(root)
    first_stats = time.perf_counter() - t0
    assert count == args.files, (count, args.files)

    listing_cases: dict[str, Callable[[], object]] = {
        "os.scandir + stat (floor)": lambda: scandir_stat(root),
        "ls -l in Python (floor)": lambda: ls_l_python(root),
        "ls -l (floor)": lambda: ls_l(root),
        "open_cache + stats()": lambda: lib_stats(root),
        "open_cache + ls --json's lines (in-process)": lambda: ls_lines(root),
        "open_cache + chunks() to dicts + json (API)": lambda: lib_ls(root),
    }
    cli_failed: dict[str, str] = {}
    if not args.no_cli:
        exe = hmem_executable()
        for label, argv in (
            ("hmem stats DIR --json", [exe, "stats", str(root), "--json"]),
            ("hmem ls DIR --json", [exe, "ls", str(root), "--json"]),
            ("hmem ls DIR --jsonl", [exe, "ls", str(root), "--jsonl"]),
        ):
            run = cli(argv)
            try:
                run()
                listing_cases[label] = run
            except RuntimeError as exc:
                cli_failed[label] = str(exc)
    log(f"listing cases, {args.rounds} rounds")
    times = in_turns(listing_cases, args.rounds)
    goals = {"open_cache + stats()", "open_cache + ls --json's lines (in-process)"} | {
        k for k in listing_cases if k.startswith("hmem ")
    }
    for name, samples in times.items():
        note = f"best {fmt_seconds(min(samples))}"
        results.append((name, statistics.median(samples), STATS_GOAL if name in goals else None, note))

    # the explanation
    cache = open_cache(root)
    requests = special_requests()
    deployment = Deployment(model=MODELS[0], world_size=WORLD)
    expected = {"full": 128, "hole": 64, "other_model": 0}
    explain_cases: dict[str, Callable[[], object]] = {"hash chain in Python, 128 chunks (floor)": lambda: None}
    for name, tokens in requests.items():
        request = Request(name, tuple(tokens))
        hit = explain(cache, [request], deployment)[0]
        if hit.hit_chunks != expected[name]:
            raise SystemExit(f"request {name}: {hit.hit_chunks} chunks hit, {expected[name]} expected")
        what = {
            "full": "explain: 32k tokens, all 128 chunks held",
            "hole": "explain: 32k tokens, chunk 64 missing on rank 1",
            "other_model": "explain: 32k tokens, stored under another model",
        }[name]
        explain_cases[what] = lambda request=request: explain(cache, [request], deployment)
    floor_tokens = requests["full"]
    explain_cases["hash chain in Python, 128 chunks (floor)"] = lambda: hash_loop(floor_tokens)
    log(f"explanations, {args.explain_rounds} rounds")
    explain_times = in_turns(explain_cases, args.explain_rounds)
    for name, samples in explain_times.items():
        goal = EXPLAIN_GOAL if name.startswith("explain") else None
        results.append((name, statistics.median(samples), goal, f"best {fmt_seconds(min(samples))}"))

    # the table
    origin = f" (built in {built:.1f} s)" if built else " (kept from a run before)"
    print(f"cache: {root}, {args.files:,} files{origin}")
    kinds = cache.stats()
    print(
        f"  {kinds.chunks:,} chunks ({', '.join(kinds.kinds)}), {len(kinds.groups)} groups, "
        f"{len(kinds.debris)} .tmp, {len(kinds.foreign)} foreign; {kinds.bytes / 1e6:.1f} MB of chunks"
    )
    if cli_note:
        print(f"  {cli_note}")
    print(
        f"  first calls (page cache as the machine left it; nothing dropped, that needs root): "
        f"os.scandir + stat {fmt_seconds(first_listing)}, then open_cache + stats() {fmt_seconds(first_stats)}"
    )
    print(f"  medians of {args.rounds} rounds (listing) and {args.explain_rounds} calls (explain), cases in turns\n")
    width = max(len(r[0]) for r in results) + 2
    print(f"{'what':<{width}}{'median':>12}{'goal':>12}  result   note")
    missed = []
    for name, seconds, goal, note in results:
        if goal is None:
            verdict, goal_text = ("floor" if "(floor)" in name else "no goal"), ""
        else:
            verdict = "MET" if seconds <= goal else "MISSED"
            goal_text = f"≤ {fmt_seconds(goal)}"
            if verdict == "MISSED":
                missed.append(name)
        print(f"{name:<{width}}{fmt_seconds(seconds):>12}{goal_text:>12}  {verdict:<7}  {note}")
    for label, why in cli_failed.items():
        print(f"{label:<{width}}{'—':>12}{'':>12}  not run  {why}")
    medians = {name: seconds for name, seconds, _, _ in results}
    floor = medians["os.scandir + stat (floor)"]
    held = medians["explain: 32k tokens, all 128 chunks held"]
    chain = medians["hash chain in Python, 128 chunks (floor)"]
    print(
        f"\nopen_cache + stats() / os.scandir + stat: {medians['open_cache + stats()'] / floor:.2f}x; "
        f"explain (all held) / hash chain: {held / chain:.1f}x"
    )
    if missed:
        print("\nMISSED: " + "; ".join(missed))
    else:
        print("\nevery goal MET")
    if args.profile:
        all_cases = {**listing_cases, **explain_cases}
        for name in missed:
            if not name.startswith("hmem "):
                profile(all_cases[name], name)


if __name__ == "__main__":
    main()
