"""One live run per snapshot location: a lock file (local, FSx) or a lease object (S3).

Two runs writing the same snapshots and metrics (a job submitted twice, a run restarted
by hand while the first still trains) would silently mix their steps. Global rank 0 takes
the lock next to the snapshots (``.<stem>.lock``, e.g. ``.snapshot.lock``) before
anything is loaded, keeps it fresh with a heartbeat, and removes it at the end.

The lock records its owner: host, pid, the job (Slurm job id or torchrun run id) and
since when. A second run is refused with an error naming that owner, unless the lock is

* stale: the owner's process is gone (same host), or its heartbeat is older than
  ``STALE_AFTER_S`` (another host: a SIGKILLed job or a lost node), or
* the same run: the same Slurm job (a requeue) or torchrun run id (a restart of failed
  workers), which takes it over.

Creation is exclusive: ``O_CREAT | O_EXCL`` on local and FSx (Lustre, NFSv3+) paths; on
object stores a conditional PUT (``If-None-Match: *``, s3fs ``mode="create"``), which AWS
S3 honours. A store that ignores the condition (some S3-compatible servers) degrades to
"last writer wins": the lock is read back after writing and a second run that lost the
race is refused, but two runs starting within the same second may both proceed. Other
filesystems (HDFS, SFTP) check existence, then write: the same limitation.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Optional

from mingpt_ddp import storage
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: the owner is dead or cut off


def job_identity() -> Optional[str]:
    """The job this process belongs to, shared by its restarts (None for a bare process)."""
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        array_task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm job {slurm}" + (f"_{array_task}" if array_task else "")
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return f"torchrun run {elastic}"
    if elastic == "none":  # torchrun without a rendezvous id: its agent is the job
        return f"torchrun agent {socket.gethostname()}:{os.getppid()}"
    return None


def _process_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive_here(pid: int, start: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start is None or _process_start(pid) in (None, start)


def describe_owner(owner: dict[str, Any]) -> str:
    job = owner.get("job") or "no Slurm job or torchrun run id"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("started", 0)))
    beat = max(0.0, time.time() - owner.get("heartbeat", 0))
    return f"host {owner.get('host')}, pid {owner.get('pid')}, {job}, since {since}, last heartbeat {beat:.0f}s ago"


class RunLock:
    """The lock of the snapshots at `store` (a SnapshotStore); only global rank 0 takes it."""

    def __init__(self, store, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.fs, self.is_local, self.is_object_store = store.fs, store.is_local, store.is_object_store
        self.path = store._join(f".{store.stem}.lock")
        self.where = store.display(self.path)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.held = False

    def _record(self, started: Optional[float] = None) -> bytes:
        now = time.time()
        return json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
            "job": job_identity(), "started": started or now, "heartbeat": now, "token": self.token,
        }).encode()

    # ---- the store's primitives --------------------------------------------------------
    def _create(self, blob: bytes) -> bool:
        """Write the lock only if there is none; False if there is one."""
        if self.is_local:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            return True
        if self.is_object_store:
            self.fs.invalidate_cache(self.path)
            if self.fs.exists(self.path):  # also right on stores that ignore If-None-Match
                return False
            try:
                self.fs.pipe_file(self.path, blob, mode="create")
            except FileExistsError:
                return False
            except OSError as exc:  # s3fs maps a 412 without its condition name to EINVAL
                if exc.errno == errno.EINVAL:
                    return False
                raise
            return True
        if self.fs.exists(self.path):
            return False
        self.fs.pipe_file(self.path, blob)
        return True

    def _overwrite(self, blob: bytes) -> None:
        if self.is_local:
            tmp = f"{self.path}.{self.token[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        else:
            self.fs.pipe_file(self.path, blob)

    def _read(self) -> Optional[dict[str, Any]]:
        """The owner's record; None if there is no lock; {} if it is unreadable."""
        try:
            if self.is_local:
                with open(self.path, "rb") as f:
                    raw = f.read()
            else:
                self.fs.invalidate_cache(self.path)
                raw = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            owner = json.loads(raw)
            return owner if isinstance(owner, dict) else {}
        except ValueError:
            return {}

    def _remove(self) -> None:
        try:
            self.fs.rm(self.path)
        except FileNotFoundError:
            pass

    # ---- taking and keeping it ------------------------------------------------------------
    def why_not_stale(self, owner: dict[str, Any]) -> Optional[str]:
        """None if `owner` no longer holds the run; else what shows it is alive."""
        age = time.time() - float(owner.get("heartbeat", 0))
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            if not _alive_here(owner["pid"], owner.get("pid_start")):
                return None
            return "its process is alive"
        if age > self.stale_after_s:
            return None
        return "its heartbeat is recent"

    def check_free(self) -> None:
        """Raise the refusal if a live run of another job holds the lock (a read-only check,
        for before anything is written; acquire() is what takes the lock)."""
        owner = self._read()
        if owner and not (job_identity() is not None and owner.get("job") == job_identity()) \
                and self.why_not_stale(owner) is not None:
            raise ConfigError(self._refusal(owner))

    def acquire(self) -> None:
        """Take the lock, or raise a ConfigError naming the live run that holds it."""
        try:
            storage.retry_transient(self._acquire, f"taking the run lock {self.where}", 0.5)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"cannot take the run lock {self.where} ({storage.describe(exc)}): check that "
                              "trainer.snapshot_path / the run directory is writable") from None

    def _acquire(self) -> None:
        mine = job_identity()
        for _ in range(5):
            if self._create(self._record()):
                break
            owner = self._read()
            if owner is None:  # released meanwhile
                continue
            if not owner:  # being written right now, or damaged
                time.sleep(1.0)
                owner = self._read()
                if owner == {}:
                    log.warning("run lock %s is unreadable; replacing it", self.where)
                    self._remove()
                continue
            if mine is not None and owner.get("job") == mine:
                log.info("run lock %s: taking it over from an earlier process of the same job (%s)",
                         self.where, describe_owner(owner))
                self._overwrite(self._record())
                break
            if self.why_not_stale(owner) is None:
                log.warning("run lock %s was left by a run that is gone (%s); taking it over",
                            self.where, describe_owner(owner))
                self._remove()
                continue
            raise ConfigError(self._refusal(owner))
        else:
            raise ConfigError(f"could not take the run lock {self.where} after 5 tries: another run is starting "
                              "in the same place; start one run per run directory / trainer.snapshot_path")
        owner = self._read() or {}
        if owner.get("token") != self.token:  # a store without conditional writes let another run in
            raise ConfigError(self._refusal(owner))
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _refusal(self, owner: dict[str, Any]) -> str:
        return (f"another run is live on these snapshots ({describe_owner(owner)}; lock {self.where}): "
                "wait for it to end or stop it, or use another hydra.run.dir / trainer.snapshot_path. A run that "
                f"died without cleaning up stops blocking once its process is gone or its heartbeat is "
                f"{self.stale_after_s / 60:g} minutes old")

    def _beat(self) -> None:
        started = time.time()
        while not self._stop.wait(self.heartbeat_s):
            try:
                owner = self._read() or {}
                if owner.get("token") != self.token:
                    log.error("run lock %s was taken by another run (%s): two runs now write these snapshots",
                              self.where, describe_owner(owner) if owner else "lock removed")
                    return
                self._overwrite(self._record(started=owner.get("started", started)))
            except Exception as exc:  # a missed heartbeat is not fatal; many in a row make the lock stale
                log.warning("run lock %s: heartbeat failed (%s)", self.where, storage.describe(exc))

    def release(self) -> None:
        """Stop the heartbeat (joined: no thread outlives the run) and remove the lock if ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            owner = self._read()
            if owner and owner.get("token") == self.token:
                self._remove()
        except Exception as exc:
            log.warning("could not remove the run lock %s (%s); the next run will find it stale",
                        self.where, storage.describe(exc))
