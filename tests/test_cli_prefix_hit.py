"""`hmem prefix-hit`: human and JSON output, and every error path."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from hmem import Bitmap, Layout, group_rows, presence_map
from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode
from hmem.cli.ranges import format_chunks, parse_chunks
from hmem.errors import InvalidArgumentError

ANSI = re.compile(r"\x1b\[")


def run(*args: str, input: bytes | None = None):
    return CliRunner().invoke(app, ["prefix-hit", *args], input=input)


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---- the readable chunk syntax --------------------------------------------------


def test_parse_chunks_forms():
    assert parse_chunks("0-2,5", 8).indices().tolist() == [0, 1, 2, 5]
    assert parse_chunks(" 6- ", 8).indices().tolist() == [6, 7]
    assert parse_chunks("all", 3) == Bitmap.ones(3)
    assert parse_chunks("none", 3) == Bitmap(3)
    assert parse_chunks("", 3) == Bitmap(3)
    assert format_chunks(parse_chunks("0-11,14", 16)) == "0-11,14"
    assert format_chunks(Bitmap(4)) == "none"


@pytest.mark.parametrize("spec", ["x", "1-x", "3-1", "0,,1", "9", "-1"])
def test_parse_chunks_rejects(spec):
    with pytest.raises(InvalidArgumentError):
        parse_chunks(spec, 8)


# ---- results ---------------------------------------------------------------


def test_human_output_names_hit_and_limiting_group():
    result = run("-c", "5", "-w", "-1,2", "-g", "0-3", "-g", "2-4", "--chunk-size", "16")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "hit: 4 of 5 chunks (64 of 80 tokens)" in out
    assert "servable prefix lengths: 4" in out
    assert "limited by: group 0 (full attention)" in out
    # the picture: group 0 keeps 0-3 and lacks 4; group 1 keeps 2-3, holds 4
    assert "g0  ####." in out
    assert "g1  ..##+" in out
    assert not ANSI.search(out)


def test_json_document_matches_library():
    doc = run_json("-c", "5", "-r", "2", "-w", "-1,2", "-g", "0-3", "-g", "2-4")
    assert doc["hit"] == 4
    assert doc["hit_tokens"] is None
    assert doc["windows"] == [-1, 2]
    assert doc["servable_lengths"] == [[4, 5]]  # half-open: length 4 only
    assert doc["limiting_groups"] == [0]
    g0, g1 = doc["groups"]
    assert (g0["first_missing"], g0["own_hit"], g0["needed"], g0["limits_hit"]) == (4, 4, [0, 4], True)
    assert (g1["first_missing"], g1["own_hit"], g1["needed"], g1["limits_hit"]) == (0, 5, [2, 4], False)
    assert g1["present_chunks"] == [[2, 5]]
    # unfold(4, C=5, R=2, W=[-1,2]) group-major keeps {0..7, 14..17}
    mask = Bitmap.from_bytes(bytes.fromhex(doc["retain_mask_hex"]), doc["retain_bits"])
    assert mask.indices().tolist() == [*range(8), *range(14, 18)]
    assert doc["retained"] == 12


def test_per_rank_groups_stop_at_missing_rank():
    # C=3, R=2: chunk 1 lacks rank 1, so the prefix stops at 1
    doc = run_json("-c", "3", "-r", "2", "-w", "-1", "-g", "all;0,2")
    assert doc["hit"] == 1
    assert doc["groups"][0]["first_missing"] == 1


def test_gappy_window_reports_highest_servable_length():
    doc = run_json("-c", "5", "-w", "2", "-g", "0,1,3,4")
    assert doc["servable_lengths"] == [[1, 3], [5, 6]]
    assert doc["hit"] == 5


@pytest.mark.parametrize("layout", ["group-major", "chunk-major"])
def test_raw_hex_in_either_layout(layout):
    rows = [[parse_chunks("0-3", 5)] * 2, [parse_chunks("2-4", 5)] * 2]
    found = presence_map(rows, 5, Layout(layout))
    doc = run_json("-c", "5", "-r", "2", "-w", "-1,2", "--hex", found.to_bytes().hex(), "--layout", layout)
    assert doc["hit"] == 4
    assert doc["layout"] == layout
    expected = {"group-major": [*range(8), *range(14, 18)], "chunk-major": [0, 1, 4, 5, *range(8, 16)]}
    mask = Bitmap.from_bytes(bytes.fromhex(doc["retain_mask_hex"]), doc["retain_bits"])
    assert mask.indices().tolist() == expected[layout]


def test_bitmap_file_and_stdin(tmp_path):
    found = presence_map([[parse_chunks("0-2", 4)]], 4)
    path = tmp_path / "presence.bin"
    path.write_bytes(found.to_bytes())
    assert run_json("-c", "4", "-w", "-1", "--bitmap-file", str(path))["hit"] == 3
    result = run("-c", "4", "-w", "-1", "--bitmap-file", "-", "--json", input=found.to_bytes())
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["hit"] == 3


def test_zero_chunks():
    doc = run_json("-c", "0", "-w", "-1", "--hex", "")
    assert doc["hit"] == 0 and doc["retain_bits"] == 0


def test_picture_switch():
    args = ("-c", "4", "-w", "-1", "-g", "0-2")
    assert "# kept" in run(*args).stdout
    assert "# kept" not in run(*args, "--no-picture").stdout


# ---- presence as rows: --row and --rows-file -----------------------------------------

# The docs/cli.md example as rows: 3 groups (full, window 4, mamba) x 2 ranks, C = 16.
ROW_SPECS = ["0-11,14", "0-11,14", "0-15", "0-9,12-15", "6-9", "6-9"]
ROW_ARGS = ("-c", "16", "-r", "2", "-w", "-1,4,1")


def test_rows_give_the_same_hit_as_the_flat_map():
    flat = run_json(*ROW_ARGS, "-g", "0-11,14", "-g", "0-15;0-9,12-15", "-g", "6-9")
    rows = run_json(*ROW_ARGS, *[arg for spec in ROW_SPECS for arg in ("--row", spec)])
    assert rows["form"] == "rows" and flat["form"] == "flat"
    assert rows["hit"] == flat["hit"] == 10
    assert rows["servable_lengths"] == flat["servable_lengths"] == [[7, 11]]
    assert rows["windows"] == [-1, 4, 1] and rows["num_ranks"] == 2
    # the retain rows are the flat mask split back, group by group
    mask = Bitmap.from_bytes(bytes.fromhex(flat["retain_mask_hex"]), flat["retain_bits"])
    split = [row for group in group_rows(mask, 16, 2, [-1, 4, 1]) for row in group]
    assert [Bitmap.from_bytes(bytes.fromhex(h), 16) for h in rows["retain_rows_hex"]] == split
    assert rows["retained"] == flat["retained"] == 30
    # group 1 rank 1 misses chunks 10-11, the mamba group holds only 6-9
    assert rows["limiting_rows"] == [3, 4, 5]
    r3 = rows["rows"][3]
    assert (r3["row"], r3["group"], r3["rank"], r3["window"], r3["first_missing"]) == (3, 1, 1, 4, 10)
    assert (r3["own_hit"], r3["needed"], r3["limits_hit"]) == (16, [6, 10], True)
    assert [r["group"] for r in rows["rows"]] == [0, 0, 1, 1, 2, 2]
    assert [r["rank"] for r in rows["rows"]] == [0, 1, 0, 1, 0, 1]


def test_rows_human_output_names_rows_and_draws_each():
    result = run(*ROW_ARGS, *[arg for spec in ROW_SPECS for arg in ("--row", spec)], "--chunk-size", "256")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "hit: 10 of 16 chunks (2560 of 4096 tokens)" in out
    assert "rows: 3 groups x 2 ranks = 6 rows of 16 chunks, 30 retained" in out
    assert "row 3 (group 1 rank 1, window 4)" in out
    assert "g1r0  ++++++####++++++" in out
    assert "g1r1  ++++++####..++++" in out
    assert "~ some ranks missing" not in out  # a row is one rank


def test_rows_file_and_stdin(tmp_path):
    rows = [parse_chunks(spec, 16) for spec in ROW_SPECS]
    data = b"".join(r.to_bytes() for r in rows)
    path = tmp_path / "rows.bin"
    path.write_bytes(data)
    from_file = run_json(*ROW_ARGS, "--rows-file", str(path))
    assert from_file["hit"] == 10 and from_file["limiting_rows"] == [3, 4, 5]
    result = run(*ROW_ARGS, "--rows-file", "-", "--json", input=data)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == from_file


def test_rows_of_zero_chunks():
    result = run("-c", "0", "-w", "-1,2", "--rows-file", "-", "--json", input=b"")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["hit"] == 0 and doc["retain_rows_hex"] == ["", ""]


# ---- errors: one line, usage exit code, nothing on stdout ----------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("-c", "5", "-w", "x,1", "-g", "0"), "--windows"),
        (("-c", "5", "-w", ",", "-g", "0"), "--windows is empty"),
        (("-c", "5", "-w", "-1,2", "-g", "0"), "2 windows"),
        (("-c", "5", "-w", "-1"), "exactly one way"),
        (("-c", "5", "-w", "-1", "-g", "0", "--hex", "00"), "exactly one way"),
        (("-c", "5", "-w", "-1,2", "--hex", "0f"), "need exactly 2"),
        (("-c", "5", "-w", "-1", "--hex", "zz"), "not hexadecimal"),
        (("-c", "5", "-w", "-1", "-g", "7"), "outside 0-4"),
        (("-c", "5", "-r", "2", "-w", "-1", "-g", "0;1;2"), "3 ranks"),
        (("-c", "5", "-w", "-1", "--bitmap-file", "/nonexistent/x"), "--bitmap-file"),
        (("-c", "-1", "-w", "-1", "-g", "0"), "--chunks"),
        (("-c", "5", "-r", "0", "-w", "-1", "-g", "0"), "--ranks"),
        (("-w", "-1", "-g", "0"), "give --chunks and --windows"),
        (("-c", "5", "-w", "-1", "-g", "0", "--layout", "diagonal"), "--layout"),
        (("-c", "5", "-w", "-1,2", "--row", "0-3"), "1 --row option(s) for 2 windows"),
        (("-c", "5", "-r", "2", "-w", "-1,2", "--row", "0", "--row", "1"), "give 4 --row"),
        (("-c", "5", "-w", "-1", "--row", "5"), "outside 0-4"),
        (("-c", "5", "-w", "-1", "--row", "0", "--layout", "chunk-major"), "rows (--row, --rows-file) have no layout"),
        (("-c", "5", "-w", "-1", "--row", "0", "-g", "0"), "exactly one way"),
        (("-c", "5", "-w", "-1", "--rows-file", "/nonexistent/x"), "--rows-file"),
        (("-c", "5", "-w", "-1", "-r", str(2**21), "--row", "0"), "at most 2^20"),
    ],
)
def test_bad_input_is_a_one_line_usage_error(args, fragment):
    result = run(*args)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"\x0f", "holds 1 bytes but 2 windows x 1 rank(s) = 2 rows of 5 chunks (1 bytes each) need exactly 2"),
        (b"\x0f\x1c\x00", "need exactly 2"),
        (b"\x0f\x3c", "row 1 sets bit 5, past its 5 chunks"),
    ],
)
def test_rows_file_of_the_wrong_size_is_refused(tmp_path, data, fragment):
    path = tmp_path / "rows.bin"
    path.write_bytes(data)
    result = run("-c", "5", "-w", "-1,2", "--rows-file", str(path))
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.stdout == ""
    assert fragment in result.stderr
