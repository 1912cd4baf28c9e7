"""torchrun, with Ctrl-C ending in one line instead of a traceback.

    python -m mingpt_ddp.torchrun --standalone --nproc_per_node=2 mingpt_ddp/main.py [overrides]

Takes exactly torchrun's arguments. On Ctrl-C, torchrun's agent forwards SIGINT to the
workers (the trainer then stops every rank at an agreed step and saves a snapshot), waits
for them, and re-raises the signal as a `SignalException` whose traceback ends the output.
Here that exception ends in one line and exit status 130 instead; a second Ctrl-C, which
interrupts the agent's wait, also kills workers still running (an abort: the newest
snapshot already saved is kept).
"""
from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def _child_pids() -> list[int]:
    """This process's children (the workers), from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces: fields after its closing parenthesis.
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == me:
            found.append(int(entry))
    return found


def cli() -> None:
    try:
        torchrun_main()
    except SignalException as exc:
        leftover = _child_pids()
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        killed = f"; killed {len(leftover)} worker(s) still running" if leftover else ""
        print(f"torchrun: interrupted by {signal.Signals(exc.sigval).name}{killed}", file=sys.stderr, flush=True)
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    cli()
