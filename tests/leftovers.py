"""Nothing a test run starts outlives it: Slurm daemons, munged, the S3 servers, torchrun agents and
their workers, HTTP servers.

Fixtures stop what they start, but only when their teardown runs: a SIGTERM from a time limit ended
pytest at once (Python's default), and a SIGKILL or a crash never tears down, so daemons on fixed
ports broke the next run. Every process a test run starts inherits MINGPT_TEST_RUN=<pytest pid>:
<its start time> from the environment (daemons that detach included: they keep their environment),
which lets the run find them in /proc whoever their parent is now. The run
- turns SIGTERM and SIGHUP into KeyboardInterrupt after killing what it started, so pytest still
  tears its fixtures down and reports;
- kills whatever still carries its mark when it ends, however it ends (pytest_unconfigure);
- at its start, kills what carries the mark of a run that is gone (one that was SIGKILLed).
Loaded by tests/conftest.py, or as a plugin (`-p leftovers`), which the test of it uses.
"""
from __future__ import annotations

import os
import signal
import time

MARK = "MINGPT_TEST_RUN"
_MARK_PREFIX = (MARK + "=").encode()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/<pid>/stat): a pid and this
    name one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[19].decode()


def _marks() -> dict[int, str]:
    """pid -> its MINGPT_TEST_RUN value, for every live process that has one (root reads every
    process's environment; a user, its own)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            if var.startswith(_MARK_PREFIX):
                found[int(entry)] = var[len(_MARK_PREFIX):].decode(errors="replace")
                break
    return found


def _owner_alive(mark: str) -> bool:
    pid, _, started = mark.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == started


def _ancestors() -> set[int]:
    """This process and its parents: never ours to kill (a test run started by another one)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError):
            break
    return pids


def kill_marked(which, grace: float = 5.0) -> list[int]:
    """SIGTERM every process whose mark `which(mark)` selects, SIGKILL those still there after
    `grace` seconds; returns the pids it signalled."""
    if not os.path.isdir("/proc"):
        return []
    spared = _ancestors()
    targets = {pid: _start_time(pid) for pid, mark in _marks().items() if which(mark) and pid not in spared}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [pid for pid, started in targets.items() if started and _start_time(pid) == started]
        for pid in live:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while live and time.monotonic() < deadline:
            time.sleep(0.1)
            live = [pid for pid in live if _alive(pid, targets[pid])]
        if not live:
            break
    return sorted(targets)


def _alive(pid: int, started: str | None) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0] != b"Z" and fields[19].decode() == started


_own_mark: str | None = None


def _stop_on_signal(signum, frame):
    """A time limit's SIGTERM (or a closed terminal's SIGHUP): kill what this run started first
    (a SIGKILL may follow soon), then let pytest tear down and report as after Ctrl-C."""
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the teardown short
    kill_marked(lambda mark: mark == _own_mark, grace=2.0)
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def pytest_configure(config):
    global _own_mark
    if not os.path.isdir("/proc") or hasattr(config, "workerinput"):
        return
    left = kill_marked(lambda mark: not _owner_alive(mark))
    if left:
        print(f"tests: stopped {len(left)} process(es) an earlier, killed test run left behind")
    _own_mark = f"{os.getpid()}:{_start_time(os.getpid())}"
    os.environ[MARK] = _own_mark
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_on_signal)


def pytest_unconfigure(config):
    if _own_mark is not None:
        kill_marked(lambda mark: mark == _own_mark)
