"""Targets run a workload under an engine config and return a RunResult.

sim: the engine core in virtual time. The live targets start a server (the
bundled engine, vLLM, SGLang) or watch a running one, replay the workload with
Locust and scrape its /metrics.
"""
from .base import Target, TargetRunError, TargetStartError
from .live import LiveOptions
from .servers import EngineTarget, SglangTarget, UrlTarget, VllmTarget
from .sim import SimTarget

__all__ = ["EngineTarget", "LiveOptions", "SglangTarget", "SimTarget", "Target", "TargetRunError",
           "TargetStartError", "UrlTarget", "VllmTarget"]
