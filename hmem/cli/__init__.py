"""hmem's command line.  ``main`` is the console script's entry point."""

from __future__ import annotations

import sys


def main() -> None:
    # Importing the application imports hmem, which refuses to load without
    # its compiled kernels: say so in one line instead of a traceback.
    try:
        from hmem.cli.app import main as run
    except ImportError as exc:
        from hmem.errors import KernelUnavailableError

        if not isinstance(exc, KernelUnavailableError):
            raise
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(1)
    run()
