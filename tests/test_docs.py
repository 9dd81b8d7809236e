"""The documentation stays true: README examples run, every command is documented."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from hmem.cli.app import app

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_examples_run():
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert blocks, "the README shows no Python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_prefix_hit_doc_examples_run():
    # the examples build on each other, as a reader types them one after another
    blocks = _python_blocks((ROOT / "docs" / "prefix-hit.md").read_text())
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/prefix-hit.md", "exec"), namespace)


def test_every_command_has_help_and_a_section_in_cli_md():
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    command = typer.main.get_command(app)
    names = sorted(command.commands)
    assert "prefix-hit" in names
    for name in names:
        sub = command.commands[name]
        assert (sub.help or "").strip(), f"hmem {name} has no help text"
        assert f"## `hmem {name}`" in cli_md, f"docs/cli.md has no section for hmem {name}"
