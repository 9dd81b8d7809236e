"""How a tier takes a put's bytes (hmem/lmcache/tier.py, ChunkTier.stage):
copied, or kept by reference until committed and then released, exactly
once, on every path.  Without LMCache (tests/lmcache drives the plugin with
LMCache's own memory objects)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from hmem import Store
from hmem.errors import InvalidArgumentError
from hmem.lmcache import ChunkTier, TierSettings

SHAPE = (2, 3, 16, 32)  # [2, layers, tokens, hidden]
LONG = 3600.0  # no commit happens by itself: only commit() commits


def words(seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


class Releases:
    """Counts the calls of each key's release."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def of(self, key: str):
        def release() -> None:
            with self.lock:
                self.calls[key] = self.calls.get(key, 0) + 1

        return release


@pytest.fixture
def tier(tmp_path: Path):
    made = ChunkTier(
        str(tmp_path / "tier"),
        embed_dim=SHAPE[-1],
        settings=TierSettings(commit_seconds=LONG, commit_bytes=1 << 40, hdc_dim=256),
    )
    yield made
    made.close()


def stored(tier: ChunkTier, key: str) -> np.ndarray:
    out = np.zeros(SHAPE, dtype=np.uint16)
    read = tier.fetch(key)
    assert read is not None and read.shape == SHAPE
    read.copy_into(out)
    return out


def test_a_kept_chunk_is_released_once_when_committed(tier: ChunkTier) -> None:
    releases, data = Releases(), words(1)
    assert tier.stage("a", data, "KV_2LTD", SHAPE, release=releases.of("a"))
    assert releases.calls == {}  # held until committed: the caller must not reuse it
    assert np.array_equal(stored(tier, "a"), data)  # read from the caller's buffer meanwhile
    tier.commit()
    assert releases.calls == {"a": 1}
    data[...] = 0  # the caller's again: the store keeps its own bytes
    assert np.array_equal(stored(tier, "a"), words(1))
    with Store.open(tier.location, read_only=True) as store:
        assert store.chunks.keys() == ["a"]


def test_a_put_of_a_held_key_is_released_at_once(tier: ChunkTier) -> None:
    releases = Releases()
    assert tier.stage("a", words(1), "KV_2LTD", SHAPE, release=releases.of("a"))
    assert not tier.stage("a", words(2), "KV_2LTD", SHAPE, release=releases.of("a-again"))
    assert releases.calls == {"a-again": 1}  # staged already: nothing kept of the second
    tier.commit()
    assert not tier.stage("a", words(3), "KV_2LTD", SHAPE, release=releases.of("a-committed"))
    assert releases.calls == {"a-again": 1, "a": 1, "a-committed": 1}
    assert np.array_equal(stored(tier, "a"), words(1))


def test_a_refused_put_is_released_and_stores_nothing(tier: ChunkTier) -> None:
    releases = Releases()
    with pytest.raises(InvalidArgumentError, match="cannot have shape"):
        tier.stage("bad-shape", words(1), "KV_2LTD", (3, *SHAPE[1:]), release=releases.of("bad-shape"))
    with pytest.raises(InvalidArgumentError, match="values for shape"):
        tier.stage("short", words(1)[:1], "KV_2LTD", SHAPE, release=releases.of("short"))
    with pytest.raises(InvalidArgumentError, match="layout"):
        tier.stage("layout", words(1), "KV_NOPE", SHAPE, release=releases.of("layout"))
    assert releases.calls == {"bad-shape": 1, "short": 1, "layout": 1}
    tier.commit()
    assert tier.keys() == [] and tier.stats().staged_chunks == 0


def test_a_chunk_read_while_staged_is_released_after_the_read(tier: ChunkTier) -> None:
    releases, data = Releases(), words(1)
    tier.stage("a", data, "KV_2LTD", SHAPE, release=releases.of("a"))
    read = tier.fetch("a")  # from the caller's buffer: it stays held until this read is done
    assert read is not None
    tier.commit()
    assert releases.calls == {}
    out = np.zeros(SHAPE, dtype=np.uint16)
    read.copy_into(out)
    assert releases.calls == {"a": 1} and np.array_equal(out, words(1))


def test_a_removed_chunk_is_released(tier: ChunkTier) -> None:
    releases = Releases()
    tier.stage("a", words(1), "KV_2LTD", SHAPE, release=releases.of("a"))
    assert tier.remove("a")
    assert releases.calls == {"a": 1}
    tier.commit()
    assert tier.keys() == []


def test_a_copied_chunk_does_not_depend_on_the_callers_buffer(tier: ChunkTier) -> None:
    data = words(1)
    assert tier.stage("a", data, "KV_2LTD", SHAPE)
    data[...] = 0  # reused at once, as a copy allows
    assert np.array_equal(stored(tier, "a"), words(1))
    tier.commit()
    assert np.array_equal(stored(tier, "a"), words(1))


def test_close_commits_what_is_staged_and_releases_it(tmp_path: Path) -> None:
    releases = Releases()
    path = tmp_path / "tier"
    tier = ChunkTier(str(path), embed_dim=SHAPE[-1], settings=TierSettings(commit_seconds=LONG, hdc_dim=256))
    tier.stage("a", words(1), "KV_2LTD", SHAPE, release=releases.of("a"))
    tier.close()  # commits what is staged, then releases it
    assert releases.calls == {"a": 1}
    with Store.open(str(path), read_only=True) as store:
        assert store.chunks.keys() == ["a"]
