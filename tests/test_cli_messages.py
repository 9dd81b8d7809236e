"""What the command line says: errors a script can read (--json), user text
shown literally (never Rich markup), and messages that send the user the
right way (docs/cli.md, "Conventions" and "Errors as JSON")."""

from __future__ import annotations

import io
import json
import re
import types
from pathlib import Path

import numpy as np
import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

import hmem
from hmem.cli import output
from hmem.cli.app import HmemGroup, app
from hmem.cli.exit_codes import ERROR_NAMES, ExitCode, error_name
from hmem.cli.prefix_hit_input import MAX_PRESENCE_BITS

D = 16
ROOT = Path(__file__).resolve().parent.parent
BASE_ENV = {
    "COLUMNS": "200",
    "NO_COLOR": None,
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "HMEM_STORE": None,
    "HMEM_DEBUG": None,
}
ANSI = re.compile(r"\x1b\[")
CLI_NAMES = {"usage", "aborted", "interrupted", "terminated", "internal_error"}


def run(*args, input: bytes | str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=BASE_ENV, input=input)


def json_error(result, exit_code: int, code: str) -> dict:
    """The one JSON error document on stdout, checked against the one error line on stderr."""
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    document = json.loads(result.stdout)  # stdout holds that document and nothing else
    assert list(document) == ["error"]
    error = document["error"]
    assert set(error) == {"code", "exit", "message", "hint"}
    assert (error["code"], error["exit"]) == (code, exit_code)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == "error: " + error["message"] + (f" ({error['hint']})" if error["hint"] else "")
    assert not ANSI.search(result.stdout)
    return error


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def rng():
    return np.random.default_rng(5)


@pytest.fixture
def store(rng) -> Path:
    """A store of three entries in layer 0, made through the library."""
    path = Path("s")
    with hmem.Store.create(path, hmem.StoreConfig(embed_dim=D, hdc_dim=256)) as s:
        for _ in range(3):
            s.put(rng.standard_normal((4, D)).astype(np.float32), rng.standard_normal((4, D)).astype(np.float32))
    return path


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ---- 1. errors a script can read ---------------------------------------------------


def test_a_library_error_under_json_is_one_document():
    error = json_error(run("stats", "nowhere", "--json"), ExitCode.NOT_A_STORE, "not_a_store")
    assert "nowhere" in error["message"] and error["hint"] == "create one with 'hmem init'"


@pytest.mark.parametrize(
    "args, exit_code, code",
    [
        (["stats", "nowhere", "--json"], ExitCode.NOT_A_STORE, "not_a_store"),
        (["init", "s", "--embed-dim", "-1", "--json"], ExitCode.USAGE, "invalid_argument"),
        (["query", "nowhere", "--query", "q.npy", "-l", "0", "--json"], ExitCode.USAGE, "invalid_argument"),
        (["verify", "nowhere", "--json"], ExitCode.NOT_A_STORE, "not_a_store"),
        (["evict", "nowhere", "--target", "1", "--yes", "--json"], ExitCode.NOT_A_STORE, "not_a_store"),
        (["compact", "nowhere", "--threshold", "101", "--json"], ExitCode.USAGE, "usage"),
    ],
)
def test_errors_of_the_store_commands_under_json(args, exit_code, code):
    json_error(run(*args), exit_code, code)
    assert not Path("s").exists()


def test_without_json_stdout_stays_empty():
    result = run("stats", "nowhere")
    assert result.exit_code == ExitCode.NOT_A_STORE and result.stdout == ""
    assert result.stderr.startswith("error: nowhere")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["query", "s", "--query", "q.npy", "--layer", "x", "--json"], "'--layer'"),  # a bad option value
        (["prefix-hit", "-c", "many", "-w", "-1", "--json"], "'--chunks'"),  # not an integer
        (["stats", "s", "--no-such-flag", "--json"], "No such option"),
        (["init", "s", "--embed-dim", "4", "--max-open-shards", "many", "--json"], "--max-open-shards"),
    ],
)
def test_typer_usage_errors_under_json(args, fragment):
    error = json_error(run(*args), ExitCode.USAGE, "usage")
    assert fragment in error["message"]
    assert error["hint"].startswith("see 'hmem ") and error["hint"].endswith(" --help'")


