"""Cleaning an LMCache cache (`hmem evict/compact/rm CACHE`, plan_clean and
clean): on copies of the small caches LMCache 0.5.6 itself wrote
(tests/data/lmcache/), each rule deletes exactly its files; a dry run, a
foreign file, a symbolic link, a file changed since the plan and anything
outside the directory are never deleted; bad input deletes nothing.  File
times are set with os.utime (no test waits for a clock)."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode
from hmem.errors import InvalidArgumentError
from hmem.lmcache import CleanPlan, PlannedFile, clean, open_cache, plan_clean, unreachable_files
from hmem.lmcache.cleaning import CHANGED, NOT_CACHE_FILE, NOT_REGULAR, STOPPED, mount_of
from hmem.lmcache.hit_explanation import Deployment, explain, parse_requests

SMALL = Path(__file__).parents[1] / "data" / "lmcache"
ORACLE = json.loads((SMALL / "oracle.json").read_text())
MODEL = ORACLE["model"]
NOW = time.time()  # the plans' "now"; the tests date files hours or more before it
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "HMEM_STORE": None, "HMEM_DEBUG": None}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def run_json(*args, code: int = 0) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root`, never following a link: a file's digest, a
    link's target, a directory's mark."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def copy(kind: str, tmp_path: Path) -> Path:
    target = tmp_path / kind
    shutil.copytree(SMALL / kind, target)
    return target


def set_times(path: Path, *, atime: float | None = None, mtime: float | None = None) -> None:
    st = path.stat()
    os.utime(
        path,
        ns=(
            st.st_atime_ns if atime is None else int(atime * 1e9),
            st.st_mtime_ns if mtime is None else int(mtime * 1e9),
        ),
    )


def names(path: Path) -> set[str]:
    return set(os.listdir(path))


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file beside the caches (never to be touched), and a sibling directory."""
    (tmp_path / "outside").mkdir()
    victim = tmp_path / "outside" / "victim.pt"
    victim.write_bytes(b"\x01" * 1024)
    return victim


# ---- dry runs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["evict", "CACHE", "--max-bytes", "0"],
        ["compact", "CACHE", "--debris-older-than", "0"],
        ["rm", "CACHE", "--tag", "user%alice"],
    ],
)
def test_unconfirmed_or_dry_run_deletes_nothing(tmp_path, command):
    cache = copy("fs", tmp_path)
    (cache / "hmem-tests-SEP-tiny-llama@1@0@ff@bfloat16.tmp").write_bytes(b"x")
    set_times(cache / "hmem-tests-SEP-tiny-llama@1@0@ff@bfloat16.tmp", mtime=1e9)
    before = tree(tmp_path)
    args = [str(cache) if a == "CACHE" else a for a in command]
    shown = run(*args)  # no --yes and no terminal to ask at: the plan is shown, nothing deleted
    assert shown.exit_code == 0, shown.output
    assert "dry run" in shown.stdout and "to delete:" in shown.stdout
    assert tree(tmp_path) == before
    for extra in (["--dry-run"], ["--dry-run", "--yes"]):
        doc = run_json(*args, *extra)
        assert doc["dry_run"] is True and doc["report"] is None and doc["plan"]["count"] > 0
        assert tree(tmp_path) == before
    done = run_json(*args, "--yes")
    assert done["dry_run"] is False
    assert done["report"]["deleted"] == [f["name"] for f in done["plan"]["files"]]
    assert names(cache) == {n.split("/", 1)[1] for n in before if n.startswith("fs/")} - set(done["report"]["deleted"])


# ---- the rules --------------------------------------------------------------------------


