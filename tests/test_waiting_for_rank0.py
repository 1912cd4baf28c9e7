"""Waiting for work only rank 0 does (issue 23 item 3): the other ranks wait in the rendezvous
store, not in a collective of the training process group, so its timeout
(trainer.collective_timeout_minutes, NCCL's on GPUs) can be minutes while rank 0 retries a
save for trainer.save_retry_minutes. Real torchrun workers with gloo, a real failing store (the
snapshot directory replaced by a file, then put back)."""
from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, TORCHRUN, load_snapshot
from test_fault_tolerance import args, start_torchrun, wait_for

pytestmark = pytest.mark.slow


class FailingDirectory:
    """The snapshot directory made unusable (a plain file where the directory was) and back."""

    def __init__(self, path: Path):
        self.path, self.away = path, path.with_name(path.name + ".away")

    def fail(self) -> None:
        self.path.rename(self.away)
        self.path.write_text("not a directory: every write below it fails (NotADirectoryError)\n")

    def heal(self) -> None:
        self.path.unlink()
        self.away.rename(self.path)


@pytest.mark.dist
def test_a_save_retried_longer_than_the_collective_timeout_does_not_time_out_the_other_ranks(tmp_path, small_corpus):
    """Training collectives time out after 12 s; rank 0's last save keeps failing for longer
    (retried, trainer.save_retry_minutes=2) while rank 1 waits for it; then the store heals and
    the run ends normally on both ranks. Before the fix rank 1 waited in a gloo broadcast, which
    gave up after 12 s (and the config refused a timeout below save_retry_minutes + 5)."""
    snapshots = tmp_path / "snapshots"
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = start_torchrun(args(run_dir, small_corpus, f"trainer.snapshot_path={snapshots}/snapshot.pt",
                               "trainer.max_steps=30", "trainer.snapshot_every_steps=10",
                               "trainer.collective_timeout_minutes=0.2", "trainer.save_retry_minutes=2"),
                          log_path=log)
    store = FailingDirectory(snapshots)
    try:
        wait_for(lambda: "saved snapshot" in log.read_text(), 180, "the first snapshot")
        store.fail()
        last = f"snapshot {snapshots}/snapshot.step000000030.pt failed"
        wait_for(lambda: last in log.read_text() or proc.poll() is not None, 180, "the last save failing")
        failing_since = time.monotonic()
        while time.monotonic() - failing_since < 30:  # 2.5 x the collective timeout
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        store.heal()
        assert proc.wait(timeout=180) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "saving works again" in text and "Traceback" not in text, text
    assert load_snapshot(snapshots / "snapshot.pt")["train_state"]["step"] == 30


WAIT_FOREVER = textwrap.dedent("""
    import sys, time
    from mingpt_ddp import distributed
    from mingpt_ddp.errors import RunError
    dist = distributed.setup(timeout_minutes=0.05, rank0_wait_minutes=float(sys.argv[1]))
    def rank0_work():
        time.sleep(float(sys.argv[2]))
        return "done"
    start = time.monotonic()
    try:
        if sys.argv[3:] == ["data"]:  # each node's first process encoding its corpus
            outcome = distributed.on_main_then_share(rank0_work, dist, once_per_node=True)
        else:
            outcome = distributed.wait_for_main(rank0_work, 'sleeping')
        print(f"rank {dist.rank}: {outcome} after {time.monotonic() - start:.1f} s", flush=True)
    except RunError as exc:
        print(f"rank {dist.rank}: RunError after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        distributed.shutdown(clean=False)
        sys.exit(2)
    distributed.shutdown(clean=True)
""")


def run_wait(tmp_path: Path, wait_minutes: float, work_s: float, *mode: str) -> str:
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOREVER)
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(wait_minutes), str(work_s),
                           *mode],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


@pytest.mark.dist
def test_waiting_for_rank_0_outlasts_the_collective_timeout_and_is_bounded_by_its_own(tmp_path):
    """distributed.wait_for_main with a 3 s collective timeout: 8 s of rank-0 work are waited
    for; with a 0.1-minute wait for rank 0, 30 s of work end rank 1's wait after 6 s with one
    error naming the wait (not after the 30 s, nor a collective timeout)."""
    text = run_wait(tmp_path, wait_minutes=1.0, work_s=8)
    assert "rank 0: done" in text and "rank 1: done after" in text, text
    waited = float(text.split("rank 1: done after ")[1].split(" s")[0])
    assert waited >= 7, text
    text = run_wait(tmp_path, wait_minutes=0.1, work_s=30)
    assert "rank 1: RunError after" in text and "waited 0.1 minutes for rank 0 sleeping" in text, text
    waited = float(text.split("rank 1: RunError after ")[1].split(" s")[0])
    assert 5 <= waited < 20, text


@pytest.mark.dist
def test_a_corpus_encoding_longer_than_the_wait_names_prepare_not_a_hung_node(tmp_path):
    """The others wait for each node's first process encoding the corpus within the rank-0
    wait; past it, the one line points to encoding ahead, not to a hung node."""
    text = run_wait(tmp_path, 0.1, 30, "data")
    line = next((l for l in text.splitlines() if l.startswith("rank 1: RunError after")), "")
    assert "preparing its data" in line and "python -m mingpt_ddp.prepare" in line, text
    assert "check that node, then run" not in line, text
