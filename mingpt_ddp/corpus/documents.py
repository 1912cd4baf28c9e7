"""Corpora that arrive as documents: Parquet and JSON-lines shards, read streaming.

A FineWeb-style data set is many ``.parquet`` files (one text column) or ``.jsonl`` /
``.jsonl.gz`` files (one JSON object a line with a text field); ``data.text_column``
names the column or field (default ``text``). Every other file is plain UTF-8 text and one
document (token_cache.py streams those itself).

Files are opened through fsspec (a local path or any URL with its storage options) and
read a bounded piece at a time: Parquet one row group at a time (pyarrow, the `parquet`
extra), JSON lines a line at a time (gzip decompressed on the fly). Memory stays at one
row group or one line, whatever the file's size. Null values and empty strings are not
documents and are skipped. A missing or non-text column, a line that is not a JSON
object, or a missing or non-string field is one ConfigError naming the file (and line).
"""
from __future__ import annotations

import gzip
import io
import json
import re
from typing import Any, Iterable, Iterator, Mapping, Optional

from mingpt_ddp.checkpoint import storage
from mingpt_ddp.errors import ConfigError

PARQUET = "parquet"
JSONL = "jsonl"
TEXT = "text"
# .json too: data sets ship JSON lines under that name (a file of one JSON document is refused by line)
_SUFFIXES = ((".parquet", PARQUET), (".jsonl", JSONL), (".jsonl.gz", JSONL), (".json", JSONL), (".json.gz", JSONL))


def file_format(name: str) -> str:
    """`parquet`, `jsonl` or `text`, from the file's name (a path or URL)."""
    lower = name.split("?", 1)[0].lower()
    for suffix, kind in _SUFFIXES:
        if lower.endswith(suffix):
            return kind
    return TEXT


def require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet files needs pyarrow: pip install 'mingpt-ddp[parquet]' "
                          "(or pip install pyarrow)") from None
    return pq


def _open(path: str, storage_options: Optional[Mapping[str, Any]]):
    if "://" not in path or path.startswith("file://"):
        return open(path.removeprefix("file://"), "rb")
    fs, remote = storage.filesystem(path, storage_options)
    return fs.open(remote, "rb")


def read_documents(path: str, text_column: str = "text", storage_options: Optional[Mapping[str, Any]] = None,
                   name: Optional[str] = None) -> Iterator[str]:
    """The documents of one Parquet or JSON-lines file, in file order. `name` is how
    messages call the file (default `path`)."""
    kind = file_format(name or path)
    if kind == PARQUET:
        yield from _parquet_documents(path, text_column, storage_options, name or path)
    elif kind == JSONL:
        yield from _jsonl_documents(path, text_column, storage_options, name or path)
    else:
        raise ValueError(f"{name or path} is neither a .parquet nor a .jsonl(.gz) file")


def _parquet_documents(path: str, column: str, storage_options, name: str) -> Iterator[str]:
    pq = require_pyarrow()
    import pyarrow as pa

    with _open(path, storage_options) as f:
        try:
            parquet = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as exc:
            raise ConfigError(f"data file {name} is not a readable Parquet file ({exc}): "
                              "check the file, or remove it from data.path") from None
        schema = parquet.schema_arrow
        if column not in schema.names:
            raise ConfigError(f"data file {name} has no column {column!r} (its columns: "
                              f"{', '.join(schema.names) or 'none'}): set data.text_column=<the text column>")
        kind = schema.field(column).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise ConfigError(f"data file {name}: column {column!r} holds {kind}, not text: "
                              "set data.text_column=<a string column>")
        for group in range(parquet.num_row_groups):
            values = parquet.read_row_group(group, columns=[column]).column(0)
            for chunk in values.chunks:
                for text in chunk.to_pylist():
                    if text:
                        yield text


