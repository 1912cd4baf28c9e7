"""Following a run with the tools people use: MLflow, W&B (offline), TensorBoard, profiler
traces. Real runs of the CLI; the trackers' own stores are read back."""
import glob
import json
import os
import struct
import subprocess
import time

import pytest

from conftest import MAIN, PYTHON, REPO, TINY, TORCHRUN, load_snapshot, output, read_metrics, run_cli

pytestmark = pytest.mark.slow


def tracked_env(**extra):
    """No tracker settings from the developer's environment, and no network for W&B."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    env.update(WANDB_BASE_URL="http://127.0.0.1:9", WANDB_SILENT="true", **extra)
    return env


def train(run_dir, corpus, *extra, nproc=2, env=None):
    proc = subprocess_run([*TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}", *extra], nproc, env)
    assert proc.returncode == 0, output(proc)
    return output(proc)


def subprocess_run(args, nproc, env):
    """Like conftest.run_cli, but with exactly `env` (run_cli adds the test's own environment)."""
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", MAIN, *args] if nproc else [PYTHON, MAIN, *args]
    return subprocess.run(cmd, cwd=REPO, env={"PYTHONUNBUFFERED": "1", **(env or tracked_env())},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


def train_rows(run_dir, key):
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r.get(key) is not None]


def assert_same_series(logged, expected):
    assert [s for s, _ in logged] == [s for s, _ in expected]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)


@pytest.mark.cli
def test_mlflow_file_store_holds_the_run_and_a_resume_continues_it(tmp_path, small_corpus, monkeypatch):
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    run_dir = tmp_path / "run"
    secret = "s3cr3t-value-for-the-test"
    env = tracked_env(I13_TEST_SECRET=secret)
    train(run_dir, small_corpus, "logger=mlflow", "trainer.max_steps=10",
          "+trainer.storage_options.secret=${oc.env:I13_TEST_SECRET}", env=env)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow_tracking.MlflowClient(tracking_uri=f"file:{run_dir}/mlruns")

    def the_run():
        experiment = client.get_experiment_by_name("mingpt-ddp")
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == 1, [r.info.run_id for r in runs]
        return runs[0]

    def history(run, key):
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    run = the_run()
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params = run.data.params
    assert params["model.n_layer"] == "3" and params["trainer.max_steps"] == "10" and params["data.block_size"] == "32"
    assert params["trainer.storage_options.secret"] == "<redacted>"
    assert run.data.tags["mingpt_ddp.run_dir"] == str(run_dir)
    assert_same_series(history(run, "train_loss"), train_rows(run_dir, "train_loss"))
    assert [s for s, _ in history(run, "train_loss")] == [5, 10]
    assert_same_series(history(run, "val_loss"), train_rows(run_dir, "val_loss"))
    assert {"lr", "tokens_per_s", "mfu"} <= set(run.data.metrics)
    for path in (run_dir / "mlruns").rglob("*"):
        assert not path.is_file() or secret not in path.read_text(errors="replace"), path

    # Resumed with more steps (and one process): the same MLflow run goes on.
    train(run_dir, small_corpus, "logger=mlflow", "trainer.max_steps=20",
          "+trainer.storage_options.secret=${oc.env:I13_TEST_SECRET}", nproc=0, env=env)
    resumed = the_run()
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert [s for s, _ in history(resumed, "train_loss")] == [5, 10, 15, 20]
    assert resumed.data.params["trainer.max_steps"] == "10" and resumed.data.tags["resumed_with.trainer.max_steps"] == "20"

    # A new run directory resuming the same snapshot path (a new Slurm job, say) finds the
    # MLflow run id in the snapshot.
    train(tmp_path / "next_job", small_corpus, "logger=mlflow", "trainer.max_steps=25",
          f"trainer.snapshot_path={run_dir}/snapshot.pt", f"logger.mlflow.tracking_uri=file:{run_dir}/mlruns",
          "+trainer.storage_options.secret=${oc.env:I13_TEST_SECRET}", nproc=0, env=env)
    again = the_run()
    assert again.info.run_id == run.info.run_id and [s for s, _ in history(again, "train_loss")][-1] == 25


