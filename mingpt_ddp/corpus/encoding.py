"""A corpus's documents to token ids, for every tokenizer, streaming.

token_cache.py decides which files, where the token file lives and when it is reused;
this module reads the files as one stream of documents and writes their ids. Plain text
files are one document each (token_cache's UTF-8 chunks); Parquet and JSON-lines files
are one document per row (documents.py). Documents are joined by the tokenizer's
separator: a newline for `char`, <|endoftext|> for `bpe` and `gpt2`.

The training/validation split is where characters put it: after the first
``total - int(total * val_fraction)`` characters of the documents joined by newlines, so
every tokenizer validates on the same text (and `val_bpb` compares them). For `bpe` and
`gpt2` the two sides are encoded separately (no token spans the split) and the token file
records how many tokens are training tokens. The BPE is trained on the training side only
(at most `train_chars` of it), so no validation text shapes its merges.

Passes over the files, each streaming (memory: a bounded batch of text and its ids):
1. count the characters (and, for `char`, collect them);
2. `bpe` only: train the tokenizer on the training side;
3. encode, in batches on `threads` threads (tiktoken's; the caller's count: the cores the
   run may use, distributed.encode_threads; default this process's cores), with a progress
   line every PROGRESS_S seconds.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from mingpt_ddp.corpus import documents, tokenizer
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)

BATCH_CHARS_PER_CORE = 1 << 20  # text encoded at once per core
MAX_PIECE_CHARS = 16 << 20  # a stretch of text without a space is cut here (documents.bpe_safe_pieces)
PROGRESS_S = 10.0


@dataclass(frozen=True)
class Scan:
    chars: int  # characters of the documents joined by newlines
    distinct: str  # the sorted distinct characters (newline included when there are two documents or more)
    documents: int
    sha256: str = ""  # of the documents' UTF-8 text, each boundary hashed as a byte UTF-8 never has
    text_bytes: int = 0  # UTF-8 bytes of the documents joined by newlines (what val_bpb and MB/s count)


DOCUMENT_BOUNDARY = b"\xff"  # in the hash only: no UTF-8 text holds this byte, so no text can fake a boundary


def scan(stream_of_documents: Callable[[], Iterable[Iterable[str]]], collect_chars: bool) -> Scan:
    """Pass 1: count characters, bytes and documents, hash the text (what nodes compare:
    two copies of a corpus with other text never pass for one); collect the distinct
    characters if asked."""
    count, size, docs, seen, digest = 0, 0, 0, set(), hashlib.sha256()
    for piece in documents.joined(stream_of_documents()):
        if piece is documents.SEPARATOR:
            count += 1
            size += 1
            docs += 1
            digest.update(DOCUMENT_BOUNDARY)
            if collect_chars:
                seen.add("\n")
            continue
        data = piece.encode("utf-8")
        digest.update(data)
        count += len(piece)
        size += len(data)
        if collect_chars:
            seen.update(piece)
    if count == 0:
        raise ConfigError("the corpus has no text: every document is empty")
    return Scan(count, "".join(sorted(seen)), docs + 1, digest.hexdigest(), size)


def train_chars(total_chars: int, val_fraction: float) -> int:
    """Where the split falls, in characters (as CharCorpus splits a character corpus)."""
    return total_chars - int(total_chars * val_fraction)


def train_bpe(stream_of_documents: Callable[[], Iterable[Iterable[str]]], split: int, vocab_size: int,
              max_chars: int, threads: Optional[int] = None) -> tokenizer.BpeTokenizer:
    """Pass 2: a BPE learned from the training side of the corpus, at most `max_chars` of it,
    on `threads` threads (BpeTokenizer.train)."""

    def training_text() -> Iterator[str]:
        left = min(split, max_chars)
        for is_val, piece in documents.split_at(documents.joined(stream_of_documents()), split):
            if is_val or left <= 0:
                return
            if piece is not documents.SEPARATOR:
                yield piece[:left]
                left -= len(piece)

    started = time.perf_counter()
    tok = tokenizer.BpeTokenizer.train(training_text(), vocab_size, threads)
    log.info("trained a byte-level BPE of %s tokens on %.1f M characters of the training split in %.1f s",
             f"{tok.size:,}", min(split, max_chars) / 1e6, time.perf_counter() - started)
    if tok.size < vocab_size:
        log.warning("the BPE has %s tokens, not data.vocab_size=%s: the training text has no more pairs to merge",
                    f"{tok.size:,}", f"{vocab_size:,}")
    return tok


class _Progress:
    def __init__(self, total_chars: int, what: str):
        self.total, self.what = total_chars, what
        self.started = self.last = time.perf_counter()

    def update(self, done_chars: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_S:
            self.last = now
            rate = done_chars / 1e6 / (now - self.started)
            left = (self.total - done_chars) / 1e6 / max(rate, 1e-9)
            log.info("%s: encoded %.0f%% (%.0f of %.0f M characters, %.1f M/s, about %.0f s left)", self.what,
                     100 * done_chars / self.total, done_chars / 1e6, self.total / 1e6, rate, left)


def write_tokens(tok: tokenizer.Tokenizer, stream_of_documents: Callable[[], Iterable[Iterable[str]]],
                 split: int, total_chars: int, out, what: str = "data",
                 threads: Optional[int] = None) -> tuple[int, int]:
    """Pass 3: the ids of every document, separators between them, into the open file
    `out`, on `threads` threads (None: this process's cores, tokenizer.usable_cores) in
    batches of BATCH_CHARS_PER_CORE per thread; returns (tokens written, tokens before the
    split). Text files' pieces are cut where the pre-tokenization splits anyway, so the ids
    are those of whole documents."""
    safe = not isinstance(tok, tokenizer.CharTokenizer)

    def items() -> Iterator[tuple[bool, Optional[str]]]:
        docs = stream_of_documents()
        if safe:
            docs = (documents.bpe_safe_pieces(doc, MAX_PIECE_CHARS) for doc in docs)
        yield from documents.split_at(documents.joined(docs), split)

    threads = max(1, threads or tokenizer.usable_cores())
    batch_chars = BATCH_CHARS_PER_CORE * threads
    separator = None  # only when there is a second document: `char` may know no newline otherwise
    written, train_tokens, done = 0, None, 0
    batch: list[Optional[str]] = []
    size = 0
    progress = _Progress(total_chars, what)

    def flush() -> None:
        nonlocal written, batch, size, separator
        texts = [p for p in batch if p is not documents.SEPARATOR]
        encoded = iter(tok.encode_batch(texts, threads)) if texts else iter(())
        for piece in batch:
            if piece is documents.SEPARATOR and separator is None:
                separator = tok.separator_ids
            ids = separator if piece is documents.SEPARATOR else next(encoded)
            out.write(ids.tobytes())
            written += len(ids)
        batch, size = [], 0

    for is_val, piece in items():
        if is_val and train_tokens is None:
            flush()
            train_tokens = written
        batch.append(piece)
        size += 1 if piece is documents.SEPARATOR else len(piece)
        done += 1 if piece is documents.SEPARATOR else len(piece)
        if size >= batch_chars:
            flush()
            progress.update(done)
    flush()
    return written, written if train_tokens is None else train_tokens