def test_json_before_the_command_is_not_taken_for_the_command_flag():
    # '--json' is a flag of the commands, not of hmem itself, and what follows '--' is an argument
    result = run("prefix-hit", "-c", "2", "-w", "x", "--", "--json")
    assert result.exit_code == ExitCode.USAGE and result.stdout == ""


def test_a_value_error_of_hmem_under_json():
    error = json_error(run("prefix-hit", "-c", "4", "-w", "x", "--json"), ExitCode.USAGE, "invalid_argument")
    assert error["message"].startswith("--windows 'x'") and error["hint"] is None


def test_a_wrongly_shaped_query_under_json_keeps_the_brackets(store):
    np.save("q3.npy", np.ones((2, 2, D), np.float32))
    before = snapshot(store)
    error = json_error(run("query", store, "--query", "q3.npy", "-l", "0", "--json"), ExitCode.USAGE, "invalid_tensor")
    assert "[n_tokens, embed_dim]" in error["message"]
    assert snapshot(store) == before


def test_a_lost_index_under_json(store):
    (store / "index.json").unlink()
    error = json_error(run("stats", store, "--json"), ExitCode.NOT_A_STORE, "not_a_store")
    assert error["hint"] == "run 'hmem verify --repair'"


def _probe(exc: BaseException | None = None, *, emit_first: bool = False) -> typer.Typer:
    """An app on hmem's error handling with a command that raises `exc`
    (after printing its JSON document or two --jsonl lines when asked)."""
    probe = typer.Typer(cls=HmemGroup)

    @probe.command()
    def boom(json_output: bool = typer.Option(False, "--json"), jsonl: bool = typer.Option(False, "--jsonl")) -> None:
        out = output.Output(json_mode=json_output or jsonl)
        if emit_first and jsonl:
            out.emit_jsonl({"id": 1})
            out.emit_jsonl({"id": 2})
        elif emit_first:
            out.emit_json({"done": True})
        if exc is not None:
            raise exc

    @probe.command()
    def other() -> None:
        pass

    return probe


def test_the_internal_error_path_under_json():
    result = CliRunner().invoke(_probe(ZeroDivisionError("oops")), ["boom", "--json"])
    error = json_error(result, ExitCode.FAILURE, "internal_error")
    assert error["message"] == "internal error: ZeroDivisionError: oops"
    assert "--debug" in error["hint"]


def test_a_locked_store_under_json_and_the_cli_wording_of_its_hint():
    exc = hmem.StoreLockedError("s is locked for writing by pid 1", hint=hmem.Hint.LOCK_WAIT)
    error = json_error(CliRunner().invoke(_probe(exc), ["boom", "--json"]), ExitCode.LOCKED, "locked")
    assert "--lock-wait" in error["hint"]


def test_jsonl_errors_are_one_compact_line():
    result = CliRunner().invoke(_probe(hmem.NotAStoreError("x holds no hmem store")), ["boom", "--jsonl"])
    assert result.exit_code == ExitCode.NOT_A_STORE
    assert result.stdout.count("\n") == 1
    assert json.loads(result.stdout) == {
        "error": {"code": "not_a_store", "exit": 5, "message": "x holds no hmem store", "hint": None}
    }


def test_jsonl_stream_ends_with_the_error_record():
    result = CliRunner().invoke(
        _probe(hmem.CorruptStoreError("shard 3 is damaged"), emit_first=True), ["boom", "--jsonl"]
    )
    assert result.exit_code == ExitCode.FAILURE
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert records[:2] == [{"id": 1}, {"id": 2}]
    assert records[2]["error"]["code"] == "corrupt_store" and len(records) == 3


def test_no_second_document_after_the_commands_own():
    result = CliRunner().invoke(_probe(hmem.HmemError("late"), emit_first=True), ["boom", "--json"])
    assert result.exit_code == ExitCode.FAILURE
    assert json.loads(result.stdout) == {"done": True}
    assert result.stderr.strip() == "error: late"


