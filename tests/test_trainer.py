"""The loop's numerics in one process: AMP clipping order, accumulation, LR schedule."""
import json
import math

import pytest
import torch

from mingpt_ddp import distributed
from mingpt_ddp.char_dataset import CharCorpus
from mingpt_ddp.config import OptimizerConfig, OptimizerName, Precision, TrainerConfig
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.trainer import Trainer, lr_at

pytestmark = pytest.mark.unit

SINGLE = distributed.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                             device=torch.device("cpu"), backend="gloo")


def make_trainer(text, precision="fp32", resumed_precision=None, optimizer=None, **trainer_kw):
    corpus = CharCorpus(text, 0.1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=corpus.vocab.size, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    cfg = TrainerConfig(batch_size=4, precision=Precision(precision), **trainer_kw)
    return Trainer(cfg, optimizer or OptimizerConfig(warmup_steps=0), model, corpus, SINGLE,
                   MetricsLog(None, enabled=False, total_steps=0), saver=None, snapshot_metadata={},
                   resumed_precision=resumed_precision)


@pytest.fixture(scope="module")
def text(shakespeare):
    return shakespeare.read_text()[:20_000]


def first_batch(trainer):
    return next(trainer.step_batches())


def test_an_epoch_s_order_is_not_built_one_python_int_at_a_time(text, monkeypatch):
    """Issue 30: torch.tensor(list(sampler)) cost seconds and GBs per rank at 10-100M windows;
    the epoch's order comes as one tensor, the same windows in the same order."""
    from mingpt_ddp.char_dataset import ResumableDistributedSampler
    trainer = make_trainer(text)
    monkeypatch.setattr(ResumableDistributedSampler, "__iter__", lambda self: pytest.fail("iterated"))
    x, _ = first_batch(trainer)[0]
    monkeypatch.undo()
    expected, _ = trainer.sampler.dataset.batch(torch.tensor(list(trainer.sampler)[:4]))
    assert torch.equal(x, expected)


def grad_norm_seen_by_optimizer(trainer):
    seen = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item())

    trainer.optimizer.register_step_pre_hook(record)
    trainer._optimizer_step(first_batch(trainer))
    return seen[0]


def test_fp16_clips_the_unscaled_gradients(text):
    """The tutorial clipped scaled gradients; here the optimizer sees norm == grad_clip."""
    unclipped = grad_norm_seen_by_optimizer(make_trainer(text, "fp16", grad_clip=0.0))
    assert unclipped > 0.2, "test needs a gradient larger than the clip below"
    clipped_trainer = make_trainer(text, "fp16", grad_clip=0.1)
    assert clipped_trainer.scaler.is_enabled() and clipped_trainer.scaler.get_scale() > 1000
    assert grad_norm_seen_by_optimizer(clipped_trainer) == pytest.approx(0.1, rel=0.05)


def test_fp32_and_bf16_steps_lower_the_loss(text):
    for precision in ("fp32", "bf16"):
        trainer = make_trainer(text, precision)
        batch = first_batch(trainer)
        losses = [trainer._optimizer_step(batch).item() for _ in range(15)]
        assert losses[-1] < losses[0] - 0.3, (precision, losses)


