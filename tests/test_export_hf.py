"""export --hf: transformers' GPT-2 directory, from a DDP snapshot file and from a sharded (FSDP)
snapshot, loaded with AutoModelForCausalLM / AutoTokenizer: the same logits, the same token ids
for the three tokenizers, and read back by read_hf_export. Tiny hand-made snapshots, in process."""
import json
import os
from dataclasses import asdict

import pytest
import torch

from mingpt_ddp.checkpoint.snapshot import encode
from mingpt_ddp.corpus import tokenizer
from mingpt_ddp.char_dataset import Vocabulary
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.tools import export
from mingpt_ddp.trainer import TrainState
from test_tokenizer import TEXT, gpt2_in_cache, tiktoken_cache  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP, no process group

CHARS = "\n !',.:?ABCDEFGHIJKLMNOPRSTUWYabcdefghiklmnoprstuvwyzÜéü東京🙂"
CHAR_TEXT = "Über café, 東京! 🙂 What's here?\nNo, not here.\n"


def snapshot(tok: tokenizer.Tokenizer, gelu: str = "exact", vocab_size=None, **extra) -> tuple[GPT, dict]:
    """A tiny model with random weights and the snapshot a run would save of it."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab_size or tok.size, block_size=16, n_layer=2, n_head=2, n_embd=16, gelu=gelu)
    model = GPT(cfg).eval()
    return model, {"model": model.state_dict(), "model_config": asdict(cfg), "tokenizer": tok.to_dict(),
                   "train_state": asdict(TrainState(step=3)), **extra}


def saved(tmp_path, state: dict) -> str:
    path = tmp_path / "snapshot.pt"
    path.write_bytes(encode(state, state["train_state"]["step"]))
    return str(path)


def sharded(tmp_path, state: dict) -> str:
    """The snapshot as an FSDP run's: DCP shards, meta.pt and the commit marker under snapshot.pt.dcp/."""
    from mingpt_ddp.checkpoint.sharded_snapshot import ShardedSnapshotStore

    store = ShardedSnapshotStore(str(tmp_path / "run" / "snapshot.pt"))
    store.check_writable()
    meta = {k: v for k, v in state.items() if k != "model"}
    assert store.save(state["train_state"]["step"], {"model": state["model"]}, meta) is None
    return str(tmp_path / "run")


def same_logits(model: GPT, out, greedy: bool = False) -> None:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(theirs).__name__ == "GPT2LMHeadModel" and theirs.dtype == torch.float32 and not theirs.training
    ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids)[0] - theirs(ids).logits).abs().max().item() <= 1e-4
    if greedy:  # random weights: a varied continuation, token for token
        prompt = ids[:1, :4]
        assert theirs.generate(prompt, max_new_tokens=12, do_sample=False).tolist() == \
            model.generate(prompt, 12, temperature=0).tolist()


@pytest.mark.parametrize("where,gelu", [("ddp", "exact"), ("sharded", "tanh")])
def test_transformers_computes_the_snapshots_logits_and_read_hf_export_gives_it_back(tmp_path, where, gelu):
    model, state = snapshot(tokenizer.CharTokenizer(Vocabulary(CHARS)), gelu)
    source = saved(tmp_path, state) if where == "ddp" else sharded(tmp_path, state)
    out = tmp_path / "hf"
    sidecar = export.export(source, str(out), hf=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         export.SIDECAR])
    same_logits(model, out, greedy=True)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["bos_token_id"] is None and config["eos_token_id"] is None
    assert sidecar == json.loads((out / export.SIDECAR).read_text())
    model_config, weights, tok_state, trained = export.read_hf_export(str(out))
    assert model_config == state["model_config"] and tok_state == state["tokenizer"]
    assert trained["step"] == 3 and trained["failed_check"] is None and trained["source"].endswith(
        "snapshot.pt" if where == "ddp" else "snapshot.pt.dcp")
    back = GPT(GPTConfig(**model_config))
    back.load_state_dict(weights)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in state["model"].items())


def bpe_tokenizer():
    return tokenizer.BpeTokenizer.train([TEXT], 300)


def gpt2_tokenizer():
    gpt2_in_cache()
    return tokenizer.load_gpt2(download=False)


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_auto_tokenizer_gives_this_projects_ids_also_for_non_ascii_text(tmp_path, kind, tiktoken_cache):
    tok = {"char": lambda: tokenizer.CharTokenizer(Vocabulary(CHARS)), "bpe": bpe_tokenizer, "gpt2": gpt2_tokenizer}[kind]()
    model, state = snapshot(tok)
    out = tmp_path / "hf"
    export.export(saved(tmp_path, state), str(out), hf=True)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    texts = [CHAR_TEXT] if kind == "char" else [TEXT, CHAR_TEXT, "naïve 東京 ☃ 𝄞 🙂🙂 emoji\r\n  it's  x"]
    for text in texts:
        ids = tok.encode(text).tolist()
        assert theirs(text)["input_ids"] == ids and theirs.decode(ids) == text
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    if kind == "char":
        assert theirs("a☃b")["input_ids"] == tok.encode("ab").tolist()  # unknown characters are dropped (docs)
    else:
        assert config["eos_token_id"] == config["bos_token_id"] == generation["eos_token_id"] == tok.eot_id
        assert theirs.eos_token_id == tok.eot_id and theirs.decode([tok.eot_id]) == tokenizer.EOT
    if kind == "gpt2":
        assert theirs("Hello world")["input_ids"] == [15496, 995]
        same_logits(model, out)  # GPT-2's vocabulary: every id of the head
        os.remove(tokenizer.gpt2_cache_path())  # offline, no cache: the directory's own ranks serve
        assert export.read_export(str(out)).tokenizer.encode(TEXT).tolist() == tok.encode(TEXT).tolist()


