"""Check the run (or sweep) directory before Hydra writes into it; one live run per run
directory, one live sweep per sweep directory.

Hydra creates ``hydra.run.dir`` and writes ``.hydra/`` and ``main.log`` there before any
of our code runs; an unwritable directory (a typo, a read-only mount) would end in three
of Hydra's own ``FileNotFoundError`` tracebacks. This callback (registered in
conf/config.yaml) runs first and answers with one line naming the key to change.

The snapshots' lock (run_lock.py) covers a run directory only where the snapshots are;
a run with another ``trainer.snapshot_path`` would still write the live run's ``.hydra/``
and ``metrics.jsonl``. So rank 0 also holds ``<run dir>/.run.dir.lock`` (a RunLock: a
kernel lock, or a lease where the filesystem has no cluster-wide flock), taken before
Hydra writes anything for a single run, and for a sweep point as its run begins (Hydra has
written the point's ``.hydra/`` by then: a refused point puts back what was there).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import uuid
from typing import Any, Optional

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from mingpt_ddp.checkpoint import storage
from mingpt_ddp.errors import ConfigError, UserFacingError, record


def check_writable_dir(path: str, key: str) -> None:
    """Create `path` if needed and prove a file can be written there, or raise a ConfigError.
    A URL is refused: Hydra would create a local directory named after it (./s3:/bucket/run)."""
    kind = "sweep" if "sweep" in key else "run"
    if "://" in path:
        raise ConfigError(
            f"{key}={path} is a URL, but the {kind} directory must be a filesystem path (Hydra writes .hydra/ and "
            f"main.log there, and would create a local directory named after the URL): set {key}=<a local or "
            "shared directory>; to keep the snapshots on S3, set trainer.snapshot_path=s3://<bucket>/<path>/snapshot.pt"
        )
    probe = os.path.join(path, f".write-test-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"cannot write to the {kind} directory {path} "
            f"({exc.strerror or type(exc).__name__}): set {key}=<a writable directory>"
        ) from None


RUN_DIR_LOCK = ".run.dir.lock"  # never a snapshot's `.<stem>.lock`: a stem holds no dot
_held: dict[str, tuple[int, Any]] = {}  # run directory (absolute): (pid, the RunLock that process holds there)


def _run_dir_lock(run_dir: str, key: str) -> Any:
    from mingpt_ddp.checkpoint.run_lock import RunLock
    from mingpt_ddp.checkpoint.snapshot import SnapshotStore

    return RunLock(SnapshotStore(os.path.join(run_dir, "run")), name=RUN_DIR_LOCK,
                   live=f"in the run directory {run_dir}", writes="this run directory", fix=key)


def _same_launch(owner: dict[str, Any]) -> bool:
    """Whether the holder may be this process's own rank 0: nothing shows another launch
    (another Slurm job or step, another torchrun run). Lenient: rank 0 judges for itself."""
    from mingpt_ddp.checkpoint.run_lock import job_instance

    theirs, mine = owner.get("instance"), job_instance()
    if not isinstance(theirs, dict):
        return not owner  # a record being written: rank 0 decides
    if (theirs.get("slurm_job"), theirs.get("slurm_step")) != (mine["slurm_job"], mine["slurm_step"]):
        return False
    agents = [str(t).startswith("agent ") for t in (theirs.get("torchrun"), mine["torchrun"])]
    return theirs.get("torchrun") == mine["torchrun"] or all(agents)  # no rdzv id: one agent per node


def hold_run_dir(run_dir: str, key: str = "hydra.run.dir") -> None:
    """One live run per run directory: rank 0 takes its lock (held until release_run_dir or
    the process ends), or raises the ConfigError naming the live run there. The other ranks
    only look, refusing a live run of another launch (their own rank 0 may hold it already)."""
    root = os.path.abspath(run_dir)
    if root in _held:
        return
    lock = _run_dir_lock(root, key)
    if _rank() != 0:
        lock.check_free(ours=_same_launch)
        return
    lock.check_free()  # a live run: refused at once, as the other ranks are (acquire waits 2 s to be sure;
    # an earlier launch of this job: acquire judges it, watching a lease, waiting for a lingering lock)
    lock.acquire()
    _held[root] = (os.getpid(), lock)


def held_lock(run_dir: str) -> Optional[Any]:
    """The run directory's lock this process holds (rank 0), else None."""
    pid, lock = _held.get(os.path.abspath(run_dir), (None, None))
    return lock if pid == os.getpid() else None


def release_run_dir(run_dir: Optional[str] = None) -> None:
    """Release the lock of `run_dir` (all of them: None) that this process holds (not one
    its parent held: a forked child exiting leaves the parent's lock alone)."""
    for root in [os.path.abspath(run_dir)] if run_dir else list(_held):
        pid, lock = _held.pop(root, (None, None))
        if lock is not None and pid == os.getpid():
            lock.release()


