"""Corpora as token files: encoded once per node by streaming, memory-mapped by every rank,
bit-identical to encoding the whole text in memory; many files; the cache; bad input."""
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

from conftest import MAIN, REPO, TINY, TORCHRUN, load_snapshot, output, read_metrics, run_cli, s3_options
from mingpt_ddp import char_dataset, config, distributed
from mingpt_ddp.corpus import token_cache
from mingpt_ddp.char_dataset import CharCorpus, Vocabulary, to_device
from mingpt_ddp.config import OptimizerConfig, Precision, TrainerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.trainer import Trainer

SINGLE = distributed.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                             device=torch.device("cpu"), backend="gloo")


def load(path, cache, vocab=None, options=None, val_fraction=0.1):
    """What load_corpus does on one process: the token file, mapped, as a corpus."""
    token_file = token_cache.prepare(str(path), None, options or {}, str(cache), 0.0, vocab)
    tokens = token_cache.open_tokens(token_file, str(cache))
    return CharCorpus.from_tokens(tokens, Vocabulary(token_file.chars), val_fraction), token_file


def todays_corpus(text_bytes, val_fraction=0.1, vocab=None):
    """The code path before token files: the whole text decoded and encoded in memory."""
    return CharCorpus(text_bytes.decode("utf-8"), val_fraction, vocab)


def make_trainer(corpus, metrics=None, **trainer_kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=corpus.vocab.size, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    cfg = TrainerConfig(batch_size=4, precision=Precision("fp32"), seed=1337, **trainer_kw)
    return Trainer(cfg, OptimizerConfig(warmup_steps=0), model, corpus, SINGLE,
                   metrics or MetricsLog(None, enabled=False, total_steps=0), saver=None, snapshot_metadata={})


# ---- the same results as before ------------------------------------------------------------
@pytest.mark.unit
def test_token_file_gives_todays_vocabulary_split_windows_order_and_losses_bit_for_bit(shakespeare, tmp_path):
    old = todays_corpus(shakespeare.read_bytes())
    new, token_file = load(shakespeare, tmp_path / "cache")
    assert token_file.dtype == "uint8" and token_file.encode_s is not None
    assert new.vocab == old.vocab
    assert torch.equal(new.train_tokens.long(), old.train_tokens.long())
    assert torch.equal(new.val_tokens.long(), old.val_tokens.long())
    trainers = [make_trainer(old), make_trainer(new)]
    for epoch in (0, 1):  # epoch 1 starts at a seeded offset
        for t in trainers:
            t.state.epoch = epoch
        for old_step, new_step in zip(*(t.step_batches() for t in trainers), strict=True):
            for (xo, yo), (xn, yn) in zip(old_step, new_step, strict=True):
                assert torch.equal(xo, xn) and torch.equal(yo, yn) and xn.dtype == torch.long
    for t in trainers:
        t.state.epoch = 0
    losses = []
    for t in trainers:
        torch.manual_seed(1)  # the same dropout draws
        losses.append([t._optimizer_step(batch).item() for batch in list(t.step_batches())[:5]])
    assert losses[0] == losses[1]  # exactly
    assert trainers[0].evaluate() == trainers[1].evaluate()


@pytest.mark.unit
def test_characters_split_between_chunks_are_decoded_and_encoded_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 7)  # every multi-byte character straddles some boundary
    text = ("naïve café, 東京 ☃ 𝄞 done.\n" * 50 + "plain ascii tail " * 20).encode()
    (tmp_path / "t.txt").write_bytes(text)
    new, _ = load(tmp_path / "t.txt", tmp_path / "cache")
    old = todays_corpus(text)
    assert new.vocab == old.vocab and torch.equal(new.tokens.long(), old.tokens.long())


@pytest.mark.unit
def test_more_than_256_characters_use_uint16_ids(tmp_path):
    text = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 300)).encode() * 3
    (tmp_path / "cjk.txt").write_bytes(text)
    new, token_file = load(tmp_path / "cjk.txt", tmp_path / "cache")
    assert token_file.dtype == "uint16" and new.tokens.dtype == torch.uint16
    assert torch.equal(new.tokens.long(), todays_corpus(text).tokens.long())


