"""What ``hmem prefix-hit`` reads: the windows, and the presence map given
per group (--group) or as raw bitmap bytes (--hex, --bitmap-file)."""

from __future__ import annotations

import sys
from pathlib import Path

from hmem import Bitmap, InvalidArgumentError, Layout, presence_map
from hmem.cli.ranges import parse_chunks


def parse_windows(text: str) -> list[int]:
    try:
        windows = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise InvalidArgumentError(
            f"--windows {text!r}: expected comma-separated integers such as -1,-1,4,1"
        ) from None
    if not windows:
        raise InvalidArgumentError("--windows is empty: give one window per object group")
    return windows


def presence_from_groups(specs: list[str], chunks: int, ranks: int, windows: list[int],
                         layout: Layout) -> Bitmap:
    if len(specs) != len(windows):
        raise InvalidArgumentError(
            f"{len(specs)} --group option(s) for {len(windows)} windows: give one --group per window, in order"
        )
    rows = []
    for g, spec in enumerate(specs):
        per_rank = spec.split(";")
        if len(per_rank) == 1:
            per_rank = per_rank * ranks
        if len(per_rank) != ranks:
            raise InvalidArgumentError(
                f"--group {spec!r} (group {g}) lists {len(per_rank)} ranks; give one chunk set "
                f"for all ranks or {ranks} separated by ';'"
            )
        rows.append([parse_chunks(part, chunks) for part in per_rank])
    return presence_map(rows, chunks, layout)


def raw_presence(hex_text: str | None, path: Path | None, nbits: int, what: str) -> Bitmap:
    if hex_text is not None:
        cleaned = "".join(hex_text.split()).lower().removeprefix("0x")
        try:
            data = bytes.fromhex(cleaned)
        except ValueError:
            raise InvalidArgumentError(f"--hex: {hex_text!r} is not hexadecimal") from None
        source = "--hex"
    else:
        assert path is not None
        try:
            data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        except OSError as exc:
            raise InvalidArgumentError(f"--bitmap-file {path}: {exc.strerror}") from None
        source = f"--bitmap-file {path}"
    need = (nbits + 7) // 8
    if len(data) != need:
        raise InvalidArgumentError(
            f"{source} holds {len(data)} bytes but {what} = {nbits} bits need exactly {need}"
        )
    return Bitmap.from_bytes(data, nbits)