atexit.register(release_run_dir)  # a run ended by an error or a signal too (the kernel lock ends with it anyway)


def refuse_a_live_run(config: DictConfig) -> None:
    """A live run of another job in this (local) run directory: refuse before Hydra writes
    its `.hydra/` files over the live run's. Object stores are checked by the trainer."""
    from mingpt_ddp.checkpoint.run_lock import RunLock
    from mingpt_ddp.checkpoint.snapshot import SnapshotStore

    path = config.trainer.get("snapshot_path") or os.path.join(str(config.hydra.run.dir), "snapshot.pt")
    if "://" in str(path) and not str(path).startswith("file://"):
        return
    RunLock(SnapshotStore(str(path))).check_free()


def take_the_sweep_lock(config: DictConfig) -> Optional[Any]:
    """One live sweep per sweep directory: before Hydra writes multirun.yaml or any point's
    files, refuse if a point's run is live there (every rank looks), and let rank 0 hold
    ``<sweep dir>/.sweep.lock`` (a RunLock) until the sweep ends, so that a second sweep is
    refused between points too. Returns the lock (rank 0), else None."""
    from mingpt_ddp.checkpoint.run_lock import RunLock
    from mingpt_ddp.checkpoint.snapshot import SnapshotStore

    sweep_dir = str(config.hydra.sweep.dir)
    try:
        for point in sorted(os.scandir(sweep_dir), key=lambda e: e.name):
            if point.is_dir():
                RunLock(SnapshotStore(os.path.join(point.path, "snapshot.pt"))).check_free()
                _run_dir_lock(point.path, "hydra.sweep.dir").check_free()
        if _rank() != 0:  # the other ranks' processes follow rank 0's sweep
            return None
        lock = RunLock(SnapshotStore(os.path.join(sweep_dir, "sweep")))
        lock.acquire()
    except ConfigError as exc:
        raise ConfigError(f"another sweep is live in hydra.sweep.dir {sweep_dir}: {exc}; "
                          "or set hydra.sweep.dir=<another directory>") from None
    atexit.register(lock.release)  # a sweep ended by a signal or an error too
    return lock


REPORT_GRACE_S = 3.0
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
_earlier_hydra_files: dict[str, bytes] = {}  # path: what an earlier run left there, read before Hydra writes


def remember_hydra_files(run_dirs: list[str], output_subdir: Optional[str]) -> None:
    """Keep the `.hydra/` files an earlier run left in these run directories: Hydra writes
    this run's config over them before any check, and a run refused (another model under
    the same snapshots) or already finished must leave them describing the run that is there."""
    if not output_subdir:
        return
    for run_dir in run_dirs:
        for name in HYDRA_FILES:
            path = os.path.join(run_dir, output_subdir, name)
            try:
                with open(path, "rb") as f:
                    _earlier_hydra_files[os.path.abspath(path)] = f.read()
            except OSError:
                pass


def keep_hydra_files(run_dir: str) -> None:
    """The run in `run_dir` has begun training: its `.hydra/` files describe it from now on,
    so the earlier run's are forgotten (restore_hydra_files then leaves them)."""
    root = os.path.abspath(run_dir)
    for path in [p for p in _earlier_hydra_files if os.path.dirname(os.path.dirname(p)) == root]:
        del _earlier_hydra_files[path]


def restore_hydra_files(run_dir: str) -> None:
    """Put back the `.hydra/` files remembered for `run_dir` (nothing if it had none, or
    once keep_hydra_files was called for it)."""
    root = os.path.abspath(run_dir)
    for path, blob in _earlier_hydra_files.items():
        if os.path.dirname(os.path.dirname(path)) == root:
            storage.write_local_atomically(path, lambda f, blob=blob: f.write(blob))


# Run directories (absolute) this launch created, each with the highest of its parents it
# created too (outputs/ on a first run): a refused run takes them away again.
_made: dict[str, str] = {}
LOG_FILE = "main.log"


def _launch_started() -> Optional[float]:
    """When torchrun's agent (this worker's parent) started, in epoch seconds (Linux), else None."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


MADE_MARK = ".made-by"  # in a run directory a launch made: which launch (remove_if_refused)


def _launch_id() -> str:
    """The same on every rank of one launch on a node, another for a relaunch under the same
    run id: torchrun's run id and its agent's start, or this process alone."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun {run_id} {_launch_started()}" if run_id else f"pid {os.getpid()}"


