"""torchrun, with the multi-machine rendezvous hosted where it should be and failures in one line.

    python -m mingpt_ddp.torchrun --standalone --nproc_per_node=2 mingpt_ddp/main.py [overrides]
    mingpt-torchrun --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=10.0.0.1:29500 ... main.py

Takes exactly torchrun's arguments. Differences:

- **Who hosts the rendezvous.** torchrun hosts the c10d rendezvous store only where the
  endpoint matches what this machine's *host name* resolves to; on a machine with several
  interfaces (EFA nodes, containers) the endpoint is another interface's address, nobody
  hosts the store and every node times out. Here, when the endpoint is one of this
  machine's addresses and `--rdzv_conf` says nothing about `is_host`, this process takes
  the port itself and tells torchrun it hosts the store. Taking the port is atomic: when
  several "machines" share one host, the first to start hosts and the others join it.
- **Failures in one line.** A rendezvous that fails (head unreachable, nodes missing, a
  node gone, the network to the head cut: a node that does not host the rendezvous checks
  every few seconds that the host answers, and stops after the rendezvous' read_timeout
  without an answer instead of blocking in a store call until TCP gives up, ~15 minutes)
  ends in one `error:` line naming the endpoint and what to check, not in
  torchrun's traceback and the C++ frames of c10d's store (the agent's C++ log is kept
  to fatal messages; the workers' is left alone). Workers that failed after reporting
  their own `error:` line (or died of a signal) get a one-line summary; a worker that
  raised (a bug) keeps torchrun's failure summary with its traceback.
- **The exit code says the error's class** (`exit_code_for`): 2 when a worker recorded a
  ConfigError, else 1 when a worker crashed without a record (a signal other than the
  agent's SIGTERM, or a traceback), else 4 when one recorded a RunError (mingpt_ddp.errors.record, in its
  torchelastic error file), whichever worker exited first and whatever the others died of
  when the agent stopped them; without a record, a class's code when every failed worker
  exited with it; else 1. Plain torchrun exits 1 for any failed worker.
- **Ctrl-C.** torchrun's agent forwards SIGINT to the workers (the trainer then stops every
  rank at an agreed step and saves a snapshot), waits for them, and re-raises the signal
  as a `SignalException`; here that ends in one line and exit status 128 + the signal; a
  second Ctrl-C, which interrupts the agent's wait, also kills workers still running (an
  abort: the newest snapshot already saved is kept).
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

from mingpt_ddp import errors
from mingpt_ddp.tools import network

# c10d's rendezvous default port (torch.distributed.elastic.rendezvous.c10d_rendezvous_backend).
DEFAULT_RDZV_PORT = 29400
RDZV_FAILED_EXIT = 1


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


def say(message: str) -> None:
    print(f"mingpt-torchrun: {message}", file=sys.stderr, flush=True)


def _import_torch_quietly() -> None:
    """Import torch with the agent's C++ log at FATAL (its store errors reach Python as
    exceptions, reported here in one line), then give the workers the user's setting."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = before or "FATAL"
    import torch.distributed.run  # noqa: F401  (c10's log level is read once, at import)

    if before is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not port.isdigit() or "]" in port:  # "host" or "[::1]"
        return endpoint.strip().strip("[]"), DEFAULT_RDZV_PORT
    return host.strip("[]"), int(port)


def _rdzv_conf(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in filter(None, (p.strip() for p in text.split(","))) if "=" in part)


def host_rendezvous_if_local(args: Any) -> Optional[Any]:
    """When the c10d endpoint is this machine's and is_host is not given: host the store
    (return it: it must live as long as the agent) and set is_host=1; if another process on
    this machine already holds the port, set is_host=0 and join it."""
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    conf = _rdzv_conf(args.rdzv_conf or "")
    if "is_host" in conf:
        return None
    host, port = _split_endpoint(args.rdzv_endpoint)
    if not network.is_local(host):
        return None
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=int(conf.get("read_timeout", 60)))
    try:
        # multi_tenant: torchrun's own TCPStore(is_master=True, multi_tenant=True) for this port,
        # in this process, reuses this server instead of binding the port again.
        store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timeout)
        conf["is_host"] = "1"
        say(f"hosting the rendezvous at {host}:{port} (run id {args.rdzv_id})")
    except RuntimeError as exc:
        if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc):
            raise
        store = None
        conf["is_host"] = "0"
        say(f"port {port} on {host} is already taken on this machine: joining the rendezvous hosted there "
            "(another node of this job on the same host; if not, give every node another RDZV_PORT)")
    args.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())
    return store


