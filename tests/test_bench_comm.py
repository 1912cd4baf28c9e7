"""`bench comm` beyond the bandwidth table: the transport each rank's collectives use (read
from NCCL's own INFO log on GPUs), and DDP's step time projected from the measured busbw.
The same across a real (shaped) link between two hosts: tests/test_netns.py."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import PYTHON, REPO, TORCHRUN
from mingpt_ddp.tools import bench
from mingpt_ddp.errors import ConfigError

# NCCL INFO lines as NCCL 2.21 and aws-ofi-nccl print them (formats as in public NCCL and
# aws-ofi-nccl issue reports), from one rank of a 2-node job.
NCCL_LOG = """\
gpu-1:6831:6831 [0] NCCL INFO Bootstrap : Using ens32:10.0.1.17<0>
gpu-1:6831:6831 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
gpu-1:6831:6840 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.9.1-aws
gpu-1:6831:6840 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
gpu-1:6831:6840 [0] NCCL INFO Using network Libfabric
gpu-1:6831:6840 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
gpu-1:6831:6840 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-1:6831:6840 [0] NCCL INFO Channel 00/0 : 15[7] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
gpu-1:6831:6840 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA
"""


@pytest.mark.unit
def test_the_transport_nccl_chose_is_read_from_its_log():
    t = bench.nccl_transport(NCCL_LOG)
    assert t == {"nccl": "2.21.5+cuda12.4", "channels": {"P2P": 2, "NET/Libfabric": 2}, "network": "Libfabric",
                 "provider": "efa", "plugin": "aws-ofi-nccl 1.9.1-aws"}
    line = bench.describe_transport({"backend": "nccl", **t})
    assert line.startswith("NCCL 2.21.5+cuda12.4: NET/Libfabric x2, P2P x2; network Libfabric (aws-ofi-nccl 1.9.1-aws, "
                           "provider efa)"), line
    assert "shared memory" not in line


@pytest.mark.unit
def test_lost_gpu_peer_access_is_named():
    """Under `srun --gpus-per-task=1` with cgroup device isolation each rank sees only its
    own GPU: NCCL's channels inside a node go through shared memory instead of P2P."""
    log = NCCL_LOG.replace("via P2P/CUMEM/read", "via SHM/direct/direct").replace("via P2P/CUMEM", "via SHM/direct/direct")
    line = bench.describe_transport({"backend": "nccl", **bench.nccl_transport(log)})
    assert "SHM x2" in line and "--gpus-per-task=1" in line and "NCCL_P2P_DISABLE" in line, line
    unknown = bench.describe_transport({"backend": "nccl", "unknown": "transport unknown (NCCL_DEBUG_FILE is set by you)"})
    assert "NCCL_DEBUG_FILE is set by you" in unknown
    gloo = bench.describe_transport({"backend": "gloo", "gloo_socket_ifname": "ens5"})
    assert gloo == "gloo over TCP on interface ens5 (GLOO_SOCKET_IFNAME)"


@pytest.mark.unit
def test_nccl_log_is_left_alone_without_gpus(monkeypatch):
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    monkeypatch.delenv(bench.NCCL_LOG_DIR, raising=False)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    bench.nccl_log_to_files()
    assert "NCCL_DEBUG_FILE" not in bench.os.environ
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/mine/nccl.%h.%p")
    bench.nccl_log_to_files()
    assert bench.os.environ["NCCL_DEBUG_FILE"] == "/mine/nccl.%h.%p"  # the user's file wins


def rows(busbw_GBps: float) -> list[dict]:
    return [{"size": s, "busbw_GBps": busbw_GBps} for s in (1 << 16, 1 << 20, 1 << 24)]


