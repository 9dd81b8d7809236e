"""The conformance suite: one set of store behaviours, run over every place
a store's bytes can live (docs/format.md, "Stores on object storage").

Each test takes ``location``, a fresh store location on one backend:

- ``directory``: a store directory under tmp_path;
- ``memory``: ``memory://bucket/prefix``, the object-storage client over
  objects held in this process (so a child process cannot see them);
- ``s3``: ``s3://bucket/prefix`` on the local S3 server of tests/conftest.py.

The fixture's value is a ``Backend``: the store's URL or path, and raw
access to the bytes of its files or objects, for the test harness alone
(damage a shard, remove a small file, let a dead writer's lease run out):
everything else goes through hmem's public API.  ``data`` holds the small
deterministic entries every test puts, and ``child`` runs a writer in a
process of its own that the test stops or kills at a line it prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import hmem

BACKENDS = ("directory", "memory", "s3")
HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)

# Small stores: 32 dimensions, 6 tokens an entry (about 1.9 kB in its
# shard), shards sealed at 8 kB: a few dozen entries make several shards.
DIM, HDC, TOKENS = 32, 256, 6
CONFIG = dict(embed_dim=DIM, hdc_dim=HDC, shard_max_bytes=8 << 10)

# The entries of a seed, in this process and in a child writer alike (the
# child runs this text too, so both put the very same bytes).
KV_SOURCE = f"""
import numpy as _np

def kv(seed, tokens={TOKENS}):
    rng = _np.random.default_rng(seed)
    return (
        rng.standard_normal((tokens, {DIM})).astype(_np.float32),
        rng.standard_normal((tokens, {DIM})).astype(_np.float32),
    )
