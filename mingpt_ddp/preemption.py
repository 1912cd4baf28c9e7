"""Notice a request to stop (Ctrl-C, SIGTERM, SIGUSR1) without stopping in the middle of a step.

Slurm sends SIGUSR1 (``--signal=USR1@<seconds>``) or SIGTERM before a time limit or a
preemption; torchrun forwards SIGTERM to its workers when it is told to stop; Ctrl-C in a
terminal sends SIGINT to every process of the job. The handler only records the request;
the trainer acts on it at a step boundary, after all ranks agreed on the step (a signal
reaches ranks at different moments), and saves a snapshot. A second Ctrl-C aborts at once.

Outside training (start-up, the end of a run, between the points of a sweep) SIGUSR1, the
scheduler's warning with time to spare, is recorded too (`record_stop_signals`): one that
arrives before training is acted on at the first agreement, one after it ends a sweep
before its next point. SIGTERM and Ctrl-C there end the process at once: there is nothing
new to save (a SIGTERM that arrives after training's last agreement ends a sweep likewise).
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


_received = 0  # a stop signal not acted on yet: received outside training, or after its last agreement


def _record(signum: int, frame: Optional[FrameType]) -> None:
    global _received
    _received = _received or signum


def record_stop_signals() -> None:
    """From now on SIGUSR1 is recorded (see `received`) instead of ending the process, or
    of being ignored as launch/multinode.sh leaves it for its torchrun agent."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, _record)


def received() -> int:
    """The stop signal this process received and has not acted on (0: none)."""
    return _received


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
        global _received
        self.signum, _received = self.signum or _received, 0  # one received before training: stop at once
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        """A request stays `received` (one that came after the last agreement, or ended the
        training): a sweep then ends instead of starting its next point."""
        global _received
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        _received = _received or self.signum

