"""Every rank of a run agrees, with real torchrun workers: on the snapshot resumed, on parameters at
the end, on the global batch over elastic resizes, on refusing a static graph with accumulation,
on a sweep point failing on one rank, and on exiting cleanly."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import MAIN, PYTHON, REPO, TINY, TORCHRUN, load_snapshot, output, run_cli
from test_fault_tolerance import children, metrics_lines, wait_for


def args(run_dir, corpus, *extra):
    return [*TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}", *extra]


def must_pass(proc):
    assert proc.returncode == 0, output(proc)
    return output(proc)


def error_lines(text):
    """`error: ...` lines, also as `[rank N] error: ...` (printed by the first rank to report it)."""
    return [line.split("] ", 1)[1] if line.startswith("[rank ") else line for line in text.splitlines()
            if line.startswith("error:") or (line.startswith("[rank ") and "] error: " in line)]


def expect_config_error(proc, *phrases):
    """Exit code 2 (torchrun: 1, its workers' 2), one `error:` line, no traceback of ours."""
    text = output(proc)
    if proc.args[0] == TORCHRUN:
        assert proc.returncode == 1 and "exitcode  : 2" in text, text
        assert f'File "{REPO / "mingpt_ddp"}' not in text, text
    else:
        assert proc.returncode == 2 and "Traceback" not in text, text
    assert len(error_lines(text)) == 1, text  # one line, from one rank
    for phrase in phrases:
        assert phrase in error_lines(text)[0], text
    return error_lines(text)[0]


# ---- 1. every rank resumes from the same snapshot ------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_ranks_that_see_different_snapshots_stop_with_one_error(tmp_path, small_corpus):
    """Rank 1 cannot see the snapshot rank 0 sees (a node-local disk, a stale listing): one
    configuration for both, so the ranks' configurations agree and the snapshots must not."""
    must_pass(run_cli(args(tmp_path / "run", small_corpus, "trainer.max_steps=4"), nproc=2))
    script = tmp_path / "blind_rank1.py"
    script.write_text(
        "import os, runpy, sys\n"
        "from mingpt_ddp.checkpoint import snapshot\n"
        "peek = snapshot.SnapshotStore.peek\n"
        "def blind(self, *a, **k):\n"
        "    return None if os.environ['RANK'] == '1' else peek(self, *a, **k)\n"
        "snapshot.SnapshotStore.peek = blind\n"
        f"sys.argv[0] = {MAIN!r}\n"
        f"runpy.run_path({MAIN!r}, run_name='__main__')\n"
    )
    start = time.monotonic()
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(script),
           *args(tmp_path / "run", small_corpus, "trainer.max_steps=8")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    line = expect_config_error(proc, "rank 0: step 4 from", "rank 1: no snapshot", "trainer.snapshot_path",
                               "every node can read")
    assert time.monotonic() - start < 60, line
    assert load_snapshot(tmp_path / "run" / "snapshot.pt")["train_state"]["step"] == 4  # nothing trained on

    # Rank 1's storage refuses the snapshot's header (another node's credentials, a stale NFS
    # handle): one line from every rank, not rank 1's traceback and a "lost node" on the others.
    script.write_text(
        "import os, runpy, sys\n"
        "from mingpt_ddp.checkpoint import snapshot\n"
        "peek = snapshot.SnapshotStore.peek\n"
        "def refused(self, *a, **k):\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise PermissionError(13, 'Access Denied', self.url)\n"
        "    return peek(self, *a, **k)\n"
        "snapshot.SnapshotStore.peek = refused\n"
        f"sys.argv[0] = {MAIN!r}\n"
        f"runpy.run_path({MAIN!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    expect_config_error(proc, "cannot read snapshots at")
    assert load_snapshot(tmp_path / "run" / "snapshot.pt")["train_state"]["step"] == 4


def diverging_main(tmp_path, strategy="ddp"):
    """main.py with rank 1's end-of-run fingerprint made to differ, in our code, not torch's:
    under DDP its weights really differ (nudged after training); under FSDP every rank gathers
    the same whole model, so rank 1's fingerprint stands for a fault in what it gathered."""
    nudge = ("        with torch.no_grad():\n"
             "            next(self.model.parameters()).add_(1e-3)\n" if strategy == "ddp" else
             "        gathered = self.strategy.fingerprint  # its collectives still run on every rank\n"
             "        self.strategy.fingerprint = lambda: 'fault' + gathered()[5:]\n")
    script = tmp_path / "diverging.py"
    script.write_text(
        "import runpy, sys, torch\n"
        "from mingpt_ddp import trainer\n"
        "check = trainer.Trainer._check_ranks_agree\n"
        "def nudged(self):\n"
        "    if self.dist.rank == 1:\n"
        f"{nudge}"
        "    return check(self)\n"
        "trainer.Trainer._check_ranks_agree = nudged\n"
        f"sys.argv[0] = {MAIN!r}\n"
        f"runpy.run_path({MAIN!r}, run_name='__main__')\n"
    )
    return script


def run_diverging(script, cmd_args):
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), *cmd_args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})