# ---- many files ------------------------------------------------------------------------------
def write_parts(directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "b.txt").write_text("second file, bbb", encoding="utf-8")
    (directory / "a.txt").write_text("first file, aaa", encoding="utf-8")
    (directory / "c.md").write_text("third: ccc", encoding="utf-8")
    (directory / "empty.txt").write_text("")
    (directory / ".hidden").write_text("never read: XYZ")
    (directory / "sub").mkdir(exist_ok=True)
    (directory / "sub" / "nested.txt").write_text("never read: QRS")


@pytest.mark.unit
def test_directory_and_glob_are_their_sorted_files_joined_by_newlines(tmp_path, caplog):
    write_parts(tmp_path / "corpus")
    with caplog.at_level(logging.WARNING):
        whole, made = load(tmp_path / "corpus", tmp_path / "cache")
    assert whole.vocab.decode(whole.tokens) == "first file, aaa\nsecond file, bbb\nthird: ccc"
    assert "empty.txt is empty: skipped" in caplog.text
    some, _ = load(f"{tmp_path}/corpus/*.txt", tmp_path / "cache")
    assert some.vocab.decode(some.tokens) == "first file, aaa\nsecond file, bbb"
    assert "\n" in some.vocab.chars  # the separator is a character of the vocabulary
    # corpus_bytes (bytes per token, MB/s) counts the joined text, separators included, as
    # the document formats do (review of issue 29, defect 10)
    assert made.corpus_bytes == len("first file, aaa\nsecond file, bbb\nthird: ccc".encode())


@pytest.mark.s3
def test_directory_and_glob_on_s3(seaweedfs, tmp_path):
    bucket = f"corpus-{uuid.uuid4().hex[:10]}"
    seaweedfs.make_bucket(bucket)
    client = seaweedfs.client()
    for key, body in {"books/b.txt": "second, bbb", "books/a.txt": "first, aaa", "books/notes.md": "md",
                      "books/empty.txt": "", "books/deeper/x.txt": "never read"}.items():
        client.put_object(Bucket=bucket, Key=key, Body=body.encode())
    options, cache = s3_options(seaweedfs), tmp_path / "cache"
    whole, first = load(f"s3://{bucket}/books/", cache, options=options)
    assert whole.vocab.decode(whole.tokens) == "first, aaa\nsecond, bbb\nmd"
    some, _ = load(f"s3://{bucket}/books/*.txt", cache, options=options)
    assert some.vocab.decode(some.tokens) == "first, aaa\nsecond, bbb"
    again, second = load(f"s3://{bucket}/books/", cache, options=options)
    assert second.encode_s is None and second.name == first.name  # nothing changed: reused
    client.put_object(Bucket=bucket, Key="books/a.txt", Body=b"first, changed")
    changed, third = load(f"s3://{bucket}/books/", cache, options=options)
    assert third.name != first.name and changed.vocab.decode(changed.tokens).startswith("first, changed\n")
    with pytest.raises(ConfigError, match="matches no file"):
        load(f"s3://{bucket}/books/*.csv", cache, options=options)


