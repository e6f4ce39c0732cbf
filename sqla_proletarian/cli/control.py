"""``enqueue``, ``pause``, ``resume`` and ``cancel``: putting a job in, and controlling queues and
jobs."""

from __future__ import annotations

import argparse
import time
import uuid

from sqlalchemy import Engine

from sqla_proletarian.cli.common import (
    EXIT_FAILURE,
    PROG,
    Command,
    _database,
    _error,
    _payload,
    _uuids,
    arg,
    parse_duration,
    parse_seconds,
    warn_if_unknown_queue,
)
from sqla_proletarian.control import cancel_job, pause_queue, resume_queue
from sqla_proletarian.enqueue import enqueue
from sqla_proletarian.inspection import JobDetail, get_job
from sqla_proletarian.models import DEFAULT_QUEUE
from sqla_proletarian.supervisor import EXIT_OK


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
