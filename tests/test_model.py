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


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_adamw_is_fused_on_gpus_and_cpus(device_type):
    """One fused kernel per parameter group (torch._fused_adamw_) instead of several foreach
    passes over parameters, gradients and both moments: on an H100 at gpt2 size about 3.5 GB
    of memory traffic a step, and torch's DTensor implements the op too, so FSDP's sharded
    parameters get it as well (torch/distributed/tensor/_ops/_pointwise_ops.py)."""
    optimizer = tiny().configure_optimizer(1e-3, 0.1, (0.9, 0.95), device_type)
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]


@pytest.mark.parametrize("compile_on", [True, False])
def test_fsdp_compiles_the_root_too_when_compiling(compile_on):
    """Under FSDP each block is compiled on its own; the root's embeddings and its head with
    the cross-entropy are compiled too (a graph each), else the head's loss ran eagerly on
    fp32 logits. Checked on the structure: nothing is compiled here (trainer.compile off:
    nothing at all)."""
    import torch.distributed as torch_dist

    from mingpt_ddp import distributed, parallel
    from mingpt_ddp.config import TrainerConfig
    from mingpt_ddp.precision import PrecisionPlan

    single = distributed.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                                 device=torch.device("cpu"), backend="gloo")
    cfg = TrainerConfig(strategy="fsdp", compile=compile_on)
    torch.manual_seed(0)
    model = parallel.build_model(cfg, GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16))
    try:
        strategy = parallel.make_strategy(cfg, single, model, PrecisionPlan("fp32", "cpu"))
        compiled = [getattr(b, "_compiled_call_impl", None) is not None for b in strategy.model.blocks]
        compiled += [hasattr(getattr(strategy.model, part), "_torchdynamo_orig_callable") for part in ("embed", "head")]
        assert compiled == [compile_on] * 4
    finally:
        torch_dist.destroy_process_group()
