"""Check the run (or sweep) directory before Hydra writes into it; one live sweep per
sweep directory.

Hydra creates ``hydra.run.dir`` and writes ``.hydra/`` and ``main.log`` there before any
of our code runs; an unwritable directory (a typo, a read-only mount) would end in three
of Hydra's own ``FileNotFoundError`` tracebacks. This callback (registered in
conf/config.yaml) runs first and answers with one line naming the key to change.
"""
from __future__ import annotations

import atexit
import os
import sys
import uuid
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from mingpt_ddp.checkpoint import storage
from mingpt_ddp.errors import ConfigError, record


def check_writable_dir(path: str, key: str) -> None:
    """Create `path` if needed and prove a file can be written there, or raise a ConfigError."""
    probe = os.path.join(path, f".write-test-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"cannot write to the {'sweep' if 'sweep' in key else 'run'} directory {path} "
            f"({exc.strerror or type(exc).__name__}): set {key}=<a writable directory>"
        ) from None


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
        if _rank() != 0:  # the other ranks' processes follow rank 0's sweep
            return None
        lock = RunLock(SnapshotStore(os.path.join(sweep_dir, "sweep")))
        lock.acquire()
    except ConfigError as exc:
        raise ConfigError(f"another sweep is live in hydra.sweep.dir {sweep_dir}: {exc}; "
                          "or set hydra.sweep.dir=<another directory>") from None
    atexit.register(lock.release)  # a sweep ended by a signal or an error too
    return lock


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


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _refuse(exc: ConfigError) -> None:
    """Exit as main() does for a ConfigError: recorded for the launchers, one line from rank 0, code 2."""
    message = storage.redact(str(exc))
    record(exc, message)
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(ConfigError.exit_code)


class RunDirCheck(Callback):
    """Hydra callback: refuse an unwritable run or sweep directory before Hydra uses it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage.redact_logs()
        try:
            check_writable_dir(str(config.hydra.run.dir), "hydra.run.dir")
            refuse_a_live_run(config)
        except ConfigError as exc:
            _refuse(exc)
        remember_hydra_files([str(config.hydra.run.dir)], config.hydra.output_subdir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage.redact_logs()
        try:
            check_writable_dir(str(config.hydra.sweep.dir), "hydra.sweep.dir")
            self._sweep_lock = take_the_sweep_lock(config)
        except ConfigError as exc:
            _refuse(exc)
        sweep_dir = str(config.hydra.sweep.dir)
        remember_hydra_files([e.path for e in os.scandir(sweep_dir) if e.is_dir()], config.hydra.output_subdir)

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that pickle the callbacks with each job (submitit) take no lock along:
        # the sweep lock stays with the process that holds it (its heartbeat thread cannot pickle).
        return {k: v for k, v in self.__dict__.items() if k != "_sweep_lock"}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        lock = getattr(self, "_sweep_lock", None)
        if lock is not None:
            lock.release()
