"""What snapshots and data share about storage: fsspec filesystems built with storage
options, bounded retries of transient failures, and keeping secrets out of everything a
run writes.

Secrets cross one boundary, the process's `Secrets` (SECRETS), which main() fills once per
run with resolve_secrets(). Credentials come from the standard chain of the backend (for
S3: the ``AWS_*`` environment, a profile, an instance role). A storage option that looks
like a secret (``key``, ``secret``, ``token``, ``password``, ...) or the user-info of a URL
in any key (``https://user:pw@host``) may only be given as an ``${oc.env:VAR}``
interpolation: Hydra writes ``.hydra/config.yaml`` from the unresolved config before any
of our code runs, so only the interpolation's text lands there. A literal one is refused
(ConfigError) and rank 0 scrubs it from the ``.hydra/`` files Hydra already wrote.
Credentials in URL query strings (presigned URLs) may be literal (typed on the command
line, they are in `ps` for every local user: the run warns, command_line_warning). Every resolved secret,
and those in the URLs of the environment the run reads (MLFLOW_TRACKING_URI, ...), are
redacted from log records, Hydra's files, the config stored in snapshots and sent to
trackers, tracker run references and error messages.
"""
from __future__ import annotations

import errno
import http.client
import logging
import os
import re
import socket
import ssl
import sys
import threading
import time
import uuid
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Optional, TypeVar
from urllib.parse import unquote

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

REDACTED = "<redacted>"
# Option names that carry credentials in s3fs, gcsfs, adlfs, ocifs, sshfs, ..., and HTTP
# header names that do (Authorization, Cookie, X-Api-Key, ...).
_SECRET_NAME = re.compile(
    r"^(key|secret|token|password|passwd|credentials?|sas|signature)$"
    r"|secret|token|passw|credential|private_key|account_key|access_key|api[-_]?key|connection_string|sas_"
    r"|authorization|cookie|bearer",
    re.IGNORECASE,
)
# Every value under a storage option of this name is secret, whatever its own name: HTTP
# headers (fsspec's HTTP filesystem sends them with every request) carry tokens under any name.
_SECRET_PARENT = "headers"
# Errors that retrying cannot fix: a wrong name, missing permission, missing credentials.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ConfigError,
              ValueError, TypeError, KeyError)
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "ParamValidationError", "ProfileNotFound",
                    "InvalidConfigError", "NoRegionError", "UnknownSignatureVersionError"}


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(str(name)))


def is_secret_option(dotted_key: str) -> bool:
    """Whether the storage option at `dotted_key` (``data.storage_options.headers.X-Id``)
    holds a secret: its name looks like one, or it is under ``headers``."""
    parts = str(dotted_key).split(".")
    return is_secret_name(parts[-1]) or any(p.lower() == _SECRET_PARENT for p in parts[:-1])


# ---- storage options and filesystems ---------------------------------------------------
def resolve_options(node: Any, where: str) -> dict[str, Any]:
    """A storage_options config node as a plain dict, ``${oc.env:VAR}`` resolved."""
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        return dict(node)
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{where}: {str(exc).splitlines()[0]}") from None


def filesystem(url: str, options: Optional[Mapping[str, Any]] = None):
    """(filesystem, path inside it) for a local path or any fsspec URL."""
    try:
        return fsspec.core.url_to_fs(url, **dict(options or {}))
    except ImportError as exc:
        scheme = url.split("://", 1)[0]
        # Only the backend: `pip install -e '.[s3]'` would also re-resolve torch (in an image, replace it).
        hint = (f"{sys.executable} -m pip install 's3fs>=2024.12' 'aiobotocore>=2.16'" if scheme in ("s3", "s3a")
                else f"install the fsspec backend for {scheme}://")
        if scheme in ("http", "https"):
            hint = f"{sys.executable} -m pip install aiohttp (the http extra), which fsspec's HTTP filesystem needs"
        if scheme == "hf":
            hint = f"{sys.executable} -m pip install huggingface_hub (its HfFileSystem reads hf:// paths)"
        raise ConfigError(f"cannot open {redact(url)}: {exc}: {hint}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot open {redact(url)} with the given storage_options: {redact(str(exc))}") from None


