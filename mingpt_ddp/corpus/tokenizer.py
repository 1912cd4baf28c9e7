"""What turns text into token ids and back: characters, a byte-level BPE, or GPT-2's.

``data.tokenizer`` picks one:

* ``char`` (the default): every distinct character of the text is a token (char_dataset's
  Vocabulary); documents are joined by a newline.
* ``bpe``: a byte-level BPE of ``data.vocab_size`` tokens trained on the training split
  with Hugging Face ``tokenizers`` and encoded with ``tiktoken`` (the `bpe` extra), GPT-2's
  pre-tokenization, and one special ``<|endoftext|>`` token that joins documents.
  Byte-level: any text encodes, no unknown token.
* ``gpt2``: GPT-2's 50,257-token encoding through ``tiktoken`` (the `gpt2` extra). Its BPE
  file is read from tiktoken's cache (``$TIKTOKEN_CACHE_DIR``, else
  ``<tmp>/data-gym-cache``); it is downloaded there only when downloads are allowed, and
  otherwise the error says where to put it.

A tokenizer goes into every snapshot as plain data (``to_dict``), so a resume, sampling
and export use exactly the one the run trained with. Decoding joins the tokens' bytes
before turning them into text: a byte-level token may end inside a UTF-8 character, and
what no whole character is left of shows as U+FFFD, never as an error.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from mingpt_ddp.char_dataset import Vocabulary
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)

KINDS = ("char", "bpe", "gpt2")
EOT = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # the 256 bytes and <|endoftext|>


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's: the encoding's
    threads where its caller gives no count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
GPT2_VOCAB = 50257
GPT2_FILE_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
GPT2_FILE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint8 up to 256 tokens, uint16 up
    to 65,536, else uint32."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ConfigError(f"a vocabulary of {vocab_size:,} tokens is more than uint32 ids hold")


def decode_bytes(pieces: Iterable[bytes]) -> str:
    """Text of the tokens' bytes joined: a character split between tokens is whole again;
    bytes of no whole character (a sample cut off mid-character) become U+FFFD."""
    return b"".join(pieces).decode("utf-8", errors="replace")


class Tokenizer:
    """Text to ids and back. `size` ids, `separator` between documents (a text for
    `char`, the id of <|endoftext|> otherwise)."""

    kind: str

    @property
    def size(self) -> int:
        raise NotImplementedError

    @property
    def dtype(self) -> np.dtype:
        return id_dtype(self.size)

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text` (ordinary text: a literal "<|endoftext|>" in it is not the special token)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str], threads: Optional[int] = None) -> list[np.ndarray]:
        """The ids of each text; the BPEs encode the texts on `threads` threads (None: one per
        core this process may use, usable_cores)."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for (b"" for a special token)."""
        raise NotImplementedError

    eot_id: Optional[int] = None

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; <|endoftext|> shows as itself (a document boundary)."""
        eot = EOT.encode()
        return decode_bytes(eot if i == self.eot_id else self.token_bytes(i) for i in map(int, ids))

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes per id, the weights of bits per byte. <|endoftext|> counts as the one
        byte of the newline it stands for: val_bpb divides by the text of the documents joined
        by newlines, which `char` encodes with a newline token, so every tokenizer divides the
        same text by the same bytes and predicts every document boundary it holds."""
        lengths = np.array([len(self.token_bytes(i)) for i in range(self.size)], dtype=np.int32)
        if self.eot_id is not None:
            lengths[self.eot_id] = 1  # b"\n"
        return lengths

    @property
    def separator_ids(self) -> np.ndarray:
        """What goes between two documents."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int) that `from_dict` rebuilds this tokenizer from: what a
        snapshot stores."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.kind} ({self.size:,} tokens)"

    def save(self, directory: str) -> Optional[str]:
        """Write the tokenizer's own file into `directory` (export); return its name."""
        return None

    def hf_json(self) -> str:
        """This tokenizer as Hugging Face's tokenizer.json (what `export --hf` writes), giving
        the same ids for the same text."""
        raise NotImplementedError


