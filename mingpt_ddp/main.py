"""Train a character-level GPT with DDP: ``torchrun mingpt_ddp/main.py [overrides]``.

The composition root: compose the config, join the process group, build data, model,
snapshot store and trainer, and hand over to ``Trainer.fit``.

How a process ends (``main`` and ``run``):

=====================================================  ==========================================
what happened                                          exit code
=====================================================  ==========================================
trained to the end, or found the run finished earlier  0
stopped by SIGTERM/SIGUSR1 after a snapshot            0 (Slurm requeues; torchrun does not restart)
stopped by Ctrl-C after a snapshot                     130 alone, 0 as a torchrun worker
bad input (ConfigError)                                2, one ``error:`` line from the rank that hit it
a failed run (RunError): worth retrying                4, the same
a sweep that went on past failed points                2 at its end if one failed with a ConfigError,
                                                       else 4 (a requeue resumes the failed ones)
a peer or the network lost (a collective failed)       3, one line
a bug                                                  its traceback (torchrun's summary names the rank)
=====================================================  ==========================================

A ConfigError or RunError is also recorded where the launchers read it (errors.record):
mingpt_ddp.tools.torchrun exits with the class's code whichever worker exited first, and
launch/train.sbatch requeues a RunError, never a ConfigError.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import os
import shlex
import signal
import sys
import time
from typing import Any, NamedTuple, Optional

if __package__ in (None, ""):
    # Run as a script (`torchrun mingpt_ddp/main.py`): import the package from this checkout,
    # not from whatever copy the interpreter has installed (or none, in a container image).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mingpt_ddp import profiling  # noqa: E402 (standard library only at import)
from mingpt_ddp.dependencies import require  # noqa: E402 (standard library only)

profiling.mark("interpreter and package started")

require("torch", "hydra", "omegaconf", "fsspec")  # one line naming a missing one, not a traceback per rank

from mingpt_ddp.preemption import INTERRUPTED_EXIT_CODE, record_stop_signals  # noqa: E402 (standard library only)


def _launch_rank() -> str:
    """This process's rank before distributed.setup: torchrun's RANK, else plain srun's
    SLURM_PROCID (setup maps it to RANK later)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


# Where the process is outside training, for the line a stop signal there prints.
STARTING = "during start-up: stopped at once (nothing new trained yet)"
AFTER_TRAINING = "after training: stopped at once (its last snapshot is saved)"
BETWEEN_POINTS = "between sweep points: stopped at once (the finished points are saved; the same command resumes)"
# Training began and failed (a save that kept failing, a lost peer): its teardown.
STOPPING_ON_ERROR = "while the run stops on an error: stopped at once (the snapshots it saved are kept)"
_outside_training = STARTING


def stop_at_once(signum, frame) -> None:
    """Ctrl-C outside training (start-up, the closing sample, between the points of a
    sweep): one line saying where, no traceback from every rank. During training the
    trainer turns Ctrl-C into a stop with a snapshot. (SIGTERM there keeps its default
    action, death at once: a Python handler would wait for a blocking call, a rendezvous
    or a store wait, to return.)"""
    if _launch_rank() == "0":
        os.write(2, f"Ctrl-C {_outside_training}\n".encode())
    os._exit(INTERRUPTED_EXIT_CODE)


def _outside(where: str) -> None:
    global _outside_training
    _outside_training = where


@contextlib.contextmanager
def _training():
    """Around fit(): after it, a Ctrl-C is outside training again; its last snapshot is saved
    only when it returned (stopped or finished), not when it raised."""
    try:
        yield
    except BaseException:
        _outside(STOPPING_ON_ERROR)
        raise
    _outside(AFTER_TRAINING)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, stop_at_once)
    # SIGUSR1 from now on asks for a stop (acted on at the first agreement of the ranks), even
    # during start-up or between the points of a sweep.
    record_stop_signals()

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from mingpt_ddp import config, distributed, loggers, parallel, precision, preemption, profiling, time_budget
from mingpt_ddp.checkpoint import pretrained, run_dir as run_dir_check, storage
from mingpt_ddp.tools import cluster, sample
from mingpt_ddp.char_dataset import Vocabulary
from mingpt_ddp.corpus import identity as corpus_identity
from mingpt_ddp.corpus import token_cache
from mingpt_ddp.corpus.token_cache import load_corpus
from mingpt_ddp.distributed import DistEnv, on_every_rank
from mingpt_ddp import errors
from mingpt_ddp.errors import ConfigError, RunError, UserFacingError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.model import GPTConfig
from mingpt_ddp.checkpoint.run_lock import Locks, RunLock
from mingpt_ddp.checkpoint.snapshot import CorruptSnapshot, SnapshotStore, decode
from mingpt_ddp.tools.runs import read_result
from mingpt_ddp.tools.sweep import write_result
from mingpt_ddp.trainer import Trainer, TrainState, is_finished, seed_everything
from torch.distributed.elastic.multiprocessing.errors import record

log = logging.getLogger("mingpt_ddp")
config.register()
cluster.register_resolvers()  # ${mingpt_cpus_per_task:} in conf/hydra/launcher/slurm.yaml
profiling.mark("imports")


def check_same_tokenizer(snapshot: dict[str, Any], where: str, cfg: config.DataConfig) -> None:
    """A resume keeps the snapshot's tokenizer: another data.tokenizer or data.vocab_size
    would give the weights ids that mean other text."""
    saved = (snapshot.get("tokenizer") or {}).get("kind", "char")
    saved_size = snapshot.get("config", {}).get("data", {}).get("vocab_size")
    kind = getattr(cfg.tokenizer, "value", cfg.tokenizer)
    changed = saved != kind or (kind == "bpe" and saved_size is not None and saved_size != cfg.vocab_size)
    if changed:
        was = f"data.tokenizer={saved}" + (f" data.vocab_size={saved_size}" if saved == "bpe" else "")
        now = f"data.tokenizer={kind}" + (f" data.vocab_size={cfg.vocab_size}" if kind == "bpe" else "")
        raise ConfigError(f"snapshot {where} was trained with {was} but the config says {now}: set {was} to resume "
                          "it, or start a new run (new hydra.run.dir / trainer.snapshot_path)")


def check_not_failed(snapshot: dict[str, Any], where: str, cfg: config.TrainerConfig, dist: DistEnv) -> None:
    """A snapshot marked as failing the end-of-run check (the ranks' parameters differed) is
    neither a finished run nor one to resume, unless trainer.resume_failed_check says so."""
    failed = snapshot.get("failed_check")
    if not failed:
        return
    message = failed.get("message") if isinstance(failed, dict) else failed
    if not cfg.resume_failed_check:
        raise ConfigError(
            f"snapshot {where} failed the end-of-run check ({message}), so it is not a finished run "
            "and its weights (rank 0's) may be wrong: compare the nodes' environments, then set "
            "trainer.resume_failed_check=true to resume from it anyway, or start a new run (new hydra.run.dir / "
            "trainer.snapshot_path)")
    if dist.is_main:
        log.warning("snapshot %s failed the end-of-run check (%s): taken as it is (trainer.resume_failed_check=true)",
                    where, message)