@pytest.mark.dist
@pytest.mark.slow
def test_parameters_that_differ_at_the_end_are_an_error_and_the_run_is_not_finished(tmp_path, small_corpus):
    """Rank 1's weights really differ. The last snapshot keeps rank 0's state, marked as failing
    the check: the same command again (as the error advises, or a requeue) and a sweep over the
    run refuse it in one line, never "finished" with exit 0; trainer.resume_failed_check=true
    takes it as it is."""
    sweep = tmp_path / "sweep"
    run_dir = sweep / "0"  # where a sweep's point 0 lives: the sweep below finds this run's snapshot
    # the last step is saved in the loop too: the check's mark must still reach the snapshot
    cmd_args = args(run_dir, small_corpus, "trainer.max_steps=3", "trainer.snapshot_every_steps=3")
    script = diverging_main(tmp_path)
    proc = run_diverging(script, cmd_args)
    text = output(proc)
    # plain torchrun exits 1 for any failed worker; each worker's own code is 2 (a ConfigError:
    # not retried, a person compares the nodes), as its failure summary shows
    assert proc.returncode != 0 and "exitcode  : 2" in text and "exitcode  : 4" not in text, text
    assert "error: parameters differ between ranks at the end of training (rank 0: " in text, text
    assert "trainer.resume_failed_check=true" in text, text
    snapshot = load_snapshot(run_dir / "snapshot.pt")
    assert snapshot["train_state"]["step"] == 3, snapshot["train_state"]  # the work is kept
    assert "parameters differ between ranks" in snapshot["failed_check"]["message"], snapshot["failed_check"]
    assert snapshot["train_state"]["final_eval_pending"], snapshot["train_state"]  # not evaluated: not finished

    again = run_diverging(script, cmd_args)  # the same command
    assert "run already finished" not in output(again), output(again)
    expect_config_error(again, "failed the end-of-run check (parameters differ between ranks",
                        "trainer.resume_failed_check=true")

    swept = run_cli(["-m", *TINY, f"data.path={small_corpus}", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}"])
    assert swept.returncode == 2, output(swept)
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "failed" and "failed the end-of-run check" in record["error"], record
    assert "finished earlier" not in (sweep / "summary.md").read_text()

    accepted = must_pass(run_cli([*cmd_args, "trainer.resume_failed_check=true"]))
    assert "failed the end-of-run check" in accepted and "its final evaluation, which was pending" in accepted, accepted
    assert "steps planned" in accepted and "final evaluation:" in accepted and "done: step 3" in accepted, accepted
    assert not load_snapshot(run_dir / "snapshot.pt")["train_state"]["final_eval_pending"]


@pytest.mark.dist
@pytest.mark.slow
def test_a_sharded_snapshot_that_failed_the_check_is_marked_and_refused(tmp_path, small_corpus):
    """FSDP: the mark is in the sharded snapshot's metadata, and a new start refuses it."""
    from mingpt_ddp.checkpoint.sharded_snapshot import ShardedSnapshotStore

    cmd_args = args(tmp_path / "run", small_corpus, "trainer.max_steps=3", "trainer.strategy=fsdp")
    proc = run_diverging(diverging_main(tmp_path, "fsdp"), cmd_args)
    assert "error: parameters differ between ranks at the end of training (rank 0: " in output(proc), output(proc)
    meta, _ = ShardedSnapshotStore(str(tmp_path / "run" / "snapshot.pt")).latest_meta()
    assert meta["train_state"]["step"] == 3 and "rank 1: fault" in meta["failed_check"]["message"], meta
    again = run_cli(cmd_args)
    assert again.returncode == 2 and "run already finished" not in output(again), output(again)
    assert "failed the end-of-run check" in error_lines(output(again))[0], output(again)


# ---- 2. the global batch is the run's, kept on every later resume ----------------------------
def stopped_run(cmd_args, nproc, log_path, run_dir):
    """Start a run, let it train a few logged steps, stop it with SIGUSR1 (a snapshot, exit 0)."""
    if nproc:
        cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", MAIN, *cmd_args]
    else:
        cmd = [PYTHON, MAIN, *cmd_args]
    before = metrics_lines(run_dir)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: metrics_lines(run_dir) >= before + 2, 180, "training progress")
        target = children(proc.pid)[0] if nproc else proc.pid
        os.kill(target, signal.SIGUSR1)
        assert proc.wait(timeout=120) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return log_path.read_text()


def plan_of(text):
    line = next(line for line in text.splitlines() if "steps planned" in line)
    return line.split("global batch ")[1].split(" x ")[0], line.rsplit("; ", 1)[1]


