"""The command-line conventions every tool keeps: ``-h``/``--help`` prints the tool's
description and usage and exits 0; an option it does not know is one ``error:`` line naming
the usage, exit 2 (ConfigError's), never taken for a path or an override."""
from __future__ import annotations

from typing import Iterable

from mingpt_ddp.errors import ConfigError

HELP = ("-h", "--help")


def options(argv: list[str], doc: str, usage: str, known: Iterable[str] = ()) -> tuple[set[str], list[str]]:
    """(the known options given, the other arguments) of `argv`. A help option prints `doc`
    and `usage` to stdout and exits 0; any other argument that starts with '-' and is not in
    `known` raises a ConfigError naming it and the usage (the tool prints it as its one line).
    Values of key=value arguments never start with '-' at the front of the argument."""
    if any(a in HELP for a in argv):
        print(f"{doc.strip()}\n\n{usage}", flush=True)
        raise SystemExit(0)
    known = set(known)
    unknown = [a for a in argv if a.startswith("-") and a not in known]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]} ({usage}; --help says more)")
    return {a for a in argv if a in known}, [a for a in argv if a not in known]

