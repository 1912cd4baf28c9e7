"""The exceptions a user is told about in one line, not with a traceback.

Raised identically on every rank (or decided on rank 0 and shared), caught once at the top
of ``main``: the rank that hit it prints the message, every rank exits with its class's code
(ConfigError 2, RunError 4) and no traceback is shown. Bugs are neither and keep their
traceback. Before exiting, each process records its class (`record`), because the exit code
that reaches a scheduler is often another process's: torchrun stops the other workers once
one exits, srun --kill-on-bad-exit the other nodes (reported as 143).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Optional

# Set by launch/train.sbatch: a directory, one per job and requeue, where every process creates
# try-<n>/ when it starts (n: torchrun's TORCHELASTIC_RESTART_COUNT, the step's try) and a file
# named after its class in it when it ends with a ConfigError or RunError, and where rank 0
# keeps the step of the newest snapshot it saved (PROGRESS_FILE). The batch script reads them
# after the step: the classes of the last try only, and whether the run made progress.
STEP_ERRORS_ENV = "MINGPT_STEP_ERRORS"
PROGRESS_FILE = "snapshot_step"
CRASH_FILE = "Crashed"  # record_crash: a worker of that try crashed (not a class: no exit code of its own)
# The key of the torchelastic error file (TORCHELASTIC_ERROR_FILE) that names the class.
CLASS_KEY = "mingpt_error_class"


class UserFacingError(Exception):
    """A failure the user acts on, told in one line naming what to do."""

    exit_code = 2


class ConfigError(UserFacingError):
    """Bad input the user can fix before running again: config, data, snapshot, paths.
    Exit code 2: running the same command again would fail the same way (never requeued)."""


class RunError(UserFacingError):
    """The run failed while it ran, through no fault of its input: snapshots that could not be saved for trainer.save_retry_minutes, a lost run lock, a rank
    that waited too long for another. Run the same command to resume once the cause is gone.
    Exit code 4: worth retrying (launch/train.sbatch requeues it)."""

    exit_code = 4


class NeedsAPerson(ConfigError):
    """The run failed in a way a retry cannot mend and a person must look into: replicas that
    diverged (different code, data or hardware on some nodes: "compare the nodes"). Counted as
    a ConfigError (exit 2, recorded as one) so that no launcher retries it: a requeue would
    refuse the snapshot marked as failing the check, or train on the same faulty nodes."""


CLASSES = (ConfigError, RunError)  # in precedence: one ConfigError anywhere makes the job's outcome ConfigError


def by_name(name: str) -> type[UserFacingError]:
    """The class of a UserFacingError from its name, to raise on every rank what one rank raised."""
    return {cls.__name__: cls for cls in CLASSES}.get(name, ConfigError)


def class_of(error: UserFacingError | type[UserFacingError]) -> type[UserFacingError]:
    """ConfigError or RunError: what `error` (or a subclass of either) counts as."""
    kind = error if isinstance(error, type) else type(error)
    return next((cls for cls in CLASSES if issubclass(kind, cls)), ConfigError)


def record(error: UserFacingError | type[UserFacingError], message: str) -> None:
    """Leave this process's error class where the launchers read it, before it exits with the
    class's code; `message` is the (redacted) line the user was shown.

    - torchelastic's error file of this worker (TORCHELASTIC_ERROR_FILE), in torch's format:
      mingpt_ddp.tools.torchrun reads the class from it for every failed worker, those its
      agent stopped included, and plain torchrun's failure summary shows the line.
    - MINGPT_STEP_ERRORS/<class> (launch/train.sbatch sets it): the batch script's view of
      the whole step, whichever node srun saw fail first.
    Best effort: a file that cannot be written leaves the exit code as the only record."""
    cls = class_of(error)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        data = {"message": {"message": f"{cls.__name__}: {message}", "extraInfo": {"timestamp": str(int(time.time()))}},
                CLASS_KEY: cls.__name__}
        try:  # whole or not at all: the agent parses it, and may SIGKILL this process at any moment
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(error_file) or ".", prefix=".error.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, error_file)
        except OSError:
            pass
    step_errors = _try_dir()
    if step_errors:
        try:
            os.makedirs(step_errors, exist_ok=True)
            with open(os.path.join(step_errors, cls.__name__), "a"):
                pass
        except OSError:
            pass


def _try_dir(try_number: Optional[int] = None) -> Optional[str]:
    step_errors = os.environ.get(STEP_ERRORS_ENV)
    if try_number is None:
        try_number = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return os.path.join(step_errors, f"try-{try_number}") if step_errors else None


def record_crash(try_number: Optional[int] = None) -> None:
    """Mark this try of the step as crashed (MINGPT_STEP_ERRORS/try-<n>/Crashed): a worker
    raised (a bug, CUDA out of memory) or died of a signal its agent did not send (the
    kernel's OOM killer). A crash recurs where the run resumes, so launch/train.sbatch
    requeues it only when a newer snapshot was saved, never "once more" as it does a lost
    node or peer. `try_number`: the agent's own record, for its last try (it has no
    TORCHELASTIC_RESTART_COUNT). Best effort, like `record`."""
    step_errors = _try_dir(try_number)
    if step_errors:
        try:
            os.makedirs(step_errors, exist_ok=True)
            with open(os.path.join(step_errors, CRASH_FILE), "a"):
                pass
        except OSError:
            pass


def record_start() -> None:
    """Mark this try of the step as started (MINGPT_STEP_ERRORS/try-<n>/): the batch script
    reads the records of the newest try only, so a class an earlier try of the same step
    recorded (a ConfigError while the data was still being staged) does not decide for a
    later try that trained and then lost a node. Best effort, like `record`."""
    step_errors = _try_dir()
    if step_errors:
        try:
            os.makedirs(step_errors, exist_ok=True)
        except OSError:
            pass


def record_progress(step: int) -> None:
    """Rank 0, after a snapshot at `step` is saved: MINGPT_STEP_ERRORS/snapshot_step holds it,
    which the batch script compares with the attempt before to requeue a failed step only
    when the run advanced. Best effort, like `record`."""
    step_errors = os.environ.get(STEP_ERRORS_ENV)
    if not step_errors:
        return
    try:
        os.makedirs(step_errors, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=step_errors, prefix=".progress.")
        with os.fdopen(fd, "w") as f:
            f.write(f"{int(step)}\n")
        os.replace(tmp, os.path.join(step_errors, PROGRESS_FILE))
    except OSError:
        pass


def recorded_class(error_file_data: Any) -> Optional[type[UserFacingError]]:
    """The class a worker recorded in its torchelastic error file (`record`), else None."""
    name = error_file_data.get(CLASS_KEY) if isinstance(error_file_data, dict) else None
    return next((cls for cls in CLASSES if cls.__name__ == name), None)
