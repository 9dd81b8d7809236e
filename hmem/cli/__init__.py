"""hmem's command line.  ``main`` is the console script's entry point."""

from __future__ import annotations


def main() -> None:
    from hmem.cli.app import main as run

    run()
