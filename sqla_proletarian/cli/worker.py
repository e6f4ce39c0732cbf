"""``worker``: import the handler and run a queue worker (the asyncio worker for ``async def``
handlers), or a supervisor of several processes."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import URL

from sqla_proletarian.asyncapp import async_url, is_async_handler, run_async_worker
from sqla_proletarian.cli.common import (
    EXIT_FAILURE,
    PROG,
    Command,
    UsageError,
    _check_tables,
    _database,
    _error,
    _one_line,
    _url,
    arg,
    explain,
)
from sqla_proletarian.errors import ConfigurationError, ProletarianError
from sqla_proletarian.handlers import JobHandlers
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
    QueueWorker,
    WorkerOptions,
)

if TYPE_CHECKING:
    from sqla_proletarian.aio import AsyncQueueWorker

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
    if is_async_handler(handler):
        return _run_async(args, handler, options)
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
    return _ended(done)


def _run_async(
    args: argparse.Namespace, handler: Callable[..., Any], options: dict[str, Any]
) -> int:
    """``async def`` handlers: the asyncio worker on the URL (a sync URL's async twin), its
    tasks as many as ``--threads``."""
    threads = options.pop("worker_threads")
    done = run_async_worker(
        async_url(_url(args)),
        handler,
        burst=args.burst,
        report=report_to_fd(args.report_fd) if args.report_fd is not None else None,
        concurrency=threads,
        engine_options={"pool_size": 2 * threads + 2},
        **options,
    )
    return _ended(done)


def _ended(done: QueueWorker | AsyncQueueWorker) -> int:
    """The exit status of a worker that stopped, after saying how it did."""
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


WORKER_ARGUMENTS = (
    arg(
        "handler",
        metavar="MODULE:ATTR",
        help="the handler: a function, a JobHandlers table, or MODULE:factory() to call one "
        "that returns it (imported from the current directory or PYTHONPATH); async def "
        "handlers run in the asyncio worker",
    ),
    arg("--queue", default=DEFAULT_QUEUE, metavar="Q", help="the queue to work off (default)"),
    arg(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="worker threads (1); for async def handlers, the asyncio worker's tasks",
    ),
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


WORKER = Command(
    "worker",
    "run a queue worker until SIGTERM/SIGINT (or, with --burst, until the queue is drained)",
    f"{PROG} worker tasks:handlers --queue emails --threads 4 --processes 2",
    WORKER_ARGUMENTS,
    worker,
    WORKER_DETAILS,
)