class AgreedSnapshot(NamedTuple):
    """The snapshot every rank resumes from: its content (a sharded store's: the metadata,
    its shards are loaded later) and where it lives."""
    snapshot: dict[str, Any]
    where: str


class SnapshotView(NamedTuple):
    """What one rank found, compared across ranks: the same step and checksum everywhere."""
    step: int
    checksum: str  # the payload's sha256, or a sharded snapshot's directory
    where: str

    @property
    def identity(self) -> tuple[int, str]:
        return self.step, self.checksum


def load_agreed_snapshot(store, dist: DistEnv) -> Optional[AgreedSnapshot]:
    """The newest snapshot, checked to be the same one (step and payload checksum, or the
    sharded snapshot's directory) on every rank. A snapshot path that is not on storage all
    nodes share gives each node its own view: one rank resuming at step N while another
    starts from scratch would train diverging replicas silently, so that is an error naming
    who saw what. A snapshot file is read by rank 0 alone and sent to the others over the
    process group (read_and_send); a sharded store gives the metadata, its shards are loaded later."""
    if dist.is_distributed and store.read_by_rank0:
        return read_and_send(store, dist)
    found = on_every_rank(store.latest_for_resume, dist)
    view = None if found is None else SnapshotView(found[0]["train_state"]["step"], store.identity(found[1]), found[1])
    check_same_snapshot(view)
    return None if found is None else AgreedSnapshot(*found)


def read_and_send(store: SnapshotStore, dist: DistEnv) -> Optional[AgreedSnapshot]:
    """Rank 0 reads and verifies the newest snapshot file; every other rank reads only its
    header (256 bytes) at the same path, so a store some node does not share is still found
    out (check_same_snapshot); then rank 0 sends the file's bytes over the process group in
    chunks (distributed.broadcast_bytes: one read of shared storage per job, not one per
    rank, 1.5 GB x 32 for gpt2 on 32 GPUs) and each rank verifies the checksum and decodes
    them itself, so every rank's checks (model, corpus, failed_check) see the same snapshot."""
    chosen = on_every_rank(lambda: distributed.wait_for_main(store.read_newest, f"reading the newest snapshot at "
                                                             f"{store.url}"), dist)
    def peek() -> Optional[tuple[int, str, str]]:
        if dist.is_main:
            return None if chosen is None else (chosen["step"], chosen["sha256"], chosen["where"])
        try:
            return storage.retry_transient(lambda: store.peek(chosen), f"reading the snapshot header at {store.url}",
                                           store.retry_minutes)
        except Exception as exc:
            raise ConfigError(f"cannot read snapshots at {store.url} ({storage.describe(exc)})"
                              f"{store._hint(exc, 'read')}") from None
    seen = on_every_rank(peek, dist)
    check_same_snapshot(SnapshotView(*seen) if seen else None)
    if chosen is None:
        return None
    snapshot, blob = store.take_kept() if dist.is_main else (None, None)
    blob = distributed.broadcast_bytes(blob, chosen["bytes"])

    def decode_received() -> dict[str, Any]:
        try:
            return decode(blob, chosen["where"])
        except CorruptSnapshot as exc:
            raise RunError(f"the snapshot sent by rank 0 arrived damaged ({exc}): run the same command to resume")
    received = on_every_rank(lambda: None if dist.is_main else decode_received(), dist)
    snapshot = snapshot if dist.is_main else received
    del blob
    reads = distributed.all_gather_object(store.bytes_read)
    if dist.is_main:
        log.info("snapshot %s (step %d, %s bytes): read from storage by rank 0 and sent to %d other rank(s); bytes "
                 "read from storage per rank: %s", chosen["where"], chosen["step"], f"{chosen['bytes']:,}",
                 dist.world_size - 1, ", ".join(f"{r:,}" for r in reads))
    return AgreedSnapshot(snapshot, chosen["where"])


def check_same_snapshot(view: Optional[SnapshotView]) -> None:
    """Every rank's view gathered: a ConfigError on every rank naming who saw what, unless all agree."""
    # plain tuples over the wire: main.py may run as __main__ (torchrun mingpt_ddp/main.py)
    views = [SnapshotView(*v) if v is not None else None
             for v in distributed.all_gather_object(tuple(view) if view else None)]
    seen: dict[Any, list[int]] = {}
    for rank, v in enumerate(views):
        seen.setdefault(v.identity if v else None, []).append(rank)
    if len(seen) > 1:
        parts = []
        for ranks in seen.values():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
            v = views[ranks[0]]
            checksum = f" (sha256 {v.checksum[:12]})" if v and v.checksum != v.where else ""
            parts.append(f"{who}: " + (f"step {v.step} from {v.where}{checksum}" if v else "no snapshot"))
        raise ConfigError(
            f"ranks see different snapshots ({'; '.join(parts)}): trainer.snapshot_path (default: snapshot.pt "
            "in the run directory) must be one location on storage every node can read (a shared filesystem "
            "or an object store), the same on every rank"
        )


def check_compatible(snapshot: dict[str, Any], where: str, model_cfg: GPTConfig, text_vocab: Vocabulary,
                     optimizer: str = "adamw") -> None:
    """Refuse a snapshot made for another model, vocabulary or optimizer, saying which part differs."""
    saved_optimizer = snapshot.get("config", {}).get("optimizer", {}).get("name", "adamw")
    if saved_optimizer != optimizer:
        raise ConfigError(
            f"snapshot {where} was trained with optimizer.name={saved_optimizer} but the config says {optimizer} "
            f"(its state does not carry over): set optimizer.name={saved_optimizer} to resume it, or use a new "
            "hydra.run.dir / trainer.snapshot_path to start over with another optimizer"
        )
    saved = {"gelu": "exact", **snapshot["model_config"]}  # snapshots from before model.gelu: exact, as trained
    for key in ("n_layer", "n_head", "n_embd", "block_size", "gelu"):
        if saved[key] != getattr(model_cfg, key):
            prefix = "data" if key == "block_size" else "model"
            raise ConfigError(
                f"snapshot {where} was trained with {prefix}.{key}={saved[key]} but the config says "
                f"{getattr(model_cfg, key)}: set {prefix}.{key}={saved[key]} to resume it, or use a new "
                "hydra.run.dir / trainer.snapshot_path to start a different model"
            )
    missing = sorted(set(text_vocab.chars) - set(snapshot["vocab"])) if isinstance(text_vocab, Vocabulary) else []
    if missing:
        raise ConfigError(
            f"snapshot {where} has a vocabulary of {len(snapshot['vocab'])} characters that lacks "
            f"{''.join(missing)!r} found in data.path: resume with the text it was trained on, "
            "or start a new run (new hydra.run.dir / trainer.snapshot_path)"
        )