def test_abort_under_json():
    json_error(CliRunner().invoke(_probe(typer.Abort()), ["boom", "--json"]), ExitCode.FAILURE, "aborted")


def test_every_library_error_has_its_own_stable_name():
    classes = [getattr(hmem, name) for name in hmem.__all__ if name.endswith("Error")]
    for cls in classes:
        name = error_name(cls.__new__(cls))
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", name), name
        assert name != "internal_error", cls
    specific = [cls for cls in classes if cls is not hmem.HmemError]
    assert all(error_name(cls.__new__(cls)) != "failure" for cls in specific)
    assert error_name(OSError(5, "I/O error")) == "storage_error"
    assert error_name(RuntimeError()) == "internal_error"


def test_docs_list_every_error_name():
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    section = cli_md[cli_md.index("### Errors as JSON") :]
    for name in {name for _, name in ERROR_NAMES} | CLI_NAMES:
        assert f"`{name}`" in section, name


# ---- 2. user text is shown literally -------------------------------------------------


def test_init_prints_a_bracketed_path_literally():
    result = run("init", "kv[bold]x", "--embed-dim", "8")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0] == "created hmem store at kv[bold]x"
    assert Path("kv[bold]x", "index.json").is_file()


def test_export_path_and_warnings_are_printed_literally(store, rng):
    (store / "notes[red]:smile:.txt").write_text("not hmem's")
    np.save("q.npy", rng.standard_normal((2, D)).astype(np.float32))
    result = run("query", store, "--query", "q.npy", "-l", "0", "--export", "run[bold]1.safetensors")
    assert result.exit_code == 0, result.stderr
    assert "to run[bold]1.safetensors (" in result.stdout
    stats = run("stats", store)
    assert stats.exit_code == 0, stats.stderr
    assert "warning: foreign file notes[red]:smile:.txt in the store directory" in stats.stderr


def test_output_never_reads_markup_or_emoji_codes(capsys):
    out = output.Output()
    out.print("shape [n_tokens, embed_dim] of run[bold]1 :smile:")
    table = out.table("file", title="[b]title")
    table.add_row("run[bold]1.safetensors")
    out.print(table)
    out.warn("tensor 'k' is [4, 4, 32] [/]")
    captured = capsys.readouterr()
    assert "shape [n_tokens, embed_dim] of run[bold]1 :smile:" in captured.out
    assert "run[bold]1.safetensors" in captured.out and "[b]title" in captured.out
    assert captured.err.strip() == "warning: tensor 'k' is [4, 4, 32] [/]"


def test_styled_text_is_still_styled():
    console = output._console(file=io.StringIO(), force_terminal=True, color_system="standard")
    console.print(output.styled("hit: 3", "bold"), "and [bold]x")
    text = console.file.getvalue()
    assert "\x1b[1mhit: 3" in text and "and [bold]x" in text


def test_error_lines_are_plain_text():
    assert output.error_line("bad [bold]x", "run 'hmem init'") == "error: bad [bold]x (run 'hmem init')"


# ---- 3a. a store that lost index.json --------------------------------------------------


@pytest.mark.parametrize(
    "command", [["stats"], ["query", "--query", "q.npy", "-l", "0"], ["compact"], ["evict", "--target", "1", "--yes"]]
)
def test_a_lost_index_is_not_sent_to_init(store, command, rng):
    np.save("q.npy", rng.standard_normal((2, D)).astype(np.float32))
    (store / "index.json").unlink()
    before = snapshot(store)
    result = run(command[0], store, *command[1:])
    assert result.exit_code == ExitCode.NOT_A_STORE, result.stderr
    line = result.stderr.strip()
    assert "no index.json" in line and "index is missing" in line and "entries.bin" in line
    assert line.endswith("(run 'hmem verify --repair')") and "hmem init" not in line
    assert snapshot(store) == before


def test_the_advice_for_a_lost_index_works(store):
    (store / "index.json").unlink()
    assert run("verify", store, "--repair", "--yes").exit_code == 0
    assert run("stats", store).exit_code == 0


