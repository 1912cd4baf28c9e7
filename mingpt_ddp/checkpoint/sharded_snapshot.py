"""Sharded snapshots of FSDP runs through torch.distributed.checkpoint (DCP).

API beyond the agreed one (issue 17): ``load()`` returns the snapshot's meta;
``load_latest(sharded)`` (collective) finds, verifies and loads the newest usable snapshot,
falling back past damaged ones; ``verify(where)``; ``save()`` (save_async + wait);
``wait()`` / ``close()`` (call close() before destroying the process group);
``save_retry_minutes`` and ``collective_timeout_minutes`` (constructor). A newer
``save_async`` supersedes a save that is waiting to be retried, so call it without
waiting for the previous handle first.

Layout next to ``trainer.snapshot_path`` (``.../snapshot.pt``)::

    snapshot.pt.dcp/step000000420/
        __0_0.distcp, __1_0.distcp, ...   each rank's shards (DCP)
        .metadata                         DCP's index of the shards (written by rank 0)
        meta.pt                           train state, RNG of every rank, vocab, config (rank 0)
        COMMITTED.json                    the commit marker, written LAST by rank 0

A directory is a snapshot only once its marker exists: rank 0 writes the marker after
every rank has written and hashed its files (DCP's finish step on the coordinator runs
after all ranks' writes; the hashes are gathered afterwards), so a crash mid-save leaves
a directory without a marker, which is never loaded and is removed by a later save.
The marker lists the size and sha256 of every file of the directory; a directory whose
files do not match is skipped with a warning (the previous committed one is used) and,
where a rename is cheap (not on object stores), moved aside as ``step....corrupt``.
On object stores the marker is one PUT, the last object written.

"Newest" is the highest step among the directory names, re-listed from the store each
time (fsspec's listing cache dropped). ``keep_last`` committed snapshots are kept, never
removing the one just committed.

Loading is safe: meta.pt with ``torch.load(weights_only=True)``, shard tensors by DCP
(weights_only), and DCP's ``.metadata`` and non-tensor entries (optimizer param groups)
through restricted unpicklers instead of DCP's plain ``pickle.load`` / ``torch.load``.

Saving runs in a background thread with its own gloo process group (created on the first
save, by every rank), so its collectives never interleave with the training loop's, and
so it works when the training group is NCCL. Training waits only for the copy of the
state to host memory; one save is in flight at a time.

Test hook: ``MINGPT_DDP_TEST_DCP_COMMIT_DELAY=<seconds>`` makes rank 0 sleep after all
shards are written and before the marker (tests kill it there).
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import pickle
import re
import threading
from contextlib import contextmanager
import time
import uuid
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (CheckpointException, DefaultLoadPlanner, FileSystemReader,
                                        FileSystemWriter, TensorStorageMetadata)

try:  # torch's one fsspec reader/writer for DCP, public classes in a private module: no other import path
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # without it: local paths through the public FileSystemReader/Writer, remote ones refused
    FsspecReader, FsspecWriter = FileSystemReader, FileSystemWriter
HAS_FSSPEC_DCP = FsspecReader is not FileSystemReader

from mingpt_ddp import errors
from mingpt_ddp.checkpoint import storage
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.checkpoint.snapshot import SnapshotStore

log = logging.getLogger(__name__)

MARKER = "COMMITTED.json"
META = "meta.pt"
MARKER_FORMAT = 1
COMMIT_DELAY_ENV = "MINGPT_DDP_TEST_DCP_COMMIT_DELAY"
_STEP_DIR = re.compile(r"^step(\d+)$")
_HASH_CHUNK = 8 << 20


class CorruptShardedSnapshot(ConfigError):
    """A committed snapshot directory whose files fail the marker's sizes or checksums (a
    ConfigError: if it reaches the user, it is one line saying which file)."""


# ---- safe unpickling of what DCP pickles --------------------------------------------------
_SAFE_MODULES = {"torch.distributed.checkpoint.metadata"}
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),  # Python 3.13+
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata holds dataclasses, torch.Size, dtypes and paths: nothing else is let in,
    so a crafted file cannot name a function to call."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module in _SAFE_MODULES and not name.startswith("_"):  # its own dataclasses and enums only
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise pickle.UnpicklingError(f"refused to load {module}.{name} from a snapshot's DCP metadata")


def metadata_file_name(rank: Optional[int] = None) -> str:
    """The name DCP gives its index of the shards (torch's private FileSystemReader._get_metadata_path
    says the same; tests/test_torch_floor.py notices if torch renames it)."""
    return ".metadata" if rank is None else f"__{rank}.metadata"


class _SafeReader(FsspecReader):
    """DCP's reader, whose .metadata passes a restricted unpickler before DCP unpickles it.

    The file is read through this store's own fsspec filesystem (`fs`, `directory`), not
    through the reader's internals; DCP then reads the same checked bytes its usual way."""

    def __init__(self, path: str, fs, directory: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._own_fs, self._directory = fs, directory

    def read_metadata(self, *args: Any, **kwargs: Any):
        name = metadata_file_name(kwargs.get("rank"))
        with self._own_fs.open(f"{self._directory}/{name}", "rb") as f:
            _MetadataUnpickler(f).load()  # raises on anything but DCP's own types
        return super().read_metadata(*args, **kwargs)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer param groups) must load with weights_only=True before DCP
    loads them (with plain pickle): the same bytes, so nothing but plain data gets through."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


