"""The ``sqla-proletarian`` command line: a thin shell over the library's public functions.

One function per command, listed in ``COMMANDS`` (name, summary, example, arguments, run):
adding a command is adding an entry. Every command reads the database URL from ``--url``
or ``DATABASE_URL``. Bad input gets one line on standard error that says what to do, and
exit status 2 (usage) or 1 (anything else); never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from sqla_proletarian import statements as sql
from sqla_proletarian.control import cancel_job, pause_queue, resume_queue
from sqla_proletarian.enqueue import enqueue
from sqla_proletarian.errors import (
    ConfigurationError,
    InvalidJobError,
    ProletarianError,
    driver_error,
)
from sqla_proletarian.handlers import JobHandlers
from sqla_proletarian.inspection import DEFAULT_FAILED_LIMIT, failed_jobs, get_job, queue_status
from sqla_proletarian.maintenance import install_tables, prune_archive, retry_failed_report
from sqla_proletarian.models import DEFAULT_QUEUE
from sqla_proletarian.supervisor import (
    EXIT_FORCED,
    EXIT_OK,
    EXIT_UNCLEAN,
    Supervisor,
    report_to_fd,
    run_worker,
    stop_with_supervisor,
)
from sqla_proletarian.worker import (
    DEFAULT_POLLING_INTERVAL,
    DEFAULT_RECONNECT_GRACE,
    WorkerOptions,
)

PROG = "sqla-proletarian"
#: Exit status for bad command-line input (argparse's own).
EXIT_USAGE = 2
#: Exit status for anything else that went wrong.
EXIT_FAILURE = 1
#: Exit status after Ctrl-C in a command other than ``worker``.
EXIT_INTERRUPTED = 130

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
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


# --- loading the handler -------------------------------------------------------------------


def load_handler(spec: str) -> Callable[..., Any]:
    """The handler named by ``MODULE:ATTR``: a handler function, a ``JobHandlers``, or, with
    ``MODULE:ATTR()``, what calling ATTR with no arguments returns (one of those two).

    The current directory comes first on ``sys.path``. Raises ConfigurationError saying what
    is wrong: no such module or attribute, an import that raised, a factory that raised.
    """
    module_name, _, attr = spec.partition(":")
    call = attr.endswith("()")
    path = attr[:-2] if call else attr
    if not module_name or not path:
        raise ConfigurationError(
            f"handler {spec!r}: give MODULE:ATTR, e.g. tasks:handlers, or tasks:make() to "
            "call a function that returns the handler"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigurationError(
                f"handler {spec!r}: no module named {exc.name!r} in the current directory "
                "or on PYTHONPATH; run the command where the module is, or set PYTHONPATH"
            ) from None
        raise ConfigurationError(
            f"handler {spec!r}: importing {module_name} failed: {_one_line(exc)}"
        ) from None
    except (Exception, SystemExit) as exc:
        raise ConfigurationError(
            f"handler {spec!r}: importing {module_name} raised {_one_line(exc)}"
        ) from None
    for name in path.split("."):
        if not hasattr(target, name):
            raise ConfigurationError(
                f"handler {spec!r}: {module_name} has no attribute {path!r}; name a function, "
                "a JobHandlers table, or a factory with ()"
            )
        target = getattr(target, name)
    if call:
        if not callable(target):
            raise ConfigurationError(f"handler {spec!r}: {path} is not a function to call")
        try:
            target = target()
        except Exception as exc:
            raise ConfigurationError(
                f"handler {spec!r}: calling it raised {_one_line(exc)}"
            ) from None
    if isinstance(target, JobHandlers) or callable(target):
        handler: Callable[..., Any] = target
        return handler
    raise ConfigurationError(
        f"handler {spec!r} is a {type(target).__name__}: give a handler function or a "
        "JobHandlers table (or a factory of one, with ())"
    )


def load_periodic_jobs(spec: str) -> tuple[Any, ...]:
    """The ``periodic_jobs`` of the handler's module (a list of ``sp.PeriodicJob``), if it
    has any: ``worker tasks:handlers`` runs the schedules that ``tasks.py`` declares."""
    module = sys.modules.get(spec.partition(":")[0])
    jobs = getattr(module, "periodic_jobs", None)
    if jobs is None:
        return ()
    try:
        return tuple(jobs)
    except TypeError:
        raise ConfigurationError(
            f"{spec.partition(':')[0]}.periodic_jobs is a {type(jobs).__name__}: give a list "
            "of sp.PeriodicJob"
        ) from None


# --- parsing values ------------------------------------------------------------------------


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, or several together (``1h30m``); a bare number is
    seconds."""
    value = text.strip().lower()
    try:
        return timedelta(seconds=float(value))
    except ValueError:
        pass
    parts = _DURATION.findall(value)
    if not value or "".join(number + unit for number, unit in parts) != value:
        raise UsageError(f"duration {text!r}: give a number and a unit, e.g. 30d, 12h, 90m or 45s")
    return timedelta(seconds=sum(float(number) * _UNITS[unit] for number, unit in parts))


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
    try:
        return make_url(text)
    except sa_exc.ArgumentError:
        raise UsageError(
            "the database URL cannot be parsed: give dialect+driver://user:password@host/dbname"
        ) from None


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
            "install it, e.g. pip install 'sqla-proletarian[postgresql]'"
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


