"""Corpus files to one token file per node: found, encoded once, memory-mapped by every rank.

`data.path` names one file, a directory (its files, not its subdirectories; names starting
with "." are skipped) or a glob, local or any fsspec URL. The corpus is the concatenation of
those files in sorted name order with one newline between consecutive files. Empty files
among several are skipped with a warning; a corpus with no text at all is an error.

One process per node (distributed.on_main_then_share(..., once_per_node=True)) fetches
remote files into `data.cache_dir`, then streams the text twice in bounded chunks: the
first pass finds the vocabulary and a hash of the text, the second writes the ids (uint8
for at most 256 characters, else uint16) to a token file in `<cache_dir>/tokens/`,
written atomically. The cache is keyed by what decides its content, never by names alone:

- an index entry (``<key>.json``) per set of sources, keyed by what identifies each
  source's content on this node: a local file's path, size, modification and change times
  and inode (the change time cannot be set back, so a copy with preserved times is still
  another file); a remote file's SHA-256, taken while copying it. It records the text's
  hash and vocabulary, so a later run on unchanged files reads nothing;
- a token file per text and encoding: ``<text hash>-<encoding hash>.<dtype>``. Nodes
  with their own copies of one text share it, other text never does.

Every use touches the files it used, and a live run keeps touching them (keep_fresh) every
KEEP_FRESH_S; only files nobody has touched for UNUSED_FOR_S are removed, so neither a node
about to map a file nor a run that has been training for days loses its files to another
job's clean-up (the modification time is the signal: it holds on NFS and Lustre, where a
lock may not reach other nodes).
Every rank then memory-maps the token file, so a node keeps one copy in its page cache.
"""
from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import http.client
import json
import logging
import os
import platform
import re
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import numpy as np
import torch

from mingpt_ddp import config, distributed
from mingpt_ddp.char_dataset import CharCorpus, Vocabulary
from mingpt_ddp.corpus import documents, encoding, tokenizer
from mingpt_ddp.checkpoint import run_lock, storage
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT = 2  # part of every cache key: a change of the file layout makes new files
CHUNK_BYTES = 2 << 20  # text read per step while encoding: memory stays tens of MB
SEPARATOR = "\n"  # between consecutive files of a directory or glob
MAX_VOCAB = 1 << 16  # ids are uint16 at most
ID_DTYPES = (np.uint8, np.uint16)
# A cache file nobody has used for this long is removed. Far longer than any start-up, so
# a file another node has just made or reused (and touched) is never taken from under it.
UNUSED_FOR_S = 24 * 3600
# A live run touches its cache files this often: a day-long run keeps them far from UNUSED_FOR_S.
KEEP_FRESH_S = 3600.0
# What an HTTP server says about a file's content; without any, a copy cannot be trusted.
HTTP_VALIDATORS = ("ETag", "Content-MD5", "Digest", "Last-Modified")


# ---- where the text comes from ------------------------------------------------------------
def is_remote(path: str) -> bool:
    """A URL that fsspec opens with something other than the local filesystem."""
    return "://" in path and not path.startswith("file://")


def default_cache_dir() -> str:
    if os.environ.get("MINGPT_DDP_CACHE"):
        return os.environ["MINGPT_DDP_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mingpt_ddp", "data")


def cache_root(cache_dir: Optional[str]) -> str:
    return os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))


def local_copy_path(url: str, cache_dir: Optional[str]) -> str:
    """Where this node reads `url` from: itself if local, else its copy in the cache, named
    by a hash of the URL's location (without credentials, query or fragment: a presigned URL
    signed anew is the same object) and its file name (the same on every rank and node)."""
    if not is_remote(url):
        return url
    location = storage.location(url)
    name = re.sub(r"[^\w.\-]", "_", location.rstrip("/").rsplit("/", 1)[-1]) or "data"
    digest = hashlib.sha256(location.encode()).hexdigest()[:16]
    return os.path.join(cache_root(cache_dir), f"{digest}-{name}")


