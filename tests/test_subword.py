"""Subword tokenizers and document shards through the whole product: the token cache,
training, val_bpb, snapshots, resume, sample, export, prepare, and a cache shared by two
"nodes". Small generated data."""
import gzip
import json
import math
import os
import socket
import subprocess

import numpy as np
import pytest
import torch

from conftest import MAIN, PYTHON, REPO, TINY, TORCHRUN, load_snapshot, output, read_metrics, run_cli
from mingpt_ddp.tools import export, sample
from mingpt_ddp.corpus import token_cache, tokenizer
from mingpt_ddp.char_dataset import CharCorpus, Vocabulary
from mingpt_ddp.errors import ConfigError
from test_token_cache import make_trainer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("tokenizers")


def documents_of(text: str, n: int) -> list[str]:
    """`text` cut into `n` documents at line ends."""
    lines = text.splitlines(keepends=True)
    per = -(-len(lines) // n)
    return ["".join(lines[i:i + per]).strip("\n") for i in range(0, len(lines), per)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, shakespeare):
    """The test corpus as FineWeb-style shards: two Parquet files and a gzipped JSON-lines one."""
    root = tmp_path_factory.mktemp("shards")
    docs = documents_of(shakespeare.read_text(encoding="utf-8")[:30_000], 60)
    for name, part in (("a.parquet", docs[:20]), ("b.parquet", docs[20:40])):
        pq.write_table(pa.table({"text": part, "id": list(range(len(part)))}), root / name, row_group_size=6)
    (root / "c.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[40:]).encode()))
    return root, docs


def prepare(path, cache, **how):
    return token_cache.prepare(str(path), None, {}, str(cache), 0.0, tokenization=token_cache.Tokenization(**how))


def corpus_of(token_file, cache, val_fraction=0.1):
    tokens = token_cache.open_tokens(token_file, str(cache))
    tok = token_cache.load_tokenizer(token_file, str(cache))
    return CharCorpus.from_tokens(tokens, tok.vocab if tok.kind == "char" else tok, val_fraction,
                                  token_file.train_tokens), tok


# ---- the token cache ------------------------------------------------------------------------
@pytest.mark.unit
def test_parquet_and_jsonl_shards_as_characters_are_their_documents_joined_by_newlines(shards, tmp_path):
    root, docs = shards
    made = prepare(root, tmp_path / "cache")
    corpus, tok = corpus_of(made, tmp_path / "cache")
    old = CharCorpus("\n".join(docs), 0.1)
    assert tok.kind == "char" and made.tokenizer is None and corpus.vocab == old.vocab
    assert torch.equal(corpus.tokens.long(), old.tokens.long()) and len(corpus.val_tokens) == len(old.val_tokens)
    glob_made = prepare(f"{root}/*.parquet", tmp_path / "cache")
    assert glob_made.length == len("\n".join(docs[:40]))


@pytest.mark.unit
def test_bpe_token_file_split_and_training_side(shards, tmp_path):
    root, docs = shards
    made = prepare(root, tmp_path / "cache", kind="bpe", vocab_size=300, val_fraction=0.1)
    corpus, tok = corpus_of(made, tmp_path / "cache")
    joined = "\n".join(docs)
    split = len(joined) - int(len(joined) * 0.1)
    assert tok.kind == "bpe" and tok.size == 300 and made.dtype == "uint16"
    # validation: the same text as for characters, <|endoftext|> where they have the newline between documents
    assert tok.decode(corpus.val_tokens.tolist()).replace(tokenizer.EOT, "\n") == joined[split:]
    train_text = tok.decode(corpus.train_tokens.tolist())
    assert train_text.replace(tokenizer.EOT, "\n") == joined[:split]
    boundaries = np.cumsum([len(d) + 1 for d in docs[:-1]]) - 1  # where "\n".join puts its newlines
    separators = int((boundaries < split).sum())
    assert corpus.train_tokens.tolist().count(tok.eot_id) == separators  # one <|endoftext|> between documents
    # trained once: a second prepare reuses the BPE and the token file without reading the text
    again = prepare(root, tmp_path / "cache", kind="bpe", vocab_size=300, val_fraction=0.1)
    assert again.encode_s is None and again.name == made.name and again.tokenizer == made.tokenizer
    other = prepare(root, tmp_path / "cache", kind="bpe", vocab_size=280, val_fraction=0.1)
    assert other.name != made.name and token_cache.load_tokenizer(other, tmp_path / "cache").size == 280


@pytest.mark.unit
def test_bpe_never_sees_the_validation_text(tmp_path):
    train_part, val_part = "the cat sat on the mat. " * 400, "zyzzyva quokka " * 100
    (tmp_path / "t.txt").write_text(train_part + val_part)
    fraction = (len(val_part) + 0.5) / len(train_part + val_part)
    made = prepare(tmp_path / "t.txt", tmp_path / "cache", kind="bpe", vocab_size=320, val_fraction=fraction)
    corpus, tok = corpus_of(made, tmp_path / "cache", fraction)
    assert tok.decode(corpus.val_tokens.tolist()) == val_part
    assert len(tok.encode("zyzzyva")) == len("zyzzyva")  # no merge learned from validation text
    assert len(tok.encode(" the mat")) <= 2


@pytest.mark.unit
def test_a_bad_column_is_one_error_naming_the_file(shards, tmp_path):
    root, _ = shards
    with pytest.raises(ConfigError, match=r"a.parquet has no column 'body'.*data.text_column"):
        prepare(root, tmp_path / "cache", text_column="body")


@pytest.mark.unit
def test_gpt2_encodes_through_the_cache(tmp_path, monkeypatch, small_corpus):
    from test_tokenizer import gpt2_in_cache

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    gpt2_in_cache()
    made = prepare(small_corpus, tmp_path / "cache", kind="gpt2")
    corpus, tok = corpus_of(made, tmp_path / "cache")
    text = small_corpus.read_text(encoding="utf-8")
    split = len(text) - int(len(text) * 0.1)
    assert tok.size == 50257 and made.dtype == "uint16"
    assert corpus.train_tokens.tolist() == tok.encode(text[:split]).tolist()
    assert corpus.val_tokens.tolist() == tok.encode(text[split:]).tolist()


# ---- bits per byte in the trainer -------------------------------------------------------------
@pytest.mark.unit
def test_val_bpb_for_characters_is_the_loss_in_bits_per_byte(small_corpus, tmp_path):
    corpus = CharCorpus(small_corpus.read_text(encoding="utf-8") + "é" * 50, 0.1)
    from mingpt_ddp.metrics import MetricsLog

    metrics = MetricsLog(str(tmp_path / "metrics.jsonl"), enabled=True, total_steps=0)
    trainer = make_trainer(corpus, metrics)
    val_loss = trainer.evaluate()
    metrics.close()
    record = read_metrics(tmp_path)[-1]
    windows = trainer.val_windows
    n = record["val_windows"]
    targets = torch.cat([windows[i][1] for i in range(n)])
    nbytes = sum(len(corpus.vocab.chars[t].encode()) for t in targets.tolist())
    assert record["val_bytes"] == nbytes > len(targets)  # the é's are two bytes each
    assert record["val_bpb"] == pytest.approx(val_loss * len(targets) / (math.log(2) * nbytes), rel=1e-6)


@pytest.mark.unit
def test_char_and_bpe_divide_the_same_documents_by_the_same_bytes(shards, tmp_path):
    """val_bpb's denominator: each target's bytes (tokenizer.byte_lengths). On one text of
    many documents, char (a newline between documents, 1 byte) and BPE (<|endoftext|>
    there) must count the same bytes, or their val_bpb are not comparable (issue 29,
    defect 10): both count the boundary as the newline of the joined text."""
    root, docs = shards
    joined = "\n".join(docs)
    split = len(joined) - int(len(joined) * 0.1)
    counted = {}
    for kind in ("char", "bpe"):
        made = prepare(root, tmp_path / "cache", kind=kind, vocab_size=300, val_fraction=0.1)
        corpus, tok = corpus_of(made, tmp_path / "cache")
        weights = torch.from_numpy(tok.byte_lengths())
        counted[kind] = (int(weights[corpus.val_tokens.long()].sum()), int(weights[corpus.tokens.long()].sum()))
        assert counted[kind][1] == made.corpus_bytes  # what bytes/token and MB/s count, too
    assert counted["char"] == counted["bpe"] == (len(joined[split:].encode()), len(joined.encode()))


@pytest.mark.unit
def test_val_bpb_for_bpe_counts_end_of_text_as_the_newline_it_stands_for(shards, tmp_path):
    root, _ = shards
    made = prepare(root, tmp_path / "cache", kind="bpe", vocab_size=300)
    corpus, tok = corpus_of(made, tmp_path / "cache")
    trainer = make_trainer(corpus)
    trainer.token_bytes = torch.from_numpy(tok.byte_lengths())
    trainer.model.eval()
    n = trainer.eval_windows()
    x, y = trainer.val_windows.batch(torch.arange(n))
    with torch.no_grad():
        logits, _ = trainer.model(x)
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, tok.size), y.reshape(-1), reduction="none")
    nbytes = torch.from_numpy(tok.byte_lengths())[y.reshape(-1)].sum().item()
    assert (y == tok.eot_id).sum() > 0  # some targets are <|endoftext|>
    val_loss = trainer.evaluate()
    assert val_loss == pytest.approx(losses.mean().item(), rel=1e-5)
    assert trainer.last_val_bpb == pytest.approx(losses.sum().item() / (math.log(2) * nbytes), rel=1e-5)
    assert nbytes == len(tok.decode(y.reshape(-1).tolist()).replace(tokenizer.EOT, "\n").encode())