def test_accumulation_matches_one_big_batch(text):
    """4 micro-batches of 4 with no_sync-style accumulation == one batch of 16: the same
    gradients reach the optimizer. (Not compared after AdamW's first step, g / (|g| + eps):
    it turns the summation order's rounding of a gradient near eps into a difference near lr.)"""
    accum = make_trainer(text, grad_accum_steps=4)
    whole = make_trainer(text)
    micro = first_batch(accum)
    x = torch.cat([m[0] for m in micro])
    y = torch.cat([m[1] for m in micro])
    grads = {}

    def keep(name):
        def hook(optimizer, args, kwargs):
            grads[name] = [p.grad.clone() for g in optimizer.param_groups for p in g["params"]]
        return hook
    for name, trainer in (("accum", accum), ("whole", whole)):
        trainer.optimizer.register_step_pre_hook(keep(name))
    accum._optimizer_step(micro)
    whole._optimizer_step([(x, y)])
    assert len(grads["accum"]) == len(grads["whole"]) == len(list(whole.model.parameters()))
    for a, b in zip(grads["accum"], grads["whole"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_lr_warms_up_then_decays_to_min_lr():
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert lr_at(0, cfg, 100) == pytest.approx(1e-4)
    assert lr_at(9, cfg, 100) == pytest.approx(1e-3)
    assert lr_at(55, cfg, 100) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr_at(100, cfg, 100) == pytest.approx(1e-4) and lr_at(500, cfg, 100) == pytest.approx(1e-4)
    fixed = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_steps=1000)
    assert lr_at(100, fixed, 100) > 9e-4  # the horizon comes from decay_steps, not the plan
    assert not math.isnan(lr_at(0, OptimizerConfig(warmup_steps=0), 1))


def resumed_under_auto(text, monkeypatch, bf16_slowdown):
    """A bf16 snapshot resumed with trainer.precision=auto on a CPU whose bf16 matmuls read
    `bf16_slowdown` times fp32's; returns (the precision used, whether auto decided again)."""
    decided = []
    monkeypatch.setattr("mingpt_ddp.precision.bf16_matmul_slowdown", lambda n_embd, rows: bf16_slowdown)
    from mingpt_ddp.precision import Decision
    monkeypatch.setattr("mingpt_ddp.precision.cpu_decision",
                        lambda *args, **kwargs: decided.append(True) or Decision("fp32", "measured", {}, ""))
    trainer = make_trainer(text, "auto", resumed_precision="bf16")
    return trainer.precision.name, bool(decided)


def test_auto_resume_keeps_bf16_where_this_cpu_runs_it_fast(text, monkeypatch):
    assert resumed_under_auto(text, monkeypatch, bf16_slowdown=0.5) == ("bf16", False)


def test_auto_resume_decides_again_where_bf16_is_emulated(text, monkeypatch):
    """Requeued from an AVX512-BF16/AMX node onto an AVX2-only one: bf16 there is ~30x slower."""
    assert resumed_under_auto(text, monkeypatch, bf16_slowdown=30.0) == ("fp32", True)


def test_resume_takes_optimizer_settings_from_the_config_not_the_snapshot(text):
    """optimizer.load_state_dict restores the saved groups' settings; a changed optimizer.muon_lr,
    muon_momentum or betas must still apply (as a changed optimizer.lr does)."""
    def muon(**kw):
        return OptimizerConfig(name=OptimizerName.muon, warmup_steps=0, lr=1e-3, **kw)

    first = make_trainer(text, optimizer=muon(muon_lr=0.02, muon_momentum=0.95, betas=(0.9, 0.95)))
    first._optimizer_step(first_batch(first))
    snapshot = first.state_dict()
    resumed = make_trainer(text, optimizer=muon(muon_lr=1e-4, muon_momentum=0.8, betas=(0.8, 0.9)))
    resumed.load_state_dict(snapshot)
    groups = resumed.optimizer.param_groups
    matrices = [g for g in groups if g["muon"]]
    assert matrices and all(g["lr_scale"] == pytest.approx(1e-4 / 1e-3) and g["momentum"] == 0.8 for g in matrices)
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in groups)
    assert resumed.optimizer.state_dict()["state"], "the moments still come from the snapshot"


class RecordingSaver:
    """BackgroundSaver's interface, keeping what each save was handed."""
    failed, error, last_saved = False, None, None

    def __init__(self):
        self.saved = []
        self.states = []

    def submit(self, state, step):
        self.saved.append((step, state["train_state"], state.get("failed_check", "not recorded")))
        self.states.append(state)

    def wait(self):
        return None


