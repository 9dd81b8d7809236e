"""`hmem prefix-hit`: human and JSON output, and every error path."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from hmem import Bitmap, Layout, presence_map
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
    assert mask.indices().tolist() == [*range(0, 8), *range(14, 18)]
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
    expected = {"group-major": [*range(0, 8), *range(14, 18)], "chunk-major": [0, 1, 4, 5, *range(8, 16)]}
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
        (("-w", "-1", "-g", "0"), "Missing option"),
        (("-c", "5", "-w", "-1", "-g", "0", "--layout", "diagonal"), "--layout"),
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