class CharTokenizer(Tokenizer):
    """Characters: the Vocabulary of char_dataset.py, as every run had before."""

    kind = "char"

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        codepoints = np.array([ord(c) for c in vocab.chars], dtype=np.int64)
        # code point -> id; `size` marks a character outside the vocabulary
        self._table = np.full(int(codepoints.max(initial=0)) + 1, vocab.size, dtype=np.int64)
        self._table[codepoints] = np.arange(vocab.size)

    @property
    def size(self) -> int:
        return self.vocab.size

    def encode_batch(self, texts: Sequence[str], threads: Optional[int] = None) -> list[np.ndarray]:
        """One table lookup per text (as token_cache encodes files); a character outside the
        vocabulary is a ConfigError naming it."""
        out = []
        for text in texts:
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            ids = np.take(self._table, codes, mode="clip")
            if len(ids) and (ids.max() == self.size or codes.max() >= len(self._table)):
                unknown = "".join(sorted(set(text) - set(self.vocab.chars)))
                raise ConfigError(f"text has characters outside the vocabulary: {unknown!r}")
            out.append(ids.astype(self.dtype))
        return out

    def token_bytes(self, token_id: int) -> bytes:
        return self.vocab.chars[token_id].encode("utf-8")

    def decode(self, ids: Iterable[int]) -> str:
        return self.vocab.decode(ids)

    @property
    def separator_ids(self) -> np.ndarray:
        return self.encode("\n")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "char", "chars": self.vocab.chars}

    def describe(self) -> str:
        return f"char ({self.size:,} characters)"

    def hf_json(self) -> str:
        """A BPE without merges over the characters, no normalizer, no pre-tokenizer: each
        character is its own token, with its id. A character outside the vocabulary has no
        token and the format no error: Hugging Face's tokenizer drops it (no unknown token)."""
        return json.dumps({
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": {"type": "Fuse"},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {c: i for i, c in enumerate(self.vocab.chars)}, "merges": []},
        }, ensure_ascii=False)


# ---- byte-level BPE: trained by Hugging Face tokenizers, encoded by tiktoken ---------------------
# GPT-2's pre-tokenization (tiktoken's r50k pattern; Hugging Face's ByteLevel regex is the same).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def require_tiktoken(what: str):
    try:
        import tiktoken
    except ImportError:
        raise ConfigError(f"{what} needs tiktoken: pip install 'mingpt-ddp[{what.rsplit('=', 1)[-1]}]' "
                          "(or pip install tiktoken)") from None
    return tiktoken


def byte_level_json(ranks: Mapping[bytes, int], eot_id: int) -> str:
    """tokenizer.json of a byte-level BPE given as tiktoken's ranks (a token's rank is its id
    and the order its merge was learned in) and <|endoftext|>'s id: GPT-2's format. Each
    token's merge is recovered by merging its bytes by rank, stopping below its own rank: the
    two parts left are the pair it was made of."""
    char_of = {b: c for c, b in _byte_of_char().items()}

    def merge_of(token: bytes, rank: int) -> list[bytes]:
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = min(((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = merge_of(token, rank)
            if len(parts) != 2:
                raise ConfigError(f"token {rank} ({token!r}) is made by no merge of lower-ranked tokens: "
                                  "not a byte-level BPE's ranks")
            merges.append(" ".join("".join(char_of[b] for b in part) for part in parts))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": eot_id, "content": EOT, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {"".join(char_of[b] for b in token): rank for token, rank in ranks.items()},
                  "merges": merges},
    }, ensure_ascii=False)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each printable character stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class _TiktokenTokenizer(Tokenizer):
    """What the two BPEs share: a tiktoken Encoding, each id's bytes, <|endoftext|>."""

    def __init__(self, encoding, token_bytes: list[bytes], eot_id: int):
        self.encoding, self._bytes, self.eot_id = encoding, token_bytes, eot_id
        self._bytes[eot_id] = b""

    @property
    def size(self) -> int:
        return len(self._bytes)

    def encode_batch(self, texts: Sequence[str], threads: Optional[int] = None) -> list[np.ndarray]:
        dtype = self.dtype
        batch = self.encoding.encode_ordinary_batch(list(texts), num_threads=threads or usable_cores())
        return [np.array(ids, dtype=dtype) for ids in batch]

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    @property
    def separator_ids(self) -> np.ndarray:
        return np.array([self.eot_id], dtype=self.dtype)


