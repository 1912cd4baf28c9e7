"""Snapshots: how one is encoded, where a run's snapshots live, and saving them safely.

A snapshot file is one header line and a ``torch.save`` payload::

    MINGPT-DDP-SNAPSHOT 1 step=<optimizer step> bytes=<payload size> sha256=<payload hash>\\n
    <payload: a dict of tensors and plain types>

The checksum catches truncated and bit-flipped files; the payload is always read with
``torch.load(weights_only=True)``, so a crafted file cannot run code when loaded.

Layout next to ``trainer.snapshot_path`` (``.../snapshot.pt``)::

    snapshot.step000000420.pt   one file per save, named by step, the newest `keep_last` kept
    snapshot.pt                 the newest snapshot (a hard link locally, a copy on S3)

Each file appears whole or not at all: a temp file in the same directory, fsync and
``os.replace`` on local and FSx paths; a single PUT or one completed multipart upload
(``pipe_file`` of the whole serialised bytes) on object stores, where rename is a copy;
a temp name and a rename on other remote filesystems (HDFS, SFTP). "Newest" is decided by
the step numbers in the names and headers, never by listing order or modification times,
and listings are re-read from the store (fsspec's listing cache dropped) each time.

Only global rank 0 writes (through a :class:`BackgroundSaver`), and at a resume on many
ranks only rank 0 reads the snapshot (main.load_agreed_snapshot sends its bytes to the
others over the process group; they read 256 bytes, its header, to prove they see the same
file). A failed
write is retried in the background while training goes on, and the trainer stops the run
once saving has kept failing for ``trainer.save_retry_minutes``.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import threading
import time
import uuid
from typing import Any, BinaryIO, Callable, Mapping, Optional, Union

import torch

from mingpt_ddp.checkpoint import storage
from mingpt_ddp import errors
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)

MAGIC = b"MINGPT-DDP-SNAPSHOT"
FORMAT_VERSION = 1
_HEADER = re.compile(rb"^MINGPT-DDP-SNAPSHOT (\d+) step=(\d+) bytes=(\d+) sha256=([0-9a-f]{64})\n")


class CorruptSnapshot(Exception):
    """A snapshot file that fails its header, length or checksum check, or does not load."""


def _header(step: int, size: int, digest: str) -> bytes:
    # Fixed width (zero-padded numbers, which the header pattern has always accepted), so it
    # can be written before the payload and filled in after it.
    return b"%s %d step=%012d bytes=%015d sha256=%s\n" % (MAGIC, FORMAT_VERSION, step, size, digest.encode())


class _HashingWriter:
    """What torch.save writes to: passed on to the file, counted and hashed on the way."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_encoded(f: BinaryIO, state: dict[str, Any], step: int) -> None:
    """Stream a snapshot (header and payload) into the seekable file `f`: the payload goes
    straight to the file, hashed as it is written, and the header is filled in afterwards.
    No second copy of the state is built in memory."""
    start = f.tell()
    f.write(_header(step, 0, "0" * 64))
    payload = _HashingWriter(f)
    torch.save(state, payload)
    end = f.tell()
    f.seek(start)
    f.write(_header(step, payload.size, payload.sha.hexdigest()))
    f.seek(end)


def encode(state: dict[str, Any], step: int) -> bytes:
    """The whole snapshot as bytes, for stores that take one object (S3's single PUT)."""
    buf = io.BytesIO()
    write_encoded(buf, state, step)
    return buf.getvalue()