# ---- the cache -------------------------------------------------------------------------------
@pytest.mark.unit
def test_token_file_is_reused_and_remade_when_a_source_changes(tmp_path, small_corpus, monkeypatch):
    (tmp_path / "text.txt").write_bytes(small_corpus.read_bytes())
    cache = tmp_path / "cache"
    _, first = load(tmp_path / "text.txt", cache)
    assert first.encode_s is not None

    def must_not_read(sources):
        raise AssertionError("the text was read again")

    monkeypatch.setattr(token_cache, "text_chunks", must_not_read)
    _, second = load(tmp_path / "text.txt", cache)
    assert second == dataclasses.replace(first, encode_s=None)
    monkeypatch.undo()
    # The snapshot's (larger) vocabulary: another file, the first pass not repeated.
    wider = first.chars + "~"
    corpus, with_vocab = load(tmp_path / "text.txt", cache, vocab=wider)
    assert with_vocab.name != first.name and corpus.vocab.chars == wider
    files = os.listdir(cache / "tokens")
    # (the encode-once lock file stays: every waiter must lock the same file)
    assert sorted(n for n in files if not n.endswith((".json", ".lock"))) == sorted([first.name, with_vocab.name])
    assert len([n for n in files if n.endswith(".json")]) == 1  # one index entry: the text was read once
    with open(tmp_path / "text.txt", "a") as f:
        f.write("more text")
    corpus, third = load(tmp_path / "text.txt", cache)
    assert third.name != first.name and corpus.vocab.decode(corpus.tokens[-9:]) == "more text"
    # The earlier version may still be in use (by another node sharing the cache): it stays
    # until nobody has used it for a day.
    assert first.name in os.listdir(cache / "tokens")
    day_ago = time.time() - token_cache.UNUSED_FOR_S - 60
    for name in (first.name, with_vocab.name):
        os.utime(cache / "tokens" / name, (day_ago, day_ago))
    load(tmp_path / "text.txt", cache)
    left = os.listdir(cache / "tokens")
    assert first.name not in left and with_vocab.name not in left and third.name in left


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_live_runs_cache_files_survive_another_jobs_clean_up_a_day_later(tmp_path, small_corpus, monkeypatch,
                                                                            kind):
    """Another job's prepare on the same data.cache_dir removes what nobody touched for a day
    (remove_unused). A run training for longer keeps touching its token file, index entry,
    tokenizer and trained BPE, so its restart maps them instead of encoding (and training the
    BPE) again while its other ranks wait (issue 29, defect 6)."""
    if kind == "bpe":
        pytest.importorskip("tokenizers")
        pytest.importorskip("tiktoken")
    monkeypatch.setattr(token_cache, "KEEP_FRESH_S", 0.1, raising=False)  # an hour, seen in a tenth of a second
    data = config.DataConfig(path=str(small_corpus), cache_dir=str(tmp_path / "cache"), block_size=16,
                             tokenizer=kind, vocab_size=300)
    token_cache.load_corpus(data, SINGLE, 0.0)  # the run starts, and trains on
    directory = token_cache.tokens_dir(data.cache_dir)
    runs_files = sorted(n for n in os.listdir(directory) if not n.endswith(".lock"))
    assert len(runs_files) == (2 if kind == "char" else 5)  # + counts, tokenizer, trained BPE
    earlier = os.path.join(directory, "0123-an-earlier-text.uint8")
    open(earlier, "wb").write(b"x")
    day_ago = time.time() - token_cache.UNUSED_FOR_S - 60
    for name in [*runs_files, os.path.basename(earlier)]:  # a day goes by
        os.utime(os.path.join(directory, name), (day_ago, day_ago))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.getmtime(os.path.join(directory, n)) < time.time() - 3600
                                              for n in runs_files):
        time.sleep(0.05)
    token_cache.remove_unused(directory)  # another job's prepare
    left = set(os.listdir(directory))
    assert os.path.basename(earlier) not in left  # unused files still go
    assert set(runs_files) <= left, sorted(set(runs_files) - left)
    again = token_cache.prepare(str(small_corpus), None, {}, data.cache_dir, 0.0,
                                tokenization=token_cache.tokenization(data))
    assert again.encode_s is None  # the restart reuses them


@pytest.mark.unit
def test_nodes_with_their_own_copy_of_one_path_share_a_cache_without_deleting_each_others_files(
        tmp_path, small_corpus):
    """Per-node copies of the text at the same path (other modification times) and one
    cache on a shared filesystem: a node never deletes the token file another node has
    just made and is about to map (item 4)."""
    text, cache = tmp_path / "corpus.txt", tmp_path / "shared-cache"
    text.write_bytes(small_corpus.read_bytes())
    node_a_mtime, node_b_mtime = 1_600_000_000_000_000_000, 1_700_000_000_000_000_000
    os.utime(text, ns=(node_a_mtime, node_a_mtime))
    node_a = token_cache.prepare(str(text), None, {}, str(cache), 0.0)
    os.utime(text, ns=(node_b_mtime, node_b_mtime))  # node B's copy: same path, same text, another mtime
    node_b = token_cache.prepare(str(text), None, {}, str(cache), 0.0)
    for made in (node_a, node_b):  # then each node's ranks map their node's file
        tokens = token_cache.open_tokens(made, str(cache))
        assert Vocabulary(made.chars).decode(tokens[:200]) == small_corpus.read_text()[:200]
    assert node_b.encode_s is None and node_b.name == node_a.name  # the same text: encoded once
    os.utime(text, ns=(node_a_mtime, node_a_mtime))
    again = token_cache.prepare(str(text), None, {}, str(cache), 0.0)
    assert again.encode_s is None and again.name == node_a.name


