"""Typed configuration: the schema Hydra checks every override against.

Each dataclass mirrors one group under ``conf/`` (model, data, optimizer, trainer).
Registering them in Hydra's ConfigStore means a wrong type (``trainer.max_epochs=abc``)
or an unknown key (``trainer.max_epoch=3``) is rejected by Hydra with a clear message
before any of our code runs. Checks a type cannot express live in :func:`validate`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import re
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, Iterator, List, Optional
from urllib.parse import urlsplit

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt_ddp.errors import ConfigError

# The training process group's collectives (NCCL on GPUs) give up after this: a hung GPU or a
# lost node holds the others for minutes, not for as long as rank 0 may retry a save.
DEFAULT_COLLECTIVE_TIMEOUT_MINUTES = 5.0
# While rank 0 does what only it does (a save retried for save_retry_minutes, a store retried at
# start), the others wait in the rendezvous store, up to the longest retry plus this margin.
RANK0_WAIT_MARGIN_MINUTES = 5.0
# trainer.snapshot_every_minutes=null on GPUs: an hours-long epoch is not hours of work at risk.
GPU_SNAPSHOT_EVERY_MINUTES = 30.0
# The same on CPUs, where an epoch is long too and a second Ctrl-C stops without a snapshot:
# GPT-2 size (124M parameters) costs ~5.6 s per snapshot on a 2-core CPU (host copy + write),
# under 1% of 10 minutes; the default gpt-mini 0.06 s (benchmarks/RESULTS.md, issue 32).
CPU_SNAPSHOT_EVERY_MINUTES = 10.0
TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
# What data.download_url may name: the schemes urllib fetches from a server.
DOWNLOAD_SCHEMES = ("http", "https", "ftp")


class Precision(str, Enum):
    """Numeric precision of the forward/backward pass (weights stay fp32)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    auto = "auto"  # bf16 on GPUs with native bf16 (Ampere+), else fp16; on CPU the faster of fp32 and bf16, timed


class OptimizerName(str, Enum):
    """Which optimizer trains the blocks' weight matrices (model.configure_optimizer)."""

    adamw = "adamw"  # AdamW for every parameter
    muon = "muon"  # Muon for the blocks' weight matrices, AdamW for the rest (muon.py)


class TokenizerKind(str, Enum):
    """How text becomes token ids (tokenizer.py)."""

    char = "char"  # every distinct character is a token
    bpe = "bpe"  # a byte-level BPE of data.vocab_size tokens trained on the training split
    gpt2 = "gpt2"  # GPT-2's 50,257-token BPE (tiktoken)


class Gelu(str, Enum):
    """The MLP's activation (model.py)."""

    exact = "exact"  # erf-based, torch's default: every model trained here so far
    tanh = "tanh"  # GPT-2's tanh approximation: what weights from GPT-2 were trained with


class Device(str, Enum):
    """Where a rank trains (distributed.pick_device)."""

    auto = "auto"  # its GPU where torch sees one; CPU on a node without GPUs; refused on a node whose GPUs torch cannot use
    cuda = "cuda"  # its GPU, else refused
    cpu = "cpu"  # CPU with gloo, on purpose, whatever the node has


class Strategy(str, Enum):
    """How the model is spread over the ranks (parallel.py)."""

    ddp = "ddp"  # a full replica per rank, gradients all-reduced
    fsdp = "fsdp"  # FSDP2: parameters, gradients and optimizer state sharded over the ranks


@dataclass
class ModelConfig:
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 192
    dropout: float = 0.1
    # exact | tanh (GPT-2's approximation; weights trained with it need it)
    gelu: Gelu = Gelu.exact
    # A transformers GPT-2 checkpoint directory to start from (checkpoint/pretrained.py): its
    # config.json decides the shape and gelu, its weights the starting values; null: random.
    init_from: Optional[str] = None