def train(cfg: DictConfig, dist: DistEnv, run_dir: str) -> "Outcome":
    """One run (or one sweep point): how it ended."""
    # model.init_from: the checkpoint's shape into cfg.model, so the checks, the snapshots and
    # a resume's comparisons see what trains (read on rank 0, the same on every rank)
    settled = distributed.on_main_then_share(lambda: _settle_init_from(cfg), dist)
    if settled is not None:
        _settle_init_from(cfg, settled)
    config.validate(cfg)
    loggers.check(cfg)  # the trackers asked for are installed (the schema itself knows no tracker)
    snapshot_options = storage.resolve_options(cfg.trainer.storage_options, "trainer.storage_options")
    path = cfg.trainer.snapshot_path or os.path.join(run_dir, "snapshot.pt")
    # The snapshot files at `path` as DDP writes them: the run lock lives beside them, and an
    # FSDP run may start from them.
    files_at_path = SnapshotStore(path, cfg.trainer.keep_last, snapshot_options,
                                  retry_minutes=cfg.trainer.load_retry_minutes)
    if parallel.strategy_name(cfg.trainer) == "fsdp":  # every rank writes its shard (sharded_snapshot.py)
        from mingpt_ddp.checkpoint.sharded_snapshot import ShardedSnapshotStore

        saves_to = ShardedSnapshotStore(path, cfg.trainer.keep_last, snapshot_options,
                                        retry_minutes=cfg.trainer.load_retry_minutes,
                                        save_retry_minutes=cfg.trainer.save_retry_minutes,
                                        collective_timeout_minutes=config.rank0_wait_minutes(cfg.trainer))
    else:
        saves_to = files_at_path
    distributed.on_main_then_share(saves_to.check_writable, dist)
    lock = RunLock(files_at_path)  # one live run per snapshot location; rank 0 holds it
    distributed.on_main_then_share(lock.acquire, dist)
    held = Locks(lock, run_dir_check.held_lock(run_dir))  # and the run directory's (main()): losing either stops it
    try:
        from_ddp = distributed.on_main_then_share(
            lambda: fsdp_continues_ddp_snapshots(cfg, files_at_path, snapshot_options), dist)
        outcome = _resume_or_start(cfg, dist, run_dir, saves_to, files_at_path if from_ddp else None, held)
        distributed.on_main_then_share(held.raise_if_lost, dist)  # lost after the last stop agreement
        return outcome
    finally:
        lock.release()


