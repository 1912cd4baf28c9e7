"""Documents to token ids for every tokenizer: the split where characters split it, BPE
trained on the training side only, streaming pieces that give the tokens of whole
documents, separators between documents, progress."""
import io
import logging

import numpy as np
import pytest

from mingpt_ddp.corpus import encoding, tokenizer
from mingpt_ddp.char_dataset import CharCorpus, Vocabulary
from mingpt_ddp.errors import ConfigError

pytestmark = pytest.mark.unit

TRAIN_WORDS = "alpha beta gamma delta, the quick brown fox. "
VAL_WORD = "zyzzyva "


def corpus_documents():
    """Three documents; the validation side (VAL_CHARS at the end) is a word the others never use."""
    return [TRAIN_WORDS * 40, "naïve café ☃\n" * 30 + TRAIN_WORDS * 10, "filler " * 100 + VAL_WORD * 60]


VAL_CHARS = len(VAL_WORD) * 60


def val_fraction_for(docs, val_chars=VAL_CHARS):
    total = len("\n".join(docs))
    return (val_chars + 0.5) / total  # int(total * fraction) == val_chars


def as_stream(docs, chunk=50):
    """Documents as streams of chunks, as token_cache reads a text file."""
    return lambda: ([d[i:i + chunk] for i in range(0, len(d), chunk)] for d in docs)


def ids_written(tok, docs, val_fraction=None):
    stream = as_stream(docs)
    total = encoding.scan(stream, collect_chars=False).chars
    split = encoding.train_chars(total, val_fraction_for(docs) if val_fraction is None else val_fraction)
    out = io.BytesIO()
    written, train = encoding.write_tokens(tok, stream, split, total, out)
    ids = np.frombuffer(out.getvalue(), dtype=tok.dtype)
    assert len(ids) == written
    return ids, train, split


def test_scan_counts_the_text_joined_by_newlines_and_its_characters():
    docs = corpus_documents()
    found = encoding.scan(as_stream(docs), collect_chars=True)
    joined = "\n".join(docs)
    assert (found.chars, found.distinct, found.documents) == (len(joined), "".join(sorted(set(joined))), 3)
    with pytest.raises(ConfigError, match="no text"):
        encoding.scan(as_stream(["", ""]), collect_chars=True)


def test_char_ids_are_todays_character_corpus_bit_for_bit():
    docs = corpus_documents()
    found = encoding.scan(as_stream(docs), collect_chars=True)
    tok = tokenizer.CharTokenizer(Vocabulary(found.distinct))
    ids, train, split = ids_written(tok, docs)
    old = CharCorpus("\n".join(docs), val_fraction_for(docs))
    assert ids.tolist() == old.tokens.tolist() and ids.dtype == np.uint8
    assert train == split == len(old.train_tokens) == len(old.tokens) - VAL_CHARS


def test_bpe_is_trained_on_the_training_side_only_and_the_split_is_where_characters_split():
    docs = corpus_documents()
    stream = as_stream(docs)
    total = encoding.scan(stream, collect_chars=False).chars
    split = encoding.train_chars(total, val_fraction_for(docs))
    joined = "\n".join(docs)
    assert joined[split:] == VAL_WORD * 60 and VAL_WORD.strip() not in joined[:split]
    tok = encoding.train_bpe(stream, split, 400, max_chars=10**9)
    assert len(tok.encode(VAL_WORD)) == len(VAL_WORD)  # never merged: not in the training text
    assert len(tok.encode("quick brown")) <= 3  # merged: in it
    ids, train, _ = ids_written(tok, docs)
    eot = [tok.eot_id]
    assert ids[:train].tolist() == [*tok.encode(docs[0]), *eot, *tok.encode(docs[1]), *eot,
                                    *tok.encode("filler " * 100)]
    assert ids[train:].tolist() == tok.encode(VAL_WORD * 60).tolist()
    assert tok.decode(ids[train:]) == joined[split:]


