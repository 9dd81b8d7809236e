"""verify beside a writer at work (several processes share a store, each
holding its lock for a commit: docs/format.md, "Several writers"): the
files a live writer is making are reported as such, not as what an
interrupted writer left, and a dead writer's are warnings again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

import hmem

HOLD = textwrap.dedent(
    """
    import sys, hmem
    store = hmem.Store.open(sys.argv[1])   # the writer's lock, held until stdin closes
    print("locked", flush=True)
    sys.stdin.read()
    store.close()
    """
)


def test_a_live_writers_files_are_work_in_progress(tmp_path):
    path = tmp_path / "store"
    with hmem.Store.create(path, embed_dim=8, hdc_dim=64) as store:
        store.put(np.ones((3, 8), np.float32), np.ones((3, 8), np.float32))
    leftover = path / ".hmem-tmp.shard_0009.safetensors"
    leftover.write_bytes(b"\0" * 64)
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,  # not the checkout: the installed hmem, as every test
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "locked"
        # the writer's open removed the leftover as any writer's does; one of its own comes in its place
        leftover.write_bytes(b"\0" * 64)
        report = hmem.verify(path)
        assert report.ok, report.findings
        (finding,) = [f for f in report.findings if f.file == leftover.name]
        assert finding.code == "file.at_work" and finding.severity == "info"
        assert str(writer.pid) in finding.message
    finally:
        writer.kill()
        writer.wait()
    report = hmem.verify(path)  # the writer is gone: its file is an interrupted writer's
    assert [(f.code, f.severity) for f in report.problems] == [("file.temp", "warning")]