def test_debris_only_when_older_than_the_age_and_named_as_lmcaches(tmp_path):
    cache = copy("fs", tmp_path)
    chunks = names(cache)
    old = "hmem-tests-SEP-tiny-llama@1@0@ff@bfloat16.tmp"
    young = "hmem-tests-SEP-tiny-llama@1@0@-ee@bfloat16.tmp"
    mp_old = "hmem-tests-SEP-tiny-llama@0x01000100@0@" + "ab" * 32 + ".tmp"
    not_theirs = "notes.tmp"
    for name, age in ((old, 7200), (young, 60), (mp_old, 86400), (not_theirs, 86400)):
        (cache / name).write_bytes(b"partial")
        set_times(cache / name, mtime=NOW - age)
    plan = plan_clean(open_cache(cache), debris_older_than=3600, now=NOW)
    assert {(f.name, f.reason) for f in plan.files} == {(old, "debris"), (mp_old, "debris")}
    assert plan.kept_debris == (not_theirs,)
    assert plan.chunk_bytes_after == plan.chunk_bytes_before  # debris is no chunk
    report = clean(open_cache(cache), plan)
    assert set(report.deleted) == {old, mp_old} and report.complete
    assert names(cache) == chunks | {young, not_theirs}
    # the command line: an hour by default; 0 takes the young one too, never notes.tmp
    run_json("compact", cache, "--yes")
    assert names(cache) == chunks | {young, not_theirs}
    doc = run_json("compact", cache, "--debris-older-than", "0s", "--yes")
    assert doc["report"]["deleted"] == [young]
    assert names(cache) == chunks | {not_theirs}


def test_local_disk_files_written_before_a_restart_are_stale(tmp_path):
    cache = copy("local_disk_restarted", tmp_path)
    restart = ORACLE["restart"]
    for name, facts in restart["files"].items():  # git keeps no file times: LMCache's, from the oracle
        os.utime(cache / name, ns=(facts["mtime_ns"], facts["mtime_ns"]))
    stale = {name for name, facts in restart["files"].items() if not facts["rewritten"]}
    plan = plan_clean(open_cache(cache), restarted_at=restart["restarted_at"], now=NOW)
    assert {f.name for f in plan.files} == stale and {f.reason for f in plan.files} == {"stale after restart"}
    assert not any("in-memory index" in w for w in plan.warnings)  # in no running LMCache's index: safe
    doc = run_json("compact", cache, "--restarted-at", repr(restart["restarted_at"]), "--yes")
    assert set(doc["report"]["deleted"]) == stale
    assert names(cache) == set(restart["rewritten_files"])
    # what is left is what the restarted LMCache hits
    made = ORACLE["caches"]["local_disk"]["requests"]
    requests = parse_requests([{"name": r["name"], "tokens": r["tokens"], "tags": r["tags"]} for r in made])
    deployment = Deployment(model=MODEL, chunk_size=ORACLE["chunk_size"], restarted_at=restart["restarted_at"])
    hits = {r.name: r.hit_tokens for r in explain(open_cache(cache), requests, deployment)}
    assert hits == {k: v for k, v in restart["lookups_after_store"].items() if k in hits}


def test_byte_cap_deletes_least_recently_used_first(tmp_path):
    cache = copy("local_disk", tmp_path)
    files = sorted(names(cache))
    rng = np.random.default_rng(36)
    used = dict(zip(files, rng.permutation(len(files)).tolist()))
    written = dict(zip(files, rng.permutation(len(files)).tolist()))
    for name in files:
        set_times(cache / name, atime=1.7e9 + used[name], mtime=1.7e9 + written[name])
    size = (cache / files[0]).stat().st_size
    cap = 3 * size + size // 2
    doc = run_json("evict", cache, "--max-bytes", str(cap), "--dry-run")
    assert doc["plan"]["clock"] == "atime" and doc["plan"]["warnings"]
    by_use = sorted(files, key=used.__getitem__)
    assert [f["name"] for f in doc["plan"]["files"]] == by_use[:4]  # least recently used first
    assert {f["reason"] for f in doc["plan"]["files"]} == {"over byte cap"}
    doc = run_json("evict", cache, "--max-bytes", str(cap), "--yes")
    assert names(cache) == set(by_use[4:])
    assert sum((cache / n).stat().st_size for n in names(cache)) <= cap
    assert doc["plan"]["chunk_bytes_after"] == 3 * size
    # by mtime: the oldest writes go
    left = sorted(names(cache), key=written.__getitem__)
    run_json("evict", cache, "--max-bytes", f"{size}B", "--by", "mtime", "--yes")
    assert names(cache) == {left[-1]}
    # already under the cap: nothing to do
    doc = run_json("evict", cache, "--max-bytes", "1KiB", "--yes")
    assert doc["plan"]["count"] == 0 and names(cache) == {left[-1]}


