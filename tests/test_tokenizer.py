"""Tokenizers (char, byte-level BPE, GPT-2's): encoding, robust decoding, what snapshots
store, and bits per byte. Small generated text; each test takes well under a second."""
import base64
import importlib.util
import math
import os
import random
import shutil

import numpy as np
import pytest
import torch

from mingpt_ddp.corpus import documents, tokenizer
from mingpt_ddp.char_dataset import Vocabulary
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import bits_per_byte, window_loss_sums

pytestmark = pytest.mark.unit

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
        "Über naïve café — 東京 ☃ 𝄞 and emoji 🙂 at the end.\r\nDigits 12345 and  double  spaces.\n") * 20


@pytest.fixture(scope="module")
def bpe():
    return tokenizer.BpeTokenizer.train([TEXT], 300)


def test_id_dtype_is_the_smallest_that_fits():
    assert [tokenizer.id_dtype(n).name for n in (65, 256, 257, 65536, 65537)] == \
        ["uint8", "uint8", "uint16", "uint16", "uint32"]


def test_char_tokenizer_is_the_vocabulary_with_bytes_per_character():
    tok = tokenizer.CharTokenizer(Vocabulary.from_text("abé\n"))
    ids = tok.encode("abéa\n")
    assert ids.dtype == np.uint8 and tok.decode(ids) == "abéa\n"
    assert dict(zip(tok.vocab.chars, tok.byte_lengths().tolist())) == {"\n": 1, "a": 1, "b": 1, "é": 2}
    assert tok.decode(tok.separator_ids) == "\n"
    again = tokenizer.from_dict(tok.to_dict())
    assert again.vocab == tok.vocab


def test_old_snapshots_without_a_tokenizer_are_characters():
    tok = tokenizer.from_snapshot({"vocab": "\n !abc"})
    assert tok.kind == "char" and tok.vocab.chars == "\n !abc"


def test_bpe_learns_the_vocabulary_size_asked_and_round_trips_any_text(bpe):
    assert bpe.size == 300 and bpe.dtype == np.uint16
    assert bpe.token_bytes(bpe.eot_id) == b"" and bpe.byte_lengths()[bpe.eot_id] == 1  # the newline it stands for
    unseen = "never seen: Ωμέγα ∑ ✓ \x00 tab\there \U0001F680"
    for text in (TEXT, unseen):
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert int(bpe.byte_lengths()[ids].sum()) == len(text.encode())  # bytes per token add up
    assert len(bpe.encode(TEXT)) < 0.7 * len(TEXT.encode())  # it learned merges


def test_bpe_treats_a_literal_end_of_text_in_the_text_as_text(bpe):
    ids = bpe.encode(f"a{tokenizer.EOT}b")
    assert bpe.eot_id not in ids.tolist() and bpe.decode(ids) == f"a{tokenizer.EOT}b"
    assert bpe.separator_ids.tolist() == [bpe.eot_id]


def test_bpe_round_trips_through_a_snapshot_dict_with_the_same_ids(bpe):
    state = bpe.to_dict()
    assert set(state) == {"kind", "json"} and isinstance(state["json"], str)
    again = tokenizer.from_snapshot({"tokenizer": state, "vocab": None})
    assert again.kind == "bpe" and again.size == bpe.size
    assert again.encode(TEXT).tolist() == bpe.encode(TEXT).tolist()
    assert tokenizer.fingerprint(again.to_dict()) == tokenizer.fingerprint(state)


@pytest.mark.parametrize("vocab_size", [300, 2000])
def test_bpe_encodes_as_hugging_faces_own_bpe_does(vocab_size):
    """Encoding goes through tiktoken built from the trained vocabulary: the same tokens."""
    from tokenizers import Tokenizer as HFTokenizer

    train = random_text(10, 20_000) + TEXT
    tok = tokenizer.BpeTokenizer.train([train], vocab_size)
    hf = HFTokenizer.from_str(tok.to_dict()["json"])
    for seed in (11, 12):
        text = random_text(seed, 3000)
        assert tok.encode(text).tolist() == hf.encode(text, add_special_tokens=False).ids


