"""What each kernel module offers its callers, whichever kernel set runs.

hmem.kernels hands out its modules typed as these protocols, so mypy checks
every call into a kernel against them; under ``if TYPE_CHECKING:`` it also
checks that both sets implement them: the compiled modules (through their
stubs, hmem/kernels/_native/*.pyi, which tests/test_kernel_stubs.py holds to
the compiled functions) and their pure-Python twins in
hmem.kernels.reference.  A parameter here is typed as what both sets accept;
a native kernel may accept more (its stub says what).

hmem imports this module for type checking only; tests/test_kernel_stubs.py
imports it to compare its parameter names with the stubs' (mypy does not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from numpy.typing import NDArray
    from typing_extensions import Buffer

    # Bit maps, signatures, sign tables: 1-d C-contiguous unsigned bytes,
    # writable where a kernel writes.
    Bytes: TypeAlias = bytes | bytearray | memoryview | NDArray[np.uint8]
    WritableBytes: TypeAlias = bytearray | memoryview | NDArray[np.uint8]
    # Checksums cover the raw bytes of any C-contiguous buffer.  numpy
    # declares its arrays buffers to type checkers of Python 3.12+ only,
    # hence NDArray besides Buffer.
    AnyBuffer: TypeAlias = Buffer | NDArray[Any]
    # One entry per signature row, 0 (or False) = skip the row.
    Alive: TypeAlias = NDArray[np.uint8] | NDArray[np.bool_] | None


class KernelModule(Protocol):
    """The CPU-path switch every kernel module has (hmem.kernels drives it)."""

    # Read-only: the native modules list three paths, the twins one.
    @property
    def PATH_NAMES(self) -> tuple[str, ...]: ...

    def best_path(self) -> int: ...

    def select_path(self, limit: int) -> int: ...

    def active_path(self) -> int: ...


class BitopsKernels(KernelModule, Protocol):
    def popcount(self, buf: Bytes, nbits: int) -> int: ...

    def highest_set_bit(self, buf: Bytes, nbits: int) -> int: ...

    def next_bit(self, buf: Bytes, start: int, end: int, want: int) -> int: ...

    def set_range(self, buf: WritableBytes, start: int, end: int) -> None: ...

    def clear_range(self, buf: WritableBytes, start: int, end: int) -> None: ...

    def fold_into(
        self, found: Bytes, C: int, R: int, windows: Sequence[int], chunk_major: bool, out: WritableBytes
    ) -> None: ...

    def unfold_into(
        self, hit: int, C: int, R: int, windows: Sequence[int], chunk_major: bool, out: WritableBytes
    ) -> None: ...

    def fold_rows_into(self, rows: Sequence[Bytes], C: int, windows: Sequence[int], out: WritableBytes) -> None: ...

    def unfold_rows_into(self, hit: int, C: int, windows: Sequence[int], outs: Sequence[WritableBytes]) -> None: ...


class ChecksumKernels(KernelModule, Protocol):
    def crc32c(self, data: AnyBuffer, crc: int = 0) -> int: ...

    def crc32c_rows(self, rows: NDArray[np.uint8], skip_start: int, skip_end: int) -> NDArray[np.uint32]: ...

    def crc32c_pieces(self, data: AnyBuffer, bounds: NDArray[np.int64]) -> NDArray[np.uint32]: ...

    def read_checked(
        self, fd: int, offsets: NDArray[np.int64], buffers: list[Any], crcs: NDArray[np.uint32]
    ) -> int: ...


class EntriesKernels(KernelModule, Protocol):
    def scan_entries(
        self,
        items: list[Any],
        dim: int,
        max_tokens: int,
        max_layer: int,
        max_importance: float,
        tokens: NDArray[np.int64],
        layers: NDArray[np.int64],
        weights: NDArray[np.float64],
        entry_type: type | None = None,
    ) -> int: ...

    def join_rows(
        self,
        items: list[Any],
        starts: NDArray[np.int64],
        k_out: NDArray[np.float32],
        v_out: NDArray[np.float32],
        entry_type: type | None = None,
    ) -> None: ...


class HeaderTextKernels(KernelModule, Protocol):
    def tensor_entries(
        self,
        prefix: bytes,
        ids: NDArray[np.int64],
        dtype: bytes,
        shapes: NDArray[np.int64],
        begins: NDArray[np.int64],
        ends: NDArray[np.int64],
    ) -> bytes: ...

    def crc_entries(self, prefix: bytes, ids: NDArray[np.int64], crcs: NDArray[np.uint32]) -> bytes: ...


class HammingKernels(KernelModule, Protocol):
    def distances(self, query: Bytes, sigs: NDArray[np.uint8]) -> NDArray[np.int32]: ...

    def topk(
        self,
        query: Bytes,
        sigs: NDArray[np.uint8],
        alive: Alive,
        k: SupportsIndex,
        lo: int = 0,
        hi: int | None = None,
    ) -> tuple[NDArray[np.int64], NDArray[np.int32]]: ...

    def topk_many(
        self,
        queries: NDArray[np.uint8],
        sigs: NDArray[np.uint8],
        alive: Alive,
        k: SupportsIndex,
        lo: int = 0,
        hi: int | None = None,
    ) -> tuple[NDArray[np.int64], NDArray[np.int32], NDArray[np.int64]]: ...

    def gather_rows(self, src: NDArray[np.uint8], rows: NDArray[np.int64], out: NDArray[np.uint8]) -> None: ...


class ProjectionKernels(KernelModule, Protocol):
    def splitmix64(self, seed: SupportsIndex, count: SupportsIndex) -> NDArray[np.uint64]: ...

    def signs_table(
        self, seed: SupportsIndex, m: SupportsIndex, rounds: SupportsIndex, blocks: SupportsIndex
    ) -> NDArray[np.uint8]: ...

    def signature(
        self,
        rows: NDArray[np.float32],
        signs: Bytes,
        m: SupportsIndex,
        rounds: SupportsIndex,
        hdc_dim: SupportsIndex,
        out: WritableBytes,
        sums: NDArray[np.float64] | None = None,
    ) -> None: ...

    def signature_many(
        self,
        rows: NDArray[np.float32],
        starts: NDArray[np.int64],
        signs: Bytes,
        m: SupportsIndex,
        rounds: SupportsIndex,
        hdc_dim: SupportsIndex,
        out: NDArray[np.uint8],
        sums: NDArray[np.float64] | None = None,
    ) -> None: ...

    def signature_of_sum(
        self,
        sums: NDArray[np.float64],
        signs: Bytes,
        m: SupportsIndex,
        rounds: SupportsIndex,
        hdc_dim: SupportsIndex,
        out: WritableBytes,
    ) -> None: ...

    def bf16_token_sums(self, words: NDArray[np.uint16], sums: NDArray[np.float64]) -> None: ...


class QuantizeKernels(KernelModule, Protocol):
    def quantize_rows(self, rows: NDArray[np.float32], q: NDArray[np.int8], scales: NDArray[np.float32]) -> None: ...

    def dequantize_rows(self, q: NDArray[np.int8], scales: NDArray[np.float32], out: NDArray[np.float32]) -> None: ...
