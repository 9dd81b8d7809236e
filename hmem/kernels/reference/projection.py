"""Plain-numpy twin of hmem.kernels._native._projection, and the executable
definition of hmem's signature projection (the on-disk format fixes it).

- splitmix64(seed, count): outputs k = 0 .. count-1 of SplitMix64:
  z = seed + (k+1) * 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
  z = (z ^ z>>27) * 0x94D049BB133111EB; out = z ^ z>>31 (all mod 2**64).
- signs_table(seed, m, rounds, blocks): the blocks*rounds*m sign bits as one
  stream, bit p in byte p // 8 under mask 1 << (p % 8): the little-endian
  bytes of splitmix64(seed, blocks*rounds*m/64).  Bit (b*rounds + r)*m + i
  set means "negate element i in round r of block b".
- signature(rows, signs, m, rounds, hdc_dim, out): s = the float64 sum of the
  float32 rows (n_tokens, d) in token order, zero-padded to m (d <= m, m a
  power of two >= 64).  For each of blocks = ceil(hdc_dim / m) blocks: v = s;
  `rounds` times: negate where the sign bit is set, then the unnormalised
  fast Walsh-Hadamard transform (Sylvester order).  Bit b*m + i of the
  hdc_dim-bit output (packed LSB-first) is v[i] > 0.0.

Every step is an IEEE double addition, subtraction or negation in a fixed
order, so any correct implementation gives the same bits.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, SupportsIndex

import numpy as np

# the CPU-path switch every kernel module offers hmem.kernels, re-exported
from hmem.kernels.reference._paths import PATH_NAMES as PATH_NAMES
from hmem.kernels.reference._paths import active_path as active_path
from hmem.kernels.reference._paths import best_path as best_path
from hmem.kernels.reference._paths import select_path as select_path

if TYPE_CHECKING:
    from typing import TypeAlias

    from numpy.typing import NDArray

    # As the native kernels take them (hmem/kernels/_native/_projection.pyi).
    _Bytes: TypeAlias = bytes | bytearray | memoryview | NDArray[np.uint8]
    _WritableBytes: TypeAlias = bytearray | memoryview | NDArray[np.uint8]

_MASK64 = (1 << 64) - 1


def _index(name: str, value, lo: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_m(m) -> int:
    m = _index("m", m, 64)
    if m & (m - 1):
        raise ValueError(f"m must be a power of two >= 64, got {m}")
    return m


def splitmix64(seed: SupportsIndex, count: SupportsIndex) -> NDArray[np.uint64]:
    """Outputs 0 .. count-1 of SplitMix64 seeded with `seed` (0 <= seed < 2**64)."""
    seed = _index("seed", seed, 0)
    if seed > _MASK64:
        raise ValueError(f"seed must be below 2**64, got {seed}")
    count = _index("count", count, 0)
    k = np.arange(1, count + 1, dtype=np.uint64)
    z = np.uint64(seed) + k * np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap mod 2**64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def signs_table(
    seed: SupportsIndex, m: SupportsIndex, rounds: SupportsIndex, blocks: SupportsIndex
) -> NDArray[np.uint8]:
    """The blocks*rounds*m sign bits, packed LSB-first: blocks*rounds*m/8 bytes."""
    m = _check_m(m)
    rounds = _index("rounds", rounds, 1)
    blocks = _index("blocks", blocks, 1)
    return splitmix64(seed, blocks * rounds * m // 64).astype("<u8").view(np.uint8)


def fwht(v: np.ndarray) -> None:
    """Unnormalised Walsh-Hadamard transform in Sylvester order, in place:
    stage h = 1, 2, 4, ... maps each pair (v[j], v[j+h]) with j in the first
    half of a block of 2h to (a + c, a - c)."""
    m = v.shape[0]
    h = 1
    while h < m:
        w = v.reshape(-1, 2, h)  # [block, half, j]
        a = w[:, 0, :].copy()
        c = w[:, 1, :].copy()
        w[:, 0, :] = a + c
        w[:, 1, :] = a - c
        h *= 2


def _checked_args(m, rounds, hdc_dim, signs) -> tuple[int, int, int, np.ndarray]:
    """(m, rounds, hdc_dim) as ints, checked, and the sign table's bytes, checked against them."""
    m = _check_m(m)
    rounds = _index("rounds", rounds, 1)
    hdc_dim = _index("hdc_dim", hdc_dim, 8)
    if hdc_dim % 8:
        raise ValueError(f"hdc_dim must be a multiple of 8, got {hdc_dim}")
    blocks = -(-hdc_dim // m)
    sign_bytes = np.frombuffer(signs, dtype=np.uint8)
    if sign_bytes.shape[0] != blocks * rounds * m // 8:
        raise ValueError(
            f"signs has {sign_bytes.shape[0]} bytes; m={m}, rounds={rounds}, "
            f"hdc_dim={hdc_dim} need {blocks * rounds * m // 8}"
        )
    return m, rounds, hdc_dim, sign_bytes


def _output(out, hdc_dim: int) -> np.ndarray:
    target = np.frombuffer(out, dtype=np.uint8)
    if target.shape[0] != hdc_dim // 8:
        raise ValueError(f"out has {target.shape[0]} bytes; hdc_dim={hdc_dim} needs {hdc_dim // 8}")
    return target


def signature(
    rows: NDArray[np.float32],
    signs: _Bytes,
    m: SupportsIndex,
    rounds: SupportsIndex,
    hdc_dim: SupportsIndex,
    out: _WritableBytes,
    sums: NDArray[np.float64] | None = None,
) -> None:
    """Write the hdc_dim-bit signature of the token sum of `rows` into `out`,
    and the float64 token sum itself into `sums` (d values) when given."""
    m, rounds, hdc_dim, sign_bytes = _checked_args(m, rounds, hdc_dim, signs)
    x = np.asarray(rows)
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"rows must be a 2-d float32 array, got {x.ndim}-d {x.dtype}")
    n, d = x.shape
    if n < 1 or d < 1 or d > m:
        raise ValueError(f"rows must be (n_tokens >= 1, d) with 1 <= d <= m = {m}, got ({n}, {d})")
    target = _output(out, hdc_dim)

    s = np.zeros(m, dtype=np.float64)
    for t in range(n):  # token order, one float64 addition per element and token
        s[:d] += x[t].astype(np.float64)
    if sums is not None:
        if len(sums) != d:
            raise ValueError(f"sums has {len(sums)} values; rows have {d} columns")
        sums[:] = s[:d]
    target[:] = _signature_bits(s, sign_bytes, m, rounds, hdc_dim)


