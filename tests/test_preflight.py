"""Pre-flight's verdict is every rank's: a wrong all_reduce result on any rank fails it,
naming the first rank (and its node) that saw one. Real processes under torchrun."""
import os
import subprocess

import pytest

from conftest import REPO, TORCHRUN, output

pytestmark = pytest.mark.dist


def preflight(nproc: int, faulty_ranks: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "FAULTY_RANKS": faulty_ranks,
           "PREFLIGHT_MAX_BYTES": "64KB", "OMP_NUM_THREADS": "1"}
    return subprocess.run([TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "--max-restarts=0",
                           str(REPO / "tests" / "preflight_faulty_rank.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def test_a_wrong_sum_on_a_non_zero_rank_fails_preflight_naming_that_rank():
    proc = preflight(3, "2")
    out = output(proc)
    assert proc.returncode != 0, out
    errors = [line for line in out.splitlines() if line.startswith("error: preflight:")]
    assert len(errors) == 1, out
    assert "wrong value(s)" in errors[0] and "on rank 2 (node " in errors[0], errors
    assert "preflight: passed" not in out, out


def test_the_first_failing_rank_is_named_and_a_healthy_job_passes():
    proc = preflight(3, "1,2")
    errors = [line for line in output(proc).splitlines() if line.startswith("error: preflight:")]
    assert len(errors) == 1 and "on rank 1 (node " in errors[0], output(proc)
    healthy = preflight(2, "")
    assert healthy.returncode == 0 and "preflight: passed: 1 node(s), 2 rank(s)" in healthy.stdout, output(healthy)
