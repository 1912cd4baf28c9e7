"""Records which process writes snapshot files, via Python's audit hooks (PEP 578).

Put this directory on PYTHONPATH and set MINGPT_AUDIT_LOG: every file opened for writing,
renamed, replaced or linked whose path mentions "snapshot" is logged with the writer's
RANK. Observes the real processes; nothing in the trainer is replaced.
"""
import os
import sys

_log_path = os.environ.get("MINGPT_AUDIT_LOG")
if _log_path:
    _fd = os.open(_log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _rank = os.environ.get("RANK", "single")
    _busy = False

    def _record(event, args):
        global _busy
        if _busy:
            return
        paths = []
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
            if writing:
                paths = [path]
        elif event in ("os.rename", "os.link", "os.remove"):
            paths = [args[0], args[1]] if event != "os.remove" else [args[0]]
        names = [str(p) for p in paths if "snapshot" in str(p)]
        if names:
            _busy = True
            try:
                os.write(_fd, f"{_rank} {os.getpid()} {event} {' '.join(names)}\n".encode())
            finally:
                _busy = False

    sys.addaudithook(_record)
