"""``worker``: import the handler and run a queue worker (the asyncio worker for ``async def``
handlers), or a supervisor of several processes."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping
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
    parse_duration,
    parse_seconds,
    warn_if_unknown_queue,
)
from sqla_proletarian.errors import ConfigurationError, ProletarianError
from sqla_proletarian.exits import unfinished_text
from sqla_proletarian.handlers import JobHandlers
from sqla_proletarian.options import (
    DEFAULT_AWAIT_TERMINATION_TIMEOUT,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_MAX_UNCLEAN_ENDS,
    DEFAULT_POLLING_INTERVAL,
    DEFAULT_RECONNECT_GRACE,
    WorkerOptions,
)
from sqla_proletarian.progress import DEFAULT_PROGRESS_INTERVAL
from sqla_proletarian.retry import RetryStrategy
from sqla_proletarian.running import RetryStrategyFn
from sqla_proletarian.supervisor import (
    EXIT_FORCED,
    EXIT_JOBS_FAILED,
    EXIT_JOBS_UNFINISHED,
    EXIT_OK,
    EXIT_UNCLEAN,
    Supervisor,
    report_to_fd,
    run_worker,
    stop_with_supervisor,
)
from sqla_proletarian.worker import QueueWorker

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


def load_worker_options(spec: str) -> dict[str, Any]:
    """The ``worker_options`` of the handler's module (a mapping of ``create_queue_worker``
    keyword options), if it has any; the command's flags override them."""
    module_name = spec.partition(":")[0]
    options = getattr(sys.modules.get(module_name), "worker_options", None)
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigurationError(
            f"{module_name}.worker_options is a {type(options).__name__}: give a dict of "
            "create_queue_worker options, e.g. {'retry_strategy': ..., 'worker_threads': 4}"
        )
    reserved = sorted(set(options) & _SET_BY_THE_COMMAND)
    if reserved:
        raise ConfigurationError(
            f"{module_name}.worker_options sets {', '.join(reserved)}, which the worker "
            "command sets itself: leave it out"
        )
    return dict(options)


#: Options the ``worker`` command sets itself, which ``worker_options`` may not.
_SET_BY_THE_COMMAND = frozenset({"install_signal_handlers", "worker_id"})

#: The worker flags (their ``args`` names) and the ``create_queue_worker`` option each sets.
_FLAG_OPTIONS = {
    "queue": "queue",
    "threads": "worker_threads",
    "batch_size": "batch_size",
    "polling_interval": "polling_interval",
    "handler_mode": "handler_mode",
    "reconnect_grace": "reconnect_grace",
    "lease_seconds": "lease_seconds",
    "heartbeat_interval": "heartbeat_interval",
    "job_timeout": "job_timeout",
    "progress_interval": "progress_interval",
    "shutdown_timeout": "await_termination_timeout",
    "max_unclean_ends": "max_unclean_ends",
    "max_result_bytes": "max_result_bytes",
}


#: The flags the supervisor passes on to its worker processes, when given.
_FORWARDED = (*_FLAG_OPTIONS, "retries", "retry_delays")


def _flag_options(args: argparse.Namespace) -> dict[str, Any]:
    """The worker options the command line gave (a flag not given sets nothing)."""
    given = vars(args)
    options = {option: given[name] for name, option in _FLAG_OPTIONS.items() if name in given}
    queues = options.pop("queue", None)
    if queues is not None:  # --queue, once or more: the queues in claim order
        if len(queues) == 1:
            options["queue"] = queues[0]
        else:
            options["queues"] = queues
    if "retry_delays" in given and "retries" not in given:
        raise UsageError("--retry-delays needs --retries N: how many times a job runs again")
    if "retries" in given:
        try:
            strategy = RetryStrategy(args.retries, given.get("retry_delays", ()))
        except ProletarianError as exc:
            raise UsageError(f"--retries {args.retries}: {exc}") from None
        options["retry_strategy"] = _every_job(strategy)
    try:
        WorkerOptions.from_kwargs(options)
    except ProletarianError as exc:
        raise UsageError(str(exc)) from None
    return options