@dataclass
class DataConfig:
    # A UTF-8 text file, a directory of them or a glob (sorted, a newline between files),
    # local or any fsspec URL.
    path: str = "data/tinyshakespeare.txt"
    block_size: int = 128
    val_fraction: float = 0.1
    # Where to fetch the corpus when `path` does not exist; null never downloads. A preset
    # ties its URL to its own path (${mingpt_download_for:...}): another path downloads
    # only with a download_url of its own.
    download_url: Optional[str] = None
    # fsspec options for a remote `path` (endpoint, profile, ...); secrets only from the
    # environment: ${oc.env:VAR}, never written literally (see storage.py).
    storage_options: Dict[str, Any] = field(default_factory=dict)
    # Where each node keeps its token file (and its copy of remote files); null: $MINGPT_DDP_CACHE, else
    # $XDG_CACHE_HOME/mingpt_ddp/data, else ~/.cache/mingpt_ddp/data.
    cache_dir: Optional[str] = None
    # char | bpe | gpt2 (tokenizer.py); a resume keeps the snapshot's.
    tokenizer: TokenizerKind = TokenizerKind.char
    # Tokens of the byte-level BPE (data.tokenizer=bpe), learned from the training split.
    vocab_size: int = 4096
    # At most this many characters of the training split train the BPE.
    tokenizer_train_chars: int = 100_000_000
    # The text column of .parquet files, the text field of .jsonl(.gz) files.
    text_column: str = "text"
    # A resume on another corpus than its snapshot's (other text, another val_fraction) is
    # refused; true goes on with this one, the epoch in progress from its first window.
    continue_on_new_corpus: bool = False


@dataclass
class OptimizerConfig:
    # muon: Muon at muon_lr for the blocks' weight matrices (whole matrices: trainer.strategy=ddp
    # only), AdamW at lr for embeddings, head, LayerNorms and biases; one LR schedule for both.
    name: OptimizerName = OptimizerName.adamw
    lr: float = 6e-4
    min_lr: float = 6e-5
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 100
    # Steps over which the cosine decays to min_lr; null: the run's planned steps. Fix it
    # to extend or shorten a run (max_epochs/max_steps) without changing its schedule.
    decay_steps: Optional[int] = None
    muon_lr: float = 0.02  # optimizer.name=muon: the matrices' peak LR (scheduled as lr is)
    muon_momentum: float = 0.95  # optimizer.name=muon: Nesterov momentum before orthogonalising


