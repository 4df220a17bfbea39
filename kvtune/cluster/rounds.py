"""What a Ray task runs on the node Ray picked: one round of stage 2 (every config once, in order) on
the GPUs Ray assigned it, the server and the load generator side by side on that node over loopback.

`run_round` is `pool.RayPool`'s task (a round of stage 2, or `kvtune run --ray`'s one run): it returns
each run's scores and RunResult, the slot (`slots.Slot`) stored in the run's summary["slot"] with the
wall-clock times it started and ended. A server that cannot start fails its run, not the round.
`check` is a search's first start of the live target, `calibrate` a whole calibration session
(`kvtune calibrate --ray`), each on one slot. `guarded` keeps a `guard` process beside the task, so
that a task killed by SIGKILL leaves no server behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..results import RunResult
from ..targets.base import TargetRunError, TargetStartError
from .slots import Slot


@dataclass
class RoundRun:
    """One run of a round: its objective values, score and result, or why it failed."""
    values: list[float] | None = None
    score: object = None  # search.slo.Score
    result: RunResult | None = None
    error: str | None = None
    start_failed: bool = False  # the server did not start (TargetStartError), rather than the run failing


def current_slot() -> Slot:
    """Where this Ray task runs: its node and the GPUs Ray assigned it."""
    import ray

    ctx = ray.get_runtime_context()
    return Slot(ray.util.get_node_ip_address(), ctx.get_node_id(), tuple(str(g) for g in ray.get_gpu_ids()))


def on_slot(target, slot: Slot):
    """`target` with its server told the GPUs of `slot` (CUDA_VISIBLE_DEVICES), over any --server-env."""
    if not slot.gpus or not hasattr(target, "env"):
        return target
    return dataclasses.replace(target, env={**target.env, "CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)})


@contextlib.contextmanager
def guarded():
    """A `guard` process watching this worker while the block runs; stopped when the block ends."""
    guard = subprocess.Popen([sys.executable, "-m", "kvtune.cluster.guard", str(os.getpid())],
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    finally:
        guard.terminate()
        guard.wait()


def run_round(target, objective, configs: list, workload) -> list[RoundRun]:
    """Each of `configs` once, in order, on this task's slot, scored by `objective` (search.objective.Objective)."""
    slot = current_slot()
    target, runs = on_slot(target, slot), []
    with guarded():
        for config in configs:
            started = time.time()
            try:
                values, score, result = objective.evaluate(target.run, config, workload)
            except (TargetStartError, TargetRunError) as err:
                runs.append(RoundRun(error=f"{err} (on {slot.label})",
                                     start_failed=isinstance(err, TargetStartError)))
                continue
            result.summary["slot"] = slot.as_dict() | {"started": started, "ended": time.time()}
            runs.append(RoundRun(values, score, result))
    return runs


def check(target, config) -> tuple[dict | None, str | None]:
    """`target.check(config)` on this task's slot, the server stopped after: what it reports, or why
    it does not serve (a TargetStartError's or TargetRunError's message, with the slot)."""
    slot = current_slot()
    target = on_slot(target, slot)
    with guarded():
        try:
            return target.check(config), None
        except (TargetStartError, TargetRunError) as err:
            return None, f"{err} (on {slot.label})"
        finally:
            target.close()


@dataclass
class Calibrated:
    """What `calibrate` gives back: the fitted profile (calibrate.profile.CalibrationProfile) or why
    there is none, the slot it ran on, and the progress lines the session said (a task's output does
    not reach the driver, which prints them)."""
    slot: dict
    lines: list[str]
    profile: object = None
    error: str | None = None


def calibrate(target, session: Callable) -> Calibrated:
    """`session(target, progress=...)` on this task's slot: a calibration that starts `target`'s server
    (and the quantized pass's, where it runs one) and stops it, as `cli.calibrate._calibrate` builds it
    from `calibrate.session.calibrate_target`. A CalibrationError's or TargetStartError's message
    comes back as `error`, with the slot."""
    from ..calibrate.errors import CalibrationError

    slot = current_slot()
    lines: list[str] = []
    with guarded():
        try:
            return Calibrated(slot.as_dict(), lines, profile=session(on_slot(target, slot), progress=lines.append))
        except (CalibrationError, TargetStartError, TargetRunError) as err:
            return Calibrated(slot.as_dict(), lines, error=f"{err} (on {slot.label})")
