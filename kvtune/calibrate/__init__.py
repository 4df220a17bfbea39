"""Calibration: fit kvengine's cost model to a live server, keep it as a named profile.

    profile = calibrate_url(CalibrationRequest("http://127.0.0.1:8000", "tiny", "cpu", EngineConfig(), "cpu-tiny"))
    save_profile(None, profile)                     # the default store (--db / $KVTUNE_DB)
    coeffs = load_cost_profile(None, "cpu-tiny")    # -> CostCoefficients for SimTarget

`kvtune calibrate` is in kvtune/cli/calibrate.py.
"""
from ..lazy import exports_of, lazy_face

EXPORTS = exports_of({
    ".session": ("CalibrationRequest", "calibrate_target", "calibrate_url",
                 "format_profile"),
    ".fit": ("FitResult", "Observation", "fit_coefficients", "fit_dequant", "step_shapes"),
    ".errors": ("CalibrationError",),
    ".server": ("ServerInfo", "server_info"),
    ".design": ("Probe", "ProbePlan", "design_probes"),
    ".timings": ("ProbeRun", "speed_drift"),
    ".runner": ("ProbeOptions", "run_probes"),
    ".profile": ("CalibrationProfile", "ProfileNotFoundError", "get_profile", "list_profiles",
                 "load_cost_profile", "save_profile"),
})
__getattr__, __dir__ = lazy_face(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