def test_byte_cap_takes_a_layerwise_chunk_whole(tmp_path):
    cache = copy("layerwise", tmp_path)
    files = sorted(names(cache))
    for n, name in enumerate(files):
        set_times(cache / name, atime=1.7e9 + n)
    size = (cache / files[0]).stat().st_size
    total = size * len(files)
    run_json("evict", cache, "--max-bytes", str(total - 1), "--yes")  # one file over: a whole chunk goes
    gone = set(files) - names(cache)
    assert {chunk_of(n) for n in gone} == {chunk_of(files[0])} and len(gone) == 2  # the oldest chunk, both layers
    left: dict[str, int] = {}
    for name in names(cache):  # every chunk left has both its layers
        left[chunk_of(name)] = left.get(chunk_of(name), 0) + 1
    assert set(left.values()) == {2}


def chunk_of(layer_file: str) -> str:
    """A layerwise file's chunk: its key without the layer."""
    fields = layer_file.removesuffix(".pt").split("@")
    return "@".join(fields[:5] + fields[6:])


def test_selection_by_tag_deletes_exactly_the_tagged_files(tmp_path):
    for kind in ("local_disk", "fs", "layerwise"):
        cache = copy(kind, tmp_path)
        tagged = {n for n in names(cache) if "@user%alice" in n}
        assert tagged
        doc = run_json("rm", cache, "--tag", "user%alice", "--yes")
        assert set(doc["report"]["deleted"]) == tagged
        assert {f["reason"] for f in doc["plan"]["files"]} == {"selected"}
        assert not any("%" in n for n in names(cache)) and len(names(cache)) == len(os.listdir(SMALL / kind)) - len(
            tagged
        )
    layerwise = tmp_path / "layerwise"
    doc = run_json("rm", layerwise, "--layer", "1", "--model", MODEL, "--yes")
    assert doc["report"]["deleted"] and all(n.endswith("@1.pt") for n in doc["report"]["deleted"])
    assert all(n.endswith("@0.pt") for n in names(layerwise))


def test_deleting_local_disk_files_a_running_lmcache_indexes_is_warned_of(tmp_path):
    local = plan_clean(open_cache(copy("local_disk", tmp_path)), tag="user%alice")
    assert any("in-memory index" in w and w.startswith("2 local_disk") for w in local.warnings)
    remote = plan_clean(open_cache(copy("fs", tmp_path)), tag="user%alice")  # fs looks files up: a miss
    assert not any("in-memory index" in w for w in remote.warnings)


def test_rm_by_name_and_key(tmp_path):
    cache = copy("fs", tmp_path)
    by_name = "hmem-tests-SEP-tiny-llama@1@0@617df1290eafef7e@bfloat16.data"
    key = f"{MODEL}@1@0@-325f4b5abc83dd87@bfloat16"
    doc = run_json("rm", cache, by_name, key, "--yes")
    assert set(doc["report"]["deleted"]) == {by_name, "hmem-tests-SEP-tiny-llama@1@0@-325f4b5abc83dd87@bfloat16.data"}
    both = tmp_path / "both"  # a key names its file in every form the directory holds
    shutil.copytree(SMALL / "fs", both)
    for name in os.listdir(SMALL / "local_disk"):
        shutil.copy(SMALL / "local_disk" / name, both / name)
    doc = run_json("rm", both, key, "--yes")
    assert set(doc["report"]["deleted"]) == {
        "hmem-tests-SEP-tiny-llama@1@0@-325f4b5abc83dd87@bfloat16.data",
        "hmem-tests-tiny-llama@1@0@-325f4b5abc83dd87@bfloat16.pt",
    }
    result = run("rm", cache, "no-such-file.data", f"{MODEL}@1@0@2036b05db044bf7a@bfloat16", "--yes")
    assert result.exit_code == ExitCode.PARTIAL and "no-such-file.data" in result.stderr
    result = run("rm", cache, "no-such-file.data", "--yes")
    assert result.exit_code == ExitCode.FAILURE
    assert len(names(cache)) == 4