def watch_rendezvous_host(args: Any, interval_s: float = 5.0) -> Optional[threading.Thread]:
    """On a node that does not host the rendezvous: end this agent, in one line, when the
    rendezvous host has been unreachable for the rendezvous' read_timeout.

    torchrun's agent asks the rendezvous store about other nodes every few seconds; when
    the network to the head is cut (no FIN or RST arrives) such a call blocks until TCP
    itself gives up, about 15 minutes on Linux, while the workers have long failed. A TCP
    connect to the endpoint every `interval_s`, after a first one succeeded, notices the
    cut within seconds."""
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    conf = _rdzv_conf(args.rdzv_conf or "")
    if conf.get("is_host", "").lower() in ("1", "true", "yes", "y", "on"):
        return None
    host, port = _split_endpoint(args.rdzv_endpoint)
    limit = float(conf.get("read_timeout", 60))

    def watch() -> None:
        last_ok = None
        while True:
            try:
                with socket.create_connection((host, port), timeout=min(interval_s, limit)):
                    last_ok = time.monotonic()
            except OSError as exc:
                if last_ok is not None and time.monotonic() - last_ok > limit:
                    say(f"error: the rendezvous at {host}:{port} (run id {args.rdzv_id}) has been unreachable from "
                        f"{socket.gethostname()} for {limit:.0f} s ({exc.strerror or exc}): the head node or the "
                        "network to it is gone; this node's workers are stopped")
                    for pid in _child_pids():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
                    os._exit(RDZV_FAILED_EXIT)  # the agent's own thread is blocked in a store call
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, daemon=True, name="rendezvous-host-watch")
    thread.start()
    return thread


def _first_line(exc: BaseException) -> str:
    """The innermost cause's message, first line (c10d's messages carry C++ frames after it)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def rendezvous_failure(exc: BaseException, args: Any) -> str:
    """One line for a rendezvous (or rendezvous store) failure, naming what to check."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    endpoint = args.rdzv_endpoint or "localhost"
    where = f"the rendezvous at {endpoint} (run id {args.rdzv_id}) failed on {socket.gethostname()}"
    cause = _first_line(exc) or ("timed out" if isinstance(exc, RendezvousTimeoutError) else type(exc).__name__)
    if isinstance(exc, RendezvousTimeoutError):
        advice = ("not every node joined in time: check that each node runs with the same NNODES "
                  f"({args.nnodes}), RDZV_PORT and RUN_ID, that they start within the rendezvous timeout of each "
                  "other, and that no node has left the job")
    else:
        advice = (f"check that the head node runs, that {endpoint.rpartition(':')[0] or endpoint} is its address as "
                  "seen from this machine, that the port is open between the machines, and that the head has not "
                  "left the job (its log says why)")
    return f"error: {where}: {cause}: {advice}"


def left_a_traceback(failure: Any) -> bool:
    """The worker wrote an error file of an uncaught exception (@record). torch fills a
    missing file's record with the message "<NONE>", which is no traceback; nor is the
    record of a ConfigError or RunError (mingpt_ddp.errors.record)."""
    message = failure.error_file_data.get("message")
    return bool(message) and message != "<NONE>" and errors.recorded_class(failure.error_file_data) is None


# The signals torchrun's agent stops the other workers with once one has failed: a worker that
# died of one of these was stopped, not the cause.
AGENT_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Deaths that are the symptom of another's failure, not a crash of their own: NCCL's watchdog
# aborts a process whose peer or link was lost (a remote error or a collective timeout is
# rethrown on its thread: std::terminate, SIGABRT), which a requeue mends.
PEER_LOSS_SIGNALS = (signal.SIGABRT,)
# The agent SIGTERMs the other workers when one fails and SIGKILLs those still there 30 s later
# (torch.distributed.elastic.multiprocessing.api: _close(timeout=30)); a worker blocked in a CUDA
# sync or an NCCL collective never runs its SIGTERM handler. Failures seen before the agent's
# close carry the time they were seen, those it killed the time of the kill, so a SIGKILL this
# much later than the first failure is the agent's, not the kernel's OOM killer's.
AGENT_KILL_AFTER_S = 20


