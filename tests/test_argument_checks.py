"""Every caller-given argument is checked through hmem/validation.py.

A bad argument raises InvalidArgumentError naming the argument, before
anything is done: the store's files, its entries and its objects stay as
they were.  A value of the right type but outside the range is refused as
surely as one of the wrong type (``import_files(layer=2.7)`` once reported
every file skipped instead).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import hmem
from hmem import InvalidArgumentError

EMBED_DIM = 8


def _kv(tokens: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((tokens, EMBED_DIM), dtype=np.float32),
        rng.standard_normal((tokens, EMBED_DIM), dtype=np.float32),
    )


@pytest.fixture
def store(store_factory):
    """A small store holding two flushed entries."""
    s = store_factory(embed_dim=EMBED_DIM)
    s.put(*_kv(seed=1), layer_idx=0)
    s.put(*_kv(seed=2), layer_idx=1)
    s.flush()
    return s


def _unchanged(store, snapshot_dir, call) -> InvalidArgumentError:
    """Run `call`, which must raise InvalidArgumentError, and check that the
    store's files and entries are as before; returns the error."""
    files, entries = snapshot_dir(store.path), store.entry_ids()
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert snapshot_dir(store.path) == files
    assert store.entry_ids() == entries
    return info.value


# ---- import_files ----------------------------------------------------------------


@pytest.mark.parametrize("layer", [2.7, -1, 2**32, True, "1", np.float64(1.0)])
def test_import_files_refuses_a_bad_layer(store, snapshot_dir, tmp_path, layer):
    path = tmp_path / "kv.safetensors"
    keys, values = _kv(seed=3)
    hmem.write_kv_file(path, {"keys": keys, "values": values})
    error = _unchanged(store, snapshot_dir, lambda: hmem.import_files(store, [path], layer=layer))
    assert str(error).startswith("layer must be")
    store.flush()
    assert len(store.entry_ids()) == 2


def test_import_files_takes_a_whole_layer(store, tmp_path):
    """The check refuses what is not a layer, not the layers themselves."""
    path = tmp_path / "kv.safetensors"
    keys, values = _kv(seed=3)
    hmem.write_kv_file(path, {"keys": keys, "values": values})
    report = hmem.import_files(store, [path], layer=np.uint32(5))
    assert report.entries_added == 1 and not report.skipped
    assert len(store.entry_ids(5)) == 1


@pytest.mark.parametrize(
    ("options", "name"),
    [
        (dict(importance=-1.0), "importance"),
        (dict(importance=math.nan), "importance"),
        (dict(layout="xyz"), "layout"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(chunk_tokens=1.5), "chunk_tokens"),
        (dict(dry_run="yes"), "dry_run"),
        (dict(again=1), "again"),
    ],
)
def test_import_files_refuses_other_bad_options(store, snapshot_dir, tmp_path, options, name):
    path = tmp_path / "kv.safetensors"
    hmem.write_kv_file(path, dict(zip(("keys", "values"), _kv(seed=3))))
    error = _unchanged(store, snapshot_dir, lambda: hmem.import_files(store, [path], **options))
    assert str(error).startswith(f"{name} must be")


# ---- the store's own calls -----------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda s: s.put(*_kv(), layer_idx=2.5), "layer_idx"),
        (lambda s: s.put(*_kv(), importance=-1.0), "importance"),
        (lambda s: s.query(_kv()[0], layer_idx=0, top_k=0), "top_k"),
        (lambda s: s.query(_kv()[0], layer_idx=0, rerank="no"), "rerank"),
        (lambda s: s.query_many([_kv()[0]], layer_idx=0, count_access=None), "count_access"),
        (lambda s: s.evict(-1), "target_entries"),
        (lambda s: s.evict(1.5), "target_entries"),
        (lambda s: s.entries(sort="name"), "sort"),
        (lambda s: s.entries(limit=-1), "limit"),
        (lambda s: s.delete([1], missing_ok="no"), "missing_ok"),
        (lambda s: s.compact(min_reclaim_share=1.5), "min_reclaim_share"),
        (lambda s: s.plan_compaction(min_dead_share=-0.1), "min_dead_share"),
        (lambda s: s.plan_compaction(repack=1), "repack"),
    ],
)
def test_store_calls_refuse_bad_arguments(store, snapshot_dir, call, name):
    error = _unchanged(store, snapshot_dir, lambda: call(store))
    assert name in str(error)


@pytest.mark.parametrize("lock_wait", [-1, "1", math.nan])
def test_copy_store_refuses_a_bad_lock_wait(store, snapshot_dir, tmp_path, lock_wait):
    destination = tmp_path / "copy"
    error = _unchanged(store, snapshot_dir, lambda: hmem.copy_store(store.path, destination, lock_wait=lock_wait))
    assert str(error).startswith("lock_wait must be")
    assert not destination.exists()


