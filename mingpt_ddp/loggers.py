"""Experiment trackers that follow a run: TensorBoard, MLflow, Weights & Biases.

Each is a :class:`Sink` that rank 0's MetricsLog sends every metrics record to (the same
records as metrics.jsonl, which is always written). A sink gets the run's resolved config
(secrets redacted) and its directory when it opens, the scalars of each record with their
step, and how the run ended when it closes; nothing else of the process reaches a tracker
(W&B's own capture of the command line, git state and code is off: WANDB_CAPTURE_OFF). Adding a tracker means adding a Sink here and
a file in conf/logger/.

A resumed run continues the same MLflow / W&B run: the ids are kept in
``<run dir>/loggers.json`` as soon as a run is opened and in every snapshot (a new run
directory that resumes the same snapshot path finds them there).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
import uuid
from typing import Any, Callable, Optional, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from mingpt_ddp.checkpoint import storage
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)

RUN_IDS_FILE = "loggers.json"
# The pip extra (pyproject.toml) and the module each tracker needs.
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
WANDB_MODES = ("online", "offline", "disabled")


def selected(cfg: Any) -> list[str]:
    """The trackers this config turns on (`logger=...`, or the older trainer.tensorboard)."""
    names = [name for name in EXTRAS if cfg.logger[name].enabled]
    if cfg.trainer.tensorboard and "tensorboard" not in names:
        names.insert(0, "tensorboard")
    return names


def check(cfg: Any) -> None:
    """Before training, on every rank: a missing extra is one clear error naming the pip command."""
    if cfg.logger.wandb.mode not in (None, *WANDB_MODES):
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode} must be one of {', '.join(WANDB_MODES)} or null")
    for name in selected(cfg):
        if importlib.util.find_spec(EXTRAS[name]) is None:
            how = "trainer.tensorboard=true" if name == "tensorboard" and not cfg.logger.tensorboard.enabled \
                else f"logger={name}"
            raise ConfigError(f"{how} needs {name}: pip install -e '.[{name}]'")


def run_label(run_dir: str) -> str:
    """The run directory's name; a sweep point (a numbered directory) with its sweep's."""
    run_dir = os.path.abspath(run_dir)
    name = os.path.basename(run_dir)
    return f"{os.path.basename(os.path.dirname(run_dir))}/{name}" if name.isdigit() else name


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """`{"model": {"n_layer": 6}}` -> `{"model.n_layer": "6"}`: trackers' parameter form."""
    if isinstance(config, dict):
        out: dict[str, str] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: storage.redact(json.dumps(config) if isinstance(config, (list, bool)) or config is None
                                        else str(config))}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record worth plotting (not its step and epoch)."""
    return {k: float(v) for k, v in record.items() if k not in ("step", "epoch") and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class Sink:
    """One tracker. `resume_ref` is what a resumed run needs to continue the same run."""

    name = "sink"
    resume_ref: Optional[dict[str, Any]] = None

    def write(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, outcome: str) -> None:
        """`outcome`: finished, stopped (by a signal, to be resumed) or failed."""


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, directory: str, config: dict[str, Any], run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(directory)
        params = "\n".join(f"    {k}: {v}" for k, v in flatten(config).items())
        self.writer.add_text("config", f"    run_dir: {storage.redact(os.path.abspath(run_dir))}\n{params}")

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self, outcome: str) -> None:
        self.writer.close()


def _credentials_to_environment(uri: Optional[str]) -> Optional[str]:
    """An HTTP tracking URI without its user-info, which goes to MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD, where MLflow's client takes basic-auth credentials from:
    MLflow prints and stores the URI it is given (the "View run at" line on stdout)."""
    if not uri:
        return uri
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    storage.remember_secrets([unquote(user) if not password else "", unquote(password)])
    return urlunsplit(parts._replace(netloc=host))


class MLflowSink(Sink):
    """A run in an MLflow tracking store, through MlflowClient (no global active run, so
    the points of a sweep in one process are separate runs)."""

    name = "mlflow"
    _STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

    def __init__(self, cfg: Any, config: dict[str, Any], run_dir: str, previous: Optional[dict[str, Any]]):
        self.tracking_uri = _credentials_to_environment(cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        if not self.tracking_uri:
            self.tracking_uri = "file:" + os.path.join(_store_dir(run_dir), "mlruns")
        if self.tracking_uri.startswith(("file:", "/")):
            # MLflow 3 keeps the file store in maintenance mode behind this opt-in; it is
            # the store that needs no server or database, next to the run's other files.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self._open(cfg, config, run_dir, previous)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"cannot open an MLflow run at {storage.redact(self.tracking_uri)} "
                              f"({storage.describe(exc)}): check logger.mlflow.tracking_uri / "
                              "MLFLOW_TRACKING_URI and that the tracking server is up") from None

    def _open(self, cfg: Any, config: dict[str, Any], run_dir: str, previous: Optional[dict[str, Any]]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        params = flatten(config)
        run = self._previous_run(previous)
        if run is None:
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
            run = self.client.create_run(experiment_id, run_name=storage.redact(cfg.run_name or run_label(run_dir)))
            logged: dict[str, str] = {}
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
            logged = run.data.params
        self.run_id = run.info.run_id
        # Kept in loggers.json and every snapshot: as shown, never with credentials.
        self.resume_ref = {"run_id": self.run_id, "tracking_uri": storage.redact(self.tracking_uri)}
        # Parameters cannot change in MLflow: a resume with other settings records them as tags.
        new = [Param(k, v[:6000]) for k, v in params.items() if k not in logged]
        changed = [RunTag(f"resumed_with.{k}", v[:5000]) for k, v in params.items() if k in logged and logged[k] != v[:6000]]
        # Created through MlflowClient, the run has no tags of MLflow's own context (the
        # fluent API's mlflow.source.name, git commit, ...): only these, redacted like the params.
        tags = [RunTag("mingpt_ddp.run_dir", storage.redact(os.path.abspath(run_dir))),
                RunTag("mingpt_ddp.run_id", storage.redact(run_label(run_dir)))]
        for start in range(0, max(len(new), 1), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=new[start:start + 100], tags=tags + changed if start == 0 else [])

    def _previous_run(self, previous: Optional[dict[str, Any]]):
        if not previous or not previous.get("run_id"):
            return None
        try:
            return self.client.get_run(previous["run_id"])
        except Exception:
            log.warning("MLflow run %s is not in %s: starting a new MLflow run", previous["run_id"],
                        storage.redact(self.tracking_uri))
            return None

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, self._STATUS.get(outcome, "FINISHED"))


class WandbSink(Sink):
    """A W&B run; `WANDB_MODE=offline` (or logger.wandb.mode=offline) writes it under
    `<run dir>/wandb` without any network, for a later `wandb sync`."""

    name = "wandb"

    def __init__(self, cfg: Any, config: dict[str, Any], run_dir: str, previous: Optional[dict[str, Any]]):
        import wandb

        run_id = (previous or {}).get("id") or uuid.uuid4().hex[:12]
        settings = _wandb_settings(wandb)
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=storage.redact(cfg.run_name or run_label(run_dir)),
                id=run_id, resume="allow", dir=os.path.abspath(run_dir),
                mode=cfg.mode or os.environ.get("WANDB_MODE") or "online",
                config={**_redacted_values(config), "run_dir": storage.redact(os.path.abspath(run_dir))},
                allow_val_change=True, settings=settings,
            )
        except Exception as exc:
            raise ConfigError(
                f"W&B could not start a run ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
                "log in with `wandb login` or set WANDB_API_KEY, or run without network with WANDB_MODE=offline"
            ) from None
        # Our step is its own axis: a resumed run logs steps again from its last snapshot,
        # which W&B's built-in, ever-increasing step would drop.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.resume_ref = {"id": self.run.id}

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome in ("finished", "stopped") else 1)


# What W&B would record of the process by itself: its metadata (the command line as given,
# a presigned URL's signature included; the program, host, OS), the git state (a remote's
# URL may carry a token), the code and pip's requirements (a package installed from a URL
# with credentials). None of it is redacted, so none of it is captured: the run gets the
# redacted config and the metrics, nothing else.
WANDB_CAPTURE_OFF = {"x_disable_meta": True, "disable_git": True, "disable_code": True, "save_code": False,
                     "x_save_requirements": False}


def _wandb_settings(wandb: Any) -> Any:
    """console="off": the progress bar and log lines stay ours (W&B still records metrics);
    nothing of the process is captured (WANDB_CAPTURE_OFF). A wandb without these settings
    would capture the command line: refused, naming the upgrade."""
    known = getattr(wandb.Settings, "model_fields", {})
    missing = [name for name in WANDB_CAPTURE_OFF if name not in known]
    if missing:
        raise ConfigError(f"logger=wandb needs a wandb whose settings can turn off {', '.join(missing)} (this "
                          f"wandb {getattr(wandb, '__version__', '?')} would upload the command line, which may "
                          "hold secrets): pip install -U wandb")
    return wandb.Settings(console="off", silent=True, **WANDB_CAPTURE_OFF)


def _store_dir(run_dir: str) -> str:
    """Where a local tracking store goes: the run directory, or for the points of a Hydra
    multirun their sweep directory, so that one store (one MLflow UI) shows every point."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return os.path.abspath(HydraConfig.get().sweep.dir)
    except ImportError:
        pass
    return os.path.abspath(run_dir)


