"""Benchmark of the prefix-hit bitmap pipeline: native kernels vs the pure-Python reference.

Runs the table of the bitmap_ops seed on the same inputs: 8 object groups with
windows (-1, -1, -1, -1, 4, 4, 8, 1) (four full-attention groups, two windows
of 4 chunks, one of 8, one mamba group) and five presence maps.  For each case
and each layout it times

- native: ``hmem.fold_unfold_ranked`` (fold -> highest set bit -> unfold in
  the compiled kernels), the library call and nothing else;
- reference: ``hmem.kernels.reference.bitops.fold_into`` + ``highest_set_bit`` +
  ``unfold_into`` on fresh bytearrays, measured in the same run.

Before timing a case the script checks that both pipelines give the same hit
and the same retain mask, and stops with exit status 1 if they differ.

Then the grouped form against the flat one at 262,144 keys (the 8 groups
above x 8 ranks x 4096 chunks: 64 rows of 4096 bits, one per (group, rank)
lookup) under a few presence fills.  It times, in the same process and the
same way as the native pipeline:

- grouped: ``hmem.fold_unfold_grouped(rows, windows)``, each row paired with
  its group's window, rows in group-major order;
- flat: ``hmem.fold_unfold_ranked`` on a flat presence map built beforehand,
  in both layouts;
- build and split: what a caller holding rows pays around the flat call,
  ``hmem.presence_map(rows_by_group, ...)`` before it and
  ``hmem.group_rows(mask, ...)`` after it, in both layouts.

The goal is grouped <= flat + build (sums of medians from the same run);
grouped against flat + build + split and against flat alone are reported
beside it.  Before timing a fill the script checks that grouped and flat give
the fill's expected hit and the same retain rows (``group_rows`` of the flat
mask), and stops with exit status 1 if they differ.

Usage::

    python scripts/bench_bitmap.py            # full run, reference on every case
    python scripts/bench_bitmap.py --quick    # no reference on the 4M-key case
    python scripts/bench_bitmap.py --grouped-only   # only grouped against flat
    python scripts/bench_bitmap.py --json     # JSON on stdout instead of the table
    python scripts/bench_bitmap.py --json out.json   # table on stdout, JSON in out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from benchlib import machine_facts

import hmem
from hmem import Bitmap, Layout
from hmem.kernels.reference import bitops as ref

WINDOWS = (-1, -1, -1, -1, 4, 4, 8, 1)

# Goals the native pipeline must meet.
GOAL_US_AT_262K = 50.0  # full pipeline at 262,144 keys, microseconds
GOAL_US_AT_4M = 1000.0  # full pipeline at 4M keys, microseconds
GOAL_SPEEDUP = 1000.0  # native vs reference, same run


@dataclass(frozen=True)
class Case:
    name: str
    chunks: int
    ranks: int
    fill: str  # "all": every bit present; "first-half": bits [0, N/2) present
    big: bool = False  # skipped by --quick for the reference

    @property
    def keys(self) -> int:
        return len(WINDOWS) * self.chunks * self.ranks

    def presence(self) -> Bitmap:
        n = self.keys
        return Bitmap.prefix(n, n if self.fill == "all" else n // 2)


CASES = (
    Case("4096 chunks x 1 rank, all present", 4096, 1, "all"),
    Case("4096 chunks x 8 ranks, all present", 4096, 8, "all"),
    Case("4096 chunks x 8 ranks, first half of bits", 4096, 8, "first-half"),
    Case("16 chunks x 8 ranks, all present", 16, 8, "all"),
    Case("62500 chunks x 8 ranks, all present", 62500, 8, "all", big=True),
)


@dataclass
class Row:
    case: str
    layout: str
    chunks: int
    ranks: int
    keys: int
    hit: int
    native_runs: int
    native_median_ns: int
    native_p90_ns: int
    native_min_ns: int
    reference_runs: int = 0
    reference_median_ns: int | None = None
    speedup: float | None = None
    goals: dict[str, bool | None] = field(default_factory=dict)


# ---- the two pipelines ------------------------------------------------------


def reference_pipeline(found_bytes, C: int, R: int, W, chunk_major: bool) -> tuple[int, bytearray]:
    """fold -> highest set bit + 1 -> unfold with the pure-Python reference kernels."""
    servable = bytearray((C + 7) // 8)
    ref.fold_into(found_bytes, C, R, W, chunk_major, servable)
    hit = ref.highest_set_bit(servable, C) + 1
    mask = bytearray((len(W) * C * R + 7) // 8)
    ref.unfold_into(hit, C, R, W, chunk_major, mask)
    return hit, mask


def time_call(call, args: tuple, min_runs: int, min_seconds: float) -> list[int]:
    """Per-call times (ns) of call(*args), after a warm-up, garbage collection off."""
    clock = time.perf_counter_ns
    warm_end = clock() + 50_000_000  # 50 ms or 20 calls, whichever is longer
    for i in range(1_000_000):
        call(*args)
        if i >= 19 and clock() >= warm_end:
            break
    times: list[int] = []
    deadline = clock() + int(min_seconds * 1e9)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        while len(times) < min_runs or (clock() < deadline and len(times) < 1_000_000):
            t0 = clock()
            call(*args)
            times.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def time_native(found: Bitmap, case: Case, layout: Layout, min_runs: int, min_seconds: float) -> list[int]:
    """Per-call times (ns) of hmem.fold_unfold_ranked."""
    args = (found, case.chunks, case.ranks, WINDOWS, layout)
    return time_call(hmem.fold_unfold_ranked, args, min_runs, min_seconds)


def time_reference(found_bytes: bytes, case: Case, chunk_major: bool, runs: int) -> list[int]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        reference_pipeline(found_bytes, case.chunks, case.ranks, WINDOWS, chunk_major)
        times.append(time.perf_counter_ns() - t0)
    return times


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


# ---- machine facts ------------------------------------------------------------


# ---- the run ------------------------------------------------------------------


def goals_for(row: Row) -> dict[str, bool | None]:
    goals: dict[str, bool | None] = {}
    med_us = row.native_median_ns / 1000
    if row.keys == 262_144:
        goals[f"<= {GOAL_US_AT_262K:g} us"] = med_us <= GOAL_US_AT_262K
    if row.keys == 4_000_000:
        goals[f"<= {GOAL_US_AT_4M:g} us"] = med_us <= GOAL_US_AT_4M
    goals[f">= {GOAL_SPEEDUP:g}x"] = None if row.speedup is None else row.speedup >= GOAL_SPEEDUP
    return goals


def run_case(case: Case, layout: Layout, args, log) -> Row:
    chunk_major = layout is Layout.CHUNK_MAJOR
    found = case.presence()
    found_bytes = found.to_bytes()
    hit, mask = hmem.fold_unfold_ranked(found, case.chunks, case.ranks, WINDOWS, layout)

    with_reference = not (args.quick and case.big)
    ref_times: list[int] = []
    if with_reference:
        # First reference run doubles as the correctness check.
        t0 = time.perf_counter_ns()
        ref_hit, ref_mask = reference_pipeline(found_bytes, case.chunks, case.ranks, WINDOWS, chunk_major)
        ref_times.append(time.perf_counter_ns() - t0)
        if ref_hit != hit or bytes(ref_mask) != mask.to_bytes():
            sys.stderr.write(
                f"\nMISMATCH in case {case.name!r}, layout {layout.value}: native hit {hit}, "
                f"reference hit {ref_hit}; masks {'equal' if bytes(ref_mask) == mask.to_bytes() else 'DIFFER'}.\n"
                "The native kernels disagree with the reference: the timings would be meaningless.\n"
            )
            raise SystemExit(1)
        ref_times += time_reference(found_bytes, case, chunk_major, args.repeat - 1)

    times = sorted(time_native(found, case, layout, args.native_runs, args.native_seconds))
    row = Row(
        case=case.name,
        layout=layout.value,
        chunks=case.chunks,
        ranks=case.ranks,
        keys=case.keys,
        hit=hit,
        native_runs=len(times),
        native_median_ns=int(statistics.median(times)),
        native_p90_ns=percentile(times, 0.9),
        native_min_ns=times[0],
    )
    if ref_times:
        row.reference_runs = len(ref_times)
        row.reference_median_ns = int(statistics.median(ref_times))
        row.speedup = row.reference_median_ns / row.native_median_ns
    row.goals = goals_for(row)
    log(
        f"  done: {case.name}, {layout.value}: native {fmt_ns(row.native_median_ns)}"
        + (f", reference {fmt_ns(row.reference_median_ns)}" if ref_times else ", reference skipped")
    )
    return row


# ---- grouped against flat -------------------------------------------------------

GROUPED_CHUNKS = 4096
GROUPED_RANKS = 8  # 8 groups x 8 ranks x 4096 chunks = 262,144 keys
MISSING_CHUNK = 3000  # the chunk one rank lacks in the "one rank misses" fill


@dataclass(frozen=True)
class Fill:
    """Which chunks each (group, rank) row holds, and the hit that gives."""

    name: str
    kind: str  # "all", "first-half", "window-tails", "rank-miss"
    expected_hit: int

    def rows_by_group(self) -> list[list[Bitmap]]:
        C, R = GROUPED_CHUNKS, GROUPED_RANKS
        out = []
        for g, w in enumerate(WINDOWS):
            ranks = []
            for r in range(R):
                if self.kind == "first-half":
                    row = Bitmap.prefix(C, C // 2)
                elif self.kind == "window-tails" and w > 0:
                    # A windowed group keeps only the chunks the longest
                    # prefix needs: its last w.
                    row = Bitmap(C)
                    row.set_range(C - w, C)
                else:
                    row = Bitmap.ones(C)
                    if self.kind == "rank-miss" and g == 0 and r == R - 1:
                        row.clear(MISSING_CHUNK)
                ranks.append(row)
            out.append(ranks)
        return out


GROUPED_FILLS = (
    # Every row full: one run per row, the whole length retained.
    Fill("all present", "all", GROUPED_CHUNKS),
    # Every row holds chunks [0, 2048): full-attention rows stop the scan at
    # 2048, the retain rows are half set.
    Fill("first half of chunks", "first-half", GROUPED_CHUNKS // 2),
    # Full-attention groups hold every chunk, each windowed group only its
    # last w: the window rows are scanned across 4 kB of zeros for one short
    # run, and the retain rows of the windows hold a few bits.
    Fill("windows hold only their last chunks", "window-tails", GROUPED_CHUNKS),
    # One rank of one full-attention group lacks one chunk: the hit stops
    # there for every group.
    Fill(f"one rank misses chunk {MISSING_CHUNK}", "rank-miss", MISSING_CHUNK),
)


@dataclass
class Timing:
    runs: int
    median_ns: int
    p90_ns: int
    min_ns: int

    @classmethod
    def of(cls, times: list[int]) -> Timing:
        ts = sorted(times)
        return cls(len(ts), int(statistics.median(ts)), percentile(ts, 0.9), ts[0])


@dataclass
class GroupedRow:
    fill: str
    layout: str  # the flat map's layout; the grouped call has none
    keys: int
    hit: int
    grouped: Timing  # the same measurement on both layouts' rows of a fill
    flat: Timing
    build: Timing
    split: Timing
    flat_build_ns: int = 0  # sums of medians
    flat_build_split_ns: int = 0
    grouped_vs_flat_build: float = 0.0  # grouped median / (flat + build)
    grouped_vs_flat_build_split: float = 0.0
    grouped_vs_flat: float = 0.0  # grouped median / flat median
    goal_holds: bool = False  # grouped <= flat + build


def grouped_mismatch(fill: Fill, layout: Layout, message: str) -> None:
    sys.stderr.write(
        f"\nMISMATCH in grouped fill {fill.name!r}, layout {layout.value}: {message}.\n"
        "The grouped and the flat operators disagree: the timings would be meaningless.\n"
    )
    raise SystemExit(1)


def check_grouped(
    fill: Fill, layout: Layout, rows: list[Bitmap], windows_per_row: tuple[int, ...], found: Bitmap
) -> int:
    """The hit both forms agree on; exit 1 when they or the fill's expected hit differ."""
    C, R = GROUPED_CHUNKS, GROUPED_RANKS
    flat_hit, mask = hmem.fold_unfold_ranked(found, C, R, WINDOWS, layout)
    hit, retain = hmem.fold_unfold_grouped(rows, windows_per_row)
    if hit != flat_hit or hit != fill.expected_hit:
        grouped_mismatch(fill, layout, f"grouped hit {hit}, flat hit {flat_hit}, expected {fill.expected_hit}")
    split = [row for ranks in hmem.group_rows(mask, C, R, WINDOWS, layout) for row in ranks]
    if len(split) != len(retain):
        grouped_mismatch(fill, layout, f"{len(retain)} grouped retain rows, {len(split)} flat ones")
    for i, (a, b) in enumerate(zip(retain, split)):
        if len(a) != len(b) or a.to_bytes() != b.to_bytes():
            g, r = divmod(i, R)
            grouped_mismatch(
                fill,
                layout,
                f"retain row of group {g} rank {r}: grouped keeps {a.runs()}, flat keeps {b.runs()}",
            )
    return hit