@contextmanager
def _database(args: argparse.Namespace, **options: Any) -> Iterator[sa.Engine]:
    """The engine of the command's URL, connected once, disposed of at the end."""
    engine = _engine(_url(args), **options)
    try:
        yield engine
    finally:
        engine.dispose()


def _check_tables(engine: sa.Engine) -> None:
    """Fail now, with advice, if the library's tables are missing or not upgraded."""
    with engine.connect() as conn:
        for statement in sql.probe_tables():
            conn.execute(*statement)


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


# --- the commands ----------------------------------------------------------------------------


def install(args: argparse.Namespace) -> int:
    from sqla_proletarian.migrations import BRANCH_LABEL, HEAD_REVISION

    with _database(args) as engine:
        applied = install_tables(engine)
    if applied:
        print(f"installed {', '.join(applied)}: the library's tables are at {HEAD_REVISION}")
    else:
        print(f"the library's tables are up to date ({HEAD_REVISION}, branch {BRANCH_LABEL})")
    return EXIT_OK


def worker(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {
        "queue": args.queue,
        "worker_threads": args.threads,
        "batch_size": args.batch_size,
        "polling_interval": args.polling_interval,
        "handler_mode": args.handler_mode,
        "reconnect_grace": args.reconnect_grace,
        "lease_seconds": args.lease_seconds,
        "heartbeat_interval": args.heartbeat_interval,
        "job_timeout": args.job_timeout,
    }
    if args.process_index is not None:
        options["worker_id"] = f"proletarian[{args.queue}]#{args.process_index}"
    try:
        WorkerOptions.from_kwargs(options)
    except ProletarianError as exc:
        raise UsageError(str(exc)) from None
    if args.processes < 1:
        raise UsageError(f"--processes {args.processes}: give 1 or more")
    if args.processes > 1:
        return _supervise(args, _url(args))
    handler = load_handler(args.handler)
    periodic = load_periodic_jobs(args.handler)
    if periodic:
        options["periodic_jobs"] = periodic
    if args.report_fd is not None:
        stop_with_supervisor()
    with _database(args, pool_size=2 * args.threads + 2) as engine:
        _check_tables(engine)
        done = run_worker(
            engine,
            handler,
            burst=args.burst,
            report=report_to_fd(args.report_fd) if args.report_fd is not None else None,
            install_signal_handlers=True,
            **options,
        )
    if done.exception is not None:
        _error("worker", f"the worker stopped: {explain(done.exception)}")
        return EXIT_FAILURE
    print(f"{done.worker_id} stopped: {done.summary_text()}", file=sys.stderr, flush=True)
    return EXIT_OK


def _supervise(args: argparse.Namespace, url: URL) -> int:
    """Run the worker in ``args.processes`` processes, the URL passed in the environment
    (not on their command lines, where any user could read a password)."""
    worker_args = [
        args.handler,
        *("--queue", args.queue, "--threads", str(args.threads)),
        *("--batch-size", str(args.batch_size)),
        *("--polling-interval", repr(args.polling_interval)),
        *("--reconnect-grace", repr(args.reconnect_grace)),
        *_given("--lease-seconds", args.lease_seconds),
        *_given("--heartbeat-interval", args.heartbeat_interval),
        *_given("--job-timeout", args.job_timeout),
        *("--handler-mode", args.handler_mode, "--log-level", args.log_level or "info"),
        *(["--burst"] if args.burst else []),
    ]
    env = {**os.environ, "DATABASE_URL": url.render_as_string(hide_password=False)}
    return Supervisor(worker_args, args.processes, burst=args.burst, env=env).run()


def _given(option: str, value: float | None) -> list[str]:
    """A worker option for the processes' command lines, if it was given."""
    return [] if value is None else [option, repr(value)]


def enqueue_job(args: argparse.Namespace) -> int:
    payload = _payload(args.payload)
    process_in = parse_duration(args.delay) if args.delay is not None else None
    with _database(args) as engine, engine.begin() as conn:
        job_id = enqueue(
            conn,
            args.job_type,
            payload,
            queue=args.queue,
            process_in=process_in,
            priority=args.priority,
            unique_key=args.unique_key,
        )
    print(job_id)
    return EXIT_OK


def status(args: argparse.Namespace) -> int:
    with _database(args) as engine:
        queues = queue_status(engine)
    if args.json:
        rows = [asdict(queue) for queue in queues]
        for row in rows:
            if row["oldest_ready_age_s"] is not None:
                row["oldest_ready_age_s"] = round(row["oldest_ready_age_s"], 3)
        print(json.dumps({"queues": rows}))
        return EXIT_OK
    if not queues:
        print("no jobs queued, and none finished in the last hour")
        return EXIT_OK
    header = (
        "QUEUE",
        "READY",
        "SCHEDULED",
        "RUNNING",
        "OLDEST READY",
        "SUCCEEDED 1H",
        "FAILED 1H",
        "PAUSED",
        "BY PRIORITY",
    )
    counts = ("ready", "scheduled", "running", "oldest_ready_age_s", "succeeded_last_hour")
    table = [
        [
            q.queue,
            *(_cell(getattr(q, name)) for name in counts),
            str(q.failed_last_hour),
            "paused" if q.paused else "-",
            " ".join(f"{priority}:{jobs}" for priority, jobs in q.by_priority.items()) or "-",
        ]
        for q in queues
    ]
    print("\n".join(_table(header, table)))
    return EXIT_OK


def failed(args: argparse.Namespace) -> int:
    with _database(args) as engine:
        jobs = failed_jobs(engine, queue=args.queue, job_type=args.job_type, limit=args.limit)
    if args.json:
        rows = [
            {
                **asdict(job),
                "job_id": str(job.job_id),
                **{name: _iso(getattr(job, name)) for name in _TIMES},
            }
            for job in jobs
        ]
        print(json.dumps({"failed": rows}))
        return EXIT_OK
    if not jobs:
        print("no failed jobs in the archive")
        return EXIT_OK
    header = ("JOB ID", "QUEUE", "JOB TYPE", "ATTEMPTS", "FINISHED (UTC)")
    cells = [
        (
            str(job.job_id),
            job.queue,
            job.job_type,
            str(job.attempts),
            job.finished_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
        for job in jobs
    ]
    first, *lines = _table(header, cells)
    print(first)
    for job, line in zip(jobs, lines, strict=True):
        print(line)
        for error_line in (job.error or "(no error recorded)").splitlines():
            print(f"    {error_line}")
    return EXIT_OK


_TIMES = ("enqueued_at", "process_at", "finished_at")


def retry(args: argparse.Namespace) -> int:
    if bool(args.job_ids) == bool(args.all):
        raise UsageError("give the JOB_IDs to put back, or --all for every failure (not both)")
    job_ids = None if args.all else _uuids(args.job_ids)
    with _database(args) as engine:
        report = retry_failed_report(engine, job_ids, queue=args.queue, job_type=args.job_type)
    count = report.put_back
    print(f"{count} failed job{'s' if count != 1 else ''} put back in the queue")
    for job_id in report.key_held:
        print(f"{job_id} stays archived: a queued job of its queue holds its unique_key")
    return EXIT_OK


def _uuids(values: Sequence[str]) -> list[uuid.UUID]:
    ids = []
    for value in values:
        try:
            ids.append(uuid.UUID(value))
        except ValueError:
            raise UsageError(f"{value!r} is not a job id: give the UUIDs `failed` shows") from None
    return ids


def pause(args: argparse.Namespace) -> int:
    with _database(args) as engine, engine.begin() as conn:
        pause_queue(conn, args.queue)
    print(f"queue {args.queue!r} paused: its workers stop claiming within a polling interval")
    return EXIT_OK


def resume(args: argparse.Namespace) -> int:
    with _database(args) as engine, engine.begin() as conn:
        resume_queue(conn, args.queue)
    print(f"queue {args.queue!r} resumed")
    return EXIT_OK


def cancel(args: argparse.Namespace) -> int:
    (job_id,) = _uuids([args.job_id])
    with _database(args) as engine, engine.begin() as conn:
        cancelled = cancel_job(conn, job_id)
        # A job under a live lease stays in the queue until its worker stops it.
        still = get_job(conn, job_id) if cancelled else None
        requested = still is not None and still.state == "running"
    if not cancelled:
        _error("cancel", f"job {job_id} was not cancelled: it is not queued, or it is running")
        return EXIT_FAILURE
    if requested:
        print(
            f"job {job_id} cancel requested (running under a lease; its worker stops it "
            "within a heartbeat)"
        )
    else:
        print(f"job {job_id} cancelled (archived as cancelled)")
    return EXIT_OK


def prune(args: argparse.Namespace) -> int:
    older_than = parse_duration(args.older_than)
    with _database(args) as engine:
        deleted = prune_archive(engine, older_than=older_than, status=args.status)
    print(f"{deleted} archived job{'s' if deleted != 1 else ''} deleted")
    return EXIT_OK


def dashboard(args: argparse.Namespace) -> int:
    from sqla_proletarian.dashboard import create_dashboard
    from sqla_proletarian.dashboard.server import create_server, server_url

    with _database(args) as engine:
        _check_tables(engine)
        app = create_dashboard(engine, read_only=args.read_only)
        try:
            server = create_server(app, args.host, args.port)
        except OSError as exc:
            raise ProletarianError(
                f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}): give "
                "another --port, or stop what uses this one"
            ) from None
        with server:
            mode = " (read-only)" if args.read_only else ""
            print(f"dashboard at {server_url(server)}{mode}; Ctrl-C stops it", flush=True)
            if args.host not in ("127.0.0.1", "localhost", "::1"):
                _error(
                    "dashboard",
                    f"warning: listening on {args.host}: the dashboard has no login of its "
                    "own, so anyone who reaches this port can use it",
                )
            _serve_until_signal(server)
    return EXIT_OK


