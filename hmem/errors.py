"""Every error hmem raises.

One class per condition.  Each carries a message that says what happened and,
where there is one, a ``hint`` that says what to do next; the command line
prints both on one line and maps the class to a documented exit code.
"""

from __future__ import annotations


class HmemError(Exception):
    """Base of every error hmem raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class InvalidArgumentError(HmemError, ValueError):
    """An argument is out of range, of the wrong type or inconsistent."""


class KernelUnavailableError(HmemError, ImportError):
    """hmem's compiled kernels are missing or an unknown kernel set was asked for."""
