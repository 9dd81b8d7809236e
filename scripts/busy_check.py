"""Run the test suite on a busy machine, several times in a row.

A user runs hmem's tests on a laptop with a browser open, or on a CI runner
shared with other jobs; the suite must pass there too.  This script makes the
machine busy the way that once broke it (issue "A suite that holds on a busy
machine"): CPU-bound Python loops, more of them than there are cores, and a
disk writer whose every write ends in an fsync, so that the tests' own
threads, subprocesses and fsyncs are descheduled and delayed at random.
Then it runs pytest ROUNDS times and reports each round.

    python scripts/busy_check.py                      # 3 rounds of the whole suite
    python scripts/busy_check.py --rounds 1 -- -m "not stress"
    python scripts/busy_check.py --busy 6 --no-disk -- tests/test_interrupts.py

Everything after ``--`` goes to pytest.  The load stops when the script ends,
whatever way it ends.  Exit status: 0 when every round passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One CPU-bound loop, as a separate interpreter: it never sleeps, so the
# scheduler shares the cores between it and the tests.
_BUSY_LOOP = "while True:\n    pass\n"


def _disk_writer(directory: Path) -> subprocess.Popen:
    """A shell loop that writes 64 MiB and fsyncs it, over and over: the
    tests' own fsyncs then wait behind it, as on a disk shared with other work."""
    target = directory / "fill"
    script = f"while true; do dd if=/dev/zero of={target} bs=1M count=64 conv=fsync status=none; done"
    return subprocess.Popen(["sh", "-c", script], start_new_session=True)


def _pytest_command() -> list[str]:
    """pytest as the README runs it.  Not `python -m pytest`: that puts the
    current directory first on sys.path, so in a checkout where hmem is
    installed (not editable) the tests would import the source tree, whose
    kernels are not compiled, instead of the installed package."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "pytest"]  # -P: no current directory on sys.path
    script = Path(sys.executable).with_name("pytest")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pytest"]


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill each load process with its session (the disk writer's dd too)."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="how many times to run pytest (default 3)")
    parser.add_argument("--busy", type=int, default=6, help="CPU-bound Python loops to start (default 6)")
    parser.add_argument("--no-disk", action="store_true", help="no fsyncing disk writer")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args()

    # A SIGTERM (kill, a CI timeout) ends the script through `finally`, as
    # Ctrl-C does: the load runs in sessions of its own and would outlive it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    scratch = Path(tempfile.mkdtemp(prefix="hmem-busy-"))
    load = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP], start_new_session=True) for _ in range(args.busy)]
    if not args.no_disk:
        load.append(_disk_writer(scratch))
    print(f"load: {args.busy} busy loops{'' if args.no_disk else ' and an fsyncing disk writer'}", flush=True)
    results = []
    try:
        for round_number in range(1, args.rounds + 1):
            started = time.monotonic()
            code = subprocess.call([*_pytest_command(), "-q", *args.pytest_args])
            seconds = time.monotonic() - started
            results.append(code)
            print(f"round {round_number}: pytest exit {code} in {seconds / 60:.1f} min", flush=True)
    finally:
        _stop(load)
        shutil.rmtree(scratch, ignore_errors=True)
    passed = sum(code == 0 for code in results)
    print(f"{passed} of {len(results)} rounds passed under load")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