def _serve_until_signal(server: Any) -> None:
    """Serve until SIGINT or SIGTERM, each handled here: a process started in the
    background of a script inherits SIGINT ignored, and Python then raises no
    KeyboardInterrupt for it."""

    def stop(signum: int, frame: object) -> None:
        # shutdown() waits for serve_forever() to return, so it cannot run in its thread.
        threading.Thread(target=server.shutdown, name="dashboard-stop", daemon=True).start()

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve_forever()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# --- the table of commands -------------------------------------------------------------------


#: One argument of a command: ``add_argument``'s names and options.
Argument = tuple[tuple[str, ...], dict[str, Any]]


def arg(*names: str, **options: Any) -> Argument:
    return names, options


WORKER_ARGUMENTS = (
    arg(
        "handler",
        metavar="MODULE:ATTR",
        help="the handler: a function, a JobHandlers table, or MODULE:factory() to call one "
        "that returns it (imported from the current directory or PYTHONPATH)",
    ),
    arg("--queue", default=DEFAULT_QUEUE, metavar="Q", help="the queue to work off (default)"),
    arg("--threads", type=int, default=1, metavar="N", help="worker threads (1)"),
    arg("--processes", type=int, default=1, metavar="N", help="worker processes (1)"),
    arg("--batch-size", type=int, default=1, metavar="N", help="jobs claimed together (1)"),
    arg(
        "--polling-interval",
        type=float,
        default=DEFAULT_POLLING_INTERVAL,
        metavar="S",
        help=f"seconds between polls of a drained queue ({DEFAULT_POLLING_INTERVAL})",
    ),
    arg(
        "--reconnect-grace",
        type=float,
        default=DEFAULT_RECONNECT_GRACE,
        metavar="S",
        help="seconds a run's worker must stay gone from the database before the run counts "
        f"as an unclean end and its job runs again ({DEFAULT_RECONNECT_GRACE:g})",
    ),
    arg(
        "--lease-seconds",
        type=float,
        metavar="S",
        help="lease mode: claim each job under a lease of S seconds, renewed by a heartbeat, "
        "and run its handler with no transaction open (for long jobs); a dead worker's job "
        "runs again once its lease expires",
    ),
    arg(
        "--heartbeat-interval",
        type=float,
        metavar="S",
        help="lease mode: seconds between renewals of the worker's leases (lease / 3)",
    ),
    arg(
        "--job-timeout",
        type=float,
        metavar="S",
        help="lease mode: fail (and retry per the retry strategy) a job still running after "
        "S seconds, asking its handler to stop",
    ),
    arg(
        "--handler-mode",
        choices=("default", "advanced"),
        default="default",
        help="default: handler(job_type, payload); advanced: handler(job)",
    ),
    arg("--burst", action="store_true", help="stop once no job of the queue is due"),
    # Between the supervisor and its worker processes (see sqla_proletarian.supervisor).
    arg("--report-fd", type=int, help=argparse.SUPPRESS),
    arg("--process-index", type=int, help=argparse.SUPPRESS),
)
ENQUEUE_ARGUMENTS = (
    arg("job_type", metavar="JOB_TYPE"),
    arg("payload", metavar="PAYLOAD_JSON", nargs="?", help="a JSON value"),
    arg("--queue", default=DEFAULT_QUEUE, metavar="Q", help="the queue (default)"),
    arg(
        "--in", dest="delay", metavar="SECONDS", help="due this many seconds (or 90s, 5m, 2h) later"
    ),
    arg("--priority", type=int, default=0, metavar="N", help="higher runs first (0)"),
    arg(
        "--unique-key",
        metavar="KEY",
        help="add nothing if a queued or running job of the queue holds this key (its id is "
        "printed instead)",
    ),
)
FAILED_ARGUMENTS = (
    arg("--queue", help="only this queue"),
    arg("--job-type", help="only this job type"),
    arg(
        "--limit", type=int, default=DEFAULT_FAILED_LIMIT, help=f"at most ({DEFAULT_FAILED_LIMIT})"
    ),
    arg("--json", action="store_true", help='one object: {"failed": [...]}'),
)
RETRY_ARGUMENTS = (
    arg("job_ids", metavar="JOB_ID", nargs="*", help="archived failures"),
    arg("--all", action="store_true", help="every archived failure"),
    arg("--queue", help="only failures of this queue"),
    arg("--job-type", help="only failures of this job type"),
)
PRUNE_ARGUMENTS = (
    arg("--older-than", required=True, metavar="DURATION", help="30d, 12h, 90m, 45s, ..."),
    arg("--status", choices=("success", "failure", "cancelled"), help="only jobs that ended so"),
)
DASHBOARD_ARGUMENTS = (
    arg("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1: this machine)"),
    arg("--port", type=int, default=8080, help="the port (8080; 0: any free one)"),
    arg("--read-only", action="store_true", help="show the queues, offer no action"),
)


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, a line of help, an example, its arguments and its run."""

    name: str
    summary: str
    example: str
    arguments: tuple[Argument, ...]
    run: Callable[[argparse.Namespace], int]
    details: str = ""


WORKER_DETAILS = f"""\
exit status:
  0    --burst drained the queue
  1    the worker stopped by itself (a database error it does not retry: see the message)
  2    bad input (the handler cannot be imported, a bad option)
  130  SIGINT, 143 SIGTERM: the process stopped gracefully on the signal (running jobs
       finished, the summary printed) and ends by it, as systemd expects; a second signal
       ends it at once
