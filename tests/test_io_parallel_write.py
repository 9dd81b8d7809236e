"""A large file is written in pieces from several threads (hmem/_io.py,
_write_run): the bytes are those of one sequential write, whatever mix of
buffers and ranges of other files makes them, and a piece that fails fails
the whole write, leaving neither the file nor its temporary name."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from hmem import StorageError, _io

MiB = 1 << 20


def _buffers(rng: np.random.Generator) -> list[np.ndarray]:
    # uneven sizes, so that pieces split buffers anywhere
    sizes = [3 * MiB + 5, 40 * MiB + 17, 1, 0, 29 * MiB + 1001, 7]
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def test_a_large_write_has_the_bytes_of_a_sequential_one(tmp_path):
    rng = np.random.default_rng(0)
    buffers = _buffers(rng)
    side = tmp_path / "side.bin"
    side.write_bytes(rng.integers(0, 256, 3 * MiB, dtype=np.uint8).tobytes())
    tail = rng.integers(0, 256, 70 * MiB, dtype=np.uint8)
    parts = [*buffers, _io.FileRange(side, 1000, 2 * MiB), tail]
    threads_seen: set[int] = set()

    def hook(op: str, path: str) -> None:
        if op == "write":
            threads_seen.add(threading.get_ident())

    _io.set_fault_hook(hook)
    try:
        size = _io.write_file(tmp_path / "big.bin", parts)
    finally:
        _io.set_fault_hook(None)
    expected = b"".join([*(b.tobytes() for b in buffers), side.read_bytes()[1000 : 1000 + 2 * MiB], tail.tobytes()])
    assert size == len(expected)
    assert (tmp_path / "big.bin").read_bytes() == expected
    assert len(threads_seen) > 1  # written in pieces, from several threads


def test_a_failing_piece_fails_the_write_and_leaves_nothing(tmp_path):
    rng = np.random.default_rng(1)
    buffers = _buffers(rng)
    calls = {"n": 0}
    lock = threading.Lock()

    def hook(op: str, path: str) -> None:
        if op == "write":
            with lock:
                calls["n"] += 1
                if calls["n"] == 3:  # one of the pieces
                    raise OSError(28, "No space left on device")

    _io.set_fault_hook(hook)
    try:
        with pytest.raises(StorageError):
            _io.write_file(tmp_path / "big.bin", buffers)
    finally:
        _io.set_fault_hook(None)
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == []
