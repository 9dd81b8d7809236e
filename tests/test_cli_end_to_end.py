"""The whole command-line job in real processes: init -> put -> query ->
evict -> compact -> stats, as an operator (or a cron job) runs it.

Each step is `python -m hmem ...` with cwd = tmp_path, so the installed
package (with its compiled kernels) is imported, not the source tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

D = 32


def test_init_put_query_evict_compact_stats(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "HMEM_STORE", "HMEM_DEBUG")}
    env.update(NO_COLOR="1", COLUMNS="120")

    def hmem(*args, code: int = 0) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "hmem", *map(str, args)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == code, (args, proc.returncode, proc.stdout, proc.stderr)
        assert "\x1b[" not in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        return proc

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
        save_file({"keys": keys, "values": values}, inputs / f"chunk_{i:02d}.safetensors",
                  metadata={"layer": "3", "importance": "10" if i == 7 else "1"})
    save_file({f"layer.{n}.{kind}": rng.standard_normal((4, D)).astype(np.float32)
               for n in range(3) for kind in "kv"}, inputs / "layers.safetensors")
    wanted_keys, wanted_values = chunks[7]
    np.save(tmp_path / "probe.npy", wanted_keys[:6] + 0.2 * rng.standard_normal((6, D)).astype(np.float32))

    created = hmem_json("init", "store", "--embed-dim", D, "--hdc-dim", 512, "--shard-max", "16KiB")
    assert created["config"]["embed_dim"] == D and created["config"]["shard_max_bytes"] == 16 * 1024

    put = hmem_json("put", "store", "dumps")
    assert (put["files"], put["files_skipped"], put["entries_added"]) == (13, 0, 15)
    assert put["shards_created"] >= 2  # 16 KiB shards seal as the import goes

    # the query finds the wanted chunk first; its exported K/V are the stored ones
    found = hmem_json("query", "store", "--query", "probe.npy", "--layer", 3, "--top-k", 3,
                      "--export", "hits.safetensors")
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
    compacted = hmem_json("compact", "store", "--threshold", 1)
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
    script = hmem("--show-completion", "bash").stdout
    assert "_HMEM_COMPLETE=complete_bash" in script
    env.update(_HMEM_COMPLETE="complete_bash", COMP_WORDS="hmem comp", COMP_CWORD="1")
    assert hmem().stdout.split() == ["compact"]
