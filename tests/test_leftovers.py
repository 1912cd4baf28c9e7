"""A test run leaves nothing running, however it ends (tests/leftovers.py): a run stopped by SIGTERM
half way kills the servers, daemons and torchrun workers it started; what a SIGKILLed run left behind
is stopped by the next run.

Each case runs a small test session of its own (pytest with the `leftovers` plugin) whose one test
starts the kinds of process the suite starts: a plain child (an S3 or HTTP server), a daemon that
detaches from its parent (slurmctld, slurmd, munged), and torchrun with two workers; it records their
pids and waits to be stopped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TORCHRUN

pytestmark = pytest.mark.cli

INNER_TEST = r'''
import os, subprocess, sys, time
from pathlib import Path

PIDS = Path(os.environ["LEFTOVERS_PIDS"])

def test_starts_things_and_waits():
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # a daemon: double fork, its own session, the parent gone (reparented to init)
    subprocess.run([sys.executable, "-c",
                    "import os, time\nif os.fork() == 0:\n os.setsid()\n if os.fork() == 0:\n"
                    "  open(os.environ['LEFTOVERS_PIDS'] + '.daemon', 'w').write(str(os.getpid()))\n"
                    "  time.sleep(600)\n os._exit(0)\nos._exit(0)"], check=True)
    workers = Path(os.environ["LEFTOVERS_PIDS"] + ".workers")
    workers.mkdir()
    torchrun = subprocess.Popen([os.environ["TORCHRUN"], "--standalone", "--nproc_per_node=2", "-m",
                                 "leftover_worker", str(workers)])
    deadline = time.monotonic() + 60
    while len(list(workers.iterdir())) < 2 or not Path(str(PIDS) + ".daemon").exists():
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    pids = [server.pid, torchrun.pid, int(Path(str(PIDS) + ".daemon").read_text())]
    pids += [int(p.name) for p in workers.iterdir()]
    PIDS.write_text(" ".join(map(str, pids)))
    time.sleep(600)
'''

WORKER = "import os, sys, time\nopen(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\ntime.sleep(600)\n"


def _start_session(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    (tmp_path / "leftover_worker.py").write_text(WORKER)
    pids = tmp_path / f"{name}.pids"
    env = {**os.environ, "LEFTOVERS_PIDS": str(pids), "TORCHRUN": TORCHRUN,
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(tmp_path)])}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "leftovers", "-p", "no:cacheprovider",
                             str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (pids.exists() and pids.read_text()):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the inner test session did not start its processes"
        time.sleep(0.2)
    return proc, pids


def _running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _cleanup(pids: list[int]) -> None:
    for pid in _running(pids):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc")
def test_a_test_run_stopped_by_sigterm_leaves_nothing_running(tmp_path):
    proc, pid_file = _start_session(tmp_path, "sigterm")
    pids = [int(p) for p in pid_file.read_text().split()]
    try:
        assert len(_running(pids)) == 5, "the inner session's processes are not all up"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0, out  # interrupted, not passed
        assert "stopped by SIGTERM" in out or "KeyboardInterrupt" in out, out
        deadline = time.monotonic() + 10
        while _running(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(pids) == [], f"left running after SIGTERM: {_running(pids)}\n{out}"
    finally:
        proc.kill()
        _cleanup(pids)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc")
def test_what_a_killed_test_run_left_is_stopped_by_the_next_run(tmp_path):
    proc, pid_file = _start_session(tmp_path, "sigkill")
    pids = [int(p) for p in pid_file.read_text().split()]
    try:
        proc.kill()  # no teardown, no hook: everything it started is still there
        proc.wait(timeout=30)
        time.sleep(0.5)
        left = _running(pids)
        assert left, "nothing outlived the SIGKILLed session: this test proves nothing"
        (tmp_path / "next").mkdir()
        (tmp_path / "next" / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
        env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
        nxt = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "leftovers", "-p", "no:cacheprovider",
                              "test_nothing.py"], cwd=tmp_path / "next", env=env, capture_output=True, text=True,
                             timeout=120)
        assert nxt.returncode == 0, nxt.stdout + nxt.stderr
        assert "an earlier, killed test run left behind" in nxt.stdout, nxt.stdout
        assert _running(pids) == [], f"still running after the next run: {_running(pids)}"
    finally:
        _cleanup(pids)
