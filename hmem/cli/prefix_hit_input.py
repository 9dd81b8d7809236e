"""What ``hmem prefix-hit`` reads: the windows, and the presence given as a
flat map, per group (--group) or as raw bitmap bytes (--hex, --bitmap-file),
or as rows, one per (group, rank) (--row, --rows-file)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hmem import Bitmap, InvalidArgumentError, Layout, presence_bits, presence_map
from hmem.cli.ranges import parse_chunks


def parse_windows(text: str) -> list[int]:
    try:
        windows = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise InvalidArgumentError(f"--windows {text!r}: expected comma-separated integers such as -1,-1,4,1") from None
    if not windows:
        raise InvalidArgumentError("--windows is empty: give one window per object group")
    return windows


def presence_from_groups(specs: list[str], chunks: int, ranks: int, windows: list[int], layout: Layout) -> Bitmap:
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


# Every presence map and retain mask is held in memory several times over
# (per group, per rank): past this many bits a request is not a model's,
# and allocating it would only end in a MemoryError.
MAX_PRESENCE_BITS = 2**30
NOT_HEX = re.compile(r"[^0-9a-f]")


def check_size(chunks: int, ranks: int, windows: list[int]) -> int:
    """G·C·R, the presence map's bits; a usage error past MAX_PRESENCE_BITS,
    before anything is allocated."""
    nbits = presence_bits(chunks, ranks, windows)
    if nbits > MAX_PRESENCE_BITS:
        raise InvalidArgumentError(
            f"{len(windows)} groups x {chunks} chunks x {ranks} ranks = {nbits} presence bits: more than "
            f"prefix-hit handles (at most 2^30 = {MAX_PRESENCE_BITS} bits, a 128 MiB map)",
            hint="check --chunks and --ranks",
        )
    return nbits


def _hex_bytes(hex_text: str, need: int, what: str) -> bytes:
    cleaned = "".join(hex_text.split()).lower().removeprefix("0x")
    bad = NOT_HEX.search(cleaned)
    if bad is not None:
        raise InvalidArgumentError(f"--hex: {hex_text!r} is not hexadecimal ({bad.group()!r} is no hex digit)")
    if len(cleaned) != 2 * need:
        raise InvalidArgumentError(
            f"--hex holds {len(cleaned)} hex digits but {what} need exactly {need} bytes ({2 * need} hex digits)"
        )
    return bytes.fromhex(cleaned)


# Rows are Python objects, one per (group, rank): past this many a request
# is not a model's (models have hundreds of rows at most).
MAX_ROWS = 2**20


def row_windows(windows: list[int], ranks: int) -> list[int]:
    """The window of each row: rows come group by group, `ranks` per group;
    a usage error past MAX_ROWS rows, before any row is made."""
    if len(windows) * ranks > MAX_ROWS:
        raise InvalidArgumentError(
            f"{len(windows)} windows x {ranks} ranks = {len(windows) * ranks} rows: more than prefix-hit "
            f"takes as rows (at most 2^20 = {MAX_ROWS})",
            hint="check --ranks",
        )
    return [w for w in windows for _ in range(ranks)]


def rows_from_specs(specs: list[str], chunks: int, ranks: int, windows: list[int]) -> list[Bitmap]:
    """One Bitmap per --row, in the order given."""
    need = len(windows) * ranks
    if len(specs) != need:
        per = "one per window" if ranks == 1 else f"{ranks} per window (one per rank), group by group"
        raise InvalidArgumentError(
            f"{len(specs)} --row option(s) for {len(windows)} windows x {ranks} rank(s): give {need} --row, {per}"
        )
    return [parse_chunks(spec, chunks) for spec in specs]


def rows_from_file(path: Path, chunks: int, ranks: int, windows: list[int]) -> list[Bitmap]:
    """Rows of raw bitmap bytes back to back, ceil(C / 8) bytes each."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"--rows-file {path}: {exc.strerror}") from None
    source = f"--rows-file {path}"
    width = (chunks + 7) // 8
    count = len(windows) * ranks
    if len(data) != count * width:
        raise InvalidArgumentError(
            f"{source} holds {len(data)} bytes but {len(windows)} windows x {ranks} rank(s) = {count} rows "
            f"of {chunks} chunks ({width} bytes each) need exactly {count * width}"
        )
    rows = []
    for i in range(count):
        raw = data[i * width : (i + 1) * width]
        spare = raw[-1] >> (chunks % 8) if chunks % 8 else 0
        if spare:  # a row for a longer request, not padding
            first = chunks + (spare & -spare).bit_length() - 1
            raise InvalidArgumentError(
                f"{source}: row {i} sets bit {first}, past its {chunks} chunks: the bits after bit "
                f"{chunks - 1} of each row must be 0"
            )
        rows.append(Bitmap.from_bytes(raw, chunks))
    return rows


def raw_presence(hex_text: str | None, path: Path | None, nbits: int, what: str) -> Bitmap:
    """The presence map from --hex or --bitmap-file; `what` describes its
    size ('3 groups x 16 chunks x 2 ranks = 96 bits')."""
    need = (nbits + 7) // 8
    if hex_text is not None:
        data = _hex_bytes(hex_text, need, what)
        source = "--hex"
    else:
        assert path is not None
        try:
            data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        except OSError as exc:
            raise InvalidArgumentError(f"--bitmap-file {path}: {exc.strerror}") from None
        source = f"--bitmap-file {path}"
        if len(data) != need:
            raise InvalidArgumentError(f"{source} holds {len(data)} bytes but {what} need exactly {need}")
    spare = data[-1] >> (nbits % 8) if nbits % 8 else 0
    if spare:  # bits of the last byte past the map: a map for another shape, not padding
        first = nbits + (spare & -spare).bit_length() - 1
        raise InvalidArgumentError(
            f"{source} sets bit {first}, past the end of the map of {what} "
            f"(bits 0-{nbits - 1}): the bits after bit {nbits - 1} must be 0"
        )
    return Bitmap.from_bytes(data, nbits)
