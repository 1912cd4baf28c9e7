"""A stop signal while the last snapshot is still being saved (issue 22): a failing store is
retried for trainer.save_retry_minutes, far longer than a scheduler's grace period, so a
second stop signal exits at once, naming the newest snapshot that was saved."""
from __future__ import annotations

import os
import signal
import time

import pytest

from mingpt_ddp.preemption import StopRequest

pytestmark = pytest.mark.dist


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def recording_request(clock):
    seen = {"exit": None, "said": []}
    request = StopRequest(clock=clock, abort=lambda: seen.update(abort=True),
                          exit_while_saving=lambda signum, newest, doing: seen.update(exit=(signum, newest)),
                          say=seen["said"].append)
    return request, seen


def test_after_the_stopping_signal_the_next_one_exits_naming_the_newest_snapshot():
    clock = Clock()
    request, seen = recording_request(clock)
    request._handle(signal.SIGUSR1, None)  # the preemption notice: stop after the agreed step
    assert request.signum == signal.SIGUSR1 and seen["exit"] is None
    clock.now += 30
    request.saving_last_snapshot(lambda: "/runs/a/snapshot.step000000010.pt", stopping=True)
    clock.now += 60
    request._handle(signal.SIGTERM, None)  # the scheduler's kill notice while the save is retried
    assert seen["exit"] == (signal.SIGTERM, "/runs/a/snapshot.step000000010.pt")


def test_at_the_end_of_a_run_the_first_signal_warns_and_the_second_exits():
    clock = Clock()
    request, seen = recording_request(clock)
    request.saving_last_snapshot(lambda: None, stopping=False)
    request._handle(signal.SIGTERM, None)
    assert seen["exit"] is None and "a second stop signal exits at once" in seen["said"][0]
    clock.now += 0.2
    request._handle(signal.SIGTERM, None)  # the same event twice (Slurm and torchrun both forward it)
    assert seen["exit"] is None
    clock.now += 5
    request._handle(signal.SIGUSR1, None)
    assert seen["exit"] == (signal.SIGUSR1, None)


def test_a_rank_that_stops_on_another_ranks_signal_exits_on_its_first():
    clock = Clock()
    request, seen = recording_request(clock)
    request.saving_last_snapshot(lambda: "/runs/a/snapshot.step000000010.pt", stopping=True)
    request._handle(signal.SIGUSR1, None)
    assert seen["exit"] == (signal.SIGUSR1, "/runs/a/snapshot.step000000010.pt")


def test_before_the_last_save_a_second_signal_still_only_asks_to_stop():
    clock = Clock()
    request, seen = recording_request(clock)
    request._handle(signal.SIGUSR1, None)
    clock.now += 10
    request._handle(signal.SIGUSR1, None)
    assert seen["exit"] is None and "abort" not in seen and request.signum == signal.SIGUSR1


@pytest.mark.slow
def test_a_second_stop_signal_while_the_last_save_fails_exits_at_once(tmp_path, small_corpus):
    """Real torchrun workers: SIGUSR1 stops the run, its snapshot cannot be written (the store
    fails) and is retried for up to 5 minutes; a second SIGUSR1 to the workers (as Slurm's
    `scancel --signal` sends it) ends them within seconds, rank 0 printing one line with the
    newest snapshot saved, which stays intact."""
    from conftest import load_snapshot
    from test_fault_tolerance import args, children, metrics_lines, start_torchrun, wait_for
    from test_waiting_for_rank0 import FailingDirectory

    snapshots, run_dir, log = tmp_path / "snapshots", tmp_path / "run", tmp_path / "train.log"
    proc = start_torchrun(args(run_dir, small_corpus, f"trainer.snapshot_path={snapshots}/snapshot.pt",
                               "trainer.max_steps=100000", "trainer.snapshot_every_steps=10",
                               "trainer.save_retry_minutes=5"), log_path=log)
    store = FailingDirectory(snapshots)
    try:
        wait_for(lambda: "saved snapshot" in log.read_text(), 180, "the first snapshot")
        store.fail()
        lines = metrics_lines(run_dir)
        wait_for(lambda: metrics_lines(run_dir) >= lines + 2, 120, "training on")
        workers = children(proc.pid)
        os.kill(workers[-1], signal.SIGUSR1)
        wait_for(lambda: "saving the last snapshot" in log.read_text(), 120, "the agreed stop")
        # Two failed attempts: a while after the first signal (one arriving twice within a second is one event).
        wait_for(lambda: log.read_text().split("saving the last snapshot", 1)[1].count("retrying in") >= 2, 60,
                 "a retry of the last save")
        started = time.monotonic()
        for pid in workers:
            os.kill(pid, signal.SIGUSR1)
        code = proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        store.heal()
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("stopped by a second SIGUSR1")]
    assert len(lines) == 1, text
    saved = snapshots / lines[0].rsplit("the newest snapshot saved is ", 1)[1].split(";")[0].rsplit("/", 1)[1]
    assert str(saved.parent) in lines[0] and load_snapshot(saved)["train_state"]["step"] % 10 == 0
    assert took < 30 and code == 0, (took, code, text)
    assert "Traceback" not in text, text
