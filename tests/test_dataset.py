"""The data path: vocabulary, split, windows and the resumable sampler."""
import pytest
import torch

from mingpt_ddp.char_dataset import (
    CharCorpus,
    ResumableDistributedSampler,
    Vocabulary,
    WindowDataset,
    epoch_offset,
)
from mingpt_ddp.errors import ConfigError

pytestmark = pytest.mark.unit


def test_vocabulary_is_sorted_and_round_trips():
    vocab = Vocabulary.from_text("hello, world\nÄß")
    assert vocab.chars == "".join(sorted(set("hello, world\nÄß")))
    ids = vocab.encode("world Äß")
    assert ids.dtype == torch.uint8
    assert vocab.decode(ids) == "world Äß"
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        vocab.encode("xyz")


def test_split_is_contiguous_and_train_windows_never_reach_validation():
    # Training text uses only a-m, validation text only n-z: any leak shows as a letter.
    train_text = ("abcdefghijklm" * 80)[:900]
    val_text = ("nopqrstuvwxyz" * 10)[:100]
    corpus = CharCorpus(train_text + val_text, val_fraction=0.1)
    assert len(corpus.train_tokens) == 900 and len(corpus.val_tokens) == 100
    for epoch in range(5):
        windows = WindowDataset(corpus.train_tokens, 16, epoch_offset(7, epoch, 16))
        for i in range(len(windows)):
            x, y = windows[i]
            assert set(corpus.vocab.decode(torch.cat([x, y]))) <= set("abcdefghijklm")
    val = WindowDataset(corpus.val_tokens, 16)
    for i in range(len(val)):
        x, y = val[i]
        assert set(corpus.vocab.decode(torch.cat([x, y]))) <= set("nopqrstuvwxyz")


def test_training_windows_do_not_overlap_and_cover_the_split():
    tokens = torch.arange(1000) % 251
    for offset in (0, 5, 15):
        ds = WindowDataset(tokens.to(torch.uint8), block_size=16, offset=offset)
        inputs = [pos for i in range(len(ds)) for pos in list(ds.token_range(i))[:-1]]
        assert len(inputs) == len(set(inputs)), "an input position is trained twice in one epoch"
        assert min(inputs) == offset and len(inputs) == len(ds) * 16
        assert 1000 - 1 - max(inputs) - 1 < 16  # at most one block of tail left out


def test_batch_gather_matches_getitem():
    ds = WindowDataset(torch.arange(500).to(torch.int32), block_size=8, offset=3)
    idx = torch.tensor([4, 0, 17])
    x, y = ds.batch(idx)
    for row, i in enumerate(idx.tolist()):
        xi, yi = ds[i]
        assert torch.equal(x[row], xi) and torch.equal(y[row], yi)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_epoch_offsets_vary_and_are_deterministic():
    offsets = [epoch_offset(1337, e, 64) for e in range(10)]
    assert offsets[0] == 0 and len(set(offsets)) > 3
    assert offsets == [epoch_offset(1337, e, 64) for e in range(10)]


def test_sampler_shards_disjointly_and_resumes_mid_epoch_even_with_another_world_size():
    ds = WindowDataset(torch.zeros(2001, dtype=torch.uint8), block_size=10)  # 200 windows
    full = {}
    for rank in range(2):
        s = ResumableDistributedSampler(ds, num_replicas=2, rank=rank, seed=3)
        s.set_epoch(4)
        full[rank] = list(s)
    assert not set(full[0]) & set(full[1])
    assert sorted(full[0] + full[1]) == list(range(200))
    # Two ranks consumed 30 windows each (60 globally); the rest, seen by 2 or by 1 rank:
    remaining = set(full[0][30:]) | set(full[1][30:])
    for world in (1, 2, 4):
        resumed = set()
        for rank in range(world):
            s = ResumableDistributedSampler(ds, num_replicas=world, rank=rank, seed=3)
            s.set_epoch(4)
            s.set_start(60)
            resumed |= set(s)
        assert resumed <= remaining and len(remaining - resumed) < world


def test_sampler_indices_are_its_order_as_one_tensor():
    ds = WindowDataset(torch.zeros(2001, dtype=torch.uint8), block_size=10)
    for world, rank, start in ((1, 0, 0), (2, 1, 60), (4, 3, 7)):
        s = ResumableDistributedSampler(ds, num_replicas=world, rank=rank, seed=3)
        s.set_epoch(4)
        s.set_start(start)
        assert s.indices().dtype == torch.long and s.indices().tolist() == list(s)


def test_block_size_larger_than_a_split_is_refused():
    corpus = CharCorpus("abcdefghij" * 10, val_fraction=0.1)  # 10 validation characters
    corpus.check_block_size(9)
    with pytest.raises(ConfigError, match="larger than the validation split"):
        corpus.check_block_size(10)