def download(url: str, dest: str, timeout_s: float = 30.0, retry_minutes: float = 0.0) -> None:
    """Fetch `url` into `dest` atomically: a reader sees the whole file or none, and only
    the whole file (a body shorter than its Content-Length is a cut connection, not the
    corpus). A server that cannot be reached is retried for `retry_minutes`; anything else
    (a 4xx answer, an unknown host, an untrusted certificate, a mistyped URL) is final at
    once. On failure nothing is left behind, not even the directories made for it."""
    directory = os.path.dirname(os.path.abspath(dest))
    made = _missing_directories(directory)
    os.makedirs(directory, exist_ok=True)
    log.info("downloading %s -> %s", storage.redact(url), dest)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".download-")
    os.close(fd)
    done = False

    def fetch() -> None:
        with open(tmp, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
            received = 0
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                received += len(chunk)
            # urllib's read returns b"" when the server closes early, whatever Content-Length said.
            announced = resp.headers.get("Content-Length", "")
            if announced.strip().isdigit() and received < int(announced):
                raise ConnectionResetError(f"the connection closed after {received:,} of {int(announced):,} bytes")
            out.flush()
            os.fsync(out.fileno())

    try:
        storage.retry_transient(fetch, f"downloading {storage.redact(url)}", retry_minutes,
                                transient=lambda exc: storage.network_cause(exc) is not None)
        os.replace(tmp, dest)
        done = True
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise ConfigError(
            f"data file {dest} is missing and downloading it from {storage.redact(url)} failed "
            f"({storage.describe(storage.network_cause(exc) or exc)}): check data.download_url, put a UTF-8 text "
            f"file at {dest}, or set data.path=<your text file>"
        ) from None
    finally:
        if not done:
            os.unlink(tmp)
            for path in made:  # deepest first
                try:
                    os.rmdir(path)
                except OSError:
                    break


def _missing_directories(directory: str) -> list[str]:
    """`directory` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while directory and not os.path.exists(directory) and directory != os.path.dirname(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return missing


def remote_version(fs, info: Mapping[str, Any]) -> Optional[str]:
    """What tells whether a remote file changed, from its listing `info`, or None when
    nothing does. HTTP: the server's ETag, Last-Modified or checksum headers (fsspec's own
    ``ukey`` for HTTP is the URL, which stays the same when the content changes and holds
    the query's secrets). Elsewhere what fsspec's ``ukey`` hashes: the whole info (size,
    ETag, modification time, version id)."""
    if storage.is_http(fs):
        validators = {key: info[key] for key in HTTP_VALIDATORS if info.get(key)}
        return _digest([info.get("size"), validators]) if validators else None
    return hashlib.sha256(str(dict(info)).encode()).hexdigest()


def fetch_to_cache(url: str, storage_options: Optional[Mapping[str, Any]], local: str, retry_minutes: float) -> str:
    """Copy remote `url` to `local` unless the copy there is of the same remote version;
    return the copy's SHA-256. Atomic: a temp file in the cache directory, then os.replace;
    a `.source` file next to it records the URL (redacted), the version and the hash."""
    fs, remote = storage.filesystem(url, storage_options)
    shown, stamp = storage.redact(url), local + ".source"

    def fetch() -> str:
        info = fs.info(remote)
        if info.get("type") == "directory":
            raise IsADirectoryError(shown)
        version = remote_version(fs, info)
        kept = _read_json(stamp) or {}
        if version is not None and kept.get("version") == version and _size(local) == kept.get("size"):
            log.info("data %s: using this node's cached copy %s", shown, local)
            return kept["sha256"]
        if version is None:
            log.info("data %s: the server sends no ETag or Last-Modified, so the copy is fetched at every start", shown)
        directory = os.path.dirname(local)
        os.makedirs(directory, exist_ok=True)
        log.info("data %s: copying to this node's cache %s", shown, local)
        digest, size = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fetch-")
        try:
            # HTTP streams (one GET): a server need not support range requests.
            with os.fdopen(fd, "wb") as out, fs.open(remote, "rb", **({"block_size": 0} if storage.is_http(fs)
                                                                        else {})) as src:
                while chunk := src.read(8 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, local)
            source = {"url": shown, "version": version, "size": size, "sha256": digest.hexdigest()}
            storage.write_local_atomically(stamp, lambda out: out.write(json.dumps(source).encode()))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return source["sha256"]

    fs.invalidate_cache(remote)
    try:
        return storage.retry_transient(fetch, f"copying data {shown}", retry_minutes)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(_fetch_error(shown, local, exc, retry_minutes)) from None


def _fetch_error(url: str, local: str, exc: BaseException, retry_minutes: float) -> str:
    """`url` is as shown (redacted)."""
    cache_dir = os.path.dirname(local)
    status = getattr(exc.__cause__, "status", None)  # fsspec's HTTP filesystem: the response behind the error
    # A server that could not be reached: fsspec's HTTP filesystem raises even that as
    # FileNotFoundError, with the real error as its cause (retried until here, not missing).
    unreachable = storage.network_cause(exc)
    if local and isinstance(exc, OSError) and exc.filename and str(exc.filename).startswith(cache_dir):
        return (f"cannot keep a copy of {url} in data.cache_dir={cache_dir} ({storage.describe(exc)}): "
                "set data.cache_dir to a writable local directory")
    if status in (401, 403) or isinstance(exc, PermissionError):
        why = f"HTTP {status}" if status else storage.describe(exc)
        return (f"cannot read data file {url} ({why}): check the credentials (AWS_* environment, AWS_PROFILE, "
                "instance role, data.storage_options; a presigned URL may have expired)")
    lasting = storage.lasting_network_cause(exc)  # an unknown host, an untrusted certificate: not retried
    if lasting is not None:
        return (f"cannot reach the server of data file {url} ({storage.describe(lasting)}): check the host name in "
                "data.path, and that this machine trusts the server's certificate")
    if isinstance(exc, FileNotFoundError) and unreachable is None:
        return f"data file not found: {url}: set data.path=<a UTF-8 text file or URL>"
    if isinstance(exc, IsADirectoryError):
        return f"data.path={url} is a directory: point it at a text file"
    return (f"cannot read data file {url} ({storage.describe(unreachable or exc)}) after retrying for "
            f"trainer.load_retry_minutes={retry_minutes:g}: check the endpoint (AWS_ENDPOINT_URL or "
            "data.storage_options), the network and the credentials")


def ensure_local_copy(path: str, url: Optional[str], storage_options: Optional[Mapping[str, Any]] = None,
                      cache_dir: Optional[str] = None, retry_minutes: float = 0.0) -> None:
    """Make one text file readable from this node's disk: download a missing local `path`
    from `url` when one is configured, or copy a remote `path` into the cache directory."""
    if is_remote(path):
        fetch_to_cache(path, storage_options, local_copy_path(path, cache_dir), retry_minutes)
    elif url and not os.path.exists(path):
        download(url, path, retry_minutes=retry_minutes)


def _visible(name: str) -> bool:
    return not os.path.basename(storage.location(name).rstrip("/")).startswith(".")


def list_files(path: str, storage_options: Optional[Mapping[str, Any]], retry_minutes: float) -> list[str]:
    """The files `path` names, in sorted order: itself, a directory's files, or a glob's
    (URLs as the filesystem can open them again, credentials included)."""
    if not is_remote(path):
        local = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)
        if os.path.isfile(local):
            return [local]
        if os.path.isdir(local):
            files = sorted(n for n in (os.path.join(local, n) for n in os.listdir(local))
                           if _visible(n) and os.path.isfile(n))
            what = "directory"
        elif glob.has_magic(local):
            files = sorted(n for n in glob.glob(local) if _visible(n) and os.path.isfile(n))
            what = "glob"
        else:
            raise ConfigError(f"data file not found: {path}: check data.path (a UTF-8 text file, directory, glob "
                              "or URL); a missing file is downloaded only from a data.download_url given with it")
        if not files:
            raise ConfigError(f"data.path={path}: the {what} matches no file: point data.path at your text files")
        return files

    fs, remote = storage.filesystem(path, storage_options)
    shown = storage.redact(path)

    def listing() -> tuple[str, list[str]]:
        fs.invalidate_cache()
        if glob.has_magic(storage.location(path)):  # not the query: "?" there is no wildcard
            return "glob", [p for p, info in fs.glob(remote, detail=True).items() if info.get("type") == "file"]
        if fs.info(remote).get("type") != "directory":
            return "file", [remote]
        return "directory", [info["name"] for info in fs.ls(remote, detail=True) if info.get("type") == "file"]

    try:
        what, names = storage.retry_transient(listing, f"listing data {shown}", retry_minutes)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(_fetch_error(shown, "", exc, retry_minutes)) from None
    files = sorted((storage.child_url(path, fs, remote, n) for n in names if _visible(n)), key=storage.location)
    if not files:
        raise ConfigError(f"data.path={shown}: the {what} matches no file: point data.path at your text files")
    return files


@dataclass(frozen=True)
class Source:
    name: str  # as shown and stored: the path, or the URL with its credentials redacted
    local: str  # where this node reads it
    size: int
    # What the cache knows this file's content by: for a local file its stat (path, size,
    # mtime, ctime, inode), for a remote file the SHA-256 of this node's copy.
    identity: tuple


def _local_identity(path: str) -> tuple:
    st = os.stat(path)
    return ("file", path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def resolve_sources(path: str, download_url: Optional[str], storage_options: Optional[Mapping[str, Any]],
                    cache_dir: Optional[str], retry_minutes: float) -> list[Source]:
    """The corpus's files, readable from this node's disk (downloaded or fetched first)."""
    if not is_remote(path) and download_url and not os.path.exists(path) and not glob.has_magic(path):
        download(download_url, path, retry_minutes=retry_minutes)
    sources = []
    for url in list_files(path, storage_options, retry_minutes):
        if is_remote(url):
            local = local_copy_path(url, cache_dir)
            sha256 = fetch_to_cache(url, storage_options, local, retry_minutes)
            sources.append(Source(storage.redact(url), local, os.path.getsize(local), ("sha256", sha256)))
        else:
            try:
                identity = _local_identity(url)
            except PermissionError as exc:
                raise ConfigError(f"cannot read data file {url}: {exc}") from None
            sources.append(Source(url, url, identity[2], identity))
    text = [s for s in sources if s.size > 0]
    if not text:
        shown = storage.redact(path)
        raise ConfigError(f"data file {shown} is empty: put training text in it or set data.path"
                          if len(sources) == 1 else
                          f"every file data.path={shown} matches is empty: put training text in them or set data.path")
    for s in sources:
        if s.size == 0:
            log.warning("data file %s is empty: skipped", s.name)
    return text


# ---- streaming the text -----------------------------------------------------------------
def _changed(source: Source) -> ConfigError:
    return ConfigError(f"data file {source.name} changed while it was being encoded: wait until it is completely "
                       "written (or copy it somewhere stable) and start again")


ASCII_BYTES = bytes(range(128))
NON_ASCII_BYTES = bytes(range(128, 256))


def text_chunks(source: Source) -> Iterator[tuple[bytes, Optional[str]]]:
    """The file a bounded chunk at a time, as (UTF-8 bytes of whole characters, their
    text): None for an ASCII chunk, whose bytes are its code points. A strict decoder
    carries characters split between chunks over to the next one."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        f = open(source.local, "rb")
    except OSError as exc:
        raise ConfigError(f"cannot read data file {source.name}: {exc}") from None
    with f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            pending = decoder.getstate()[0]
            if chunk and not pending and chunk.isascii():
                yield chunk, None
            else:
                try:
                    text = decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as exc:
                    where = offset - len(pending) + exc.start
                    raise ConfigError(
                        f"data file {source.name} is not UTF-8 text (byte {where:,}: "
                        f"{exc.object[exc.start:exc.start + 1]!r}): convert it, e.g. "
                        "`iconv -f latin1 -t utf-8 in.txt > out.txt`, or remove it from data.path"
                    ) from None
                if text:
                    whole = pending + chunk
                    yield whole[:len(whole) - len(decoder.getstate()[0])], text
            if not chunk:
                break
            offset += len(chunk)
    if offset != source.size:
        raise _changed(source)


def code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


@dataclass(frozen=True)
class TextSummary:
    """What the first pass learns about the corpus."""

    chars: str  # its sorted distinct characters
    length: int  # its number of characters
    sha256: str  # of its text (the files joined by SEPARATOR): what decides the token file


def find_characters(sources: list[Source]) -> TextSummary:
    """First pass: the characters, their count and the text's hash. Bytes already known are
    deleted with bytes.translate (C speed); only what is left, usually nothing or a few
    non-ASCII characters, is looked at further."""
    seen_ascii = bytearray()
    seen_other: set[str] = set()
    count = 0
    text_hash = hashlib.sha256()
    for i, source in enumerate(sources):
        if i:
            text_hash.update(SEPARATOR.encode())
        for data, text in text_chunks(source):
            text_hash.update(data)
            count += len(data) if text is None else len(text)
            new = data.translate(None, seen_ascii)
            if text is not None:
                seen_other.update(new.translate(None, ASCII_BYTES).decode("utf-8"))
                new = new.translate(None, NON_ASCII_BYTES)
            while new:
                seen_ascii.append(new[0])
                new = new.translate(None, new[:1])
    if len(sources) > 1:
        seen_other.add(SEPARATOR)
        count += len(sources) - 1
    return TextSummary("".join(sorted(seen_other.union(map(chr, seen_ascii)))), count, text_hash.hexdigest())


def id_dtype(vocab_size: int, what: str) -> np.dtype:
    for dtype in ID_DTYPES:
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ConfigError(
        f"{what} has {vocab_size:,} distinct characters, more than the {MAX_VOCAB:,} a character-level model's "
        "uint16 token ids hold: check that data.path names text files (not binaries), or use fewer files"
    )


def write_ids(sources: list[Source], chars: str, out) -> int:
    """Second pass: the ids of every character, chunk by chunk, into the open file `out`."""
    dtype = id_dtype(len(chars), "the vocabulary")
    codepoints = np.array([ord(c) for c in chars], dtype=np.int64)
    table = np.zeros(max(256, int(codepoints.max()) + 1), dtype=dtype)
    table[codepoints] = np.arange(len(chars), dtype=dtype)
    ascii_ids = table[:256].tobytes() if dtype == np.uint8 else None  # a bytes.translate table
    written = 0
    for i, source in enumerate(sources):
        if i:
            table[[ord(SEPARATOR)]].tofile(out)
            written += 1
        for data, text in text_chunks(source):
            if text is None and ascii_ids is not None:
                out.write(data.translate(ascii_ids))
            else:
                codes = np.frombuffer(data, dtype=np.uint8) if text is None else code_points(text)
                # clip: no bounds checks (every character is in `chars`; a changed file is caught after)
                np.take(table, codes, mode="clip").tofile(out)
            written += len(data) if text is None else len(text)
    return written


# ---- the cache ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenFile:
    """What every rank needs to map this node's token file (shared from rank 0)."""

    name: str  # file name inside `directory`
    chars: str  # the vocabulary the ids index
    length: int  # tokens
    dtype: str
    corpus: str  # data.path as shown (credentials redacted), for messages
    corpus_bytes: int
    encode_s: Optional[float]  # None when an existing token file was reused
    directory: str = ""  # <cache_dir>/tokens as the process that made it resolved it
    text_sha256: str = ""  # of the text: nodes must agree on it
    tokenizer: Optional[str] = None  # bpe/gpt2: the tokenizer's file in <cache_dir>/tokens (tokenizer.to_dict as JSON)
    train_tokens: Optional[int] = None  # bpe/gpt2: tokens before the split (None: CharCorpus splits by val_fraction)
    fingerprint: Optional[str] = None  # bpe/gpt2: tokenizer.fingerprint of the tokenizer
    # The cache files in `directory` a run on this token file needs (itself, its index entry
    # and counts, its tokenizer, the trained BPE): what keep_fresh touches while it runs.
    in_use: tuple[str, ...] = ()


def tokens_dir(cache_dir: Optional[str]) -> str:
    return os.path.join(cache_root(cache_dir), "tokens")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode()).hexdigest()[:16]


