"""One live run per snapshot location: a kernel lock where the filesystem has one, a lease
where it has not (S3).

Two runs writing the same snapshots and metrics (a job submitted twice, two srun steps of
one allocation, a restart by hand while the first still trains) would silently mix their
steps. Global rank 0 takes the lock next to the snapshots (``.<stem>.lock``, e.g.
``.snapshot.lock``) before anything is loaded and holds it until the run ends. The lock
records its owner (host, pid, job, since when, a heartbeat every ``HEARTBEAT_S``, the
machine's boot id and PID namespace) for the messages and for the judgements below.

**Kernel lock** (local disks; NFS; Lustre/FSx mounted with ``flock``, FSx's default):
``fcntl.flock`` on the lock file. The kernel, or the filesystem's lock manager, releases it
when its holder dies however it dies, and refuses it to every other process that sees the
file, in any PID namespace or container and on any node. Refused: a live run holds it.
Taken: whoever held it is gone. No pid or clock is guessed at.

**Lease** (S3; filesystems whose flock is missing or local to one node: Lustre ``noflock``
or ``localflock``, FUSE, SMB): the record itself is the lock, renewed by the heartbeat.
Creating it is exclusive (S3: a PUT with ``If-None-Match: *``; files: a hard link, which
fails if the name exists). Its owner is gone when its process is gone (judged only on the
same machine and in the same PID namespace, where a pid means something; two containers
with host networking share a host name, not a PID namespace) or when its heartbeat is
``STALE_AFTER_S`` old. Taking over compares and swaps what was judged (S3: a PUT with
``If-Match`` on the ETag read; files: renaming that very inode aside), so of two runs
taking over one stale lease exactly one wins. Renewing never leaves the lease without its
holder's record, which a run starting then would take (S3: the same PUT with ``If-Match``;
files: a new record renamed over it, while no other run can have judged the holder gone).
A holder that cannot renew its lease for ``STALE_AFTER_S`` less two heartbeats counts it
as lost (before another run may take it).

Either way a Slurm requeue (a higher ``SLURM_RESTART_COUNT``) takes over at once from the
earlier launch, which Slurm ended first; a kernel lock still held for it (a dead node's lock
that NFS or Lustre has not released yet) is waited for ``LINGERING_LOCK_WAIT_S``, then the
run fails as a RunError (requeued again), never as a refusal. torchrun restarting its workers (a higher
``TORCHELASTIC_RESTART_COUNT``) on the same machine takes over from the dead pid; on another
machine, once the earlier restart's lease has missed two heartbeats: a second torchrun with
the same ``--rdzv_id`` counts restarts too, and its refused first try must not make the
second a takeover (check_free leaves such an owner to acquire's watch). Two live steps of one allocation (the same ``SLURM_JOB_ID``) are two runs.

A run that loses its lock (the file removed or replaced under it, the lease taken over or
expired) sees it at its next heartbeat: ``lost`` says why, and the trainer stops every rank
at its next stop agreement with that error, saving nothing more.

Why ``fcntl.flock`` and not the filelock package (which torch installs, at any version):
the owner record lives in the locked file, the errno that says "no flock here" chooses the
lease, and filelock's handling of the file on open and release changed between releases
(older ones truncated it on every attempt). Other fsspec stores (GCS, Azure, HDFS, SFTP):
a lease that checks, writes, then reads back: a second run is refused, but two runs
starting within a second of each other may both pass.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Optional

try:
    import fcntl
except ImportError:  # Windows: leases only
    fcntl = None  # type: ignore[assignment]

from mingpt_ddp.checkpoint import storage
from mingpt_ddp.errors import ConfigError, RunError, UserFacingError

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: the owner is dead or cut off
REFUSE_AFTER_S = 2.0  # a kernel lock held this long by another process: a live run, not a check_free probe
# A Slurm requeue that finds the kernel lock still held for the earlier launch, which Slurm
# ended: a dead node's lock its filesystem has not released yet (NFSv4 and Lustre: within
# their lease or eviction time, a minute or two; NFSv3/NLM: not until that client reboots).
# Waited for this long, then a RunError (exit 4: requeued again), not a refusal.
LINGERING_LOCK_WAIT_S = 300.0

# flock failures that mean "this filesystem has no flock" (Lustre mounted noflock: ENOSYS).
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
# Hard links refused: the lease file is then created with O_EXCL.
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
# Disks only this machine sees: its kernel's lock reaches every process that can open the file.
_LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs", "reiserfs",
                      "tmpfs", "ramfs", "overlay"}
# Shared filesystems whose flock is cluster-wide (NFS too, unless mounted local_lock=flock/all).
_CLUSTER_FLOCK = {"ceph", "gpfs", "ocfs2", "gfs2"}


# ---- who and where ------------------------------------------------------------------------
def job_identity() -> Optional[str]:
    """The job this process belongs to, for messages (None for a bare process)."""
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


def _count(name: str) -> int:
    try:
        return int(os.environ.get(name) or 0)
    except ValueError:
        return 0


def job_instance() -> dict[str, Any]:
    """Which launch of which job this process is: the ids a job's restarts share, and the
    counters that grow with each restart."""
    slurm = os.environ.get("SLURM_JOB_ID") or None
    if slurm and os.environ.get("SLURM_ARRAY_TASK_ID"):
        slurm += "_" + os.environ["SLURM_ARRAY_TASK_ID"]
    elastic = os.environ.get("TORCHELASTIC_RUN_ID") or None
    if elastic == "none":
        elastic = f"agent {socket.gethostname()}:{os.getppid()}"
    return {"slurm_job": slurm, "slurm_restart": _count("SLURM_RESTART_COUNT"),
            "slurm_step": os.environ.get("SLURM_STEP_ID"), "torchrun": elastic,
            "torchrun_restart": _count("TORCHELASTIC_RESTART_COUNT")}


def ended_by_restart(theirs: Any, mine: dict[str, Any]) -> Optional[str]:
    """Why the owner is an earlier launch of this very job, which its launcher ended before
    starting this one; None if it is not (another job, or another live step of this one)."""
    if not isinstance(theirs, dict) or theirs.get("slurm_job") != mine["slurm_job"]:
        return None
    if mine["slurm_job"]:
        if theirs.get("slurm_restart", 0) < mine["slurm_restart"]:
            return f"Slurm requeued job {mine['slurm_job']} (restart {mine['slurm_restart']})"
    return None


def restarted_by_torchrun(theirs: Any, mine: dict[str, Any]) -> bool:
    """Whether the owner is an earlier restart of this torchrun run. Not proof that it
    ended: a second torchrun with the same --rdzv_id on another node counts restarts too
    (its own, after a refusal), so the owner must also have stopped its heartbeat."""
    return (isinstance(theirs, dict) and mine["torchrun"] is not None and theirs.get("torchrun") == mine["torchrun"]
            and theirs.get("torchrun_restart", 0) < mine["torchrun_restart"])


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def machine() -> dict[str, Optional[str]]:
    """Where a pid means something: this kernel (its boot id) and this PID namespace."""
    try:
        pid_ns: Optional[str] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns}


def pids_comparable(owner: dict[str, Any]) -> bool:
    """Whether the owner's pid can be looked up here: same kernel and PID namespace."""
    here = machine()
    if here["boot_id"] is None:  # not Linux (macOS): one PID space per host
        return owner.get("host") == here["host"] and owner.get("boot_id") is None
    return owner.get("boot_id") == here["boot_id"] and owner.get("pid_ns") == here["pid_ns"]


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


