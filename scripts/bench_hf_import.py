"""A Hugging Face cache dump through `hmem put --chunk-tokens` beside the library's batch put, same run.

The input is what a serving process saves from a transformers cache: one
safetensors file of ``past_key_values.{i}.key``/``.value`` tensors,
[1, kv_heads, tokens, head_dim] (bhtd) in BF16.  By default a 32-layer model
with 8 K/V heads of 128 dims after a 4096-token prompt: 32 x 2 x 4096 x 1024
values, 512 MiB of BF16 (README.md, "Real models' K/V").  It is written once
to a temporary directory; every run below starts from a fresh store.

- hmem put: `hmem init --storage-dtype D` (not timed), then
  `hmem put STORE dump.safetensors --chunk-tokens 256 --json` in a
  subprocess, timed end to end (interpreter start-up, reading and
  converting the file, the puts, the flush); the time it reports itself
  (opening the store through the flush) is shown beside it.
- baseline: the library's `Store.put_many` of the same entries (rows
  already in memory as [256, kv_heads x head_dim] float32 chunks, with the
  meta `hmem put` gives them), then `Store.flush`; `Store.create` and
  making the entries are not timed.  Run as a program of its own in a fresh
  process, as `hmem put` runs: a fresh process pays the first touch of the
  memory it fills (on this benchmark's virtual machine about 4 ms per MiB
  the first time, 0.2 ms after), and so does `hmem put`.  The same put_many
  in this (warm) process is shown too.
- put_cache (with torch installed): `Store.put_cache` of the same K/V as a
  cache of torch bfloat16 tensors in memory, `chunk_tokens` as above, then
  `Store.flush`, in this process, beside put_many warm.

Every side runs for storage_dtype f32 and bf16, `--repeat` times in
rotating order, each after `os.sync()` (no run pays for the write-back of
the one before); the medians are compared.  Goals: `hmem put` end to end at
>= 80% of put_many's throughput (the fresh process), and a bf16 store <=
0.52 x the disk of an f32 store of the same data (an int8 store is shown
too).

Usage::

    python scripts/bench_hf_import.py
    python scripts/bench_hf_import.py --layers 8 --tokens 2048 --repeat 3
    python scripts/bench_hf_import.py --json figures.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import compile_like_an_install, fmt_rate, fmt_seconds, print_machine_facts

import hmem

GOAL_SHARE = 0.80
GOAL_DISK = 0.52


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the bits of the nearest bfloat16 (round half to even); numpy has no bfloat16."""
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_dump(path: Path, layers: int, heads: int, tokens: int, dim: int, seed: int) -> list[np.ndarray]:
    """The BF16 dump, written tensor by tensor (a safetensors file by hand:
    numpy has no bfloat16); returns each tensor's bits, in file order."""
    shape = [1, heads, tokens, dim]
    size = heads * tokens * dim * 2
    names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    header = {
        name: {"dtype": "BF16", "shape": shape, "data_offsets": [n * size, (n + 1) * size]}
        for n, name in enumerate(names)
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    tensors = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _ in names:
            bits = bf16_bits(rng.standard_normal(shape, dtype=np.float32))
            f.write(bits.tobytes())
            tensors.append(bits)
    return tensors


def read_dump(path: Path) -> list[np.ndarray]:
    """The bits of each tensor of a dump written by write_dump, in file order."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
    order = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    return [data[a:b].view(np.uint16).reshape(t["shape"]) for _, t in order for a, b in [t["data_offsets"]]]


def entries_of(tensors: list[np.ndarray], chunk: int, source: str) -> list[hmem.Entry]:
    """What `hmem put --chunk-tokens` makes of the dump: per layer, [tokens, heads x dim] rows in chunks."""
    out = []
    for layer in range(len(tensors) // 2):
        k, v = (from_bf16_bits(t[0]).transpose(1, 0, 2).reshape(t.shape[2], -1) for t in tensors[2 * layer :][:2])
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        for n, start in enumerate(range(0, k.shape[0], chunk)):
            stop = min(start + chunk, k.shape[0])
            meta = {"source": source, "tokens": [start, stop], "chunk": n}
            out.append(hmem.Entry(k[start:stop], v[start:stop], layer, 1.0, meta))
    return out


def disk_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def hmem_cmd(*args: str, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hmem", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"hmem {' '.join(args)} exited with {proc.returncode}: {proc.stderr.strip()}")
    return seconds, proc


def cli_put(store: Path, dump: Path, storage: str, embed_dim: int, chunk: int) -> tuple[float, float, int]:
    """(wall seconds, seconds hmem put reports, bytes on disk)."""
    shutil.rmtree(store, ignore_errors=True)
    hmem_cmd("init", str(store), "--embed-dim", str(embed_dim), "--storage-dtype", storage, "--quiet", cwd=store.parent)
    wall, proc = hmem_cmd("put", str(store), str(dump), "--chunk-tokens", str(chunk), "--json", cwd=store.parent)
    doc = json.loads(proc.stdout)
    assert doc["files_skipped"] == 0, doc
    return wall, doc["seconds"], disk_bytes(store)


def library_put(store: Path, entries: list[hmem.Entry], storage: str, embed_dim: int) -> tuple[float, int]:
    """(seconds of put_many + flush, bytes on disk)."""
    shutil.rmtree(store, ignore_errors=True)
    with hmem.Store.create(store, embed_dim=embed_dim, storage_dtype=storage) as s:
        t0 = time.perf_counter()
        ids = s.put_many(entries)
        s.flush()
        seconds = time.perf_counter() - t0
    assert len(ids) == len(entries)
    return seconds, disk_bytes(store)


def torch_cache(tensors: list[np.ndarray]) -> list[tuple] | None:
    """The dump as the legacy cache Store.put_cache takes: per layer (keys,
    values), torch bfloat16 [1, heads, tokens, dim]; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    as_bf16 = [torch.from_numpy(np.array(t).view(np.int16)).view(torch.bfloat16) for t in tensors]
    return list(zip(as_bf16[0::2], as_bf16[1::2]))


def cache_put(store: Path, cache: list[tuple], storage: str, embed_dim: int, chunk: int) -> tuple[float, int]:
    """(seconds of put_cache + flush of the bfloat16 cache, bytes on disk)."""
    shutil.rmtree(store, ignore_errors=True)
    with hmem.Store.create(store, embed_dim=embed_dim, storage_dtype=storage) as s:
        t0 = time.perf_counter()
        s.put_cache(cache, chunk_tokens=chunk)
        s.flush()
        seconds = time.perf_counter() - t0
    return seconds, disk_bytes(store)


def put_many_child(argv: list[str]) -> None:
    """The baseline as a program of its own: DUMP STORE STORAGE CHUNK; prints the seconds as JSON."""
    dump, store, storage, chunk = Path(argv[0]), Path(argv[1]), argv[2], int(argv[3])
    tensors = read_dump(dump)
    entries = entries_of(tensors, chunk, dump.name)
    del tensors
    seconds, size = library_put(store, entries, storage, entries[0].keys.shape[1])
    print(json.dumps({"seconds": seconds, "disk_bytes": size}))


def library_process(store: Path, dump: Path, storage: str, chunk: int) -> tuple[float, int]:
    """(seconds of put_many + flush in a fresh process, bytes on disk)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--put-many-child", str(dump), str(store), storage, str(chunk)],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(proc.stdout)
    return doc["seconds"], doc["disk_bytes"]


def main() -> None:
    if sys.argv[1:2] == ["--put-many-child"]:
        return put_many_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to build the dump and the stores (default: a temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()

    print_machine_facts()
    print(compile_like_an_install(), end="\n\n")
    embed_dim = args.kv_heads * args.head_dim
    values = args.layers * 2 * args.tokens * embed_dim
    root = Path(tempfile.mkdtemp(prefix="hmem-bench-hf-", dir=args.dir))
    try:
        dump = root / "dump.safetensors"
        t0 = time.perf_counter()
        tensors = write_dump(dump, args.layers, args.kv_heads, args.tokens, args.head_dim, seed=0)
        entries = entries_of(tensors, args.chunk_tokens, dump.name)
        cache = torch_cache(tensors)
        del tensors
        print(
            f"dump: {args.layers} layers x K,V x [1, {args.kv_heads}, {args.tokens}, {args.head_dim}] BF16, "
            f"{dump.stat().st_size / 2**20:,.0f} MiB ({time.perf_counter() - t0:.1f} s to make); "
            f"{len(entries)} entries of {args.chunk_tokens} tokens x {embed_dim}; "
            f"throughput below counts {values * 4 / 2**20:,.0f} MiB of K/V as float32 rows\n"
        )

        t: dict[str, list[float]] = {}
        disk: dict[str, int] = {}
        sides = ["cli", "proc", "warm"] + (["cache"] if cache is not None else [])
        for storage in ("f32", "bf16"):
            for r in range(args.repeat):
                for side in sides[r % len(sides) :] + sides[: r % len(sides)]:  # rotate: no side always first
                    os.sync()  # no run pays for the write-back of the one before it
                    if side == "cli":
                        wall, own, size = cli_put(root / "cli", dump, storage, embed_dim, args.chunk_tokens)
                        t.setdefault(f"cli_{storage}", []).append(wall)
                        t.setdefault(f"cli_self_{storage}", []).append(own)
                    elif side == "proc":
                        seconds, size = library_process(root / "proc", dump, storage, args.chunk_tokens)
                        t.setdefault(f"proc_{storage}", []).append(seconds)
                    elif side == "warm":
                        seconds, size = library_put(root / "warm", entries, storage, embed_dim)
                        t.setdefault(f"warm_{storage}", []).append(seconds)
                    else:
                        seconds, size = cache_put(root / "cache", cache, storage, embed_dim, args.chunk_tokens)
                        t.setdefault(f"cache_{storage}", []).append(seconds)
                    disk.setdefault(f"{side}_{storage}", size)
                # the round's own share: runs next to each other see the same machine
                t.setdefault(f"pair_{storage}", []).append(t[f"proc_{storage}"][-1] / t[f"cli_{storage}"][-1])
        os.sync()
        wall, own, disk["cli_int8"] = cli_put(root / "cli", dump, "int8", embed_dim, args.chunk_tokens)
        t["cli_int8"], t["cli_self_int8"] = [wall], [own]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    pairs = {d: sorted(t.pop(f"pair_{d}")) for d in ("f32", "bf16")}
    m = {k: statistics.median(v) for k, v in t.items()}
    payload = values * 4
    report: dict = {
        "layers": args.layers,
        "tokens": args.tokens,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "chunk_tokens": args.chunk_tokens,
        "repeat": args.repeat,
        "entries": len(entries),
        "kv_bytes_f32": payload,
        "median_seconds": m,
        "samples": t,
        "disk_bytes": disk,
    }
    best = {k: min(v) for k, v in t.items()}
    report["best_seconds"] = best

    def line(label: str, key: str, share: str = "") -> None:
        print(
            f"  {label:<44}{fmt_seconds(m[key]):>10}{fmt_seconds(best[key]):>10}"
            f"{fmt_rate(payload, m[key]):>12}  {share}"
        )

    print(f"  {str(args.repeat) + ' runs each':<44}{'median':>10}{'best':>10}{'throughput':>12}  share (median)")
    for storage in ("f32", "bf16"):
        share = m[f"proc_{storage}"] / m[f"cli_{storage}"]
        report[f"share_{storage}"] = share
        report[f"share_vs_warm_{storage}"] = m[f"warm_{storage}"] / m[f"cli_{storage}"]
        line(f"{storage}: put_many + flush, a fresh process", f"proc_{storage}", "baseline")
        line(f"{storage}: put_many + flush, this (warm) process", f"warm_{storage}")
        line(
            f"{storage}: hmem put, end to end",
            f"cli_{storage}",
            f"{share:.0%} (best {best[f'proc_{storage}'] / best[f'cli_{storage}']:.0%}; "
            f"{report[f'share_vs_warm_{storage}']:.0%} of warm)",
        )
        line(
            f"{storage}: hmem put, as it reports itself",
            f"cli_self_{storage}",
            f"{m[f'proc_{storage}'] / m[f'cli_self_{storage}']:.0%}",
        )
        if f"cache_{storage}" in m:
            line(
                f"{storage}: Store.put_cache (bfloat16 tensors), warm",
                f"cache_{storage}",
                f"{m[f'warm_{storage}'] / m[f'cache_{storage}']:.0%} of put_many warm",
            )
    line("int8: hmem put, end to end (one run)", "cli_int8")
    report["paired_shares"] = pairs
    print(
        "\nshare of each round (put_many in a fresh process / hmem put end to end, run side by side): "
        + "; ".join(f"{d} median {statistics.median(v):.0%}, {v[0]:.0%}-{v[-1]:.0%}" for d, v in pairs.items())
    )
    ratio = {d: disk[f"cli_{d}"] / disk["cli_f32"] for d in ("bf16", "int8")}
    report["disk_ratio"] = ratio
    sizes = ", ".join(f"{d} {disk[f'cli_{d}'] / 2**20:,.1f} MiB" for d in ("f32", "bf16", "int8"))
    print(
        f"\ndisk after hmem put: {sizes}"
        + f"; bf16/f32 {ratio['bf16']:.3f}, int8/f32 {ratio['int8']:.3f}"
        + f" (put_many's stores: f32 {disk['proc_f32'] / 2**20:,.1f} MiB, bf16 {disk['proc_bf16'] / 2**20:,.1f} MiB)"
    )
    share_holds = min(report["share_f32"], report["share_bf16"]) >= GOAL_SHARE
    disk_holds = ratio["bf16"] <= GOAL_DISK
    report["goals_hold"] = {"share": share_holds, "disk": disk_holds}
    print(
        f"goal: hmem put >= {GOAL_SHARE:.0%} of put_many's throughput (fresh process): "
        f"{'holds' if share_holds else 'FAILS'} "
        f"(f32 {report['share_f32']:.0%}, bf16 {report['share_bf16']:.0%})"
    )
    print(f"goal: bf16 disk <= {GOAL_DISK} x f32: {'holds' if disk_holds else 'FAILS'} ({ratio['bf16']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
