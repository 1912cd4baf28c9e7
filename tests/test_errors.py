"""Bad input and failed runs are distinct exception types with the same one-line, exit-2
treatment, and a rank raises the type another rank raised."""
import pytest

from mingpt_ddp import distributed
from mingpt_ddp.errors import ConfigError, RunError, UserFacingError

pytestmark = pytest.mark.unit


def raising(exc):
    def fn():
        raise exc
    return fn


def test_bad_input_and_run_failures_are_distinct_but_both_exit_2():
    assert not issubclass(RunError, ConfigError) and not issubclass(ConfigError, RunError)
    assert ConfigError.exit_code == RunError.exit_code == UserFacingError.exit_code == 2


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
