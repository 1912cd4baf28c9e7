"""Shared test helpers: the corpus, small corpora, and running the real CLI."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leftovers import pytest_configure, pytest_unconfigure  # noqa: F401  (nothing a run starts outlives it)
from tier_times import (pytest_runtest_logreport, pytest_runtest_teardown, pytest_sessionstart,  # noqa: F401
                        pytest_terminal_summary)  # (time by tier)
import tier_times

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MAIN = str(REPO / "mingpt_ddp" / "main.py")

# Seconds-long runs: a 3-layer, 48-dim model on short windows.
TINY = [
    "model=gpt-nano",
    "data.block_size=32",
    "trainer.batch_size=8",
    "trainer.eval_batches=4",
    "trainer.log_every=5",
    "trainer.eval_every=1000",
    "optimizer.warmup_steps=5",
    "optimizer.lr=3e-3",
    "trainer.precision=fp32",  # the same numerics on every CPU (auto picks bf16 where AMX is)
]


TIERS = tier_times.TIERS  # pyproject.toml describes them; tests/README.md maps them


def pytest_collection_modifyitems(config, items):
    """Every test names its tier, so that `-m unit` stays the whole in-process set."""
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}; see tests/README.md): "
                                + ", ".join(untiered))


CORPUS = REPO / "tests" / "data" / "tinyshakespeare-40k.txt"


def corpus_path() -> Path:
    """The committed 40,000-character slice of tiny-shakespeare (tests/data), or the text
    named by MINGPT_TEST_CORPUS when a run wants another one."""
    override = os.environ.get("MINGPT_TEST_CORPUS")
    return Path(override) if override else CORPUS


@pytest.fixture(autouse=True)
def compile_workers_setting_stays_in_its_test():
    """The trainer sizes inductor's compile workers for its process (TORCHINDUCTOR_COMPILE_THREADS,
    torch._inductor.config.compile_threads) unless a user set them: an in-process test must not
    hand its setting to later tests' children as if a user had made it."""
    before = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    inductor = sys.modules.get("torch._inductor.config")
    threads = inductor.compile_threads if inductor is not None else None
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    else:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = before
    if inductor is not None:
        inductor.compile_threads = threads


@pytest.fixture(scope="session", autouse=True)
def token_cache_dir(tmp_path_factory) -> Path:
    """Runs that set no data.cache_dir keep their token files here, not in ~/.cache."""
    os.environ.setdefault("MINGPT_DDP_CACHE", str(tmp_path_factory.mktemp("token-cache")))
    return Path(os.environ["MINGPT_DDP_CACHE"])


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return corpus_path()


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, shakespeare) -> Path:
    """The first 40,000 characters: a few seconds per epoch for gpt-nano."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(shakespeare.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return path


def run_cli(args: list[str], nproc: int = 0, cwd: Path = REPO, env: dict | None = None, timeout: float = 300,
            torchrun_args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run main.py alone (nproc=0) or under torchrun with `nproc` gloo workers."""
    if nproc:
        cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *(torchrun_args or []), MAIN, *args]
    else:
        cmd = [PYTHON, MAIN, *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR")
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def serving(directory: Path):
    """A real HTTP server on 127.0.0.1 serving `directory` (python -m http.server, a process
    of its own), up before the block runs; yields its base URL."""
    import socket
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base + "/", timeout=1).read(1)
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the HTTP server on {base} did not come up")
                time.sleep(0.05)
        yield base
    finally:
        server.terminate()
        server.wait()


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_snapshot(path: Path) -> dict:
    from mingpt_ddp.checkpoint.snapshot import decode

    return decode(path.read_bytes(), str(path))


# ---- S3 servers on 127.0.0.1 (tests/s3_servers.py), one of each per session ----------------
@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """SeaweedFS's S3 gateway; a test that stops it must start it again (same ports, same data)."""
    from s3_servers import SeaweedFS

    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    from s3_servers import MotoServer

    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    try:
        yield server
    finally:
        server.stop()


def s3_env(server, **extra) -> dict:
    """Environment for a child process that talks to `server` only: its endpoint and test
    credentials, botocore retrying briefly (our own retries are what is tested), no profile
    files and no instance-metadata lookups."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env, AWS_RETRY_MODE="standard", AWS_MAX_ATTEMPTS="2", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def s3_options(server) -> dict:
    """fsspec storage options for in-process tests (no environment needed)."""
    from s3_servers import ACCESS_KEY, SECRET_KEY

    return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": server.endpoint,
                                                                       "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
