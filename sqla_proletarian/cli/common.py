"""What every command shares: exit statuses, parsing values, the database URL and its engine,
one-line errors, and the table that declares a command."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from sqla_proletarian import statements as sql
from sqla_proletarian.asyncapp import sync_url
from sqla_proletarian.dashboard.views import age_text
from sqla_proletarian.errors import ConfigurationError, ProletarianError, driver_error
from sqla_proletarian.exits import EXIT_INTERRUPTED as EXIT_INTERRUPTED
from sqla_proletarian.inspection import JOB_STATES, list_jobs, queue_status
from sqla_proletarian.limits import QueueLimits
from sqla_proletarian.replicas import ReplicaLag, replica_lag

PROG = "sqla-proletarian"
#: Exit status for bad command-line input (argparse's own).
EXIT_USAGE = 2
#: Exit status for anything else that went wrong.
EXIT_FAILURE = 1

#: A number and its unit, in any of the usual spellings (``5m``, ``5min``, ``5 minutes``).
_DURATION = re.compile(
    r"\s*(\d+(?:\.\d+)?)\s*(days?|d|hours?|hrs?|h|minutes?|mins?|m|seconds?|secs?|s)\s*"
)
#: Seconds per unit, by the unit's first letter.
_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
#: Words in a database's error that mean the library's tables (or columns) are missing.
_MISSING_TABLE = (
    "does not exist",
    "doesn't exist",
    "no such table",
    "no such column",
    "unknown column",
)


class UsageError(ConfigurationError):
    """The command line is wrong: exit status 2."""


# --- parsing values ------------------------------------------------------------------------


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, or several together (``1h30m``); the units also
    spelt ``day(s)``, ``hr``/``hour(s)``, ``min(s)``/``minute(s)``, ``sec(s)``/``second(s)``
    (``5min``, ``2 hours``); a bare number is seconds."""
    value = text.strip().lower()
    try:
        return timedelta(seconds=float(value))
    except ValueError:
        pass
    parts = list(_DURATION.finditer(value))
    if not value or "".join(part.group(0) for part in parts) != value:
        raise UsageError(
            f"duration {text!r}: give a number and a unit, e.g. 30d, 12h, 5min, 90m or 45s"
        )
    return timedelta(seconds=sum(float(part[1]) * _UNITS[part[2][0]] for part in parts))


