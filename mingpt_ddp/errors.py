"""The one exception type for problems the user can fix."""


class ConfigError(Exception):
    """Bad input the user can fix (config, data, snapshot, paths).

    Raised identically on every rank (or decided on rank 0 and broadcast), caught once at
    the top of ``main``: rank 0 prints the message, every rank exits with code 2, and no
    traceback is shown. Bugs are not ConfigErrors and keep their traceback.
    """

    exit_code = 2
