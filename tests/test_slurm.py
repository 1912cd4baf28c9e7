"""The launch scripts on a real Slurm cluster: slurmctld plus two slurmd "nodes" (n1, n2) on
this machine, brought up once for the session by tests/slurm_cluster.sh and stopped by PID
at the end. Every job trains gpt-nano for a few dozen steps on CPU.

What each test proves is in its docstring. Skipped, with the reason, where Slurm cannot be
installed (not root, no apt-get).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, output

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLUSTER_SH = REPO / "tests" / "slurm_cluster.sh"
MULTINODE = REPO / "launch" / "multinode.sh"
SBATCH_SCRIPT = REPO / "launch" / "train.sbatch"
PYTHON = REPO / ".venv" / "bin" / "python"

# Rank probe: a sitecustomize on PYTHONPATH that, in each trainer process, records at exit
# where the process stood (RANK etc. from torchrun, or from Slurm via read_topology).
PROBE = '''
import atexit, json, os, socket, sys
_dir = os.environ.get("MINGPT_RANK_PROBE")
def _record():
    if _dir and "RANK" in os.environ and sys.argv and sys.argv[0].endswith("main.py"):
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "SLURM_JOB_ID")
        info = {k: os.environ.get(k) for k in keys}
        info["host"] = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        with open(os.path.join(_dir, f"{info['host']}-{os.getpid()}.json"), "w") as f:
            json.dump(info, f)
atexit.register(_record)
'''


# ---- the cluster ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def slurm():
    """Bring the two-node cluster up once; yields the environment for srun/sbatch."""
    if not shutil.which("bash") or sys.platform != "linux":
        pytest.skip("needs Linux and bash")
    # Not pytest's tmp_path: munged (user munge) must be able to reach the directory.
    cluster_dir = tempfile.mkdtemp(prefix="mingpt-slurm-")
    up = subprocess.run(["bash", str(CLUSTER_SH), "up", cluster_dir], capture_output=True, text=True, timeout=300)
    if up.returncode == 3:
        shutil.rmtree(cluster_dir, ignore_errors=True)
        pytest.skip(f"no Slurm on this machine: {up.stderr.strip().splitlines()[-1]}")
    if up.returncode != 0:
        down = subprocess.run(["bash", str(CLUSTER_SH), "down", cluster_dir], capture_output=True, text=True)
        logs = "".join(f"\n--- {p}\n{p.read_text()[-2000:]}" for p in Path(cluster_dir, "log").glob("*.log"))
        shutil.rmtree(cluster_dir, ignore_errors=True)
        pytest.fail(f"Slurm bring-up failed:\n{up.stderr}{down.stderr}{logs}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    # PREFLIGHT=0: train.sbatch's default (1) is tested in tests/test_launch.py, the checks on this
    # cluster by the tests that ask for them; the other jobs skip their extra torchrun round.
    env.update(SLURM_CONF=f"{cluster_dir}/slurm.conf", PYTHONUNBUFFERED="1", PREFLIGHT="0")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "down", cluster_dir], capture_output=True, text=True)
        shutil.rmtree(cluster_dir, ignore_errors=True)


@pytest.fixture
def probe(tmp_path):
    """(environment additions, function returning the recorded processes)."""
    site = tmp_path / "probe_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    records = tmp_path / "ranks"
    records.mkdir()

    def read():
        return [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]

    return {"PYTHONPATH": str(site), "MINGPT_RANK_PROBE": str(records)}, read


def tiny(corpus: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.path={corpus}", *extra]


def job_id_from(text: str) -> str:
    m = re.search(r"Slurm job (\d+)", text)
    assert m, text
    return m.group(1)


def topology_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("multinode: topology:")]


def sbatch(env: dict, log_dir: Path, args: list[str], extra_env: dict | None = None) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={log_dir}/%x_%j.out", str(SBATCH_SCRIPT), *args],
        cwd=REPO, env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, output(proc)
    return proc.stdout.strip().split(";")[0]


def job_field(env: dict, job: str, name: str) -> str:
    info = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S+)", info)
    return m.group(1) if m else ""


def wait_job(env: dict, job: str, timeout: float) -> str:
    """Wait until the job has left the queue for good; its final state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(env, job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} still {job_field(env, job, 'JobState')} after {timeout} s")


