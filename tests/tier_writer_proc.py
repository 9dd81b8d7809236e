"""A process of the tier tests of several writers (tests/test_lmcache_tier_writers.py).

Run as ``python tier_writer_proc.py LOCATION SETTINGS_JSON OPTIONS_JSON``: it
says ``["started", pid]``, opens a ``hmem.lmcache.ChunkTier`` on LOCATION
when the line ``["open"]`` comes, says ``["ready", pid]`` (or
``["open_failed", error]``) and then does what each line of its stdin asks (a JSON list), answering with
JSON lines on stdout, as one LMCache worker process (a tensor-parallel
rank) would drive the tier.  Every chunk's values come from its key
(``chunk_words``), so whoever reads a chunk can check it by itself.

Commands:

- ``["stage", keys]``: stage a chunk under each key; ``["staged", keys]``.
- ``["commit"]``: ``commit()``; ``["committed", keys]``: every key staged
  since the last commit, now acknowledged.
- ``["loop", prefix, groups, size(, point)]``: per group i, stage ``size``
  chunks ``prefix-i-j``, say ``["committing", i]``, ``commit()``, say
  ``["committed", keys]``; then ``["looped"]``: a writer a kill may stop
  anywhere.  With `point`, the second commit stops the process there
  (SIGSTOP: HMEM_PAUSE_AT, hmem/_io.py) for the test to kill it.
- ``["wait_own_commit"]``: wait (polling the tier's stats) until the
  committer thread has committed every staged chunk by itself, without a
  ``commit()``; ``["own_commit", keys, seconds waited]``.
- ``["watch", groups]``: as a reader, poll ``keys()`` and ``contains()``,
  checking that each group (the chunks one commit stored) is seen whole or
  not at all and that every chunk seen reads back bit-exact; say
  ``["seen", group numbers]`` as groups appear, and once all have (or a
  line ``["stop"]`` came), ``["watched", polls, keys seen, problems]``.
- ``["close"]``: ``close()``; ``["closed", stats]`` and the process ends.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import select
import sys
import time

import numpy as np

from hmem.lmcache import ChunkTier, TierSettings

SHAPE = (2, 4, 16, 64)  # KV_2LTD: [2, layers, tokens, hidden], as LMCache hands a chunk over
EMBED = SHAPE[-1]


def chunk_words(key: str) -> np.ndarray:
    """The chunk under `key`: bfloat16 words (the top half of float32 normal
    values, so every one is finite), the same in every process."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    values = np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def say(*item: object) -> None:
    sys.stdout.write(json.dumps(list(item)) + "\n")
    sys.stdout.flush()


def read_back(tier: ChunkTier, key: str) -> str | None:
    """None when the chunk under `key` reads back as put, else what is wrong."""
    found = tier.fetch(key)
    if found is None:
        return "listed but not fetched"
    if tuple(found.shape) != SHAPE:
        found.close()
        return f"shape {list(found.shape)}"
    out = np.empty(SHAPE, dtype=np.uint16)
    found.copy_into(out)
    if not np.array_equal(out, chunk_words(key)):
        return "wrong values"
    return None


class Commands:
    """The lines of stdin, read unbuffered: `ready` tells, without waiting,
    whether a whole line has come (a buffered reader could hold it unseen)."""

    def __init__(self) -> None:
        self._data = b""
        self._ended = False

    def ready(self) -> bool:
        while b"\n" not in self._data and not self._ended and select.select([0], [], [], 0)[0]:
            self._fill()
        return b"\n" in self._data or self._ended

    def next(self) -> list | None:
        while b"\n" not in self._data and not self._ended:
            self._fill()
        if b"\n" not in self._data:
            return None
        line, self._data = self._data.split(b"\n", 1)
        return json.loads(line)

    def _fill(self) -> None:
        more = os.read(0, 65536)
        self._data += more
        self._ended = not more


def watch(tier: ChunkTier, groups: list[list[str]], commands: Commands) -> None:
    """Poll the tier as a reader (see the module docstring)."""
    group_of = {key: n for n, group in enumerate(groups) for key in group}
    seen: set[str] = set()
    whole: set[int] = set()  # groups seen whole
    problems: list[str] = []
    polls = 0
    while len(whole) < len(groups):
        if commands.ready():
            commands.next()  # ["stop"]
            break
        polls += 1
        listed = set(tier.keys())  # one commit's view
        for n in {group_of[key] for key in listed if key in group_of}:
            missing = [key for key in groups[n] if key not in listed]
            if missing:
                problems.append(f"keys(): group {n} seen without {missing}")
        for n, group in enumerate(groups):
            held = tier.contains(group)  # one look-up of the whole group
            if any(held) and not all(held):
                problems.append(f"contains(): group {n} partly held: {held}")
        for key in sorted(listed - seen):
            wrong = read_back(tier, key)
            if wrong is not None:
                problems.append(f"{key}: {wrong}")
        seen |= listed
        new = sorted(n for n, group in enumerate(groups) if n not in whole and set(group) <= listed)
        if new:
            whole.update(new)
            say("seen", new)
    say("watched", polls, sorted(seen), problems[:20])


def main() -> None:
    location, settings, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    commands = Commands()
    say("started", os.getpid())
    if commands.next() != ["open"]:  # several writers open the tier at once, as LMCache's workers start
        raise SystemExit("expected ['open']")
    try:
        tier = ChunkTier(location, embed_dim=EMBED, settings=TierSettings(**settings), storage_options=options or None)
    except Exception as exc:
        say("open_failed", f"{type(exc).__name__}: {exc}")
        raise
    say("ready", os.getpid())
    pending: list[str] = []
    while (command := commands.next()) is not None:
        op = command[0]
        if op == "stage":
            for key in command[1]:
                tier.stage(key, chunk_words(key), "KV_2LTD", SHAPE)
            pending += command[1]
            say("staged", command[1])
        elif op == "commit":
            tier.commit()
            say("committed", pending)
            pending = []
        elif op == "loop":
            prefix, groups, size = command[1:4]
            pause_at = command[4] if len(command) > 4 else None
            for i in range(groups):
                keys = [f"{prefix}-{i}-{j}" for j in range(size)]
                for key in keys:
                    tier.stage(key, chunk_words(key), "KV_2LTD", SHAPE)
                say("committing", i)
                tier.commit()
                say("committed", keys)
                if pause_at and i == 0:
                    # from now on (the second commit) the process stops itself at this
                    # point of hmem's write path (hmem/_io.py crash_point), to be killed there
                    os.environ["HMEM_PAUSE_AT"] = pause_at
            say("looped")
        elif op == "wait_own_commit":
            # an event (the committer thread's commit), polled: the writer calls no commit()
            started = time.monotonic()
            while tier.stats().staged_chunks:
                time.sleep(0.005)
            say("own_commit", pending, time.monotonic() - started)
            pending = []
        elif op == "watch":
            watch(tier, command[1], commands)
        elif op == "close":
            tier.close()
            say("closed", dataclasses.asdict(tier.stats()))
            return
        else:
            raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