def is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


def is_http(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"http", "https"}.intersection(protocols))


def location(url: str) -> str:
    """What a URL names, without what only authorises reading it: no password (or, for
    HTTP, no user-info at all), query or fragment. Keys and names cache entries, so that
    a presigned URL signed anew, or other credentials, still find the same copy."""
    if "://" not in url:
        return url
    url = _USERINFO.sub(lambda m: f"{m['scheme']}{'' if _is_http_scheme(m['scheme']) else m['user'] + '@'}", url)
    return url.split("#", 1)[0].split("?", 1)[0]


def child_url(url: str, fs, root: str, name: str) -> str:
    """The URL of `name`, a path that `fs` (opened from `url`, whose path in it is `root`)
    listed: the filesystem's own unstrip_protocol, unless that drops part of what came
    before the path in `url` (the host of sftp:// or ftp://, which lives in the filesystem
    object; a chained cache:: prefix), in which case that part is put back."""
    unstripped = fs.unstrip_protocol(name)
    base, root = url.rstrip("/"), root.rstrip("/")
    head = base[:len(base) - len(root)] if root and base.endswith(root) else ""
    if head and not unstripped.startswith(head):
        return head + name
    return unstripped


# Flat key/value stores: an object appears whole with one PUT, "rename" is copy + delete,
# directories are only key prefixes, and makedirs on a bucket path would create the bucket.
OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "r2", "cos", "tos"}


def is_object_store(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(OBJECT_STORE_PROTOCOLS.intersection(protocols))


def is_s3(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"s3", "s3a"}.intersection(protocols)) and hasattr(fs, "call_s3")


# ---- conditional writes on S3 (the run lease, run_lock.py) ------------------------------------
def s3_put_parameters() -> set[str]:
    """The PutObject parameters the installed botocore can send. If-None-Match and If-Match
    came with botocore 1.35.74 (aiobotocore 2.16); an older one cannot send them."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("s3")
    return set(model.operation_model("PutObject").input_shape.members)


def s3_read(fs, path: str) -> tuple[Optional[bytes], Optional[str]]:
    """An object's bytes and the ETag of exactly those bytes (one GET); (None, None) if absent."""
    bucket, key, _ = fs.split_path(path)

    async def get() -> tuple[bytes, str]:
        reply = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = reply["Body"]
        try:
            return await body.read(), reply["ETag"]
        finally:
            body.close()

    try:
        return fsspec.asyn.sync(fs.loop, get)
    except FileNotFoundError:
        return None, None


def s3_put_if(fs, path: str, data: bytes, if_match: Optional[str] = None) -> Optional[str]:
    """PUT `data` only if the object is absent (``If-None-Match: *``) or, given `if_match`,
    still has that ETag (``If-Match``). Its new ETag, or None when the condition failed: the
    server's 412, AWS's 409 for a concurrent conditional write, or (If-Match) no object."""
    bucket, key, _ = fs.split_path(path)
    condition = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
    try:
        return fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
    except FileExistsError:  # s3fs's name for a 412 that names If-None-Match
        return None
    except FileNotFoundError:
        if if_match:
            return None
        raise
    except OSError as exc:
        status = getattr(exc.__cause__, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (409, 412):
            return None
        raise


# ---- retries ----------------------------------------------------------------------------
# Failures to reach a server, by class name (aiohttp's and fsspec's, without importing them).
_NETWORK_NAMES = {"ClientConnectionError", "ClientPayloadError", "FSTimeoutError"}
# A network down or a route missing for a moment: plain OSErrors, not ConnectionErrors.
_NETWORK_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN}
# TLS failures that are a connection cut during the handshake, not a certificate refused.
_TLS_DROPS = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)
# Failures to reach a server that no wait mends, by class name (aiohttp's): an untrusted
# certificate, a TLS handshake the server refuses.
_LASTING_NAMES = {"ClientSSLError", "ClientConnectorCertificateError"}


