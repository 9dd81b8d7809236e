"""Crafted stores on object storage (issue 42): a manifest or a state
object with every checksum recomputed, against the local S3 server of
tests/conftest.py (moto: real HTTP).

What must hold (docs/security.md, "Stores on object storage"):

- a `retired` list naming anything but the store's own shard and state
  names (another store's manifest beside a store at a bucket's root, a
  path with `..`), or with a `since` that is no time, is refused when the
  manifest is read, and no command changes any object; every deletion
  goes through one function that deletes only the store's own names;
- every number of a manifest is a whole number (or a finite time) within
  its bound, and a state object's pieces lie within it: otherwise a clean
  CorruptStoreError (exit 1), never an internal error;
- files a manifest claims (1 TiB each) cost no memory: refused within an
  address-space limit, before anything is sized by them;
- data shorter than the manifest says is a damaged store (exit 1, or a
  finding of verify), not "object store unavailable" (exit 11).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from hmem import Store
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode
from hmem.formats import objects as fmt  # crafting a manifest needs the format's own encoder

DIM = 16
HDC = 256
S3_BUCKET = "hmem-tests"  # the session bucket of tests/conftest.py, where stores are made before they are copied
HANG_GUARD = 300  # seconds: a bounded run that reaches this has failed (only a hang takes so long)


def _cli(*args):
    return CliRunner().invoke(
        app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1", "HMEM_STORE": None, "HMEM_DEBUG": None}
    )


def _fill(store: Store, seeds) -> list[int]:
    rng = np.random.default_rng(len(seeds))
    return store.put_many(
        [
            (rng.standard_normal((2, DIM)).astype(np.float32), rng.standard_normal((2, DIM)).astype(np.float32), 0)
            for _ in seeds
        ]
    )


@pytest.fixture
def bucket(s3_env) -> str:
    """A bucket of the test's own, so that a store may sit at its root."""
    name = f"unt-{uuid.uuid4().hex[:12]}"
    s3_env.boto().create_bucket(Bucket=name)
    return name


def _listing(server, bucket: str) -> dict[str, tuple[str, int]]:
    """key -> (ETag, size) of every object of the bucket."""
    out = {}
    for page in server.boto().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            out[item["Key"]] = (item["ETag"], item["Size"])
    return out


def _make_store(server, bucket: str, prefix: str, entries: int = 6) -> str:
    """A store of a few entries at s3://bucket/prefix ("" for the root),
    made elsewhere and copied in object by object (init refuses a store
    beside or inside another, but stores copied so exist)."""
    source = f"make-{uuid.uuid4().hex[:8]}"
    with Store.create(f"s3://{S3_BUCKET}/{source}", embed_dim=DIM, hdc_dim=HDC) as store:
        ids = _fill(store, range(entries))
        store.flush()
        store.delete(ids[:2])  # evicted: compaction has work
    client = server.boto()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=source + "/"):
        for item in page.get("Contents", []):
            rest = item["Key"][len(source) + 1 :]
            client.copy_object(
                Bucket=bucket,
                Key=f"{prefix}/{rest}" if prefix else rest,
                CopySource={"Bucket": S3_BUCKET, "Key": item["Key"]},
            )
    return f"s3://{bucket}/{prefix}".rstrip("/")


