"""Stores on object storage never touch each other, and their failures are
clean and told truly (issue 40, goals 3, 6 and 7), against the local S3
server of tests/conftest.py (moto: real HTTP, real conditional writes).

- `init` refuses a prefix inside another store, around one (a store in a
  sub-prefix), or at a bucket's root beside others; a prefix holding only
  what an interrupted init left is still accepted;
- stores that exist side by side, nested and at a bucket's root all the
  same (made by another hmem, or copied in) stay apart: compacting,
  repairing or putting into one changes no object of another, compared
  by a listing of the whole bucket with ETags and sizes;
- a bucket that does not exist is a one-line error with its exit code;
- a server that does not answer fails a call after one timeout, not after
  one per retry;
- `hmem stats` is not `health: ok` on a store whose shard or state object
  is gone (what verify reports as an error).
"""

from __future__ import annotations

import errno
import json
import re
import socket
import threading
import uuid

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem import ObjectStoreError, PathError, Store, StoreExistsError
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

DIM = 16
HDC = 256
HANG_GUARD = 120  # seconds: a wait that reaches this has failed (only a hang takes so long)
SMALL_SHARDS = 4 << 10  # a few entries a shard: stores of several shards


def _kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = 1 + seed % 3
    return (
        rng.standard_normal((tokens, DIM)).astype(np.float32),
        rng.standard_normal((tokens, DIM)).astype(np.float32),
    )


def _fill(store: Store, seeds) -> dict[int, int]:
    """One entry per seed (importance = seed); returns id -> seed."""
    ids = store.put_many([(*_kv(seed), seed % 2, float(seed)) for seed in seeds])
    return dict(zip(ids, seeds))


def _contents(url: str) -> dict[int, tuple[bytes, bytes]]:
    """What a fresh reader sees: entry id -> (keys, values) bytes."""
    with Store.open(url, read_only=True) as reader:
        out = {}
        for entry_id in reader.entry_ids():
            got = reader.get(entry_id)
            out[entry_id] = (got.keys.tobytes(), got.values.tobytes())
        return out


def _cli(*args):
    """One command run in this process; the S3 environment is the test's."""
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1", "HMEM_STORE": None})


@pytest.fixture
def bucket(s3_env) -> str:
    """A bucket of the test's own, so that a store may sit at its root."""
    name = f"iso-{uuid.uuid4().hex[:12]}"
    s3_env.boto().create_bucket(Bucket=name)
    return name


def _listing(server, bucket: str) -> dict[str, tuple[str, int]]:
    """key -> (ETag, size) of every object of the bucket."""
    out = {}
    for page in server.boto().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            out[item["Key"]] = (item["ETag"], item["Size"])
    return out


def _own(prefix: str) -> re.Pattern:
    """The keys of the store at `prefix` ("" for a bucket's root): the
    names docs/format.md gives its objects, directly under its prefix."""
    head = f"{re.escape(prefix)}/" if prefix else ""
    return re.compile(head + r"(manifest\.json|lease\.json|shards/[^/]+|state/[^/]+)")


def _others(listing: dict[str, tuple[str, int]], prefix: str) -> dict[str, tuple[str, int]]:
    own = _own(prefix)
    return {key: item for key, item in listing.items() if not own.fullmatch(key)}


def _copy_in(server, src_bucket: str, src_prefix: str, bucket: str, prefix: str) -> None:
    """A store's objects copied to another place, object by object (what a
    store made by another hmem, or copied with a sync tool, looks like)."""
    client = server.boto()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=src_bucket, Prefix=src_prefix + "/"):
        for item in page.get("Contents", []):
            rest = item["Key"][len(src_prefix) + 1 :]
            client.copy_object(
                Bucket=bucket,
                Key=f"{prefix}/{rest}" if prefix else rest,
                CopySource={"Bucket": src_bucket, "Key": item["Key"]},
            )


# ---- goal 3: init refuses a prefix inside, around or beside another store ---------------