def wait_for_text(path: Path, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text()):
            return
        time.sleep(0.2)
    pytest.fail(f"{pattern!r} not in {path} after {timeout} s:\n{path.read_text() if path.exists() else '(no file)'}")


def final_fingerprint(text: str) -> str:
    m = re.findall(r"parameters identical on all \d+ rank\(s\) \(sha256 (\w+)\)", text)
    assert m, text
    return m[-1]


def job_processes(job: str, node: str) -> list[tuple[int, str, bool]]:
    """(pid, command line, is a trainer worker) of the job's processes on `node`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"SLURMD_NODENAME={node}".encode() in env:
            found.append((int(entry), cmd, any(e.startswith(b"RANK=") for e in env) and "main.py" in cmd))
    return found


# ---- srun ----------------------------------------------------------------------------------
def test_srun_multinode_trains_across_both_nodes(slurm, probe, small_corpus, tmp_path):
    """`srun -N2 --ntasks-per-node=1 launch/multinode.sh`, started from another directory,
    with NPROC_PER_NODE=2: one torchrun agent per node, world size 2 x 2 = 4, global ranks
    0..3 each exactly once (two per node, local ranks 0 and 1 on each), the rendezvous on
    the first node, one snapshot writer, outputs in the given hydra.run.dir."""
    probe_env, recorded = probe
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", str(MULTINODE),
         *tiny(small_corpus, "trainer.max_steps=10", f"hydra.run.dir={run_dir}")],
        cwd=tmp_path, env={**slurm, **probe_env, "NPROC_PER_NODE": "2", "MAX_RESTARTS": "0"},
        capture_output=True, text=True, timeout=240,
    )
    out = output(proc)
    assert proc.returncode == 0, out

    topo = topology_lines(out)
    assert len(topo) == 2, out  # one line per node
    assert any(" n1 " in t and "hosts the rendezvous n1:" in t for t in topo), topo
    assert any(" n2 " in t and "joins n1:" in t for t in topo), topo
    assert all("nnodes=2 nproc_per_node=2" in t for t in topo), topo
    assert "training" in out and "on 4 process(es)" in out, out

    ranks = recorded()
    assert sorted(int(r["RANK"]) for r in ranks) == [0, 1, 2, 3], ranks
    assert {r["WORLD_SIZE"] for r in ranks} == {"4"}, ranks
    by_host = {h: sorted(int(r["LOCAL_RANK"]) for r in ranks if r["host"] == h) for h in ("n1", "n2")}
    assert by_host == {"n1": [0, 1], "n2": [0, 1]}, ranks
    assert {r["GROUP_RANK"] for r in ranks} == {"0", "1"}, ranks

    # One writer: rank 0 alone logs saves (the last step twice: pending its final evaluation,
    # then evaluated; four writers would log eight), and the snapshots are in the run directory.
    assert out.count("saved snapshot") == 2, out
    assert (run_dir / "snapshot.pt").exists() and list(run_dir.glob("snapshot.step*.pt")), list(run_dir.iterdir())
    assert "done: step 10" in out, out


def test_plain_srun_without_torchrun(slurm, probe, small_corpus, tmp_path):
    """`srun -N2 --ntasks-per-node=1 python mingpt_ddp/main.py`: no torchrun; the trainer takes
    its rank from SLURM_PROCID / SLURM_NTASKS and meets on the first node (read_topology).
    Without hydra.run.dir the run directory is outputs/slurm-<job id>."""
    probe_env, recorded = probe
    proc = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", str(PYTHON), "mingpt_ddp/main.py",
         *tiny(small_corpus, "trainer.max_steps=10")],
        cwd=REPO, env={**slurm, **probe_env}, capture_output=True, text=True, timeout=180,
    )
    out = output(proc)
    ranks = recorded()
    jobs = {r["SLURM_JOB_ID"] for r in ranks}
    try:
        assert proc.returncode == 0, out
        assert "on 2 process(es)" in out and "done: step 10" in out, out
        assert sorted((r["host"], r["RANK"]) for r in ranks) == [("n1", "0"), ("n2", "1")], ranks
        assert {r["MASTER_ADDR"] for r in ranks} == {"n1"}, ranks
        assert len(jobs) == 1, ranks
        assert f"saved snapshot {REPO}/outputs/slurm-{next(iter(jobs))}/snapshot" in out, out
    finally:
        for job in jobs:
            shutil.rmtree(REPO / "outputs" / f"slurm-{job}", ignore_errors=True)


def test_node_failure_fails_fast_with_a_clear_message(slurm, small_corpus, tmp_path):
    """SIGKILL the torchrun agent on n2 mid-run (MAX_RESTARTS=2 allowed): multinode.sh on n2
    names the failure and stops that node's orphaned workers, srun --kill-on-bad-exit ends the
    step, and the whole job exits non-zero within seconds instead of hanging until the
    rendezvous or time limit. No process of the job is left on either node."""
    proc = subprocess.Popen(
        ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", str(MULTINODE),
         *tiny(small_corpus, "trainer.max_steps=100000", f"hydra.run.dir={tmp_path / 'run'}")],
        cwd=REPO, env={**slurm, "MAX_RESTARTS": "2", "RDZV_TIMEOUT": "600"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    job = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if job is None and "Slurm job" in line:
                job = job_id_from(line)
            if re.search(r"step \d+/\d+", line):
                break
        assert job, "".join(lines)
        agents = [pid for pid, cmd, worker in job_processes(job, "n2") if "-m mingpt_ddp.torchrun" in cmd and not worker]
        assert len(agents) == 1, job_processes(job, "n2")
        killed_at = time.monotonic()
        os.kill(agents[0], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            if job:
                subprocess.run(["scancel", job], env=slurm)
    out = "".join(lines) + rest
    assert proc.returncode != 0, out
    assert elapsed < 45, f"took {elapsed:.0f} s to fail:\n{out}"
    assert "the torchrun agent on n2 died of SIGKILL" in out, out
    assert "n2: task 1" in out, out  # srun names the task that failed
    deadline = time.monotonic() + 15
    while (job_processes(job, "n1") or job_processes(job, "n2")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(job, "n1") == [] and job_processes(job, "n2") == []


def test_worker_failure_on_one_node_recovers_with_restarts(slurm, small_corpus, tmp_path):
    """SIGKILL one trainer worker on n2 with MAX_RESTARTS=1: both agents restart their
    workers in a new rendezvous round, the workers resume from the latest snapshot, and the
    job completes (srun exits 0)."""
    proc = subprocess.Popen(
        ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", str(MULTINODE),
         *tiny(small_corpus, "trainer.max_steps=16", "trainer.log_every=2", "trainer.snapshot_every_steps=2",
               f"hydra.run.dir={tmp_path / 'run'}")],
        cwd=REPO, env={**slurm, "MAX_RESTARTS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    job = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if job is None and "Slurm job" in line:
                job = job_id_from(line)
            if "saved snapshot" in line:
                break
        workers = [pid for pid, cmd, worker in job_processes(job, "n2") if worker]
        assert len(workers) == 1, job_processes(job, "n2")
        os.kill(workers[0], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=180)  # a restart re-imports torch on a loaded machine
    finally:
        if proc.poll() is None:
            proc.kill()
            if job:
                subprocess.run(["scancel", job], env=slurm)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert re.search(r"resumed from \S+: epoch \d+, step [1-9]", out), out
    assert "done: step 16" in out, out


# ---- sbatch --------------------------------------------------------------------------------
# Identical training in the reference and the preempted job; log_every=2 also makes the
# trainer check for a stop request every 2 steps, so the signal lands mid-run.
REFERENCE_STEPS = 20
REFERENCE_ARGS = [f"trainer.max_steps={REFERENCE_STEPS}", "trainer.log_every=2"]


@pytest.fixture(scope="module")
def reference_job(slurm, small_corpus, tmp_path_factory):
    """One uninterrupted `sbatch launch/train.sbatch` run, default run directory."""
    logs = tmp_path_factory.mktemp("sbatch-logs")
    job = sbatch(slurm, logs, tiny(small_corpus, *REFERENCE_ARGS))
    state = wait_job(slurm, job, timeout=240)
    log = (logs / f"mingpt_{job}.out").read_text()
    yield job, state, log
    shutil.rmtree(REPO / "outputs" / f"slurm-{job}", ignore_errors=True)


def test_sbatch_train_script_completes(reference_job):
    """`sbatch launch/train.sbatch`: the job completes on both nodes; its log has the
    topology line of each node, the training losses and the final result; the run
    directory is outputs/slurm-<job id>."""
    job, state, log = reference_job
    assert state == "COMPLETED", log
    assert f"train.sbatch: job {job} on 2 node(s)" in log, log
    topo = topology_lines(log)
    assert len(topo) == 2 and all(f"Slurm job {job}" in t for t in topo), log
    assert re.search(rf"step {REFERENCE_STEPS}/{REFERENCE_STEPS} epoch \d+ \| train_loss \d+\.\d+", log), log
    assert re.search(rf"done: step {REFERENCE_STEPS}, epoch \d+, val_loss \d+\.\d+", log), log
    assert "on 2 process(es)" in log, log
    assert "train.sbatch: done" in log, log
    run_dir = REPO / "outputs" / f"slurm-{job}"
    assert (run_dir / "snapshot.pt").exists(), log
    assert f"saved snapshot {run_dir}/snapshot.step" in log, log


def preempted_job(slurm: dict, log_dir: Path, args: list[str], progress: str, timeout: float = 240):
    """`sbatch launch/train.sbatch ARGS`, SIGUSR1 to its batch shell once the log shows
    `progress`; (job id, final state, log) once the job has left the queue."""
    job = sbatch(slurm, log_dir, args)
    log_path = log_dir / f"mingpt_{job}.out"
    wait_for_text(log_path, progress, timeout=150)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    state = wait_job(slurm, job, timeout=timeout)
    return job, state, log_path.read_text()


def test_sbatch_preemption_snapshots_requeues_and_resumes_exactly(slurm, reference_job, small_corpus, tmp_path):
    """SIGUSR1 to the batch shell (as `--signal=B:USR1@120` does before the time limit):
    train.sbatch passes it to the training step, the trainer snapshots and stops, the
    script requeues the job, and the requeued job (same id, same run directory) resumes from
    that snapshot and ends with exactly the parameters of the uninterrupted run."""
    _, ref_state, ref_log = reference_job
    assert ref_state == "COMPLETED", ref_log
    run_dir = tmp_path / "run"
    job, state, log = preempted_job(slurm, tmp_path, tiny(small_corpus, *REFERENCE_ARGS, f"hydra.run.dir={run_dir}"),
                                    rf"step 2/{REFERENCE_STEPS} ")
    assert state == "COMPLETED", log
    assert "SIGUSR1" in log and f"requeueing job {job}" in log, log
    m = re.search(r"(?:preempted|stopped by SIG[A-Z0-9]+) at step (\d+)", log)
    assert m, log
    stopped_at = int(m.group(1))
    assert 0 < stopped_at < REFERENCE_STEPS, log
    assert job_field(slurm, job, "Restarts") == "1", log
    assert "restart 1" in log, log
    assert re.search(rf"resumed from \S+: epoch \d+, step {stopped_at}", log), log
    assert f"done: step {REFERENCE_STEPS}" in log, log
    assert final_fingerprint(log) == final_fingerprint(ref_log), "resumed run differs from the uninterrupted one"


def test_sbatch_sweep_preemption_ends_the_sweep_and_the_requeued_job_finishes_it(slurm, small_corpus, tmp_path):
    """`sbatch launch/train.sbatch -m ...` and SIGUSR1 to the batch shell during point 0:
    that point snapshots, the sweep ends there (point 1 never starts in that attempt), the
    step exits 0 and the script requeues the job; the requeued sweep resumes point 0 and
    runs point 1."""
    sweep = tmp_path / "sweep"
    job, state, log = preempted_job(slurm, tmp_path, ["-m", "trainer.seed=1,2", *tiny(
        small_corpus, "trainer.max_steps=20", f"hydra.sweep.dir={sweep}")], r"step 5/20 ", timeout=400)
    assert state == "COMPLETED", log
    first, _, after = log.partition("restart 1")
    assert after, log
    assert "sweep stopped by SIGUSR1 after point 0" in first and f"requeueing job {job}" in first, log
    assert "#1 : trainer.seed=2" not in first and "step 5/20 " in first, log  # point 1 never started
    assert re.search(r"resumed from \S+/0/snapshot\.step\d+\.pt", after), log
    rows = (sweep / "summary.csv").read_text().splitlines()[1:]
    assert [r.split(",")[2] for r in rows] == ["completed", "completed"], rows


def test_sbatch_never_requeues_bad_input_whatever_srun_reports(slurm, tmp_path):
    """A missing data file, with REQUEUE_MIN_STEP_SECONDS=0 (the step's short life cannot
    save it): every worker records its ConfigError in <submit dir>/.mingpt-step/<job>/<restart>/,
    which the batch
    script reads, since srun reports 143 when --kill-on-bad-exit stopped the other node before
    that node's own exit 2. The job is not requeued."""
    run_dir = tmp_path / "run"
    job = sbatch(slurm, tmp_path, tiny(tmp_path / "missing.txt", f"hydra.run.dir={run_dir}"),
                 {"REQUEUE_MIN_STEP_SECONDS": "0", "MAX_REQUEUES": "1", "MAX_RESTARTS": "0"})
    state = wait_job(slurm, job, timeout=180)
    log = (tmp_path / f"mingpt_{job}.out").read_text()
    assert state == "FAILED", log
    assert "training step refused its input (a ConfigError, step exit code " in log, log
    assert "requeueing" not in log and job_field(slurm, job, "Restarts") == "0", log
    assert not (run_dir / ".step_errors").exists(), log  # the records are the job's, and go with it