def index_key(sources: list[Source]) -> str:
    """The index entry's name: what identifies the sources' content on this node."""
    return _digest({"format": FORMAT, "sources": [list(s.identity) for s in sources]})


def token_file_name(text_sha256: str, chars: str, dtype: np.dtype) -> str:
    """A token file is decided by the text and its encoding (here: the characters the ids
    index; a tokenizer would add its own name and version to `encoding`)."""
    encoding = {"format": FORMAT, "chars": chars}
    return f"{text_sha256[:32]}-{_digest(encoding)}.{dtype.name}"


def _check_writable(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"cannot write the token cache in data.cache_dir={os.path.dirname(directory)} "
                          f"({storage.describe(exc)}): set data.cache_dir to a writable local directory") from None


def _unchanged(sources: list[Source]) -> None:
    for s in sources:
        try:
            same = (_local_identity(s.local) == s.identity if s.identity[0] == "file"
                    else os.path.getsize(s.local) == s.size)
        except OSError:
            raise _changed(s) from None
        if not same:
            raise _changed(s)


@dataclass(frozen=True)
class Tokenization:
    """How the corpus becomes ids (data.tokenizer and the keys that decide it)."""

    kind: str = "char"
    vocab_size: int = 4096  # bpe
    train_chars: int = 100_000_000  # bpe: at most this much of the training split trains it
    text_column: str = "text"  # .parquet / .jsonl files
    val_fraction: float = 0.1  # bpe/gpt2: where the split falls decides the BPE and the ids
    state: Optional[Mapping[str, Any]] = None  # a snapshot's tokenizer (tokenizer.to_dict): encode with exactly it
    download: bool = False  # gpt2: fetch GPT-2's BPE file into tiktoken's cache when missing