def test_unreachable_chunks_after_a_hole(tmp_path):
    cache = copy("fs_deleted", tmp_path)
    made = ORACLE["caches"]["fs"]["requests"]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"name": r["name"], "tokens": r["tokens"], "tags": r["tags"]} for r in made]))
    expected = set(ORACLE["deleted_chunk"]["unreachable"])
    doc = run_json(
        "compact", cache, "--tokens", tokens, "--model", MODEL, "--chunk-size", ORACLE["chunk_size"], "--yes"
    )
    assert set(doc["report"]["deleted"]) == expected
    assert {f["reason"] for f in doc["plan"]["files"]} == {"unreachable"}
    # no hit changes: nothing could reach them
    requests = parse_requests([{"name": r["name"], "tokens": r["tokens"], "tags": r["tags"]} for r in made])
    deployment = Deployment(model=MODEL, chunk_size=ORACLE["chunk_size"])
    hits = {r.name: r.hit_tokens for r in explain(open_cache(cache), requests, deployment)}
    assert hits == ORACLE["deleted_chunk"]["lookups"]


def test_unreachable_layerwise_chunks_go_with_every_layer(tmp_path):
    cache = copy("layerwise", tmp_path)
    for layer in (0, 1):  # a hole: chunk 1 of a, b and c
        (cache / f"hmem-tests-tiny-llama@1@0@2036b05db044bf7a@bfloat16@{layer}.pt").unlink()
    made = ORACLE["caches"]["layerwise"]["requests"]
    requests = parse_requests([{"name": r["name"], "tokens": r["tokens"], "tags": r["tags"]} for r in made])
    deployment = Deployment(model=MODEL, chunk_size=ORACLE["chunk_size"])
    before = {r.name: r.hit_tokens for r in explain(open_cache(cache), requests, deployment)}
    files = unreachable_files(open_cache(cache), requests, deployment)
    stems = {f.rsplit("@", 1)[0] for f in files}
    assert {f"{s}@{layer}.pt" for s in stems for layer in (0, 1)} == set(files)  # both layers of each
    assert stems == {
        "hmem-tests-tiny-llama@1@0@-325f4b5abc83dd87@bfloat16",
        "hmem-tests-tiny-llama@1@0@617df1290eafef7e@bfloat16",
        "hmem-tests-tiny-llama@1@0@-7a6f39b325e1852@bfloat16",
    }
    report = clean(open_cache(cache), plan_clean(open_cache(cache), unreachable=files))
    assert set(report.deleted) == set(files)
    assert {r.name: r.hit_tokens for r in explain(open_cache(cache), requests, deployment)} == before


def test_unreachable_in_multiprocess_mode(tmp_path):
    mp = ORACLE.get("mp")
    if mp is None:
        pytest.skip("no multiprocess-mode cache among the fixtures")
    cache = copy("mp", tmp_path)
    deployment = Deployment(
        model=mp["model"], world_size=mp["world_size"], chunk_size=mp["chunk_size"], windows=tuple(mp["windows"])
    )
    requests = parse_requests([{"name": r["name"], "tokens": r["tokens"]} for r in mp["requests"]])
    results = explain(open_cache(cache), requests, deployment)
    before = {r.name: r.hit_tokens for r in results}
    files = unreachable_files(open_cache(cache), requests, deployment)
    assert set(files) == {f for r in results for f in r.unreachable_files}
    plan = plan_clean(open_cache(cache), unreachable=files)
    report = clean(open_cache(cache), plan)
    assert set(report.deleted) == set(files)
    assert {r.name: r.hit_tokens for r in explain(open_cache(cache), requests, deployment)} == before


# ---- what is never deleted --------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["evict", "CACHE", "--max-bytes", "0"],
        ["compact", "CACHE", "--debris-older-than", "0"],
        ["rm", "CACHE", "--model", MODEL],
        ["rm", "CACHE", "LINK"],
    ],
)
def test_a_link_is_never_deleted_nor_followed(tmp_path, outside, args):
    cache = copy("local_disk", tmp_path)
    link = "hmem-tests-tiny-llama@1@0@abc@bfloat16.pt"  # named as a chunk, pointing outside
    os.symlink(outside, cache / link)
    os.symlink(outside, cache / "hmem-tests-tiny-llama@1@0@abd@bfloat16.tmp")
    os.symlink(tmp_path / "outside", cache / "a-directory-link")
    links = {link, "hmem-tests-tiny-llama@1@0@abd@bfloat16.tmp", "a-directory-link"}
    victim = outside.read_bytes()
    before = tree(tmp_path)
    result = run(*[{"CACHE": str(cache), "LINK": link}.get(a, a) for a in args], "--yes")
    assert result.exit_code in (ExitCode.OK, ExitCode.FAILURE), result.output
    assert links <= names(cache) and (cache / link).is_symlink() and outside.read_bytes() == victim
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("local_disk/")} == {
        k: v for k, v in before.items() if not k.startswith("local_disk/")
    }


