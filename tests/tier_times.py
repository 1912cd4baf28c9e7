"""Where a test run's time goes, by tier: printed at the end of every run (issue 31), so a
tier that grows shows in the next run's output, CI's included. Each test's setup, call and
teardown count towards its tier; a module's shared fixture counts towards the test that
started it. Wall time is the run's own clock, so the tiers' sum falls short of it by
collection and what runs between tests."""
from __future__ import annotations

import time
from collections import defaultdict

TIERS = ("unit", "cli", "dist", "s3", "slurm")  # conftest.py refuses a test without one

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)
_tier_of: dict[str, str] = {}
_started = time.monotonic()


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        _tier_of[item.nodeid] = next((t for t in TIERS if item.get_closest_marker(t)), "none")


def pytest_runtest_logreport(report) -> None:
    tier = _tier_of.get(report.nodeid, "none")
    _seconds[tier] += report.duration
    _tests[tier].add(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    total = sum(_seconds.values())
    terminalreporter.section("time by tier")
    terminalreporter.write_line(f"{'tier':<6} {'tests':>6} {'seconds':>9} {'share':>6}")
    for tier in (*TIERS, "none"):
        if tier in _seconds:
            terminalreporter.write_line(f"{tier:<6} {len(_tests[tier]):>6} {_seconds[tier]:>9.1f} "
                                        f"{_seconds[tier] / total:>6.0%}")
    terminalreporter.write_line(f"{'all':<6} {sum(map(len, _tests.values())):>6} {total:>9.1f} "
                                f"(wall {time.monotonic() - _started:.1f} s since the plugin loaded)")