"""
_kv_namespace: dict = {}
exec(KV_SOURCE, _kv_namespace)
kv: Callable[..., tuple[np.ndarray, np.ndarray]] = _kv_namespace["kv"]


# ---- where a store lives ---------------------------------------------------------------


@dataclasses.dataclass
class Backend:
    """A store location and raw access to its bytes (the harness's only
    way below hmem's API).  Names are relative to the store: a directory's
    file names, or object keys under the store's prefix."""

    kind: str
    url: str
    can_cross_processes: bool
    names: Callable[[], list[str]]
    read: Callable[[str], bytes]
    write: Callable[[str, bytes], object]
    delete: Callable[[str], None]

    @property
    def on_object_storage(self) -> bool:
        return self.kind != "directory"

    def shard_names(self) -> list[str]:
        """The shard files (objects) present, committed or not."""
        return sorted(name for name in self.names() if name.endswith(".safetensors"))

    def records_file_names(self) -> list[str]:
        """Where the store's records live: entries.bin in a directory; on
        object storage the newest state object (a closed writer's last
        snapshot holds them whole; older ones wait out their retire time)."""
        if self.on_object_storage:
            return sorted(name for name in self.names() if name.startswith("state/"))[-1:]
        return [name for name in ("entries.bin",) if name in self.names()]

    def flip_byte(self, name: str, offset: int) -> None:
        """Invert the bits of one byte (negative offsets count from the end)."""
        data = bytearray(self.read(name))
        data[offset] ^= 0xFF
        self.write(name, bytes(data))

    def expire_lease(self) -> None:
        """The lease a vanished writer left runs out now, as time passing
        would (docs/format.md, "The writer's lease").  A directory needs
        nothing: a dead process's lock goes with it."""
        if not self.on_object_storage:
            return
        lease = json.loads(self.read("lease.json"))
        self.write("lease.json", json.dumps({**lease, "expires": 0}).encode())


def _directory_backend(root: Path) -> Backend:
    def names() -> list[str]:
        if not root.exists():
            return []
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    return Backend(
        kind="directory",
        url=str(root),
        can_cross_processes=True,
        names=names,
        read=lambda name: (root / name).read_bytes(),
        write=lambda name, data: (root / name).write_bytes(data),
        delete=lambda name: (root / name).unlink(),
    )


def _memory_backend(url: str) -> Backend:
    from hmem.object_store import ObjectClient

    client = ObjectClient(url)  # the same in-process bucket the store's own client uses

    def names() -> list[str]:
        return sorted(key for key, _ in client.list())

    return Backend(
        kind="memory",
        url=url,
        can_cross_processes=False,  # memory:// objects live in this process only
        names=names,
        read=lambda name: client.get(name)[0],
        write=lambda name, data: client.put(name, data),
        delete=lambda name: client.delete([name]),
    )


def _s3_backend(server, url: str) -> Backend:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    boto = server.boto()

    def names() -> list[str]:
        out = []
        for page in boto.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            out += [item["Key"][len(prefix) + 1 :] for item in page.get("Contents", [])]
        return sorted(out)

    return Backend(
        kind="s3",
        url=url,
        can_cross_processes=True,
        names=names,
        read=lambda name: boto.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read(),
        write=lambda name, data: server.put_object(prefix, name, data),
        delete=lambda name: server.delete_object(prefix, name),
    )


@pytest.fixture
def new_location(request, tmp_path, monkeypatch) -> Callable[[str], Backend]:
    """``new_location(kind)`` -> a fresh Backend of that kind (several may be made)."""
    made = 0
    monkeypatch.setenv("HMEM_CACHE_DIR", str(tmp_path / "hmem-cache"))  # stores' working copies: private

    def make(kind: str) -> Backend:
        nonlocal made
        made += 1
        name = f"{request.node.originalname[:40]}-{made}-{uuid.uuid4().hex[:8]}"
        if kind == "directory":
            return _directory_backend(tmp_path / name)
        if kind == "memory":
            return _memory_backend(f"memory://{uuid.uuid4().hex[:12]}/{name}")
        if kind == "s3":
            server = request.getfixturevalue("s3_env")  # the server starts only for tests that use it
            from_conftest = request.getfixturevalue("s3_url")  # its bucket, as the root suite names it
            bucket = from_conftest[len("s3://") :].partition("/")[0]
            return _s3_backend(server, f"s3://{bucket}/{name}")
        raise ValueError(kind)

    return make


@pytest.fixture(params=BACKENDS)
def location(request, new_location) -> Backend:
    """A fresh store location on each backend in turn."""
    return new_location(request.param)


# ---- the entries the tests put ----------------------------------------------------------


class Data:
    """Deterministic entries by seed, and checks of what a store holds."""

    config = CONFIG
    dim = DIM
    kv = staticmethod(kv)

    @staticmethod
    def fill(store: hmem.Store, seeds, layer: int = 0, importance: float = 1.0) -> dict[int, int]:
        """Put one entry per seed (one put_many); returns {entry id: seed}."""
        seeds = list(seeds)
        ids = store.put_many([(*kv(seed), layer, importance) for seed in seeds])
        return dict(zip(ids, seeds))

    @staticmethod
    def check_kv(store: hmem.Store, id_to_seed: dict[int, int]) -> None:
        """The store's live entries are exactly these, each bit-exact as put."""
        assert store.entry_ids() == sorted(id_to_seed)
        for entry_id, seed in id_to_seed.items():
            keys, values = kv(seed)
            got = store.get(entry_id)
            assert got.keys.tobytes() == keys.tobytes() and got.values.tobytes() == values.tobytes(), entry_id

    @staticmethod
    def rankings(store: hmem.Store, seeds, layer: int = 0, top_k: int = 5) -> list[list[tuple[int, float]]]:
        """(entry id, similarity) of each seed's query, uncounted."""
        out = []
        for seed in seeds:
            found = store.query(kv(seed)[0], layer, top_k=top_k, count_access=False)
            out.append([(r.entry_id, r.similarity) for r in found])
        return out


@pytest.fixture(scope="session")
def data() -> Data:
    return Data()


# ---- a writer in a process of its own -------------------------------------------------------


class Child:
    """A Python process whose stdout lines the test waits for."""

    def __init__(self, code: str, cwd: Path) -> None:
        env = dict(os.environ)  # the S3 server's endpoint and the cache directory included
        env.pop("HMEM_CRASH_AT", None)
        env.pop("HMEM_PAUSE_AT", None)
        self.stderr_path = cwd / f"child-{uuid.uuid4().hex[:8]}.err"
        self._stderr = open(self.stderr_path, "w")  # closed by finish()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", KV_SOURCE + "\n" + code],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )

    def line(self) -> str:
        """The child's next line (a failure if it ends or hangs first)."""
        got: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(HANG_GUARD)
        assert got and got[0], f"the child printed nothing more:\n{self.stderr_path.read_text()}"
        return got[0].strip()

    def expect(self, wanted: str) -> None:
        line = self.line()
        assert line == wanted, f"expected {wanted!r}, got {line!r}:\n{self.stderr_path.read_text()}"

    def wait_stopped(self) -> None:
        """Wait until the child stops itself (HMEM_PAUSE_AT: SIGSTOP at a named point)."""
        out: list[int] = []
        waiter = threading.Thread(target=lambda: out.append(os.waitpid(self.proc.pid, os.WUNTRACED)[1]), daemon=True)
        waiter.start()
        waiter.join(HANG_GUARD)
        assert out, "the child did not stop"
        assert os.WIFSTOPPED(out[0]), f"the child ended instead of stopping:\n{self.stderr_path.read_text()}"

    def kill(self) -> None:
        """SIGKILL, as a machine that loses power ends a writer."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(HANG_GUARD)
        assert self.proc.returncode == -signal.SIGKILL, self.stderr_path.read_text()

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(HANG_GUARD)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()


@pytest.fixture
def child(tmp_path) -> Iterator[Callable[[str], Child]]:
    """``child(code)`` starts ``python -c KV_SOURCE + code`` (cwd tmp_path,
    this process's environment); every child is killed at teardown."""
    started: list[Child] = []

    def start(code: str) -> Child:
        proc = Child(code, tmp_path)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.finish()


@pytest.fixture(scope="session")
def conformance() -> types.SimpleNamespace:
    """Constants of the suite, for the test modules (which cannot import this file)."""
    return types.SimpleNamespace(backends=BACKENDS, hang_guard=HANG_GUARD, dim=DIM, config=CONFIG)
