"""DDP's step time across a shaped link, measured against its projection from the link's busbw.

    sudo .venv/bin/python benchmarks/netns_ddp.py [--rate-mbit 100] [--rounds 3] [--steps 12]

Two hosts in Linux network namespaces of this machine joined by a veth link shaped with
`tc tbf` (tests/netns_hosts.py; netem's delay too where the kernel has it). Once: `bench comm`
across the two hosts (busbw against the link's rate). Then, per round and interleaved so
both see the same load: the compute, as one single-process `bench train` on each host at
once, and `bench train` as DDP across the two hosts (one process each, gradients in small
buckets so the all_reduce overlaps the backward); each host's processes are pinned to a core of
its own (tests/netns_hosts.py), so a host is one core running one thread. Each round's
projection is `bench comm`'s: step = compute + exposed comm, from that round's compute and the
measured busbw. Prints the figures and the median
ratio measured / projected; the model is gpt-nano at block 32 (the tests' TINY settings).
Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import TINY, corpus_path  # noqa: E402
from mingpt_ddp.tools import bench  # noqa: E402
from netns_hosts import Network  # noqa: E402

PYTHON = sys.executable


def run_bench(host, head, port: int, args: list[str], out: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": host.dev}
    cmd = host.cmd(PYTHON, "-m", "mingpt_ddp.torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={head.addr}:{port}", f"--rdzv_id=b{port}", f"--local-addr={host.addr}",
                   "--max-restarts=0", "-m", "mingpt_ddp.bench", *args, f"out={out}")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def across(net: Network, args: list[str], out: Path, port: int) -> dict:
    a, _ = net.hosts
    procs = [run_bench(h, a, port, args, out, out.with_suffix(f".{i}.log"))  # rank 0 writes `out`
             for i, h in enumerate(net.hosts)]
    if any(p.wait(timeout=900) for p in procs):
        sys.exit(f"failed: {out.with_suffix('.0.log').read_text()[-3000:]}")
    return json.loads(out.read_text())


def compute_alone(net: Network, train: list[str], work: Path, i: int) -> Path:
    """The compute of one DDP rank without its gradient exchange: one single-process `bench
    train` on each host at the same time, as the two DDP ranks share this machine's cores;
    the slower one's JSON (DDP's step waits for the slower rank)."""
    outs = [work / f"compute{i}-{h.ns}.json" for h in net.hosts]
    procs = [subprocess.Popen(h.cmd(PYTHON, "-m", "mingpt_ddp.bench", *train, f"out={out}"), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, out in zip(net.hosts, outs)]
    for proc in procs:
        text, _ = proc.communicate(timeout=900)
        if proc.returncode:
            sys.exit(text)
    return max(outs, key=lambda o: bench.load_compute(str(o))["step_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--bucket-mb", type=float, default=0.1)
    opts = ap.parse_args()
    why = Network.unavailable()
    if why:
        sys.exit(why)
    work = Path(tempfile.mkdtemp(prefix="netns-ddp-"))
    train = ["train", *TINY, f"data.path={corpus_path()}", f"trainer.ddp_bucket_cap_mb={opts.bucket_mb}",
             f"steps={opts.steps}", "warmup=3"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in Path("/proc/cpuinfo").read_text()]
    print(f"commit {commit}; CPU flags {','.join(flags)}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f} at start")
    with Network(rate_mbit=opts.rate_mbit, delay_ms=1) as net:
        print(f"link: {net.shaping}")
        comm = across(net, ["comm", "min_bytes=16KB", "max_bytes=4MB", "iters=5", "warmup=2"], work / "comm.json", 29811)
        link_GBps = opts.rate_mbit / 8 / 1000
        for r in comm["rows"]:
            print(f"  all_reduce {r['size']:>9,} B: busbw {r['busbw_GBps'] * 1e3:6.2f} MB/s "
                  f"({r['busbw_GBps'] / link_GBps:.0%} of the link's {link_GBps * 1e3:.2f} MB/s)")
        ratios = []
        for i in range(opts.rounds):
            alone = compute_alone(net, train, work, i)
            ddp = across(net, train, work / f"ddp{i}.json", 29812 + i)
            compute = bench.load_compute(str(alone))
            p = bench.project_ddp_step(compute, comm["rows"], 2)
            measured = ddp["ms_per_step_median"]
            ratios.append(measured / p["step_ms"])
            print(f"round {i + 1}: at 2 hosts of this link, step = compute + exposed comm = {p['compute_ms']:.1f} + "
                  f"{p['exposed_ms']:.1f} = {p['step_ms']:.1f} ms projected (all_reduce {p['comm_ms']:.1f} ms in "
                  f"{p['buckets']} buckets); measured {measured:.1f} ms (median of {opts.steps}); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
        for n in (4, 8, 16):
            p = bench.project_ddp_step(compute, comm["rows"], n)
            print(f"at {n} hosts of this link, step = compute + exposed comm = {p['compute_ms']:.1f} + "
                  f"{p['exposed_ms']:.1f} = {p['step_ms']:.1f} ms (last round's compute)")
    print(f"measured / projected: median {statistics.median(ratios):.2f} over {len(ratios)} round(s) "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
