"""Calibration: fit kvengine's cost model to a live server, keep it as a named profile.

    profile = calibrate_url("http://127.0.0.1:8000", "tiny", "cpu", EngineConfig(), "cpu-tiny")
    save_profile(None, profile)                     # the default store (--db / $KVTUNE_DB)
    coeffs = load_cost_profile(None, "cpu-tiny")    # -> CostCoefficients for SimTarget
"""
from .cli import add_calibrate_command, calibrate_target, calibrate_url, format_profile
from .fit import FitResult, Observation, fit_coefficients, step_shapes
from .probes import (
                     CalibrationError,
                     Probe,
                     ProbeOptions,
                     ProbePlan,
                     ProbeRun,
                     ServerInfo,
                     design_probes,
                     run_probes,
                     server_info,
                     speed_drift,
)
from .profile import (
                     CalibrationProfile,
                     ProfileNotFoundError,
                     get_profile,
                     list_profiles,
                     load_cost_profile,
                     save_profile,
)

__all__ = [
    "CalibrationError", "CalibrationProfile", "FitResult", "Observation", "Probe", "ProbeOptions", "ProbePlan",
    "ProbeRun", "ProfileNotFoundError", "ServerInfo", "add_calibrate_command", "calibrate_target",
    "calibrate_url", "design_probes", "fit_coefficients", "format_profile", "get_profile", "list_profiles",
    "load_cost_profile", "run_probes", "save_profile", "server_info", "speed_drift", "step_shapes",
]
