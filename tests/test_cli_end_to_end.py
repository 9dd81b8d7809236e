"""The whole command-line job in real processes: init -> put -> query ->
evict -> compact -> stats, as an operator (or a cron job) runs it.

Each step is `python -m hmem ...` with cwd = tmp_path, so the installed
package (with its compiled kernels) is imported, not the source tree.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

D = 32


def _runner(tmp_path) -> tuple[dict, Callable[..., subprocess.CompletedProcess]]:
    """The environment of the runs (a test may change it between them) and
    `hmem(*args, code=0)`: one run of `python -m hmem` in tmp_path, its exit
    code checked, with no colour and no traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "HMEM_STORE", "HMEM_DEBUG")}
    env.update(NO_COLOR="1", COLUMNS="120")

    def hmem(*args, code: int = 0) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "hmem", *map(str, args)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == code, (args, proc.returncode, proc.stdout, proc.stderr)
        assert "\x1b[" not in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        return proc

    return env, hmem


@pytest.mark.stress
def test_init_put_query_evict_compact_stats(tmp_path):
    env, hmem = _runner(tmp_path)

    def hmem_json(*args, code: int = 0) -> dict:
        return json.loads(hmem(*args, "--json", code=code).stdout)

    # K/V files as an inference process would dump them: 12 chunk files of
    # layer 3 (importance 1), one of them the wanted entry (importance 10),
    # and a per-layer file.
    rng = np.random.default_rng(5)
    inputs = tmp_path / "dumps"
    inputs.mkdir()
    common = rng.standard_normal(D) * 2  # keys share a large mean, as real keys do
    chunks = {}
    for i in range(12):
        keys = (common + rng.standard_normal(D) + 0.5 * rng.standard_normal((16, D))).astype(np.float32)
        values = rng.standard_normal((16, D)).astype(np.float32)
        chunks[i] = keys, values
        save_file(
            {"keys": keys, "values": values},
            inputs / f"chunk_{i:02d}.safetensors",
            metadata={"layer": "3", "importance": "10" if i == 7 else "1"},
        )
    save_file(
        {f"layer.{n}.{kind}": rng.standard_normal((4, D)).astype(np.float32) for n in range(3) for kind in "kv"},
        inputs / "layers.safetensors",
    )
    wanted_keys, wanted_values = chunks[7]
    np.save(tmp_path / "probe.npy", wanted_keys[:6] + 0.2 * rng.standard_normal((6, D)).astype(np.float32))

    created = hmem_json("init", "store", "--embed-dim", D, "--hdc-dim", 512, "--shard-max", "16KiB")
    assert created["config"]["embed_dim"] == D and created["config"]["shard_max_bytes"] == 16 * 1024

    put = hmem_json("put", "store", "dumps")
    assert (put["files"], put["files_skipped"], put["entries_added"]) == (13, 0, 15)
    assert put["shards_created"] >= 2  # 16 KiB shards seal as the import goes

    # the query finds the wanted chunk first; its exported K/V are the stored ones
    found = hmem_json(
        "query", "store", "--query", "probe.npy", "--layer", 3, "--top-k", 3, "--export", "hits.safetensors"
    )
    ranked = [r["entry_id"] for r in found["results"]]
    assert len(ranked) == 3 and found["results"][0]["importance"] == 10.0
    assert found["results"][0]["score"] > found["results"][1]["score"]
    exported = load_file(tmp_path / "hits.safetensors")
    np.testing.assert_array_equal(exported[f"k_{ranked[0]}"], wanted_keys)
    np.testing.assert_array_equal(exported[f"v_{ranked[0]}"], wanted_values)
    human = hmem("query", "store", "--query", "probe.npy", "--layer", 3, "--top-k", 3).stdout
    assert "3 result(s) from layer 3" in human

    # evict down to 8 entries: the important chunk survives
    evicted = hmem_json("evict", "store", "--target", 8, "--yes")
    assert evicted["evicted"] == 7 and ranked[0] not in evicted["entry_ids"]
    hmem("evict", "store", "--target", 1, code=2)  # no --yes off a terminal: refused

    # a cron job with a threshold above the reclaimable share does nothing ...
    stats = hmem_json("stats", "store")
    share = 100 * stats["reclaimable_bytes"] / stats["bytes_on_disk"]
    assert 0 < share < 95
    cron = hmem("compact", "store", "--threshold", 95).stdout
    assert cron.startswith("nothing to do: ") and len(cron.strip().splitlines()) == 1
    # ... and compaction frees the evicted bytes
    compacted = hmem_json("compact", "store", "--threshold", 1, "--min-dead", 0)
    assert compacted["performed"] is True and compacted["bytes_freed"] > 0

    stats = hmem_json("stats", "store")
    assert (stats["entries"], stats["evicted"], stats["reclaimable_bytes"]) == (8, 0, 0)
    # (compact measured while it held the lock: the lock file's owner record counted then)
    assert 0 <= compacted["bytes_after"] - stats["bytes_on_disk"] <= 256
    assert sum(stats["layers"].values()) == 8
    assert [s["index"] for s in stats["shards"]] == list(range(len(stats["shards"])))
    again = hmem_json("query", "store", "--query", "probe.npy", "--layer", 3, "--top-k", 1)
    assert again["results"][0]["entry_id"] == ranked[0]
    assert stats["total_accesses"] == 0  # shell queries only read

    # HMEM_STORE stands in for the argument
    env["HMEM_STORE"] = "store"
    assert hmem_json("stats")["entries"] == 8
    del env["HMEM_STORE"]

    # shell completion is offered; show it and ask it for a word (nothing is installed)
    help_text = hmem("--help").stdout
    assert "--install-completion" in help_text and "--show-completion" in help_text
    # the shell is found among the process's parents: run it from bash, whatever runs the tests
    shown = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m hmem --show-completion; exit $?"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    script = shown.stdout
    assert "_HMEM_COMPLETE=complete_bash" in script
    env.update(_HMEM_COMPLETE="complete_bash", COMP_WORDS="hmem comp", COMP_CWORD="1")
    assert hmem().stdout.split() == ["compact"]


