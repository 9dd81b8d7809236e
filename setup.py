"""Build of hmem's compiled kernels.

All compiler settings live here.  The kernels are compiled for a portable
baseline of the target architecture (no -march=native): faster instruction
paths (hardware popcount, AVX-512 VPOPCNTDQ) are compiled as separate
functions with per-function target attributes in ``hmem/kernels/_native/bitops.h``
and chosen at run time from the CPU's feature flags.  -ffp-contract=off
keeps the compiler from fusing a multiply and an add: the signature
projection must give the same bits as its numpy reference.
"""

from glob import glob

from Cython.Build import cythonize
from setuptools import Extension, setup

COMPILE_ARGS = ["-O3", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unused-function"]

extensions = [
    Extension(
        f"hmem.kernels._native.{name}",
        [f"hmem/kernels/_native/{name}.pyx"],
        depends=sorted(glob("hmem/kernels/_native/*.h") + glob("hmem/kernels/_native/*.pxi")),
        include_dirs=["hmem/kernels/_native"],
        extra_compile_args=COMPILE_ARGS,
    )
    for name in ("_bitops", "_checksum", "_entries", "_header_text", "_hamming", "_projection", "_quantize")
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )
)
