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
from mingpt_ddp.errors import ConfigError


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


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _refuse(exc: ConfigError) -> None:
    """Exit as main() does for a ConfigError: one line from rank 0, code 2."""
    if _rank() == 0:
        print(f"error: {storage.redact(str(exc))}", file=sys.stderr, flush=True)
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

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage.redact_logs()
        try:
            check_writable_dir(str(config.hydra.sweep.dir), "hydra.sweep.dir")
            self._sweep_lock = take_the_sweep_lock(config)
        except ConfigError as exc:
            _refuse(exc)

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that pickle the callbacks with each job (submitit) take no lock along:
        # the sweep lock stays with the process that holds it (its heartbeat thread cannot pickle).
        return {k: v for k, v in self.__dict__.items() if k != "_sweep_lock"}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        lock = getattr(self, "_sweep_lock", None)
        if lock is not None:
            lock.release()
