"""A writer that vanishes without flushing, on every backend: the next
writer opens at once (the dead writer's lock goes with it; its lease runs
out), holds exactly what the last acknowledged flush committed, and the
store verifies clean once that writer has tidied what the dead one left.

In a directory and on S3 the writer is a process of its own, SIGKILLed
while it puts or stopped in the middle of a flush's commit and killed
there; memory:// objects live in this process, so there the writer is
dropped in-process (``store_internals.abandon_writer``), as it is on every
backend in the first test.
"""

from __future__ import annotations

import pytest

import hmem
from hmem import Store

FLUSHED = range(10)  # the seeds the dead writer flushed
# where a flush is stopped and killed: its records written but index.json
# not yet replaced (a directory), its objects uploaded but manifest.json
# not yet replaced (object storage)
MID_COMMIT = {"directory": "flush.records_written", "s3": "remote.objects_written"}

WRITER = """
import os, sys
import hmem

store = hmem.Store.open({url!r})
store.put_many([(*kv(seed), 0, 1.0) for seed in range(10)])
store.flush()
print("flushed", flush=True)
if {mode!r} == "mid-put":
    for seed in range(10, 210):  # puts until killed: the kill lands in a put (or between two)
        store.put(*kv(seed))
        print("put", seed, flush=True)
else:
    store.put_many([(*kv(seed), 0, 1.0) for seed in range(10, 30)])
    os.environ["HMEM_PAUSE_AT"] = {point!r}  # this flush stops itself there (hmem/_io.py, crash_point)
    print("flushing", flush=True)
    store.flush()
    print("flush returned", flush=True)
sys.stdin.readline()
"""


def _check_recovered(location, data, flushed: dict[int, int]) -> None:
    with Store.open(location.url, lock_wait=0) as store:  # at once: no lock or lease left held
        data.check_kv(store, flushed)
        assert store.stats().unflushed == 0
        report = hmem.verify(location.url)
        # what a commit that never happened uploaded is named by no commit:
        # reported, and removed by the next compaction (docs/format.md, "The commit")
        assert {f.code for f in report.problems} <= {"remote.orphan"}, report.problems
        if report.problems:
            assert location.on_object_storage
            store.compact()
        more = data.fill(store, range(500, 505))
    report = hmem.verify(location.url, full=True)
    assert report.ok, report.findings
    with Store.open(location.url, read_only=True) as reader:
        data.check_kv(reader, {**flushed, **more})


def test_a_writer_dropped_unflushed_loses_only_what_it_never_flushed(location, data, store_internals):
    store = Store.create(location.url, **data.config)
    flushed = data.fill(store, FLUSHED)
    store.flush()
    data.fill(store, range(10, 30))  # several shards' worth, sealed as they fill: never committed
    store_internals.abandon_writer(store)
    location.expire_lease()
    del store
    _check_recovered(location, data, flushed)


@pytest.mark.stress
@pytest.mark.parametrize("mode", ["mid-put", "mid-commit"])
def test_a_killed_writer_process_loses_only_what_it_never_flushed(location, data, child, mode):
    if not location.can_cross_processes:
        pytest.skip("memory:// objects live in one process: no other process can write them")
    Store.create(location.url, **data.config).close()
    writer = child(WRITER.format(url=location.url, mode=mode, point=MID_COMMIT[location.kind]))
    writer.expect("flushed")
    if mode == "mid-put":
        for _ in range(15):  # fifteen puts acknowledged, then killed in (or between) the next ones
            assert writer.line().startswith("put ")
    else:
        writer.expect("flushing")
        writer.wait_stopped()  # stopped inside the flush's commit
    writer.kill()
    location.expire_lease()
    with Store.open(location.url, read_only=True) as reader:
        ids = reader.entry_ids()
    assert len(ids) == len(FLUSHED)
    _check_recovered(location, data, dict(zip(ids, FLUSHED)))
