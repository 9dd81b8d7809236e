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

Usage::

    python scripts/bench_bitmap.py            # full run, reference on every case
    python scripts/bench_bitmap.py --quick    # no reference on the 4M-key case
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
from dataclasses import asdict, dataclass, field

import hmem
from hmem import Bitmap, Layout
from hmem.kernels.reference import bitops as ref
from benchlib import machine_facts

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


def time_native(found: Bitmap, case: Case, layout: Layout, min_runs: int, min_seconds: float) -> list[int]:
    """Per-call times (ns) of hmem.fold_unfold_ranked, after a warm-up."""
    C, R = case.chunks, case.ranks
    call = hmem.fold_unfold_ranked
    clock = time.perf_counter_ns
    warm_end = clock() + 50_000_000  # 50 ms or 20 calls, whichever is longer
    for i in range(1_000_000):
        call(found, C, R, WINDOWS, layout)
        if i >= 19 and clock() >= warm_end:
            break
    times: list[int] = []
    deadline = clock() + int(min_seconds * 1e9)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        while len(times) < min_runs or (clock() < deadline and len(times) < 1_000_000):
            t0 = clock()
            call(found, C, R, WINDOWS, layout)
            times.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


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
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    right = {2, 3, 4, 5, 6, 7}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


def summary(rows: list[Row]) -> list[str]:
    lines = []
    checks = [(f"full pipeline at 262,144 keys <= {GOAL_US_AT_262K:g} us", f"<= {GOAL_US_AT_262K:g} us"),
              (f"full pipeline at 4M keys <= {GOAL_US_AT_4M:g} us", f"<= {GOAL_US_AT_4M:g} us"),
              (f">= {GOAL_SPEEDUP:g}x faster than the reference (same run)", f">= {GOAL_SPEEDUP:g}x")]
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="skip the reference on the 4M-key case (it takes seconds per run)")
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="reference runs per case (default 3)")
    p.add_argument("--native-runs", type=int, default=200, metavar="N", help="minimum native runs per case (default 200)")
    p.add_argument("--native-seconds", type=float, default=0.5, metavar="S",
                   help="minimum native timing time per case, seconds (default 0.5)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the results as JSON: to stdout instead of the table, or to PATH")
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

    rows = []
    for case in CASES:
        for layout in (Layout.GROUP_MAJOR, Layout.CHUNK_MAJOR):
            rows.append(run_case(case, layout, args, log))

    result = {
        "machine": facts,
        "windows": list(WINDOWS),
        "settings": {"quick": args.quick, "repeat": args.repeat, "native_runs": args.native_runs,
                     "native_seconds": args.native_seconds},
        "rows": [asdict(r) for r in rows],
        "goals": summary(rows),
    }
    if not json_only:
        print(file=out)
        print(render_table(rows), file=out)
        print(file=out)
        for line in summary(rows):
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