class BpeTokenizer(_TiktokenTokenizer):
    """A byte-level BPE in Hugging Face's tokenizer.json format (what snapshots store and
    export writes), encoded with tiktoken built from the same vocabulary: a token's rank
    is its id, the order its merge was learned in, and the pre-tokenization is the same,
    so the tokens are the ones Hugging Face's BPE gives (tests compare them) at about six
    times the speed per core. Only training needs Hugging Face's library."""

    kind = "bpe"

    def __init__(self, hf_json: str):
        tiktoken = require_tiktoken("data.tokenizer=bpe")
        self.json = hf_json
        spec = json.loads(hf_json)
        byte_of = _byte_of_char()
        special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        if EOT not in special:
            raise ConfigError(f"this BPE tokenizer has no {EOT} token: it was not made by mingpt_ddp")
        ranks = {bytes(byte_of[c] for c in token): i for token, i in spec["model"]["vocab"].items()
                 if token not in special}
        token_bytes = [b""] * (max([*ranks.values(), *special.values()]) + 1)
        for token, i in ranks.items():
            token_bytes[i] = token
        encoding = tiktoken.Encoding(f"mingpt-ddp-bpe-{len(token_bytes)}", pat_str=GPT2_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=special)
        super().__init__(encoding, token_bytes, special[EOT])

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, threads: Optional[int] = None) -> "BpeTokenizer":
        """A byte-level BPE of at most `vocab_size` tokens (fewer when the text has fewer
        pairs to merge) learned from `texts`, with Hugging Face's trainer: on its thread pool
        (Rust's rayon, one per process, sized once from RAYON_NUM_THREADS when first used),
        of `threads` where given, the process's first use of the pool and RAYON_NUM_THREADS
        unset; else one per core of the machine."""
        if vocab_size < MIN_BPE_VOCAB:
            raise ConfigError(f"data.vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
                              f"{MIN_BPE_VOCAB} (256 bytes and {EOT}); e.g. data.vocab_size=4096")
        try:
            from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError:
            raise ConfigError("data.tokenizer=bpe needs Hugging Face tokenizers to train: pip install "
                              "'mingpt-ddp[bpe]' (or pip install tokenizers tiktoken)") from None
        require_tiktoken("data.tokenizer=bpe")
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        with _rayon_threads(threads):
            hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf.to_str())

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "bpe", "json": self.json}

    def hf_json(self) -> str:
        return self.json  # Hugging Face's own, as trained

    def save(self, directory: str) -> str:
        """tokenizer.json, as Hugging Face's ``tokenizers.Tokenizer.from_file`` reads it."""
        with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(self.json)
        return "tokenizer.json"


@contextlib.contextmanager
def _rayon_threads(threads: Optional[int]) -> Iterator[None]:
    """RAYON_NUM_THREADS=threads while Hugging Face's trainer builds its pool (the user's own
    value wins); restored after, so no child process inherits it."""
    if threads is None or "RAYON_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        os.environ.pop("RAYON_NUM_THREADS", None)


# ---- GPT-2 (tiktoken) ---------------------------------------------------------------------
def tiktoken_cache_dir() -> str:
    """Where tiktoken keeps its downloads (as tiktoken.load decides it)."""
    for name in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if name in os.environ:
            return os.environ[name]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def gpt2_cache_path() -> str:
    """Where tiktoken looks for GPT-2's BPE file (its r50k_base encoding, the same ranks)."""
    return os.path.join(tiktoken_cache_dir(), hashlib.sha1(GPT2_FILE_URL.encode()).hexdigest())


def _gpt2_file_is_cached() -> bool:
    path = gpt2_cache_path()
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest() == GPT2_FILE_SHA256