with --processes N (N > 1), the supervisor's:
  {EXIT_OK}    SIGTERM/SIGINT, and every worker process stopped gracefully; or --burst done
  {EXIT_UNCLEAN}    a worker process did not stop gracefully (it died during the stop), or
       with --burst ended on an error
  1, 2 the first worker process could not start: its own status (see its message)
  {EXIT_FORCED}+N  a second SIGTERM/SIGINT stopped them at once (130 SIGINT, 143 SIGTERM)
"""

COMMANDS: tuple[Command, ...] = (
    Command(
        "install",
        "create or upgrade the library's tables (its Alembic migrations, in alembic_version)",
        f"{PROG} install --url postgresql+psycopg://app@db/app",
        (),
        install,
        "For a database without an Alembic project of its own. To use your own Alembic\n"
        "project later, add sqla_proletarian.migrations:versions to its version_locations:\n"
        "`alembic upgrade heads` then finds the library's revisions applied.",
    ),
    Command(
        "worker",
        "run a queue worker until SIGTERM/SIGINT (or, with --burst, until the queue is drained)",
        f"{PROG} worker tasks:handlers --queue emails --threads 4 --processes 2",
        WORKER_ARGUMENTS,
        worker,
        WORKER_DETAILS,
    ),
    Command(
        "enqueue",
        "enqueue one job (committed) and print its id",
        f'{PROG} enqueue send-welcome-email \'{{"email": "ada@example.com"}}\' --in 60',
        ENQUEUE_ARGUMENTS,
        enqueue_job,
    ),
    Command(
        "status",
        "per queue: ready, scheduled, running, oldest ready, finished in the last hour",
        f"{PROG} status --json",
        (arg("--json", action="store_true", help='one object: {"queues": [...]}'),),
        status,
    ),
    Command(
        "failed",
        "the archived failures, newest first, with their errors",
        f"{PROG} failed --queue billing --limit 20",
        FAILED_ARGUMENTS,
        failed,
    ),
    Command(
        "retry-failed",
        "put archived failures back in the queue (same job id, attempts from zero, due now)",
        f"{PROG} retry-failed --all --job-type charge-card",
        RETRY_ARGUMENTS,
        retry,
    ),
    Command(
        "pause",
        "pause a queue: its workers stop claiming (running jobs finish), in every process",
        f"{PROG} pause billing",
        (arg("queue", metavar="QUEUE"),),
        pause,
    ),
    Command(
        "resume",
        "resume a paused queue: its workers claim again",
        f"{PROG} resume billing",
        (arg("queue", metavar="QUEUE"),),
        resume,
    ),
    Command(
        "cancel",
        "cancel a queued job that no worker is running (archived as cancelled), or ask the "
        "worker running it under a lease to stop it",
        f"{PROG} cancel 0b3f4c1e-8a52-4d3e-9a57-2f1f6c1d2e3a",
        (arg("job_id", metavar="JOB_ID"),),
        cancel,
        "exit status: 0 cancelled or cancel requested; 1 not cancelled (not queued, or "
        "running right now in transaction mode)",
    ),
    Command(
        "prune",
        "delete archived jobs that finished long ago",
        f"{PROG} prune --older-than 30d --status success",
        PRUNE_ARGUMENTS,
        prune,
    ),
    Command(
        "dashboard",
        "serve the web dashboard of the queues (on 127.0.0.1 unless --host says otherwise)",
        f"{PROG} dashboard --port 8080 --read-only",
        DASHBOARD_ARGUMENTS,
        dashboard,
        "Needs Jinja2 (pip install 'sqla-proletarian[dashboard]'). It has no login of its\n"
        "own: keep it on 127.0.0.1 and reach it through an SSH tunnel, or mount\n"
        "create_dashboard() in your app behind its login (docs/dashboard.md).",
    ),
)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors in one line."""

    def error(self, message: str) -> NoReturn:
        command = None if self.prog == PROG else self.prog.removeprefix(f"{PROG} ")
        _error(command, f"{message} (see {self.prog} --help)")
        raise SystemExit(EXIT_USAGE)


