"""Helpers shared by the benchmark scripts: machine facts, timing, and the
stores a benchmark builds once and keeps."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import hmem


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_facts() -> dict[str, str]:
    import numpy

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "hmem": hmem.__version__,
        "kernels": hmem.kernels.describe(),
        "cpu_paths": ", ".join(hmem.kernels.available_cpu_paths()),
        "cpu": cpu_model(),
        "cpus": str(os.cpu_count()),
        "platform": platform.platform(),
        "numpy": numpy.__version__,
    }


def print_machine_facts() -> None:
    for key, value in machine_facts().items():
        print(f"{key:>10}: {value}")
    print()


def compile_like_an_install() -> str:
    """Compile hmem's modules to bytecode, as `pip install` does, so that a
    benchmark's `hmem` subprocesses start as they do on a user's machine.
    An editable install never compiles them, and with PYTHONDONTWRITEBYTECODE
    set (as on the machine these benchmarks run on) nothing caches them: each
    `hmem` command would compile every module again (about 0.25 s here).
    Returns a line saying what was done, for the benchmark to print."""
    import compileall
    from pathlib import Path

    package = Path(hmem.__file__).parent
    compileall.compile_dir(package, quiet=1)
    return (
        f"hmem's modules compiled to bytecode as an install does ({package}); "
        f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '(unset)')}"
    )


def time_calls(
    fn: Callable[[], object], *, min_runs: int = 20, min_seconds: float = 0.2, max_runs: int = 100_000
) -> list[float]:
    """Seconds per call of `fn`, after one warm-up call, garbage collection off."""
    fn()
    samples: list[float] = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        while len(samples) < max_runs and (len(samples) < min_runs or time.perf_counter() - start < min_seconds):
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1e9)
    finally:
        if gc_was:
            gc.enable()
    return samples


def samples_in_turns(cases: dict[str, Callable[[int], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of every call of each case over `rounds` rounds: in round i
    every case is called once with i, the cases taking turns (so each meets
    the caches the others leave, as queries of a serving process do, and
    load from other work on the machine falls on all alike); garbage
    collection off."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(rounds):
            for name, fn in cases.items():
                t0 = time.perf_counter_ns()
                fn(i)
                times[name].append((time.perf_counter_ns() - t0) / 1e9)
    finally:
        if gc_was:
            gc.enable()
    return times


def medians_in_turns(cases: dict[str, Callable[[int], object]], rounds: int) -> dict[str, float]:
    """The median of each case's samples_in_turns."""
    return {name: statistics.median(t) for name, t in samples_in_turns(cases, rounds).items()}


def log(msg: str) -> None:
    """A progress line on stderr (the results go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def native_kernels() -> bool:
    """Whether the native kernels are in use; says why not on stderr
    otherwise (a benchmark of hmem's speed measures them)."""
    if hmem.kernels.KERNEL_SET == "native":
        return True
    sys.stderr.write("this benchmark measures the native kernels: unset HMEM_KERNELS\n")
    return False


def print_goals(goals: list[dict], out=None) -> None:
    """One line per goal: holds or MISSED, the goal, the figures."""
    for g in goals:
        print(f"{'holds' if g['holds'] else 'MISSED'}: {g['goal']} ({g['detail']})", file=out or sys.stdout)


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def fmt_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:,.0f} MB/s"


def kept_store(
    path: Path, config: hmem.StoreConfig, build: Callable[[], object], log: Callable[[str], None]
) -> float | None:
    """A store that a benchmark builds once and keeps at `path` (a directory
    of the benchmark's own): built by `build` when absent, and built again
    when the kept one has other settings than `config`, what `build` makes
    today. A store kept from before a default changed would otherwise
    measure the old setting (the kept stores of 2026-12-01 mapped 4 shards
    at once, while new stores map 256). Returns the seconds `build` took,
    or None when the kept store was used."""
    if (path / "index.json").exists():
        with hmem.Store.open(path, read_only=True) as kept:
            old = kept.config
        if old == config:
            return None
        changed = ", ".join(
            f"{name} {getattr(old, name)!r} (now {getattr(config, name)!r})"
            for name in config.__dataclass_fields__
            if getattr(old, name) != getattr(config, name)
        )
        log(f"{path} was built with {changed}: building it again")
        shutil.rmtree(path)
    start = time.perf_counter()
    build()
    return time.perf_counter() - start