# ---- the whole product ------------------------------------------------------------------------
@pytest.mark.cli
def test_a_bpe_run_on_shards_round_trips_its_tokenizer_through_snapshot_resume_sample_and_export(shards, tmp_path):
    root, _ = shards
    run = tmp_path / "run"
    common = [*TINY, f"hydra.run.dir={run}", f"data.path={root}", f"data.cache_dir={tmp_path / 'cache'}",
              "data.tokenizer=bpe", "data.vocab_size=300"]
    first = run_cli([*common, "trainer.max_steps=4"])
    assert first.returncode == 0, output(first)
    vals = [r for r in read_metrics(run) if "val_loss" in r]
    assert vals and all(0 < r["val_bpb"] < 20 and r["val_bytes"] > 0 for r in vals)
    assert "val_bpb" in output(first) and "bytes of text" in output(first)
    snap = load_snapshot(run / "snapshot.pt")
    assert snap["tokenizer"]["kind"] == "bpe" and snap["model_config"]["vocab_size"] == 300
    tok = tokenizer.from_snapshot(snap)

    # a changed tokenizer is refused, in one line, before anything is trained or overwritten
    for change, said in (("data.tokenizer=char", "data.tokenizer=char"), ("data.vocab_size=400", "data.vocab_size=400")):
        refused = run_cli([*[c for c in common if not c.startswith(change.split("=")[0] + "=")], change,
                           "trainer.max_steps=8"])
        assert refused.returncode == 2, output(refused)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "was trained with data.tokenizer=bpe data.vocab_size=300" in errors[0] \
            and said in errors[0], refused.stderr
    # a resume encodes with exactly the snapshot's tokenizer (even with the cache gone)
    import shutil
    shutil.rmtree(tmp_path / "cache")
    resumed = run_cli([*common, "trainer.max_steps=6"])
    assert resumed.returncode == 0 and "resumed from" in output(resumed) and "done: step 6" in output(resumed), \
        output(resumed)
    assert "training a byte-level BPE" not in output(resumed)
    assert tokenizer.from_snapshot(load_snapshot(run / "snapshot.pt")).to_dict() == tok.to_dict()

    # sample decodes with the run's BPE; a prompt any text
    text = sample.generate_text(str(run), sample.SampleConfig(prompt="ROMEO: ☃", max_new_tokens=20, seed=1))
    assert text.startswith("ROMEO: ☃") and len(text) > len("ROMEO: ☃")
    # export writes the tokenizer beside the weights; Hugging Face's library reads it back the same
    meta = export.export(str(run), str(tmp_path / "exported"))
    assert meta["tokenizer"] == {"kind": "bpe", "file": "tokenizer.json", "vocab_size": 300, "eot_id": tok.eot_id}
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tmp_path / "exported" / "tokenizer.json"))
    assert hf.encode("ROMEO: wherefore", add_special_tokens=False).ids == tok.encode("ROMEO: wherefore").tolist()