def test_a_training_cap_limits_what_bpe_learns_from():
    docs = [TRAIN_WORDS * 40 + "unusualword " * 40, VAL_WORD * 60]
    capped = encoding.train_bpe(as_stream(docs), 10**9, 400, max_chars=len(TRAIN_WORDS) * 40)
    full = encoding.train_bpe(as_stream(docs), 10**9, 400, max_chars=10**9)
    assert len(capped.encode("unusualword")) > len(full.encode("unusualword"))


def test_bpe_pieces_give_the_ids_of_whole_documents():
    docs = corpus_documents()
    tok = tokenizer.BpeTokenizer.train(docs[:2], 400)
    ids, train, _ = ids_written(tok, docs, val_fraction=0.0001)  # the split in the last document
    expected = [*tok.encode(docs[0]), tok.eot_id, *tok.encode(docs[1]), tok.eot_id]
    assert ids[:len(expected)].tolist() == expected


def test_long_encodings_report_progress(caplog, monkeypatch):
    monkeypatch.setattr(encoding, "PROGRESS_S", 0.0)
    monkeypatch.setattr(encoding, "BATCH_CHARS_PER_CORE", 100)
    tok = tokenizer.CharTokenizer(Vocabulary(encoding.scan(as_stream(corpus_documents()), True).distinct))
    with caplog.at_level(logging.INFO, logger="mingpt_ddp.corpus.encoding"):
        ids_written(tok, corpus_documents())
    lines = [r.getMessage() for r in caplog.records if "encoded" in r.getMessage()]
    assert len(lines) > 5 and "M characters" in lines[-1] and "s left" in lines[-1]


# ---- issue 32 item 5: the encoding uses the threads the run may use ----------------------------------
def test_the_encoding_runs_on_the_threads_it_is_given_not_the_machines_cores(monkeypatch):
    """tiktoken got os.cpu_count() threads and batches of that many cores' text: every core of
    the machine, those outside the process's affinity and trainer.cpu_threads included."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(encoding, "BATCH_CHARS_PER_CORE", 100)
    docs = corpus_documents()
    tok = tokenizer.BpeTokenizer.train([TRAIN_WORDS * 20], 300)
    calls, original = [], tok.encoding.encode_ordinary_batch

    def spy(texts, *, num_threads):
        calls.append((num_threads, sum(map(len, texts))))
        return original(texts, num_threads=num_threads)

    monkeypatch.setattr(tok.encoding, "encode_ordinary_batch", spy)
    stream = as_stream(docs)
    total = encoding.scan(stream, collect_chars=False).chars
    outputs = {}
    for threads, expected in ((None, 2), (3, 3)):  # None: this process's affinity, not os.cpu_count()
        calls.clear()
        out = io.BytesIO()
        encoding.write_tokens(tok, stream, total, total, out, **({} if threads is None else {"threads": threads}))
        assert {n for n, _ in calls} == {expected}, calls
        assert max(chars for _, chars in calls) <= 100 * expected + 60, calls  # 100 characters per thread, + a piece
        outputs[threads] = out.getvalue()
    assert outputs[3] == outputs[None]  # the same ids, whatever the threads


def test_bpe_training_runs_on_the_threads_it_is_given(monkeypatch):
    """Hugging Face's trainer sizes its pool (rayon) from RAYON_NUM_THREADS when first used:
    set while it trains, unset after (no child inherits it); the user's own value wins."""
    import os

    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    seen = []

    def texts():
        seen.append(os.environ.get("RAYON_NUM_THREADS"))
        yield TRAIN_WORDS * 20

    tokenizer.BpeTokenizer.train(texts(), 300, threads=3)
    assert seen == ["3"] and "RAYON_NUM_THREADS" not in os.environ
    monkeypatch.setenv("RAYON_NUM_THREADS", "5")
    tokenizer.BpeTokenizer.train(texts(), 300, threads=3)
    assert seen[-1] == "5" and os.environ["RAYON_NUM_THREADS"] == "5"