def load_gpt2(download: bool) -> "Gpt2Tokenizer":
    """GPT-2's encoding from tiktoken's cache; downloaded into it only when `download`.
    tiktoken itself would go to the network whenever the file is missing (and delete a
    cached file that does not match): both are checked here first."""
    tiktoken = require_tiktoken("data.tokenizer=gpt2")
    if not (download or _gpt2_file_is_cached()):
        raise ConfigError(
            f"data.tokenizer=gpt2 needs GPT-2's BPE file and tiktoken's cache has none: download {GPT2_FILE_URL} "
            f"to {gpt2_cache_path()} (sha256 {GPT2_FILE_SHA256[:12]}...; TIKTOKEN_CACHE_DIR chooses the "
            "directory), or allow downloads"
        )
    try:
        encoding = tiktoken.get_encoding("r50k_base")
    except Exception as exc:  # tiktoken raises requests' and its own errors
        raise ConfigError(f"data.tokenizer=gpt2: cannot get GPT-2's BPE file {GPT2_FILE_URL} ({exc}): put it at "
                          f"{gpt2_cache_path()} (TIKTOKEN_CACHE_DIR chooses the directory)") from None
    return Gpt2Tokenizer(encoding)


class Gpt2Tokenizer(_TiktokenTokenizer):
    kind = "gpt2"

    def __init__(self, encoding):
        if encoding.n_vocab != GPT2_VOCAB:
            raise ConfigError(f"tiktoken's {encoding.name} has {encoding.n_vocab} tokens, not GPT-2's {GPT2_VOCAB}")
        super().__init__(encoding, [encoding.decode_single_token_bytes(i) for i in range(encoding.n_vocab)],
                         encoding.eot_token)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "gpt2", "encoding": "r50k_base", "sha256": GPT2_FILE_SHA256}

    def hf_json(self) -> str:
        """GPT-2's tokenizer.json (vocab and merges), rebuilt offline from tiktoken's ranks."""
        return byte_level_json({t: i for i, t in enumerate(self._bytes) if i != self.eot_id}, self.eot_id)

    def save(self, directory: str) -> str:
        """GPT-2's ranks in tiktoken's file format, what tiktoken.load.load_tiktoken_bpe reads."""
        import base64

        with open(os.path.join(directory, "gpt2.tiktoken"), "wb") as f:
            for rank, token in enumerate(self._bytes):
                if rank != self.eot_id:
                    f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
        return "gpt2.tiktoken"


# ---- snapshots ------------------------------------------------------------------------------
def from_dict(state: Mapping[str, Any], download: bool = False) -> Tokenizer:
    kind = state.get("kind")
    if kind == "char":
        return CharTokenizer(Vocabulary(state["chars"]))
    if kind == "bpe":
        return BpeTokenizer(state["json"])
    if kind == "gpt2":
        return load_gpt2(download)
    raise ConfigError(f"unknown tokenizer kind {kind!r} (a newer mingpt_ddp's?): expected one of {', '.join(KINDS)}")


def from_export(directory: str, kind: str, file: Optional[str], chars: Optional[Iterable[str]] = None,
                eot_id: Optional[int] = None) -> Tokenizer:
    """The tokenizer an export wrote to `directory` (`save`'s file; characters are listed in its
    config.json): it needs neither a snapshot nor tiktoken's cache."""
    if kind == "char":
        return CharTokenizer(Vocabulary("".join(chars or ())))
    with open(os.path.join(directory, file or ""), "rb") as f:
        data = f.read()
    if kind == "bpe":
        return BpeTokenizer(data.decode("utf-8"))
    if kind == "gpt2":
        import base64

        tiktoken = require_tiktoken("an export with GPT-2's tokenizer")
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
        return Gpt2Tokenizer(tiktoken.Encoding("r50k_base", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                               special_tokens={EOT: GPT2_VOCAB - 1 if eot_id is None else eot_id}))
    raise ConfigError(f"unknown tokenizer kind {kind!r} (a newer mingpt_ddp's?): expected one of {', '.join(KINDS)}")


def from_snapshot(snapshot: Mapping[str, Any], download: bool = False) -> Tokenizer:
    """The tokenizer a snapshot was trained with; snapshots from before tokenizers were
    configurable hold only their characters (`vocab`)."""
    if snapshot.get("tokenizer"):
        return from_dict(snapshot["tokenizer"], download)
    return CharTokenizer(Vocabulary(snapshot["vocab"]))


def fingerprint(state: Mapping[str, Any]) -> str:
    """A short digest of a tokenizer's data (cache keys, comparisons)."""
    return hashlib.sha256(json.dumps(state, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def batched(texts: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    """`texts` grouped into lists of about `max_chars` characters: what encode_batch gets
    at once, so that all cores have work and memory stays bounded."""
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