def _chain(exc: Optional[BaseException]) -> Iterable[BaseException]:
    """`exc` and the exceptions behind it (causes, else contexts), outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _lasting(exc: BaseException) -> bool:
    if isinstance(exc, socket.gaierror):  # a host name that does not exist; EAI_AGAIN is a DNS outage
        return exc.errno != socket.EAI_AGAIN
    if isinstance(exc, ssl.SSLError):
        return not isinstance(exc, _TLS_DROPS)
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & _LASTING_NAMES) or ("ClientConnectorDNSError" in names and (
        "not known" in str(exc) or "No address associated" in str(exc)))


def lasting_network_cause(exc: BaseException) -> Optional[BaseException]:
    """The failure behind `exc` that retrying cannot mend, if there is one: an unknown host
    name (a typo in the URL) or a certificate this machine does not trust. The network
    answered; the input or the trust store needs fixing."""
    return next((link for link in _chain(exc) if _lasting(link)), None)


def _unreachable(exc: BaseException) -> bool:
    status = getattr(exc, "status", None)
    return (isinstance(exc, (ConnectionError, TimeoutError, http.client.IncompleteRead))
            or (isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN)
            or (isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS)
            or any(cls.__name__ in _NETWORK_NAMES for cls in type(exc).__mro__)
            or (isinstance(status, int) and (status >= 500 or status in (408, 429))))


def network_cause(exc: BaseException) -> Optional[BaseException]:
    """The failure to reach the server behind `exc`, if there is one: a refused, reset or
    cut connection (a body shorter than announced), a timeout, a temporary DNS failure,
    throttling or a 5xx answer anywhere in its chain of causes, and nothing that no wait
    mends (lasting_network_cause) behind it. fsspec's HTTP filesystem raises
    FileNotFoundError for any failed HEAD/GET, a refused connection included (with the
    real error as its cause), and urllib URLError for every failure before an answer, a
    mistyped scheme or path included: the cause decides."""
    if lasting_network_cause(exc) is not None:
        return None
    return next((link for link in _chain(exc) if _unreachable(link)), None)


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection failures, timeouts, throttling, 5xx, whatever exception
    wraps them. Not worth it: a missing bucket or file, access denied, missing credentials,
    bad options, an unknown host, an untrusted certificate, and what the project has
    already turned into a user-facing error."""
    if isinstance(exc, ConfigError) or lasting_network_cause(exc) is not None:
        return False
    if network_cause(exc) is not None:
        return True
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 400 <= status < 500:  # an answer (not found, refused), not an outage
        return False
    if isinstance(exc, _PERMANENT):
        return False
    return not any(cls.__name__ in _PERMANENT_NAMES for cls in type(exc).__mro__)


def describe(exc: BaseException) -> str:
    """One line for a log or an error message, with any known secret redacted."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return redact(f"{type(exc).__name__}: {text[:500]}" if text else type(exc).__name__)


def backoff_delays(first: float = 0.5, cap: float = 30.0) -> Iterable[float]:
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * 2)


def retry_transient(fn: Callable[[], T], what: str, minutes: float, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep,
                    transient: Callable[[BaseException], bool] = is_transient) -> T:
    """Call `fn`; retry transient failures with exponential backoff for up to `minutes`,
    logging each with `what` and the error. Permanent failures are raised at once; past the
    limit, the last error is raised as it is (the caller turns it into a ConfigError)."""
    start = clock()
    for delay in backoff_delays():
        try:
            return fn()
        except Exception as exc:
            elapsed = clock() - start
            if not transient(exc) or elapsed + delay > 60 * minutes:
                raise
            log.warning("%s failed (%s); retrying in %.1fs (%.0fs of %.1f min so far)",
                        what, describe(network_cause(exc) or exc), delay, elapsed, minutes)
            sleep(delay)
    raise AssertionError("unreachable")


# ---- local files ---------------------------------------------------------------------------
def write_local_atomically(path: str, write: Callable[[BinaryIO], None],
                           before_replace: Optional[Callable[[], None]] = None) -> None:
    """`path` appears whole or not at all: `write` fills a temp file in the same directory (a
    rename never crosses filesystems), then fsync, os.replace, and fsync of the directory so
    that a power loss cannot undo the rename. The file gets the usual permissions (umask).
    `before_replace` may still stop it (by raising) once the file is written: nothing appears."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make a rename durable: without this a power loss can undo it on some filesystems."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- secrets ------------------------------------------------------------------------------