def test_init_refuses_a_prefix_inside_around_or_beside_another_store(s3_env, bucket):
    server = s3_env
    with Store.create(f"s3://{bucket}/prod", embed_dim=DIM, hdc_dim=HDC) as prod:
        _fill(prod, range(3))
    before = _listing(server, bucket)
    refused = {
        f"s3://{bucket}/prod/canary": "lies inside the hmem store s3://" + bucket + "/prod",
        f"s3://{bucket}/prod/a/b": "lies inside the hmem store s3://" + bucket + "/prod",
        f"s3://{bucket}": f"holds another store (s3://{bucket}/prod/manifest.json)",  # the root beside it
    }
    for url, why in refused.items():
        with pytest.raises(StoreExistsError, match=re.escape(why)):
            Store.create(url, embed_dim=DIM, hdc_dim=HDC)
        result = _cli("init", url, "--embed-dim", DIM)
        assert result.exit_code == ExitCode.FAILURE, result.output
        (line,) = result.stderr.splitlines()  # one line: the message and its hint
        assert line.startswith(f"error: {url} ") and why in line and "choose a prefix" in line
    assert _listing(server, bucket) == before  # nothing made, nothing changed

    # around: a store in a sub-prefix, however deep
    with Store.create(f"s3://{bucket}/team/x/store", embed_dim=DIM, hdc_dim=HDC):
        pass
    with pytest.raises(StoreExistsError, match=re.escape(f"s3://{bucket}/team/x/store/manifest.json")):
        Store.create(f"s3://{bucket}/team", embed_dim=DIM, hdc_dim=HDC)
    # beside: a sibling prefix is another place ("prod" is not a prefix of "production")
    with Store.create(f"s3://{bucket}/production", embed_dim=DIM, hdc_dim=HDC):
        pass


def test_a_store_at_a_bucket_root_takes_no_store_beside_or_inside_it(s3_env, bucket):
    with Store.create(f"s3://{bucket}", embed_dim=DIM, hdc_dim=HDC) as root:
        _fill(root, range(3))
    before = _listing(s3_env, bucket)
    for url in (f"s3://{bucket}/other", f"s3://{bucket}/a/b"):
        with pytest.raises(StoreExistsError, match=f"lies inside the hmem store s3://{bucket}:"):
            Store.create(url, embed_dim=DIM, hdc_dim=HDC)
    assert _listing(s3_env, bucket) == before


def test_init_refuses_a_prefix_holding_other_objects_but_takes_an_interrupted_inits(s3_env, bucket):
    server = s3_env
    client = server.boto()
    client.put_object(Bucket=bucket, Key="data/notes.txt", Body=b"not a store")
    with pytest.raises(StoreExistsError, match="is not empty .it holds notes.txt."):
        Store.create(f"s3://{bucket}/data", embed_dim=DIM, hdc_dim=HDC)
    # shard objects without a manifest: an interrupted copy, or a store that lost its manifest
    client.put_object(Bucket=bucket, Key=f"lost/shards/{'a' * 32}.safetensors", Body=b"a shard")
    with pytest.raises(StoreExistsError, match="holds shard objects"):
        Store.create(f"s3://{bucket}/lost", embed_dim=DIM, hdc_dim=HDC)
    # what an init stopped before its first commit leaves: its lease (given
    # back or expired) and its first state object; a new init takes them over
    lease = {"format": "hmem-object-store-lease", "token": "0" * 32, "owner": {}, "expires": 0}
    client.put_object(Bucket=bucket, Key="fresh/lease.json", Body=json.dumps(lease).encode())
    client.put_object(Bucket=bucket, Key="fresh/state/000000000000-00000000.bin", Body=b"a state object")
    with Store.create(f"s3://{bucket}/fresh", embed_dim=DIM, hdc_dim=HDC) as store:
        ids = _fill(store, [5])
    assert set(_contents(f"s3://{bucket}/fresh")) == set(ids)


def test_a_manifest_json_of_another_program_above_is_no_store(s3_env, bucket):
    client = s3_env.boto()
    client.put_object(Bucket=bucket, Key="web/manifest.json", Body=b'{"name": "a web app"}')
    client.put_object(Bucket=bucket, Key="empty/manifest.json", Body=b"")
    for url in (f"s3://{bucket}/web/kv", f"s3://{bucket}/empty/kv"):
        with Store.create(url, embed_dim=DIM, hdc_dim=HDC) as store:
            ids = _fill(store, [1, 2])
        assert set(_contents(url)) == set(ids)


def test_copy_refuses_a_destination_inside_another_store(s3_env, bucket, tmp_path):
    with Store.create(f"s3://{bucket}/prod", embed_dim=DIM, hdc_dim=HDC) as prod:
        _fill(prod, range(3))
    with Store.create(tmp_path / "local", embed_dim=DIM, hdc_dim=HDC) as local:
        _fill(local, range(10, 13))
    before = _listing(s3_env, bucket)
    with pytest.raises(StoreExistsError, match="inside the hmem store"):
        hmem.copy_store(tmp_path / "local", f"s3://{bucket}/prod/copy")
    assert _listing(s3_env, bucket) == before


# ---- goal 3: stores that exist nested and side by side stay apart ------------------------


# objects of names hmem never gives its own, in the store at prod
STRANGERS = {"prod/notes.txt": b"someone's notes", "prod/shards/README": b"not a name hmem gives a shard"}