@pytest.mark.cli
def test_mlflow_tracking_uri_from_the_environment(tmp_path, small_corpus, monkeypatch):
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    run_dir, store = tmp_path / "run", tmp_path / "store"
    train(run_dir, small_corpus, "logger=mlflow", "trainer.max_steps=5", "logger.mlflow.experiment=exp1", nproc=0,
          env=tracked_env(MLFLOW_TRACKING_URI=f"file:{store}", MLFLOW_ALLOW_FILE_STORE="true"))
    assert not (run_dir / "mlruns").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow_tracking.MlflowClient(tracking_uri=f"file:{store}")
    runs = client.search_runs([client.get_experiment_by_name("exp1").experiment_id])
    assert len(runs) == 1 and [m.step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")] == [5]


@pytest.mark.cli
def test_mlflow_in_a_sweep_one_store_with_a_run_per_point(tmp_path, small_corpus, monkeypatch):
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    sweep = tmp_path / "sweep"
    proc = subprocess_run(["-m", "trainer.seed=1,2", *TINY, "trainer.max_steps=5", f"data.path={small_corpus}",
                           f"hydra.sweep.dir={sweep}", "logger=mlflow"], 0, tracked_env())
    assert proc.returncode == 0, output(proc)
    assert not (sweep / "0" / "mlruns").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow_tracking.MlflowClient(tracking_uri=f"file:{sweep}/mlruns")
    runs = client.search_runs([client.get_experiment_by_name("mingpt-ddp").experiment_id])
    assert sorted((r.info.run_name, r.data.params["trainer.seed"]) for r in runs) == [("sweep/0", "1"), ("sweep/1", "2")]


@pytest.mark.cli
def test_an_unreachable_mlflow_server_is_a_clear_error(tmp_path, small_corpus):
    pytest.importorskip("mlflow")
    import socket

    with socket.socket() as s:  # a loopback port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess_run([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "logger=mlflow"],
                          0, tracked_env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}",
                                         MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5"))
    assert proc.returncode == 2, output(proc)
    assert f"error: cannot open an MLflow run at http://127.0.0.1:{port}" in output(proc)
    assert "Traceback" not in output(proc)


