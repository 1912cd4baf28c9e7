"""Composition of conf/ with the typed schema, presets, experiments and run ids."""
import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO
from mingpt_ddp import config


def composed(*overrides):
    config.register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.unit
@pytest.mark.parametrize("preset, shape", [
    ("gpt-nano", (3, 3, 48)), ("gpt-micro", (4, 4, 128)), ("gpt-mini", (6, 6, 192)),
    ("gopher-44m", (8, 16, 512)), ("gpt2", (12, 12, 768)),
])
def test_presets(preset, shape):
    m = composed(f"model={preset}").model
    assert (m.n_layer, m.n_head, m.n_embd) == shape


@pytest.mark.unit
def test_defaults_are_the_documented_interface():
    cfg = composed()
    assert cfg.data.path == "data/tinyshakespeare.txt" and cfg.data.val_fraction == 0.1
    assert cfg.trainer.precision == config.Precision.auto and cfg.trainer.snapshot_path is None
    config.validate(cfg)


@pytest.mark.unit
def test_ddp_buckets_are_100_mib_on_gpus_unless_set():
    """Issue 30: torch's 25 MiB cut gpt2's compiled graph into about 14 pieces on GPUs."""
    t = composed().trainer
    assert config.ddp_bucket_cap_mb(t, "cuda") == 100 and config.ddp_bucket_cap_mb(t, "cpu") == 25
    t = composed("trainer.ddp_bucket_cap_mb=40").trainer
    assert config.ddp_bucket_cap_mb(t, "cuda") == config.ddp_bucket_cap_mb(t, "cpu") == 40


@pytest.mark.unit
def test_a_key_added_outside_the_schema_is_refused_naming_the_closest_key():
    """Hydra's hint for a typo ("To append to your config use +trainer.max_stepz=1") would
    add a key nothing reads: the run would train silently with the default. Open dicts
    (storage_options) take new keys."""
    from mingpt_ddp.errors import ConfigError

    for added, near in (("+trainer.max_stepz=1", "trainer.max_steps"), ("+trainer.storage_opts={profile: ml}",
                                                                         "trainer.storage_options"),
                        ("+extra=1", None)):
        with pytest.raises(ConfigError, match="is not a config key") as err:
            config.validate(composed(added))
        assert (f"did you mean {near}?" in str(err.value)) == bool(near), err.value
    config.validate(composed("+trainer.storage_options.profile=ml", "+data.storage_options.client_kwargs.a=1"))
    with pytest.raises(ConfigError) as err:
        config.compose(["trainer.max_stepz=1"])
    assert "To append" not in str(err.value) and "did you mean trainer.max_steps?" in str(err.value), err.value


@pytest.mark.unit
def test_a_mistyped_key_or_preset_is_one_line_naming_the_closest_valid_ones():
    """A typo in a key or a preset: the one line names the nearest of its siblings or of the
    group's options (a preset's typo named none; `+trainer.foo` suggested `trainer`)."""
    from mingpt_ddp.errors import ConfigError

    for override, hint in (("trainer.bath_size=8", "did you mean trainer.batch_size?"),
                           ("trainer.max_epoch=3", "did you mean trainer.max_epochs?"),
                           ("model=gpt-mni", "did you mean model=gpt-mini?"),
                           ("experiment=shakespeare", "did you mean experiment=shakespeare_char_cpu?")):
        with pytest.raises(ConfigError) as err:
            config.compose([override])
        assert hint in str(err.value) and "\n" not in str(err.value), err.value
    with pytest.raises(ConfigError) as err:
        config.validate(composed("+trainer.foo=1"))
    assert "did you mean" not in str(err.value), err.value
    assert config.closest_keys("trainer.eval_evry") == ["trainer.eval_every"]


@pytest.mark.unit
def test_ddp_tutorial_experiment():
    cfg = composed("experiment=ddp_tutorial")
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (8, 8, 512)
    assert cfg.trainer.batch_size == 216 and cfg.optimizer.lr == cfg.optimizer.min_lr == 3e-4
    assert cfg.trainer.save_every == 3


@pytest.mark.dist
def test_run_id_is_shared_by_ranks_and_restarts(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert config.run_id() == "slurm-4242"
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert config.run_id() == "slurm-4242_3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")  # launch/multinode.sh: --rdzv_id=$SLURM_JOB_ID
    assert config.run_id() == "slurm-4242_3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")  # another torchrun inside the allocation
    assert config.run_id() == "torchrun-abc"


@pytest.mark.unit
def test_the_tiny_shakespeare_download_belongs_to_the_presets_own_path():
    """A download happens only when asked for: the preset's path with its URL, or a
    data.download_url given with data.path; any other path (a typo) never downloads."""
    assert composed().data.download_url == config.TINY_SHAKESPEARE_URL
    assert composed("data.path=./data//tinyshakespeare.txt").data.download_url == config.TINY_SHAKESPEARE_URL
    assert composed("data.path=/fsx/corpora/enwk9").data.download_url is None
    assert composed("data.path=/fsx/x.txt", "data.download_url=http://h/x.txt").data.download_url == "http://h/x.txt"
    assert composed("data.download_url=null").data.download_url is None
    assert config.DataConfig().download_url is None  # a config built in Python downloads nothing by itself


