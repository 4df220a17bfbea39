"""The store's errors: what a command reports as `error: ...` (kvtune.cli.ERRORS)."""
from __future__ import annotations


class StoreError(RuntimeError):
    """The database cannot be used: a bad URL, a missing driver, a refused connection."""


class RunNotFoundError(StoreError):
    """No run with that id."""
