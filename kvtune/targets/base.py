"""What every target is: `run(config, workload) -> RunResult`, and how it fails."""
from __future__ import annotations

from typing import Protocol

from kvengine.config import EngineConfig

from ..results import RunResult
from ..workload import Workload
from .rules import TargetRules


class TargetStartError(RuntimeError):
    """The server could not start with this config (an OOM, a bad flag): a failed trial.

    `cause`: the line of the server's log that says why (None when none was found);
    `log_path`: where the server's whole log is kept (None when there is none).
    """

    def __init__(self, message: str, cause: str | None = None, log_path: str | None = None):
        super().__init__(message)
        self.cause = cause
        self.log_path = log_path

    def __reduce__(self):  # keeps cause and log_path across processes (pickle)
        return type(self), (str(self), self.cause, self.log_path)


class TargetRunError(RuntimeError):
    """The run started but did not complete (server died, refused, answered errors)."""


class Target(Protocol):
    name: str

    def run(self, config: EngineConfig, workload: Workload) -> RunResult: ...


class LiveTarget(Target, Protocol):
    """A target that serves for real (kvengine, vLLM, SGLang, a URL): what a search's live stage asks of it."""
    rules: TargetRules  # what the server accepts and defaults to

    def check(self, config: EngineConfig) -> dict:
        """Start (or reach) the server with `config` and see it answer; what it reports of its config."""
        ...
