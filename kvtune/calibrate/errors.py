"""What a calibration raises where it cannot go on; nothing is saved then."""


class CalibrationError(RuntimeError):
    """Calibration could not complete: the server died, refused or answered errors,
    or the probes could not be fitted. Nothing is saved."""