def _settle_init_from(cfg: DictConfig, shape: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """Rank 0 (`shape` None): pretrained.settle_config against this command line's overrides;
    returns the model.* values it wrote (None without model.init_from). Every rank: writes them."""
    if shape is not None:
        with open_dict(cfg):
            cfg.model.update(shape)
        return shape
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    note = pretrained.settle_config(cfg, overrides)
    if note is None:
        return None
    log.info(note)
    return {key: getattr(cfg.model[key], "value", cfg.model[key]) for key in pretrained.SHAPE}


def fsdp_continues_ddp_snapshots(cfg: DictConfig, store: SnapshotStore, options: dict[str, Any]) -> bool:
    """Whether an FSDP run starts from DDP snapshot files (True: each rank takes its shard of
    them; its own snapshots are sharded from then on). An FSDP run's shards are not resumed
    by DDP: refused, saying how."""
    fsdp = parallel.strategy_name(cfg.trainer) == "fsdp"
    if not fsdp and not store.may_have_sharded():  # a DDP run imports no DCP (0.6 s) when there is none
        return False
    from mingpt_ddp.checkpoint.sharded_snapshot import is_sharded

    sharded = is_sharded(store.url, options)
    if fsdp:
        return not sharded and bool(store.candidates())
    if sharded:
        raise ConfigError(
            f"the snapshots at {store.url} were saved with trainer.strategy=fsdp: resume them with "
            "trainer.strategy=fsdp, or start a new run (new hydra.run.dir / trainer.snapshot_path)"
        )
    return False


class RunData(NamedTuple):
    """What the run trains on: the corpus (in the ids the weights use), its tokenizer, the
    vocabulary the snapshots record, the model's shape, and the corpus's identity
    (corpus/identity.py) that snapshots and results record."""
    corpus: Any
    tokenizer: Any
    vocab: Any
    model_cfg: GPTConfig
    identity: dict[str, Any]
    start: Optional[pretrained.Start] = None  # model.init_from's weights (checkpoint/pretrained.py)


class Outcome(NamedTuple):
    """How a run (or sweep point) ended: its status, final val loss, snapshot URL, and the
    identity of the corpus it trained on (None when it never got that far)."""
    status: str
    val_loss: Optional[float]
    snapshot: Optional[str]
    corpus: Optional[dict[str, Any]] = None


def _resume_or_start(cfg: DictConfig, dist: DistEnv, run_dir: str, saves_to,
                     ddp_files: Optional[SnapshotStore] = None,
                     lock: Optional[Locks] = None) -> Outcome:
    """`saves_to`: the store this run saves to (and resumes from); `ddp_files`: the DDP
    snapshots an FSDP run starts from; `lock`: the run locks rank 0 holds (losing one stops the run).
    Every rank goes through the same steps in the same order: each has collectives."""
    found = load_agreed_snapshot(ddp_files or saves_to, dist)
    profiling.mark("run lock, snapshot search")
    data = build_data(cfg, dist, found)
    profiling.mark("data (token cache)")
    resume = None
    if found is not None:
        # Checked even for a finished run: another model or text under the same snapshot
        # path is a mistake to report, not a run to skip.
        check_same_start(cfg, dist, found, data.start)
        optimizer = getattr(cfg.optimizer.name, "value", cfg.optimizer.name)
        on_every_rank(lambda: check_compatible(found.snapshot, found.where, data.model_cfg, data.corpus.vocab,
                                               optimizer), dist)
        on_every_rank(lambda: check_not_failed(found.snapshot, found.where, cfg.trainer, dist), dist)
        corpus = corpus_identity.compare(found.snapshot.get("corpus"),
                                         (found.snapshot.get("config") or {}).get("data"), data.identity)
        if corpus.note and dist.is_main:  # the same text elsewhere, or a snapshot older than corpus identities
            log.info("snapshot %s: %s", found.where, corpus.note)
        finished = finished_earlier(cfg, dist, found, corpus.changed)
        if finished is not None:  # recognised before building anything: sweeps skip it fast
            return Outcome("finished earlier", finished.last_val_loss, saves_to.url, found.snapshot.get("corpus"))
        resume = on_every_rank(lambda: check_same_run(cfg, found, corpus), dist)
        if data.vocab != data.corpus.vocab:  # encode with the snapshot's ids so resumed weights mean the same
            corpus_now, _, tok = load_corpus(cfg.data, dist, cfg.trainer.load_retry_minutes, data.vocab,
                                             threads=_encode_threads(cfg, dist))
            data = data._replace(corpus=corpus_now, tokenizer=tok)
    return run_training(cfg, dist, run_dir, saves_to, ddp_files, lock, found, data, resume)


def check_same_start(cfg: DictConfig, dist: DistEnv, found: AgreedSnapshot, start: Optional[pretrained.Start]) -> None:
    """A resume starts from its snapshot, never from model.init_from's weights; these must
    still be the ones its run started from (or none, as then): refused in one line, unless
    trainer.continue_with_new_settings=true (then logged)."""
    changed = pretrained.start_changed(found.snapshot.get("init_from"), start.identity if start else None)
    if changed is None:
        return
    if not cfg.trainer.continue_with_new_settings:
        raise ConfigError(
            f"snapshot {found.where} was trained from other starting weights than this config's ({changed}): give "
            "the model.init_from it started from to resume it, set trainer.continue_with_new_settings=true to resume "
            "it anyway (from the snapshot's weights), or start a new run (another hydra.run.dir / "
            "trainer.snapshot_path)")
    if dist.is_main:
        log.warning("snapshot %s: %s; resumed from the snapshot's weights (trainer.continue_with_new_settings=true)",
                    found.where, changed)


class ResumeCheck(NamedTuple):
    """What a resume logs about the run it continues, whether the epoch in progress starts
    over (its saved position indexes windows of another corpus or another seed's order), and
    whether the corpus is a new one (its validation losses are not the snapshot's)."""
    notes: list[str]
    restart_epoch: bool
    new_corpus: bool = False


def check_same_run(cfg: DictConfig, found: AgreedSnapshot, corpus: corpus_identity.Comparison) -> ResumeCheck:
    """A resume continues the run its snapshot holds. On another corpus, or under other
    values of the settings that define the result (RESULT_KEYS), it is refused in one line
    naming what changed, unless the config asks to go on (data.continue_on_new_corpus,
    trainer.continue_with_new_settings): then the log says so, and the epoch in progress
    starts over where its saved position no longer means the same windows."""
    notes: list[str] = []
    restart = False
    if corpus.changed:
        if not cfg.data.continue_on_new_corpus:
            raise ConfigError(
                f"the corpus changed since the snapshot {found.where}: {corpus.changed}: resume on the text and data "
                "settings it was trained on, set data.continue_on_new_corpus=true to train on this corpus from the "
                "start of the epoch in progress, or start a new run (another hydra.run.dir / trainer.snapshot_path)")
        notes.append(f"continuing on a new corpus (data.continue_on_new_corpus=true): {corpus.changed}; the epoch in "
                     "progress starts again from its first window, and the best validation loss afresh")
        restart = True
    changed = settings_changed(found.snapshot.get("config"), cfg, planned_total=found.snapshot.get("total_steps"))
    if changed:
        if not cfg.trainer.continue_with_new_settings:
            raise ConfigError(
                f"snapshot {found.where} was trained under other settings than this config's "
                f"({'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''}): give the settings it was trained "
                "with to resume it, set trainer.continue_with_new_settings=true to continue it under these, or start "
                "a new run (another hydra.run.dir / trainer.snapshot_path)")
        reseeded = any(c.startswith("trainer.seed=") for c in changed)
        notes.append(f"continuing under other settings than the snapshot's (trainer.continue_with_new_settings=true): "
                     f"{'; '.join(changed)}" + ("; the epoch in progress starts again from its first window (another "
                                                "seed orders its windows otherwise)" if reseeded and not restart else ""))
        restart = restart or reseeded
    return ResumeCheck(notes, restart, new_corpus=bool(corpus.changed))


def _encode_threads(cfg: DictConfig, dist: DistEnv) -> int:
    """The corpus encoding's threads: the cores the node's processes may use (trainer.cpu_threads
    each), as the others wait for the one that encodes (distributed.encode_threads)."""
    return distributed.encode_threads(config.cpu_threads_setting(cfg.trainer), dist.local_world_size)


def build_data(cfg: DictConfig, dist: DistEnv, found: Optional[AgreedSnapshot]) -> RunData:
    """The corpus and model shape: a resumed run keeps the snapshot's tokenizer and vocabulary."""
    saved_tokenizer = None
    if found is not None:
        check_same_tokenizer(found.snapshot, found.where, cfg.data)
        if (found.snapshot.get("tokenizer") or {}).get("kind", "char") != "char":
            saved_tokenizer = found.snapshot["tokenizer"]  # encode with exactly the run's BPE / GPT-2 tokenizer
    corpus, token_file, tok = load_corpus(cfg.data, dist, cfg.trainer.load_retry_minutes,
                                          tokenizer_state=saved_tokenizer, threads=_encode_threads(cfg, dist))
    vocab = corpus.vocab
    if found is not None and saved_tokenizer is None:
        vocab = Vocabulary(found.snapshot["vocab"])
    shape = {k: v for k, v in OmegaConf.to_container(cfg.model, enum_to_str=True).items() if k != "init_from"}
    model_cfg = GPTConfig(vocab_size=vocab.size, block_size=cfg.data.block_size, **shape)
    shown = storage.redacted_config(OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True))
    identity = corpus_identity.identity(token_file.text_sha256, len(corpus.train_tokens), len(corpus.val_tokens), shown)
    # A resume never reads the starting weights again (it loads its snapshot): their hash only.
    start = pretrained.read(cfg.model.init_from, dist, model_cfg, fresh=found is None) if cfg.model.init_from else None
    return RunData(corpus, tok, vocab, model_cfg, identity, start)


