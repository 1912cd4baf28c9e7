"""Notice a request to stop (SIGTERM, SIGUSR1) without stopping in the middle of a step.

Slurm sends SIGUSR1 (``--signal=USR1@<seconds>``) or SIGTERM before a time limit or a
preemption; torchrun forwards SIGTERM to its workers when it is told to stop. The handler
only records the request; the trainer acts on it at a step boundary, after all ranks
agreed on the step (a signal reaches ranks at different moments).
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Install with `with StopRequest() as stop:`; `stop.signum` is set once asked (0 before)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.signum = 0
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
