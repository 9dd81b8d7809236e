"""Shared test settings and fixtures.

Hypothesis profiles (pick one with HYPOTHESIS_PROFILE=<name>):

- ``ci`` (default): no deadline (shared 2-core runners stall), no example
  database (runs do not depend on earlier runs), a moderate example count
  that keeps the whole suite well under a minute;
- ``dev``: fewer examples, for a quick edit-test loop;
- ``thorough``: many examples, for a soak run before a release.

Tests run with ``--import-mode=importlib``, so they cannot import each other or
this file; shared helpers are fixtures.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, settings

from hmem import kernels
from hmem._native import _bitops

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

settings.register_profile("ci", max_examples=150, database=None, **_COMMON)
settings.register_profile("dev", max_examples=20, **_COMMON)
settings.register_profile("thorough", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ---- CPU paths of the native kernels ----------------------------------------


def _native_paths() -> tuple[str, ...]:
    if kernels.KERNEL_SET == "native":
        return kernels.available_cpu_paths()
    # HMEM_KERNELS=reference: hmem.kernels does not drive the native module,
    # so drive it directly (the twin tests still compare it to the reference).
    return _bitops.PATH_NAMES[: _bitops.best_path() + 1]


def _current() -> str:
    if kernels.KERNEL_SET == "native":
        return kernels.cpu_path()  # loads the kernels (and applies HMEM_CPU) if not yet done
    return _bitops.PATH_NAMES[_bitops.active_path()]


def _select(name: str) -> str:
    if kernels.KERNEL_SET == "native":
        return kernels.select_cpu_path(name)
    return _bitops.PATH_NAMES[_bitops.select_path(_bitops.PATH_NAMES.index(name))]


@contextmanager
def _on_cpu_path(name: str) -> Iterator[str]:
    """Run the native kernels on CPU path `name`, then restore the path in use before."""
    before = _current()
    used = _select(name)
    assert used == name, f"asked for CPU path {name!r}, got {used!r}"
    assert _bitops.PATH_NAMES[_bitops.active_path()] == name
    try:
        yield name
    finally:
        _select(before)


@pytest.fixture(scope="session")
def cpu_paths() -> tuple[str, ...]:
    """Every CPU path of the native kernels this machine can run, slowest first."""
    paths = _native_paths()
    assert paths and paths[0] == "portable"
    return paths


@pytest.fixture(scope="session")
def on_cpu_path():
    """A context manager: ``with on_cpu_path("popcnt"): ...``."""
    return _on_cpu_path


@pytest.fixture(scope="session")
def on_every_cpu_path(cpu_paths) -> Callable[[Callable[[], object]], dict[str, object]]:
    """``on_every_cpu_path(fn)`` calls fn once per CPU path and returns {path: result}."""

    def run(fn: Callable[[], object]) -> dict[str, object]:
        out = {}
        for name in cpu_paths:
            with _on_cpu_path(name):
                out[name] = fn()
        return out

    return run


@pytest.fixture(scope="module", autouse=True)
def _restore_cpu_path() -> Iterator[None]:
    """Whatever a test module does to the CPU path, the next module starts from the same one."""
    before = _current()
    yield
    _select(before)
    assert _current() == before