@pytest.mark.dist
@pytest.mark.slow
def test_global_batch_and_plan_survive_2_1_1_2_workers(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    common = args(run_dir, small_corpus, "trainer.max_epochs=6", "trainer.log_every=5")
    logs = [stopped_run(common, 2, tmp_path / "a.log", run_dir),
            stopped_run(common, 0, tmp_path / "b.log", run_dir),
            stopped_run(common, 0, tmp_path / "c.log", run_dir),
            stopped_run(common, 2, tmp_path / "d.log", run_dir)]
    plans = [plan_of(text) for text in logs]
    assert len(set(plans)) == 1 and plans[0][0] == "16", plans
    assert "world size 1 as when the run's global batch was set: global batch 16 kept" in logs[2], logs[2]
    assert load_snapshot(run_dir / "snapshot.pt")["global_batch"] == 16
    # An explicit override, with the setting that lets a resume change it, changes it, and says so.
    text = stopped_run([*common, "trainer.batch_size=4", "trainer.continue_with_new_settings=true"], 2,
                       tmp_path / "e.log", run_dir)
    assert "global batch changed from 16 to 8" in text and plan_of(text)[0] == "8", text


# ---- 3. DDP static graph with gradient accumulation ------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_static_graph_with_accumulation_is_refused_before_training(tmp_path, small_corpus):
    proc = run_cli(args(tmp_path / "run", small_corpus, "trainer.ddp_static_graph=true",
                        "trainer.grad_accum_steps=2", "trainer.max_steps=4"), nproc=2, timeout=120)
    expect_config_error(proc, "trainer.ddp_static_graph=true", "trainer.ddp_static_graph=false")
    assert not list((tmp_path / "run").glob("snapshot*.pt"))


@pytest.mark.dist
@pytest.mark.slow
def test_static_graph_refused_when_an_elastic_resume_turns_accumulation_on(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    static = "trainer.ddp_static_graph=true"
    must_pass(run_cli(args(run_dir, small_corpus, static, "trainer.max_steps=2"), nproc=4))  # global batch 32
    proc = run_cli(args(run_dir, small_corpus, static, "trainer.max_steps=4"), nproc=2, timeout=120)
    expect_config_error(proc, "keep the snapshot's global batch", "trainer.ddp_static_graph=false")
    assert load_snapshot(run_dir / "snapshot.pt")["train_state"]["step"] == 2


# ---- 5. a sweep point failing on some ranks only ---------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_sweep_point_failing_on_one_rank_fails_on_all_before_moving_on(tmp_path, small_corpus):
    # A per-rank cache directory: rank 1 alone finds its node's token cache elsewhere (as a
    # process whose $HOME differs from its node's local rank 0 would).
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "trainer.seed=1,2", *TINY, "trainer.max_steps=3", f"data.path={small_corpus}",
                    f"data.cache_dir={tmp_path}/cache_${{oc.env:RANK}}", f"hydra.sweep.dir={sweep}"],
                   nproc=2, timeout=180)
    assert proc.returncode != 0 and "error: 2 of 2 sweep points failed" in proc.stderr, output(proc)
    results = [json.loads((sweep / p / "result.json").read_text()) for p in ("0", "1")]
    assert [r["status"] for r in results] == ["failed", "failed"], results
    assert all("on rank(s) 1 of 2" in r["error"] and "this process's data.cache_dir" in r["error"] for r in results)


# ---- 13. a finished run exits cleanly --------------------------------------------------------------
EXIT_PROBE = """
import os, threading
def _probe():
    import sys
    dist = sys.modules.get("torch.distributed")
    alive = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    with open(os.environ["MINGPT_EXIT_PROBE"] + "." + os.environ.get("RANK", "x"), "w") as f:
        f.write(f"{bool(dist and dist.is_available() and dist.is_initialized())} {alive}")
threading._register_atexit(_probe)  # runs when the main thread is done, before atexit handlers
"""


@pytest.mark.dist
@pytest.mark.slow
def test_quick_two_worker_runs_exit_cleanly_in_a_loop(tmp_path, small_corpus):
    """The process group is gone and no thread is left when Python starts shutting down,
    and the quick path never ends in an abort (MINGPT_EXIT_LOOP runs; 200 for the full check)."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(EXIT_PROBE)
    runs = int(os.environ.get("MINGPT_EXIT_LOOP", "3"))
    for i in range(runs):
        probe = tmp_path / f"exit{i}"
        proc = run_cli([*TINY, f"data.path={small_corpus}", "trainer.max_steps=3"], nproc=2, cwd=tmp_path,
                       env={"PYTHONPATH": f"{probe_dir}{os.pathsep}{REPO}", "MINGPT_EXIT_PROBE": str(probe)})
        text = output(proc)
        assert proc.returncode == 0 and "terminate called" not in text, text
        for rank in (0, 1):
            assert Path(f"{probe}.{rank}").read_text() == "False []", (rank, text)