def test_bpe_is_trained_only_on_the_texts_it_is_given():
    tok = tokenizer.BpeTokenizer.train(["aaaa bbbb " * 200], 400)
    held_out = "zyzzyva quixotic " * 50
    # Merges of the given text: a long run is one or two tokens; the held-out words stay in bytes.
    assert len(tok.encode("aaaa bbbb")) <= 3
    assert len(tok.encode(held_out)) == len(held_out.encode())


def test_bpe_refuses_a_vocabulary_smaller_than_the_bytes():
    with pytest.raises(ConfigError, match="data.vocab_size=100 .*at least 257"):
        tokenizer.BpeTokenizer.train([TEXT], 100)


def test_decoding_a_token_that_ends_inside_a_character_does_not_fail(bpe):
    ids = bpe.encode("☂").tolist()
    assert len(ids) == 3  # not in the training text: one token per byte
    assert bpe.decode(ids) == "☂"
    assert bpe.decode(ids[:2]) == "\ufffd"  # cut off mid-character: no exception
    assert set(bpe.decode(ids[1:])) == {"\ufffd"}  # stray continuation bytes
    assert bpe.decode(bpe.encode("ab").tolist() + ids[:1]) == "ab\ufffd"


def test_a_batch_is_encoded_like_its_texts_one_by_one(bpe):
    texts = [TEXT[i:i + 97] for i in range(0, 2000, 97)]
    assert [ids.tolist() for ids in bpe.encode_batch(texts)] == [bpe.encode(t).tolist() for t in texts]


# ---- streaming pieces --------------------------------------------------------------------
def random_text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    words = ["the", "The", "citizen", "don't", "we'll", "1234", "3.14", "naïve", "東京", "☃", "🙂", "--", "!?",
             "x" * 40, "  ", " ", "\n", "\n\n", "\r\n", "\t", "\u00a0", "\u3000", "\x1c", "'s"]
    return "".join(rng.choice(words) + rng.choice(["", " ", " ", "\n", ""]) for _ in range(n))


def chunks_of(text: str, size: int):
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("seed", range(4))
def test_bpe_safe_pieces_encode_to_the_tokens_of_the_whole_text(bpe, seed):
    text = random_text(seed, 3000)
    pieces = list(documents.bpe_safe_pieces(chunks_of(text, 113), max_chars=10_000))
    assert "".join(pieces) == text and len(pieces) > 20
    assert np.concatenate(bpe.encode_batch(pieces)).tolist() == bpe.encode(text).tolist()


def test_a_stretch_without_spaces_is_cut_at_max_chars():
    text = "y" * 1000 + " tail"
    pieces = list(documents.bpe_safe_pieces(chunks_of(text, 100), max_chars=300))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 300 + 100


def test_documents_are_joined_by_one_separator_and_split_where_characters_split():
    docs = [["ab", "cd"], [], ["", "efg"], ["h"]]
    stream = list(documents.joined(docs))
    assert stream == ["ab", "cd", None, "efg", None, "h"]
    as_chars = "abcd\nefg\nh"  # what char joins them into
    for train_chars in range(len(as_chars) + 1):
        parts = {False: [], True: []}
        for is_val, piece in documents.split_at(stream, train_chars):
            parts[is_val].append("\n" if piece is None else piece)
        assert "".join(parts[False]) == as_chars[:train_chars]
        assert "".join(parts[True]) == as_chars[train_chars:]


# ---- bits per byte --------------------------------------------------------------------------
def test_bits_per_byte_weights_each_target_by_its_bytes_and_leaves_special_tokens_out():
    byte_lengths = torch.tensor([0, 1, 2, 3])  # id 0 is special
    logits = torch.zeros(1, 4, 4)  # uniform: ln 4 nats per target
    targets = torch.tensor([[0, 1, 2, 3]])
    sums = window_loss_sums(logits, targets, byte_lengths)
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([4 * math.log(4), 4, 3 * math.log(4), 6])
    assert sums[0] / sums[1] == pytest.approx(torch.nn.functional.cross_entropy(logits[0], targets[0]).item())
    assert bits_per_byte(sums[2].item(), sums[3].item()) == pytest.approx(3 * 2 / 6)  # 2 bits per target
    assert math.isnan(bits_per_byte(1.0, 0))


