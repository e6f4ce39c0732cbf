"""Worker options are checked where the worker is built, with messages that say what to give."""

from __future__ import annotations

import inspect
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import sqla_proletarian as sp
from sqla_proletarian.worker import WorkerOptions


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    """An engine that is never connected: building a worker must not touch the database."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'never-created.db'}")
    yield engine
    engine.dispose()


def handler(job_type: str, payload: Any) -> None:
    return None


def test_the_defaults_are_the_documented_ones() -> None:
    options = WorkerOptions.from_kwargs({})
    assert options.queue == sp.DEFAULT_QUEUE
    assert options.worker_threads == 1
    assert options.polling_interval == 0.1
    assert options.handler_mode == "default"
    assert options.install_signal_handlers is False
    assert options.await_termination_timeout == 10
    assert options.max_unclean_ends == 3
    assert options.retry_strategy is None
    assert options.worker_id == "proletarian[default]"


def test_the_default_worker_id_names_the_queue() -> None:
    assert WorkerOptions.from_kwargs({"queue": "mail"}).worker_id == "proletarian[mail]"
    assert WorkerOptions.from_kwargs({"worker_id": "w1"}).worker_id == "w1"


def test_an_unknown_option_is_refused_with_the_list_of_options() -> None:
    with pytest.raises(sp.ConfigurationError) as info:
        WorkerOptions.from_kwargs({"threads": 2, "polling_interval": 1})
    message = str(info.value)
    assert "threads" in message
    assert "worker_threads" in message
    assert "polling_interval" in message


def test_a_mistyped_option_is_a_type_error_naming_create_queue_worker(engine: sa.Engine) -> None:
    """Its options are real keyword parameters: a typo names the public function (and
    mypy catches it), not an internal one."""
    with pytest.raises(TypeError) as info:
        sp.create_queue_worker(engine, handler, handler_fn_mode="advanced")  # type: ignore[call-arg]
    message = str(info.value)
    assert message.startswith("create_queue_worker() got an unexpected keyword argument")
    assert "'handler_fn_mode'" in message


def test_the_worker_creators_take_every_worker_option_as_a_keyword() -> None:
    """create_queue_worker's keywords are WorkerOptions' fields with their defaults;
    create_async_queue_worker's the same but for the two it refuses, plus concurrency."""
    from sqla_proletarian.aio import create_async_queue_worker

    fields = {name: f.default for name, f in WorkerOptions.__dataclass_fields__.items()}
    sync = inspect.signature(sp.create_queue_worker).parameters
    keywords = {n: p for n, p in sync.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert list(keywords) == list(fields)
    assert {n: p.default for n, p in keywords.items()} == fields
    asyncio_keywords = {
        n
        for n, p in inspect.signature(create_async_queue_worker).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert asyncio_keywords == set(fields) | {"concurrency"}


def test_process_next_job_refuses_an_unknown_option(engine: sa.Engine) -> None:
    with pytest.raises(sp.ConfigurationError, match="retries"):
        sp.process_next_job(engine, handler, retries=3)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_worker_threads_must_be_a_whole_number_of_at_least_one(value: Any) -> None:
    with pytest.raises(sp.ConfigurationError, match="worker_threads"):
        WorkerOptions(worker_threads=value)


@pytest.mark.parametrize("name", ["polling_interval", "await_termination_timeout"])
@pytest.mark.parametrize("value", [-0.1, float("nan"), "1", True, None])
def test_durations_must_be_non_negative_numbers_of_seconds(name: str, value: Any) -> None:
    with pytest.raises(sp.ConfigurationError, match=name):
        WorkerOptions(**{name: value})


def test_a_zero_polling_interval_is_refused_since_it_would_poll_without_pause() -> None:
    with pytest.raises(sp.ConfigurationError, match="polling_interval is 0; give a number"):
        WorkerOptions(polling_interval=0)
    assert WorkerOptions(polling_interval=0.001).polling_interval == 0.001


def test_a_zero_await_termination_timeout_is_allowed() -> None:
    assert WorkerOptions(await_termination_timeout=0).await_termination_timeout == 0


@pytest.mark.parametrize("mode", ["fancy", "Default", None])
def test_handler_mode_is_default_or_advanced(mode: Any) -> None:
    with pytest.raises(sp.ConfigurationError) as info:
        WorkerOptions(handler_mode=mode)
    assert "'default'" in str(info.value)
    assert "'advanced'" in str(info.value)


@pytest.mark.parametrize(
    "name", ["retry_strategy", "failed_job_handler", "on_polling_error", "on_shutdown"]
)
def test_callback_options_must_be_functions(name: str) -> None:
    with pytest.raises(sp.ConfigurationError, match=name):
        WorkerOptions(**{name: "not a function"})


@pytest.mark.parametrize("value", [0, -3, 2.0])
def test_max_unclean_ends_is_a_positive_whole_number(value: Any) -> None:
    with pytest.raises(sp.ConfigurationError, match="max_unclean_ends"):
        WorkerOptions(max_unclean_ends=value)


def test_max_unclean_ends_none_turns_crash_accounting_off() -> None:
    assert WorkerOptions(max_unclean_ends=None).max_unclean_ends is None


@pytest.mark.parametrize("queue", ["", "q\x00", "x" * 256])
def test_a_bad_queue_name_is_refused(queue: str) -> None:
    with pytest.raises(sp.ProletarianError, match="queue"):
        WorkerOptions(queue=queue)


def test_the_handler_must_be_callable(engine: sa.Engine) -> None:
    with pytest.raises(sp.ConfigurationError, match="handler"):
        sp.create_queue_worker(engine, "handler")  # type: ignore[arg-type]


def test_a_new_worker_reports_zero_outcomes_in_words(engine: sa.Engine) -> None:
    worker = sp.create_queue_worker(engine, handler)
    assert worker.summary() == {"succeeded": 0, "retried": 0, "failed": 0}
    assert worker.summary_text() == "0 succeeded, 0 retried, 0 failed"
    assert not worker.running


def test_signal_handlers_asked_for_outside_the_main_thread_are_refused(
    engine: sa.Engine, tmp_path: Path
) -> None:
    errors: list[BaseException] = []

    def build() -> None:
        try:
            sp.create_queue_worker(engine, handler, install_signal_handlers=True)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert not (tmp_path / "never-created.db").exists()
    assert len(errors) == 1
    assert isinstance(errors[0], sp.ConfigurationError)
    assert "main thread" in str(errors[0])


def test_an_in_memory_sqlite_engine_is_refused_since_threads_would_not_share_it() -> None:
    """``sqlite://`` gives each thread its own empty database: the worker says to use a file."""
    memory = sa.create_engine("sqlite://")
    try:
        with pytest.raises(sp.ConfigurationError) as info:
            sp.create_queue_worker(memory, handler)
    finally:
        memory.dispose()
    assert "file database" in str(info.value)
    assert "process_next_job" in str(info.value)


def test_something_that_is_not_an_engine_is_refused(engine: sa.Engine) -> None:
    with engine.connect() as conn, pytest.raises(sp.ConfigurationError, match="Engine"):
        sp.create_queue_worker(conn, handler)  # type: ignore[arg-type]


#: A server that is never contacted: building a worker must not connect.
UNREACHABLE_POSTGRESQL = "postgresql+psycopg://nobody@127.0.0.1:1/never"


def test_a_pool_that_cannot_give_one_thread_its_two_connections_is_refused() -> None:
    """A claim and its crash-ledger connection, plus the worker's run-record owner: a pool
    of two can never serve a thread."""
    small = sa.create_engine(UNREACHABLE_POSTGRESQL, pool_size=2, max_overflow=0)
    try:
        with pytest.raises(sp.ConfigurationError) as info:
            sp.create_queue_worker(small, handler)
        assert "pool_size + max_overflow >= 3" in str(info.value)
        assert "run-record owner" in str(info.value)
        # Without the crash ledger a thread needs one connection, which the pool has.
        worker = sp.create_queue_worker(small, handler, max_unclean_ends=None)
        assert not worker.running
    finally:
        small.dispose()


def test_a_pool_smaller_than_the_threads_need_is_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    small = sa.create_engine(UNREACHABLE_POSTGRESQL, pool_size=4, max_overflow=0)
    try:
        sp.create_queue_worker(small, handler, worker_threads=2)
    finally:
        small.dispose()
    [warning] = [r for r in caplog.records if getattr(r, "event", None) == "pool-too-small"]
    assert (warning.pool_capacity, warning.worker_threads) == (4, 2)
    assert "pool_size + max_overflow >= 5" in warning.hint


# --- lease settings --------------------------------------------------------------------------

#: Lease settings that cannot work, each with the option the refusal must name and the range
#: it must give: infinite and NaN (no lease or timeout can be computed), too long (past what
#: the heartbeat and a dead worker's wait can live with), too short (shorter than a
#: heartbeat's round trip), not a number.
_BAD_LEASE_SETTINGS = [
    ({"lease_seconds": float("inf")}, "lease_seconds is inf", "from 1 to 604800"),
    ({"lease_seconds": float("nan")}, "lease_seconds is nan", "from 1 to 604800"),
    ({"lease_seconds": 1e12}, "lease_seconds is 1000000000000.0", "from 1 to 604800"),
    ({"lease_seconds": 604801.0}, "lease_seconds is 604801.0", "from 1 to 604800"),
    ({"lease_seconds": 1e-6}, "lease_seconds is 1e-06", "from 1 to 604800"),
    ({"lease_seconds": 0.5}, "lease_seconds is 0.5", "from 1 to 604800"),
    ({"lease_seconds": 0.0}, "lease_seconds is 0.0", "from 1 to 604800"),
    ({"lease_seconds": 0}, "lease_seconds is 0", "from 1 to 604800"),
    ({"lease_seconds": "60"}, "lease_seconds is '60'", "from 1 to 604800"),
    ({"lease_seconds": True}, "lease_seconds is True", "from 1 to 604800"),
    (
        {"lease_seconds": 60.0, "heartbeat_interval": float("nan")},
        "heartbeat_interval is nan",
        "from 0.05, and shorter than lease_seconds",
    ),
    (
        {"lease_seconds": 60.0, "heartbeat_interval": 1e-6},
        "heartbeat_interval is 1e-06",
        "from 0.05, and shorter than lease_seconds",
    ),
    (
        {"lease_seconds": 60.0, "heartbeat_interval": float("inf")},
        "heartbeat_interval is inf",
        "from 0.05, and shorter than lease_seconds",
    ),
    (
        {"lease_seconds": 60.0, "heartbeat_interval": 60.0},
        "heartbeat_interval (60.0) must be shorter than lease_seconds (60.0)",
        "leave it out",
    ),
    (
        {"lease_seconds": 60.0, "job_timeout": float("inf")},
        "job_timeout is inf",
        "> 0, up to 604800",
    ),
    (
        {"lease_seconds": 60.0, "job_timeout": float("nan")},
        "job_timeout is nan",
        "> 0, up to 604800",
    ),
    (
        {"lease_seconds": 60.0, "job_timeout": 1e12},
        "job_timeout is 1000000000000.0",
        "up to 604800",
    ),
    ({"lease_seconds": 60.0, "job_timeout": 0.0}, "job_timeout is 0.0", "> 0, up to 604800"),
    ({"lease_seconds": 60.0, "job_timeout": -1.0}, "job_timeout is -1.0", "> 0, up to 604800"),
]


@pytest.mark.parametrize(("options", "refusal", "wanted"), _BAD_LEASE_SETTINGS)
def test_lease_settings_that_cannot_work_are_refused_naming_the_option_and_its_range(
    options: dict[str, Any], refusal: str, wanted: str
) -> None:
    """An infinite, NaN, too long or too short lease, heartbeat or timeout is refused where
    the options are made (not later by an OverflowError, a dead heartbeat thread or failing
    claims), with the option, the value and the range to give."""
    with pytest.raises(sp.ConfigurationError) as info:
        WorkerOptions.from_kwargs(options)
    message = str(info.value)
    assert message.startswith(refusal), message
    assert wanted in message, message


@pytest.mark.parametrize(
    ("options", "refusal", "wanted"),
    # What a flag can give: a number (argparse refuses anything else), read as a float.
    [case for case in _BAD_LEASE_SETTINGS if all(type(v) is float for v in case[0].values())],
)
def test_the_worker_command_refuses_the_same_lease_flags_with_the_same_message(
    options: dict[str, Any], refusal: str, wanted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--lease-seconds, --heartbeat-interval and --job-timeout are refused with the option's
    own message (exit status 2), before the handler is imported or a database is reached."""
    flags = [
        item
        for name, value in options.items()
        for item in (f"--{name.replace('_', '-')}", repr(value) if value == value else "nan")
    ]
    from sqla_proletarian.cli import main

    assert main(["worker", "no_such_module:handler", *flags]) == 2
    error = capsys.readouterr().err
    assert f"sqla-proletarian worker: error: {refusal}" in error, error
    assert wanted in error
    assert "Traceback" not in error and "no_such_module" not in error


@pytest.mark.parametrize(
    "options",
    [
        {"lease_seconds": 1},
        {"lease_seconds": 604800, "heartbeat_interval": 604799.9, "job_timeout": 604800},
        {"lease_seconds": 1, "heartbeat_interval": 0.05, "job_timeout": 0.001},
        {"lease_seconds": 60.0, "heartbeat_interval": 20, "job_timeout": 900},
    ],
)
def test_lease_settings_at_the_ends_of_their_ranges_are_accepted(options: dict[str, Any]) -> None:
    made = WorkerOptions.from_kwargs(options)
    for name, value in options.items():
        assert getattr(made, name) == value


def test_a_long_worker_id_is_cut_in_its_middle_where_run_records_and_leases_name_it() -> None:
    """Run records and leases hold 255 characters of ``worker_id@host/thread``: a longer
    one keeps its start and its end (the thread, a process's ``#N``), not only its start."""
    from sqla_proletarian.running import owner_text

    assert owner_text("w1", "host:12", "w1-0") == "w1@host:12/w1-0"
    long_id = "a" * 150 + "b" * 150 + "#3"
    owner = owner_text(long_id, "host:12", f"{long_id}-1")
    assert len(owner) == 255
    assert owner.startswith("a" * 120) and owner.endswith("b" * 100 + "#3-1")
    assert "..." in owner
