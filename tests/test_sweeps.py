"""Hydra multirun under torchrun: one directory per point, restarts skip finished points,
failures are recorded, a summary and a plot at the end."""
import csv
import json
import os
import signal
import struct
import subprocess

import pytest
import yaml

from conftest import MAIN, PYTHON, REPO, TINY, TORCHRUN, output, read_metrics, run_cli
from test_fault_tolerance import children, metrics_lines, wait_for

pytestmark = pytest.mark.slow
FIXED = [o for o in TINY if not o.startswith(("model=", "optimizer.lr="))]  # swept here


def summary_rows(sweep_dir):
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.dist
def test_a_2x2_sweep_under_torchrun_gives_four_independent_points(tmp_path, small_corpus):
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "optimizer.lr=1e-3,3e-3", "model=gpt-nano,gpt-micro", *FIXED, "trainer.max_steps=10",
                    f"data.path={small_corpus}", f"hydra.sweep.dir={sweep}"], nproc=2)
    assert proc.returncode == 0, output(proc)
    points = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert points == ["0", "1", "2", "3"]  # a rank with another idea of the directory would add more
    seen = set()
    for point in points:
        d = sweep / point
        cfg = yaml.safe_load((d / ".hydra" / "config.yaml").read_text())
        seen.add((cfg["optimizer"]["lr"], cfg["model"]["n_embd"]))
        steps = [r["step"] for r in read_metrics(d) if "train_loss" in r]
        assert steps == [5, 10], "a point must start from step 0, not inherit another's counter"
        assert (d / "snapshot.pt").is_file()
    assert seen == {(1e-3, 48), (3e-3, 48), (1e-3, 128), (3e-3, 128)}
    assert len({(sweep / p / "snapshot.pt").read_bytes() for p in points}) == 4
    rows = summary_rows(sweep)
    assert [r["status"] for r in rows] == ["completed"] * 4
    assert rows[0]["overrides"] == "optimizer.lr=0.001 model=gpt-nano"  # as Hydra records the sweep value
    assert all(float(r["final_val_loss"]) < 4.2 and float(r["tokens_per_s"]) > 0 for r in rows)
    assert "| point | overrides | status |" in proc.stdout
    assert (sweep / "summary.md").read_text().count("| completed |") == 4


@pytest.mark.cli
def test_a_failing_point_is_recorded_and_the_sweep_goes_on_in_one_process(tmp_path, small_corpus):
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "model.n_embd=48,50,96", *TINY, "trainer.max_steps=5", f"data.path={small_corpus}",
                    f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 2, output(proc)  # the sweep goes on, and then says that it was not all done
    assert "error: 1 of 3 sweep points failed (point 1)" in proc.stderr, output(proc)
    rows = summary_rows(sweep)
    assert [r["status"] for r in rows] == ["completed", "failed", "completed"]
    assert "not divisible by model.n_head=3" in rows[1]["error"]
    stop = run_cli(["-m", "model.n_embd=50,48", *TINY, "trainer.max_steps=5", f"data.path={small_corpus}",
                    f"hydra.sweep.dir={tmp_path / 'stop'}", "sweep.stop_on_failure=true"])
    assert stop.returncode == 2 and not (tmp_path / "stop" / "1").exists()