def parse_seconds(text: str) -> float:
    """A flag's seconds: a number, or a duration such as ``5min`` (see parse_duration). A
    number is taken as it is (``inf`` and ``nan`` too): the option's own check refuses what
    it cannot use, naming its range."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_duration(text).total_seconds()
    except UsageError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give seconds, or a number and a unit, e.g. 30, 45s, 5min or 2h"
        ) from None


def parse_rate(text: str) -> tuple[int, float]:
    """``COUNT/SECONDS``: at most COUNT starts in any window of SECONDS, a number or a
    duration (``10/1s``, ``100/5min``); a unit alone is one of it (``10/s``, ``600/min``)."""
    count, slash, window = (part.strip() for part in text.partition("/"))
    example = "e.g. 10/1s (10 a second), 600/min or 100/5min"
    if not slash:
        raise argparse.ArgumentTypeError(f"{text!r}: give COUNT/SECONDS, {example}")
    if not count.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: {count!r} before the / is not a whole number of starts; give {example}"
        )
    try:
        seconds = parse_seconds("1" + window if window[:1].isalpha() else window)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {window!r} after the / is not seconds nor a duration; give {example}"
        ) from None
    return int(count), seconds


def _payload(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(
            f"PAYLOAD_JSON is not JSON ({exc}): give one JSON value, e.g. '{{\"id\": 42}}'"
        ) from None


# --- the database --------------------------------------------------------------------------


def _url(args: argparse.Namespace) -> URL:
    text = args.url or os.environ.get("DATABASE_URL")
    if not text:
        raise UsageError(
            "no database URL: pass --url dialect+driver://user@host/dbname or set DATABASE_URL"
        )
    return _parsed_url(text, "database URL")


def _parsed_url(text: str, what: str) -> URL:
    """``text`` as a URL, ``what`` naming it in the errors."""
    try:
        url = make_url(text)
    except sa_exc.ArgumentError:
        raise UsageError(
            f"the {what} cannot be parsed: give dialect+driver://user:password@host/dbname"
        ) from None
    if url.get_backend_name() == "sqlite" and url.host:
        # sqlite://app.db reads app.db as a host name, which SQLite has none of.
        path = url.host + (f"/{url.database}" if url.database else "")
        raise UsageError(
            f"Invalid SQLite URL {text!r}: use {url.drivername}:///{path} (three slashes for "
            "a relative path, four for an absolute one)"
        )
    return url


def _engine(url: URL, **options: Any) -> sa.Engine:
    """An engine on ``url`` whose first connection succeeded."""
    try:
        engine = sa.create_engine(url, **options)
    except sa_exc.NoSuchModuleError:
        raise UsageError(
            f"the database URL names an unknown dialect ({url.drivername}): use postgresql+"
            "psycopg://, mysql+pymysql://, sqlite:///path, ..."
        ) from None
    except ImportError as exc:
        raise ProletarianError(
            f"the database driver of {url.drivername} is not installed ({_one_line(exc)}): "
            f"install it, or the one the package's extra brings: {_driver_advice(url)}"
        ) from None
    try:
        with engine.connect():
            pass
    except sa_exc.DBAPIError as exc:
        engine.dispose()
        raise ProletarianError(
            f"cannot connect to the database at {url.render_as_string(hide_password=True)}: "
            f"{_database_message(exc)}; check --url or DATABASE_URL, and that the server is "
            "running and lets you in"
        ) from None
    return engine


def _driver_advice(url: URL) -> str:
    """How to install a driver for ``url``'s server, and the URL that names it."""
    if url.get_backend_name() in ("mysql", "mariadb"):
        return "pip install 'sqla-proletarian[mysql]' (PyMySQL), and a mysql+pymysql:// URL"
    return "pip install 'sqla-proletarian[postgresql]' (psycopg), and a postgresql+psycopg:// URL"


@contextmanager
def _database(args: argparse.Namespace, **options: Any) -> Iterator[sa.Engine]:
    """The engine of the command's URL (an async URL's sync twin), connected once, disposed
    of at the end."""
    engine = _engine(sync_url(_url(args)), **options)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def _read_database(args: argparse.Namespace) -> Iterator[sa.Engine | None]:
    """The engine of ``--read-url`` (a replica the read-only views read from), connected
    once, disposed of at the end; None without one."""
    if not getattr(args, "read_url", None):
        yield None
        return
    engine = _engine(sync_url(_parsed_url(args.read_url, "--read-url")))
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def _reading_database(args: argparse.Namespace) -> Iterator[sa.Engine]:
    """The engine a read-only command reads with: ``--read-url``'s when given (the primary's
    URL is then not needed), else the database's. With ``--read-url``, how far it lags is
    said first (``read_lag``)."""
    with _read_database(args) as read_engine:
        if read_engine is not None:
            yield read_engine
            return
    with _database(args) as engine:
        yield engine


def read_lag(args: argparse.Namespace, engine: sa.Engine) -> ReplicaLag | None:
    """With ``--read-url``: how far its server lags (``replica_lag``); None without it."""
    return replica_lag(engine) if getattr(args, "read_url", None) else None


def _check_tables(engine: sa.Engine) -> None:
    """Fail now, with advice, if the library's tables are missing or not upgraded."""
    with engine.connect() as conn:
        for statement in sql.probe_tables():
            conn.execute(*statement)