CHARS = Tokenization()


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def _size(path: str) -> Optional[int]:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _touch(path: str) -> None:
    """Mark a cache file as used now (what keeps it from removal)."""
    try:
        os.utime(path)
    except OSError:
        pass


def prepare(path: str, download_url: Optional[str], storage_options: Optional[Mapping[str, Any]],
            cache_dir: Optional[str], retry_minutes: float, vocab: Optional[str] = None,
            tokenization: Tokenization = CHARS, threads: Optional[int] = None) -> TokenFile:
    """This node's token file for `path`, encoded with `vocab` (default: the text's own
    characters) or as `tokenization` says; made unless an identical one exists. Run by one
    process per node; on a cache_dir all nodes share, one node makes it and the others
    wait for it (shared_cache_lock). A BPE is trained and the text encoded on `threads`
    threads (distributed.encode_threads; None: this process's cores)."""
    directory = tokens_dir(cache_dir)
    _check_writable(directory)
    with shared_cache_lock(directory, storage.redact(path)):
        sources = resolve_sources(path, download_url, storage_options, cache_dir, retry_minutes)
        if tokenization.kind == "char" and all(documents.file_format(s.name) == documents.TEXT for s in sources):
            return _prepare_characters(path, sources, directory, vocab)
        return _prepare_documents(storage.redact(path), sources, directory, tokenization, vocab, threads)


