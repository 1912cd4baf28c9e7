"""The time-by-tier table every test run ends with (tests/tier_times.py): each test's time goes
to its tier, the teardown after the last test (session fixtures: servers, clusters stopping)
to its own row, not to whichever test ran last."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO

INNER = {
    "conftest.py": """
import time, pytest
from tier_times import pytest_runtest_logreport, pytest_runtest_teardown, pytest_sessionstart, pytest_terminal_summary

@pytest.fixture(scope="session")
def server():
    time.sleep(0.3)
    yield
    time.sleep(1.0)
""",
    "test_a.py": """
import time, pytest

@pytest.mark.s3
def test_with_the_server(server):
    time.sleep(0.2)
""",
    "test_b.py": """
import pytest

@pytest.mark.unit
def test_quick():
    pass

@pytest.mark.unit
def test_quick_too():
    pass
""",
}


@pytest.mark.cli
def test_each_tier_gets_its_tests_time_and_the_session_end_its_own_row(tmp_path):
    for name, text in INNER.items():
        (tmp_path / name).write_text(text)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "-o", "markers=unit\ns3", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO / "tests"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {name: (count, seconds) for name, count, seconds in
            re.findall(r"^(unit|s3|end) +(\d*) +([\d.]+) +\d+%$", done.stdout, re.M)}
    assert rows["s3"][0] == "1" and 0.5 <= float(rows["s3"][1]) < 1.0, done.stdout  # setup 0.3 + call 0.2
    assert rows["unit"][0] == "2" and float(rows["unit"][1]) < 0.5, done.stdout  # not the server's teardown
    assert rows["end"][0] == "" and float(rows["end"][1]) >= 1.0, done.stdout
