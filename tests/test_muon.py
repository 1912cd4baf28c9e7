"""optimizer=muon: Muon for the blocks' matrices, AdamW for the rest, saved and resumed exactly."""
import pytest
import torch

from conftest import TINY, load_snapshot, output, run_cli
from mingpt_ddp import config
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.muon import Muon, orthogonalize
from test_config import composed
from test_rank_agreement import expect_config_error


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_updates_are_nearly_orthogonal_in_the_runs_precision(shape, dtype):
    """A gradient whose singular values spread over 100x leaves as one with all of them near 1."""
    generator = torch.Generator().manual_seed(0)
    u, _, v = torch.linalg.svd(torch.randn(*shape, generator=generator), full_matrices=False)
    g = u @ torch.diag(torch.logspace(-2, 0, min(shape))) @ v
    update = orthogonalize(g, dtype=dtype)
    assert update.dtype == g.dtype and update.shape == g.shape
    singular = torch.linalg.svdvals(update)
    assert 0.5 < singular.min() and singular.max() < 1.35, singular


@pytest.mark.unit
def test_block_matrices_go_to_muon_and_the_rest_to_adamw():
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32))
    optimizer = model.configure_optimizer(1e-3, 0.1, (0.9, 0.95), "cpu", muon_lr=0.02)
    assert isinstance(optimizer, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [({names[id(p)] for p in g["params"]}, g) for g in optimizer.param_groups]
    muon = [names for names, g in groups if g["muon"]]
    assert muon == [{n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}]
    assert groups[0][0] == {"wte.weight", "wpe.weight"} and groups[0][1]["weight_decay"] == 0.1
    assert all(n.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in groups[1][0])
    assert sum(len(n) for n, _ in groups) == len(names)  # every parameter once (the tied head is wte)
    assert groups[2][1]["lr_scale"] == pytest.approx(20.0)


@pytest.mark.unit
def test_muon_steps_lower_the_loss():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    optimizer = model.configure_optimizer(3e-3, 0.1, (0.9, 0.95), "cpu", muon_lr=0.02)
    x = torch.randint(20, (8, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(15):
        _, loss = model(x, x.roll(-1, dims=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.unit
def test_muon_is_refused_under_fsdp_with_the_fix_named():
    cfg = composed("optimizer=muon", "trainer.strategy=fsdp")
    with pytest.raises(ConfigError, match="use trainer.strategy=ddp with muon, or optimizer.name=adamw"):
        config.validate(cfg)


def train(run_dir, corpus, *extra):
    proc = run_cli([*TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}", "optimizer.decay_steps=20", *extra])
    assert proc.returncode == 0, output(proc)
    return output(proc)


@pytest.mark.cli
def test_a_muon_run_resumes_bit_identical_and_another_optimizer_is_refused(tmp_path, small_corpus):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(straight, small_corpus, "optimizer=muon", "trainer.max_steps=8")
    train(split, small_corpus, "optimizer=muon", "trainer.max_steps=4")
    assert "resumed from" in train(split, small_corpus, "optimizer=muon", "trainer.max_steps=8")
    a, b = load_snapshot(straight / "snapshot.pt"), load_snapshot(split / "snapshot.pt")
    assert a["train_state"] == b["train_state"] and a["train_state"]["step"] == 8
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    buffers = [s["momentum_buffer"] for s in a["optimizer"]["state"].values() if "momentum_buffer" in s]
    assert buffers and all(torch.equal(x, s["momentum_buffer"]) for x, s in
                           zip(buffers, (s for s in b["optimizer"]["state"].values() if "momentum_buffer" in s)))
    proc = run_cli([*TINY, f"hydra.run.dir={split}", f"data.path={small_corpus}", "trainer.max_steps=12"])
    expect_config_error(proc, "trained with optimizer.name=muon but the config says adamw",
                        "set optimizer.name=muon to resume it")
