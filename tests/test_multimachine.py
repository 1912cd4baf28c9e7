"""Two machines without Slurm: launch/multinode.sh run once per "machine", both on this host
(127.0.0.1), as a user would on two servers with HEAD_NODE=<first server> NNODES=2."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MAIN, PYTHON, REPO, TINY

pytestmark = pytest.mark.slow

MULTINODE = REPO / "launch" / "multinode.sh"

PROBE = '''
import atexit, json, os, socket, sys
_dir = os.environ.get("MINGPT_RANK_PROBE")
def _record():
    if _dir and "RANK" in os.environ and sys.argv and sys.argv[0].endswith("main.py"):
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MACHINE", "MASTER_ADDR",
                "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        with open(os.path.join(_dir, f"{os.getpid()}.json"), "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)
atexit.register(_record)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_env(**settings: str) -> dict:
    """This process's environment without any Slurm job around it, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", **settings)
    return env


def resolve(tmp_path: Path, **settings: str) -> tuple[str, str]:
    """(topology line, torchrun command) that multinode.sh would use, from DRY_RUN=1."""
    proc = subprocess.run([str(MULTINODE), "model=gpt-nano"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=machine_env(DRY_RUN="1", **settings))
    assert proc.returncode == 0, proc.stderr
    topology = [line for line in proc.stderr.splitlines() if line.startswith("multinode: topology:")]
    assert len(topology) == 1, proc.stderr
    return topology[0], proc.stdout


@pytest.mark.dist
def test_topology_resolution(tmp_path):
    """What multinode.sh derives from its environment: workers per GPU that the workers' torch
    can use (issue 30: asked of torch, `python -m mingpt_ddp.devices`, not counted from
    CUDA_VISIBLE_DEVICES or `nvidia-smi -L`) or NPROC_PER_NODE; under Slurm the node count,
    first node, job id and a per-job port; without Slurm HEAD_NODE, port 29500 and a run id
    both machines agree on; elastic MIN:MAX; overrides."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\nfor i in 0 1 2; do echo \"GPU $i: Fake (UUID: GPU-$i)\"; done\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    with_smi = f"{fake_bin}:{os.environ['PATH']}"
    cuda_python = tmp_path / "cuda-python"  # a CUDA torch that can use 2 GPUs
    cuda_python.write_text('#!/usr/bin/env bash\n[ "$3 $4" = "-m mingpt_ddp.devices" ] && { echo 2; exit 0; }\n'
                           f'exec {sys.executable} "$@"\n')
    cuda_python.chmod(0o755)

    topo, cmd = resolve(tmp_path, PATH=with_smi, PYTHON=str(cuda_python))
    assert "nproc_per_node=2 (GPUs; 2 GPU(s))" in topo and "--nproc_per_node=2" in cmd, topo  # not nvidia-smi's 3
    topo, cmd = resolve(tmp_path, CUDA_VISIBLE_DEVICES="0,1")  # this CPU torch: CUDA_VISIBLE_DEVICES counts no GPU
    assert "--nproc_per_node=1" in cmd and "no GPU" in topo, topo
    topo, cmd = resolve(tmp_path, PATH=with_smi, PYTHON=str(cuda_python), CUDA_VISIBLE_DEVICES="", DEVICE="cpu")
    assert "--nproc_per_node=1" in cmd and "DEVICE=cpu" in topo, topo
    topo, cmd = resolve(tmp_path, PYTHON=str(cuda_python), CUDA_VISIBLE_DEVICES="0,1", NPROC_PER_NODE="1")
    assert "--nproc_per_node=1" in cmd, topo

    # A dry run: 10.1.2.3 is only text to the script (it binds it locally to ask whether it is
    # this machine's, which fails without a packet) and nothing connects to it.
    topo, cmd = resolve(tmp_path, HEAD_NODE="10.1.2.3", NNODES="2")
    assert "--nnodes=2" in cmd and "--rdzv_endpoint=10.1.2.3:29500" in cmd and "--rdzv_id=10.1.2.3-29500" in cmd
    assert "joins 10.1.2.3:29500" in topo, topo
    topo, cmd = resolve(tmp_path, HEAD_NODE="127.0.0.1", NNODES="1:4", RDZV_PORT="31000", RUN_ID="exp7",
                        MAX_RESTARTS="5", RDZV_TIMEOUT="60")
    assert "hosts the rendezvous 127.0.0.1:31000" in topo, topo
    for part in ("--nnodes=1:4", "--rdzv_id=exp7", "--max-restarts=5", "join_timeout=60"):
        assert part in cmd, cmd

    slurm = dict(SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="gpu-[007-008]", SLURM_JOB_NUM_NODES="2", SLURM_NODEID="1")
    topo, cmd = resolve(tmp_path, **slurm)
    assert "(Slurm job 1234 node 1 of 2) joins gpu-007:30734" in topo, topo
    for part in ("--nnodes=2", "--rdzv_endpoint=gpu-007:30734", "--rdzv_id=1234"):
        assert part in cmd, cmd
    topo, cmd = resolve(tmp_path, **slurm, MASTER_PORT="40000")
    assert "--rdzv_endpoint=gpu-007:40000" in cmd, cmd

    bad = subprocess.run([str(MULTINODE)], capture_output=True, text=True, timeout=60,
                         env=machine_env(DRY_RUN="1", NNODES="two"))
    assert bad.returncode == 1 and "NNODES=two" in bad.stderr, bad.stderr


@pytest.mark.cli
def test_two_machines_with_different_process_counts_started_apart(tmp_path, small_corpus):
    """Machine A (1 process) starts, machine B (2 processes, same HEAD_NODE and NNODES=2,
    no RUN_ID: the default is derived from HEAD_NODE and the port, so both agree) starts
    10 s later: together they form one job of world size 3 with global ranks 0, 1, 2
    each exactly once, and both exit 0."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    ranks_dir = tmp_path / "ranks"
    ranks_dir.mkdir()
    common = dict(HEAD_NODE="127.0.0.1", NNODES="2", RDZV_PORT=str(free_port()), RDZV_TIMEOUT="120",
                  MAX_RESTARTS="0", PYTHONPATH=str(site), MINGPT_RANK_PROBE=str(ranks_dir))
    args = [*TINY, f"data.path={small_corpus}", "trainer.max_steps=10", f"hydra.run.dir={tmp_path / 'run'}"]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("a", "b")}
    procs = {}
    try:
        procs["a"] = subprocess.Popen([str(MULTINODE), *args], cwd=tmp_path, stdout=logs["a"], stderr=subprocess.STDOUT,
                                      env=machine_env(**common, NPROC_PER_NODE="1", MACHINE="a"))
        time.sleep(10)
        assert procs["a"].poll() is None, (tmp_path / "a.log").read_text()  # still waiting for B
        procs["b"] = subprocess.Popen([str(MULTINODE), *args], cwd=tmp_path, stdout=logs["b"], stderr=subprocess.STDOUT,
                                      env=machine_env(**common, NPROC_PER_NODE="2", MACHINE="b"))
        codes = {name: p.wait(timeout=180) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    out = {name: (tmp_path / f"{name}.log").read_text() for name in logs}
    assert codes == {"a": 0, "b": 0}, out
    for name, text in out.items():
        topo = [line for line in text.splitlines() if line.startswith("multinode: topology:")]
        assert len(topo) == 1 and f"run_id=127.0.0.1-{common['RDZV_PORT']}" in topo[0], text
    both = out["a"] + out["b"]
    assert "on 3 process(es)" in both and "done: step 10" in both, out

    ranks = [json.loads(p.read_text()) for p in ranks_dir.glob("*.json")]
    assert sorted(int(r["RANK"]) for r in ranks) == [0, 1, 2], ranks
    assert {r["WORLD_SIZE"] for r in ranks} == {"3"}, ranks
    assert sorted((r["MACHINE"], r["LOCAL_WORLD_SIZE"], r["LOCAL_RANK"]) for r in ranks) == [
        ("a", "1", "0"), ("b", "2", "0"), ("b", "2", "1")], ranks
    assert len({r["GROUP_RANK"] for r in ranks}) == 2, ranks  # two nodes, ranked by the rendezvous
    assert (tmp_path / "run" / "snapshot.pt").exists()


@pytest.mark.dist
def test_unreachable_head_fails_within_the_timeout_with_a_clear_message(tmp_path, small_corpus):
    """A machine pointed at a head where nothing answers (a loopback address and port with no
    listener: tests send traffic to 127.0.0.0/8 only) does not hang:
    it exits non-zero after RDZV_TIMEOUT with a message that names the address and port and
    what to check (firewall, NCCL_SOCKET_IFNAME)."""
    timeout = 6
    start = time.monotonic()
    proc = subprocess.run(
        [str(MULTINODE), *TINY, f"data.path={small_corpus}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=machine_env(HEAD_NODE="127.0.0.77", IS_HEAD="0", NNODES="2", RDZV_PORT="29555", RDZV_TIMEOUT=str(timeout)),
    )
    elapsed = time.monotonic() - start
    err = proc.stderr
    assert proc.returncode != 0, proc.stdout + err
    assert timeout - 1 <= elapsed < timeout + 20, f"{elapsed:.1f} s\n{err}"
    message = err.strip().splitlines()[-1]
    assert "127.0.0.77:29555" in message and f"RDZV_TIMEOUT={timeout}s" in message, err
    assert "firewall" in message and "NCCL_SOCKET_IFNAME" in message, err
    assert "training" not in proc.stdout + err  # it never started torchrun
    assert not re.search(r"Traceback", err), err


@pytest.mark.cli
def test_preflight_reports_what_the_workers_see_and_their_transport(tmp_path):
    """PREFLIGHT=only: each node's line gives the FI_*/NCCL_* variables as the workers see
    them (a value set outside the launcher, as a container image's ENV, included), and the
    comm sweep names each rank's transport (here gloo on the interface that reaches
    HEAD_NODE, loopback)."""
    proc = subprocess.run([str(MULTINODE)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env=machine_env(PREFLIGHT="only", NPROC_PER_NODE="2", RDZV_PORT=str(free_port()),
                                          PREFLIGHT_MAX_BYTES="64KB", FI_PROVIDER="tcp", EFA="0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    node = next(line for line in out.splitlines() if line.startswith("preflight: node "))
    assert "workers see: FI_PROVIDER=tcp GLOO_SOCKET_IFNAME=lo NCCL_DEBUG=WARN NCCL_SOCKET_IFNAME==lo" in node, node
    assert re.search(r"# transport, rank\(s\) 0,1 on \S+: gloo over TCP on interface lo \(GLOO_SOCKET_IFNAME\)", out), out


STORE_CLOSES = '''
import datetime, socket
from mingpt_ddp.tools import torchrun
torchrun._import_torch_quietly()
from torch.distributed import TCPStore
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))
del server  # the head gave up: the agent's store call fails
try:
    client.get("never")
except Exception as exc:
    print("python:", str(exc).splitlines()[0])
'''


@pytest.mark.dist
def test_the_agents_store_failures_print_no_cpp_frames():
    """The agent (mingpt_ddp.tools.torchrun) imports torch with c10's log at FATAL: a store call that
    fails when the rendezvous host goes away reaches Python as one exception, without c10d's
    warning and its C++ frames. c10 reads the level once, when torch is first imported, so
    importing the package (its torch version check) must not import torch before the agent."""
    env = {k: v for k, v in machine_env().items() if k != "TORCH_CPP_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", STORE_CLOSES], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and text.startswith("python: "), text
    assert "frame #" not in text and "TCPStore.cpp" not in text, text


@pytest.mark.cli
def test_a_head_name_resolving_to_loopback_advertises_no_loopback_address(tmp_path):
    """Under Slurm HEAD_NODE is a host name, which on the head itself often resolves to
    127.0.1.1 (Debian's /etc/hosts): advertising that, or binding lo, would send the other
    nodes to their own loopback. `localhost` stands for such a name here. An IP literal
    (several "machines" on one host) keeps its route."""
    topo, cmd = resolve(tmp_path, HEAD_NODE="localhost", NNODES="2")
    assert "net=default (localhost resolves to " in topo, topo
    assert "--local-addr" not in cmd and "IFNAME=lo" not in topo, (topo, cmd)
    topo, cmd = resolve(tmp_path, HEAD_NODE="127.0.0.1", NNODES="2")
    assert "net=lo 127.0.0.1" in topo and "--local-addr=127.0.0.1" in cmd, (topo, cmd)
    topo, cmd = resolve(tmp_path, HEAD_NODE="localhost", NNODES="1")
    assert "net=lo " in topo, topo


@pytest.mark.unit
def test_the_launcher_exits_with_the_class_its_workers_recorded(tmp_path, monkeypatch):
    """The node's exit code is the class the workers recorded in their torchelastic error files
    (errors.record, read back by torch's own ProcessFailure), not the first exit code: the
    first worker to exit makes the agent SIGTERM the others, or they lose their peers (3).
    ConfigError (2) when any worker recorded one, else RunError (4). Without a record, 2 or 4
    only when every failed worker exited with it, else 1. A worker that crashed without a record
    (a signal the agent does not send) outranks a RunError: 1. A record is no traceback:
    one summary line; a bug's error file keeps torchrun's own summary."""
    import signal as signals

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mingpt_ddp.errors import ConfigError, RunError, record
    from mingpt_ddp.tools import torchrun

    def failure(rank, exitcode, recorded=None):
        error_file = tmp_path / f"{len(list(tmp_path.iterdir()))}" / "error.json"
        error_file.parent.mkdir()
        if recorded:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
            record(recorded("why"), "why")
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))

    term, kill = -signals.SIGTERM, -signals.SIGKILL
    cases = [({0: failure(0, 2, ConfigError), 1: failure(1, term)}, 2),  # the agent stopped rank 1 first
             ({0: failure(0, 3), 1: failure(1, term, ConfigError)}, 2),  # rank 1 recorded, then was stopped
             ({0: failure(0, 4, RunError), 1: failure(1, 2, ConfigError)}, 2),
             ({0: failure(0, 4, RunError), 1: failure(1, 3)}, 4),
             ({0: failure(0, 3), 1: failure(1, kill, RunError)}, 4),
             ({0: failure(0, 4, RunError), 1: failure(1, term)}, 4),  # rank 1 stopped by the agent
             # rank 0 crashed (OOM-killed, SIGSEGV) with no record: rank 1's RunError (a wait for it
             # that ran out) is its symptom; the node is a crash (1), not a requeue-at-once RunError
             ({0: failure(0, kill), 1: failure(1, 4, RunError)}, torchrun.RDZV_FAILED_EXIT),
             ({0: failure(0, -signals.SIGSEGV), 1: failure(1, term, RunError)}, torchrun.RDZV_FAILED_EXIT),
             ({0: failure(0, kill), 1: failure(1, 2, ConfigError)}, 2),  # bad input still wins
             ({0: failure(0, 2), 1: failure(1, 2)}, 2),  # exited 2 before main() could record
             ({0: failure(0, 4), 1: failure(1, 4)}, 4),
             ({0: failure(0, 2), 1: failure(1, 4)}, torchrun.RDZV_FAILED_EXIT),
             ({0: failure(0, 2), 1: failure(1, term)}, torchrun.RDZV_FAILED_EXIT),
             ({0: failure(0, 3), 1: failure(1, term)}, torchrun.RDZV_FAILED_EXIT),
             ({0: failure(0, kill)}, torchrun.RDZV_FAILED_EXIT)]
    for failures, code in cases:
        described = {r: (f.exitcode, f.error_file_data.get("mingpt_error_class")) for r, f in failures.items()}
        assert torchrun.exit_code_for(failures) == code, described

    # Issue 30 review: on GPUs the agent SIGKILLs a worker blocked in NCCL 30 s after another
    # failed, and NCCL's watchdog aborts (SIGABRT) a worker whose peer was lost: neither is a
    # crash (launch/train.sbatch requeues a crash only after progress), the OOM killer's is.
    run_error, late_kill = failure(0, 4, RunError), failure(1, kill)
    late_kill.timestamp = run_error.timestamp + 31
    assert not torchrun.crashed(late_kill, {0: run_error, 1: late_kill})
    assert torchrun.exit_code_for({0: run_error, 1: late_kill}) == 4
    oom_killed = failure(1, kill)
    oom_killed.timestamp = run_error.timestamp
    assert torchrun.crashed(oom_killed, {0: run_error, 1: oom_killed})
    aborted = {0: failure(0, -signals.SIGABRT), 1: failure(1, -signals.SIGABRT)}
    assert not any(torchrun.crashed(f, aborted) for f in aborted.values())
    assert torchrun.exit_code_for(aborted) == torchrun.RDZV_FAILED_EXIT

    refused = ChildFailedError("main.py", cases[0][0])
    line = torchrun.workers_failed(refused)
    assert line and line.startswith("error: worker(s) on") and "rank 0 (local rank 0) exited with code 2" in line
    assert "rank 1 (local rank 1) died of SIGTERM" in line, line
    assert "ConfigError: why" in refused.format_msg()  # plain torchrun's summary shows the line
    (tmp_path / "error.json").write_text(json.dumps({"message": {"message": "ValueError: bug", "extraInfo": {
        "py_callstack": "Traceback ...", "timestamp": "0"}}}))
    bug = ProcessFailure(local_rank=0, pid=1000, exitcode=1, error_file=str(tmp_path / "error.json"))
    assert torchrun.workers_failed(ChildFailedError("main.py", {0: bug})) is None  # torchrun's summary shows it


# A rank that is slow to leave after its error (an atexit sleep in that worker): the agent
# stops it with SIGTERM once the other rank has exited, the race that decided the node's exit
# code before the workers recorded their error class.
SLOW_TO_EXIT = '''
import atexit, os, sys, time
if os.environ.get("RANK") == os.environ.get("SLOW_RANK") and sys.argv and sys.argv[0].endswith("main.py"):
    atexit.register(time.sleep, 60)
'''


def slow_to_exit(tmp_path: Path, rank: int) -> dict:
    site = tmp_path / "slow_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_TO_EXIT)
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "SLOW_RANK": str(rank), "PYTHONUNBUFFERED": "1"}


def launcher_summary(text: str) -> str:
    summary = [line for line in text.splitlines() if line.startswith("mingpt-torchrun: error: worker(s) on")]
    assert len(summary) == 1, text
    return summary[0]


@pytest.mark.cli
def test_bad_input_under_the_launcher_ends_with_one_line_and_exit_2(tmp_path):
    """Two workers refuse a missing data file: one rank says why, the agent adds one summary
    line, no traceback. Rank 1 is slow to leave, so the agent stops it with SIGTERM after rank
    0 exited 2: the launcher still exits 2 (train.sbatch: never requeued), from the class the
    workers recorded, not 1 as when the first exit code decided."""
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.torchrun", "--standalone", "--nproc_per_node=2", str(MAIN),
                           f"data.path={tmp_path / 'missing.txt'}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180, env=slow_to_exit(tmp_path, 1))
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text and "ChildFailedError" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing.txt" in errors[0], text
    summary = launcher_summary(text)
    assert "rank 0 (local rank 0) exited with code 2" in summary and "rank 1 (local rank 1) died of SIGTERM" in summary
    assert proc.returncode == 2, text


@pytest.mark.dist
def test_a_run_error_under_the_launcher_exits_4_whichever_worker_exits_first(tmp_path, small_corpus):
    """Saves fail past trainer.save_retry_minutes (the snapshot directory made unusable after
    the first save): every rank stops with the RunError, one line. Rank 0 is slow to leave, so
    the agent stops it with SIGTERM after rank 1 exited: the launcher exits 4 (a failed run,
    which train.sbatch requeues), not 2 (bad input, never requeued) nor 1."""
    from test_fault_tolerance import wait_for
    from test_waiting_for_rank0 import FailingDirectory

    snapshots, log = tmp_path / "snapshots", tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [PYTHON, "-m", "mingpt_ddp.torchrun", "--standalone", "--nproc_per_node=2", str(MAIN), *TINY,
             f"data.path={small_corpus}", f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=100000",
             f"trainer.snapshot_path={snapshots}/snapshot.pt", "trainer.snapshot_every_steps=4",
             "trainer.log_every=2", "trainer.save_retry_minutes=0.05"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=slow_to_exit(tmp_path, 0), start_new_session=True)
    store = FailingDirectory(snapshots)
    try:
        wait_for(lambda: "saved snapshot" in log.read_text() or proc.poll() is not None, 180, "the first snapshot")
        store.fail()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith(("error:", "[rank 1] error:"))]
    assert len(errors) == 1 and "Traceback" not in text, text
    summary = launcher_summary(text)
    assert "rank 1 (local rank 1) exited with code 4" in summary and "rank 0 (local rank 0) died of SIGTERM" in summary
    assert proc.returncode == 4, text
