"""Fine-tuning from GPT-2-format weights (model.init_from, checkpoint/pretrained.py): a tiny GPT-2
with random weights saved by transformers itself (GPT2Config, save_pretrained) stands in for
downloaded weights; GPT-2's BPE comes offline as in test_tokenizer.py."""
import os
import shutil
import signal

import numpy as np
import pytest
import torch

from conftest import load_snapshot, output, run_cli
from test_config import composed
from test_fault_tolerance import children, same_parameters, start_torchrun, wait_for
from test_tokenizer import gpt2_in_cache

from mingpt_ddp import distributed, parallel
from mingpt_ddp.char_dataset import CharCorpus
from mingpt_ddp.checkpoint import hf_gpt2, pretrained
from mingpt_ddp.corpus import tokenizer
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.model import GPTConfig
from mingpt_ddp.trainer import Trainer

transformers = pytest.importorskip("transformers")

SINGLE = distributed.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                             device=torch.device("cpu"), backend="gloo")
SHAPE = dict(n_layer=2, n_head=2, n_embd=32)


def save_gpt2(directory, seed=0, **config):
    """A GPT2LMHeadModel with random weights, saved as transformers saves (model.safetensors)."""
    torch.manual_seed(seed)
    fields = {"vocab_size": 50257, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
              **SHAPE, **config}
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)).eval()
    model.save_pretrained(directory)
    return model


