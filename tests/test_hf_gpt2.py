"""The weights in transformers' GPT-2 layout and back (checkpoint/hf_gpt2.py): transformers'
own GPT2LMHeadModel, built from a config here (no download), computes this model's logits."""
import pytest
import torch

from mingpt_ddp.checkpoint import hf_gpt2
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit


def hf_model(model_config: dict):
    fields = {k: v for k, v in hf_gpt2.hf_config(model_config).items() if k not in ("architectures", "model_type")}
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)).eval()


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_transformers_computes_the_same_logits_and_the_weights_come_back_equal(gelu):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=70, block_size=32, n_layer=2, n_head=4, n_embd=32, gelu=gelu)
    ours = GPT(cfg).eval()
    theirs = hf_model(vars(cfg))
    missing, unexpected = theirs.load_state_dict(hf_gpt2.to_hf(ours.state_dict(), cfg.n_layer), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the tied head, stored once
    ids = torch.randint(0, 70, (3, 32))
    with torch.no_grad():
        assert (ours(ids)[0] - theirs(ids).logits).abs().max() <= 1e-5
    back = GPT(cfg)
    back.load_state_dict(hf_gpt2.from_hf(theirs.state_dict(), cfg.n_layer))
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())
    assert hf_gpt2.model_config_from_hf(theirs.config.to_dict(), "x") == {
        "vocab_size": 70, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, "gelu": gelu}


def test_exact_and_tanh_gelu_differ_so_the_setting_matters():
    torch.manual_seed(0)
    ids = torch.randint(0, 70, (2, 16))
    exact = GPT(GPTConfig(vocab_size=70, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    tanh = GPT(GPTConfig(vocab_size=70, block_size=16, n_layer=1, n_head=2, n_embd=16, gelu="tanh")).eval()
    tanh.load_state_dict(exact.state_dict())
    with torch.no_grad():
        assert not torch.equal(exact(ids)[0], tanh(ids)[0])


def test_what_this_model_cannot_reproduce_is_refused_by_name():
    good = hf_gpt2.hf_config({"vocab_size": 70, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    for change, named in [({"model_type": "llama"}, "model_type"), ({"n_inner": 100}, "n_inner"),
                          ({"activation_function": "relu"}, "activation_function"),
                          ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
                          ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
                          ({"tie_word_embeddings": False}, "tie_word_embeddings")]:
        with pytest.raises(ConfigError, match=named):
            hf_gpt2.model_config_from_hf({**good, **change}, "ckpt/config.json")
    state = hf_gpt2.to_hf(GPT(GPTConfig(vocab_size=70, block_size=32, n_layer=2, n_head=4, n_embd=32)).state_dict(), 2)
    with pytest.raises(ConfigError, match="missing: transformer|missing: h.1|layout"):
        hf_gpt2.from_hf(state, 3)
    untied = {**state, "lm_head.weight": torch.zeros_like(state["transformer.wte.weight"])}
    with pytest.raises(ConfigError, match="ties"):
        hf_gpt2.from_hf(untied, 2)