# Environment variables whose values are never shown: the AWS chain's and the trackers' secrets.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "MLFLOW_TRACKING_PASSWORD",
               "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Environment variables holding URLs the run (or a library it calls) uses: their credentials are secrets.
_URL_ENV = ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "WANDB_BASE_URL",
            "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
# Shorter values are redacted only where they stand in a URL (else "pw" would vanish from every word).
_MIN_SECRET_LENGTH = 6
# A URL's user-info: scheme://user:password@ (or scheme://user@, which for HTTP is a token).
_USERINFO = re.compile(
    r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^\s/?#@:'\"<>]*)(?::(?P<password>[^\s/?#@'\"<>]*))?@")
# Query parameters of URLs that carry credentials: presigned S3 (X-Amz-Signature,
# X-Amz-Credential, X-Amz-Security-Token), GCS (X-Goog-Signature), Azure SAS (sig),
# and the usual token / key / password parameters.
_URL_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;](?:[\w.\-]*(?:signature|credential|token|secret|passw|api[_\-]?key|access[_\-]?key)[\w.\-]*"
    r"|sig|key|code|auth|password))=(?P<value>[^&#;\s'\"<>]+)",
    re.IGNORECASE,
)

# The query of a URL: every value in it is shown and stored redacted (a presigned URL's
# token may have any name), the names kept.
_URL_QUERY = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://(?:<redacted>|[^\s?#'\"<>])*\?)(?P<query>(?:<redacted>|[^\s#'\"<>])+)")
_QUERY_VALUE = re.compile(r"(?P<name>(?:^|[&;])[^=&;]*)=(?P<value>[^&;]*)")


def _redact_query(m: re.Match) -> str:
    query = _QUERY_VALUE.sub(lambda v: f"{v['name']}={REDACTED}" if v["value"] else v[0], m["query"])
    return m["head"] + query


def _is_http_scheme(scheme: str) -> bool:
    return scheme.lower().rstrip(":/").rsplit("::", 1)[-1] in ("http", "https")


def _userinfo_secret(m: re.Match) -> Optional[str]:
    """The credential in a user-info match: the password, or a lone HTTP user name (a token)."""
    if m["password"] is not None:
        return m["password"]
    if m["user"] and _is_http_scheme(m["scheme"]):
        return m["user"]
    return None


def url_credentials(text: str) -> list[str]:
    """The credentials in the URLs of `text`: user-info passwords (an HTTP user-info
    whole) and the values of credential query parameters, as written and URL-decoded."""
    if "://" not in text and "=" not in text:
        return []
    found = [_userinfo_secret(m) for m in _USERINFO.finditer(text)]
    found += [m["value"] for m in _URL_SECRET_PARAM.finditer(text)]
    values = [v for v in found if v and v != REDACTED]
    return values + [unquote(v) for v in values if unquote(v) != v]


def redact_url_secrets(text: str) -> str:
    """`text` with the credentials of its URLs replaced: user-info passwords (an HTTP
    user-info whole), every value of a URL's query, and the values of credential-carrying
    parameters elsewhere (a presigned URL or a ``?token=`` is used to read, never shown or
    stored)."""
    if "://" in text:
        text = _URL_QUERY.sub(_redact_query, text)
        def userinfo(m: re.Match) -> str:
            secret = _userinfo_secret(m)
            if not secret or secret == REDACTED:
                return m[0]
            return f"{m['scheme']}{m['user']}:{REDACTED}@" if m["password"] is not None else f"{m['scheme']}{REDACTED}@"

        text = _USERINFO.sub(userinfo, text)
    if "=" in text:
        text = _URL_SECRET_PARAM.sub(lambda m: f"{m['name']}={REDACTED}" if m["value"] != REDACTED else m[0], text)
    return text