def _without_lease(listing: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """A listing but the lease: a writer refused after it took the lease
    gives it back (a write of lease.json), and changes nothing else."""
    return {key: item for key, item in listing.items() if not key.endswith("lease.json")}


def _manifest_key(prefix: str) -> str:
    return f"{prefix}/manifest.json" if prefix else "manifest.json"


def _read_manifest(server, bucket: str, prefix: str) -> fmt.RemoteManifest:
    raw = server.boto().get_object(Bucket=bucket, Key=_manifest_key(prefix))["Body"].read()
    return fmt.RemoteManifest.parse(raw, "manifest.json")


def _write_doc(server, bucket: str, prefix: str, edit) -> None:
    """manifest.json rewritten with `edit` applied to its JSON document and
    its checksum recomputed (what an attacker who can write the bucket does)."""
    key = _manifest_key(prefix)
    doc = json.loads(server.boto().get_object(Bucket=bucket, Key=key)["Body"].read())
    doc.pop("checksum")
    edit(doc)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    from hmem.kernels import checksum

    doc["checksum"] = f"crc32c:{int(checksum.crc32c(canonical)):08x}"
    server.boto().put_object(Bucket=bucket, Key=key, Body=json.dumps(doc).encode())


def _kv_file(tmp_path: Path) -> Path:
    path = tmp_path / "kv.safetensors"
    rows = np.random.default_rng(7).standard_normal((3, DIM)).astype(np.float32)
    save_file({"keys": rows, "values": rows}, str(path))
    return path


def _writer_commands(url: str, tmp_path: Path) -> list[list[str]]:
    return [
        ["put", url, str(_kv_file(tmp_path))],
        ["evict", url, "--target", "1", "--yes"],
        ["rm", url, "3", "--yes"],
        ["compact", url],
        ["verify", url, "--repair", "--yes"],
    ]


# ---- 1. retired keys: only the store's own names, refused at parse ---------------------


@pytest.mark.parametrize(
    "retired",
    [
        [{"key": "teamB/manifest.json", "since": 0}],  # another store's commit point
        [{"key": "teamB/shards/{uid}.safetensors", "since": 0}],  # another store's shard
        [{"key": "state/../teamB/manifest.json", "since": 0}],
        [{"key": "x/../y", "since": 0}],
        [{"key": "lease.json", "since": 0}],
        [{"key": "shards/{own}.safetensors", "since": 0}],  # a shard the manifest still names
        [{"key": "state/000000000001-0000abcd.bin", "since": float("nan")}],
        [{"key": "state/000000000001-0000abcd.bin", "since": -1.0}],
        [{"key": "state/000000000001-0000abcd.bin", "since": 1e300}],
        [{"key": "state/000000000001-0000abcd.bin", "since": True}],
    ],
    ids=["manifest", "shard", "dotdot-state", "dotdot", "lease", "live", "nan", "negative", "absurd", "bool"],
)
def test_a_retired_list_naming_anything_but_the_stores_own_objects_is_refused(s3_env, bucket, tmp_path, retired):
    root = _make_store(s3_env, bucket, "")
    _make_store(s3_env, bucket, "teamB")
    other_uid = next(iter(_read_manifest(s3_env, bucket, "teamB").shards))
    own_uid = next(iter(_read_manifest(s3_env, bucket, "").shards))
    for item in retired[:2]:
        item["key"] = item["key"].format(uid=other_uid, own=own_uid)
    _write_doc(s3_env, bucket, "", lambda doc: doc.__setitem__("retired", retired))
    before = _listing(s3_env, bucket)
    for args in [*_writer_commands(root, tmp_path), ["stats", root]]:
        result = _cli(*args)
        assert result.exit_code == ExitCode.FAILURE, (args, result.output)
        (line,) = result.stderr.splitlines()
        assert "manifest.json: retired" in line and "run 'hmem verify'" in line, line
        assert "internal error" not in line
    verified = _cli("verify", root)
    assert verified.exit_code == ExitCode.PROBLEMS_FOUND and "remote.manifest" in verified.stdout, verified.output
    assert _listing(s3_env, bucket) == before  # nothing deleted, nothing written, in either store
    with Store.open(f"s3://{bucket}/teamB", read_only=True) as team_b:
        assert len(team_b.entry_ids()) == 4


def test_a_writer_deletes_only_its_own_expired_names(s3_env, bucket, tmp_path):
    # the same store with a retired list a writer could have made: its own
    # names, expired, are deleted by the next commit, nothing of teamB's
    root = _make_store(s3_env, bucket, "")
    _make_store(s3_env, bucket, "teamB")
    stale = "state/000000000000-0000abcd.bin"
    s3_env.boto().put_object(Bucket=bucket, Key=stale, Body=b"an old state object")
    _write_doc(s3_env, bucket, "", lambda doc: doc.__setitem__("retired", [{"key": stale, "since": 0}]))
    before = {k: v for k, v in _listing(s3_env, bucket).items() if k.startswith("teamB/")}
    result = _cli("put", root, _kv_file(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    after = _listing(s3_env, bucket)
    assert stale not in after
    assert {k: v for k, v in after.items() if k.startswith("teamB/")} == before


def test_every_object_deletion_goes_through_the_one_function():
    # the object client's delete is called from one place: ObjectLink.delete_objects
    # (hmem/store/object_link.py), which takes only the store's own names
    root = Path(__file__).resolve().parent.parent / "hmem"
    calls = []
    for path in root.rglob("*.py"):
        for text in path.read_text().splitlines():
            if re.search(r"\.delete\(", text) and "def delete" not in text:
                calls.append((path.relative_to(root.parent).as_posix(), text.strip()))
    deleting = [(path, text) for path, text in calls if "client.delete(" in text or "_obstore.delete(" in text]
    assert sorted(path for path, _ in deleting) == ["hmem/object_store.py", "hmem/store/object_link.py"], deleting
    assert [text for path, text in deleting if path == "hmem/store/object_link.py"] == ["self.client.delete(own)"]


# ---- 2. every number of a manifest within its bound ------------------------------------


def _shards(doc, field, value):
    for item in doc["shards"].values():
        item[field] = value


def _state(doc, field, value):
    for item in doc["state"]:
        item[field] = value


CRAFTED_NUMBERS = {
    "negative shard size": (lambda d: _shards(d, "bytes", -5), "shards.bytes"),
    "shard size 2^63": (lambda d: _shards(d, "bytes", 1 << 63), "shards.bytes"),
    "shard size 2^64": (lambda d: _shards(d, "bytes", 1 << 64), "shards.bytes"),
    "fractional shard size": (lambda d: _shards(d, "bytes", 1.5), "shards.bytes"),
    "boolean shard size": (lambda d: _shards(d, "bytes", True), "shards.bytes"),
    "string shard size": (lambda d: _shards(d, "bytes", "12"), "shards.bytes"),
    "negative state size": (lambda d: _state(d, "bytes", -1), "state.bytes"),
    "state size 2^63": (lambda d: _state(d, "bytes", 1 << 63), "state.bytes"),
    "negative file size": (lambda d: d["files"].__setitem__("entries.bin", -1), "files.entries.bin"),
    "boolean file size": (lambda d: d["files"].__setitem__("pooled.bin", True), "files.pooled.bin"),
    "infinite generation": (lambda d: d.__setitem__("generation", float("inf")), "generation"),
    "generation 2^63": (lambda d: d.__setitem__("generation", 1 << 63), "generation"),
    "NaN committed": (lambda d: d.__setitem__("committed", float("nan")), "committed"),
    "infinite committed": (lambda d: d.__setitem__("committed", float("inf")), "committed"),
    "a state key the client refuses": (lambda d: _state(d, "key", "state//x"), "state key"),
    "a state key with a newline": (lambda d: _state(d, "key", "state/a\nb"), "state key"),
    "a state object listed twice": (lambda d: d.__setitem__("state", d["state"] * 2), "state key"),
    "files past what its state objects hold": (
        lambda d: d["files"].__setitem__("sources.jsonl", sum(s["bytes"] for s in d["state"]) + 1),
        "files claims",
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED_NUMBERS))
def test_a_manifest_number_out_of_its_bound_is_a_clean_error(s3_env, bucket, tmp_path, case):
    edit, field = CRAFTED_NUMBERS[case]
    url = _make_store(s3_env, bucket, "s")
    _write_doc(s3_env, bucket, "s", edit)
    before = _listing(s3_env, bucket)
    for args in (["stats", url], ["ls", url], ["compact", url]):
        result = _cli(*args)
        assert result.exit_code == ExitCode.FAILURE, (args, result.output)
        (line,) = result.stderr.splitlines()
        assert f"manifest.json: {field}" in line and "internal error" not in line, line
    verified = _cli("verify", url)
    assert verified.exit_code == ExitCode.PROBLEMS_FOUND and "remote.manifest" in verified.stdout, verified.output
    assert _listing(s3_env, bucket) == before


# ---- 3. a state object's pieces within it ----------------------------------------------


def _raw_state(rows: list[tuple[int, int, int, int]], body: bytes) -> bytes:
    """A state object of any table, checksum recomputed: (file, zero,
    offset, length) rows, then `body`."""
    table = b"".join(struct.pack("<IIQQ", *row) for row in rows)
    data = b"HMEMSTAT" + struct.pack("<II", 1, len(rows)) + table + body
    from hmem.kernels import checksum

    return data + struct.pack("<I", int(checksum.crc32c(data)))


CRAFTED_PIECES = {
    # two lengths past 2^63 whose 64-bit sum wraps to the body's length
    "lengths that wrap": [(2, 0, 0, 1 << 63), (2, 0, 0, (1 << 63) + 8)],
    "a length of 2^64 - 1": [(2, 0, 0, (1 << 64) - 1), (2, 0, 0, 9)],
    "an offset of 2^63": [(2, 0, 1 << 63, 8)],
    "an offset of 2^64 - 1": [(2, 0, (1 << 64) - 1, 8)],
    "file 2^32 - 1": [((1 << 32) - 1, 0, 0, 8)],
    "a nonzero pad": [(2, 7, 0, 8)],
}


@pytest.mark.parametrize("case", sorted(CRAFTED_PIECES))
def test_a_state_object_piece_out_of_range_is_a_clean_error(s3_env, bucket, case):
    url = _make_store(s3_env, bucket, "s")
    body = _raw_state(CRAFTED_PIECES[case], b"12345678")
    key = "state/000000000099-0000abcd.bin"
    s3_env.boto().put_object(Bucket=bucket, Key=f"s/{key}", Body=body)

    def edit(doc):
        doc["state"] = [{"key": key, "bytes": len(body)}]
        doc["files"] = dict.fromkeys(doc["files"], 0)

    _write_doc(s3_env, bucket, "s", edit)
    before = _listing(s3_env, bucket)
    for args in (["stats", url], ["ls", url], ["compact", url]):
        result = _cli(*args)
        assert result.exit_code == ExitCode.FAILURE, (args, result.output)
        (line,) = result.stderr.splitlines()
        assert f"state object {key} is damaged" in line and "internal error" not in line, line
    verified = _cli("verify", url)
    assert verified.exit_code == ExitCode.PROBLEMS_FOUND and "remote.state" in verified.stdout, verified.output
    assert _without_lease(_listing(s3_env, bucket)) == _without_lease(before)


# ---- 4. files a manifest claims cost nothing -------------------------------------------

_BOUNDED = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from typer.testing import CliRunner
from hmem.cli.app import app
out = []
for args in json.loads(sys.argv[1]):
    started = time.perf_counter()
    result = CliRunner().invoke(app, args, env={{"COLUMNS": "200", "HMEM_DEBUG": None, "HMEM_STORE": None}})
    out.append({{"args": args, "code": result.exit_code, "seconds": time.perf_counter() - started,
                "stderr": result.stderr[-400:], "stdout": result.stdout[-400:]}})
print(json.dumps({{"runs": out, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""


def _run_bounded(argv: list[list[str]], limit: int) -> dict:
    """Commands run in a subprocess under an address-space limit of `limit`
    bytes, against the test's S3 server (its endpoint and keys are in this
    process's environment: s3_env)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HMEM_CRASH_AT", None)
    proc = subprocess.run(
        [sys.executable, "-c", _BOUNDED.format(limit=limit), json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        env=env,
        # outside the checkout: the subprocess imports the installed hmem
        # (its compiled kernels), never the source tree
        cwd=tempfile.gettempdir(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("claim", ["files", "files and state objects"])
def test_a_tiny_manifest_claiming_terabyte_files_is_refused_within_bounds(s3_env, bucket, tmp_path, claim):
    url = _make_store(s3_env, bucket, "s")

    def edit(doc):
        doc["files"] = dict.fromkeys(doc["files"], 1 << 40)  # 1 TiB each (MAX_FILE_BYTES)
        if claim != "files":  # and state objects that could hold them
            doc["state"] = [{**item, "bytes": 5 << 40} for item in doc["state"]]

    _write_doc(s3_env, bucket, "s", edit)
    before = _listing(s3_env, bucket)
    argv = [["stats", url], ["verify", url], ["ls", url], ["evict", url, "--target", "1", "--yes"]]
    got = _run_bounded(argv, 2_000_000_000)
    why = "more than its state objects hold" if claim == "files" else "bytes, the manifest says"
    for run in got["runs"]:
        if run["args"][0] == "verify":
            assert run["code"] == ExitCode.PROBLEMS_FOUND, run  # remote.manifest or remote.state
            continue
        assert run["code"] == ExitCode.FAILURE, run
        assert why in run["stderr"] and "internal error" not in run["stderr"], run
    print(json.dumps({"claim": claim, "maxrss_kib": got["maxrss_kib"], "seconds": [r["seconds"] for r in got["runs"]]}))
    assert _without_lease(_listing(s3_env, bucket)) == _without_lease(before)


# ---- 5. data shorter than the manifest says: a damaged store, not an unavailable server --


@pytest.mark.parametrize("kept", [0, 100], ids=["empty", "cut"])
def test_a_shard_object_shorter_than_the_manifest_says_is_damage_not_unavailability(s3_env, bucket, tmp_path, kept):
    url = _make_store(s3_env, bucket, "s")
    mf = _read_manifest(s3_env, bucket, "s")
    client = s3_env.boto()
    for item in mf.shards.values():  # a shard object cut short (416 for an empty one, a short answer otherwise)
        key = f"s/{item['key']}"
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        client.put_object(Bucket=bucket, Key=key, Body=data[:kept])
    with Store.open(url, read_only=True) as reader:
        some = reader.entry_ids()[0]
    verified = _cli("verify", url)
    assert verified.exit_code == ExitCode.PROBLEMS_FOUND, verified.output
    assert "remote.size" in verified.stdout
    for args in (["show", url, some], ["export", url, some, "--output", tmp_path / "out.safetensors"]):
        result = _cli(*args)
        assert result.exit_code == ExitCode.FAILURE, (args, result.output)
        (line,) = result.stderr.splitlines()
        assert "shorter than the store says" in line and "run 'hmem verify'" in line, line


# ---- 6. the structured fuzzer, on object storage -----------------------------------------

# Seeded mutations of a store at a bucket's root, beside another store
# (teamB/): manifest.json's retired list, numbers and state list, and the
# pieces of a state object, every checksum recomputed.  Each case runs the
# readers and the writers and must end with a documented exit code and one
# clear line, never an internal error; no object of teamB may change, and
# each case stays within a time and a memory budget.

REMOTE_FUZZ_CASES = int(os.environ.get("HMEM_REMOTE_FUZZ_CASES", "16"))
CASE_SECONDS = 300  # a case's time budget: a hang guard (a case takes seconds even on a busy machine)
CASE_MEMORY_KIB = 256 << 10  # how far one case may raise the peak memory of the test process
BAD_NUMBERS = [-1, -(2**63), 2**31, 2**40, 2**62, 2**63, 2**64, 10**30, True, 1.5, float("inf"), float("nan"), "7"]
FOREIGN_KEYS = [
    "teamB/manifest.json",
    "teamB/lease.json",
    "teamB/shards/{other}.safetensors",
    "state/../teamB/manifest.json",
    "lease.json",
    "manifest.json",
    "shards/{own}.safetensors",
    "state//x",
    "state/a\nb",
    "x" * 2000,
]


def _f_retired(rng, doc, ctx) -> str:
    n = int(rng.integers(1, 4))
    items = []
    for _ in range(n):
        key = str(rng.choice(FOREIGN_KEYS)).format(**ctx)
        since = rng.choice([0, 0.0, -1.0, 1e300, float("nan"), float("inf"), True, "0"])
        items.append({"key": key, "since": since.item() if hasattr(since, "item") else since})
    doc["retired"] = items
    return f"retired = {items!r:.80}"


def _f_number(rng, doc, ctx) -> str:
    where = str(rng.choice(["shards.bytes", "state.bytes", "files", "generation", "committed"]))
    value = BAD_NUMBERS[int(rng.integers(len(BAD_NUMBERS)))]
    if where == "shards.bytes":
        _shards(doc, "bytes", value)
    elif where == "state.bytes":
        _state(doc, "bytes", value)
    elif where == "files":
        doc["files"][str(rng.choice(sorted(doc["files"])))] = value
    else:
        doc[where] = value
    return f"{where} = {value!r}"


def _f_state_list(rng, doc, ctx) -> str:
    how = str(rng.choice(["empty", "twice", "foreign", "many"]))
    if how == "empty":
        doc["state"] = []
    elif how == "twice":
        doc["state"] = doc["state"] * 2
    elif how == "foreign":
        doc["state"] = [{"key": "teamB/manifest.json", "bytes": 10}]
    else:
        doc["state"] = [{"key": f"state/{i:012d}-0000abcd.bin", "bytes": 1 << 40} for i in range(5000)]
    return f"state list: {how}"


def _piece_rows(rng) -> list[tuple[int, int, int, int]]:
    big = [0, 8, 2**31, 2**62, 2**63, (1 << 64) - 1]

    def pick(values: list[int]) -> int:
        return values[int(rng.integers(len(values)))]

    return [
        (pick([0, 1, 2, 3, 4, (1 << 32) - 1]), pick([0, 0, 0, 7]), pick(big), pick(big))
        for _ in range(int(rng.integers(1, 4)))
    ]


MANIFEST_MUTATIONS = [_f_retired, _f_number, _f_state_list]


def _copy_bucket(server, source: str, bucket: str) -> None:
    client = server.boto()
    for key in _listing(server, source):
        client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": source, "Key": key})


def _remote_case(server, template: str, bucket: str, seed: int) -> tuple[str, list[str]]:
    """A copy of `template` (a store at its root, teamB/ beside it) in
    `bucket`, mutated by case `seed`."""
    rng = np.random.default_rng(seed)
    _copy_bucket(server, template, bucket)
    url = f"s3://{bucket}"
    ctx = {
        "other": next(iter(_read_manifest(server, bucket, "teamB").shards)),
        "own": next(iter(_read_manifest(server, bucket, "").shards)),
    }
    done: list[str] = []
    pieces = seed % 4 == 3 or rng.random() < 0.25
    if pieces:  # a state object of crafted pieces, the manifest naming it alone
        body = _raw_state(_piece_rows(rng), bytes(rng.integers(0, 256, size=int(rng.integers(0, 64)), dtype=np.uint8)))
        key = "state/000000000099-0000abcd.bin"
        server.boto().put_object(Bucket=bucket, Key=key, Body=body)
        done.append(f"state pieces ({len(body)} bytes)")
    kinds = (
        [MANIFEST_MUTATIONS[seed % 3]] if seed < 3 else list(rng.choice(MANIFEST_MUTATIONS, int(rng.integers(0, 3))))
    )

    def edit(doc):
        if pieces:
            doc["state"] = [{"key": key, "bytes": len(body)}]
            doc["files"] = dict.fromkeys(doc["files"], int(rng.choice([0, 8, 1 << 40])))
        for mutate in kinds:
            done.append(mutate(rng, doc, ctx))

    _write_doc(server, bucket, "", edit)
    return url, done


@pytest.mark.stress
def test_fuzzed_stores_on_object_storage_delete_nothing_foreign_and_stay_in_budget(s3_env, tmp_path):
    import resource
    import signal

    class OverBudget(BaseException):  # not an Exception: the command line must not catch it
        pass

    def over(signum, frame):
        raise OverBudget(f"a case ran past its budget of {CASE_SECONDS} s")

    template = f"fuzz-{uuid.uuid4().hex[:12]}"
    s3_env.boto().create_bucket(Bucket=template)
    _make_store(s3_env, template, "")
    _make_store(s3_env, template, "teamB")
    codes: dict[str, int] = {}
    for seed in range(REMOTE_FUZZ_CASES):
        bucket = f"fuzz-{uuid.uuid4().hex[:12]}"
        s3_env.boto().create_bucket(Bucket=bucket)
        url, done = _remote_case(s3_env, template, bucket, seed)
        what = f"remote fuzz case {seed} ({'; '.join(done)})"
        team_b = {k: v for k, v in _listing(s3_env, bucket).items() if k.startswith("teamB/")}
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        previous = signal.signal(signal.SIGALRM, over)
        signal.alarm(CASE_SECONDS)
        try:
            for args in [["stats", url], ["verify", url], ["ls", url], *_writer_commands(url, tmp_path)]:
                result = _cli(*args)
                context = f"{what}: {args[0]} exit {result.exit_code}\n{result.output}"
                assert result.exception is None or isinstance(result.exception, SystemExit), context
                assert result.exit_code in set(ExitCode), context
                assert "internal error" not in result.output and "Traceback" not in result.output, context
                if result.exit_code not in (ExitCode.OK, ExitCode.PROBLEMS_FOUND):
                    assert result.stderr.startswith("error: "), context
                codes[f"{args[0]}={result.exit_code}"] = codes.get(f"{args[0]}={result.exit_code}", 0) + 1
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
        assert growth < CASE_MEMORY_KIB, f"{what} raised peak memory by {growth} KiB"
        after = {k: v for k, v in _listing(s3_env, bucket).items() if k.startswith("teamB/")}
        assert after == team_b, f"{what} changed another store's objects"
    print(
        "FIGURES", json.dumps({"kind": "untrusted", "name": "remote-fuzz", "cases": REMOTE_FUZZ_CASES, "codes": codes})
    )