@dataclass
class TrainerConfig:
    max_epochs: int = 5
    max_steps: Optional[int] = None
    # Plan the run's steps from the pace of its first steps so that training ends within
    # this many minutes (max_epochs/max_steps still cap it); the plan is kept in snapshots.
    time_budget_minutes: Optional[float] = None
    batch_size: int = 32
    grad_accum_steps: int = 1
    precision: Precision = Precision.auto
    strategy: Strategy = Strategy.ddp
    device: Device = Device.auto
    grad_clip: float = 1.0
    eval_every: int = 250
    # Validation batches per rank in a periodic evaluation (the first ones of the split):
    # seconds even on a big corpus. null: the whole split every time.
    eval_batches: Optional[int] = 100
    # The same for the evaluation at the end of a run (its val_loss is the run's result):
    # the whole split of a text up to a few MB, bounded on a big corpus; null: the whole split.
    final_eval_batches: Optional[int] = 200
    log_every: int = 10
    # The ranks agree on stop signals at every log step and at least this often (seconds of
    # wall time, at a step derived from the measured pace): keep it well under the
    # scheduler's grace period between SIGTERM and SIGKILL (Slurm's KillWait, 30 s).
    stop_check_seconds: float = 5.0
    save_every: int = 1
    snapshot_every_steps: Optional[int] = None
    # Also snapshot every N minutes of wall time (rank 0's clock); null: every
    # GPU_SNAPSHOT_EVERY_MINUTES on GPUs, CPU_SNAPSHOT_EVERY_MINUTES on CPUs; 0: never.
    snapshot_every_minutes: Optional[float] = None
    keep_last: int = 2
    snapshot_path: Optional[str] = None
    # Resume from a snapshot that failed the end-of-run check (the ranks' parameters
    # differed): refused unless set, as its weights are rank 0's and may be wrong.
    resume_failed_check: bool = False
    seed: int = 1337
    # A resume under other values of the settings that define the result (model.*,
    # optimizer.*, batch_size, grad_accum_steps, seed, grad_clip) is refused; true goes on
    # under these values, logged (after a seed change the epoch in progress starts over).
    continue_with_new_settings: bool = False
    compile: Optional[bool] = None  # null: on for CUDA, off on CPU
    # Bit-identical resumes on GPUs too: deterministic kernels (or an error naming the op),
    # a fixed cuBLAS workspace, cuDNN and inductor without autotuning (determinism.py). Slower.
    deterministic: bool = False
    # Also write the metrics as TensorBoard scalars (rank 0, <run dir>/tensorboard); needs
    # the `tensorboard` extra.
    tensorboard: bool = False
    # A torch.profiler trace of the steps between profile_steps[0] and profile_steps[1] (as
    # the log counts them), on rank 0, into <run dir>/profile (profiling.py).
    profile: bool = False
    profile_steps: List[int] = field(default_factory=lambda: [10, 15])
    # DDP gradient bucket size (MiB): larger, fewer all-reduces and fewer pieces of the compiled
    # graph (DDPOptimizer splits it at each bucket); smaller, earlier overlap. None: 100 on GPUs,
    # 25 (torch's default) on CPUs (ddp_bucket_cap_mb()).
    ddp_bucket_cap_mb: Optional[float] = None
    ddp_static_graph: bool = False  # DDP static_graph: the same parameters are used every step (true here)
    # With one process, DDP still wraps the model, over a process group of one rank (NCCL on
    # CUDA): its reducer, no_sync and the NCCL calls run as on many GPUs (launch/gpu_smoke.sh
    # checks them on one GPU). Off: one process trains the plain model, without the wrapper's cost.
    ddp_one_process: bool = False
    # Intra-op threads of each process (per process, not per node); null: this process's share
    # of the cores it may use (distributed.cpu_threads_per_process). Honoured on GPUs too.
    cpu_threads: Optional[int] = None
    # fsspec options for snapshot_path (endpoint, profile, ...); secrets as for data.
    storage_options: Dict[str, Any] = field(default_factory=dict)
    # Saving may keep failing (retried in the background) this long before the run stops.
    save_retry_minutes: float = 15.0
    # At start, an unreachable store (snapshots, data) is retried this long, then an error.
    load_retry_minutes: float = 2.0
    # How long a collective of the training process group (and the rendezvous) waits for the
    # other ranks before the job fails: a hung GPU or an unreachable node. Waits for rank 0's
    # own work (saves, stores at start) do not count: the others wait for it in the
    # rendezvous store (see rank0_wait_minutes).
    collective_timeout_minutes: float = DEFAULT_COLLECTIVE_TIMEOUT_MINUTES


@dataclass
class TensorBoardLoggerConfig:
    enabled: bool = False  # logger=tensorboard (or trainer.tensorboard=true) turns it on
    dir: Optional[str] = None  # null: <run dir>/tensorboard


@dataclass
class MLflowLoggerConfig:
    enabled: bool = False  # logger=mlflow turns it on
    # null: $MLFLOW_TRACKING_URI when set, else a file store in <run dir>/mlruns (a sweep's: <sweep dir>/mlruns).
    tracking_uri: Optional[str] = None
    experiment: str = "mingpt-ddp"
    run_name: Optional[str] = None  # null: the run directory's name


