"""OS errors and closed pipes (docs/reliability.md, "OS errors"; docs/cli.md,
"Exit codes").

Every writing command, refused by the file system, ends with one line on
stderr that names the path and says what to do, and with its documented
exit code (8 permission denied or read-only file system, 9 no space, 10 a
missing path or one of the wrong kind) -- never "internal error".  The store
is left consistent: `hmem.verify` finds at most the leftovers a writer
removes, clean once a writer opened it, and every entry committed before the
failure is still there, bit-exact.

How the conditions are made:

- injected: hmem's fault hook (`_io.set_fault_hook`, as in
  tests/test_crash_faults.py) raises OSError(errno, ...) from inside an I/O
  primitive at the n-th call of one operation (open, write, fsync, rename,
  unlink, truncate, mkdir), exactly where the kernel would raise it;
- real, where this machine allows (skipped with the reason otherwise): a
  read-only bind mount (EROFS), an immutable directory (`chattr +i`: EPERM,
  even for root), a directory another user may not write (EACCES, run as
  `nobody` through setpriv: as root, permission bits stop nothing), a 6 MB
  tmpfs filled up (ENOSPC), and missing or wrong-kind paths;
- a closed stdout: a real pipe whose reader is gone, in a subprocess.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import hmem
from hmem import _io  # the fault hook: the one way to make an I/O primitive fail on purpose
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

D, HDC = 32, 256
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "FORCE_COLOR": None, "HMEM_STORE": None, "HMEM_DEBUG": None}
LEFTOVERS = {"file.temp", "file.orphan", "entries.tail"}  # what verify notes and the next writer removes
SEEDS = range(1, 25)
TARGET = 10  # what `hmem evict` keeps

# Subprocesses run outside the checkout so that they import the installed hmem
# (with its compiled kernels), not the source tree.
OUTSIDE_CHECKOUT = tempfile.gettempdir()


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def kv(seed: int, n: int = 4) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.standard_normal((n, D)).astype(np.float32), r.standard_normal((n, D)).astype(np.float32)


def content(keys, values) -> tuple[bytes, bytes]:
    return np.ascontiguousarray(keys).tobytes(), np.ascontiguousarray(values).tobytes()


def snapshot(path) -> dict[int, tuple[bytes, bytes]]:
    """Every live entry's K/V bytes, through the public read API."""
    with hmem.Store.open(path, read_only=True) as s:
        return {eid: content(got.keys, got.values) for eid in s.entry_ids() for got in [s.get(eid)]}


