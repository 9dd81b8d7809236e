"""Degraded reads (docs/reliability.md, "Degraded reads"): a query with
``on_damage="skip"`` (``hmem query --skip-damaged``) leaves out the entries
it cannot read, lets the next best take their places, reports what it left
out, and never returns wrong K/V; ``on_damage="raise"`` (the default) still
refuses.  ``Store.stats().health`` (the health line of ``hmem stats``) names
missing and cut shard files and counts the live entries they hold.

The store under test (tests/conftest.py, ``reliability_template``): entries
1..14, entry i in layer (i - 1) % 3; live entries 1, 2 in shard 0; 4, 5, 6
in shard 1; 7, 9 in shard 2; 10, 11 in shard 3; 13, 14 in shard 4 (3, 8, 12
evicted); built F32 and INT8.  Each probe query's clean ranking covers its
whole layer, with every entry's similarity and cosine, so what any query
should return with some entries left out can be computed from it.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import hmem
from hmem import Store
from hmem.cli.app import app

CLI_ENV = {"COLUMNS": "200", "NO_COLOR": "1", "HMEM_DEBUG": None, "HMEM_STORE": None}
ADVICE = "run 'hmem verify --full', then 'hmem verify --repair'"
ALL_KINDS = frozenset({"k", "v", "p", "ks", "vs"})
SHARD_ENTRIES = {0: {1, 2}, 1: {4, 5, 6}, 2: {7, 9}, 3: {10, 11}, 4: {13, 14}}


# ---- damage, done to the files as a disk would ------------------------------------------


def shard_path(root: Path, index: int) -> Path:
    return root / f"shard_{index:04d}.safetensors"


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute [start, end) of a tensor's bytes in a shard (the safetensors layout, docs/format.md)."""
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw, 0)
    start, end = json.loads(raw[8 : 8 + length])[name]["data_offsets"]
    return 8 + length + start, 8 + length + end


def flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def delete_shard(index: int):
    def damage(root: Path) -> dict[int, frozenset]:
        shard_path(root, index).unlink()
        return dict.fromkeys(SHARD_ENTRIES[index], ALL_KINDS)

    return damage


def truncate_shard(index: int, cut: int = 1):
    def damage(root: Path) -> dict[int, frozenset]:
        path = shard_path(root, index)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - cut)
        return dict.fromkeys(SHARD_ENTRIES[index], ALL_KINDS)

    return damage