def command_line_warning(argv: Iterable[str]) -> Optional[str]:
    """The warning for overrides whose URLs carry credentials as typed (a presigned URL's
    query): redacted wherever the run shows or stores them, but any local user reads a
    process's command line (`ps`, /proc) while it runs, unlike its environment. None when
    there are none (an ``${oc.env:VAR}`` puts only the reference on the command line)."""
    keys = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        typed = re.sub(r"\$\{[^}]*\}", "", value)  # what an interpolation resolves to is not on the command line
        if sep and redact_url_secrets(typed) != typed:
            keys.append(key.lstrip("+~"))
    if not keys:
        return None
    keys = list(dict.fromkeys(keys))
    return (f"{', '.join(keys)} on the command line holds a URL's credentials (a presigned URL's query): they are "
            "shown and stored only as <redacted>, but any user of this machine can read them with `ps` while the "
            f"run lasts. Pass the URL from the environment instead: '{keys[0]}=${{oc.env:MY_URL}}' with MY_URL "
            "exported (see docs/storage.md)")


class Secrets:
    """What this process must never show or store. main() resolves it once, from the config
    and the environment (resolve_secrets); everything that shows or stores text goes
    through it: log records (redact_logs), the YAML files Hydra wrote, the config kept in
    snapshots and sent to trackers (redact_config), tracker run references, error lines."""

    def __init__(self) -> None:
        self.values: set[str] = set()

    def add(self, values: Iterable[Any]) -> None:
        for value in values:
            if isinstance(value, str) and len(value) >= _MIN_SECRET_LENGTH:
                self.values.add(value)

    def redact(self, text: str) -> str:
        """`text` with every known secret, every secret of the environment and every URL
        credential replaced by <redacted>."""
        environment = [os.environ.get(name) or "" for name in _SECRET_ENV]
        environment += [v for name in _URL_ENV for v in url_credentials(os.environ.get(name) or "")]
        for secret in sorted({*self.values, *(v for v in environment if len(v) >= _MIN_SECRET_LENGTH)},
                             key=len, reverse=True):
            text = text.replace(secret, REDACTED)
        return redact_url_secrets(text)

    def redact_config(self, container: Any) -> Any:
        """A resolved config (plain containers) as it may be stored or sent: secret-looking
        storage options replaced, every string redacted."""
        if isinstance(container, dict):
            return {key: _redact_options(value) if key == "storage_options" else self.redact_config(value)
                    for key, value in container.items()}
        if isinstance(container, list):
            return [self.redact_config(v) for v in container]
        if isinstance(container, str):
            return self.redact(container)
        return container

    def scrub_files(self, directories: Iterable[str]) -> None:
        """Redact the YAML files Hydra wrote into `directories` (.hydra/config.yaml,
        overrides.yaml, hydra.yaml; a sweep's multirun.yaml), in place."""
        import yaml

        def clean(value: Any) -> Any:
            if isinstance(value, str):
                return self.redact(value)
            if isinstance(value, dict):
                return {clean(k): clean(v) for k, v in value.items()}
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value

        def rewrite(text: str) -> str:
            if self.redact(text) == text:
                return text
            return yaml.safe_dump(clean(yaml.safe_load(text)), sort_keys=False, allow_unicode=True)

        for directory in directories:
            _rewrite_yaml_files(directory, rewrite)


SECRETS = Secrets()  # this process's; a sweep's points add theirs


def remember_secrets(values: Iterable[Any]) -> None:
    """Values to redact wherever this process shows or stores text."""
    SECRETS.add(values)


def redact(text: str) -> str:
    return SECRETS.redact(text)


def redacted_config(container: Any) -> Any:
    return SECRETS.redact_config(container)