# ---- pre-flight checks -----------------------------------------------------------------------
def test_sbatch_preflight_passes_then_trains(slurm, small_corpus, tmp_path):
    """PREFLIGHT=1 sbatch launch/train.sbatch: through the job's own torchrun topology (gloo on
    the two nodes) every node reports host, CPU cores and versions, the all_reduce sweep
    prints busbw, the checks pass, and then the job trains to completion."""
    run_dir = tmp_path / "run"
    job = sbatch(slurm, tmp_path, tiny(small_corpus, "trainer.max_steps=6", f"hydra.run.dir={run_dir}"),
                 {"PREFLIGHT": "1"})
    state = wait_job(slurm, job, timeout=300)
    log = (tmp_path / f"mingpt_{job}.out").read_text()
    assert state == "COMPLETED", log
    assert "preflight: 2 node(s), 2 rank(s)" in log, log
    assert re.search(r"preflight: node n1: 1 worker\(s\) \| CPU, \d+ cores \| torch \S+", log), log
    assert "preflight: node n2: " in log and "busbw(GB/s)" in log, log
    assert log.index("preflight: passed") < log.index("on 2 process(es)"), log
    assert "done: step 6" in log and (run_dir / "snapshot.pt").exists(), log


def run_preflight(slurm, small_corpus, tmp_path, **settings: str) -> tuple[subprocess.CompletedProcess, Path, float]:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", str(MULTINODE),
         *tiny(small_corpus, "trainer.max_steps=6", f"hydra.run.dir={run_dir}")],
        cwd=tmp_path, env={**slurm, "MAX_RESTARTS": "2", **settings}, capture_output=True, text=True, timeout=300,
    )
    return proc, run_dir, time.monotonic() - start


