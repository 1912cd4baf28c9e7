"""Where a test run's time goes, by tier: printed at the end of every run (issue 31), so a
tier that grows shows in the next run's output, CI's included. Each test's setup, call and
teardown count towards its tier (read from the report's markers, so it holds under xdist
too); a module's shared fixture counts towards the test that started it, and the teardown
after the last test (the session's servers and clusters stopping) has its own row. The
tiers' sum falls short of the wall time by collection and what runs between tests."""
from __future__ import annotations

import time
from collections import defaultdict

import pytest

TIERS = ("unit", "cli", "dist", "s3", "slurm")  # conftest.py refuses a test without one
SESSION_END = "end"  # the last teardown: session-scoped fixtures (Slurm, S3 servers) stopping

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)
_last: set[str] = set()
_started = [time.monotonic()]


def pytest_sessionstart(session) -> None:
    _seconds.clear(), _tests.clear(), _last.clear()
    _started[0] = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None:
        _last.add(item.nodeid)
    yield


def pytest_runtest_logreport(report) -> None:
    tier = next((t for t in TIERS if t in report.keywords), "none")
    if report.when == "teardown" and report.nodeid in _last:
        tier = SESSION_END
    _seconds[tier] += report.duration
    if tier != SESSION_END:
        _tests[tier].add(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    total = sum(_seconds.values())
    terminalreporter.section("time by tier")
    terminalreporter.write_line(f"{'tier':<6} {'tests':>6} {'seconds':>9} {'share':>6}")
    for tier in (*TIERS, "none", SESSION_END):
        if tier in _seconds:
            count = len(_tests[tier]) if tier != SESSION_END else ""
            terminalreporter.write_line(f"{tier:<6} {count:>6} {_seconds[tier]:>9.1f} {_seconds[tier] / total:>6.0%}")
    terminalreporter.write_line(f"{'all':<6} {sum(map(len, _tests.values())):>6} {total:>9.1f} "
                                f"(wall {time.monotonic() - _started[0]:.1f} s from the session's start)")