def _signature_bits(s: np.ndarray, sign_bytes: np.ndarray, m: int, rounds: int, hdc_dim: int) -> np.ndarray:
    """The packed signature of the zero-padded float64 token sum `s` (m values)."""
    blocks = -(-hdc_dim // m)
    negate = np.unpackbits(sign_bytes, bitorder="little").astype(bool)
    bits = np.zeros(blocks * m, dtype=bool)
    for b in range(blocks):
        v = s.copy()
        for r in range(rounds):
            p = (b * rounds + r) * m
            flip = negate[p : p + m]
            v[flip] = -v[flip]
            fwht(v)
        bits[b * m : (b + 1) * m] = v > 0.0
    return np.packbits(bits[:hdc_dim], bitorder="little")


def signature_many(
    rows: NDArray[np.float32],
    starts: NDArray[np.int64],
    signs: _Bytes,
    m: SupportsIndex,
    rounds: SupportsIndex,
    hdc_dim: SupportsIndex,
    out: NDArray[np.uint8],
    sums: NDArray[np.float64] | None = None,
) -> None:
    """signature() of many entries in one call: entry e is rows
    starts[e] .. starts[e + 1] - 1 (at least one row; starts[0] = 0 and
    starts[-1] = the row count); its signature goes to out[e] and, when
    `sums` is given, its float64 token sum to sums[e]."""
    x = np.asarray(rows)
    bounds = np.asarray(starts)
    count = len(bounds) - 1
    if count < 0:
        raise ValueError("starts must hold at least one offset")
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"rows must be a 2-d float32 array, got {x.ndim}-d {x.dtype}")
    if bounds[0] != 0 or bounds[-1] != x.shape[0]:
        raise ValueError(f"starts must run from 0 to the row count {x.shape[0]}")
    if np.any(np.diff(bounds) <= 0):
        raise ValueError(f"entry {int(np.argmax(np.diff(bounds) <= 0))} has no rows (starts must increase)")
    if out.shape != (count, int(hdc_dim) // 8):
        raise ValueError(f"out must be ({count}, {int(hdc_dim) // 8}), got {out.shape}")
    if sums is not None and sums.shape != (count, x.shape[1]):
        raise ValueError(f"sums must be ({count}, {x.shape[1]}), got {sums.shape}")
    for e in range(count):
        signature(x[bounds[e] : bounds[e + 1]], signs, m, rounds, hdc_dim, out[e], None if sums is None else sums[e])


def signature_of_sum(
    sums: NDArray[np.float64],
    signs: _Bytes,
    m: SupportsIndex,
    rounds: SupportsIndex,
    hdc_dim: SupportsIndex,
    out: _WritableBytes,
) -> None:
    """Write into `out` the signature of rows whose float64 token sum is
    `sums` (d values): signature()'s bits for those rows."""
    m, rounds, hdc_dim, sign_bytes = _checked_args(m, rounds, hdc_dim, signs)
    total = np.asarray(sums)
    if total.dtype != np.float64 or total.ndim != 1:
        raise ValueError(f"sums must be a 1-d float64 array, got {total.ndim}-d {total.dtype}")
    if not 1 <= total.shape[0] <= m:
        raise ValueError(f"sums must hold 1 <= d <= m = {m} values, got {total.shape[0]}")
    target = _output(out, hdc_dim)
    s = np.zeros(m, dtype=np.float64)
    s[: total.shape[0]] = total
    target[:] = _signature_bits(s, sign_bytes, m, rounds, hdc_dim)


def bf16_token_sums(words: NDArray[np.uint16], sums: NDArray[np.float64]) -> None:
    """Write into `sums` (a*b values) the float64 token sums of the
    float32 values of the bfloat16 words (n, a, b), in token order."""
    w = np.asarray(words)
    if w.dtype != np.uint16 or w.ndim != 3:
        raise ValueError(f"words must be a 3-d uint16 array, got {w.ndim}-d {w.dtype}")
    n, a, b = w.shape
    if len(sums) != a * b:
        raise ValueError(f"sums has {len(sums)} values; the words' rows have {a * b}")
    total = np.zeros(a * b, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # NaN words give NaN sums, which the caller looks for
        for t in range(n):  # token order, one float64 addition per value and token
            widened = (w[t].reshape(-1).astype(np.uint32) << np.uint32(16)).view(np.float32)
            total += widened.astype(np.float64)
    sums[:] = total
