"""Shared test settings and fixtures.

Hypothesis profiles (pick one with HYPOTHESIS_PROFILE=<name>):

- ``ci`` (default): no deadline (shared 2-core runners stall), no example
  database (runs do not depend on earlier runs), 100 examples a test
  (Hypothesis's own default), within the suite's 10-minute budget;
- ``dev``: fewer examples, for a quick edit-test loop; the quick subset
  (``pytest -m "not stress"``) takes it unless HYPOTHESIS_PROFILE says otherwise;
- ``thorough``: many examples, for a soak run before a release.

The ``stress`` marker (pyproject.toml) names the heavy tests: crash, kill
and signal loops, state machines, end-to-end runs of many commands.  The
default run takes everything; ``-m "not stress"`` is the quick subset for
work on hmem (README.md, "Test it").

Tests run with ``--import-mode=importlib``, so they cannot import each other or
this file; shared helpers are fixtures.  They run on one worker process per
CPU (pytest-xdist, pyproject.toml's addopts), so a test must not depend on
another having run in its process, nor on a fixed path or port of its own
outside its tmp_path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, settings

from hmem import kernels
from hmem.kernels._native import _bitops

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

settings.register_profile("ci", max_examples=100, database=None, **_COMMON)
settings.register_profile("dev", max_examples=20, **_COMMON)
settings.register_profile("thorough", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    # The quick subset is an edit-test loop: fewer Hypothesis examples too.
    if "HYPOTHESIS_PROFILE" not in os.environ and "not stress" in (config.option.markexpr or ""):
        settings.load_profile("dev")
    _build_each_cli_app_once()


def _build_each_cli_app_once() -> None:
    """Typer's CliRunner builds the click command of the application it is
    given on every invoke: each command's options read from its signature,
    string annotations evaluated, about 80 ms for hmem's fourteen commands,
    more than most commands take to run.  The `hmem` process builds it once
    (hmem/cli/app.py); the tests now do too, per application object.  A
    click command keeps no state between invocations (each gets its own
    context), so one built command serves every invoke."""
    import typer.testing

    build = typer.testing._get_command
    built: dict[int, tuple[object, object]] = {}

    def build_once(typer_app):
        key = id(typer_app)
        if key not in built or built[key][0] is not typer_app:
            built[key] = (typer_app, build(typer_app))  # the app is kept, so its id is not reused
        return built[key][1]

    typer.testing._get_command = build_once


# ---- CPU paths of the native kernels ----------------------------------------


def _native_paths() -> tuple[str, ...]:
    if kernels.KERNEL_SET == "native":
        return kernels.available_cpu_paths()
    # HMEM_KERNELS=reference: hmem.kernels does not drive the native module,
    # so drive it directly (the twin tests still compare it to the reference).
    return _bitops.PATH_NAMES[: _bitops.best_path() + 1]


def _current() -> str:
    if kernels.KERNEL_SET == "native":
        return kernels.cpu_path()  # loads the kernels (and applies HMEM_CPU) if not yet done
    return _bitops.PATH_NAMES[_bitops.active_path()]


def _select(name: str) -> str:
    if kernels.KERNEL_SET == "native":
        return kernels.select_cpu_path(name)
    return _bitops.PATH_NAMES[_bitops.select_path(_bitops.PATH_NAMES.index(name))]


@contextmanager
def _on_cpu_path(name: str) -> Iterator[str]:
    """Run the native kernels on CPU path `name`, then restore the path in use before."""
    before = _current()
    used = _select(name)
    assert used == name, f"asked for CPU path {name!r}, got {used!r}"
    assert _bitops.PATH_NAMES[_bitops.active_path()] == name
    try:
        yield name
    finally:
        _select(before)


@pytest.fixture(scope="session")
def cpu_paths() -> tuple[str, ...]:
    """Every CPU path of the native kernels this machine can run, slowest first."""
    paths = _native_paths()
    assert paths and paths[0] == "portable"
    return paths


@pytest.fixture(scope="session")
def on_cpu_path():
    """A context manager: ``with on_cpu_path("popcnt"): ...``."""
    return _on_cpu_path


@pytest.fixture(scope="session")
def on_every_cpu_path(cpu_paths) -> Callable[[Callable[[], object]], dict[str, object]]:
    """``on_every_cpu_path(fn)`` calls fn once per CPU path and returns {path: result}."""

    def run(fn: Callable[[], object]) -> dict[str, object]:
        out = {}
        for name in cpu_paths:
            with _on_cpu_path(name):
                out[name] = fn()
        return out

    return run


@pytest.fixture(scope="module", autouse=True)
def _restore_cpu_path() -> Iterator[None]:
    """Whatever a test module does to the CPU path, the next module starts from the same one."""
    before = _current()
    yield
    _select(before)
    assert _current() == before


# ---- the store engine (tests/test_store*.py) ------------------------------------
#
# Small stores in tmp_path, a snapshot of a store directory, the signature
# as the format defines it (computed with the pure-Python reference), a
# rewrite of index.json with a correct checksum, and a subprocess runner.

import base64 as _base64  # noqa: E402
import json as _json  # noqa: E402
import subprocess as _subprocess  # noqa: E402
import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

import numpy as _np  # noqa: E402


@pytest.fixture
def store_factory(tmp_path):
    """``store_factory(name="s", **config)`` creates a store under tmp_path
    (embed_dim 16, hdc_dim 256 unless given); every store it makes, and every
    store passed to ``store_factory.track``, is closed at teardown."""
    import hmem

    made: list = []

    def make(name: str = "s", **config):
        config.setdefault("embed_dim", 16)
        config.setdefault("hdc_dim", 256)
        store = hmem.Store.create(tmp_path / name, **config)
        made.append(store)
        return store

    def track(store):
        made.append(store)
        return store

    make.track = track
    yield make
    for store in reversed(made):
        try:
            store.close()
        except Exception:
            pass


@pytest.fixture
def snapshot_dir():
    """``snapshot_dir(path)`` -> {file name: bytes} of every file in a store directory."""

    def snap(path) -> dict[str, bytes]:
        root = _Path(path)
        return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}

    return snap


@pytest.fixture(scope="session")
def ref_signature():
    """``ref_signature(keys, embed_dim, hdc_dim, seed)`` -> the packed signature of
    float32 rows, computed by hmem.kernels.reference.projection (the format's definition)."""
    from hmem.kernels.reference import projection as ref

    def sig(keys, embed_dim: int, hdc_dim: int, seed: int = 0) -> _np.ndarray:
        m = max(64, 1 << (embed_dim - 1).bit_length())
        blocks = -(-hdc_dim // m)
        signs = ref.signs_table(seed, m, 3, blocks)
        out = _np.zeros(hdc_dim // 8, dtype=_np.uint8)
        ref.signature(_np.ascontiguousarray(keys, dtype=_np.float32), signs, m, 3, hdc_dim, out)
        return out

    return sig


def _index_checksum(body: dict) -> str:
    from hmem.kernels import checksum

    canonical = _json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return f"crc32c:{checksum.crc32c(canonical):08x}"


@pytest.fixture(scope="session")
def index_checksum():
    """``index_checksum(doc_without_checksum)`` -> "crc32c:xxxxxxxx", per docs/format.md."""
    return _index_checksum


@pytest.fixture(scope="session")
def rewrite_index():
    """``rewrite_index(store_dir, edit)``: load index.json, call edit(doc) (which
    changes it in place), write it back with a correct checksum."""

    def rewrite(store_dir, edit) -> dict:
        path = _Path(store_dir) / "index.json"
        doc = _json.loads(path.read_text())
        doc.pop("checksum")
        edit(doc)
        doc["checksum"] = _index_checksum(doc)
        path.write_text(_json.dumps(doc, indent=1) + "\n")
        return doc

    return rewrite


@pytest.fixture(scope="session")
def read_index():
    """``read_index(store_dir)`` -> index.json as a dict, pending record updates decoded."""
    from hmem.formats.records import UPDATE_DTYPE

    def read(store_dir) -> dict:
        doc = _json.loads((_Path(store_dir) / "index.json").read_text())
        raw = _base64.b64decode(doc["pending"]["record_updates"])
        doc["pending"]["record_updates"] = _np.frombuffer(raw, dtype=UPDATE_DTYPE).copy()
        return doc

    return read


@pytest.fixture(scope="session")
def read_records():
    """``read_records(store_dir)`` -> the committed records of entries.bin (hmem.formats.records.read)."""
    from hmem.formats import records

    def read(store_dir) -> _np.ndarray:
        from hmem import StoreConfig

        doc = _json.loads((_Path(store_dir) / "index.json").read_text())
        return records.read(_Path(store_dir) / "entries.bin", doc["record_count"], StoreConfig.from_dict(doc["config"]))

    return read


@pytest.fixture
def run_python(tmp_path):
    """``run_python(code, env=None, timeout=60)`` runs ``sys.executable -c code`` with
    cwd = tmp_path (outside the checkout) and returns the CompletedProcess."""

    def run(code: str, *, env: dict | None = None, timeout: float = 60, check: bool = False):
        full_env = dict(os.environ)
        full_env.pop("HMEM_CRASH_AT", None)
        full_env.update(env or {})
        proc = _subprocess.run(
            [_sys.executable, "-c", code], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run


# ---- verify, repair and corruption (tests/test_verify.py, tests/test_corruption.py) ----
#
# One small store per setting (F32 / INT8), built once per session and copied
# by each test before it damages it: three layers, five shards (a small
# shard_max_bytes), three evicted entries, some access counts.  What the
# clean store returns (every entry's K/V, every probe query's ranking) is
# recorded so that a damaged or repaired copy can be compared with it.

import shutil as _shutil  # noqa: E402
import types as _types  # noqa: E402

RELIABILITY_EMBED, RELIABILITY_HDC = 16, 256


def _build_reliability_template(path: _Path, quantized: bool) -> _types.SimpleNamespace:
    import hmem

    rng = _np.random.default_rng(7)
    puts: dict[int, tuple] = {}
    with hmem.Store.create(
        path,
        embed_dim=RELIABILITY_EMBED,
        hdc_dim=RELIABILITY_HDC,
        shard_max_bytes=4200 if quantized else 3400,
        quantize_stored=quantized,
    ) as store:
        for i in range(14):
            n = 1 + i % 3
            keys = rng.standard_normal((n, RELIABILITY_EMBED)).astype(_np.float32)
            values = rng.standard_normal((n, RELIABILITY_EMBED)).astype(_np.float32)
            # entries 3, 8 and 12 get the lowest importance: evict(11) takes them
            entry_id = store.put(keys, values, layer_idx=i % 3, importance=0.1 if i in (2, 7, 11) else 1.0 + i)
            puts[entry_id] = (keys, values, i % 3)
        store.flush()
        assert store.evict(11) == 3
        for entry_id in (1, 2, 4, 5, 5, 6):  # access counts that must survive a repair
            keys, _, layer = puts[entry_id]
            store.query(keys, layer, 1)
        # Commit the counts now, so that close's commit (the exact next id)
        # lists no pending step: the template verifies with no finding at all.
        store.flush()
    assert not hmem.verify(path, full=True).findings
    recs = hmem.formats.records.read(path / "entries.bin", 14, RELIABILITY_HDC // 8)
    evicted = {int(r["entry_id"]) for r in recs if r["shard_idx"] == hmem.formats.records.EVICTED}
    assert evicted == {3, 8, 12}
    live = set(puts) - evicted
    shard_of = {int(r["entry_id"]): int(r["shard_idx"]) for r in recs if int(r["entry_id"]) in live}
    queries = [(puts[i][0], puts[i][2]) for i in sorted(puts)]
    kv: dict[int, tuple] = {}
    results: list[list[tuple]] = []
    with hmem.Store.open(path, read_only=True) as reader:
        for q, layer in queries:
            found = reader.query(q, layer, top_k=len(puts))
            results.append([(r.entry_id, r.similarity, r.cosine) for r in found])
            for r in found:
                kv[r.entry_id] = (_np.array(r.keys), _np.array(r.values))
    assert set(kv) == live
    for entry_id in live:
        keys, values, _ = puts[entry_id]
        if quantized:  # within half a scale step of the input (docs/format.md)
            assert _np.all(_np.abs(kv[entry_id][0] - keys) <= _np.abs(keys).max(axis=1, keepdims=True) / 254 + 1e-6)
        else:
            assert kv[entry_id][0].tobytes() == keys.tobytes() and kv[entry_id][1].tobytes() == values.tobytes()
    assert len(set(shard_of.values())) >= 4
    return _types.SimpleNamespace(
        path=path,
        quantized=quantized,
        puts=puts,
        kv=kv,
        live=live,
        evicted=evicted,
        shard_of=shard_of,
        records=recs,
        queries=queries,
        results=results,
        top_k=len(puts),
    )


@pytest.fixture(scope="session")
def reliability_template(tmp_path_factory):
    """``reliability_template(quantized)`` -> a namespace describing a small
    closed store (built once per session per setting; copy it with
    ``clone_store`` before changing it): ``path``, ``quantized``, ``puts``
    {entry id: (keys, values, layer)}, ``kv`` {live entry id: (keys, values)
    as the clean store returns them}, ``live`` and ``evicted`` (entry ids),
    ``shard_of`` {live entry id: shard index}, ``records`` (entries.bin),
    ``queries`` [(query rows, layer)], ``results`` [[(entry id, similarity,
    cosine)] per query, top_k=``top_k`` covering every entry of a layer]."""
    built: dict[bool, _types.SimpleNamespace] = {}

    def get(quantized: bool) -> _types.SimpleNamespace:
        if quantized not in built:
            root = tmp_path_factory.mktemp("reliability")
            built[quantized] = _build_reliability_template(root / ("int8" if quantized else "f32"), quantized)
        return built[quantized]

    return get


@pytest.fixture
def clone_store(tmp_path):
    """``clone_store(template, name="s")`` -> a fresh copy of the template's
    store directory under tmp_path (lock file included, empty)."""

    def clone(template, name: str = "s") -> _Path:
        dst = tmp_path / name
        _shutil.copytree(template.path, dst)
        return dst

    return clone


@pytest.fixture(scope="session")
def dir_state():
    """``dir_state(path)`` -> {file name: (bytes, mtime_ns)} of a directory,
    for asserting that something wrote nothing at all."""

    def state(path) -> dict[str, tuple[bytes, int]]:
        root = _Path(path)
        return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.iterdir()) if p.is_file()}

    return state


@pytest.fixture(scope="session")
def probe_store():
    """``probe_store(path, template, read_only=...)`` opens the store and runs
    every probe query of the template.  Opening and each query must either
    raise CorruptStoreError / NotAStoreError / StoreChangedError or return
    exactly what the clean store returned (ids, scores, K/V bit for bit).
    Returns a namespace: ``opened``, ``open_error``, ``served`` and
    ``refused`` (query counts), ``errors`` (the refusals' exception types).
    With ``keep`` (entry ids), the clean results are first restricted to
    those entries (a repaired store that dropped the others), and with
    ``exact_scores=False`` cosines may differ in the last bits (the
    candidate set changed)."""
    import hmem

    allowed = (hmem.CorruptStoreError, hmem.NotAStoreError, hmem.StoreChangedError)

    def probe(
        path, template, *, read_only: bool, keep: set | None = None, exact_scores: bool = True
    ) -> _types.SimpleNamespace:
        out = _types.SimpleNamespace(opened=False, open_error=None, served=0, refused=0, errors=[])
        try:
            store = hmem.Store.open(path, read_only=read_only)
        except allowed as exc:
            assert exc.message and exc.hint, exc  # a clear error: what happened, what to do
            out.open_error = type(exc)
            return out
        out.opened = True
        with store:
            for (q, layer), expected in zip(template.queries, template.results):
                try:
                    found = store.query(q, layer, top_k=template.top_k, count_access=False)
                except allowed as exc:
                    assert exc.message, exc
                    out.refused += 1
                    out.errors.append(type(exc))
                    continue
                if keep is not None:
                    expected = [row for row in expected if row[0] in keep]
                assert [(r.entry_id, r.similarity) for r in found] == [row[:2] for row in expected]
                cosines = [r.cosine for r in found]
                if exact_scores:
                    assert cosines == [row[2] for row in expected]
                else:  # BLAS rounds a row's dot product differently with the candidate count
                    assert cosines == pytest.approx([row[2] for row in expected], rel=1e-12, abs=1e-12)
                for r in found:
                    keys, values = template.kv[r.entry_id]
                    assert r.keys.dtype == keys.dtype and r.keys.shape == keys.shape
                    assert _np.asarray(r.keys).tobytes() == keys.tobytes()
                    assert _np.asarray(r.values).tobytes() == values.tobytes()
                out.served += 1
        return out

    return probe


# ---- the few checks that need the Store's internals ------------------------------
#
# Everything else in the tests reads a store through its public API
# (Store.entry_ids, get, entries, stats, query) or reads the on-disk format
# with hmem.formats.  What these helpers check, no public API exposes: how
# many shard files are memory-mapped at once, a put failing after it has
# sealed shards, and a writer that vanishes (as a killed process would)
# without flushing or closing.  They are the one
# place that names the Store's private attributes: update them here when
# those attributes move.


class _StoreInternals:
    @staticmethod
    def open_shard_maps(store) -> int:
        """How many shard files the store holds memory-mapped now."""
        return store._state.cache.open_count()  # private: the shard map cache has no public view

    @staticmethod
    def shard_map_limit(store) -> int:
        """How many shard files the store keeps memory-mapped at most (max_open_shards in use)."""
        return store._state.cache.capacity  # private: see open_shard_maps

    @staticmethod
    @contextmanager
    def watch_shard_maps(store) -> Iterator[list[int]]:
        """Within the block, every time the store maps (or reuses) a shard,
        the number of shard maps it then holds open is appended to the
        yielded list: ``max(counts)`` is the peak."""
        cache = store._state.cache  # private: see open_shard_maps
        real_get = cache.get
        counts: list[int] = []

        def counting_get(*args, **kwargs):
            reader = real_get(*args, **kwargs)
            counts.append(cache.open_count())
            return reader

        cache.get = counting_get
        try:
            yield counts
        finally:
            del cache.get  # back to the class's method

    @staticmethod
    def prepared_joined(store, entries) -> bool:
        """Whether put_many would join these entries' rows into one array
        (small entries) rather than take them one by one (large ones):
        the two ways a batch is prepared (hmem/store/prepare.py), which
        tests of both need to know they reach."""
        from hmem.store import prepare

        batch = prepare.prepare_all(store._state, entries)  # private: the way taken is not visible outside
        batch.release()
        return batch.joined

    @staticmethod
    @contextmanager
    def failing_records_growth(store) -> Iterator[None]:
        """Within the block, the put that next grows the store's records
        raises MemoryError there: after it has sealed its shards, before it
        is in (hmem/store/writer.py, insert).  No public input fails a put
        that late."""
        state = store._state  # private: the records' growth has no public hook

        def fail(count: int) -> None:
            del state.grow  # once: back to the class's method
            raise MemoryError("no memory for the records (injected)")

        state.grow = fail
        try:
            yield
        finally:
            state.__dict__.pop("grow", None)

    @staticmethod
    @contextmanager
    def seals_in_the_writers_thread() -> Iterator[None]:
        """Within the block, a shard that a put fills is written when the
        writer next waits for it (before its next write or commit), in the
        writer's own thread, not on a thread of its own while the put goes on
        (hmem/store/shard_builder.py, SealInFlight).  The writer's file
        operations then come in the same order on every run, however busy
        the machine, so a fault hook can count them.  It is the path a
        signal that lands between sealing and starting the thread takes."""
        from hmem.store.shard_builder import SealInFlight

        start = SealInFlight.start
        SealInFlight.start = lambda self: None  # private: the seal's thread has no public switch
        try:
            yield
        finally:
            SealInFlight.start = start

    @staticmethod
    def abandon_writer(store) -> None:
        """The writer vanishes as a killed process would: its lock is
        released, nothing is flushed, and the object is closed without
        close() (which would flush).  No public API drops a writer unflushed."""
        store._state.shut()  # private (see the docstring): closed, maps dropped, lock released, no flush


@pytest.fixture(scope="session")
def store_internals() -> _StoreInternals:
    """``store_internals.open_shard_maps(store)``, ``.shard_map_limit(store)``,
    ``.watch_shard_maps(store)`` (a context manager), ``.prepared_joined(store, entries)``,
    ``.failing_records_growth(store)``, ``.seals_in_the_writers_thread()`` (context managers) and
    ``.abandon_writer(store)``: the only checks that reach past the Store's
    public API (see the comment above _StoreInternals)."""
    return _StoreInternals()


# ---- a local S3-compatible server (stores on object storage) ------------------------
# moto in server mode, started on 127.0.0.1 by the tests and stopped after
# them: real HTTP requests, real conditional writes (docs/format.md,
# "Stores on object storage").  Its data lives in this process, so a server
# stopped and started again on the same port holds what it held.

S3_BUCKET = "hmem-tests"
S3_ACCESS = {"AWS_ACCESS_KEY_ID": "hmem-test", "AWS_SECRET_ACCESS_KEY": "hmem-test-secret", "AWS_REGION": "us-east-1"}


class S3Server:
    """A moto server on 127.0.0.1 that a test may stop and start again."""

    def __init__(self, port: int = 0) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{self.port}"
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._server.stop()
            self.running = False

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        if not self.running:
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            self._server.start()
            self.running = True

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, **S3_ACCESS}

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Every object under `prefix` of the test bucket, read directly."""
        client = self.boto()
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=prefix + "/"):
            for item in page.get("Contents", []):
                key = item["Key"]
                out[key[len(prefix) + 1 :]] = client.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read()
        return out

    def put_object(self, prefix: str, key: str, data: bytes) -> None:
        self.boto().put_object(Bucket=S3_BUCKET, Key=f"{prefix}/{key}", Body=data)

    def delete_object(self, prefix: str, key: str) -> None:
        self.boto().delete_object(Bucket=S3_BUCKET, Key=f"{prefix}/{key}")

    def boto(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_ACCESS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ACCESS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    server.boto().create_bucket(Bucket=S3_BUCKET)
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path) -> S3Server:
    """The standard AWS environment pointed at the local server, and a
    private cache directory for the stores' working copies."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HMEM_CACHE_DIR", str(tmp_path / "hmem-cache"))
    return s3_server


@pytest.fixture
def s3_url(s3_env, request) -> str:
    """A fresh store URL (its own prefix of the test bucket)."""
    import uuid

    return f"s3://{S3_BUCKET}/{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["s3", "memory"])
def object_url(request, monkeypatch, tmp_path) -> str:
    """A fresh store URL on each object-storage backend: the local S3
    server, and memory:// (the same client over objects held in this
    process), so that one test holds for both."""
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    import uuid

    monkeypatch.setenv("HMEM_CACHE_DIR", str(tmp_path / "hmem-cache"))
    return f"memory://{uuid.uuid4().hex[:12]}/{request.node.originalname[:40]}"


@pytest.fixture
def own_s3_server(s3_server) -> Iterator[S3Server]:
    """A second server of the test's own, which it may stop and start; it
    sees the session server's buckets (moto keeps one backend per process)."""
    server = S3Server()
    yield server
    server.stop()
