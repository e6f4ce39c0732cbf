"""``enqueue``, ``pause``, ``resume``, ``limits`` and ``cancel``: putting a job in, and
controlling queues and jobs."""

from __future__ import annotations

import argparse
import json
import time
import uuid

from sqlalchemy import Engine

from sqla_proletarian.cli.common import (
    EXIT_FAILURE,
    PROG,
    Command,
    UsageError,
    _database,
    _error,
    _payload,
    _uuids,
    arg,
    limits_table,
    parse_duration,
    parse_rate,
    parse_seconds,
    warn_if_unknown_queue,
)
from sqla_proletarian.control import cancel_job, pause_queue, resume_queue
from sqla_proletarian.enqueue import enqueue
from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.inspection import JobDetail, get_job, queue_status
from sqla_proletarian.limits import (
    QueueLimits,
    check_rate,
    check_running,
    clear_queue_limits,
    queue_limits,
    set_queue_limits,
)
from sqla_proletarian.models import DEFAULT_QUEUE
from sqla_proletarian.supervisor import EXIT_OK
from sqla_proletarian.values import check_name


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


def pause(args: argparse.Namespace) -> int:
    with _database(args) as engine:
        warn_if_unknown_queue(engine, "pause", args.queue)
        with engine.begin() as conn:
            pause_queue(conn, args.queue)
    print(f"queue {args.queue!r} paused: its workers stop claiming within a polling interval")
    return EXIT_OK


def resume(args: argparse.Namespace) -> int:
    with _database(args) as engine:
        warn_if_unknown_queue(engine, "resume", args.queue)
        with engine.begin() as conn:
            resume_queue(conn, args.queue)
    print(f"queue {args.queue!r} resumed")
    return EXIT_OK


def limits_set(args: argparse.Namespace) -> int:
    check_name("queue", args.queue)
    limits = _limits_given(args)
    with _database(args) as engine:
        warn_if_unknown_queue(engine, "limits set", args.queue)
        with engine.begin() as conn:
            limits = set_queue_limits(
                conn,
                args.queue,
                max_running=limits.max_running,
                max_running_per_key=limits.max_running_per_key,
                rate_limit=limits.rate_limit,
                rate_limit_per_key=limits.rate_limit_per_key,
            )
    print(
        f"queue {args.queue!r} limits: {limits.describe()} (from each worker's next claim; "
        "the limits not given are none)"
    )
    return EXIT_OK


def _limits_given(args: argparse.Namespace) -> QueueLimits:
    """The limits of ``limits set``'s flags, checked before the database is opened."""
    try:
        limits = QueueLimits(
            check_running("--max-running", args.max_running),
            check_running("--max-running-per-key", args.max_running_per_key),
            check_rate("--rate", args.rate),
            check_rate("--rate-per-key", args.rate_per_key),
        )
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None
    if limits == QueueLimits():
        raise UsageError(
            "no limit given: give --max-running, --max-running-per-key, --rate or "
            f"--rate-per-key; `{PROG} limits clear QUEUE` removes a queue's limits"
        )
    return limits


def limits_show(args: argparse.Namespace) -> int:
    with _database(args) as engine:
        limits = queue_limits(engine)
        waiting = {q.queue: q.waiting for q in queue_status(engine)} if limits else {}
    if args.json:
        shown = {
            queue: {**found.as_dict(), "waiting": waiting.get(queue)}
            for queue, found in sorted(limits.items())
        }
        print(json.dumps(shown))
        return EXIT_OK
    if not limits:
        print(f"no queue has limits (`{PROG} limits set QUEUE ...` sets them)")
        return EXIT_OK
    limited = [(queue, found, waiting.get(queue)) for queue, found in sorted(limits.items())]
    print("\n".join(limits_table(limited)))
    return EXIT_OK


def limits_clear(args: argparse.Namespace) -> int:
    check_name("queue", args.queue)
    with _database(args) as engine, engine.begin() as conn:
        had = clear_queue_limits(conn, args.queue)
    if had:
        print(f"queue {args.queue!r} limits cleared: from each worker's next claim, none")
    else:
        print(f"queue {args.queue!r} had no limits: nothing to clear")
    return EXIT_OK