def finished_earlier(cfg: DictConfig, dist: DistEnv, found: AgreedSnapshot,
                     corpus_changed: Optional[str] = None) -> Optional[TrainState]:
    """The snapshot's state if it ended its run (under this config's limits), else None.
    `corpus_changed`: how the corpus differs from the one it was trained on (corpus/identity.py)."""
    lifted = time_budget.lift_changed_plan(found.snapshot, cfg.trainer.time_budget_minutes, cfg.optimizer)
    if lifted and dist.is_main:
        log.info(lifted)
    state = TrainState(**found.snapshot["train_state"])
    if not is_finished(state, cfg.trainer):
        return None
    past = past_limits(state, found.snapshot.get("config"), cfg.trainer)
    if past:  # it trained further than this config would: its loss is not this config's (a reordered sweep)
        raise ConfigError(
            f"the run at {found.where} finished past this config's end ({past}): its result is not this config's. "
            "Start a new run (another hydra.run.dir / hydra.sweep.dir), or give the limits it was trained with")
    if corpus_changed:  # its loss is another text's, whatever data.continue_on_new_corpus says
        raise ConfigError(
            f"the run at {found.where} finished on another corpus than this config's ({corpus_changed}): its result "
            "is not this corpus's. Start a new run (another hydra.run.dir / hydra.sweep.dir), or give the text and "
            "data settings it was trained on")
    if state.final_eval_pending:  # training is over, for this config too: the resume runs the final evaluation
        return None  # (a resume compares the settings it may not change: check_same_run)
    changed = settings_changed(found.snapshot.get("config"), cfg, finished=True,
                               planned_total=found.snapshot.get("total_steps"))
    if changed:  # its loss would be credited to settings it never trained with (a reordered sweep)
        raise ConfigError(
            f"the run at {found.where} finished under other training settings than this config's "
            f"({'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''}): its result is not this config's. "
            "Start a new run (another hydra.run.dir / hydra.sweep.dir), or give the settings it was trained with")
    if dist.is_main:
        by_plan = not is_finished(dataclasses.replace(state, planned_steps=None), cfg.trainer)
        further = (time_budget.how_to_extend(state, cfg.trainer.time_budget_minutes) if by_plan
                   else "raise trainer.max_epochs/max_steps to train further")
        log.info("run already finished (epoch %d, step %d, snapshot %s): nothing to do; %s, or start a new run",
                 state.epoch, state.step, found.where, further)
    return state


def past_limits(state: TrainState, saved: Any, now: Any) -> Optional[str]:
    """Where a finished run went past where this config (trainer.* `now`) stops, naming the
    limit then (the snapshot's config `saved`) and now; None when it stopped where this
    config stops. A run that trained further is another run (its schedule, its weights)."""
    then = (saved or {}).get("trainer") or {} if isinstance(saved, dict) else {}
    if now.max_steps is not None and state.step > now.max_steps:
        return (f"it stopped at step {state.step}: trainer.max_steps={then.get('max_steps')} then, "
                f"{now.max_steps} now")
    if state.epoch > now.max_epochs or (state.epoch == now.max_epochs and state.epoch_position > 0):
        return (f"it stopped in epoch {state.epoch + (state.epoch_position > 0)} (step {state.step}): "
                f"trainer.max_epochs={then.get('max_epochs')} then, {now.max_epochs} now")
    return None


# What a run's result depends on, beyond what check_compatible compares (shape, vocabulary,
# optimizer) and the corpus (corpus/identity.py): a run under other values of these did not
# train what it reports, so a finished run is not reported for them and a resume under them
# is refused (check_same_run) unless trainer.continue_with_new_settings says to go on.
RESULT_KEYS = ("model.", "optimizer.", "data.block_size", "trainer.batch_size", "trainer.grad_accum_steps",
               "trainer.seed", "trainer.grad_clip")
# What shapes a finished run's reported result but may change on a resume: a resume evaluates
# with this config's final_eval_batches, keeps the snapshot's tokenizer, and may be given
# another precision (docs/fault-tolerance.md; auto keeps the snapshot's). trainer.precision
# is the requested value (auto's choice may differ from machine to machine).
FINISHED_KEYS = ("trainer.final_eval_batches", "data.tokenizer_train_chars", "trainer.precision")


def settings_changed(saved: Any, cfg: DictConfig, finished: bool = False,
                     planned_total: Optional[int] = None) -> list[str]:
    """`key: saved -> now` for the RESULT_KEYS (and for a `finished` run the FINISHED_KEYS)
    whose value differs from the snapshot's config (none when the snapshot records no
    config). A key its config lacks was added since it was written: its default is what that
    run trained with, so another value now is a change. Settings that did nothing on either side are no
    change: optimizer.muon_* without Muon, data.tokenizer_train_chars without BPE; nor is
    optimizer.decay_steps pinned to `planned_total`, the horizon the snapshot's null meant."""
    if not isinstance(saved, dict):
        return []
    before = config.flat_resolved(saved)
    now = config.flat_resolved(storage.redacted_config(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))
    schema = config.flat_resolved(OmegaConf.structured(config.Config))
    before.update({key: schema[key] for key in now.keys() - before.keys() if key in schema})
    keys = RESULT_KEYS + (FINISHED_KEYS if finished else ())

    def either(key: str, value: str) -> bool:
        return value in (before.get(key), now.get(key))

    def compared(key: str) -> bool:
        if key == "model.init_from":  # by the weights' hash, not the path (check_same_start)
            return False
        if key.startswith("optimizer.muon_"):
            return either("optimizer.name", "muon")
        if key == "data.tokenizer_train_chars":
            return either("data.tokenizer", "bpe")
        return key.startswith(keys)

    def same(key: str) -> bool:
        if key == "optimizer.decay_steps" and before[key] is None and planned_total is not None:
            return now[key] in (None, planned_total)
        return before[key] == now[key]

    return [f"{key}={before[key]!r} then, {now[key]!r} now" for key in sorted(set(before) & set(now))
            if compared(key) and not same(key)]


def lr_horizon(cfg: DictConfig, snapshot: dict[str, Any], total_steps: int,
               resume: Optional[ResumeCheck], moved: Optional[str] = None, plan_pending: bool = False) -> Optional[str]:
    """A note when a resume moves the cosine's horizon (optimizer.decay_steps=null follows
    the planned steps: raised max_steps/max_epochs, another corpus or batch), else None. In
    a sweep that is another point's schedule (its values reordered): refused unless
    trainer.continue_with_new_settings=true or data.continue_on_new_corpus asked for it.
    `snapshot["total_steps"]`: the steps it planned (absent in snapshots before it was recorded).
    `moved`: what the load did to the LR (trainer.continue_schedule; None: its warm-up goes on).
    `plan_pending`: a time budget plans the horizon after the first steps (the lifted plan's note says so)."""
    then = snapshot.get("total_steps")
    if cfg.optimizer.decay_steps is not None or then is None or then == total_steps:
        return None
    if plan_pending:
        return None
    if (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
            and not cfg.trainer.continue_with_new_settings and not (resume is not None and resume.new_corpus)):
        raise ConfigError(
            f"the snapshot's run planned {then} steps and this point plans {total_steps}: with "
            "optimizer.decay_steps=null its LR schedule would be another run's (a sweep's values in another order?). "
            "Give the limits it was trained with, set trainer.continue_with_new_settings=true to extend it, or start "
            "a new sweep (another hydra.sweep.dir)")
    return (f"LR horizon {then} \u2192 {total_steps} steps ({moved or 'its warm-up goes on'}; "
            "optimizer.decay_steps=null follows the planned steps; "
            f"optimizer.decay_steps={then} keeps the snapshot's schedule)")


