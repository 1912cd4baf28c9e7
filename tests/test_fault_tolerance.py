"""Failures a long run must survive, with real processes: SIGKILLed workers under torchrun
restarts, rank 0 killed mid-write, damaged snapshots, preemption signals, and resuming with
another world size."""
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import MAIN, TINY, TORCHRUN, load_snapshot, output, read_metrics, run_cli

pytestmark = pytest.mark.slow


def args(run_dir, corpus, *extra):
    return [*TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}", *extra]


def must_pass(proc):
    assert proc.returncode == 0, output(proc)
    return output(proc)


def same_parameters(a: Path, b: Path) -> None:
    sa, sb = load_snapshot(a), load_snapshot(b)
    assert sa["train_state"]["step"] == sb["train_state"]["step"]
    for name, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][name]), f"{name} differs"


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (torchrun's workers), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def start_torchrun(run_args, nproc=2, max_restarts=0, log_path=None):
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", MAIN, *run_args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.dist
def test_three_sigkills_under_torchrun_restarts_end_bit_identical(tmp_path, small_corpus):
    common = ["trainer.max_epochs=12", "trainer.snapshot_every_steps=7", "trainer.log_every=5"]
    reference = tmp_path / "reference"
    must_pass(run_cli(args(reference, small_corpus, *common), nproc=2))

    run_dir = tmp_path / "killed"
    proc = start_torchrun(args(run_dir, small_corpus, *common), max_restarts=3, log_path=tmp_path / "killed.log")
    rng = random.Random(7)
    try:
        killed: set[int] = set()
        for _ in range(3):
            lines_before = metrics_lines(run_dir)
            # A fresh generation of workers that has trained a little since the last kill.
            workers = wait_for(lambda: (w := children(proc.pid)) and len(w) == 2 and not set(w) & killed and w,
                               120, "restarted workers")
            wait_for(lambda: metrics_lines(run_dir) >= lines_before + 2, 120, "training progress")
            time.sleep(rng.uniform(0.0, 0.3))
            victim = rng.choice(workers)
            os.kill(victim, signal.SIGKILL)
            killed |= set(workers)
        assert proc.wait(timeout=300) == 0, (tmp_path / "killed.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "killed.log").read_text()
    assert log.count("resumed from") >= 3, log
    same_parameters(reference / "snapshot.pt", run_dir / "snapshot.pt")


@pytest.mark.dist
def test_rank0_killed_while_writing_keeps_the_previous_snapshot(tmp_path, small_corpus):
    """A large model makes the write long enough to kill rank 0 inside it."""
    run_dir = tmp_path / "run"
    run_args = args(run_dir, small_corpus, "model=gopher-44m", "trainer.batch_size=2", "trainer.max_steps=4",
                    "trainer.snapshot_every_steps=1", "trainer.log_every=1", "optimizer.decay_steps=100")
    proc = start_torchrun(run_args, log_path=tmp_path / "first.log")
    try:
        wait_for(lambda: (run_dir / "snapshot.step000000001.pt").exists(), 180, "the first snapshot")
        temp = wait_for(lambda: [p for p in run_dir.glob(".snapshot.step*.tmp-*")], 180, "the second write")
        rank0 = next(pid for pid in children(proc.pid) if rank_of(pid) == 0)
        os.kill(rank0, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    survivor = load_snapshot(run_dir / "snapshot.pt")  # whole and checksummed
    assert survivor["train_state"]["step"] >= 1
    assert not (run_dir / temp[0].name.split(".tmp-")[0].lstrip(".")).exists() or \
        load_snapshot(run_dir / temp[0].name.split(".tmp-")[0].lstrip("."))  # never half a file under a real name
    text = must_pass(run_cli(run_args, nproc=2))
    assert f"resumed from {run_dir}/snapshot.step00000000{survivor['train_state']['step']}.pt" in text
    assert load_snapshot(run_dir / "snapshot.pt")["train_state"]["step"] == 4


@pytest.mark.cli
def test_damaged_newest_snapshot_falls_back_and_all_damaged_is_an_error(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    fixed = ["trainer.snapshot_every_steps=5", "optimizer.decay_steps=100"]
    must_pass(run_cli(args(run_dir, small_corpus, "trainer.max_steps=10", *fixed)))
    newest = run_dir / "snapshot.step000000010.pt"
    blob = bytearray(newest.read_bytes())
    blob[len(blob) // 2] ^= 0x40  # one flipped bit (snapshot.pt is the same file: a hard link)
    newest.write_bytes(bytes(blob))
    text = must_pass(run_cli(args(run_dir, small_corpus, "trainer.max_steps=15", *fixed)))
    assert "snapshot.step000000010.pt: checksum mismatch" in text
    assert f"resumed from {run_dir}/snapshot.step000000005.pt" in text

    for snap in run_dir.glob("snapshot*.pt"):
        snap.write_bytes(snap.read_bytes()[:1000])
    damaged = {p.name: p.read_bytes() for p in run_dir.glob("snapshot*.pt")}
    proc = run_cli(args(run_dir, small_corpus, "trainer.max_steps=20", *fixed))
    assert proc.returncode == 2 and "no usable snapshot" in output(proc) and "Traceback" not in output(proc)
    assert {p.name: p.read_bytes() for p in run_dir.glob("snapshot*.pt")} == damaged


@pytest.mark.dist
@pytest.mark.parametrize("how", ["SIGUSR1 to one worker", "SIGTERM to torchrun"])
def test_preemption_signal_snapshots_at_an_agreed_step_and_resumes_exactly(tmp_path, small_corpus, how):
    common = ["trainer.max_epochs=8", "trainer.log_every=5"]
    reference = tmp_path / "reference"
    must_pass(run_cli(args(reference, small_corpus, *common), nproc=2))

    run_dir = tmp_path / "preempted"
    proc = start_torchrun(args(run_dir, small_corpus, *common), log_path=tmp_path / "preempted.log")
    try:
        wait_for(lambda: metrics_lines(run_dir) >= 6, 120, "training progress")
        if how.startswith("SIGUSR1"):
            os.kill(children(proc.pid)[-1], signal.SIGUSR1)
        else:
            os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards SIGTERM to its workers
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "preempted.log").read_text()
    if how.startswith("SIGUSR1"):
        assert proc.returncode == 0, log
    assert "stopped by SIG" in log, log
    stopped = load_snapshot(run_dir / "snapshot.pt")["train_state"]
    assert 0 < stopped["step"] and stopped["epoch"] < 8
    assert f"at step {stopped['step']} " in log

    text = must_pass(run_cli(args(run_dir, small_corpus, *common), nproc=2))
    assert f"step {stopped['step']}" in text.split("resumed from", 1)[1].splitlines()[0]
    same_parameters(reference / "snapshot.pt", run_dir / "snapshot.pt")


@pytest.mark.dist
def test_resuming_with_another_world_size_keeps_the_global_batch(tmp_path, small_corpus):
    fixed = ["optimizer.decay_steps=60", "model.dropout=0.0", "trainer.eval_every=10"]
    two, mixed = tmp_path / "two", tmp_path / "mixed"
    must_pass(run_cli(args(two, small_corpus, "trainer.max_steps=45", *fixed), nproc=2))
    must_pass(run_cli(args(mixed, small_corpus, "trainer.max_steps=15", *fixed), nproc=2))
    text = must_pass(run_cli(args(mixed, small_corpus, "trainer.max_steps=30", *fixed), nproc=0))
    assert "world size changed from 2 to 1: global batch 16 kept" in text and "8 x 1 -> 8 x 2" in text
    text = must_pass(run_cli(args(mixed, small_corpus, "trainer.max_steps=45", *fixed), nproc=2))
    assert "world size changed from 1 to 2: global batch 16 kept" in text and "8 x 1 -> 8 x 1" in text
    a, b = load_snapshot(two / "snapshot.pt"), load_snapshot(mixed / "snapshot.pt")
    assert a["train_state"]["step"] == b["train_state"]["step"] == 45
    assert a["train_state"]["tokens_seen"] == b["train_state"]["tokens_seen"]
    # Same data in the same order, same global batch, no dropout: only the float summation
    # order differs, so the weights stay close.
    drift = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    assert drift < 0.05, drift
    # Periodic evaluations read the same windows whatever the world size: the run's
    # eval_batches x batch_size x 2 processes it started with (the final ones: the whole split).
    for run_dir in (two, mixed):
        periodic = {r["step"]: r["val_windows"] for r in read_metrics(run_dir) if "val_windows" in r and r["step"] % 15}
        assert periodic == {10: 64, 20: 64, 40: 64}, periodic


@pytest.mark.cli
def test_precision_auto_keeps_the_snapshots_choice_and_an_explicit_one_overrides_it(tmp_path, small_corpus):
    """precision=auto resolves once per run: a resume (on another CPU, or with the cache of
    measurements gone) trains on in the snapshot's precision, unless that is bf16 on a CPU
    without bf16 instructions (emulated, many times slower): then auto decides again, and
    says why. An explicit precision replaces it."""
    run_dir = tmp_path / "run"
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    # emulated: no bf16 instructions, or torch held to AVX2 (ATEN_CPU_CAPABILITY=avx2, as in the AVX2 emulation)
    bf16_emulated = (not ({"avx512_bf16", "amx_bf16"} & set(flags))
                     or torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"))

    def run(precision: str, steps: int) -> tuple[str, str]:
        text = must_pass(run_cli(args(run_dir, small_corpus, f"trainer.max_steps={steps}",
                                      f"trainer.precision={precision}")))
        return text.split("process(es) (cpu, ", 1)[1].split(")", 1)[0], text

    assert run("bf16", 5)[0].endswith("bf16") and load_snapshot(run_dir / "snapshot.pt")["precision"] == "bf16"
    chosen, text = run("auto", 10)
    kept = "fp32" if bf16_emulated else "bf16"
    assert chosen.endswith(kept) and load_snapshot(run_dir / "snapshot.pt")["precision"] == kept, text
    assert ("is emulated on this CPU" in text) == bf16_emulated, text
    assert run("fp32", 15)[0].endswith("fp32") and load_snapshot(run_dir / "snapshot.pt")["precision"] == "fp32"
    assert run("auto", 20)[0].endswith("fp32") and load_snapshot(run_dir / "snapshot.pt")["precision"] == "fp32"


@pytest.mark.cli
def test_step_and_time_based_snapshots_with_retention(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    must_pass(run_cli(args(run_dir, small_corpus, "trainer.max_steps=40", "trainer.snapshot_every_steps=15",
                           "trainer.keep_last=3")))
    assert sorted(p.name for p in run_dir.glob("snapshot.step*.pt")) == [
        "snapshot.step000000015.pt", "snapshot.step000000030.pt", "snapshot.step000000040.pt"]
    timed = tmp_path / "timed"
    must_pass(run_cli(args(timed, small_corpus, "trainer.max_steps=40", "trainer.snapshot_every_minutes=1e-6",
                           "trainer.keep_last=20", "trainer.stop_check_seconds=1e6")))
    steps = sorted(int(p.name[13:22]) for p in timed.glob("snapshot.step*.pt"))
    # Checked at every stop agreement: after the first step, then every log step (log_every=5;
    # stop_check_seconds adds none).
    assert steps == [1, *range(5, 45, 5)], steps
