"""What ``hmem prefix-hit`` reads: the windows, and the presence map given
per group (--group) or as raw bitmap bytes (--hex, --bitmap-file)."""

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
            hint="check --chunks and --ranks")
    return nbits


def _hex_bytes(hex_text: str, need: int, what: str) -> bytes:
    cleaned = "".join(hex_text.split()).lower().removeprefix("0x")
    bad = NOT_HEX.search(cleaned)
    if bad is not None:
        raise InvalidArgumentError(f"--hex: {hex_text!r} is not hexadecimal ({bad.group()!r} is no hex digit)")
    if len(cleaned) != 2 * need:
        raise InvalidArgumentError(f"--hex holds {len(cleaned)} hex digits but {what} need exactly "
                                   f"{need} bytes ({2 * need} hex digits)")
    return bytes.fromhex(cleaned)


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
        raise InvalidArgumentError(f"{source} sets bit {first}, past the end of the map of {what} "
                                   f"(bits 0-{nbits - 1}): the bits after bit {nbits - 1} must be 0")
    return Bitmap.from_bytes(data, nbits)
