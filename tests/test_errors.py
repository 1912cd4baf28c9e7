"""Bad input and failed runs are distinct exception types with the same one-line treatment
and their own exit codes (2: do not retry, 4: worth retrying), and a rank raises the type
another rank raised."""
import os

import pytest

from mingpt_ddp import distributed
from mingpt_ddp.errors import ConfigError, RunError, UserFacingError

pytestmark = pytest.mark.unit


def raising(exc):
    def fn():
        raise exc
    return fn


def test_bad_input_and_run_failures_are_distinct_with_codes_of_their_own():
    """2 is bad input (train.sbatch never requeues it), 4 a run that failed (requeued); neither
    is 0, 1 (the launcher's own failures, Python's uncaught exception), 3 (a lost peer) or 130."""
    from mingpt_ddp.distributed import LOST_PEERS_EXIT_CODE
    from mingpt_ddp.preemption import INTERRUPTED_EXIT_CODE
    from mingpt_ddp.tools.torchrun import RDZV_FAILED_EXIT

    assert not issubclass(RunError, ConfigError) and not issubclass(ConfigError, RunError)
    assert ConfigError.exit_code == UserFacingError.exit_code == 2 and RunError.exit_code == 4
    assert RunError.exit_code not in (0, RDZV_FAILED_EXIT, ConfigError.exit_code, LOST_PEERS_EXIT_CODE,
                                      INTERRUPTED_EXIT_CODE)


def test_a_process_records_its_class_where_the_launchers_read_it(tmp_path, monkeypatch):
    """errors.record: the worker's torchelastic error file names the class (a subclass of
    ConfigError counts as one), replaced whole; MINGPT_STEP_ERRORS (train.sbatch's) gets a file
    per class and try; without either, or where they cannot be written, nothing and no exception."""
    import json

    from mingpt_ddp.checkpoint.sharded_snapshot import CorruptShardedSnapshot
    from mingpt_ddp.errors import STEP_ERRORS_ENV, record, recorded_class

    worker = tmp_path / "attempt_0" / "0"
    worker.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(worker / "error.json"))
    monkeypatch.setenv(STEP_ERRORS_ENV, str(tmp_path / "run" / ".step_errors"))
    record(CorruptShardedSnapshot("shard 3 is corrupt"), "shard 3 is corrupt")
    assert recorded_class(json.loads((worker / "error.json").read_text())) is ConfigError
    record(RunError, "saving snapshots has failed for 1 minutes")
    data = json.loads((worker / "error.json").read_text())
    assert recorded_class(data) is RunError and data["message"]["message"].startswith("RunError: saving snapshots")
    assert sorted(os.listdir(worker)) == ["error.json"]
    # in the directory of this try of the step (torchrun's restart count), so a later try's
    # records are not mixed with an earlier one's
    assert sorted(os.listdir(tmp_path / "run" / ".step_errors" / "try-0")) == ["ConfigError", "RunError"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    record(RunError, "again")
    assert sorted(os.listdir(tmp_path / "run" / ".step_errors" / "try-2")) == ["RunError"]
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "no-such-dir" / "error.json"))
    monkeypatch.setenv(STEP_ERRORS_ENV, str(worker / "error.json" / "x"))  # under a file: cannot be made
    record(ConfigError, "bad input")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    monkeypatch.delenv(STEP_ERRORS_ENV)
    record(ConfigError, "bad input")
    assert recorded_class({"message": "<NONE>"}) is None and recorded_class("garbage") is None


@pytest.mark.parametrize("error_type", [ConfigError, RunError])
def test_the_error_shared_with_other_ranks_keeps_its_type_and_message(error_type):
    outcome, mine = distributed._outcome(raising(error_type("saving snapshots failed")))
    assert isinstance(mine, error_type)
    with pytest.raises(error_type, match="^saving snapshots failed$"):
        distributed._raise_outcome(outcome, "rank 0")


def test_a_bug_is_not_turned_into_a_user_facing_error():
    outcome, _ = distributed._outcome(raising(KeyError("x")))
    with pytest.raises(RuntimeError, match="rank 0 failed: KeyError") as err:
        distributed._raise_outcome(outcome, "rank 0")
    assert not isinstance(err.value, UserFacingError)


@pytest.mark.parametrize("override, says", [("model=nonexistent", "model/nonexistent"),
                                            ("trainer.batch_sise=8", "trainer.batch_sise"),
                                            ("trainer.batch_size=many", "trainer.batch_size")])
def test_overrides_that_do_not_compose_are_bad_input_for_every_tool(override, says):
    """bench and prepare compose the config themselves (not a Hydra app): a misspelt key, an
    unknown preset or a wrong type is a ConfigError naming it, not Hydra's traceback."""
    from mingpt_ddp import config

    with pytest.raises(ConfigError, match=says) as caught:
        config.compose([override])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides", [["trainer.storage_options.secret=SUPERSECRET123", "trainer.batch_sise=3"],
                                       ["trainer.storage_options.secret=SUPERSECRET123"],
                                       ["trainer.keep_last=s3://AKIAXXXX:SUPERSECRET123@bucket/x"],
                                       ["trainer.batch_size=${oc.env:SUPERSECRET123_UNSET}"]])
def test_a_config_error_never_shows_a_secret_from_the_command_line(overrides):
    """Hydra quotes the override it could not apply: secret-named keys' values and URL
    credentials are masked before the one line is printed (by bench, prepare, sweeps)."""
    from mingpt_ddp import config

    with pytest.raises(ConfigError) as caught:
        config.compose(overrides)
    message = str(caught.value)
    assert "\n" not in message
    if "oc.env" in overrides[0]:
        assert "SUPERSECRET123_UNSET" in message  # an environment variable's name is no secret: it says what to set
    else:
        assert "SUPERSECRET123" not in message, message


def test_a_lost_rendezvous_store_is_a_lost_peer_not_a_run_error(monkeypatch):
    """Waiting in the store whose host has gone (rank 0's node died, e.g. OOM-killed while it
    encodes) is a symptom of another process dying: main() ends it like a failed collective
    (exit 3, no class recorded), never as a RunError that train.sbatch would requeue at once."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    monkeypatch.setattr(distributed, "_store", client)
    del server  # the host is gone
    with pytest.raises(Exception) as raised:
        distributed._await(["mingpt_ddp/never"], "each node's first process preparing its data")
    assert not isinstance(raised.value, UserFacingError), raised.value
    line = distributed.communication_failure(raised.value)
    assert line and line.startswith("lost the job's rendezvous store while waiting for each node's"), line