# A real MLflow tracking server on 127.0.0.1: MLflow's own REST app (file store) under
# werkzeug, behind HTTP basic auth as a deployment would put it, so a run that lost its
# credentials fails.
MLFLOW_SERVER = """
import base64, os, sys
from werkzeug.serving import make_server
port, store, user, password = sys.argv[1:5]
os.environ.update(_MLFLOW_SERVER_FILE_STORE=store, _MLFLOW_SERVER_ARTIFACT_ROOT=store + "-artifacts",
                  _MLFLOW_SERVER_SERVE_ARTIFACTS="false", MLFLOW_ALLOW_FILE_STORE="true")
from mlflow.server import app
expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
def basic_auth(environ, start_response):
    if environ.get("PATH_INFO") != "/health" and environ.get("HTTP_AUTHORIZATION") != expected:
        start_response("401 Unauthorized", [("WWW-Authenticate", "Basic")])
        return [b"unauthorized"]
    return app(environ, start_response)
make_server("127.0.0.1", int(port), basic_auth, threaded=True).serve_forever()
"""
MLFLOW_USER, MLFLOW_PASSWORD = "alice", "tracking-pw-7f3a9c"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow.server")
    import socket
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "w")
    server = subprocess.Popen([PYTHON, "-c", MLFLOW_SERVER, str(port), str(root / "mlruns"), MLFLOW_USER,
                               MLFLOW_PASSWORD], env=tracked_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()
                time.sleep(0.25)
        yield f"127.0.0.1:{port}", root / "mlruns"
    finally:
        server.terminate()
        server.wait()
        log.close()


def assert_password_nowhere(text, *directories):
    assert MLFLOW_PASSWORD not in text, text
    for directory in directories:
        for path in directory.rglob("*"):
            assert MLFLOW_PASSWORD not in path.name, path
            if path.is_file():
                assert MLFLOW_PASSWORD.encode() not in path.read_bytes(), path


@pytest.mark.cli
def test_mlflow_credentials_in_a_tracking_uri_are_used_but_never_shown_or_stored(tmp_path, small_corpus,
                                                                                 mlflow_server, monkeypatch):
    """In MLFLOW_TRACKING_URI, or logger.mlflow.tracking_uri from the environment: the run
    logs to the server that asks for them, and the password reaches no output, no file of
    the run (.hydra/, loggers.json, the snapshot's config and logger run ids) and no
    parameter of the MLflow run. Written literally into the config it is refused."""
    from mlflow.tracking import MlflowClient

    host, store = mlflow_server
    uri = f"http://{MLFLOW_USER}:{MLFLOW_PASSWORD}@{host}"
    runs = {"env": ([], tracked_env(MLFLOW_TRACKING_URI=uri)),
            "interpolated": (["logger.mlflow.tracking_uri=${oc.env:I22_TRACKING_URI}"],
                             tracked_env(I22_TRACKING_URI=uri))}
    for name, (extra, env) in runs.items():
        run_dir = tmp_path / name
        text = train(run_dir, small_corpus, "logger=mlflow", "trainer.max_steps=5", f"logger.mlflow.experiment={name}",
                     *extra, nproc=0, env=env)
        assert_password_nowhere(text, run_dir, store)
        snapshot = load_snapshot(run_dir / "snapshot.pt")
        assert MLFLOW_PASSWORD not in repr(snapshot["config"]) + repr(snapshot["logger_runs"])
        assert json.loads((run_dir / "loggers.json").read_text())["mlflow"]["tracking_uri"] == f"http://{host}"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", MLFLOW_USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_PASSWORD)
    client = MlflowClient(tracking_uri=f"http://{host}")
    for name in runs:
        [run] = client.search_runs([client.get_experiment_by_name(name).experiment_id])
        assert run.info.status == "FINISHED" and [m.step for m in client.get_metric_history(run.info.run_id,
                                                                                            "train_loss")] == [5]
        assert MLFLOW_PASSWORD not in repr(run.data.params) + repr(run.data.tags)

    literal = subprocess_run([*TINY, f"hydra.run.dir={tmp_path / 'literal'}", f"data.path={small_corpus}",
                              "logger=mlflow", f"logger.mlflow.tracking_uri={uri}"], 0, tracked_env())
    text = output(literal)
    assert literal.returncode == 2 and text.count("error: logger.mlflow.tracking_uri: secrets must not") == 1, text
    assert_password_nowhere(text, tmp_path / "literal")


def wandb_records(path):
    """The records of a .wandb file (W&B's LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, header = open(path, "rb").read(), 32768, 7
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header]) if left >= header else (0, 0, 0)
        if left < header or (kind == 0 and length == 0):
            pos += left
            continue
        chunk += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_history(run_file):
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.mark.cli
def test_wandb_offline_directory_holds_the_run_and_tensorboard_runs_beside_it(tmp_path, small_corpus):
    pytest.importorskip("wandb")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_dir = tmp_path / "run"
    env = tracked_env(WANDB_MODE="offline")
    train(run_dir, small_corpus, "logger=[wandb,tensorboard]", "trainer.max_steps=10", env=env)
    run_id = json.loads((run_dir / "loggers.json").read_text())["wandb"]["id"]
    offline = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(offline) == 1, os.listdir(run_dir / "wandb")
    records = list(wandb_records(offline[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_id == run_id and run.project == "mingpt-ddp" and run.display_name == "run"
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["n_layer"] == 3 and config["run_dir"] == str(run_dir)
    logged = [(h["step"], h["train_loss"]) for h in wandb_history(offline[0]) if "train_loss" in h]
    assert_same_series(logged, train_rows(run_dir, "train_loss"))
    assert [s for s, _ in logged] == [5, 10]
    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == [5, 10]

    # A resume continues the same W&B run (offline: a second directory with the same id,
    # which `wandb sync` merges).
    train(run_dir, small_corpus, "logger=[wandb,tensorboard]", "trainer.max_steps=15", nproc=0, env=env)
    resumed = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(resumed) == 2 and all(p.endswith(f"run-{run_id}.wandb") for p in resumed)
    later = next(p for p in resumed if p != offline[0])
    assert [h["step"] for h in wandb_history(later) if "train_loss" in h] == [15]


@pytest.mark.cli
def test_no_tracker_keeps_a_secret_from_the_command_line_or_the_environment(tmp_path, small_corpus):
    """A presigned URL's signature on the command line (W&B's own metadata would record
    sys.argv as given) and a credential from the environment: every file the three trackers
    and the run wrote (wandb/, mlruns/, the event files, metrics.jsonl, .hydra/) is free of both."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    signature, token = "9f1c0e6d2b7a4c3e8f5d1a0b6c7e8f9aSIGNATURE", "env-token-5d8e2a7c41f9"
    run_dir = tmp_path / "run"
    # data.path exists, so the presigned download URL is only part of the command line.
    text = train(run_dir, small_corpus, "logger=[wandb,mlflow,tensorboard]", "trainer.max_steps=5",
                 f'data.download_url="http://127.0.0.1:9/input.txt?X-Amz-Expires=3600&X-Amz-Signature={signature}"',
                 "+trainer.storage_options.token=${oc.env:I29_TOKEN}", nproc=0,
                 env=tracked_env(WANDB_MODE="offline", I29_TOKEN=token))
    written = list(run_dir.rglob("*"))
    assert {"wandb", "mlruns", "tensorboard", "metrics.jsonl", ".hydra"} <= {p.name for p in written}
    assert glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    for secret in (signature, token):
        assert secret not in text
        leaked = [p for p in written if secret in p.name or p.is_file() and secret.encode() in p.read_bytes()]
        assert not leaked, (secret, leaked)