def test_a_directory_without_store_files_is_still_sent_to_init():
    Path("empty").mkdir()
    (Path("empty") / "notes.txt").write_text("x")
    result = run("stats", "empty")
    assert result.exit_code == ExitCode.NOT_A_STORE
    assert result.stderr.strip() == (
        "error: empty holds no hmem store (no index.json) and no LMCache cache: none of its 1 entries is named as "
        "LMCache names a chunk (model@world@worker@hash@dtype.pt or .data) (create one with 'hmem init')"
    )


# ---- 3b, 3f, 3g. prefix-hit input ---------------------------------------------------------


def test_hex_of_the_wrong_length_names_the_length():
    result = run("prefix-hit", "-c", "4", "-w", "-1", "--hex", "fff")
    assert result.exit_code == ExitCode.USAGE
    line = result.stderr.strip()
    assert "not hexadecimal" not in line
    assert line == (
        "error: --hex holds 3 hex digits but 1 groups x 4 chunks x 1 ranks = 4 bits need exactly 1 bytes (2 hex digits)"
    )


def test_hex_with_a_bad_digit_names_it():
    result = run("prefix-hit", "-c", "4", "-w", "-1", "--hex", "0g")
    assert result.exit_code == ExitCode.USAGE
    assert "is not hexadecimal ('g' is no hex digit)" in result.stderr


@pytest.mark.parametrize("hex_text, first", [("f0", 4), ("1f", 4), ("80", 7), ("20", 5)])
def test_bits_past_the_map_are_refused(hex_text, first):
    result = run("prefix-hit", "-c", "4", "-w", "-1", "--hex", hex_text)
    assert result.exit_code == ExitCode.USAGE, result.stdout
    assert (
        f"--hex sets bit {first}, past the end of the map of 1 groups x 4 chunks x 1 ranks = 4 bits "
        f"(bits 0-3)" in result.stderr
    )
    assert result.stdout == ""


def test_a_full_last_byte_and_the_bitmap_file_are_checked_too():
    assert run("prefix-hit", "-c", "4", "-w", "-1", "--hex", "0f").exit_code == 0
    assert run("prefix-hit", "-c", "4", "-w", "-1,1", "--hex", "ff").exit_code == 0  # 8 bits: no spare bit
    Path("bm").write_bytes(b"\xff\x07")
    result = run("prefix-hit", "-c", "5", "-w", "-1,2", "--bitmap-file", "bm")
    assert result.exit_code == ExitCode.USAGE and "sets bit 10, past the end" in result.stderr
    Path("bm").write_bytes(b"\xff\x03")
    assert run("prefix-hit", "-c", "5", "-w", "-1,2", "--bitmap-file", "bm").exit_code == 0


@pytest.mark.parametrize(
    "args",
    [
        ["-c", str(2**40), "-w", "-1", "-g", "0"],
        ["-c", str(2**40), "-w", "-1", "--hex", "00"],
        ["-c", str(2**20), "-r", str(2**10), "-w", "-1,-1", "-g", "0", "-g", "0"],
        ["-c", "4", "-r", str(2**62), "-w", "-1", "-g", "0"],
    ],
)
def test_impossible_sizes_are_usage_errors(args):
    result = run("prefix-hit", *args)
    assert result.exit_code == ExitCode.USAGE, result.stderr
    assert "internal error" not in result.stderr and "MemoryError" not in result.stderr
    assert f"at most 2^30 = {MAX_PRESENCE_BITS} bits" in result.stderr
    assert result.stderr.strip().endswith("(check --chunks and --ranks)")


def test_the_largest_size_allowed_is_accepted_up_to_the_input_check():
    # exactly the limit: refused for its input (one byte given), not for its size
    result = run("prefix-hit", "-c", str(MAX_PRESENCE_BITS), "-w", "-1", "--hex", "00")
    assert result.exit_code == ExitCode.USAGE
    assert f"need exactly {MAX_PRESENCE_BITS // 8} bytes" in result.stderr


# ---- 3c. the query file's kind -----------------------------------------------------------


