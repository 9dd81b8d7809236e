"""The examples of docs/cli.md and docs/lmcache.md run, and print what
the pages show.

Every fenced block of these pages says in its info string what it is:

- ```` ```console ````: a shell transcript, run by this test.  A line
  starting with ``$ `` is a command (continued on the next line while it
  ends with ``\\`` or a quote is open); the lines after it, up to the next
  command, are what it prints, stdout and stderr together as a terminal
  shows them.  The commands run in order in a scratch directory of their
  own, with ``NO_COLOR=1 COLUMNS=100``.
- ```` ```console session=NAME ````: the same, in the scratch directory of
  session NAME, which SESSIONS below prepares (the stores and input files
  the example needs); the blocks of one session run in the order of the
  page, each seeing what the ones before it did.  Session ``lmcache``
  holds the caches LMCache 0.5.6 itself wrote (tests/data/lmcache).
- ```` ```LANG file=NAME ````: a file the examples use (``peek.py``), written
  into every scratch directory (of either page) before its commands run.
- ```` ```LANG skip: REASON ````: not run, for the reason given (it needs an
  object store, a Ctrl-C at a chosen moment, or it is no transcript).

Shown and actual output are compared line by line after the same
normalisation: timings, rates, ages, dates, timestamps, pids and the
kernel path become placeholders, runs of spaces and of table rules become
one (so column widths may differ), and a line ``...`` in the shown output
stands for any number of lines.  Output that is one JSON document on both
sides is compared as JSON, so the page may show it folded.

A ``hmem ...`` command runs in this process (typer's CliRunner on
hmem.cli.app, as the other CLI tests do); any other command, or one with
a pipe or redirection, runs in bash, with this Python's scripts first on
PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import hmem
from hmem.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PAGE_NAMES = ("docs/cli.md", "docs/lmcache.md")
LMCACHE_DATA = ROOT / "tests" / "data" / "lmcache"

# The terminal the examples were shown on: no colour, 100 columns, and none
# of the caller's settings that change what hmem prints.
ENV = {
    "NO_COLOR": "1",
    "COLUMNS": "100",
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "HMEM_STORE": None,
    "HMEM_DEBUG": None,
}


# ---- the blocks of the page ---------------------------------------------------------


@dataclass
class Command:
    line: int  # in its page
    text: str
    shown: list[str]


@dataclass
class Block:
    page: str  # docs/cli.md
    line: int
    section: str  # the heading above it
    language: str  # "" when the fence names none
    marks: dict[str, str]  # session=NAME, file=NAME, and anything else written there
    skip: str | None  # the reason after "skip:"
    body: str
    commands: list[Command] = field(default_factory=list)

    @property
    def session(self) -> str | None:
        return self.marks.get("session")

    @property
    def file(self) -> str | None:
        return self.marks.get("file")


FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)


def blocks(text: str, page: str = "docs/cli.md") -> list[Block]:
    found = []
    section, searched_to = "", 0
    for match in FENCE.finditer(text):
        headings = re.findall(r"^#+ (.+)$", text[searched_to : match.start()], flags=re.M)
        section, searched_to = (headings[-1] if headings else section), match.end()
        line = text.count("\n", 0, match.start()) + 1
        language, _, rest = match["info"].strip().partition(" ")
        rest = rest.strip()
        skip = rest.removeprefix("skip:").strip() if rest.startswith("skip:") else None
        marks = {} if skip is not None else dict(mark.partition("=")[::2] for mark in rest.split())
        indent = len(match["indent"])
        body = "".join(row[indent:] for row in match["body"].splitlines(keepends=True))
        block = Block(page, line, section, language, marks, skip, body)
        if language == "console" and skip is None:
            block.commands = _commands(body, line + 1)
        found.append(block)
    return found


def _commands(body: str, first_line: int) -> list[Command]:
    """The `$ ` commands of a transcript, each with the lines it shows."""
    commands: list[Command] = []
    rows = body.splitlines()
    i = 0
    while i < len(rows):
        if not rows[i].startswith("$ "):
            if commands:  # output before the first command is reported by the marker test
                commands[-1].shown.append(rows[i])
            i += 1
            continue
        start, text = i, rows[i][2:]
        while (text.endswith("\\") or not _complete(text)) and i + 1 < len(rows):
            i += 1
            text += "\n" + rows[i]
        commands.append(Command(first_line + start, text, []))
        i += 1
    return commands


def _complete(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:  # a quote still open: the command goes on
        return False
    return True


PAGE = [block for name in PAGE_NAMES for block in blocks((ROOT / name).read_text(encoding="utf-8"), name)]


def _sessions() -> dict[str, list[Block]]:
    """Blocks to run, by session; a block without one is a session alone,
    named after its section (hmem-prefix-hit-2: the second of that section;
    of a page other than docs/cli.md, after the page too: lmcache-...)."""
    sessions: dict[str, list[Block]] = {}
    for block in PAGE:
        if block.language == "console" and block.skip is None:
            name = block.session
            if name is None:
                slug = re.sub(r"[^a-z0-9]+", "-", block.section.lower()).strip("-")
                if block.page != PAGE_NAMES[0]:
                    slug = f"{Path(block.page).stem}-{slug}"
                name = next(f"{slug}-{n}" for n in range(1, len(PAGE) + 1) if f"{slug}-{n}" not in sessions)
            sessions.setdefault(name, []).append(block)
    return sessions


# ---- running a command --------------------------------------------------------------


SHELL_OPERATOR = re.compile(r"^[|&;<>()]+$")


def _tokens(command: str) -> list[str]:
    lexer = shlex.shlex(command.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def run(command: str, previous_code: int) -> tuple[str, int]:
    """What `command` prints (stdout and stderr together) and its exit code."""
    tokens = _tokens(command)
    assignments = {}
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        assignments[name] = value
    if tokens[:1] == ["hmem"] and not any(SHELL_OPERATOR.match(t) for t in tokens):
        result = CliRunner().invoke(app, tokens[1:], env={**ENV, **assignments})
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.output, result.exit_code
    env = {k: v for k, v in {**os.environ, **ENV}.items() if v is not None}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    done = subprocess.run(
        ["bash", "-c", f"(exit {previous_code}); {command}"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        encoding="utf-8",
        errors="replace",
        timeout=120,
    )
    return done.stdout, done.returncode


# ---- comparing output ---------------------------------------------------------------


VARYING = [
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?Z?( UTC)?"), "<date>"),
    (re.compile(r'("(seconds|timestamp_ns)": )[-0-9.e]+'), r"\1<n>"),
    (re.compile(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)/s\b"), "<rate>"),
    (re.compile(r"\b\d+(\.\d+)? ?(µs|ms|s|min|h)\b"), "<time>"),
    (re.compile(r"\bby pid \d+ on \S+ \([^)]*\)"), "by pid <pid> on <host> (<command>)"),
    (re.compile(r"kernels: [\w-]+(, cpu path: [\w-]+)?"), "kernels: <kernels>"),
    # a checksum of floats that hmem computed (pooled keys): its last bits
    # may differ with the CPU's vector instructions
    (re.compile(r"\bCRC-32C [0-9a-f]{8}\b"), "CRC-32C <crc>"),
    (re.compile(r"[━─═]+"), "─"),
    (re.compile(r"[ \t]+"), " "),
]
NUMBER = re.compile(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)")


def normal(line: str) -> str:
    for pattern, replacement in VARYING:
        line = pattern.sub(replacement, line)
    return line.strip()


def close(shown: str, actual: str) -> bool:
    """Two numbers as printed: equal, or as near as the store's varying
    sizes make them.  index.json holds each shard's checksum as a decimal
    number, whose length varies from store to store, so a size on disk may
    differ by a few bytes: shown in KiB (one decimal) by 0.1, as a count of
    bytes (4 digits or more) by up to 16.  Whole floats (JSON) differ in
    their last digits with the CPU's vector instructions."""
    if shown == actual:
        return True
    a, b = float(shown), float(actual)
    if re.fullmatch(r"-?\d+\.\d", shown) and re.fullmatch(r"-?\d+\.\d", actual):
        return abs(a - b) < 0.1001
    if re.fullmatch(r"-?\d{4,}", shown) and re.fullmatch(r"-?\d{4,}", actual):
        return abs(a - b) <= 16
    if len(re.sub(r"\D", "", shown)) >= 5:
        return abs(a - b) <= 1e-4 * max(abs(a), abs(b))
    return False


