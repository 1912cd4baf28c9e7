"""Text to tensors: a character vocabulary, one encoded tensor, train/validation windows.

The split is contiguous (the last `val_fraction` of the text is validation) and identical
on every rank, and windows never cross it, so no validation character is ever trained on.
Training windows do not overlap within an epoch; their offset changes per epoch so every
position is a window boundary in some epoch.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import fsspec
import torch
from torch.utils.data import Dataset, DistributedSampler

from mingpt_ddp import storage
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)


def read_text(path: str) -> str:
    """Read a whole UTF-8 text through fsspec (local path or URL)."""
    try:
        with fsspec.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"data file not found: {path}: set data.path=<a UTF-8 text file or URL>"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"data.path={path} is a directory: point it at a text file") from None
    except PermissionError as exc:
        raise ConfigError(f"cannot read data file {path}: {exc}") from None
    if not raw:
        raise ConfigError(f"data file {path} is empty: put training text in it or set data.path")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"data file {path} is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}): "
            "convert it, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`, and set data.path"
        ) from None


def download(url: str, dest: str, timeout_s: float = 30.0) -> None:
    """Fetch `url` into `dest` atomically: a reader sees the whole file or none."""
    directory = os.path.dirname(os.path.abspath(dest))
    os.makedirs(directory, exist_ok=True)
    log.info("downloading %s -> %s", url, dest)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".download-")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except OSError as exc:
        raise ConfigError(
            f"data file {dest} is missing and downloading it from {url} failed ({exc}): "
            f"put a UTF-8 text file at {dest}, or set data.path=<your text file>"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def is_remote(path: str) -> bool:
    """A URL that fsspec opens with something other than the local filesystem."""
    return "://" in path and not path.startswith("file://")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mingpt_ddp", "data")


def local_copy_path(path: str, cache_dir: Optional[str]) -> str:
    """Where this node reads `path` from: itself if local, else its copy in the cache,
    named by a hash of the URL (the same name on every rank and node)."""
    if not is_remote(path):
        return path
    name = path.rstrip("/").rsplit("/", 1)[-1] or "data"
    digest = hashlib.sha256(path.encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(cache_dir or default_cache_dir()), f"{digest}-{name}")


def fetch_to_cache(url: str, storage_options: Optional[Mapping[str, Any]], local: str, retry_minutes: float) -> None:
    """Copy remote `url` to `local` unless the copy there is of the same remote version
    (fsspec's ``ukey``: size, ETag, modification time). Atomic: a temp file in the cache
    directory, then os.replace; a `.source` file next to it records the version."""
    fs, remote = storage.filesystem(url, storage_options)
    stamp = local + ".source"

    def fetch() -> None:
        if fs.isdir(remote):
            raise IsADirectoryError(url)
        version = fs.ukey(remote)
        if os.path.exists(local) and os.path.exists(stamp):
            with open(stamp, encoding="utf-8") as f:
                if f.read() == version:
                    log.info("data %s: using this node's cached copy %s", url, local)
                    return
        directory = os.path.dirname(local)
        os.makedirs(directory, exist_ok=True)
        log.info("data %s: copying to this node's cache %s", url, local)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fetch-")
        try:
            with os.fdopen(fd, "wb") as out, fs.open(remote, "rb") as src:
                shutil.copyfileobj(src, out, 8 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, local)
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(version)
            os.replace(tmp, stamp)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    fs.invalidate_cache(remote)
    try:
        storage.retry_transient(fetch, f"copying data {url}", retry_minutes)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(_fetch_error(url, local, exc, retry_minutes)) from None


def _fetch_error(url: str, local: str, exc: BaseException, retry_minutes: float) -> str:
    cache_dir = os.path.dirname(local)
    if isinstance(exc, OSError) and exc.filename and str(exc.filename).startswith(cache_dir):
        return (f"cannot keep a copy of {url} in data.cache_dir={cache_dir} ({storage.describe(exc)}): "
                "set data.cache_dir to a writable local directory")
    if isinstance(exc, FileNotFoundError):
        return f"data file not found: {url}: set data.path=<a UTF-8 text file or URL>"
    if isinstance(exc, IsADirectoryError):
        return f"data.path={url} is a directory: point it at a text file"
    if isinstance(exc, PermissionError):
        return (f"cannot read data file {url} ({storage.describe(exc)}): check the credentials (AWS_* environment, "
                "AWS_PROFILE, instance role) and data.storage_options")
    return (f"cannot read data file {url} ({storage.describe(exc)}) after retrying for trainer.load_retry_minutes="
            f"{retry_minutes:g}: check the endpoint (AWS_ENDPOINT_URL or data.storage_options), the network and the "
            "credentials")


def ensure_local_copy(path: str, url: Optional[str], storage_options: Optional[Mapping[str, Any]] = None,
                      cache_dir: Optional[str] = None, retry_minutes: float = 0.0) -> None:
    """Make the text readable from this node's disk: download a missing local `path` from
    `url` when one is configured, or copy a remote `path` into the cache directory.
    Run by one process per node (the others wait), so each node reads the store once."""
    if is_remote(path):
        fetch_to_cache(path, storage_options, local_copy_path(path, cache_dir), retry_minutes)
    elif url and not os.path.exists(path):
        download(url, path)


def _codepoints(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)


@dataclass(frozen=True)
class Vocabulary:
    """Sorted set of characters; stored in every snapshot so sampling decodes the same way."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> "Vocabulary":
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids as a compact tensor, via one table lookup over the code points (no Python loop)."""
        unknown = sorted(set(text) - set(self.chars))
        if unknown:
            raise ConfigError(f"text has characters outside the vocabulary: {''.join(unknown)!r}")
        codepoints = _codepoints(text)
        vocab_codepoints = _codepoints(self.chars).long()
        table = torch.zeros(int(vocab_codepoints.max()) + 1 if self.size else 1, dtype=torch.int32)
        table[vocab_codepoints] = torch.arange(self.size, dtype=torch.int32)
        dtype = torch.uint8 if self.size <= 256 else torch.int32
        return table[codepoints.long()].to(dtype)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CharCorpus:
    """One encoded tensor of the whole text, split contiguously into train and validation."""

    def __init__(self, text: str, val_fraction: float, vocab: Optional[Vocabulary] = None):
        self.vocab = vocab or Vocabulary.from_text(text)
        self.tokens = self.vocab.encode(text)
        n_val = int(len(self.tokens) * val_fraction)
        self.train_tokens = self.tokens[: len(self.tokens) - n_val]
        self.val_tokens = self.tokens[len(self.tokens) - n_val :]

    def check_block_size(self, block_size: int) -> None:
        """A window needs block_size + 1 tokens (inputs and shifted targets)."""
        for name, part in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if len(part) < block_size + 1:
                raise ConfigError(
                    f"data.block_size={block_size} is larger than the {name} split "
                    f"({len(part)} characters): lower data.block_size (at most {max(1, len(part) - 1)}), "
                    "change data.val_fraction, or use a larger text"
                )


class WindowDataset(Dataset):
    """Non-overlapping (input, target) windows of `block_size` starting at `offset`.

    Item i is tokens[offset + i*T : offset + (i+1)*T] and the same shifted by one.
    `batch()` gathers many windows with one indexing op instead of Python per item.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, offset: int = 0):
        self.tokens = tokens
        self.block_size = block_size
        self.offset = offset
        self._columns = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1 - self.offset) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.offset + i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.offset + indices * self.block_size
        chunks = self.tokens[starts[:, None] + self._columns].long()
        return chunks[:, :-1], chunks[:, 1:]

    def token_range(self, i: int) -> range:
        """The token positions window i reads (inputs and targets)."""
        start = self.offset + i * self.block_size
        return range(start, start + self.block_size + 1)