@pytest.mark.unit
def test_other_text_under_the_same_path_size_and_mtime_is_never_taken_for_the_cached_one(tmp_path):
    """Name, size and modification time do not decide what a file holds (a per-node copy
    made with preserved times, an image built with fixed mtimes): the cache must not hand
    out another text's token file."""
    text, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    text.write_text("abcdefgh" * 500)
    os.utime(text, ns=(1_000_000_000, 1_000_000_000))
    first, _ = load(text, cache)
    text.write_text("hgfedcba" * 500)  # same size
    os.utime(text, ns=(1_000_000_000, 1_000_000_000))  # same mtime
    second, _ = load(text, cache)
    assert second.vocab.decode(second.tokens[:8]) == "hgfedcba"


@pytest.mark.unit
def test_a_token_file_that_is_missing_at_open_is_explained_by_what_happened(tmp_path, small_corpus):
    cache = tmp_path / "cache"
    made = token_cache.prepare(str(small_corpus), None, {}, str(cache), 0.0)
    with pytest.raises(ConfigError) as err:  # this process resolves another data.cache_dir
        token_cache.open_tokens(made, str(tmp_path / "elsewhere"))
    assert "data.cache_dir" in str(err.value) and str(tmp_path / "elsewhere") in str(err.value)
    assert str(cache) in str(err.value)
    os.unlink(cache / "tokens" / made.name)  # the same directory, but the file was removed meanwhile
    with pytest.raises(ConfigError) as err:
        token_cache.open_tokens(made, str(cache))
    assert "was removed or truncated" in str(err.value) and "data.cache_dir" not in str(err.value)


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.unit
def test_bytes_that_are_not_utf8_name_the_file_and_the_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 1000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("fine\n" * 10)
    (tmp_path / "d" / "b.txt").write_bytes(("é" * 1500).encode() + "café".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"data file .*b\.txt is not UTF-8 text \(byte 3,003: b'\\xe9'\).*iconv"):
        load(tmp_path / "d", tmp_path / "cache")
    (tmp_path / "cut.txt").write_bytes(b"abc" + "é".encode()[:1])  # cut inside the last character
    with pytest.raises(ConfigError, match=r"cut\.txt is not UTF-8 text \(byte 3:"):
        load(tmp_path / "cut.txt", tmp_path / "cache")


@pytest.mark.unit
def test_a_directory_or_glob_that_matches_no_file(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="the directory matches no file"):
        load(tmp_path / "empty_dir", tmp_path / "cache")
    with pytest.raises(ConfigError, match="the glob matches no file"):
        load(f"{tmp_path}/*.nothing", tmp_path / "cache")
    with pytest.raises(ConfigError, match="data file not found"):
        load(tmp_path / "missing.txt", tmp_path / "cache")


@pytest.mark.unit
def test_empty_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("")
    (tmp_path / "d" / "b.txt").write_text("")
    with pytest.raises(ConfigError, match="every file data.path=.* matches is empty"):
        load(tmp_path / "d", tmp_path / "cache")
    with pytest.raises(ConfigError, match="a.txt is empty"):
        load(tmp_path / "d" / "a.txt", tmp_path / "cache")


@pytest.mark.unit
def test_more_distinct_characters_than_uint16_ids_hold(tmp_path):
    (tmp_path / "wide.txt").write_bytes("".join(chr(c) for c in range(0x10000, 0x10000 + 65_537)).encode())
    with pytest.raises(ConfigError, match="has 65,537 distinct characters, more than the 65,536"):
        load(tmp_path / "wide.txt", tmp_path / "cache")