def note_if_new(run_dir: str) -> None:
    """Before anything writes there: whether this launch makes `run_dir`. The rank whose mkdir
    makes it marks it with this launch's id, so rank 0 knows it also when another rank of the
    launch was first. A directory that was there before (a user's, an earlier attempt's under
    the same run id) is never counted: nothing of it is ever taken away."""
    if "://" in run_dir:  # a URL: refused next (check_writable_dir), never made here as ./s3:/...
        return
    root = os.path.abspath(run_dir)
    if os.path.exists(root):
        try:
            with open(os.path.join(root, MADE_MARK), encoding="utf-8") as f:
                if f.read() == _launch_id():
                    _made[root] = root
        except OSError:
            pass
        return
    top = root
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        os.mkdir(root)
    except OSError:  # another rank made it a moment ago (its mark may follow), or it cannot be made
        return None
    with open(os.path.join(root, MADE_MARK), "w", encoding="utf-8") as f:
        f.write(_launch_id())
    _made[root] = top


def remove_if_refused(run_dir: str, output_subdir: Optional[str]) -> bool:
    """A run refused before it trained (a ConfigError at start): rank 0 takes away the run
    directory this launch made, when it holds nothing but what Hydra wrote (`.hydra/`,
    main.log), the launch's mark and its own lock, so that a typo leaves no empty
    outputs/<run id>/ behind. Never a sweep's (the caller's test), never a directory that was
    there before. The lock is let go last: no other launch writes there meanwhile. Whether it went."""
    root = os.path.abspath(run_dir)
    if _rank() != 0 or root not in _made:
        return False
    hydra_dir = os.path.join(root, output_subdir) if output_subdir else None
    try:
        if set(os.listdir(root)) - {LOG_FILE, output_subdir, MADE_MARK, RUN_DIR_LOCK}:
            return False
        if hydra_dir and os.path.isdir(hydra_dir) and set(os.listdir(hydra_dir)) - set(HYDRA_FILES):
            return False
        for name in HYDRA_FILES:
            if hydra_dir and os.path.exists(os.path.join(hydra_dir, name)):
                os.unlink(os.path.join(hydra_dir, name))
        if hydra_dir and os.path.isdir(hydra_dir):
            os.rmdir(hydra_dir)
        for name in (LOG_FILE, MADE_MARK):
            if os.path.exists(os.path.join(root, name)):
                os.unlink(os.path.join(root, name))
        release_run_dir(root)
        os.rmdir(root)  # fails, leaving it, if anything appeared meanwhile
        parent, top = root, _made.pop(root)
        while parent != top and not os.listdir(os.path.dirname(parent)):  # outputs/, made for this run alone
            parent = os.path.dirname(parent)
            os.rmdir(parent)
    except OSError:
        return False
    return True


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _refuse(exc: UserFacingError) -> None:
    """Exit as main() does for a ConfigError (code 2) or a RunError (4: a lock still held for
    the launch a Slurm requeue replaces): recorded for the launchers, one line from rank 0. The other ranks (no process group yet to agree through) give rank 0 a moment to
    print it: a launcher that sees one of them exit first stops rank 0 at once, its line unprinted."""
    message = storage.redact(str(exc))
    record(exc, message)
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(REPORT_GRACE_S)
    sys.exit(exc.exit_code)


class RunDirCheck(Callback):
    """Hydra callback: refuse an unwritable run or sweep directory, or one where another run
    is live, before Hydra uses it; rank 0 holds a single run's directory from then on."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage.redact_logs()
        try:
            note_if_new(str(config.hydra.run.dir))
            check_writable_dir(str(config.hydra.run.dir), "hydra.run.dir")
            refuse_a_live_run(config)
            hold_run_dir(str(config.hydra.run.dir))
        except UserFacingError as exc:
            _refuse(exc)
        remember_hydra_files([str(config.hydra.run.dir)], config.hydra.output_subdir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage.redact_logs()
        try:
            check_writable_dir(str(config.hydra.sweep.dir), "hydra.sweep.dir")
            self._sweep_lock = take_the_sweep_lock(config)
        except UserFacingError as exc:
            _refuse(exc)
        sweep_dir = str(config.hydra.sweep.dir)
        remember_hydra_files([e.path for e in os.scandir(sweep_dir) if e.is_dir()], config.hydra.output_subdir)

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that pickle the callbacks with each job (submitit) take no lock along:
        # the sweep lock stays with the process that holds it (its heartbeat thread cannot pickle).
        return {k: v for k, v in self.__dict__.items() if k != "_sweep_lock"}

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        release_run_dir(str(config.hydra.runtime.output_dir))  # a sweep's next point may be elsewhere
        if config.hydra.mode == RunMode.MULTIRUN:
            # What the next points' directories hold now: a run started in one of them since
            # the sweep began gets its files back if that point is refused.
            sweep_dir = str(config.hydra.sweep.dir)
            remember_hydra_files([e.path for e in os.scandir(sweep_dir) if e.is_dir()], config.hydra.output_subdir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        lock = getattr(self, "_sweep_lock", None)
        if lock is not None:
            lock.release()