def assert_one_error_line(result, code: int, *fragments: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.stderr, lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def assert_consistent(path, before: dict, new_contents: set = frozenset(), *, evicting: bool = False) -> None:
    """verify finds at most leftovers, and nothing once a writer opened the
    store; every entry of `before` is still there (an evict may have taken
    some, down to TARGET) with the same bytes; any other entry holds one of
    `new_contents`."""
    report = hmem.verify(path, full=True)
    assert {f.code for f in report.problems} <= LEFTOVERS, report.problems
    hmem.Store.open(path).close()  # a writer finishes the last commit's steps and removes leftovers
    assert hmem.verify(path, full=True).ok, hmem.verify(path, full=True).problems
    now = snapshot(path)
    for eid, data in now.items():
        assert data == before.get(eid) or (eid not in before and data in new_contents), f"entry {eid} changed"
    if evicting:
        assert set(now) <= set(before) and len(now) in (len(before), TARGET)
    else:
        assert set(before) <= set(now), f"entries lost: {sorted(set(before) - set(now))}"


# ---- the stores and inputs the commands work on --------------------------------------------------


def build_store(path: Path) -> None:
    """24 entries over several shards, 6 of them evicted (so compaction has work)."""
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, shard_max_bytes=3000) as s:
        s.put_many([(*kv(seed), seed % 2, float(seed)) for seed in SEEDS])
        s.flush()
        s.evict(len(SEEDS) - 6)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A template store, K/V files to put and a query file (made before any fault is injected)."""
    root = tmp_path_factory.mktemp("os-errors")
    build_store(root / "template")
    inputs = []
    for i, seed in enumerate(range(100, 106)):
        p = root / f"in_{i}.safetensors"
        hmem.write_kv_file(p, dict(zip(("keys", "values"), kv(seed))), {"layer": str(seed % 2)})
        inputs.append(p)
    np.save(root / "q.npy", kv(3)[0])
    return {
        "root": root,
        "inputs": inputs,
        "query": root / "q.npy",
        "new": {content(*kv(seed)) for seed in range(100, 106)},
        "before": snapshot(root / "template"),
    }


COMMANDS: dict[str, Callable[[dict, Path, Path], list]] = {
    "put": lambda w, store, work: ["put", store, *w["inputs"], "--json"],
    "evict": lambda w, store, work: ["evict", store, "--target", TARGET, "--yes", "--json"],
    "compact": lambda w, store, work: ["compact", store, "--json"],
    "query --count-access": lambda w, store, work: [
        "query",
        store,
        "--query",
        w["query"],
        "--layer",
        1,
        "--count-access",
        "--json",
    ],
    "query --export": lambda w, store, work: [
        "query",
        store,
        "--query",
        w["query"],
        "--layer",
        1,
        "--export",
        work / "out.safetensors",
        "--json",
    ],
    "demo": lambda w, store, work: ["demo", work / "demo", "--json"],
}


class Inject:
    """A fault hook: records every call; the `nth` call of `op` raises
    OSError(err) as the kernel would (nth 0: nothing fails)."""

    def __init__(self, op: str = "", nth: int = 0, err: int = 0) -> None:
        self.op, self.nth, self.err = op, nth, err
        self.calls: list[tuple[str, str]] = []
        self.failed: str | None = None

    def __call__(self, op: str, path: str) -> None:
        self.calls.append((op, path))
        if op == self.op and sum(1 for o, _ in self.calls if o == op) == self.nth:
            self.failed = path
            raise OSError(self.err, os.strerror(self.err), path)


def run_with(hook: Inject, w: dict, command: str, work: Path):
    """Run `command` on a fresh copy of the template store with `hook` in place."""
    work.mkdir()
    store = work / "s"
    shutil.copytree(w["root"] / "template", store)
    _io.set_fault_hook(hook)
    try:
        result = run(*COMMANDS[command](w, store, work))
    finally:
        _io.set_fault_hook(None)
    return result, store


_recorded: dict[str, list[tuple[str, str]]] = {}


def calls_of(w: dict, command: str, tmp_path: Path) -> list[tuple[str, str]]:
    """The primitive I/O calls `command` makes on a healthy disk."""
    if command not in _recorded:
        hook = Inject()
        result, _ = run_with(hook, w, command, tmp_path / "healthy")
        assert result.exit_code == 0, result.stderr
        _recorded[command] = hook.calls
    return _recorded[command]


def check_injected(w: dict, command: str, op: str, nth: int, err: int, code: int, work: Path) -> str:
    """Fail the nth `op` of `command` with `err`; check the answer and the
    store.  Returns "failed" or "absorbed" (a best-effort step failed, such
    as clearing the lock's owner record, and the command succeeded)."""
    hook = Inject(op, nth, err)
    result, store = run_with(hook, w, command, work)
    assert hook.failed is not None
    if result.exit_code == 0:
        outcome = "absorbed"
    else:
        assert_one_error_line(result, code, os.strerror(err), os.path.dirname(hook.failed))
        # every command runs with --json: stdout holds the error's document alone (docs/cli.md)
        assert json.loads(result.stdout)["error"]["exit"] == code
        outcome = "failed"
    if command == "demo":
        if (work / "demo" / "index.json").exists():
            assert_consistent(work / "demo", snapshot(work / "demo"))
    else:
        assert_consistent(store, w["before"], w["new"], evicting=command == "evict")
    assert not [p for p in work.iterdir() if p.name.startswith(_io.TEMP_PREFIX)]  # no temporary file left
    return outcome


# (errno, exit code, the operations where that error is met in practice)
CONDITIONS = {
    "permission denied": (errno.EACCES, ExitCode.NO_PERMISSION, ("open", "rename", "unlink", "mkdir")),
    "read-only file system": (errno.EROFS, ExitCode.NO_PERMISSION, ("open", "truncate", "mkdir")),
    "no space": (errno.ENOSPC, ExitCode.NO_SPACE, ("write", "fsync", "mkdir")),
    "missing path": (errno.ENOENT, ExitCode.BAD_PATH, ("open", "rename", "mkdir")),
    "wrong kind": (errno.ENOTDIR, ExitCode.BAD_PATH, ("open", "rename", "mkdir")),
}


@pytest.mark.parametrize("condition", list(CONDITIONS))
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.stress
def test_an_os_error_is_one_line_with_its_exit_code_and_the_store_stays_consistent(world, command, condition, tmp_path):
    err, code, ops = CONDITIONS[condition]
    calls = calls_of(world, command, tmp_path)
    outcomes = {"failed": 0, "absorbed": 0}
    for op in ops:
        count = sum(1 for o, _ in calls if o == op)
        for nth in sorted({1, count}) if count else []:  # the first and the last call of the operation
            outcomes[check_injected(world, command, op, nth, err, code, tmp_path / f"{op}-{nth}")] += 1
    assert outcomes["failed"], (command, condition, outcomes)
    print("FIGURES", json.dumps({"command": command, "condition": condition, **outcomes}))


@pytest.mark.stress
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES, errno.EIO], ids=errno.errorcode.get)
@pytest.mark.parametrize("command", ["put", "evict", "compact", "query --count-access"])
def test_every_call_of_a_writing_command_may_fail(world, command, err, tmp_path):
    """Each I/O call of the command in turn (every one with HMEM_STRESS_ROUNDS set, else at most 3 of each op)."""
    code = {errno.ENOSPC: ExitCode.NO_SPACE, errno.EACCES: ExitCode.NO_PERMISSION}.get(err, ExitCode.FAILURE)
    calls = calls_of(world, command, tmp_path)
    cap = 10_000 if "HMEM_STRESS_ROUNDS" in os.environ else 3
    outcomes = {"failed": 0, "absorbed": 0}
    for op in sorted({o for o, _ in calls}):
        count = sum(1 for o, _ in calls if o == op)
        for nth in sorted(set(np.linspace(1, count, min(count, cap)).round().astype(int).tolist())):
            outcomes[check_injected(world, command, op, nth, err, code, tmp_path / f"{op}-{nth}")] += 1
    assert outcomes["failed"] > outcomes["absorbed"], outcomes
    print("FIGURES", json.dumps({"command": command, "errno": errno.errorcode[err], **outcomes}))