def _every_job(strategy: RetryStrategy) -> RetryStrategyFn:
    """A retry strategy function that gives every failed job ``strategy``."""

    def retry_strategy(job: Any, exc: Exception) -> RetryStrategy:
        return strategy

    return retry_strategy


def worker(args: argparse.Namespace) -> int:
    flags = _flag_options(args)
    if args.processes < 1:
        raise UsageError(f"--processes {args.processes}: give 1 or more")
    if args.processes > 1:
        return _supervise(args, _url(args))
    handler = load_handler(args.handler)
    module_options = load_worker_options(args.handler)
    if "queue" in flags or "queues" in flags:  # --queue overrides the module's queue(s)
        module_options = {k: v for k, v in module_options.items() if k not in _QUEUE_OPTIONS}
    options = {**module_options, **flags}
    periodic = load_periodic_jobs(args.handler)
    if periodic:
        options["periodic_jobs"] = periodic
    checked = WorkerOptions.from_kwargs(options)
    if args.process_index is not None:
        options["worker_id"] = f"{checked.worker_id}#{args.process_index}"
    # A queue named (by --queue or worker_options) that never held a job is most likely
    # misspelt: said once (by the first of several processes).
    named = checked.queues if _QUEUE_OPTIONS & set(options) else ()
    named = named if args.process_index in (None, 0) else ()
    if args.report_fd is not None:
        stop_with_supervisor()
    threads = checked.worker_threads
    if is_async_handler(handler):
        return _run_async(args, handler, options, threads, named)
    with _database(args, pool_size=2 * threads + 2) as engine:
        _check_tables(engine)
        _warn_if_unknown(engine, named)
        done = run_worker(
            engine,
            handler,
            burst=args.burst,
            report=report_to_fd(args.report_fd) if args.report_fd is not None else None,
            install_signal_handlers=True,
            **options,
        )
    return _ended(args, done)


#: The worker options that name the queues served.
_QUEUE_OPTIONS = frozenset({"queue", "queues"})


def _warn_if_unknown(engine: Any, queues: tuple[str, ...]) -> None:
    for queue in queues:
        warn_if_unknown_queue(engine, "worker", queue)


def _run_async(
    args: argparse.Namespace,
    handler: Callable[..., Any],
    options: dict[str, Any],
    threads: int,
    named: tuple[str, ...],
) -> int:
    """``async def`` handlers: the asyncio worker on the URL (a sync URL's async twin), its
    tasks as many as the threads asked for; the queue names checked through its own engine
    (no sync driver needed)."""
    options.pop("worker_threads", None)
    done = run_async_worker(
        async_url(_url(args)),
        handler,
        burst=args.burst,
        report=report_to_fd(args.report_fd) if args.report_fd is not None else None,
        concurrency=threads,
        engine_options={"pool_size": 2 * threads + 2},
        before_start=lambda engine: _warn_if_unknown(engine, named),
        **options,
    )
    return _ended(args, done)


def _ended(args: argparse.Namespace, done: QueueWorker | AsyncQueueWorker) -> int:
    """The exit status of a worker that stopped, after saying how it did."""
    if done.exception is not None:
        _error("worker", f"the worker stopped: {explain(done.exception)}")
        return EXIT_FAILURE
    print(f"{done.worker_id} stopped: {done.summary_text()}", file=sys.stderr, flush=True)
    if done.unfinished:
        # A job claimed after the burst found the queues drained, which its stop gave up on.
        timeout = done.options.await_termination_timeout
        print(
            unfinished_text(done.worker_id, done.unfinished, timeout), file=sys.stderr, flush=True
        )
        return EXIT_JOBS_UNFINISHED
    if args.burst and done.summary()["failed"]:
        return EXIT_JOBS_FAILED
    return EXIT_OK


def _supervise(args: argparse.Namespace, url: URL) -> int:
    """Run the worker in ``args.processes`` processes, the URL passed in the environment
    (not on their command lines, where any user could read a password); each process
    gets the flags given here, and reads the handler module's ``worker_options`` itself."""
    given = vars(args)
    worker_args = [
        args.handler,
        *(word for name in _FORWARDED if name in given for word in _flag(name, given[name])),
        *("--log-level", args.log_level or "info"),
        *(["--burst"] if args.burst else []),
    ]
    env = {**os.environ, "DATABASE_URL": url.render_as_string(hide_password=False)}
    return Supervisor(worker_args, args.processes, burst=args.burst, env=env).run()


