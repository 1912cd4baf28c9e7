"""One live run per snapshot location (mingpt_ddp/checkpoint/run_lock.py), tried with real processes:
holders in other PID namespaces (`unshare`), SIGKILLed holders, two steps of one Slurm job,
two runs taking over one stale lock at the same time, the requests an S3 server really
receives (through a recording proxy on loopback), and a run that loses its lock."""
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import MAIN, PYTHON, REPO, TINY, load_snapshot, run_cli, s3_options
from test_fault_tolerance import metrics_lines, wait_for
from test_rank_agreement import args, expect_config_error, must_pass

JOB_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def no_job(monkeypatch):
    """This test process belongs to no Slurm job or torchrun run unless the test says so."""
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def lock_store(url, options=None):
    from mingpt_ddp.checkpoint.snapshot import SnapshotStore

    return SnapshotStore(str(url), storage_options=options)


def new_lock(url, options=None, **kwargs):
    from mingpt_ddp.checkpoint.run_lock import RunLock

    return RunLock(lock_store(url, options), **kwargs)


def s3_url(server):
    bucket = f"lock-{uuid.uuid4().hex[:12]}"
    server.make_bucket(bucket)
    return f"s3://{bucket}/run/snapshot.pt"


def where_to_lock(where, tmp_path, request):
    """(snapshot URL, storage options) of a local directory or a bucket on a real S3 server."""
    if where == "local":
        return tmp_path / "snapshot.pt", None
    server = request.getfixturevalue(where)
    return s3_url(server), s3_options(server)


def lock_key(url):
    return str(url).rsplit("/", 1)[0] + "/.snapshot.lock"


def read_owner(url, options=None):
    import fsspec

    fs, path = fsspec.core.url_to_fs(lock_key(url), **(options or {}))
    fs.invalidate_cache()
    return json.loads(fs.cat_file(path))


def write_owner(url, options=None, **fields):
    """A lock record left by another run: another machine (no boot id of ours), 60 s old."""
    import fsspec

    owner = {"host": "elsewhere", "pid": 4242, "pid_start": None, "job": None, "started": time.time() - 60,
             "heartbeat": time.time(), "token": "other"}
    owner.update(fields)
    fs, path = fsspec.core.url_to_fs(lock_key(url), **(options or {}))
    if fs.protocol in ("file", "local") or "file" in fs.protocol:  # whole or not at all, as a real writer's
        fs.pipe_file(path + ".tmp", json.dumps(owner).encode())
        os.replace(path + ".tmp", path)
    else:
        fs.pipe_file(path, json.dumps(owner).encode())
    return owner


HOLDER = """
import json, os, sys
from mingpt_ddp.checkpoint.snapshot import SnapshotStore
from mingpt_ddp.checkpoint.run_lock import RunLock
lock = RunLock(SnapshotStore(sys.argv[1], storage_options=json.loads(sys.argv[2]) or None))
lock.acquire()
print("held", os.getpid(), flush=True)
sys.stdin.read()  # hold it until the test closes stdin (or kills this process)
lock.release()
"""


RUN_DIR_HOLDER = """
import sys
from mingpt_ddp.checkpoint import run_dir
run_dir.hold_run_dir(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


@contextmanager
def holding(url, options=None, env=None, namespace=False, log=None, script=HOLDER):
    """A real process that takes the lock and holds it; with `namespace`, in a PID namespace
    of its own (as in another container on this host: same host name, same kernel).
    script=RUN_DIR_HOLDER: the lock of the run directory `url`."""
    cmd = [PYTHON, "-c", script, str(url), json.dumps(options or {})]
    if namespace:
        cmd = ["unshare", "--pid", "--mount-proc", "--kill-child", *cmd]
    full_env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    full_env.update(env or {})
    with open(log or os.devnull, "w") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                cwd=REPO, env=full_env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("held"), (line, Path(log).read_text() if log else "")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def dead_pid() -> int:
    child = subprocess.Popen([PYTHON, "-c", "pass"])
    child.wait()
    return child.pid


def no_flock(fd, operation):
    """fcntl.flock as on a filesystem without it (Lustre mounted with noflock)."""
    raise OSError(errno.ENOSYS, "Function not implemented")


def no_links(source, target):
    raise OSError(errno.EPERM, "Operation not permitted")


def can_make_pid_namespaces():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--mount-proc", "--kill-child", "true"],
                          capture_output=True).returncode == 0


needs_pid_namespaces = pytest.mark.skipif(not can_make_pid_namespaces(),
                                          reason="needs root and unshare to make a PID namespace")


# ---- the basics ---------------------------------------------------------------------------
@pytest.mark.dist
def test_a_live_run_is_refused_a_dead_one_replaced_and_the_lock_removed_at_the_end(tmp_path, no_job):
    from mingpt_ddp.errors import ConfigError

    url = tmp_path / "snapshot.pt"
    first = new_lock(url)
    first.acquire()
    with pytest.raises(ConfigError, match=f"another run is live on these snapshots \\(host {socket.gethostname()}, "
                                          f"pid {os.getpid()}, no Slurm job or torchrun run id, since"):
        new_lock(url).acquire()
    with pytest.raises(ConfigError, match="another run is live"):
        new_lock(url).check_free()  # the read-only check before Hydra writes .hydra/
    first.release()
    assert not (tmp_path / ".snapshot.lock").exists()
    for stale in ({"heartbeat": time.time() - 3600},  # another machine, heartbeat an hour old
                  {"heartbeat": time.time() - 3600, "job": "slurm job 77"}):
        write_owner(url, **stale)
        lock = new_lock(url)
        lock.check_free()
        lock.acquire()
        assert read_owner(url)["token"] == lock.token
        lock.release()
    write_owner(url, job="slurm job 77")  # alive on another machine (recent heartbeat)
    with pytest.raises(ConfigError, match="host elsewhere, pid 4242, slurm job 77"):
        new_lock(url).acquire()
    # This host's name and a pid that is not running here, but no boot id and PID namespace
    # of ours (another container with host networking): the pid proves nothing, the
    # heartbeat is recent.
    write_owner(url, host=socket.gethostname(), pid=dead_pid())
    with pytest.raises(ConfigError, match=f"host {socket.gethostname()}, pid"):
        new_lock(url).acquire()


@pytest.mark.s3
@pytest.mark.parametrize("where", ["local", "local-without-flock", pytest.param("moto_s3", marks=pytest.mark.slow)])
def test_a_sigkilled_holder_is_replaced_at_once(where, tmp_path, request, no_job):
    """Local disks: the kernel dropped its lock. Without a kernel lock (S3, or a mount
    without flock): its pid is gone, which counts on the same machine and PID namespace."""
    if where == "local-without-flock":  # this process only: the holder took a kernel lock
        no_job.setattr(fcntl, "flock", no_flock)
        where = "local"
    url, options = where_to_lock(where, tmp_path, request)
    with holding(url, options) as holder:
        holder.kill()
        holder.wait()
    start = time.monotonic()
    lock = new_lock(url, options)
    lock.acquire()
    assert time.monotonic() - start < 5
    lock.release()


# ---- item 2: a live holder in another PID namespace on this host -------------------------
@pytest.mark.s3
@pytest.mark.slow
@needs_pid_namespaces
@pytest.mark.parametrize("where", ["local", "moto_s3"])
def test_a_live_run_in_another_pid_namespace_on_this_host_is_not_taken_over(where, tmp_path, request, no_job):
    """Two containers with host networking: same host name, same kernel, different PID
    namespaces. The holder's pid means nothing here, its heartbeat is fresh: refused."""
    from mingpt_ddp.errors import ConfigError

    url, options = where_to_lock(where, tmp_path, request)
    with holding(url, options, namespace=True, log=tmp_path / "holder.log") as holder:
        owner = read_owner(url, options)
        assert owner["host"] == socket.gethostname() and owner["pid"] != holder.pid
        with pytest.raises(ConfigError, match="another run is live on these snapshots"):
            new_lock(url, options).acquire()
        assert read_owner(url, options)["token"] == owner["token"]
        if where == "local":  # the kernel releases its lock when the holder dies, whatever its namespace
            holder.kill()
            holder.wait()
            lock = new_lock(url, options)
            lock.acquire()
            lock.release()


