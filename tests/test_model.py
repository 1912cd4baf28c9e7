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


def sharp() -> GPT:
    """tiny() with its matrices 25x larger: random weights whose next token depends on the
    context (at GPT-2's initial scale greedy text soon repeats one token, whatever came before)."""
    model = tiny()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(25)
    return model


def autocast(dtype):
    return torch.autocast("cpu", dtype) if dtype is not None else torch.autocast("cpu", enabled=False)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_cache_gives_the_plain_loops_greedy_tokens_while_the_text_fits_the_block(dtype):
    """Sampling with a KV cache (issue 33): up to exactly block_size tokens of text, every
    greedy token is the plain loop's (the whole cropped context through the model per token),
    for prompts of one token, several and a whole block; fp32 and under CPU bf16 autocast."""
    model = sharp()
    for prompt in (1, 5, 16):
        idx = torch.randint(11, (2, prompt))
        new = 16 - prompt + 1  # the last one drawn from a text of exactly block_size tokens
        with autocast(dtype):
            cached = model.generate(idx, new, temperature=0)
            plain = model.generate(idx, new, temperature=0, use_cache=False)
        assert torch.equal(cached, plain), prompt


def test_kv_cache_past_the_block_refills_from_the_last_half_block_where_documented():
    """Past block_size the cache is refilled from the last half block (positions from 0), so
    each token is drawn from the last cached_context_length(n) tokens: the plain loop's context
    only where the cache is full. Checked token by token, to 3x block_size, against plain
    forwards of exactly that context (so the first block's tokens are the plain loop's), for a
    prompt shorter and one longer than the block."""
    from mingpt_ddp.model import cached_context_length, kv_refill_tokens

    assert kv_refill_tokens(16) == 8
    # text of n tokens -> context: n up to the block; then 8 after each refill, growing to 16
    assert [cached_context_length(n, 3, 16) for n in (3, 16, 17, 18, 24, 25, 26, 34, 35)] == \
        [3, 16, 8, 9, 15, 16, 8, 16, 8]
    assert [cached_context_length(n, 20, 16) for n in (20, 21, 29, 30)] == [16, 8, 16, 8]
    model = sharp()
    for prompt in (3, 20):
        idx = torch.randint(11, (2, prompt))
        out = model.generate(idx, 48 - prompt, temperature=0)
        assert out.shape == (2, 48)
        with torch.no_grad():
            for n in range(prompt, out.size(1)):
                context = out[:, n - cached_context_length(n, prompt, 16) : n]
                assert torch.equal(model(context)[0][:, -1].argmax(-1), out[:, n]), (prompt, n)


@pytest.mark.parametrize("dtype, block", [(None, 16), (torch.bfloat16, 16), (None, 160), (torch.bfloat16, 160)],
                         ids=["fp32", "bf16-explicit", "fp32-long", "bf16-flash"])
def test_kv_cache_new_tokens_after_cached_ones_see_the_cache_and_their_causal_part(dtype, block):
    """Several new tokens after cached ones (a prefill that continues a cache): each sees
    every cached key and the new ones up to itself, as in one forward of the whole text. bf16
    on CPU: the explicit attention up to 128 positions, SDPA with a mask beyond."""
    from mingpt_ddp.model import KVCache

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=block, n_layer=2, n_head=2, n_embd=16, dropout=0.0)).eval()
    idx = torch.randint(11, (2, block))
    cuts = [0, block // 3, block // 3 + 5, block // 3 + 6, block]
    with autocast(dtype), torch.no_grad():
        whole = model(idx)[0]
        cache = KVCache(2, block)
        for lo, hi in zip(cuts, cuts[1:]):
            logits = model(idx[:, lo:hi], cache=cache)[0]
            assert logits.shape == (2, 1, 11) and cache.length == hi
            torch.testing.assert_close(logits[:, -1], whole[:, hi - 1], atol=2e-3 if dtype else 1e-5, rtol=0)
        with pytest.raises(ValueError, match="exceed block_size"):
            model(idx[:, :1], cache=cache)


def test_kv_cache_samples_the_plain_loops_tokens_with_the_same_generator():
    """temperature and top_k: the same sampling code after the logits, the same draws from a
    seeded generator, while the text fits the block."""
    model = sharp()
    idx = torch.randint(11, (3, 2))
    for temperature, top_k in ((0.8, None), (1.3, 4)):
        cached = model.generate(idx, 15, temperature, top_k, generator=torch.Generator().manual_seed(5))
        plain = model.generate(idx, 15, temperature, top_k, generator=torch.Generator().manual_seed(5),
                               use_cache=False)
        assert torch.equal(cached, plain)


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