def epoch_offset(seed: int, epoch: int, block_size: int) -> int:
    """Where the first training window of `epoch` starts; identical on every rank."""
    if epoch == 0:
        return 0
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return int(torch.randint(block_size, (1,), generator=g))


def shuffle_seed(seed: int, epoch: int) -> int:
    """The seed of `epoch`'s window order, derived from both: with ``seed + epoch``, seed s
    at epoch e+1 would repeat seed s+1 at epoch e, and a seed sweep would train shifted
    copies of the same orders."""
    digest = hashlib.sha256(f"mingpt_ddp/window-order/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler's shuffled order, able to start part-way through an epoch.

    The epoch's order is one permutation of all windows (seeded by shuffle_seed, the same
    for every world size); rank r takes every world_size-th index from a global
    `start` position. Resuming at the number of windows all ranks consumed so far therefore
    continues with exactly the windows not yet seen, even if the world size changed.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_start(self, global_position: int) -> None:
        self.start = global_position

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(shuffle_seed(self.seed, self.epoch))
        order = torch.randperm(len(self.dataset), generator=g)
        usable = (len(order) - self.start) // self.num_replicas * self.num_replicas
        mine = order[self.start : self.start + usable][self.rank :: self.num_replicas]
        return iter(mine.tolist())

    def __len__(self) -> int:
        return max(0, len(self.dataset) - self.start) // self.num_replicas