def test_a_forged_plan_naming_a_link_is_refused(tmp_path, outside):
    cache = copy("local_disk", tmp_path)
    link = "hmem-tests-tiny-llama@1@0@abc@bfloat16.pt"
    os.symlink(outside, cache / link)
    st = outside.stat()
    forged = CleanPlan(
        str(cache), (PlannedFile(link, "local_disk", "selected", st.st_size, st.st_mtime_ns, 0),), 0, 0, 0, 0, NOW
    )
    report = clean(open_cache(cache), forged)
    assert [(s.name, s.reason) for s in report.skipped] == [(link, NOT_REGULAR)] and not report.deleted
    assert (cache / link).is_symlink() and outside.read_bytes() == b"\x01" * 1024


def test_a_file_swapped_for_a_link_after_planning_is_skipped(tmp_path, outside):
    cache = copy("fs", tmp_path)
    plan = plan_clean(open_cache(cache), max_bytes=0)
    target = plan.files[0].name
    (cache / target).unlink()
    os.symlink(outside, cache / target)
    report = clean(open_cache(cache), plan)
    assert [(s.name, s.reason) for s in report.skipped] == [(target, NOT_REGULAR)]
    assert len(report.deleted) == plan.count - 1
    assert (cache / target).is_symlink() and outside.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["evict", "CACHE", "--max-bytes", "0"],
        ["compact", "CACHE", "--debris-older-than", "0"],
        ["rm", "CACHE", "--model", MODEL],
        ["rm", "CACHE", "FOREIGN"],
    ],
)
def test_foreign_files_and_subdirectories_survive(tmp_path, args):
    cache = copy("fs", tmp_path)
    foreign = {
        "README.md": b"notes",
        "notes.tmp": b"mine",
        "hmem-tests-SEP-tiny-llama@1@0@ZZ@bfloat16.data": b"no key",  # upper-case hash: no key
        "model@1@0@ff@float7.pt": b"unknown dtype",
    }
    for name, data in foreign.items():
        (cache / name).write_bytes(data)
        set_times(cache / name, atime=1e9, mtime=1e9)
    (cache / "sub").mkdir()
    (cache / "sub" / "hmem-tests-SEP-tiny-llama@1@0@ff@bfloat16.data").write_bytes(b"inside a subdirectory")
    inner = tree(cache / "sub")
    expanded = [a for arg in args for a in ({"CACHE": [str(cache)], "FOREIGN": list(foreign)}.get(arg, [arg]))]
    result = run(*expanded, "--yes")
    assert result.exit_code in (ExitCode.OK, ExitCode.FAILURE), result.output
    assert set(foreign) | {"sub"} <= names(cache)
    assert tree(cache / "sub") == inner
    assert all((cache / n).read_bytes() == d for n, d in foreign.items())


def test_a_file_changed_or_gone_since_the_plan_is_not_deleted(tmp_path):
    cache = copy("local_disk", tmp_path)
    plan = plan_clean(open_cache(cache), max_bytes=0)
    rewritten, touched, gone = (plan.files[i].name for i in range(3))
    data = (cache / rewritten).read_bytes()
    (cache / rewritten).write_bytes(data + b"more")  # LMCache wrote it again, longer
    set_times(cache / touched, mtime=NOW)  # same bytes, a new write
    (cache / gone).unlink()  # LMCache evicted it
    report = clean(open_cache(cache), plan)
    assert {(s.name, s.reason) for s in report.skipped} == {(rewritten, CHANGED), (touched, CHANGED)}
    assert report.already_gone == (gone,) and not report.complete
    assert names(cache) == {rewritten, touched}
    assert len(report.deleted) == plan.count - 3
    assert report.deleted_bytes == sum(f.size for f in plan.files[3:])