def test_storage_errors_are_os_errors_with_errno_filename_and_strerror(tmp_path):
    store = tmp_path / "s"
    build_store(store)
    with hmem.Store.open(store) as s:
        s.put(*kv(99))
        _io.set_fault_hook(Inject("write", 1, errno.ENOSPC))
        try:
            with pytest.raises(OSError) as caught:
                s.flush()
        finally:
            _io.set_fault_hook(None)
        s.flush()  # the disk is fine again: the same flush goes through
    exc = caught.value
    assert isinstance(exc, hmem.NoSpaceError) and isinstance(exc, hmem.StorageError)
    assert isinstance(exc, hmem.HmemError)
    assert exc.errno == errno.ENOSPC and exc.strerror == os.strerror(errno.ENOSPC)
    assert exc.filename == exc.path and Path(exc.path).parent == store
    assert not Path(exc.path).name.startswith(_io.TEMP_PREFIX)  # named by its final file
    assert exc.message == f"cannot write {exc.path}: No space left on device"
    assert "free space" in exc.hint
    assert len(snapshot(store)) == len(SEEDS) - 6 + 1
    assert hmem.verify(store, full=True).ok


@pytest.mark.parametrize(
    "err, cls, words",
    [
        (errno.EACCES, hmem.PermissionDeniedError, "Permission denied"),
        (errno.EPERM, hmem.PermissionDeniedError, "Operation not permitted"),
        (errno.EROFS, hmem.PermissionDeniedError, "Read-only file system"),
        (errno.ENOSPC, hmem.NoSpaceError, "No space left on device"),
        (errno.EDQUOT, hmem.NoSpaceError, "quota"),
        (errno.ENOENT, hmem.PathError, "No such file or directory"),
        (errno.ENOTDIR, hmem.PathError, "Not a directory"),
        (errno.EISDIR, hmem.PathError, "Is a directory"),
        (errno.ENAMETOOLONG, hmem.PathError, "File name too long"),
        (errno.ELOOP, hmem.PathError, "symbolic links"),
        (errno.EIO, hmem.StorageError, "Input/output error"),
    ],
)
def test_each_errno_has_its_class(tmp_path, err, cls, words):
    path = tmp_path / "out.safetensors"
    _io.set_fault_hook(Inject("open", 1, err))
    try:
        with pytest.raises(cls) as caught:
            hmem.write_kv_file(path, {"k": np.zeros(3, np.float32)})
    finally:
        _io.set_fault_hook(None)
    exc = caught.value
    assert type(exc) is cls and exc.errno == err and exc.filename == str(path)
    assert words in exc.message and exc.hint
    assert isinstance(exc, hmem.PermissionDeniedError) == (cls is hmem.PermissionDeniedError)
    if cls is hmem.PermissionDeniedError:
        assert exc.read_only_fs == (err == errno.EROFS)
    assert not path.exists() and not list(tmp_path.iterdir())


