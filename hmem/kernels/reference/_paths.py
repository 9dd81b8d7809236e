"""The CPU-path switch of every reference kernel module.

hmem.kernels drives each kernel module through the same four names (the
KernelModule protocol of hmem/kernels/_interface.py).  The native modules
pick among several CPU paths at run time (cpu_paths.pxi, one_path.pxi); the
reference set is plain Python with one path only, so its switch always
answers path 0 and every reference module re-exports this one copy.
"""

from __future__ import annotations

PATH_NAMES = ("reference",)


def best_path() -> int:
    """Index in PATH_NAMES of the fastest path: the only one."""
    return 0


def select_path(limit: int) -> int:
    """Accepts any cap, as the native modules do; the one path stays in use."""
    return 0


def active_path() -> int:
    return 0