@pytest.mark.cli
def test_prepare_encodes_ahead_of_the_job(tmp_path, small_corpus):
    cache = tmp_path / "cache"
    args = [f"data.path={small_corpus}", f"data.cache_dir={cache}", "data.tokenizer=bpe", "data.vocab_size=290"]
    made = subprocess.run([PYTHON, "-m", "mingpt_ddp.prepare", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0 and "tokens (uint16)" in made.stdout and "encoded in" in made.stdout, output(made)
    again = subprocess.run([PYTHON, "-m", "mingpt_ddp.prepare", *args], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "already there" in again.stdout, output(again)
    for wrong, said in (("data.vocab_size=12", "data.vocab_size=12"), ("data.vocab_sise=300", "vocab_sise")):
        bad = subprocess.run([PYTHON, "-m", "mingpt_ddp.prepare", *args[:3], wrong], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and bad.stderr.count("error:") == 1 and said in bad.stderr, output(bad)
        assert "Traceback" not in bad.stderr


@pytest.mark.unit
def test_prepare_and_a_run_encode_on_the_threads_trainer_cpu_threads_gives(tmp_path, monkeypatch):
    """The prepare tool composes the run's config: trainer.cpu_threads sets the encoding's
    threads there (one process), a bad value is refused naming it; load_corpus (a run, bench)
    passes its count down to the tokenizer."""
    from mingpt_ddp import config, distributed
    from mingpt_ddp.tools import prepare as prepare_tool

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 200)
    seen, original = [], tokenizer.BpeTokenizer.encode_batch

    def spy(self, texts, threads=None):
        seen.append(threads)
        return original(self, texts)

    monkeypatch.setattr(tokenizer.BpeTokenizer, "encode_batch", spy)
    args = [f"data.path={tmp_path / 't.txt'}", "data.tokenizer=bpe", "data.vocab_size=290"]
    prepare_tool.prepare([*args, f"data.cache_dir={tmp_path / 'a'}", "trainer.cpu_threads=3"])
    assert seen and set(seen) == {3}, seen
    with pytest.raises(ConfigError, match=r"^trainer.cpu_threads=0 must be a number of threads"):
        prepare_tool.prepare([*args, f"data.cache_dir={tmp_path / 'b'}", "trainer.cpu_threads=0"])
    seen.clear()
    data = config.DataConfig(path=str(tmp_path / "t.txt"), cache_dir=str(tmp_path / "c"), block_size=16,
                             tokenizer="bpe", vocab_size=290)
    single = distributed.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                                 device=torch.device("cpu"), backend="gloo")
    token_cache.load_corpus(data, single, 0.0, threads=2)
    assert seen and set(seen) == {2}, seen


SPY = """
import os
if os.environ.get("ENCODE_SPY"):
    from mingpt_ddp.corpus import encoding

    def _spy(name):
        real = getattr(encoding, name)

        def call(*args, **kwargs):
            with open(os.environ["ENCODE_SPY"], "a") as f:
                f.write(f"{name} node {os.environ.get('GROUP_RANK')}\\n")
            return real(*args, **kwargs)
        setattr(encoding, name, call)

    _spy("train_bpe")
    _spy("write_tokens")
"""


@pytest.mark.dist
@pytest.mark.slow
def test_a_shared_cache_is_encoded_once_by_one_of_two_nodes(tmp_path, small_corpus):
    """Two torchrun agents on this host stand for two nodes with data.cache_dir on storage
    both share: one trains the BPE and encodes, the other waits and maps its file. (A
    sitecustomize records each process's calls of the two passes.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(SPY)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ENCODE_SPY": str(calls),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "spy"), os.environ.get("PYTHONPATH", "")])}
    cache = tmp_path / "shared-cache"
    procs = [subprocess.Popen(
        [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=shared", MAIN, *TINY, f"hydra.run.dir={tmp_path / 'run'}",
         f"data.path={small_corpus}", f"data.cache_dir={cache}", "data.tokenizer=bpe", "data.vocab_size=300",
         "trainer.max_steps=2"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    results = [(p.wait(timeout=600), p.stdout.read()) for p in procs]
    both = "".join(text for _, text in results)
    assert all(rc == 0 for rc, _ in results), both
    assert "done: step 2" in both
    made = calls.read_text().splitlines()
    assert sorted(line.split(" node ")[0] for line in made) == ["train_bpe", "write_tokens"], made
    assert len({line.split(" node ")[1] for line in made}) == 1, made  # both by the same node
    tokens = os.listdir(cache / "tokens")
    assert len([n for n in tokens if n.endswith(".uint16")]) == 1
    assert_no_lock_held(cache / "tokens")


# ---- the shared cache's lock ------------------------------------------------------------------
def assert_no_lock_held(directory):
    """The cache's lock files stay (a kernel lock on a file never removed), none still held."""
    import fcntl

    for name in os.listdir(directory):
        if name.endswith(".lock"):
            with open(os.path.join(directory, name), "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if held


@pytest.mark.unit
def test_the_cache_lock_makes_a_second_process_wait_and_a_dead_ones_lock_is_taken_over(tmp_path, monkeypatch, caplog):
    import threading
    import time

    events = []

    def hold(name, seconds):
        with token_cache.shared_cache_lock(str(tmp_path), "corpus.txt"):
            events.append(f"{name} in")
            time.sleep(seconds)
            events.append(f"{name} out")

    first = threading.Thread(target=hold, args=("first", 0.5))
    first.start()
    while not events:
        time.sleep(0.01)
    hold("second", 0)
    first.join()
    assert events == ["first in", "first out", "second in", "second out"]
    assert_no_lock_held(tmp_path)
    # a kernel lock dies with its holder: a lock file left by a killed process is taken at once
    lock = tmp_path / f".{token_cache._digest('corpus.txt')}.lock"
    lock.write_text("node9 pid 4242\n")
    started = time.monotonic()
    hold("third", 0)
    assert events[-2:] == ["third in", "third out"] and time.monotonic() - started < 5
    # where flock does not reach every node, a lock file nobody keeps fresh is taken over
    monkeypatch.setattr(token_cache.run_lock, "flock_reaches_everyone", lambda directory: False)
    monkeypatch.setattr(token_cache, "LOCK_STALE_S", 1.0)
    lease = lock.with_suffix(".lease")  # a name of its own: the kernel lock's file stays for good
    lease.write_text("node9 pid 4242\n")
    os.utime(lease, (time.time() - 5, time.time() - 5))
    with caplog.at_level("WARNING", logger="mingpt_ddp.corpus.token_cache"):
        hold("fourth", 0)
    assert events[-2:] == ["fourth in", "fourth out"] and "node9 pid 4242" in caplog.text


@pytest.mark.unit
def test_the_final_evaluation_is_bounded_by_default_and_the_whole_split_on_request(small_corpus):
    corpus = CharCorpus(small_corpus.read_text(encoding="utf-8"), 0.5)  # 20,000 characters: 1,249 windows of 16
    trainer = make_trainer(corpus)  # batch 4, the default trainer.final_eval_batches
    assert len(trainer.val_windows) == 1249
    assert trainer.eval_windows(final=True) == 200 * 4
    assert make_trainer(corpus, final_eval_batches=None).eval_windows(final=True) == 1249


@pytest.mark.s3
def test_shards_on_s3_give_the_tokens_of_their_local_copies(shards, tmp_path, moto_s3):
    from conftest import s3_options

    root, docs = shards
    moto_s3.make_bucket("corpora")
    client = moto_s3.client()
    for path in sorted(root.iterdir()):
        client.put_object(Bucket="corpora", Key=f"fineweb/{path.name}", Body=path.read_bytes())
    options = s3_options(moto_s3)
    remote = token_cache.prepare("s3://corpora/fineweb/", None, options, str(tmp_path / "cache"), 0.0,
                                 tokenization=token_cache.Tokenization(kind="bpe", vocab_size=300))
    local = prepare(root, tmp_path / "local-cache", kind="bpe", vocab_size=300)
    assert remote.length == local.length and remote.train_tokens == local.train_tokens
    assert remote.fingerprint == local.fingerprint  # the same BPE from the same documents
    assert torch.equal(token_cache.open_tokens(remote, str(tmp_path / "cache")),
                       token_cache.open_tokens(local, str(tmp_path / "local-cache")))