def run_training(cfg: DictConfig, dist: DistEnv, run_dir: str, saves_to, ddp_files: Optional[SnapshotStore],
                 lock: Optional[Locks], found: Optional[AgreedSnapshot], data: RunData,
                 resume: Optional[ResumeCheck] = None) -> Outcome:
    """Build the model, trackers and trainer, load the snapshot's state, train, report."""
    seed_everything(cfg.trainer.seed)  # identical initial weights on every rank
    weights = data.start.take_weights() if data.start is not None else None  # model.init_from on a fresh start
    model = parallel.build_model(cfg.trainer, data.model_cfg, weights)  # FSDP: on the meta device, shards filled later
    if weights is not None:
        del weights
        distributed.release_cached_memory()  # the checkpoint's bytes and decoded copies (2-3x its size) go back
    profiling.mark("model built")
    seed_everything(cfg.trainer.seed + dist.rank)  # but each rank draws its own dropout masks
    vocab, tok = data.vocab, data.tokenizer
    metadata = {
        "vocab": vocab.chars if isinstance(vocab, Vocabulary) else "",  # characters (as before tokenizers)
        "tokenizer": tok.to_dict(),  # what sample, export and a resume decode and encode with
        "model_config": dict(vars(data.model_cfg)),
        "corpus": data.identity,  # what it trains on: a resume on other text is refused (corpus/identity.py)
        "init_from": pretrained.recorded_start(found.snapshot if found else None, data.start),  # its starting weights
        "config": storage.redacted_config(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)),
    }
    sinks: list[loggers.Sink] = []  # rank 0's trackers; one that cannot start stops every rank
    previous_runs = found.snapshot.get("logger_runs") if found is not None else None
    distributed.on_main_then_share(lambda: sinks.extend(loggers.open_sinks(cfg, metadata["config"], run_dir,
                                                                           previous_runs)), dist)
    metadata["logger_runs"] = loggers.run_ids(sinks)  # a resume continues the same tracker runs
    metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl"), dist.is_main, total_steps=0, sinks=sinks)
    outcome = "failed"
    try:
        saver = saves_to.saver(cfg.trainer.save_retry_minutes, dist.is_main, run_lock=lock)
        trainer = Trainer(cfg.trainer, cfg.optimizer, model, data.corpus, dist, metrics, saver, metadata, lock,
                          token_bytes=torch.from_numpy(tok.byte_lengths()),
                          resumed_precision=found.snapshot.get("precision") if found is not None else None)
        if found is not None:
            # from the store it was found in: an FSDP run starting from DDP files reads them whole
            resumed_from = ddp_files or saves_to
            trainer.load_state_dict(resumed_from.complete(found.snapshot, found.where, trainer.strategy,
                                                          trainer.optimizer),
                                    restart_epoch=resume is not None and resume.restart_epoch,
                                    new_validation=resume is not None and resume.new_corpus)
            metrics.note(f"resumed from {found.where}: epoch {trainer.state.epoch}, step {trainer.state.step}"
                         + (" (a DDP snapshot: each rank took its shard; this run's snapshots are sharded, in "
                            f"{saves_to.display(saves_to.root)})" if ddp_files is not None else ""))
            for note in resume.notes if resume is not None else ():
                metrics.note(note)
            if resume is not None and resume.new_corpus:  # losses before it are another validation split's
                metrics.mark(trainer.state.step, "new corpus")
            horizon = lr_horizon(cfg, found.snapshot, trainer.total_steps, resume, trainer.horizon_moved,
                                 trainer.plan_pending)
            if horizon:
                metrics.note(horizon)
        metrics.total_steps = None if trainer.plan_pending else trainer.total_steps  # shown once planned
        trainer.resume_hint = how_to_resume(cfg, run_dir)
        if cfg.trainer.time_budget_minutes:
            trainer.step_callbacks.append(time_budget.TimeBudget(cfg.trainer.time_budget_minutes))
        precision_check = precision.RunCheck.for_trainer(trainer)  # auto's CPU choice against the run's steps
        if precision_check is not None:
            trainer.step_callbacks.append(precision_check)
        run_dir_check.keep_hydra_files(run_dir)  # from here the run's .hydra/ files describe what trained
        profiling.mark("trainer ready (trackers, wrapping, optimizer)")
        with _training(), profiling.profile_steps(trainer, cfg.trainer, run_dir):
            val_loss = trainer.fit()
        outcome = "finished" if val_loss is not None else "stopped"
        if val_loss is not None and (dist.is_main or trainer.strategy.collective_forward):
            if dist.is_main:
                metrics.note(sample.preview_line())
            # the same text on every rank (same seed; where they sample together rank 0's clock bounds it)
            preview = sample.preview(model, tok, run_dir, together=trainer.strategy.collective_forward,
                                     prompt=sample.corpus_prompt(tok, data.corpus.val_tokens))
            if dist.is_main:
                metrics.note(preview)
            profiling.mark("closing sample")
    finally:
        metrics.close(outcome)
        profiling.mark("metrics closed")
    return Outcome("completed" if val_loss is not None else f"stopped by {trainer.stopped_by}", val_loss,
                   saves_to.url, data.identity)


def how_to_resume(cfg: DictConfig, run_dir: str, what: str = "") -> str:
    """What to run to resume `what` (e.g. "the sweep"; by default the run): the same command,
    plus the directory unless the command names it; else its run id decides (a timestamp,
    torchrun --standalone's random id, a new Slurm job's id) and the same command would start
    over. (A requeued Slurm job keeps its id and resumes by itself.)"""
    hydra_cfg = HydraConfig.get()
    key = "hydra.sweep.dir" if hydra_cfg.mode == RunMode.MULTIRUN else "hydra.run.dir"
    named = any(o.lstrip("+~").split("=", 1)[0] == key for o in hydra_cfg.overrides.hydra)
    resume = f"to resume {what}" if what else "to resume"
    if named or cfg.trainer.snapshot_path:
        return f"run the same command {resume}"
    where = hydra_cfg.sweep.dir if hydra_cfg.mode == RunMode.MULTIRUN else run_dir
    return f"run the same command with {shlex.quote(f'{key}={where}')} {resume}"


def _quiet_other_ranks(dist: DistEnv) -> None:
    """Rank 0 tells the story; the other ranks only speak up for warnings."""
    if not dist.is_main:
        logging.getLogger().setLevel(logging.WARNING)