def _jsonl_documents(path: str, field: str, storage_options, name: str) -> Iterator[str]:
    with _open(path, storage_options) as raw:
        stream = gzip.GzipFile(fileobj=raw) if name.split("?", 1)[0].lower().endswith(".gz") else raw
        try:
            for number, line in enumerate(io.TextIOWrapper(stream, encoding="utf-8", newline="\n"), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"data file {name}, line {number}: not a JSON object ({exc.msg}): "
                                      "each line of a .jsonl file must be one JSON object") from None
                if not isinstance(record, dict) or field not in record:
                    fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                    raise ConfigError(f"data file {name}, line {number}: no field {field!r} (it has: {fields}): "
                                      "set data.text_column=<the text field>")
                text = record[field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise ConfigError(f"data file {name}, line {number}: field {field!r} is a "
                                      f"{type(text).__name__}, not text: set data.text_column=<a text field>")
                if text:
                    yield text
        except UnicodeDecodeError as exc:
            raise ConfigError(f"data file {name} is not UTF-8 ({exc.reason}): convert it to UTF-8") from None
        except (gzip.BadGzipFile, EOFError) as exc:
            raise ConfigError(f"data file {name} is not a complete gzip file ({exc}): "
                              "check the file, or remove it from data.path") from None


# ---- documents as one stream ----------------------------------------------------------------
SEPARATOR = None  # the place between two documents, in a stream of text pieces


def joined(documents: Iterable[Iterable[str]]) -> Iterator[Optional[str]]:
    """The pieces of every document, with SEPARATOR between consecutive documents (not
    before the first or after the last): how a corpus of many documents is one text."""
    first = True
    for pieces in documents:
        started = False
        for piece in pieces:
            if not piece:
                continue
            if not started and not first:
                yield SEPARATOR
            started, first = True, False
            yield piece


def split_at(stream: Iterable[Optional[str]], train_chars: int) -> Iterator[tuple[bool, Optional[str]]]:
    """(is_validation, piece) for a joined stream cut after its first `train_chars`
    characters, a separator counting as one (the newline that joins documents for
    `char`): every tokenizer splits the same text at the same place as characters do."""
    seen = 0
    for piece in stream:
        size = 1 if piece is SEPARATOR else len(piece)
        if seen >= train_chars:
            yield True, piece
        elif seen + size <= train_chars:
            yield False, piece
        else:  # a text piece crossing the boundary
            cut = train_chars - seen
            yield False, piece[:cut]
            yield True, piece[cut:]
        seen += size


# A non-space character followed by ASCII whitespace: no token of GPT-2's pre-tokenization
# spans it (a token holds spaces only at its start, or only spaces), and whatever the text
# after it, the tokens before it are the same. (Python's \S is stricter than the Rust regex's.)
_CUT = re.compile(r"\S(?=[ \t\n\r\f\v])")
_CUT_WINDOW = 4096


def bpe_safe_pieces(chunks: Iterable[str], max_chars: int) -> Iterator[str]:
    """The text of `chunks` again, in pieces cut only between a non-space character and a
    space: encoding the pieces one by one with GPT-2-style pre-tokenization (the `bpe` and
    `gpt2` tokenizers) gives exactly the tokens of the whole text. A stretch of `max_chars`
    without such a place (a very long word or blob) is cut there anyway."""
    carry = ""
    for chunk in chunks:
        text = carry + chunk
        cut = _last_cut(text, max(0, len(carry) - 1))
        if cut is None and len(text) >= max_chars:
            cut = len(text)
        if cut is None:
            carry = text
            continue
        yield text[:cut]
        carry = text[cut:]
    if carry:
        yield carry


def _last_cut(text: str, start: int) -> Optional[int]:
    """The last cut place at or after `start` (searched backwards a window at a time), or None."""
    end = len(text)
    while end > start:
        low = max(start, end - _CUT_WINDOW)
        found = None
        for found in _CUT.finditer(text, low, end):
            pass
        if found is not None:
            return found.end()
        end = low + 1 if low > start else start  # keep one character of overlap: a match needs two
    return None
