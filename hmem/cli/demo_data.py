"""The generated inputs of ``hmem demo``: small K/V safetensors files in
the three naming forms ``hmem put`` reads (docs/cli.md), and the presence
map of its prefix-hit example."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hmem import Bitmap, presence_map, write_kv_file

EMBED_DIM = 128
TOKENS = 32

# the prefix-hit example: full attention, a 4-chunk window and mamba over 16 chunks
PREFIX_CHUNKS = 16
PREFIX_WINDOWS = [-1, 4, 1]


def _write(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> Path:
    write_kv_file(path, tensors, metadata)  # written through hmem's I/O module (docs/architecture.md)
    return path


def write_inputs(folder: Path, rng: np.random.Generator) -> list[Path]:
    """K/V files in the three naming forms `hmem put` reads, with keys that
    share a large mean component, as real attention keys do."""
    common = rng.standard_normal(EMBED_DIM) * 2

    def kv(n: int = TOKENS) -> tuple[np.ndarray, np.ndarray]:
        keys = common + rng.standard_normal(EMBED_DIM) + 0.8 * rng.standard_normal((n, EMBED_DIM))
        return keys.astype(np.float32), rng.standard_normal((n, EMBED_DIM)).astype(np.float32)

    paths = []
    for i in range(8):  # one entry per file, its layer and importance in the metadata
        k, v = kv()
        paths.append(
            _write(
                folder / f"single_{i:02d}.safetensors",
                {"keys": k, "values": v},
                {"layer": str(i % 4), "importance": str(1 + i % 3)},
            )
        )
    for i in range(6):  # one entry per layer, stored as float16
        tensors = {}
        for layer in range(4):
            k, v = kv()
            tensors[f"layer.{layer}.k"], tensors[f"layer.{layer}.v"] = k.astype(np.float16), v.astype(np.float16)
        paths.append(_write(folder / f"layers_{i:02d}.safetensors", tensors))
    for i in range(4):  # several entries of one layer
        tensors = {}
        for n in range(3):
            tensors[f"k_{n}"], tensors[f"v_{n}"] = kv(16)
        paths.append(_write(folder / f"numbered_{i:02d}.safetensors", tensors, {"layer": "2"}))
    return paths


def prefix_presence() -> Bitmap:
    """Which chunks each group of the prefix-hit example holds (one rank)."""
    rows = [
        [Bitmap.from_indices([*range(12), 14], PREFIX_CHUNKS)],
        [Bitmap.from_indices([*range(10), *range(12, 16)], PREFIX_CHUNKS)],
        [Bitmap.from_indices(range(6, 10), PREFIX_CHUNKS)],
    ]
    return presence_map(rows, PREFIX_CHUNKS)