def _add_common_arguments(parser: argparse.ArgumentParser, default: object) -> None:
    """``--url`` and ``--log-level``, taken before the command or after it."""
    parser.add_argument(
        "--url",
        default=default,
        help="the database URL (default: the DATABASE_URL environment variable)",
    )
    parser.add_argument(
        "--log-level",
        default=default,
        choices=("debug", "info", "warning", "error"),
        help="the library's log level (worker: info; other commands: warning)",
    )


def build_parser() -> argparse.ArgumentParser:
    # After the command the options only override what was given before it.
    common = _Parser(add_help=False)
    _add_common_arguments(common, argparse.SUPPRESS)
    parser = _Parser(
        prog=PROG,
        description="A durable job queue in your SQLAlchemy database: commands.",
        epilog="examples:\n"
        + "\n".join(f"  {command.example}" for command in COMMANDS)
        + f"\n\n`{PROG} COMMAND --help` tells more.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common_arguments(parser, None)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(
            command.name,
            parents=[common],
            help=command.summary,
            description=command.summary[:1].upper() + command.summary[1:] + ".",
            epilog=(f"{command.details}\n" if command.details else "")
            + f"example:\n  {command.example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for names, options in command.arguments:
            sub.add_argument(*names, **options)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the process's exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _configure_logging(args.log_level or ("info" if args.command == "worker" else "warning"))
    try:
        status: int = args.run(args)
    except (UsageError, InvalidJobError) as exc:
        return _error(args.command, _one_line(exc), EXIT_USAGE)
    except ConfigurationError as exc:
        code = EXIT_USAGE if args.command == "worker" else EXIT_FAILURE
        return _error(args.command, _one_line(exc), code)
    except KeyboardInterrupt:
        return _error(args.command, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:
        return _error(args.command, explain(exc), EXIT_FAILURE)
    return status


def _error(command: str | None, message: str, code: int = EXIT_USAGE) -> int:
    where = f"{PROG} {command}" if command else PROG
    print(f"{where}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return code


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("sqla_proletarian").setLevel(level.upper())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header and rows as lines of aligned columns."""
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]


def _cell(value: int | float | None) -> str:
    """A count as it is; an age (float seconds) as 12.3s, 5m 3s, 2h 5m or 3d 4h."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    seconds = value
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    for unit, size, smaller, small_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if whole >= size:
            return f"{whole // size}{unit} {whole % size // small_size}{smaller}"
    return f"{whole // 60}m {whole % 60}s"


def _iso(value: datetime) -> str:
    return value.isoformat()