def test_nothing_outside_the_directory_is_deleted(tmp_path, outside):
    cache = copy("fs", tmp_path)
    sibling = copy("local_disk", tmp_path)
    before = {k: v for k, v in tree(tmp_path).items() if not k.startswith("fs/")}
    run_json("evict", cache, "--max-bytes", "0", "--yes")
    assert names(cache) == set()
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("fs/")} == before
    # plans naming files elsewhere are refused
    st = outside.stat()
    escaping = [
        PlannedFile(f"../outside/{outside.name}", "local_disk", "selected", st.st_size, st.st_mtime_ns, 0),
        PlannedFile("..", "local_disk", "selected", 0, 0, 0),
        PlannedFile(f"../local_disk/{next(iter(names(sibling)))}", "local_disk", "selected", 0, 0, 0),
    ]
    report = clean(open_cache(sibling), CleanPlan(str(sibling), tuple(escaping), 0, 0, 0, 0, NOW))
    assert {s.reason for s in report.skipped} == {NOT_CACHE_FILE} and not report.deleted
    with pytest.raises(InvalidArgumentError, match="plan is for"):
        clean(open_cache(sibling), CleanPlan(str(cache), (), 0, 0, 0, 0, NOW))
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("fs/")} == before


def test_a_stop_request_deletes_nothing_more(tmp_path):
    cache = copy("fs", tmp_path)
    plan = plan_clean(open_cache(cache), max_bytes=0)
    report = clean(open_cache(cache), plan, should_stop=lambda: True)
    assert report.stopped and not report.deleted and {s.reason for s in report.skipped} == {STOPPED}
    assert names(cache) == set(os.listdir(SMALL / "fs"))


def test_already_gone_is_not_an_error(tmp_path):
    cache = copy("fs", tmp_path)
    plan = plan_clean(open_cache(cache), tag="user%alice")
    for f in plan.files:
        (cache / f.name).unlink()
    report = clean(open_cache(cache), plan)
    assert set(report.already_gone) == {f.name for f in plan.files} and report.complete and not report.deleted


# ---- the mount, and bad input -----------------------------------------------------------


def test_the_mount_says_how_far_atime_is_use(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "rootfs / ext4 rw,relatime 0 0\n"
        f"tmpfs {tmp_path} tmpfs rw,noatime 0 0\n"
        f"tmpfs {tmp_path}/with\\040space xfs rw,strictatime 0 0\n"
    )
    (tmp_path / "with space" / "cache").mkdir(parents=True)
    (tmp_path / "cache").mkdir()
    assert mount_of(tmp_path / "cache", str(mounts)).atime_updates == "never"
    spaced = mount_of(tmp_path / "with space" / "cache", str(mounts))
    assert (spaced.mount_point, spaced.fs_type, spaced.atime_updates) == (f"{tmp_path}/with space", "xfs", "every read")
    assert mount_of("/", str(mounts)).atime_updates == "relatime"
    assert mount_of("/", str(tmp_path / "no-such-file")) is None
    plan = plan_clean(open_cache(copy("fs", tmp_path)), max_bytes=0)
    assert plan.clock == "atime" and any("atime" in w for w in plan.warnings)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["evict", "CACHE", "--max-bytes", "-5"], "--max-bytes"),
        (["evict", "CACHE", "--max-bytes", "10XB"], "--max-bytes"),
        (["evict", "CACHE", "--max-bytes", "1KiB", "--by", "ctime"], "ctime"),
        (["evict", "CACHE"], "--max-bytes"),
        (["evict", "CACHE", "--target", "3"], "--target"),
        (["compact", "CACHE", "--debris-older-than", "soon"], "--debris-older-than"),
        (["compact", "CACHE", "--debris-older-than", "-1h"], "--debris-older-than"),
        (["compact", "CACHE", "--restarted-at", "4000000000"], "restarted_at"),
        (["compact", "CACHE", "--restarted-at", "yesterday"], "ISO 8601"),
        (["compact", "CACHE", "--model", MODEL], "--tokens"),
        (["compact", "CACHE", "--repack"], "--repack"),
        (["rm", "CACHE"], "select chunks"),
        (["rm", "CACHE", "--tag", "novalue"], "name%value"),
        (["rm", "CACHE", "--dtype", "float7"], "float7"),
        (["rm", "CACHE", "--world-size", "0"], "world-size"),
    ],
)
def test_bad_input_is_a_usage_error_and_deletes_nothing(tmp_path, args, fragment):
    cache = copy("fs", tmp_path)
    before = tree(tmp_path)
    result = run(*[str(cache) if a == "CACHE" else a for a in args], "--yes")
    assert result.exit_code == ExitCode.USAGE, (result.exit_code, result.output)
    assert fragment in result.output
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "bad",
    [
        {"max_bytes": -1},
        {"max_bytes": 1.5},
        {"by": "ctime", "max_bytes": 0},
        {"debris_older_than": -1},
        {"debris_older_than": float("nan")},
        {"restarted_at": NOW + 1},
        {"tag": "novalue"},
        {"world_size": 0},
        {"layer": -1},
    ],
)
def test_bad_plan_arguments_are_refused(tmp_path, bad):
    with pytest.raises(InvalidArgumentError):
        plan_clean(open_cache(copy("fs", tmp_path)), now=NOW, **bad)


