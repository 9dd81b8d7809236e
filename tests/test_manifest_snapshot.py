"""index.json's decoded form (hmem/formats/manifest.py) is an immutable
snapshot: a Manifest, its Pending steps and its ShardInfos are frozen, their
lists are tuples and their update rows read-only, so the commit a store
holds in memory (StoreState.committed) is replaced whole, never changed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hmem import Store
from hmem.formats import manifest, store_files
from hmem.formats.manifest import Pending

EMBED, HDC = 16, 256


def _store_with_pending_updates(path):
    """A store whose index.json lists shards and pending record updates
    (access counts a query changed, committed by the last flush)."""
    rng = np.random.default_rng(5)
    keys = [rng.standard_normal((2, EMBED)).astype(np.float32) for _ in range(3)]
    with Store.create(path, embed_dim=EMBED, hdc_dim=HDC) as store:
        for k in keys:
            store.put(k, k)
        store.flush()
        store.query(keys[1], 0, 1)
        store.flush()  # commits the new count as a pending update, then writes it in place
        return manifest.load(path)


def test_a_loaded_manifest_cannot_be_changed_in_place(tmp_path):
    mf = _store_with_pending_updates(tmp_path / "s")
    assert mf.shards and len(mf.pending.record_updates)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mf.generation += 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        mf.pending = Pending()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        mf.pending.deletes = ("x",)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        mf.shards[0].dead_entries = 1  # type: ignore[misc]
    # the lists are tuples: nothing to append to
    assert isinstance(mf.shards, tuple)
    assert isinstance(mf.pending.renames, tuple) and isinstance(mf.pending.deletes, tuple)
    with pytest.raises(ValueError, match="read-only"):
        mf.pending.record_updates["access_count"] = 0
    # a change is a new snapshot; the old one stays as it was
    done = dataclasses.replace(mf, pending=Pending())
    assert not done.pending and mf.pending and done.shards is mf.shards


def test_lists_given_are_kept_as_tuples(tmp_path):
    mf = _store_with_pending_updates(tmp_path / "s")
    again = dataclasses.replace(mf, shards=list(mf.shards))
    assert again.shards == mf.shards and isinstance(again.shards, tuple)
    temp = store_files.REWRITE_PREFIX + "shard_0000.safetensors"
    pending = Pending(renames=[(temp, "shard_0000.safetensors")], deletes=["shard_0001.safetensors"])
    assert pending.renames == ((temp, "shard_0000.safetensors"),)
    assert pending.deletes == ("shard_0001.safetensors",)
    assert not pending.record_updates.flags.writeable


def test_writing_a_manifest_leaves_it_unchanged(tmp_path):
    mf = _store_with_pending_updates(tmp_path / "s")
    before = (mf.committed, mf.written_by)
    root = tmp_path / "copy"
    root.mkdir()
    kept, data = manifest.write(root, dataclasses.replace(mf, committed="2000-01-01T00:00:00Z"))
    written = manifest.parse(root, data)
    assert written.committed != "2000-01-01T00:00:00Z"  # the time of this commit, in the copy written
    assert (mf.committed, mf.written_by) == before
    assert (written.generation, written.shards) == (mf.generation, mf.shards)
    # the snapshot a writer keeps of what it committed: what the bytes hold
    assert (kept.committed, kept.written_by) == (written.committed, written.written_by)
    assert kept.shards is mf.shards and kept.pending is mf.pending
