"""Text to tensors: a character vocabulary, one encoded tensor, train/validation windows.

(How files become that tensor, once per node and memory-mapped, is token_cache.py's.)

The split is contiguous (the last `val_fraction` of the text is validation) and identical
on every rank, and windows never cross it, so no validation character is ever trained on.
Training windows do not overlap within an epoch; their offset changes per epoch so every
position is a window boundary in some epoch.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.utils.data import Dataset, DistributedSampler

from mingpt_ddp.errors import ConfigError


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
        vocab = vocab or Vocabulary.from_text(text)
        self._split(vocab, vocab.encode(text), val_fraction)

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, vocab: Vocabulary, val_fraction: float,
                    train_tokens: Optional[int] = None) -> "CharCorpus":
        """A corpus over ids encoded elsewhere (a memory-mapped token file): nothing copied.
        `train_tokens` puts the split where the encoder put it (subword tokenizers split
        where characters do, token_cache.py); `vocab` is then their tokenizer."""
        corpus = cls.__new__(cls)
        corpus._split(vocab, tokens, val_fraction, train_tokens)
        return corpus

    def _split(self, vocab: Vocabulary, tokens: torch.Tensor, val_fraction: float,
               train_tokens: Optional[int] = None) -> None:
        self.vocab, self.tokens = vocab, tokens
        n_val = int(len(self.tokens) * val_fraction) if train_tokens is None else len(tokens) - train_tokens
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

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """Windows `indices` as one contiguous (B, block_size + 1) block of the token dtype:
        inputs are its [:, :-1], targets its [:, 1:]."""
        starts = self.offset + indices * self.block_size
        return self.tokens[starts[:, None] + self._columns]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return split_inputs_targets(self.gather(indices).long())

    def token_range(self, i: int) -> range:
        """The token positions window i reads (inputs and targets)."""
        start = self.offset + i * self.block_size
        return range(start, start + self.block_size + 1)


def split_inputs_targets(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return block[:, :-1], block[:, 1:]


def pin(block: torch.Tensor) -> torch.Tensor:
    return block.pin_memory()


def to_device(block: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) as int64 on `device` from a gathered (B, T+1) block.

    On CUDA the block, contiguous and still in its compact token dtype, is pinned and copied
    once without blocking the host; widening and the shift happen on the GPU. (Pinning the
    strided int64 views instead makes the copy go through a pageable temporary, 8x the bytes.)
    """
    if device.type == "cuda":
        block = pin(block).to(device, non_blocking=True)
    return split_inputs_targets(block.long())


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

    def indices(self) -> torch.Tensor:
        """This rank's windows of the epoch from `start`, in order, as one int64 tensor: what
        iterating yields, without a Python int per window (seconds and GBs per rank at
        10-100M windows, issue 30)."""
        g = torch.Generator().manual_seed(shuffle_seed(self.seed, self.epoch))
        order = torch.randperm(len(self.dataset), generator=g)
        usable = (len(order) - self.start) // self.num_replicas * self.num_replicas
        return order[self.start : self.start + usable][self.rank :: self.num_replicas].clone()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return max(0, len(self.dataset) - self.start) // self.num_replicas
