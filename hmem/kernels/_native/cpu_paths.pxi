# The CPU-path switch every kernel module built on bitops.h exposes.  It is
# included, not imported: each extension module has its own copy of the
# static path variable in bitops.h, and hmem.kernels sets them all.

cdef extern from "bitops.h" nogil:
    int hm_best_path()
    int hm_select_path(int limit)
    int hm_path

PATH_NAMES = ("portable", "popcnt", "avx512-vpopcntdq")


def best_path():
    """Index in PATH_NAMES of the fastest path this CPU supports."""
    return hm_best_path()


def select_path(int limit):
    """Use the fastest supported path not above `limit`; returns the index used."""
    return hm_select_path(limit)


def active_path():
    return hm_path
