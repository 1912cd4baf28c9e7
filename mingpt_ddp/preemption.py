"""Notice a request to stop (Ctrl-C, SIGTERM, SIGUSR1) without stopping in the middle of a step.

Slurm sends SIGUSR1 (``--signal=USR1@<seconds>``) or SIGTERM before a time limit or a
preemption; torchrun forwards SIGTERM to its workers when it is told to stop; Ctrl-C in a
terminal sends SIGINT to every process of the job. The handler only records the request;
the trainer acts on it at a step boundary, after all ranks agreed on the step (a signal
reaches ranks at different moments), and saves a snapshot; rank 0 says so at once on the
first Ctrl-C (FIRST_CTRL_C), which a person would otherwise press again. A second Ctrl-C aborts at once;
so does a second stop signal of any kind while the last snapshot is still being saved (a
failing store is retried for trainer.save_retry_minutes, longer than a scheduler's grace
period), naming the newest snapshot that was saved.

Outside training (start-up, the end of a run, between the points of a sweep) SIGUSR1, the
scheduler's warning with time to spare, is recorded too (`record_stop_signals`): one that
arrives before training is acted on at the first agreement, one after it ends a sweep
before its next point. SIGTERM and Ctrl-C there end the process at once (Ctrl-C with one
line from rank 0 saying where, main.stop_at_once): there is nothing new to save (a SIGTERM
that arrives after training's last agreement ends a sweep likewise).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Callable, MutableMapping, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Exit status of a run stopped by Ctrl-C, as shells report a process ended by SIGINT.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
# A SIGINT this soon after the first is the same Ctrl-C arriving twice (torchrun versions that
# leave workers in the terminal's process group forward a SIGINT they already got), not a
# person pressing it again.
SAME_CTRL_C_SECONDS = 1.0
# What a first Ctrl-C during training does, said at once (a person would press again meanwhile).
# No figure: the ranks act on it at their next agreement, after the step in progress and any
# evaluation or save under way (tens of seconds for a large model's CPU step), not within
# trainer.stop_check_seconds.
FIRST_CTRL_C = ("Ctrl-C: stopping with a snapshot after the step in progress (and any evaluation or save under "
                "way); press Ctrl-C again to stop at once, without one")


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


def _say(line: str) -> None:
    """One line on stderr from rank 0 (os.write: safe inside a signal handler)."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, (line + "\n").encode())


WHILE_SAVING = "without waiting for the last snapshot, which was still being saved"
DURING_FINAL_EVALUATION = "during the final evaluation, without finishing it"
AT_THE_END = "at the end of the run"


def _exit_while_saving(signum: int, newest_saved: Optional[str], doing: str = WHILE_SAVING) -> None:
    name = signal.Signals(signum).name
    where = (f"the newest snapshot saved is {newest_saved}; run the same command to resume from it" if newest_saved
             else "this run saved no snapshot; run the same command to resume from the newest one there, if any")
    _say(f"stopped by a second {name} {doing}: {where}")
    # Under torchrun 0, as after Ctrl-C: a failed worker would be restarted (or reported) by its agent.
    os._exit(0 if os.environ.get("TORCHELASTIC_RUN_ID") else 128 + signum)


MAX_COMPILE_THREADS = 32  # inductor's own cap (torch/_inductor/config.py decide_compile_threads)