def _flag(name: str, value: object) -> list[str]:
    """A flag given to the supervisor, as its worker processes' command lines give it."""
    if isinstance(value, list):  # a repeated flag (--queue)
        return [word for each in value for word in _flag(name, each)]
    if isinstance(value, tuple):
        text = ",".join(map(repr, value))
    else:
        text = "off" if value is None else value if isinstance(value, str) else repr(value)
    return [f"--{name.replace('_', '-')}", text]


def _delays(text: str) -> tuple[float, ...]:
    """``--retry-delays``: seconds (or durations such as 5m), separated by commas."""
    try:
        return tuple(parse_duration(part).total_seconds() for part in text.split(","))
    except UsageError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give seconds separated by commas, e.g. 1,5,30 (the last is repeated)"
        ) from None


def _queue_names(text: str) -> list[str]:
    """``--queue``: one queue name, or several separated by commas (``critical,default``)."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a queue name, or names separated by commas, e.g. critical,default"
        )
    return names


def _number_or_off(text: str, advice: str) -> int | None:
    """A whole number, or None for ``off`` (or ``none``); else ``advice`` as the error."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {advice}") from None


def _unclean_ends(text: str) -> int | None:
    """``--max-unclean-ends``: a whole number, or ``off`` to turn crash accounting off."""
    return _number_or_off(text, "give a whole number >= 1, or off to turn crash accounting off")


def _result_bytes(text: str) -> int | None:
    """``--max-result-bytes``: a whole number of bytes, or ``off`` for no limit."""
    return _number_or_off(text, "give a whole number of bytes >= 1, or off for no limit")


#: The default of a worker flag: not given, so the module's worker_options (or the
#: worker's own default) applies.
_UNSET: Any = argparse.SUPPRESS

WORKER_ARGUMENTS = (
    arg(
        "handler",
        metavar="MODULE:ATTR",
        help="the handler: a function, a JobHandlers table, or MODULE:factory() to call one "
        "that returns it (imported from the current directory or PYTHONPATH); async def "
        "handlers run in the asyncio worker",
    ),
    arg(
        "--queue",
        action="extend",
        type=_queue_names,
        default=_UNSET,
        metavar="Q",
        help="the queue to work off (default); repeat it, or give names separated by commas, "
        "for several queues, claimed in the order given (a queue's jobs when the queues "
        "before it have none due)",
    ),
    arg(
        "--threads",
        type=int,
        default=_UNSET,
        metavar="N",
        help="worker threads (1); for async def handlers, the asyncio worker's tasks",
    ),
    arg("--processes", type=int, default=1, metavar="N", help="worker processes (1)"),
    arg("--batch-size", type=int, default=_UNSET, metavar="N", help="jobs claimed together (1)"),
    arg(
        "--polling-interval",
        type=parse_seconds,
        default=_UNSET,
        metavar="S",
        help=f"seconds between polls of a drained queue ({DEFAULT_POLLING_INTERVAL})",
    ),
    arg(
        "--reconnect-grace",
        type=parse_seconds,
        default=_UNSET,
        metavar="S",
        help="seconds a run's worker must stay gone from the database before the run counts "
        f"as an unclean end and its job runs again ({DEFAULT_RECONNECT_GRACE:g})",
    ),
    arg(
        "--lease-seconds",
        type=parse_seconds,
        default=_UNSET,
        metavar="S",
        help="lease mode: claim each job under a lease of S seconds, renewed by a heartbeat, "
        "and run its handler with no transaction open (for long jobs); a dead worker's job "
        "runs again once its lease expires",
    ),
    arg(
        "--heartbeat-interval",
        type=parse_seconds,
        default=_UNSET,
        metavar="S",
        help="lease mode: seconds between renewals of the worker's leases (lease / 3)",
    ),
    arg(
        "--job-timeout",
        type=parse_seconds,
        default=_UNSET,
        metavar="S",
        help="lease mode: fail (and retry per the retry strategy) a job still running after "
        "S seconds, asking its handler to stop",
    ),
    arg(
        "--progress-interval",
        type=parse_seconds,
        default=_UNSET,
        metavar="S",
        help="least seconds between two writes of a running job's progress (job.set_progress)"
        f"; the latest report is written then, and when the handler returns "
        f"({DEFAULT_PROGRESS_INTERVAL:g})",
    ),
    arg(
        "--handler-mode",
        choices=("default", "advanced"),
        default=_UNSET,
        help="default: handler(job_type, payload); advanced: handler(job)",
    ),
    arg(
        "--retries",
        type=int,
        default=_UNSET,
        metavar="N",
        help="retry every failed job N times (RetryStrategy(N, delays)); overrides the "
        "module's worker_options retry_strategy (default: no retries)",
    ),
    arg(
        "--retry-delays",
        type=_delays,
        default=_UNSET,
        metavar="S,S,...",
        help="with --retries: seconds before each retry, the last repeated, e.g. 1,5,30 "
        "(none: at once)",
    ),
    arg(
        "--shutdown-timeout",
        type=parse_seconds,
        default=_UNSET,
        metavar="S",
        help="seconds a stop waits for the running jobs to finish before it ends them "
        f"({DEFAULT_AWAIT_TERMINATION_TIMEOUT:g})",
    ),
    arg(
        "--max-unclean-ends",
        type=_unclean_ends,
        default=_UNSET,
        metavar="N",
        help="a job whose runs ended unclean (its worker died) N times is failed for good; "
        f"off: crash accounting off ({DEFAULT_MAX_UNCLEAN_ENDS})",
    ),
    arg(
        "--max-result-bytes",
        type=_result_bytes,
        default=_UNSET,
        metavar="N",
        help="a handler result longer than N bytes serialized fails its job "
        f"(ResultTooLargeError); off: no limit ({DEFAULT_MAX_RESULT_BYTES})",
    ),
    arg(
        "--burst",
        action="store_true",
        help="stop once no job of the queues is due and the jobs it started have ended "
        "(jobs scheduled for later are left, in one log line)",
    ),
    # Between the supervisor and its worker processes (see sqla_proletarian.supervisor).
    arg("--report-fd", type=int, help=argparse.SUPPRESS),
    arg("--process-index", type=int, help=argparse.SUPPRESS),
)