def run_grouped(fill: Fill, args, log) -> list[GroupedRow]:
    C, R = GROUPED_CHUNKS, GROUPED_RANKS
    rows_by_group = fill.rows_by_group()
    rows = [row for ranks in rows_by_group for row in ranks]
    windows_per_row = tuple(w for w in WINDOWS for _ in range(R))
    flat_maps = {layout: hmem.presence_map(rows_by_group, C, layout) for layout in Layout}
    hits = {layout: check_grouped(fill, layout, rows, windows_per_row, flat_maps[layout]) for layout in Layout}

    runs, seconds = args.native_runs, args.native_seconds
    grouped = Timing.of(time_call(hmem.fold_unfold_grouped, (rows, windows_per_row), runs, seconds))
    out = []
    for layout in (Layout.GROUP_MAJOR, Layout.CHUNK_MAJOR):
        found = flat_maps[layout]
        _, mask = hmem.fold_unfold_ranked(found, C, R, WINDOWS, layout)
        flat = Timing.of(time_call(hmem.fold_unfold_ranked, (found, C, R, WINDOWS, layout), runs, seconds))
        build = Timing.of(time_call(hmem.presence_map, (rows_by_group, C, layout), runs, seconds))
        split = Timing.of(time_call(hmem.group_rows, (mask, C, R, WINDOWS, layout), runs, seconds))
        fb = flat.median_ns + build.median_ns
        fbs = fb + split.median_ns
        out.append(
            GroupedRow(
                fill=fill.name,
                layout=layout.value,
                keys=len(WINDOWS) * C * R,
                hit=hits[layout],
                grouped=grouped,
                flat=flat,
                build=build,
                split=split,
                flat_build_ns=fb,
                flat_build_split_ns=fbs,
                grouped_vs_flat_build=grouped.median_ns / fb,
                grouped_vs_flat_build_split=grouped.median_ns / fbs,
                grouped_vs_flat=grouped.median_ns / flat.median_ns,
                goal_holds=grouped.median_ns <= fb,
            )
        )
        log(
            f"  done: grouped, {fill.name}, {layout.value}: grouped {fmt_ns(grouped.median_ns)}, "
            f"flat {fmt_ns(flat.median_ns)}, build {fmt_ns(build.median_ns)}, split {fmt_ns(split.median_ns)}"
        )
    return out