def flip_tensor(entry_id: int, kind: str):
    def damage(root: Path) -> dict[int, frozenset]:
        shard = next(s for s, ids in SHARD_ENTRIES.items() if entry_id in ids)
        path = shard_path(root, shard)
        start, end = tensor_span(path, f"{kind}_{entry_id}")
        flip(path, (start + end) // 2, 6)
        return {entry_id: frozenset({kind})}

    return damage


def combined(*damages):
    def damage(root: Path) -> dict[int, frozenset]:
        out: dict[int, frozenset] = {}
        for d in damages:
            for entry_id, kinds in d(root).items():
                out[entry_id] = out.get(entry_id, frozenset()) | kinds
        return out

    return damage


DAMAGE = {
    "shard-deleted": delete_shard(2),
    "shard-truncated": truncate_shard(3),
    "tensor-k-flipped": flip_tensor(5, "k"),
    "tensor-v-flipped": flip_tensor(13, "v"),
    "tensor-p-flipped": flip_tensor(4, "p"),
    "all-three": combined(delete_shard(2), truncate_shard(3), flip_tensor(5, "k")),
}


# ---- what a query should return: the clean ranking with entries left out ------------------


def expected_answer(clean: list[tuple], damaged: dict[int, frozenset], top_k: int, factor: int, rerank: bool):
    """(results [(entry id, similarity, cosine)], skipped ids) as docs/reliability.md
    describes: rank by signature (ties: lower id), re-rank a shortlist of
    factor * top_k by cosine (reading each candidate's pooled key), read the
    K/V of the top_k; an entry whose read fails is left out and the query
    ranks again without it."""
    skipped: set[int] = set()
    kv_kinds = ALL_KINDS - {"p"}
    while True:
        by_signature = sorted((r for r in clean if r[0] not in skipped), key=lambda r: (-r[1], r[0]))
        if rerank:
            shortlist = by_signature[: top_k * factor]
            bad = {r[0] for r in shortlist if "p" in damaged.get(r[0], ())}
            if bad:
                skipped |= bad
                continue
            top = sorted(shortlist, key=lambda r: (-r[2], r[0]))[:top_k]
        else:
            top = [(r[0], r[1], None) for r in by_signature[:top_k]]
        bad = {r[0] for r in top if damaged.get(r[0], frozenset()) & kv_kinds}
        if not bad:
            return top, skipped
        skipped |= bad


def assert_served_exactly(found, expected, tpl) -> None:
    """The results are the expected ones, scores bit for bit, K/V bit-exact with the clean store's."""
    assert [(r.entry_id, r.similarity, r.cosine) for r in found] == expected
    for r in found:
        keys, values = tpl.kv[r.entry_id]
        assert np.asarray(r.keys).tobytes() == keys.tobytes()
        assert np.asarray(r.values).tobytes() == values.tobytes()
        if not tpl.quantized:  # F32: exactly what was put
            put_keys, put_values, _ = tpl.puts[r.entry_id]
            assert np.asarray(r.keys).tobytes() == put_keys.tobytes()
            assert np.asarray(r.values).tobytes() == put_values.tobytes()


def shard_files_of(store_dir: Path, ids) -> dict[int, str]:
    return {i: shard_path(store_dir, s).name for s, members in SHARD_ENTRIES.items() for i in ids if i in members}


# ---- the library ----------------------------------------------------------------------------


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_skip_serves_the_healthy_entries_and_names_the_damaged(name, quantized, reliability_template, clone_store):
    tpl = reliability_template(quantized)
    root = clone_store(tpl)
    damaged = DAMAGE[name](root)
    layer_of = {i: tpl.puts[i][2] for i in tpl.live}
    with Store.open(root, read_only=True) as store:
        for (q, layer), clean in zip(tpl.queries, tpl.results):
            hit = {i for i in damaged if layer_of[i] == layer}
            # every entry of the layer competes: each damaged one is met, skipped and named
            found = store.query(q, layer, top_k=tpl.top_k, on_damage="skip", count_access=False)
            assert isinstance(found, hmem.QueryResults) and isinstance(found, list)
            expected, _ = expected_answer(clean, damaged, tpl.top_k, 4, True)
            assert_served_exactly(found, expected, tpl)
            assert {s.entry_id for s in found.skipped} == hit and len(found.skipped) == len(hit)
            files = shard_files_of(root, hit)
            for s in found.skipped:
                assert isinstance(s, hmem.SkippedEntry) and tuple(s) == (s.entry_id, s.shard, s.reason)
                assert s.shard == files[s.entry_id]
                assert s.reason and s.shard in s.reason
            # Without "skip" a re-rank takes each candidate's pooled key from
            # pooled.bin, so only the K/V of the answer are read from shards:
            # the query raises when one of them is damaged, and otherwise
            # answers as the clean store does.
            meets = any(damaged.get(r[0], frozenset()) & (ALL_KINDS - {"p"}) for r in clean[: tpl.top_k])
            if meets:
                with pytest.raises(hmem.CorruptStoreError) as info:
                    store.query(q, layer, top_k=tpl.top_k, count_access=False)
                assert info.value.hint
            elif hit:
                assert_served_exactly(store.query(q, layer, top_k=tpl.top_k, count_access=False), list(clean), tpl)
            else:  # a layer with no damage answers exactly as before, in both modes
                assert found.skipped == ()
                assert_served_exactly(found, list(clean), tpl)
                assert_served_exactly(store.query(q, layer, top_k=tpl.top_k, count_access=False), list(clean), tpl)


@pytest.mark.parametrize("rerank", [True, False], ids=["rerank", "signature-only"])
@pytest.mark.parametrize("top_k,factor", [(1, 1), (1, 2), (2, 1), (2, 4), (3, 2)])
@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_the_next_best_takes_a_skipped_entrys_place(name, top_k, factor, rerank, reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    damaged = DAMAGE[name](root)
    with Store.open(root, read_only=True) as store:
        for (q, layer), clean in zip(tpl.queries, tpl.results):
            found = store.query(
                q, layer, top_k=top_k, rerank=rerank, shortlist_factor=factor, on_damage="skip", count_access=False
            )
            expected, skipped = expected_answer(clean, damaged, top_k, factor, rerank)
            assert_served_exactly(found, expected, tpl)
            assert {s.entry_id for s in found.skipped} == skipped
            # up to top_k come back when the layer has that many healthy entries
            healthy = [r for r in clean if not damaged.get(r[0])]
            assert len(found) >= min(top_k, len(healthy))


@pytest.mark.parametrize("verify_reads", [True, False], ids=["verify", "trust"])
@pytest.mark.parametrize("rerank", [True, False], ids=["rerank", "signature-only"])
@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_batch_skips_as_its_queries_would_alone(name, rerank, verify_reads, reliability_template, clone_store):
    # query_many reads a batch's tensors ahead, shard by shard; damage met
    # there must end exactly as it does for a query of its own (and "skip"
    # checks what it returns whatever verify_reads says)
    tpl = reliability_template(False)
    root = clone_store(tpl)
    damaged = DAMAGE[name](root)
    with Store.open(root, read_only=True, verify_reads=verify_reads) as store:
        for layer in sorted({layer for _, layer in tpl.queries}):
            items = [(q, clean) for (q, lay), clean in zip(tpl.queries, tpl.results) if lay == layer]
            batch = store.query_many(
                [q for q, _ in items] * 2, layer, top_k=2, rerank=rerank, on_damage="skip", count_access=False
            )
            for found, (_q, clean) in zip(batch, items * 2):
                expected, skipped = expected_answer(clean, damaged, 2, 4 if rerank else 1, rerank)
                assert_served_exactly(found, expected, tpl)
                assert {s.entry_id for s in found.skipped} == skipped
            # every entry of the layer answers: without "skip", damaged K/V met
            # raises (a damaged pooled key is not read: pooled.bin holds it)
            hit = {i for i in damaged if tpl.puts[i][2] == layer and damaged[i] - {"p"}}
            if hit and len(items) > 1 and verify_reads:
                with pytest.raises(hmem.CorruptStoreError):
                    store.query_many([q for q, _ in items], layer, top_k=len(tpl.live), count_access=False)


def test_a_batch_that_meets_damage_counts_no_access(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(13, "v")(root)
    layer = tpl.puts[13][2]
    others = [i for i in tpl.live if tpl.puts[i][2] == layer and i != 13][:3]
    qs = [tpl.puts[i][0] for i in others] + [tpl.puts[13][0]]  # each finds its own entry first
    with Store.open(root) as store:
        before = [e.access_count for e in store.entries()]
        # alone, the first queries are answered (and counted) ...
        assert [r.entry_id for q in qs[:-1] for r in store.query(q, layer, top_k=1, count_access=False)] == others
        # ... but in a batch with one that meets the damage, nothing is counted
        with pytest.raises(hmem.CorruptStoreError):
            store.query_many(qs, layer, top_k=1)
        assert [e.access_count for e in store.entries()] == before


def test_signature_only_ranking_reads_no_pooled_key(reliability_template, clone_store):
    """A damaged pooled key does not matter without re-ranking: the entry's K/V are sound."""
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(4, "p")(root)
    with Store.open(root, read_only=True) as store:
        q = tpl.puts[4][0]
        found = store.query(q, 0, top_k=1, rerank=False, on_damage="skip")
        assert [r.entry_id for r in found] == [4] and found.skipped == ()
        found = store.query(q, 0, top_k=1, on_damage="skip")
        assert 4 not in [r.entry_id for r in found] and [s.entry_id for s in found.skipped] == [4]
        assert "p_4" in found.skipped[0].reason


def test_skip_checks_every_tensor_it_returns_even_without_verify_reads(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(5, "k")(root)
    q, layer = tpl.puts[5][0], 1
    with Store.open(root, read_only=True, verify_reads=False) as store:
        # verify_reads=False trusts the disk: the flipped key comes back as read ...
        raw = store.query(q, layer, top_k=1, count_access=False)
        assert raw[0].entry_id == 5 and np.asarray(raw[0].keys).tobytes() != tpl.kv[5][0].tobytes()
        # ... which is why "skip" checks every tensor it returns, whatever verify_reads says
        found = store.query(q, layer, top_k=1, on_damage="skip", count_access=False)
        assert [s.entry_id for s in found.skipped] == [5]
        expected, _ = expected_answer(tpl.results[4], {5: frozenset({"k"})}, 1, 4, True)
        assert_served_exactly(found, expected, tpl)


def test_a_layer_with_every_entry_damaged_gives_nothing_and_names_them(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    delete_shard(1)(root)
    delete_shard(2)(root)  # layer 2 holds entries 6 and 9 only
    with Store.open(root, read_only=True) as store:
        found = store.query(tpl.puts[6][0], 2, top_k=5, on_damage="skip")
        assert found == [] and {s.entry_id for s in found.skipped} == {6, 9}


def test_bad_on_damage_is_a_clear_error_and_changes_nothing(reliability_template, clone_store, snapshot_dir):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    before = snapshot_dir(root)  # bytes: a writer's open touches the lock file's mtime
    with Store.open(root) as store:
        counts = [e.access_count for e in store.entries()]
        for bad in ("ignore", "", None, 1, True, "SKIP"):
            with pytest.raises(hmem.InvalidArgumentError, match=r"on_damage must be one of raise, skip, got"):
                store.query(tpl.puts[1][0], 0, on_damage=bad)
        assert [e.access_count for e in store.entries()] == counts  # no access was counted
    assert snapshot_dir(root) == before


def test_counted_accesses_go_to_the_results_only(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    delete_shard(2)(root)
    with Store.open(root) as store:
        before = {e.entry_id: e.access_count for e in store.entries()}
        new_id = store.put(tpl.puts[7][0], tpl.puts[7][1], layer_idx=0)  # in the open shard, in memory
        found = store.query(tpl.puts[7][0], 0, top_k=5, on_damage="skip")
        served = [r.entry_id for r in found]
        assert served[0] == new_id and 7 not in served and [s.entry_id for s in found.skipped] == [7]
        after = {e.entry_id: e.access_count for e in store.entries()}
        for entry_id, count in before.items():
            assert after[entry_id] == count + (entry_id in served)
        assert after[new_id] == 1


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(data=st.data())
def test_random_damage_never_returns_wrong_kv(data, reliability_template):
    """Random shards deleted, cut anywhere, or with bytes flipped anywhere:
    each skip-mode result is the clean one with the skipped entries left out,
    its K/V bit-exact, and every skipped entry lies in a damaged shard."""
    quantized = data.draw(st.booleans(), label="quantized")
    tpl = reliability_template(quantized)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "s"
        shutil.copytree(tpl.path, root)
        touched: set[int] = set()
        for index in data.draw(st.sets(st.sampled_from(sorted(SHARD_ENTRIES)), min_size=1, max_size=3), label="shards"):
            path = shard_path(root, index)
            size = path.stat().st_size
            how = data.draw(st.sampled_from(["delete", "cut", "flip"]), label=f"shard {index}")
            if how == "delete":
                path.unlink()
            elif how == "cut":
                with open(path, "r+b") as f:
                    f.truncate(data.draw(st.integers(0, size - 1), label="cut at"))
            else:
                for offset in data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=4), label="flips"):
                    flip(path, offset, data.draw(st.integers(0, 7), label="bit"))
            touched |= SHARD_ENTRIES[index]
        top_k = data.draw(st.integers(1, 5), label="top_k")
        rerank = data.draw(st.booleans(), label="rerank")
        with Store.open(root, read_only=True, verify_reads=data.draw(st.booleans(), label="verify_reads")) as store:
            for (q, layer), clean in zip(tpl.queries, tpl.results):
                found = store.query(q, layer, top_k=top_k, rerank=rerank, on_damage="skip", count_access=False)
                skipped = {s.entry_id for s in found.skipped}
                assert skipped <= touched
                assert len(skipped) == len(found.skipped)
                healthy = {r[0]: frozenset() for r in clean}
                expected, _ = expected_answer(clean, {**healthy, **dict.fromkeys(skipped, ALL_KINDS)}, top_k, 4, rerank)
                assert_served_exactly(found, expected, tpl)


# ---- stats' health --------------------------------------------------------------------------


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
def test_health_of_a_sound_store(quantized, reliability_template, clone_store):
    root = clone_store(reliability_template(quantized))
    with Store.open(root, read_only=True) as store:
        health = store.stats().health
    assert health == hmem.StoreHealth(
        ok=True,
        problems=(),
        advice="",
        missing_shards=(),
        wrong_size_shards=(),
        unreachable_entries=0,
        entries_file_problem="",
    )


def test_health_names_a_missing_shard_and_counts_what_it_holds(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    delete_shard(1)(root)
    with Store.open(root, read_only=True) as store:
        st_ = store.stats()
    health = st_.health
    assert not health.ok and health.missing_shards == ("shard_0001.safetensors",)
    assert health.wrong_size_shards == () and health.unreachable_entries == 3
    assert health.problems == ("shard shard_0001.safetensors is missing (3 live entries)",)
    assert health.advice == hmem.Hint.VERIFY_THEN_REPAIR
    assert st_.entries == len(tpl.live)  # live counts stay those of the index


def test_health_names_a_cut_shard(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    size = shard_path(root, 3).stat().st_size
    truncate_shard(3, cut=8)(root)
    with Store.open(root, read_only=True) as store:
        health = store.stats().health
    assert not health.ok and health.wrong_size_shards == ("shard_0003.safetensors",)
    assert health.missing_shards == () and health.unreachable_entries == 2
    assert health.problems == (
        f"shard shard_0003.safetensors is {size - 8} bytes, the store expects {size} (2 live entries)",
    )


def test_health_counts_only_live_entries_and_reads_no_tensor(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    flip_tensor(5, "k")(root)  # a flipped bit inside a file: only verify(full=True) reads tensors
    delete_shard(2)(root)  # 7 and 9 live; 8 (evicted) was in it too
    with Store.open(root, read_only=True) as store:
        health = store.stats().health
    assert health.missing_shards == ("shard_0002.safetensors",) and health.unreachable_entries == 2
    assert len(health.problems) == 1


def test_health_sees_entries_bin_lost_after_open(reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    with Store.open(root, read_only=True) as store:
        with open(root / "entries.bin", "r+b") as f:
            f.truncate(100)
        health = store.stats().health
        assert not health.ok and health.problems == (health.entries_file_problem,)
        assert health.entries_file_problem.startswith("entries.bin is 100 bytes, shorter than its 14 committed")
        (root / "entries.bin").unlink()
        assert store.stats().health.entries_file_problem == "entries.bin is missing"


# ---- the command line -------------------------------------------------------------------------


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=CLI_ENV)


@pytest.fixture
def damaged_copy(reliability_template, clone_store, tmp_path):
    """A copy of the F32 template with shard 2 (entries 7 and 9) deleted, and query files."""
    tpl = reliability_template(False)
    root = clone_store(tpl)
    delete_shard(2)(root)
    for entry_id in (1, 6):
        np.save(tmp_path / f"q{entry_id}.npy", tpl.puts[entry_id][0])
    return tpl, root


def test_cli_skip_damaged_exits_0_and_lists_the_skipped(damaged_copy, tmp_path):
    tpl, root = damaged_copy
    args = [root, "--query", tmp_path / "q1.npy", "--layer", 0, "--top-k", 5]
    refused = cli("query", *args)
    assert refused.exit_code == 1 and "shard_0002.safetensors is missing" in refused.stderr
    result = cli("query", *args, "--skip-damaged")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines() == [
        "warning: skipped damaged entry 7 (shard_0002.safetensors): shard shard_0002.safetensors is missing"
    ]
    assert "4 result(s) from layer 0, ranked by cosine of pooled keys, in" in result.stdout
    assert f"; 1 damaged entry skipped ({ADVICE})" in result.stdout
    with Store.open(root, read_only=True) as store:
        library = store.query(tpl.puts[1][0], 0, top_k=5, on_damage="skip")
    doc = json.loads(cli("query", *args, "--skip-damaged", "--json").stdout)
    assert [r["entry_id"] for r in doc["results"]] == [r.entry_id for r in library] == [1, 13, 4, 10]
    assert doc["skipped"] == [
        {"entry_id": 7, "shard": "shard_0002.safetensors", "reason": "shard shard_0002.safetensors is missing"}
    ]
    quiet = cli("query", *args, "--skip-damaged", "--quiet")
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == ""
    clean = cli("query", root, "--query", tmp_path / "q1.npy", "--layer", 1, "--skip-damaged", "--json")
    assert clean.exit_code == 0 and clean.stderr == "" and json.loads(clean.stdout)["skipped"] == []


def test_cli_skip_damaged_with_nothing_left_is_an_error(damaged_copy, tmp_path):
    tpl, root = damaged_copy
    delete_shard(1)(root)  # layer 2 (entries 6 and 9) is gone entirely
    result = cli("query", root, "--query", tmp_path / "q6.npy", "--layer", 2, "--skip-damaged")
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert sorted(lines[:2]) == [
        "warning: skipped damaged entry 6 (shard_0001.safetensors): shard shard_0001.safetensors is missing",
        "warning: skipped damaged entry 9 (shard_0002.safetensors): shard shard_0002.safetensors is missing",
    ]
    assert lines[2:] == [f"error: no readable entry in layer 2: 2 damaged entries skipped ({ADVICE})"]


def test_cli_stats_health_line(reliability_template, clone_store):
    tpl = reliability_template(False)
    sound = clone_store(tpl, "sound")
    result = cli("stats", sound)
    assert result.exit_code == 0 and "\nhealth: ok\n" in result.stdout
    doc = json.loads(cli("stats", sound, "--json").stdout)
    assert doc["health"] == {
        "ok": True,
        "problems": [],
        "advice": "",
        "missing_shards": [],
        "wrong_size_shards": [],
        "unreachable_entries": 0,
        "entries_file_problem": "",
        "stale_index": "",
    }

    root = clone_store(tpl, "damaged")
    delete_shard(2)(root)
    truncate_shard(3)(root)
    flip_tensor(5, "k")(root)  # not seen by the cheap check
    result = cli("stats", root)
    assert result.exit_code == 0, result.stderr
    line = (
        "health: 1 shard missing (shard_0002.safetensors), 1 shard of the wrong size (shard_0003.safetensors), "
        f"4 of 11 live entries unreachable; {ADVICE}"
    )
    assert line in result.stdout.splitlines()
    assert "shard_0002.safetensors (missing)" in result.stdout
    assert "shard_0003.safetensors (wrong size)" in result.stdout
    assert "11 live, 3 evicted" in result.stdout  # the index's count, unchanged
    doc = json.loads(cli("stats", root, "--json").stdout)
    health = doc["health"]  # the library's StoreHealth, its advice an hmem.Hint like every library hint
    assert health["ok"] is False and health["unreachable_entries"] == 4
    assert health["advice"] == hmem.Hint.VERIFY_THEN_REPAIR
    assert health["missing_shards"] == ["shard_0002.safetensors"]
    assert health["wrong_size_shards"] == ["shard_0003.safetensors"]
    assert len(health["problems"]) == 2 and doc["entries"] == 11


@pytest.mark.parametrize("name", ["shard-deleted", "shard-truncated", "tensor-k-flipped"])
def test_cli_stats_health_per_damage(name, reliability_template, clone_store):
    tpl = reliability_template(False)
    root = clone_store(tpl)
    DAMAGE[name](root)
    with Store.open(root, read_only=True) as store:
        library = store.stats().health
    doc = json.loads(cli("stats", root, "--json").stdout)["health"]
    assert doc["ok"] == library.ok == (name == "tensor-k-flipped")
    assert doc["problems"] == list(library.problems)
    assert doc["unreachable_entries"] == library.unreachable_entries
    expected = {
        "shard-deleted": "health: 1 shard missing (shard_0002.safetensors), 2 of 11 live entries "
        f"unreachable; {ADVICE}",
        "shard-truncated": "health: 1 shard of the wrong size (shard_0003.safetensors), 2 of 11 live "
        f"entries unreachable; {ADVICE}",
        "tensor-k-flipped": "health: ok",
    }[name]
    assert expected in cli("stats", root).stdout.splitlines()