def test_store_options_and_cache_options_do_not_mix(tmp_path):
    with hmem.Store.create(tmp_path / "store", embed_dim=8, hdc_dim=64):
        pass
    for args, fragment in (
        (["evict", tmp_path / "store", "--max-bytes", "1"], "--max-bytes"),
        (["compact", tmp_path / "store", "--restarted-at", "0"], "--restarted-at"),
        (["rm", tmp_path / "store", "0", "--tag", "user%alice"], "--tag"),
    ):
        result = run(*args)
        assert result.exit_code == ExitCode.USAGE and fragment in result.output, result.output


def test_the_plan_is_shown_as_a_table_with_totals(tmp_path):
    cache = copy("fs", tmp_path)
    result = run("rm", cache, "--tag", "user%alice")
    assert result.exit_code == 0
    lines = result.stdout
    assert "name" in lines and "reason" in lines and "size" in lines
    assert "user%alice" in lines and "selected" in lines
    assert "to delete: 2 file(s)" in lines and "chunks: 7" in lines and "-> 5" in lines
    done = run("rm", cache, "--tag", "user%alice", "--yes")
    assert done.exit_code == 0 and "deleted 2 file(s)" in done.stdout


def test_multiprocess_mode_selection_and_cap_by_rank(tmp_path):
    cache = copy("mp", tmp_path)
    files = sorted(names(cache))
    rank1 = {n for n in files if "@0x02010201@" in n}
    plan = plan_clean(open_cache(cache), world_size=2, rank=1, model=MODEL)
    assert {f.name for f in plan.files} == rank1
    for n, name in enumerate(files):
        set_times(cache / name, atime=1.7e9 + n)
    size = (cache / files[0]).stat().st_size
    plan = plan_clean(open_cache(cache), max_bytes=size * len(files) - 1)
    # one object of one group, on every rank that holds it, goes whole
    chunks = {(n.split("@")[2], n.split("@")[3]) for n in (f.name for f in plan.files)}
    assert len(chunks) == 1
    group, digest = chunks.pop()
    assert {f.name for f in plan.files} == {n for n in files if n.split("@")[2:4] == [group, digest]}


@pytest.mark.parametrize(("answer", "deleted"), [(b"y\n", True), (b"n\n", False)])
def test_the_person_at_the_terminal_confirms(tmp_path, answer, deleted):
    cache = copy("fs", tmp_path)
    tagged = {n for n in names(cache) if "%" in n}
    controller, terminal = pty.openpty()  # stdin a terminal: hmem asks, and reads the answer already typed
    try:
        os.write(controller, answer)
        env = {k: v for k, v in os.environ.items() if k not in ("HMEM_STORE", "HMEM_DEBUG")}
        done = subprocess.run(
            [sys.executable, "-m", "hmem", "rm", str(cache), "--tag", "user%alice"],
            stdin=terminal,
            capture_output=True,
            timeout=120,
            env={**env, "NO_COLOR": "1", "COLUMNS": "200"},
        )
    finally:
        os.close(controller)
        os.close(terminal)
    assert done.returncode == 0, done.stderr
    assert b"delete 2 file(s)" in done.stderr  # the question
    assert (names(cache) & tagged == set()) is deleted
    assert (b"deleted 2 file(s)" in done.stdout) is deleted