def same_line(shown: str, actual: str) -> bool:
    if shown == actual:
        return True
    shown_parts, actual_parts = NUMBER.split(shown), NUMBER.split(actual)
    if len(shown_parts) != len(actual_parts):
        return False
    texts_equal = shown_parts[::2] == actual_parts[::2]
    return texts_equal and all(close(x, y) for x, y in zip(shown_parts[1::2], actual_parts[1::2]))


def same_json(shown, actual) -> bool:
    if isinstance(shown, dict) and isinstance(actual, dict):
        if shown.keys() != actual.keys():
            return False
        return all(key in ("seconds", "timestamp_ns") or same_json(shown[key], actual[key]) for key in shown)
    if isinstance(shown, list) and isinstance(actual, list):
        return len(shown) == len(actual) and all(same_json(x, y) for x, y in zip(shown, actual))
    if isinstance(shown, str) and isinstance(actual, str):
        return normal(shown) == normal(actual)
    numbers = (int, float)
    if isinstance(shown, numbers) and isinstance(actual, numbers) and not isinstance(shown, bool):
        return type(shown) is type(actual) and close(repr(shown), repr(actual))
    return shown == actual


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def matches(shown: list[str], actual: str) -> bool:
    shown_text = "\n".join(shown)
    if shown_text.strip().startswith(("{", "[")):
        want, got = _json(shown_text), _json(actual)
        if want is not None and got is not None:
            return same_json(want, got)
    return _lines_match([normal(s) for s in shown], [normal(a) for a in actual.rstrip("\n").splitlines()])