#: ``cancel --wait``: the job ended another way than cancelled (its handler finished
#: before its worker stopped it): archived as ``success``, or as ``failure``.
EXIT_CANCEL_SUCCEEDED = 3
EXIT_CANCEL_FAILED = 4
#: ``cancel --wait``: the job had not ended when ``--timeout`` passed (as timeout(1) says).
EXIT_CANCEL_TIMEOUT = 124
#: ``cancel --wait``'s default ``--timeout``, in seconds.
DEFAULT_CANCEL_TIMEOUT = 60.0
#: Seconds between two looks at a job ``cancel --wait`` waits for.
CANCEL_POLL = 0.2
#: The exit status of ``cancel --wait`` by the state the job was archived in.
_ENDED = {"cancelled": EXIT_OK, "succeeded": EXIT_CANCEL_SUCCEEDED, "failed": EXIT_CANCEL_FAILED}
#: The archive's status of each archived state, as ``cancel --wait`` reports it.
_ARCHIVE_STATUS = {"cancelled": "cancelled", "succeeded": "success", "failed": "failure"}


def cancel(args: argparse.Namespace) -> int:
    (job_id,) = _uuids([args.job_id], "jobs")
    with _database(args) as engine:
        with engine.begin() as conn:
            cancelled = cancel_job(conn, job_id)
            # A job under a live lease stays in the queue until its worker stops it.
            still = get_job(conn, job_id)
            requested = cancelled and still is not None and still.state == "running"
        if not cancelled:
            _error("cancel", f"job {job_id} was not cancelled: {_why_not_cancelled(still)}")
            return EXIT_FAILURE
        if not requested:
            print(f"job {job_id} cancelled (archived as cancelled)")
            return EXIT_OK
        print(
            f"job {job_id} cancel requested: it is running under a lease, and its worker "
            "stops it at its next heartbeat if it is still running then (archived as "
            "cancelled); a handler that finishes first ends as it would have"
            + ("" if args.wait else f" (`{PROG} cancel --wait` waits and says which)"),
            flush=True,
        )
        if not args.wait:
            return EXIT_OK
        return _wait_for_end(engine, job_id, args.timeout)


def _wait_for_end(engine: Engine, job_id: uuid.UUID, timeout: float) -> int:
    """Wait until the job is archived, and say how it ended: the exit status of its state
    (``_ENDED``), or EXIT_CANCEL_TIMEOUT when it is still queued once ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        job = get_job(engine, job_id)
        if job is not None and job.finished_at is not None:
            print(f"job {job_id} ended: archived as {_ARCHIVE_STATUS[job.state]}")
            return _ENDED[job.state]
        if job is None:  # archived and pruned meanwhile
            print(f"job {job_id} ended, and its archive row is gone (pruned)")
            return EXIT_OK
        if time.monotonic() >= deadline:
            print(
                f"job {job_id} has not ended after {timeout:g} s (it is {job.state}); "
                f"`{PROG} jobs --state {job.state}` shows it"
            )
            return EXIT_CANCEL_TIMEOUT
        time.sleep(min(CANCEL_POLL, max(0.0, deadline - time.monotonic())))


def _why_not_cancelled(job: JobDetail | None) -> str:
    """Why ``cancel_job`` left a job alone, from what ``get_job`` finds of it."""
    if job is None:
        return f"no job has this id; `{PROG} jobs` lists the queued jobs and their ids"
    if job.finished_at is not None:
        return f"it has ended already ({job.state})"
    return "it is running right now in transaction mode; cancel it once it is queued again"


ENQUEUE_ARGUMENTS = (
    arg("job_type", metavar="JOB_TYPE"),
    arg("payload", metavar="PAYLOAD_JSON", nargs="?", help="a JSON value"),
    arg("--queue", default=DEFAULT_QUEUE, metavar="Q", help="the queue (default)"),
    arg(
        "--in",
        dest="delay",
        metavar="SECONDS",
        help="due this many seconds (or 90s, 5min, 2h) later",
    ),
    arg("--priority", type=int, default=0, metavar="N", help="higher runs first (0)"),
    arg(
        "--unique-key",
        metavar="KEY",
        help="add nothing if a queued or running job of the queue holds this key (its id is "
        "printed instead)",
    ),
)


ENQUEUE = Command(
    "enqueue",
    "enqueue one job (committed) and print its id",
    f'{PROG} enqueue send-welcome-email \'{{"email": "ada@example.com"}}\' --in 60',
    ENQUEUE_ARGUMENTS,
    enqueue_job,
)


PAUSE = Command(
    "pause",
    "pause a queue: its workers stop claiming (running jobs finish), in every process",
    f"{PROG} pause billing",
    (arg("queue", metavar="QUEUE"),),
    pause,
)


RESUME = Command(
    "resume",
    "resume a paused queue: its workers claim again",
    f"{PROG} resume billing",
    (arg("queue", metavar="QUEUE"),),
    resume,
)


LIMITS_SET = Command(
    "set",
    "set a queue's limits, all four at once, for every worker",
    f"{PROG} limits set partner-api --rate 10/1s --max-running-per-key 2",
    (
        arg("queue", metavar="QUEUE"),
        arg(
            "--max-running",
            type=int,
            metavar="N",
            help="at most N jobs of the queue run at once, across every worker and process",
        ),
        arg(
            "--max-running-per-key",
            type=int,
            metavar="N",
            help="at most N jobs of each concurrency_key run at once",
        ),
        arg(
            "--rate",
            type=parse_rate,
            metavar="N/SECONDS",
            help="at most N jobs of the queue start in any window of SECONDS (10/1s, 600/min, "
            "100/5min)",
        ),
        arg(
            "--rate-per-key",
            type=parse_rate,
            metavar="N/SECONDS",
            help="the same for each concurrency_key",
        ),
    ),
    limits_set,
    """\