def _mount(path: str) -> Optional[tuple[str, set[str]]]:
    """The filesystem type and options of the mount holding `path` (None where there is
    no /proc/self/mountinfo: not Linux)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real, best = os.path.realpath(path), None
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 6 or len(rest) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (best is None or len(point) >= len(best[0])):
            best = (point, rest[0], set(fields[5].split(",")) | set(rest[2].split(",")))
    return (best[1], best[2]) if best else None


def flock_reaches_everyone(directory: str) -> bool:
    """Whether a flock on a file in `directory` is seen by every process that can open that
    file: disks only this machine sees, and shared filesystems with cluster-wide locks."""
    mount = _mount(directory)
    if mount is None:
        return False  # unknown: a lease (a restart on this machine is still judged by its pid)
    fstype, options = mount
    if fstype == "lustre":
        return "flock" in options  # not noflock (no flock at all) nor localflock (this node only)
    if fstype in ("nfs", "nfs4"):
        return not {"local_lock=flock", "local_lock=all"} & options
    return fstype in _CLUSTER_FLOCK or fstype in _LOCAL_FILESYSTEMS


def describe_owner(owner: dict[str, Any]) -> str:
    job = owner.get("job") or "no Slurm job or torchrun run id"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("started", 0)))
    beat = max(0.0, time.time() - owner.get("heartbeat", 0))
    return f"host {owner.get('host')}, pid {owner.get('pid')}, {job}, since {since}, last heartbeat {beat:.0f}s ago"


def _parse(raw: Optional[bytes]) -> dict[str, Any]:
    """The owner's record; {} if there is none or it is unreadable (being written, damaged)."""
    try:
        owner = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _same_file(fd: int, path: str) -> bool:
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)


