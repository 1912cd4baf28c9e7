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
``os.replace`` on local and FSx paths; a single PUT (``pipe_file``) on object stores.
"Newest" is decided by the step numbers in the names and headers, never by listing
order or modification times.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import threading
import uuid
from typing import Any, Optional

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)

MAGIC = b"MINGPT-DDP-SNAPSHOT"
FORMAT_VERSION = 1
_HEADER = re.compile(rb"^MINGPT-DDP-SNAPSHOT (\d+) step=(\d+) bytes=(\d+) sha256=([0-9a-f]{64})\n")


class CorruptSnapshot(Exception):
    """A snapshot file that fails its header, length or checksum check, or does not load."""


def encode(state: dict[str, Any], step: int) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    header = b"%s %d step=%d bytes=%d sha256=%s\n" % (MAGIC, FORMAT_VERSION, step, len(payload), digest.encode())
    return header + payload


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


def to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor on the CPU: what a background write may safely read
    while training goes on changing the live tensors in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


class SnapshotStore:
    """The snapshots of one run at `path` (a local path or any fsspec URL)."""

    def __init__(self, path: str, keep_last: int = 2):
        self.url = path
        self.fs, self.path = fsspec.core.url_to_fs(path)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.keep_last = keep_last
        self.directory, name = self.path.rsplit("/", 1) if "/" in self.path else ("", self.path)
        self.stem, dot, suffix = name.partition(".")
        self.suffix = dot + suffix if dot else ""
        self._history = re.compile(re.escape(self.stem) + r"\.step(\d+)" + re.escape(self.suffix) + "$")

    def _join(self, name: str) -> str:
        return f"{self.directory}/{name}" if self.directory else name

    def step_path(self, step: int) -> str:
        return self._join(f"{self.stem}.step{step:09d}{self.suffix}")

    def display(self, path: str) -> str:
        return self.fs.unstrip_protocol(path) if not self.is_local else path

    # ---- reading -----------------------------------------------------------------
    def _history_steps(self) -> list[tuple[int, str]]:
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

    def candidates(self) -> list[str]:
        """Existing snapshot files, newest step first (by number, not by listing order)."""
        found = self._history_steps()
        if self.fs.exists(self.path):
            with self.fs.open(self.path, "rb") as f:
                step = header_step(f.read(256))
            found.append((step if step is not None else -1, self.path))
        # Equal steps: prefer the per-step file, the latest pointer is the same bytes.
        found.sort(key=lambda item: (item[0], item[1] != self.path), reverse=True)
        return [path for _, path in found]

    def load_latest(self) -> Optional[tuple[dict[str, Any], str]]:
        """The newest snapshot that passes its checks, or None when there is none at all.

        A damaged file is skipped with a warning naming it; if every file is damaged,
        a ConfigError: starting from scratch silently would throw the run away.
        """
        candidates = self.candidates()
        problems = []
        for path in candidates:
            try:
                state = decode(self.fs.cat_file(path), self.display(path))
            except CorruptSnapshot as exc:
                log.warning("skipping unusable snapshot %s", exc)
                problems.append(str(exc))
                continue
            return state, self.display(path)
        if problems:
            raise ConfigError(
                "no usable snapshot: " + "; ".join(problems)
                + ". Move these files away to start from scratch, or set trainer.snapshot_path elsewhere"
            )
        return None

    # ---- writing (global rank 0 only) --------------------------------------------
    def check_writable(self) -> None:
        """Fail before training, not at the first save hours later."""
        probe = self._join(f".{self.stem}.write-test-{uuid.uuid4().hex[:8]}")
        try:
            if self.directory:
                self.fs.makedirs(self.directory, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm(probe)
        except Exception as exc:
            raise ConfigError(
                f"cannot write snapshots to {self.url} ({type(exc).__name__}: {exc}): "
                "set trainer.snapshot_path to a writable location"
            ) from None

    def _write_whole(self, path: str, blob: bytes) -> None:
        if not self.is_local:
            self.fs.pipe_file(path, blob)  # one PUT: the object appears whole or not at all
            return
        directory = os.path.dirname(path) or "."
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(directory)

    def _point_latest_at(self, step_file: str) -> None:
        if not self.is_local:
            self.fs.copy(step_file, self.path)  # server-side copy, whole or nothing
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
        _fsync_dir(os.path.dirname(self.path) or ".")

    def save(self, blob: bytes, step: int) -> str:
        step_file = self.step_path(step)
        self._write_whole(step_file, blob)
        self._point_latest_at(step_file)
        for old_step, old in sorted(self._history_steps(), reverse=True)[self.keep_last :]:
            self.fs.rm(old)
        return self.display(step_file)


def _fsync_dir(directory: str) -> None:
    """Make a rename durable: without this a power loss can undo it on some filesystems."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class BackgroundSaver:
    """Writes snapshots in a background thread so training only pauses to copy state.

    At most one write is in flight: a new save first waits for the previous one. Only
    global rank 0 ever creates one, so there is never a second writer.
    """

    def __init__(self, store: SnapshotStore):
        self.store = store
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last_saved: Optional[str] = None

    def submit(self, state_on_cpu: dict[str, Any], step: int) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(state_on_cpu, step), daemon=True)
        self._thread.start()

    def _write(self, state: dict[str, Any], step: int) -> None:
        try:
            self.last_saved = self.store.save(encode(state, step), step)
            log.info("saved snapshot %s (step %d)", self.last_saved, step)
        except BaseException as exc:  # surfaced by wait() in the training thread
            self._error = exc

    def wait(self) -> None:
        """Block until the write in flight is done; re-raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"saving a snapshot to {self.store.url} failed: {error}") from error