def _prepare_characters(path: str, sources: list[Source], directory: str, vocab: Optional[str]) -> TokenFile:
    """Plain text files as characters: two fast passes over the bytes."""
    shown = storage.redact(path)
    corpus_bytes = sum(s.size for s in sources) + len(SEPARATOR.encode()) * (len(sources) - 1)  # the joined text
    started = time.perf_counter()

    index_path = os.path.join(directory, index_key(sources) + ".json")
    entry = _read_json(index_path)
    if entry is None or entry.get("format") != FORMAT:
        log.info("data %s: reading %d file(s), %.1f MB, for the vocabulary", shown, len(sources), corpus_bytes / 1e6)
        summary = find_characters(sources)
        _unchanged(sources)
        entry = {"format": FORMAT, "text_sha256": summary.sha256, "chars": summary.chars, "length": summary.length,
                 "sources": [[s.name, s.size] for s in sources]}
        storage.write_local_atomically(index_path, lambda out: out.write(json.dumps(entry, ensure_ascii=False).encode()))
    else:
        _touch(index_path)
    chars = vocab if vocab is not None else entry["chars"]
    outside = sorted(set(entry["chars"]) - set(chars))
    if outside:
        raise ConfigError(f"data.path={shown} has characters outside the snapshot's vocabulary: {''.join(outside)!r}: "
                          "resume with the text it was trained on, or start a new run")
    dtype = id_dtype(len(chars), f"data.path={shown}")
    name = token_file_name(entry["text_sha256"], chars, dtype)
    token_path = os.path.join(directory, name)
    encode_s = None
    if _size(token_path) == entry["length"] * dtype.itemsize:
        _touch(token_path)
        log.info("data %s: using the token file %s (%s tokens)", shown, token_path, f"{entry['length']:,}")
    else:
        written = []
        storage.write_local_atomically(token_path, lambda out: written.append(write_ids(sources, chars, out)))
        try:
            if written[0] != entry["length"]:
                raise ConfigError(f"data.path={shown} changed while it was being encoded: start again once it is "
                                  "stable")
            _unchanged(sources)
        except ConfigError:
            os.unlink(token_path)
            raise
        encode_s = time.perf_counter() - started
        log.info("data %s: encoded %.1f MB into this node's token cache %s in %.1f s (%.0f MB/s)", shown,
                 corpus_bytes / 1e6, token_path, encode_s, corpus_bytes / 1e6 / max(encode_s, 1e-9))
    remove_unused(directory)
    return TokenFile(name, chars, entry["length"], dtype.name, shown, corpus_bytes, encode_s, directory,
                     entry["text_sha256"], in_use=(os.path.basename(index_path), name))


def remove_unused(directory: str, unused_for_s: float = UNUSED_FOR_S) -> None:
    """Remove the cache files nobody has used for `unused_for_s` (each use touches them):
    earlier versions of a text, index entries of files that changed, what a killed writer
    left. Never a file in use: another node sharing the cache touched it moments ago, and a
    live run touches its files every KEEP_FRESH_S (keep_fresh), so its restart (a requeue,
    an elastic restart) finds them instead of encoding the corpus again."""
    cutoff = time.time() - unused_for_s
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        try:
            if (entry.is_file(follow_symlinks=False) and not entry.name.endswith(".lock")
                    and entry.stat().st_mtime < cutoff):
                os.unlink(entry.path)
        except OSError:
            pass


_fresh: dict[str, Any] = {"paths": (), "thread": None}
_fresh_changed = threading.Event()


def keep_fresh(paths: tuple[str, ...]) -> None:
    """Touch `paths` every KEEP_FRESH_S for as long as this process lives, so that no
    remove_unused (another job's prepare on a shared cache) takes them while this run uses
    them. Replaces what the process kept fresh before: a process trains on one corpus at a
    time (a sweep's next point, a resume's re-encoding with the snapshot's ids, its own).
    A daemon thread: it ends with the process, and then the files age as any others."""
    _fresh["paths"] = tuple(paths)
    _fresh_changed.set()  # (re)reads KEEP_FRESH_S and the paths now
    if _fresh["thread"] is None:
        def touch_forever() -> None:
            while _fresh["paths"]:
                _fresh_changed.wait(KEEP_FRESH_S)
                _fresh_changed.clear()
                for path in _fresh["paths"]:
                    _touch(path)

        _fresh["thread"] = threading.Thread(target=touch_forever, daemon=True, name="token-cache-keep-fresh")
        _fresh["thread"].start()


