"""The caches LMCache 0.5.6 itself writes, once per test session: its real
engine runs on the CPU in its own environment (HMEM_LMCACHE_PYTHON, made
by .ci/run; tests/lmcache/lmcache_writer.py), and what it reports is the
oracle (oracle.json beside the caches).  Without that environment the
tests that need it are skipped; the small caches committed in
tests/data/lmcache/ (written the same way) need nothing."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import pytest

WRITER = Path(__file__).with_name("lmcache_writer.py")


@pytest.fixture(scope="session")
def lmcache_python() -> str:
    """The interpreter of an environment with LMCache 0.5.6 and hmem (.ci/run makes one)."""
    python = os.environ.get("HMEM_LMCACHE_PYTHON")
    if not python:
        pytest.skip("HMEM_LMCACHE_PYTHON names no interpreter with LMCache 0.5.6 (.ci/run makes one)")
    return python


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> tuple[Path, dict]:
    python = os.environ.get("HMEM_LMCACHE_PYTHON")
    if not python:
        pytest.skip("HMEM_LMCACHE_PYTHON names no interpreter with LMCache 0.5.6 (.ci/run makes one)")
    # One run for the whole session, shared by pytest-xdist's workers: the
    # first to take the lock writes, the others wait for the lock, then read.
    # The caches are read-only to the tests: a test that changes one copies it first.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is a directory of this run's
        shared = shared.parent
    out = shared / "lmcache-caches"
    with open(shared / "lmcache-caches.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "oracle.json").exists():
            out.mkdir(exist_ok=True)
            run = subprocess.run([python, str(WRITER), str(out)], capture_output=True, text=True, timeout=900)
            assert run.returncode == 0, run.stderr[-4000:]
    return out, json.loads((out / "oracle.json").read_text())