def test_the_last_step_is_saved_before_the_final_evaluation_then_after_it(text):
    """The last step is saved right after the check, flagged final_eval_pending (a kill during
    a long final evaluation loses nothing), then again with its final val_loss; saved in the
    loop too (snapshot_every_steps reaching it), it would hold no final val_loss nor the check."""
    trainer = make_trainer(text, max_steps=4, snapshot_every_steps=2, eval_every=1000, eval_batches=1)
    trainer.saver = saver = RecordingSaver()
    val_loss = trainer.fit()
    assert [(step, state["final_eval_pending"], check) for step, state, check in saver.saved] == [
        (2, False, None), (4, True, None), (4, False, None)]
    assert saver.saved[-1][1]["last_val_loss"] == val_loss


def test_where_a_step_cannot_be_saved_again_atomically_the_last_step_is_saved_once(text):
    """Sharded snapshots remove a step's committed directory before its second save is
    committed: a kill then would lose the step and, with keep_last=1, the whole run. Their
    saver says so, and the last step is saved once, after the final evaluation."""
    trainer = make_trainer(text, max_steps=4, snapshot_every_steps=2, eval_every=1000, eval_batches=1)
    trainer.saver = saver = RecordingSaver()
    saver.replaces_a_step_atomically = False
    val_loss = trainer.fit()
    assert [(step, state["final_eval_pending"], check) for step, state, check in saver.saved] == [
        (2, False, None), (4, False, None)]
    assert saver.saved[-1][1]["last_val_loss"] == val_loss


@pytest.fixture(autouse=True)
def forget_stop_signals():
    """A stop signal stays `received` after training (a sweep ends on it): not into the next test."""
    yield
    from mingpt_ddp import preemption

    preemption._received = 0


def stop_at(step):
    """A step callback: SIGUSR1 to this process at `step` (the next agreement stops the run)."""
    import os
    import signal

    return lambda t: t.state.step == step and os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.parametrize("ends_by", ["max_steps", "max_epochs"])
def test_a_start_on_a_snapshot_pending_its_final_evaluation_runs_only_that(text, ends_by):
    """Stopped at its last step (also the last epoch's, counted after its batch loop): saved
    pending its final evaluation, which the next start runs, training nothing, then saves."""
    text = text[:3000]
    limits = dict(max_steps=4) if ends_by == "max_steps" else dict(max_epochs=1)
    kw = dict(eval_every=1000, eval_batches=1, log_every=1, **limits)
    trainer = make_trainer(text, **kw)
    last = trainer.total_steps
    trainer.saver = saver = RecordingSaver()
    trainer.step_callbacks.append(stop_at(last))
    assert trainer.fit() is None and trainer.stopped_by == "SIGUSR1"
    assert [(step, state["final_eval_pending"]) for step, state, _ in saver.saved] == [(last, True)]
    snapshot = saver.states[-1]

    resumed = make_trainer(text, **kw)
    resumed.load_state_dict(snapshot)
    resumed.saver = again = RecordingSaver()
    steps = []
    resumed.step_callbacks.append(lambda t: steps.append(t.state.step))
    val_loss = resumed.fit()
    assert val_loss is not None and not steps
    assert [(step, state["final_eval_pending"], state["last_val_loss"]) for step, state, _ in again.saved] == [
        (last, False, val_loss)]