def stop_keeping_fresh() -> None:
    """End keep_fresh's thread (the run is over): no thread of ours is left when the
    interpreter shuts down, where a daemon thread can still wake and take the GIL."""
    thread, _fresh["paths"], _fresh["thread"] = _fresh["thread"], (), None
    if thread is not None:
        _fresh_changed.set()
        thread.join(timeout=5)


def document_stream(sources: list[Source], text_column: str):
    """The corpus as documents (each an iterable of text pieces), a new pass per call: a
    text file is one document, a Parquet or JSON-lines file one per row."""
    def stream():
        for s in sources:
            if documents.file_format(s.name) == documents.TEXT:
                yield (data.decode("ascii") if text is None else text for data, text in text_chunks(s))
            else:
                yield from ((doc,) for doc in documents.read_documents(s.local, text_column, name=s.name))
    return stream


def _prepare_documents(path: str, sources: list[Source], directory: str, how: Tokenization,
                       vocab: Optional[str], threads: Optional[int] = None) -> TokenFile:
    """Any tokenizer, any file format (encoding.py's passes). Cached: the scan of the corpus
    (<key>.json), a trained BPE (<key>-bpe-<settings>.tokenizer.json, reused by every run
    with the same settings), and the token file, named by the corpus, the tokenizer's
    fingerprint and the split."""
    names = _digest(["documents", *[s.name for s in sources]])
    key = f"{names}-{_digest([FORMAT, how.text_column, [list(s.identity) for s in sources]])}"
    stream = document_stream(sources, how.text_column)
    file_bytes = sum(s.size for s in sources)  # compressed, or with JSON's syntax: not the text's size
    started = time.perf_counter()
    meta_path = os.path.join(directory, key + ".json")
    meta = _read_json(meta_path)
    chars_needed = how.kind == "char"  # the BPEs need only the count: collecting characters costs seconds per 100 MB
    if (meta is None or "documents" not in meta or "text_sha256" not in meta
            or (chars_needed and meta.get("chars") is None)):
        log.info("data %s: reading %d file(s), %.1f MB of files, to count its characters", path, len(sources),
                 file_bytes / 1e6)
        found = encoding.scan(stream, collect_chars=chars_needed)
        _unchanged(sources)
        meta = {"format": FORMAT, "chars": found.distinct if chars_needed else None, "length": found.chars,
                "documents": found.documents, "text_sha256": found.sha256, "text_bytes": found.text_bytes,
                "sources": [[s.name, s.size] for s in sources]}
        storage.write_local_atomically(meta_path, lambda out: out.write(json.dumps(meta, ensure_ascii=False).encode()))
    split = encoding.train_chars(meta["length"], how.val_fraction)
    corpus_bytes = meta["text_bytes"]  # the text's UTF-8 bytes: bytes per token and MB/s of text, whatever the format

    tok = _tokenizer_for(path, how, vocab, meta, stream, split, directory, key, threads)
    state = tok.to_dict()
    fingerprint = tokenizer.fingerprint(state)
    char = tok.kind == "char"
    name = f"{key}-{tok.kind}-{fingerprint}" + ("" if char else f"-{_digest(how.val_fraction)}") + f".{tok.dtype.name}"
    token_path = os.path.join(directory, name)
    tokenizer_name = None
    if not char:
        tokenizer_name = f"{key}-{tok.kind}-{fingerprint}.tokenizer.json"
        tokenizer_path = os.path.join(directory, tokenizer_name)
        if not os.path.exists(tokenizer_path):
            storage.write_local_atomically(tokenizer_path, lambda out: out.write(json.dumps(state).encode()))
    counts_path = token_path + ".json"
    encode_s = None
    counts = _read_json(counts_path) if os.path.exists(token_path) else None
    if counts is not None and os.path.getsize(token_path) != counts["length"] * tok.dtype.itemsize:
        counts = None
    if counts is not None:
        log.info("data %s: using this node's token cache %s (%s tokens)", path, token_path, f"{counts['length']:,}")
    else:
        log.info("data %s: encoding %.1f M characters with the %s tokenizer on %d threads", path, meta["length"] / 1e6,
                 tok.describe(), 1 if char else threads or tokenizer.usable_cores())
        result = []
        storage.write_local_atomically(token_path, lambda out: result.append(
            encoding.write_tokens(tok, stream, split, meta["length"], out, f"data {path}", threads)))
        try:
            _unchanged(sources)
        except ConfigError:
            os.unlink(token_path)
            raise
        counts = {"length": result[0][0], "train_tokens": result[0][1]}
        storage.write_local_atomically(counts_path, lambda out: out.write(json.dumps(counts).encode()))
        encode_s = time.perf_counter() - started
        log.info("data %s: encoded %.1f MB into %s tokens (%s) in this node's token cache %s in %.1f s (%.1f MB/s)",
                 path, corpus_bytes / 1e6, f"{counts['length']:,}", tok.describe(), token_path, encode_s,
                 corpus_bytes / 1e6 / max(encode_s, 1e-9))
    trained = _trained_bpe_name(key, how)
    in_use = tuple(n for n in (os.path.basename(meta_path), name, os.path.basename(counts_path), tokenizer_name,
                               trained) if n and os.path.exists(os.path.join(directory, n)))
    for used in in_use:
        _touch(os.path.join(directory, used))  # in use: remove_unused leaves it alone
    remove_unused(directory)
    return TokenFile(name, tok.vocab.chars if char else "", counts["length"], tok.dtype.name, path, corpus_bytes,
                     encode_s, directory=directory, text_sha256=meta["text_sha256"], tokenizer=tokenizer_name,
                     train_tokens=None if char else counts["train_tokens"], fingerprint=None if char else fingerprint,
                     in_use=in_use)