@pytest.mark.dist
def test_a_missing_tracker_is_one_clear_error_on_every_rank_before_training(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    env = tracked_env(PYTHONPATH=str(REPO / "tests" / "without_modules"), MINGPT_TEST_WITHOUT="mlflow")
    start = time.monotonic()
    proc = subprocess_run([*TINY, f"hydra.run.dir={run_dir}", f"data.path={small_corpus}", "logger=[tensorboard,mlflow]"],
                          2, env)
    text = output(proc)
    assert proc.returncode != 0 and time.monotonic() - start < 120
    assert text.count("error: logger=mlflow needs mlflow: pip install -e '.[mlflow]'") == 1, text
    # No traceback from our processes (torchrun adds its own report of the failed workers).
    assert f'File "{REPO / "mingpt_ddp"}' not in text and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.cli
def test_profiler_trace_of_a_window_of_steps_on_rank_0(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    text = train(run_dir, small_corpus, "trainer.profile=true", "trainer.profile_steps=[3,6]", "trainer.max_steps=8")
    traces = sorted(p.name for p in (run_dir / "profile").iterdir())
    assert traces == ["rank0.steps3-6.pt.trace.json", "rank0.steps3-6.txt"], traces
    trace = json.loads((run_dir / "profile" / "rank0.steps3-6.pt.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    assert "aten::mm" in names or "aten::addmm" in names
    assert "Self CPU" in (run_dir / "profile" / "rank0.steps3-6.txt").read_text()
    assert "profiler trace of steps 3-6 on rank 0" in text
    bad = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'bad'}", f"data.path={small_corpus}", "trainer.profile=true",
                   "trainer.profile_steps=[5,5]"])
    assert bad.returncode == 2 and "error: trainer.profile_steps=[5, 5] must be [first, last]" in output(bad)


@pytest.mark.cli
def test_wandb_online_without_credentials_is_a_clear_error(tmp_path, small_corpus):
    pytest.importorskip("wandb")
    env = tracked_env(HOME=str(tmp_path / "home"), WANDB_MODE="online")  # no API key, no ~/.netrc
    proc = subprocess_run([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "logger=wandb"], 0, env)
    assert proc.returncode == 2, output(proc)
    assert "error: W&B could not start a run" in output(proc) and "WANDB_MODE=offline" in output(proc)
    assert "Traceback" not in output(proc)