# ---- output -------------------------------------------------------------------


def fmt_ns(ns: int | None) -> str:
    if ns is None:
        return "-"
    if ns < 1_000_000:
        return f"{ns / 1000:.1f} us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_goals(goals: dict[str, bool | None]) -> str:
    parts = []
    for name, ok in goals.items():
        parts.append(f"{name}: {'n/a' if ok is None else 'yes' if ok else 'NO'}")
    return "; ".join(parts)


def render_table(rows: list[Row]) -> str:
    header = ("case", "layout", "keys", "hit", "reference", "native median", "native p90", "speedup", "goals")
    body = [
        (
            r.case,
            r.layout,
            f"{r.keys:,}",
            f"{r.hit:,}",
            fmt_ns(r.reference_median_ns),
            fmt_ns(r.native_median_ns),
            fmt_ns(r.native_p90_ns),
            "-" if r.speedup is None else f"{r.speedup:,.0f}x",
            fmt_goals(r.goals),
        )
        for r in rows
    ]
    return columns(header, body, right={2, 3, 4, 5, 6, 7})


def columns(header: tuple[str, ...], body: Sequence[tuple[str, ...]], right: set[int]) -> str:
    """A plain-text table; the columns in `right` are right-aligned."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


def render_grouped_table(rows: list[GroupedRow]) -> str:
    header = (
        "fill",
        "flat layout",
        "hit",
        "grouped",
        "grouped p90",
        "flat",
        "flat p90",
        "build",
        "split",
        "flat + build",
        "flat + build + split",
        "grouped / (flat + build)",
        "grouped / flat",
    )
    body = [
        (
            r.fill,
            r.layout,
            f"{r.hit:,}",
            fmt_ns(r.grouped.median_ns),
            fmt_ns(r.grouped.p90_ns),
            fmt_ns(r.flat.median_ns),
            fmt_ns(r.flat.p90_ns),
            fmt_ns(r.build.median_ns),
            fmt_ns(r.split.median_ns),
            fmt_ns(r.flat_build_ns),
            fmt_ns(r.flat_build_split_ns),
            f"{r.grouped_vs_flat_build:.3f}",
            f"{r.grouped_vs_flat:.2f}",
        )
        for r in rows
    ]
    return columns(header, body, right=set(range(2, len(header))))


def ratio_range(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.3g}x" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}x-{hi:.3g}x"


def grouped_summary(rows: list[GroupedRow]) -> list[str]:
    if not rows:
        return []
    failed = [r for r in rows if not r.goal_holds]
    verdict = (
        "FAILS on " + ", ".join(f"{r.fill} ({r.layout})" for r in failed) if failed else f"holds ({len(rows)} rows)"
    )
    return [
        f"goal: grouped <= flat + build at 262,144 keys (same run): {verdict}; grouped takes "
        f"{ratio_range([r.grouped_vs_flat_build for r in rows])} the time of flat + build",
        f"grouped against flat + build + split: {ratio_range([r.grouped_vs_flat_build_split for r in rows])} the time",
        f"grouped against the flat pipeline alone (map already built): "
        f"{ratio_range([r.grouped_vs_flat for r in rows])} the time; faster on "
        f"{sum(r.grouped_vs_flat < 1 for r in rows)} of {len(rows)} rows",
    ]


def summary(rows: list[Row]) -> list[str]:
    lines = []
    checks = [
        (f"full pipeline at 262,144 keys <= {GOAL_US_AT_262K:g} us", f"<= {GOAL_US_AT_262K:g} us"),
        (f"full pipeline at 4M keys <= {GOAL_US_AT_4M:g} us", f"<= {GOAL_US_AT_4M:g} us"),
        (f">= {GOAL_SPEEDUP:g}x faster than the reference (same run)", f">= {GOAL_SPEEDUP:g}x"),
    ]
    for text, key in checks:
        results = [(r, r.goals[key]) for r in rows if key in r.goals]
        measured = [(r, ok) for r, ok in results if ok is not None]
        failed = [r for r, ok in measured if not ok]
        if not measured:
            verdict = "not measured"
        elif failed:
            verdict = "FAILS on " + ", ".join(f"{r.case} ({r.layout})" for r in failed)
        else:
            verdict = f"holds ({len(measured)} rows)"
        if len(measured) < len(results):
            verdict += f"; {len(results) - len(measured)} rows not measured"
        lines.append(f"goal: {text}: {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="skip the reference on the 4M-key case (it takes seconds per run)"
    )
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="reference runs per case (default 3)")
    p.add_argument(
        "--native-runs", type=int, default=200, metavar="N", help="minimum native runs per case (default 200)"
    )
    p.add_argument(
        "--native-seconds",
        type=float,
        default=0.5,
        metavar="S",
        help="minimum native timing time per case, seconds (default 0.5)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the results as JSON: to stdout instead of the table, or to PATH",
    )
    p.add_argument(
        "--grouped-only", action="store_true", help="run only the grouped-against-flat section at 262,144 keys"
    )
    args = p.parse_args(argv)
    if args.repeat < 1 or args.native_runs < 1 or args.native_seconds < 0:
        p.error("--repeat and --native-runs must be >= 1, --native-seconds >= 0")

    if hmem.kernels.KERNEL_SET != "native":
        sys.stderr.write(
            f"hmem runs the {hmem.kernels.KERNEL_SET} kernels ({hmem.kernels.KERNELS_ENV} is set): "
            "this benchmark measures the native ones; unset it.\n"
        )
        return 2

    json_only = args.json == "-"
    out = sys.stderr if json_only else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    facts = machine_facts()
    print("hmem prefix-hit bitmap benchmark (scripts/bench_bitmap.py)", file=out)
    for k, v in facts.items():
        print(f"  {k:9} {v}", file=out)
    print(f"  windows   {WINDOWS}", file=out)
    print(
        f"  timing    native: median/p90 of >= {args.native_runs} runs and >= {args.native_seconds:g} s per case "
        f"(gc off); reference: median of {args.repeat} run(s){', skipped on the 4M case' if args.quick else ''}",
        file=out,
        flush=True,
    )
    print(
        f"  grouped   {len(WINDOWS)} groups x {GROUPED_RANKS} ranks x {GROUPED_CHUNKS} chunks "
        f"({len(WINDOWS) * GROUPED_RANKS} rows); grouped, flat, build and split each timed as native",
        file=out,
        flush=True,
    )

    rows = []
    if not args.grouped_only:
        for case in CASES:
            for layout in (Layout.GROUP_MAJOR, Layout.CHUNK_MAJOR):
                rows.append(run_case(case, layout, args, log))
    grouped_rows = []
    for fill in GROUPED_FILLS:
        grouped_rows += run_grouped(fill, args, log)

    result = {
        "machine": facts,
        "windows": list(WINDOWS),
        "settings": {
            "quick": args.quick,
            "repeat": args.repeat,
            "native_runs": args.native_runs,
            "native_seconds": args.native_seconds,
            "grouped_only": args.grouped_only,
        },
        "rows": [asdict(r) for r in rows],
        "goals": summary(rows) if rows else [],
        "grouped": {
            "chunks": GROUPED_CHUNKS,
            "ranks": GROUPED_RANKS,
            "rows": [asdict(r) for r in grouped_rows],
            "goals": grouped_summary(grouped_rows),
        },
    }
    if not json_only:
        if rows:
            print(file=out)
            print(render_table(rows), file=out)
            print(file=out)
            for line in summary(rows):
                print(line, file=out)
        print(file=out)
        print(
            f"grouped against flat, {len(WINDOWS)} groups x {GROUPED_RANKS} ranks x {GROUPED_CHUNKS} chunks "
            "(262,144 keys):",
            file=out,
        )
        print(render_grouped_table(grouped_rows), file=out)
        print(file=out)
        for line in grouped_summary(grouped_rows):
            print(line, file=out)
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
