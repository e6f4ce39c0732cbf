"""What the command line makes of mistyped input: durations in the usual spellings
(``5min`` as well as ``5m``), a mistyped option refused by its command with the option it
most likely meant, and a SQLite URL missing its third slash."""

from __future__ import annotations

from datetime import timedelta

import pytest
from cli_support import assert_one_line_error, cli

from sqla_proletarian.cli import build_parser, main, parse_duration
from sqla_proletarian.cli.common import UsageError

SPELLINGS = {
    "5m": 300, "5min": 300, "5mins": 300, "5 minutes": 300, "1minute": 60,
    "45s": 45, "45sec": 45, "45secs": 45, "45 seconds": 45, "1second": 1,
    "2h": 7200, "2hr": 7200, "2hrs": 7200, "2 hours": 7200, "1hour": 3600,
    "3d": 259200, "3day": 259200, "3 days": 259200, "1h30min": 5400, "1 hour 30 minutes": 5400,
    "90": 90, "1.5min": 90,
}  # fmt: skip


@pytest.mark.parametrize(("text", "seconds"), SPELLINGS.items())
def test_a_duration_takes_the_usual_spellings_of_its_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["5 mintues", "5x", "min", "5m later", ""])
def test_a_duration_in_no_known_spelling_is_refused_with_examples(text: str) -> None:
    with pytest.raises(UsageError, match=r"give a number and a unit, e\.g\. 30d, 12h, 5min"):
        parse_duration(text)


def test_the_worker_flags_in_seconds_take_durations_too() -> None:
    args = build_parser().parse_args(
        ["worker", "tasks:handlers", "--shutdown-timeout", "2min", "--lease-seconds", "5 min",
         "--job-timeout", "1h", "--polling-interval", "0.5"]
    )  # fmt: skip
    assert (args.shutdown_timeout, args.lease_seconds, args.job_timeout) == (120, 300, 3600)
    assert args.polling_interval == 0.5


def test_cancel_timeout_takes_a_duration() -> None:
    args = build_parser().parse_args(["cancel", "x", "--wait", "--timeout", "2min"])
    assert (args.wait, args.timeout) == (True, 120)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["worker", "tasks:handlers", "--burts"],
            "sqla-proletarian worker: error: unrecognized arguments: --burts; did you mean "
            "--burst? (see sqla-proletarian worker --help)",
        ),
        (
            ["worker", "tasks:handlers", "--shutdown-timout=3"],
            "sqla-proletarian worker: error: unrecognized arguments: --shutdown-timout=3; did "
            "you mean --shutdown-timeout? (see sqla-proletarian worker --help)",
        ),
        (
            ["status", "--nothing-like-it"],
            "sqla-proletarian status: error: unrecognized arguments: --nothing-like-it (see "
            "sqla-proletarian status --help)",
        ),
    ],
)
def test_a_mistyped_option_gets_did_you_mean_and_its_commands_help(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == line


@pytest.mark.parametrize(
    ("url", "fixed"),
    [("sqlite://app.db", "sqlite:///app.db"), ("sqlite+pysqlite://data/app.db",
                                               "sqlite+pysqlite:///data/app.db")],
)  # fmt: skip
def test_a_sqlite_url_without_its_third_slash_says_how_to_write_it(url: str, fixed: str) -> None:
    line = assert_one_line_error(cli("status", "--url", url), 2)
    assert line == (
        f"sqla-proletarian status: error: Invalid SQLite URL '{url}': use {fixed} (three "
        "slashes for a relative path, four for an absolute one)"
    )