@pytest.mark.parametrize("ends_by", ["max_steps", "max_epochs"])
@pytest.mark.parametrize("stopped_at_the_end", [False, True])
def test_a_failed_end_of_run_check_is_recorded_in_the_last_snapshot(text, stopped_at_the_end, ends_by, caplog):
    """The ranks' parameters differ at the end (the check's answer stands in for two ranks'):
    the last snapshot is saved with the failed check, then the run fails, also when a stop
    signal came at the last step, and when the run ends by max_epochs (whose last step the
    loop saves when snapshot_every_steps reaches it)."""
    from mingpt_ddp import errors

    text = text[:3000]
    limits = dict(max_steps=4) if ends_by == "max_steps" else dict(max_epochs=1)
    trainer = make_trainer(text, eval_every=1000, eval_batches=1, log_every=1, **limits)
    last = trainer.total_steps
    assert last % 2 == 0, "the test saves at half the run"
    trainer.cfg.snapshot_every_steps = last // 2  # and at the last step
    trainer.saver = saver = RecordingSaver()
    failed = {"check": "parameters identical on all ranks", "message": "parameters differ between ranks (...)"}
    trainer._check_ranks_agree = lambda: failed
    if stopped_at_the_end:
        trainer.step_callbacks.append(stop_at(last))
    with pytest.raises(errors.UserFacingError, match=r"parameters differ between ranks \(\.\.\.\): the last snapshot .* "
                                                 r"trainer\.resume_failed_check=true") as raised:
        trainer.fit()
    # a person compares the nodes: exit 2 and recorded as a ConfigError, never requeued as a RunError
    assert errors.class_of(raised.value) is errors.ConfigError and raised.value.exit_code == 2, type(raised.value)
    assert trainer.stopped_by == ("SIGUSR1" if stopped_at_the_end else None)
    assert [(step, check) for step, _, check in saver.saved] == [(last // 2, None), (last, failed)]
    assert [r.message for r in caplog.records if r.levelname == "ERROR"] == [
        "parameters differ between ranks (...): saving the last snapshot marked as failing this check"]


def test_a_failed_check_whose_marked_snapshot_cannot_be_saved_is_still_reported(text, caplog):
    """The marked save fails (the store unreachable for trainer.save_retry_minutes): the error
    says both, and the check was logged before the save was tried."""
    from mingpt_ddp import errors

    class FailingSaver(RecordingSaver):
        def wait(self):
            return "saving snapshot.pt failed: store unreachable" if self.saved else None

    trainer = make_trainer(text, max_steps=2, eval_every=1000, eval_batches=1)
    trainer.saver = FailingSaver()
    trainer._check_ranks_agree = lambda: {"check": "parameters identical on all ranks",
                                          "message": "parameters differ between ranks (...)"}
    with pytest.raises(errors.NeedsAPerson, match=r"parameters differ between ranks \(\.\.\.\), and the last "
                                                  r"snapshot, marked .* could not be saved \(saving snapshot.pt failed"):
        trainer.fit()
    assert any(r.levelname == "ERROR" and "parameters differ" in r.message for r in caplog.records)


def test_the_loop_reads_device_values_only_at_log_steps(text):
    """A GPU runs ahead of the host only while the host never waits for a device value: a
    `.item()`, `float(t)` or `bool(t)` (each one aten._local_scalar_dense, seen here on the CPU
    too) in every step would stall it once per micro-batch. Counted per step through fit():
    the loss and the gradient norm (clipping) are read at log steps alone (after steps 5 and 10)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class CountScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    trainer = make_trainer(text, grad_accum_steps=2, grad_clip=1.0, max_steps=12, log_every=5, eval_every=1000,
                           final_eval_batches=1)
    per_step, before = [], [0]

    def count(t):
        per_step.append(len(reads) - before[0])
        before[0] = len(reads)

    trainer.step_callbacks.append(count)
    with CountScalarReads():
        trainer.fit()
    assert len(per_step) == 12
    assert [step for step, n in enumerate(per_step, 1) if n] == [6, 11], per_step  # the reads of steps 5 and 10's logs


def test_each_metrics_record_names_the_precision_its_steps_trained_in(text, tmp_path, monkeypatch):
    """Review of issue 32: nothing machine-readable recorded precision=auto's switch mid-run
    (precision.RunCheck switches at a log step, after that window's steps)."""
    from mingpt_ddp import metrics, precision, trainer as trainer_module

    monkeypatch.setattr(trainer_module, "cached_peak", lambda device, dtype, shapes: metrics.Peak(1e11, str(dtype)))
    trainer = make_trainer(text, max_steps=4, log_every=2, eval_every=1000, final_eval_batches=1)
    trainer.metrics = MetricsLog(str(tmp_path / "metrics.jsonl"), enabled=True, total_steps=4)
    trainer.step_callbacks.append(lambda t: t.state.step == 2 and t.switch_precision(precision.PrecisionPlan("bf16", "cpu")))
    trainer.fit()
    trainer.metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["precision"]) for r in records if "train_loss" in r] == [(2, "fp32"), (4, "bf16")]