def _hydra_files_dirs() -> list[str]:
    """Where this process's Hydra wrote the config (rank 0 only): the run's `.hydra/` and,
    in a multirun, the sweep directory's multirun.yaml."""
    hydra_cfg = HydraConfig.get()
    if not hydra_cfg.output_subdir:
        return []
    dirs = [os.path.join(hydra_cfg.runtime.output_dir, hydra_cfg.output_subdir)]
    if hydra_cfg.mode == RunMode.MULTIRUN:
        dirs.append(hydra_cfg.sweep.dir)
    return dirs


def _agreed_run_dir(dist: DistEnv) -> str:
    """The run directory, checked to be the same on every rank (else snapshots would split)."""
    run_dir = HydraConfig.get().runtime.output_dir
    seen = distributed.all_gather_object(run_dir)
    if len(set(seen)) != 1:
        raise RuntimeError(
            f"ranks disagree on the run directory: {sorted(set(seen))}; pass hydra.run.dir / "
            "hydra.sweep.dir explicitly, or start the job through torchrun/srun so all ranks share a run id"
        )
    return run_dir


# Each node may keep its token cache in its own place (a node-local disk).
PER_NODE_KEYS = ("data.cache_dir",)


def _check_ranks_resolved_the_same(cfg: DictConfig) -> None:
    """Every rank must train the configuration rank 0 does: an ${oc.env:...} that differs
    between nodes, or a per-rank path, would go unnoticed (with the per-node token file only
    each node's local rank 0 reads data.path). A hash per rank, then the keys that differ."""
    try:
        flat = config.flat_resolved(cfg)
        problem = None
    except OmegaConfBaseException as exc:
        flat, problem = {}, f"cannot resolve the configuration: {exc}"
    mine = {k: v for k, v in flat.items() if k not in PER_NODE_KEYS}
    digest = hashlib.sha256(repr(sorted(mine.items())).encode()).hexdigest()
    if len(set(distributed.all_gather_object((digest, problem)))) == 1:
        if problem:
            raise ConfigError(problem)
        return
    shown = config.flat_resolved(storage.redacted_config(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))) \
        if problem is None else {}
    ranks = distributed.all_gather_object((mine, shown, problem))
    failed = [(rank, p) for rank, (_, _, p) in enumerate(ranks) if p]
    if failed:
        raise ConfigError(f"rank {failed[0][0]} {failed[0][1]}")
    every_key = set().union(*(m for m, _, _ in ranks))
    keys = sorted(k for k in every_key if len({repr(m.get(k, "<missing>")) for m, _, _ in ranks}) > 1)
    secret = storage.is_secret_option(keys[0])
    values = ", ".join(f"rank {rank}: {storage.REDACTED if secret else theirs.get(keys[0], '<missing>')}"
                       for rank, (_, theirs, _) in enumerate(ranks[:4]))
    raise ConfigError(
        f"ranks resolved different configurations: {', '.join(keys)} ({keys[0]}: {values}"
        f"{', ...' if len(ranks) > 4 else ''}): every rank must train the same configuration; set these keys on "
        "the command line, or give the environment variables they read (${oc.env:...}) the same value on every node"
    )