WORKER_DETAILS = f"""\
exit status:
  0    --burst drained the queue (no job due, and every job it ran has ended), and no
       job was given up on
  1    the worker stopped by itself (a database error it does not retry: see the message)
  2    bad input (the handler cannot be imported, a bad option or worker_options)
  {EXIT_JOBS_FAILED}    --burst drained the queue, and some jobs failed for good (retries used up)
  {EXIT_JOBS_UNFINISHED}    SIGTERM/SIGINT (or the end of --burst), and the stop gave up on
       running jobs when --shutdown-timeout passed (they run again)
  130  SIGINT, 143 SIGTERM: the process stopped gracefully on the signal (running jobs
       finished, the summary printed) and ends by it, as systemd expects; a second signal
       ends it at once (lease mode: after giving the running jobs' leases back)
with --processes N (N > 1), the supervisor's:
  {EXIT_OK}    SIGTERM/SIGINT, and every worker process stopped gracefully; or --burst done
  {EXIT_UNCLEAN}    a worker process did not stop gracefully (it died during the stop, once
       started), or with --burst ended on an error
  {EXIT_JOBS_FAILED}    --burst done, and some worker process gave up on jobs
  {EXIT_JOBS_UNFINISHED}    SIGTERM/SIGINT (or --burst done), and some process's stop gave up
       on running jobs
  1, 2 the first worker process could not start: its own status (see its message), with
       --burst too
  {EXIT_FORCED}+N  a second SIGTERM/SIGINT stopped them at once (130 SIGINT, 143 SIGTERM)
"""


WORKER = Command(
    "worker",
    "run a queue worker until SIGTERM/SIGINT (or, with --burst, until its queues are drained)",
    f"{PROG} worker tasks:handlers --queue critical --queue emails --threads 4 --processes 2",
    WORKER_ARGUMENTS,
    worker,
    WORKER_DETAILS
    + "options not given as flags come from the handler module's worker_options (a dict of\n"
    "create_queue_worker options), if it has one, else the worker's defaults\n",
)
