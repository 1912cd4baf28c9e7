"""The model's weights in Hugging Face transformers' GPT-2 layout, both ways.

The model here is GPT-2's architecture (learned positions, pre-LayerNorm blocks, a tied head,
biases everywhere, LayerNorm eps 1e-5); only the names differ, and GPT-2 stores its linear
layers as Conv1D, (in, out), the transpose of nn.Linear's (out, in). Plain torch here: no
transformers import, so export and fine-tuning need it only where the user wants it.
"""
from __future__ import annotations

from typing import Any

import torch

from mingpt_ddp.errors import ConfigError

# Our name inside a block -> GPT-2's, and whether the tensor is transposed (Conv1D weights).
_BLOCK_NAMES = {
    "ln_1.weight": ("ln_1.weight", False), "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False), "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True), "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True), "mlp.proj.bias": ("mlp.c_proj.bias", False),
}
_OUTER_NAMES = {"wte.weight": "wte.weight", "wpe.weight": "wpe.weight",
                "ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}
# transformers' activation names: GPT-2's own ("gelu_new") and its equivalents, and exact GELU.
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "exact"}
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, as in model.py


def to_hf(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """This model's state dict -> GPT2LMHeadModel's (`transformer.*`; the head is tied to
    wte, so it is stored once, as transformers itself saves it). Contiguous copies: ready
    for safetensors."""
    out = {f"transformer.{hf}": state[ours] for ours, hf in _OUTER_NAMES.items()}
    for i in range(n_layer):
        for ours, (hf, transposed) in _BLOCK_NAMES.items():
            t = state[f"blocks.{i}.{ours}"]
            out[f"transformer.h.{i}.{hf}"] = t.t() if transposed else t
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf(hf_state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """GPT-2 weights (GPT2LMHeadModel's `transformer.*` names, or GPT2Model's / the original
    checkpoints' without the prefix) -> this model's state dict. Buffers (attn.bias,
    attn.masked_bias) are ignored; a head that is not wte is refused (the model ties them)."""
    state = {k.removeprefix("transformer."): v for k, v in hf_state.items()
             if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    head = state.pop("lm_head.weight", None)
    out, wanted = {}, {}
    for ours, hf in _OUTER_NAMES.items():
        wanted[hf] = (ours, False)
    for i in range(n_layer):
        for ours, (hf, transposed) in _BLOCK_NAMES.items():
            wanted[f"h.{i}.{hf}"] = (f"blocks.{i}.{ours}", transposed)
    missing = sorted(set(wanted) - set(state))
    unexpected = sorted(set(state) - set(wanted))
    if missing or unexpected:
        raise ConfigError(
            "the weights are not GPT-2's layout for the config's "
            f"{n_layer} layers (missing: {', '.join(missing[:4]) or 'none'}; unexpected: "
            f"{', '.join(unexpected[:4]) or 'none'}): point model.init_from at a GPT-2 checkpoint directory")
    for hf, (ours, transposed) in wanted.items():
        t = state[hf]
        out[ours] = t.t().contiguous() if transposed else t
    if head is not None and not torch.equal(head, out["wte.weight"]):
        raise ConfigError("the checkpoint's lm_head.weight differs from its wte.weight: this model ties them "
                          "(as GPT-2 does), so untied weights cannot be loaded")
    out["lm_head.weight"] = out["wte.weight"]
    return out


def hf_config(model_config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """config.json of a GPT2LMHeadModel with this model's shape (`model_config`: GPTConfig's
    fields); `extra` adds or overrides entries (token ids, torch_dtype, ...)."""
    gelu = model_config.get("gelu", "exact")
    dropout = model_config.get("dropout", 0.0)
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": model_config["vocab_size"], "n_positions": model_config["block_size"],
        "n_embd": model_config["n_embd"], "n_layer": model_config["n_layer"], "n_head": model_config["n_head"],
        "n_inner": None, "activation_function": "gelu_new" if gelu == "tanh" else "gelu",
        "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True,
    }
    config.update(extra)
    return config


def model_config_from_hf(config: dict[str, Any], where: str) -> dict[str, Any]:
    """GPTConfig's fields (vocab_size, block_size, n_layer, n_head, n_embd, gelu) from a GPT-2
    config.json; anything this model cannot reproduce exactly is one clear error."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}; model.init_from takes GPT-2 checkpoints (GPT2LMHeadModel) only")

    if config.get("model_type") != "gpt2":
        raise refuse(f"model_type is {config.get('model_type')!r}, not 'gpt2'")
    n_embd = config.get("n_embd", config.get("hidden_size"))
    if config.get("n_inner") not in (None, 4 * n_embd):
        raise refuse(f"n_inner={config['n_inner']} (this model's MLP is 4 x n_embd = {4 * n_embd})")
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GELU:
        raise refuse(f"activation_function={activation!r} (this model has GELU, exact or tanh)")
    for key, fine in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if config.get(key, fine) != fine:
            raise refuse(f"{key}={config[key]}")
    eps = config.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if abs(eps - LAYER_NORM_EPS) > 1e-12:
        raise refuse(f"layer_norm_epsilon={eps} (this model's LayerNorms use {LAYER_NORM_EPS})")
    if config.get("tie_word_embeddings", True) is False:
        raise refuse("tie_word_embeddings is false (this model ties its head to the token embeddings)")
    return {"vocab_size": config["vocab_size"], "block_size": config.get("n_positions", config.get("n_ctx")),
            "n_layer": config["n_layer"], "n_head": config["n_head"], "n_embd": n_embd, "gelu": _GELU[activation]}