def size_compile_workers(threads: int, env: MutableMapping[str, str] = os.environ) -> Optional[int]:
    """torch.compile's worker processes per rank: this rank's share of the cores (`threads`),
    unless TORCHINDUCTOR_COMPILE_THREADS was set. Inductor otherwise starts min(32, cores)
    per rank, 8 x 32 processes on an 8-GPU node under plain torchrun (issue 30); it reads the
    variable once, at import, so its config is set too. Before any compile (the pool is
    started by shield_compile_workers or the first compile). The count set, or None."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in env:
        return None
    n = max(1, min(MAX_COMPILE_THREADS, threads))
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(n)  # also for the compile sidecar and anything it starts
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return n
    inductor_config.compile_threads = n
    return n


def shield_compile_workers(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> bool:
    """Start torch.compile's worker processes now, with the stop signals blocked, so that they
    never receive them.

    Inductor compiles Triton kernels (GPU builds) in a sidecar process and its pool of
    workers: processes of this job too, so Slurm's SIGUSR1 and SIGTERM (sent to every process
    of a step) and a terminal's Ctrl-C reach them, and by default kill them, failing a compile
    in progress with a traceback on every rank. A blocked signal stays blocked in children
    (fork and exec alike), so workers started inside this block, and the ones the sidecar
    forks later, keep them pending forever; the trainer's own handlers see them as before.
    Only where torch itself would start workers (inductor's maybe_warm_pool: Triton present);
    False when torch has no such hook (private API: tests/test_torch_floor.py notices).
    """
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return False
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        maybe_warm_pool()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return True


class StopRequest:
    """Install with `with StopRequest() as stop:`; `stop.signum` is set once asked (0 before)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 clock: Callable[[], float] = time.monotonic, abort: Callable[[], None] = _abort_now,
                 exit_while_saving: Callable[[int, Optional[str], str], None] = _exit_while_saving,
                 say: Callable[[str], None] = _say):
        self.signals = signals
        self.signum = 0
        self._first_interrupt: Optional[float] = None
        self._last_signal: Optional[float] = None
        self._clock, self._abort, self._exit_while_saving, self._say = clock, abort, exit_while_saving, say
        self._newest_saved: Optional[Callable[[], Optional[str]]] = None
        self._saving: Callable[[], bool] = lambda: True
        # Set by the trainer around the final evaluation, which runs while (or after) the last
        # step's snapshot is saved: what a signal then interrupts.
        self.final_evaluation = False
        self._previous: dict[signal.Signals, object] = {}

    def saving_last_snapshot(self, newest_saved: Callable[[], Optional[str]], stopping: bool,
                             saving: Optional[Callable[[], bool]] = None) -> None:
        """From now on the last snapshot is being saved, which may be retried for
        trainer.save_retry_minutes: a stop signal exits at once, naming `newest_saved()`, if
        the run is `stopping` on a signal (which may have reached another rank only) or one
        came before; at the end of a run, the second one does. `saving()`: is a write still
        in flight (the lines say so only then; unknown: assumed)."""
        self._newest_saved = newest_saved
        self._saving = saving or (lambda: True)
        if stopping and not self.signum:
            self.signum = int(signal.SIGTERM)  # the ranks agreed to stop on another rank's signal

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        now = self._clock()
        # One event can arrive twice within a moment (Slurm signals every process of a step and
        # torchrun forwards what it got; a terminal's Ctrl-C reaches the whole process group).
        repeated = self._last_signal is not None and now - self._last_signal < SAME_CTRL_C_SECONDS
        self._last_signal = now
        if self._newest_saved is not None and not repeated:
            saving, newest = self._saving(), self._newest_saved()
            if self.signum:
                self._exit_while_saving(signum, newest, WHILE_SAVING if saving else
                                        DURING_FINAL_EVALUATION if self.final_evaluation else AT_THE_END)
                return
            self.signum = signum
            self._say(self._at_the_end(signum, saving, newest))
            return
        # After a Ctrl-C, another one aborts; so does the SIGTERM with which torchrun's agent
        # follows up when its wait for the stopping workers is itself interrupted by Ctrl-C.
        if (signum in (signal.SIGINT, signal.SIGTERM) and self._first_interrupt is not None
                and now - self._first_interrupt >= SAME_CTRL_C_SECONDS):
            self._abort()
            return
        if signum == signal.SIGINT and self._first_interrupt is None:
            self._first_interrupt = now
            if not self.signum:  # at once: the ranks act on it only at their next agreement
                self._say(FIRST_CTRL_C)
        if not self.signum:
            self.signum = signum

    def _at_the_end(self, signum: int, saving: bool, newest: Optional[str]) -> str:
        """What a first stop signal after training's last agreement does: nothing but end the
        run after what is under way (a sweep starts no next point); said as it is."""
        who = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        where = "during the final evaluation" if self.final_evaluation else "at the end of the run"
        if saving:
            state = ("the last snapshot is being saved (retried for up to trainer.save_retry_minutes); the newest saved "
                     f"is {newest or 'none yet'}")
        else:
            state = f"the newest snapshot saved is {newest}" if newest else "no snapshot saved yet"
        then = ("the evaluation finishes, is saved, and the run ends" if self.final_evaluation
                else "the run waits for it, runs its final evaluation if one is due, and ends" if saving
                else "the run ends")
        again = ("press Ctrl-C again to stop at once" if signum == signal.SIGINT
                 else "a second stop signal exits at once")
        return f"{who} {where}: {state}; {then}; {again}, keeping the newest snapshot saved"

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