@pytest.mark.unit
@pytest.mark.parametrize("url, message", [
    ("file:///nonexistent/corpus.txt", "not file://"), ("htps://127.0.0.1:9/x.txt", "not htps://"),
    ("/fsx/corpus.txt", "not a path without a scheme"), ("http:///x.txt", "names no host"),
])
def test_a_download_url_that_no_server_can_answer_is_refused_before_the_run(url, message):
    """urllib reports a local path, a mistyped scheme and a missing host like a network
    failure; the config says so in one line before anything is retried (review of issue
    29, defect 8). The message shows the scheme only: the URL's query may hold a secret."""
    cfg = composed("data.path=/fsx/x.txt", f"data.download_url={url}")
    with pytest.raises(config.ConfigError, match=message) as err:
        config.validate(cfg)
    assert "\n" not in str(err.value) and "x.txt" not in str(err.value) and "corpus" not in str(err.value)
    for good in ("https://h/x.txt?X-Amz-Signature=abc", "http://127.0.0.1:8000/x.txt", "ftp://h/x.txt"):
        config.validate(composed("data.path=/fsx/x.txt", f"data.download_url='{good}'"))


@pytest.mark.unit
def test_what_a_finished_run_or_a_resume_is_compared_on():
    """settings_changed (main.py): the requested precision, final_eval_batches and the BPE's
    training text only for a finished run's result (a resume may be given another precision,
    evaluates with this config's batches and keeps the snapshot's tokenizer); settings that did nothing on either side (muon_* under
    AdamW, tokenizer_train_chars without BPE) and decay_steps pinned to the horizon the
    snapshot's null meant are no change. past_limits: a finished run that trained past this
    config's end is named with the limit then and now."""
    from omegaconf import OmegaConf

    from mingpt_ddp.main import past_limits, settings_changed
    from mingpt_ddp.trainer import TrainState

    def saved(*overrides):
        return OmegaConf.to_container(composed(*overrides), resolve=True, enum_to_str=True)

    then = saved("trainer.precision=fp32")
    assert settings_changed(then, composed("trainer.precision=bf16")) == []  # a resume may change it
    assert settings_changed(then, composed("trainer.precision=bf16"), finished=True) == [
        "trainer.precision='fp32' then, 'bf16' now"]
    assert settings_changed(then, composed("trainer.precision=fp32", "trainer.final_eval_batches=3")) == []
    assert settings_changed(then, composed("trainer.precision=fp32", "trainer.final_eval_batches=3"), finished=True) \
        == ["trainer.final_eval_batches=200 then, 3 now"]
    assert settings_changed(saved(), composed("optimizer.muon_lr=0.05", "optimizer.muon_momentum=0.9")) == []
    assert settings_changed(saved("optimizer.name=muon"), composed("optimizer.name=muon", "optimizer.muon_lr=0.05")) \
        == ["optimizer.muon_lr=0.02 then, 0.05 now"]
    assert settings_changed(saved(), composed("data.tokenizer_train_chars=1000"), finished=True) == []
    assert settings_changed(saved("data.tokenizer=bpe"), composed("data.tokenizer=bpe", "data.tokenizer_train_chars=1000"),
                            finished=True) == ["data.tokenizer_train_chars=100000000 then, 1000 now"]
    assert settings_changed(saved(), composed("optimizer.decay_steps=40"), planned_total=40) == []
    assert settings_changed(saved(), composed("optimizer.decay_steps=30"), planned_total=40) \
        == ["optimizer.decay_steps=None then, 30 now"]
    # A key added since the snapshot was written: the run trained with its default (it used to pass unseen)
    older = saved()
    del older["optimizer"]["warmup_steps"]
    assert settings_changed(older, composed()) == []
    assert settings_changed(older, composed("optimizer.warmup_steps=7")) == ["optimizer.warmup_steps=100 then, 7 now"]

    ten = TrainState(epoch=0, step=10, epoch_position=80)
    limits = saved("trainer.max_steps=10")
    assert past_limits(ten, limits, composed("trainer.max_steps=10").trainer) is None
    assert past_limits(ten, limits, composed("trainer.max_steps=4").trainer) \
        == "it stopped at step 10: trainer.max_steps=10 then, 4 now"
    two_epochs = TrainState(epoch=2, step=16)
    assert past_limits(two_epochs, saved("trainer.max_epochs=2"), composed("trainer.max_epochs=2").trainer) is None
    assert past_limits(two_epochs, saved("trainer.max_epochs=2"), composed("trainer.max_epochs=1").trainer) \
        == "it stopped in epoch 2 (step 16): trainer.max_epochs=2 then, 1 now"


@pytest.mark.unit
def test_a_snapshot_pending_its_final_evaluation_is_refused_like_a_finished_run():
    """finished_earlier (main.py): a snapshot saved at the last step before the final
    evaluation (a kill during it) is no finished run yet, but its training is over: a config
    that stops earlier, or another corpus, is refused as for a finished run, never completed
    and reported as this config's result."""
    from dataclasses import asdict

    import torch
    from omegaconf import OmegaConf

    from mingpt_ddp.distributed import DistEnv
    from mingpt_ddp.errors import ConfigError
    from mingpt_ddp.main import AgreedSnapshot, finished_earlier
    from mingpt_ddp.trainer import TrainState

    dist = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    then = OmegaConf.to_container(composed("trainer.max_steps=20"), resolve=True, enum_to_str=True)
    for pending in (False, True):
        state = asdict(TrainState(epoch=0, step=20, epoch_position=160, final_eval_pending=pending))
        found = AgreedSnapshot({"train_state": state, "config": then, "total_steps": 20}, "run/snapshot.pt")
        with pytest.raises(ConfigError, match="finished past this config's end"):
            finished_earlier(composed("trainer.max_steps=10"), dist, found)
        with pytest.raises(ConfigError, match="finished on another corpus"):
            finished_earlier(composed("trainer.max_steps=20"), dist, found, corpus_changed="the text changed")
        same = finished_earlier(composed("trainer.max_steps=20"), dist, found)
        assert (same is None) == pending  # pending: the resume runs the final evaluation