def _make_stores(server, bucket: str) -> dict[str, dict[int, tuple[bytes, bytes]]]:
    """Stores at the bucket's root, at prod, nested at prod/canary and
    beside at side, each of several shards with evicted entries (work for
    compaction) and one orphan of its own (a shard a writer uploaded and
    never committed); objects of unknown names in prod (STRANGERS).  Made apart, then copied
    into place: init refuses these places now.  Returns prefix -> contents."""
    made = {}
    for n, prefix in enumerate(["", "prod", "prod/canary", "side"]):
        source = f"make-{uuid.uuid4().hex[:8]}"
        url = f"s3://hmem-tests/{source}"
        with Store.create(url, embed_dim=DIM, hdc_dim=HDC, shard_max_bytes=SMALL_SHARDS) as store:
            ids = _fill(store, range(100 * n, 100 * n + 24))
            store.flush()
            store.delete(list(ids)[:12])  # evicted: compaction has work
        _copy_in(server, "hmem-tests", source, bucket, prefix)
        stray = f"shards/{uuid.uuid4().hex}.safetensors"  # an orphan of this store's own
        server.boto().put_object(Bucket=bucket, Key=f"{prefix}/{stray}" if prefix else stray, Body=b"never committed")
        made[prefix] = _contents(f"s3://{bucket}/{prefix}".rstrip("/"))
        assert len(made[prefix]) == 12
    for key, data in STRANGERS.items():
        server.boto().put_object(Bucket=bucket, Key=key, Body=data)
    return made


def test_stores_nested_beside_and_at_a_bucket_root_never_touch_each_other(s3_env, bucket):
    server = s3_env
    made = _make_stores(server, bucket)
    url_of = {prefix: f"s3://{bucket}/{prefix}".rstrip("/") for prefix in made}

    # verify of an outer store reports its own orphan only, nothing of the
    # others; an unknown name among its shards as information (left alone)
    for prefix, url in url_of.items():
        findings = hmem.verify(url).findings
        orphans = [f.file for f in findings if f.code == "remote.orphan"]
        assert len(orphans) == 1 and orphans[0].startswith("shards/"), (prefix, orphans)
        foreign = [(f.file, f.severity) for f in findings if f.code == "remote.foreign"]
        assert foreign == ([("shards/README", "info")] if prefix == "prod" else []), prefix

    operations = [
        ("compact (the command, as a cron line)", lambda url: _cli("compact", url, "--threshold", "20")),
        ("repair", lambda url: hmem.repair(url)),
        ("put", lambda url: _put_one(url)),
        ("compact", lambda url: _compact(url)),
    ]
    for name, operation in operations:
        for prefix, url in url_of.items():
            before = _listing(server, bucket)
            outcome = operation(url)
            if hasattr(outcome, "exit_code"):
                assert outcome.exit_code == 0, (name, url, outcome.output)
            after = _listing(server, bucket)
            assert _others(after, prefix) == _others(before, prefix), (name, url)
    for prefix, url in url_of.items():
        state = _contents(url)
        assert {i: state[i] for i in made[prefix]} == made[prefix], prefix  # every entry as it was
        assert len(state) == len(made[prefix]) + 1  # and the one put
        assert hmem.verify(url, full=True).problems == (), prefix  # its own orphan removed
    for key, data in STRANGERS.items():  # what hmem does not write stays
        assert server.boto().get_object(Bucket=bucket, Key=key)["Body"].read() == data


def _put_one(url: str) -> None:
    with Store.open(url) as store:
        _fill(store, [999])


def _compact(url: str) -> None:
    with Store.open(url) as store:
        store.compact()


# ---- goal 6: a missing bucket; the documented timeout ------------------------------------


def test_a_missing_bucket_is_a_one_line_error_with_its_exit_code(s3_env, tmp_path):
    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    for args in (["init", f"s3://{missing}/x", "--embed-dim", DIM], ["stats", f"s3://{missing}/x"]):
        result = _cli(*args)
        assert result.exit_code == ExitCode.BAD_PATH, result.output
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"error: bucket '{missing}' does not exist at {s3_env.endpoint} ("), line
        assert "internal error" not in line and "create the bucket" in line
        doc = json.loads(_cli(*args, "--json").stdout)
        assert doc["error"]["code"] == "bad_path" and doc["error"]["exit"] == ExitCode.BAD_PATH
    with pytest.raises(PathError) as caught:
        Store.create(f"s3://{missing}/x", embed_dim=DIM)
    assert caught.value.errno == errno.ENOENT and caught.value.path == f"s3://{missing}"
    assert not list((tmp_path / "hmem-cache").glob("remote-*"))  # no working copy left behind
    assert missing not in [b["Name"] for b in s3_env.boto().list_buckets()["Buckets"]]  # nothing made


