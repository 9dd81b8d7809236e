"""docs/cli-reference.md is what scripts/cli_reference.py makes of the
command line as it is, and the links into it and into docs/cli.md lead
somewhere."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import typer

from hmem.cli.app import app
from hmem.cli.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cli_reference.py"


def _generator():
    # a script, not part of the package: loaded from its file
    spec = importlib.util.spec_from_file_location("cli_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_is_up_to_date():
    generator = _generator()
    diff = generator.check(generator.REFERENCE)
    assert diff is None, f"docs/cli-reference.md is out of date; regenerate it with `{generator.REGENERATE}`:\n\n{diff}"


def test_the_reference_lists_every_command_option_and_exit_code():
    text = (ROOT / "docs" / "cli-reference.md").read_text(encoding="utf-8")
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        section = text[text.index(f"## `hmem {name}`") :]
        section = section[: section.index("\n## ", 1)]
        for param in command.params:
            if param.param_type_name == "option":
                assert f"`{param.opts[0]}`" in section, (name, param.opts)
    for code in ExitCode:
        assert f"| {int(code)} | `{code.name}` |" in text, code


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes of a page's headings."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", _without_code_blocks(markdown), flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return anchors


def _without_code_blocks(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)


def test_links_to_the_cli_docs_find_their_sections():
    targets = {
        name: _anchors((ROOT / "docs" / name).read_text(encoding="utf-8")) for name in ("cli.md", "cli-reference.md")
    }
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for source in sources:
        for page, anchor in re.findall(
            r"\]\((?:docs/)?(cli(?:-reference)?\.md)?#([^)]+)\)", source.read_text(encoding="utf-8")
        ):
            page = page or source.name
            if page not in targets:
                continue
            assert anchor in targets[page], f"{source.relative_to(ROOT)} links to {page}#{anchor}, which is no heading"
            checked += 1
    assert checked, "no link into docs/cli.md or docs/cli-reference.md was found"


def test_cli_md_lists_each_command_and_links_to_its_reference():
    cli_md = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name in typer.main.get_command(app).commands:
        assert f"| [`hmem {name}`](#hmem-{name}) |" in cli_md, f"docs/cli.md's table of commands lacks hmem {name}"
        start = cli_md.index(f"## `hmem {name}`")
        end = cli_md.find("\n## ", start + 1)
        section = cli_md[start : end if end >= 0 else len(cli_md)]
        assert f"(cli-reference.md#hmem-{name})" in section, f"docs/cli.md's hmem {name} does not link its options"
