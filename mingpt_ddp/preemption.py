"""Notice a request to stop (Ctrl-C, SIGTERM, SIGUSR1) without stopping in the middle of a step.

Slurm sends SIGUSR1 (``--signal=USR1@<seconds>``) or SIGTERM before a time limit or a
preemption; torchrun forwards SIGTERM to its workers when it is told to stop; Ctrl-C in a
terminal sends SIGINT to every process of the job. The handler only records the request;
the trainer acts on it at a step boundary, after all ranks agreed on the step (a signal
reaches ranks at different moments), and saves a snapshot. A second Ctrl-C aborts at once.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Callable, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Exit status of a run stopped by Ctrl-C, as shells report a process ended by SIGINT.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
# A SIGINT this soon after the first is the same Ctrl-C arriving twice (torchrun versions that
# leave workers in the terminal's process group forward a SIGINT they already got), not a
# person pressing it again.
SAME_CTRL_C_SECONDS = 1.0


def _abort_now() -> None:
    if os.environ.get("RANK", "0") == "0":
        os.write(2, b"interrupted again: stopping now, without a snapshot (the newest saved one is kept)\n")
    os._exit(INTERRUPTED_EXIT_CODE)


class StopRequest:
    """Install with `with StopRequest() as stop:`; `stop.signum` is set once asked (0 before)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 clock: Callable[[], float] = time.monotonic, abort: Callable[[], None] = _abort_now):
        self.signals = signals
        self.signum = 0
        self._first_interrupt: Optional[float] = None
        self._clock, self._abort = clock, abort
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        now = self._clock()
        # After a Ctrl-C, another one aborts; so does the SIGTERM with which torchrun's agent
        # follows up when its wait for the stopping workers is itself interrupted by Ctrl-C.
        if (signum in (signal.SIGINT, signal.SIGTERM) and self._first_interrupt is not None
                and now - self._first_interrupt >= SAME_CTRL_C_SECONDS):
            self._abort()
            return
        if signum == signal.SIGINT and self._first_interrupt is None:
            self._first_interrupt = now
        if not self.signum:
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