@pytest.mark.stress
def test_a_cron_import_day(tmp_path):
    """A cron job imports a dump directory twice (the second run finds
    everything stored), an operator lists, removes two entries, compacts,
    lists again and exports a remaining entry, which comes back bit-exact
    (bf16: the stored words themselves)."""
    _, hmem = _runner(tmp_path)

    rng = np.random.default_rng(11)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for n in range(3):  # what a serving process dumps: [1, kv_heads, tokens, head_dim] per layer
        save_file(
            {
                f"past_key_values.{layer}.{kind}": rng.standard_normal((1, 2, 8, D // 2)).astype(np.float32)
                for layer in range(2)
                for kind in ("key", "value")
            },
            dumps / f"req{n}.safetensors",
        )
    hmem("init", "store", "--embed-dim", D, "--storage-dtype", "bf16", "-q")

    first = json.loads(hmem("put", "store", "dumps", "--chunk-tokens", "4", "--json").stdout)
    assert (first["files_imported"], first["entries_added"]) == (3, 12)  # 3 files x 2 layers x 2 chunks
    ids = [i for f in first["imported"] for i in f["entry_ids"]]
    assert ids == list(range(1, 13))
    again = json.loads(hmem("put", "store", "dumps", "--chunk-tokens", "4", "--json").stdout)
    assert (again["entries_added"], again["files_already_imported"]) == (0, 3)

    listed = [json.loads(line) for line in hmem("ls", "store", "--jsonl").stdout.splitlines()]
    assert [row["entry_id"] for row in listed] == ids
    table = hmem("ls", "store").stdout
    assert all(f" {i} " in table for i in ids)

    removed = json.loads(hmem("rm", "store", 2, 7, "--yes", "--json").stdout)
    assert removed["deleted"] == 2 and removed["store_entries"] == 10
    compacted = json.loads(hmem("compact", "store", "--min-dead", "0", "--json").stdout)
    assert compacted["performed"] is True
    left = [json.loads(line)["entry_id"] for line in hmem("ls", "store", "--jsonl").stdout.splitlines()]
    assert left == [i for i in ids if i not in (2, 7)]

    hmem("export", "store", 9, "-o", "nine.safetensors")
    exported = _bf16_words(tmp_path / "nine.safetensors")  # numpy has no bfloat16: the raw words
    shown = json.loads(hmem("show", "store", 9, "--json").stdout)
    source = load_file(dumps / shown["meta"]["source"])  # entry 9: req2, one of its layers, tokens 0-4
    layer = shown["layer"]
    start, stop = shown["meta"]["tokens"]
    for kind, name in (("k", "key"), ("v", "value")):
        rows = source[f"past_key_values.{layer}.{name}"][0].transpose(1, 0, 2).reshape(8, D)[start:stop]
        bits = rows.view(np.uint32)
        words = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # float32 -> bf16, nearest even
        assert exported[f"{kind}_9"] == ("BF16", [stop - start, D], words.tobytes()), kind


def _bf16_words(path) -> dict[str, tuple[str, list[int], bytes]]:
    """Each tensor of a safetensors file as (dtype, shape, its bytes)."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    body = data[8 + size :]
    return {
        name: (t["dtype"], t["shape"], body[t["data_offsets"][0] : t["data_offsets"][1]]) for name, t in header.items()
    }
