"""The GPT module: causality, initial loss, optimizer groups, generation, FLOP count."""
import math

import pytest
import torch

from mingpt_ddp.model import GPT, GPTConfig

pytestmark = pytest.mark.unit


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0, **kw)).eval()


def test_attention_is_causal():
    """Changing token t may change logits at positions >= t only (the tutorial's mask was not causal)."""
    model = tiny()
    idx = torch.randint(11, (2, 16))
    logits, _ = model(idx)
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 11
    logits2, _ = model(changed)
    assert torch.allclose(logits[:, :9], logits2[:, :9], atol=1e-6)
    assert not torch.allclose(logits[:, 9:], logits2[:, 9:])


def test_initial_loss_is_near_uniform():
    model = tiny()
    idx = torch.randint(11, (8, 16))
    _, loss = model(idx, idx)
    assert abs(loss.item() - math.log(11)) < 0.3


def test_weight_decay_only_on_matrices():
    model = tiny()
    opt = model.configure_optimizer(1e-3, 0.1, (0.9, 0.95), "cpu")
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_generate_appends_tokens_from_the_vocabulary_beyond_block_size():
    model = tiny()
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=40, top_k=5)
    assert out.shape == (1, 43)
    assert int(out.min()) >= 0 and int(out.max()) < 11


def test_flops_per_token_is_6n_plus_attention_term():
    model = tiny()
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    assert model.num_params() == n
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 16 * 16


def test_explicit_causal_attention_equals_sdpa_in_values_and_gradients():
    """The CPU bf16 fast path computes the same function as scaled_dot_product_attention."""
    import torch.nn.functional as F

    from mingpt_ddp.model import causal_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 3, 20, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = causal_attention(q, k, v)
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in zip(torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(out, (q, k, v), g)):
        assert torch.allclose(a, b, atol=1e-5)


def test_bf16_autocast_on_cpu_is_causal_and_close_to_fp32():
    """Under CPU bf16 autocast short sequences take the explicit-attention path."""
    model = tiny()
    idx = torch.randint(11, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 11
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
        logits2, _ = model(changed)
    assert torch.equal(logits[:, :9], logits2[:, :9])
    assert not torch.equal(logits[:, 9:], logits2[:, 9:])
    assert abs(loss.item() - model(idx, idx)[1].item()) < 0.05