# ---- item 3: the same Slurm job id ---------------------------------------------------------
@pytest.mark.cli
def test_a_live_step_of_the_same_slurm_job_is_refused(tmp_path, no_job):
    """Two srun steps of one allocation share SLURM_JOB_ID: two runs, not a restart."""
    from mingpt_ddp.errors import ConfigError

    url = tmp_path / "snapshot.pt"
    with holding(url, env={"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}) as holder:
        no_job.setenv("SLURM_JOB_ID", "4242")
        no_job.setenv("SLURM_STEP_ID", "1")
        with pytest.raises(ConfigError, match="another run is live on these snapshots .*slurm job 4242"):
            new_lock(url).check_free()
        with pytest.raises(ConfigError, match="another run is live on these snapshots .*slurm job 4242"):
            new_lock(url).acquire()
        holder.kill()  # the first step dies: the job's next step takes over at once
        holder.wait()
        lock = new_lock(url)
        lock.acquire()
        lock.release()


@pytest.mark.s3
@pytest.mark.slow
def test_s3_lease_of_the_same_job_is_taken_over_only_by_a_later_restart(moto_s3, no_job):
    from mingpt_ddp.errors import ConfigError

    url, options = s3_url(moto_s3), s3_options(moto_s3)
    live = {"job": "slurm job 77", "instance": {"slurm_job": "77", "slurm_restart": 0, "slurm_step": "0",
                                                "torchrun": None, "torchrun_restart": 0}}
    write_owner(url, options, **live)
    no_job.setenv("SLURM_JOB_ID", "77")
    no_job.setenv("SLURM_STEP_ID", "1")  # another step of the same allocation
    with pytest.raises(ConfigError, match="another run is live on these snapshots .*slurm job 77"):
        new_lock(url, options).acquire()
    no_job.setenv("SLURM_RESTART_COUNT", "1")  # the job requeued: Slurm ended the first launch
    no_job.setenv("SLURM_STEP_ID", "0")
    lock = new_lock(url, options)
    lock.acquire()
    assert read_owner(url, options)["token"] == lock.token
    lock.release()


# ---- item 3: taking over a stale lock is atomic ---------------------------------------------
@pytest.mark.s3
@pytest.mark.parametrize("where", ["local", "local-without-flock", "local-without-flock-or-links",
                                   pytest.param("moto_s3", marks=pytest.mark.slow),
                                   pytest.param("seaweedfs", marks=pytest.mark.slow)])
def test_two_runs_taking_over_one_stale_lock_leave_one_holder(where, tmp_path, request, no_job):
    """B judges the stale owner gone; before B acts, A takes the lock over. B must not
    remove A's fresh lock: exactly one of them holds it, and the lock names that one."""
    from mingpt_ddp.errors import ConfigError
    from mingpt_ddp.checkpoint.run_lock import RunLock

    if where.startswith("local-without-flock"):  # as on Lustre mounted without flock
        no_job.setattr(fcntl, "flock", no_flock)
        if where.endswith("-or-links"):  # and a FUSE or SMB mount without hard links
            no_job.setattr(os, "link", no_links)
        where = "local"
    url, options = where_to_lock(where, tmp_path, request)
    write_owner(url, options, heartbeat=time.time() - 3600)
    a, b = new_lock(url, options), new_lock(url, options)
    outcome = {}
    judge = RunLock.why_not_stale

    def b_judging(self, owner):
        verdict = judge(self, owner)
        if self is b and "a" not in outcome:  # A takes the lock over while B decides
            try:
                a.acquire()
                outcome["a"] = "held"
            except ConfigError:
                outcome["a"] = "refused"
        return verdict

    no_job.setattr(RunLock, "why_not_stale", b_judging)
    try:
        b.acquire()
        outcome["b"] = "held"
    except ConfigError:
        outcome["b"] = "refused"
    try:
        assert sorted(outcome.values()) == ["held", "refused"], outcome
        holder = a if outcome["a"] == "held" else b
        assert read_owner(url, options)["token"] == holder.token
    finally:
        a.release()
        b.release()


# ---- item 3: what the S3 server receives ------------------------------------------------------
@pytest.mark.s3
@pytest.mark.slow
def test_s3_lease_writes_are_conditional_as_the_server_receives_them(moto_s3, no_job):
    """Creating sends If-None-Match: * (a second creator gets 412 and changes nothing),
    taking over and renewing send If-Match on the ETag read: checked at a recording proxy."""
    from s3_servers import RecordingProxy

    from mingpt_ddp.errors import ConfigError

    url = s3_url(moto_s3)
    with RecordingProxy(moto_s3.endpoint) as proxy:
        options = s3_options(moto_s3)
        options["client_kwargs"]["endpoint_url"] = proxy.endpoint
        first = new_lock(url, options)
        first.acquire()
        created = proxy.puts("/.snapshot.lock")
        assert created and created[0]["headers"].get("if-none-match") == "*" and created[0]["status"] == 200
        before = len(proxy.requests)
        with pytest.raises(ConfigError, match="another run is live on these snapshots"):
            new_lock(url, options).acquire()
        second = [r for r in proxy.requests[before:] if r["method"] == "PUT"]
        assert second and all(r["headers"].get("if-none-match") == "*" and r["status"] == 412 for r in second)
        assert read_owner(url, options)["token"] == first.token  # nothing overwritten
        first.release()
        with pytest.raises(FileNotFoundError):  # removed at the end
            read_owner(url, options)

        stale = write_owner(url, s3_options(moto_s3), heartbeat=time.time() - 3600)  # past the proxy
        etag = moto_s3.client().head_object(Bucket=url.split("/")[2], Key="run/.snapshot.lock")["ETag"]
        before = len(proxy.requests)
        third = new_lock(url, options, heartbeat_s=0.2)
        third.acquire()
        takeover = [r for r in proxy.requests[before:] if r["method"] == "PUT" and r["status"] == 200]
        assert takeover[0]["headers"].get("if-match") == etag, (stale, proxy.requests[before:])
        assert not [r for r in proxy.requests[before:] if r["method"] == "DELETE"]  # never remove, then create
        before = len(proxy.requests)
        wait_for(lambda: [r for r in proxy.requests[before:] if r["method"] == "PUT"], 10, "a heartbeat")
        beats = [r for r in proxy.requests[before:] if r["method"] == "PUT"]
        assert beats and all(r["headers"].get("if-match", "").startswith('"') for r in beats), beats
        third.release()


@pytest.mark.unit
def test_s3_leases_are_refused_without_conditional_writes(no_job, monkeypatch):
    """A botocore too old to send If-None-Match/If-Match (as with s3fs before 2024.12):
    one clear error, not an unconditional PUT."""
    from mingpt_ddp.checkpoint import storage
    from mingpt_ddp.errors import ConfigError

    monkeypatch.setattr(storage, "s3_put_parameters", lambda: {"Bucket", "Key", "Body"})
    with pytest.raises(ConfigError, match=r"conditional writes .*pip install .*s3fs>=2024.12"):
        new_lock("s3://bucket/run/snapshot.pt", {"key": "k", "secret": "s"}).acquire()


# ---- item 3: a run that lost its lock stops -----------------------------------------------------
@pytest.mark.s3
@pytest.mark.parametrize("where", ["local", pytest.param("moto_s3", marks=pytest.mark.slow)])
def test_a_lock_taken_from_its_holder_is_reported_lost(where, tmp_path, request, no_job):
    from mingpt_ddp.checkpoint.run_lock import RunLock

    url, options = where_to_lock(where, tmp_path, request)
    first = new_lock(url, options, heartbeat_s=0.1)
    first.acquire()
    assert first.lost is None
    if where == "local":
        os.unlink(tmp_path / ".snapshot.lock")  # removed by hand, or by a run that thought it stale
        second = new_lock(url, options)
        second.acquire()
    else:
        second = RunLock(lock_store(url, options))
        write_owner(url, options, token=second.token)  # another writer replaced the lease
    wait_for(lambda: first.lost, 10, "the holder to notice")
    assert "lost the run lock" in first.lost and "stops" in first.lost, first.lost
    first.release()
    assert read_owner(url, options)["token"] == second.token  # the loser removed nothing
    if where == "local":
        second.release()


LOSER = """
import runpy, sys
from mingpt_ddp.checkpoint import run_lock
run_lock.HEARTBEAT_S = 0.2
sys.argv[0] = {main!r}
runpy.run_path({main!r}, run_name="__main__")
"""


def start_a_losing_run(tmp_path, run_dir, corpus, *overrides):
    """A training run whose lock heartbeat beats every 0.2 s, logging to loser.log."""
    script = tmp_path / "loser.py"
    script.write_text(LOSER.format(main=MAIN))
    cmd = [PYTHON, str(script), *TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}", *overrides]
    with open(tmp_path / "loser.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)})


def steal_the_lock(run_dir):
    """Remove the run's lock file (by hand, or a run that thought it stale) and take it."""
    os.unlink(run_dir / ".snapshot.lock")
    thief = new_lock(run_dir / "snapshot.pt")
    thief.acquire()
    return thief


def stopped_by_the_lost_lock(tmp_path, proc, run_dir, thief):
    """The losing run's log, once it exited 4 (a RunError) with one `error: lost the run lock`
    line and left the thief's lock alone (then released)."""
    rc = proc.wait(timeout=60)
    text = (tmp_path / "loser.log").read_text()
    assert rc == 4, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost the run lock" in errors[0], text
    assert "Traceback" not in text, text
    assert read_owner(run_dir / "snapshot.pt")["token"] == thief.token
    thief.release()
    return text


@pytest.mark.dist
@pytest.mark.slow
def test_a_run_that_lost_its_lock_stops_with_one_error(tmp_path, small_corpus, no_job):
    """The lock file is replaced under a training run (removed by hand, then taken by
    another run): at its next stop agreement the run stops on every rank, saves nothing
    more, exits 2 with one error line, and leaves the new owner's lock alone."""
    run_dir = tmp_path / "run"
    proc = start_a_losing_run(tmp_path, run_dir, small_corpus, "trainer.max_epochs=100", "trainer.log_every=2")
    try:
        wait_for(lambda: metrics_lines(run_dir) >= 2, 120, "training progress")
        thief = steal_the_lock(run_dir)
        start = time.monotonic()
        text = stopped_by_the_lost_lock(tmp_path, proc, run_dir, thief)
        assert time.monotonic() - start < 30, text
        assert "stopped by" not in text, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ---- done when: two runs of one job id in one directory, as a user starts them ------------------
@pytest.mark.dist
@pytest.mark.slow
def test_two_runs_of_one_slurm_job_in_one_directory(tmp_path, small_corpus):
    """Both default to outputs/slurm-<id> (two srun steps of one allocation): the second is
    refused within 30 s and the live run's files are kept; the first SIGKILLed, a restart of
    the job resumes at once."""
    job = {"SLURM_JOB_ID": "918273", "PYTHONUNBUFFERED": "1"}
    run_dir = tmp_path / "outputs" / "slurm-918273"
    common = [*TINY, f"data.path={small_corpus}", "trainer.max_epochs=100", "trainer.snapshot_every_steps=10"]
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}

    def start(name, step):
        with open(tmp_path / f"{name}.log", "w") as log:
            return subprocess.Popen([PYTHON, MAIN, *common], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**env, **job, "SLURM_STEP_ID": step})

    first = start("first", "0")
    try:
        wait_for(lambda: metrics_lines(run_dir) >= 2, 120, "the first run training")
        began = time.monotonic()
        second = run_cli([*common, "trainer.seed=4242"], cwd=tmp_path, timeout=120,
                         env={**job, "SLURM_STEP_ID": "1"})
        line = expect_config_error(second, "another run is live", f"pid {first.pid}", "slurm job 918273")
        assert time.monotonic() - began < 30, line
        steps = [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(steps), steps  # one writer
        assert "4242" not in (run_dir / ".hydra" / "config.yaml").read_text()  # the live run's config kept
        wait_for(lambda: list(run_dir.glob("snapshot*.pt")), 120, "a snapshot")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert (run_dir / ".snapshot.lock").exists()  # left behind by the SIGKILL
    saved = load_snapshot(run_dir / "snapshot.pt")["train_state"]["step"]
    # The restart is not refused and waits for nothing (a stale heartbeat would take 5 minutes).
    text = must_pass(run_cli([*common, f"trainer.max_steps={saved + 2}"], cwd=tmp_path, timeout=300,
                             env={**job, "SLURM_STEP_ID": "0"}))
    assert "left by a run that is gone" in text and f"resumed from {run_dir}" in text, text


@pytest.mark.cli
def test_a_second_run_in_a_live_runs_directory_is_refused_whatever_its_snapshot_path(tmp_path, small_corpus,
                                                                                     no_job):
    """Issue 29, 7: the same hydra.run.dir, another trainer.snapshot_path: refused in one line
    before Hydra writes, naming the live run; the live run's .hydra/ files and metrics.jsonl
    are untouched (the metrics only grow, one writer); nothing is saved at the other path."""
    run_dir = tmp_path / "run"
    proc = start_a_losing_run(tmp_path, run_dir, small_corpus, "trainer.max_epochs=1000", "trainer.log_every=2")
    try:
        wait_for(lambda: metrics_lines(run_dir) >= 2, 120, "the first run training")
        kept = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        metrics = (run_dir / "metrics.jsonl").read_bytes()
        elsewhere = tmp_path / "elsewhere" / "snapshot.pt"
        second = run_cli(args(run_dir, small_corpus, "trainer.max_steps=3", "trainer.seed=4242",
                              f"trainer.snapshot_path={elsewhere}"), timeout=120)
        assert proc.poll() is None, (tmp_path / "loser.log").read_text()
        expect_config_error(second, "another run is live in the run directory", f"pid {proc.pid}", "hydra.run.dir")
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == kept
        grown = (run_dir / "metrics.jsonl").read_bytes()
        assert grown.startswith(metrics) and b"4242" not in grown
        steps = [json.loads(r)["step"] for r in grown.decode().splitlines() if '"step"' in r]
        assert steps == sorted(steps), steps
        assert not elsewhere.parent.exists() or not list(elsewhere.parent.glob("snapshot*"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.cli
def test_a_sweep_over_a_live_runs_directory_is_refused_before_hydra_writes(tmp_path, small_corpus, no_job):
    """A run lives in what would be point 1's directory (its snapshots elsewhere): a sweep
    there is refused in one line naming it, before any point runs or Hydra writes."""
    sweep = tmp_path / "sweep"
    with holding(sweep / "1", script=RUN_DIR_HOLDER) as holder:
        proc = run_cli(["-m", "trainer.seed=1,2", *TINY, "trainer.max_steps=2", f"data.path={small_corpus}",
                        f"hydra.sweep.dir={sweep}"], timeout=120)
        expect_config_error(proc, "another sweep is live", f"in the run directory {sweep / '1'}",
                            f"pid {holder.pid}", "hydra.sweep.dir")
        assert sorted(str(p.relative_to(sweep)) for p in sweep.rglob("*")) == ["1", "1/.run.dir.lock"]


@pytest.mark.dist
def test_a_torchrun_run_in_a_live_runs_directory_is_refused_in_one_line(tmp_path, small_corpus, no_job):
    """Every rank refuses (rank 1 by looking, rank 0 by the lock); rank 0 says so in one line
    before the launcher, seeing rank 1 exit, stops it. Hydra wrote nothing there."""
    run_dir = tmp_path / "run"
    with holding(run_dir, script=RUN_DIR_HOLDER) as holder:
        proc = run_cli(args(run_dir, small_corpus, "trainer.max_steps=2",
                            f"trainer.snapshot_path={tmp_path / 'elsewhere' / 'snapshot.pt'}"), nproc=2, timeout=120)
        expect_config_error(proc, "another run is live in the run directory", f"pid {holder.pid}")
        assert [p.name for p in run_dir.iterdir()] == [".run.dir.lock"]


@pytest.mark.unit
def test_only_rank_0_holds_a_run_directory_and_the_others_refuse_another_launchs(tmp_path, no_job):
    """Rank 0 of torchrun run exp1 holds the run directory; its other ranks pass (their own
    rank 0 holds it), any rank of another launch is refused."""
    from mingpt_ddp.checkpoint import run_dir
    from mingpt_ddp.errors import ConfigError

    no_job.setenv("TORCHELASTIC_RUN_ID", "exp1")
    no_job.setenv("RANK", "0")
    run_dir.hold_run_dir(str(tmp_path))
    _, lock = run_dir._held.pop(str(tmp_path))  # as if in the process of rank 0, not this one
    try:
        no_job.setenv("RANK", "1")
        run_dir.hold_run_dir(str(tmp_path))  # exp1's rank 1
        assert run_dir.held_lock(str(tmp_path)) is None
        no_job.setenv("TORCHELASTIC_RUN_ID", "exp2")
        for rank in ("1", "0"):
            no_job.setenv("RANK", rank)
            with pytest.raises(ConfigError, match=f"another run is live in the run directory {tmp_path} "
                                                  r"\(.*torchrun run exp1.*or use another hydra.run.dir"):
                run_dir.hold_run_dir(str(tmp_path))
    finally:
        lock.release()
    assert not list(tmp_path.iterdir())


@pytest.mark.unit
def test_a_run_that_lost_its_run_directorys_lock_stops_as_for_its_snapshots(tmp_path, no_job):
    """The trainer and the savers see the two locks rank 0 holds as one (main.train)."""
    from mingpt_ddp.checkpoint import run_dir
    from mingpt_ddp.checkpoint.run_lock import Locks
    from mingpt_ddp.errors import RunError

    snapshots = new_lock(tmp_path / "snapshot.pt", heartbeat_s=3600)
    snapshots.acquire()
    run_dir.hold_run_dir(str(tmp_path))
    held = Locks(snapshots, run_dir.held_lock(str(tmp_path)))
    assert held.confirm() is None and held.lost is None
    os.unlink(tmp_path / ".run.dir.lock")  # removed by hand, then taken by another run
    thief = run_dir._run_dir_lock(str(tmp_path), "hydra.run.dir")
    thief.acquire()
    why = held.confirm()
    assert why and f"lost the run lock {tmp_path / '.run.dir.lock'}" in why and "this run directory" in why, why
    assert held.lost == why
    with pytest.raises(RunError, match="lost the run lock"):
        held.raise_if_lost()
    run_dir.release_run_dir(str(tmp_path))
    snapshots.release()
    assert (tmp_path / ".run.dir.lock").exists()  # the thief's, left alone
    thief.release()


@pytest.mark.unit
def test_the_background_saver_writes_nothing_once_the_lock_is_lost(tmp_path, no_job):
    """The loss is acted on at the next stop agreement; until then the saver already refuses
    to write, so a run that lost its lock never writes beside the new holder."""
    import torch
    from mingpt_ddp.checkpoint.snapshot import BackgroundSaver, SnapshotStore

    url = str(tmp_path / "snapshot.pt")
    first = new_lock(url, heartbeat_s=0.1)
    first.acquire()
    saver = BackgroundSaver(SnapshotStore(url), retry_minutes=1, run_lock=first)
    os.unlink(tmp_path / ".snapshot.lock")
    second = new_lock(url)
    second.acquire()
    wait_for(lambda: first.lost, 10, "the holder to notice")
    saver.submit({"model": {"w": torch.ones(2)}, "train_state": {"step": 3}, "vocab": "ab"}, 3)
    error = saver.wait()
    assert not list(tmp_path.glob("snapshot*.pt")), list(tmp_path.iterdir())
    assert error and "lost the run lock" in error, error
    first.release()
    second.release()


@pytest.mark.unit
@pytest.mark.parametrize("kernel_lock", [True, False], ids=["flock", "lease"])
def test_a_save_confirms_the_lock_itself_without_waiting_for_a_heartbeat(tmp_path, no_job, kernel_lock):
    """Steps can be far shorter than a heartbeat: a lock taken over a moment ago (the holder's
    heartbeat has not run yet) already refuses the next save, for both savers, with a kernel
    lock and with a lease file."""
    import torch
    from mingpt_ddp.checkpoint import run_lock
    from mingpt_ddp.checkpoint.sharded_snapshot import MARKER, ShardedSaver, ShardedSnapshotStore
    from mingpt_ddp.checkpoint.snapshot import BackgroundSaver, SnapshotStore

    if not kernel_lock:
        no_job.setattr(run_lock, "flock_reaches_everyone", lambda directory: False)
    url = str(tmp_path / "snapshot.pt")
    first = new_lock(url, heartbeat_s=3600)
    first.acquire()
    assert first.confirm() is None  # still ours: confirming changes nothing
    if kernel_lock:
        os.unlink(tmp_path / ".snapshot.lock")
        second = new_lock(url)
        second.acquire()
    else:
        write_owner(url, job="torchrun run other", token="other")
    assert first.lost is None  # the heartbeat has not noticed
    saver = BackgroundSaver(SnapshotStore(url), retry_minutes=1, run_lock=first)
    saver.submit({"model": {"w": torch.ones(2)}, "train_state": {"step": 3}, "vocab": "ab"}, 3)
    error = saver.wait()
    assert error and "lost the run lock" in error, error
    assert not list(tmp_path.glob("snapshot*.pt")), list(tmp_path.iterdir())
    sharded = ShardedSaver(ShardedSnapshotStore(url), run_lock=first)
    sharded.submit({"model": {"w": torch.ones(2)}, "optimizer": {}, "train_state": {"step": 3}}, 3)
    error = sharded.wait()
    assert error and "lost the run lock" in error, error
    assert not list(tmp_path.glob(f"snapshot.pt.dcp/*/{MARKER}")), list(tmp_path.rglob("*"))
    first.release()
    if kernel_lock:
        second.release()
        assert not (tmp_path / ".snapshot.lock").exists()
    else:
        assert read_owner(url)["token"] == "other"  # the loser's release leaves the new owner's record


@pytest.mark.cli
@pytest.mark.slow
def test_a_run_that_lost_its_lock_saves_nothing_more_even_between_stop_agreements(tmp_path, small_corpus, no_job):
    """Stop agreements far apart (log_every, stop_check_seconds), a snapshot every 3 steps and
    every epoch: the lock is taken from the run after its first snapshot; its next save stops
    it on every rank with one error line, and no snapshot is written after the loss."""
    run_dir = tmp_path / "run"
    proc = start_a_losing_run(tmp_path, run_dir, small_corpus, "trainer.max_epochs=200", "trainer.log_every=100000",
                              "trainer.stop_check_seconds=100000", "trainer.save_every=1",
                              "trainer.snapshot_every_steps=3", "trainer.keep_last=1000")
    try:
        wait_for(lambda: (run_dir / "snapshot.pt").exists(), 120, "a first snapshot")
        thief = steal_the_lock(run_dir)
        saved = {p.name: p.stat().st_mtime_ns for p in run_dir.glob("snapshot*.pt")}
        stopped_by_the_lost_lock(tmp_path, proc, run_dir, thief)
        assert {p.name: p.stat().st_mtime_ns for p in run_dir.glob("snapshot*.pt")} == saved
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("store", [pytest.param("local", marks=pytest.mark.unit),
                                   pytest.param("memory", marks=pytest.mark.unit),
                                   pytest.param("moto_s3", marks=pytest.mark.s3)])
def test_a_background_write_under_way_when_the_lock_is_lost_is_not_published(tmp_path, request, no_job, store):
    """The lock is confirmed before a write starts, and again before it is published (the
    rename, "latest", retention): a write of minutes during which the lock was taken over
    leaves nothing of it and the new holder's snapshot intact, and the saver reports the
    loss. Local files; a store written by temp name then rename (memory://); S3, where the
    object is visible once written, and is removed (the new holder's "latest" keeps its step)."""
    import fsspec
    import torch
    from mingpt_ddp.checkpoint import snapshot
    from mingpt_ddp.checkpoint.snapshot import BackgroundSaver, SnapshotStore, encode

    lock_url = str(tmp_path / "snapshot.pt")
    first = new_lock(lock_url, heartbeat_s=3600)  # the loss is found by the saver's own check
    first.acquire()
    url, options = lock_url, None
    if store == "memory":
        url = f"memory://{tmp_path}/snapshot.pt"
    elif store != "local":
        url, options = where_to_lock(store, tmp_path, request)
    fs, root = fsspec.core.url_to_fs(url.rsplit("/", 1)[0], **(options or {}))
    fs.makedirs(root, exist_ok=True)
    taken = []

    def taken_over_meanwhile(write):
        def wrapped(*args, **kwargs):
            if not taken:  # the write is under way: another run takes the lock and saves step 3
                os.unlink(tmp_path / ".snapshot.lock")
                taken.append(new_lock(lock_url))
                taken[0].acquire()
                SnapshotStore(url, storage_options=options).save(encode({"holder": torch.zeros(1)}, 3), 3)
            return write(*args, **kwargs)
        return wrapped

    losing = SnapshotStore(url, storage_options=options)
    if store == "local":  # streamed into a temp file
        no_job.setattr(snapshot, "write_encoded", taken_over_meanwhile(snapshot.write_encoded))
    else:  # uploaded (under a temp name, or as the object itself)
        no_job.setattr(losing.fs, "pipe_file", taken_over_meanwhile(losing.fs.pipe_file))
    saver = BackgroundSaver(losing, retry_minutes=1, run_lock=first)
    saver.submit({"model": {"w": torch.ones(2)}, "train_state": {"step": 3}, "vocab": "ab"}, 3)
    error = saver.wait()
    assert taken, "the write never started"
    assert error and "lost the run lock" in error, error
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    left = ["snapshot.pt"] if store == "moto_s3" else ["snapshot.pt", "snapshot.step000000003.pt"]
    assert [n for n in names if n.startswith("snapshot")] == left, names
    assert not [n for n in names if "tmp" in n], names
    for name in left:
        assert "holder" in snapshot.decode(fs.cat_file(f"{root}/{name}"), name), name  # the new holder's
    first.release()
    taken[0].release()


@pytest.mark.unit
def test_the_sharded_saver_commits_nothing_once_the_lock_is_lost(tmp_path, no_job):
    """FSDP's saver: rank 0 held the lock; a save after it is lost is refused before it
    touches anything (every rank learns it from rank 0), so the new holder's snapshot of the
    same step survives byte for byte."""
    import torch
    from mingpt_ddp.checkpoint.sharded_snapshot import ShardedSaver
    from mingpt_ddp.checkpoint.sharded_snapshot import MARKER, ShardedSnapshotStore

    url = str(tmp_path / "snapshot.pt")
    first = new_lock(url, heartbeat_s=0.1)
    first.acquire()
    saver = ShardedSaver(ShardedSnapshotStore(url), run_lock=first)
    os.unlink(tmp_path / ".snapshot.lock")
    second = new_lock(url)
    second.acquire()
    wait_for(lambda: first.lost, 10, "the holder to notice")
    holder = ShardedSnapshotStore(url)  # the new holder has already saved the same step
    assert holder.save(3, {"model": {"w": torch.zeros(2)}, "optimizer": {}}, {"train_state": {"step": 3}}) is None
    holder.close()
    saved = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    saver.submit({"model": {"w": torch.ones(2)}, "optimizer": {}, "train_state": {"step": 3}}, 3)
    error = saver.wait()
    assert error and "lost the run lock" in error, error
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == saved
    first.release()
    second.release()


@pytest.mark.unit
def test_a_torchrun_restart_elsewhere_takes_a_lease_only_from_an_owner_that_stopped_beating(tmp_path, no_job):
    """A second torchrun with the same --rdzv_id on another node, refused at restart 0 and
    restarted by its agent (restart 1), must not take the lease of the live first run
    (restart 0, heartbeat going on); once that owner stops beating, a restart takes over
    within a few heartbeats, not STALE_AFTER_S."""
    import threading

    from mingpt_ddp.checkpoint import run_lock
    from mingpt_ddp.errors import ConfigError

    no_job.setattr(run_lock, "flock_reaches_everyone", lambda directory: False)  # NFS local_lock, Lustre localflock
    url = tmp_path / "snapshot.pt"
    first = {"job": "torchrun run exp1", "instance": {"slurm_job": None, "slurm_restart": 0, "slurm_step": None,
                                                       "torchrun": "exp1", "torchrun_restart": 0}}
    beating = threading.Event()
    beating.set()

    def beat():  # the live owner, on another node: rewrites its record as its heartbeat does
        while beating.is_set():
            write_owner(url, **first)
            time.sleep(0.2)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        wait_for(lambda: (tmp_path / ".snapshot.lock").exists(), 5, "the owner's record")
        no_job.setenv("TORCHELASTIC_RUN_ID", "exp1")
        no_job.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        with pytest.raises(ConfigError, match="another run is live on these snapshots"):
            new_lock(url, heartbeat_s=0.5).acquire()
        assert read_owner(url)["token"] == "other"
    finally:
        beating.clear()
        thread.join()
    began = time.monotonic()
    lock = new_lock(url, heartbeat_s=0.5)
    lock.acquire()  # the owner stopped beating: torchrun ended it before this restart
    assert time.monotonic() - began < 10
    assert read_owner(url)["token"] == lock.token
    lock.release()


@pytest.mark.unit
def test_a_torchrun_restart_elsewhere_is_not_refused_before_the_two_heartbeat_watch(tmp_path, no_job):
    """On a lease filesystem, the new rank 0 of a torchrun restart on another node: the
    earlier restart's leases (run directory, snapshots) stopped beating 40 s ago, not yet
    stale. The look before taking (hold_run_dir's check_free, the Hydra callback's
    refuse_a_live_run) must leave it to acquire's watch, which takes it over."""
    from mingpt_ddp.checkpoint import run_dir, run_lock

    no_job.setattr(run_lock, "flock_reaches_everyone", lambda directory: False)  # NFS local_lock, Lustre localflock
    no_job.setattr(run_lock, "HEARTBEAT_S", 0.5)
    earlier = {"job": "torchrun run rid42", "heartbeat": time.time() - 40, "token": "old",
               "instance": {"slurm_job": None, "slurm_restart": 0, "slurm_step": None, "torchrun": "rid42",
                            "torchrun_restart": 0}}
    url = tmp_path / "snapshot.pt"
    write_owner(url, **earlier)
    (tmp_path / ".run.dir.lock").write_text(json.dumps({**read_owner(url), "token": "old-dir"}))
    no_job.setenv("TORCHELASTIC_RUN_ID", "rid42")
    no_job.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    no_job.setenv("RANK", "0")
    new_lock(url).check_free()  # refuse_a_live_run's look
    began = time.monotonic()
    run_dir.hold_run_dir(str(tmp_path))
    try:
        assert time.monotonic() - began < 10
        assert json.loads((tmp_path / ".run.dir.lock").read_text())["instance"]["torchrun_restart"] == 1
    finally:
        run_dir.release_run_dir(str(tmp_path))


def run_dir_check_config(directory):
    from omegaconf import OmegaConf

    return OmegaConf.create({"hydra": {"run": {"dir": str(directory)}, "output_subdir": None,
                                       "overrides": {"hydra": [], "task": []}},
                             "trainer": {"snapshot_path": None}})


@pytest.mark.unit
def test_a_slurm_requeue_waits_for_a_lingering_kernel_lock_then_fails_to_be_requeued(tmp_path, no_job):
    """A requeue (restart 1) finds the kernel lock still held for restart 0 of its job (a dead
    node's flock that NFS or Lustre has not released; here a live process): not refused as a
    second step of the job (exit 2, never requeued), but waited for, then a RunError (exit 4,
    requeued again) naming the lingering lock; taken if it is released during the wait."""
    import threading

    from mingpt_ddp.checkpoint import run_dir, run_lock
    from mingpt_ddp.errors import RunError

    no_job.setattr(run_lock, "LINGERING_LOCK_WAIT_S", 2.5, raising=False)  # absent before the fix
    no_job.setenv("SLURM_JOB_ID", "77")
    no_job.setenv("SLURM_RESTART_COUNT", "1")
    no_job.setenv("RANK", "0")
    earlier = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}
    with holding(tmp_path, env=earlier, script=RUN_DIR_HOLDER):
        began = time.monotonic()
        with pytest.raises(RunError, match="still held for the earlier launch of this job .*slurm job 77.* "
                                           "a lingering lock"):
            run_dir.hold_run_dir(str(tmp_path))
        assert 2.5 <= time.monotonic() - began < 15
        with pytest.raises(SystemExit) as exited:  # through the Hydra callback: exit 4, not 2
            run_dir.RunDirCheck().on_run_start(run_dir_check_config(tmp_path))
        assert exited.value.code == 4
    no_job.setattr(run_lock, "LINGERING_LOCK_WAIT_S", 60.0)
    with holding(tmp_path, env=earlier, script=RUN_DIR_HOLDER) as ghost:
        threading.Timer(1.0, ghost.stdin.close).start()  # the filesystem lets go of it
        began = time.monotonic()
        run_dir.hold_run_dir(str(tmp_path))
        try:
            assert time.monotonic() - began < 30
            assert json.loads((tmp_path / ".run.dir.lock").read_text())["instance"]["slurm_restart"] == 1
        finally:
            run_dir.release_run_dir(str(tmp_path))


@pytest.mark.unit
def test_a_file_lease_renewal_never_overwrites_a_takeover_made_meanwhile(tmp_path, monkeypatch):
    """Another run takes the lease over while its holder renews late (past the time in which
    no run may judge it gone; right after the holder looked at it): the renewal fails and
    the taker's record stays."""
    from mingpt_ddp.checkpoint.run_lock import _FileLease

    path = str(tmp_path / ".snapshot.lock")
    holder = _FileLease(path)
    version = holder.create(b'{"token": "A", "heartbeat": 1}')
    real_read = _FileLease.read
    taken = []

    def read_then_taken(self):
        seen = real_read(self)
        if not taken:  # another run judged it stale and takes it over now
            taken.append(_FileLease(path).take_over(b'{"token": "B", "heartbeat": 2}', seen[1]))
        return seen

    monkeypatch.setattr(_FileLease, "read", read_then_taken)
    renewed = holder.renew(b'{"token": "A", "heartbeat": 3}', version)
    with open(path, "rb") as f:
        now = f.read()
    if taken and taken[0] is not None:
        assert renewed is None and now == b'{"token": "B", "heartbeat": 2}', now
    else:  # the takeover lost the race: the holder renewed
        assert renewed is not None and now == b'{"token": "A", "heartbeat": 3}', now
    assert len(list(tmp_path.iterdir())) == 1, list(tmp_path.iterdir())  # nothing left aside


@pytest.mark.unit
def test_a_lease_that_cannot_be_renewed_is_lost_before_another_run_may_take_it(tmp_path, monkeypatch, no_job):
    """Renewals failing (S3 unreachable): the holder counts its lease lost while its last
    heartbeat is still younger than stale_after_s, before any other run may judge it stale."""
    from mingpt_ddp.checkpoint import run_lock

    monkeypatch.setattr(run_lock, "flock_reaches_everyone", lambda directory: False)  # a lease
    lock = new_lock(tmp_path / "snapshot.pt", heartbeat_s=0.3, stale_after_s=3.0)
    lock.acquire()
    renewals = []
    real_renew = lock._lease.renew

    def renew_then_fail(blob, version, **when):
        if len(renewals) < 2:
            renewals.append(time.monotonic())
            return real_renew(blob, version, **when)
        raise OSError(errno.EIO, "the store is unreachable")

    lock._lease.renew = renew_then_fail
    wait_for(lambda: lock.lost, 10, "the lease to count as lost")
    lost_at = time.monotonic()
    heartbeat = read_owner(tmp_path / "snapshot.pt")["heartbeat"]
    assert lost_at - renewals[-1] < 3.0 and time.time() - heartbeat < 3.0, (lost_at - renewals[-1], lock.lost)
    assert "could not be renewed" in lock.lost, lock.lost
    lock.release()


@pytest.mark.unit
def test_a_newcomer_between_the_steps_of_a_healthy_renewal_is_refused(tmp_path, monkeypatch, no_job):
    """Issue 29, 9: a lease file's renewal must leave no moment without the holder's record.
    A newcomer tries to start after every filesystem step of a renewal: each try is refused
    (the holder's process is alive), and the holder keeps its lease."""
    from mingpt_ddp.checkpoint import run_lock
    from mingpt_ddp.errors import ConfigError

    monkeypatch.setattr(run_lock, "flock_reaches_everyone", lambda directory: False)  # a lease
    url = tmp_path / "snapshot.pt"
    holder = new_lock(url, heartbeat_s=3600)  # renewed below, step by step, not by its thread
    holder.acquire()
    outcomes, trying = [], []

    def then_a_newcomer(step):
        def wrapped(*args, **kwargs):
            result = step(*args, **kwargs)
            if not trying:
                trying.append(True)
                newcomer = new_lock(url)
                try:
                    newcomer.acquire()
                    outcomes.append(f"taken after {step.__name__}")
                    newcomer.release()
                except ConfigError as exc:
                    outcomes.append(str(exc))
                trying.clear()
            return result
        return wrapped

    with monkeypatch.context() as steps:
        for name in ("rename", "replace", "link", "unlink"):
            steps.setattr(os, name, then_a_newcomer(getattr(os, name)))
        why = holder._renew()
    assert outcomes and all("another run is live on these snapshots" in o for o in outcomes), outcomes
    assert why is None, why
    assert read_owner(url)["token"] == holder.token
    holder.release()
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