# ---- the prefix-hit operators ------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hmem.Bitmap(-1), "length must be >= 0"),
        (lambda: hmem.Bitmap(True), "length must be an integer"),
        (lambda: hmem.Bitmap.prefix(8, 9), "count must be between 0 and 8"),
        (lambda: hmem.Bitmap.from_bytes(b"\x00", -8), "nbits must be >= 0"),
        (lambda: hmem.merge_bitmaps([], -1), "nbits must be >= 0"),
        (lambda: hmem.select_retained(hmem.Bitmap(4), 4, policy="middle"), "policy must be one of prefix, keep-all"),
        (lambda: hmem.fold(hmem.Bitmap(4), 4, 1, [0], layout="diagonal"), "layout must be one of"),
        (lambda: hmem.fold(hmem.Bitmap(4), 4, 0, [0]), "num_ranks must be >= 1"),
        (lambda: hmem.unfold(-1, 4, 1, [0]), "hit must be >= 0"),
        (lambda: hmem.unfold(2.0, 4, 1, [0]), "hit must be an integer"),
        (lambda: hmem.presence_map([[hmem.Bitmap(4)]], -1), "num_chunks must be >= 0"),
        (lambda: hmem.unfold_grouped(1, -4, [0]), "num_chunks must be >= 0"),
    ],
)
def test_prefix_hit_operators_refuse_bad_arguments(call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call()


def test_trim_policy_and_layout_take_their_enums_and_names():
    found = hmem.Bitmap.from_indices([0, 1, 3], 4)
    assert hmem.select_retained(found, 4, policy="keep-all") == found
    assert hmem.select_retained(found, 4, policy=hmem.TrimPolicy.PREFIX) == hmem.Bitmap.prefix(4, 2)
    for layout in ("chunk-major", hmem.Layout.CHUNK_MAJOR):
        assert hmem.fold(found, 4, 1, [0], layout=layout) == hmem.fold(found, 4, 1, [0])


# ---- storage options of a store on object storage ----------------------------------------


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": "5"}, "timeout"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": 86401}, "timeout"),
        ({"connect_timeout": -1}, "connect_timeout"),
        ({"max_retries": 21}, "max_retries"),
        ({"max_retries": True}, "max_retries"),
        ({"cache_bytes": 0}, "cache_bytes"),
        ({"lease_seconds": math.inf}, "lease_seconds"),
        ({"coalesce_bytes": -1}, "coalesce_bytes"),
        ({"coalesce_bytes": 1.5}, "coalesce_bytes"),
        ({"retire_seconds": "abc"}, "retire_seconds"),
        ({"retire_seconds": -1}, "retire_seconds"),
        ({"retire_seconds": True}, "retire_seconds"),
    ],
)
def test_storage_options_are_checked_before_any_request(s3_env, s3_url, options, name):
    hmem.Store.create(s3_url, embed_dim=EMBED_DIM).close()
    prefix = s3_url.split("/", 3)[3]  # s3://bucket/prefix
    before = s3_env.objects(prefix)
    for read_only in (True, False):
        with pytest.raises(InvalidArgumentError) as info:
            hmem.Store.open(s3_url, read_only=read_only, storage_options=options)
        assert str(info.value).startswith(f"storage option {name} must be")
    assert s3_env.objects(prefix) == before


@pytest.mark.parametrize(
    ("options", "name"), [(dict(read_only="no"), "read_only"), (dict(verify_reads=1.0), "verify_reads")]
)
def test_open_refuses_flags_that_are_not_booleans(store, snapshot_dir, options, name):
    """read_only="no" once opened a reader (a truthy string)."""
    path = store.path
    store.close()
    files = snapshot_dir(path)
    with pytest.raises(InvalidArgumentError, match=f"^{name} must be"):
        hmem.Store.open(path, **options)
    assert snapshot_dir(path) == files


@pytest.mark.parametrize(
    ("options", "name"),
    [
        (dict(max_seconds="soon"), "max_seconds"),
        (dict(max_seconds=-1), "max_seconds"),
        (dict(subset=(3, 2)), "subset k"),
        (dict(subset=(1.5, 2)), "subset k"),
        (dict(subset=(1, 0)), "subset n"),
    ],
)
def test_verify_refuses_a_bad_bound(store, snapshot_dir, options, name):
    path = store.path
    store.close()
    files = snapshot_dir(path)
    with pytest.raises(InvalidArgumentError, match=f"^{name} must be"):
        hmem.verify(path, full=True, **options)
    assert snapshot_dir(path) == files