Each `limits set` sets all four limits: a limit not given is none (as sp.set_queue_limits).
Every worker obeys them from its next claim. Jobs held back wait in the queue: they are
never failed, dropped or charged an attempt. --max-running and --max-running-per-key are 1
to 10000; a rate's count is a whole number from 1, and its window is up to a week.
""",
)


LIMITS_SHOW = Command(
    "show",
    "every queue's limits, and its ready jobs waiting",
    f"{PROG} limits show --json",
    (
        arg(
            "--json",
            action="store_true",
            help='one object: {"QUEUE": {"max_running": N, ..., "rate_limit": [N, SECONDS], '
            '"waiting": N}}',
        ),
    ),
    limits_show,
)


LIMITS_CLEAR = Command(
    "clear",
    "remove a queue's limits: its jobs are claimed as fast as the workers go",
    f"{PROG} limits clear partner-api",
    (arg("queue", metavar="QUEUE"),),
    limits_clear,
)


LIMITS = Command(
    "limits",
    "set, show or clear a queue's limits: jobs running at once, starts per time window, "
    "overall or per concurrency_key",
    f"{PROG} limits show",
    (),
    None,
    actions=(LIMITS_SET, LIMITS_SHOW, LIMITS_CLEAR),
)


CANCEL = Command(
    "cancel",
    "cancel a queued job that no worker is running (archived as cancelled), or ask the "
    "worker running it under a lease to stop it",
    f"{PROG} cancel 0b3f4c1e-8a52-4d3e-9a57-2f1f6c1d2e3a",
    (
        arg("job_id", metavar="JOB_ID"),
        arg(
            "--wait",
            action="store_true",
            help="of a job running under a lease: wait until it ends, and say how (its "
            "handler may finish before its worker stops it)",
        ),
        arg(
            "--timeout",
            type=parse_seconds,
            default=DEFAULT_CANCEL_TIMEOUT,
            metavar="S",
            help=f"with --wait: seconds to wait at most ({DEFAULT_CANCEL_TIMEOUT:g})",
        ),
    ),
    cancel,
    f"""\
exit status:
  0    cancelled (archived as cancelled), or, without --wait, cancel requested of a job
       running under a lease: its worker stops it at its next heartbeat if it still runs
  1    not cancelled: no job has this id, it has ended, or it is running right now in
       transaction mode
with --wait, of a job running under a lease (0: it ended cancelled):
  {EXIT_CANCEL_SUCCEEDED}    its handler finished first: archived as success
  {EXIT_CANCEL_FAILED}    its handler finished first: archived as failure
  {EXIT_CANCEL_TIMEOUT}  it had not ended when --timeout passed
""",
)