def crashed(failure: Any, failures: dict[int, Any]) -> bool:
    """A worker that died without recording a class: with a traceback (a bug, CUDA out of
    memory), or killed by a signal neither its agent nor NCCL's watchdog sends (the kernel's OOM
    killer, SIGSEGV). `failures`: every failure of the try, to tell the agent's late SIGKILL."""
    if errors.recorded_class(failure.error_file_data) is not None:
        return False
    if left_a_traceback(failure):
        return True
    if failure.exitcode >= 0 or -failure.exitcode in AGENT_STOP_SIGNALS + PEER_LOSS_SIGNALS:
        return False
    first = min(f.timestamp for f in failures.values())
    return not (-failure.exitcode == signal.SIGKILL and failure.timestamp - first >= AGENT_KILL_AFTER_S)


def exit_code_for(failures: dict[int, Any]) -> int:
    """This node's exit code, from the class each failed worker recorded, not from the first
    exit code: the first worker to exit makes the agent stop the others (SIGTERM: they die
    of it, exit 0 after a snapshot, or lose their peers, exit 3), whoever that was.
    ConfigError's code (2) when any worker recorded one; else RDZV_FAILED_EXIT (1) when a
    worker crashed (`crashed`: the others' RunErrors, e.g. a wait for it that ran out, are its
    symptoms, and a crash is not requeued at once); else RunError's (4) when any recorded
    that; without a record (an exit before main() could record, e.g. a tool's usage error, or
    an error file that could not be written) a class's code when every failed worker exited
    with it; else 1: a lost peer, a signal, a bug."""
    recorded = {errors.recorded_class(f.error_file_data) for f in failures.values()}
    codes = {f.exitcode for f in failures.values()}
    for cls in errors.CLASSES:
        if cls is errors.RunError and any(crashed(f, failures) for f in failures.values()):
            return RDZV_FAILED_EXIT
        if cls in recorded or codes == {cls.exit_code}:
            return cls.exit_code
    return RDZV_FAILED_EXIT


def workers_failed(exc: Any) -> Optional[str]:
    """One line for workers that failed without a traceback of their own: they exited with a
    code after printing their own `error:` line, or died of a signal. None when one of them
    left a traceback (a bug): torchrun's summary shows it."""
    if any(left_a_traceback(f) for f in exc.failures.values()):
        return None
    parts = []
    for rank, f in sorted(exc.failures.items()):
        how = (f"died of {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}")
        parts.append(f"rank {rank} (local rank {f.local_rank}) {how}")
    return (f"error: worker(s) on {socket.gethostname()} failed: {', '.join(parts)}; no restarts left "
            "(their own `error:` lines above say why)")


USAGE = "usage: mingpt-torchrun [torchrun's options] mingpt_ddp/main.py [overrides]"


def parse_args(argv: list[str]):
    """torchrun's own parser (its --help, exit 0), but a bad option is one `error:` line, exit 2,
    not argparse's usage of 30 lines first."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "mingpt-torchrun"

    def error(message: str) -> None:
        print(f"error: {message} ({USAGE}; --help lists torchrun's options)", file=sys.stderr, flush=True)
        raise SystemExit(errors.ConfigError.exit_code)
    parser.error = error
    return parser.parse_args(argv)


def cli(argv: Optional[list[str]] = None) -> None:
    _import_torch_quietly()
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    # On the failure paths the rendezvous logs warnings ("failed to shutdown the rendezvous ...
    # RendezvousConnectionError") that the one line below says better.
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").setLevel(logging.ERROR)
    try:
        store = host_rendezvous_if_local(args)  # noqa: F841  (kept alive while the agent runs)
        watch_rendezvous_host(args)
        run(args)
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
    except (RendezvousError, DistError) as exc:
        say(rendezvous_failure(exc, args))
        sys.exit(RDZV_FAILED_EXIT)
    except ChildFailedError as exc:
        if any(crashed(f, exc.failures) for f in exc.failures.values()):  # a signal (OOM killer) leaves no record of its own
            errors.record_crash(args.max_restarts)  # the last try: its restarts are spent
        line = workers_failed(exc)
        if line is None:
            raise
        say(line)
        sys.exit(exit_code_for(exc.failures))


if __name__ == "__main__":
    cli()
