"""The one place that chooses between the native kernels and their
pure-Python reference twins.

- ``HMEM_KERNELS=native`` (the default) loads the compiled Cython kernels.
  When they are missing, importing hmem fails with KernelUnavailableError:
  hmem never falls back to the slow path on its own.
- ``HMEM_KERNELS=reference`` uses hmem._reference, explicitly and slowly.
- ``HMEM_CPU=portable|popcnt|avx512-vpopcntdq`` caps the native CPU path
  (the fastest one the CPU supports is used otherwise); tests use it to run
  every path against the reference.
"""

from __future__ import annotations

import os

from hmem.errors import KernelUnavailableError

KERNELS_ENV = "HMEM_KERNELS"
CPU_ENV = "HMEM_CPU"

_mode = os.environ.get(KERNELS_ENV, "native").strip().lower() or "native"

if _mode == "reference":
    from hmem._reference import bitops
elif _mode == "native":
    try:
        from hmem._native import _bitops as bitops
    except ImportError as exc:  # the extension was not built or cannot load
        raise KernelUnavailableError(
            f"hmem's compiled kernels cannot be loaded ({exc})",
            hint="reinstall with 'pip install .' on a machine with gcc, "
            f"or set {KERNELS_ENV}=reference to run the slow pure-Python kernels",
        ) from exc
else:
    raise KernelUnavailableError(
        f"unknown {KERNELS_ENV}={_mode!r}", hint="use 'native' or 'reference'"
    )

KERNEL_SET: str = _mode


def _select_cpu_path() -> None:
    wanted = os.environ.get(CPU_ENV, "").strip().lower()
    if KERNEL_SET != "native" or not wanted:
        return
    if wanted not in bitops.PATH_NAMES:
        raise KernelUnavailableError(
            f"unknown {CPU_ENV}={wanted!r}", hint="use one of " + ", ".join(bitops.PATH_NAMES)
        )
    bitops.select_path(bitops.PATH_NAMES.index(wanted))


def select_cpu_path(name: str | None) -> str:
    """Cap the CPU path at `name` (None: the fastest supported); returns the path in use."""
    if KERNEL_SET == "native":
        limit = len(bitops.PATH_NAMES) - 1 if name is None else bitops.PATH_NAMES.index(name)
        bitops.select_path(limit)
    return cpu_path()


def cpu_path() -> str:
    """Name of the CPU path the kernels use now."""
    return bitops.PATH_NAMES[bitops.active_path()]


def available_cpu_paths() -> tuple[str, ...]:
    """Every CPU path this machine can run, slowest first."""
    return bitops.PATH_NAMES[: bitops.best_path() + 1]


def describe() -> str:
    """One line for --version and stats: which kernels and CPU path run."""
    return f"kernels: {KERNEL_SET}, cpu path: {cpu_path()}"


select_cpu_path(None)
_select_cpu_path()
