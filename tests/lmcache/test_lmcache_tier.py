"""hmem as LMCache 0.5.6's durable remote tier, driven by LMCache's real
engine on the CPU (tests/lmcache/tier_driver.py, run by the interpreter in
HMEM_LMCACHE_PYTHON; skipped without it).

What a store written through the tier gives a new engine process, against
LMCache's own fs connector on the same requests; a byte cap; hmem's admin
commands beside an engine at work; a writer killed with SIGKILL; a chunk
whose bytes fail their checksum.  Every wait is for a line a driver prints
(or its exit), with a ceiling against a hung driver.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

import hmem

DRIVER = Path(__file__).with_name("tier_driver.py")
CEILING = 300  # seconds: a hung driver fails the test, nothing waits this long otherwise


class Driver:
    """tier_driver.py in a process of its own: lines to its stdin, lines from its stdout."""

    def __init__(self, python: str, *args: str, log: Path) -> None:
        self.log_path = log
        self.log = open(log, "w")  # a file: a pipe left unread could fill
        self.proc = subprocess.Popen(
            [python, str(DRIVER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )

    def line(self, prefix: str) -> str:
        """The next line starting with `prefix` (earlier lines are skipped)."""
        stdout = self.proc.stdout
        assert stdout is not None
        deadline = time.monotonic() + CEILING
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stdout], [], [], left)[0]:
                raise AssertionError(f"no {prefix!r} line from the driver in {CEILING} s\n{self.stderr()}")
            text = stdout.readline()
            if not text:
                raise AssertionError(f"the driver ended before a {prefix!r} line\n{self.stderr()}")
            if text.startswith(prefix):
                return text.rstrip("\n")

    def send(self, text: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(text + "\n")
        stdin.flush()

    def wait(self) -> int:
        return self.proc.wait(timeout=CEILING)

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.log.close()


class Reader:
    """One process of fresh engines: each read is an engine that never wrote."""

    def __init__(self, driver: Driver, scratch: Path) -> None:
        self.driver, self.scratch, self.count = driver, scratch, 0

    def read(self, kind: str, store: Path) -> dict[str, Any]:
        self.count += 1
        out = self.scratch / f"read-{self.count}.json"
        self.driver.send(json.dumps({"kind": kind, "store": str(store), "out": str(out)}))
        self.driver.line("done")
        result = json.loads(out.read_text())
        assert "error" not in result, result.get("error")
        return dict(result["requests"])


@pytest.fixture(scope="module")
def reader(lmcache_python: str, tmp_path_factory: pytest.TempPathFactory):
    scratch = tmp_path_factory.mktemp("tier-reads")
    driver = Driver(lmcache_python, "serve", log=scratch / "serve.log")
    try:
        yield Reader(driver, scratch)
        assert driver.proc.stdin is not None
        driver.proc.stdin.close()  # the end of its orders
        assert driver.wait() == 0, driver.stderr()
    finally:
        driver.close()


@pytest.fixture(scope="module")
def written(lmcache_python: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """fs, hmem and capped stores of the same requests, and what the writer saw."""
    out = tmp_path_factory.mktemp("tier-written")
    run = subprocess.run(
        [lmcache_python, str(DRIVER), "write", str(out)], capture_output=True, text=True, timeout=CEILING
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return out, json.loads((out / "written.json").read_text())


def hmem_cli(*args: str, ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """An hmem command in a process of its own; its JSON document."""
    run = subprocess.run(
        [sys.executable, "-m", "hmem", *args, "--json"], capture_output=True, text=True, timeout=CEILING
    )
    assert run.returncode in ok, f"hmem {' '.join(args)}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return dict(json.loads(run.stdout))


def store_keys(path: Path) -> set[str]:
    with hmem.Store.open(str(path), read_only=True) as store:
        return set(store.chunks.keys())


def prefix_tokens(keys: list[str], held: set[str], chunk: int) -> int:
    """LMCache's hit: the chunks up to the first one not held."""
    hit = 0
    while hit < len(keys) and keys[hit] in held:
        hit += 1
    return hit * chunk


