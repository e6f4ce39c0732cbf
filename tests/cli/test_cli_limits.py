"""``limits set``, ``limits show`` and ``limits clear`` through the console script, on every
backend: each ``set`` sets all four limits; ``show`` (and ``status``) list them with the
ready jobs waiting; ``clear`` says whether there were any; a bad value is one line and
exit status 2, and changes nothing. Rates are ``COUNT/SECONDS`` in the command line's
duration spellings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from cli_support import assert_one_line_error, cli, url_of
from test_cli_worker_settings import in_process  # noqa: F401 (a fixture)

import sqla_proletarian as sp
from sqla_proletarian.cli import build_parser, main

if TYPE_CHECKING:
    from conftest import Database


def run(*args: str) -> str:
    """The command's standard output; it must succeed."""
    done = cli(*args)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


def shown(url: str) -> dict[str, Any]:
    return json.loads(run("limits", "show", "--json", "--url", url))  # type: ignore[no-any-return]


def test_limits_set_show_clear_and_status_through_the_script(database: Database) -> None:
    """Limits set from the command line are what sp.queue_limits reads; ``show --json`` gives
    each queue's as_dict() and its ready jobs waiting (scheduled ones are not); ``status``
    shows the limits and waiting count of a limited queue, null for the others; a second
    ``set`` with one flag leaves only that limit; a bad value is refused with status 2;
    ``clear`` says whether it had limits."""
    url = url_of(database)
    engine = database.engine()
    with engine.begin() as conn:
        for tenant in ("a", "a", "b"):
            sp.enqueue(conn, "call", queue="partner-api", concurrency_key=tenant)
        sp.enqueue(conn, "call", queue="partner-api", process_in=3600)
        sp.enqueue(conn, "mail", queue="mail")

    said = run("limits", "set", "partner-api", "--max-running", "5", "--max-running-per-key",
               "2", "--rate", "10/s", "--rate-per-key", "100/5min", "--url", url)  # fmt: skip
    expected = sp.QueueLimits(5, 2, (10, 1.0), (100, 300.0))
    assert said.strip() == (
        f"queue 'partner-api' limits: {expected.describe()} (from each worker's next claim; "
        "the limits not given are none)"
    )
    assert sp.queue_limits(engine) == {"partner-api": expected}
    assert shown(url) == {"partner-api": {**expected.as_dict(), "waiting": 3}}
    table = run("limits", "show", "--url", url).splitlines()
    assert table[0].split() == ["QUEUE", "LIMITS", "WAITING"]
    assert table[1].split() == ["partner-api", *expected.describe().split(), "3"]

    status = json.loads(run("status", "--json", "--url", url))
    queues = {queue["queue"]: queue for queue in status["queues"]}
    assert (queues["partner-api"]["limits"], queues["partner-api"]["waiting"]) == (
        expected.as_dict(),
        3,
    )
    assert (queues["mail"]["limits"], queues["mail"]["waiting"]) == (None, None)
    lines = run("status", "--url", url).splitlines()
    limits_header = lines.index("") + 1
    assert lines[limits_header].split() == ["QUEUE", "LIMITS", "WAITING"]
    assert lines[limits_header + 1:] == [table[1]]  # fmt: skip

    bad = cli("limits", "set", "partner-api", "--rate", "10/0", "--url", url)
    assert "--rate's seconds: 0.0 is out of range" in assert_one_line_error(bad, 2)
    again = run("limits", "set", "partner-api", "--rate", "1/1h30min", "--url", url)
    assert "rate_limit=1/5400s (from each worker's next claim" in again
    assert sp.queue_limits(engine) == {"partner-api": sp.QueueLimits(rate_limit=(1, 5400.0))}

    assert run("limits", "clear", "partner-api", "--url", url).strip() == (
        "queue 'partner-api' limits cleared: from each worker's next claim, none"
    )
    assert run("limits", "clear", "partner-api", "--url", url).strip() == (
        "queue 'partner-api' had no limits: nothing to clear"
    )
    assert sp.queue_limits(engine) == {}
    assert run("limits", "show", "--url", url).startswith("no queue has limits")


