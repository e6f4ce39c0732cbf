"""``enqueue``, ``pause``, ``resume`` and ``cancel``: putting a job in, and controlling queues and
jobs."""

from __future__ import annotations

import argparse

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


def cancel(args: argparse.Namespace) -> int:
    (job_id,) = _uuids([args.job_id], "jobs")
    with _database(args) as engine, engine.begin() as conn:
        cancelled = cancel_job(conn, job_id)
        # A job under a live lease stays in the queue until its worker stops it.
        still = get_job(conn, job_id)
        requested = cancelled and still is not None and still.state == "running"
    if not cancelled:
        _error("cancel", f"job {job_id} was not cancelled: {_why_not_cancelled(still)}")
        return EXIT_FAILURE
    if requested:
        print(
            f"job {job_id} cancel requested (running under a lease; its worker stops it "
            "within a heartbeat)"
        )
    else:
        print(f"job {job_id} cancelled (archived as cancelled)")
    return EXIT_OK


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
    (arg("job_id", metavar="JOB_ID"),),
    cancel,
    "exit status: 0 cancelled or cancel requested; 1 not cancelled (no job has this id, it "
    "has ended, or it is running right now in transaction mode)",
)