def test_preflight_below_min_busbw_stops_before_training(slurm, small_corpus, tmp_path):
    """PREFLIGHT_MIN_BUSBW above anything gloo reaches: the job stops before any training step
    (MAX_RESTARTS does not retry a failed check), with one message giving the measured busbw,
    the nodes and the threshold."""
    proc, run_dir, elapsed = run_preflight(slurm, small_corpus, tmp_path, PREFLIGHT="1", PREFLIGHT_MIN_BUSBW="1e9")
    out = output(proc)
    assert proc.returncode != 0, out
    errors = [line for line in out.splitlines() if line.startswith("error: preflight:")]
    assert len(errors) == 1, out
    assert re.search(r"busbw \d+\.\d+ GB/s at [\d,]+ bytes over 2 ranks on n1, n2 is below PREFLIGHT_MIN_BUSBW=1e\+09",
                     errors[0]), errors
    assert "pre-flight checks did not pass" in out, out
    assert "on 2 process(es)" not in out and not re.search(r"step \d+/", out), out
    assert not run_dir.exists(), list(run_dir.iterdir())
    assert elapsed < 150, f"{elapsed:.0f} s"


def test_preflight_only_checks_and_exits(slurm, small_corpus, tmp_path):
    """PREFLIGHT=only: the checks run on both nodes and pass; nothing trains."""
    proc, run_dir, _ = run_preflight(slurm, small_corpus, tmp_path, PREFLIGHT="only")
    out = output(proc)
    assert proc.returncode == 0, out
    assert "preflight: 2 node(s), 2 rank(s)" in out and "preflight: passed" in out, out
    assert out.count("PREFLIGHT=only: not training") == 2, out
    assert "on 2 process(es)" not in out and not run_dir.exists(), out