# ---- missing paths and paths of the wrong kind, for real ----------------------------------------------


def test_export_into_a_missing_directory_onto_a_directory_or_under_a_file(world, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(world["root"] / "template", store)
    (tmp_path / "a-file").write_bytes(b"x")
    (tmp_path / "a-dir").mkdir()
    files_before = {p.name: p.read_bytes() for p in store.iterdir()}
    for target, words in [
        (tmp_path / "missing" / "out.safetensors", "No such file or directory"),
        (tmp_path / "a-dir", "Is a directory"),
        (tmp_path / "a-file" / "out.safetensors", "Not a directory"),
    ]:
        for extra in ([], ["--count-access"]):
            result = run("query", store, "--query", world["query"], "--layer", 1, "--export", target, *extra)
            assert_one_error_line(result, ExitCode.BAD_PATH, str(target), words)
            # checked before the store is opened: not even the access counts changed
            assert {p.name: p.read_bytes() for p in store.iterdir()} == files_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file", "s"]
    assert not list((tmp_path / "a-dir").iterdir())
    with pytest.raises(hmem.PathError):
        hmem.check_export_path(tmp_path / "missing" / "x.safetensors")
    hmem.check_export_path(tmp_path / "fine.safetensors")


def test_demo_given_a_file_or_a_path_under_a_file(tmp_path):
    (tmp_path / "a-file").write_bytes(b"x")
    result = run("demo", tmp_path / "a-file")
    assert_one_error_line(result, ExitCode.BAD_PATH, str(tmp_path / "a-file"), "not a directory")
    result = run("demo", tmp_path / "a-file" / "store", "--json")
    assert_one_error_line(result, ExitCode.BAD_PATH, str(tmp_path / "a-file" / "store"), "Not a directory")
    assert (tmp_path / "a-file").read_bytes() == b"x" and sorted(os.listdir(tmp_path)) == ["a-file"]


# ---- real permission conditions ---------------------------------------------------------------------------


WRITING = {
    "put": lambda w, s: ["put", s, w["inputs"][0]],
    "evict": lambda w, s: ["evict", s, "--target", TARGET, "--yes"],
    "compact": lambda w, s: ["compact", s],
    "query --count-access": lambda w, s: ["query", s, "--query", w["query"], "--layer", 1, "--count-access"],
}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True)


