"""What every target is: `run(config, workload) -> RunResult`, and how it fails."""
from __future__ import annotations

from typing import Protocol

from kvengine.config import EngineConfig

from ..results import RunResult
from ..workload import Workload


class TargetStartError(RuntimeError):
    """The server could not start with this config (an OOM, a bad flag): a failed trial."""


class TargetRunError(RuntimeError):
    """The run started but did not complete (server died, refused, answered errors)."""


class Target(Protocol):
    name: str

    def run(self, config: EngineConfig, workload: Workload) -> RunResult: ...
