"""Targets run a workload under an engine config and return a RunResult.

sim: the engine core in virtual time. The live targets start a server (the
bundled engine, vLLM, SGLang) or watch a running one, replay the workload with
Locust and scrape its /metrics.
"""
from ..lazy import exports_of, lazy_face

EXPORTS = exports_of({
    ".base": ("LiveTarget", "Target", "TargetRunError", "TargetStartError"),
    ".live": ("LiveOptions",),
    ".servers": ("EngineTarget", "SglangTarget", "UrlTarget", "VllmTarget"),
    ".sim": ("SimTarget",),
})
__getattr__, __dir__ = lazy_face(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