class _HashingStream:
    """A written file, hashed on the way (DCP writes its shard files front to back); a seek
    voids the hash and the file is read back instead."""

    def __init__(self, stream):
        self._stream, self.sha, self.size, self.sequential = stream, hashlib.sha256(), 0, True

    def write(self, data) -> int:
        written = self._stream.write(data)
        view = memoryview(data).cast("B")
        self.sha.update(view[: len(view) if written is None else written])
        self.size += len(view) if written is None else written
        return written

    def seek(self, *args):
        self.sequential = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _HashingFileSystem:
    """The writer's file system object, with the files it writes hashed on the way; anything
    else passes through to it."""

    def __init__(self, inner, written: dict[str, tuple[int, str]]) -> None:
        self._inner, self.written = inner, written

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path, mode: str):
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        if hashing.sequential:
            self.written[os.fspath(path).rsplit("/", 1)[-1]] = (hashing.size, hashing.sha.hexdigest())


class _HashingWriter(FsspecWriter):
    """DCP's fsspec writer, keeping the size and sha256 of each file as it writes it, so a
    rank need not read its shards back (from S3) to put them in the commit marker. The
    writer's `fs` is DCP's own attribute: without it, the files are read back to hash them."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.written: dict[str, tuple[int, str]] = {}  # file name -> (size, sha256) as written
        inner = getattr(self, "fs", None)
        if callable(getattr(inner, "create_stream", None)):
            self.fs = _HashingFileSystem(inner, self.written)


# ---- helpers ----------------------------------------------------------------------------------
def _sha256_of(fs, path: str) -> tuple[int, str]:
    sha, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                break
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _agree(group, value: Any) -> list[Any]:
    """Every rank's `value`, on every rank (the group's collective; a no-op alone)."""
    if not dist.is_initialized() or _group_size(group) == 1:
        return [value]
    values: list[Any] = [None] * _group_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _from_rank0(group, value: Any) -> Any:
    if not dist.is_initialized() or _group_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


class SaveHandle:
    """One background save. Every rank's wait() returns the same answer: rank 0 tells the
    others whether the snapshot was committed."""

    def __init__(self, step: int, directory: str):
        self.step = step
        self.directory = directory
        self._error: Optional[str] = None
        self.superseded = threading.Event()
        self.committed = False  # True once this snapshot's marker is written (not when superseded)
        self._thread: Optional[threading.Thread] = None

    def _run(self, target) -> None:
        def body() -> None:
            try:
                self._error = target()
            except BaseException as exc:  # never lost silently: wait() reports it
                log.exception("sharded save of step %d failed", self.step)
                self._error = f"saving sharded snapshot {self.directory} failed: {storage.describe(exc)}"

        self._thread = threading.Thread(target=body, daemon=True, name=f"dcp-save-{self.step}")
        self._thread.start()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Optional[str]:
        """Block until the save is committed (None) or has failed (the error text)."""
        if self._thread is not None:
            self._thread.join()
        return self._error


class ShardedSnapshotStore:
    """Sharded (DCP) snapshots of one run: ``<snapshot_path>.dcp/step000000420/`` directories.

    `path` is the run's ``trainer.snapshot_path`` (a local path or any fsspec URL);
    `storage_options` go to fsspec (and to DCP's fsspec reader and writer). Reading a remote
    store retries transient failures for `retry_minutes` (then a ConfigError); a save that
    fails transiently is retried in the background for `save_retry_minutes` (then its
    handle's wait() returns the error, on every rank). The saves' own gloo group gives up
    waiting for a rank after `collective_timeout_minutes` (default: torch's).
    """

    def __init__(self, path: str, keep_last: int = 2, storage_options: Optional[Mapping[str, Any]] = None,
                 retry_minutes: float = 2.0, save_retry_minutes: float = 15.0,
                 collective_timeout_minutes: Optional[float] = None):
        self.url = path
        self.run_lock: Any = None  # rank 0's RunLock (ShardedSaver sets it): lost, nothing is committed
        self.collective_timeout_minutes = collective_timeout_minutes
        self.save_retry_minutes = save_retry_minutes
        self.storage_options = dict(storage_options or {})
        self.keep_last = max(1, keep_last)
        self._files = SnapshotStore(path, keep_last, storage_options, retry_minutes)  # check_writable, hints
        self.fs, path_in_fs = self._files.fs, self._files.path
        self.is_local, self.is_object_store = self._files.is_local, self._files.is_object_store
        if not self.is_local and not HAS_FSSPEC_DCP:
            raise ConfigError(f"sharded snapshots at {path} need torch.distributed.checkpoint's fsspec reader and "
                              f"writer, which torch {torch.__version__} lacks: put trainer.snapshot_path on a local or "
                              "shared filesystem, or use a torch that has them")
        self.retry_minutes = self._files.retry_minutes
        self.root = path_in_fs + ".dcp"
        self._group = None
        self._stager = None
        self._inflight: Optional[SaveHandle] = None

    # ---- what a run asks of its snapshots, whichever store it has (SnapshotStore too) -----
    read_by_rank0 = False  # every rank loads its own shards (and reads the small metadata itself)

    def latest_for_resume(self) -> Optional[tuple[dict[str, Any], str]]:
        """(meta, directory) of the newest committed snapshot on this rank; the shards are
        read by complete(), once the model and optimizer to read them into exist."""
        return self.latest_meta()

    def identity(self, where: str) -> str:
        """What must be the same on every rank resuming from `where`: the snapshot's directory."""
        return where

    def saver(self, save_retry_minutes: float, is_main: bool, run_lock: Any = None) -> "ShardedSaver":
        """Every rank's side of a save: each writes its own shard (save_retry_minutes is the store's)."""
        return ShardedSaver(self, run_lock=run_lock)

    def complete(self, snapshot: dict[str, Any], where: str, strategy: Any, optimizer: Any) -> dict[str, Any]:
        """The snapshot's metadata with this rank's shards of the model and optimizer, read in
        place at this world size (resharded if it changed). Collective."""
        shards = strategy.state_dicts(optimizer)
        self.load(where, shards)
        return {**snapshot, **shards}

    # ---- names --------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return f"{self.root}/step{step:09d}"

    def display(self, path: str) -> str:
        return self._files.display(path)

    def _url(self, path: str) -> str:
        """What DCP's fsspec reader/writer is given: the path with its protocol."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def _in_fs(self, where: str) -> str:
        return where if self.is_local else self.fs._strip_protocol(where)

    def check_writable(self) -> None:
        """The snapshot directory is writable (the .dcp tree lives in it), else a ConfigError."""
        self._files.check_writable()

    # ---- reading ------------------------------------------------------------------------
    def _step_dirs(self) -> list[tuple[int, str]]:
        """(step, directory) of every step directory, committed or not, newest first."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            if entry.get("type") != "directory":
                continue
            m = _STEP_DIR.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if m:
                found.append((int(m[1]), entry["name"].rstrip("/")))
        return sorted(found, reverse=True)

    def _is_committed(self, directory: str) -> bool:
        self.fs.invalidate_cache(directory)
        return self.fs.exists(f"{directory}/{MARKER}")

    def candidates(self) -> list[str]:
        """Committed snapshot directories (display form), newest step first."""
        return self._retrying(lambda: [self.display(d) for _, d in self._step_dirs() if self._is_committed(d)],
                              "listing sharded snapshots")

    def _retrying(self, fn, what: str):
        try:
            return storage.retry_transient(fn, f"{what} at {self.url}", self.retry_minutes)
        except ConfigError:  # CorruptShardedSnapshot included
            raise
        except Exception as exc:
            raise ConfigError(f"cannot read sharded snapshots at {self.url} ({storage.describe(exc)})"
                              f"{self._files._hint(exc, 'read')}") from None

    def read_marker(self, directory: str) -> dict[str, Any]:
        """The commit marker of `directory` (display or in-store form), checked for shape."""
        directory = self._in_fs(directory)
        where = self.display(directory)
        self.fs.invalidate_cache(directory)  # s3fs sizes files from its listing cache before reading
        try:
            marker = json.loads(self.fs.cat_file(f"{directory}/{MARKER}"))
        except FileNotFoundError:
            raise CorruptShardedSnapshot(f"{where}: no commit marker (an unfinished save)") from None
        except ValueError as exc:
            raise CorruptShardedSnapshot(f"{where}: unreadable commit marker ({exc})") from None
        files = marker.get("files") if isinstance(marker, dict) else None
        if (not isinstance(files, dict) or marker.get("format") != MARKER_FORMAT or META not in files
                or ".metadata" not in files
                or not all("/" not in name and name not in (".", "..") for name in files)  # names in this directory
                or not all(isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                           for v in files.values())):
            raise CorruptShardedSnapshot(f"{where}: malformed commit marker")
        m = _STEP_DIR.match(directory.rsplit("/", 1)[-1])
        if not m or int(m[1]) != marker.get("step"):
            raise CorruptShardedSnapshot(f"{where}: the commit marker is for another step ({marker.get('step')})")
        return marker

    def _check_sizes(self, directory: str, marker: dict[str, Any]) -> None:
        """Cheap check: every file the marker lists exists with its size (one listing)."""
        where = self.display(directory)
        self.fs.invalidate_cache(directory)
        sizes = {e["name"].rsplit("/", 1)[-1]: e.get("size") for e in self.fs.ls(directory, detail=True)}
        for name, info in marker["files"].items():
            if name not in sizes:
                raise CorruptShardedSnapshot(f"{where}: {name} is missing")
            if sizes[name] != info["size"]:
                raise CorruptShardedSnapshot(f"{where}: {name} has {sizes[name]} bytes, the marker says {info['size']}")

    def _check_checksums(self, directory: str, names: list[str], marker: dict[str, Any]) -> None:
        where = self.display(directory)
        self.fs.invalidate_cache(directory)
        for name in names:
            try:
                size, digest = _sha256_of(self.fs, f"{directory}/{name}")
            except FileNotFoundError:
                raise CorruptShardedSnapshot(f"{where}: {name} is missing") from None
            if size != marker["files"][name]["size"]:
                raise CorruptShardedSnapshot(f"{where}: {name} is truncated ({size} of "
                                             f"{marker['files'][name]['size']} bytes)")
            if digest != marker["files"][name]["sha256"]:
                raise CorruptShardedSnapshot(f"{where}: checksum mismatch in {name} (modified or damaged)")

    def _read_meta(self, directory: str, marker: dict[str, Any]) -> dict[str, Any]:
        where = self.display(directory)
        self.fs.invalidate_cache(directory)
        try:
            blob = self.fs.cat_file(f"{directory}/{META}")
        except FileNotFoundError:
            raise CorruptShardedSnapshot(f"{where}: {META} is missing") from None
        if len(blob) != marker["files"][META]["size"] or hashlib.sha256(blob).hexdigest() != marker["files"][META]["sha256"]:
            raise CorruptShardedSnapshot(f"{where}: checksum mismatch in {META} (modified or damaged)")
        try:
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CorruptShardedSnapshot(f"{where}: refused to load {META} ({type(exc).__name__}: "
                                         f"{str(exc)[:300]})") from None

    def latest_meta(self) -> Optional[tuple[dict[str, Any], str]]:
        """(meta, directory) of the newest committed snapshot whose marker, file sizes and
        meta.pt checksum are right; None when there is none. The shards' checksums are
        verified by load(). Every committed snapshot damaged: a ConfigError. Not collective:
        where all ranks must take the same decision, use load_latest (or broadcast this)."""
        def find() -> Optional[tuple[dict[str, Any], str]]:
            problems = []
            for _, directory in self._committed():
                try:
                    marker = self.read_marker(directory)
                    self._check_sizes(directory, marker)
                    return self._read_meta(directory, marker), self.display(directory)
                except CorruptShardedSnapshot as exc:
                    log.warning("skipping unusable sharded snapshot %s", exc)
                    problems.append(str(exc))
            self._no_usable(problems)
            return None

        return self._retrying(find, "reading sharded snapshots")

    def _committed(self) -> list[tuple[int, str]]:
        return [(s, d) for s, d in self._step_dirs() if self._is_committed(d)]

    def _no_usable(self, problems: list[str]) -> None:
        if problems:
            raise ConfigError("no usable sharded snapshot: " + "; ".join(problems)
                              + ". Move these directories away to start from scratch, or set trainer.snapshot_path"
                              " elsewhere")

    def verify(self, where: str, process_group=None) -> dict[str, Any]:
        """Collective: every file of `where` against the marker's sizes and sha256, the files
        split over the ranks (each read once in all); the snapshot's meta. Every rank raises
        the same: CorruptShardedSnapshot if any rank found damage, a ConfigError if a rank
        could not read the store (after retrying for `retry_minutes`)."""
        directory = self._in_fs(where)
        where = self.display(directory)
        rank, size = _group_rank(process_group), _group_size(process_group)

        def my_part() -> tuple[Optional[dict[str, Any]], Optional[str]]:
            try:
                marker = self.read_marker(directory)
                meta = self._read_meta(directory, marker)
                self._check_checksums(directory, sorted(marker["files"])[rank::size], marker)
                return meta, None
            except CorruptShardedSnapshot as exc:  # returned, not raised: damage is not retried
                return None, str(exc)

        meta, outcome = None, (None, "")
        try:
            meta, damage = storage.retry_transient(my_part, f"verifying {where}", self.retry_minutes)
            if damage:
                outcome = (damage, "damaged")
        except Exception as exc:
            outcome = (f"cannot read sharded snapshot {where} ({storage.describe(exc)})"
                       f"{self._files._hint(exc, 'read')}", "unreadable")
        outcomes = _agree(process_group, outcome)
        for kind, error in (("unreadable", ConfigError), ("damaged", CorruptShardedSnapshot)):
            found = [text for text, k in outcomes if k == kind]
            if found:
                raise error(found[0])
        return meta

    def load(self, where: str, sharded: dict[str, Any], process_group=None) -> dict[str, Any]:
        """Collective: DCP-load the snapshot at `where` (from latest_meta/candidates) in place
        into `sharded` (this world size's sharded state dicts; DCP reshards), after verify();
        its meta. Raises as verify() does, and a ConfigError (on every rank) if DCP cannot load
        it into `sharded` (another model's snapshot)."""
        try:
            return self._load(where, sharded, process_group)
        except CorruptShardedSnapshot as exc:
            raise CorruptShardedSnapshot(f"{exc}. Move that directory away to resume from the previous snapshot, "
                                         "or set trainer.snapshot_path elsewhere") from None

    def _load(self, where: str, sharded: dict[str, Any], process_group=None) -> dict[str, Any]:
        meta = self.verify(where, process_group)
        try:
            dcp.load(sharded, storage_reader=self._reader(self._in_fs(where)), planner=_SafeLoadPlanner(),
                     process_group=process_group)
        except (Exception, CheckpointException) as exc:  # checksums matched: another model's, or crafted
            raise ConfigError(_unloadable(self.display(self._in_fs(where)), exc)) from None
        return meta

    def load_latest(self, sharded: dict[str, Any], process_group=None) -> Optional[tuple[dict[str, Any], str]]:
        """Collective: load the newest snapshot that passes every check into `sharded`;
        (meta, where), or None when there is none. Damaged ones are skipped with a warning
        (and moved aside by rank 0 where renaming is cheap); all damaged: a ConfigError.
        Rank 0's listing is used by every rank, so all ranks try the same snapshots."""
        rank = _group_rank(process_group)
        listed = _from_rank0(process_group, self._retrying(lambda: [d for _, d in self._committed()],
                                                           "listing sharded snapshots") if rank == 0 else None)
        problems = []
        for directory in listed:
            where = self.display(directory)
            try:
                return self._load(where, sharded, process_group), where
            except CorruptShardedSnapshot as exc:
                log.warning("skipping unusable sharded snapshot %s", exc)
                problems.append(str(exc))
                if rank == 0:
                    self._set_aside(directory, str(exc))
        self._no_usable(problems)
        return None

    def _reader(self, directory: str) -> _SafeReader:
        return _SafeReader(self._url(directory), self.fs, directory, **({} if self.is_local else self.storage_options))

    # ---- writing --------------------------------------------------------------------------
    def _save_group(self):
        """A gloo group of its own for the background thread (collective on first use)."""
        if self._group is None and dist.is_initialized():
            minutes = self.collective_timeout_minutes
            self._group = dist.new_group(backend="gloo", timeout=None if minutes is None else
                                         datetime.timedelta(minutes=minutes))
        return self._group

    def _stage(self, sharded: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            # The state's own device, not torch.cuda.is_available(): a CPU run on a GPU node
            # (trainer.device=cpu) must not open a CUDA context to pin memory.
            cuda = any(getattr(t, "is_cuda", False) for t in _tensors(sharded))
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager.stage(sharded)

    def save_async(self, step: int, sharded: dict[str, Any], meta: dict[str, Any], process_group=None) -> SaveHandle:
        """Collective: stage `sharded` to host memory (what training waits for), then write it
        and commit in the background. `meta` is written by rank 0. Waits for the previous
        save first. `process_group`: a group with a CPU backend that nothing else uses
        meanwhile (default: one gloo group this store creates)."""
        if self._inflight is not None:
            self._inflight.superseded.set()  # a save waiting to be retried gives way to this newer one
            self._inflight.wait()
        group = process_group if process_group is not None else self._save_group()
        rank = _group_rank(group)
        meta_blob = None
        if rank == 0:
            buf = io.BytesIO()
            torch.save(meta, buf)
            meta_blob = buf.getvalue()
        staged = self._stage(sharded)
        directory = self.step_dir(step)
        handle = SaveHandle(step, self.display(directory))
        handle._run(lambda: self._save(step, directory, staged, meta_blob, group, handle))
        self._inflight = handle
        return handle

    def save(self, step: int, sharded: dict[str, Any], meta: dict[str, Any], process_group=None) -> Optional[str]:
        """save_async and wait: None once committed, else the error."""
        return self.save_async(step, sharded, meta, process_group).wait()

    def wait(self) -> Optional[str]:
        """Wait for the save in flight, if any; its error or None."""
        return self._inflight.wait() if self._inflight is not None else None

    def close(self) -> Optional[str]:
        """Wait for the save in flight and free the staging buffers; before the process
        group is destroyed (the save's collectives use it). Its error or None."""
        error = self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        return error

    def _save(self, step: int, directory: str, staged: dict[str, Any], meta_blob: Optional[bytes], group,
              handle: SaveHandle) -> Optional[str]:
        """Attempt the save until it is committed, fails for good, or has failed for
        `save_retry_minutes`; every rank takes the same decisions (each attempt's outcome is
        agreed), so their collectives stay in step. A newer save_async on any rank ends the
        retries: the newer snapshot replaces this one."""
        where = self.display(directory)
        started = time.monotonic()
        for attempt, delay in enumerate(storage.backoff_delays(first=1.0, cap=60.0), start=1):
            error, transient = self._save_once(step, directory, staged, meta_blob, group)
            if error is None:
                handle.committed = True
                if attempt > 1:
                    log.warning("saving sharded snapshot %s worked after %d failed attempts", where, attempt - 1)
                return None
            elapsed = time.monotonic() - started
            if not transient or elapsed + delay > 60 * self.save_retry_minutes:
                if transient:
                    error += (f" (failing for {elapsed:.0f}s, {attempt} attempts; "
                              f"trainer.save_retry_minutes={self.save_retry_minutes:g})")
                return error
            log.warning("%s; retrying in %.0fs while training goes on", error, delay)
            handle.superseded.wait(delay)
            if any(_agree(group, handle.superseded.is_set())):
                log.warning("sharded snapshot %s was not saved; a newer one replaces it", where)
                return None
        raise AssertionError("unreachable")

    def _save_once(self, step: int, directory: str, staged: dict[str, Any], meta_blob: Optional[bytes],
                   group) -> tuple[Optional[str], bool]:
        """One attempt: (error, worth retrying), the same on every rank."""
        rank = _group_rank(group)
        where = self.display(directory)
        # 1. rank 0 clears what an earlier attempt left at this step and writes meta.pt.
        outcome: tuple[Optional[str], bool] = (None, False)
        lost = self.run_lock.confirm() if rank == 0 and self.run_lock is not None else None
        if lost:  # before clearing: a run that lost its lock removes nothing of the new holder's
            outcome = (f"sharded snapshot {where} not saved: {lost}", False)
        elif rank == 0:
            try:
                self._clear_for_save(directory)
                self._write_whole(f"{directory}/{META}", meta_blob)
            except Exception as exc:
                outcome = (f"preparing sharded snapshot {where} failed: {storage.describe(exc)}",
                           _transient(exc))
        outcome = _from_rank0(group, outcome)
        if outcome[0]:
            return outcome
        # 2. every rank writes its shards; DCP raises the same exception on every rank if any failed.
        writer = self._writer(directory)
        try:
            dcp.save(staged, storage_writer=writer, process_group=group)
        except (Exception, CheckpointException) as exc:  # (CheckpointException is a BaseException)
            return f"writing sharded snapshot {where} failed: {_why(exc)}", _transient(exc)
        # 3. every rank lists its own files (hashed as written when the stored size agrees,
        #    else read back); rank 0 commits once it has them all.
        hashed: dict[str, Any] = {}
        try:
            stored = self._files_of_rank(directory, rank)
            if rank == 0:
                stored.update({name: None for name in (".metadata", META)})
            for name, stored_size in stored.items():
                size, digest = writer.written.get(name, (None, None))
                if size is None or size != stored_size:
                    size, digest = _sha256_of(self.fs, f"{directory}/{name}")
                hashed[name] = {"size": size, "sha256": digest}
        except Exception as exc:
            hashed = {"error": f"rank {rank}: hashing its files failed: {storage.describe(exc)}",
                      "transient": _transient(exc)}
        everyone = _agree(group, hashed)
        if rank == 0:
            outcome = self._commit(step, directory, everyone, _group_size(group))
        return _from_rank0(group, outcome)

    def _commit(self, step: int, directory: str, everyone: list[dict[str, Any]],
                world_size: int) -> tuple[Optional[str], bool]:
        where = self.display(directory)
        failed = [h for h in everyone if "error" in h]
        if failed:
            return (f"sharded snapshot {where} not committed: " + "; ".join(h["error"] for h in failed),
                    all(h["transient"] for h in failed))
        files: dict[str, Any] = {}
        for h in everyone:
            files.update(h)
        delay = float(os.environ.get(COMMIT_DELAY_ENV, "0") or 0)
        if delay > 0:
            log.warning("%s=%g: waiting before committing %s (a test hook)", COMMIT_DELAY_ENV, delay, where)
            time.sleep(delay)
        lost = self.run_lock.confirm() if self.run_lock is not None else None
        if lost:  # another run now writes these snapshots: never publish one beside it
            return f"sharded snapshot {where} not committed: {lost}", False
        marker = {"format": MARKER_FORMAT, "step": step, "world_size": world_size, "files": files}
        try:
            self._write_whole(f"{directory}/{MARKER}", json.dumps(marker, indent=1, sort_keys=True).encode())
            if self.is_local:  # the step directory's own entry, before retention removes older ones
                storage.fsync_dir(self.root)
        except Exception as exc:
            return f"committing sharded snapshot {where} failed: {storage.describe(exc)}", _transient(exc)
        log.info("saved sharded snapshot %s (step %d)", where, step)
        try:
            self._apply_retention(step)
        except Exception as exc:  # the snapshot is committed; the next save retries the cleanup
            log.warning("removing old sharded snapshots at %s failed (%s); will retry at the next save",
                        self.url, storage.describe(exc))
        return None, False

    def _writer(self, directory: str) -> _HashingWriter:
        # Object stores: a completed PUT is durable; fsync would fall back to a local os.sync().
        return _HashingWriter(self._url(directory), sync_files=not self.is_object_store,
                              **({} if self.is_local else self.storage_options))

    def _files_of_rank(self, directory: str, rank: int) -> dict[str, int]:
        """{name: stored size} of the shard files `rank` wrote (DCP names them __<rank>_<n>)."""
        pattern = re.compile(rf"^__{rank}_\d+\.distcp$")
        self.fs.invalidate_cache(directory)
        entries = self.fs.ls(directory, detail=True)
        return {name: entry.get("size") for entry in entries
                if pattern.match(name := entry["name"].rstrip("/").rsplit("/", 1)[-1])}

    def _write_whole(self, path: str, blob: bytes) -> None:
        """`path` appears whole or not at all (atomic rename locally, one PUT on object stores)."""
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            storage.write_local_atomically(path, lambda f: f.write(blob))
        elif self.is_object_store:
            self.fs.pipe_file(path, blob)
        else:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(tmp, blob)
            self.fs.mv(tmp, path)

    def _clear_for_save(self, directory: str) -> None:
        """Remove what is at this step's directory: leftovers of an unfinished save, or an
        earlier snapshot of the same step (unpublished first: its marker goes before its files)."""
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(directory):
            return
        if self._is_committed(directory):
            log.warning("replacing sharded snapshot %s of the same step", self.display(directory))
        self._remove(directory)

    def _remove(self, directory: str) -> None:
        marker = f"{directory}/{MARKER}"
        if self.fs.exists(marker):
            self.fs.rm(marker)  # first: a half-removed directory is never taken for a snapshot
        self.fs.rm(directory, recursive=True)
        self.fs.invalidate_cache(self.root)

    def _set_aside(self, directory: str, why: str) -> None:
        """Move a damaged snapshot out of the way where a rename is cheap; on object stores
        (rename = copy) it stays and is skipped each time."""
        if self.is_object_store:
            return
        try:
            self.fs.mv(directory, f"{directory}.corrupt-{uuid.uuid4().hex[:6]}", recursive=True)
            log.warning("moved damaged sharded snapshot aside to %s.corrupt-* (%s)", self.display(directory), why)
        except Exception as exc:
            log.warning("could not move damaged %s aside (%s)", self.display(directory), storage.describe(exc))
        self.fs.invalidate_cache(self.root)

    def _apply_retention(self, step: int) -> None:
        """Keep the `keep_last` highest committed steps and always `step`. A committed
        snapshot above `step` (the run resumed from an older one, so it may be damaged) is
        checked and, if damaged, set aside rather than taking a slot. Unfinished directories
        below `step` are leftovers of crashed saves and are removed."""
        kept_valid = []
        for item_step, directory in self._step_dirs():
            if item_step == step:
                kept_valid.append((item_step, directory))
                continue
            if not self._is_committed(directory):
                if item_step < step:
                    self._remove(directory)
                continue
            if item_step > step:
                try:
                    marker = self.read_marker(directory)
                    self._check_sizes(directory, marker)
                except CorruptShardedSnapshot as exc:
                    self._set_aside(directory, str(exc))
                    continue
            kept_valid.append((item_step, directory))
        keep = {d for _, d in kept_valid[: self.keep_last]} | {self.step_dir(step)}
        for _, directory in kept_valid:
            if directory not in keep:
                self._remove(directory)


def _why(exc: BaseException) -> str:
    """One line: for DCP's CheckpointException (a whole traceback per rank), the first rank's error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = sorted(exc.failures.items(), key=lambda item: item[0])[0]
        return f"rank {rank}: {storage.describe(inner)}"
    return storage.describe(exc)


def _transient(exc: BaseException) -> bool:
    """Worth retrying while training goes on: what storage.is_transient retries, and an
    unknown host or an untrusted certificate too. The store answered at start, so mid-run
    they are a DNS or certificate-rotation hiccup (final at start, where they mean a typo)."""
    if isinstance(exc, CheckpointException):
        return bool(exc.failures) and all(_transient(inner) for inner, _ in exc.failures.values())
    return storage.is_transient(exc) or storage.lasting_network_cause(exc) is not None


def _unloadable(where: str, exc: BaseException) -> str:
    return (f"cannot load sharded snapshot {where} ({_why(exc)}): it was saved by another model or "
            "optimizer configuration, or is not a mingpt-ddp snapshot. Resume with the settings it was saved "
            "with, or set trainer.snapshot_path elsewhere")


# ---- one process, no process group -----------------------------------------------------------
def load_full_model_state(path: str, storage_options: Optional[Mapping[str, Any]] = None
                          ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(full model state_dict of plain tensors, meta) from the newest valid committed snapshot
    of the run whose ``trainer.snapshot_path`` was `path`: one process, no process group
    (sampling, export). Every file is checksummed first; damaged snapshots are skipped."""
    store = ShardedSnapshotStore(path, storage_options=storage_options)

    def find() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        problems = []
        for _, directory in store._committed():
            try:
                marker = store.read_marker(directory)
                store._check_checksums(directory, sorted(marker["files"]), marker)
                meta = store._read_meta(directory, marker)
            except CorruptShardedSnapshot as exc:
                log.warning("skipping unusable sharded snapshot %s", exc)
                problems.append(str(exc))
                continue
            try:
                # Plain tensors shaped as the index says, filled by DCP without a process group.
                reader = store._reader(directory)
                state = {"model": {key[len("model."):]: torch.empty(item.size, dtype=item.properties.dtype)
                                   for key, item in reader.read_metadata().state_dict_metadata.items()
                                   if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}}
                dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=True)
            except (Exception, CheckpointException) as exc:
                raise ConfigError(_unloadable(store.display(directory), exc)) from None
            return state["model"], meta
        store._no_usable(problems)
        raise ConfigError(f"no sharded snapshot at {store.display(store.root)}: train with trainer.strategy=fsdp "
                          "first, or point trainer.snapshot_path at a run that did")

    return store._retrying(find, "reading sharded snapshots")


def is_sharded(path: str, storage_options: Optional[Mapping[str, Any]] = None) -> bool:
    """Does ``<path>.dcp/`` hold committed snapshots?"""
    return bool(ShardedSnapshotStore(path, storage_options=storage_options).candidates())


class ShardedSaver:
    """Every rank's side of saving sharded snapshots (ShardedSnapshotStore above), with
    BackgroundSaver's interface: `submit` stages this rank's shards and returns while they
    are written in the background; at most one save is in flight. `run_lock` (rank 0's
    RunLock): once it is lost, rank 0 commits nothing more and every rank's save fails."""

    # A second save of a step removes its committed directory before the new one is
    # committed (ShardedSnapshotStore._clear_for_save): the trainer saves the last step once.
    replaces_a_step_atomically = False

    def __init__(self, store, run_lock: Any = None):
        self.store = store
        store.run_lock = run_lock
        self._handle = None
        self._error: Optional[str] = None
        self.last_saved: Optional[str] = None  # the newest committed snapshot directory

    def submit(self, state: dict[str, Any], step: int) -> None:
        self._finish_previous()
        sharded = {"model": state.pop("model"), "optimizer": state.pop("optimizer")}
        self._handle = self.store.save_async(step, sharded, state)  # collective: every rank stages its shards

    def _finish_previous(self) -> None:
        if self._handle is not None:
            error = self._handle.wait()
            if self._handle.committed:
                self.last_saved = self._handle.directory
                if dist.is_initialized() and dist.get_rank() == 0 or not dist.is_initialized():
                    errors.record_progress(self._handle.step)  # launch/train.sbatch: the run advanced
            self._error = error or self._error
            self._handle = None

    @property
    def saving(self) -> bool:
        """A save is in flight on this rank."""
        handle = self._handle
        return handle is not None and not handle.done()

    @property
    def failed(self) -> bool:
        """The last save failed on this rank (the store has retried it already)."""
        if self._handle is not None and self._handle.done():
            self._finish_previous()
        return self._error is not None

    @property
    def error(self) -> Optional[str]:
        return self._error

    def wait(self) -> Optional[str]:
        """Block until the save in flight is committed; the error, the same on every rank."""
        self._finish_previous()
        return self._error


def _tensors(tree: Any):
    """The tensors in a nested dict/list state (DTensors count as tensors)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)
