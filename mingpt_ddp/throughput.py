"""Timing a window of training: its steps alone (what tokens/s and MFU are computed from) and
its whole wall time (evaluations and saves included: what a run's length is planned from)."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch


def device_sync(device: torch.device) -> Callable[[], None]:
    """Wait for the device's queued work (a no-op on CPU, where work is synchronous)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class StepTimer:
    """Seconds spent training since the last `take()`; evaluations, saves and anything else
    between `pause()` and `resume()` are left out (`take_window()` also gives the window's
    wall seconds, which keep them).

    GPU work is asynchronous: every clock read follows a device sync, so a window measures
    what the device did rather than how fast the host queued it. The syncs happen only at
    the window's edges (every log_every steps, and around evaluations and saves, which end
    in a host sync anyway).
    """

    def __init__(self, device: torch.device, clock: Optional[Callable[[], float]] = None):
        self._sync = device_sync(device)
        self._clock = clock or time.perf_counter
        self._seconds = 0.0
        self._since: Optional[float] = None
        self._window_start: Optional[float] = None

    def _now(self) -> float:
        self._sync()
        return self._clock()

    def resume(self) -> None:
        self._since = self._now()
        if self._window_start is None:
            self._window_start = self._since

    def pause(self) -> None:
        if self._since is not None:
            self._seconds += self._now() - self._since
            self._since = None

    def take(self) -> float:
        """The training seconds of the window just ended; the next window starts now."""
        return self.take_window()[0]

    def take_window(self) -> tuple[float, float]:
        """(training seconds, wall seconds) of the window just ended; the next one starts now."""
        now = self._now()
        if self._since is not None:
            self._seconds += now - self._since
            self._since = now
        wall = now - self._window_start if self._window_start is not None else 0.0
        self._window_start = now
        seconds, self._seconds = self._seconds, 0.0
        return seconds, wall
