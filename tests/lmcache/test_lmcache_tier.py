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
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import pytest

import hmem

DRIVER = Path(__file__).with_name("tier_driver.py")
CEILING = 300  # seconds: a hung driver fails the test, nothing waits this long otherwise
ROUNDS = 3  # of hmem evict and hmem compact beside the engine: each shard rewrite races its reads


class Driver:
    """A tier_driver.py process: orders to its stdin, lines from its stdout."""

    def __init__(self, python: str, log: Path) -> None:
        self.log_path = log
        self.log = open(log, "w")  # a file: a pipe left unread could fill
        self.proc = subprocess.Popen(
            [python, str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )

    def order(self, mode: str, **args: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps({"mode": mode, **args}) + "\n")
        stdin.flush()

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
            if text.startswith("failed "):
                raise AssertionError(json.loads(text.split(" ", 1)[1]))
            if text.startswith(prefix):
                return text.rstrip("\n")

    def wait(self) -> int:
        return self.proc.wait(timeout=CEILING)

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def end_orders(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def finish(self) -> None:
        """End of orders: it exits; kill it if it does not."""
        try:
            if self.proc.poll() is None:
                self.end_orders()
                assert self.wait() == 0, self.stderr()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.log.close()


class Drivers:
    """This module's driver processes (importing LMCache is most of what
    they cost): "writer" writes and runs the loop, "reader" reads (it never
    writes: an engine of a new process), "spare" is killed."""

    def __init__(self, python: str, scratch: Path) -> None:
        self.python, self.scratch = python, scratch
        self.running: dict[str, Driver] = {}
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            # one process runs every test here: start them all now; pytest-xdist's
            # workers share this module's tests out, so each starts what its tests ask for
            for name in ("writer", "reader", "spare"):
                self[name]

    def __getitem__(self, name: str) -> Driver:
        driver = self.running.get(name)
        if driver is None or driver.proc.poll() is not None:  # a spare is started again once killed
            if driver is not None:
                driver.finish()
            driver = self.running[name] = Driver(self.python, self.scratch / f"{name}-{len(self.running)}.log")
        return driver

    def read(self, kind: str, store: Path) -> dict[str, Any]:
        """What an engine of the reader process reads of `store`."""
        out = self.scratch / f"read-{time.monotonic_ns()}.json"
        reader = self["reader"]
        reader.order("read", kind=kind, store=str(store), out=str(out))
        reader.line("done")
        return dict(json.loads(out.read_text())["requests"])

    def finish(self) -> None:
        for driver in self.running.values():
            driver.end_orders()  # all at once: each exit takes a while
        problems = []
        for driver in self.running.values():
            try:
                driver.finish()
            except AssertionError as exc:  # the others are ended all the same
                problems.append(str(exc))
        assert not problems, problems


@pytest.fixture(scope="module")
def drivers(lmcache_python: str, tmp_path_factory: pytest.TempPathFactory):
    started = Drivers(lmcache_python, tmp_path_factory.mktemp("tier-drivers"))
    try:
        yield started
    finally:
        started.finish()


@pytest.fixture(scope="module")
def written(drivers: Drivers, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """fs, hmem and capped stores of the same requests, and what the writer saw."""
    out = tmp_path_factory.mktemp("tier-written")
    drivers["writer"].order("write", out=str(out))
    drivers["writer"].line("written")
    return out, json.loads((out / "written.json").read_text())


def hmem_cli(*args: str, ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """An hmem command in a process of its own; its JSON document."""
    run = subprocess.run(
        [sys.executable, "-m", "hmem", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=CEILING,
        cwd=tempfile.gettempdir(),  # not the checkout: the installed hmem, as every test
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


def test_a_new_engine_reads_what_the_fs_connector_reads(drivers: Drivers, written: tuple[Path, dict[str, Any]]) -> None:
    out, w = written
    chunk = w["chunk_size"]
    fs, tier = drivers.read("fs", out / "fs"), drivers.read("hmem", out / "hmem")
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
    drivers: Drivers, written: tuple[Path, dict[str, Any]]
) -> None:
    out, w = written
    chunk, capped = w["chunk_size"], w["capped"]
    before, after = store_keys(out / "hmem"), store_keys(out / "capped")  # all the chunks; those kept
    assert after < before, "storing under the cap evicted nothing"
    stats = hmem_cli("stats", str(out / "capped"))
    assert stats["bytes_on_disk"] <= capped["max_bytes"], stats
    tier = drivers.read("hmem", out / "capped")
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


def test_admin_commands_beside_an_engine_at_work(drivers: Drivers, tmp_path: Path) -> None:
    store, stop, counts_path = tmp_path / "live", tmp_path / "stop", tmp_path / "counts.json"
    driver = drivers["writer"]
    driver.order("loop", store=str(store), stop=str(stop), counts=str(counts_path))
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
        for _ in range(ROUNDS):
            evicted = beside("evict", "--keep", "0.5", "--lock-wait", "30", "--yes")
            assert evicted["evicted"] > 0, evicted
            compacted = beside("compact", "--lock-wait", "30")
            assert compacted["performed"] and compacted["bytes_freed"] > 0, compacted
        verify_beside("--full")
        driver.line("iteration")
        driver.line("iteration")
    finally:
        stop.touch()
        driver.line("stopped")
    counts = json.loads(counts_path.read_text())
    assert counts["failures"] == [], counts["failures"]
    assert counts["errors"] == counts["mismatched"] == counts["tier_errors"] == 0, counts
    assert counts["put_failed"] == counts["failed_commits"] == counts["bad_chunks"] == 0, counts
    assert counts["retrieves"] == 2 * counts["iterations"] and counts["whole"] > 0, counts
    assert hmem_cli("verify", "--full", str(store))["verify"]["ok"]


def test_chunks_committed_before_a_kill_survive_it(drivers: Drivers, tmp_path: Path) -> None:
    store, stored_path = tmp_path / "killed", tmp_path / "stored.json"
    driver = drivers["spare"]
    driver.order("kill", store=str(store), out=str(stored_path))
    try:
        commits = int(driver.line("committed").split()[1])
        # killed while it stores and commits more: once two commits followed the line
        while int(driver.line("stored").split()[-1]) < commits + 2:
            pass
    finally:
        driver.proc.send_signal(signal.SIGKILL)
    assert driver.wait() == -signal.SIGKILL
    stored = json.loads(stored_path.read_text())
    chunk = stored["chunk_size"]
    committed = {key for req in stored["requests"] for key in req["keys"]}
    assert committed and committed < store_keys(store)  # and some of what followed
    report = hmem_cli("verify", str(store), ok=(0, 4))["verify"]  # a killed commit's shard: a warning
    assert report["complete"] and not [f for f in report["findings"] if f["severity"] == "error"], report
    tier = drivers.read("hmem", store)
    for req in stored["requests"]:
        whole = len(req["keys"]) * chunk
        assert tier[req["name"]]["lookup"] == whole, req["name"]
        assert_exact(tier[req["name"]], req, whole, chunk)


def test_a_put_is_held_by_reference_until_committed(drivers: Drivers, tmp_path: Path) -> None:
    """No copy of a put: the tier keeps LMCache's buffer by a reference of
    its own until the chunk is committed, then gives it back; a put of a
    chunk it holds gives its reference back at once."""
    out = tmp_path / "hold.json"
    driver = drivers["writer"]
    driver.order("hold", store=str(tmp_path / "held"), out=str(out))
    driver.line("done")
    counts = json.loads(out.read_text())
    assert {k: v for k, v in counts.items() if not k.startswith("sha256")} == {
        "before": 1,
        "staged": 2,
        "put_again": 2,
        "committed": 1,
        "put_committed": 1,
    }
    assert counts["sha256_put"] == counts["sha256_stored"]


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
    drivers: Drivers, written: tuple[Path, dict[str, Any]], tmp_path: Path
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
    tier = drivers.read("hmem", damaged)
    for req in w["requests"]:
        name = req["name"]
        expected = 2 * chunk if name == "c" else len(req["keys"]) * chunk
        assert_exact(tier[name], req, expected, chunk)  # never the damaged bytes
        assert tier[name]["lookup_after_retrieve"] == expected, name
    report = hmem_cli("verify", "--full", str(damaged), ok=(4,))["verify"]
    named = {finding.get("entry_id") for finding in report["findings"] if finding["code"] == "tensor.checksum"}
    assert named == {ids[1]}, report["findings"]