@pytest.mark.dist
def test_a_restart_mid_sweep_skips_finished_points_and_resumes_the_interrupted_one(tmp_path, small_corpus):
    sweep = tmp_path / "sweep"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", MAIN, "-m",
           "optimizer.lr=1e-3,2e-3,3e-3", *FIXED, "trainer.max_steps=150", "trainer.snapshot_every_steps=10",
           f"data.path={small_corpus}", f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    try:
        wait_for(lambda: metrics_lines(sweep / "2") >= 4 and (sweep / "2" / "snapshot.pt").exists(), 300, "point 3")
        finished = {p: (sweep / p / "metrics.jsonl").read_text() for p in ("0", "1")}
        os.kill(children(proc.pid)[0], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log").read_text()
    after_restart = text.split("run already finished", 1)
    assert len(after_restart) == 2 and text.count("run already finished") == 2, text
    for p, before in finished.items():  # not retrained: nothing appended to their metrics
        assert (sweep / p / "metrics.jsonl").read_text() == before
    assert f"resumed from {sweep}/2/snapshot.step" in text
    assert [r["status"] for r in summary_rows(sweep)] == ["completed"] * 3


@pytest.mark.cli
def test_plot_of_a_two_point_sweep_is_a_real_png(tmp_path, small_corpus):
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "optimizer.lr=1e-3,3e-3", *FIXED, "trainer.max_steps=20", "trainer.eval_every=5",
                    f"data.path={small_corpus}", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, output(proc)
    out = tmp_path / "plot.png"
    done = subprocess.run([PYTHON, "-m", "mingpt_ddp.plot", str(sweep), str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 600 and len(data) > 20_000
    assert (sweep / "losses.png").is_file() and "![losses](losses.png)" in (sweep / "summary.md").read_text()


@pytest.mark.dist
@pytest.mark.parametrize("how", ["SIGUSR1 to one worker", "SIGTERM to torchrun"])
def test_a_stop_signal_ends_the_whole_sweep_after_the_points_snapshot(tmp_path, small_corpus, how):
    """Slurm's preemption warning (SIGUSR1) or a SIGTERM during point 0: that point saves a
    snapshot and the whole sweep ends (the next point never starts), exiting 0 as a single
    run does, so that train.sbatch requeues the job; the requeued sweep resumes point 0."""
    sweep = tmp_path / "sweep"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=0", MAIN, "-m", "optimizer.lr=1e-3,2e-3",
           *FIXED, "trainer.max_epochs=1000", f"data.path={small_corpus}", f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    try:
        wait_for(lambda: metrics_lines(sweep / "0") >= 4, 300, "point 0 training")
        if how.startswith("SIGUSR1"):
            os.kill(children(proc.pid)[-1], signal.SIGUSR1)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the sweep went on after the stop signal:\n" + (tmp_path / "log").read_text())
    finally:
        if proc.poll() is None:  # torchrun's workers run in sessions of their own
            for pid in children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log").read_text()
    if how.startswith("SIGUSR1"):
        assert code == 0, text
    assert not (sweep / "1").exists(), text  # the next point never started
    result = yaml.safe_load((sweep / "0" / "result.json").read_text())
    assert result["status"].startswith("stopped by SIG"), result
    assert (sweep / "0" / "snapshot.pt").is_file()
    assert "sweep stopped by SIG" in text and "run the same command to resume the sweep" in text, text
    if how.startswith("SIGUSR1"):
        assert "Traceback" not in text, text


@pytest.mark.unit
def test_result_file_redacts_the_snapshot_urls_secrets(tmp_path):
    """result.json (and the summary.csv built from it) never holds a URL's credentials."""
    from mingpt_ddp.tools import sweep
    url = "s3://u:hunter2pw@bucket/run/snapshot.pt?X-Amz-Signature=abcdef0123456789"
    sweep.write_result(str(tmp_path), {"status": "completed", "val_loss": 2.0, "snapshot": url,
                                       "error": f"cannot write {url}"})
    text = (tmp_path / "result.json").read_text()
    assert "hunter2pw" not in text and "abcdef0123456789" not in text
    assert "bucket/run/snapshot.pt" in text  # still says where the snapshot is


@pytest.mark.unit
def test_a_result_file_with_wrong_typed_fields_does_not_stop_the_summary(tmp_path):
    """A point's result.json edited by hand (or another version's): its wrong-typed fields are
    left out, and the summary at the sweep's end is still written."""
    from mingpt_ddp.tools import sweep
    from mingpt_ddp.tools.runs import read_result

    for point, body in {"0": {"status": "completed", "wall_s": "12s", "val_loss": [1.0], "error": None},
                        "1": {"status": "completed", "wall_s": 3.5, "val_loss": 2.0, "snapshot": "a/snapshot.pt"}}.items():
        (tmp_path / point / ".hydra").mkdir(parents=True)
        (tmp_path / point / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={point}\n")
        (tmp_path / point / "result.json").write_text(json.dumps(body))
        (tmp_path / point / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.0}\n')
    assert read_result(tmp_path / "0") == {"status": "completed", "error": None}
    assert read_result(tmp_path / "1")["wall_s"] == 3.5
    sweep.write_summary(str(tmp_path))
    rows = summary_rows(tmp_path)
    assert [(r["status"], r["wall_s"]) for r in rows] == [("completed", ""), ("completed", "3.5")], rows


@pytest.mark.unit
def test_a_sweep_whose_points_all_failed_before_training_still_gets_its_summary(tmp_path):
    """No point logged a metrics line (each refused its input): the closing line points at
    summary.md, so it is written, without a plot."""
    from mingpt_ddp.tools import sweep

    for point in ("0", "1"):
        (tmp_path / point / ".hydra").mkdir(parents=True)
        (tmp_path / point / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={point}\n")
        (tmp_path / point / "result.json").write_text(json.dumps({"status": "failed", "error": "data file not found"}))
    sweep.write_summary(str(tmp_path))
    assert [r["status"] for r in summary_rows(tmp_path)] == ["failed", "failed"]
    assert "data file not found" in (tmp_path / "summary.md").read_text()


@pytest.mark.cli
def test_a_second_sweep_in_a_live_sweeps_directory_is_refused_before_hydra_writes(tmp_path, small_corpus):
    """Sweep B started in the directory of sweep A while A's point 0 trains: B stops within
    seconds with one error line and exit code 2, and A's files (multirun.yaml, the point's
    .hydra/ and main.log) are untouched; B trains nothing."""
    sweep = tmp_path / "sweep"
    cmd = [PYTHON, MAIN, "-m", "trainer.seed=1,2", *TINY, "trainer.max_epochs=1000", f"data.path={small_corpus}",
           f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "a.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: metrics_lines(sweep / "0") >= 2, 120, "point 0 of the first sweep training")
        kept = {p: p.read_bytes() for p in [sweep / "multirun.yaml", *(sweep / "0" / ".hydra").iterdir(),
                                            sweep / "0" / "main.log"]}
        second = run_cli(["-m", "trainer.seed=777,778", *TINY, "trainer.max_steps=3", f"data.path={small_corpus}",
                          f"hydra.sweep.dir={sweep}"], timeout=60)
        assert first.poll() is None, (tmp_path / "a.log").read_text()
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1, output(second)
        assert "another sweep is live" in errors[0] and "hydra.sweep.dir" in errors[0], errors[0]
        assert "Traceback" not in output(second)
        grown = (sweep / "0" / "main.log").read_bytes()
        assert {p: (grown[:len(kept[p])] if p.name == "main.log" else p.read_bytes()) for p in kept} == kept
        # B's process would log its own start line and its 3-step plan (a bare "777" can be a figure in A's lines)
        assert grown.count(b"rank 0 (local 0 of 1)") == 1 and b"3 steps planned" not in grown, grown.decode()
        assert not (sweep / "1").exists()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


@pytest.mark.cli
def test_a_point_refused_once_is_recorded_as_finished_once_it_is(tmp_path, small_corpus):
    """A sweep run again with another model refuses its finished points (recorded as failed);
    run again as it was, the points are finished earlier: their records say so, not the old
    failure, and summary.md lists no failed point. Nor is a point finished earlier under
    other values, or on another corpus than the one its record names."""
    sweep = tmp_path / "sweep"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(small_corpus.read_text())
    base = [PYTHON, str(MAIN), "--multirun", *FIXED, "model=gpt-nano", f"data.path={corpus}", f"hydra.sweep.dir={sweep}",
            "trainer.max_steps=2", "optimizer.lr=3e-3,1e-3"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sweep_once(*extra):
        return subprocess.run([*base, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)

    first = sweep_once()
    assert first.returncode == 0, first.stderr
    refused = sweep_once("model.n_layer=2")
    assert refused.returncode == 2, refused.stderr
    assert {json.loads((sweep / p / "result.json").read_text())["status"] for p in ("0", "1")} == {"failed"}
    again = sweep_once()
    assert again.returncode == 0, again.stderr
    for point in ("0", "1"):
        record = json.loads((sweep / point / "result.json").read_text())
        assert record["status"] == "finished earlier" and record["corpus"]["train_tokens"] == 36_000, record
    assert "failed" not in (sweep / "summary.md").read_text().lower()
    # The values in another order: point 0 (now lr=1e-3) holds lr=3e-3's finished run. Its loss
    # must not be reported as lr=1e-3's: refused, naming the setting.
    base[-1] = "optimizer.lr=1e-3,3e-3"
    reordered = sweep_once()
    assert reordered.returncode == 2, reordered.stderr
    for point, change in (("0", "optimizer.lr=0.003 then, 0.001 now"), ("1", "optimizer.lr=0.001 then, 0.003 now")):
        record = json.loads((sweep / point / "result.json").read_text())
        assert record["status"] == "failed" and change in record["error"], record
    # In their order again, on a corpus that changed since: not finished for this one.
    base[-1] = "optimizer.lr=3e-3,1e-3"
    corpus.write_text(small_corpus.read_text() + "\nmore text")
    changed = sweep_once()
    assert changed.returncode == 2, changed.stderr
    for point in ("0", "1"):
        record = json.loads((sweep / point / "result.json").read_text())
        assert record["status"] == "failed" and "finished on another corpus" in record["error"], record
        assert "40,000 tokens then, 40,010 now" in record["error"], record


@pytest.mark.cli
def test_a_sweep_over_its_limits_in_another_order_reports_no_other_points_run(tmp_path, small_corpus):
    """trainer.max_steps=4,2 then 2,4: point 0 holds a run that went on to step 4, past
    max_steps=2 (refused, naming the limit then and now, not "finished earlier"); point 1 a
    2-step run that would be extended to 4 under a cosine stretched from 2 steps to 4
    (optimizer.decay_steps=null), which no fresh 4-step run gives: refused in a sweep."""
    sweep = tmp_path / "sweep"
    base = [PYTHON, str(MAIN), "--multirun", *TINY, f"data.path={small_corpus}", f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sweep_once(*extra):
        return subprocess.run([*base, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)

    first = sweep_once("trainer.max_steps=4,2")
    assert first.returncode == 0, first.stderr
    reordered = sweep_once("trainer.max_steps=2,4")
    assert reordered.returncode == 2, reordered.stderr
    records = {p: json.loads((sweep / p / "result.json").read_text()) for p in ("0", "1")}
    assert records["0"]["status"] == "failed", records
    assert "finished past this config's end (it stopped at step 4: trainer.max_steps=4 then, 2 now)" \
        in records["0"]["error"], records
    assert records["1"]["status"] == "failed", records
    assert "planned 2 steps and this point plans 4" in records["1"]["error"], records


@pytest.mark.unit
def test_a_points_best_val_loss_starts_again_on_a_new_corpus(tmp_path):
    """After data.continue_on_new_corpus the losses before it are another validation split's:
    the summary's best_val_loss is the best since the last "new corpus" mark (main.py writes it)."""
    from mingpt_ddp.tools.sweep import point_row

    records = [{"step": 5, "val_loss": 1.0}, {"step": 5, "event": "new corpus"}, {"step": 10, "val_loss": 2.5},
               {"step": 15, "val_loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = point_row(tmp_path, "")
    assert (row["best_val_loss"], row["final_val_loss"]) == (2.0, 2.0)
