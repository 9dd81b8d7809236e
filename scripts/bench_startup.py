"""How long an `hmem` command takes to start, beside the floors it stands on.

Every `hmem` command pays its start-up before any work: the interpreter,
numpy, hmem's modules, Typer and Rich, and the parsing of its options.
Operators run hmem from shells and cron, often many times over, so this is
a cost they see.  Measured in the same run, each a fresh process, the cases
taking turns:

- floors: `python -c pass`, `python -c "import numpy"`, `python -c "import
  hmem"` (the library alone, as a program using it pays);
- commands: `hmem --version`, `hmem stats STORE` (a small store: the open
  included; a table printed through Rich), `hmem stats STORE --json` (the
  same, as a script runs it: no Rich), `hmem put STORE EMPTY_DIR` (every
  option parsed, then "no .safetensors files found", exit 2).

With `--compare-path DIR`, every command also runs with DIR first on
PYTHONPATH (for example a folder holding another Typer release, installed
with `pip install --target DIR --no-deps typer==X`), taking turns with the
installed one: the difference is what that folder's packages cost (or, a
folder holding another hmem tree, what its code costs).

Usage::

    python scripts/bench_startup.py
    python scripts/bench_startup.py --rounds 15 --compare-path /tmp/typer-0.29
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import compile_like_an_install, print_machine_facts

import hmem


def hmem_executable() -> str:
    found = shutil.which("hmem", path=str(Path(sys.executable).parent))
    return found or "hmem"


def wall(argv: list[str], env: dict[str, str], expect: set[int]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode not in expect:
        raise SystemExit(f"{argv} exited {done.returncode}: {done.stderr.decode(errors='replace')}")
    return seconds


def typer_version(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import typer; print(typer.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument(
        "--compare-path",
        type=Path,
        default=None,
        help="also run every hmem command with this folder first on PYTHONPATH",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()

    print_machine_facts()
    print(compile_like_an_install())
    root = Path(tempfile.mkdtemp(prefix="hmem-bench-startup-"))
    try:
        store = root / "store"
        with hmem.Store.create(store, embed_dim=64) as s:
            rng = np.random.default_rng(0)
            s.put_many(
                [
                    (
                        rng.standard_normal((4, 64), dtype=np.float32),
                        rng.standard_normal((4, 64), dtype=np.float32),
                        i % 4,
                        1.0,
                    )
                    for i in range(1000)
                ]
            )
        empty = root / "empty"
        empty.mkdir()

        base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        envs = {"installed": base_env}
        if args.compare_path is not None:
            envs["compare"] = dict(base_env, PYTHONPATH=str(args.compare_path.resolve()))
        for name, env in envs.items():
            print(f"typer, {name}: {typer_version(env)}")
        print()

        py = sys.executable
        exe = hmem_executable()
        cases: dict[str, tuple[list[str], str, set[int]]] = {
            "python -c pass": ([py, "-c", "pass"], "installed", {0}),
            "python -c 'import numpy'": ([py, "-c", "import numpy"], "installed", {0}),
            "python -c 'import hmem'": ([py, "-c", "import hmem"], "installed", {0}),
        }
        for env_name in envs:
            tag = "" if env_name == "installed" else " [compare]"
            cases[f"hmem --version{tag}"] = ([exe, "--version"], env_name, {0})
            cases[f"hmem stats STORE{tag}"] = ([exe, "stats", str(store)], env_name, {0})
            cases[f"hmem stats STORE --json{tag}"] = ([exe, "stats", str(store), "--json"], env_name, {0})
            cases[f"hmem put STORE EMPTY_DIR{tag}"] = ([exe, "put", str(store), str(empty)], env_name, {2})

        for argv, env_name, expect in cases.values():  # warm the page cache
            wall(argv, envs[env_name], expect)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (argv, env_name, expect) in cases.items():
                samples[name].append(wall(argv, envs[env_name], expect))

        medians = {name: statistics.median(t) for name, t in samples.items()}
        print(f"  {args.rounds} rounds, cases taking turns{'':<20}{'median':>10}{'best':>10}")
        for name, t in samples.items():
            print(f"  {name:<52}{medians[name] * 1e3:>8.0f} ms{min(t) * 1e3:>7.0f} ms")
        if args.compare_path is not None:
            print()
            for cmd in ("hmem --version", "hmem stats STORE", "hmem stats STORE --json", "hmem put STORE EMPTY_DIR"):
                saved = medians[f"{cmd} [compare]"] - medians[cmd]
                print(f"  {cmd}: {saved * 1e3:+.0f} ms with the compared path")
        if args.json:
            args.json.write_text(json.dumps({"medians": medians, "samples": samples}, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
