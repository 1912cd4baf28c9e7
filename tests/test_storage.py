"""Storage without training: secrets kept out of config files and logs, retries and their
limits, the background saver's failure handling, and the snapshot store and data cache on
real S3 servers (moto and SeaweedFS on 127.0.0.1)."""
import errno
import http.client
import logging
import os
import socket
import ssl
import threading
import time
import types
import urllib.error
import uuid

import pytest
import torch
from omegaconf import OmegaConf

from conftest import s3_options
from mingpt_ddp.checkpoint import storage
from mingpt_ddp.corpus.token_cache import ensure_local_copy, local_copy_path
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.checkpoint.snapshot import BackgroundSaver, SnapshotStore, decode, encode
from s3_servers import READER_ACCESS_KEY, READER_SECRET_KEY, SECRET_KEY, free_ports


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 4), float(step))}, "train_state": {"step": step}, "vocab": "ab"}


# ---- secrets ---------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("name", ["key", "secret", "token", "password", "aws_secret_access_key", "session_token",
                                  "account_key", "sas_token", "client_secret", "connection_string", "credentials",
                                  "Authorization", "Proxy-Authorization", "Cookie", "X-Api-Key", "bearer"])
def test_secret_looking_option_names(name):
    assert storage.is_secret_name(name)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["profile", "anon", "endpoint_url", "region_name", "client_kwargs", "requester_pays",
                                  "sse_kms_key_id", "default_block_size", "use_ssl"])
def test_ordinary_option_names(name):
    assert not storage.is_secret_name(name)


@pytest.mark.unit
def test_a_hugging_face_token_is_a_secret_like_the_aws_ones(monkeypatch):
    """docs/data.md: hf:// paths take HF_TOKEN from the environment or a `token` storage
    option from ${oc.env:HF_TOKEN}; a literal one is refused, the environment's is redacted."""
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    cfg = cfg_with(data_options={"token": "hf_literal_token_value"})
    cfg.data.path = "hf://datasets/someone/corpus/input.txt"
    assert storage.literal_secrets(cfg) == [("data.storage_options.token", "hf_literal_token_value")]
    assert storage.literal_secrets(cfg_with(data_options={"token": "${oc.env:HF_TOKEN}"})) == []
    assert "hf_abcdefghijklmnop" not in storage.redact("401 for token hf_abcdefghijklmnop")


def cfg_with(trainer_options=None, data_options=None, snapshot_path=None):
    return OmegaConf.create({
        "trainer": {"storage_options": trainer_options or {}, "snapshot_path": snapshot_path},
        "data": {"storage_options": data_options or {}, "path": "data/x.txt", "download_url": None},
    })


