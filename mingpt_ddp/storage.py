"""What snapshots and data share about storage: fsspec filesystems built with storage
options, bounded retries of transient failures, and keeping secrets out of everything a
run writes.

Secrets policy: credentials come from the standard chain of the backend (for S3: the
``AWS_*`` environment, a profile, an instance role). A storage option that looks like a
secret (``key``, ``secret``, ``token``, ``password``, ...) may only be given as an
``${oc.env:VAR}`` interpolation: Hydra writes ``.hydra/config.yaml`` from the unresolved
config before any of our code runs, so only the interpolation's text lands there. A
literal secret is refused (ConfigError) and rank 0 scrubs it from the ``.hydra/`` files
Hydra already wrote. Resolved secrets are redacted from the config stored in snapshots
and from log lines.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
import uuid
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Optional, TypeVar
from urllib.parse import urlsplit

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

REDACTED = "<redacted>"
# Option names that carry credentials in s3fs, gcsfs, adlfs, ocifs, sshfs, ...
_SECRET_NAME = re.compile(
    r"^(key|secret|token|password|passwd|credentials?|sas|signature)$"
    r"|secret|token|passw|credential|private_key|account_key|access_key|api_key|connection_string|sas_",
    re.IGNORECASE,
)
# Environment variables whose values must never be logged (the AWS chain's secrets).
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
# Errors that retrying cannot fix: a wrong name, missing permission, missing credentials.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ConfigError,
              ValueError, TypeError, KeyError)
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "ParamValidationError", "ProfileNotFound",
                    "InvalidConfigError", "NoRegionError", "UnknownSignatureVersionError"}


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(str(name)))


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
        raise ConfigError(f"cannot open {url}: {exc}: {hint}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot open {url} with the given storage_options: {redact(str(exc))}") from None


def is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


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
def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection failures, timeouts, throttling, 5xx. Not worth it: a
    missing bucket or file, access denied, missing credentials, bad options."""
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
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """Call `fn`; retry transient failures with exponential backoff for up to `minutes`,
    logging each with `what` and the error. Permanent failures are raised at once; past the
    limit, the last error is raised as it is (the caller turns it into a ConfigError)."""
    start = clock()
    for delay in backoff_delays():
        try:
            return fn()
        except Exception as exc:
            elapsed = clock() - start
            if not is_transient(exc) or elapsed + delay > 60 * minutes:
                raise
            log.warning("%s failed (%s); retrying in %.1fs (%.0fs of %.1f min so far)",
                        what, describe(exc), delay, elapsed, minutes)
            sleep(delay)
    raise AssertionError("unreachable")


# ---- secrets ------------------------------------------------------------------------------
_known_secrets: set[str] = set()


def remember_secrets(values: Iterable[Any]) -> None:
    """Values to redact wherever this process logs or reports an error."""
    for value in values:
        if isinstance(value, str) and len(value) >= 6:
            _known_secrets.add(value)


def _secret_env_values() -> list[str]:
    return [os.environ[name] for name in _SECRET_ENV if os.environ.get(name)]


def redact(text: str) -> str:
    for secret in sorted({*_known_secrets, *[v for v in _secret_env_values() if len(v) >= 6]}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return redact_url_secrets(text)


# Query parameters of URLs that carry credentials: presigned S3 (X-Amz-Signature,
# X-Amz-Credential, X-Amz-Security-Token), GCS (X-Goog-Signature), Azure SAS (sig),
# and the usual token / key / password parameters.
_URL_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;](?:[\w.\-]*(?:signature|credential|token|secret|passw|api[_\-]?key|access[_\-]?key)[\w.\-]*"
    r"|sig|key|code|auth|password))=(?P<value>[^&#;\s'\"<>]+)",
    re.IGNORECASE,
)


def redact_url_secrets(text: str) -> str:
    """`text` with the values of credential-carrying URL query parameters replaced: a
    presigned URL or a ``?token=`` in data.path is used to read, never shown or stored."""
    if "=" not in text:
        return text
    return _URL_SECRET_PARAM.sub(lambda m: f"{m['name']}={REDACTED}" if m["value"] != REDACTED else m[0], text)


def scrub_url_secrets(directories: Iterable[str]) -> None:
    """Redact URL query secrets from the YAML files Hydra wrote into `directories`
    (.hydra/config.yaml, overrides.yaml, hydra.yaml; a sweep's multirun.yaml)."""
    for directory in directories:
        _rewrite_yaml_files(directory, redact_url_secrets)


