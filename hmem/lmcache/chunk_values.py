"""A chunk's K/V as numbers.  LMCache stores bfloat16 and the fp8 formats,
which numpy has no type for: ``CacheDirectory.read`` hands them out as
they are stored (bfloat16 as 16-bit words, fp8 as bytes), and this module
decodes them to float32, for ``hmem show``'s sample of a chunk's values
(``value_sample``) and for the non-finite values ``verify(deep=True)``
counts (``non_finite_count``)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hmem.lmcache.cache import ChunkInfo

FP8_FORMATS = {  # exponent bits, bias, fnuz
    "fp8_e4m3fn": (4, 7, False),
    "fp8_e5m2": (5, 15, False),
    "fp8_e4m3fnuz": (4, 8, True),
    "fp8_e5m2fnuz": (5, 16, True),
}


@functools.cache
def fp8_table(kv_dtype: str) -> np.ndarray:
    """The float32 value of each of the 256 codes of an fp8 format: e4m3fn
    (no inf; NaN at S.1111.111), e5m2 (IEEE-like inf and NaN), and the
    fnuz forms (their own bias, no inf, NaN only at 0x80, no -0).  Made
    once per format, read-only."""
    exponent_bits, bias, fnuz = FP8_FORMATS[kv_dtype]
    codes = np.arange(256)
    mantissa_bits = 7 - exponent_bits
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (codes & ((1 << mantissa_bits) - 1)) / (1 << mantissa_bits)
    values = np.where(exponent == 0, mantissa * 2.0 ** (1 - bias), (1 + mantissa) * 2.0 ** (exponent - bias)) * sign
    top = (1 << exponent_bits) - 1
    if fnuz:
        values[0x80] = np.nan
    elif exponent_bits == 4:
        values[(exponent == top) & (mantissa * 8 == 7)] = np.nan
    else:
        values[(exponent == top) & (mantissa == 0)] = np.inf * sign[(exponent == top) & (mantissa == 0)]
        values[(exponent == top) & (mantissa != 0)] = np.nan
    table = values.astype(np.float32)
    table.flags.writeable = False
    return table


def as_float32(kv_dtype: str, values: np.ndarray) -> np.ndarray | None:
    """K/V values as ``CacheDirectory.read`` gives them, as float32:
    bfloat16 words shifted into a float32's high half, fp8 bytes through
    their format's table, half and float widened or kept; None for
    integer dtypes (no float to decode)."""
    if kv_dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    if kv_dtype in FP8_FORMATS:
        return fp8_table(kv_dtype)[values]
    if values.dtype.kind == "f":
        return values.astype(np.float32)
    return None


def non_finite_count(kv_dtype: str, values: np.ndarray) -> int:
    """How many of the values are inf or NaN, in their own dtype (a double
    beyond float32's range is finite), without a float copy of them all."""
    flat = values.reshape(-1)
    if kv_dtype == "bfloat16":  # exponent all ones: inf or NaN
        return int(np.count_nonzero((flat & 0x7F80) == 0x7F80))
    if kv_dtype in FP8_FORMATS:  # each code counted once, then the non-finite codes summed
        codes = np.bincount(flat, minlength=256)
        return int(codes[~np.isfinite(fp8_table(kv_dtype))].sum())
    if flat.dtype.kind == "f":
        return int(flat.size - np.count_nonzero(np.isfinite(flat)))
    return 0


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def value_sample(info: ChunkInfo, data: np.ndarray, values: int) -> dict[str, Any] | None:
    """A look at a chunk's values (`data` as ``CacheDirectory.read`` gives
    it): per layer and plane (K and V, or the MLA latent), the first
    token's first `values` values as float32 (integer dtypes as stored:
    ``decoded`` false), the largest finite magnitude and the count of
    non-finite values.  A JSON-ready dict; None for a layout not known."""
    if info.memory_format == "KV_T2D":  # one layer: [tokens, 2, hidden]
        planes = {"k": data[:, 0, :], "v": data[:, 1, :]}
        per_layer = [(info.layer, planes)]
    elif info.memory_format == "KV_MLA_FMT" and data.ndim == 2:  # one layer, latent: [tokens, hidden]
        per_layer = [(info.layer, {"latent": data})]
    elif data.ndim == 4 and data.shape[0] == 1:  # [1, layers, tokens, hidden]
        per_layer = [(layer, {"latent": data[0, layer]}) for layer in range(data.shape[1])]
    elif info.memory_format == "KV_2TD" and data.ndim == 3:  # one layer: [2, tokens, hidden]
        per_layer = [(info.layer, {"k": data[0], "v": data[1]})]
    elif data.ndim == 4:  # [2, layers, tokens, hidden]
        per_layer = [(layer, {"k": data[0, layer], "v": data[1, layer]}) for layer in range(data.shape[1])]
    else:
        return None
    layers = []
    decoded = True
    for layer, planes_of in per_layer:
        entry: dict[str, Any] = {"layer": layer}
        for plane, stored in planes_of.items():
            floats = as_float32(info.kv_dtype, stored)
            if floats is None:
                decoded = False
                entry[plane] = [int(x) for x in stored[0, :values]]
                continue
            entry[plane] = [_json_float(float(x)) for x in floats[0, :values]]
            finite = floats[np.isfinite(floats)]
            entry[f"max_abs_{plane}"] = float(np.abs(finite).max()) if finite.size else None
            entry[f"non_finite_{plane}"] = int(floats.size - finite.size)
        layers.append(entry)
    return {"token": 0, "values": values, "decoded": decoded, "layers": layers}


__all__ = ["FP8_FORMATS", "as_float32", "fp8_table", "non_finite_count", "value_sample"]