@pytest.mark.unit
def test_literal_secrets_are_found_but_environment_interpolations_and_flags_are_not():
    cfg = cfg_with(
        {"secret": "${oc.env:S3_SECRET}", "key": "${oc.env:S3_KEY}", "anon": False, "profile": "ml",
         "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}},
        {"client_kwargs": {"aws_secret_access_key": "literal-value"}, "token": None},
        snapshot_path="sftp://user:hunter22@host/runs/snapshot.pt",
    )
    found = storage.literal_secrets(cfg)
    assert found == [("data.storage_options.client_kwargs.aws_secret_access_key", "literal-value"),
                     ("trainer.snapshot_path", "hunter22")]


@pytest.mark.unit
def test_a_literal_secret_is_refused_by_name_and_scrubbed_from_hydra_files(tmp_path):
    hydra_dir = tmp_path / ".hydra"
    hydra_dir.mkdir()
    cfg = cfg_with({"secret": SECRET_KEY, "profile": "ml"})
    (hydra_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (hydra_dir / "overrides.yaml").write_text(f"- +trainer.storage_options.secret={SECRET_KEY}\n")
    (hydra_dir / "hydra.yaml").write_text(
        f"hydra:\n  overrides:\n    task:\n    - +trainer.storage_options.secret={SECRET_KEY}\n"
        f"  job:\n    override_dirname: +trainer.storage_options.secret={SECRET_KEY}\n")
    with pytest.raises(ConfigError) as err:
        storage.refuse_literal_secrets(cfg, [str(hydra_dir)])
    assert "trainer.storage_options.secret" in str(err.value) and "${oc.env:" in str(err.value)
    assert SECRET_KEY not in str(err.value)
    for path in hydra_dir.iterdir():
        text = path.read_text()
        assert SECRET_KEY not in text and storage.REDACTED in text, path
    assert OmegaConf.load(hydra_dir / "config.yaml").trainer.storage_options.profile == "ml"


@pytest.mark.unit
def test_stored_config_and_log_lines_have_resolved_secrets_redacted(monkeypatch, caplog):
    monkeypatch.setenv("S3_SECRET_FOR_TEST", "resolved-secret-0123")
    cfg = cfg_with({"secret": "${oc.env:S3_SECRET_FOR_TEST}", "profile": "ml"})
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["trainer"]["storage_options"]["secret"] == "resolved-secret-0123"
    stored = storage.redacted_config(resolved)
    assert stored["trainer"]["storage_options"] == {"secret": storage.REDACTED, "profile": "ml"}

    options = storage.resolve_options(cfg.trainer.storage_options, "trainer.storage_options")
    storage.remember_secrets(storage.secret_option_values(options))
    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    try:
        storage.redact_logs()
        with caplog.at_level(logging.INFO):
            logging.getLogger("mingpt_ddp.test").warning("upload failed: bad secret %s", "resolved-secret-0123")
        assert handler.filters and all(
            "resolved-secret-0123" not in handler.format(r) for r in caplog.records)
    finally:
        logging.getLogger().removeHandler(handler)


@pytest.mark.unit
def test_every_http_header_in_storage_options_is_a_secret(monkeypatch):
    """fsspec's HTTP filesystem sends `headers` with every request: a token may stand under
    any header name. Resolved, each is learnt and redacted where stored; literal, refused."""
    monkeypatch.setenv("AUTH_FOR_TEST", "Bearer header-token-0123")
    monkeypatch.setenv("ID_FOR_TEST", "tenant-id-4567")
    cfg = cfg_with(data_options={"headers": {"Authorization": "${oc.env:AUTH_FOR_TEST}", "X-Tenant": "${oc.env:ID_FOR_TEST}"}})
    assert storage.literal_secrets(cfg) == []
    storage.resolve_secrets(cfg, [])
    text = storage.redact("sent Bearer header-token-0123 and tenant-id-4567")
    assert "header-token-0123" not in text and "tenant-id-4567" not in text, text
    stored = storage.redacted_config(OmegaConf.to_container(cfg, resolve=True))
    assert stored["data"]["storage_options"]["headers"] == {"Authorization": storage.REDACTED, "X-Tenant": storage.REDACTED}
    assert storage.is_secret_option("data.storage_options.headers.X-Tenant")
    literal = cfg_with(data_options={"headers": {"X-Tenant": "tenant-id-4567"}})
    assert storage.literal_secrets(literal) == [("data.storage_options.headers.X-Tenant", "tenant-id-4567")]


@pytest.mark.unit
def test_printed_text_is_redacted_a_line_at_a_time():
    """sys.stdout/sys.stderr go through RedactingStream (main.py's run()): a URL written in
    pieces is redacted whole; the wrapped stream's attributes stay reachable."""
    import io

    out = io.StringIO()
    stream = storage.RedactingStream(out)
    stream.write("reading https://h/c.txt?X-Amz-")
    assert out.getvalue() == ""  # held until the line ends
    stream.write("Signature=SIGdeadbeef012345 failed\nprogress 10%\r")
    stream.write("tail")
    stream.flush()
    assert out.getvalue() == "reading https://h/c.txt?X-Amz-Signature=<redacted> failed\nprogress 10%\rtail"
    assert stream.getvalue() == out.getvalue() and not stream.isatty()


def tracked_cfg(tracking_uri):
    cfg = cfg_with()
    cfg.logger = {"mlflow": {"tracking_uri": tracking_uri, "experiment": "mingpt-ddp"}}
    return cfg


@pytest.mark.unit
def test_a_literal_password_in_any_url_valued_key_is_refused_and_scrubbed(tmp_path):
    """logger.mlflow.tracking_uri is a URL like data.path: its user-info is a credential."""
    hydra_dir = tmp_path / ".hydra"
    hydra_dir.mkdir()
    cfg = tracked_cfg("https://alice:hunter2-tracking@mlflow.example.com")
    (hydra_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (hydra_dir / "overrides.yaml").write_text("- logger.mlflow.tracking_uri=https://alice:hunter2-tracking@mlflow."
                                              "example.com\n")
    with pytest.raises(ConfigError) as err:
        storage.refuse_literal_secrets(cfg, [str(hydra_dir)])
    assert str(err.value).startswith("logger.mlflow.tracking_uri: secrets must not be written into the config")
    assert "hunter2-tracking" not in str(err.value)
    for path in hydra_dir.iterdir():
        assert "hunter2-tracking" not in path.read_text() and "alice:<redacted>@" in path.read_text(), path
    # From the environment by interpolation: allowed (Hydra's files hold the reference).
    assert storage.literal_secrets(tracked_cfg("${oc.env:MY_TRACKING_URI}")) == []
    assert storage.literal_secrets(tracked_cfg("https://alice:${oc.env:MY_PW}@mlflow.example.com")) == []
    assert storage.literal_secrets(tracked_cfg("https://bob@mlflow.example.com")) == [
        ("logger.mlflow.tracking_uri", "bob")]  # an HTTP user name alone is a token


@pytest.mark.unit
def test_resolved_url_credentials_are_redacted_in_the_stored_config_params_and_run_references(
        tmp_path, monkeypatch, caplog):
    from mingpt_ddp import loggers

    monkeypatch.setenv("I22_TRACKING_URI", "https://alice:resolved-pw-0123@mlflow.example.com/")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://carol:env-only-pw-4567@mlflow.example.com/")
    cfg = tracked_cfg("${oc.env:I22_TRACKING_URI}")
    cfg.data.path = "https://h.example.com/corpus.txt?X-Amz-Signature=abcdef0123456789"
    secrets = storage.resolve_secrets(cfg, [])
    stored = secrets.redact_config(OmegaConf.to_container(cfg, resolve=True))
    assert stored["logger"]["mlflow"]["tracking_uri"] == "https://alice:<redacted>@mlflow.example.com/"
    assert stored["data"]["path"] == "https://h.example.com/corpus.txt?X-Amz-Signature=<redacted>"
    params = loggers.flatten(stored)
    assert "resolved-pw-0123" not in str(params) and "abcdef0123456789" not in str(params)
    # The password alone, wherever a library puts it (an error message, a header dump):
    assert storage.redact("auth failed for alice/resolved-pw-0123") == "auth failed for alice/<redacted>"
    assert storage.redact("retrying with env-only-pw-4567") == "retrying with <redacted>"
    with caplog.at_level(logging.INFO):
        logging.getLogger("mlflow.test").info("View run at https://alice:resolved-pw-0123@mlflow.example.com/#/1")
    assert "resolved-pw-0123" not in caplog.text and "alice:<redacted>@" in caplog.text
    # MLflow gets the URI without user-info (it prints and stores what it is given); the
    # credentials go where its client reads basic auth from.
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert loggers._credentials_to_environment("https://alice:p%40ss-word@mlflow.example.com:5000/x") == \
        "https://mlflow.example.com:5000/x"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice" and os.environ["MLFLOW_TRACKING_PASSWORD"] == "p@ss-word"


@pytest.mark.unit
def test_a_presigned_url_typed_on_the_command_line_is_warned_about_naming_oc_env():
    """Redacted everywhere the run shows or stores it, a URL credential typed on the command
    line is still in `ps` for every local user: the warning says so and how to pass it."""
    signature = "9f1c0e6d2b7a4c3e8f5d1a0b6c7e8f9aSIG"
    warning = storage.command_line_warning(
        ["model=gpt-nano", f"data.path='https://h.example.com/c.txt?X-Amz-Expires=60&X-Amz-Signature={signature}'",
         "+data.download_url=https://h.example.com/d.txt?token=tok123456"])
    assert warning.startswith("data.path, data.download_url on the command line holds a URL's credentials"), warning
    assert "any user of this machine can read them with `ps` while the run lasts" in warning
    assert "'data.path=${oc.env:MY_URL}'" in warning and signature not in warning
    for argv in (["data.path=${oc.env:MY_URL}"], ["data.path=https://h.example.com/c.txt?X-Amz-Signature=${oc.env:S}"],
                 ["data.path=s3://bucket/c.txt", "trainer.max_steps=5"], []):
        assert storage.command_line_warning(argv) is None, argv


@pytest.mark.unit
def test_a_wandb_that_cannot_turn_off_its_capture_of_the_command_line_is_refused():
    """W&B records sys.argv as given (a presigned URL's signature included) unless its
    settings turn that off; a wandb without those settings is one error naming the upgrade."""
    from types import SimpleNamespace

    from mingpt_ddp import loggers

    old = SimpleNamespace(__version__="0.15.0", Settings=type("Settings", (), {"model_fields": {"console": None}}))
    with pytest.raises(ConfigError, match=r"x_disable_meta.*would upload the command line.*pip install -U wandb"):
        loggers._wandb_settings(old)
    taken = {}
    new = SimpleNamespace(Settings=type("Settings", (), {"model_fields": dict.fromkeys(loggers.WANDB_CAPTURE_OFF),
                                                          "__init__": lambda self, **kw: taken.update(kw)}))
    loggers._wandb_settings(new)
    assert taken["x_disable_meta"] is True and taken["disable_git"] is True and taken["console"] == "off"


@pytest.mark.unit
def test_the_redacting_filter_never_raises():
    """A malformed log call in any library must not raise into the training loop."""
    handler = logging.StreamHandler()
    handler.addFilter(storage.RedactingFilter())
    logger = logging.getLogger("mingpt_ddp.test.malformed")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("%d items", "not a number")  # logging itself reports it on stderr, no exception
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "%s and %s", ("one",), None)
        assert storage.RedactingFilter().filter(record) is True
    finally:
        logger.removeHandler(handler)


@pytest.mark.unit
def test_urls_are_named_by_their_location_and_listed_children_keep_their_host():
    assert storage.location("https://u:p@h.example.com/a/b.txt?X-Amz-Signature=s#frag") == "https://h.example.com/a/b.txt"
    assert storage.location("sftp://alice:pw@host/data/x.txt") == "sftp://alice@host/data/x.txt"
    assert storage.location("/local/path?.txt") == "/local/path?.txt"

    class Listing:  # the protocol attributes of fsspec's filesystems, no server needed
        def __init__(self, cls):
            self.cls = cls

        def unstrip_protocol(self, name):
            return self.cls.unstrip_protocol(self, name)

    from fsspec.implementations.ftp import FTPFileSystem
    from fsspec.implementations.http import HTTPFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    ftp = Listing(FTPFileSystem)
    ftp.protocol = FTPFileSystem.protocol
    assert storage.child_url("ftp://alice@host:2121/data/*.txt", ftp, "/data/*.txt", "/data/a.txt") == \
        "ftp://alice@host:2121/data/a.txt"  # unstrip_protocol alone gives ftp:///data/a.txt
    url = "http://127.0.0.1:8/data/a.txt?X-Amz-Signature=s"
    assert storage.child_url(url, HTTPFileSystem(), url, url) == url  # not http://http://...
    memory = MemoryFileSystem()
    assert storage.child_url("memory://corpus/", memory, "/corpus", "/corpus/a.txt") == "memory:///corpus/a.txt"
    assert storage.child_url("simplecache::memory://corpus/", memory, "/corpus", "/corpus/a.txt") == \
        "simplecache::memory://corpus/a.txt"  # the chained cache stays


@pytest.mark.unit
def test_an_unset_environment_variable_is_a_config_error():
    cfg = cfg_with({"secret": "${oc.env:MINGPT_SURELY_UNSET_VAR}"})
    with pytest.raises(ConfigError, match="trainer.storage_options"):
        storage.resolve_options(cfg.trainer.storage_options, "trainer.storage_options")


# ---- retries ---------------------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.unit
def test_transient_failures_are_retried_with_backoff_until_the_limit():
    clock, calls = FakeClock(), []

    def down():
        calls.append(clock.now)
        raise ConnectionError("endpoint down")

    with pytest.raises(ConnectionError):
        storage.retry_transient(down, "reading", minutes=1.0, clock=clock, sleep=clock.sleep)
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps == sorted(gaps) and gaps[0] == 0.5 and max(gaps) <= 30  # exponential, capped
    assert calls[-1] <= 60  # never past the limit

    attempts = iter([ConnectionError("blip"), TimeoutError("slow"), "ok"])

    def flaky():
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert storage.retry_transient(flaky, "reading", minutes=1.0, clock=clock, sleep=clock.sleep) == "ok"


@pytest.mark.unit
@pytest.mark.parametrize("error", [FileNotFoundError("no bucket"), PermissionError("denied")])
def test_permanent_failures_are_not_retried(error):
    calls = []

    def fail():
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        storage.retry_transient(fail, "reading", minutes=10.0, sleep=lambda s: None)
    assert len(calls) == 1


def _raised_from(outer: BaseException, cause: BaseException) -> BaseException:
    """`outer` as fsspec's HTTP filesystem raises it: `raise FileNotFoundError(url) from exc`."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise outer from exc
    except BaseException as raised:
        return raised


@pytest.mark.unit
def test_an_outage_is_transient_whatever_wraps_it_and_an_answer_is_not():
    """fsspec's HTTP filesystem turns a refused connection or a 503 into FileNotFoundError
    (issue 29, defect 8): the cause decides; a 404 or 403 stays final, and so does an error
    the project already turned into a ConfigError."""
    aiohttp = pytest.importorskip("aiohttp")

    def answer(status):
        return aiohttp.ClientResponseError(None, (), status=status)

    for cause in (ConnectionRefusedError(111, "Connection refused"), TimeoutError("read timed out"),
                  aiohttp.ServerDisconnectedError(), answer(503), answer(429)):
        wrapped = _raised_from(FileNotFoundError("http://h/x.txt"), cause)
        assert storage.is_transient(wrapped) and storage.network_cause(wrapped) is cause, cause
    for cause in (answer(404), answer(403), ValueError("bad url")):
        assert not storage.is_transient(_raised_from(FileNotFoundError("http://h/x.txt"), cause)), cause
    assert not storage.is_transient(answer(404)) and storage.is_transient(answer(502))
    assert not storage.is_transient(_raised_from(ConfigError("cannot read"), ConnectionRefusedError()))


def _as_urllib_raises(cause) -> BaseException:
    """urllib.request's way: `except OSError as err: raise URLError(err)` (a context)."""
    try:
        try:
            raise cause
        except OSError as err:
            raise urllib.error.URLError(err)
    except urllib.error.URLError as raised:
        return raised


@pytest.mark.unit
def test_an_unknown_host_or_an_untrusted_certificate_is_final_and_a_dns_outage_is_not():
    """urllib wraps every failure before an answer in URLError, aiohttp an unknown host or a
    refused certificate in a ClientConnectionError: the cause decides. A name that does not
    resolve (EAI_NONAME, EAI_NODATA) or a certificate not trusted is a mistake to report at
    once, a temporary DNS failure (EAI_AGAIN), a cut body or a refused connection an outage;
    a mistyped scheme, a URL without a host or a local path is no network failure at all
    (review of issue 29, defect 8). Mid-run, a sharded save still retries the first two."""
    aiohttp = pytest.importorskip("aiohttp")
    from mingpt_ddp.checkpoint.sharded_snapshot import _transient as retried_mid_run
    key = types.SimpleNamespace(host="data-host-typo.invalid", port=443, ssl=True)

    def dns(code, text):
        return socket.gaierror(code, text)

    unknown = dns(socket.EAI_NONAME, "Name or service not known")
    no_address = dns(getattr(socket, "EAI_NODATA", -5), "No address associated with hostname")
    untrusted = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    for lasting in (_as_urllib_raises(unknown), _as_urllib_raises(no_address), _as_urllib_raises(untrusted),
                    _raised_from(FileNotFoundError("https://h/x"), _raised_from(
                        aiohttp.ClientConnectorDNSError(key, unknown), unknown)),
                    aiohttp.ClientConnectorDNSError(key, OSError(None, "Name or service not known")),
                    _raised_from(FileNotFoundError("https://h/x"), _raised_from(
                        aiohttp.ClientConnectorCertificateError(key, untrusted), untrusted))):
        assert not storage.is_transient(lasting) and storage.network_cause(lasting) is None, repr(lasting)
        assert storage.lasting_network_cause(lasting) is not None and retried_mid_run(lasting), repr(lasting)
    again = dns(socket.EAI_AGAIN, "Temporary failure in name resolution")
    for outage in (_as_urllib_raises(again), _raised_from(aiohttp.ClientConnectorDNSError(key, again), again),
                   _as_urllib_raises(ConnectionRefusedError(111, "Connection refused")),
                   _as_urllib_raises(OSError(errno.ENETUNREACH, "Network is unreachable")),
                   http.client.IncompleteRead(b"x" * 10, 90)):
        assert storage.is_transient(outage) and storage.network_cause(outage) is not None, repr(outage)
    for mistake in (urllib.error.URLError("unknown url type: htps"), urllib.error.URLError("no host given"),
                    _as_urllib_raises(FileNotFoundError(2, "No such file or directory"))):
        assert storage.network_cause(mistake) is None, repr(mistake)


# ---- the background saver --------------------------------------------------------------------
class FlakyStore(SnapshotStore):
    """A local store whose saves fail while `down` is set."""

    def __init__(self, path):
        super().__init__(path, keep_last=2)
        self.down = threading.Event()
        self.attempts = 0

    def save(self, blob, step, confirm=None):
        self.attempts += 1
        if self.down.is_set():
            raise ConnectionError(f"Could not connect to the endpoint URL: {self.url}")
        return super().save(blob, step, confirm)


@pytest.mark.unit
def test_saver_retries_a_failed_write_in_the_background_until_it_lands(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(storage, "backoff_delays", lambda first, cap: iter([0.05] * 1000))
    store = FlakyStore(str(tmp_path / "snapshot.pt"))
    saver = BackgroundSaver(store, retry_minutes=5)
    store.down.set()
    with caplog.at_level(logging.WARNING):
        saver.submit(state(7), 7)
        deadline = time.monotonic() + 30
        while store.attempts < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not saver.failed and saver.error is None
        store.down.clear()
        assert saver.wait() is None
    assert decode((tmp_path / "snapshot.pt").read_bytes())["train_state"]["step"] == 7
    assert f"saving snapshot {tmp_path}/snapshot.step000000007.pt failed (ConnectionError: Could not connect" in caplog.text


@pytest.mark.unit
def test_saver_reports_failure_past_the_limit_and_a_success_resets_it(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "backoff_delays", lambda first, cap: iter([0.01] * 100000))
    clock = FakeClock()
    store = FlakyStore(str(tmp_path / "snapshot.pt"))
    saver = BackgroundSaver(store, retry_minutes=1, clock=clock)
    store.down.set()
    saver.submit(state(1), 1)
    while store.attempts < 2:
        time.sleep(0.01)
    assert not saver.failed
    clock.now += 61
    error = saver.wait()
    assert saver.failed and error.startswith(f"saving snapshots to {store.url} has failed for 1.0 minutes")
    assert "trainer.save_retry_minutes=1" in error and "Newest snapshot saved by this run: none" in error
    store.down.clear()
    saver.submit(state(2), 2)
    assert saver.wait() is None and not saver.failed


@pytest.mark.unit
def test_a_newer_snapshot_replaces_one_waiting_to_be_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "backoff_delays", lambda first, cap: iter([3600.0] * 10))
    store = FlakyStore(str(tmp_path / "snapshot.pt"))
    saver = BackgroundSaver(store, retry_minutes=120)
    store.down.set()
    saver.submit(state(1), 1)
    while store.attempts < 1:
        time.sleep(0.01)
    store.down.clear()
    start = time.monotonic()
    saver.submit(state(2), 2)  # does not sit out the hour-long backoff of step 1
    assert saver.wait() is None and time.monotonic() - start < 30
    assert sorted(p.name for p in tmp_path.glob("snapshot*.pt")) == ["snapshot.pt", "snapshot.step000000002.pt"]


# ---- the snapshot store and the data cache on real S3 servers -------------------------------
@pytest.fixture(params=["moto", "seaweedfs"])
def s3(request):
    server = request.getfixturevalue("moto_s3" if request.param == "moto" else "seaweedfs")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    server.make_bucket(bucket)
    return server, bucket


@pytest.mark.s3
def test_s3_store_keeps_last_k_and_finds_the_newest_by_step(s3):
    server, bucket = s3
    store = SnapshotStore(f"s3://{bucket}/runs/exp1/snapshot.pt", keep_last=2, storage_options=s3_options(server))
    store.check_writable()
    for step in (5, 10, 100, 20):  # out of order on purpose: newest means highest step
        store.save(encode(state(step), step), step)
    names = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{bucket}/runs/exp1"))
    assert names == ["snapshot.pt", "snapshot.step000000020.pt", "snapshot.step000000100.pt"]
    loaded, where = store.load_latest()
    assert loaded["train_state"]["step"] == 100 and where == f"s3://{bucket}/runs/exp1/snapshot.step000000100.pt"


@pytest.mark.s3
def test_s3_listing_cache_never_hides_what_another_process_wrote(s3):
    """Two filesystem instances stand for two processes: the reader listed before the
    writer saved, and must still see the new snapshot (fsspec caches listings)."""
    server, bucket = s3
    url = f"s3://{bucket}/run/snapshot.pt"
    writer = SnapshotStore(url, storage_options={**s3_options(server), "skip_instance_cache": True})
    reader = SnapshotStore(url, storage_options={**s3_options(server), "skip_instance_cache": True})
    writer.save(encode(state(1), 1), 1)
    assert reader.load_latest()[0]["train_state"]["step"] == 1
    writer.save(encode(state(2), 2), 2)
    loaded, where = reader.load_latest()
    assert loaded["train_state"]["step"] == 2 and where.endswith("snapshot.step000000002.pt")
    assert [p.rsplit("/", 1)[-1] for p in reader.candidates()] == [
        "snapshot.step000000002.pt", "snapshot.pt", "snapshot.step000000001.pt"]


@pytest.mark.s3
def test_a_truncated_object_is_skipped_on_s3(s3):
    server, bucket = s3
    store = SnapshotStore(f"s3://{bucket}/r/snapshot.pt", keep_last=5, storage_options=s3_options(server))
    for step in (1, 2):
        store.save(encode(state(step), step), step)
    blob = encode(state(3), 3)
    store.fs.pipe_file(f"{bucket}/r/snapshot.step000000003.pt", blob[: len(blob) // 2])
    loaded, where = store.load_latest()
    assert loaded["train_state"]["step"] == 2 and where.endswith("snapshot.step000000002.pt")


@pytest.mark.s3
def test_a_missing_bucket_is_an_error_and_is_not_created(moto_s3):
    options = s3_options(moto_s3)
    store = SnapshotStore("s3://no-such-bucket-mingpt/run/snapshot.pt", storage_options=options)
    with pytest.raises(ConfigError, match="cannot write snapshots to s3://no-such-bucket-mingpt/run/snapshot.pt"
                                          r".*bucket or container does not exist"):
        store.check_writable()
    assert "no-such-bucket-mingpt" not in [b["Name"] for b in moto_s3.client().list_buckets()["Buckets"]]


@pytest.mark.s3
def test_read_only_credentials_fail_the_write_check(seaweedfs):
    bucket = f"ro-{uuid.uuid4().hex[:12]}"
    seaweedfs.make_bucket(bucket)
    options = {**s3_options(seaweedfs), "key": READER_ACCESS_KEY, "secret": READER_SECRET_KEY}
    store = SnapshotStore(f"s3://{bucket}/run/snapshot.pt", storage_options=options)
    with pytest.raises(ConfigError, match="cannot write snapshots.*access denied.*credentials"):
        store.check_writable()
    assert store.load_latest() is None  # but reading works


@pytest.mark.unit
def test_an_unreachable_store_is_a_clear_error_after_bounded_retries():
    port = free_ports(1)[0]  # nothing listens there
    options = {"key": "k", "secret": "s" * 8, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = SnapshotStore("s3://bucket/run/snapshot.pt", storage_options=options, retry_minutes=0.05)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"cannot read snapshots at s3://bucket/run/snapshot.pt "
                                          r"\(EndpointConnectionError.*load_retry_minutes=0.05"):
        store.load_latest()
    assert time.monotonic() - start < 30


@pytest.mark.s3
def test_remote_data_is_copied_to_the_node_cache_once_and_again_when_it_changes(s3, tmp_path, caplog):
    server, bucket = s3
    options = s3_options(server)
    url = f"s3://{bucket}/corpora/text.txt"
    fs, _ = storage.filesystem(url, options)
    fs.pipe_file(f"{bucket}/corpora/text.txt", b"first version\n")
    local = local_copy_path(url, str(tmp_path / "cache"))
    assert local.startswith(str(tmp_path / "cache")) and local.endswith("-text.txt")
    with caplog.at_level(logging.INFO):
        ensure_local_copy(url, None, options, str(tmp_path / "cache"))
        ensure_local_copy(url, None, options, str(tmp_path / "cache"))
    assert open(local).read() == "first version\n"
    assert caplog.text.count("copying to this node's cache") == 1 and "using this node's cached copy" in caplog.text
    fs.pipe_file(f"{bucket}/corpora/text.txt", b"second, longer version\n")
    ensure_local_copy(url, None, options, str(tmp_path / "cache"))
    assert open(local).read() == "second, longer version\n"
    with pytest.raises(ConfigError, match=f"data file not found: s3://{bucket}/corpora/nope.txt"):
        ensure_local_copy(f"s3://{bucket}/corpora/nope.txt", None, options, str(tmp_path / "cache"))
    assert sorted(os.listdir(tmp_path / "cache")) == sorted([os.path.basename(local), os.path.basename(local) + ".source"])


@pytest.mark.unit
def test_every_value_of_a_urls_query_is_redacted_whatever_its_name():
    from mingpt_ddp.checkpoint.storage import redact_url_secrets

    shown = redact_url_secrets("data http://alice:<redacted>@127.0.0.1:8000/input.txt?X-Amz-Signature=<redacted>"
                               "&mytok=PLAINQ&flag: copying; step=5 mytok=kept")
    assert "PLAINQ" not in shown and "mytok=<redacted>&flag:" in shown, shown
    assert "127.0.0.1:8000/input.txt?" in shown and shown.endswith("step=5 mytok=kept"), shown