def decode(blob: bytes, where: str = "snapshot") -> dict[str, Any]:
    """Verify and unpickle a snapshot; raise CorruptSnapshot saying what is wrong."""
    match = _HEADER.match(blob[:256])
    if not match:
        raise CorruptSnapshot(f"{where}: not a mingpt-ddp snapshot (bad or missing header)")
    version, _, size, digest = int(match[1]), int(match[2]), int(match[3]), match[4].decode()
    if version != FORMAT_VERSION:
        raise CorruptSnapshot(f"{where}: snapshot format {version}, this version reads {FORMAT_VERSION}")
    payload = memoryview(blob)[match.end() :]
    if len(payload) != size:
        raise CorruptSnapshot(f"{where}: truncated ({len(payload)} of {size} payload bytes)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptSnapshot(f"{where}: checksum mismatch (the file was modified or damaged)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refusing a crafted pickle lands here too
        raise CorruptSnapshot(f"{where}: refused to load ({type(exc).__name__}: {str(exc)[:300]})") from None


def header_step(head: bytes) -> Optional[int]:
    match = _HEADER.match(head)
    return int(match[2]) if match else None


def to_cpu(obj: Any, pinned: Optional[dict[tuple, torch.Tensor]] = None) -> Any:
    """A deep copy with every tensor on the CPU: what a background write may safely read
    while training goes on changing the live tensors in place.

    CUDA tensors are copied without blocking into pinned host buffers, then one synchronise
    waits for all of them (instead of hundreds of blocking pageable copies). `pinned` keeps
    those buffers between calls, keyed by their place in `obj`, so later snapshots reuse
    them; the caller must not reuse them while a previous copy is still being read.
    """
    pending = [False]
    copied = _copy_to_cpu(obj, {} if pinned is None else pinned, (), pending)
    if pending[0]:
        torch.cuda.synchronize()
    return copied


def _copy_to_cpu(obj: Any, pinned: dict[tuple, torch.Tensor], where: tuple, pending: list) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            return obj.detach().to("cpu", copy=True)
        buffer = pinned.get(where)
        if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
            buffer = pinned[where] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
        buffer.copy_(obj.detach(), non_blocking=True)
        pending[0] = True
        return buffer
    if isinstance(obj, dict):
        return {k: _copy_to_cpu(v, pinned, where + (k,), pending) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_to_cpu(v, pinned, where + (i,), pending) for i, v in enumerate(obj))
    return obj


class WriteRefused(Exception):
    """A snapshot written but not published: the run lost its lock while writing it."""


class SnapshotStore:
    """The snapshots of one run at `path` (a local path or any fsspec URL).

    `storage_options` go to the fsspec filesystem (e.g. an S3 endpoint or profile).
    On remote stores, reading and the write check retry transient failures (store
    unreachable, throttled) for up to `retry_minutes`, then raise a ConfigError saying
    what failed.
    """

    def __init__(self, path: str, keep_last: int = 2, storage_options: Optional[Mapping[str, Any]] = None,
                 retry_minutes: float = 0.0):
        self.url = path
        self.fs, self.path = storage.filesystem(path, storage_options)
        self.is_local = storage.is_local(self.fs)
        self.is_object_store = storage.is_object_store(self.fs)
        self.keep_last = keep_last
        # A local error (no space, read-only, not a directory) does not go away by retrying.
        self.retry_minutes = 0.0 if self.is_local else retry_minutes
        self.directory, name = self.path.rsplit("/", 1) if "/" in self.path else ("", self.path)
        self.stem, dot, suffix = name.partition(".")
        self.suffix = dot + suffix if dot else ""
        self._history = re.compile(re.escape(self.stem) + r"\.step(\d+)" + re.escape(self.suffix) + "$")
        self.loaded_sha256: Optional[str] = None  # payload checksum of what load_latest() returned
        self.bytes_read = 0  # read from the store by this process (the resume's log line shows every rank's)
        self._kept: Optional[tuple[dict[str, Any], bytes]] = None  # read_newest()'s, until take_kept()
        self._kept_blob: Optional[tuple[bytes, str]] = None

    # ---- what a run asks of its snapshots, whichever store it has (ShardedSnapshotStore too) ----
    def latest_for_resume(self) -> Optional[tuple[dict[str, Any], str]]:
        """(snapshot, where) of the newest snapshot that passes its checksum, on this rank."""
        return self.load_latest()

    def identity(self, where: str) -> str:
        """What must be the same on every rank resuming from `where`: the payload's checksum."""
        return self.loaded_sha256 or where

    def saver(self, save_retry_minutes: float, is_main: bool, run_lock: Any = None) -> Optional["BackgroundSaver"]:
        """Rank 0's background writer; None on the other ranks (one writer, ever)."""
        return BackgroundSaver(self, save_retry_minutes, run_lock=run_lock) if is_main else None

    def complete(self, snapshot: dict[str, Any], where: str, strategy: Any, optimizer: Any) -> dict[str, Any]:
        """The snapshot with everything a resume loads: a whole-model file holds it all already."""
        return snapshot

    # ---- a resume on many ranks: rank 0 reads, the others receive (main.load_agreed_snapshot) ----
    read_by_rank0 = True  # a sharded store's ranks each load their own shards

    def read_newest(self) -> Optional[dict[str, Any]]:
        """Rank 0: load_latest(), its content and bytes kept for take_kept(); returns what the
        other ranks check (peek) and need to receive: step, checksum, path, where, size."""
        found = self.load_latest(keep_bytes=True)
        if found is None:
            return None
        blob, path = self._kept_blob
        self._kept, self._kept_blob = (found[0], blob), None
        return {"step": header_step(blob[:256]), "sha256": self.loaded_sha256, "path": path, "where": found[1],
                "bytes": len(blob)}

    def peek(self, chosen: Optional[dict[str, Any]]) -> Optional[tuple[int, str, str]]:
        """The other ranks: (step, checksum, where) from the header (256 bytes) of the file rank
        0 chose, as this rank's storage has it; where rank 0 found none, of this rank's newest
        file. None where this rank sees no such file: a store not shared by every node."""
        try:
            paths = [chosen["path"]] if chosen is not None else self.candidates()[:1]
            for path in paths:
                match = _HEADER.match(self._cat(path, 0, 256))
                if match:
                    return int(match[2]), match[4].decode(), self.display(path)
        except (FileNotFoundError, IsADirectoryError):
            pass
        return None

    def take_kept(self) -> tuple[dict[str, Any], bytes]:
        """Rank 0: the snapshot read_newest() read, and its bytes to send; forgotten here."""
        kept, self._kept = self._kept, None
        assert kept is not None, "read_newest() first"
        return kept

    def _cat(self, path: str, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
        data = self.fs.cat_file(path, start=start, end=end)
        self.bytes_read += len(data)
        return data

    def _join(self, name: str) -> str:
        return f"{self.directory}/{name}" if self.directory else name

    def step_path(self, step: int) -> str:
        return self._join(f"{self.stem}.step{step:09d}{self.suffix}")

    def display(self, path: str) -> str:
        return self.fs.unstrip_protocol(path) if not self.is_local else path

    # ---- reading -----------------------------------------------------------------
    def _history_steps(self) -> list[tuple[int, str]]:
        # Another process (the writer, or an earlier run) may have changed the directory
        # since this process last listed it: never answer from fsspec's listing cache.
        self.fs.invalidate_cache(self.directory or None)
        try:
            names = self.fs.ls(self.directory or ".", detail=False)
        except FileNotFoundError:
            return []
        found = []
        for full in names:
            m = self._history.match(full.rsplit("/", 1)[-1])
            if m:
                found.append((int(m[1]), full))
        return found

    def may_have_sharded(self) -> bool:
        """False when ``<path>.dcp`` surely does not exist (no FSDP run's sharded snapshots
        beside these files): one look, without importing torch.distributed.checkpoint
        (0.6 s of every run's start). True when it exists or the look failed: then
        sharded_snapshot.is_sharded decides (with its retries and its one-line errors)."""
        target = self.path + ".dcp"
        try:
            self.fs.invalidate_cache(target)
            self.fs.info(target)  # not exists(): fsspec's swallows every error as "absent"
        except FileNotFoundError:
            return False
        except Exception:
            return True
        return True

    def candidates(self) -> list[str]:
        """Existing snapshot files, newest step first (by number, not by listing order)."""
        found = self._history_steps()
        try:
            step = header_step(self._cat(self.path, 0, 256))
        except (FileNotFoundError, IsADirectoryError):
            pass
        else:
            found.append((step if step is not None else -1, self.path))
        # Equal steps: prefer the per-step file, the latest pointer is the same bytes.
        found.sort(key=lambda item: (item[0], item[1] != self.path), reverse=True)
        return [path for _, path in found]

    def load_latest(self, keep_bytes: bool = False) -> Optional[tuple[dict[str, Any], str]]:
        """The newest snapshot that passes its checks, or None when there is none at all
        (`keep_bytes`: its bytes and path kept too, for read_newest).

        A damaged file is skipped with a warning naming it; if every file is damaged,
        a ConfigError: starting from scratch silently would throw the run away. An
        unreachable store is retried for `retry_minutes`, then a ConfigError, for the same
        reason.
        """
        try:
            return storage.retry_transient(lambda: self._load_newest_valid(keep_bytes),
                                           f"reading snapshots at {self.url}", self.retry_minutes)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"cannot read snapshots at {self.url} ({storage.describe(exc)}){self._hint(exc, 'read')}"
            ) from None

    def _load_newest_valid(self, keep_bytes: bool = False) -> Optional[tuple[dict[str, Any], str]]:
        problems = []
        self.loaded_sha256 = None
        for path in self.candidates():
            try:
                blob = self._cat(path)
                state = decode(blob, self.display(path))
            except FileNotFoundError:  # removed by the writer's retention since the listing
                continue
            except CorruptSnapshot as exc:
                log.warning("skipping unusable snapshot %s", exc)
                problems.append(str(exc))
                continue
            self.loaded_sha256 = _HEADER.match(blob[:256])[4].decode()  # which bytes: ranks compare it
            self._kept_blob = (blob, path) if keep_bytes else None
            return state, self.display(path)
        if problems:
            raise ConfigError(
                "no usable snapshot: " + "; ".join(problems)
                + ". Move these files away to start from scratch, or set trainer.snapshot_path elsewhere"
            )
        return None

    def _hint(self, exc: BaseException, doing: str) -> str:
        if isinstance(exc, FileNotFoundError) and not self.is_local:
            return ": the bucket or container does not exist; create it, or set trainer.snapshot_path"
        if isinstance(exc, PermissionError):
            return (f": access denied; check the credentials (AWS_* environment, AWS_PROFILE, instance role) and "
                    f"that they may {doing} this location, or set trainer.snapshot_path")
        if storage.is_transient(exc) and not self.is_local:
            return (f": the store stayed unreachable for trainer.load_retry_minutes={self.retry_minutes:g}; check "
                    "the endpoint (AWS_ENDPOINT_URL or trainer.storage_options), the network and the credentials")
        return ""

    # ---- writing (global rank 0 only) --------------------------------------------
    def check_writable(self) -> None:
        """Fail before training, not at the first save hours later. On object stores a
        missing bucket is an error: it is never created here."""
        probe = self._join(f".{self.stem}.write-test-{uuid.uuid4().hex[:8]}")

        def write_and_remove_probe() -> None:
            if self.directory and not self.is_object_store:
                self.fs.makedirs(self.directory, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm(probe)

        try:
            storage.retry_transient(write_and_remove_probe, f"checking that {self.url} is writable",
                                    self.retry_minutes)
        except Exception as exc:
            hint = self._hint(exc, "write to")
            raise ConfigError(
                f"cannot write snapshots to {self.url} ({storage.describe(exc)}){hint}"
                + ("" if hint else ": set trainer.snapshot_path to a writable location")
            ) from None

    def _write_whole(self, path: str, blob: Union[bytes, Callable[[BinaryIO], None]],
                     confirm: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Write `blob` (bytes, or a function that writes them to a seekable file) so that
        `path` appears whole or not at all. Local files are streamed; other stores get bytes.
        `confirm()`, once the bytes are stored and before they are published, returns why
        they must not be (then WriteRefused, and nothing appears)."""
        if callable(blob) and not self.is_local:
            buf = io.BytesIO()
            blob(buf)
            blob = buf.getvalue()

        def refuse_if_told(written: Optional[str] = None) -> None:
            why = confirm() if confirm is not None else None
            if why and written is not None:
                try:
                    self.fs.rm(written)
                except Exception as exc:
                    log.warning("could not remove %s (%s)", self.display(written), storage.describe(exc))
            if why:
                raise WriteRefused(why)

        if self.is_object_store:
            # One PUT (or one multipart upload, completed at the end): the object appears
            # whole or not at all. Never a rename: on S3 that is a copy and a delete.
            self.fs.pipe_file(path, blob)
            # Already visible: removed, so that no run resumes from it (should the new holder
            # have saved this very step meanwhile, its "latest" copy still holds it).
            refuse_if_told(written=path)
            return
        if not self.is_local:  # HDFS, SFTP, ...: write a temp name, then rename
            tmp = self._join(f".{path.rsplit('/', 1)[-1]}.tmp-{uuid.uuid4().hex[:8]}")
            self.fs.pipe_file(tmp, blob)
            refuse_if_told(written=tmp)
            self.fs.mv(tmp, path)
            return
        storage.write_local_atomically(path, blob if callable(blob) else (lambda f: f.write(blob)),
                                       before_replace=refuse_if_told)

    def _point_latest_at(self, step_file: str) -> None:
        if self.is_object_store:
            self.fs.copy(step_file, self.path)  # server-side copy, whole or nothing
            return
        if not self.is_local:
            self._write_whole(self.path, self.fs.cat_file(step_file))
            return
        tmp = f"{self.path}.link-{uuid.uuid4().hex[:8]}"
        try:
            os.link(step_file, tmp)
            os.replace(tmp, self.path)
        except OSError:  # filesystems without hard links
            with open(step_file, "rb") as f:
                self._write_whole(self.path, f.read())
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        storage.fsync_dir(os.path.dirname(self.path) or ".")

    def save(self, blob: Union[bytes, dict[str, Any]], step: int,
             confirm: Optional[Callable[[], Optional[str]]] = None) -> str:
        """Save an encoded snapshot, or a state dict (streamed into a local file, encoded
        for other stores), as this step's file and the latest. `confirm` (the run lock's):
        asked again once the step's file is written, which can take minutes, and before it is
        published, "latest" pointed at it and older ones removed; a reason to stop drops the
        write (WriteRefused)."""
        step_file = self.step_path(step)
        if isinstance(blob, dict):
            state = blob
            blob = lambda f: write_encoded(f, state, step)  # noqa: E731
        self._write_whole(step_file, blob, confirm)
        self._point_latest_at(step_file)
        try:
            self._apply_retention(step)
        except Exception as exc:  # the snapshot is saved; the next save retries the cleanup
            log.warning("removing old snapshots at %s failed (%s); will retry at the next save",
                        self.url, storage.describe(exc))
        return self.display(step_file)


    def _apply_retention(self, step: int) -> None:
        """Keep the `keep_last` highest steps, and always the snapshot just written.

        A file with a higher step than the one just written is checked: the run may have
        resumed from an older step because that file is damaged. A damaged file never
        takes a slot (that would delete the newest valid snapshot); it is moved aside as
        ``<name>.corrupt`` and reported.
        """
        history = sorted(self._history_steps(), reverse=True)
        valid = []
        for item_step, path in history:
            if item_step > step:
                try:
                    problem = verify(self.fs.cat_file(path), self.display(path))
                except FileNotFoundError:
                    continue
                if problem:
                    self.fs.mv(path, path + ".corrupt")
                    log.warning("moved damaged snapshot aside to %s.corrupt (%s)", self.display(path), problem)
                    continue
            valid.append((item_step, path))
        kept = {path for _, path in valid[: self.keep_last]} | {self.step_path(step)}
        for _, path in valid:
            if path not in kept:
                self.fs.rm(path)


def verify(blob: bytes, where: str = "snapshot") -> Optional[str]:
    """What is wrong with a snapshot's header, length or checksum (None if nothing),
    without unpickling it."""
    match = _HEADER.match(blob[:256])
    if not match or int(match[1]) != FORMAT_VERSION:
        return f"{where}: not a mingpt-ddp snapshot of format {FORMAT_VERSION}"
    payload = memoryview(blob)[match.end() :]
    if len(payload) != int(match[3]):
        return f"{where}: truncated ({len(payload)} of {match[3].decode()} payload bytes)"
    if hashlib.sha256(payload).hexdigest() != match[4].decode():
        return f"{where}: checksum mismatch (the file was modified or damaged)"
    return None


class BackgroundSaver:
    """Writes snapshots in a background thread so training only pauses to copy state.

    At most one write is in flight: a new save first waits for the upload in progress.
    Only global rank 0 ever creates one, so there is never a second writer.

    A failed write is logged (URL and error) and retried with exponential backoff in the
    background while training goes on; a newer snapshot submitted meanwhile replaces the
    one waiting to be retried. Once saving has failed for `retry_minutes` with no success
    in between, `failed` turns true and `error` says why: the trainer then stops every
    rank rather than train on with nothing saved.

    `run_lock` (the RunLock rank 0 holds): once it is lost, no write starts (each attempt
    confirms the lock with the store first), so the run that lost its lock never writes beside the new holder, even
    before the next stop agreement acts on the loss; `error` then says why. A write already
    under way confirms it again before publishing, and is dropped if it was lost meanwhile.
    """

    # A second save of a step replaces its file by a rename: the old one stays until then.
    replaces_a_step_atomically = True

    def __init__(self, store: SnapshotStore, retry_minutes: float = 15.0,
                 clock: Callable[[], float] = time.monotonic, run_lock: Any = None):
        self.store = store
        self.run_lock = run_lock
        self._refused: Optional[str] = None  # the lost lock's message, once a write was refused
        self.retry_minutes = retry_minutes
        self._clock = clock
        self._thread: Optional[threading.Thread] = None
        self._superseded = threading.Event()
        self._failing_since: Optional[float] = None
        self._failures = 0
        self._last_error: Optional[str] = None
        self._bug: Optional[BaseException] = None
        self.last_saved: Optional[str] = None
        self._pinned: dict[tuple, torch.Tensor] = {}  # host buffers for GPU state, reused by every save

    def submit(self, state: dict[str, Any], step: int) -> None:
        """Copy `state` to host memory (the only part training waits for) and write it in
        the background."""
        self._superseded.set()  # a write waiting to be retried gives way to this newer one
        self._join()  # the previous write no longer reads the host buffers reused below
        self._superseded.clear()
        state_on_cpu = to_cpu(state, self._pinned)
        self._thread = threading.Thread(target=self._write, args=(state_on_cpu, step), daemon=True,
                                        name="snapshot-writer")
        self._thread.start()

    @property
    def saving(self) -> bool:
        """A write is in flight (being written or waiting to be retried)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def failed(self) -> bool:
        """Saving has failed for `retry_minutes` without a success in between."""
        since = self._failing_since
        return since is not None and self._clock() - since >= 60 * self.retry_minutes

    @property
    def error(self) -> Optional[str]:
        if self._refused:
            return self._refused
        if not self.failed:
            return None
        minutes = (self._clock() - self._failing_since) / 60
        return (
            f"saving snapshots to {self.store.url} has failed for {minutes:.1f} minutes ({self._failures} attempts; "
            f"trainer.save_retry_minutes={self.retry_minutes:g}), last error: {self._last_error}. Newest snapshot "
            f"saved by this run: {self.last_saved or 'none'}. Fix the storage (endpoint, credentials, permissions, "
            "space) and run the same command to resume from the newest snapshot"
        )

    def _write(self, state: dict[str, Any], step: int) -> None:
        snapshot: Union[bytes, dict[str, Any]] = state  # local files: streamed from the state, per attempt
        if not self.store.is_local:
            try:
                snapshot = encode(state, step)
            except BaseException as exc:  # a bug, not storage: surfaced by the next submit()/wait()
                self._bug = exc
                return
        del state
        where = self.store.display(self.store.step_path(step))
        for delay in storage.backoff_delays(first=1.0, cap=60.0):
            lost = self.run_lock.confirm() if self.run_lock is not None else None
            if lost:
                log.error("snapshot %s not saved: %s", where, lost)
                self._refused = lost
                return
            started = self._clock()
            try:
                confirm = self.run_lock.confirm if self.run_lock is not None else None
                self.last_saved = self.store.save(snapshot, step, confirm)
            except WriteRefused as exc:
                log.error("snapshot %s written but dropped, not published: %s", where, exc)
                self._refused = str(exc)
                return
            except Exception as exc:
                if isinstance(snapshot, dict) and not isinstance(exc, OSError):
                    self._bug = exc  # encoding failed while streaming: a bug, not storage
                    return
                if self._failing_since is None:
                    self._failing_since = started
                self._failures += 1
                self._last_error = storage.describe(exc)
                if self.failed:
                    log.error("saving snapshot %s failed (%s); giving up after trainer.save_retry_minutes=%g",
                              where, self._last_error, self.retry_minutes)
                    return
                left = 60 * self.retry_minutes - (self._clock() - self._failing_since)
                delay = max(0.0, min(delay, left))
                log.warning("saving snapshot %s failed (%s); retrying in %.0fs while training goes on "
                            "(failing for %.0fs; the run stops after trainer.save_retry_minutes=%g)",
                            where, self._last_error, delay, self._clock() - self._failing_since,
                            self.retry_minutes)
                if self._superseded.wait(delay):
                    log.info("snapshot %s was not saved; a newer one replaces it", where)
                    return
                continue
            if self._failing_since is not None:
                log.warning("saving works again after %d failed attempts", self._failures)
            self._failing_since, self._failures = None, 0
            log.info("saved snapshot %s (step %d)", self.last_saved, step)
            errors.record_progress(step)  # launch/train.sbatch: the run advanced
            return

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._bug is not None:
            bug, self._bug = self._bug, None
            raise RuntimeError(f"encoding a snapshot for {self.store.url} failed: {bug}") from bug

    def wait(self) -> Optional[str]:
        """Block until the write in flight is saved (retrying it for up to `retry_minutes`)
        or has failed past that limit; return `error` (None once saved)."""
        self._join()
        return self.error
