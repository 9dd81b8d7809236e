"""The one place that chooses between the native kernels and their
pure-Python reference twins.

- ``HMEM_KERNELS=native`` (the default) uses the compiled Cython kernels.
  When they are missing, the first use of a kernel raises
  KernelUnavailableError: hmem never falls back to the slow path on its own.
  (Loading happens on first use so that ``import hmem`` and the command
  line can still start and report the problem in one line.)
- ``HMEM_KERNELS=reference`` uses hmem.kernels.reference, explicitly and slowly.
- ``HMEM_CPU=portable|popcnt|avx512-vpopcntdq`` caps the native CPU path of
  every kernel module (the fastest one the CPU supports is used otherwise);
  tests use it to run every path against the reference.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from hmem.errors import KernelUnavailableError

if TYPE_CHECKING:
    from hmem.kernels._interface import (
        BitopsKernels,
        ChecksumKernels,
        EntriesKernels,
        HammingKernels,
        HeaderTextKernels,
        KernelModule,
        ProjectionKernels,
        QuantizeKernels,
    )

KERNELS_ENV = "HMEM_KERNELS"
CPU_ENV = "HMEM_CPU"
KERNEL_SETS = ("native", "reference")

KERNEL_SET: str = os.environ.get(KERNELS_ENV, "native").strip().lower() or "native"


def _import(name: str) -> ModuleType:
    if KERNEL_SET == "reference":
        return importlib.import_module(f"hmem.kernels.reference.{name}")
    if KERNEL_SET != "native":
        raise KernelUnavailableError(f"unknown {KERNELS_ENV}={KERNEL_SET!r}", hint="use 'native' or 'reference'")
    try:
        module = importlib.import_module(f"hmem.kernels._native._{name}")
    except ImportError as exc:  # the extension was not built or cannot load
        raise KernelUnavailableError(
            f"hmem's compiled kernels cannot be loaded ({exc})",
            hint="reinstall with 'pip install .' on a machine with gcc, "
            f"or set {KERNELS_ENV}=reference to run the slow pure-Python kernels",
        ) from exc
    _apply_cpu_env(module)
    return module


def _apply_cpu_env(module: KernelModule) -> None:
    wanted = os.environ.get(CPU_ENV, "").strip().lower()
    names = module.PATH_NAMES
    if not wanted:
        module.select_path(len(names) - 1)
        return
    if wanted not in names:
        raise KernelUnavailableError(f"unknown {CPU_ENV}={wanted!r}", hint="use one of " + ", ".join(names))
    module.select_path(names.index(wanted))


class _KernelModule:
    """Stands for one kernel module; loads it on first attribute access and
    then holds its functions as plain attributes (no per-call indirection)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = _import(self.__dict__["_name"])
        for key in dir(module):
            if not key.startswith("__"):
                self.__dict__[key] = getattr(module, key)
        return getattr(module, attr)


# Each stand-in is typed as the interface its module implements in both
# kernel sets (the casts are checked below), so that mypy checks every call
# into a kernel.
bitops = cast("BitopsKernels", _KernelModule("bitops"))
checksum = cast("ChecksumKernels", _KernelModule("checksum"))
entries = cast("EntriesKernels", _KernelModule("entries"))
header_text = cast("HeaderTextKernels", _KernelModule("header_text"))
hamming = cast("HammingKernels", _KernelModule("hamming"))
projection = cast("ProjectionKernels", _KernelModule("projection"))
quantize = cast("QuantizeKernels", _KernelModule("quantize"))

_MODULES: tuple[KernelModule, ...] = (bitops, checksum, entries, header_text, hamming, projection, quantize)

if TYPE_CHECKING:
    # What makes the casts above safe: mypy checks that the compiled modules
    # (through their stubs) and their reference twins, whichever _import
    # returns, implement each interface.  Never run.
    from hmem.kernels._native import (
        _bitops,
        _checksum,
        _entries,
        _hamming,
        _header_text,
        _projection,
        _quantize,
    )
    from hmem.kernels.reference import bitops as reference_bitops
    from hmem.kernels.reference import checksum as reference_checksum
    from hmem.kernels.reference import entries as reference_entries
    from hmem.kernels.reference import hamming as reference_hamming
    from hmem.kernels.reference import header_text as reference_header_text
    from hmem.kernels.reference import projection as reference_projection
    from hmem.kernels.reference import quantize as reference_quantize

    _native_bitops: BitopsKernels = _bitops
    _reference_bitops: BitopsKernels = reference_bitops
    _native_checksum: ChecksumKernels = _checksum
    _reference_checksum: ChecksumKernels = reference_checksum
    _native_entries: EntriesKernels = _entries
    _reference_entries: EntriesKernels = reference_entries
    _native_header_text: HeaderTextKernels = _header_text
    _reference_header_text: HeaderTextKernels = reference_header_text
    _native_hamming: HammingKernels = _hamming
    _reference_hamming: HammingKernels = reference_hamming
    _native_projection: ProjectionKernels = _projection
    _reference_projection: ProjectionKernels = reference_projection
    _native_quantize: QuantizeKernels = _quantize
    _reference_quantize: QuantizeKernels = reference_quantize


def select_cpu_path(name: str | None) -> str:
    """Cap the CPU path at `name` (None: the fastest supported); returns the path in use.

    Applies to every kernel module (loading any not loaded yet): each native
    extension has its own copy of the path switch."""
    for module in _MODULES:
        names = module.PATH_NAMES
        module.select_path(len(names) - 1 if name is None else names.index(name))
    return cpu_path()


def cpu_path() -> str:
    """Name of the CPU path the kernels use now."""
    return bitops.PATH_NAMES[bitops.active_path()]


def available_cpu_paths() -> tuple[str, ...]:
    """Every CPU path this machine can run, slowest first."""
    return tuple(bitops.PATH_NAMES[: bitops.best_path() + 1])


def describe() -> str:
    """One line for --version and stats: which kernels and CPU path run."""
    return f"kernels: {KERNEL_SET}, cpu path: {cpu_path()}"