def test_a_server_that_does_not_answer_fails_after_one_timeout_not_one_per_retry(s3_env):
    """docs/cli.md: "a server that does not answer within 30 s ... exits
    with code 11".  A retry after a timeout would wait the timeout again
    (3 retries: 4 x 30 s); the server here counts the attempts: the
    connections it was asked for, each a new one (none is ever answered)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    outcome: dict = {}

    def open_store() -> None:
        try:
            Store.open(
                "s3://hmem-tests/silent",
                read_only=True,
                storage_options={"endpoint": endpoint, "timeout": 1},  # the default max_retries (3)
            )
        except BaseException as exc:
            outcome["error"] = exc

    try:
        thread = threading.Thread(target=open_store, daemon=True)
        thread.start()
        thread.join(HANG_GUARD)
        assert not thread.is_alive(), f"still running after {HANG_GUARD} s"
        error = outcome.get("error")
        assert isinstance(error, ObjectStoreError), error
        assert "manifest.json" in error.message and "gives up after 1 s" in (error.hint or "")
        silent.setblocking(False)  # the attempts made wait, connected, in the backlog
        attempts = []
        while True:
            try:
                attempts.append(silent.accept()[0])
            except BlockingIOError:
                break
        for connection in attempts:
            connection.close()
        assert len(attempts) == 1
    finally:
        silent.close()


# ---- goal 7: stats is not "ok" where verify finds an error -------------------------------


def test_stats_health_sees_a_shard_object_deleted(s3_env, bucket):
    url = f"s3://{bucket}/store"
    with Store.create(url, embed_dim=DIM, hdc_dim=HDC, shard_max_bytes=SMALL_SHARDS) as store:
        ids = _fill(store, range(24))
    with Store.open(url, read_only=True) as reader:
        st = reader.stats()
        assert st.health.ok and len(st.shards) >= 3
        # the check (a listing of shards/ and of state/) is not counted as the store's requests
        assert reader.stats().remote.requests == st.remote.requests
        victim = st.shards[1]
    shard_key = json.loads(s3_env.boto().get_object(Bucket=bucket, Key="store/manifest.json")["Body"].read())
    index = json.loads(shard_key["index"])
    uid = next(s["uid"] for s in index["shards"] if s["file"] == victim.file)
    s3_env.boto().delete_object(Bucket=bucket, Key=f"store/shards/{uid}.safetensors")

    assert {f.code for f in hmem.verify(url).problems} >= {"remote.missing"}
    with Store.open(url, read_only=True) as reader:
        health = reader.stats().health
    assert not health.ok and health.missing_shards == (victim.file,)
    assert health.unreachable_entries == victim.entries - victim.dead_entries > 0
    result = _cli("stats", url)
    assert result.exit_code == 0, result.output
    assert f"health: 1 shard missing ({victim.file})" in result.stdout
    assert "health: ok" not in result.stdout
    doc = json.loads(_cli("stats", url, "--json").stdout)
    assert doc["health"]["ok"] is False and doc["health"]["missing_shards"] == [victim.file]
    assert len(ids) == 24


def test_stats_health_sees_a_state_object_this_host_still_holds(s3_env, bucket):
    url = f"s3://{bucket}/store"
    with Store.create(url, embed_dim=DIM, hdc_dim=HDC) as store:
        _fill(store, range(5))
    manifest = json.loads(s3_env.boto().get_object(Bucket=bucket, Key="store/manifest.json")["Body"].read())
    (state,) = manifest["state"]
    s3_env.boto().delete_object(Bucket=bucket, Key=f"store/{state['key']}")
    assert "remote.missing" in {f.code for f in hmem.verify(url).problems}
    # this host kept the state object (docs/format.md, "The working copy"): the store opens
    with Store.open(url, read_only=True) as reader:
        health = reader.stats().health
        assert len(reader.entry_ids()) == 5
    assert not health.ok and f"state object {state['key']} is missing" in health.entries_file_problem
    result = _cli("stats", url)
    assert result.exit_code == 0 and "health: ok" not in result.stdout
    assert f"state object {state['key']} is missing" in result.stdout


def test_stats_health_is_not_ok_when_the_objects_cannot_be_listed(s3_url, own_s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", own_s3_server.endpoint)  # a server this test may stop
    with Store.create(s3_url, embed_dim=DIM, hdc_dim=HDC) as store:
        _fill(store, range(3))
    with Store.open(s3_url, read_only=True, storage_options={"timeout": 5, "max_retries": 0}) as reader:
        assert reader.stats().health.ok
        own_s3_server.stop()
        try:
            st = reader.stats()  # stats still answers: from the working copy
        finally:
            own_s3_server.start()
    assert st.entries == 3
    assert not st.health.ok and st.health.problems[-1].startswith("the store's objects could not be listed")