def resolve_secrets(cfg: DictConfig, hydra_dirs: Iterable[str]) -> Secrets:
    """The one way secrets come in, at the start of every run: refuse those written
    literally into the config (after removing them from the files Hydra already wrote),
    learn every resolved one (secret-looking storage options, the credentials of every
    URL-valued key, of the URLs in the environment the run reads), redact Hydra's files and
    every log record from then on. Returns the process's Secrets."""
    hydra_dirs = list(hydra_dirs)
    redact_logs()
    refuse_literal_secrets(cfg, hydra_dirs)
    for key, value in _leaves(cfg, ""):
        if ".storage_options." in f"{key}." and is_secret_option(key.split(".storage_options.", 1)[-1]):
            SECRETS.add([value])
        if isinstance(value, str):
            SECRETS.add(url_credentials(value))
    SECRETS.scrub_files(hydra_dirs)
    return SECRETS


def _leaves(node: Any, path: str) -> Iterable[tuple[str, Any]]:
    """(dotted key, resolved value) of every leaf of a config; one that cannot be resolved
    is skipped (its key reports that itself, where it is used)."""
    if isinstance(node, DictConfig):
        items = [(f"{path}.{k}" if path else str(k), k) for k in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(f"{path}[{i}]", i) for i in range(len(node))]
    else:
        yield path, node
        return
    for key, index in items:
        try:
            value = node[index]
        except OmegaConfBaseException:
            continue
        yield from _leaves(value, key)


def _rewrite_yaml_files(directory: str, rewrite: Callable[[str], str]) -> None:
    """Apply `rewrite` to the text of each YAML file in `directory`, replacing a file (atomically)
    only when its text changes."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".yaml") or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        cleaned = rewrite(text)
        if cleaned == text:
            continue
        tmp = f"{path}.redacting-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(cleaned)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _secret_leaves(value: Any, path: str, secret: bool = False) -> Iterable[tuple[str, Any]]:
    """(dotted key, value) of every secret-looking entry in a nested mapping of storage
    options (`secret`: everything below is, as under ``headers``)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if (secret or is_secret_name(k)) and not isinstance(v, Mapping):
                yield f"{path}.{k}", v
            else:
                yield from _secret_leaves(v, f"{path}.{k}", secret or str(k).lower() == _SECRET_PARENT)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _secret_leaves(v, f"{path}[{i}]", secret)
    elif secret and path:
        yield path, value


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.strip().startswith("${")


def literal_secrets(cfg: DictConfig) -> list[tuple[str, str]]:
    """(config key, value) of secrets written literally into the config: secret-looking
    storage options that are not ``${oc.env:...}`` interpolations, and the user-info
    credentials of a URL in any key (an interpolated password, ``https://u:${oc.env:PW}@h``,
    is not literal). Credential query values may be literal: they are redacted instead."""
    found = []
    for group in ("trainer", "data"):
        options = cfg[group].get("storage_options") if group in cfg else None
        if options is None:
            continue
        raw = OmegaConf.to_container(options, resolve=False)
        for key, value in _secret_leaves(raw, f"{group}.storage_options"):
            is_interpolation = isinstance(value, str) and re.fullmatch(r"\$\{oc\.env:[^}]+\}", value.strip())
            if value not in (None, "", False, True) and not is_interpolation:
                found.append((key, str(value)))
    for key, value in _raw_leaves(OmegaConf.to_container(cfg, resolve=False), ""):
        if isinstance(value, str) and "://" in value and not _is_interpolation(value):
            for m in _USERINFO.finditer(value):
                secret = _userinfo_secret(m)
                if secret and "${" not in secret and secret != REDACTED:
                    found.append((key, secret))
    return found


