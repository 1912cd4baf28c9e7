"""A GPT language model: plain nn.Module, nothing about ranks, devices or files.

Follows minGPT/nanoGPT: token + position embeddings, pre-LayerNorm transformer blocks with
causal self-attention, a tied output head, GPT-2 initialisation.
"""
from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    # "exact" (erf) or "tanh": GPT-2's own approximation, for weights trained with it
    # (model.init_from). Old snapshots have no such field: exact, as they were trained.
    gelu: str = "exact"


# Up to this many positions, CPU bf16 attention is computed as explicit matrix products
# (see causal_attention); longer sequences use PyTorch's flash-attention kernel.
CPU_BF16_EXPLICIT_ATTENTION_MAX_T = 128


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v as two batched matmuls and an fp32 softmax.

    The same function as scaled_dot_product_attention(is_causal=True) where q and k have the
    same length; with more keys (cached), query i is the key S - T + i. Used for bf16 on
    CPUs with short sequences: there PyTorch's CPU flash-attention backward is 2-5x
    slower than these matmuls (AMX) plus the T x T softmax (torch 2.13, T <= 128); from
    about 256 positions on, the flash kernel is faster and never stores T x T scores.
    """
    T, S = q.size(-2), k.size(-2)  # S > T: the queries are the last T of S positions (a KV cache)
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)
    mask = torch.full((T, S), float("-inf"), device=q.device).triu_(S - T + 1)  # -inf: the future
    probs = F.softmax(scores.float() + mask, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return probs.to(q.dtype) @ v


class KVCache:
    """The keys and values of the tokens generated so far, for each layer: `length` positions
    from 0 (at most block_size). Filled by GPT.forward(idx, cache=...), which reads `length`
    as the first new token's position and advances it; setting it to 0 empties the cache."""

    def __init__(self, n_layer: int, block_size: int):
        self.block_size, self.length = block_size, 0
        self.layers = [LayerKV(self) for _ in range(n_layer)]


class LayerKV:
    """One layer's keys and values: (B, heads, block_size, head dim) buffers, allocated at the
    first use in the dtype the layer computes (bf16 under autocast), written in place."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    @property
    def start(self) -> int:
        return self.owner.length

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k and v (B, heads, T, head dim); all the cached ones so far."""
        start, end = self.owner.length, self.owner.length + k.size(2)
        if self.k is None or self.k.shape[:2] != k.shape[:2] or self.k.dtype != k.dtype or self.k.device != k.device:
            shape = (*k.shape[:2], self.owner.block_size, k.size(3))
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        self.k.narrow(2, start, end - start).copy_(k)
        self.v.narrow(2, start, end - start).copy_(v)
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)