@pytest.mark.unit
def test_a_cache_directory_that_is_not_writable(tmp_path, small_corpus):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match="cannot write the token cache in data.cache_dir=.*a_file"):
        load(small_corpus, tmp_path / "a_file")


@pytest.mark.unit
@pytest.mark.parametrize("during", ["find_characters", "write_ids"])
def test_a_source_that_changes_while_being_encoded(tmp_path, monkeypatch, during):
    path = tmp_path / "growing.txt"
    path.write_text("the first part of a file someone is still writing\n" * 100)
    encoding_pass = getattr(token_cache, during)

    def writer_appends_meanwhile(*args):
        result = encoding_pass(*args)
        with open(path, "a") as f:
            f.write("and more\n")
        return result

    monkeypatch.setattr(token_cache, during, writer_appends_meanwhile)
    with pytest.raises(ConfigError, match="growing.txt changed while it was being encoded"):
        load(path, tmp_path / "cache")
    assert not [n for n in os.listdir(tmp_path / "cache" / "tokens") if n.endswith(("uint8", "uint16"))]


@pytest.mark.cli
def test_bad_inputs_from_the_command_line_are_one_error_line(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("fine text\n" * 500)
    (tmp_path / "d" / "b.txt").write_bytes(b"ok " + "é".encode("latin-1"))
    for data_path, message in ((tmp_path / "d", "b.txt is not UTF-8 text (byte 3"),
                               (f"{tmp_path}/*.none", "the glob matches no file")):
        proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={data_path}",
                        f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=2"], timeout=120)
        assert proc.returncode == 2 and message in output(proc) and "Traceback" not in output(proc), output(proc)


# ---- the batch copy to an accelerator (issue 12, finding 3) ------------------------------------
@pytest.mark.unit
def test_batches_reach_the_gpu_as_one_pinned_contiguous_copy_of_the_token_dtype(shakespeare, monkeypatch):
    """With a CUDA device, each micro-batch is gathered as one contiguous (B, T+1) uint8
    block, pinned, copied once non-blocking, and only then widened and shifted."""
    corpus = todays_corpus(shakespeare.read_bytes())
    trainer = make_trainer(corpus, grad_accum_steps=2)
    expected = list(trainer.step_batches())[:3]
    pinned, copies = [], []

    class PinnedBlock:
        def __init__(self, block):
            self.block = block

        def to(self, device, non_blocking=False):
            copies.append((device, non_blocking))
            return self.block.clone()  # stands for the device copy

    def fake_pin(block):
        pinned.append(block)
        return PinnedBlock(block)

    monkeypatch.setattr(char_dataset, "pin", fake_pin)
    trainer.device = torch.device("cuda", 0)  # CUDA reported: the trainer takes the pinned path
    got = list(trainer.step_batches())[:3]
    assert len(pinned) == len(copies) == len(trainer.sampler) // 4
    for block in pinned:
        assert block.dtype == torch.uint8 and block.shape == (4, 17) and block.is_contiguous()
    assert set(copies) == {(torch.device("cuda", 0), True)}
    for step_got, step_expected in zip(got, expected, strict=True):
        for (x, y), (xe, ye) in zip(step_got, step_expected, strict=True):
            assert torch.equal(x, xe) and torch.equal(y, ye) and x.dtype == torch.long
    x, y = to_device(torch.arange(12, dtype=torch.uint8).view(2, 6), torch.device("cpu"))
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (2, 5)


# ---- evaluation on big corpora ---------------------------------------------------------------
@pytest.mark.unit
def test_periodic_evaluations_are_bounded_and_the_final_one_reads_the_whole_split(shakespeare, tmp_path):
    corpus = todays_corpus(shakespeare.read_bytes())  # 4,000 validation characters: 249 windows of 16
    metrics = MetricsLog(str(tmp_path / "metrics.jsonl"), enabled=True, total_steps=0)
    trainer = make_trainer(corpus, metrics, eval_batches=3, max_steps=2, eval_every=1)
    assert trainer.eval_windows() == 12 and trainer.eval_windows(final=True) == len(trainer.val_windows) == 249
    trainer.fit()
    metrics.close()
    vals = [r for r in read_metrics(tmp_path) if "val_loss" in r]
    # the last step has no periodic evaluation: the final one, over the whole split, is its
    assert [(r["step"], r["val_windows"]) for r in vals] == [(1, 12), (2, 249)]
    bounded = make_trainer(corpus, eval_batches=3, final_eval_batches=5)
    assert bounded.eval_windows(final=True) == 20


# ---- a big corpus under torchrun -------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_a_60mb_corpus_trains_under_torchrun_with_bounded_memory(tmp_path, shakespeare):
    """Before token files each process held ~14 bytes per character (0.85 GB for 60 MB on
    top of ~0.45 GB); now the text is a shared uint8 map and encoding streams."""
    text = shakespeare.read_bytes()
    corpus = tmp_path / "big.txt"
    with open(corpus, "wb") as f:
        for _ in range(60_000_000 // len(text)):
            f.write(text)
    wrapper = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print('max_child_rss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
    args = [*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.max_steps=3", "trainer.eval_batches=2", "trainer.final_eval_batches=2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", wrapper, TORCHRUN, "--standalone", "--nproc_per_node=2", MAIN, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text_out = output(proc)
    assert proc.returncode == 0, text_out
    assert "done: step 3" in text_out and text_out.count("into this node's token cache") == 1, text_out
    peak_gb = int(text_out.split("max_child_rss_kb")[1].split()[0]) / 2**20
    assert peak_gb < 0.7, f"peak RSS of a process {peak_gb:.2f} GB"


def two_nodes(tmp_path, name, data_path, node_env, wrap=lambda node, cmd: cmd):
    """Two torchrun agents on this host standing for two nodes (one worker each); node i
    runs with the environment node_env(i) and the command wrap(i, command)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        wrap(node, [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={name}", MAIN, *TINY,
                    f"hydra.run.dir={tmp_path / name}", f"data.path={data_path}", "trainer.max_steps=2"]),
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **node_env(node)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


def _can_unshare_mounts() -> bool:
    """Root with unshare(1) and CAP_SYS_ADMIN (a `docker build` step is root without it)."""
    return (os.geteuid() == 0 and shutil.which("unshare") is not None
            and subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare_mounts(),
                    reason="needs root, unshare(1) and CAP_SYS_ADMIN: each node gets a private mount namespace")
def test_nodes_may_keep_their_own_copies_of_the_text_and_caches_but_not_other_text(tmp_path, small_corpus):
    """Each node has its own copy of the text at the same path (another modification time;
    a private mount namespace per agent binds the node's directory there). With one cache
    on a shared filesystem, each node used to delete the token file the other had just made
    (item 4); with a cache per node, a rank must find its node's token file by its agent,
    not by the host name that both agents share (as containers with host networking do)."""
    common = tmp_path / "corpora"
    common.mkdir()
    copies = [tmp_path / f"node{node}" / "text.txt" for node in (0, 1)]
    for copy in copies:
        copy.parent.mkdir()
        copy.write_bytes(small_corpus.read_bytes())
    os.utime(copies[1], ns=(1, 1))
    shared_cache = lambda node: {"MINGPT_DDP_CACHE": str(tmp_path / "shared-cache")}  # noqa: E731
    own_cache = lambda node: {"MINGPT_DDP_CACHE": str(tmp_path / f"cache{node}")}  # noqa: E731

    def two_nodes(name, cache, own_host_names=False):
        """Two torchrun agents on this host stand for two nodes, one worker each (with their
        own host names in their own UTS namespaces, or both with this host's)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", *(["--uts"] if own_host_names else []), "sh", "-c",
             (f"hostname node{node}-{os.getpid()} && " if own_host_names else "")
             + f'mount --bind {copies[node].parent} {common} && exec "$@"', "sh",
             TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
             "--local_addr=127.0.0.1",
             f"--rdzv_id={name}", MAIN, *TINY, f"hydra.run.dir={tmp_path / name}", f"data.path={common}/text.txt",
             "trainer.max_steps=2"], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **cache(node)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        return [(p.wait(timeout=300), p.stdout.read()) for p in procs]

    shared = two_nodes("shared", shared_cache, own_host_names=True)
    assert all(rc == 0 for rc, _ in shared), shared
    own = two_nodes("own", own_cache)
    assert all(rc == 0 for rc, _ in own), own
    copies[1].write_text(small_corpus.read_text()[:30_000])
    other = two_nodes("other", own_cache)
    assert all(rc != 0 for rc, _ in other), other
    assert "read another text for data.path=" in "".join(text for _, text in other)


@pytest.mark.cli
def test_a_resume_encodes_the_text_with_the_snapshots_larger_vocabulary(tmp_path, small_corpus):
    wide, narrow = tmp_path / "wide.txt", tmp_path / "narrow.txt"
    wide.write_text(small_corpus.read_text() + "~{}" * 20)
    narrow.write_text(small_corpus.read_text())
    common = [*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    first = run_cli([*common, f"data.path={wide}", "trainer.max_steps=2"])
    assert first.returncode == 0, output(first)
    # another text: a resume on it is asked for (issue 29), then encoded with the snapshot's ids
    resumed = run_cli([*common, f"data.path={narrow}", "trainer.max_steps=4", "data.continue_on_new_corpus=true"])
    assert resumed.returncode == 0 and "resumed from" in output(resumed) and "done: step 4" in output(resumed), \
        output(resumed)
    token_files = [n for n in os.listdir(tmp_path / "cache" / "tokens") if n.endswith(".uint8")]
    assert len(token_files) == 3  # the wide text, the narrow one with its own and with the snapshot's characters
    assert load_snapshot(tmp_path / "run" / "snapshot.pt")["vocab"] == "".join(sorted(set(wide.read_text())))


# ---- review of issue 25: the document path ----------------------------------------------------
def _jsonl(path, docs, gz=False):
    import gzip
    import json
    data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    (gzip.open if gz else open)(path, "wb").write(data)
    return str(path)


def _prepare_docs(path, cache, kind="char"):
    pytest.importorskip("pyarrow")
    return token_cache.prepare(path, None, None, str(cache), 0.0, tokenization=token_cache.Tokenization(kind=kind))


@pytest.mark.unit
def test_json_lines_copies_with_other_text_of_the_same_length_have_other_hashes(tmp_path):
    """Nodes compare text_sha256: a node's copy with "thy" for "the" must not pass for the same text."""
    docs = [f"the cat {i} sat on the mat" for i in range(50)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = _prepare_docs(_jsonl(tmp_path / "a" / "c.jsonl", docs), tmp_path / "ca")
    b = _prepare_docs(_jsonl(tmp_path / "b" / "c.jsonl", [d.replace("the", "thy") for d in docs]), tmp_path / "cb")
    assert a.length == b.length and a.text_sha256 and b.text_sha256
    assert a.text_sha256 != b.text_sha256
    again = _prepare_docs(_jsonl(tmp_path / "b" / "d.jsonl", docs), tmp_path / "cb")
    assert again.text_sha256 == a.text_sha256  # the same text, another file: the same hash


@pytest.mark.unit
def test_a_char_run_on_one_json_lines_document(tmp_path):
    made = _prepare_docs(_jsonl(tmp_path / "one.jsonl", ["the quick brown fox " * 20]), tmp_path / "cache")
    assert made.length == len("the quick brown fox " * 20) and "\n" not in made.chars


@pytest.mark.unit
def test_json_lines_bytes_are_the_texts_not_the_files(tmp_path):
    docs = ["héllo wörld " * 30 for _ in range(20)]
    made = _prepare_docs(_jsonl(tmp_path / "c.jsonl.gz", docs, gz=True), tmp_path / "cache")
    assert made.corpus_bytes == len("\n".join(docs).encode())


@pytest.mark.unit
def test_the_document_path_removes_unused_cache_files(tmp_path):
    directory = token_cache.tokens_dir(str(tmp_path / "cache"))
    os.makedirs(directory)
    old = os.path.join(directory, "old.uint8")
    open(old, "wb").write(b"x")
    os.utime(old, (time.time() - 2 * token_cache.UNUSED_FOR_S,) * 2)
    _prepare_docs(_jsonl(tmp_path / "c.jsonl", ["some text"] * 5), tmp_path / "cache")
    assert not os.path.exists(old)


def _hold_cache_lock(directory, queue):
    token_cache.LOCK_STALE_S, token_cache.LOCK_HEARTBEAT_S = 1.0, 0.1
    with token_cache.shared_cache_lock(directory, "corpus"):
        queue.put(("in", time.time()))
        time.sleep(0.5)
        queue.put(("out", time.time()))


@pytest.mark.unit
def test_the_cache_lock_left_by_a_dead_process_is_held_by_one_waiter_at_a_time(tmp_path):
    import multiprocessing
    lock = tmp_path / f".{token_cache._digest('corpus')}.lock"
    lock.write_text("dead pid\n")
    os.utime(lock, (time.time() - 100,) * 2)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_hold_cache_lock, args=(str(tmp_path), queue)) for _ in range(3)]
    [w.start() for w in workers]
    [w.join(60) for w in workers]
    inside, most = 0, 0
    for kind, _ in sorted((queue.get() for _ in range(6)), key=lambda e: e[1]):
        inside += 1 if kind == "in" else -1
        most = max(most, inside)
    assert most == 1


# ---- the corpus identity a snapshot records (corpus/identity.py) ----------------------------
def corpus_identity_of(path, cache, data):
    from mingpt_ddp.corpus import identity

    corpus, token_file = load(path, cache, val_fraction=data["val_fraction"])
    return identity.identity(token_file.text_sha256, len(corpus.train_tokens), len(corpus.val_tokens), data)


@pytest.mark.unit
def test_a_corpus_is_its_text_and_split_not_its_path(tmp_path):
    """The text's hash (the one the cache already takes) decides: the same text elsewhere is
    the same corpus, noted; another text or another val_fraction is another one, in words
    that name it; a snapshot without an identity compares what its config recorded."""
    from mingpt_ddp.corpus.identity import compare

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.txt").write_text("to be or not to be\n" * 200)
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    data = {"path": str(tmp_path / "a"), "text_column": "text", "val_fraction": 0.1}
    then = corpus_identity_of(tmp_path / "a", tmp_path / "cache", data)
    assert then["train_tokens"] + then["val_tokens"] == 3800 and then["val_tokens"] == 380

    moved = corpus_identity_of(tmp_path / "moved", tmp_path / "cache", {**data, "path": str(tmp_path / "moved")})
    same = compare(then, data, moved)
    assert same.changed is None and f"data.path {tmp_path / 'a'} then, {tmp_path / 'moved'} now" in same.note
    assert compare(then, data, then) == (None, None)

    split = compare(then, data, corpus_identity_of(tmp_path / "a", tmp_path / "cache", {**data, "val_fraction": 0.2}))
    assert split.changed == "data.val_fraction 0.1 then, 0.2 now; training/validation tokens 3,420/380 then, 3,040/760 now"

    (tmp_path / "a" / "2.txt").write_text("a new shard\n")
    grown = compare(then, data, corpus_identity_of(tmp_path / "a", tmp_path / "cache", data))
    assert grown.changed.startswith(f"the text at data.path changed (sha256 {then['text_sha256'][:12]}.. then, ")
    assert grown.changed.endswith("; 3,800 tokens then, 3,813 now)")

    old = compare(None, data, then)  # a snapshot from before identities: accepted, with a note
    assert old.changed is None and "predates recorded corpus identities" in old.note
    old_split = compare(None, data, {**then, "val_fraction": 0.2})
    assert old_split.changed.startswith("data.val_fraction 0.1 then, 0.2 now (the snapshot predates")
    assert compare(None, None, then).changed is None  # no config either: nothing to compare, never a crash
    # A config written before data.text_column existed: that key had its default then.
    before_text_column = {k: v for k, v in data.items() if k != "text_column"}
    assert compare(None, before_text_column, then).changed is None
    assert compare(None, before_text_column, {**then, "val_fraction": 0.2}).changed.startswith("data.val_fraction 0.1")
    url = "https://example.org/corpus.txt?X-Amz-Date=20260101T000000Z&X-Amz-Signature=ab12"
    signed_anew = {**then, "path": url.replace("20260101", "20260102")}
    assert compare(None, {**data, "path": url}, signed_anew) == compare(None, data, then)  # the same object