def _tokenizer_for(path: str, how: Tokenization, vocab: Optional[str], meta: dict, stream, split: int,
                   directory: str, key: str, threads: Optional[int] = None) -> tokenizer.Tokenizer:
    """The snapshot's tokenizer when resuming; else characters of the text, GPT-2's, or a
    BPE trained on the training split (cached: trained once per corpus and settings)."""
    if how.kind == "char":
        chars = vocab if vocab is not None else meta["chars"]
        outside = sorted(set(meta["chars"]) - set(chars))
        if outside:
            raise ConfigError(f"data.path={path} has characters outside the snapshot's vocabulary: "
                              f"{''.join(outside)!r}: resume with the text it was trained on, or start a new run")
        id_dtype(len(chars), f"data.path={path}")
        return tokenizer.CharTokenizer(tokenizer.Vocabulary(chars))
    if how.state is not None:
        return tokenizer.from_dict(how.state, how.download)
    if how.kind == "gpt2":
        return tokenizer.load_gpt2(how.download)
    trained = os.path.join(directory, _trained_bpe_name(key, how))
    if os.path.exists(trained):
        _touch(trained)
        return tokenizer.from_dict(_read_json(trained))
    log.info("data %s: training a byte-level BPE of %s tokens on the training split", path, f"{how.vocab_size:,}")
    tok = encoding.train_bpe(stream, split, how.vocab_size, how.train_chars, threads)
    storage.write_local_atomically(trained, lambda out: out.write(json.dumps(tok.to_dict()).encode()))
    return tok


def _trained_bpe_name(key: str, how: Tokenization) -> Optional[str]:
    """The cached BPE trained for this corpus and these settings (None: no BPE is trained)."""
    if how.kind != "bpe" or how.state is not None:
        return None
    return f"{key}-bpe-{_digest([how.vocab_size, how.train_chars, how.val_fraction])}.tokenizer.json"


def load_tokenizer(token_file: TokenFile, cache_dir: Optional[str]) -> tokenizer.Tokenizer:
    """The tokenizer a token file's ids belong to, on any rank of its node."""
    if token_file.tokenizer is None:
        return tokenizer.CharTokenizer(tokenizer.Vocabulary(token_file.chars))
    with open(os.path.join(tokens_dir(cache_dir), token_file.tokenizer), encoding="utf-8") as f:
        return tokenizer.from_dict(json.load(f), download=False)


# ---- one node encodes for all that share the cache -----------------------------------------
LOCK_HEARTBEAT_S = 5.0
LOCK_STALE_S = 60.0  # a lock not touched for this long was left by a process that died


@contextlib.contextmanager
def shared_cache_lock(directory: str, path: str) -> Iterator[None]:
    """Exclusive use of `directory` for corpus `path` among all processes that share it.

    With data.cache_dir on storage all nodes share (FSx, NFS), every node's local rank 0
    arrives here at about the same time: the first takes the lock and encodes; the others
    wait, then find the token file made and only map it. Where flock reaches every process
    that sees the file (run_lock.flock_reaches_everyone: local disks, NFS, Lustre with
    flock), the kernel lock on a file that is never removed: released when its holder
    ends or dies, no staleness guessed. Elsewhere a lock file (_lock_file_lease).
    """
    lock = os.path.join(directory, f".{_digest(path)}.lock")
    if run_lock.fcntl is not None and run_lock.flock_reaches_everyone(directory):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        held, waited = False, False
        try:
            while not held:
                try:
                    run_lock.fcntl.flock(fd, run_lock.fcntl.LOCK_EX | run_lock.fcntl.LOCK_NB)
                    held = True
                except BlockingIOError:
                    if not waited:
                        log.info("data %s: another process is preparing the token cache %s; waiting for it", path,
                                 directory)
                        waited = True
                    time.sleep(0.2)
                except OSError as exc:
                    if exc.errno not in run_lock._NO_FLOCK:
                        raise
                    break  # no flock on this filesystem after all: the lock file below
            if held:
                yield
        finally:
            os.close(fd)  # releases the kernel lock; the file stays, so every waiter locks the same inode
        if held:
            return
    # Its own name: the kernel lock's file stays for good, and would read as held here.
    with _lock_file_lease(lock[:-len(".lock")] + ".lease", path, directory):
        yield