def test_window_loss_sums_needs_no_host_sync():
    """Issue 30: an evaluation read the device once per batch (boolean indexing waits for its
    output size). On the meta device, which has no values, any op whose shape or value the host
    needs fails: the function must run there."""
    logits = torch.empty(2, 5, 7, device="meta")
    targets = torch.empty(2, 5, dtype=torch.long, device="meta")
    sums = window_loss_sums(logits, targets, torch.empty(7, dtype=torch.int32, device="meta"))
    assert sums.shape == (4,) and sums.dtype == torch.float64


def test_for_ascii_characters_bits_per_byte_is_the_loss_in_bits(bpe):
    tok = tokenizer.CharTokenizer(Vocabulary.from_text("abc\n"))
    logits = torch.randn(2, 5, tok.size, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(tok.size, (2, 5), generator=torch.Generator().manual_seed(1))
    sums = window_loss_sums(logits, targets, torch.from_numpy(tok.byte_lengths()))
    assert bits_per_byte(sums[2].item(), sums[3].item()) == pytest.approx((sums[0] / sums[1]).item() / math.log(2))


# ---- GPT-2 through tiktoken -------------------------------------------------------------------
def whisper_gpt2_file():
    """GPT-2's BPE ranks as the openai-whisper package ships them (whisper/assets/gpt2.tiktoken,
    byte for byte tiktoken's r50k_base file): a real encoding file without the network."""
    spec = importlib.util.find_spec("whisper")
    path = spec and spec.submodule_search_locations and \
        os.path.join(list(spec.submodule_search_locations)[0], "assets", "gpt2.tiktoken")
    return path if path and os.path.isfile(path) else None


@pytest.fixture
def tiktoken_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    return tmp_path / "tiktoken"


def gpt2_in_cache() -> None:
    """GPT-2's file in tiktoken's cache (TIKTOKEN_CACHE_DIR), or the test skipped with the reason."""
    pytest.importorskip("tiktoken")
    source = whisper_gpt2_file()
    if source is None:
        pytest.skip("no GPT-2 encoding file on this machine: tiktoken cannot build one offline "
                    "(tests/setup.sh installs openai-whisper, which ships it)")
    os.makedirs(os.path.dirname(tokenizer.gpt2_cache_path()), exist_ok=True)
    shutil.copyfile(source, tokenizer.gpt2_cache_path())


def test_gpt2_without_its_file_offline_says_where_to_put_it(tiktoken_cache):
    pytest.importorskip("tiktoken")
    with pytest.raises(ConfigError) as err:
        tokenizer.load_gpt2(download=False)
    message = str(err.value)
    assert "\n" not in message and tokenizer.gpt2_cache_path() in message and tokenizer.GPT2_FILE_URL in message
    assert tokenizer.gpt2_cache_path().startswith(str(tiktoken_cache))
    assert not tiktoken_cache.exists()  # nothing fetched, nothing written


def test_gpt2_from_a_cached_encoding_file(tiktoken_cache, tmp_path):
    gpt2_in_cache()
    tok = tokenizer.load_gpt2(download=False)
    assert tok.size == 50257 and tok.eot_id == 50256 and tok.dtype == np.uint16
    assert tok.encode("Hello world").tolist() == [15496, 995]  # GPT-2's ids
    text = "naïve 東京 ☃ <|endoftext|>\n"
    ids = tok.encode(text)
    assert tok.eot_id not in ids.tolist() and tok.decode(ids) == text
    assert int(tok.byte_lengths()[ids].sum()) == len(text.encode())
    again = tokenizer.from_snapshot({"tokenizer": tok.to_dict()})
    assert again.encode(text).tolist() == ids.tolist()
    # export: the ranks in tiktoken's own file format
    name = tok.save(str(tmp_path))
    with open(tmp_path / name, "rb") as f:
        ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in f.read().splitlines())}
    assert len(ranks) == 50256 and ranks[b"Hello"] == 15496
    # streaming pieces give GPT-2's tokens of the whole text too
    text = random_text(7, 3000)
    pieces = list(documents.bpe_safe_pieces(chunks_of(text, 113), max_chars=10_000))
    assert np.concatenate(tok.encode_batch(pieces)).tolist() == tok.encode(text).tolist()