class _EndProcess(BaseException):
    """Ends the process with `code`, from inside a sweep: torchrun's @record turns
    SystemExit(0) into a plain return, after which Hydra would start the next point."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


_ran_by_cli = False  # main() runs inside run(): this process runs the whole sweep
_points_run = 0  # points of this process's sweep so far
_failed_points: dict[str, type[UserFacingError]] = {}  # those that failed, and how (the same on every rank)


def _stop_exit_code(signum: int) -> int:
    """Ctrl-C: 130 as shells expect (0 under torchrun, which would restart or report a failed
    worker). SIGTERM/SIGUSR1: 0, a clean stop after a snapshot, which launch/train.sbatch
    requeues after SIGUSR1 and torchrun neither restarts nor reports as failed."""
    if signum == signal.SIGINT and not os.environ.get("TORCHELASTIC_RUN_ID"):
        return INTERRUPTED_EXIT_CODE
    return 0


def _report_error(message: str) -> None:
    """One `error:` line from the rank that hit it (prefixed with its rank unless 0), once
    when every rank hit it. Exiting non-zero then ends the job: torchrun stops the other
    workers, srun does with --kill-on-bad-exit."""
    rank = int(os.environ.get("RANK", "0"))
    if distributed.first_to_report(message, HydraConfig.get().runtime.output_dir):
        print(f"{f'[rank {rank}] ' if rank else ''}error: {message}", file=sys.stderr, flush=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
@record  # a bug's traceback reaches torchrun's failure summary, naming the rank (ConfigErrors stay one line)
def main(cfg: DictConfig) -> Optional[float]:
    """Train once, or one point of a multirun; returns the final validation loss (sweepers
    such as Optuna minimise it)."""
    global _points_run
    in_sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    _points_run += in_sweep
    started = time.time()
    profiling.mark("config composed (Hydra)")
    errors.record_start()  # launch/train.sbatch reads the records of the newest try only
    try:
        # Before anything else (Hydra has just written .hydra/ from the raw config): the one
        # boundary every secret crosses; logs, files, snapshots and trackers redact through it.
        storage.resolve_secrets(cfg, _hydra_files_dirs())
        config.check_known_keys(cfg)  # a `+typo=` key: one line before anything starts
        warning = storage.command_line_warning(sys.argv[1:])  # a presigned URL typed there: `ps` shows it
        if warning and _points_run <= 1 and _launch_rank() == "0":
            log.warning(warning)
        config.check_resolves(cfg.trainer)  # its timeouts are read before validate()
        dist = distributed.setup(config.collective_timeout_minutes(cfg.trainer), config.rank0_wait_minutes(cfg.trainer),
                                 config.device_setting(cfg.trainer), config.cpu_threads_setting(cfg.trainer))
        _quiet_other_ranks(dist)
        profiling.mark("process group")
        run_dir = _agreed_run_dir(dist)
        # One live run per run directory: a single run's rank 0 took it before Hydra wrote
        # (RunDirCheck); a sweep point's, now. Refused: the point's .hydra/ goes back below.
        key = "hydra.sweep.dir" if in_sweep else "hydra.run.dir"
        distributed.on_main_then_share(lambda: run_dir_check.hold_run_dir(run_dir, key), dist)
        _check_ranks_resolved_the_same(cfg)
        status, val_loss, snapshot, corpus = train(cfg, dist, run_dir)
        error = ""
    except UserFacingError as exc:  # bad input (ConfigError, exit 2) or a failed run (RunError, 4): one line
        error = storage.redact(str(exc))
        ends_here = not in_sweep or cfg.sweep.stop_on_failure
        if ends_here:  # first: once this rank's peers see it leave, the launcher may stop it at any moment
            errors.record(exc, error)
        run_dir_check.restore_hydra_files(HydraConfig.get().runtime.output_dir)  # unless it began training
        _report_error(error)
        if not in_sweep:  # refused at start: no empty outputs/<run id>/ left behind (rank 0, what this launch made)
            run_dir_check.remove_if_refused(HydraConfig.get().runtime.output_dir, HydraConfig.get().output_subdir)
        if ends_here:
            sys.exit(exc.exit_code)
        status, val_loss, snapshot, corpus = "failed", None, None, None
        run_dir = HydraConfig.get().runtime.output_dir
        _failed_points[str(HydraConfig.get().job.num)] = errors.class_of(exc)
    except Exception as exc:
        refused = distributed.nccl_refused(exc)
        if refused is not None:  # bad input NCCL found (two ranks on one GPU): a ConfigError, never requeued
            errors.record(ConfigError, refused)
            _report_error(refused)
            sys.exit(ConfigError.exit_code)
        lost = distributed.communication_failure(exc)
        if lost is None:
            errors.record_crash()  # launch/train.sbatch: a crash recurs, requeued only after progress
            raise  # a bug: its traceback reaches torchrun's failure summary (@record)
        _report_error(lost)  # a peer or the network is gone: one line, no traceback
        sys.exit(distributed.LOST_PEERS_EXIT_CODE)
    finally:
        if in_sweep:
            _outside(BETWEEN_POINTS)
        gc.collect()  # a sweep's next point starts without this one's model and optimizer
        distributed.release_cached_memory()
    if status == "finished earlier":
        run_dir_check.restore_hydra_files(run_dir)
    # A finished run's record keeps its wall time; a refused or failed attempt's is replaced.
    already_recorded = status == "finished earlier" and read_result(run_dir).get("status") in ("completed",
                                                                                             "finished earlier")
    if in_sweep and int(os.environ.get("RANK", "0")) == 0 and not already_recorded:
        write_result(run_dir, {"status": status, "val_loss": val_loss, "snapshot": snapshot,
                               "wall_s": round(time.time() - started, 2), "error": error, "corpus": corpus})
    # A stop signal ends the job, a sweep included: after the point it stopped (its snapshot
    # is saved), or after the point during whose end it came, never starting the next one.
    stopped_by = signal.Signals[status.split()[-1]] if status.startswith("stopped by ") else 0
    if in_sweep and not stopped_by:
        stopped_by = max(distributed.all_gather_object(preemption.received()))
    if stopped_by and in_sweep and int(os.environ.get("RANK", "0")) == 0:
        log.info("sweep stopped by %s after point %s: %s (finished points are skipped, a stopped one resumes "
                 "from its snapshot)", signal.Signals(stopped_by).name, HydraConfig.get().job.num,
                 how_to_resume(cfg, run_dir, "the sweep"))
    if stopped_by == signal.SIGINT or (stopped_by and in_sweep):
        if _ran_by_cli:  # a sweep of this process's own: through Hydra and torchrun's @record to run()
            raise _EndProcess(_stop_exit_code(stopped_by))
        sys.exit(_stop_exit_code(stopped_by))  # a launcher's job (submitit) for this point alone
    return val_loss


def run() -> None:
    """main(), then a defined shutdown: background threads joined, the process group
    destroyed on every rank while the interpreter is still whole (see distributed.shutdown)."""
    global _ran_by_cli
    _ran_by_cli = True
    # What the imports made (torch's, Hydra's modules: most of the heap) is never garbage: the
    # collections between sweep points, at shutdown and at exit skip it (0.15 s each).
    gc.freeze()
    # Whatever this process prints, a bug's traceback and Hydra's "Error executing job with
    # overrides: [...]" (every override as typed) included, is redacted.
    storage.redact_output()
    try:
        config.check_options(sys.argv[1:])
        with config.hydra_errors_in_one_line(main, sys.argv[1:]):
            try:
                main()
                profiling.mark("main returned (run lock released)")
            finally:
                token_cache.stop_keeping_fresh()  # the run's files age from here, as any others
    except config.BadOverrides as bad:  # Hydra would print the override back, a URL's signature included
        errors.record(bad.error, str(bad.error))  # before the wait below: the agent may stop this worker
        # Every node's local rank 0 prints the same line (there is no process group to agree
        # on one printer, and a node whose rank 0 is slower must not go silent).
        if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
            print(f"error: {bad.error}", file=sys.stderr, flush=True)
        else:  # its node's local rank 0 composes the same command line: its line first, before the agent stops us
            time.sleep(2)
        distributed.shutdown(clean=False)
        sys.exit(bad.error.exit_code)
    except _EndProcess as end:
        distributed.shutdown(clean=False)
        sys.exit(end.code)
    except SystemExit:
        storage.redact_error_file()  # a bug's: torch's @record wrote its message and traceback as they were
        distributed.shutdown(clean=False)  # a rank may have stopped alone: no waiting for the others
        raise
    except BaseException:  # a bug re-raised by Hydra (HYDRA_FULL_ERROR=1)
        storage.redact_error_file()
        raise
    # A bug's exception propagates with its traceback; atexit still tears the group down.
    profiling.mark("token cache thread stopped")
    distributed.shutdown(clean=True)
    profiling.mark("process group destroyed")
    if _failed_points:  # the sweep went on past them; its exit code still says it is not all done
        # A ConfigError would fail again; points that only failed with RunErrors are worth a
        # retry (a requeued sweep skips its finished points and runs the failed ones again).
        failed_with = ConfigError if ConfigError in _failed_points.values() else errors.RunError
        message = (f"{len(_failed_points)} of {_points_run} sweep points failed (point {', '.join(_failed_points)}"
                   f"{'' if failed_with is ConfigError else ', all with a RunError'}): their errors are in the "
                   "sweep's summary.md")
        errors.record(failed_with, message)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(failed_with.exit_code)


def exit_without_finalising(code: int = 0) -> None:
    """End the process as the interpreter would, less its finalisation (0.2-0.3 s freeing
    torch's modules one by one, after every run): threading's own shutdown (its atexit hooks
    first, which tell idle thread and process pools to stop, as inductor's compile pool is,
    then the non-daemon threads joined), atexit handlers run (weakref finalizers, trackers'
    own), logs and streams flushed, then os._exit. A stream that cannot be flushed exits 120,
    as the interpreter does."""
    import atexit
    import threading

    threading._shutdown()  # what Py_FinalizeEx runs first: joining alone hung on an idle pool
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # a closed pipe: nothing more to deliver
            pass
        except (OSError, ValueError):
            code = code or 120
    os._exit(code)


if __name__ == "__main__":
    run()
    exit_without_finalising(0)  # only as a program: run() returned, the run ended well