def test_query_suffix_is_case_insensitive_and_content_decides(store, rng):
    tokens = rng.standard_normal((3, D)).astype(np.float32)
    np.save("q.npy", tokens)
    Path("q.NPY").write_bytes(Path("q.npy").read_bytes())
    Path("q.bin").write_bytes(Path("q.npy").read_bytes())
    hmem.write_kv_file(Path("q.SafeTensors"), {"query": tokens})

    def ids(name: str) -> list[int]:
        result = run("query", store, "--query", name, "-l", "0", "--json")
        assert result.exit_code == 0, result.stderr
        return [r["entry_id"] for r in json.loads(result.stdout)["results"]]

    expected = ids("q.npy")
    assert ids("q.NPY") == ids("q.bin") == ids("q.SafeTensors") == expected


def test_a_query_file_of_neither_kind(store):
    Path("q.txt").write_text("0.1 0.2 0.3\n")
    result = run("query", store, "--query", "q.txt", "-l", "0")
    assert result.exit_code == ExitCode.USAGE
    assert result.stderr.startswith("error: --query q.txt: neither a .npy file nor a safetensors file")
    Path("bad.NPY").write_text("not numpy")
    result = run("query", store, "--query", "bad.NPY", "-l", "0")
    assert result.exit_code == ExitCode.USAGE
    assert "not a readable .npy file" in result.stderr and "header length" not in result.stderr


@pytest.mark.parametrize("name, fragment", [("missing.npy", "no such file"), (".", "a directory")])
def test_a_query_path_that_is_no_file(store, name, fragment):
    result = run("query", store, "--query", name, "-l", "0")
    assert result.exit_code == ExitCode.USAGE and fragment in result.stderr


# ---- 3d. --help ----------------------------------------------------------------------------


def _help_texts() -> dict[str, str]:
    names = sorted(typer.main.get_command(app).commands)
    texts = {"hmem": run("--help").stdout}
    for name in names:
        result = run(name, "--help")
        assert result.exit_code == 0, result.stderr
        texts[name] = result.stdout
    return texts


def test_help_shows_no_bool_after_flags():
    texts = _help_texts()
    for name, text in texts.items():
        assert "<bool>" not in text, name
        assert "--help" in text
    # options that take a value still show what they take
    assert "<path>" in texts["query"] and "SECONDS" in texts["compact"] and "PCT" in texts["compact"]
    assert "<int range>" in texts["prefix-hit"] and "<str>" in texts["prefix-hit"]


# ---- 3e. one unit system -------------------------------------------------------------------


@pytest.mark.parametrize("speed, shown", [(3 * 2**20, "3.0 MiB/s"), (1536, "1.5 KiB/s"), (100, "100 B/s"), (None, "?")])
def test_progress_speed_is_in_binary_units(speed, shown):
    task = types.SimpleNamespace(finished_speed=None, speed=speed)
    assert output.binary_speed_column().render(task).plain == shown


def test_byte_progress_bars_use_the_binary_column(monkeypatch):
    seen: list[list] = []

    import rich.progress

    class Recording(rich.progress.Progress):
        def __init__(self, *columns, **kwargs):
            seen.append(list(columns))
            super().__init__(*columns, **kwargs)

    monkeypatch.setattr(rich.progress, "Progress", Recording)  # output.py imports Rich where it prints
    out = output.Output()
    out._err = output._console(file=io.StringIO(), force_terminal=True)  # a terminal for stderr (Output makes its own)
    with out.progress("importing", 10 * 2**20, bytes_mode=True) as bar:
        bar.advance(2**20)
    with out.progress("files", 3) as bar:
        bar.advance(1)
    kinds = [[type(c).__name__ for c in columns] for columns in seen]
    assert "BinaryTransferSpeedColumn" in kinds[0] and "TransferSpeedColumn" not in kinds[0]
    assert "MofNCompleteColumn" in kinds[1]
    assert "MB/s" not in out.err.file.getvalue()


def test_human_bytes_is_binary():
    assert output.human_bytes(1536) == "1.5 KiB" and output.human_bytes(10**10) == "9.3 GiB"


def test_a_console_for_tests_is_plain():
    # the consoles of Output never read markup, whatever Rich's default
    assert isinstance(output.Output().out, Console)
    assert output.Output().out._markup is False and output.Output().err._emoji is False