def test_ids_of_a_padded_vocabulary_are_never_generated(tmp_path):
    """Ids past the tokenizer's would decode to nothing: generation_config.json suppresses them."""
    tok = tokenizer.CharTokenizer(Vocabulary(CHARS))
    model, state = snapshot(tok, vocab_size=tok.size + 3)
    with torch.no_grad():
        state["model"]["wte.weight"][tok.size:] = 10 * state["model"]["wte.weight"][:3]  # the likeliest, unsuppressed
    out = tmp_path / "hf"
    export.export(saved(tmp_path, state), str(out), hf=True)
    assert json.loads((out / "generation_config.json").read_text())["suppress_tokens"] == [tok.size + i for i in range(3)]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = torch.tensor([tok.encode("Hello").tolist()])
    generated = theirs.generate(prompt, max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    assert len(generated) == 8 and max(generated) < tok.size


def test_a_snapshot_that_failed_the_end_of_run_check_is_exported_with_hf_only_on_request(tmp_path, capsys):
    from test_export import FAILED_CHECK

    _, state = snapshot(tokenizer.CharTokenizer(Vocabulary(CHARS)), failed_check=FAILED_CHECK)
    source, out = saved(tmp_path, state), tmp_path / "hf"
    with pytest.raises(ConfigError, match="failed the end-of-run check .*--accept-failed-check"):
        export.export(source, str(out), hf=True)
    assert not out.exists()
    export.cli([source, str(out), "--hf", "--accept-failed-check"])
    assert f"{export.SIDECAR} records it" in capsys.readouterr().err
    assert json.loads((out / export.SIDECAR).read_text())["trained"]["failed_check"] == FAILED_CHECK
    assert export.read_hf_export(str(out))[3]["failed_check"] == FAILED_CHECK


def test_the_usage_names_hf_and_an_unknown_flag_is_refused(capsys):
    for argv in (["only-one"], ["a", "b", "--hf", "--huggingface"]):
        with pytest.raises(SystemExit) as refused:
            export.cli(argv)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err.startswith("error:") and "[--hf]" in err, err


def test_read_hf_export_refuses_a_directory_it_did_not_write(tmp_path):
    with pytest.raises(ConfigError, match=f"no {export.SIDECAR}: not a directory"):
        export.read_hf_export(str(tmp_path))


def files(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_export_stopped_half_way_leaves_the_earlier_one_whole_and_formats_never_mix(tmp_path, monkeypatch):
    """The export is written beside the directory and renamed into place: stopped after its
    weights (Ctrl-C, a full disk), the earlier export is as it was (it used to get the new
    weights beside the old tokenizer, read without a word); an --hf export over a plain one
    leaves no weights.pt behind."""
    chars = tokenizer.CharTokenizer(Vocabulary(CHARS))
    _, first = snapshot(chars)
    out = tmp_path / "out"
    (tmp_path / "a").mkdir()
    export.export(saved(tmp_path / "a", first), str(out))
    before = files(out)

    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(tokenizer.CharTokenizer, "hf_json", interrupted)
    _, second = snapshot(chars, gelu="tanh", train_state=asdict(TrainState(step=9)))
    (tmp_path / "b").mkdir()
    with pytest.raises(KeyboardInterrupt):
        export.export(saved(tmp_path / "b", second), str(out), hf=True)
    assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]
    monkeypatch.undo()
    export.export(saved(tmp_path / "b", second), str(out), hf=True)
    assert "weights.pt" not in files(out) and export.read_export(str(out)).model_config["gelu"] == "tanh"


def test_what_export_will_not_write_over_or_to(tmp_path, capsys):
    """A run directory (or any directory with other files) is never an export's target, nor a
    URL (it was written to ./s3:/...), nor --hf with --safetensors (ignored before)."""
    _, state = snapshot(tokenizer.CharTokenizer(Vocabulary(CHARS)))
    source = saved(tmp_path, state)  # tmp_path now holds snapshot.pt: a run directory
    for out, message in ((tmp_path, "not an export"), ("s3://bucket/out", "is a URL"), (source, "is a file")):
        with pytest.raises(ConfigError, match=message):
            export.export(source, str(out), hf=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot.pt"]
    with pytest.raises(SystemExit) as refused:
        export.cli([source, str(tmp_path / "x"), "--hf", "--safetensors"])
    assert refused.value.code == 2 and "drop --safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("hf", [False, True])
def test_damaged_weights_in_an_export_are_one_error_naming_the_fix(tmp_path, hf):
    _, state = snapshot(tokenizer.CharTokenizer(Vocabulary(CHARS)))
    out = tmp_path / "out"
    export.export(saved(tmp_path, state), str(out), hf=hf)
    weights = out / ("model.safetensors" if hf else "weights.pt")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match="cannot read .*export"):
        export.read_export(str(out))