def test_a_read_only_bind_mount(world, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    store = tmp_path / "s"
    shutil.copytree(world["root"] / "template", store)
    before = _files(store)
    made = _sh("mount", "--bind", str(store), str(store))
    if made.returncode:
        pytest.skip(f"mount --bind is not permitted here: {made.stderr.strip()}")
    try:
        remounted = _sh("mount", "-o", "remount,ro,bind", str(store))
        if remounted.returncode:
            pytest.skip(f"cannot remount read-only here: {remounted.stderr.strip()}")
        for _name, args in WRITING.items():
            line = assert_one_error_line(
                run(*args(world, store)), ExitCode.NO_PERMISSION, str(store), "Read-only file system"
            )
            assert "remount" in line, line
        assert run("stats", store).exit_code == 0  # reading still works
        assert run("query", store, "--query", world["query"], "--layer", 1).exit_code == 0
        assert run("verify", store, "--full").exit_code == 0
    finally:
        assert _sh("umount", str(store)).returncode == 0
    assert _files(store) == before
    assert_consistent(store, world["before"])


def test_an_immutable_store_directory(world, tmp_path):
    """chattr +i: no file may be created, renamed or removed in it, even by root (EPERM)."""
    store = tmp_path / "s"
    shutil.copytree(world["root"] / "template", store)
    made = _sh("chattr", "+i", str(store))
    if made.returncode:
        pytest.skip(f"chattr +i is not supported here: {made.stderr.strip() or made.returncode}")
    try:
        for name, args in WRITING.items():
            before = snapshot(store)
            result = run(*args(world, store))
            assert_one_error_line(
                result, ExitCode.NO_PERMISSION, str(store), "Operation not permitted", "check the permissions"
            )
            now = snapshot(store)
            assert now == before or name == "evict" and set(now) <= set(before)
    finally:
        _sh("chattr", "-i", str(store))
    assert_consistent(store, world["before"], evicting=True)


@pytest.mark.stress
def test_a_store_another_user_may_not_write(world, tmp_path):
    """Permission bits stop no write of root's, so the commands run as
    `nobody` (setpriv) on a store owned by root: EACCES for real."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as another user")
    shared = Path(tempfile.mkdtemp(prefix="hmem-eacces-"))  # outside pytest's private (0700) tmp dirs
    try:
        shared.chmod(0o755)
        store = shared / "s"
        shutil.copytree(world["root"] / "template", store)
        qfile = shutil.copy(world["query"], shared / "q.npy")
        kvfile = shutil.copy(world["inputs"][0], shared / "in.safetensors")
        for p in (store, qfile, kvfile, *store.iterdir()):
            os.chmod(p, 0o755 if Path(p).is_dir() else 0o644)
        before = _files(store)
        probe = _sh("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", "import hmem")
        if probe.returncode:
            pytest.skip(f"hmem cannot run as another user here: {probe.stderr.strip()[-200:]}")
        w = {**world, "query": qfile, "inputs": [kvfile]}
        env = {**os.environ, "NO_COLOR": "1", "HOME": str(shared)}
        for name, args in WRITING.items():
            proc = subprocess.run(
                [
                    "setpriv",
                    "--reuid=65534",
                    "--regid=65534",
                    "--clear-groups",
                    sys.executable,
                    "-m",
                    "hmem",
                    *map(str, args(w, store)),
                ],
                capture_output=True,
                text=True,
                env=env,
                cwd=OUTSIDE_CHECKOUT,
            )
            assert proc.returncode == ExitCode.NO_PERMISSION, (name, proc.returncode, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "Permission denied" in lines[0] and str(store) in lines[0], proc.stderr
            assert "internal error" not in proc.stderr
        assert _files(store) == before
        assert_consistent(store, world["before"])
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# ---- a real full file system ----------------------------------------------------------------------------


@pytest.mark.stress
def test_a_full_file_system_during_put_and_compact(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    made = _sh("mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt))
    if made.returncode:
        pytest.skip(f"cannot mount a 6 MB tmpfs here: {made.stderr.strip()}")
    try:
        store = mnt / "s"
        assert run("init", store, "--embed-dim", D, "--hdc-dim", HDC, "--shard-max", "512KiB").exit_code == 0

        def batch(i: int) -> tuple[Path, set]:
            """A K/V file of 8 entries of 64 tokens (128 KiB of K/V) outside the
            tmpfs; odd files are less important (evicted first)."""
            tensors, made = {}, set()
            for n in range(8):
                k, v = kv(1000 + 8 * i + n, 64)
                tensors[f"k_{n}"], tensors[f"v_{n}"] = k, v
                made.add(content(k, v))
            path = tmp_path / f"batch_{i}.safetensors"
            hmem.write_kv_file(path, tensors, {"layer": "0", "importance": str(1 + i % 2)})
            return path, made

        # 1.5 MB in one put (shards of about four files), then evict the less
        # important half: every shard keeps half its entries, so compaction
        # must rewrite 0.75 MB
        assert run("put", store, *[batch(i)[0] for i in range(12)], "--json").exit_code == 0
        assert run("evict", store, "--keep", "0.5", "--yes", "--json").exit_code == 0
        acknowledged = set(snapshot(store).values())
        assert len(acknowledged) == 48
        failed = None
        for i in range(12, 80):  # fill the rest of the 6 MB
            path, made = batch(i)
            result = run("put", store, path, "--json")
            if result.exit_code != 0:
                failed = result
                break
            acknowledged |= made
        assert failed is not None, "6 MB never filled up"
        assert_one_error_line(failed, ExitCode.NO_SPACE, str(store), "No space left on device", "free space")
        now = snapshot(store)
        assert set(now.values()) == acknowledged  # the failed put's entries are all absent, the others exact
        problems = {f.code for f in hmem.verify(store, full=True).problems}
        assert problems <= LEFTOVERS, problems
        assert run("stats", store).exit_code == 0  # a full disk still reads

        result = run("compact", store, "--json")
        assert_one_error_line(result, ExitCode.NO_SPACE, str(store), "No space left on device")
        assert set(snapshot(store).values()) == acknowledged
        problems = {f.code for f in hmem.verify(store, full=True).problems}
        assert problems <= LEFTOVERS, problems
        assert run("verify", store, "--full", "--json").exit_code in (0, ExitCode.PROBLEMS_FOUND)
        print(
            "FIGURES",
            json.dumps(
                {
                    "full_disk": {
                        "entries": len(acknowledged),
                        "puts_before_full": i - 12,
                        "df": shutil.disk_usage(mnt).free,
                    }
                }
            ),
        )
    finally:
        assert _sh("umount", str(mnt)).returncode == 0


# ---- a closed stdout ---------------------------------------------------------------------------------------


def _many_shards(path: Path) -> None:
    """A store of 150 one-entry shards: `hmem stats --all-shards` prints
    far more than a 4 KiB pipe holds."""
    with hmem.Store.create(path, embed_dim=D, hdc_dim=HDC, shard_max_bytes=600) as s:
        for seed in range(150):
            s.put(*kv(seed, 1))


def _hmem(args: list, stdout: int, unbuffered: bool | None = None) -> subprocess.Popen:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
    env.pop("HMEM_DEBUG", None)
    if unbuffered is not None:
        env.pop("PYTHONUNBUFFERED", None)
        env.update({"PYTHONUNBUFFERED": "1"} if unbuffered else {})
    return subprocess.Popen(
        [sys.executable, "-m", "hmem", *map(str, args)],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=env,
        cwd=OUTSIDE_CHECKOUT,
    )


@pytest.fixture(scope="module")
def shards_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pipe") / "s"
    _many_shards(path)
    return path


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["rich", "json"])
def test_a_reader_that_stops_after_one_line(shards_store, json_flag, unbuffered):
    """`hmem stats S | head -1`: the reader takes one line and closes the
    pipe while hmem still writes (a 4 KiB pipe, far less than the output).
    Also under PYTHONUNBUFFERED, where Python's own text layer would drop
    the rest of a partial write without an error (and exit 0)."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    proc = _hmem(["stats", shards_store, "--all-shards", *json_flag], stdout=w, unbuffered=unbuffered)
    os.close(w)
    first = b""
    while not first.endswith(b"\n"):
        chunk = os.read(r, 1)
        if not chunk:
            proc.kill()
            raise AssertionError(f"hmem printed no whole line: {first!r}, {proc.communicate()[1]!r}")
        first += chunk
    os.close(r)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.BROKEN_PIPE == 141, stderr
    assert stderr == b"", stderr  # no message, no traceback, no "Exception ignored"
    assert first.strip() == b"{" if json_flag else first.strip()


@pytest.mark.parametrize(
    "args",
    [["stats", "{store}"], ["stats", "{store}", "--json"], ["--version"]],
    ids=["stats", "stats-json", "version"],
)
def test_a_reader_gone_before_hmem_writes(shards_store, args):
    r, w = os.pipe()
    os.close(r)
    proc = _hmem([a.format(store=shards_store) for a in args], stdout=w)
    os.close(w)
    _, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stderr) == (ExitCode.BROKEN_PIPE, b"")


