# The CPU-path switch of a kernel module whose code is the same on every
# path (no code compiled per path, nothing from bitops.h): it is kept so
# that hmem.kernels can treat every module alike.  Included, not imported,
# as cpu_paths.pxi is by the modules that do switch.

PATH_NAMES = ("portable", "popcnt", "avx512-vpopcntdq")
_path = len(PATH_NAMES) - 1


def best_path():
    """Index in PATH_NAMES of the fastest path (every one runs the same code)."""
    return len(PATH_NAMES) - 1


def select_path(int limit):
    """Note the path asked for, as the other modules do; returns its index."""
    global _path
    _path = max(0, min(limit, len(PATH_NAMES) - 1))
    return _path


def active_path():
    return _path
