"""The exceptions a user is told about in one line (exit code 2), not with a traceback.

Raised identically on every rank (or decided on rank 0 and shared), caught once at the top
of ``main``: the rank that hit it prints the message, every rank exits with code 2, and no
traceback is shown. Bugs are neither and keep their traceback.
"""


class UserFacingError(Exception):
    """A failure the user acts on, told in one line naming what to do."""

    exit_code = 2


class ConfigError(UserFacingError):
    """Bad input the user can fix before running again: config, data, snapshot, paths."""


class RunError(UserFacingError):
    """The run failed while it ran, through no fault of its input: replicas that diverged,
    snapshots that could not be saved for trainer.save_retry_minutes, a lost run lock, a rank
    that waited too long for another. Run the same command to resume once the cause is gone."""


def by_name(name: str) -> type[UserFacingError]:
    """The class of a UserFacingError from its name, to raise on every rank what one rank raised."""
    return {cls.__name__: cls for cls in (ConfigError, RunError)}.get(name, ConfigError)
