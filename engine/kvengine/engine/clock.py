"""The engine's time: virtual for trace replay, wall-clock for serving."""
from __future__ import annotations

import time


class VirtualClock:
    """Jumps: a step advances it by the executor's step time, idle time is skipped."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def step_started(self) -> None:
        pass

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t


class WallClock:
    """Real time. A step that returns faster than its modelled time (the simulator)
    sleeps the rest, so clients see the latencies of the simulated device."""

    def __init__(self):
        self._origin = time.monotonic()
        self._step_start = 0.0

    @property
    def now(self) -> float:
        return time.monotonic() - self._origin

    def step_started(self) -> None:
        self._step_start = self.now

    def advance(self, seconds: float) -> None:
        remaining = self._step_start + seconds - self.now
        if remaining > 0:
            time.sleep(remaining)

    def advance_to(self, t: float) -> None:
        remaining = t - self.now
        if remaining > 0:
            time.sleep(remaining)