@pytest.mark.unit
def test_ddp_projection_overlaps_buckets_with_the_backward():
    """100 ms of compute (backward: the middle 2/3), 4 MiB of gradients in 1 MiB buckets.
    On a fast link every bucket but the last hides behind the backward; on a slow one the
    buckets queue up and most of the all_reduce is exposed. A ring moves 2(N-1)/N of each
    bucket over every link."""
    compute = {"step_ms": 100.0, "gradient_bytes": 4 << 20, "bucket_bytes": 1 << 20}
    bucket_s = (1 << 20) / 1e9  # 1 MiB at 1 GB/s, 2 hosts (2(N-1)/N = 1)
    fast = bench.project_ddp_step(compute, rows(1.0), 2)
    assert fast["buckets"] == 4
    assert fast["comm_ms"] == pytest.approx(4e3 * bucket_s) and fast["exposed_ms"] == pytest.approx(1e3 * bucket_s)
    assert fast["step_ms"] == pytest.approx(100 + 1e3 * bucket_s)
    four = bench.project_ddp_step(compute, rows(1.0), 4)
    assert four["exposed_ms"] == pytest.approx(1.5e3 * bucket_s)

    slow = bench.project_ddp_step(compute, rows(0.01), 2)  # each bucket 104.9 ms
    first_ready_ms, backward_end_ms = 100 / 6 + 100 * 2 / 3 / 4, 100 / 6 + 100 * 2 / 3
    assert slow["exposed_ms"] == pytest.approx(first_ready_ms + 4 * 1e5 * bucket_s - backward_end_ms)
    assert slow["step_ms"] == pytest.approx(100 + slow["exposed_ms"])


@pytest.mark.unit
def test_busbw_between_the_sizes_measured():
    measured = [{"size": 1 << 10, "busbw_GBps": 0.1}, {"size": 1 << 20, "busbw_GBps": 10.0}]
    assert bench.busbw_at(measured, 1 << 15) == pytest.approx(5.05)  # halfway on a log scale
    assert bench.busbw_at(measured, 1 << 9) == pytest.approx(0.05)  # latency-bound below: same time
    assert bench.busbw_at(measured, 1 << 30) == 10.0


@pytest.mark.unit
def test_projection_needs_a_one_process_train_json(tmp_path):
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"mode": "train", "env": {"world_size": 2}}))
    with pytest.raises(ConfigError, match="run as one process"):
        bench.load_compute(str(two))
    with pytest.raises(ConfigError, match="cannot read a bench train JSON"):
        bench.load_compute(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="hosts=1"):
        bench.parse_hosts("1")


@pytest.mark.dist
def test_comm_prints_its_transport_and_the_projection(tmp_path):
    """Two gloo ranks: the table, each rank's transport, and one projection line per host
    count, from a one-process train JSON (the bucket size from its overrides). One rank
    alone has no busbw to project from: one line saying so."""
    train = tmp_path / "train.json"
    train.write_text(json.dumps({
        "mode": "train", "env": {"world_size": 1}, "overrides": ["model=gpt-nano", "trainer.ddp_bucket_cap_mb=0.5"],
        "strategy": "ddp", "ms_per_step": 40.0, "ms_per_step_median": 30.0, "parameters": 89_232,
        "state_bytes_whole_model": {"parameters": 356_928, "gradients": 356_928, "optimizer_state": 713_864}}))
    args = ["-m", "mingpt_ddp.bench", "comm", "min_bytes=64KB", "max_bytes=256KB", "iters=2", "warmup=1",
            f"project={train}", "hosts=2,8", f"out={tmp_path / 'comm.json'}"]
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"# transport, rank\(s\) 0,1 on \S+: gloo over TCP", proc.stdout), proc.stdout
    assert "compute 30.0 ms/step" in proc.stdout and "buckets of 0.5 MiB" in proc.stdout, proc.stdout
    for n in (2, 8):
        assert re.search(rf"^at {n} hosts of this link, step = compute \+ exposed comm = 30\.0 \+ [\d.]+ = [\d.]+ ms",
                         proc.stdout, re.M), proc.stdout
    saved = json.loads((tmp_path / "comm.json").read_text())
    assert [p["hosts"] for p in saved["projection"]["hosts"]] == [2, 8] and saved["transport"][0]["backend"] == "gloo"

    alone = subprocess.run([PYTHON, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and alone.stderr.strip() == (
        "error: project= needs the all_reduce measured over 2 or more ranks, one per host across the link "
        "(torchrun --nnodes=2 --nproc_per_node=1 ...)"), alone.stderr