def write_local_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """`path` appears whole or not at all: `write` fills a temp file in the same directory (a
    rename never crosses filesystems), then fsync, os.replace, and fsync of the directory so
    that a power loss cannot undo the rename. The file gets the usual permissions (umask)."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
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


def _secret_leaves(value: Any, path: str) -> Iterable[tuple[str, Any]]:
    """(dotted key, value) of every secret-looking entry in a nested mapping."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if is_secret_name(k) and not isinstance(v, Mapping):
                yield f"{path}.{k}", v
            else:
                yield from _secret_leaves(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _secret_leaves(v, f"{path}[{i}]")


def _url_password(url: Any) -> Optional[str]:
    if not isinstance(url, str) or "://" not in url:
        return None
    try:
        return urlsplit(url.split("::")[-1]).password
    except ValueError:
        return None


def literal_secrets(cfg: DictConfig) -> list[tuple[str, str]]:
    """(config key, value) of secrets written literally into the config: secret-looking
    storage options that are not ``${oc.env:...}`` interpolations, and passwords in URLs."""
    found = []
    for group in ("trainer", "data"):
        options = cfg[group].get("storage_options")
        if options is None:
            continue
        raw = OmegaConf.to_container(options, resolve=False)
        for key, value in _secret_leaves(raw, f"{group}.storage_options"):
            is_interpolation = isinstance(value, str) and re.fullmatch(r"\$\{oc\.env:[^}]+\}", value.strip())
            if value not in (None, "", False, True) and not is_interpolation:
                found.append((key, str(value)))
    for key in ("trainer.snapshot_path", "data.path", "data.download_url"):
        group, name = key.split(".")
        password = _url_password(OmegaConf.to_container(cfg[group], resolve=False).get(name))
        if password:
            found.append((key, password))
    return found


def refuse_literal_secrets(cfg: DictConfig, hydra_dirs: Iterable[str]) -> None:
    """Raise a ConfigError naming (never showing) each literal secret, after removing them
    from the YAML files Hydra wrote into `hydra_dirs` before we ran."""
    found = literal_secrets(cfg)
    if not found:
        return
    remember_secrets(value for _, value in found)
    for directory in hydra_dirs:
        scrub_yaml_files(directory, [value for _, value in found])
    keys = ", ".join(key for key, _ in found)
    raise ConfigError(
        f"{keys}: secrets must not be written into the config (Hydra saves it to .hydra/config.yaml and the "
        "snapshot stores it). Use the standard credential chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE, an instance role), or pass the value from the environment, e.g. "
        "'+trainer.storage_options.secret=${oc.env:MY_SECRET}'"
    )


def scrub_yaml_files(directory: str, secrets: list[str]) -> None:
    """Replace every occurrence of `secrets` in the YAML files of `directory`, in place."""
    import yaml

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            for secret in secrets:
                value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, dict):
            return {clean(k): clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    def rewrite(text: str) -> str:
        if not any(secret in text for secret in secrets):
            return text
        return yaml.safe_dump(clean(yaml.safe_load(text)), sort_keys=False, allow_unicode=True)

    _rewrite_yaml_files(directory, rewrite)


def redacted_config(container: Any) -> Any:
    """A resolved config (plain containers) with secret-looking storage options replaced."""
    if isinstance(container, dict):
        out = {}
        for key, value in container.items():
            if key == "storage_options":
                out[key] = _redact_options(value)
            else:
                out[key] = redacted_config(value)
        return out
    if isinstance(container, list):
        return [redacted_config(v) for v in container]
    if isinstance(container, str):
        return redact_url_secrets(container)
    return container


def _redact_options(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_name(k) and not isinstance(v, dict) and v not in (None, True, False)
                else _redact_options(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_options(v) for v in value]
    return value


def secret_option_values(options: Mapping[str, Any]) -> list[Any]:
    """The resolved values of secret-looking options (to redact them from logs)."""
    return [v for _, v in _secret_leaves(dict(options), "")]


class RedactingFilter(logging.Filter):
    """Removes known secret values from every record a handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        return True


def redact_logs() -> None:
    """Install the redacting filter on every handler of the root logger (Hydra's console
    and main.log handlers), and redact URL query secrets in every record as it is made
    (Hydra's own lines too, whatever handlers it configures later)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "redacts_urls", False):
        def make_record(*args, **kwargs) -> logging.LogRecord:
            record = factory(*args, **kwargs)
            try:
                message = record.getMessage()
            except Exception:  # a malformed record: leave it to logging to report
                return record
            cleaned = redact_url_secrets(message)
            if cleaned != message:
                record.msg, record.args = cleaned, ()
            return record

        make_record.redacts_urls = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(make_record)