@dataclass
class WandbLoggerConfig:
    enabled: bool = False  # logger=wandb turns it on
    project: str = "mingpt-ddp"
    entity: Optional[str] = None
    mode: Optional[str] = None  # online | offline | disabled; null: $WANDB_MODE, else online
    run_name: Optional[str] = None  # null: the run directory's name


@dataclass
class LoggerConfig:
    """Where rank 0 also sends the metrics (loggers.py). ``logger=[mlflow,tensorboard]``
    selects conf/logger/mlflow.yaml and tensorboard.yaml, which turn those on."""

    tensorboard: TensorBoardLoggerConfig = field(default_factory=TensorBoardLoggerConfig)
    mlflow: MLflowLoggerConfig = field(default_factory=MLflowLoggerConfig)
    wandb: WandbLoggerConfig = field(default_factory=WandbLoggerConfig)


@dataclass
class SweepConfig:
    # In a multirun, a point failing with a config/data error is recorded as failed and
    # the sweep goes on; true stops the sweep at the first failing point.
    stop_on_failure: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose(overrides: list[str], job_name: str = "mingpt_ddp"):
    """The config main.py would run with these overrides (conf/ and the schema), checked:
    for tools that are not a Hydra app (bench, prepare)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name=job_name):
            cfg = hydra_compose("config", overrides=overrides)
        validate(cfg)  # reads every value: an interpolation that cannot resolve fails here
    except (HydraException, OmegaConfBaseException) as exc:  # an unknown key, group option, type or interpolation
        raise override_error(exc, overrides) from None
    return cfg


def override_error(exc: BaseException, overrides: list[str]) -> ConfigError:
    """The one line for a config Hydra could not compose (an unknown key or preset, a wrong
    type, an override's syntax): what failed, why (the OmegaConf error under it, its key)
    and Hydra's hint, with the values of secret-named keys and URL credentials masked, since
    Hydra quotes the override it could not apply."""
    from omegaconf.errors import OmegaConfBaseException

    parts: list[str] = []
    for line in str(exc).split("\n"):
        if line.startswith("Config search path:"):
            break
        if line.startswith("\t") and parts:  # a preset's available options, one a line
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line.strip()
        # Hydra's "To append to your config use +key=value" would add a key nothing reads,
        # except in an open dict (storage_options), where new keys need the +
        elif line.strip() and not line.strip().startswith(("reference_type=", "object_type=")) and not (
                line.strip().startswith("To append to") and ".storage_options." not in line):
            parts.append(line.strip().rstrip("."))
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
        parts.insert(1, str(cause).strip().splitlines()[0].rstrip("."))
    unknown = re.match(r"Could not override '([^']+)'", parts[0] if parts else "")
    near = closest_keys(unknown[1].lstrip("+~")) if unknown and "not in" in " ".join(parts) \
        and ".storage_options." not in unknown[1] else []
    preset = re.search(r"Could not find '([\w-]+)/([^']+)'.*?Available options in '\1': ([^;]+)", "; ".join(parts))
    if preset:  # a mistyped preset (model=gpt-mni): the group's nearest options
        near = [f"{preset[1]}={o}" for o in closest(preset[2], [o.strip() for o in preset[3].split(",")])]
    if near:
        parts.append(f"did you mean {either(near)}?")
    return ConfigError(f"{_without_secrets('; '.join(parts), overrides)} (see docs/configuration.md for the keys "
                       "and their types)")


def _without_secrets(text: str, overrides: list[str]) -> str:
    """`text` with the values of secret-named keys, of every storage option (a dict or list
    value may hold a secret under any name) and URL credentials masked."""
    from mingpt_ddp.checkpoint import storage

    for override in overrides:
        key, _, value = override.partition("=")
        if value and (storage.is_secret_name(key.rsplit(".", 1)[-1]) or "storage_options" in key):
            for shown in {value, value.strip().strip("'\"")} - {""}:
                text = text.replace(shown, storage.REDACTED)
    return storage.redact(text)


class BadOverrides(BaseException):
    """A command line Hydra could not compose into a config, as the one ConfigError to
    print. A BaseException: Hydra's own report (which prints the override back as given,
    a presigned URL's signature included) catches only Exceptions."""

    def __init__(self, error: ConfigError):
        super().__init__(str(error))
        self.error = error


MAIN_USAGE = ("usage: python mingpt_ddp/main.py [--multirun] [key=value ...]; --help lists the config groups and keys, "
              "--hydra-help Hydra's options")


def check_options(argv: list[str]) -> None:
    """An option Hydra's parser does not know (`--foo`) is the one line naming the usage
    (BadOverrides), not argparse's usage block and a second line."""
    from hydra._internal.utils import get_args_parser

    _, unknown = get_args_parser().parse_known_args(argv)
    flags = [a for a in unknown if a.startswith("-")]
    if flags:
        raise BadOverrides(ConfigError(f"unknown option {flags[0]} ({MAIN_USAGE})"))


@contextlib.contextmanager
def hydra_errors_in_one_line(task: Callable[..., Any], overrides: list[str]) -> Iterator[None]:
    """While a @hydra.main app (`task`) runs: an error of Hydra's in composing the config
    from the command line, a run's or any point's of a sweep, raises BadOverrides instead
    of Hydra printing it (a multi-line message quoting the override as typed, exit 1).
    Exceptions that passed through `task` (a bug in it) keep Hydra's report. Hydra offers no
    hook for this: its reporting function (hydra._internal.utils.run_and_report) is wrapped
    while the app runs; a Hydra without it keeps its own report."""
    from hydra._internal import utils as hydra_utils
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    report = getattr(hydra_utils, "run_and_report", None)
    task_code = inspect.unwrap(task).__code__
    if report is None:
        yield
        return

    def from_task(exc: BaseException) -> bool:
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is task_code:
                return True
            tb = tb.tb_next
        return False

    def checked(func: Callable[[], Any]) -> Any:
        try:
            return func()
        except (HydraException, OmegaConfBaseException) as exc:
            if from_task(exc):
                raise
            raise BadOverrides(override_error(exc, overrides)) from None

    hydra_utils.run_and_report = lambda func: report(lambda: checked(func))
    try:
        yield
    finally:
        hydra_utils.run_and_report = report


def run_id() -> str:
    """A name for this run that every rank, and every restart of the job, agrees on.

    Hydra's default ``${now:...}`` is read separately by each process and can differ by a
    second between ranks, which would split one run over two directories.
    """
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm and elastic in (None, "none", slurm):  # srun alone, or torchrun with --rdzv_id=$SLURM_JOB_ID
        array_task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{slurm}" + (f"_{array_task}" if array_task else "")
    if elastic and elastic != "none":
        return f"torchrun-{elastic}"
    if elastic == "none":
        # torchrun without --standalone/--rdzv_id: all local workers share their agent.
        return f"torchrun-{os.uname().nodename}-{os.getppid()}"
    return time.strftime("%Y-%m-%d_%H-%M-%S")


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def _hydra_output_subdir() -> Optional[str]:
    """Only the main process writes `.hydra/`, so ranks never race on the same files."""
    return ".hydra" if _is_main_process() else None


def download_for(path: Any, own_path: Any, url: Any) -> Optional[str]:
    """A data preset's download_url, ``${mingpt_download_for:${.path},<its path>,<its URL>}``:
    the URL while data.path is the preset's own path, else null. So a mistyped data.path
    is an error naming it, never a file filled with the preset's corpus and trained on."""
    return str(url) if os.path.normpath(str(path)) == os.path.normpath(str(own_path)) else None


def register() -> None:
    """Register the schema and the resolvers that conf/ uses."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, resolver in (("run_id", run_id), ("hydra_output_subdir", _hydra_output_subdir)):
        if not OmegaConf.has_resolver(name):
            # Cached: a run id must not change between two reads in one process.
            OmegaConf.register_new_resolver(name, resolver, use_cache=True)
    if not OmegaConf.has_resolver("mingpt_download_for"):
        OmegaConf.register_new_resolver("mingpt_download_for", download_for)


def _positive(value: Any, name: str, fix: str) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}: {fix}")


def _check_download_url(url: Optional[str]) -> None:
    """A URL urllib fetches from a server, before the run starts: a local path or a
    mistyped scheme is an error now, not a download retried for minutes. The message
    names only the scheme (a presigned URL's query is a secret)."""
    if url is None:
        return
    try:
        parts = urlsplit(str(url))
    except ValueError as exc:
        raise ConfigError(f"data.download_url is not a URL ({exc}): write it as https://<host>/<path>") from None
    if parts.scheme.lower() not in DOWNLOAD_SCHEMES:
        got = f"{parts.scheme}://" if parts.scheme else "a path without a scheme"
        raise ConfigError(f"data.download_url must be an http://, https:// or ftp:// URL, not {got}: fix its scheme "
                          "(a file on this machine goes in data.path, without data.download_url)")
    if not parts.hostname:
        raise ConfigError(f"data.download_url names no host ({parts.scheme}:///...): write it as "
                          f"{parts.scheme}://<host>/<path>")


def schema_keys(schema: Optional[type] = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (the dataclasses); open dicts (storage_options) as one key."""
    keys = []
    for f in dataclasses.fields(schema or Config):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if dataclasses.is_dataclass(_field_default(f)):
            keys += schema_keys(type(_field_default(f)), f"{key}.")
    return keys


def _field_default(f: "dataclasses.Field") -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def closest(word: str, candidates: list[str]) -> list[str]:
    """The candidates most like `word` (a typo's fixes; difflib), best first: the best one and
    any others nearly as close, at most 3."""
    import difflib

    scored = sorted(((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in candidates), reverse=True)
    return [c for score, c in scored[:3] if score >= 0.6 and score >= scored[0][0] - 0.1]


def closest_keys(key: str) -> list[str]:
    """The schema keys most like `key`: among its siblings where its parent is a key
    (trainer.bath_size: trainer.*), else among the top-level keys or, under a mistyped
    parent, all of them."""
    keys = schema_keys()
    parent, _, leaf = key.rpartition(".")
    if parent in keys or not parent:
        siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
        return [siblings[name] for name in closest(leaf, list(siblings))]
    return closest(key, keys)


def either(options: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"


def check_known_keys(node: Any, prefix: str = "") -> None:
    """A key added with ``+`` outside the schema is refused: it would be accepted and never
    read (a typo's run would train silently with the default). Open dicts (storage_options,
    Dict[str, Any] in the schema) take any key."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return
    fields = {f.name for f in dataclasses.fields(schema)}
    for name in node.keys():
        key = f"{prefix}{name}"
        if name not in fields:
            near = closest_keys(key)
            raise ConfigError(f"{key} is not a config key{f' (did you mean {either(near)}?)' if near else ''}: remove "
                              "it (see docs/configuration.md for the keys)")
        check_known_keys(node._get_node(name), f"{key}.")


def validate(cfg: Any) -> None:
    """Checks that types alone cannot express; each message names the fix."""
    check_known_keys(cfg)
    m, d, o, t = cfg.model, cfg.data, cfg.optimizer, cfg.trainer
    for name in ("n_layer", "n_head", "n_embd"):
        _positive(m[name], f"model.{name}", f"set model.{name}=<positive integer>")
    if m.n_embd % m.n_head != 0:
        raise ConfigError(
            f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: "
            f"choose n_embd as a multiple of n_head (e.g. model.n_embd={m.n_head * max(1, m.n_embd // m.n_head)})"
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    _positive(d.block_size, "data.block_size", "set data.block_size=<context length, e.g. 128>")
    if d.tokenizer == TokenizerKind.bpe and not 257 <= d.vocab_size <= 1 << 24:
        raise ConfigError(f"data.vocab_size={d.vocab_size} must be between 257 (the 256 bytes and <|endoftext|>) and "
                          f"{1 << 24:,} for data.tokenizer=bpe, e.g. data.vocab_size=4096")
    _positive(d.tokenizer_train_chars, "data.tokenizer_train_chars", "e.g. data.tokenizer_train_chars=100000000")
    if not d.text_column:
        raise ConfigError("data.text_column must name the text column of the .parquet / field of the .jsonl files")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be between 0 and 1 (e.g. 0.1)")
    _check_download_url(d.download_url)
    _positive(o.lr, "optimizer.lr", "set optimizer.lr, e.g. optimizer.lr=6e-4")
    if o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr}")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas={list(o.betas)} must be two numbers in [0, 1), e.g. [0.9,0.95]")
    if o.decay_steps is not None:
        _positive(o.decay_steps, "optimizer.decay_steps", "or set it to null to decay over the whole run")
    if o.name == OptimizerName.muon:
        _positive(o.muon_lr, "optimizer.muon_lr", "set optimizer.muon_lr, e.g. optimizer.muon_lr=0.02")
        if not 0.0 <= o.muon_momentum < 1.0:
            raise ConfigError(f"optimizer.muon_momentum={o.muon_momentum} must be in [0, 1), e.g. 0.95")
        if t.strategy == Strategy.fsdp:
            raise ConfigError("optimizer.name=muon orthogonalises whole weight matrices, which trainer.strategy=fsdp "
                              "shards over the ranks: use trainer.strategy=ddp with muon, or optimizer.name=adamw "
                              "with fsdp")
    if o.warmup_steps < 0 or o.weight_decay < 0:
        raise ConfigError("optimizer.warmup_steps and optimizer.weight_decay must not be negative")
    _positive(t.max_epochs, "trainer.max_epochs", "set trainer.max_epochs=<number of epochs>")
    if t.max_steps is not None:
        _positive(t.max_steps, "trainer.max_steps", "set trainer.max_steps=<steps> or null for no cap")
    if t.time_budget_minutes is not None:
        _positive(t.time_budget_minutes, "trainer.time_budget_minutes", "or set it to null to train by epochs/steps")
    _positive(t.batch_size, "trainer.batch_size", "set trainer.batch_size=<sequences per process>")
    _positive(t.grad_accum_steps, "trainer.grad_accum_steps", "set trainer.grad_accum_steps=1 or more")
    for name in ("eval_every", "log_every", "save_every", "keep_last"):
        _positive(t[name], f"trainer.{name}", f"set trainer.{name} to 1 or more")
    for name in ("eval_batches", "final_eval_batches"):
        if t[name] is not None:
            _positive(t[name], f"trainer.{name}", "set it to null to evaluate the whole split")
    _positive(t.stop_check_seconds, "trainer.stop_check_seconds", "set it to a few seconds, e.g. 5")
    if t.snapshot_every_steps is not None:
        _positive(t.snapshot_every_steps, "trainer.snapshot_every_steps", "or set it to null")
    if t.snapshot_every_minutes is not None and t.snapshot_every_minutes < 0:
        raise ConfigError(f"trainer.snapshot_every_minutes={t.snapshot_every_minutes} must be >= 0 (0: never; "
                          f"null: every {GPU_SNAPSHOT_EVERY_MINUTES:g} minutes on GPUs, "
                          f"{CPU_SNAPSHOT_EVERY_MINUTES:g} on CPUs)")
    if t.ddp_bucket_cap_mb is not None:
        _positive(t.ddp_bucket_cap_mb, "trainer.ddp_bucket_cap_mb", "set it to the DDP bucket size in MiB, e.g. 100, or null")
    if t.profile and not (len(t.profile_steps) == 2 and 0 <= t.profile_steps[0] < t.profile_steps[1]):
        raise ConfigError(f"trainer.profile_steps={list(t.profile_steps)} must be [first, last] with "
                          "0 <= first < last, e.g. trainer.profile_steps=[10,15]")
    if t.grad_clip < 0:
        raise ConfigError(f"trainer.grad_clip={t.grad_clip} must be >= 0 (0 turns clipping off)")
    if t.save_retry_minutes <= 0:
        raise ConfigError(f"trainer.save_retry_minutes={t.save_retry_minutes} must be positive")
    if t.load_retry_minutes < 0:
        raise ConfigError(f"trainer.load_retry_minutes={t.load_retry_minutes} must be >= 0 (0: no retries)")
    collective_timeout_minutes(t)


def flat_resolved(cfg: Any) -> dict[str, Any]:
    """Every value of a config (a DictConfig, resolved, or plain containers) by its dotted key."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else cfg
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = value

    walk("", container)
    return flat


def check_resolves(node: Any) -> None:
    """ConfigError naming the first key of `node` whose interpolation cannot resolve (an
    ${oc.env:VAR} with VAR unset), in one line: read before validate() (the process
    group's timeouts), it would otherwise be a traceback."""
    try:
        OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "the configuration"
        reason = str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]
        raise ConfigError(f"cannot resolve {key}: {reason}") from None


def collective_timeout_minutes(t: Any) -> float:
    """trainer.collective_timeout_minutes, checked."""
    if not t.collective_timeout_minutes > 0:
        raise ConfigError(f"trainer.collective_timeout_minutes={t.collective_timeout_minutes} must be positive: "
                          f"how long a collective waits for the other ranks, e.g. {DEFAULT_COLLECTIVE_TIMEOUT_MINUTES:g}")
    return float(t.collective_timeout_minutes)


def device_setting(t: Any) -> str:
    """trainer.device as a plain string (auto, cuda or cpu)."""
    return str(getattr(t.device, "value", t.device))


def cpu_threads_setting(t: Any) -> Optional[int]:
    """trainer.cpu_threads, read before validate() (distributed.setup sizes the pool with it)."""
    return getattr(t, "cpu_threads", None)


def rank0_wait_minutes(t: Any) -> float:
    """How long the other ranks wait for rank 0's own work: a save it retries for
    trainer.save_retry_minutes, a store it retries at start for load_retry_minutes, plus a
    margin for the attempt in progress."""
    return float(max(t.save_retry_minutes, t.load_retry_minutes) + RANK0_WAIT_MARGIN_MINUTES)


GPU_DDP_BUCKET_CAP_MB = 100.0
CPU_DDP_BUCKET_CAP_MB = 25.0  # torch's own default


def ddp_bucket_cap_mb(t: Any, device_type: str) -> float:
    """trainer.ddp_bucket_cap_mb as it applies on `device_type`. On GPUs 100 MiB: torch's 25
    cut gpt2's compiled graph into about 14 pieces (one per bucket, DDPOptimizer) and NVLink
    moves a bucket of 100 MiB in well under a millisecond (issue 30)."""
    if t.ddp_bucket_cap_mb is None:
        return GPU_DDP_BUCKET_CAP_MB if device_type == "cuda" else CPU_DDP_BUCKET_CAP_MB
    return float(t.ddp_bucket_cap_mb)


def snapshot_every_minutes(t: Any, device_type: str) -> Optional[float]:
    """trainer.snapshot_every_minutes as it applies on `device_type`: None for never."""
    minutes = t.snapshot_every_minutes
    if minutes is None:
        return GPU_SNAPSHOT_EVERY_MINUTES if device_type == "cuda" else CPU_SNAPSHOT_EVERY_MINUTES
    return float(minutes) if minutes > 0 else None