class RunsCode:
    """Unpickled by plain pickle, it would call os.system (harmlessly: `true`)."""
    def __reduce__(self):
        return os.system, ("true",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2-tiny")
    save_gpt2(directory)
    return directory


@pytest.fixture
def gpt2_bpe(tmp_path, monkeypatch):
    """GPT-2's BPE file in a tiktoken cache of this test's own (children inherit it)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    gpt2_in_cache()


def settled(checkpoint, *overrides):
    """The config main.py settles for this command line (`overrides`, as Hydra gives them)."""
    cfg = composed(f"model.init_from={checkpoint}", "data.tokenizer=gpt2", "data.block_size=32", *overrides)
    note = pretrained.settle_config(cfg, overrides)
    return cfg, note


@pytest.mark.unit
def test_the_first_step_s_loss_is_what_transformers_computes_on_the_same_batch(checkpoint, gpt2_bpe, shakespeare):
    """data.tokenizer=gpt2, fp32, dropout 0: the loss of the trainer's first step (before its
    update) against GPT2LMHeadModel's own loss on the same windows, within 1e-4. The default
    preset's shape (gpt-mini) and gelu are replaced by the checkpoint's, its 64 positions
    cropped to data.block_size=32."""
    cfg, note = settled(checkpoint, "model.dropout=0.0", "trainer.precision=fp32", "trainer.batch_size=4")
    assert "cropped to data.block_size=32" in note and "gelu=tanh" in note
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.gelu.value) == (2, 2, 32, "tanh")
    tok = tokenizer.load_gpt2(download=False)
    ids = torch.from_numpy(tok.encode(shakespeare.read_text(encoding="utf-8")[:20_000]).astype(np.int64))
    corpus = CharCorpus.from_tokens(ids, tok, 0.1)
    model_cfg = GPTConfig(vocab_size=tok.size, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, gelu="tanh")
    start = pretrained.read(str(checkpoint), SINGLE, model_cfg, fresh=True)
    assert start.identity["files"] == ["model.safetensors"] and len(start.identity["sha256"]) == 64
    model = parallel.build_model(cfg.trainer, model_cfg, start.weights)
    assert model.wpe.weight.shape == (32, 32) and model.lm_head.weight is model.wte.weight
    trainer = Trainer(cfg.trainer, cfg.optimizer, model, corpus, SINGLE, MetricsLog(None, enabled=False, total_steps=0),
                      saver=None, snapshot_metadata={}, token_bytes=torch.from_numpy(tok.byte_lengths()))
    batch = next(trainer.step_batches())
    (x, y), = batch
    ours = trainer._optimizer_step(batch).item()
    theirs = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).eval()
    window = torch.cat([x, y[:, -1:]], dim=1)  # transformers shifts the labels itself
    with torch.no_grad():
        expected = theirs(input_ids=window, labels=window).loss.item()
    assert abs(ours - expected) <= 1e-4, (ours, expected)


@pytest.mark.unit
def test_what_the_checkpoint_decides_and_what_is_refused(checkpoint, tmp_path):
    # the command line's own values must agree; the presets' are replaced
    with pytest.raises(ConfigError, match=r"n_layer=2 but the command line's model.n_layer=3 .*drop model.n_layer=3"):
        settled(checkpoint, "model.n_layer=3")
    with pytest.raises(ConfigError, match=r"model=gpt-nano gives 3: drop model=gpt-nano"):
        settled(checkpoint, "model=gpt-nano")
    with pytest.raises(ConfigError, match=r"gelu=tanh but the command line's model.gelu=exact"):
        settled(checkpoint, "model.gelu=exact")
    assert settled(checkpoint, "model.n_layer=2", "model.gelu=tanh")[0].model.n_layer == 2
    gpt2_shape = tmp_path / "gpt2-config-only"  # GPT-2 small's config: settle reads config.json alone
    gpt2_shape.mkdir()
    (gpt2_shape / "config.json").write_text(transformers.GPT2Config().to_json_string())
    cfg, note = settled(gpt2_shape, "model=gpt2")
    assert (cfg.model.n_layer, cfg.model.n_embd) == (12, 768) and "1024 positions cropped" in note
    # positions, vocabulary, tokenizer: one line each, naming the fix
    with pytest.raises(ConfigError, match=r"data.block_size=65 is longer than the checkpoint's 64 positions: set "
                                          r"data.block_size=64 or less"):
        settled(checkpoint, "data.block_size=65")
    assert "cropped" not in settled(checkpoint, "data.block_size=64")[1]
    for kind in ("char", "bpe"):
        with pytest.raises(ConfigError, match=f"data.tokenizer={kind} gives other ids: set data.tokenizer=gpt2"):
            settled(checkpoint, f"data.tokenizer={kind}")
    padded = tmp_path / "padded"
    padded.mkdir()
    (padded / "config.json").write_text(transformers.GPT2Config(vocab_size=50304).to_json_string())
    with pytest.raises(ConfigError, match="vocab_size=50304 is not GPT-2's 50257"):
        settled(padded)
    with pytest.raises(ConfigError, match="no such directory"):
        settled(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"no model.safetensors or pytorch_model.bin"):
        pretrained.weight_files(str(padded))
    assert pretrained.settle_config(composed()) is None  # without init_from nothing changes


@pytest.mark.unit
def test_pytorch_model_bin_and_shards_load_as_tensors_only(checkpoint, tmp_path):
    """pytorch_model.bin through torch.load(weights_only=True): a pickle that would run code is
    refused in one line; model.safetensors.index.json's shards are read as one checkpoint."""
    model_cfg = GPTConfig(vocab_size=50257, block_size=64, gelu="tanh", **SHAPE)
    state = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).state_dict()
    expected = pretrained.read(str(checkpoint), SINGLE, model_cfg, fresh=True).weights
    as_bin = tmp_path / "bin"
    as_bin.mkdir()
    torch.save(state, as_bin / "pytorch_model.bin")
    got = pretrained.read(str(as_bin), SINGLE, model_cfg, fresh=True).weights
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    torch.save({**state, "code": RunsCode()}, as_bin / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pytorch_model.bin holds more than tensors .*it was not.*model.safetensors"):
        pretrained.read(str(as_bin), SINGLE, model_cfg, fresh=True)
    sharded = tmp_path / "sharded"
    transformers.GPT2LMHeadModel.from_pretrained(checkpoint).save_pretrained(sharded, max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").exists()
    start = pretrained.read(str(sharded), SINGLE, model_cfg, fresh=True)
    assert len(start.identity["files"]) > 1 and all(torch.equal(start.weights[k], v) for k, v in expected.items())
    assert pretrained.read(str(sharded), SINGLE, model_cfg, fresh=False) == pretrained.Start(start.identity, None)  # a resume: hashed


@pytest.mark.unit
def test_a_resume_is_compared_on_its_starting_weights_and_gelu():
    """The starting weights by their hash (the path only shows where); a snapshot from before
    model.init_from started from random weights. model.gelu is the model's: a snapshot from
    before it records none and means exact."""
    from mingpt_ddp.main import check_compatible, settings_changed

    then = {"path": "/a", "files": ["model.safetensors"], "sha256": "1" * 64}
    assert pretrained.start_changed(then, {**then, "path": "/moved"}) is None
    assert pretrained.start_changed(None, None) is None
    assert "changed since it started from them" in pretrained.start_changed(then, {**then, "sha256": "2" * 64})
    assert "started from random weights, and model.init_from=/a now" in pretrained.start_changed(None, then)
    assert "model.init_from is null now" in pretrained.start_changed(then, None)
    saved = {"model_config": {"vocab_size": 65, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
             "vocab": "", "config": {}}
    tanh = GPTConfig(vocab_size=65, block_size=32, gelu="tanh", **SHAPE)
    with pytest.raises(ConfigError, match="model.gelu=exact but the config says tanh"):
        check_compatible(saved, "s.pt", tanh, None)
    check_compatible(saved, "s.pt", GPTConfig(vocab_size=65, block_size=32, **SHAPE), None)
    from omegaconf import OmegaConf
    before = OmegaConf.to_container(composed("model.init_from=/a"), resolve=True, enum_to_str=True)
    assert settings_changed(before, composed("model.init_from=/moved")) == []  # by the hash, not here
    assert settings_changed(before, composed("model.init_from=/a", "model.gelu=tanh")) == [
        "model.gelu='exact' then, 'tanh' now"]


@pytest.mark.dist
def test_fine_tune_killed_resumes_bit_identically_and_exports_back_to_the_same_weights(
        checkpoint, gpt2_bpe, small_corpus, tmp_path):
    """Issue 33's second Done-when: a transformers-saved GPT-2 fine-tuned through model.init_from
    on 2 gloo workers, one SIGKILLed mid-run (torchrun restarts them; they resume from the
    snapshot, not from model.init_from) ends bit-identical to an unbroken run; a resume whose
    starting weights changed is refused in one line; export --hf gives the trained weights."""
    start = tmp_path / "gpt2"
    shutil.copytree(checkpoint, start)
    common = [f"model.init_from={start}", "data.tokenizer=gpt2", f"data.path={small_corpus}", "data.block_size=32",
              "trainer.batch_size=4", "trainer.max_steps=8", "trainer.snapshot_every_steps=3", "trainer.log_every=1",
              "trainer.eval_every=1000", "trainer.eval_batches=2", "trainer.final_eval_batches=2",
              "trainer.precision=fp32", "optimizer.lr=1e-3", "optimizer.warmup_steps=2"]
    reference = tmp_path / "reference"
    proc = run_cli([*common, f"hydra.run.dir={reference}"], nproc=2)
    assert proc.returncode == 0, output(proc)
    run_dir = tmp_path / "killed"
    log = tmp_path / "killed.log"
    proc = start_torchrun([*common, f"hydra.run.dir={run_dir}"], max_restarts=1, log_path=log)
    try:
        workers = wait_for(lambda: (w := children(proc.pid)) and len(w) == 2 and w, 120, "workers")
        wait_for(lambda: (run_dir / "snapshot.step000000003.pt").exists(), 120, "the first snapshot")
        os.kill(workers[1], signal.SIGKILL)
        assert proc.wait(timeout=120) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "resumed from" in log.read_text(), log.read_text()
    same_parameters(reference / "snapshot.pt", run_dir / "snapshot.pt")
    trained = load_snapshot(run_dir / "snapshot.pt")
    assert trained["init_from"]["sha256"] == pretrained.read(str(start), SINGLE, None, fresh=False).identity["sha256"]
    assert trained["model_config"]["gelu"] == "tanh" and trained["config"]["model"]["n_layer"] == 2

    # the directory's content changed: the finished run is not taken as this config's result
    save_gpt2(start, seed=1)
    refused = run_cli([*common, f"hydra.run.dir={run_dir}"])
    assert refused.returncode == 2 and "error: snapshot" in refused.stderr, output(refused)
    assert "the weights at model.init_from changed" in refused.stderr and "Traceback" not in output(refused)

    from mingpt_ddp.tools.export import export
    out = tmp_path / "hf"
    export(str(run_dir), str(out), hf=True)
    from safetensors.torch import load_file
    back = hf_gpt2.from_hf(load_file(out / "model.safetensors"), 2)
    assert set(back) == set(trained["model"])
    for name, tensor in trained["model"].items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.unit
def test_the_starting_weights_are_given_up_by_every_holder_once_taken():
    """main.py's caller kept the whole starting state dict alive in its RunData for the run
    (about the checkpoint's size per process; review): taking them clears every copy's field."""
    from mingpt_ddp.main import RunData

    start = pretrained.Start({"path": "/ck"}, {"wte.weight": torch.zeros(2, 2)})
    data = RunData(None, None, None, None, {}, start)
    moved = data._replace(identity={"x": 1})
    assert start.take_weights() is not None
    assert data.start.weights is None and moved.start.weights is None and start.take_weights() is None


@pytest.mark.unit
def test_a_resume_records_where_its_weights_came_from_not_the_directory_it_was_let_through_with():
    """After trainer.continue_with_new_settings=true let a resume name another model.init_from,
    its snapshots recorded that directory as their start (review): the lineage's start is kept."""
    a = {"path": "/ckA", "files": ["model.safetensors"], "sha256": "a" * 64}
    b = pretrained.Start({"path": "/ckB", "files": ["model.safetensors"], "sha256": "b" * 64}, None)
    assert pretrained.recorded_start({"init_from": a}, b) == a
    assert pretrained.recorded_start({}, b) is None  # a run that started from its own initialisation
    assert pretrained.recorded_start(None, b) == b.identity and pretrained.recorded_start(None, None) is None