def warn_if_unknown_queue(engine: sa.Engine, command: str, queue: str | None) -> None:
    """Warn on standard error if ``queue`` has never held a job (no job, archived job,
    pause or limits of it) while other queues have: most likely a misspelling, which would otherwise
    pass in silence. A database that has never held any job (a fresh deployment) gets no
    warning: no queue name is known yet to compare with."""
    if queue is None:
        return
    for state in JOB_STATES:
        if list_jobs(engine, state, queue=queue, limit=1).jobs:
            return
    statuses = queue_status(engine)
    if any(status.queue == queue for status in statuses):
        return  # paused, or limited
    if not statuses and not any(list_jobs(engine, state, limit=1).jobs for state in JOB_STATES):
        return  # no queue has held a job yet
    print(
        f"{PROG} {command}: warning: queue {queue!r} has never held a job (no job, archived "
        f"job, pause or limits of it): check its spelling; `{PROG} status` lists the queues",
        file=sys.stderr,
        flush=True,
    )


def explain(exc: BaseException) -> str:
    """One line that says what went wrong and, where it can, what to do."""
    if isinstance(exc, ProletarianError):
        return _one_line(exc)
    if isinstance(exc, sa_exc.SQLAlchemyError):
        message = _database_message(exc)
        lowered = message.lower()
        if any(words in lowered for words in _MISSING_TABLE):
            return (
                f"the library's tables are missing or older than this version ({message}): "
                f"run `{PROG} install` (or your own Alembic migrations)"
            )
        if "permission denied" in lowered or "command denied" in lowered:
            return f"the database refused ({message}): grant the role what docs/privileges.md lists"
        return f"database error: {message}"
    return f"unexpected error: {_one_line(exc)}"


def _database_message(exc: BaseException) -> str:
    """The first line of the driver's own message (drivers add hints on further lines)."""
    orig = driver_error(exc)
    lines = str(orig if orig is not None else exc).strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(exc).__name__


def _one_line(exc: BaseException) -> str:
    """A library error's message, or any other exception as ``Type: message``."""
    text = str(exc) if isinstance(exc, ProletarianError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _uuids(values: Sequence[str], listed_by: str) -> list[uuid.UUID]:
    """The job ids given, each a UUID; ``listed_by`` is the command that shows such ids."""
    ids = []
    for value in values:
        try:
            ids.append(uuid.UUID(value))
        except ValueError:
            raise UsageError(
                f"{value!r} is not a job id: give the UUIDs `{PROG} {listed_by}` shows"
            ) from None
    return ids


# --- declaring a command --------------------------------------------------------------------


#: One argument of a command: ``add_argument``'s names and options.
Argument = tuple[tuple[str, ...], dict[str, Any]]


def arg(*names: str, **options: Any) -> Argument:
    return names, options


#: ``--read-url`` of the read-only views.
READ_URL = arg(
    "--read-url",
    metavar="URL",
    help="read from this database, e.g. a replica, instead of --url (and say how far it lags)",
)


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, a line of help, an example, its arguments and its run; or,
    with ``actions``, a group of commands (``limits set``, ``limits show``), each its own."""

    name: str
    summary: str
    example: str
    arguments: tuple[Argument, ...]
    run: Callable[[argparse.Namespace], int] | None
    details: str = ""
    actions: tuple[Command, ...] = ()


def _error(command: str | None, message: str, code: int = EXIT_USAGE) -> int:
    where = f"{PROG} {command}" if command else PROG
    print(f"{where}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return code


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header and rows as lines of aligned columns."""
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]


def limits_table(limited: Sequence[tuple[str, QueueLimits, int | None]]) -> list[str]:
    """The queues with limits as lines of a table: each one's limits, and its ready jobs
    waiting (``-`` when not known)."""
    cells = [(queue, limits.describe(), _cell(waiting)) for queue, limits, waiting in limited]
    return _table(("QUEUE", "LIMITS", "WAITING"), cells)


def _cell(value: int | float | None) -> str:
    """A count as it is; an age (float seconds) as 12.3s, 5m 3s, 2h 5m or 3d 4h."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return age_text(value)


def _iso(value: datetime) -> str:
    return value.isoformat()
