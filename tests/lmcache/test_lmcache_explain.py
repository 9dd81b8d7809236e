"""hmem explains a request's hit from an LMCache cache's files exactly as
LMCache itself reports it: the hit tokens of LMCache 0.5.6's own lookups
(the oracle the writer recorded) in every scenario it wrote: local_disk,
fs, layerwise, a tagged request, a prompt shorter than a chunk, a deleted
chunk, a restart, eviction, a hash seed, and multiprocess mode's hybrid
object groups through hmem's grouped operators.

Each test runs on the small caches committed in tests/data/lmcache/ and,
where LMCache is installed (HMEM_LMCACHE_PYTHON), on the full-size ones
it writes in this session."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hmem.cli.app import app
from hmem.lmcache import open_cache
from hmem.lmcache.hit_explanation import Deployment, Request, explain, parse_requests

SMALL = Path(__file__).parents[1] / "data" / "lmcache"


@pytest.fixture(params=["small", "written"])
def source(request) -> tuple[Path, dict]:
    if request.param == "small":
        return SMALL, json.loads((SMALL / "oracle.json").read_text())
    return request.getfixturevalue("written")


def _requests(made: dict) -> list[Request]:
    return parse_requests([{"name": r["name"], "tokens": r["tokens"], "tags": r["tags"]} for r in made["requests"]])


def _deployment(oracle: dict, **settings) -> Deployment:
    return Deployment(model=oracle["model"], chunk_size=oracle["chunk_size"], **settings)


@pytest.mark.parametrize("kind", ["local_disk", "fs", "layerwise"])
def test_hit_tokens_are_lmcaches_own(source, kind):
    root, oracle = source
    made = oracle["caches"][kind]
    results = explain(open_cache(root / kind), _requests(made), _deployment(oracle))
    assert [r.hit_tokens for r in results] == [r["lookup"] for r in made["requests"]]
    for result, req in zip(results, made["requests"]):
        keys = req["keys"]
        if kind == "layerwise":  # a key per layer: the explanation names the chunk, without a layer
            keys = ["@".join(k.split("@")[:5] + k.split("@")[6:]) for k in keys[:: oracle["layers"]]]
        assert list(result.keys) == keys
        assert result.chunk_hashes == tuple(f"{h:x}" for h in req["chunk_hashes"])


def test_a_prompt_shorter_than_a_chunk_never_hits_and_says_why(source):
    root, oracle = source
    short = next(r for r in oracle["caches"]["fs"]["requests"] if r["name"] == "short")
    [result] = explain(open_cache(root / "fs"), parse_requests([short["tokens"]]), _deployment(oracle))
    assert (result.hit_tokens, result.chunks, result.short) == (0, 0, True)
    assert "shorter than one chunk" in (result.reason or "")


def test_a_tag_is_part_of_the_key(source):
    root, oracle = source
    cache = open_cache(root / "fs")
    tagged = next(r for r in oracle["caches"]["fs"]["requests"] if r["tags"])
    tokens = tuple(tagged["tokens"])
    [alice] = explain(cache, [Request("t", tokens, (("user", "alice"),))], _deployment(oracle))
    assert alice.hit_tokens == tagged["lookup"]
    # with another tag value nothing hits, and hmem says what is stored instead
    [bob] = explain(cache, [Request("t", tokens, (("user", "bob"),))], _deployment(oracle))
    assert bob.hit_tokens == 0
    assert {(m.setting, m.stored, m.wanted) for m in bob.near_misses} == {
        ("tags", "user%alice", "user%bob"),
        ("tags", "(none)", "user%bob"),
    }


def test_a_deleted_chunk_stops_the_hit_and_strands_the_rest(source):
    root, oracle = source
    deleted = oracle["deleted_chunk"]
    results = explain(open_cache(root / "fs_deleted"), _requests(oracle["caches"]["fs"]), _deployment(oracle))
    assert {r.name: r.hit_tokens for r in results} == deleted["lookups"]
    c = next(r for r in results if r.name == "c")
    assert c.first_missing == c.hit_chunks
    assert deleted["deleted"].rsplit("@", 2)[0].split("@")[-1] in (c.reason or "")  # the missing chunk's hash
    assert set(c.unreachable_files) == set(deleted["unreachable"])
    assert "X" in c.grid[0] and "u" in c.grid[0]


def test_after_a_restart_only_files_written_since_count(source, tmp_path):
    root, oracle = source
    restart = oracle["restart"]
    requests = _requests(oracle["caches"]["local_disk"])
    cache_dir = tmp_path / "restarted"
    shutil.copytree(root / "local_disk_restarted", cache_dir)
    after = _deployment(oracle, restarted_at=restart["restarted_at"])
    # the files as they were when the new process started: every one older than it
    for name, mtime in restart["mtime_ns_before_restart"].items():
        os.utime(cache_dir / name, ns=(mtime, mtime))
    results = explain(open_cache(cache_dir), requests, after)
    assert {r.name: r.hit_tokens for r in results} == restart["lookups_before_store"]
    a = next(r for r in results if r.name == "a")
    assert "restart" in (a.reason or "") and "s" in a.grid[0]
    # then the new process stored request a again: those files count, the others still do not
    for name, facts in restart["files"].items():
        os.utime(cache_dir / name, ns=(facts["mtime_ns"], facts["mtime_ns"]))
    results = explain(open_cache(cache_dir), requests, after)
    assert {r.name: r.hit_tokens for r in results} == restart["lookups_after_store"]
    # without the restart time, the files alone would hit more than the running LMCache does
    unaware = explain(open_cache(cache_dir), requests, _deployment(oracle))
    assert sum(r.hit_tokens for r in unaware) > sum(restart["lookups_after_store"].values())


def test_eviction_can_strand_every_file(source):
    root, oracle = source
    evicted = oracle["evicted"]
    cache = open_cache(root / "local_disk_evicted")
    results = explain(cache, _requests(oracle["caches"]["local_disk"]), _deployment(oracle))
    assert {r.name: r.hit_tokens for r in results} == evicted["lookups"]
    stranded = {f for r in results for f in r.unreachable_files}
    assert stranded and stranded <= set(evicted["files"])


def test_a_hash_seed_changes_every_key_and_hmem_names_it(source):
    root, oracle = source
    seeded = oracle["caches"]["fs_seeded"]
    cache = open_cache(root / "fs_seeded")
    requests = _requests(seeded)
    right = explain(cache, requests, _deployment(oracle, hash_seed=seeded["pythonhashseed"]))
    assert [r.hit_tokens for r in right] == [r["lookup"] for r in seeded["requests"]]
    by_value = explain(cache, requests, _deployment(oracle, none_hash=seeded["none_hash"]))
    assert [r.hit_tokens for r in by_value] == [r["lookup"] for r in seeded["requests"]]
    # looked up as LMCache outside vLLM would (NONE_HASH 0): nothing hits
    wrong = explain(cache, requests, _deployment(oracle))
    assert all(r.hit_tokens == 0 for r in wrong)
    assert all(any("PYTHONHASHSEED" in note for note in r.notes) for r in wrong if r.chunks)
    # and the other way round: a seeded lookup of an unseeded cache names the seed as the cause
    plain = explain(open_cache(root / "fs"), requests[:1], _deployment(oracle, hash_seed=seeded["pythonhashseed"]))
    assert plain[0].hit_tokens == 0
    assert [m.setting for m in plain[0].near_misses] == ["none_hash"]


def test_another_model_name_or_world_size_is_a_near_miss(source):
    root, oracle = source
    made = oracle["caches"]["fs"]
    requests = _requests(made)[:1]
    cache = open_cache(root / "fs")
    [other] = explain(cache, requests, Deployment(model="meta-llama/Other", chunk_size=oracle["chunk_size"]))
    assert other.hit_tokens == 0
    assert [(m.setting, m.stored) for m in other.near_misses] == [
        ("model", oracle["model"]),  # the untagged copy
        ("model, tags", f"{oracle['model']}, user%alice"),  # the tagged copy of the same tokens
    ]
    [wider] = explain(cache, requests, _deployment(oracle, world_size=2))
    assert wider.hit_tokens == 0 and len(wider.rows) == 2
    assert [(m.setting, m.stored, m.wanted) for m in wider.near_misses][0] == ("world_size", "1", "2")


def test_multiprocess_mode_hit_and_retained_cells_are_lmcaches(source):
    root, oracle = source
    mp = oracle.get("mp")
    if mp is None:
        pytest.skip("this writer run made no multiprocess-mode cache")
    cache = open_cache(root / "mp")
    deployment = Deployment(
        model=mp["model"], world_size=mp["world_size"], chunk_size=mp["chunk_size"], windows=tuple(mp["windows"])
    )
    requests = parse_requests(
        [{"name": r["name"], "tokens": r["tokens"], "salt": r["cache_salt"]} for r in mp["requests"]]
    )
    for result, req in zip(explain(cache, requests, deployment), mp["requests"]):
        assert (result.hit_chunks, result.hit_tokens) == (req["hit_chunks"], req["hit_tokens"]), req["name"]
        assert result.chunk_hashes == tuple(req["chunk_hashes"])
        for label, window, cells, row in zip(result.rows, result.windows, result.grid, req["rows"]):
            assert window == row["window"]
            assert label.startswith(f"group {row['object_group']} ")
            held = [c in "HhuX" and c != "X" for c in cells]
            assert held == [bool(p) for p in row["present"]], (req["name"], label)
            assert [i for i, c in enumerate(cells) if c == "H"] == row["retained"], (req["name"], label)


def test_the_command_line_explains_with_a_grid_and_as_json(tmp_path):
    oracle = json.loads((SMALL / "oracle.json").read_text())
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps([{"name": r["name"], "tokens": r["tokens"]} for r in oracle["caches"]["fs"]["requests"]])
    )
    common = ["--tokens", str(tokens), "--model", oracle["model"], "--chunk-size", str(oracle["chunk_size"])]
    runner = CliRunner()
    shown = runner.invoke(app, ["prefix-hit", str(SMALL / "fs_deleted"), *common])
    assert shown.exit_code == 0, shown.output
    assert "request c: 32 of" in shown.output and "stops at chunk 2" in shown.output
    assert "held after the hole" in shown.output
    as_json = runner.invoke(app, ["prefix-hit", str(SMALL / "fs_deleted"), *common, "--json"])
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output)
    assert {r["name"]: r["hit_tokens"] for r in doc["requests"]} == oracle["deleted_chunk"]["lookups"]
    assert doc["deployment"]["model"] == oracle["model"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "m"], "needs both CACHE and --tokens"),
        (["--tokens", "TOKENS"], "model name"),
        (["--tokens", "TOKENS", "--model", "m", "--hash", "sha256"], "hash algorithm"),
        (["--tokens", "TOKENS", "--model", "m", "--hash-seed", "x"], "PYTHONHASHSEED"),
        (["--tokens", "TOKENS", "--model", "m", "--tag", "novalue"], "NAME=VALUE"),
        (["--tokens", "TOKENS", "--model", "m", "--restarted-at", "yesterday"], "ISO 8601"),
        (["--tokens", "BAD", "--model", "m"], "token ids"),
    ],
)
def test_bad_explanation_input_is_a_usage_error(tmp_path, args, message):
    cache = tmp_path / "cache"
    shutil.copytree(SMALL / "fs", cache)
    before = sorted(os.listdir(cache))
    (tmp_path / "tokens.json").write_text("[[1, 2, 3]]")
    (tmp_path / "bad.json").write_text('[["a"]]')
    args = [{"TOKENS": str(tmp_path / "tokens.json"), "BAD": str(tmp_path / "bad.json")}.get(a, a) for a in args]
    result = CliRunner().invoke(app, ["prefix-hit", str(cache), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert sorted(os.listdir(cache)) == before


def test_every_cell_of_the_grid_has_a_glyph():
    from hmem.cli import lmcache_prefix_hit_view
    from hmem.lmcache import CELL_MEANINGS

    assert set(lmcache_prefix_hit_view._CELLS) == set(CELL_MEANINGS)