# A forked child (a DataLoader worker, a helper process) must not keep the kernel lock
# after this process dies: it closes its copies of the locked files at once.
_HELD_FDS: set[int] = set()


def _close_held_in_child() -> None:
    for fd in list(_HELD_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


# ---- leases: create, renew, take over, remove --------------------------------------------------
# Each returns the version it wrote (the record's bytes, an ETag), or None when the store
# shows that someone else got there first.
class _FileLease:
    """A lease file: created whole by a hard link (which fails if the name exists; O_EXCL
    where there are no hard links); taken over by renaming the file aside and keeping it
    aside only if it is the very record judged (else it goes back), then creating the new
    record. Renewed in place (a whole new record renamed over it: the name never goes
    missing, so a run starting meanwhile finds the holder's record and is refused), or,
    when the holder is late, the way a takeover is (see renew).
    A version is the record's bytes (its token and heartbeat make it unique): an inode
    number would be reused by the next file created."""

    def __init__(self, path: str):
        self.path = path

    def _whole_file(self, blob: bytes) -> str:
        tmp = f"{self.path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def read(self) -> tuple[Optional[bytes], Optional[bytes]]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None, None
        return raw, raw

    def create(self, blob: bytes) -> Optional[bytes]:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self._whole_file(blob)
        try:
            return self._link_in(tmp, blob)
        finally:
            os.unlink(tmp)

    def _link_in(self, tmp: str, blob: bytes) -> Optional[bytes]:
        """`tmp` (already written whole) as the record, unless the name exists."""
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return None
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            return self._create_exclusive(blob)
        return blob

    def _create_exclusive(self, blob: bytes) -> Optional[bytes]:
        """Without hard links: O_EXCL, then the record (a reader meanwhile sees it empty and waits)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        return blob

    def take_over(self, blob: bytes, version: Optional[bytes]) -> Optional[bytes]:
        tmp = self._whole_file(blob)  # written before the name goes aside: its gap holds no fsync
        try:
            return self._swap_in(tmp, blob, version)
        finally:
            os.unlink(tmp)

    def _swap_in(self, tmp: str, blob: bytes, version: Optional[bytes]) -> Optional[bytes]:
        aside = f"{self.path}.{uuid.uuid4().hex[:8]}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return None
        try:
            with open(aside, "rb") as f:
                judged = f.read() == version
            if not judged:  # changed since it was judged: put it back
                self._put_back(aside)
                return None
        finally:
            if os.path.lexists(aside):
                os.unlink(aside)
        return self._link_in(tmp, blob)

    def renew(self, blob: bytes, version: Optional[bytes], in_place_until: float = 0.0) -> Optional[bytes]:
        """Replace the record if it is still `version`. Until `in_place_until` (monotonic)
        no other run may have judged the holder gone (its heartbeat is fresh, its process
        alive, and it changed its record within a torchrun restart's two-heartbeat watch), so
        a rename over the record loses nothing: no name-less moment in which a run starting
        would take the lease. Later, a takeover may be under way, which a blind replace would
        overwrite: then the compare-and-swap of a takeover (rename aside, compare, create),
        whose name-less instant a starting run may win (this one then finds its lease lost:
        never two holders)."""
        tmp = self._whole_file(blob)  # the slow part (fsync) before the clock is read
        try:
            if time.monotonic() >= in_place_until:
                return self._swap_in(tmp, blob, version)
            if self.read()[0] != version:
                return None
            os.replace(tmp, self.path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        return blob

    def _put_back(self, aside: str) -> None:
        try:
            os.link(aside, self.path)
        except FileExistsError:
            pass  # a third run created one meanwhile; the owner finds its lease gone
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            if not os.path.lexists(self.path):
                os.rename(aside, self.path)

    def remove(self, version: Optional[bytes]) -> None:
        if self.read()[0] == version:
            os.unlink(self.path)


class _S3Lease:
    """A lease object: conditional PUTs on the ETag (storage.s3_put_if)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def read(self) -> tuple[Optional[bytes], Optional[str]]:
        return storage.s3_read(self.fs, self.path)

    def create(self, blob: bytes) -> Optional[str]:
        return storage.s3_put_if(self.fs, self.path, blob)

    def renew(self, blob: bytes, version: Optional[str], in_place_until: float = 0.0) -> Optional[str]:
        """A PUT with If-Match: replaced in place and only if unchanged, at any time."""
        return self.take_over(blob, version)

    def take_over(self, blob: bytes, version: Optional[str]) -> Optional[str]:
        return storage.s3_put_if(self.fs, self.path, blob, if_match=version) if version else None

    def remove(self, version: Optional[str]) -> None:
        self.fs.rm_file(self.path)


class _CheckThenWriteLease:
    """Other fsspec stores: check, then write (the lock is read back after taking it)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.create_mode = {"mode": "create"} if storage.is_object_store(fs) else {}  # honoured by some (GCS)

    def read(self) -> tuple[Optional[bytes], Optional[bytes]]:
        self.fs.invalidate_cache(self.path)
        try:
            raw = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        return raw, raw

    def create(self, blob: bytes) -> Optional[bytes]:
        self.fs.invalidate_cache(self.path)
        if self.fs.exists(self.path):
            return None
        try:
            self.fs.pipe_file(self.path, blob, **self.create_mode)
        except FileExistsError:
            return None
        return blob

    def take_over(self, blob: bytes, version: Optional[bytes]) -> Optional[bytes]:
        if self.read()[0] != version:
            return None
        self.fs.pipe_file(self.path, blob)
        return blob

    def renew(self, blob: bytes, version: Optional[bytes], in_place_until: float = 0.0) -> Optional[bytes]:
        return self.take_over(blob, version)

    def remove(self, version: Optional[bytes]) -> None:
        self.fs.rm(self.path)


# ---- the lock ----------------------------------------------------------------------------------
class RunLock:
    """The lock of the snapshots at `store` (a SnapshotStore); only global rank 0 takes it.
    `name` (another file in the store's directory), `live` and `writes` (what the messages
    say it guards) and `fix` (the keys that choose another place) serve the other places
    one live run owns: a run directory (run_dir.py), a sweep directory."""

    def __init__(self, store, heartbeat_s: Optional[float] = None, stale_after_s: Optional[float] = None, *,
                 name: Optional[str] = None, live: str = "on these snapshots", writes: str = "these snapshots",
                 fix: str = "hydra.run.dir / trainer.snapshot_path"):
        self.fs, self.is_local = store.fs, store.is_local
        self.path = store._join(name or f".{store.stem}.lock")
        self.where = store.display(self.path)
        self.live, self.writes, self.fix = live, writes, fix
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.stale_after_s = STALE_AFTER_S if stale_after_s is None else stale_after_s
        self.token = uuid.uuid4().hex
        self.held = False
        self.lost: Optional[str] = None  # why this run no longer holds its lock (set by the heartbeat)
        self._fd: Optional[int] = None  # the kernel-locked file, while held
        self._written = 0
        self._version: Any = None  # the lease as this run last wrote it (its bytes, its ETag)
        self._wrote_at = 0.0  # (monotonic) just before this run last wrote its lease record
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self.is_local:
            self._lease: Any = _FileLease(self.path)
        elif storage.is_s3(self.fs):
            self._lease = _S3Lease(self.fs, self.path)
        else:
            self._lease = _CheckThenWriteLease(self.fs, self.path)

    def _kernel_lock_possible(self) -> bool:
        return self.is_local and fcntl is not None and flock_reaches_everyone(os.path.dirname(self.path) or ".")

    def _record(self) -> bytes:
        return json.dumps({
            **machine(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()), "job": job_identity(),
            "instance": job_instance(), "started": self._started, "heartbeat": time.time(), "token": self.token,
            "kernel_lock": self._fd is not None,
        }).encode()

    # ---- judging an owner ------------------------------------------------------------------
    def why_not_stale(self, owner: dict[str, Any]) -> Optional[str]:
        """None if the lease's `owner` no longer holds the run; else what shows it is alive."""
        if pids_comparable(owner) and isinstance(owner.get("pid"), int):
            return "its process is alive" if _alive_here(owner["pid"], owner.get("pid_start")) else None
        if ended_by_restart(owner.get("instance"), job_instance()):
            return None
        if time.time() - float(owner.get("heartbeat", 0)) > self.stale_after_s:
            return None
        return "its heartbeat is recent"

    def _why_gone(self, owner: dict[str, Any]) -> str:
        if pids_comparable(owner) and isinstance(owner.get("pid"), int):
            return "its process is gone"
        restart = ended_by_restart(owner.get("instance"), job_instance())
        return restart or f"its last heartbeat is {time.time() - float(owner.get('heartbeat', 0)):.0f}s old"

    def _refusal(self, owner: dict[str, Any], kernel: bool) -> str:
        who = describe_owner(owner) if owner else "it is starting: its record is not written yet"
        mine = job_instance()
        same_job = (mine["slurm_job"] and isinstance(owner.get("instance"), dict)
                    and owner["instance"].get("slurm_job") == mine["slurm_job"])
        step_hint = ("; two live steps of one Slurm job are two runs: give each srun step its own hydra.run.dir"
                     if same_job else "")
        ends = ("The lock is released the moment that run ends or dies" if kernel else
                "A run that died without cleaning up stops blocking once its process is gone (same machine) or its "
                f"heartbeat is {self.stale_after_s / 60:g} minutes old")
        return (f"another run is live {self.live} ({who}; lock {self.where}): wait for it to end or stop it, "
                f"or use another {self.fix}{step_hint}. {ends}")

    # ---- taking it ---------------------------------------------------------------------------
    def check_free(self, ours: Optional[Any] = None) -> None:
        """Raise the refusal if a live run holds the lock: a read-only look, for before
        anything is written (acquire() is what takes the lock). `ours(owner)`: whether a
        holder is this very run after all (its rank 0, for the other ranks): not refused."""
        if self._kernel_lock_possible():
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: probes do not block each other
                owner = _parse(os.pread(fd, 1 << 16, 0))
                if not owner or owner.get("kernel_lock"):
                    return  # nobody holds the kernel lock: whoever wrote this is gone
            except BlockingIOError:
                owner = self._owner_of_file()
                if (ours is not None and ours(owner)) or ended_by_restart(owner.get("instance"), job_instance()):
                    return  # this run's own rank 0; a lingering lock of the requeued launch: acquire() waits
                raise ConfigError(self._refusal(owner, kernel=True)) from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
            finally:
                os.close(fd)
        owner = _parse(self._lease.read()[0])
        if not owner or self.why_not_stale(owner) is None or (ours is not None and ours(owner)):
            return
        if restarted_by_torchrun(owner.get("instance"), job_instance()):
            return  # maybe ended by torchrun on another node: acquire() watches it for two heartbeats
        raise ConfigError(self._refusal(owner, kernel=False))

    def acquire(self) -> None:
        """Take the lock, or raise a ConfigError naming the live run that holds it (a
        RunError: a lock still held for the earlier launch a Slurm requeue replaces)."""
        if storage.is_s3(self.fs):
            self._require_conditional_writes()
        try:
            storage.retry_transient(self._acquire, f"taking the run lock {self.where}", 0.5,
                                    transient=lambda e: not isinstance(e, UserFacingError) and storage.is_transient(e))
        except UserFacingError:
            raise
        except Exception as exc:
            raise ConfigError(f"cannot take the run lock {self.where} ({storage.describe(exc)}): check that "
                              "trainer.snapshot_path / the run directory is writable") from None

    def _require_conditional_writes(self) -> None:
        if {"IfMatch", "IfNoneMatch"} <= storage.s3_put_parameters():
            return
        import botocore
        import s3fs

        raise ConfigError(
            f"the run lease {self.where} needs S3 conditional writes (If-None-Match, If-Match), which botocore "
            f"{botocore.__version__} (under s3fs {s3fs.__version__}) cannot send, so two runs could both take it: "
            f"{sys.executable} -m pip install -U 's3fs>=2024.12' 'aiobotocore>=2.16'"
        )

    def _acquire(self) -> None:
        self._started = time.time()
        if not (self._kernel_lock_possible() and self._take_kernel_lock()):
            self._take_lease()
        self.held, self.lost = True, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _take_kernel_lock(self) -> bool:
        """Take the kernel lock; False if the filesystem has no flock after all (then a lease)."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        began = time.monotonic()
        refuse_at, lingering = began + REFUSE_AFTER_S, None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < refuse_at:
                    time.sleep(0.1 if lingering is None else 1.0)
                    continue
                owner = self._owner_of_file()
                requeue = ended_by_restart(owner.get("instance"), job_instance())
                if not requeue:
                    raise ConfigError(self._refusal(owner, kernel=True)) from None
                if lingering is None:  # Slurm ended that launch: its lock outlives it somewhere
                    lingering, refuse_at = owner, began + LINGERING_LOCK_WAIT_S
                    log.warning("run lock %s is still held for the earlier launch of this job (%s) although %s: "
                                "a lingering lock of a dead node; waiting up to %.0fs for the filesystem to release "
                                "it", self.where, describe_owner(owner), requeue, LINGERING_LOCK_WAIT_S)
                    continue
                raise RunError(
                    f"the run lock {self.where} is still held for the earlier launch of this job "
                    f"({describe_owner(owner)}) {LINGERING_LOCK_WAIT_S:.0f}s after {requeue}: a lingering lock "
                    "(a dead node's, which NFSv3 keeps until that node reboots, NFSv4 and Lustre until its lease "
                    "or eviction ends); a requeue tries again, or reboot or evict that node to release it"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in _NO_FLOCK:
                    log.info("run lock %s: no flock on this filesystem (%s); using a lease", self.where,
                             os.strerror(exc.errno))
                    return False
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # removed or replaced while we took it: lock the file now there
        owner = _parse(os.pread(fd, 1 << 16, 0))
        if owner and not owner.get("kernel_lock") and self.why_not_stale(owner) is not None:
            os.close(fd)  # a lease's holder (another mount of this filesystem) that is alive
            raise ConfigError(self._refusal(owner, kernel=False))
        if owner:
            log.warning("run lock %s was left by a run that is gone (%s); taking it over", self.where,
                        describe_owner(owner))
        self._fd = fd
        _HELD_FDS.add(fd)
        os.ftruncate(fd, 0)
        self._written = 0
        self._write_in_place(self._record())
        return True

    def _write_in_place(self, blob: bytes) -> None:
        """Rewrite the record in the locked file, never shorter than before, so that a
        reader never sees it cut short (JSON allows the trailing spaces)."""
        padded = blob.ljust(self._written)
        os.pwrite(self._fd, padded, 0)
        os.fsync(self._fd)
        self._written = len(padded)

    def _stopped_beating(self, owner: dict[str, Any], raw: bytes) -> Any:
        """An earlier torchrun restart's lease on another machine (where its pid cannot be
        looked up): watch it for two heartbeats; the version to take over if it did not
        change (torchrun ended it before this restart), else None (a live run)."""
        if not restarted_by_torchrun(owner.get("instance"), job_instance()):
            return None
        time.sleep(2 * self.heartbeat_s + 1)
        again, version = self._lease.read()
        return version if again == raw else None

    def _owner_of_file(self) -> dict[str, Any]:
        """The kernel lock holder's record, for a message (it may be writing it right now)."""
        for _ in range(10):
            owner = _parse(self._lease.read()[0])
            if owner:
                return owner
            time.sleep(0.1)
        return {}

    def _take_lease(self) -> None:
        for _ in range(5):
            self._wrote_at = time.monotonic()
            version = self._lease.create(self._record())
            if version is None:
                raw, version = self._lease.read()
                if raw is None:  # released meanwhile
                    continue
                owner = _parse(raw)
                if not owner:  # being written (check-then-write stores), or damaged
                    time.sleep(1.0)
                    again, version = self._lease.read()
                    if again != raw:
                        continue
                    log.warning("run lock %s is unreadable; replacing it", self.where)
                elif self.why_not_stale(owner) is not None:
                    version = self._stopped_beating(owner, raw)
                    if version is None:
                        raise ConfigError(self._refusal(owner, kernel=False))
                    log.warning("run lock %s: its owner, an earlier restart of this torchrun run (%s), stopped its "
                                "heartbeat; taking it over", self.where, describe_owner(owner))
                else:
                    log.warning("run lock %s was left by a run that is gone (%s: %s); taking it over", self.where,
                                describe_owner(owner), self._why_gone(owner))
                self._wrote_at = time.monotonic()
                version = self._lease.take_over(self._record(), version)
                if version is None:  # another run changed it first: look again
                    continue
            break
        else:
            raise ConfigError(f"could not take the run lock {self.where} after 5 tries: another run is starting "
                              f"in the same place; start one run per {self.fix}")
        raw, self._version = self._lease.read()
        owner = _parse(raw)
        if owner.get("token") != self.token:  # a store without compare-and-swap let another run in
            raise ConfigError(self._refusal(owner, kernel=False))
        if isinstance(self._lease, _S3Lease) and storage.s3_put_if(self.fs, self.path, self._record()) is not None:
            self._version = self._lease.read()[1]
            log.warning("the S3 store of %s ignores If-None-Match (conditional writes): two runs started within a "
                        "second of each other may both take the run lock", self.where)

    # ---- keeping it --------------------------------------------------------------------------
    def _beat(self) -> None:
        # Counted lost two heartbeats before another run may judge it stale: this run stops
        # saving before anyone else can start.
        lost_after = max(self.heartbeat_s, self.stale_after_s - 2 * self.heartbeat_s)
        while not self._stop.wait(self.heartbeat_s):
            try:
                why = self._renew()
            except Exception as exc:  # a missed heartbeat is not fatal; many in a row let the lease expire
                late = time.monotonic() - self._wrote_at
                if self._fd is not None or late < lost_after:
                    log.warning("run lock %s: heartbeat failed (%s)", self.where, storage.describe(exc))
                    continue
                why = (f"its lease could not be renewed for {late:.0f}s "
                       f"({storage.describe(exc)}), so another run may take it")
            if why:
                self._mark_lost(why)
                return

    def _mark_lost(self, why: str) -> None:
        self.lost = (f"lost the run lock {self.where}: {why}. This run stops without saving again, so that "
                     f"one run alone writes {self.writes}")

    def confirm(self) -> Optional[str]:
        """Check now, not at the next heartbeat, that the lock is still this run's; why it
        is not, or None. A saver calls it just before each write: steps can be far shorter
        than a heartbeat, and a run must not save even once beside the run that took over.
        Only a record naming another run counts here: a lease file can be briefly absent
        (a late renewal, another run's takeover attempt that puts it back), so absence, like
        a store that cannot be read, is left to the heartbeat to judge."""
        if self.lost or not self.held:
            return self.lost
        try:
            why = self._taken_from_us()
        except Exception as exc:
            log.warning("run lock %s: could not check it before saving (%s)", self.where, storage.describe(exc))
            return None
        if why:
            self._mark_lost(why)
        return self.lost

    def _taken_from_us(self) -> Optional[str]:
        """Why the lock no longer is this run's, read without writing; None if it still is
        or nothing shows otherwise."""
        if self._fd is not None:
            return self._kernel_lock_gone()
        owner = _parse(self._lease.read()[0])
        if owner and owner.get("token") != self.token:
            return f"another run took it over ({describe_owner(owner)})"
        return None

    def _kernel_lock_gone(self) -> Optional[str]:
        if _same_file(self._fd, self.path):
            return None
        owner = _parse(self._lease.read()[0])
        return "the lock file was removed or replaced" + (
            f"; it is now held by another run ({describe_owner(owner)})" if owner else "")

    def _renew(self) -> Optional[str]:
        """Refresh the heartbeat; why the lock is no longer this run's, or None."""
        if self._fd is not None:
            why = self._kernel_lock_gone()
            if why:
                return why
            self._write_in_place(self._record())
            return None
        started, blob = time.monotonic(), self._record()
        # In place while no other run can have judged this one gone: a torchrun restart
        # elsewhere watches for two heartbeats (and 1 s) without a change before it takes over.
        version = self._lease.renew(blob, self._version, in_place_until=self._wrote_at + 2 * self.heartbeat_s)
        if version is None:
            raw, version = self._lease.read()
            for _ in range(10):  # absent: another run's takeover attempt may be putting it back
                if raw is not None:
                    break
                time.sleep(0.1)
                raw, version = self._lease.read()
            owner = _parse(raw)
            if owner.get("token") != self.token:
                return f"another run took it over ({describe_owner(owner)})" if owner else "the lock was removed"
            if raw != blob:  # ours as written before (put back): renewed at the next heartbeat
                self._version = version
                return None
            # else our own write went through; its reply was lost
        self._version, self._wrote_at = version, started
        return None

    def raise_if_lost(self) -> None:
        """For after the run: a lock lost since the last stop agreement is still an error."""
        if self.lost:
            raise RunError(self.lost)

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
            if self._fd is not None:
                if _same_file(self._fd, self.path):
                    os.unlink(self.path)  # while still locked: a waiter then finds the name gone and retries
            elif not self.lost:
                raw, version = self._lease.read()
                if _parse(raw).get("token") == self.token:
                    self._lease.remove(version)
        except Exception as exc:
            log.warning("could not remove the run lock %s (%s); the next run will find it stale",
                        self.where, storage.describe(exc))
        finally:
            if self._fd is not None:
                _HELD_FDS.discard(self._fd)
                os.close(self._fd)
                self._fd = None


class Locks:
    """The locks one run holds together (its snapshots', its run directory's), as the trainer
    and the savers see one: lost when any is (the first loss says why)."""

    def __init__(self, *locks: Optional[RunLock]):
        self.locks = [lock for lock in locks if lock is not None]

    @property
    def lost(self) -> Optional[str]:
        return next((lock.lost for lock in self.locks if lock.lost), None)

    def confirm(self) -> Optional[str]:
        for lock in self.locks:
            why = lock.confirm()
            if why:
                return why
        return None

    def raise_if_lost(self) -> None:
        for lock in self.locks:
            lock.raise_if_lost()