PROBE = """
import sys, typer
from hmem.cli.app import HmemGroup
probe = typer.Typer(cls=HmemGroup)

@probe.command()
def buffered() -> None:
    sys.stdout.write("kept in the buffer until the interpreter flushes it\\n")

@probe.command()
def other() -> None:
    pass

probe(["buffered"])
"""


def test_output_that_reaches_the_pipe_only_at_the_final_flush():
    """Output still buffered when the command returns: Python would flush it
    at exit, fail, print "Exception ignored ... BrokenPipeError" and exit
    120; hmem flushes first, then points stdout at os.devnull."""
    r, w = os.pipe()
    os.close(r)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], stdout=w, stderr=subprocess.PIPE, timeout=120, cwd=OUTSIDE_CHECKOUT
    )
    os.close(w)
    assert (proc.returncode, proc.stderr) == (ExitCode.BROKEN_PIPE, b"")


def test_an_os_error_no_hmem_error_covers_is_still_one_line():
    """The last line of defence: a bare OSError reaching the command line."""
    import typer

    from hmem.cli.app import HmemGroup

    probe = typer.Typer(cls=HmemGroup)

    @probe.command()
    def boom() -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), "/somewhere/file")

    @probe.command()
    def other() -> None:
        pass

    result = CliRunner().invoke(probe, ["boom"])
    assert_one_error_line(result, ExitCode.FAILURE, "/somewhere/file", "Input/output error")