def kv_refill_tokens(block_size: int) -> int:
    """How many of the last tokens refill a full cache (GPT.stream): half a block, at least 1."""
    return max(1, block_size // 2)


def cached_context_length(n: int, prompt: int, block_size: int) -> int:
    """How many of the last tokens GPT.stream draws the next one from when the text has `n`
    tokens (`prompt` of them given): n while it fits the block (the plain loop's context);
    past it, keep = kv_refill_tokens(block_size) after each refill, growing by one a token
    until the cache is full (block_size, the plain loop's context again), then refilled."""
    if n <= block_size:
        return n
    full = max(prompt, block_size)  # the text's length when the cache is first full
    if n == full:
        return block_size
    keep = kv_refill_tokens(block_size)
    return keep + (n - full - 1) % (block_size - keep + 1)


def next_token(logits: torch.Tensor, temperature: float, top_k: Optional[int],
               generator: Optional[torch.Generator]) -> torch.Tensor:
    """The next token (B, 1) from the last position's logits (B, vocab): the likeliest at
    temperature 0, else drawn from softmax(logits / temperature) over the top_k likeliest."""
    if temperature == 0:  # greedy: the likeliest token, no sampling
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: Optional["LayerKV"] = None) -> torch.Tensor:
        if cache is not None:
            return self._forward_cached(x, cache)
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        if q.device.type == "cpu" and q.dtype == torch.bfloat16 and T <= CPU_BF16_EXPLICIT_ATTENTION_MAX_T:
            y = causal_attention(q, k, v, dropout_p)
        else:  # is_causal=True masks every future position (a boolean mask, not an additive one)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))

    def _forward_cached(self, x: torch.Tensor, cache: "LayerKV") -> torch.Tensor:
        """The new positions' attention over the cached ones and themselves (generation), their
        keys and values kept. Query i sees keys up to S - T + i (S: cached and new): all the
        cached ones and the causal part of the new ones. Each case takes the kernel that the
        plain forward of all S positions would use (explicit for short CPU bf16, causal SDPA
        for a first fill), so the tokens agree with the plain loop's. Fewer ops than forward's
        (one view and permute for q, k, v): at one token per pass their overhead is the time."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        first = cache.start == 0
        keys, values = cache.extend(k, v)
        if first:  # the very tensors the plain forward attends to
            keys, values = k, v
        S = keys.size(-2)
        if q.device.type == "cpu" and q.dtype == torch.bfloat16 and S <= CPU_BF16_EXPLICIT_ATTENTION_MAX_T:
            y = causal_attention(q, keys, values)
        elif first or T == 1:  # causal over the new tokens alone / one query sees every key
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=first and T > 1)
        else:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_(S - T)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: Optional["LayerKV"] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # One draw from the global generator, on the CPU also when built on the meta device,
        # before anything else draws: the seed of every initial value, wherever and whenever
        # they are filled in (init_weights).
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        # Starting values by parameter name (weights from elsewhere: model.init_from) that
        # init_weights writes instead of drawing; used once, then dropped.
        self.init_values: Optional[dict[str, torch.Tensor]] = None
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        if not self.wte.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, fill: Optional[Callable[[torch.Tensor, torch.Tensor], object]] = None) -> None:
        """GPT-2's initialisation: weights normal(0, 0.02), residual projections 0.02/sqrt(2 *
        n_layer) so depth does not grow the stream, zero biases, unit LayerNorms.

        Each parameter is drawn whole on the CPU, in a fixed order, from a generator seeded by
        `init_seed`: a model built on the meta device and sharded first (FSDP) gets the same
        values as one built whole. `fill(parameter, value)` writes one (default: copy_).
        With `init_values` set, those are written instead of drawn.
        """
        self.lm_head.weight = self.wte.weight  # still tied (Module.to_empty from the meta device unties them)
        generator = torch.Generator().manual_seed(self.init_seed)
        modules = dict(self.named_modules())
        given, self.init_values = self.init_values, None
        for name, p in self.named_parameters():  # the tied head once, as wte.weight
            value = torch.empty(p.shape, device="cpu")
            if given is not None:
                value = given[name]
            elif isinstance(modules[name.rpartition(".")[0]], nn.LayerNorm):
                value.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                value.zero_()
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                value.normal_(0.0, std, generator=generator)
            if fill is None:
                p.copy_(value)
            else:
                fill(p, value)

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, cache: Optional["KVCache"] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits (B, T, vocab) and the loss against `targets`. With a `cache` (generation,
        eval mode): `idx` continues the cached tokens, its keys and values are added to the
        cache, and the logits are the last position's alone (B, 1, vocab)."""
        if cache is not None:
            return self._forward_cached(idx, cache), None
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets)

    def _forward_cached(self, idx: torch.Tensor, cache: "KVCache") -> torch.Tensor:
        start, T = cache.length, idx.shape[1]
        if start + T > self.cfg.block_size:
            raise ValueError(f"{start} cached + {T} new positions exceed block_size {self.cfg.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block, layer in zip(self.blocks, cache.layers):
            x = block(x, layer)
        cache.length = start + T
        return self.head(x[:, -1:])[0]

    # The work outside the blocks, as methods of their own: FSDP (parallel.py), which compiles
    # block by block, compiles these two apart; the whole model compiled (DDP) inlines them.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings of (B, T) ids."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Final LayerNorm, the tied head, and the mean cross-entropy against `targets`, on
        fp32 logits (as autocast computes cross-entropy)."""
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, without position embeddings by default (the count FLOP formulas use)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token: 6N + 12·L·T·d (PaLM appendix B; nanoGPT's estimate).

        6N counts the forward and backward matmuls through the N parameters (tied head
        included once); 12·L·T·d the attention scores and weighted sums over T positions.
        """
        T = seq_len or self.cfg.block_size
        return 6 * self.num_params() + 12 * self.cfg.n_layer * T * self.cfg.n_embd

    def matmul_shapes(self, rows: int) -> list[tuple[int, int, int]]:
        """(rows, inner, columns) of the largest matmuls a pass over `rows` tokens runs (qkv,
        the MLP's two, the head): where the peak that MFU is quoted against is measured."""
        d, vocab = self.cfg.n_embd, self.cfg.vocab_size
        return [(rows, d, 3 * d), (rows, d, 4 * d), (rows, 4 * d, d)] + ([(rows, d, vocab)] if vocab > d else [])

    def configure_optimizer(
        self, lr: float, weight_decay: float, betas: tuple[float, float], device_type: str,
        muon_lr: Optional[float] = None, muon_momentum: float = 0.95, ns_dtype: torch.dtype = torch.float32,
    ) -> torch.optim.Optimizer:
        """AdamW with weight decay on matrices only (not on biases, LayerNorms). With
        `muon_lr`: Muon for the blocks' weight matrices at that LR (orthogonalised in
        `ns_dtype`), AdamW for the rest (embeddings and the tied head with weight decay)."""
        params = {name: p for name, p in self.named_parameters() if p.requires_grad}
        muon = {name for name, p in params.items() if muon_lr is not None and p.dim() == 2
                and name.startswith("blocks.")}
        groups = [
            {"params": [p for n, p in params.items() if p.dim() >= 2 and n not in muon], "weight_decay": weight_decay},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
        ]
        if muon_lr is not None:
            groups.append({"params": [params[n] for n in params if n in muon], "weight_decay": weight_decay,
                           "muon": True, "lr_scale": muon_lr / lr})
            from mingpt_ddp.muon import Muon  # here: model.py is exported alone, for plain PyTorch

            return Muon(groups, lr=lr, betas=tuple(betas), momentum=muon_momentum, ns_dtype=ns_dtype)
        fused_ok = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=fused_ok or None)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to `idx` (B, T). With `use_cache` (see `stream`:
        the same tokens as the plain loop while the text fits the block, then its refill
        strategy); without, the plain loop: the whole context, cropped to the last block_size
        tokens, through the model for every token."""
        if use_cache:
            new = list(itertools.islice(self.stream(idx, temperature, top_k, generator), max_new_tokens))
            return torch.cat([idx, *new], dim=1)
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size :]
            logits, _ = self(context)
            idx = torch.cat([idx, next_token(logits[:, -1, :], temperature, top_k, generator)], dim=1)
        return idx

    @torch.no_grad()
    def stream(
        self,
        idx: torch.Tensor,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> Iterator[torch.Tensor]:
        """The tokens that follow `idx` (B, T), one (B, 1) tensor at a time, without end, with a
        KV cache: each token is one position through the model.

        While the text fits the block, every token is drawn from the same context as the plain
        loop's (token for token the same at temperature 0). Learned positions cannot slide a
        cache (every cached key depends on its position), so past the block, when the cache is
        full, it is refilled: the last `kv_refill_tokens(block_size)` tokens (half a block; the
        new one included) go through the model again at positions 0, 1, ... and the cache grows
        from there. A token is then drawn from the last L tokens, where the plain loop uses the
        last block_size: see `cached_context_length`. Only where the cache is full (L =
        block_size, every block_size - keep + 1 tokens) is it the plain loop's context."""
        block, keep = self.cfg.block_size, kv_refill_tokens(self.cfg.block_size)
        cache = KVCache(self.cfg.n_layer, block)
        context = idx[:, -block:]  # the tokens in the cache (and in `recent`, to refill from)
        recent = idx.new_empty((idx.size(0), block))
        recent[:, : context.size(1)] = context
        logits = self(context, cache=cache)[0]
        while True:
            token = next_token(logits[:, -1, :], temperature, top_k, generator)
            yield token
            if cache.length == block:  # full: refill from the last `keep` tokens, positions from 0
                recent[:, : keep - 1] = recent[:, block - keep + 1 :].clone()
                recent[:, keep - 1 : keep] = token
                cache.length = 0
                logits = self(recent[:, :keep], cache=cache)[0]
            else:
                recent[:, cache.length : cache.length + 1] = token
                logits = self(token, cache=cache)[0]