def _raw_leaves(value: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _raw_leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _raw_leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def refuse_literal_secrets(cfg: DictConfig, hydra_dirs: Iterable[str]) -> None:
    """Raise a ConfigError naming (never showing) each literal secret, after removing them
    from the YAML files Hydra wrote into `hydra_dirs` before we ran."""
    found = literal_secrets(cfg)
    if not found:
        return
    SECRETS.add(value for _, value in found)
    SECRETS.scrub_files(hydra_dirs)
    keys = ", ".join(dict.fromkeys(key for key, _ in found))
    raise ConfigError(
        f"{keys}: secrets must not be written into the config (Hydra saves it to .hydra/config.yaml and the "
        "snapshot stores it). Use the standard credential chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE, an instance role; MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD), or pass the value "
        "from the environment, e.g. '+trainer.storage_options.secret=${oc.env:MY_SECRET}' or "
        "'logger.mlflow.tracking_uri=${oc.env:MY_TRACKING_URI}'"
    )


def _redact_options(value: Any, secret: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if (secret or is_secret_name(k)) and not isinstance(v, (dict, list))
                and v not in (None, True, False)
                else _redact_options(v, secret or str(k).lower() == _SECRET_PARENT) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_options(v, secret) for v in value]
    if secret and value not in (None, True, False):
        return REDACTED
    return SECRETS.redact(value) if isinstance(value, str) else value


def secret_option_values(options: Mapping[str, Any]) -> list[Any]:
    """The resolved values of secret-looking options (to redact them from logs)."""
    return [v for _, v in _secret_leaves(dict(options), "")]


def _redact_record(record: logging.LogRecord) -> None:
    """Redact a record's message (and its traceback) in place; a record whose message
    cannot be formatted (a malformed log call anywhere) is left for logging to report."""
    try:
        message = record.getMessage()
    except Exception:
        return
    cleaned = redact(message)
    if cleaned != message:
        record.msg, record.args = cleaned, ()
    if record.exc_info and not record.exc_text:
        try:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        except Exception:
            pass


class RedactingFilter(logging.Filter):
    """Removes known secrets from every record a handler emits. Never raises: a filter
    that raised would turn one malformed log call in any library into an exception in the
    training loop."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            _redact_record(record)
        except Exception:
            pass
        return True


def redact_logs() -> None:
    """Install the redacting filter on every handler of the root logger (Hydra's console
    and main.log handlers), and redact every record as it is made (Hydra's own lines and
    libraries with handlers of their own too, whatever handlers are configured later)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "redacts", False):
        def make_record(*args, **kwargs) -> logging.LogRecord:
            record = factory(*args, **kwargs)
            try:
                _redact_record(record)
            except Exception:
                pass
            return record

        make_record.redacts = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(make_record)


class RedactingStream:
    """sys.stdout/sys.stderr through redact(): what any code prints (a bug's traceback,
    Hydra's "Error executing job with overrides: [...]", a library's message) shows no
    secret. Text is held until a line ends (``\\n``, or ``\\r`` for progress bars) or a
    flush, so a secret written in pieces is still whole when redacted; everything else
    (isatty, fileno, encoding, buffer) is the wrapped stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            end = max(self._pending.rfind("\n"), self._pending.rfind("\r"))
            if end >= 0:
                ready, self._pending = self._pending[:end + 1], self._pending[end + 1:]
                self._stream.write(_redact_output(ready))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                ready, self._pending = self._pending, ""
                self._stream.write(_redact_output(ready))
        self._stream.flush()

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _redact_output(text: str) -> str:
    """Printed text redacted; never raises (a print must not fail on redaction)."""
    try:
        return redact(text)
    except Exception:
        return text


def redact_output() -> None:
    """Route this process's sys.stdout and sys.stderr through RedactingStream (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))


def redact_error_file() -> None:
    """Redact this worker's torchelastic error file (TORCHELASTIC_ERROR_FILE) in place: for
    a bug, torch's @record writes the exception's message and traceback there as they were,
    and torchrun's failure summary prints it."""
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            text = f.read()
        data = json.loads(text)
    except (OSError, ValueError):
        return

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return _redact_output(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    cleaned = clean(data)
    if cleaned != data:
        try:
            write_local_atomically(path, lambda f: f.write(json.dumps(cleaned).encode()))
        except OSError:
            pass