def assert_exact(got: dict[str, Any], req: dict[str, Any], tokens: int, chunk: int) -> None:
    """`tokens` retrieved, and their chunks bit-exact: the SHA-256 of what was stored."""
    assert got["retrieved"] == tokens, (req["name"], got)
    assert got["chunk_sha256"] == req["chunk_sha256"][: tokens // chunk], req["name"]


def test_a_new_engine_reads_what_the_fs_connector_reads(reader: Reader, written: tuple[Path, dict[str, Any]]) -> None:
    out, w = written
    chunk = w["chunk_size"]
    fs, tier = reader.read("fs", out / "fs"), reader.read("hmem", out / "hmem")
    every_key = set()
    for req in w["requests"]:
        name = req["name"]
        assert req["keys"] == req["fs_keys"], name  # the tier is addressed by LMCache's own keys
        every_key.update(req["keys"])
        whole = len(req["keys"]) * chunk
        assert req["fs_lookup"] == req["hmem_lookup"] == whole, name  # the writing engines
        assert tier[name]["keys"] == req["keys"]
        assert tier[name]["lookup"] == fs[name]["lookup"] == whole, name  # the new engine
        assert_exact(fs[name], req, whole, chunk)  # the reference reads back what was stored ...
        assert_exact(tier[name], req, whole, chunk)  # ... and so does the tier
    assert every_key and store_keys(out / "hmem") == every_key  # a chunk shared by requests is stored once


def test_a_byte_cap_evicts_and_lookups_stop_at_the_first_evicted_chunk(
    reader: Reader, written: tuple[Path, dict[str, Any]]
) -> None:
    out, w = written
    chunk, capped = w["chunk_size"], w["capped"]
    before, after = store_keys(out / "hmem"), store_keys(out / "capped")  # all the chunks; those kept
    assert after < before, "storing under the cap evicted nothing"
    stats = hmem_cli("stats", str(out / "capped"))
    assert stats["bytes_on_disk"] <= capped["max_bytes"], stats
    tier = reader.read("hmem", out / "capped")
    behind_a_hole = False
    for req in w["requests"]:
        name = req["name"]
        expected = prefix_tokens(req["keys"], after, chunk)
        behind_a_hole |= any(key in after for key in req["keys"][expected // chunk :])
        assert capped["lookups"][name] == expected, name  # the engine that stored, after its commits
        assert tier[name]["lookup"] == expected, name  # a new engine
        assert_exact(tier[name], req, expected, chunk)
    # the eviction left a chunk behind a missing one: the prefix rule was tested
    assert behind_a_hole, after


def test_admin_commands_beside_an_engine_at_work(lmcache_python: str, tmp_path: Path) -> None:
    store, stop, counts_path = tmp_path / "live", tmp_path / "stop", tmp_path / "counts.json"
    driver = Driver(lmcache_python, "loop", str(store), str(stop), str(counts_path), log=tmp_path / "loop.log")
    try:
        driver.line("ready")

        def beside(*args: str, ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
            driver.line("iteration")  # the engine works before the command, and after it
            driver.line("iteration")
            return hmem_cli(*args, str(store), ok=ok)

        def verify_beside(*args: str) -> None:
            # A store committed to while it is checked gives warnings (exit 4:
            # a shard of the commit in progress, "run verify again"), never an error.
            report = beside("verify", *args, ok=(0, 4))["verify"]
            assert report["complete"] and not [f for f in report["findings"] if f["severity"] == "error"], report

        stats = beside("stats")
        assert stats["entries"] > 0, stats
        verify_beside()
        evicted = beside("evict", "--keep", "0.5", "--lock-wait", "30", "--yes")
        assert evicted["evicted"] > 0, evicted
        compacted = beside("compact", "--lock-wait", "30")
        assert compacted["performed"] and compacted["bytes_freed"] > 0, compacted
        verify_beside("--full")
        driver.line("iteration")
        driver.line("iteration")
        stop.touch()
        driver.line("stopped")
        assert driver.wait() == 0, driver.stderr()
    finally:
        driver.close()
    counts = json.loads(counts_path.read_text())
    assert counts["failures"] == [], counts["failures"]
    assert counts["errors"] == counts["mismatched"] == 0, counts
    assert counts["put_failed"] == counts["failed_commits"] == counts["bad_chunks"] == 0, counts
    assert counts["retrieves"] == 2 * counts["iterations"] and counts["whole"] > 0, counts
    assert hmem_cli("verify", "--full", str(store))["verify"]["ok"]


def test_chunks_committed_before_a_kill_survive_it(
    lmcache_python: str, reader: Reader, written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    _, w = written
    chunk = w["chunk_size"]
    store = tmp_path / "killed"
    driver = Driver(lmcache_python, "kill", str(store), log=tmp_path / "kill.log")
    try:
        _, commits, keys = driver.line("committed").split(" ", 2)
        committed = set(json.loads(keys))
        # killed while it stores and commits more: once two commits followed the line
        while int(driver.line("stored").split()[-1]) < int(commits) + 2:
            pass
        driver.proc.send_signal(signal.SIGKILL)
        assert driver.wait() == -signal.SIGKILL
    finally:
        driver.close()
    assert committed == {key for req in w["requests"] for key in req["keys"]}
    assert committed < store_keys(store)  # and some of what followed
    report = hmem_cli("verify", str(store), ok=(0, 4))["verify"]  # a killed commit's shard: a warning
    assert report["complete"] and not [f for f in report["findings"] if f["severity"] == "error"], report
    tier = reader.read("hmem", store)
    for req in w["requests"]:
        whole = len(req["keys"]) * chunk
        assert tier[req["name"]]["lookup"] == whole, req["name"]
        assert_exact(tier[req["name"]], req, whole, chunk)


def flip_tensor_byte(store: Path, tensor: str) -> None:
    """Flip a byte in the middle of `tensor`'s data in whichever shard file
    holds it (a shard is a safetensors file: docs/format.md)."""
    for shard in sorted(store.glob("shard_*.safetensors")):
        with open(shard, "r+b") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            if tensor not in header:
                continue
            start, end = header[tensor]["data_offsets"]
            f.seek(8 + size + (start + end) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
            return
    raise AssertionError(f"no shard of {store} holds {tensor}")


def test_a_chunk_failing_its_checksum_is_a_miss(
    reader: Reader, written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, w = written
    chunk = w["chunk_size"]
    damaged = tmp_path / "damaged"
    shutil.copytree(out / "hmem", damaged)
    [c] = [req for req in w["requests"] if req["name"] == "c"]
    key = c["keys"][2]  # c's own third chunk: c should hit its first two only
    with hmem.Store.open(str(damaged), read_only=True) as s:
        ids = s.chunks.ids(key)
    assert ids is not None
    flip_tensor_byte(damaged, f"k_{ids[1]}")  # the keys of its second layer
    tier = reader.read("hmem", damaged)
    for req in w["requests"]:
        name = req["name"]
        expected = 2 * chunk if name == "c" else len(req["keys"]) * chunk
        assert_exact(tier[name], req, expected, chunk)  # never the damaged bytes
        assert tier[name]["lookup_after_retrieve"] == expected, name
    report = hmem_cli("verify", "--full", str(damaged), ok=(4,))["verify"]
    named = {finding.get("entry_id") for finding in report["findings"] if finding["code"] == "tensor.checksum"}
    assert named == {ids[1]}, report["findings"]