@contextlib.contextmanager
def _lock_file_lease(lock: str, path: str, directory: str) -> Iterator[None]:
    """Where there is no flock: the first creates the lock file (O_CREAT|O_EXCL) and keeps
    its modification time fresh; a lock untouched for LOCK_STALE_S is taken over."""
    waited = False
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            try:
                age = time.time() - os.stat(lock).st_mtime
                with open(lock, encoding="utf-8") as f:
                    owner = f.read().strip()
            except OSError:
                continue  # released just now
            if age > LOCK_STALE_S:
                log.warning("data %s: taking over the token cache lock %s of %s (untouched for %.0f s)", path, lock,
                            owner or "an unknown process", age)
                with contextlib.suppress(OSError):
                    os.unlink(lock)
                continue
            if not waited:
                log.info("data %s: %s is preparing the token cache %s; waiting for it", path, owner or "another node",
                         directory)
                waited = True
            time.sleep(0.2)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{platform.node()} pid {os.getpid()}\n")
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(LOCK_HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(lock)

    beat = threading.Thread(target=heartbeat, daemon=True, name="token-cache-lock")
    beat.start()
    try:
        yield
    finally:
        done.set()
        beat.join()
        with contextlib.suppress(OSError):
            os.unlink(lock)


def this_nodes_token_file(made_here: Optional[TokenFile], dist: distributed.DistEnv) -> TokenFile:
    """The token file this node's local rank 0 made (`made_here` on that rank, else None),
    for every rank of the node; checked to hold the same text as global rank 0's. Nodes
    may keep their own copies of the text (even their own caches), never other text. A
    node is the launcher's (torchrun's agent, Slurm's node): host names can be shared by
    containers and are generic in many images. Every rank takes part (one all_gather of
    small objects)."""
    node = distributed.node_id()
    everyone = distributed.all_gather_object((node, platform.node(), made_here))
    reference = everyone[0][2]
    for _, host, made in everyone:
        if made is not None and made.fingerprint != reference.fingerprint:
            raise ConfigError(
                f"node {host} encoded data.path={reference.corpus} with another tokenizer than rank 0 (a BPE trained "
                "on its own copy of the text): put data.cache_dir on storage every node shares, or give every node "
                "the same files"
            )
        if made is not None and (made.text_sha256, made.length, made.train_tokens) != (
                reference.text_sha256, reference.length, reference.train_tokens):
            raise ConfigError(
                f"node {host} read another text for data.path={reference.corpus} than rank 0 "
                f"({made.length:,} characters, {len(made.chars)} distinct, against {reference.length:,} and "
                f"{len(reference.chars)}): give every node the same files"
            )
    return next(made for made_on, _, made in everyone if made_on == node and made is not None)


def open_tokens(token_file: TokenFile, cache_dir: Optional[str]) -> torch.Tensor:
    """The token file as a tensor backed by a copy-on-write memory map (never written):
    every process on a node shares the same page-cache pages."""
    directory = tokens_dir(cache_dir)
    path = os.path.join(directory, token_file.name)
    dtype = np.dtype(token_file.dtype)
    if _size(path) != token_file.length * dtype.itemsize:
        if token_file.directory and not _same_directory(directory, token_file.directory):
            raise ConfigError(
                f"this process's data.cache_dir is {os.path.dirname(directory)} but this node's local rank 0 used "
                f"{os.path.dirname(token_file.directory)} ($MINGPT_DDP_CACHE, $XDG_CACHE_HOME or $HOME differ "
                "between the processes of a node): set data.cache_dir=<a local directory> for all of them"
            )
        raise ConfigError(
            f"this node's token file {path} for data.path={token_file.corpus} was removed or truncated after local "
            "rank 0 made it, while the job started (by something cleaning the cache?): start the job again"
        )
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", shape=(token_file.length,)))


def _same_directory(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def tokenization(cfg: config.DataConfig, state: Optional[dict[str, Any]] = None) -> Tokenization:
    """data.tokenizer and the keys that decide its ids; `state`: a snapshot's BPE or GPT-2 tokenizer."""
    return Tokenization(kind=getattr(cfg.tokenizer, "value", cfg.tokenizer), vocab_size=cfg.vocab_size,
                        train_chars=cfg.tokenizer_train_chars, text_column=cfg.text_column,
                        val_fraction=cfg.val_fraction, state=state)


def load_corpus(cfg: config.DataConfig, dist: distributed.DistEnv, retry_minutes: float, vocab: Optional[Vocabulary] = None,
                tokenizer_state: Optional[dict[str, Any]] = None, threads: Optional[int] = None
                ) -> tuple[CharCorpus, TokenFile, tokenizer.Tokenizer]:
    """Encode the corpus once per node into a token file in data.cache_dir (streaming;
    remote files fetched and a missing local file downloaded first; reused while the
    sources are unchanged), then memory-map it on every rank. `vocab` (a snapshot's
    characters) or `tokenizer_state` (a snapshot's BPE or GPT-2 tokenizer) gives the ids
    instead of data.tokenizer's own. `threads`: the encoding's (distributed.encode_threads:
    the node's other ranks wait meanwhile). Returns the corpus, its token file and its tokenizer."""
    options = storage.resolve_options(cfg.storage_options, "data.storage_options")
    made: list[TokenFile] = []
    distributed.on_main_then_share(
        lambda: made.append(prepare(cfg.path, cfg.download_url, options, cfg.cache_dir, retry_minutes,
                                    vocab.chars if vocab is not None else None, tokenization(cfg, tokenizer_state),
                                    threads)),
        dist, once_per_node=True,
    )
    token_file = this_nodes_token_file(made[0] if made else None, dist)
    if made:  # the process that made or reused this node's files keeps them from removal while the run lives
        keep_fresh(tuple(os.path.join(made[0].directory, name) for name in made[0].in_use))

    def open_here() -> tuple[CharCorpus, tokenizer.Tokenizer]:  # each rank maps its node's file: it may fail on some ranks only
        tokens = open_tokens(token_file, cfg.cache_dir)
        tok = load_tokenizer(token_file, cfg.cache_dir)
        ids_of = tok.vocab if isinstance(tok, tokenizer.CharTokenizer) else tok
        corpus = CharCorpus.from_tokens(tokens, ids_of, cfg.val_fraction, token_file.train_tokens)
        corpus.check_block_size(cfg.block_size)
        return corpus, tok

    corpus, tok = distributed.on_every_rank(open_here, dist)
    return corpus, token_file, tok