@pytest.mark.usefixtures("in_process")
def test_a_queue_that_never_held_a_job_gets_limits_with_a_warning(
    database: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    """Limits may come before a queue's first job: set (warned about as ``pause`` warns, once
    other queues have held jobs: most likely a misspelling), shown with 0 waiting."""
    url = url_of(database)
    engine = database.engine()
    with engine.begin() as conn:
        sp.enqueue(conn, "mail", queue="mail")

    assert main(["limits", "set", "reports", "--max-running", "1", "--url", url]) == 0
    assert "queue 'reports' has never held a job" in capsys.readouterr().err
    assert main(["limits", "show", "--json", "--url", url]) == 0
    assert json.loads(capsys.readouterr().out)["reports"]["waiting"] == 0
    assert main(["limits", "set", "reports", "--max-running", "2", "--url", url]) == 0
    assert "never held a job" not in capsys.readouterr().err  # known by its limits now


BAD_LIMITS = [
    (["--max-running", "0"], "--max-running: 0 is out of range; give 1 to 10000"),
    (["--max-running-per-key", "10001"], "--max-running-per-key: 10001 is out of range"),
    (["--max-running", "two"], "argument --max-running: invalid int value: 'two'"),
    (["--rate", "10"], "argument --rate: '10': give COUNT/SECONDS, e.g. 10/1s"),
    (["--rate", "ten/s"], "'ten' before the / is not a whole number of starts"),
    (["--rate", "10/soon"], "'soon' after the / is not seconds nor a duration"),
    (["--rate", "10/0"], "--rate's seconds: 0.0 is out of range; give more than 0"),
    (["--rate-per-key", "0/1s"], "--rate-per-key's count: 0 is "),
    (["--rate-per-key", "1/8d"], "--rate-per-key's seconds: 691200.0 is out of range"),
    ([], "no limit given: give --max-running, --max-running-per-key, --rate or --rate-per-key"),
]


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(("flags", "message"), BAD_LIMITS)
def test_a_bad_limit_is_one_line_with_exit_status_2_and_changes_nothing(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = sa.create_engine(url)
    sp.metadata.create_all(engine)
    with engine.begin() as conn:
        sp.set_queue_limits(conn, "api", max_running=3)

    try:
        status = main(["limits", "set", "api", *flags, "--url", url])
    except SystemExit as exit_:  # argparse's own refusals
        status = exit_.code  # type: ignore[assignment]

    assert status == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("sqla-proletarian limits set: error: ")
    assert message in line
    assert sp.queue_limits(engine) == {"api": sp.QueueLimits(max_running=3)}
    engine.dispose()


@pytest.mark.parametrize(
    ("text", "rate"),
    [("10/1s", (10, 1.0)), ("10/s", (10, 1.0)), ("600/min", (600, 60.0)), ("3/2.5", (3, 2.5)),
     ("100/5min", (100, 300.0)), ("1000 / 1 hour", (1000, 3600.0)), ("5/1h30m", (5, 5400.0))],
)  # fmt: skip
def test_a_rate_is_a_count_per_seconds_or_per_duration(text: str, rate: tuple[int, float]) -> None:
    args = build_parser().parse_args(["limits", "set", "api", "--rate", text])
    assert args.rate == rate


def test_limits_needs_an_action_and_a_mistyped_flag_names_the_action(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, line in (
        (["limits"], "sqla-proletarian limits: error: the following arguments are required: "
         "ACTION (see sqla-proletarian limits --help)"),
        (["limits", "set", "api", "--max-runing", "2"], "sqla-proletarian limits set: error: "
         "unrecognized arguments: --max-runing 2; did you mean --max-running? (see "
         "sqla-proletarian limits set --help)"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip() == line