# ---- sweeps --------------------------------------------------------------------------------
def test_sweep_submits_one_job_per_point(slurm, small_corpus, tmp_path):
    """`main.py -m hydra/launcher=slurm optimizer.lr=a,b`: hydra-submitit-launcher submits one
    Slurm job per point; both complete, each in its own directory under the one sweep
    directory that the submitting process named (multirun/${run_id:} is resolved there,
    not again inside each job), each with its own metrics and snapshot."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    sweep_root = tmp_path / "multirun"
    proc = subprocess.run(
        [str(PYTHON), "mingpt_ddp/main.py", "-m", "hydra/launcher=slurm",
         *tiny(small_corpus, "trainer.max_steps=10"), "optimizer.lr=1e-3,3e-4",  # after TINY's lr
         f"hydra.sweep.dir={sweep_root}/${{run_id:}}"],
        cwd=REPO, env=slurm, capture_output=True, text=True, timeout=300,
    )
    out = output(proc)
    assert proc.returncode == 0, out
    sweeps = [p for p in sweep_root.iterdir() if p.is_dir()]
    assert len(sweeps) == 1, sweeps  # one sweep directory, the submitter's timestamp
    assert not sweeps[0].name.startswith("slurm-"), sweeps
    points = sorted(p.name for p in sweeps[0].iterdir() if p.is_dir() and not p.name.startswith("."))
    assert points == ["0", "1"], points
    lrs = set()
    for point in points:
        d = sweeps[0] / point
        assert (d / "snapshot.pt").exists(), list(d.iterdir())
        assert "done: step 10" in (d / "main.log").read_text(), (d / "main.log").read_text()
        lrs.add(re.search(r"optimizer\.lr=(\S+)", (d / ".hydra" / "overrides.yaml").read_text()).group(1))
    assert lrs == {"0.001", "0.0003"}, lrs
    assert len(list((sweeps[0] / ".submitit").glob("*_0"))) == 1  # one array job, two tasks
    # CPUs per task from the nodes (2 CPUs, 1 task per node), srun told to use them and to end
    # the step when a task fails.
    script = next((sweeps[0] / ".submitit").rglob("*submission.sh")).read_text()
    assert "#SBATCH --cpus-per-task=2" in script, script
    assert "export SLURM_KILL_BAD_EXIT=1" in script and "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK" in script, script