def _lines_match(shown: list[str], actual: list[str]) -> bool:
    """`shown` against `actual`, where a shown line '...' stands for any
    number of actual lines."""
    if not shown:
        return not actual
    if shown[0] == "...":
        return any(_lines_match(shown[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and same_line(shown[0], actual[0]) and _lines_match(shown[1:], actual[1:])


# ---- the sessions' stores and inputs ------------------------------------------------


def hmem_ok(*args) -> None:
    """Run a command that prepares a session; it must succeed."""
    result = CliRunner().invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == 0, (args, result.output)


def kv_rows(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def hf_dump(path: Path, rng: np.random.Generator, layers: int, tokens: int) -> None:
    """A transformers cache dumped to safetensors: per layer, F16 keys and
    values of 1 sequence x 4 heads x `tokens` x 32 (embed_dim 128)."""
    tensors = {}
    for layer in range(layers):
        for role in ("key", "value"):
            tensors[f"past_key_values.{layer}.{role}"] = kv_rows(rng, 1, 4, tokens, 32).astype(np.float16)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path)


def noisy_keys(store: str, entry_id: int, tokens: int, path: str, rng: np.random.Generator) -> None:
    """A query file: a noisy copy of the first `tokens` keys of an entry."""
    with hmem.Store.open(store, read_only=True) as s:
        keys = np.asarray(s.get(entry_id).keys)[:tokens]
    np.save(path, (keys + 0.3 * rng.standard_normal(keys.shape)).astype(np.float32))


def count_accesses(store: str, accesses: dict[int, int]) -> None:
    """Give entries accesses, as queries that find them do."""
    with hmem.Store.open(store) as s:
        for entry_id, times in accesses.items():
            entry = s.get(entry_id)
            for _ in range(times):
                assert s.query(entry.keys, entry.info.layer_idx, top_k=1)[0].entry_id == entry_id


def setup_init(stack: contextlib.ExitStack) -> None:
    """Nothing: `hmem init` makes the store."""


def setup_put(stack: contextlib.ExitStack) -> None:
    """A new store, kv-small (at most 20 entries), `dumps` of three requests
    (F32 keys and values, 128 tokens each) and `incoming`: a good file, a
    file of keys without values and one of a smaller model."""
    rng = np.random.default_rng(11)
    hmem_ok("init", "kv-store", "--embed-dim", 128, "-q")
    hmem_ok("init", "kv-small", "--embed-dim", 128, "--max-entries", 20, "-q")
    Path("dumps").mkdir()
    for i in range(3):
        save_file({"keys": kv_rows(rng, 128, 128), "values": kv_rows(rng, 128, 128)}, f"dumps/req{i}.safetensors")
    Path("incoming").mkdir()
    save_file({"keys": kv_rows(rng, 10, 128), "values": kv_rows(rng, 10, 128)}, "incoming/good.safetensors")
    save_file({"k": kv_rows(rng, 10, 128)}, "incoming/half.safetensors")
    save_file({"keys": kv_rows(rng, 10, 64), "values": kv_rows(rng, 10, 64)}, "incoming/small_model.safetensors")


def setup_layouts(stack: contextlib.ExitStack) -> None:
    """A new store of embed_dim 128, `dumps` of two requests as transformers
    caches (4 layers of 200 tokens), and square.safetensors, whose shape
    reads as two layouts."""
    rng = np.random.default_rng(12)
    hmem_ok("init", "kv-store", "--embed-dim", 128, "-q")
    for i in range(2):
        hf_dump(Path(f"dumps/request-{i}.safetensors"), rng, layers=4, tokens=200)
    save_file({"k": kv_rows(rng, 4, 4, 32), "v": kv_rows(rng, 4, 4, 32)}, "square.safetensors")


def setup_query(stack: contextlib.ExitStack) -> None:
    """The store of "Naming conventions and layouts" filled, a query close
    to entry 18 (layer 0), a text file and `back`, a new store."""
    setup_layouts(stack)
    hmem_ok("put", "kv-store", "dumps", "--chunk-tokens", 64, "-q")
    hmem_ok("put", "kv-store", "square.safetensors", "--layout", "htd", "-q")
    noisy_keys("kv-store", 18, 64, "query.npy", np.random.default_rng(13))
    Path("q.txt").write_text("hello\n")
    hmem_ok("init", "back", "--embed-dim", 128, "-q")


def setup_damaged(stack: contextlib.ExitStack) -> None:
    """240 entries of 16 tokens in 4 layers and 7 shards, the third shard
    file deleted, and a query close to entry 38 (layer 1)."""
    rng = np.random.default_rng(24)  # data whose query meets one damaged entry among its best three
    hmem_ok("init", "kv-store", "--embed-dim", 128, "--shard-max", "700k", "-q")
    for i in range(15):
        hf_dump(Path(f"dumps/request-{i:02d}.safetensors"), rng, layers=4, tokens=64)
    hmem_ok("put", "kv-store", "dumps", "--chunk-tokens", 16, "-q")
    noisy_keys("kv-store", 38, 16, "query.npy", rng)
    Path("kv-store/shard_0002.safetensors").unlink()


def setup_entries(stack: contextlib.ExitStack) -> None:
    """request-0 and, with importance 2, request-1 (2 layers of 150 tokens)
    in chunks of 64 tokens, entries 2, 5 and 9 accessed; kv-bf16 and kv-int8
    hold request-0 whole, stored as bf16 and int8."""
    rng = np.random.default_rng(15)
    for i in range(2):
        hf_dump(Path(f"dumps/request-{i}.safetensors"), rng, layers=2, tokens=150)
    hmem_ok("init", "kv-store", "--embed-dim", 128, "-q")
    hmem_ok("put", "kv-store", "dumps/request-0.safetensors", "--chunk-tokens", 64, "-q")
    hmem_ok("put", "kv-store", "dumps/request-1.safetensors", "--chunk-tokens", 64, "--importance", 2, "-q")
    count_accesses("kv-store", {2: 3, 5: 1, 9: 2})
    for dtype in ("bf16", "int8"):
        hmem_ok("init", f"kv-{dtype}", "--embed-dim", 128, "--storage-dtype", dtype, "-q")
        hmem_ok("put", f"kv-{dtype}", "dumps/request-0.safetensors", "-q")


def setup_maintained(stack: contextlib.ExitStack) -> None:
    """A store of 16 entries in 4 layers and 3 shards, with a limit of 10G
    on disk: entries 1-8 of 32 tokens in layers 0-3, 9-14 of 64 tokens in
    layer 0, each put from a file of its own in one put; then 15 (layer 0)
    and, with importance 2, 16 (layer 2), of 8 tokens, put one by one.
    Entries 9, 13 and 14 were accessed once."""
    rng = np.random.default_rng(16)
    hmem_ok("init", "kv-store", "--embed-dim", 128, "--max-disk", "10G", "-q")
    Path("dumps").mkdir()
    for i, (layer, tokens) in enumerate([*((n % 4, 32) for n in range(8)), *((0, 64) for _ in range(6))]):
        save_file(
            {"keys": kv_rows(rng, tokens, 128), "values": kv_rows(rng, tokens, 128)},
            f"dumps/part-{i:02d}.safetensors",
            metadata={"layer": str(layer)},
        )
    hmem_ok("put", "kv-store", "dumps", "-q")
    for name, layer, importance in (("late-0", 0, 1), ("late-1", 2, 2)):
        save_file({"keys": kv_rows(rng, 8, 128), "values": kv_rows(rng, 8, 128)}, f"{name}.safetensors")
        hmem_ok("put", "kv-store", f"{name}.safetensors", "--layer", layer, "--importance", importance, "-q")
    count_accesses("kv-store", {9: 1, 13: 1, 14: 1})


def setup_maintained_compacted(stack: contextlib.ExitStack) -> None:
    """The maintained store after `hmem evict --keep 0.5` and `hmem compact --min-dead 0`."""
    setup_maintained(stack)
    hmem_ok("evict", "kv-store", "--keep", 0.5, "--yes", "-q")
    hmem_ok("compact", "kv-store", "--min-dead", "0", "-q")


def setup_no_index(stack: contextlib.ExitStack) -> None:
    """The maintained store without its index.json."""
    setup_maintained(stack)
    Path("kv-store/index.json").unlink()


def setup_locked(stack: contextlib.ExitStack) -> None:
    """The maintained store, its write lock held by another writer."""
    setup_maintained(stack)
    stack.enter_context(hmem.Store.open("kv-store"))


def _small_store() -> None:
    rng = np.random.default_rng(17)
    hmem_ok("init", "kv-store", "--embed-dim", 32, "-q")
    Path("kvs").mkdir()
    for i in range(5):
        save_file({"keys": kv_rows(rng, 8, 32), "values": kv_rows(rng, 8, 32)}, f"kvs/{i}.safetensors")
    hmem_ok("put", "kv-store", "kvs", "-q")


def setup_verify(stack: contextlib.ExitStack) -> None:
    """A small store: 5 entries of 8 tokens, embed_dim 32, in one shard."""
    _small_store()


def setup_verify_flipped(stack: contextlib.ExitStack) -> None:
    """The small store with one bit flipped in the pooled keys of entry 5."""
    _small_store()
    flip_bit(Path("kv-store/shard_0000.safetensors"), "p_5")


def flip_bit(shard: Path, tensor: str) -> None:
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, _ = json.loads(data[8 : 8 + length])[tensor]["data_offsets"]
    data[8 + length + begin] ^= 0x01
    shard.write_bytes(bytes(data))


def setup_lmcache(stack: contextlib.ExitStack) -> None:
    """The caches LMCache 0.5.6 wrote (tests/data/lmcache: chunks of 16
    tokens, 2 layers, hidden 8, bf16), copied as new files; its requests
    as token files: requests.json (a, b, c, a-tagged, short, with their
    tags and multiprocess-mode salts) and each alone (a.json, ...).  The
    restarted local_disk cache gets the files' times LMCache left, moved so
    that its restart is at 2026-12-01T12:00:00Z (git keeps no times)."""
    oracle = json.loads((LMCACHE_DATA / "oracle.json").read_text())
    for cache in sorted(p for p in LMCACHE_DATA.iterdir() if p.is_dir()):
        shutil.copytree(cache, cache.name, copy_function=shutil.copyfile)
    salts = {r["name"]: r["cache_salt"] for r in oracle["mp"]["requests"]}
    requests = []
    for r in oracle["caches"]["local_disk"]["requests"]:
        request: dict = {"name": r["name"], "tokens": r["tokens"]}
        if r["tags"]:
            request["tags"] = {k.removeprefix("lmcache.tag."): v for k, v in r["tags"].items()}
        if salts.get(r["name"]):
            request["salt"] = salts[r["name"]]
        requests.append(request)
        Path(f"{r['name']}.json").write_text(json.dumps([request]))
    Path("requests.json").write_text(json.dumps(requests))
    restart = oracle["restart"]
    restarted_at = int(datetime(2026, 12, 1, 12, tzinfo=timezone.utc).timestamp()) * 10**9
    for name, facts in restart["files"].items():
        mtime = restarted_at + facts["mtime_ns"] - restart["restarted_at_ns"]
        os.utime(Path("local_disk_restarted") / name, ns=(mtime, mtime))


SESSIONS: dict[str, Callable[[contextlib.ExitStack], None]] = {
    "init": setup_init,
    "put": setup_put,
    "layouts": setup_layouts,
    "query": setup_query,
    "damaged": setup_damaged,
    "entries": setup_entries,
    "maintained": setup_maintained,
    "maintained-compacted": setup_maintained_compacted,
    "no-index": setup_no_index,
    "locked": setup_locked,
    "verify": setup_verify,
    "verify-flipped": setup_verify_flipped,
    "lmcache": setup_lmcache,
}


# ---- the tests ----------------------------------------------------------------------


def test_every_block_is_run_or_says_why_not():
    sessions_used = set()
    for block in PAGE:
        where = f"{block.page}:{block.line}"
        assert block.language, f"{where}: a code block without a language (see {__name__}'s docstring)"
        if block.skip is not None:
            assert block.skip, f"{where}: 'skip:' without a reason"
            continue
        unknown = set(block.marks) - {"session", "file"}
        assert not unknown and all(block.marks.values()), f"{where}: unknown marks {block.marks}"
        if block.file is not None:
            continue
        assert block.language == "console", f"{where}: a {block.language} block neither run, a file nor skipped"
        assert block.commands, f"{where}: a console block without a '$ ' command"
        assert block.body.startswith("$ "), f"{where}: output before the first command"
        if block.session is not None:
            assert block.session in SESSIONS, f"{where}: no session {block.session!r} in SESSIONS"
            sessions_used.add(block.session)
    assert sessions_used == set(SESSIONS), f"sessions no block uses: {set(SESSIONS) - sessions_used}"


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Iterator[contextlib.ExitStack]:
    monkeypatch.chdir(tmp_path)  # the examples use relative paths
    for block in PAGE:
        if block.file is not None:
            Path(block.file).write_text(block.body, encoding="utf-8")
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.mark.parametrize("session", list(_sessions()))
@pytest.mark.stress
def test_the_examples_print_what_the_page_shows(session, scratch):
    blocks_run = _sessions()[session]
    if session in SESSIONS:
        SESSIONS[session](scratch)
    code = 0
    for block in blocks_run:
        for command in block.commands:
            actual, code = run(command.text, code)
            if not matches(command.shown, actual):
                pytest.fail(
                    f"{block.page}:{command.line}: `{command.text}` printed (exit code {code}):\n{actual}\n"
                    "where the page shows:\n" + "\n".join(command.shown),
                    pytrace=False,
                )