def _redacted_values(config: Any) -> Any:
    if isinstance(config, dict):
        return {k: _redacted_values(v) for k, v in config.items()}
    if isinstance(config, list):
        return [_redacted_values(v) for v in config]
    return storage.redact(config) if isinstance(config, str) else config


def _read_run_ids(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, RUN_IDS_FILE)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_run_ids(run_dir: str, ids: dict[str, Any]) -> None:
    path = os.path.join(run_dir, RUN_IDS_FILE)
    os.makedirs(run_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(ids, f, indent=2)
    os.replace(path + ".tmp", path)


def open_sinks(cfg: Any, config: dict[str, Any], run_dir: str, previous: Optional[dict[str, Any]] = None) -> list[Sink]:
    """Open the selected trackers (rank 0 only, through distributed.on_main_then_share so that
    a tracker that cannot start stops every rank with its error). `config` is the resolved,
    redacted config; `previous` the ids a snapshot kept (else those in the run directory)."""
    names = selected(cfg)
    if not names:
        return []
    previous = previous or _read_run_ids(run_dir)
    openers: dict[str, Callable[[], Sink]] = {
        "tensorboard": lambda: TensorBoardSink(cfg.logger.tensorboard.dir or os.path.join(run_dir, "tensorboard"),
                                               config, run_dir),
        "mlflow": lambda: MLflowSink(cfg.logger.mlflow, config, run_dir, previous.get("mlflow")),
        "wandb": lambda: WandbSink(cfg.logger.wandb, config, run_dir, previous.get("wandb")),
    }
    sinks: list[Sink] = []
    try:
        for name in names:
            sinks.append(openers[name]())
    except BaseException:
        close_all(sinks, "failed")
        raise
    ids = run_ids(sinks)
    if ids:
        _write_run_ids(run_dir, ids)
    return sinks


def run_ids(sinks: Sequence[Sink]) -> dict[str, Any]:
    """What a resume needs to continue the same tracker runs (kept in every snapshot)."""
    return {s.name: s.resume_ref for s in sinks if s.resume_ref}


def fan_out(sinks: Sequence[Sink], record: dict[str, Any]) -> None:
    """Send a metrics record to every sink. A tracker that fails (a server down) is
    reported and skipped: it must not stop a run that metrics.jsonl still records."""
    values = scalars(record)
    if not values:
        return
    for sink in sinks:
        try:
            sink.write(record["step"], values)
        except Exception as exc:
            log.warning("could not send step %s to %s: %s", record["step"], sink.name, storage.describe(exc))


def close_all(sinks: Sequence[Sink], outcome: str) -> None:
    for sink in sinks:
        try:
            sink.close(outcome)
        except Exception as exc:
            log.warning("could not close the %s run: %s", sink.name, storage.describe(exc))
